//! Postgres failover with real servers: a primary with a synchronous
//! standby made by `pg_basebackup -R`, behind a TCP switch standing in for
//! a VIP (the gateways' `[store] url` names the switch). The primary
//! crashes (`pg_ctl stop -m immediate`), the switch moves to the standby
//! while it is still in recovery, and the standby is promoted with
//! `pg_ctl promote`, all under a load of competing lock holders.
//!
//! What the recording upstream and the ledger of answers show, in `single`
//! and `shared` mode: no lower token applied after a higher one; no two
//! tokens in flight; every acknowledged write applied exactly once and
//! nothing else applied (so no 503 forwarded anything); only 503 (or, in
//! shared mode, 409 from memory) while there is no writable primary;
//! recovery without a restart within [`RECOVERY_BOUND`] of the promotion;
//! every token acknowledged before the failover still enforced after it, by
//! an instance with nothing in memory. Also: a read-only server (a standby
//! before promotion, a primary with `default_transaction_read_only`) is
//! refused as unavailable and `/readyz` says which; single mode takes its
//! lock again on the new primary and a second single instance still cannot
//! start; a shared-mode write in flight through the failover holds back the
//! next token on another instance (its marker is a row); the durability
//! warning appears for an asynchronous standby and not for a synchronous
//! one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use sqlx::{Connection, PgConnection};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::support::app::{assert_detail_says, config_text, docs_route, problem, route, TestApp};
use crate::support::db::SINGLE_WRITER_NAMESPACE;
use crate::support::fenced_put;
use crate::support::pg::PrivatePg;
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

/// `[store] timeout_ms` of the test gateways (`support::app::config_text`).
const STORE_TIMEOUT: Duration = Duration::from_millis(1500);
/// The bound docs/operations/failover.md states: fenced writes succeed
/// again within `timeout_ms` + 1 s of the new primary taking writes.
const RECOVERY_BOUND: Duration = Duration::from_millis(STORE_TIMEOUT.as_millis() as u64 + 1000);
/// A 503 during the outage comes within `timeout_ms`; the slack is for a
/// loaded machine, not a performance claim.
const PROMPT: Duration = Duration::from_millis(STORE_TIMEOUT.as_millis() as u64 + 1500);

/// A TCP proxy standing in for a VIP: it forwards to one server, and
/// moving it cuts every open connection, as a moved address does.
struct Switch {
    addr: SocketAddr,
    target: Arc<watch::Sender<Option<SocketAddr>>>,
    accept: JoinHandle<()>,
}

