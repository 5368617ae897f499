//! The traffic listener's HTTP/1.1, byte by byte: refused heads, keep-alive
//! and its end, pipelining, `Expect: 100-continue`, HTTP/1.0, bodies that
//! arrive in pieces, bodies a refusal leaves unread, HEAD. Every refusal is
//! checked at the upstream too: nothing reaches it.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::server_limits::app_with;
use crate::support::app::{config_sections, docs_route, problem, route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::raw_upstream::RawUpstream;
use crate::support::wait_for;

/// One answer as read off the wire.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A raw client connection that reads answers one at a time.
struct Raw {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    async fn connect(app: &TestApp) -> Raw {
        Raw {
            s: TcpStream::connect(app.addr).await.unwrap(),
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
    }

    /// Reads more; false at the close.
    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), self.s.read(&mut chunk))
            .await
            .expect("an answer or the close within 10 s")
            .unwrap_or(0);
        self.buf.extend_from_slice(&chunk[..n]);
        n > 0
    }

    /// The next answer; `head_only` for the answer to a HEAD.
    async fn answer_to(&mut self, head_only: bool) -> Answer {
        loop {
            let mut fields = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut fields);
            if let httparse::Status::Complete(len) = resp.parse(&self.buf).unwrap() {
                let status = resp.code.unwrap();
                let headers: Vec<(String, String)> = resp
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_string(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                let answer = Answer {
                    status,
                    headers,
                    body: Vec::new(),
                };
                let mut answer = answer;
                self.buf.drain(..len);
                if head_only || status == 100 || status == 204 || status == 304 {
                    return answer;
                }
                if answer.header("transfer-encoding").is_some() {
                    while !self.buf.windows(5).any(|w| w == b"0\r\n\r\n") {
                        assert!(self.fill().await, "closed inside a chunked answer");
                    }
                    let end = self.buf.windows(5).position(|w| w == b"0\r\n\r\n").unwrap() + 5;
                    answer.body = self.buf.drain(..end).collect();
                    return answer;
                }
                let len: usize = answer
                    .header("content-length")
                    .expect("a length or chunks")
                    .parse()
                    .unwrap();
                while self.buf.len() < len {
                    assert!(self.fill().await, "closed inside an answer's body");
                }
                answer.body = self.buf.drain(..len).collect();
                return answer;
            }
            assert!(
                self.fill().await,
                "closed before a whole answer; had {:?}",
                String::from_utf8_lossy(&self.buf)
            );
        }
    }

    async fn answer(&mut self) -> Answer {
        self.answer_to(false).await
    }

    /// Whether the server closes the connection (within 10 s) without
    /// sending anything more.
    async fn closed(&mut self) -> bool {
        let had = self.buf.len();
        while self.fill().await {}
        self.buf.len() == had
    }
}

fn is_problem(a: &Answer) -> bool {
    a.header("content-type") == Some("application/problem+json")
        && serde_json::from_slice::<serde_json::Value>(&a.body)
            .is_ok_and(|v| v["status"] == a.status)
}

#[tokio::test]
async fn refused_heads_get_problems_and_nothing_is_forwarded() {
    let (_s, up, app) = app_with("").await;
    let many: String = (0..101).map(|i| format!("x-f{i}: 1\r\n")).collect();
    let long = format!("x-long: {}\r\n", "a".repeat(70 * 1024));
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (format!("GET /docs/a HTTP/1.1\r\nHost: x\r\n{many}\r\n").into_bytes(), 431),
        (format!("GET /docs/a HTTP/1.1\r\nHost: x\r\n{long}\r\n").into_bytes(), 431),
        (b"GET /docs/a HTTP/1.1\r\nBad Name: 1\r\n\r\n".to_vec(), 400),
        (b"GET /docs/a HTTP/3.0\r\nHost: x\r\n\r\n".to_vec(), 400),
        (
            b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: gzip\r\n\r\nxx"
                .to_vec(),
            501,
        ),
        (
            b"PUT /docs/a HTTP/1.0\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"
                .to_vec(),
            400,
        ),
        (
            b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx"
                .to_vec(),
            400,
        ),
        (
            b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: +2\r\n\r\nxx"
                .to_vec(),
            400,
        ),
        // A list in one field, even of equal lengths (RFC 9110 §8.6 lets a
        // recipient refuse it, as hyper does).
        (
            b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 2, 2\r\n\r\nxx"
                .to_vec(),
            400,
        ),
        // An empty list element: `chunked` is the last coding to some
        // readers, the empty one to others.
        (
            b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked,\r\n\r\n0\r\n\r\n"
                .to_vec(),
            400,
        ),
    ];
    for (raw, status) in cases {
        let mut c = Raw::connect(&app).await;
        // A head too large may be refused before it is all sent.
        let _ = c.s.write_all(&raw).await;
        let a = c.answer().await;
        let shown = String::from_utf8_lossy(&raw[..raw.len().min(60)]).into_owned();
        assert_eq!(a.status, status, "{shown}");
        assert!(is_problem(&a), "{shown}: {a:?}");
        assert_eq!(a.header("connection"), Some("close"), "{shown}");
        assert!(c.closed().await, "{shown}: the connection ends");
    }
    assert!(up.requests().is_empty(), "{:?}", up.requests());
}

