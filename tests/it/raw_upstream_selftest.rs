//! Self-tests of the raw-socket upstream, driven by raw TCP clients (no
//! gateway): each behaviour does what its header says, and each kind of
//! violation is detected, so the exchange-lifetime and handover tests can
//! rely on them.

use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::support::raw_upstream::{chunk, read_response, Behaviour, RawResponse, RawUpstream};

/// A request head; `framing` is `Some(n)` for `content-length: n`, `None`
/// for a chunked body.
fn head(method: &str, target: &str, headers: &[(&str, &str)], framing: Option<usize>) -> String {
    let mut h = format!("{method} {target} HTTP/1.1\r\nhost: upstream\r\n");
    for (n, v) in headers {
        h.push_str(&format!("{n}: {v}\r\n"));
    }
    match framing {
        Some(n) => h.push_str(&format!("content-length: {n}\r\n")),
        None => h.push_str("transfer-encoding: chunked\r\n"),
    }
    h.push_str("\r\n");
    h
}

/// A write with a Content-Length body.
fn put(path: &str, token: i64, headers: &[(&str, &str)], body: &str) -> String {
    let t = token.to_string();
    let mut all = vec![("x-fence-token", t.as_str())];
    all.extend_from_slice(headers);
    format!("{}{body}", head("PUT", path, &all, Some(body.len())))
}

struct Client {
    stream: TcpStream,
    buf: BytesMut,
}

impl Client {
    async fn connect(up: &RawUpstream) -> Client {
        Client {
            stream: TcpStream::connect(up.addr()).await.expect("connect"),
            buf: BytesMut::new(),
        }
    }

    async fn send(&mut self, raw: &[u8]) {
        self.stream.write_all(raw).await.expect("send");
    }

    async fn response(&mut self) -> RawResponse {
        read_response(&mut self.stream, &mut self.buf)
            .await
            .expect("an answer's head")
    }

    async fn exchange(&mut self, raw: &str) -> RawResponse {
        self.send(raw.as_bytes()).await;
        self.response().await
    }
}

/// Waits until `cond` holds, or panics after 10 s.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const SETTLE: Duration = Duration::from_secs(10);

/// Token 1's write on `/p`, with the behaviour `headers` ask for.
fn one(headers: &[(&str, &str)]) -> String {
    put("/p", 1, headers, "one")
}

/// What the detectors report when token 2 reached `/p` while the upstream
/// was still working on token 1.
const OVERTAKEN: [&str; 2] = [
    "two tokens in flight on /p: 1 and 2",
    "applied 1 after 2 on /p",
];

/// A raw upstream, and a client connected to it.
async fn started() -> (RawUpstream, Client) {
    let up = RawUpstream::start().await;
    let c = Client::connect(&up).await;
    (up, c)
}