impl Switch {
    async fn start(target: SocketAddr) -> Switch {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind switch");
        let addr = listener.local_addr().expect("switch address");
        let target = Arc::new(watch::channel(Some(target)).0);
        let tx = target.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let mut moved = tx.subscribe();
                tokio::spawn(async move {
                    // Nothing behind the address, or a server that is down:
                    // the connection closes at once.
                    let Some(to) = *moved.borrow_and_update() else {
                        return;
                    };
                    let Ok(mut server) = TcpStream::connect(to).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = moved.changed() => {}
                    }
                });
            }
        });
        Switch {
            addr,
            target,
            accept,
        }
    }

    fn point_at(&self, to: SocketAddr) {
        self.target.send_replace(Some(to));
    }

    fn url(&self) -> String {
        format!("postgres://postgres@{}/postgres", self.addr)
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Waits until `ok` holds, polling every 50 ms for at most `limit`.
async fn eventually<F, Fut>(what: &str, limit: Duration, mut ok: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    for _ in 0..10_000 {
        if ok().await {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within 10000 polls");
}

async fn connect(url: &str) -> PgConnection {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match PgConnection::connect(url).await {
            Ok(c) => return c,
            Err(e) => assert!(Instant::now() < deadline, "cannot connect to {url}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn count(url: &str, query: &str) -> i64 {
    let mut c = connect(url).await;
    let n = sqlx::query_scalar(query)
        .fetch_one(&mut c)
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"));
    let _ = c.close().await;
    n
}

/// Runs statements one by one, each outside a transaction (ALTER SYSTEM
/// needs that), in a session that may write whatever the server's
/// defaults say.
async fn admin(url: &str, statements: &[&str]) {
    let mut c = connect(url).await;
    for st in ["SET default_transaction_read_only = off"]
        .iter()
        .chain(statements)
    {
        sqlx::raw_sql(st)
            .execute(&mut c)
            .await
            .unwrap_or_else(|e| panic!("{st}: {e}"));
    }
    let _ = c.close().await;
}

async fn wait_for_replicas(primary: &PrivatePg, sync_state: &str) {
    let url = primary.url();
    let query = format!(
        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = '{sync_state}'"
    );
    eventually(
        &format!("a {sync_state} standby streaming"),
        Duration::from_secs(30),
        || async { count(&url, &query).await == 1 },
    )
    .await;
}

/// A primary that waits for a standby on every commit, and that standby.
/// The standby asks for no synchronous standby of its own, so once promoted
/// it takes writes alone (as Patroni's non-strict synchronous mode does).
async fn synchronous_pair() -> (PrivatePg, PrivatePg) {
    let (primary, standby) = tokio::task::spawn_blocking(|| {
        let primary = PrivatePg::start_with(&[("synchronous_standby_names", "*")]);
        let standby =
            PrivatePg::standby_of(&primary, "standby1", &[("synchronous_standby_names", "")]);
        (primary, standby)
    })
    .await
    .expect("start the private servers");
    wait_for_replicas(&primary, "sync").await;
    (primary, standby)
}

/// `pg_ctl stop -m immediate` off the async threads.
async fn crash(pg: PrivatePg) -> PrivatePg {
    tokio::task::spawn_blocking(move || {
        pg.stop_immediate();
        pg
    })
    .await
    .expect("crash the primary")
}

async fn promote(pg: PrivatePg) -> PrivatePg {
    tokio::task::spawn_blocking(move || {
        pg.promote();
        pg
    })
    .await
    .expect("promote the standby")
}

/// `/readyz`: its status and body.
/// A `mode` instance started on `standby`, still in recovery, refuses to
/// start, and says why.
async fn refused_on_standby(standby: &PrivatePg, routes: &str, mode: &str) {
    let refused = TestApp::try_spawn(&standby.url(), routes).await;
    let err = refused
        .err()
        .unwrap_or_else(|| panic!("a {mode} instance started on a standby"));
    let err = err.to_string();
    assert!(
        err.contains("is read-only: the server is in recovery"),
        "{err}"
    );
}

async fn readyz(app: &TestApp) -> (u16, serde_json::Value) {
    let r = app.admin_get("/readyz").await;
    let status = r.status().as_u16();
    (status, r.json().await.expect("readyz is JSON"))
}

/// A `/readyz` answer of 503 that gives `why` in its store's detail; the
/// store's details.
fn unready_for<'a>(status: u16, ready: &'a serde_json::Value, why: &str) -> &'a serde_json::Value {
    assert_eq!(status, 503, "{ready}");
    let store = &ready["details"]["store"];
    let detail = store["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(why), "{ready}");
    store
}

/// Waits until `/readyz` shows `pred` of its `details.store`; returns the
/// whole answer.
async fn wait_readyz(
    app: &TestApp,
    what: &str,
    pred: impl Fn(u16, &serde_json::Value) -> bool,
) -> (u16, serde_json::Value) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = readyz(app).await;
        if pred(status, &body["details"]["store"]) {
            return (status, body);
        }
        assert!(
            Instant::now() < deadline,
            "/readyz never showed {what}; last: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One fenced write of the load, and its answer.
#[derive(Debug, Clone)]
struct Sent {
    key: String,
    token: i64,
    body: String,
    status: u16,
    sent: Instant,
    answered: Instant,
}

/// Competing lock holders: two per key, each writing with its token until
/// refused, then taking over with a higher one; a 503 is retried with the
/// same token. Each write goes to a random gateway.
struct Load {
    stop: watch::Sender<bool>,
    writers: Vec<JoinHandle<Vec<Sent>>>,
}

impl Load {
    fn start(gateways: Vec<SocketAddr>, keys: &[&str]) -> Load {
        let stop = watch::channel(false).0;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("reqwest client");
        let mut writers = Vec::new();
        for key in keys {
            let highest = Arc::new(AtomicI64::new(0));
            for w in 0..2 {
                let (http, gateways, highest) = (http.clone(), gateways.clone(), highest.clone());
                let (key, mut stopped) = (key.to_string(), stop.subscribe());
                writers.push(tokio::spawn(async move {
                    let mut sent = Vec::new();
                    let mut token = 1 + w as i64;
                    let deadline = Instant::now() + Duration::from_secs(120);
                    for n in 0..5_000 {
                        if *stopped.borrow_and_update() || Instant::now() > deadline {
                            break;
                        }
                        let (gw, take_over, pause) = {
                            let mut rng = rand::thread_rng();
                            (
                                gateways[rng.gen_range(0..gateways.len())],
                                rng.gen_bool(0.15),
                                rng.gen_range(20..60),
                            )
                        };
                        if take_over {
                            token = token.max(highest.load(Ordering::SeqCst) + 1);
                        }
                        let body = format!("{key}/{w}/{n}/{token}");
                        let started = Instant::now();
                        let answer = fenced_put(
                            &http,
                            format!("http://{gw}/docs/{key}"),
                            token,
                            body.clone(),
                        )
                        .send()
                        .await;
                        let (status, refused_below) = match answer {
                            Ok(r) => {
                                let status = r.status().as_u16();
                                let v: serde_json::Value = r.json().await.unwrap_or_default();
                                (status, v["highest_token"].as_i64())
                            }
                            Err(_) => (0, None),
                        };
                        sent.push(Sent {
                            key: key.clone(),
                            token,
                            body,
                            status,
                            sent: started,
                            answered: Instant::now(),
                        });
                        match status {
                            200 => {
                                highest.fetch_max(token, Ordering::SeqCst);
                            }
                            409 => {
                                let h = refused_below.unwrap_or(token);
                                highest.fetch_max(h, Ordering::SeqCst);
                                token = h + 1;
                            }
                            _ => {}
                        }
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                    sent
                }));
            }
        }
        Load { stop, writers }
    }

    async fn finish(self) -> Vec<Sent> {
        self.stop.send_replace(true);
        let mut all = Vec::new();
        for w in self.writers {
            all.extend(w.await.expect("a writer panicked"));
        }
        all
    }
}

/// The highest token acknowledged per key among `sent` answered before
/// `before`.
fn acknowledged(sent: &[Sent], before: Instant) -> BTreeMap<String, i64> {
    let mut h = BTreeMap::new();
    for s in sent
        .iter()
        .filter(|s| s.status == 200 && s.answered < before)
    {
        let e = h.entry(s.key.clone()).or_insert(s.token);
        *e = (*e).max(s.token);
    }
    h
}

/// What must hold of a run: the upstream saw no ordering breach, applied
/// exactly the acknowledged writes, each once; nothing succeeded while
/// there was no writable primary (writes sent from `down` and answered
/// before `promoting`).
fn check_run(up: &Upstream, sent: &[Sent], down: Instant, promoting: Instant, shared: bool) {
    assert_eq!(up.violations(), Vec::<String>::new(), "ordering breached");
    let mut applied = HashMap::new();
    for a in up.applied() {
        let body = String::from_utf8_lossy(&a.body).into_owned();
        *applied.entry(body).or_insert(0) += 1;
    }
    let acked: HashSet<&str> = sent
        .iter()
        .filter(|s| s.status == 200)
        .map(|s| s.body.as_str())
        .collect();
    for s in sent {
        let times = applied.get(&s.body).copied().unwrap_or(0);
        match s.status {
            200 => assert_eq!(
                times, 1,
                "acknowledged write {} applied {times} times",
                s.body
            ),
            409 | 503 => assert_eq!(times, 0, "{} answered {} but was applied", s.body, s.status),
            other => panic!("unexpected answer {other} to {}", s.body),
        }
    }
    let load_applied = applied
        .keys()
        .filter(|b| sent.iter().any(|s| s.body == **b))
        .count();
    assert_eq!(
        load_applied,
        acked.len(),
        "the upstream applied writes nobody was told of"
    );
    let during: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.sent >= down && s.answered < promoting)
        .collect();
    assert!(
        during.len() >= 4,
        "the load barely ran while there was no primary ({} writes)",
        during.len()
    );
    for s in &during {
        let fine = s.status == 503 || (shared && s.status == 409);
        assert!(
            fine,
            "{} answered {} while there was no writable primary",
            s.body, s.status
        );
    }
    let refused = during.iter().filter(|s| s.status == 503).count();
    assert!(refused >= 1, "no 503 while there was no primary");
    let ok = sent.iter().filter(|s| s.status == 200).count();
    eprintln!(
        "failover load: {} writes, {ok} acknowledged, {} while there was no primary ({refused} of them 503)",
        sent.len(),
        during.len()
    );
}

/// Fenced writes through `app` (in `mode`) are accepted again within
/// [`RECOVERY_BOUND`] of a promotion that just ended.
async fn recovers_in_bound(app: &TestApp, path: &str, token: &str, mode: &str) {
    let promoted = Instant::now();
    let recovered = until_accepted(app, path, token, Duration::from_secs(30)).await;
    let took = recovered - promoted;
    eprintln!("{mode} mode: fenced writes recovered {took:?} after the promotion");
    assert!(took <= RECOVERY_BOUND, "recovered after {took:?}");
}

/// Retries `put` until it answers 200; returns when that was.
async fn until_accepted(app: &TestApp, path: &str, token: &str, limit: Duration) -> Instant {
    let r = app
        .put_until_not_503(path, token, "recovery probe", limit)
        .await;
    assert_eq!(r.status(), 200, "{path} {token}: answered during recovery");
    Instant::now()
}

/// Every token acknowledged before the failover is refused when lower, by
/// an instance whose memory is empty, and the store shows it.
async fn still_enforced(fresh: &TestApp, acked: &BTreeMap<String, i64>) {
    assert!(
        !acked.is_empty(),
        "nothing was acknowledged before the failover"
    );
    for (key, &h) in acked {
        let body = problem(
            fresh
                .put(&format!("/docs/{key}"), Some(&(h - 1).to_string()), "stale")
                .await,
            409,
        )
        .await;
        let highest = body["highest_token"].as_i64().unwrap_or_default();
        assert!(highest >= h, "{key}: acknowledged {h}, store now {highest}");
        let rec: serde_json::Value = fresh
            .admin_get(&format!("/fences/doc:{key}"))
            .await
            .json()
            .await
            .expect("fence record");
        assert!(
            rec["highest_token"].as_i64().unwrap_or_default() >= h,
            "{rec}"
        );
    }
}

const KEYS: &[&str] = &["l0", "l1", "l2"];

/// What both failover tests start from: a synchronous pair, a switch that
/// leads to its primary for now (the gateway's store address), and an
/// upstream.
async fn failover_rig() -> (PrivatePg, PrivatePg, Switch, Upstream) {
    let (primary, standby) = synchronous_pair().await;
    let switch = Switch::start(primary.addr()).await;
    (primary, standby, switch, Upstream::start().await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_mode_fails_over_to_a_synchronous_standby() {
    let test_started = Instant::now();
    let (primary, standby, switch, up) = failover_rig().await;
    let routes = docs_route(&up.url());
    let app = TestApp::spawn(&switch.url(), &routes).await;

    let (status, ready) = readyz(&app).await;
    assert_eq!(status, 200, "{ready}");
    let store = &ready["details"]["store"];
    assert_eq!(store["server"], "writable", "{ready}");
    assert_eq!(store["writer_lock"]["held"], true, "{ready}");
    assert_eq!(store["durability"]["status"], "ok", "{ready}");
    assert_eq!(store["durability"]["synchronous_replicas"], 1, "{ready}");

    // A key memory knows exactly: the second write is admitted from memory.
    for _ in 0..2 {
        assert_eq!(app.put("/docs/m", Some("7"), "m").await.status(), 200);
    }
    let load = Load::start(vec![app.addr], KEYS);
    tokio::time::sleep(Duration::from_secs(1)).await;

    let crashed = Instant::now();
    let primary = crash(primary).await;
    // Within the lock's check interval (250 ms) the instance knows its lock
    // is gone; from then on it decides nothing, not even from memory.
    let (status, ready) = wait_readyz(&app, "the writer lock lost", |_, s| {
        s["writer_lock"]["held"] == false
    })
    .await;
    let down = Instant::now();
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["type"], "urn:fencegate:problem:not-ready");
    for (token, what) in [
        ("7", "equal to the cached token"),
        ("6", "below it"),
        ("8", "above it"),
    ] {
        let asked = Instant::now();
        let r = app.put("/docs/m", Some(token), "during").await;
        let took = asked.elapsed();
        assert!(r.headers().contains_key("retry-after"), "{what}");
        let body = problem(r, 503).await;
        assert!(took < PROMPT, "{what}: 503 after {took:?}");
        assert_eq!(
            body["type"], "urn:fencegate:problem:store-unavailable",
            "{what}"
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The address now leads to the standby, still in recovery: it answers,
    // but counts as unavailable, and /readyz says so.
    switch.point_at(standby.addr());
    let (status, ready) = wait_readyz(&app, "a read-only server", |_, s| {
        s["server"] == "read-only"
    })
    .await;
    let store = unready_for(status, &ready, "in recovery");
    assert_eq!(store["writer_lock"]["held"], false, "{ready}");
    assert_detail_says(&ready, "read-only");
    problem(app.put("/docs/m", Some("8"), "on the standby").await, 503).await;
    // An instance started on the standby itself refuses to start.
    refused_on_standby(&standby, &routes, "single").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Seconds of retries later, the lock is still not taken on the standby:
    // there it would exclude nobody writing a primary.
    let (_, ready) = readyz(&app).await;
    let lock = &ready["details"]["store"]["writer_lock"];
    assert_eq!(lock["held"], false, "{ready}");
    let why = lock["detail"].as_str().unwrap_or_default();
    assert!(why.contains("waiting for a writable primary"), "{ready}");

    let promoting = Instant::now();
    let standby = promote(standby).await;
    recovers_in_bound(&app, "/docs/m", "8", "single").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let sent = load.finish().await;

    // The lock is held again, on the new primary, by this instance.
    let held = count(
        &standby.url(),
        &format!(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'advisory' AND l.classid = {SINGLE_WRITER_NAMESPACE} \
               AND l.objid = 1 AND l.objsubid = 2 AND l.granted \
               AND a.application_name = 'fencegate'"
        ),
    )
    .await;
    assert_eq!(held, 1, "the single-writer lock on the new primary");
    let (status, ready) = readyz(&app).await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["details"]["store"]["writer_lock"]["held"], true);
    // A second single instance still cannot start.
    let second = TestApp::try_spawn(&switch.url(), &routes).await;
    let err = second.err().expect("a second single instance started");
    assert!(
        err.to_string().contains("another fencegate instance"),
        "{err}"
    );

    check_run(&up, &sent, down, promoting, false);
    let m: Vec<Option<i64>> = up.applied_on("/docs/m").iter().map(|a| a.token).collect();
    assert_eq!(
        m,
        vec![Some(7), Some(7), Some(8)],
        "nothing of m during the outage"
    );

    let acked = acknowledged(&sent, crashed);
    app.stop().await;
    let fresh = TestApp::spawn(&switch.url(), &routes).await;
    still_enforced(&fresh, &acked).await;
    assert_eq!(up.violations(), Vec::<String>::new());
    fresh.stop().await;
    drop(primary);
    eprintln!(
        "single-mode failover test took {:?}",
        test_started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_mode_fails_over_to_a_synchronous_standby() {
    let test_started = Instant::now();
    let (primary, standby, switch, up) = failover_rig().await;
    // A route timeout long enough for a write to be in flight through the
    // whole failover.
    let routes = format!(
        "mode = \"shared\"\n{}timeout_ms = 12000\n",
        route("docs", "/docs/{id}", &up.url(), "doc:{id}")
    );
    let a = TestApp::spawn(&switch.url(), &routes).await;
    let b = TestApp::spawn(&switch.url(), &routes).await;
    for app in [&a, &b] {
        let (status, ready) = readyz(app).await;
        assert_eq!(status, 200, "{ready}");
        let store = &ready["details"]["store"];
        assert_eq!(store["mode"], "shared", "{ready}");
        assert!(store.get("writer_lock").is_none(), "{ready}");
        assert_eq!(store["durability"]["status"], "ok", "{ready}");
    }
    let load = Load::start(vec![a.addr, b.addr], KEYS);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // A write admitted through a before the crash, still at the upstream
    // after the promotion.
    let slow_sent = Instant::now();
    let slow = {
        let (http, url) = (a.http.clone(), a.url("/docs/slow"));
        tokio::spawn(async move {
            fenced_put(&http, url, "10", "slow 10")
                .header("x-test-delay-ms", "9000")
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    eventually(
        "the slow write at the upstream",
        Duration::from_secs(10),
        || async { up.requests().iter().any(|r| r.path() == "/docs/slow") },
    )
    .await;

    let crashed = Instant::now();
    let primary = crash(primary).await;
    let down = Instant::now();
    let asked = Instant::now();
    let r = b.put("/docs/new", Some("1"), "during").await;
    let took = asked.elapsed();
    assert!(r.headers().contains_key("retry-after"));
    problem(r, 503).await;
    assert!(took < PROMPT, "503 after {took:?}");
    wait_readyz(&a, "an unreachable store", |status, s| {
        status == 503 && s["server"] == "unreachable"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    switch.point_at(standby.addr());
    for app in [&a, &b] {
        let (_, ready) =
            wait_readyz(app, "a read-only server", |_, s| s["server"] == "read-only").await;
        let detail = ready["details"]["store"]["detail"]
            .as_str()
            .unwrap_or_default();
        assert!(detail.contains("in recovery"), "{ready}");
    }
    // An instance started on the standby itself refuses to start: its
    // connections are refused on connect, before migrations could find
    // nothing to do there.
    refused_on_standby(&standby, &routes, "shared").await;
    let r = b.put("/docs/new", Some("1"), "on the standby").await;
    let body = problem(r, 503).await;
    assert_detail_says(&body, "read-only");

    let promoting = Instant::now();
    let standby = promote(standby).await;
    recovers_in_bound(&b, "/docs/new", "1", "shared").await;

    // The slow write's marker came through the failover: b's higher token
    // waits until the write can no longer be in flight, although a's key
    // lock ended with the old primary and b has never seen the key.
    eprintln!(
        "shared mode: token 11 first sent {:?} after the slow write (9 s at the upstream)",
        slow_sent.elapsed()
    );
    assert!(
        !slow.is_finished(),
        "the failover took longer than the slow write (9 s): this check would prove nothing"
    );
    let next = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let r = b.put("/docs/slow", Some("11"), "slow 11").await;
            match r.status().as_u16() {
                200 => break,
                503 => tokio::time::sleep(Duration::from_millis(200)).await,
                other => panic!("slow 11: {other}"),
            }
        }
    })
    .await;
    assert!(next.is_ok(), "token 11 never admitted");
    let slow = slow.await.expect("the slow write's task");
    assert_eq!(
        slow.ok(),
        Some(200),
        "the write in flight through the failover"
    );
    let order: Vec<Option<i64>> = up
        .applied_on("/docs/slow")
        .iter()
        .map(|a| a.token)
        .collect();
    assert_eq!(order, vec![Some(10), Some(11)]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let sent = load.finish().await;

    check_run(&up, &sent, down, promoting, true);
    let acked = acknowledged(&sent, crashed);
    let fresh = TestApp::spawn(&switch.url(), &routes).await;
    still_enforced(&fresh, &acked).await;
    assert_eq!(up.violations(), Vec::<String>::new());
    for app in [a, b, fresh] {
        app.stop().await;
    }
    drop((primary, standby));
    eprintln!(
        "shared-mode failover test took {:?}",
        test_started.elapsed()
    );
}

/// `default_transaction_read_only` switched on under a running gateway:
/// open connections get SQLSTATE 25006, new ones are refused on connect;
/// either way 503, nothing forwarded, `/readyz` names the setting; and
/// writes resume by themselves when it is switched off.
async fn read_only_primary_is_unavailable(mode: &str) {
    let pg = tokio::task::spawn_blocking(PrivatePg::start)
        .await
        .expect("start a private server");
    let up = Upstream::start().await;
    let routes = format!("mode = \"{mode}\"\n{}", docs_route(&up.url()));
    let app = TestApp::spawn(&pg.url(), &routes).await;
    assert_eq!(app.put("/docs/k", Some("1"), "before").await.status(), 200);

    admin(
        &pg.url(),
        &[
            "ALTER SYSTEM SET default_transaction_read_only = on",
            "SELECT pg_reload_conf()",
        ],
    )
    .await;
    // Sessions read the reloaded setting at their next command.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut token = 2;
    loop {
        let r = app
            .put("/docs/k", Some(&token.to_string()), "read-only")
            .await;
        match r.status().as_u16() {
            503 => break,
            200 => token += 1,
            other => panic!("{other} while the server turned read-only"),
        }
        assert!(Instant::now() < deadline, "writes never refused");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let forwarded = up.applied_on("/docs/k").len();
    // The lock's session notices at its next check (every 250 ms).
    let (status, ready) = wait_readyz(&app, "a read-only server", |_, s| {
        s["server"] == "read-only" && (mode == "shared" || s["writer_lock"]["held"] == false)
    })
    .await;
    let store = unready_for(status, &ready, "default_transaction_read_only");
    if mode == "single" {
        let why = store["writer_lock"]["detail"].as_str().unwrap_or_default();
        assert!(why.contains("read-only transactions"), "{ready}");
    }
    for _ in 0..3 {
        problem(
            app.put("/docs/k", Some(&(token + 1).to_string()), "refused")
                .await,
            503,
        )
        .await;
    }
    assert_eq!(
        up.applied_on("/docs/k").len(),
        forwarded,
        "forwarded while read-only"
    );

    admin(
        &pg.url(),
        &[
            "ALTER SYSTEM RESET default_transaction_read_only",
            "SELECT pg_reload_conf()",
        ],
    )
    .await;
    let writable = Instant::now();
    // Recovery is probed on a key of its own: in shared mode a write on
    // /docs/k that was forwarded just as the server turned read-only can
    // have had its leave refused (25006), and then its in-flight marker
    // rightly keeps /docs/k closed to other tokens until it expires (the
    // route's timeout_ms, 30 s by default, + 1 s from its admission).
    let recovered = until_accepted(&app, "/docs/after", "1", Duration::from_secs(30)).await;
    let took = recovered - writable;
    eprintln!("{mode} mode: writes recovered {took:?} after the server took writes again");
    assert!(took <= RECOVERY_BOUND, "recovered after {took:?}");
    until_accepted(
        &app,
        "/docs/k",
        &(token + 1).to_string(),
        Duration::from_secs(31) + RECOVERY_BOUND,
    )
    .await;
    let (status, ready) = readyz(&app).await;
    assert_eq!(status, 200, "{ready}");
    problem(app.put("/docs/k", Some("1"), "stale").await, 409).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_primary_is_unavailable_single() {
    read_only_primary_is_unavailable("single").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_primary_is_unavailable_shared() {
    read_only_primary_is_unavailable("shared").await
}

/// The durability check: an asynchronous standby is a warning at start-up
/// and in `/readyz`; once it is synchronous, neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durability_warning_for_an_asynchronous_standby_only() {
    let (primary, standby) = tokio::task::spawn_blocking(|| {
        let primary = PrivatePg::start();
        let standby = PrivatePg::standby_of(&primary, "standby1", &[]);
        (primary, standby)
    })
    .await
    .expect("start the private servers");
    wait_for_replicas(&primary, "async").await;
    let config = config_text(&primary.url(), &docs_route("http://127.0.0.1:9"));
    let http = reqwest::Client::new();
    let durability = |gw: &GatewayProcess| {
        let url = gw.admin_url("/readyz");
        let http = http.clone();
        async move {
            let r = http.get(url).send().await.expect("readyz answers");
            assert_eq!(r.status(), 200, "a durability warning is not unreadiness");
            let v: serde_json::Value = r.json().await.expect("readyz is JSON");
            v["details"]["store"]["durability"].clone()
        }
    };

    let mut gw = GatewayProcess::start(&config);
    let log = gw.log();
    assert!(
        log.contains("fence store durability") && log.contains("none synchronously"),
        "no durability warning at start-up:\n{log}"
    );
    let d = durability(&gw).await;
    assert_eq!(d["status"], "warning", "{d}");
    assert_eq!(d["replicas"], 1, "{d}");
    assert_eq!(d["synchronous_replicas"], 0, "{d}");
    assert!(
        d["warnings"][0]
            .as_str()
            .unwrap_or_default()
            .contains("none synchronously"),
        "{d}"
    );
    gw.signal(libc::SIGTERM);
    assert!(
        gw.wait_exit(Duration::from_secs(20)).is_some(),
        "the gateway did not stop"
    );

    admin(
        &primary.url(),
        &[
            "ALTER SYSTEM SET synchronous_standby_names = '*'",
            "SELECT pg_reload_conf()",
        ],
    )
    .await;
    wait_for_replicas(&primary, "sync").await;
    let mut gw = GatewayProcess::start(&config);
    let log = gw.log();
    assert!(
        !log.contains("fence store durability"),
        "a warning for a synchronous standby:\n{log}"
    );
    let d = durability(&gw).await;
    assert_eq!(d["status"], "ok", "{d}");
    assert_eq!(d["synchronous_replicas"], 1, "{d}");
    assert_eq!(d["synchronous_standby_names"], "*", "{d}");
    assert_eq!(d["synchronous_commit"], "on", "{d}");
    gw.signal(libc::SIGTERM);
    assert!(
        gw.wait_exit(Duration::from_secs(20)).is_some(),
        "the gateway did not stop"
    );
    drop((primary, standby));
}
