//! HTTP/2 to upstreams (`[[routes]] upstream_protocol = "h2"` over TLS with
//! ALPN, `"h2c"` by prior knowledge): one connection per upstream and
//! worker, its streams multiplexed, kept while it lives and replaced when
//! it ends.
//!
//! A fenced write's exchange hears the same events from a stream as from an
//! HTTP/1.1 connection ([`Witness`]), decided per stream:
//! - **Written**: END_STREAM was handed to h2 (on the head for a bodiless
//!   request, on the last DATA otherwise).
//! - **Handed over**: a PING sent after that END_STREAM was answered. The
//!   upstream reads a connection's frames in order, so its PONG says it
//!   has read the whole request; an answer that begins before it is an
//!   early answer, as on HTTP/1.1 (the safe reading when the two race).
//! - **Cut**: at the exchange's deadline the stream is reset
//!   (`RST_STREAM CANCEL`); a request whose END_STREAM had not gone is then
//!   never complete at the upstream.
//! - An abnormal end (`RST_STREAM` from the upstream, GOAWAY, a broken
//!   connection) is an answer that broke off. A stream the upstream's
//!   GOAWAY or `REFUSED_STREAM` says it never processed counts as never
//!   sent: the key may open, and a request that is not a fenced write is
//!   sent once more on a new connection.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use h2::client::SendRequest;
use h2::{Ping, PingPong, Reason};
use http::{header, Request, Response, Uri};
use http_body::{Frame, SizeHint};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify};

use crate::http1::client::{ExchangeError, SendError, Upstream, Witness};

use super::body::RecvBody;

/// How long connecting (TCP, TLS, the HTTP/2 handshake) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// What the upstream may send on one stream before the answer is read.
const STREAM_WINDOW: u32 = 1024 * 1024;
/// What the upstream may send on the connection before answers are read.
const CONNECTION_WINDOW: u32 = 8 * 1024 * 1024;

/// One worker's HTTP/2 connections; cheap to clone (clones share them).
#[derive(Clone, Default)]
pub struct Http2Client {
    conns: Arc<Mutex<HashMap<Arc<str>, Conn>>>,
}

/// One live connection: where streams are opened, and its handover pings.
#[derive(Clone)]
struct Conn {
    send: SendRequest<Bytes>,
    handover: Arc<Handover>,
}

/// Which protocol a connection is opened with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dial {
    /// TLS, ALPN `h2`.
    Tls,
    /// Plain TCP, prior knowledge.
    Plain,
}

impl Http2Client {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends `req` (its URI in origin form, `Host` set, as for HTTP/1.1)
    /// on a stream to `upstream` and waits for the answer's head; the
    /// answer's body is the stream's. `fenced`: a fenced write's deadline
    /// and the exchange that hears what the stream does.
    pub async fn send(
        &self,
        upstream: &Upstream,
        dial: Dial,
        req: Request<Body>,
        fenced: Option<(Instant, Arc<dyn Witness>)>,
    ) -> Result<Response<AnswerBody>, SendError> {
        let req = to_h2(upstream, req)?;
        let (parts, body) = req.into_parts();
        let end = http_body::Body::is_end_stream(&body);
        // A dead connection (the upstream closed it, or is going away) is
        // found before a stream is opened on it: once more on a new one,
        // nothing having been sent.
        let mut opened = None;
        for fresh in [false, true] {
            let conn = self.connection(upstream, dial, fresh).await?;
            let stream = match conn.send.clone().ready().await {
                Ok(mut send) => send.send_request(Request::from_parts(parts.clone(), ()), end),
                Err(e) => Err(e),
            };
            match stream {
                Ok(stream) => {
                    opened = Some((stream, conn.handover));
                    break;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "HTTP/2 upstream connection unusable");
                    self.forget(&upstream.pool_key);
                    if fresh {
                        return Err(SendError::Connect(format!("HTTP/2 stream not opened: {e}")));
                    }
                }
            }
        }
        let Some(((answer, stream), handover)) = opened else {
            return Err(SendError::Connect("no HTTP/2 connection".into()));
        };
        let sent = Arc::new(Sent::default());
        let (finished, ended) = oneshot::channel();
        tokio::spawn(request_side(
            stream,
            (!end).then_some(body),
            handover,
            sent.clone(),
            fenced.clone(),
            ended,
        ));
        match answer.await {
            Ok(head) => {
                // Let a PONG that came first be seen.
                tokio::task::yield_now().await;
                let handed_over = sent.handed_over.load(Ordering::Acquire);
                if let Some((_, w)) = &fenced {
                    w.answer_began(handed_over);
                }
                let (parts, recv) = head.into_parts();
                let body = AnswerBody {
                    body: RecvBody::new(recv, None),
                    handed_over,
                    sent,
                    _finished: finished,
                };
                Ok(Response::from_parts(parts, body))
            }
            // The upstream never processed it: as if never sent (the key
            // may open). Not sent again: its body has gone to the stream.
            Err(e) if never_processed(&e) => Err(SendError::Connect(format!(
                "the upstream did not process the stream: {e}"
            ))),
            Err(e) => Err(SendError::Exchange(ExchangeError::Io(
                std::io::Error::other(e),
            ))),
        }
    }

    /// The live connection to `upstream`, or a new one.
    async fn connection(
        &self,
        upstream: &Upstream,
        dial: Dial,
        fresh: bool,
    ) -> Result<Conn, SendError> {
        if !fresh {
            let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = conns.get(&upstream.pool_key) {
                return Ok(c.clone());
            }
        }
        let conn = tokio::time::timeout(CONNECT_TIMEOUT, connect(upstream, dial))
            .await
            .map_err(|_| {
                SendError::Connect(format!(
                    "connecting to {} took longer than {CONNECT_TIMEOUT:?}",
                    upstream.authority
                ))
            })??;
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(upstream.pool_key.clone(), conn.clone());
        Ok(conn)
    }

    fn forget(&self, key: &str) {
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }
}

