//! Protections of the listener itself: header-read timeout, connection limit,
//! graceful shutdown.

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::app::{config_sections, config_text, docs_route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

/// A gateway on SQLite with the docs route and `server_extra` in `[server]`.
pub(crate) async fn app_with(server_extra: &str) -> (TestStore, Upstream, TestApp) {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let text = config_sections(
        &format!("{server_extra}\n"),
        &store.url,
        "",
        &docs_route(&up.url()),
    );
    let app = TestApp::from_text(&text).await;
    (store, up, app)
}

#[tokio::test]
async fn slow_headers_are_cut_off() {
    let (_s, _up, app) = app_with("header_read_timeout_ms = 300").await;
    let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    s.write_all(b"GET /docs/a HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    // The server must close (or answer 408) instead of waiting forever.
    let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
    match r {
        Ok(Ok(n)) => {
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
        }
        Ok(Err(_)) => {}
        Err(_) => panic!("a slow-header connection was kept open"),
    }
}

#[tokio::test]
async fn connection_limit_queues_extra_clients() {
    let (_s, _up, app) = app_with("max_connections = 2\nheader_read_timeout_ms = 60000").await;
    // Two idle connections take both slots.
    let a = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let b = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let client = reqwest::Client::new();
    let url = app.url("/docs/q");
    let third = tokio::spawn(async move { client.get(url).send().await.map(|r| r.status()) });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served beyond the limit"
    );
    drop(a);
    let status = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("served once a slot freed")
        .unwrap()
        .unwrap();
    assert_eq!(status, 404);
    drop(b);
}

/// Waits for a gateway process told to stop (within 15 s: its grace period
/// is longer, but the tests' writes end sooner) and asserts it exited 0;
/// returns its log.
async fn exits_0(mut gw: GatewayProcess) -> String {
    let (status, log) = tokio::task::spawn_blocking(move || {
        let s = gw.wait_exit(Duration::from_secs(15));
        (s, gw.log())
    })
    .await
    .unwrap();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    log
}

/// A fenced write whose client left mid-exchange goes on in a task of its
/// own (it must not be cut off halfway); SIGTERM then must still let it end
/// before the process exits, and keep its key held until the route's
/// deadline (within the grace period), so that an instance started at once
/// cannot forward a newer token that overtakes it at the upstream: the
/// upstream applies 5 then 6, once each.
/// Single mode on SQLite, and shared mode on Postgres.
#[tokio::test]
async fn sigterm_lets_a_write_whose_client_left_finish() {
    for shared in [false, true] {
        let store = TestStore::new(if shared {
            Backend::Postgres
        } else {
            Backend::Sqlite
        })
        .await;
        let up = Upstream::start().await;
        let mode = if shared { "mode = \"shared\"\n" } else { "" };
        // A client that left holds its key until the route's timeout
        // (CONTRACT.md), and a clean stop waits for that: kept short here.
        let routes = format!("{mode}{}timeout_ms = 2500\n", docs_route(&up.url()));
        let config = config_text(&store.url, &routes);
        let gw = GatewayProcess::start(&config);
        // The client leaves once the upstream has the write (1.2 s of work):
        // its request, connection and pool are dropped.
        let client = reqwest::Client::new();
        let put = tokio::spawn(
            crate::support::fenced_put(&client, gw.url("/docs/left"), 5, "five")
                .header("x-test-delay-ms", "1200")
                .send(),
        );
        crate::support::wait_for("token 5 at the upstream", || up.in_flight() == 1).await;
        put.abort();
        assert!(put.await.is_err_and(|e| e.is_cancelled()));
        drop(client);
        gw.signal(libc::SIGTERM);
        let log = exits_0(gw).await;
        if shared {
            // Its exchange did not end normally (nobody read the answer), so
            // its in-flight marker is not left but outlives the deadline
            // (`InFlight::abandon`), as after a crash: bounded, and then the
            // key opens on every instance.
            let mut c = PgConnection::connect(&store.url).await.unwrap();
            let (highest, bounded): (i64, bool) = sqlx::query_as(
                "SELECT highest_token, inflight = 0 OR writer_until < now() + interval '30 s' \
                 FROM fences WHERE resource_key = 'doc:left'",
            )
            .fetch_one(&mut c)
            .await
            .unwrap();
            assert_eq!((highest, bounded), (5, true), "{log}");
        }
        // The next instance, at once: its newer token must not reach the
        // upstream before the write the stopped one still had there.
        let app = TestApp::spawn(&store.url, &routes).await;
        assert_eq!(app.put("/docs/left", Some("6"), "six").await.status(), 200);
        crate::support::wait_for("the upstream done with both writes", || up.in_flight() == 0)
            .await;
        let applied = up.applied_on("/docs/left");
        assert_eq!(
            applied.iter().map(|a| a.token).collect::<Vec<_>>(),
            [Some(5), Some(6)],
            "shared={shared}: the stop let a newer token overtake a write still at the upstream\n{log}"
        );
        app.assert_stale("/docs/left", "4", "four", 6).await;
        app.stop().await;
    }
}

#[tokio::test]
async fn sigterm_lets_in_flight_writes_finish_and_exits_0() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let gw = GatewayProcess::start(&config_text(&store.url, &docs_route(&up.url())));
    let slow = up.held_write(gw.url("/docs/s"), "1", "slow", 700).await;
    assert_eq!(
        up.in_flight(),
        1,
        "the slow write did not reach the upstream"
    );
    gw.signal(libc::SIGTERM);
    let status = slow.await.unwrap().expect("in-flight write answered");
    assert_eq!(status, 200);
    exits_0(gw).await;
    assert_eq!(up.applied().len(), 1);
}
