//! A raw-socket upstream: an HTTP/1.1 server on `127.0.0.1:0` written
//! directly over tokio `TcpStream`s, so that it can misbehave precisely
//! (break a connection after the head, answer before reading the body, keep
//! working after the proxy has gone) where a hyper server would not let it.
//!
//! Request heads are parsed with `httparse`; request bodies may be framed by
//! `Content-Length` or be chunked; connections are kept alive for several
//! requests when the behaviour allows it.
//!
//! Every write (any method but GET, HEAD and OPTIONS) is recorded as a
//! [`WriteRecord`]. A write is *in flight* from `started` (its head received)
//! until `ended` (the upstream is completely done with it: applied or aborted,
//! and its answer sent, broken off or given up). The upstream reports every
//! breach of the fencing guarantees it sees ([`RawUpstream::violations`]):
//!
//! - a write starts on a path while a write with a *different*
//!   `x-fence-token` is in flight there: `"two tokens in flight on /p: 5 and 7"`;
//! - a write is applied with a token lower than the highest applied on its
//!   path: `"applied 5 after 7 on /p"`.
//!
//! A write whose body is cut off (EOF, reset, bad chunk framing) before it is
//! complete is recorded as aborted and never applied, whatever its behaviour.
//! A stalled body is read only after the stall, so a connection the proxy
//! *reset* meanwhile shows as the few bytes the upstream's socket already
//! held, then the reset: aborted. A connection the proxy merely *closed*
//! (FIN after its data) still delivers all of its queued body when the
//! upstream gets to it, complete: applied.
//! GET, HEAD and OPTIONS are answered `200` with an empty body and are not
//! recorded.
//!
//! Request headers that steer a write (all optional):
//!
//! | header | effect |
//! | --- | --- |
//! | `x-test-behaviour: normal` (default) | read the body, work, apply, answer `200` with a small JSON body; keep the connection alive |
//! | `x-test-behaviour: break-after-head` | read the body, send a chunked `200` head and one chunk, reset the connection (RST: `SO_LINGER` 0), then work and apply |
//! | `x-test-behaviour: slow-stream` | read the body, work, send a chunked `200` head, then `x-test-chunks` chunks one every `x-test-chunk-ms`, apply when that streaming period is over (whether or not the peer is still there), then send the final chunk |
//! | `x-test-behaviour: early-answer` | right after the head, send a complete `200` (Content-Length body) before reading the body; then read the body however slowly it comes, work, apply |
//! | `x-test-behaviour: flood` | read the body, work, apply, then send a chunked `200` of `x-test-flood-bytes` as fast as the peer takes it, with no time limit (a peer that stops reading stalls it); the write ends when the answer is sent or found cut off. Not among [`Behaviour::ALL`] |
//! | `x-test-behaviour: stall-body` | after the head, read nothing for `x-test-stall-ms`, then read the body, work, apply, answer `200` as `normal` does: an upstream too busy to read (with a small receive buffer, see [`RawUpstream::start_with_recv_buffer`], the sender's queue fills). Not among [`Behaviour::ALL`] |
//! | `x-test-behaviour: answer-then-stall` | right after the head, send a complete `200` (Content-Length body), then read nothing for `x-test-stall-ms`, then read the body, work, apply; keep the connection alive. Not among [`Behaviour::ALL`] |
//! | `x-test-behaviour: half-close-after-head` | right after the head, send a complete `200` with `connection: close` and shut the sending side (FIN), then read nothing for `x-test-stall-ms`, then read the body, work, apply. Not among [`Behaviour::ALL`] |
//! | `x-test-work-ms: N` | the write's work before it is applied, in ms (default 0) |
//! | `x-test-stall-ms: N` | the three stalling behaviours: how long the body is left unread, from the head's arrival, in ms (default 4000) |
//! | `x-test-chunks: N` | `slow-stream`: number of chunks (default 10) |
//! | `x-test-chunk-ms: N` | `slow-stream`: ms between chunks (default 100) |
//! | `x-test-flood-bytes: N` | `flood`: bytes of answer body (default 32 MiB) |
//! | `x-test-id: S` | recorded as [`WriteRecord::test_id`], to find a write again |
//!
//! An unknown `x-test-behaviour` is answered `400` and the connection closed.
//!
//! Two timing details, both chosen so that a correct proxy can never be
//! reported by mistake: `ended` is taken just *before* the last bytes of an
//! answer that completes after the write was applied are handed to the
//! socket (a proxy cannot have seen that answer end earlier), and
//! `break-after-head` waits [`BREAK_PAUSE`] after the chunk before the reset
//! so the proxy sees the head first.
//!
//! Every byte each connection received is kept, in the order the
//! connections were accepted ([`RawUpstream::received`]): what a proxy
//! sent, whatever the upstream made of it (a smuggled request shows there
//! as its own head, whether or not it parsed).
//!
//! The module also has small client-side helpers for tests that talk raw
//! HTTP/1.1 themselves: [`read_response_head`], [`read_response`],
//! [`chunk`].
#![allow(dead_code)] // shared test support: not every test uses every item

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

