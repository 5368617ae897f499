//! Upgrades on pass-through routes (`[[routes]] upgrades = true`): a
//! WebSocket over HTTP/1.1 (`101`) and over HTTP/2 (extended CONNECT, RFC
//! 8441), any other protocol as bytes both ways, and the limits: fenced
//! methods never upgrade, a route without upgrades takes none, a tunnel
//! ends when idle and at a stop with FINs both ways, and holds its
//! connection's slot. Each asserted at the upstream as well.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::handshake::server::{
    Request as WsRequest, Response as WsResponse,
};
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::support::app::{config_sections, docs_route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::upstream::Upstream;
use crate::support::{serve_each, wait_for};

/// What an upstream saw of its upgrades: each handshake's head, and how
/// each tunnel ended on its side.
#[derive(Clone, Default)]
struct Seen {
    heads: Arc<Mutex<Vec<http::HeaderMap>>>,
    ends: Arc<Mutex<Vec<String>>>,
}

impl Seen {
    fn heads(&self) -> Vec<http::HeaderMap> {
        self.heads.lock().unwrap().clone()
    }

    fn ends(&self) -> Vec<String> {
        self.ends.lock().unwrap().clone()
    }
}

/// A WebSocket echo server (tokio-tungstenite) on port 0.
async fn websocket_upstream() -> (SocketAddr, Seen) {
    let seen = Seen::default();
    let s = seen.clone();
    let addr = serve_each(move |tcp| {
        let s = s.clone();
        async move {
            let heads = s.heads.clone();
            // tungstenite's callback type, whose error is an answer.
            #[allow(clippy::result_large_err)]
            let record = move |req: &WsRequest, resp: WsResponse| {
                heads.lock().unwrap().push(req.headers().clone());
                Ok(resp)
            };
            let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(tcp, record).await else {
                s.ends.lock().unwrap().push("no handshake".into());
                return;
            };
            let end = loop {
                match ws.next().await {
                    Some(Ok(m @ (Message::Text(_) | Message::Binary(_)))) => {
                        if ws.send(m).await.is_err() {
                            break "send failed".to_string();
                        }
                    }
                    Some(Ok(Message::Close(_))) => break "close frame".to_string(),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => break format!("error: {e}"),
                    None => break "end".to_string(),
                }
            };
            s.ends.lock().unwrap().push(end);
        }
    })
    .await;
    (addr, seen)
}

/// A raw upstream that answers every upgrade with a `101` (with `extra`
/// fields), then echoes bytes until the client's FIN, and sends its own.
/// Its ends: "eof" after a FIN, or the read error.
async fn echo_upstream(extra: &'static str) -> (SocketAddr, Seen) {
    let seen = Seen::default();
    let s = seen.clone();
    let addr = serve_each(move |mut tcp| {
        let s = s.clone();
        async move {
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let mut byte = [0u8; 1];
                if tcp.read_exact(&mut byte).await.is_err() {
                    return;
                }
                head.push(byte[0]);
            }
            let mut fields = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut fields);
            req.parse(&head).unwrap();
            let mut map = http::HeaderMap::new();
            for f in req.headers.iter() {
                map.append(
                    http::HeaderName::from_bytes(f.name.as_bytes()).unwrap(),
                    http::HeaderValue::from_bytes(f.value).unwrap(),
                );
            }
            s.heads.lock().unwrap().push(map);
            let answer = format!(
                "HTTP/1.1 101 Switching Protocols\r\nupgrade: echo\r\nconnection: upgrade\r\n{extra}\r\n"
            );
            tcp.write_all(answer.as_bytes()).await.unwrap();
            let mut buf = [0u8; 4096];
            let end = loop {
                match tcp.read(&mut buf).await {
                    Ok(0) => break "eof".to_string(),
                    Ok(n) => {
                        if tcp.write_all(&buf[..n]).await.is_err() {
                            break "write failed".to_string();
                        }
                    }
                    Err(e) => break format!("error: {e}"),
                }
            };
            let _ = tcp.shutdown().await;
            s.ends.lock().unwrap().push(end);
        }
    })
    .await;
    (addr, seen)
}

/// A route `/ws/{room}` to `upstream`, with `extra` lines.
fn ws_route(upstream: SocketAddr, extra: &str) -> String {
    format!(
        "[[routes]]\nname = \"ws\"\npath = \"/ws/{{room}}\"\nupstream = \"http://{upstream}\"\n\
         key = \"ws:{{room}}\"\n{extra}"
    )
}

