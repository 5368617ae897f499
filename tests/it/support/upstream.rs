//! A recording upstream: a real HTTP/1.1 server on `127.0.0.1:0` that sits
//! behind the gateway in integration tests and checks the fencing guarantees
//! from the backend's side.
//!
//! Every request is recorded ([`Upstream::requests`]). Writes (any method but
//! GET, HEAD and OPTIONS) are "applied" after their body has been read in full
//! and an optional delay; the upstream records the order in which writes were
//! applied ([`Upstream::applied`]) and every breach of the fencing guarantees
//! it sees ([`Upstream::violations`]):
//!
//! - two writes on one path in flight at once with different
//!   `x-fence-token` values: `"two tokens in flight on /p: 5 and 7"`;
//! - a write applied with a token lower than one already applied on its path:
//!   `"applied 5 after 7 on /p"`.
//!
//! A write's life in the recorder, from its arrival (headers received) to the
//! moment it is applied, is its "in flight" period. Once its body has been
//! received in full, a write is applied even if the client goes away while it
//! is being delayed (as a real backend would); a write whose body is cut short
//! is recorded in [`Upstream::aborted`] and never applied.
//!
//! Request headers that steer the recorder (all optional):
//!
//! | header | effect |
//! | --- | --- |
//! | `x-test-delay-ms: N` | sleep N ms before applying a write / answering a read (for a write it replaces the random `write_delay_ms` delay) |
//! | `x-test-status: NNN` | answer with this status (a write is still applied) |
//! | `x-test-response-bytes: N` | answer with a streamed body of N bytes ([`pattern_bytes`]) in 64 KiB chunks instead of the usual body |
//! | `x-test-chunk-delay-ms: N` | with `x-test-response-bytes`, sleep N ms before each chunk after the first |
//!
//! Every response carries `x-upstream: recorder`.
#![allow(dead_code)] // shared test support: not every test binary uses every item

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use rand::Rng;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use super::breaches::Breaches;

/// Header: delay (ms) before applying a write or answering a read.
pub const DELAY_HEADER: &str = "x-test-delay-ms";
/// Header: status code to answer with.
pub const STATUS_HEADER: &str = "x-test-status";
/// Header: answer with a streamed body of this many bytes.
pub const RESPONSE_BYTES_HEADER: &str = "x-test-response-bytes";
/// Header: delay (ms) between the chunks of a streamed response body.
pub const CHUNK_DELAY_HEADER: &str = "x-test-chunk-delay-ms";
/// Header carrying the fencing token.
pub const FENCE_HEADER: &str = "x-fence-token";
/// Size of one chunk of a streamed response body.
pub const CHUNK_SIZE: usize = 64 * 1024;

type RespBody = UnsyncBoxBody<Bytes, Infallible>;

/// Options for [`Upstream::start_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpstreamOptions {
    /// Inclusive range `(min, max)` in milliseconds of the random delay applied
    /// to each write after its body is read and before it is applied. Ignored
    /// for a request carrying `x-test-delay-ms`. Default `(0, 0)`: no delay.
    pub write_delay_ms: (u64, u64),
}

/// One write as applied by the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Global sequence number, starting at 1, in the order of application.
    pub seq: u64,
    /// HTTP method, e.g. `"POST"`.
    pub method: String,
    /// Request path, without the query.
    pub path: String,
    /// The `x-fence-token` header parsed as `i64`; `None` if absent or not a number.
    pub token: Option<i64>,
    /// The full request body.
    pub body: Bytes,
}

/// One request as received by the upstream.
#[derive(Debug, Clone)]
pub struct Received {
    /// HTTP method, e.g. `"GET"`.
    pub method: String,
    /// Path and query as received, e.g. `"/docs/1?x=y"`.
    pub path_and_query: String,
    /// All request headers, duplicates kept (names are lower case).
    pub headers: HeaderMap,
    /// Number of body bytes received: 0 until the body has been read; for an
    /// aborted write, the bytes received before the body was cut short.
    pub body_len: usize,
    /// When its head arrived.
    pub arrived: std::time::Instant,
    /// The same moment on the wall clock, which is the clock Postgres's
    /// `clock_timestamp()` reads on this host: a comparison with a time the
    /// store decided by is not thrown off by the two clocks' drift.
    pub arrived_wall: std::time::SystemTime,
    /// HTTP/1.1, or HTTP/2 from a route with `upstream_protocol = "h2c"`.
    pub version: http::Version,
}

impl Received {
    /// The path without the query.
    pub fn path(&self) -> &str {
        self.path_and_query
            .split_once('?')
            .map_or(self.path_and_query.as_str(), |(p, _)| p)
    }