#[tokio::test]
async fn normal_writes_are_applied_on_a_kept_alive_connection() {
    let (up, mut c) = started().await;

    let resp = c
        .exchange(&put(
            "/d/1?x=y",
            5,
            &[("x-test-work-ms", "200"), ("x-test-id", "first")],
            "hello",
        ))
        .await;
    assert_eq!(resp.status, 200);
    assert!(resp.complete);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    let json: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(json["token"], 5);

    // The same connection, a chunked body.
    let mut raw = head(
        "POST",
        "/d/1",
        &[("x-fence-token", "5"), ("x-test-behaviour", "normal")],
        None,
    )
    .into_bytes();
    raw.extend(chunk(b"ab"));
    raw.extend(chunk(b"cde"));
    raw.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n");
    c.send(&raw).await;
    let resp = c.response().await;
    assert_eq!(resp.status, 200);
    assert!(resp.complete);

    // And a read.
    let resp = c.exchange(&head("GET", "/d/1", &[], Some(0))).await;
    assert_eq!((resp.status, resp.complete), (200, true));
    assert!(resp.body.is_empty());

    let writes = up.writes();
    assert_eq!(writes.len(), 2, "{writes:#?}");
    let (a, b) = (&writes[0], &writes[1]);
    assert_eq!((a.method.as_str(), b.method.as_str()), ("PUT", "POST"));
    assert_eq!((a.path.as_str(), b.path.as_str()), ("/d/1", "/d/1"));
    assert_eq!((a.token, b.token), (Some(5), Some(5)));
    assert_eq!(a.test_id.as_deref(), Some("first"));
    assert_eq!(b.test_id, None);
    assert_eq!(
        (a.behaviour, b.behaviour),
        (Behaviour::Normal, Behaviour::Normal)
    );
    assert_eq!((&a.body[..], a.body_bytes), (&b"hello"[..], 5));
    assert_eq!((&b.body[..], b.body_bytes), (&b"abcde"[..], 5));
    for w in &writes {
        assert!(w.body_complete && !w.aborted && !w.in_flight(), "{w:#?}");
        let applied = w.applied_at.expect("applied");
        assert!(w.last_body_byte.unwrap() >= w.started);
        assert!(applied >= w.last_body_byte.unwrap());
        assert!(w.ended.unwrap() >= applied);
    }
    let work = a.applied_at.unwrap() - a.last_body_byte.unwrap();
    assert!(work >= Duration::from_millis(200), "worked {work:?}");
    assert_eq!(up.applied_tokens("/d/1"), vec![5, 5]);
    assert!(up.applied_tokens("/d/2").is_empty());
    assert_eq!(up.arrived("/d/1", 5), 2);
    assert_eq!(up.arrived("/d/1", 6), 0);
    assert_eq!(up.in_flight(), 0);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

#[tokio::test]
async fn reads_are_answered_empty_and_not_recorded() {
    let (up, mut c) = started().await;
    for method in ["GET", "HEAD", "OPTIONS"] {
        let resp = c.exchange(&head(method, "/d/1", &[], Some(0))).await;
        assert_eq!((resp.status, resp.complete), (200, true), "{method}");
        assert!(resp.body.is_empty());
    }
    assert!(up.writes().is_empty());
}

#[tokio::test]
async fn an_unknown_behaviour_is_refused() {
    let (up, mut c) = started().await;
    let resp = c
        .exchange(&put("/d/1", 1, &[("x-test-behaviour", "sideways")], "x"))
        .await;
    assert_eq!(resp.status, 400);
    assert!(up.writes().is_empty());
}

#[tokio::test]
async fn different_tokens_in_flight_together_are_a_violation() {
    let up = RawUpstream::start().await;
    let mut slow = Client::connect(&up).await;
    slow.send(put("/p", 5, &[("x-test-work-ms", "300")], "five").as_bytes())
        .await;
    eventually("token 5 in flight", || up.in_flight() == 1).await;
    // Another path is independent.
    let mut other = Client::connect(&up).await;
    assert_eq!(other.exchange(&put("/q", 7, &[], "q")).await.status, 200);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
    // The same path with another token while 5 is still in flight.
    let resp = other.exchange(&put("/p", 7, &[], "seven")).await;
    assert_eq!(resp.status, 200);
    assert_eq!(up.violations(), vec!["two tokens in flight on /p: 5 and 7"]);
    assert_eq!(slow.response().await.status, 200);
    // Then 5 is applied after 7: the order went down too.
    assert_eq!(
        up.violations(),
        vec![
            "two tokens in flight on /p: 5 and 7",
            "applied 5 after 7 on /p"
        ]
    );
    assert_eq!(up.applied_tokens("/p"), vec![7, 5]);
}

#[tokio::test]
async fn equal_tokens_in_flight_together_are_fine() {
    let up = RawUpstream::start().await;
    let mut a = Client::connect(&up).await;
    let mut b = Client::connect(&up).await;
    a.send(put("/p", 5, &[("x-test-work-ms", "300")], "a").as_bytes())
        .await;
    b.send(put("/p", 5, &[("x-test-work-ms", "300")], "b").as_bytes())
        .await;
    eventually("both in flight", || up.in_flight() == 2).await;
    assert_eq!(a.response().await.status, 200);
    assert_eq!(b.response().await.status, 200);
    assert_eq!(up.in_flight(), 0);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
    assert_eq!(up.applied_tokens("/p"), vec![5, 5]);
}

#[tokio::test]
async fn apply_order_going_down_is_a_violation() {
    let (up, mut c) = started().await;
    for t in [3, 7, 7] {
        assert_eq!(c.exchange(&put("/p", t, &[], "x")).await.status, 200);
    }
    assert!(up.violations().is_empty(), "{:?}", up.violations());
    assert_eq!(c.exchange(&put("/p", 5, &[], "x")).await.status, 200);
    assert_eq!(up.violations(), vec!["applied 5 after 7 on /p"]);
    assert_eq!(up.applied_tokens("/p"), vec![3, 7, 7, 5]);
}

#[tokio::test]
async fn a_cut_body_is_aborted_and_never_applied() {
    let up = RawUpstream::start().await;
    // Content-Length, for each behaviour.
    for (i, b) in Behaviour::ALL.into_iter().enumerate() {
        let mut c = Client::connect(&up).await;
        let h = head(
            "PUT",
            "/p",
            &[("x-fence-token", "1"), ("x-test-behaviour", b.as_str())],
            Some(100),
        );
        c.send(format!("{h}0123456789").as_bytes()).await;
        eventually("the body's start arrives", || {
            up.writes().get(i).is_some_and(|w| w.body_bytes == 10)
        })
        .await;
        drop(c);
    }
    // A chunked body cut inside a chunk.
    let mut c = Client::connect(&up).await;
    let mut raw = head("PUT", "/p", &[("x-fence-token", "1")], None).into_bytes();
    raw.extend(chunk(b"abc"));
    raw.extend_from_slice(b"10\r\nonly-part");
    c.send(&raw).await;
    drop(c);
    up.settle(SETTLE).await;

    let writes = up.writes();
    assert_eq!(writes.len(), 5);
    for w in &writes {
        assert!(w.aborted, "{w:#?}");
        assert!(!w.body_complete && w.applied_at.is_none() && w.ended.is_some());
    }
    assert_eq!(writes[4].body, b"abconly-part");
    assert!(up.applied_tokens("/p").is_empty());
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

#[tokio::test]
async fn break_after_head_resets_and_keeps_working() {
    let (up, mut c) = started().await;
    let resp = c
        .exchange(&one(&[
            ("x-test-behaviour", "break-after-head"),
            ("x-test-work-ms", "400"),
        ]))
        .await;
    let broken_at = Instant::now();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("transfer-encoding"), Some("chunked"));
    assert!(!resp.complete, "the answer must break off: {resp:?}");
    assert_eq!(resp.body, b"partial answer\n");
    // A reset, not a clean close.
    let mut probe = [0u8; 1];
    let again = tokio::io::AsyncReadExt::read(&mut c.stream, &mut probe).await;
    assert!(
        matches!(&again, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
            || matches!(again, Ok(0)),
        "{again:?}"
    );

    // The upstream is still working on token 1: a token 2 now is a breach.
    assert_eq!(up.in_flight(), 1);
    let w = up.write("/p", 1);
    assert!(w.applied_at.is_none() && w.body_complete);
    let mut other = Client::connect(&up).await;
    assert_eq!(other.exchange(&put("/p", 2, &[], "two")).await.status, 200);
    up.settle(SETTLE).await;

    let w = up.write("/p", 1);
    let applied = w.applied_at.expect("applied after the reset");
    assert!(applied >= broken_at, "applied only after the reset");
    assert!(applied - w.started >= Duration::from_millis(400));
    assert!(w.ended.unwrap() >= applied);
    assert_eq!(up.violations(), OVERTAKEN);
}

#[tokio::test]
async fn slow_stream_streams_then_applies() {
    let (up, mut c) = started().await;
    let resp = c
        .exchange(&one(&[
            ("x-test-behaviour", "slow-stream"),
            ("x-test-chunks", "5"),
            ("x-test-chunk-ms", "60"),
        ]))
        .await;
    let done = Instant::now();
    assert_eq!(resp.status, 200);
    assert!(resp.complete);
    let text = String::from_utf8(resp.body).unwrap();
    assert_eq!(text.lines().count(), 5, "{text}");
    assert!(text.ends_with("chunk 5 of 5\n"), "{text}");
    let w = up.write("/p", 1);
    let applied = w.applied_at.unwrap();
    assert!(applied - w.started >= Duration::from_millis(300));
    assert!(w.ended.unwrap() >= applied && w.ended.unwrap() <= done);
    assert_eq!(w.answer_cut, None);
    // The connection is kept alive after the final chunk.
    assert_eq!(c.exchange(&put("/p", 1, &[], "again")).await.status, 200);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

#[tokio::test]
async fn slow_stream_keeps_working_after_the_peer_left() {
    let (up, mut c) = started().await;
    c.send(
        one(&[
            ("x-test-behaviour", "slow-stream"),
            ("x-test-chunks", "6"),
            ("x-test-chunk-ms", "100"),
        ])
        .as_bytes(),
    )
    .await;
    let (status, _) = crate::support::raw_upstream::read_response_head(&mut c.stream, &mut c.buf)
        .await
        .unwrap();
    assert_eq!(status, 200);
    drop(c); // the peer leaves after the head
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(up.in_flight(), 1, "still streaming to nobody");
    let mut other = Client::connect(&up).await;
    assert_eq!(other.exchange(&put("/p", 2, &[], "two")).await.status, 200);
    up.settle(SETTLE).await;
    let w = up.write("/p", 1);
    let applied = w.applied_at.expect("applied although the peer left");
    assert!(applied - w.started >= Duration::from_millis(600));
    let cut = w
        .answer_cut
        .expect("the upstream noticed the peer was gone");
    assert!(cut < applied, "noticed at a chunk, before the stream's end");
    assert_eq!(up.applied_tokens("/p"), vec![2, 1]);
    assert_eq!(up.violations(), OVERTAKEN);
}

#[tokio::test]
async fn early_answer_comes_before_the_body_is_read() {
    let (up, mut c) = started().await;
    let h = head(
        "PUT",
        "/p",
        &[
            ("x-fence-token", "1"),
            ("x-test-behaviour", "early-answer"),
            ("x-test-work-ms", "150"),
        ],
        None,
    );
    c.send(h.as_bytes()).await;
    // The whole answer arrives before any body byte was sent.
    let resp = c.response().await;
    assert_eq!((resp.status, resp.complete), (200, true));
    assert_eq!(up.in_flight(), 1);
    for part in ["ab", "cd", "ef"] {
        tokio::time::sleep(Duration::from_millis(80)).await;
        c.send(&chunk(part.as_bytes())).await;
    }
    eventually("three parts", || up.write("/p", 1).body_bytes == 6).await;
    assert!(up.write("/p", 1).applied_at.is_none(), "body not complete");
    c.send(b"0\r\n\r\n").await;
    // The connection takes the next request while token 1 is worked on.
    let resp = c.exchange(&put("/q", 1, &[], "next")).await;
    assert_eq!(resp.status, 200);
    up.settle(SETTLE).await;
    let w = up.write("/p", 1);
    assert_eq!(w.body, b"abcdef");
    assert!(w.body_complete && !w.aborted);
    let applied = w.applied_at.unwrap();
    assert!(applied - w.last_body_byte.unwrap() >= Duration::from_millis(150));
    assert!(w.ended.unwrap() >= applied);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

#[tokio::test]
async fn early_answer_with_a_cut_body_is_aborted() {
    let (up, mut c) = started().await;
    let h = head(
        "PUT",
        "/p",
        &[("x-fence-token", "1"), ("x-test-behaviour", "early-answer")],
        Some(50),
    );
    c.send(h.as_bytes()).await;
    let resp = c.response().await;
    assert_eq!((resp.status, resp.complete), (200, true));
    c.send(b"0123456789").await;
    eventually("ten bytes", || up.write("/p", 1).body_bytes == 10).await;
    drop(c);
    up.settle(SETTLE).await;
    let w = up.write("/p", 1);
    assert!(w.aborted && !w.body_complete && w.applied_at.is_none());
    assert!(up.applied_tokens("/p").is_empty());
}

#[tokio::test]
async fn dropping_the_upstream_stops_it() {
    let up = RawUpstream::start().await;
    let addr = up.addr();
    let mut open = Client::connect(&up).await;
    assert_eq!(open.exchange(&put("/p", 1, &[], "x")).await.status, 200);
    drop(up);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(TcpStream::connect(addr).await.is_err(), "listener closed");
    let mut probe = [0u8; 1];
    let read = tokio::io::AsyncReadExt::read(&mut open.stream, &mut probe).await;
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "connection closed: {read:?}"
    );
}

/// A body far larger than a 4 KiB receive buffer, sent whole on a new
/// connection to `up` with `behaviour` and a stall of 500 ms; answers the
/// connection once the body is in the client's send queue.
async fn stalled_big_write(up: &RawUpstream, path: &str, behaviour: &str) -> TcpStream {
    let mut s = TcpStream::connect(up.addr()).await.expect("connect");
    let body = vec![b'x'; 300 * 1024];
    let h = head(
        "PUT",
        path,
        &[
            ("x-fence-token", "1"),
            ("x-test-behaviour", behaviour),
            ("x-test-stall-ms", "500"),
        ],
        Some(body.len()),
    );
    let mut raw = h.into_bytes();
    raw.extend_from_slice(&body);
    // The client's send queue takes it all: the upstream reads nothing yet.
    s.write_all(&raw).await.expect("send");
    s
}

/// The mechanism the handover tests rest on: a stalled body stays in the
/// sender's queue; a sender that *closes* (FIN after its data) still
/// delivers all of it, and the write is applied after the stall; a sender
/// that *resets* delivers only what the upstream's socket already held,
/// and the write is aborted.
#[tokio::test]
async fn stall_body_applies_what_a_close_delivers_and_aborts_what_a_reset_cuts() {
    let up = RawUpstream::start_with_recv_buffer(4096).await;
    let closed = stalled_big_write(&up, "/closed", "stall-body").await;
    let reset = stalled_big_write(&up, "/reset", "stall-body").await;
    eventually("both heads", || up.writes().len() == 2).await;
    drop(closed);
    reset.set_zero_linger().expect("SO_LINGER 0");
    drop(reset);
    up.settle(SETTLE).await;
    let (c, r) = (up.write("/closed", 1), up.write("/reset", 1));
    assert!(c.body_complete && c.applied_at.is_some(), "{c:?}");
    assert!(c.last_body_byte.unwrap() - c.started >= Duration::from_millis(500));
    assert!(r.aborted && !r.body_complete && r.applied_at.is_none());
    assert!(r.body_bytes < 300 * 1024, "{} bytes", r.body_bytes);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

/// `answer-then-stall` and `half-close-after-head` answer before reading
/// anything of the body, then read and apply it after the stall; the
/// half-close ends the answer with `connection: close` and a FIN.
#[tokio::test]
async fn answers_before_a_stalled_body() {
    let up = RawUpstream::start_with_recv_buffer(4096).await;
    for (path, behaviour) in [("/a", "answer-then-stall"), ("/h", "half-close-after-head")] {
        let mut s = stalled_big_write(&up, path, behaviour).await;
        let mut buf = BytesMut::new();
        let resp = read_response(&mut s, &mut buf).await.expect("an answer");
        assert_eq!((resp.status, resp.complete), (200, true), "{behaviour}");
        let w = up.write(path, 1);
        assert!(w.body_bytes == 0 && w.applied_at.is_none(), "{w:?}");
        if behaviour == "half-close-after-head" {
            assert_eq!(resp.header("connection"), Some("close"));
            let mut probe = [0u8; 1];
            let read = tokio::io::AsyncReadExt::read(&mut s, &mut probe).await;
            assert!(matches!(read, Ok(0)), "FIN after the answer: {read:?}");
        }
        up.settle(SETTLE).await;
        let w = up.write(path, 1);
        assert!(w.body_complete && w.applied_at.is_some(), "{w:?}");
        assert!(w.applied_at.unwrap() - w.started >= Duration::from_millis(500));
    }
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}