use super::breaches::{fmt_token, Breaches};

/// Header: how the upstream behaves for this write.
pub const BEHAVIOUR_HEADER: &str = "x-test-behaviour";
/// Header: work (ms) before a write is applied.
pub const WORK_HEADER: &str = "x-test-work-ms";
/// Header: `slow-stream`'s number of chunks.
pub const CHUNKS_HEADER: &str = "x-test-chunks";
/// Header: `slow-stream`'s pause between chunks (ms).
pub const CHUNK_MS_HEADER: &str = "x-test-chunk-ms";
/// Header: `flood`'s answer size in bytes.
pub const FLOOD_BYTES_HEADER: &str = "x-test-flood-bytes";
/// Header: an identifier recorded with the write.
pub const ID_HEADER: &str = "x-test-id";
/// Header carrying the fencing token.
pub const FENCE_HEADER: &str = "x-fence-token";
/// Header: how long the stalling behaviours leave the body unread (ms).
pub const STALL_MS_HEADER: &str = "x-test-stall-ms";
/// The stalling behaviours' stall without `x-test-stall-ms`.
pub const DEFAULT_STALL: Duration = Duration::from_millis(4000);
/// `break-after-head`: pause between the chunk and the reset.
pub const BREAK_PAUSE: Duration = Duration::from_millis(30);

/// Largest request head accepted.
const MAX_HEAD: usize = 64 * 1024;

/// How the upstream treats one write (`x-test-behaviour`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Behaviour {
    Normal,
    BreakAfterHead,
    SlowStream,
    EarlyAnswer,
    Flood,
    StallBody,
    AnswerThenStall,
    HalfCloseAfterHead,
}

impl Behaviour {
    /// The behaviours of an exchange of ordinary size (the randomized mix
    /// draws from these); `flood` and the stalling ones are for the cases
    /// they were made for.
    pub const ALL: [Behaviour; 4] = [
        Behaviour::Normal,
        Behaviour::BreakAfterHead,
        Behaviour::SlowStream,
        Behaviour::EarlyAnswer,
    ];

    /// The header value naming this behaviour.
    pub fn as_str(self) -> &'static str {
        match self {
            Behaviour::Normal => "normal",
            Behaviour::BreakAfterHead => "break-after-head",
            Behaviour::SlowStream => "slow-stream",
            Behaviour::EarlyAnswer => "early-answer",
            Behaviour::Flood => "flood",
            Behaviour::StallBody => "stall-body",
            Behaviour::AnswerThenStall => "answer-then-stall",
            Behaviour::HalfCloseAfterHead => "half-close-after-head",
        }
    }

    /// Parses a header value (ASCII case-insensitive, trimmed).
    pub fn parse(s: &str) -> Option<Behaviour> {
        let s = s.trim();
        Behaviour::ALL
            .into_iter()
            .chain([
                Behaviour::Flood,
                Behaviour::StallBody,
                Behaviour::AnswerThenStall,
                Behaviour::HalfCloseAfterHead,
            ])
            .find(|b| b.as_str().eq_ignore_ascii_case(s))
    }
}

/// One write as seen by the upstream. While the write is in flight, its
/// record is a snapshot.
#[derive(Debug, Clone)]
pub struct WriteRecord {
    /// Index in [`RawUpstream::writes`], in order of arrival.
    pub id: usize,
    /// HTTP method, e.g. `"PUT"`.
    pub method: String,
    /// Request path without the query.
    pub path: String,
    /// `x-fence-token` parsed as `i64`; `None` if absent or not a number.
    pub token: Option<i64>,
    /// `x-test-id`, if sent.
    pub test_id: Option<String>,
    pub behaviour: Behaviour,
    /// When the request head had been received.
    pub started: Instant,
    /// Body bytes received so far.
    pub body_bytes: usize,
    /// The body received so far.
    pub body: Vec<u8>,
    /// When the last body byte so far arrived.
    pub last_body_byte: Option<Instant>,
    /// Whether the body was received in full.
    pub body_complete: bool,
    /// When the write was applied; `None` if not (yet).
    pub applied_at: Option<Instant>,
    /// The body was cut off: the write is never applied.
    pub aborted: bool,
    /// When the upstream first failed to send its answer (the peer had
    /// gone, or stopped reading for the rest of a `slow-stream`); `None` if
    /// it never did. Not set by `break-after-head`'s own reset.
    pub answer_cut: Option<Instant>,
    /// When the upstream was completely done with the write; `None` while
    /// it is in flight.
    pub ended: Option<Instant>,
}

