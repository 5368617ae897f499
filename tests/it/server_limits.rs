//! Protections of the listener itself: header-read timeout, connection limit,
//! graceful shutdown.

use std::time::Duration;

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

#[tokio::test]
async fn sigterm_lets_in_flight_writes_finish_and_exits_0() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let mut gw = GatewayProcess::start(&config_text(&store.url, &docs_route(&up.url())));
    let slow = up.held_write(gw.url("/docs/s"), "1", "slow", 700).await;
    assert_eq!(
        up.in_flight(),
        1,
        "the slow write did not reach the upstream"
    );
    gw.signal(libc::SIGTERM);
    let status = slow.await.unwrap().expect("in-flight write answered");
    assert_eq!(status, 200);
    let exit = tokio::task::spawn_blocking(move || {
        let s = gw.wait_exit(Duration::from_secs(10));
        (s, gw.log())
    })
    .await
    .unwrap();
    assert_eq!(exit.0.and_then(|s| s.code()), Some(0), "{}", exit.1);
    assert_eq!(up.applied().len(), 1);
}
