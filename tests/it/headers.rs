//! Header hygiene and streaming; the headers a request's `Connection`
//! cannot take away, and one set of credentials.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::app::{config_sections, docs_route, problem, route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::fenced_put;
use crate::support::upstream::Upstream;

async fn setup() -> (TestStore, Upstream, TestApp) {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    (store, up, app)
}

#[tokio::test]
async fn hop_by_hop_headers_are_removed_and_forwarding_headers_set() {
    let (_s, up, app) = setup().await;
    // Raw HTTP, so nothing in the client library normalizes what we send.
    let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    s.write_all(
        b"PUT /docs/h?x=1 HTTP/1.1\r\n\
          Host: client.example\r\n\
          Connection: keep-alive, X-Private\r\n\
          X-Private: secret\r\n\
          Keep-Alive: timeout=5\r\n\
          TE: trailers\r\n\
          Trailer: X-Checksum\r\n\
          Upgrade: websocket\r\n\
          Proxy-Authorization: Basic Zm9vOmJhcg==\r\n\
          Proxy-Connection: keep-alive\r\n\
          X-Forwarded-For: 10.1.2.3\r\n\
          X-Forwarded-Proto: https\r\n\
          X-Fence-Token: 0042\r\n\
          X-Custom: kept\r\n\
          Content-Length: 5\r\n\r\nhello",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");

    let reqs = up.requests();
    assert_eq!(reqs.len(), 1);
    let r = &reqs[0];
    assert_eq!(r.path_and_query, "/docs/h?x=1");
    let h = &r.headers;
    for gone in [
        "connection",
        "x-private",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
    ] {
        assert!(!h.contains_key(gone), "{gone} was forwarded");
    }
    assert_eq!(h["x-fence-token"], "0042", "token forwarded unchanged");
    assert_eq!(h["x-custom"], "kept");
    assert_eq!(h["x-forwarded-for"], "10.1.2.3, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-host"], "client.example");
    assert_eq!(
        h["host"],
        up.addr().to_string(),
        "upstream authority comes from config"
    );
    assert_eq!(r.body_len, 5);
}

/// A fenced write (token 1) of `n` copies of `chunk` on `path`, sent
/// chunked: the gateway learns the body's length only at its end.
async fn put_chunked(app: &TestApp, path: &str, n: usize, chunk: Vec<u8>) -> reqwest::Response {
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = (0..n).map(|_| Ok(chunk.clone())).collect();
    let body = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    fenced_put(&app.http, app.url(path), "1", body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn bodies_stream_both_ways() {
    let (_s, up, app) = setup().await;
    // 8 MiB up, chunked (unknown length), through the gateway.
    let resp = put_chunked(&app, "/docs/big", 128, vec![7u8; 64 * 1024]).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(up.applied()[0].body.len(), 8 * 1024 * 1024);
    // 32 MiB down, larger than the request limit: responses are not limited.
    let resp = app
        .http
        .get(app.url("/docs/big"))
        .header("x-test-response-bytes", (32 * 1024 * 1024).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.bytes().await.unwrap().len(), 32 * 1024 * 1024);
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    // A small limit via the [server] section.
    let text = config_sections(
        "max_body_bytes = 1000\n",
        &store.url,
        "",
        &docs_route(&up.url()),
    );
    let app = TestApp::from_text(&text).await;
    // Declared too large: refused before anything else.
    let resp = app.put("/docs/a", Some("1"), &"x".repeat(1001)).await;
    problem(resp, 413).await;
    // Chunked and too large: cut off on the bytes actually read.
    let resp = put_chunked(&app, "/docs/b", 4, vec![1u8; 600]).await;
    problem(resp, 413).await;
    assert!(up.applied().is_empty(), "no oversized write was applied");
    // At the limit is fine.
    assert_eq!(
        app.put("/docs/c", Some("1"), &"x".repeat(1000))
            .await
            .status(),
        200
    );
    // Each fenced write is one decision: the declared-too-large one is
    // `too_large`; the chunked one had been forwarded when it was cut off.
    let metrics = app.metrics().await;
    for line in [
        "fencegate_decisions_total{route=\"docs\",outcome=\"too_large\"} 1",
        "fencegate_decisions_total{route=\"docs\",outcome=\"forwarded\"} 2",
    ] {
        assert!(metrics.contains(line), "missing {line} in\n{metrics}");
    }
}

/// Content-Length together with Transfer-Encoding (RFC 9112 §6.1): the
/// server parses the body by Transfer-Encoding alone, drops Content-Length
/// and closes the connection afterwards, so the upstream receives one
/// unambiguous message and nothing can be smuggled behind it.
#[tokio::test]
async fn conflicting_framing_cannot_smuggle() {
    let (_s, up, app) = setup().await;
    let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    s.write_all(
        b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\n\
          Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n\
          PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 0\r\nContent-Length: 0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut all = Vec::new();
    let read =
        tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut all)).await;
    assert!(
        read.is_ok(),
        "the connection must be closed after such a request"
    );
    let text = String::from_utf8_lossy(&all);
    assert!(
        text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.1 400"),
        "{text}"
    );
    assert_eq!(
        text.matches("HTTP/1.1").count(),
        1,
        "the request behind it was not served: {text}"
    );
    for r in up.requests() {
        assert!(
            !r.headers.contains_key("content-length") || r.body_len == 5,
            "{r:?}"
        );
        assert_eq!(r.body_len, 5);
    }
}

#[tokio::test]
async fn garbage_requests_get_4xx_not_a_crash() {
    let (_s, up, app) = setup().await;
    for raw in [
        &b"GARBAGE\r\n\r\n"[..],
        b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: \xff\xfe\r\nContent-Length: 0\r\n\r\n",
        b"PUT /docs/%ff HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n",
        b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: abc\r\n\r\n",
    ] {
        let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        s.write_all(raw).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).await.unwrap_or(0);
        let head = String::from_utf8_lossy(&buf[..n]);
        assert!(
            head.starts_with("HTTP/1.1 4"),
            "{:?} → {head}",
            String::from_utf8_lossy(raw)
        );
    }
    assert!(up.requests().is_empty());
    // Still serving.
    assert_eq!(app.put("/docs/a", Some("1"), "ok").await.status(), 200);
}

