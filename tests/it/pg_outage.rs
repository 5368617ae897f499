//! Postgres goes away: fenced writes fail closed with 503 promptly, reads
//! still flow, `/readyz` says 503, and writes recover by themselves when
//! Postgres is back — with no stale write accepted afterwards.

use std::time::{Duration, Instant};

use crate::support::app::{docs_route, problem, TestApp};
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
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let resp = app.put("/docs/a", Some("12"), "after").await;
        if resp.status() == 200 {
            break;
        }
        assert_eq!(resp.status(), 503);
        assert!(
            Instant::now() < deadline,
            "writes did not recover within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    app.assert_stale("/docs/a", "11", "stale", 12).await;
    let ready = app.admin_get("/readyz").await;
    assert_eq!(ready.status(), 200);
}