    /// The first value of header `name`, if present and valid UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Every value of header `name`, in the order received (non UTF-8 values skipped).
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    }
}

/// The bytes of a streamed test body of `n` bytes: byte `i` is `i % 251`.
pub fn pattern_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

/// A running recording upstream. The server stops (listener closed, open
/// connections dropped) when this value is dropped.
pub struct Upstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: JoinHandle<()>,
}

/// A port of 127.0.0.1 bound but not listening: connections to it are
/// refused, as to a server that is down, and no other socket can take it
/// meanwhile (a port merely found free and let go can be, by a test running
/// alongside, whose server then answers in the down one's place).
pub struct HeldPort(socket2::Socket);

impl HeldPort {
    pub fn new() -> HeldPort {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("a socket");
        let any: SocketAddr = "127.0.0.1:0".parse().expect("an address");
        socket.bind(&any.into()).expect("bind a port");
        HeldPort(socket)
    }

    pub fn addr(&self) -> SocketAddr {
        self.0
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .expect("a bound port")
    }
}

impl Upstream {
    /// Start a recorder with default options on `127.0.0.1:0`.
    /// Must be called within a tokio runtime.
    pub async fn start() -> Upstream {
        Self::start_with(UpstreamOptions::default()).await
    }

    /// Start a recorder that holds every write a random `min..=max` ms
    /// before applying it, so that concurrent writes overlap and reorder
    /// at the upstream (see [`UpstreamOptions::write_delay_ms`]).
    pub async fn with_write_delays(min: u64, max: u64) -> Upstream {
        Self::start_with(UpstreamOptions {
            write_delay_ms: (min, max),
        })
        .await
    }

    /// Start a recorder with `opts` on `127.0.0.1:0`.
    /// Must be called within a tokio runtime.
    pub async fn start_with(opts: UpstreamOptions) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind recording upstream");
        Self::serve(listener, opts)
    }

    /// Start a recorder with default options on a port a test held
    /// refusing connections (to start the upstream only after the gateway
    /// found it down).
    pub async fn start_on(held: HeldPort) -> Upstream {
        held.0.listen(1024).expect("listen on the held port");
        held.0.set_nonblocking(true).expect("non-blocking");
        let listener = TcpListener::from_std(held.0.into()).expect("a tokio listener");
        Self::serve(listener, UpstreamOptions::default())
    }

    fn serve(listener: TcpListener, opts: UpstreamOptions) -> Upstream {
        let (lo, hi) = opts.write_delay_ms;
        assert!(lo <= hi, "write_delay_ms: min {lo} > max {hi}");
        let addr = listener.local_addr().expect("local_addr");
        let shared = Arc::new(Shared {
            opts,
            state: Mutex::new(State::default()),
        });
        let server = tokio::spawn(accept_loop(listener, shared.clone()));
        Upstream {
            addr,
            shared,
            server,
        }
    }

    /// All applied writes, in the order they were applied.
    pub fn applied(&self) -> Vec<Applied> {
        self.shared.lock().applied.clone()
    }

    /// The bodies of the applied writes on `path`, in the order they were
    /// applied.
    pub fn bodies_on(&self, path: &str) -> Vec<String> {
        self.applied_on(path)
            .iter()
            .map(|a| String::from_utf8_lossy(&a.body).into_owned())
            .collect()
    }

    /// The applied writes on `path` (compared with the path without query),
    /// in the order they were applied.
    pub fn applied_on(&self, path: &str) -> Vec<Applied> {
        self.shared
            .lock()
            .applied
            .iter()
            .filter(|a| a.path == path)
            .cloned()
            .collect()
    }

    /// Ordering violations seen so far; empty means the fencing guarantees held.
    pub fn violations(&self) -> Vec<String> {
        self.shared.lock().breaches.seen.clone()
    }

    /// Every request received (any method), in arrival order.
    pub fn requests(&self) -> Vec<Received> {
        self.shared.lock().requests.clone()
    }

    /// Number of writes currently in flight (arrived, not yet applied or aborted).
    pub fn in_flight(&self) -> usize {
        self.shared.lock().in_flight_total
    }

    /// Writes whose body could not be read completely (never applied).
    pub fn aborted(&self) -> Vec<Received> {
        self.shared.lock().aborted.clone()
    }

    /// Sends a fenced write to `url` (a gateway in front of this recorder)
    /// in the background, held here for `delay_ms` (`x-test-delay-ms`), and
    /// returns once it is in flight here, or after 3 s (the caller checks
    /// if it must): a write to stop or kill the gateway under. The task
    /// answers the write's status.
    pub async fn held_write(
        &self,
        url: String,
        token: &'static str,
        body: &'static str,
        delay_ms: u64,
    ) -> JoinHandle<reqwest::Result<reqwest::StatusCode>> {
        let write = tokio::spawn(async move {
            super::fenced_put(&reqwest::Client::new(), url, token, body)
                .header("x-test-delay-ms", delay_ms.to_string())
                .send()
                .await
                .map(|r| r.status())
        });
        for _ in 0..300 {
            if self.in_flight() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        write
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every
        // connection task: the listener and all connections are closed.
        self.server.abort();
    }
}

