//! Forwarding to the upstream: header hygiene, and the
//! body wrappers that enforce the size limit and report a fenced exchange's
//! progress to its [`Exchange`] (which decides when the key may open).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Uri};
use http_body::{Frame, SizeHint};
use tokio::time::Sleep;

use crate::gateway::exchange::Exchange;
use crate::http1::client::Upstream;
use crate::http1::client::{ExchangeError, UpstreamBody};
use crate::http1::codec::strip_hop_by_hop_and_underscored;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Who sent a request, as the upstream is told (`X-Forwarded-For`,
/// `X-Forwarded-Proto`).
#[derive(Debug, Clone)]
pub struct Downstream {
    /// The client's address as `X-Forwarded-For` names it: formatted once
    /// per connection, not per request (formatting an address costs about
    /// as much as parsing a request head's headers).
    pub forwarded_for: Option<http::HeaderValue>,
    /// Over TLS.
    pub https: bool,
}

impl Downstream {
    pub fn new(addr: Option<SocketAddr>, https: bool) -> Self {
        Self {
            forwarded_for: addr.and_then(|a| http::HeaderValue::try_from(a.ip().to_string()).ok()),
            https,
        }
    }
}

/// Rewrites a client request into the upstream request: origin-form URI
/// (with the upstream's base path), `Host` set to the upstream from config,
/// `X-Forwarded-*` set. The `X-Fence-Token` header is left exactly as the
/// client sent it.
///
/// - Header names with `_` are dropped (nginx's default): CGI, WSGI and
///   Rack read `X_Tenant` as `X-Tenant`, so the application could read
///   one the client slipped past what the gateway saw. A fenced write
///   that carries one was refused before it got here
///   (`gateway::check_headers`), so only pass-through requests lose them.
/// - `X-Forwarded-Host` is the gateway's own: the client's `Host`, which
///   the server validated (`http1::server::request`); a client's `X-Forwarded-Host`
///   is replaced by it, or dropped when there is none (an HTTP/1.0
///   request without `Host`), never forwarded as sent.
pub fn upstream_request(
    mut req: Request<Body>,
    upstream: &Upstream,
    peer: Downstream,
) -> Result<Request<Body>, http::Error> {
    let path_and_query = match req.uri().path_and_query() {
        // The common case shares the client's bytes instead of copying them.
        Some(pq) if upstream.base_path.is_empty() => pq.clone(),
        pq => {
            let pq = pq.map(|pq| pq.as_str()).unwrap_or("/");
            format!("{}{}", upstream.base_path, pq).try_into()?
        }
    };
    let mut uri = http::uri::Parts::default();
    uri.path_and_query = Some(path_and_query);
    *req.uri_mut() = Uri::from_parts(uri)?;
    *req.version_mut() = http::Version::HTTP_11;
    let headers = req.headers_mut();
    strip_hop_by_hop_and_underscored(headers);
    match headers.insert(header::HOST, upstream.host.clone()) {
        Some(host) => _ = headers.insert(X_FORWARDED_HOST, host),
        None => _ = headers.remove(X_FORWARDED_HOST),
    }
    if let Some(peer) = peer.forwarded_for {
        let prev = headers
            .get(&X_FORWARDED_FOR)
            .and_then(|v| v.to_str().ok())
            .filter(|prev| !prev.trim().is_empty());
        let value = match prev {
            // The common case: the connection's own value, shared.
            None => Some(peer),
            Some(prev) => {
                // One buffer, handed to the header without another copy.
                let mut value = Vec::with_capacity(prev.len() + 2 + peer.len());
                value.extend_from_slice(prev.as_bytes());
                value.extend_from_slice(b", ");
                value.extend_from_slice(peer.as_bytes());
                HeaderValue::from_maybe_shared(Bytes::from(value)).ok()
            }
        };
        if let Some(v) = value {
            headers.insert(X_FORWARDED_FOR, v);
        }
    }
    let proto = if peer.https { "https" } else { "http" };
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    Ok(req)
}

/// How a client body ended, as seen by [`LimitedBody`]; read after the
/// exchange to tell "the client broke off" and "too large" apart from
/// upstream failures.
#[derive(Clone, Default)]
pub struct BodyOutcome(Arc<AtomicU8>);

impl BodyOutcome {
    const OPEN: u8 = 0;
    const TOO_LARGE: u8 = 1;
    const CLIENT_ERROR: u8 = 2;

    pub fn too_large(&self) -> bool {
        self.0.load(Ordering::Acquire) == Self::TOO_LARGE
    }

    pub fn client_failed(&self) -> bool {
        self.0.load(Ordering::Acquire) == Self::CLIENT_ERROR
    }

    fn set(&self, v: u8) {
        let _ = self
            .0
            .compare_exchange(Self::OPEN, v, Ordering::AcqRel, Ordering::Acquire);
    }
}

pin_project_lite::pin_project! {
    /// The client's request body on its way upstream, with the byte limit
    /// enforced on what is actually read (a lying `Content-Length` or an
    /// endless chunked body is cut off the same way). For a fenced write it
    /// cuts the body off at the exchange's deadline. (When the upstream
    /// has the body is its connection's to tell: see `http1::client::flight`.)
    pub struct LimitedBody {
        #[pin]
        inner: Body,
        remaining: u64,
        outcome: BodyOutcome,
        deadline: Deadline,
    }
}

impl LimitedBody {
    /// `deadline`: a fenced write's exchange's.
    pub fn new(inner: Body, limit: u64, outcome: BodyOutcome, deadline: Option<Instant>) -> Self {
        Self {
            inner,
            remaining: limit,
            outcome,
            deadline: Deadline::new(deadline),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    #[error("request body exceeds the configured limit")]
    TooLarge,
    #[error("client body error: {0}")]
    Client(axum::Error),
    #[error("the fenced write's exchange ran past the route's timeout_ms")]
    Deadline,
}

impl http_body::Body for LimitedBody {
    type Data = Bytes;
    type Error = LimitError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, LimitError>>> {
        let mut this = self.project();
        match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if this.deadline.passed() {
                    return Poll::Ready(Some(Err(LimitError::Deadline)));
                }
                if let Some(data) = frame.data_ref() {
                    let n = data.len() as u64;
                    if n > *this.remaining {
                        this.outcome.set(BodyOutcome::TOO_LARGE);
                        return Poll::Ready(Some(Err(LimitError::TooLarge)));
                    }
                    *this.remaining -= n;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.outcome.set(BodyOutcome::CLIENT_ERROR);
                Poll::Ready(Some(Err(LimitError::Client(e))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                ready!(this.deadline.poll(cx));
                Poll::Ready(Some(Err(LimitError::Deadline)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Why a relayed response body broke off.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("upstream body error: {0}")]
    Upstream(ExchangeError),
    #[error("the fenced write's exchange ran past the route's timeout_ms")]
    Deadline,
}

/// An upstream's response body on its way to the client. It hands the
/// upstream connection back to the worker's pool once the exchange is over
/// in both directions, and, for a fenced write, tells the [`Exchange`]
/// whether it ended normally and cuts the answer off at the exchange's
/// deadline. Dropped before its end (the client left), a fenced write's
/// answer is drained to its end in a task of its own, within the deadline
/// and [`DRAIN_LIMIT`], so that the key opens as soon as the upstream is
/// done; a pass-through answer's connection is reset.
pub struct RelayBody {
    /// Taken (left empty) when the relay ends or is dropped.
    inner: Answer,
    exchange: Option<Arc<Exchange>>,
    deadline: Deadline,
    /// The upstream's body has ended; waiting for the request to be
    /// written in full too.
    finishing: bool,
    /// Ended (normally or not); nothing more to do.
    done: bool,
}

/// An upstream's answer body, from an HTTP/1.1 connection or an HTTP/2
/// stream; both say when their exchange ended normally (`poll_finish`).
/// Unboxed although the variants differ in size: the HTTP/1.1 one is the
/// common case, and boxing it would cost an allocation per answer.
#[allow(clippy::large_enum_variant)]
pub enum Answer {
    Http1(UpstreamBody),
    Http2(crate::http2::client::AnswerBody),
}

impl Default for Answer {
    /// An empty HTTP/1.1 answer, holding no connection.
    fn default() -> Self {
        Answer::Http1(UpstreamBody::default())
    }
}

impl Answer {
    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        match self {
            Answer::Http1(b) => b.poll_finish(cx),
            Answer::Http2(b) => b.poll_finish(cx),
        }
    }
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = crate::http1::client::ExchangeError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Answer::Http1(b) => Pin::new(b).poll_frame(cx),
            Answer::Http2(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Answer::Http1(b) => b.is_end_stream(),
            Answer::Http2(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Answer::Http1(b) => b.size_hint(),
            Answer::Http2(b) => b.size_hint(),
        }
    }
}

/// Most bytes of a fenced write's answer read and discarded for a client
/// that left before its end. A longer answer is cut: its key then stays
/// closed until the deadline, as for any exchange that did not end
/// normally.
pub const DRAIN_LIMIT: u64 = 1024 * 1024;

impl Drop for RelayBody {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // A body empty from the start (a 204, a HEAD's answer) may never be
        // polled: the server knows it has nothing to send. The upstream's
        // answer did end normally.
        let ended = self.finishing || http_body::Body::is_end_stream(&self.inner);
        let mut inner = std::mem::take(&mut self.inner);
        let exchange = self.exchange.take();
        if !ended && exchange.is_none() {
            // Pass-through: the connection resets as `inner` is dropped.
            return;
        }
        // Most often the request is written in full already: finish here,
        // without a task.
        if ended {
            let mut now = Context::from_waker(std::task::Waker::noop());
            if let Poll::Ready(normal) = inner.poll_finish(&mut now) {
                finished(exchange, normal);
                return;
            }
        }
        let deadline = self.deadline.at;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            drop(rt.spawn(async move {
                // Only a fenced write's answer is drained, and it has a
                // deadline; without one nothing is drained (the safe side).
                let drained = ended
                    || match deadline {
                        Some(at) => drain(&mut inner, at).await,
                        None => false,
                    };
                let normal = drained && std::future::poll_fn(|cx| inner.poll_finish(cx)).await;
                finished(exchange, normal);
            }));
        }
    }
}

/// Reads an answer nobody will see to its end, discarding it: within
/// `deadline`, and at most [`DRAIN_LIMIT`] bytes. Answers whether it ended
/// normally.
async fn drain(body: &mut Answer, deadline: Instant) -> bool {
    let read = async {
        let mut left = DRAIN_LIMIT;
        loop {
            match std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut *body), cx))
                .await
            {
                None => return true,
                Some(Ok(frame)) => {
                    let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                    match left.checked_sub(n) {
                        Some(l) => left = l,
                        None => return false,
                    }
                }
                Some(Err(_)) => return false,
            }
        }
    };
    tokio::time::timeout_at(deadline.into(), read)
        .await
        .unwrap_or(false)
}

/// The exchange is over in both directions: `normal`, the upstream is done
/// with the write (see `UpstreamBody::poll_finish`); otherwise the key
/// stays closed until the deadline as the exchange is let go.
fn finished(exchange: Option<Arc<Exchange>>, normal: bool) {
    if let Some(x) = exchange {
        if normal {
            x.response_ended();
        }
    }
}

impl RelayBody {
    /// `exchange` for a fenced write; `None` for pass-through.
    pub fn new(inner: Answer, exchange: Option<Arc<Exchange>>) -> Self {
        Self {
            inner,
            deadline: Deadline::new(exchange.as_ref().map(|x| x.deadline())),
            exchange,
            finishing: false,
            done: false,
        }
    }

    /// Ends the relay abnormally: the connection is reset, and the
    /// exchange is let go without a normal end.
    fn broken(&mut self, e: RelayError) -> RelayError {
        self.done = true;
        self.inner = Answer::default();
        self.exchange.take();
        e
    }
}

impl http_body::Body for RelayBody {
    type Data = Bytes;
    type Error = RelayError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RelayError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if !this.finishing {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if this.deadline.passed() {
                        return Poll::Ready(Some(Err(this.broken(RelayError::Deadline))));
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(e))) => {
                    // Broken off: the upstream may still be at work.
                    return Poll::Ready(Some(Err(this.broken(RelayError::Upstream(e)))));
                }
                Poll::Ready(None) => this.finishing = true,
                Poll::Pending => {
                    ready!(this.deadline.poll(cx));
                    return Poll::Ready(Some(Err(this.broken(RelayError::Deadline))));
                }
            }
        }
        // The answer has ended; the exchange is over when the request is
        // written in full too.
        let Poll::Ready(normal) = this.inner.poll_finish(cx) else {
            ready!(this.deadline.poll(cx));
            return Poll::Ready(Some(Err(this.broken(RelayError::Deadline))));
        };
        this.done = true;
        finished(this.exchange.take(), normal);
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A fenced exchange's deadline as seen by a body wrapper: checked on every
/// frame, and a timer armed only when the body has to wait (most bodies
/// never do, and pay for no timer).
struct Deadline {
    at: Option<Instant>,
    timer: Option<Pin<Box<Sleep>>>,
}

impl Deadline {
    fn new(at: Option<Instant>) -> Self {
        Self { at, timer: None }
    }

    fn passed(&self) -> bool {
        self.at.is_some_and(|at| Instant::now() >= at)
    }

    /// Ready once the deadline has passed; never without one.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(at) = self.at else {
            return Poll::Pending;
        };
        self.timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())))
            .as_mut()
            .poll(cx)
    }
}