async fn gateway(server: &str, routes: &str) -> (TestApp, TestStore) {
    let store = TestStore::new(Backend::Sqlite).await;
    let app = TestApp::from_text(&config_sections(server, &store.url, "", routes)).await;
    (app, store)
}

/// Sends `head` on a new connection and reads the answer's head.
async fn ask(addr: SocketAddr, head: &str) -> (TcpStream, String) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    while !got.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut byte))
            .await
            .expect("an answer head")
            .unwrap();
        assert!(
            n > 0,
            "closed before an answer: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    (tcp, String::from_utf8(got).unwrap())
}

/// An upgrade to the echo protocol, asked on `/ws/{room}`.
fn echo_head(room: &str) -> String {
    format!("GET /ws/{room} HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n")
}

#[tokio::test]
async fn a_websocket_over_http1_is_tunnelled_to_the_upstream() {
    let (up, seen) = websocket_upstream().await;
    let (app, _store) = gateway("", &ws_route(up, "upgrades = true\n")).await;
    let url = format!("ws://{}/ws/lobby", app.addr);
    let tcp = TcpStream::connect(app.addr).await.unwrap();
    let (mut ws, answer) = tokio_tungstenite::client_async(url, tcp).await.unwrap();
    assert_eq!(answer.status(), 101);
    ws.send(Message::text("hello")).await.unwrap();
    assert_eq!(ws.next().await.unwrap().unwrap(), Message::text("hello"));
    let big = vec![7u8; 300 * 1024];
    ws.send(Message::binary(big.clone())).await.unwrap();
    assert_eq!(ws.next().await.unwrap().unwrap(), Message::binary(big));
    ws.close(None).await.unwrap();
    wait_for("the upstream saw the close", || !seen.ends().is_empty()).await;
    assert_eq!(seen.ends(), ["close frame"]);
    let heads = seen.heads();
    assert_eq!(heads.len(), 1);
    let head = &heads[0];
    assert_eq!(head["upgrade"], "websocket");
    assert_eq!(head["host"], up.to_string().as_str());
    assert!(head.contains_key("sec-websocket-key"));
    assert_eq!(head["x-forwarded-for"], "127.0.0.1");
}

#[tokio::test]
async fn any_protocol_passes_as_bytes_and_half_closes() {
    let (up, seen) = echo_upstream("").await;
    let (app, _store) = gateway("", &ws_route(up, "upgrades = true\n")).await;
    // Bytes sent right behind the request reach the upstream after it.
    let head = echo_head("raw") + "early ";
    let (mut tcp, answer) = ask(app.addr, &head).await;
    assert!(
        answer.starts_with("HTTP/1.1 101 Switching Protocols\r\n"),
        "{answer}"
    );
    assert!(answer.contains("upgrade: echo\r\n"), "{answer}");
    assert!(answer.contains("connection: upgrade\r\n"), "{answer}");
    assert_eq!(tunnels_open(&app).await, 1);
    tcp.write_all(b"bytes").await.unwrap();
    // The client's FIN is passed on; the upstream's answer still comes.
    tcp.shutdown().await.unwrap();
    let mut echoed = String::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_string(&mut echoed))
        .await
        .expect("the tunnel ended")
        .expect("with a FIN, not a reset");
    assert_eq!(echoed, "early bytes");
    wait_for("the upstream saw the end", || !seen.ends().is_empty()).await;
    assert_eq!(seen.ends(), ["eof"]);
    for _ in 0..500 {
        if tunnels_open(&app).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        tunnels_open(&app).await,
        0,
        "the tunnel is no longer counted"
    );
}