crate::support::served_at_addr!(Upstream);

struct Shared {
    opts: UpstreamOptions,
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the record half-updated
        // in a way that matters to tests; keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Default)]
struct State {
    next_seq: u64,
    next_flight_id: u64,
    applied: Vec<Applied>,
    /// Writes in flight per path: (flight id, token).
    in_flight: HashMap<String, Vec<(u64, Option<i64>)>>,
    in_flight_total: usize,
    breaches: Breaches,
    requests: Vec<Received>,
    aborted: Vec<Received>,
    /// Body of the last applied write per path.
    last_body: HashMap<String, Bytes>,
}

impl State {
    fn leave_flight(&mut self, path: &str, id: u64) {
        if let Some(list) = self.in_flight.get_mut(path) {
            if let Some(pos) = list.iter().position(|(i, _)| *i == id) {
                list.swap_remove(pos);
                self.in_flight_total -= 1;
            }
            if list.is_empty() {
                self.in_flight.remove(path);
            }
        }
    }
}

/// Registration of a write as in flight on a path; unregisters on drop.
struct FlightGuard {
    shared: Arc<Shared>,
    path: String,
    id: u64,
    done: bool,
}

impl FlightGuard {
    fn enter(shared: &Arc<Shared>, path: &str, token: Option<i64>) -> FlightGuard {
        let mut st = shared.lock();
        let id = st.next_flight_id;
        st.next_flight_id += 1;
        let others: Vec<Option<i64>> = st
            .in_flight
            .get(path)
            .map(|l| l.iter().map(|(_, t)| *t).collect())
            .unwrap_or_default();
        st.breaches.arrive(path, token, others);
        st.in_flight
            .entry(path.to_string())
            .or_default()
            .push((id, token));
        st.in_flight_total += 1;
        FlightGuard {
            shared: shared.clone(),
            path: path.to_string(),
            id,
            done: false,
        }
    }

