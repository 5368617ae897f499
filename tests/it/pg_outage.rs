//! Postgres goes away: fenced writes fail closed with 503 promptly, reads
//! still flow, `/readyz` says 503, and writes recover by themselves when
//! Postgres is back — with no stale write accepted afterwards. And the
//! gateway's connections are cut while in steady use: the same, without
//! a restart.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::support::app::{docs_route, problem, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::pg::PrivatePg;
use crate::support::upstream::Upstream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_fails_closed_and_recovers() {
    let pg = tokio::task::spawn_blocking(PrivatePg::start).await.unwrap();
    let up = Upstream::start().await;
    let app = TestApp::spawn(&pg.url(), &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/a", Some("10"), "ok").await.status(), 200);

    let pg = tokio::task::spawn_blocking(move || {
        pg.stop_immediate();
        pg
    })
    .await
    .unwrap();

    let started = Instant::now();
    let resp = app.put("/docs/a", Some("11"), "during outage").await;
    let took = started.elapsed();
    assert_eq!(
        resp.headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap()),
        Some("1")
    );
    problem(resp, 503).await;
    assert!(
        took < Duration::from_secs(10),
        "503 must come promptly, took {took:?}"
    );
    let ready = app.admin_get("/readyz").await;
    assert_eq!(ready.status(), 503);
    // Reads do not need the store.
    let read = app.http.get(app.url("/docs/a")).send().await.unwrap();
    assert_eq!(read.status(), 200);
    assert_eq!(up.applied().len(), 1, "nothing forwarded during the outage");

    let _pg = tokio::task::spawn_blocking(move || {
        pg.start_again();
        pg
    })
    .await
    .unwrap();
    // Recovery without a restart, within a bounded time.
    let resp = app
        .put_until_not_503("/docs/a", "12", "after", Duration::from_secs(30))
        .await;
    assert_eq!(resp.status(), 200, "writes did not recover");
    app.assert_stale("/docs/a", "11", "stale", 12).await;
    let ready = app.admin_get("/readyz").await;
    assert_eq!(ready.status(), 200);
}

/// Connections in steady use are not pinged before each statement (only
/// those idle for a second are), so a write can meet one that Postgres (a
/// restart, a pooler, an operator's `pg_terminate_backend`) cut a moment
/// ago. Such a write fails closed: 503, nothing forwarded. The broken
/// connections are not used again, so writes go through after a few
/// refusals, forwarded once, and no stale write is accepted after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_in_use_fail_closed_and_are_replaced() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    // Several connections in use at once, each used just now.
    let paths: Vec<String> = (0..8).map(|i| format!("/docs/w{i}")).collect();
    let warm: Vec<_> = paths
        .iter()
        .map(|path| app.put(path, Some("1"), "warm"))
        .collect();
    for resp in futures_util::future::join_all(warm).await {
        assert_eq!(resp.status(), 200);
    }
    assert_eq!(app.put("/docs/a", Some("1"), "first").await.status(), 200);

    cut_connections(&store.url).await;

    // At once, well within a second of their last use: until a write is
    // accepted. One token throughout: a 503 whose decision committed
    // before its answer was lost leaves the key at 2, which the retry's
    // equal token passes.
    let limit = Duration::from_secs(30);
    let resp = app
        .put_until_not_503("/docs/a", "2", "after the cut", limit)
        .await;
    assert_eq!(resp.status(), 200, "a write after the cut");
    // The token accepted is durable: an older one is refused as stale once
    // this instance decides again. Until it has taken its single-writer
    // lock again (that session was cut too), it decides nothing, not even
    // a refusal from memory: 503, never a forward.
    let resp = app.put_until_not_503("/docs/a", "1", "stale", limit).await;
    let answer = problem(resp, 409).await;
    assert_eq!(answer["highest_token"], 2, "{answer}");
    // Only accepted writes reached the upstream, once each.
    assert_eq!(up.bodies_on("/docs/a"), ["first", "after the cut"]);
}

/// Connections cut while the gateway is quiet (a Postgres restart at
/// night, a pooler recycling its server connections) are found out before
/// a write meets them: each connection idle for a second is pinged before
/// it is used again, the batchers' own connections as much as the pool's.
/// So once the gateway has its single-writer lock back, the first write
/// after the quiet spell is accepted at once, with no 503. (A connection
/// used without that check fails the write that meets it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_while_idle_are_replaced_before_a_write_meets_them() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/a", Some("1"), "first").await.status(), 200);

    cut_connections(&store.url).await;

    // The writer lock's session was cut too: wait until it is held again
    // (`/readyz` runs on the pool, never on the batchers' connections).
    let deadline = Instant::now() + Duration::from_secs(30);
    while app.admin_get("/readyz").await.status() != 200 {
        assert!(Instant::now() < deadline, "/readyz never recovered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Past the idle threshold of every connection the write will use.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    assert_eq!(
        app.put("/docs/a", Some("2"), "after the quiet")
            .await
            .status(),
        200,
        "the first write after the quiet spell met a dead connection"
    );
    app.assert_stale("/docs/a", "1", "stale", 2).await;
    assert_eq!(up.bodies_on("/docs/a"), ["first", "after the quiet"]);
    // Nor did the stale write arrive there, refused or not.
    let arrived = up
        .requests()
        .iter()
        .filter(|r| r.path() == "/docs/a")
        .count();
    assert_eq!(arrived, 2, "requests that arrived on /docs/a");
}

/// Cuts every connection to the test's database but the caller's own, as
/// `pg_terminate_backend` from an operator or a pooler would.
async fn cut_connections(url: &str) {
    let mut admin = PgConnection::connect(url).await.unwrap();
    let (cut,): (i64,) = sqlx::query_as(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(cut >= 2, "the gateway's connections were cut ({cut})");
}