/// `fencegate_tunnels_open` of the route `ws`.
async fn tunnels_open(app: &TestApp) -> u64 {
    let text = app.metrics().await;
    let line = text
        .lines()
        .find(|l| l.starts_with("fencegate_tunnels_open{route=\"ws\"}"))
        .unwrap_or_else(|| panic!("no tunnels_open series in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Without `upgrades`, an HTTP/1.1 `Upgrade` is a hop-by-hop field like
/// the others: the GET is passed on without it, and answered as a GET.
#[tokio::test]
async fn a_route_without_upgrades_passes_a_plain_get() {
    let up = Upstream::start().await;
    let store = TestStore::new(Backend::Sqlite).await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    let head =
        "GET /docs/a HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n";
    let (_tcp, answer) = ask(app.addr, head).await;
    // The recorder's answer to a GET of a document it does not have.
    assert!(answer.starts_with("HTTP/1.1 404 Not Found\r\n"), "{answer}");
    assert!(answer.contains("x-upstream: recorder\r\n"), "{answer}");
    let seen = up.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "GET");
    assert_eq!(seen[0].header("upgrade"), None);
    assert_eq!(seen[0].header("connection"), None);
}

/// Fenced methods never upgrade, on a route that takes upgrades: the write
/// is fenced and forwarded as a write, its `Upgrade` dropped.
#[tokio::test]
async fn fenced_methods_never_upgrade() {
    let up = Upstream::start().await;
    let store = TestStore::new(Backend::Sqlite).await;
    let routes = docs_route(&up.url()) + "upgrades = true\n";
    let app = TestApp::spawn(&store.url, &routes).await;
    let head = "PUT /docs/w HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: echo\r\n\
                x-fence-token: 5\r\ncontent-length: 4\r\n\r\nfive";
    let (_tcp, answer) = ask(app.addr, head).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    let head = "PUT /docs/w HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: echo\r\n\
                x-fence-token: 4\r\ncontent-length: 4\r\n\r\nfour";
    let (_tcp, answer) = ask(app.addr, head).await;
    assert!(answer.starts_with("HTTP/1.1 409 Conflict\r\n"), "{answer}");
    assert_eq!(up.bodies_on("/docs/w"), ["five"]);
    let seen = up.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].header("upgrade"), None);
}

/// What an HTTP/2 extended CONNECT to `path` is answered, on a new h2c
/// connection; with its stream when it opened a tunnel.
async fn extended_connect(
    addr: SocketAddr,
    path: &str,
    protocol: &'static str,
) -> (
    http::Response<h2::RecvStream>,
    h2::SendStream<Bytes>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut client = client.ready().await.unwrap();
    // The server's SETTINGS arrive as the connection is driven.
    for _ in 0..500 {
        if client.is_extended_connect_protocol_enabled() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        client.is_extended_connect_protocol_enabled(),
        "SETTINGS_ENABLE_CONNECT_PROTOCOL"
    );
    let req = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(format!("http://{addr}{path}"))
        .extension(h2::ext::Protocol::from_static(protocol))
        .header("sec-websocket-version", "13")
        .body(())
        .unwrap();
    let (answer, send) = client.send_request(req, false).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("an answer")
        .unwrap();
    (answer, send, conn)
}

#[tokio::test]
async fn a_websocket_over_http2_extended_connect_is_tunnelled() {
    let (up, seen) = websocket_upstream().await;
    let (app, _store) = gateway("", &ws_route(up, "upgrades = true\n")).await;
    let (answer, send, _conn) = extended_connect(app.addr, "/ws/h2", "websocket").await;
    assert_eq!(answer.status(), 200);
    assert!(!answer.headers().contains_key("sec-websocket-accept"));
    let io = fencegate::http2::tunnel::StreamIo::new(answer.into_body(), send);
    let mut ws = WebSocketStream::from_raw_socket(io, Role::Client, None).await;
    ws.send(Message::text("over h2")).await.unwrap();
    assert_eq!(ws.next().await.unwrap().unwrap(), Message::text("over h2"));
    ws.close(None).await.unwrap();
    wait_for("the upstream saw the close", || !seen.ends().is_empty()).await;
    assert_eq!(seen.ends(), ["close frame"]);
    // The upstream had an HTTP/1.1 WebSocket handshake, with a key the
    // gateway made (and whose accept it checked).
    let head = &seen.heads()[0];
    assert_eq!(head["upgrade"], "websocket");
    assert_eq!(head["sec-websocket-version"], "13");
    assert!(head.contains_key("sec-websocket-key"));
}

/// An extended CONNECT is nothing but a tunnel: where the route takes
/// none it is refused, never passed on as a GET.
#[tokio::test]
async fn an_extended_connect_where_the_route_takes_none_is_405() {
    let up = Upstream::start().await;
    let store = TestStore::new(Backend::Sqlite).await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    let (answer, _send, _conn) = extended_connect(app.addr, "/docs/a", "websocket").await;
    assert_eq!(answer.status(), 405);
    assert_eq!(answer.headers()["content-type"], "application/problem+json");
    assert!(up.requests().is_empty(), "{:?}", up.requests());
}