/// The route whose key has a header part: `/t/{id}?tenant=T` with
/// `X-Region` → `ten:T:{id}:REGION`.
fn tenants_route(upstream: &str) -> String {
    route(
        "tenants",
        "/t/{id}",
        upstream,
        "ten:{query.tenant}:{id}:{header.x-region}",
    )
}

/// Sends `raw` on a new connection and reads the answer's head and body
/// (by its Content-Length): its status and body.
async fn raw_answer(app: &TestApp, raw: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    s.write_all(raw.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if body.len() >= length {
                let status = head[9..12].parse().unwrap();
                return (status, body.to_string());
            }
        }
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk)).await;
        match read.expect("an answer within 5 s").unwrap_or(0) {
            0 => panic!("the connection ended before the answer: {text}"),
            n => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// `method` on `/t/7?tenant=a` with every header the gateway relies on
/// (token, `Idempotency-Key`, credentials, the key's `X-Region`) and the
/// `connection` lines given (each a whole `Connection: ...` line, or none).
fn tenant_request(method: &str, connection: &[&str]) -> String {
    let mut raw = format!(
        "{method} /t/7?tenant=a HTTP/1.1\r\nHost: x\r\nX-Region: eu\r\nX-Fence-Token: 5\r\n\
         Idempotency-Key: \"k-1\"\r\nAuthorization: Bearer upstream-key\r\n"
    );
    for line in connection {
        raw.push_str(line);
        raw.push_str("\r\n");
    }
    raw.push_str("Content-Length: 2\r\n\r\nok");
    raw
}

/// A `Connection` header that names a header the gateway relies on, in any
/// case, among other tokens or in a second `Connection` header, is 400
/// `protected-header` naming it, on a fenced write and on a pass-through
/// read, and nothing reaches the upstream. Before, the gateway stripped
/// the header and forwarded the rest: a write fenced under `ten:a:7:eu`
/// arrived without its `X-Region`, and `Connection: keep-alive,
/// X-Fence-Token` took the token away.
#[tokio::test]
async fn connection_cannot_strip_a_header_the_gateway_relies_on() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let routes = format!("{}{}", tenants_route(&up.url()), docs_route(&up.url()));
    let app = TestApp::spawn(&store.url, &routes).await;
    for method in ["PUT", "GET"] {
        for (connection, named) in [
            (
                &["Connection: keep-alive, X-Fence-Token"][..],
                "x-fence-token",
            ),
            (&["Connection: x-fence-token"], "x-fence-token"),
            (&["Connection: Idempotency-Key"], "idempotency-key"),
            (&["Connection: close, IDEMPOTENCY-KEY"], "idempotency-key"),
            (&["Connection: Authorization"], "authorization"),
            (&["Connection: keep-alive,authorization ,"], "authorization"),
            (&["Connection: x-region"], "x-region"),
            (&["Connection: X-REGION, keep-alive"], "x-region"),
            (
                &["Connection: keep-alive", "Connection: X-Region"],
                "x-region",
            ),
            (
                &[
                    "Connection: keep-alive",
                    "Connection: x-private, X-Fence-Token",
                ],
                "x-fence-token",
            ),
        ] {
            let (status, body) = raw_answer(&app, &tenant_request(method, connection)).await;
            assert_eq!(status, 400, "{method} {connection:?}: {body}");
            let body: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(
                body["type"], "urn:fencegate:problem:protected-header",
                "{method} {connection:?}"
            );
            assert!(
                body["detail"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("'{named}'")),
                "{method} {connection:?}: {body}"
            );
            assert!(
                up.requests().is_empty(),
                "{method} {connection:?} was forwarded: {:?}",
                up.requests()
            );
        }
    }
    // On another route, `X-Region` is no key part: a Connection naming it
    // strips it as any hop-by-hop header; the rest stays protected.
    let docs = |connection: &str, token: &str| {
        format!(
            "PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Region: eu\r\nX-Fence-Token: {token}\r\n\
             Connection: {connection}\r\nContent-Length: 2\r\n\r\nok"
        )
    };
    let (status, body) = raw_answer(&app, &docs("keep-alive, X-Fence-Token", "1")).await;
    assert_eq!(status, 400, "{body}");
    assert!(up.requests().is_empty());
    let (status, body) = raw_answer(&app, &docs("keep-alive, X-Region", "1")).await;
    assert_eq!(status, 200, "{body}");
    let reqs = up.requests();
    assert_eq!(reqs.len(), 1);
    assert!(!reqs[0].headers.contains_key("x-region"), "{reqs:?}");
    assert_eq!(reqs[0].header("x-fence-token"), Some("1"));
    // The same write, its Connection naming nothing it relies on: fenced
    // under its region, forwarded with it.
    let plain = tenant_request("PUT", &["Connection: keep-alive, X-Private"]);
    let (status, body) = raw_answer(&app, &plain).await;
    assert_eq!(status, 200, "{body}");
    let reqs = up.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[1].header("x-region"), Some("eu"));
    assert_eq!(reqs[1].header("x-fence-token"), Some("5"));
    let fence = app.admin_get("/fences/ten:a:7:eu").await;
    assert_eq!(fence.status(), 200);
}