/// Whether an upstream said it never processed a stream: it refused it
/// (`REFUSED_STREAM`, RFC 9113 §8.7), or a graceful GOAWAY ended it, which
/// h2 does only to the streams above the GOAWAY's last stream id (those at
/// or below it go on). A GOAWAY with an error ends every stream alike,
/// processed or not: that is a broken exchange, the safe reading.
fn never_processed(e: &h2::Error) -> bool {
    let reason = e.reason();
    reason == Some(Reason::REFUSED_STREAM)
        || (e.is_go_away() && e.is_remote() && reason == Some(Reason::NO_ERROR))
}

async fn connect(upstream: &Upstream, dial: Dial) -> Result<Conn, SendError> {
    let unreachable = |e: &dyn std::fmt::Display| {
        SendError::Connect(format!("cannot connect to {}: {e}", upstream.authority))
    };
    let tcp = TcpStream::connect(upstream.address())
        .await
        .map_err(|e| unreachable(&e))?;
    let _ = tcp.set_nodelay(true);
    let mut builder = h2::client::Builder::new();
    builder
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .enable_push(false);
    let (send, mut conn) = match dial {
        Dial::Plain => builder
            .handshake::<_, Bytes>(tcp)
            .await
            .map(|(s, c)| (s, Driven::Plain(Box::new(c))))
            .map_err(|e| unreachable(&e))?,
        Dial::Tls => {
            let Some(tls) = &upstream.tls else {
                return Err(SendError::Connect(format!(
                    "{} is https, but its TLS was not loaded",
                    upstream.authority
                )));
            };
            let mut config = (*tls.config).clone();
            config.alpn_protocols = vec![b"h2".to_vec()];
            let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(tls.server_name.clone(), tcp)
                .await
                .map_err(|e| unreachable(&e))?;
            if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
                return Err(SendError::Connect(format!(
                    "{} did not agree to HTTP/2 (ALPN h2)",
                    upstream.authority
                )));
            }
            builder
                .handshake::<_, Bytes>(stream)
                .await
                .map(|(s, c)| (s, Driven::Tls(Box::new(c))))
                .map_err(|e| unreachable(&e))?
        }
    };
    let pings = conn.ping_pong();
    let handover = Arc::new(Handover::default());
    tokio::spawn(async move {
        if let Err(e) = conn.drive().await {
            tracing::debug!(error = %e, "HTTP/2 upstream connection ended");
        }
    });
    if let Some(pings) = pings {
        tokio::spawn(handover.clone().run(pings));
    }
    Ok(Conn { send, handover })
}

/// A client connection of either transport, driven by its own task.
enum Driven {
    Plain(Box<h2::client::Connection<TcpStream, Bytes>>),
    Tls(Box<h2::client::Connection<tokio_rustls::client::TlsStream<TcpStream>, Bytes>>),
}

impl Driven {
    fn ping_pong(&mut self) -> Option<PingPong> {
        match self {
            Driven::Plain(c) => c.ping_pong(),
            Driven::Tls(c) => c.ping_pong(),
        }
    }

    async fn drive(self) -> Result<(), h2::Error> {
        match self {
            Driven::Plain(c) => (*c).await,
            Driven::Tls(c) => (*c).await,
        }
    }
}

/// A stream's request side as the exchange needs it known.
#[derive(Default)]
struct Sent {
    /// END_STREAM was handed to h2.
    written: AtomicBool,
    /// A PING after END_STREAM was answered: the upstream has it all.
    handed_over: AtomicBool,
    /// The request side is over: written, failed, or cut.
    over: AtomicBool,
    /// The stream was reset at the deadline.
    cut: AtomicBool,
    /// The answer's body, waiting for the request side to be over.
    waker: futures_util::task::AtomicWaker,
}