impl WriteRecord {
    /// Whether the write is still in flight.
    pub fn in_flight(&self) -> bool {
        self.ended.is_none()
    }
}

/// A running raw upstream. The server stops (listener closed, connections
/// and pending work dropped) when this value is dropped.
pub struct RawUpstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl RawUpstream {
    /// Starts a raw upstream on `127.0.0.1:0`. Must be called within a
    /// tokio runtime.
    pub async fn start() -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind raw upstream");
        Self::serve(listener)
    }

    /// Like [`start`](Self::start), with `SO_RCVBUF` set to `bytes` on the
    /// listening socket before `listen`, so that every accepted connection
    /// has that small a receive buffer (and window) from its handshake on:
    /// a body the upstream does not read stays in the sender's queue, not
    /// in the upstream's socket.
    pub async fn start_with_recv_buffer(bytes: u32) -> RawUpstream {
        let socket = tokio::net::TcpSocket::new_v4().expect("raw upstream socket");
        socket
            .set_recv_buffer_size(bytes)
            .expect("SO_RCVBUF on the raw upstream");
        socket
            .bind("127.0.0.1:0".parse().expect("an address"))
            .expect("bind raw upstream");
        let listener = socket.listen(1024).expect("listen");
        Self::serve(listener)
    }

    fn serve(listener: TcpListener) -> RawUpstream {
        let addr = listener.local_addr().expect("local_addr");
        let shared = Arc::new(Shared::default());
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        shared.track(accept.abort_handle());
        RawUpstream { addr, shared }
    }

    /// Every write received, in order of arrival.
    pub fn writes(&self) -> Vec<WriteRecord> {
        self.shared.state().writes.clone()
    }

    /// The writes on `path` with token `token`, in order of arrival.
    pub fn writes_with(&self, path: &str, token: i64) -> Vec<WriteRecord> {
        self.shared
            .state()
            .writes
            .iter()
            .filter(|w| w.path == path && w.token == Some(token))
            .cloned()
            .collect()
    }

    /// The one write on `path` with `token`; panics unless there is
    /// exactly one.
    pub fn write(&self, path: &str, token: i64) -> WriteRecord {
        let mut found = self.writes_with(path, token);
        assert_eq!(
            found.len(),
            1,
            "expected exactly one write with token {token} on {path}: {found:#?}"
        );
        found.remove(0)
    }

    /// The bytes each connection received so far, in the order the
    /// connections were accepted.
    pub fn received(&self) -> Vec<Vec<u8>> {
        self.shared.state().received.clone()
    }

    /// [`received`](Self::received), each connection's bytes as text (for
    /// assertions and their messages).
    pub fn received_text(&self) -> Vec<String> {
        self.received()
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect()
    }

    /// Breaches of the fencing guarantees seen so far; empty means they held.
    pub fn violations(&self) -> Vec<String> {
        self.shared.state().breaches.seen.clone()
    }

    /// The tokens of the writes applied on `path`, in the order they were
    /// applied (writes without a numeric token are left out).
    pub fn applied_tokens(&self, path: &str) -> Vec<i64> {
        let st = self.shared.state();
        st.applied
            .iter()
            .map(|&id| &st.writes[id])
            .filter(|w| w.path == path)
            .filter_map(|w| w.token)
            .collect()
    }

    /// Number of writes in flight now.
    pub fn in_flight(&self) -> usize {
        self.shared.state().in_flight.values().map(Vec::len).sum()
    }

    /// How many writes with `token` have arrived on `path`.
    pub fn arrived(&self, path: &str, token: i64) -> usize {
        self.shared
            .state()
            .writes
            .iter()
            .filter(|w| w.path == path && w.token == Some(token))
            .count()
    }

    /// How many writes carrying `x-test-id: id` have arrived.
    pub fn arrived_id(&self, id: &str) -> usize {
        self.shared
            .state()
            .writes
            .iter()
            .filter(|w| w.test_id.as_deref() == Some(id))
            .count()
    }

    /// The writes on `path` as the upstream saw them, one line each, in ms
    /// since `t0` (for assertion messages).
    pub fn timeline(&self, path: &str, t0: Instant) -> String {
        let ms = |t: Instant| t.saturating_duration_since(t0).as_millis();
        let mut out = format!("writes on {path}, ms since the test's first write was sent:\n");
        for w in self.writes().iter().filter(|w| w.path == path) {
            out.push_str(&format!(
                "  token {:?} {}: started {}, body {} bytes{}, last byte {:?}, applied {:?}{}, ended {:?}\n",
                w.token,
                w.behaviour.as_str(),
                ms(w.started),
                w.body_bytes,
                if w.body_complete { "" } else { " (incomplete)" },
                w.last_body_byte.map(ms),
                w.applied_at.map(ms),
                if w.aborted { " (aborted)" } else { "" },
                w.ended.map(ms),
            ));
        }
        out
    }

    /// Waits until no write is in flight; panics after `limit`.
    pub async fn settle(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.in_flight() > 0 {
            assert!(
                Instant::now() < deadline,
                "the upstream still has {} writes in flight after {limit:?}",
                self.in_flight()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        let tasks = self
            .shared
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        for t in tasks.into_iter().flatten() {
            t.abort();
        }
    }
}

crate::support::served_at_addr!(RawUpstream);

struct Shared {
    state: Mutex<State>,
    /// Every task the server started, aborted when it is dropped; `None`
    /// once it has been (a task started after that is aborted at once).
    tasks: Mutex<Option<Vec<AbortHandle>>>,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            state: Mutex::default(),
            tasks: Mutex::new(Some(Vec::new())),
        }
    }
}