/// Two `Authorization` headers on a proxied request, fenced or not: 400
/// `ambiguous-credentials`, nothing forwarded (before, both went to the
/// upstream, which judged the request by whichever it reads).
#[tokio::test]
async fn two_authorization_headers_on_a_proxied_request_are_refused() {
    let (_s, up, app) = setup().await;
    for method in ["PUT", "GET"] {
        let raw = format!(
            "{method} /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\n\
             Authorization: Bearer admin-key\r\nAuthorization: Bearer billing-key\r\n\
             Content-Length: 2\r\n\r\nok"
        );
        let (status, body) = raw_answer(&app, &raw).await;
        assert_eq!(status, 400, "{method}: {body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            body["type"], "urn:fencegate:problem:ambiguous-credentials",
            "{method}"
        );
        assert!(up.requests().is_empty(), "{method} was forwarded");
    }
    // One is forwarded as sent.
    let one = fenced_put(&app.http, app.url("/docs/a"), "1", "ok")
        .bearer_auth("admin-key")
        .send()
        .await
        .unwrap();
    assert_eq!(one.status(), 200);
    assert_eq!(
        up.requests()[0].header_all("authorization"),
        ["Bearer admin-key"]
    );
}

/// Issue 49's D4: CGI, WSGI and Rack read `X_Region` and `X-Region` as one
/// variable, so a write fenced under the `X-Region` the gateway read could
/// be applied under the `X_Region` the application read (Puma's
/// CVE-2024-45614). A fenced write with a `_` in any header name is 400
/// `ambiguous-header` (naming the key header it shadows, when it does),
/// nothing forwarded; a pass-through request's are dropped, the rest kept.
#[tokio::test]
async fn header_names_with_underscores_are_refused_on_writes_and_dropped_from_reads() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let routes = format!("{}{}", tenants_route(&up.url()), docs_route(&up.url()));
    let app = TestApp::spawn(&store.url, &routes).await;
    let put = |path: &str, extra: &str| {
        format!(
            "PUT {path} HTTP/1.1\r\nHost: x\r\nX-Region: eu\r\nX-Fence-Token: 5\r\n\
             Idempotency-Key: \"k-1\"\r\n{extra}Content-Length: 2\r\n\r\nok"
        )
    };
    for (path, extra, shadows) in [
        ("/t/7?tenant=a", "X_Region: us\r\n", Some("x-region")),
        ("/t/7?tenant=a", "x_REGION: us\r\n", Some("x-region")),
        (
            "/t/7?tenant=a",
            "X_Fence_Token: 1\r\n",
            Some("x-fence-token"),
        ),
        (
            "/t/7?tenant=a",
            "Idempotency_Key: \"k-2\"\r\n",
            Some("idempotency-key"),
        ),
        ("/t/7?tenant=a", "X_Custom: 1\r\n", None),
        // On the docs route, X-Region is no key part.
        ("/docs/a", "X_Region: us\r\n", None),
    ] {
        let (status, body) = raw_answer(&app, &put(path, extra)).await;
        assert_eq!(status, 400, "{extra:?}: {body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            body["type"], "urn:fencegate:problem:ambiguous-header",
            "{extra:?}"
        );
        let detail = body["detail"].as_str().unwrap();
        match shadows {
            Some(name) => assert!(detail.contains(&format!("'{name}'")), "{extra:?}: {detail}"),
            None => assert!(!detail.contains("which the gateway checked"), "{detail}"),
        }
        assert!(up.requests().is_empty(), "{extra:?} was forwarded");
    }
    // A read: forwarded without them, everything else as sent.
    let get = "GET /t/7?tenant=a HTTP/1.1\r\nHost: x\r\nX-Region: eu\r\nX_Region: us\r\n\
               x_other: 1\r\nX-Kept: 1\r\n\r\n";
    let (status, body) = raw_answer(&app, get).await;
    assert_eq!(status, 404, "the upstream's: nothing there yet: {body}");
    let reqs = up.requests();
    assert_eq!(reqs.len(), 1);
    let names: Vec<&str> = reqs[0].headers.keys().map(|n| n.as_str()).collect();
    assert!(names.iter().all(|n| !n.contains('_')), "{names:?}");
    assert_eq!(reqs[0].header("x-region"), Some("eu"));
    assert_eq!(reqs[0].header("x-kept"), Some("1"));
    // And the write without one goes through.
    let (status, body) = raw_answer(&app, &put("/t/7?tenant=a", "")).await;
    assert_eq!(status, 200, "{body}");
}

/// `X-Forwarded-Host` is the gateway's: the client's validated `Host`, or
/// none (an HTTP/1.0 request without `Host`); a client's own never passes
/// (`X-Forwarded-Host: a b@c` used to reach the upstream as sent).
#[tokio::test]
async fn x_forwarded_host_is_the_validated_host_or_nothing() {
    let (_s, up, app) = setup().await;
    let (status, _) = raw_answer(
        &app,
        "GET /docs/a HTTP/1.1\r\nHost: client.example:8080\r\nX-Forwarded-Host: a b@c\r\n\r\n",
    )
    .await;
    assert_eq!(status, 404, "the upstream's");
    let (status, _) = raw_answer(
        &app,
        "GET /docs/b HTTP/1.0\r\nX-Forwarded-Host: a b@c\r\nX-Forwarded-Host: evil\r\n\r\n",
    )
    .await;
    assert_eq!(status, 404, "the upstream's");
    let reqs = up.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(
        reqs[0].header_all("x-forwarded-host"),
        ["client.example:8080"]
    );
    assert!(
        reqs[1].header_all("x-forwarded-host").is_empty(),
        "{reqs:?}"
    );
}
