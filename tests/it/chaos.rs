//! Chaos harnesses for `shared` mode: real gateway processes paused
//! (SIGSTOP, a GC-like stall), killed (-9) and restarted under load; and a
//! private Postgres crashed and restarted under load. Bounded in time.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rand::Rng;

use crate::support::app::{config_sections, docs_route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::holders::{self, Workload};
use crate::support::pg::PrivatePg;
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

fn shared_config(store_url: &str, upstream: &str) -> String {
    // A short route timeout: it bounds how long a key stays closed after an
    // instance dies mid-forward.
    config_sections(
        "shutdown_grace_ms = 1000\n",
        store_url,
        "mode = \"shared\"\ntimeout_ms = 2000\nkey_lock_wait_ms = 20000\n",
        &format!("{}timeout_ms = 1000\n", docs_route(upstream)),
    )
}

/// Three gateway processes on one Postgres database; 24 lock holders send
/// each write to a random instance while a chaos thread pauses, kills and
/// restarts instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pauses_kills_and_restarts_keep_per_key_order() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::with_write_delays(0, 10).await;
    let config = shared_config(&store.url, &up.url());
    let procs: Vec<GatewayProcess> = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || {
            (0..3).map(|_| GatewayProcess::start(&config)).collect()
        })
        .await
        .unwrap()
    };
    let targets = Arc::new(RwLock::new(
        procs.iter().map(|p| p.url("")).collect::<Vec<_>>(),
    ));
    let procs = Arc::new(std::sync::Mutex::new(procs));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // The chaos thread: every 300-700 ms, pause one instance for 200-800 ms,
    // or kill one with -9 and start a new one in its place.
    let chaos = {
        let (targets, procs, stop, config) =
            (targets.clone(), procs.clone(), stop.clone(), config.clone());
        tokio::task::spawn_blocking(move || {
            let (mut pauses, mut kills) = (0, 0);
            let deadline = Instant::now() + Duration::from_secs(40);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
                let (nap, which, kill, pause_ms) = {
                    let mut rng = rand::thread_rng();
                    (
                        rng.gen_range(300..700),
                        rng.gen_range(0..3),
                        rng.gen_bool(0.35),
                        rng.gen_range(200..800),
                    )
                };
                std::thread::sleep(Duration::from_millis(nap));
                if kill {
                    procs.lock().unwrap()[which].kill9();
                    let fresh = GatewayProcess::start(&config);
                    targets.write().unwrap()[which] = fresh.url("");
                    procs.lock().unwrap()[which] = fresh;
                    kills += 1;
                } else {
                    let ps = procs.lock().unwrap();
                    ps[which].signal(libc::SIGSTOP);
                    std::thread::sleep(Duration::from_millis(pause_ms));
                    ps[which].signal(libc::SIGCONT);
                    pauses += 1;
                }
            }
            (pauses, kills)
        })
    };

    // Long enough for several chaos events: the shared-mode writes of 30
    // rounds can be over within a second.
    let out = holders::run_dynamic(
        targets,
        Workload {
            clients: 24,
            rounds: 100,
            docs: 4,
            max_pause_ms: 20,
        },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (pauses, kills) = chaos.await.unwrap();
    holders::check(&up, &out);
    assert!(
        pauses + kills >= 3,
        "the chaos thread did little: {pauses} pauses, {kills} kills"
    );
    assert!(
        out.acked.len() > 50,
        "too little got through: {:?}",
        out.statuses
    );
    eprintln!(
        "chaos run: {} acknowledged writes, statuses {:?}, {pauses} pauses, {kills} kills",
        out.acked.len(),
        out.statuses
    );
}

/// Postgres crashes (`pg_ctl stop -m immediate`) and comes back, three times,
/// under load from two shared-mode gateways. Writes fail closed meanwhile;
/// nothing out of order reaches the upstream; writes recover by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_crashes_under_load_keep_per_key_order() {
    let pg = Arc::new(tokio::task::spawn_blocking(PrivatePg::start).await.unwrap());
    let up = Upstream::with_write_delays(0, 10).await;
    let config = shared_config(&pg.url(), &up.url());
    let mut apps = Vec::new();
    for _ in 0..2 {
        apps.push(TestApp::from_text(&config).await);
    }
    let targets: Vec<String> = apps.iter().map(|a| a.url("")).collect();
    let chaos = {
        let pg = pg.clone();
        // The first crash comes early and the workload is long enough to
        // span all three: a workload that ends before the first crash
        // tests nothing (shared-mode writes got fast enough for 30 rounds
        // to end within 800 ms).
        tokio::task::spawn_blocking(move || {
            for i in 0..3 {
                std::thread::sleep(Duration::from_millis(if i == 0 { 300 } else { 500 }));
                pg.stop_immediate();
                std::thread::sleep(Duration::from_millis(700));
                pg.start_again();
            }
        })
    };
    let out = holders::run_fixed(
        targets.clone(),
        Workload {
            clients: 20,
            rounds: 120,
            docs: 4,
            max_pause_ms: 30,
        },
    )
    .await;
    chaos.await.unwrap();
    holders::check(&up, &out);
    assert!(
        out.statuses.get(&503).copied().unwrap_or(0) > 0,
        "the outages were not seen: {:?}",
        out.statuses
    );
    // After the last restart, writes go through again without a restart of
    // the gateways.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = apps[0].put("/docs/after", Some("1"), "after").await;
        if r.status() == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {}", r.status());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "postgres chaos run: {} acknowledged writes, statuses {:?}",
        out.acked.len(),
        out.statuses
    );
}
