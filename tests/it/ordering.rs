//! The ordering guarantee under concurrency: for one key, no write reaches
//! the upstream after a write with a higher token, and writes with different
//! tokens are never in flight together.
//!
//! These tests fail on a naive check-then-forward gateway: with the gate
//! bypassed (store check only), `lock_holders_never_overlap` reports
//! "two tokens in flight" and "applied N after M" violations within its
//! first few hundred writes, and the disconnect tests see the newer token
//! forwarded while the older write is still open at the upstream.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use tokio::io::AsyncWriteExt;

use crate::support::app::{docs_route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::per_store;
use crate::support::upstream::Upstream;
use crate::support::{fenced_put, wait_for};

per_store!(#[tokio::test(flavor = "multi_thread", worker_threads = 4)] lock_holders_never_overlap => lock_holders_never_overlap_sqlite, lock_holders_never_overlap_postgres);

/// 24 clients act as lock holders on 3 documents: each takes the next token
/// for a random document ("acquires the lock"), pauses at random (a GC
/// pause), then writes one to three times with it while the upstream takes a
/// random time to apply each write.
async fn lock_holders_never_overlap(b: Backend) {
    const CLIENTS: usize = 24;
    const ROUNDS: usize = 12;
    const DOCS: usize = 3;
    let store = TestStore::new(b).await;
    let up = Upstream::with_write_delays(0, 8).await;
    let app = Arc::new(TestApp::spawn(&store.url, &docs_route(&up.url())).await);
    let counters: Arc<Vec<AtomicI64>> = Arc::new((0..DOCS).map(|_| AtomicI64::new(0)).collect());
    // body → token, for every write the gateway acknowledged with 200.
    let acked: Arc<Mutex<HashMap<String, i64>>> = Arc::default();
    let refused = Arc::new(AtomicI64::new(0));

    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let (app, counters, acked, refused) = (
            app.clone(),
            counters.clone(),
            acked.clone(),
            refused.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let (doc, pause, writes) = {
                    let mut rng = rand::thread_rng();
                    (
                        rng.gen_range(0..DOCS),
                        rng.gen_range(0..15u64),
                        rng.gen_range(1..=3),
                    )
                };
                let token = counters[doc].fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_millis(pause)).await;
                for w in 0..writes {
                    let body = format!("c{client}-r{round}-w{w}-t{token}");
                    let resp = app
                        .put(&format!("/docs/{doc}"), Some(&token.to_string()), &body)
                        .await;
                    match resp.status().as_u16() {
                        200 => {
                            acked.lock().unwrap().insert(body, token);
                        }
                        409 => {
                            let v: serde_json::Value = resp.json().await.unwrap();
                            let highest = v["highest_token"].as_i64().unwrap();
                            assert!(highest > token, "409 must name a higher token: {v}");
                            refused.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        s => panic!(
                            "unexpected status {s}: {}",
                            resp.text().await.unwrap_or_default()
                        ),
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    let violations = up.violations();
    assert!(
        violations.is_empty(),
        "ordering violated:\n{}",
        violations.join("\n")
    );
    let applied = up.applied();
    let acked = acked.lock().unwrap();
    let mut seen = HashMap::new();
    for a in &applied {
        let body = String::from_utf8_lossy(&a.body).into_owned();
        *seen.entry(body).or_insert(0) += 1;
    }
    for (body, token) in acked.iter() {
        assert_eq!(
            seen.get(body),
            Some(&1),
            "acknowledged write {body} (token {token}) applied once"
        );
    }
    assert_eq!(
        applied.len(),
        acked.len(),
        "only acknowledged writes were applied"
    );
    assert!(
        acked.len() > CLIENTS,
        "the run did real work ({} writes)",
        acked.len()
    );
    assert!(
        refused.load(Ordering::Relaxed) > 0,
        "the run exercised stale holders"
    );
}

/// A client sends the start of a large body with token 33 and goes away
/// while a holder of 34 writes. The upstream must never see 34 while 33's
/// request is open, and never apply the truncated write. (Large: a small
/// body goes to the upstream only whole, see the next test.)
#[tokio::test]
async fn client_disconnect_mid_body_does_not_let_newer_overtake() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let mut routes = docs_route(&up.url());
    routes.push_str("timeout_ms = 1000\n");
    let app = TestApp::spawn(&store.url, &routes).await;

    let mut a = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    a.write_all(
        b"PUT /docs/x HTTP/1.1\r\nhost: t\r\nx-fence-token: 33\r\ncontent-length: 100000\r\n\r\n0123456789",
    )
    .await
    .unwrap();
    // Wait until the upstream has A's request open.
    wait_for("the first write at the upstream", || up.in_flight() == 1).await;

    let app2 = Arc::new(app);
    let b = {
        let app = app2.clone();
        tokio::spawn(async move { app.put("/docs/x", Some("34"), "B").await.status() })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        !b.is_finished(),
        "34 must wait while 33's write is open upstream"
    );
    assert!(up.applied().is_empty());
    drop(a);
    assert_eq!(b.await.unwrap(), 200);

    let violations = up.violations();
    assert!(violations.is_empty(), "{violations:?}");
    let applied = up.applied();
    assert_eq!(applied.len(), 1);
    assert_eq!(applied[0].token, Some(34));
    assert_eq!(
        up.aborted().len(),
        1,
        "the truncated write was seen and not applied"
    );
}

/// A small body (a length within one write) goes to the upstream only
/// whole, with its head: a client that sends half of one and goes away has
/// sent the upstream nothing, and 34 is forwarded once the fence has it.
/// An upstream given the head alone may answer before the body, and an
/// early answer would keep the key closed to the deadline.
#[tokio::test]
async fn a_small_body_cut_short_sends_the_upstream_nothing() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    let mut a = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    a.write_all(
        b"PUT /docs/y HTTP/1.1\r\nhost: t\r\nx-fence-token: 33\r\ncontent-length: 100\r\n\r\n0123456789",
    )
    .await
    .unwrap();
    // 33 is admitted (the fence moved) but waits for its body.
    let resp = app.put("/docs/y", Some("32"), "older").await;
    assert_eq!(resp.status(), 409, "33 is recorded");
    assert!(up.requests().is_empty(), "{:?}", up.requests());
    drop(a);
    assert_eq!(app.put("/docs/y", Some("34"), "B").await.status(), 200);
    let seen: Vec<_> = up
        .requests()
        .iter()
        .map(|r| r.header("x-fence-token").map(str::to_string))
        .collect();
    assert_eq!(
        seen,
        [Some("34".to_string())],
        "33 never reached the upstream"
    );
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

/// A write whose client disconnects after sending everything still runs to
/// its end upstream, and a newer token waits for it.
#[tokio::test]
async fn forward_survives_client_disconnect() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = Arc::new(TestApp::spawn(&store.url, &docs_route(&up.url())).await);

    let a = slow_put(&app, "/docs/y", "33", 400);
    wait_for("the first write at the upstream", || up.in_flight() == 1).await;
    a.abort(); // the client goes away mid-exchange
    let b = app.put("/docs/y", Some("34"), "B").await;
    assert_eq!(b.status(), 200);
    let violations = up.violations();
    assert!(violations.is_empty(), "{violations:?}");
    let order: Vec<_> = up.applied().iter().map(|a| a.token).collect();
    assert_eq!(order, vec![Some(33), Some(34)], "A ran to its end before B");
    // A's own end accounted for it, though its client was gone: a write
    // dropped with its client would never be counted.
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("fencegate_decisions_total{route=\"docs\",outcome=\"forwarded\"} 2"),
        "{metrics}"
    );
}

/// A client that gives up while its write waits at the gate behind an
/// older token's write: the write, polled in the request's future until
/// then, goes on in a task of its own, is admitted once the older write is
/// done, and is never started, because its client is gone. A newer token
/// goes after the older one.
#[tokio::test]
async fn client_gone_while_waiting_at_the_gate_is_never_forwarded() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = Arc::new(TestApp::spawn(&store.url, &docs_route(&up.url())).await);

    let slow = slow_put(&app, "/docs/g", "5", 800);
    wait_for("the first write at the upstream", || up.in_flight() == 1).await;
    let gave_up = fenced_put(&app.http, app.url("/docs/g"), "6", "six")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        gave_up.is_err(),
        "token 6 was answered while 5 held the key"
    );
    assert_eq!(slow.await.unwrap().unwrap().status(), 200);
    let gone = "fencegate_decisions_total{route=\"docs\",outcome=\"client_gone\"} 1";
    let mut metrics = String::new();
    for _ in 0..250 {
        metrics = app.metrics().await;
        if metrics.contains(gone) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(metrics.contains(gone), "{metrics}");
    assert_eq!(app.put("/docs/g", Some("7"), "seven").await.status(), 200);
    let tokens: Vec<_> = up.applied_on("/docs/g").iter().map(|a| a.token).collect();
    assert_eq!(
        tokens,
        vec![Some(5), Some(7)],
        "token 6 must never be applied"
    );
    assert!(up.violations().is_empty());
}

/// Equal tokens may be in flight together (one holder writing in parallel).
#[tokio::test]
async fn equal_tokens_run_concurrently() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = Arc::new(TestApp::spawn(&store.url, &docs_route(&up.url())).await);
    let mut tasks = Vec::new();
    for i in 0..4 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            fenced_put(&app.http, app.url("/docs/z"), "5", format!("w{i}"))
                .header("x-test-delay-ms", "300")
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    let mut max_in_flight = 0;
    while tasks.iter().any(|t| !t.is_finished()) {
        max_in_flight = max_in_flight.max(up.in_flight());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert!(max_in_flight > 1, "equal tokens were serialized");
    assert!(up.violations().is_empty());
}

/// A fenced PUT of `token` on `path` (its body: the token) that the
/// upstream holds for `delay_ms` before applying it, sent in a task.
fn slow_put(
    app: &Arc<TestApp>,
    path: &str,
    token: &'static str,
    delay_ms: u64,
) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
    let send = fenced_put(&app.http, app.url(path), token, token)
        .header("x-test-delay-ms", delay_ms.to_string())
        .send();
    tokio::spawn(send)
}
