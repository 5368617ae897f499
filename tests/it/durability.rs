//! The new highest token is durable before forwarding: it survives a
//! graceful restart and a kill -9, on both stores. And only one `single`
//! instance may use a store.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::support::app::{config_text, docs_route, problem, TestApp};
use crate::support::db::{Backend, TestStore, SINGLE_WRITER_NAMESPACE};
use crate::support::fenced_put;
use crate::support::per_store;
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

per_store!(#[tokio::test] survives_restart => survives_restart_sqlite, survives_restart_postgres);

async fn survives_restart(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/a", Some("34"), "B").await.status(), 200);
    app.stop().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    app.assert_stale("/docs/a", "33", "A", 34).await;
    assert_eq!(
        app.put("/docs/a", Some("34"), "B again").await.status(),
        200
    );
}

per_store!(#[tokio::test] survives_kill_9 => survives_kill_9_sqlite, survives_kill_9_postgres);

/// Acknowledged tokens survive kill -9 of the gateway process, including
/// writes acknowledged the instant before the kill.
async fn survives_kill_9(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let config = config_text(&store.url, &docs_route(&up.url()));
    let mut gw = GatewayProcess::start(&config);
    let http = reqwest::Client::new();
    let mut last_acked = 0;
    for t in 1..=50 {
        let resp = fenced_put(&http, gw.url(&format!("/docs/k{}", t % 5)), t, "x")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        last_acked = t;
    }
    gw.kill9();
    let gw = GatewayProcess::start(&config);
    for k in 0..5 {
        // The highest acknowledged token for key k is the largest t ≤ 50 with t % 5 == k.
        let highest = (1..=last_acked).filter(|t| t % 5 == k).max().unwrap();
        let resp = fenced_put(&http, gw.url(&format!("/docs/k{k}")), highest - 1, "stale")
            .send()
            .await
            .unwrap();
        let body = problem(resp, 409).await;
        assert_eq!(body["highest_token"], highest, "key k{k}");
    }
    assert!(
        up.applied().iter().all(|a| &a.body[..] == b"x"),
        "no stale write reached the upstream"
    );
}

per_store!(#[tokio::test] second_single_instance_is_refused => second_single_instance_is_refused_sqlite, second_single_instance_is_refused_postgres);

async fn second_single_instance_is_refused(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let first = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    let second = TestApp::try_spawn(&store.url, &docs_route(&up.url())).await;
    let err = match second {
        Ok(_) => panic!("a second single-mode instance started on the same store"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("another fencegate instance"), "{err}");
    // Also as a process: it exits non-zero with the message.
    let config = config_text(&store.url, &docs_route(&up.url()));
    let log = match GatewayProcess::try_start(&config) {
        Ok(_) => panic!("a second single-mode process started"),
        Err(log) => log,
    };
    assert!(log.contains("another fencegate instance"), "{log}");
    // Once the first stops, a new instance may start.
    first.stop().await;
    TestApp::spawn(&store.url, &docs_route(&up.url())).await;
}

/// An instance started while the single-writer lock is still held by a
/// session that ends a moment later (a predecessor killed a moment ago,
/// whose server process has not yet noticed) waits for the lock instead
/// of refusing to start; then it decides.
#[tokio::test]
async fn a_restart_waits_for_a_crashed_instance_session_to_end() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    // The predecessor's session, holding the lock until it closes.
    let mut session = PgConnection::connect(&store.url).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1::int4, 1)")
        .bind(SINGLE_WRITER_NAMESPACE)
        .execute(&mut session)
        .await
        .unwrap();
    let held_for = Duration::from_millis(800);
    let ends = tokio::spawn(async move {
        tokio::time::sleep(held_for).await;
        session.close().await.unwrap();
    });
    let started = Instant::now();
    let app = TestApp::try_spawn(&store.url, &docs_route(&up.url()))
        .await
        .unwrap_or_else(|e| panic!("refused to start while the old session was ending: {e}"));
    assert!(
        started.elapsed() >= held_for,
        "started after {:?}, while the lock was still held",
        started.elapsed()
    );
    ends.await.unwrap();
    assert_eq!(app.put("/docs/a", Some("1"), "x").await.status(), 200);
    assert_eq!(up.applied().len(), 1);
}

per_store!(#[tokio::test] restart_after_crash_waits_for_in_flight_writes => restart_after_crash_waits_for_in_flight_writes_sqlite, restart_after_crash_waits_for_in_flight_writes_postgres);

/// A single-mode gateway killed while its write (token 5) is still being
/// applied upstream, restarted at once: a write with token 6 must not reach
/// the upstream while 5 may still be in flight. After a clean stop, no such
/// wait.
async fn restart_after_crash_waits_for_in_flight_writes(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let mut routes = docs_route(&up.url());
    routes.push_str("timeout_ms = 1500\n");
    let config = config_text(&store.url, &routes);
    let mut gw = GatewayProcess::start(&config);
    let slow = up.held_write(gw.url("/docs/q"), "5", "old", 1000).await;
    assert_eq!(
        up.in_flight(),
        1,
        "the slow write did not reach the upstream"
    );
    gw.kill9();
    let _ = slow.await;
    let gw = GatewayProcess::start(&config);
    assert!(gw.log().contains("did not stop cleanly"), "{}", gw.log());
    let resp = fenced_put(&reqwest::Client::new(), gw.url("/docs/q"), "6", "new")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let violations = up.violations();
    assert!(violations.is_empty(), "{violations:?}");
    let order: Vec<_> = up.applied().iter().map(|a| a.token).collect();
    assert_eq!(order, vec![Some(5), Some(6)]);

    // A clean stop (SIGTERM) leaves no such wait behind.
    let mut gw = gw;
    gw.signal(libc::SIGTERM);
    let exit =
        tokio::task::spawn_blocking(move || gw.wait_exit(std::time::Duration::from_secs(10)))
            .await
            .unwrap();
    assert_eq!(exit.and_then(|s| s.code()), Some(0));
    let gw = GatewayProcess::start(&config);
    assert!(!gw.log().contains("did not stop cleanly"), "{}", gw.log());
}