    /// Apply the write and leave the in-flight set, under one lock.
    fn apply(mut self, method: &str, token: Option<i64>, body: Bytes) -> u64 {
        let mut st = self.shared.lock();
        let path = self.path.as_str();
        st.breaches.apply(path, token);
        st.next_seq += 1;
        let seq = st.next_seq;
        st.applied.push(Applied {
            seq,
            method: method.to_string(),
            path: path.to_string(),
            token,
            body: body.clone(),
        });
        st.last_body.insert(path.to_string(), body);
        st.leave_flight(path, self.id);
        self.done = true;
        seq
    }
}

impl Drop for FlightGuard {
    fn drop(&mut self) {
        if !self.done {
            self.shared.lock().leave_flight(&self.path, self.id);
        }
    }
}

/// Records a request as aborted if dropped before its body was read in full
/// (covers both a read error and a cancelled handler).
struct BodyGuard {
    shared: Arc<Shared>,
    index: usize,
    is_write: bool,
    read: usize,
    done: bool,
}

impl BodyGuard {
    fn complete(mut self, len: usize) {
        self.done = true;
        self.shared.lock().requests[self.index].body_len = len;
    }
}

impl Drop for BodyGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.shared.lock();
        st.requests[self.index].body_len = self.read;
        if self.is_write {
            let rec = st.requests[self.index].clone();
            st.aborted.push(rec);
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let shared = shared.clone();
                    conns.spawn(async move {
                        let service = hyper::service::service_fn(move |req| {
                            let shared = shared.clone();
                            async move {
                                // Run each request on its own task so that a
                                // dropped connection never cancels a write
                                // half-way through.
                                let resp = match tokio::spawn(handle(shared, req)).await {
                                    Ok(resp) => resp,
                                    Err(_) => simple(StatusCode::INTERNAL_SERVER_ERROR, "handler failed"),
                                };
                                Ok::<_, Infallible>(resp)
                            }
                        });
                        // HTTP/1.1, and HTTP/2 by prior knowledge (h2c) for
                        // routes with `upstream_protocol = "h2c"`.
                        let _ = hyper_util::server::conn::auto::Builder::new(
                            hyper_util::rt::TokioExecutor::new(),
                        )
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                    });
                }
                Err(_) => {
                    // E.g. too many open files: back off briefly.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn header_u64(headers: &HeaderMap, name: &str) -> Option<u64> {
    header_str(headers, name).and_then(|s| s.trim().parse().ok())
}

fn full(body: impl Into<Bytes>) -> RespBody {
    Full::new(body.into()).boxed_unsync()
}

fn simple(status: StatusCode, msg: &'static str) -> Response<RespBody> {
    let mut resp = Response::new(full(msg));
    *resp.status_mut() = status;
    resp
}

/// A body of `n` pattern bytes, streamed in [`CHUNK_SIZE`] chunks with
/// `delay_ms` between chunks.
fn streamed(n: usize, delay_ms: u64) -> RespBody {
    let stream = futures_util::stream::unfold(0usize, move |sent| async move {
        if sent >= n {
            return None;
        }
        if sent > 0 && delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        }
        let len = CHUNK_SIZE.min(n - sent);
        let chunk: Vec<u8> = (sent..sent + len).map(|i| (i % 251) as u8).collect();
        Some((
            Ok::<_, Infallible>(Frame::data(Bytes::from(chunk))),
            sent + len,
        ))
    });
    StreamBody::new(stream).boxed_unsync()
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<RespBody> {
    let (parts, mut body) = req.into_parts();
    let method = parts.method.clone();
    let path = parts.uri.path().to_string();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or_else(|| path.clone(), |pq| pq.as_str().to_string());
    let headers = parts.headers;
    let is_write = !matches!(method, Method::GET | Method::HEAD | Method::OPTIONS);
    let token: Option<i64> =
        header_str(&headers, FENCE_HEADER).and_then(|s| s.trim().parse::<i64>().ok());

    let index = {
        let mut st = shared.lock();
        st.requests.push(Received {
            method: method.to_string(),
            path_and_query,
            headers: headers.clone(),
            body_len: 0,
            arrived: std::time::Instant::now(),
            arrived_wall: std::time::SystemTime::now(),
            version: parts.version,
        });
        st.requests.len() - 1
    };
    let flight = is_write.then(|| FlightGuard::enter(&shared, &path, token));
    let mut guard = BodyGuard {
        shared: shared.clone(),
        index,
        is_write,
        read: 0,
        done: false,
    };

    // Read the whole body; on error (or a short body) the guard records the abort.
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    guard.read += data.len();
                    buf.extend_from_slice(&data);
                }
            }
            Some(Err(_)) => return simple(StatusCode::BAD_REQUEST, "body aborted"),
            None => break,
        }
    }
    let declared = header_str(&headers, "content-length").and_then(|s| s.parse::<usize>().ok());
    if declared.is_some_and(|d| buf.len() < d) {
        return simple(StatusCode::BAD_REQUEST, "body shorter than content-length");
    }
    let body = buf.freeze();
    guard.complete(body.len());

    let delay_ms = match header_u64(&headers, DELAY_HEADER) {
        Some(ms) => ms,
        None if is_write => {
            let (lo, hi) = shared.opts.write_delay_ms;
            if hi == 0 {
                0
            } else {
                rand::thread_rng().gen_range(lo..=hi)
            }
        }
        None => 0,
    };
    if delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    }

    let response_bytes = header_u64(&headers, RESPONSE_BYTES_HEADER).map(|n| n as usize);
    let chunk_delay = header_u64(&headers, CHUNK_DELAY_HEADER).unwrap_or(0);
    let test_status = header_str(&headers, STATUS_HEADER)
        .and_then(|s| s.trim().parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok());

    let mut resp = if let Some(flight) = flight {
        let seq = flight.apply(method.as_str(), token, body);
        match response_bytes {
            Some(n) => Response::new(streamed(n, chunk_delay)),
            None => {
                let json = serde_json::json!({ "applied": seq, "token": token });
                let mut r = Response::new(full(json.to_string()));
                r.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                r
            }
        }
    } else if method == Method::OPTIONS {
        let mut r = Response::new(full(Bytes::new()));
        r.headers_mut().insert(
            http::header::ALLOW,
            HeaderValue::from_static("GET, HEAD, OPTIONS, POST, PUT, PATCH, DELETE"),
        );
        r
    } else if let Some(n) = response_bytes {
        Response::new(streamed(n, chunk_delay))
    } else {
        let last = shared.lock().last_body.get(&path).cloned();
        match last {
            Some(b) => Response::new(full(b)),
            None => simple(StatusCode::NOT_FOUND, "nothing applied on this path"),
        }
    };
    if let Some(status) = test_status {
        *resp.status_mut() = status;
    }
    resp.headers_mut()
        .insert("x-upstream", HeaderValue::from_static("recorder"));
    resp
}