impl Sent {
    fn over(&self) {
        self.over.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// The handover pings of one connection: h2 has one PING of ours in
/// flight at a time, so requests that finished meanwhile share the next.
#[derive(Default)]
struct Handover {
    waiting: Mutex<Vec<Arc<Sent>>>,
    /// Holds a permit when `waiting` has gained entries.
    wake: Notify,
}

impl Handover {
    fn after(&self, sent: Arc<Sent>) {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(sent);
        self.wake.notify_one();
    }

    async fn run(self: Arc<Self>, mut pings: PingPong) {
        loop {
            self.wake.notified().await;
            let batch =
                std::mem::take(&mut *self.waiting.lock().unwrap_or_else(|e| e.into_inner()));
            if batch.is_empty() {
                continue;
            }
            if pings.ping(Ping::opaque()).await.is_err() {
                return;
            }
            for sent in batch {
                sent.handed_over.store(true, Ordering::Release);
            }
        }
    }
}

/// A stream's request side, in a task of its own: the body under the
/// upstream's flow control, then the handover ping, then (for a fenced
/// write) the deadline, at which the stream is reset. Ends when the answer
/// side ends (`ended`).
async fn request_side(
    mut stream: h2::SendStream<Bytes>,
    body: Option<Body>,
    handover: Arc<Handover>,
    sent: Arc<Sent>,
    fenced: Option<(Instant, Arc<dyn Witness>)>,
    ended: oneshot::Receiver<()>,
) {
    let deadline = fenced.as_ref().map(|(at, _)| *at);
    let cut = async {
        match deadline {
            Some(at) => tokio::time::sleep_until(at.into()).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(cut);
    tokio::pin!(ended);
    if let Some(body) = body {
        let sending = super::body::send(&mut stream, body);
        let result = tokio::select! {
            r = sending => r.is_ok(),
            _ = &mut cut => {
                cut_off(&mut stream, &sent, &fenced);
                false
            }
            _ = &mut ended => false,
        };
        if !result {
            return sent.over();
        }
    }
    sent.written.store(true, Ordering::Release);
    if let Some((_, w)) = &fenced {
        w.request_written();
    }
    handover.after(sent.clone());
    sent.over();
    tokio::select! {
        _ = &mut cut => cut_off(&mut stream, &sent, &fenced),
        _ = &mut ended => {}
    }
}

/// Resets the stream at the deadline, and tells the exchange.
fn cut_off(
    stream: &mut h2::SendStream<Bytes>,
    sent: &Sent,
    fenced: &Option<(Instant, Arc<dyn Witness>)>,
) {
    sent.cut.store(true, Ordering::Release);
    stream.send_reset(Reason::CANCEL);
    if let Some((_, w)) = fenced {
        w.cut();
    }
}

/// `req` as an HTTP/2 request: the absolute URI the pseudo-fields are made
/// of (the upstream's scheme and authority), no `Host`, no fields HTTP/2
/// forbids; gRPC's `te: trailers` kept.
fn to_h2(upstream: &Upstream, req: Request<Body>) -> Result<Request<Body>, SendError> {
    let (mut parts, body) = req.into_parts();
    let grpc = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(path)
        .build()
        .map_err(|e| SendError::Connect(format!("the request target cannot go as HTTP/2: {e}")))?;
    parts.version = http::Version::HTTP_2;
    parts.headers.remove(header::HOST);
    super::connection_specific(&mut parts.headers);
    if grpc {
        parts
            .headers
            .insert(header::TE, http::HeaderValue::from_static("trailers"));
    }
    Ok(Request::from_parts(parts, body))
}

/// An answer's body on a stream: DATA, then trailers (gRPC's status is
/// there), window space given back as it is read.
pub struct AnswerBody {
    body: RecvBody,
    /// The request was handed over before the answer began.
    handed_over: bool,
    sent: Arc<Sent>,
    /// Dropped with the body: the request side then stops waiting.
    _finished: oneshot::Sender<()>,
}

impl AnswerBody {
    /// Waits, once the answer has ended, for the request side to be over
    /// too; answers whether the exchange ended normally: the request was
    /// handed over before the answer began, the answer ended, and the
    /// deadline did not cut the stream.
    pub fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        let sent = &self.sent;
        if !sent.over.load(Ordering::Acquire) {
            sent.waker.register(cx.waker());
            if !sent.over.load(Ordering::Acquire) {
                return Poll::Pending;
            }
        }
        let normal = sent.written.load(Ordering::Acquire)
            && self.handed_over
            && http_body::Body::is_end_stream(&self.body)
            && !sent.cut.load(Ordering::Acquire);
        Poll::Ready(normal)
    }
}

impl http_body::Body for AnswerBody {
    type Data = Bytes;
    type Error = ExchangeError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ExchangeError>>> {
        Pin::new(&mut self.body)
            .poll_frame(cx)
            .map_err(|e| ExchangeError::Io(std::io::Error::other(e)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