#[derive(Default)]
struct State {
    writes: Vec<WriteRecord>,
    /// Ids of the writes in flight, per path.
    in_flight: HashMap<String, Vec<usize>>,
    /// Ids of applied writes, in order of application.
    applied: Vec<usize>,
    breaches: Breaches,
    /// The bytes each connection received, by connection.
    received: Vec<Vec<u8>>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a record half-updated
        // in a way that matters to tests.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new connection's place in `received`.
    fn connected(&self) -> usize {
        let mut st = self.state();
        st.received.push(Vec::new());
        st.received.len() - 1
    }

    fn receive(&self, conn: usize, bytes: &[u8]) {
        self.state().received[conn].extend_from_slice(bytes);
    }

    fn track(&self, handle: AbortHandle) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        match tasks.as_mut() {
            Some(tasks) => {
                if tasks.len() >= 256 {
                    tasks.retain(|t| !t.is_finished());
                }
                tasks.push(handle);
            }
            None => handle.abort(),
        }
    }

    /// Records a write whose head has arrived; checks it against the writes
    /// in flight on its path.
    fn begin(&self, head: &Head, behaviour: Behaviour) -> usize {
        let token = head
            .header(FENCE_HEADER)
            .and_then(|s| s.trim().parse::<i64>().ok());
        let mut st = self.state();
        let id = st.writes.len();
        let path = head.path.clone();
        let others: Vec<Option<i64>> = st
            .in_flight
            .get(&path)
            .map(|ids| ids.iter().map(|&i| st.writes[i].token).collect())
            .unwrap_or_default();
        st.breaches.arrive(&path, token, others);
        st.in_flight.entry(path.clone()).or_default().push(id);
        st.writes.push(WriteRecord {
            id,
            method: head.method.clone(),
            path,
            token,
            test_id: head.header(ID_HEADER).map(str::to_string),
            behaviour,
            started: head.received,
            body_bytes: 0,
            body: Vec::new(),
            last_body_byte: None,
            body_complete: false,
            applied_at: None,
            aborted: false,
            answer_cut: None,
            ended: None,
        });
        id
    }

    fn body_data(&self, id: usize, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut st = self.state();
        let w = &mut st.writes[id];
        w.body_bytes += data.len();
        w.body.extend_from_slice(data);
        w.last_body_byte = Some(now);
    }

    fn body_complete(&self, id: usize) {
        self.state().writes[id].body_complete = true;
    }

    fn apply(&self, id: usize) {
        let now = Instant::now();
        let mut st = self.state();
        let (path, token) = {
            let w = &st.writes[id];
            assert!(!w.aborted, "an aborted write is never applied");
            (w.path.clone(), w.token)
        };
        st.breaches.apply(&path, token);
        st.writes[id].applied_at = Some(now);
        st.applied.push(id);
    }

    fn answer_cut(&self, id: usize) {
        let now = Instant::now();
        self.state().writes[id].answer_cut.get_or_insert(now);
    }

    fn abort(&self, id: usize) {
        self.state().writes[id].aborted = true;
    }

    /// The upstream is done with the write: it leaves the in-flight set.
    fn end(&self, id: usize) {
        let now = Instant::now();
        let mut st = self.state();
        st.writes[id].ended = Some(now);
        let path = st.writes[id].path.clone();
        if let Some(ids) = st.in_flight.get_mut(&path) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                st.in_flight.remove(&path);
            }
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                let task = tokio::spawn(serve_connection(shared.clone(), stream));
                shared.track(task.abort_handle());
            }
            // E.g. too many open files: back off briefly.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// A connection with its read buffer.