/// An upstream whose `101` does not accept the key the gateway made for a
/// WebSocket over HTTP/2 did not agree to that handshake: 502, and no
/// tunnel.
#[tokio::test]
async fn a_wrong_websocket_accept_is_502_and_no_tunnel() {
    let (up, seen) = echo_upstream("sec-websocket-accept: bm90IHRoZSBhY2NlcHQ=\r\n").await;
    let (app, _store) = gateway("", &ws_route(up, "upgrades = true\n")).await;
    let (answer, _send, _conn) = extended_connect(app.addr, "/ws/x", "websocket").await;
    assert_eq!(answer.status(), 502);
    assert_eq!(seen.heads().len(), 1);
    wait_for("the upstream connection was dropped", || {
        !seen.ends().is_empty()
    })
    .await;
}

/// A protocol that carries HTTP itself (`h2c`, `h2`, `HTTP/2.0`, TLS) is
/// never tunnelled, even on a route with `upgrades`: through such a
/// tunnel a client would speak HTTP straight to the upstream, its writes
/// never fenced ("h2c smuggling"). The upgrade is dropped, so the
/// upstream sees a plain GET; this one switches anyway, unasked, and that
/// is 502. Over HTTP/2 the extended CONNECT is 405, and nothing arrives.
#[tokio::test]
async fn an_upgrade_to_http_itself_is_never_tunnelled() {
    let (up, seen) = echo_upstream("").await;
    let (app, _store) = gateway("", &ws_route(up, "upgrades = true\n")).await;
    let offers = ["h2c", "websocket, h2c", "HTTP/2.0", "TLS/1.2"];
    for offer in offers {
        let head = format!(
            "GET /ws/smuggle HTTP/1.1\r\nhost: gw\r\nconnection: upgrade, http2-settings\r\n\
             upgrade: {offer}\r\nhttp2-settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n"
        );
        let (_tcp, answer) = ask(app.addr, &head).await;
        assert!(answer.starts_with("HTTP/1.1 502 "), "{offer}: {answer}");
    }
    let heads = seen.heads();
    assert_eq!(heads.len(), offers.len());
    for head in &heads {
        assert!(!head.contains_key("upgrade"), "{head:?}");
        assert!(!head.contains_key("http2-settings"), "{head:?}");
    }
    let (answer, _send, _conn) = extended_connect(app.addr, "/ws/smuggle", "h2c").await;
    assert_eq!(answer.status(), 405);
    assert_eq!(
        seen.heads().len(),
        offers.len(),
        "the CONNECT reached nothing"
    );
}

/// The upstream must switch to a protocol that was asked for (RFC 9110
/// §7.8): a `101` naming another one is 502, and no tunnel.
#[tokio::test]
async fn a_101_to_a_protocol_not_asked_for_is_502() {
    let (up, seen) = echo_upstream("").await;
    let (app, _store) = gateway("", &ws_route(up, "upgrades = true\n")).await;
    let head =
        "GET /ws/other HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: other\r\n\r\n";
    let (_tcp, answer) = ask(app.addr, head).await;
    assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
    assert_eq!(seen.heads()[0]["upgrade"], "other");
    wait_for("the upstream connection was dropped", || {
        !seen.ends().is_empty()
    })
    .await;
}

#[tokio::test]
async fn an_idle_tunnel_is_closed_with_fins_both_ways() {
    let (up, seen) = echo_upstream("").await;
    let routes = ws_route(up, "upgrades = true\nupgrade_idle_timeout_ms = 300\n");
    let (app, _store) = gateway("", &routes).await;
    let (mut tcp, answer) = ask(app.addr, &echo_head("idle")).await;
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
    tcp.write_all(b"once").await.unwrap();
    let mut got = [0u8; 4];
    tcp.read_exact(&mut got).await.unwrap();
    // Then nothing: the gateway ends the tunnel.
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut rest))
        .await
        .expect("the idle tunnel ended")
        .expect("with a FIN, not a reset");
    assert!(rest.is_empty());
    wait_for("the upstream saw the end", || !seen.ends().is_empty()).await;
    assert_eq!(seen.ends(), ["eof"]);
}

