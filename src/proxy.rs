//! Forwarding to the upstream: header hygiene, the pooled client, and the
//! body wrappers that enforce the size limit and keep the gate's permit alive
//! for exactly as long as the exchange lasts.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Uri};
use http_body::{Frame, SizeHint};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::config::Upstream;

/// The pooled upstream client shared by every route.
pub type UpstreamClient = Client<HttpConnector, Body>;

/// Builds the upstream client: keep-alive pool, no Nagle delay, bounded
/// connect time (a refused or unroutable upstream must fail fast as 502).
pub fn client() -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    connector.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(1024)
        .set_host(false)
        .build(connector)
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus `Proxy-Connection`, which old
/// clients still send. `Expect` is answered by our own server side. Typed
/// names: a `&str` name would be parsed again on every lookup.
const HOP_BY_HOP: [HeaderName; 10] = [
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

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Removes hop-by-hop headers, including every header `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Rewrites a client request into the upstream request: absolute URI from
/// config, `Host` set to the upstream, `X-Forwarded-*` set. The
/// `X-Fence-Token` header is left exactly as the client sent it.
pub fn upstream_request(
    mut req: Request<Body>,
    upstream: &Upstream,
    peer: Option<SocketAddr>,
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
    uri.scheme = Some(upstream.scheme.clone());
    uri.authority = Some(upstream.authority.clone());
    uri.path_and_query = Some(path_and_query);
    *req.uri_mut() = Uri::from_parts(uri)?;
    *req.version_mut() = http::Version::HTTP_11;
    let headers = req.headers_mut();
    strip_hop_by_hop(headers);
    if let Some(host) = headers.insert(header::HOST, upstream.host.clone()) {
        headers.insert(X_FORWARDED_HOST, host);
    }
    if let Some(peer) = peer {
        // One buffer, handed to the header without another copy.
        let mut value = String::with_capacity(48);
        if let Some(prev) = headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
            if !prev.trim().is_empty() {
                value.push_str(prev);
                value.push_str(", ");
            }
        }
        let _ = write!(value, "{}", peer.ip());
        if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(value)) {
            headers.insert(X_FORWARDED_FOR, v);
        }
    }
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
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
    /// endless chunked body is cut off the same way).
    pub struct LimitedBody {
        #[pin]
        inner: Body,
        remaining: u64,
        outcome: BodyOutcome,
    }
}

impl LimitedBody {
    pub fn new(inner: Body, limit: u64, outcome: BodyOutcome) -> Self {
        Self {
            inner,
            remaining: limit,
            outcome,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("request body exceeds the configured limit")]
    TooLarge,
    #[error("client body error: {0}")]
    Client(axum::Error),
}

impl http_body::Body for LimitedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
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
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// A response body that holds something (the gate's permit) until the
    /// body has ended or is dropped: a key stays closed to newer tokens until
    /// the upstream's answer has been fully relayed or abandoned.
    pub struct HoldingBody<T> {
        #[pin]
        inner: hyper::body::Incoming,
        held: Option<T>,
    }
}

impl<T> HoldingBody<T> {
    pub fn new(inner: hyper::body::Incoming, held: T) -> Self {
        Self {
            inner,
            held: Some(held),
        }
    }
}

impl<T> http_body::Body for HoldingBody<T> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            this.held.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
}