struct Conn {
    stream: TcpStream,
    buf: BytesMut,
    /// Its place in `received`, and where its bytes are kept.
    id: usize,
    shared: Arc<Shared>,
}

/// A connection's socket as its bodies are read: what it reads is kept.
struct Tap<'a> {
    stream: &'a mut TcpStream,
    id: usize,
    shared: &'a Shared,
}

impl AsyncRead for Tap<'_> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut *self.stream).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = polled {
            self.shared.receive(self.id, &buf.filled()[before..]);
        }
        polled
    }
}

/// A parsed request head.
struct Head {
    method: String,
    path: String,
    /// Names in lower case, in the order received.
    headers: Vec<(String, String)>,
    framing: Framing,
    received: Instant,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn header_u64(&self, name: &str) -> Option<u64> {
        self.header(name).and_then(|v| v.trim().parse().ok())
    }
}

/// How a message body is delimited.
#[derive(Debug, Clone, Copy)]
enum Framing {
    Length(u64),
    Chunked,
    /// Until the connection closes (responses only).
    Eof,
}

/// What became of a request's head read.
enum HeadRead {
    Head(Head),
    /// The connection closed (or broke) between requests.
    Closed,
    /// A head that cannot be served.
    Bad(&'static str),
}

async fn read_head(conn: &mut Conn) -> HeadRead {
    loop {
        if !conn.buf.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&conn.buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let received = Instant::now();
                    let method = req.method.unwrap_or("").to_string();
                    let target = req.path.unwrap_or("/");
                    let path = target
                        .split_once('?')
                        .map_or(target, |(p, _)| p)
                        .to_string();
                    let headers = lowercase_headers(req.headers);
                    conn.buf.advance(n);
                    let framing = match request_framing(&headers) {
                        Ok(f) => f,
                        Err(why) => return HeadRead::Bad(why),
                    };
                    return HeadRead::Head(Head {
                        method,
                        path,
                        headers,
                        framing,
                        received,
                    });
                }
                Ok(httparse::Status::Partial) if conn.buf.len() > MAX_HEAD => {
                    return HeadRead::Bad("request head too large")
                }
                Ok(httparse::Status::Partial) => {}
                Err(_) => return HeadRead::Bad("malformed request head"),
            }
        }
        let before = conn.buf.len();
        match conn.stream.read_buf(&mut conn.buf).await {
            Ok(0) | Err(_) => return HeadRead::Closed,
            Ok(_) => conn.shared.receive(conn.id, &conn.buf[before..]),
        }
    }
}

/// Parsed headers as `(lowercase name, value)` pairs.
pub(crate) fn lowercase_headers(headers: &[httparse::Header<'_>]) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect()
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .filter(|(n, _)| n == "transfer-encoding")
        .flat_map(|(_, v)| v.split(','))
        .next_back()
        .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"))
}

fn content_length(headers: &[(String, String)]) -> Result<Option<u64>, &'static str> {
    let mut lengths = headers.iter().filter(|(n, _)| n == "content-length");
    match (lengths.next(), lengths.next()) {
        (None, _) => Ok(None),
        (Some((_, v)), None) => v.trim().parse().map(Some).map_err(|_| "bad content-length"),
        (Some(_), Some(_)) => Err("more than one content-length"),
    }
}