#[tokio::test]
async fn a_slow_head_gets_408_and_an_idle_connection_ends_quietly() {
    let (_s, up, app) = app_with("header_read_timeout_ms = 300").await;
    let mut c = Raw::connect(&app).await;
    c.send(b"GET /docs/a HTTP/1.1\r\nHost: x\r\n").await;
    let a = c.answer().await;
    assert_eq!(a.status, 408);
    assert!(is_problem(&a), "{a:?}");
    assert!(c.closed().await);
    // Idle between requests: the same timeout, and no answer at all.
    let mut c = Raw::connect(&app).await;
    c.send(b"GET /docs/a HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(c.answer().await.status, 404);
    assert!(c.closed().await, "an idle keep-alive connection ends");
    assert_eq!(up.requests().len(), 1);
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let (_s, up, app) = app_with("").await;
    let mut c = Raw::connect(&app).await;
    // The first is the slowest; the answers still come in the order asked.
    c.send(
        b"GET /docs/a HTTP/1.1\r\nHost: x\r\nx-test-delay-ms: 300\r\nx-test-status: 201\r\n\r\n\
          PUT /docs/b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\n\r\nhello\
          GET /docs/c HTTP/1.1\r\nHost: x\r\nx-test-status: 203\r\n\r\n",
    )
    .await;
    let statuses = [
        c.answer().await.status,
        c.answer().await.status,
        c.answer().await.status,
    ];
    assert_eq!(statuses, [201, 200, 203]);
    let paths: Vec<String> = up.requests().iter().map(|r| r.path().to_string()).collect();
    assert_eq!(paths, ["/docs/a", "/docs/b", "/docs/c"]);
    assert_eq!(up.bodies_on("/docs/b"), ["hello"]);
}

#[tokio::test]
async fn expect_continue_is_answered_only_when_the_body_is_wanted() {
    let (_s, up, app) = app_with("").await;
    let mut c = Raw::connect(&app).await;
    c.send(b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 5\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        .await;
    let go = c.answer().await;
    assert_eq!(go.status, 100, "{go:?}");
    c.send(b"hello").await;
    assert_eq!(c.answer().await.status, 200);
    assert_eq!(up.bodies_on("/docs/a"), ["hello"]);
    // A stale write is refused before its body is wanted: no 100, and the
    // connection ends (the client may or may not send the body now).
    c.send(b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 4\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        .await;
    let refused = c.answer().await;
    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.header("connection"), Some("close"));
    assert!(c.closed().await);
    assert_eq!(up.applied().len(), 1);
}

#[tokio::test]
async fn http10_clients_are_closed_unless_they_ask_to_keep_alive() {
    let (_s, up, app) = app_with("").await;
    let mut c = Raw::connect(&app).await;
    c.send(b"GET /docs/a HTTP/1.0\r\nx-test-status: 202\r\n\r\n")
        .await;
    let a = c.answer().await;
    assert_eq!(a.status, 202);
    assert!(c.closed().await);
    let mut c = Raw::connect(&app).await;
    c.send(b"GET /docs/a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        .await;
    let a = c.answer().await;
    assert_eq!(a.header("connection"), Some("keep-alive"), "{a:?}");
    c.send(b"GET /docs/b HTTP/1.0\r\n\r\n").await;
    assert_eq!(c.answer().await.status, 404);
    assert!(c.closed().await);
    assert_eq!(up.requests().len(), 3);
}

#[tokio::test]
async fn bodies_that_arrive_in_pieces_reach_the_upstream_whole() {
    let (_s, up, app) = app_with("").await;
    let mut c = Raw::connect(&app).await;
    c.send(b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd")
        .await;
    for piece in [
        &b"\r\n"[..],
        b"3;ext=1\r\nefg\r\n",
        b"0\r\n",
        b"x-trailer: 1\r\n\r\n",
    ] {
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.send(piece).await;
    }
    assert_eq!(c.answer().await.status, 200);
    c.send(
        b"PUT /docs/b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 10\r\n\r\n01234",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    c.send(b"56789").await;
    assert_eq!(c.answer().await.status, 200);
    assert_eq!(up.bodies_on("/docs/a"), ["abcdefg"]);
    assert_eq!(up.bodies_on("/docs/b"), ["0123456789"]);
    // A malformed chunk breaks the body off: nothing is applied, and the
    // connection ends.
    c.send(b"PUT /docs/c HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab")
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    c.send(b"XX\r\n0\r\n\r\n").await;
    let a = c.answer().await;
    assert!(a.status >= 400, "{a:?}");
    assert!(c.closed().await);
    assert!(up.bodies_on("/docs/c").is_empty());
}

#[tokio::test]
async fn an_unread_body_is_skipped_when_small_and_ends_the_connection_when_large() {
    let (_s, up, app) = app_with("").await;
    let mut c = Raw::connect(&app).await;
    // No token: refused without reading the body, which is small and
    // already sent: it is read past and the connection goes on.
    let body = "b".repeat(3000);
    c.send(
        format!(
            "PUT /docs/a HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    let a = c.answer().await;
    assert_eq!(a.status, 428);
    assert_eq!(a.header("connection"), None, "{a:?}");
    c.send(b"GET /docs/a HTTP/1.1\r\nHost: x\r\nx-test-status: 203\r\n\r\n")
        .await;
    assert_eq!(c.answer().await.status, 203);
    // A large one, half sent: the answer says close, and the connection ends.
    c.send(b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n")
        .await;
    c.send(&[b'x'; 100_000]).await;
    let a = c.answer().await;
    assert_eq!(a.status, 428);
    assert_eq!(a.header("connection"), Some("close"));
    assert!(c.closed().await);
    assert_eq!(up.requests().len(), 1, "only the GET");
}

#[tokio::test]
async fn a_head_answer_keeps_its_length_and_has_no_body() {
    let (_s, _up, app) = app_with("").await;
    let mut c = Raw::connect(&app).await;
    assert_eq!(app.put("/docs/a", Some("1"), "hello").await.status(), 200);
    c.send(b"GET /docs/a HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let got = c.answer().await;
    assert_eq!(got.status, 200);
    c.send(b"HEAD /docs/a HTTP/1.1\r\nHost: x\r\n\r\nGET /docs/a HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let head = c.answer_to(true).await;
    assert_eq!(head.status, 200);
    assert_eq!(
        head.header("content-length"),
        Some(got.body.len().to_string().as_str()),
        "{head:?}"
    );
    // Had the HEAD's answer carried a body, this would not parse as the
    // next answer.
    let again = c.answer().await;
    assert_eq!((again.status, again.body), (200, got.body));
}

#[tokio::test]
async fn an_idle_connection_ends_when_the_gateway_stops() {
    let (_s, _up, app) = app_with("").await;
    let mut c = Raw::connect(&app).await;
    c.send(b"GET /docs/a HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(c.answer().await.status, 404);
    let stopped = tokio::spawn(app.stop());
    assert!(c.closed().await, "the drain ends an idle connection");
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .expect("the gateway stops without waiting out its grace period")
        .unwrap();
}

#[tokio::test]
async fn a_body_still_arriving_when_the_gateway_stops_is_finished_and_the_connection_closed() {
    let (_s, up, app) = app_with("").await;
    let mut c = Raw::connect(&app).await;
    c.send(
        b"PUT /docs/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 10\r\n\r\n01234",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stopped = tokio::spawn(app.stop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.send(b"56789").await;
    let a = c.answer().await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(
        a.header("connection"),
        Some("close"),
        "a draining server says so"
    );
    assert!(c.closed().await);
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .expect("the gateway stops once the write is done")
        .unwrap();
    assert_eq!(up.bodies_on("/docs/a"), ["0123456789"]);
}

/// A gateway whose docs route goes to a raw upstream that keeps every byte
/// of every connection.
async fn app_on_raw() -> (TestStore, RawUpstream, TestApp) {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = RawUpstream::start().await;
    let text = config_sections("", &store.url, "", &docs_route(&up.url()));
    let app = TestApp::from_text(&text).await;
    (store, up, app)
}

/// Sends `raw` on a new connection; the answer, which must be a problem
/// of `status` and type `kind` ending the connection.
async fn refused_with(app: &TestApp, raw: &[u8], status: u16, kind: &str) -> Answer {
    let mut c = Raw::connect(app).await;
    let _ = c.s.write_all(raw).await;
    let a = c.answer().await;
    let shown = String::from_utf8_lossy(&raw[..raw.len().min(120)]).into_owned();
    assert_eq!(a.status, status, "{shown:?}: {a:?}");
    assert!(is_problem(&a), "{shown:?}: {a:?}");
    let body: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(
        body["type"],
        format!("urn:fencegate:problem:{kind}"),
        "{shown:?}"
    );
    assert!(c.closed().await, "{shown:?}: the connection ends");
    a
}

/// Asserts that the upstream received not one byte, once the refusals'
/// own connections have had a moment to end.
async fn nothing_received(up: &RawUpstream) {
    tokio::time::sleep(Duration::from_millis(100)).await;
    let received = up.received_text();
    assert!(
        received.iter().all(String::is_empty),
        "the upstream received {received:?}"
    );
}

/// The fenced write head of issue 49's D1-D3, and the request they hide.
const CHUNKED_PUT: &str =
    "PUT /docs/x HTTP/1.1\r\nHost: a\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
const SMUGGLED: &str = "GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n";
const FIRST_CHUNK: &str = "5\r\nhello\r\n";

/// Issue 49's D1-D3 bodies, each hiding [`SMUGGLED`].
fn hiding_bodies() -> [(&'static str, String); 3] {
    let zs = "Z".repeat(40);
    [
        // A bare LF after `;`: nginx reads a chunk of 2 (`xx`) and one of
        // 0x50 that holds the GET; a lenient decoder read `50` as the data.
        (
            "D1",
            format!("2;\nxx\r\n50\r\n0\r\n\r\n{SMUGGLED}{zs}\r\n0\r\n\r\n"),
        ),
        // A size line with no digits taken as the last chunk.
        ("D2", format!("{FIRST_CHUNK}\r\n\r\n{SMUGGLED}")),
        // A bare LF taken as a trailer line, swallowing the GET.
        ("D3", format!("{FIRST_CHUNK}0\r\n\n{SMUGGLED}")),
    ]
}

/// Issue 49's D1-D3: chunked bodies that a lenient decoder (httparse's
/// `parse_chunk_size`, trailers skipped to the next CRLF) framed another
/// way than a front end forwarding them verbatim, so that the upstream got
/// a short PUT and then `GET /smuggled` as a request of its own. Each is
/// refused with 400 before anything is forwarded, and the connection
/// ends: the upstream receives not one byte.
#[tokio::test]
async fn chunked_bodies_a_front_end_frames_otherwise_are_refused_and_smuggle_nothing() {
    let (_s, up, app) = app_on_raw().await;
    for (defect, body) in hiding_bodies() {
        let raw = format!("{CHUNKED_PUT}{body}");
        let a = refused_with(&app, raw.as_bytes(), 400, "bad-request").await;
        let detail =
            serde_json::from_slice::<serde_json::Value>(&a.body).unwrap()["detail"].to_string();
        assert!(detail.contains("chunked body"), "{defect}: {detail}");
    }
    nothing_received(&up).await;
    // A sound chunked write still goes through, decoded.
    let mut c = Raw::connect(&app).await;
    c.send(format!("{CHUNKED_PUT}5;a=b\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n").as_bytes())
        .await;
    assert_eq!(c.answer().await.status, 200);
    assert_eq!(up.write("/docs/x", 1).body, b"hello");
}

/// The same bodies when the malformed part comes after the write was
/// forwarded (the head and a first chunk ahead of it): the body breaks
/// off at the upstream (the write is aborted, never applied), the client
/// gets 400 and the connection ends; the hidden GET never reaches the
/// upstream, as a request or as bytes. (One key each: a write broken off
/// keeps its key closed to other tokens until its deadline.)
#[tokio::test]
async fn a_chunked_body_that_turns_malformed_midway_is_cut_off_at_the_upstream() {
    let (_s, up, app) = app_on_raw().await;
    for (defect, body) in hiding_bodies() {
        // After a first chunk, which goes on to the upstream at once.
        let rest = body.strip_prefix(FIRST_CHUNK).unwrap_or(&body);
        let path = format!("/docs/{defect}");
        let path = path.as_str();
        let mut c = Raw::connect(&app).await;
        let head = CHUNKED_PUT.replace("/docs/x", path);
        c.send(format!("{head}{FIRST_CHUNK}").as_bytes()).await;
        wait_for("the write to reach the upstream", || {
            up.writes_with(path, 1)
                .first()
                .is_some_and(|w| w.body_bytes == 5)
        })
        .await;
        c.send(rest.as_bytes()).await;
        let a = c.answer().await;
        assert_eq!(a.status, 400, "{path}: {a:?}");
        assert!(is_problem(&a), "{a:?}");
        assert!(c.closed().await);
        wait_for("the write to end at the upstream", || {
            !up.write(path, 1).in_flight()
        })
        .await;
        let w = up.write(path, 1);
        assert!(w.aborted && w.applied_at.is_none(), "{w:?}");
    }
    let received = up.received_text().concat();
    assert!(!received.contains("smuggled"), "{received}");
    assert!(!received.contains("GET "), "{received}");
}

/// Issue 49's D6: a request coding other than one `chunked` (RFC 9112
/// §6.1) is 501 `unsupported-coding`, and nothing is forwarded. Before,
/// `gzip, chunked` was decoded as chunked and the coded bytes forwarded
/// framed by a length, as if they were the body.
#[tokio::test]
async fn a_transfer_coding_other_than_chunked_is_501_and_nothing_is_forwarded() {
    let (_s, up, app) = app_on_raw().await;
    for te in [
        "gzip, chunked",
        "chunked, chunked",
        "x-unknown, chunked",
        "gzip\r\nTransfer-Encoding: chunked",
        "chunked;ext=1",
        "gzip",
        "identity",
    ] {
        let raw = format!(
            "PUT /docs/x HTTP/1.1\r\nHost: a\r\nX-Fence-Token: 1\r\nTransfer-Encoding: {te}\r\n\r\n\
             5\r\nhello\r\n0\r\n\r\n"
        );
        refused_with(&app, raw.as_bytes(), 501, "unsupported-coding").await;
    }
    // A pass-through GET too.
    let raw =
        "GET /docs/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n";
    refused_with(&app, raw.as_bytes(), 501, "unsupported-coding").await;
    nothing_received(&up).await;
}

/// Issue 49's D5: a missing, repeated or invalid `Host` (RFC 9112 §3.2,
/// RFC 3986's authority without userinfo) is 400, and nothing is
/// forwarded. An HTTP/1.0 request may lack one.
#[tokio::test]
async fn a_missing_repeated_or_invalid_host_is_400_and_nothing_is_forwarded() {
    let (_s, up, app) = app_on_raw().await;
    let put = |hosts: &str| {
        format!("PUT /docs/x HTTP/1.1\r\n{hosts}X-Fence-Token: 1\r\nContent-Length: 2\r\n\r\nok")
    };
    for hosts in [
        String::new(),
        "Host: a\r\nHost: a\r\n".to_string(),
        "Host: a\r\nHost: b\r\n".to_string(),
        "Host: a b@c\r\n".to_string(),
        "Host: user@a\r\n".to_string(),
        "Host: a/b\r\n".to_string(),
        "Host: a:b\r\n".to_string(),
        "Host: [::1\r\n".to_string(),
        "Host: \r\n".to_string(),
    ] {
        let a = refused_with(&app, put(&hosts).as_bytes(), 400, "bad-request").await;
        let detail = String::from_utf8_lossy(&a.body).into_owned();
        assert!(detail.contains("Host"), "{hosts:?}: {detail}");
    }
    let get = "GET /docs/x HTTP/1.1\r\nX-Forwarded-Host: a b@c\r\n\r\n";
    refused_with(&app, get.as_bytes(), 400, "bad-request").await;
    nothing_received(&up).await;
    // Valid ones pass.
    for host in ["a", "a.example:8080", "127.0.0.1:1", "[::1]:443"] {
        let mut c = Raw::connect(&app).await;
        c.send(put(&format!("Host: {host}\r\n")).as_bytes()).await;
        assert_eq!(c.answer().await.status, 200, "{host}");
    }
}

/// A bare LF ends a head's line for httparse (RFC 9112 §2.2 lets a
/// recipient take it so) but not for every front end, which then sees one
/// field where the gateway saw two (`X: a\nTransfer-Encoding: chunked`):
/// 400, nothing forwarded.
#[tokio::test]
async fn a_bare_lf_in_a_request_head_is_400_and_nothing_is_forwarded() {
    let (_s, up, app) = app_on_raw().await;
    for raw in [
        &b"PUT /docs/x HTTP/1.1\r\nHost: a\r\nX-Fence-Token: 1\r\nX: a\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"[..],
        b"GET /docs/x HTTP/1.1\nHost: a\n\n",
        b"GET /docs/x HTTP/1.1\r\nHost: a\r\n\n",
        b"\nGET /docs/x HTTP/1.1\r\nHost: a\r\n\r\n",
    ] {
        refused_with(&app, raw, 400, "bad-request").await;
    }
    nothing_received(&up).await;
}

/// Issue 49's D7: every 405 carries `Allow` (RFC 9110 §15.5.6): a
/// proxied route's (its safe methods and its fenced ones), the lock API's
/// and the admin API's.
#[tokio::test]
async fn every_405_carries_allow() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = RawUpstream::start().await;
    let routes = route("docs", "/docs/{id}", &up.url(), "doc:{id}")
        .replace("key = ", "methods = [\"PUT\", \"DELETE\"]\nkey = ");
    let text = config_sections("", &store.url, "", &format!("{routes}[locks]\n"));
    let app = TestApp::from_text(&text).await;
    for method in ["POST", "PATCH", "TRACE"] {
        let resp = app
            .http
            .request(method.parse().unwrap(), app.url("/docs/a"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 405, "{method}");
        assert_eq!(
            resp.headers()["allow"],
            "GET, HEAD, OPTIONS, PUT, DELETE",
            "{method}"
        );
        problem(resp, 405).await;
    }
    let resp = app
        .http
        .delete(app.url("/_fencegate/locks/a"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    let allow = resp.headers()["allow"].to_str().unwrap().to_string();
    assert!(allow.contains("POST") && allow.contains("GET"), "{allow}");
    let resp = app
        .http
        .post(app.admin_url("/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    assert!(resp.headers()["allow"].to_str().unwrap().contains("GET"));
    nothing_received(&up).await;
}

/// What the gateway does not speak, on purpose (docs/internals/http1.md,
/// "Refused on purpose"): HTTP/0.9 and versions but 1.0 and 1.1 are 400
/// (HTTP/2 comes by its preface or ALPN: tests/it/http2.rs); CONNECT and
/// `OPTIONS *` name no route (404): nothing is forwarded and no tunnel is
/// opened; an `Upgrade` is hop-by-hop and dropped, so the upstream sees a
/// plain request (and a `101` from it would be 502).
#[tokio::test]
async fn http09_connect_and_upgrades_are_not_served() {
    let (_s, up, app) = app_on_raw().await;
    for (raw, status, kind) in [
        (&b"GET /docs/x\r\n\r\n"[..], 400, "bad-request"),
        (
            b"GET /docs/x HTTP/2.0\r\nHost: a\r\n\r\n",
            400,
            "bad-request",
        ),
    ] {
        refused_with(&app, raw, status, kind).await;
    }
    for raw in [
        &b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n"[..],
        b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
    ] {
        let mut c = Raw::connect(&app).await;
        c.send(raw).await;
        let a = c.answer().await;
        assert_eq!(a.status, 404, "{:?}: {a:?}", String::from_utf8_lossy(raw));
        assert!(is_problem(&a), "{a:?}");
    }
    nothing_received(&up).await;
    let mut c = Raw::connect(&app).await;
    c.send(b"GET /docs/x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        .await;
    assert_eq!(c.answer().await.status, 200);
    let received = up.received_text().concat();
    assert!(
        received.starts_with("GET /docs/x HTTP/1.1\r\n"),
        "{received}"
    );
    assert!(
        !received.to_ascii_lowercase().contains("upgrade"),
        "{received}"
    );
}