#[tokio::test]
async fn a_stop_closes_tunnels_with_fins_after_the_grace_period() {
    let (up, seen) = echo_upstream("").await;
    let routes = ws_route(up, "upgrades = true\n");
    let (app, _store) = gateway("shutdown_grace_ms = 300\n", &routes).await;
    let (mut tcp, answer) = ask(app.addr, &echo_head("stop")).await;
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
    tcp.write_all(b"before").await.unwrap();
    let mut got = [0u8; 6];
    tcp.read_exact(&mut got).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), app.stop())
        .await
        .expect("the stop ended");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut rest))
        .await
        .expect("the tunnel ended")
        .expect("with a FIN, not a reset");
    wait_for("the upstream saw the end", || !seen.ends().is_empty()).await;
    assert_eq!(seen.ends(), ["eof"]);
}

/// The same over HTTP/2: at the end of the grace period the tunnel's
/// stream gets END_STREAM after what the upstream had sent, and the
/// upstream a FIN, not a reset.
#[tokio::test]
async fn a_stop_ends_an_http2_tunnel_with_end_stream() {
    let (up, seen) = echo_upstream("").await;
    let routes = ws_route(up, "upgrades = true\n");
    let (app, _store) = gateway("shutdown_grace_ms = 300\n", &routes).await;
    // The echo upstream agrees to any protocol: `echo` over CONNECT.
    let (answer, send, _conn) = extended_connect(app.addr, "/ws/h2stop", "echo").await;
    assert_eq!(answer.status(), 200);
    let mut io = fencegate::http2::tunnel::StreamIo::new(answer.into_body(), send);
    io.write_all(b"before").await.unwrap();
    let mut got = [0u8; 6];
    io.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"before");
    tokio::time::timeout(Duration::from_secs(20), app.stop())
        .await
        .expect("the stop ended");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), io.read_to_end(&mut rest))
        .await
        .expect("the tunnel ended")
        .expect("with END_STREAM, not a reset");
    wait_for("the upstream saw the end", || !seen.ends().is_empty()).await;
    assert_eq!(seen.ends(), ["eof"]);
}

/// A tunnel keeps its client connection, and so its slot of the
/// listener's connection limit: at the limit, the next client waits in
/// the backlog until a tunnel ends.
#[tokio::test]
async fn tunnels_hold_their_connection_slots() {
    let (up, _seen) = echo_upstream("").await;
    let routes = ws_route(up, "upgrades = true\n");
    let (app, _store) = gateway("max_connections = 2\n", &routes).await;
    let (mut first, a) = ask(app.addr, &echo_head("one")).await;
    let (_second, b) = ask(app.addr, &echo_head("two")).await;
    assert!(a.starts_with("HTTP/1.1 101") && b.starts_with("HTTP/1.1 101"));
    let addr = app.addr;
    let third = tokio::spawn(async move { ask(addr, &echo_head("three")).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served at the limit"
    );
    first.shutdown().await.unwrap();
    let mut rest = Vec::new();
    first.read_to_end(&mut rest).await.unwrap();
    let (_third, c) = tokio::time::timeout(Duration::from_secs(10), third)
        .await
        .expect("served once a slot was free")
        .unwrap();
    assert!(c.starts_with("HTTP/1.1 101"), "{c}");
}

#[test]
fn upgrades_need_an_http1_upstream_and_an_unfenced_get() {
    let base = |extra: &str| {
        config_sections(
            "",
            "sqlite://x.db",
            "",
            &format!(
                "[[routes]]\nname = \"ws\"\npath = \"/ws/{{r}}\"\nupstream = \"http://127.0.0.1:9\"\n\
                 key = \"ws:{{r}}\"\nupgrades = true\n{extra}"
            ),
        )
    };
    let e = crate::support::app::config_error(&base("upstream_protocol = \"h2c\"\n"));
    assert!(e.contains("routes[0].upgrades"), "{e}");
    let e = crate::support::app::config_error(&base("methods = [\"GET\", \"PUT\"]\n"));
    assert!(e.contains("fenced methods never upgrade"), "{e}");
    let e = crate::support::app::config_error(&base("upgrade_idle_timeout_ms = 0\n"));
    assert!(e.contains("routes[0].upgrade_idle_timeout_ms"), "{e}");
}