fn request_framing(headers: &[(String, String)]) -> Result<Framing, &'static str> {
    let te = headers.iter().any(|(n, _)| n == "transfer-encoding");
    let cl = content_length(headers)?;
    match (te, cl) {
        (true, Some(_)) => Err("both transfer-encoding and content-length"),
        (true, None) if is_chunked(headers) => Ok(Framing::Chunked),
        (true, None) => Err("a transfer-encoding other than chunked"),
        (false, Some(n)) => Ok(Framing::Length(n)),
        (false, None) => Ok(Framing::Length(0)),
    }
}

/// Incremental body decoder, for requests and responses alike.
struct Decoder {
    state: DecodeState,
}

enum DecodeState {
    Length(u64),
    ChunkSize,
    ChunkData(u64),
    ChunkEnd,
    Trailers,
    Eof,
    Done,
}

impl Decoder {
    fn new(framing: Framing) -> Decoder {
        let state = match framing {
            Framing::Length(0) => DecodeState::Done,
            Framing::Length(n) => DecodeState::Length(n),
            Framing::Chunked => DecodeState::ChunkSize,
            Framing::Eof => DecodeState::Eof,
        };
        Decoder { state }
    }

    /// Consumes what it can from `buf`, handing body data to `out`.
    /// `Ok(true)` once the body is complete.
    fn decode(
        &mut self,
        buf: &mut BytesMut,
        out: &mut impl FnMut(&[u8]),
    ) -> Result<bool, &'static str> {
        loop {
            match self.state {
                DecodeState::Done => return Ok(true),
                DecodeState::Eof => {
                    if !buf.is_empty() {
                        out(buf);
                        buf.clear();
                    }
                    return Ok(false);
                }
                DecodeState::Length(rem) | DecodeState::ChunkData(rem) => {
                    if buf.is_empty() {
                        return Ok(false);
                    }
                    let n = rem.min(buf.len() as u64) as usize;
                    out(&buf[..n]);
                    buf.advance(n);
                    let rem = rem - n as u64;
                    self.state = match self.state {
                        DecodeState::Length(_) if rem == 0 => DecodeState::Done,
                        DecodeState::Length(_) => DecodeState::Length(rem),
                        _ if rem == 0 => DecodeState::ChunkEnd,
                        _ => DecodeState::ChunkData(rem),
                    };
                }
                DecodeState::ChunkSize => match httparse::parse_chunk_size(buf) {
                    Ok(httparse::Status::Complete((n, size))) => {
                        buf.advance(n);
                        self.state = if size == 0 {
                            DecodeState::Trailers
                        } else {
                            DecodeState::ChunkData(size)
                        };
                    }
                    Ok(httparse::Status::Partial) => return Ok(false),
                    Err(_) => return Err("bad chunk size"),
                },
                DecodeState::ChunkEnd => {
                    if buf.len() < 2 {
                        return Ok(false);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err("chunk data not followed by CRLF");
                    }
                    buf.advance(2);
                    self.state = DecodeState::ChunkSize;
                }
                DecodeState::Trailers => match buf.windows(2).position(|w| w == b"\r\n") {
                    Some(0) => {
                        buf.advance(2);
                        self.state = DecodeState::Done;
                    }
                    Some(i) => buf.advance(i + 2),
                    None => return Ok(false),
                },
            }
        }
    }

    /// Whether the end of the connection completes the body.
    fn ends_at_eof(&self) -> bool {
        matches!(self.state, DecodeState::Eof | DecodeState::Done)
    }
}

/// The body was cut off before it was complete.
#[derive(Debug)]
struct Cut;

/// Reads a body to its end, handing data to `out`, from `buf` then `reader`.
async fn read_body<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    framing: Framing,
    mut out: impl FnMut(&[u8]),
) -> Result<(), Cut> {
    let mut decoder = Decoder::new(framing);
    loop {
        match decoder.decode(buf, &mut out) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(_) => return Err(Cut),
        }
        match reader.read_buf(buf).await {
            Ok(0) | Err(_) if decoder.ends_at_eof() => return Ok(()),
            Ok(0) | Err(_) => return Err(Cut),
            Ok(_) => {}
        }
    }
}

async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    let mut conn = Conn {
        stream,
        buf: BytesMut::with_capacity(8192),
        id: shared.connected(),
        shared: shared.clone(),
    };
    loop {
        let head = match read_head(&mut conn).await {
            HeadRead::Head(h) => h,
            HeadRead::Closed => return,
            HeadRead::Bad(why) => {
                let _ = answer_and_close(conn, 400, why).await;
                return;
            }
        };
        conn = match serve_request(&shared, conn, head).await {
            Some(c) => c,
            None => return,
        };
    }
}

