//! Forwarding to the upstream: header hygiene, and the
//! body wrappers that enforce the size limit and report a fenced exchange's
//! progress to its [`Exchange`] (which decides when the key may open).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Uri};
use http_body::{Frame, SizeHint};
use tokio::time::Sleep;

use crate::config::Upstream;
use crate::exchange::Exchange;
use crate::upstream::{ExchangeError, UpstreamBody};

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus `Proxy-Connection`, which old
/// clients still send. `Expect` is answered by our own server side. Typed
/// names: a `&str` name would be parsed again on every lookup.
const HOP_BY_HOP: [HeaderName; HOP_BY_HOP_NAMES] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::EXPECT,
];

/// How many names [`HOP_BY_HOP`] holds: `strip_hop_by_hop` marks those it
/// finds in a message as bits of a u16.
const HOP_BY_HOP_NAMES: usize = 10;
const _: () = assert!(HOP_BY_HOP_NAMES <= 16);

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Whether a header of this name (as sent, in any case) is hop-by-hop
/// itself (not counting those a `Connection` header names).
pub fn is_hop_by_hop(name: &[u8]) -> bool {
    HOP_BY_HOP
        .iter()
        .any(|h| h.as_str().as_bytes().eq_ignore_ascii_case(name))
}

/// Whether a `Connection` header's value names any header besides the
/// usual `keep-alive` and `close` (which name none that is not hop-by-hop
/// already).
pub fn names_headers(connection: &[u8]) -> bool {
    connection
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .any(|t| {
            !t.is_empty()
                && !t.eq_ignore_ascii_case(b"keep-alive")
                && !t.eq_ignore_ascii_case(b"close")
        })
}

/// The tokens of every `Connection` header of a message, in order, trimmed,
/// empty ones skipped (`Connection: a,,b` and two `Connection` headers are
/// one list, RFC 9110 §5.3).
pub fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether a header's name has `_` (see [`upstream_request`]).
pub fn is_underscored(name: &HeaderName) -> bool {
    name.as_str().as_bytes().contains(&b'_')
}

/// Removes hop-by-hop headers, including every header `Connection` names.
///
/// On a request, `Connection` never names a header the gateway relies on
/// (the token, the idempotency key, the credentials, a key part): such a
/// request was refused before it got here (`gateway::check_headers`), so
/// what is forwarded is what was checked.
///
/// One pass over the message's few names finds which hop-by-hop ones it
/// carries (usually none in a request, and only `Connection: keep-alive`
/// in an answer), and only those are removed: a removal is a hashed lookup,
/// and doing one per hop-by-hop name cost more than the rest of the header
/// rewriting together.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip(headers, false)
}

/// [`strip_hop_by_hop`], and with `underscored` the names with `_` too,
/// found in the same pass.
fn strip(headers: &mut HeaderMap, underscored: bool) {
    let mut present = 0u16;
    let mut odd = false;
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            present |= 1 << i;
        }
        odd |= underscored && is_underscored(name);
    }
    if odd {
        let names: Vec<HeaderName> = headers
            .keys()
            .filter(|n| is_underscored(n))
            .cloned()
            .collect();
        for name in names {
            headers.remove(name);
        }
    }
    if present == 0 {
        return;
    }
    // Headers named by `Connection` (present only with it: it is one of
    // them). Its usual tokens need no lookup: `close` names no header, and
    // `keep-alive`'s header is one of them already.
    let named: Vec<HeaderName> = connection_tokens(headers)
        .filter(|t| !t.eq_ignore_ascii_case(b"keep-alive") && !t.eq_ignore_ascii_case(b"close"))
        .filter_map(|t| HeaderName::from_bytes(t).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
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
///   the server validated (`server::wire`); a client's `X-Forwarded-Host`
///   is replaced by it, or dropped when there is none (an HTTP/1.0
///   request without `Host`), never forwarded as sent.
pub fn upstream_request(
    mut req: Request<Body>,
    upstream: &Upstream,
    peer: crate::gateway::Downstream,
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
    strip(headers, true);
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
    /// has the body is its connection's to tell: see `upstream::flight`.)
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
pub enum BodyError {
    #[error("request body exceeds the configured limit")]
    TooLarge,
    #[error("client body error: {0}")]
    Client(axum::Error),
    #[error("the fenced write's exchange ran past the route's timeout_ms")]
    Deadline,
}

impl http_body::Body for LimitedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if this.deadline.passed() {
                    return Poll::Ready(Some(Err(BodyError::Deadline)));
                }
                if let Some(data) = frame.data_ref() {
                    let n = data.len() as u64;
                    if n > *this.remaining {
                        this.outcome.set(BodyOutcome::TOO_LARGE);
                        return Poll::Ready(Some(Err(BodyError::TooLarge)));
                    }
                    *this.remaining -= n;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.outcome.set(BodyOutcome::CLIENT_ERROR);
                Poll::Ready(Some(Err(BodyError::Client(e))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                ready!(this.deadline.poll(cx));
                Poll::Ready(Some(Err(BodyError::Deadline)))
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
    inner: UpstreamBody,
    exchange: Option<Arc<Exchange>>,
    deadline: Deadline,
    /// The upstream's body has ended; waiting for the request to be
    /// written in full too.
    finishing: bool,
    /// Ended (normally or not); nothing more to do.
    done: bool,
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
async fn drain(body: &mut UpstreamBody, deadline: Instant) -> bool {
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
    pub fn new(inner: UpstreamBody, exchange: Option<Arc<Exchange>>) -> Self {
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
        self.inner = UpstreamBody::default();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "close, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("x-fence-token", "7".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["x-fence-token"], "7");
    }

    /// Every hop-by-hop header goes, whichever of them a message carries
    /// and in whatever case it was sent; a message without one is left as
    /// it is.
    #[test]
    fn strips_each_hop_by_hop_header_alone_and_all_together() {
        for name in &HOP_BY_HOP {
            let mut h = HeaderMap::new();
            h.insert(name.clone(), "x".parse().unwrap());
            h.insert("x-fence-token", "7".parse().unwrap());
            strip_hop_by_hop(&mut h);
            assert_eq!(h.len(), 1, "{name} stayed");
        }
        let mut h = HeaderMap::new();
        for name in &HOP_BY_HOP {
            h.append(name.clone(), "x".parse().unwrap());
            h.append(name.clone(), "y".parse().unwrap());
        }
        h.insert(
            header::CONNECTION,
            "Keep-Alive, Upgrade, X-Named".parse().unwrap(),
        );
        h.insert("x-named", "1".parse().unwrap());
        h.insert("x-fence-token", "7".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().collect::<Vec<_>>(), ["x-fence-token"]);
        let mut h = HeaderMap::new();
        h.insert("x-fence-token", "7".parse().unwrap());
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }
}
