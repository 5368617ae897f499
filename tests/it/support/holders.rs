//! Lock holders hammering the gateway(s): the workload of the ordering tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rand::Rng;

use super::fenced_put;
use super::upstream::Upstream;

/// What the holders saw.
#[derive(Default, Debug)]
pub struct Outcome {
    /// body → token, for every write answered 200.
    pub acked: HashMap<String, i64>,
    /// Answers by status (0: no answer, e.g. the instance was killed).
    pub statuses: HashMap<u16, usize>,
}

/// The shape of a run.
#[derive(Clone, Copy)]
pub struct Workload {
    pub clients: usize,
    pub rounds: usize,
    pub docs: usize,
    /// Longest pause a holder takes after getting its token (a GC pause).
    pub max_pause_ms: u64,
}

/// `clients` holders; each round a holder takes the next token of a random
/// document (its "lock"), pauses at random, then writes one to three times
/// with it through a random gateway of `targets` (which may change while it
/// runs: instances restart on new ports). Every 409 must name a higher token.
/// Like [`run_dynamic`], over a fixed list.
pub async fn run_fixed(targets: Vec<String>, w: Workload) -> Outcome {
    run_dynamic(Arc::new(RwLock::new(targets)), w).await
}

pub async fn run_dynamic(targets: Arc<RwLock<Vec<String>>>, w: Workload) -> Outcome {
    let counters: Arc<Vec<AtomicI64>> = Arc::new((0..w.docs).map(|_| AtomicI64::new(0)).collect());
    let out = Arc::new(Mutex::new(Outcome::default()));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let mut tasks = Vec::new();
    for client in 0..w.clients {
        let (targets, counters, out, http) =
            (targets.clone(), counters.clone(), out.clone(), http.clone());
        tasks.push(tokio::spawn(async move {
            for round in 0..w.rounds {
                let (doc, pause, writes) = {
                    let mut rng = rand::thread_rng();
                    (
                        rng.gen_range(0..w.docs),
                        rng.gen_range(0..=w.max_pause_ms),
                        rng.gen_range(1..=3),
                    )
                };
                let token = counters[doc].fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_millis(pause)).await;
                for n in 0..writes {
                    let target = {
                        let t = targets.read().unwrap();
                        let mut rng = rand::thread_rng();
                        t[rng.gen_range(0..t.len())].clone()
                    };
                    let body = format!("c{client}-r{round}-w{n}-t{token}");
                    let resp =
                        fenced_put(&http, format!("{target}/docs/{doc}"), token, body.clone())
                            .send()
                            .await;
                    let status = resp.as_ref().map(|r| r.status().as_u16()).unwrap_or(0);
                    *out.lock().unwrap().statuses.entry(status).or_default() += 1;
                    match status {
                        200 => {
                            out.lock().unwrap().acked.insert(body, token);
                        }
                        409 => {
                            let v: serde_json::Value = resp.unwrap().json().await.unwrap();
                            let highest = v["highest_token"].as_i64().unwrap();
                            assert!(highest > token, "409 must name a higher token: {v}");
                            break;
                        }
                        0 | 502 | 503 | 504 => {}
                        s => panic!("unexpected status {s}"),
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    Arc::try_unwrap(out).unwrap().into_inner().unwrap()
}

/// The guarantees, as seen by the upstream: no violation (no lower token
/// applied after a higher one, never two tokens in flight), every
/// acknowledged write applied exactly once, no write applied twice.
pub fn check(up: &Upstream, out: &Outcome) {
    let violations = up.violations();
    assert!(
        violations.is_empty(),
        "ordering violated:\n{}",
        violations.join("\n")
    );
    let mut seen: HashMap<String, usize> = HashMap::new();
    for a in up.applied() {
        *seen
            .entry(String::from_utf8_lossy(&a.body).into_owned())
            .or_default() += 1;
    }
    for (body, n) in &seen {
        assert_eq!(*n, 1, "{body} applied {n} times");
    }
    for (body, token) in &out.acked {
        assert_eq!(
            seen.get(body),
            Some(&1),
            "acknowledged write {body} (token {token}) not applied"
        );
    }
}