async fn answer_and_close(mut conn: Conn, status: u16, msg: &str) -> io::Result<()> {
    let text = format!(
        "HTTP/1.1 {status} {}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{msg}",
        reason(status),
        msg.len()
    );
    conn.stream.write_all(text.as_bytes()).await?;
    conn.stream.shutdown().await
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        _ => "Unknown",
    }
}

fn json_answer(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

const CHUNKED_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// One chunk of a chunked body carrying `data` (not empty).
pub fn chunk(data: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

async fn work(ms: u64) {
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// Serves one request; returns the connection if it may carry another.
async fn serve_request(shared: &Arc<Shared>, mut conn: Conn, head: Head) -> Option<Conn> {
    if matches!(head.method.as_str(), "GET" | "HEAD" | "OPTIONS") {
        let Conn {
            stream,
            buf,
            id,
            shared,
        } = &mut conn;
        let mut tap = Tap {
            stream,
            id: *id,
            shared,
        };
        read_body(&mut tap, buf, head.framing, |_| {}).await.ok()?;
        conn.stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await
            .ok()?;
        return Some(conn);
    }
    let behaviour = match head.header(BEHAVIOUR_HEADER) {
        None => Behaviour::Normal,
        Some(v) => match Behaviour::parse(v) {
            Some(b) => b,
            None => {
                let _ = answer_and_close(conn, 400, "unknown x-test-behaviour").await;
                return None;
            }
        },
    };
    let work_ms = head.header_u64(WORK_HEADER).unwrap_or(0);
    let id = shared.begin(&head, behaviour);

    if matches!(
        behaviour,
        Behaviour::EarlyAnswer | Behaviour::AnswerThenStall | Behaviour::HalfCloseAfterHead
    ) {
        // The whole answer first, the body after.
        let text = format!("{{\"write\":{id},\"early\":true}}");
        let mut answer = json_answer(&text);
        if behaviour == Behaviour::HalfCloseAfterHead {
            let at = answer
                .windows(2)
                .position(|w| w == b"\r\n")
                .expect("a status line");
            answer.splice(at + 2..at + 2, b"connection: close\r\n".iter().copied());
        }
        if conn.stream.write_all(&answer).await.is_err() {
            shared.answer_cut(id);
        }
        if behaviour == Behaviour::HalfCloseAfterHead {
            // FIN: this side is done sending; the body is still read.
            let _ = conn.stream.shutdown().await;
        }
    }
    if matches!(
        behaviour,
        Behaviour::StallBody | Behaviour::AnswerThenStall | Behaviour::HalfCloseAfterHead
    ) {
        // Counted from the head's arrival; nothing is read meanwhile.
        let stall = head
            .header_u64(STALL_MS_HEADER)
            .map_or(DEFAULT_STALL, Duration::from_millis);
        tokio::time::sleep_until((head.received + stall).into()).await;
    }

    // The request body, for every behaviour; a cut body aborts the write.
    let read = {
        let Conn {
            stream,
            buf,
            id: conn_id,
            shared: conn_shared,
        } = &mut conn;
        let mut tap = Tap {
            stream,
            id: *conn_id,
            shared: conn_shared,
        };
        read_body(&mut tap, buf, head.framing, |d| shared.body_data(id, d)).await
    };
    if read.is_err() {
        shared.abort(id);
        shared.end(id);
        return None;
    }
    shared.body_complete(id);

    match behaviour {
        Behaviour::Normal | Behaviour::StallBody => {
            work(work_ms).await;
            shared.apply(id);
            let token = shared.state().writes[id].token;
            let text = format!("{{\"write\":{id},\"token\":{}}}", fmt_token(token));
            let answer = json_answer(&text);
            shared.end(id);
            if conn.stream.write_all(&answer).await.is_err() {
                shared.answer_cut(id);
                return None;
            }
            Some(conn)
        }
        Behaviour::EarlyAnswer => {
            // Keep working after the exchange, off the connection, which may
            // carry the next request meanwhile.
            let worker = shared.clone();
            let task = tokio::spawn(async move {
                work(work_ms).await;
                worker.apply(id);
                worker.end(id);
            });
            shared.track(task.abort_handle());
            Some(conn)
        }
        Behaviour::AnswerThenStall => {
            // Answered already: work, apply, and the connection may carry
            // the next request.
            work(work_ms).await;
            shared.apply(id);
            shared.end(id);
            Some(conn)
        }
        Behaviour::HalfCloseAfterHead => {
            work(work_ms).await;
            shared.apply(id);
            shared.end(id);
            None
        }
        Behaviour::BreakAfterHead => {
            let mut out = CHUNKED_HEAD.to_vec();
            out.extend_from_slice(&chunk(b"partial answer\n"));
            if conn.stream.write_all(&out).await.is_ok() {
                tokio::time::sleep(BREAK_PAUSE).await;
            }
            // SO_LINGER 0: closing sends an RST instead of a FIN.
            let _ = conn.stream.set_zero_linger();
            drop(conn);
            work(work_ms).await;
            shared.apply(id);
            shared.end(id);
            None
        }
        Behaviour::Flood => {
            // Applied first: the answer is what is long, not the work.
            work(work_ms).await;
            shared.apply(id);
            let total = head.header_u64(FLOOD_BYTES_HEADER).unwrap_or(32 << 20);
            let piece = chunk(&vec![b'x'; 64 * 1024]);
            let mut alive = conn.stream.write_all(CHUNKED_HEAD).await.is_ok();
            let mut sent = 0;
            while alive && sent < total {
                alive = conn.stream.write_all(&piece).await.is_ok();
                sent += 64 * 1024;
            }
            alive = alive && conn.stream.write_all(LAST_CHUNK).await.is_ok();
            if !alive {
                shared.answer_cut(id);
            }
            shared.end(id);
            alive.then_some(conn)
        }
        Behaviour::SlowStream => {
            work(work_ms).await;
            let chunks = head.header_u64(CHUNKS_HEADER).unwrap_or(10);
            let every = Duration::from_millis(head.header_u64(CHUNK_MS_HEADER).unwrap_or(100));
            let mut alive = conn.stream.write_all(CHUNKED_HEAD).await.is_ok();
            if !alive {
                shared.answer_cut(id);
            }
            let t0 = tokio::time::Instant::now();
            let over = t0 + every * chunks as u32;
            for i in 1..=chunks {
                tokio::time::sleep_until(t0 + every * i as u32).await;
                if alive {
                    let piece = chunk(format!("chunk {i} of {chunks}\n").as_bytes());
                    // A stalled peer must not hold up the schedule.
                    let wrote = tokio::time::timeout_at(over, conn.stream.write_all(&piece)).await;
                    alive = matches!(wrote, Ok(Ok(())));
                    if !alive {
                        shared.answer_cut(id);
                    }
                }
            }
            tokio::time::sleep_until(over).await;
            shared.apply(id);
            shared.end(id);
            if !alive {
                return None;
            }
            if conn.stream.write_all(LAST_CHUNK).await.is_err() {
                shared.answer_cut(id);
                return None;
            }
            Some(conn)
        }
    }
}

// ---------------------------------------------------------------------------
// Client-side helpers for tests that speak raw HTTP/1.1.

/// An answer read from a raw socket.
#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    /// Names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    /// The body as far as it was received.
    pub body: Vec<u8>,
    /// Whether the body was received to its end as framed.
    pub complete: bool,
}

impl RawResponse {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads an answer's head (status and headers) from `reader`, leaving any
/// body bytes already read in `buf`.
pub async fn read_response_head<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
) -> io::Result<(u16, Vec<(String, String)>)> {
    loop {
        if !buf.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let status = resp.code.unwrap_or(0);
                    let headers = lowercase_headers(resp.headers);
                    buf.advance(n);
                    return Ok((status, headers));
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
            }
        }
        if reader.read_buf(buf).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// Reads a whole answer (to a request other than HEAD): its head, then its
/// body until it is complete or the connection ends or breaks
/// (`complete: false`). An error only if the head cannot be read.
pub async fn read_response<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
) -> io::Result<RawResponse> {
    let (status, headers) = read_response_head(reader, buf).await?;
    let framing = if is_chunked(&headers) {
        Framing::Chunked
    } else {
        match content_length(&headers) {
            Ok(Some(n)) => Framing::Length(n),
            Ok(None) if status == 204 || status == 304 || (100..200).contains(&status) => {
                Framing::Length(0)
            }
            Ok(None) => Framing::Eof,
            Err(why) => return Err(io::Error::new(io::ErrorKind::InvalidData, why)),
        }
    };
    let mut body = Vec::new();
    let complete = read_body(reader, buf, framing, |d| body.extend_from_slice(d))
        .await
        .is_ok();
    Ok(RawResponse {
        status,
        headers,
        body,
        complete,
    })
}
