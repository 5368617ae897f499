//! `[store] mode = "shared"`: several gateways on one Postgres keep the
//! per-key ordering guarantee between them.

use crate::support::app::{config_sections, docs_route, problem, TestApp, SHARED_STORE};
use crate::support::db::{Backend, TestStore};
use crate::support::fenced_put;
use crate::support::holders::{self, Workload};
use crate::support::upstream::Upstream;

async fn gateways(store: &TestStore, up: &Upstream, n: usize) -> Vec<TestApp> {
    gateways_with(store, up, n, "").await
}

/// `n` shared-mode gateways; `store_extra` is added to their `[store]`.
async fn gateways_with(
    store: &TestStore,
    up: &Upstream,
    n: usize,
    store_extra: &str,
) -> Vec<TestApp> {
    let mut apps = Vec::new();
    for _ in 0..n {
        let store_lines = format!("{SHARED_STORE}{store_extra}\n");
        let text = config_sections("", &store.url, &store_lines, &docs_route(&up.url()));
        apps.push(TestApp::from_text(&text).await);
    }
    apps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_keep_per_key_order() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::with_write_delays(0, 8).await;
    let apps = gateways(&store, &up, 3).await;
    let targets = apps.iter().map(|a| a.url("")).collect::<Vec<_>>();
    let out = holders::run_fixed(
        targets,
        Workload {
            clients: 24,
            rounds: 10,
            docs: 3,
            max_pause_ms: 15,
        },
    )
    .await;
    holders::check(&up, &out);
    assert!(out.acked.len() > 24, "{:?}", out.statuses);
    assert!(
        out.statuses.get(&409).copied().unwrap_or(0) > 0,
        "{:?}",
        out.statuses
    );
    assert_eq!(out.statuses.get(&503), None, "{:?}", out.statuses);
}

#[tokio::test]
async fn shared_instances_see_each_others_tokens() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = gateways(&store, &up, 2).await;
    assert_eq!(apps[0].put("/docs/a", Some("34"), "B").await.status(), 200);
    apps[1].assert_stale("/docs/a", "33", "A", 34).await;
    assert_eq!(apps[1].put("/docs/a", Some("34"), "B2").await.status(), 200);
    assert_eq!(apps[1].put("/docs/a", Some("35"), "C").await.status(), 200);
    problem(apps[0].put("/docs/a", Some("34"), "B3").await, 409).await;
}

/// Sends token 5 to `path` through `app`, applied by the upstream after
/// 1.5 s, so that the key is held meanwhile; returns once the write is in
/// flight. The task answers the write's status.
async fn hold_key(app: &TestApp, path: &str) -> tokio::task::JoinHandle<reqwest::Result<u16>> {
    let req = fenced_put(&app.http, app.url(path), "5", "five").header("x-test-delay-ms", "1500");
    let task = tokio::spawn(async move { req.send().await.map(|r| r.status().as_u16()) });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    task
}

/// Two instances on a Postgres store with `key_lock_wait_ms = wait_ms`,
/// the first holding `path`'s key for a slow token 5 (see [`hold_key`]).
async fn held_by_the_first(
    path: &str,
    wait_ms: u64,
) -> (
    TestStore,
    Upstream,
    Vec<TestApp>,
    tokio::task::JoinHandle<reqwest::Result<u16>>,
) {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let wait = format!("key_lock_wait_ms = {wait_ms}");
    let apps = gateways_with(&store, &up, 2, &wait).await;
    let slow = hold_key(&apps[0], path).await;
    (store, up, apps, slow)
}

/// A client that gives up while its write waits inside `fencegate_enter`
/// (another instance holds the key for an older token): its write is never
/// started, and the key's cross-instance lock is not leaked — a newer token
/// gets through at once instead of waiting out `key_lock_wait_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_while_waiting_in_postgres_leaks_no_lock() {
    // Instance 0 forwards token 5 slowly, holding the key.
    let (_store, up, apps, slow) = held_by_the_first("/docs/w", 3000).await;
    // Token 6 on instance 1 waits for it inside Postgres; its client gives up.
    let gave_up = fenced_put(&apps[1].http, apps[1].url("/docs/w"), "6", "six")
        .timeout(std::time::Duration::from_millis(300))
        .send()
        .await;
    assert!(
        gave_up.is_err(),
        "token 6 was answered while 5 held the key"
    );
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    // Token 7 is let in, not held up by a lock token 6 left behind (that
    // would be a 503 after key_lock_wait_ms).
    let status = apps[0].put("/docs/w", Some("7"), "seven").await.status();
    assert_eq!(status, 200);
    let tokens: Vec<_> = up.applied_on("/docs/w").iter().map(|a| a.token).collect();
    assert_eq!(
        tokens,
        vec![Some(5), Some(7)],
        "token 6 must never be applied"
    );
    let metrics = apps[1].metrics().await;
    let line = "fencegate_decisions_total{route=\"docs\",outcome=\"client_gone\"} 1";
    assert!(metrics.contains(line), "missing {line} in\n{metrics}");
}

/// A write that waits inside Postgres longer than `key_lock_wait_ms` (another
/// instance holds the key for a slow older write) is answered 503 with
/// `Retry-After`, is never forwarded, and leaves nothing behind: its gate
/// connection, whose lock state is unknown after the `lock_timeout` error,
/// is closed rather than pooled, and later writes on the key go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_wait_past_key_lock_wait_is_503_and_leaves_nothing_behind() {
    let (_store, up, apps, slow) = held_by_the_first("/docs/t", 300).await;
    let resp = apps[1].put("/docs/t", Some("6"), "six").await;
    assert!(resp.headers().contains_key("retry-after"), "{resp:?}");
    // Postgres's lock_timeout: the gateway's own bound on the statement
    // (key_lock_wait_ms + timeout_ms = 3.3 s) is longer than the slow write.
    let body = problem(resp, 503).await;
    assert_eq!(body["type"], "urn:fencegate:problem:key-busy", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("300 ms"),
        "{body}"
    );
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    // Both instances go on serving the key, and the client's retry of 6
    // is the one that lands.
    assert_eq!(apps[1].put("/docs/t", Some("6"), "six").await.status(), 200);
    assert_eq!(
        apps[0].put("/docs/t", Some("7"), "seven").await.status(),
        200
    );
    let tokens: Vec<_> = up.applied_on("/docs/t").iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6), Some(7)]);
    let line = "fencegate_decisions_total{route=\"docs\",outcome=\"key_busy\"} 1";
    let metrics = apps[1].metrics().await;
    assert!(metrics.contains(line), "missing {line} in\n{metrics}");
}
