//! A client for the lock API (`/_fencegate/locks/{name}`), and a
//! [`LeaseKeeper`] for leader election.
//!
//! [`LockClient`] speaks the four calls of the lock API: [`acquire`],
//! [`renew`], [`release`] and [`status`]. A [`Grant`] carries the fencing
//! token to send as `X-Fence-Token` on writes through the gateway; its
//! `lease` is the secret that proves ownership and is never printed.
//!
//! It speaks `http` and `https` (rustls; the CAs of [`ClientOptions`], else
//! the platform's trust roots), and sends a bearer key when given one
//! ([`ClientOptions::api_key`]), for gateways with `[[auth.clients]]`.
//!
//! [`LeaseKeeper`] renews a grant in the background and says, from the
//! client's own monotonic clock, when the lease can no longer be trusted:
//! as soon as a renewal is refused, or once the last successful renewal is
//! older than the ttl (minus a margin for clock drift). Work done as the
//! holder should stop when [`LeaseKeeper::lost`] resolves; the fencing token
//! makes the gateway refuse any write that slips through anyway.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use fencegate::client::{Error, LockClient};
//!
//! # async fn demo() -> Result<(), Error> {
//! let locks = LockClient::new("http://127.0.0.1:8080")?;
//!
//! // One-off: take the lock, write with its token, let go.
//! let grant = locks
//!     .acquire("job:nightly", Duration::from_secs(30), Duration::from_secs(5))
//!     .await?;
//! println!("fence {}; send X-Fence-Token: {}", grant.fence, grant.token);
//! locks.release("job:nightly", &grant.lease).await?;
//!
//! // Leader election: keep the lease alive while working.
//! let keeper = locks
//!     .acquire_keeper("job:nightly", Duration::from_secs(10), Duration::from_secs(30))
//!     .await?;
//! tokio::select! {
//!     _ = keeper.lost() => eprintln!("leadership lost; stop and retry"),
//!     _ = async {
//!         // Leader work; send keeper.token() as X-Fence-Token on each write.
//!     } => {}
//! }
//! keeper.release().await.ok();
//! # Ok(()) }
//! ```
//!
//! [`acquire`]: LockClient::acquire
//! [`renew`]: LockClient::renew
//! [`release`]: LockClient::release
//! [`status`]: LockClient::status

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::{header, HeaderMap, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use rustls::pki_types::ServerName;
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;

/// Default time limit for one request (plus the `wait` of an acquire).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest answer body read; lock API answers are a few hundred bytes.
const MAX_ANSWER: usize = 64 * 1024;
/// How much of an unexpected answer body is kept in [`Error::Unexpected`].
const MAX_ERROR_BODY: usize = 2048;

/// Everything but RFC 3986 unreserved characters, and `.` too (so that a
/// name of `.` or `..` is never taken for a dot-segment): a lock name is
/// always exactly one path segment, whatever `/`, `:`, `?` or `%` it holds.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'~');

/// The grant and status types are the server's own, so the two sides cannot
/// drift apart; `Grant`'s `Debug` redacts the lease id.
pub use crate::locks::{Grant, Status};

/// What can go wrong in a lock API call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// 409 `lock-held`: another holder has the lock (after waiting up to the
    /// `wait` asked for).
    #[error("the lock is held by another holder{}", expiry_note(.expires_in))]
    Held {
        /// Time left on the holder's lease, when the gateway said.
        expires_in: Option<Duration>,
    },
    /// 409 `not-holder`: the lease expired, was released, or never held the
    /// lock.
    #[error("this lease does not hold the lock: it expired, was released, or never held it")]
    NotHolder,
    /// 503: the gateway cannot reach its lock backend or fence store; nothing
    /// was granted.
    #[error("the lock service is unavailable{}", retry_note(.retry_after))]
    Unavailable {
        /// The answer's `Retry-After`, if it had one.
        retry_after: Option<Duration>,
    },
    /// 400: the gateway refused the request (a ttl or wait out of bounds, a
    /// bad name...).
    #[error("bad lock request: {detail}")]
    BadRequest {
        /// The refused field (`ttl_ms`, `wait_ms`, `lease`, `name`, `body`).
        field: Option<String>,
        /// The gateway's explanation.
        detail: String,
    },
    /// The request did not get an answer: connection refused or broken,
    /// timeout, unreadable body.
    #[error("lock request failed: {0}")]
    Http(String),
    /// An answer this client does not know what to do with.
    #[error("unexpected answer from the gateway: {status}: {body}")]
    Unexpected {
        /// The HTTP status code.
        status: u16,
        /// The answer's body (shortened), or why a success body was unusable.
        body: String,
    },
    /// The base URL given to [`LockClient::new`] is not usable.
    #[error("invalid base URL: {0}")]
    InvalidBaseUrl(String),
    /// 401 or 403: the gateway does not know this client (no or a wrong
    /// bearer key), or does not let it use this name.
    #[error("{} by the gateway: {detail}", if *.status == 401 { "not authenticated" } else { "forbidden" })]
    Denied {
        /// 401 or 403.
        status: u16,
        /// The gateway's explanation.
        detail: String,
    },
    /// The client cannot be set up as asked: a CA file that cannot be read
    /// or holds no certificate, no trust roots for https, an API key that
    /// cannot be sent in a header.
    #[error("cannot set up the client: {0}")]
    Setup(String),
}

fn expiry_note(d: &Option<Duration>) -> String {
    d.map(|d| format!(" (expires in {} ms)", d.as_millis()))
        .unwrap_or_default()
}

fn retry_note(d: &Option<Duration>) -> String {
    d.map(|d| format!(" (retry after {} s)", d.as_secs()))
        .unwrap_or_default()
}

impl Error {
    /// Whether trying again later may succeed: [`Error::Unavailable`],
    /// [`Error::Http`], and unexpected 5xx, 408 and 429 answers (say, from a
    /// load balancer in front of the gateway).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Unavailable { .. } | Error::Http(_) => true,
            Error::Unexpected { status, .. } => *status >= 500 || matches!(status, 408 | 429),
            _ => false,
        }
    }
}

/// How a [`LockClient`] reaches its gateway, besides the URL.
#[derive(Clone, Default)]
pub struct ClientOptions {
    /// PEM CA certificates trusted for https instead of the platform's: a
    /// gateway's certificate is often issued by a private CA.
    trust_pem: Option<Vec<u8>>,
    /// Sent as `Authorization: Bearer KEY`: gateways with `[[auth.clients]]`
    /// refuse lock calls without a known key.
    api_key: Option<String>,
}

impl fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientOptions")
            .field("trust_pem", &self.trust_pem.as_ref().map(|p| p.len()))
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl ClientOptions {
    /// No custom CA (the platform's roots are used for https), no API key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts the CA certificates in `pem` for https, and no others.
    pub fn trust_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.trust_pem = Some(pem.into());
        self
    }

    /// Trusts the CA certificates in the PEM file at `path`, and no others.
    pub fn trust_file(self, path: &Path) -> Result<Self, Error> {
        let pem = std::fs::read(path)
            .map_err(|e| Error::Setup(format!("cannot read {}: {e}", path.display())))?;
        Ok(self.trust_pem(pem))
    }

    /// Sends `key` as `Authorization: Bearer KEY` on every call.
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }
}

/// A client for the lock API of one gateway. Cheap to clone: clones share a
/// connection pool.
#[derive(Clone)]
pub struct LockClient {
    http: Client<Connector, Full<Bytes>>,
    /// `http[s]://host:port` plus any path prefix, without a trailing `/`.
    base: Arc<str>,
    timeout: Duration,
    /// `Bearer KEY`, marked sensitive; `None` without an API key.
    authorization: Option<HeaderValue>,
}

impl fmt::Debug for LockClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockClient")
            .field("base", &self.base)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl LockClient {
    /// A client for the gateway at `base_url`, e.g. `http://127.0.0.1:8080`
    /// (the traffic listener; a path prefix is kept, for a gateway mounted
    /// under one). `https` URLs are verified against the platform's trust
    /// roots; see [`LockClient::with_options`] for a CA of your own and an
    /// API key. Requests time out after [`DEFAULT_TIMEOUT`]; see
    /// [`LockClient::with_timeout`].
    pub fn new(base_url: &str) -> Result<Self, Error> {
        Self::with_options(base_url, &ClientOptions::default())
    }

    /// Like [`LockClient::new`], with a CA to trust for https and an API key.
    pub fn with_options(base_url: &str, options: &ClientOptions) -> Result<Self, Error> {
        let base = normalize_base(base_url)?;
        let tls = if base.starts_with("https:") {
            Some(tls_connector(options.trust_pem.as_deref())?)
        } else {
            None
        };
        let authorization = match &options.api_key {
            Some(key) => {
                let mut v = HeaderValue::try_from(format!("Bearer {key}"))
                    .map_err(|_| Error::Setup("the API key cannot be sent in a header".into()))?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(Duration::from_secs(5)));
        tcp.enforce_http(false);
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(Connector { tcp, tls });
        Ok(Self {
            http,
            base: base.into(),
            timeout: DEFAULT_TIMEOUT,
            authorization,
        })
    }

    /// Sets the time limit for one request. An acquire gets this plus the
    /// `wait` it asks for, so that the gateway's waiting is never cut short.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The per-request time limit.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The gateway's base URL, as normalized (no trailing `/`).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// Acquires `name` for `ttl`, letting the gateway wait up to `wait` for
    /// the current holder to release or expire (zero: answer at once).
    ///
    /// Times are sent in whole milliseconds. Note that if this call fails
    /// with a timeout or a broken connection, the gateway may still have
    /// granted the lease; nobody can renew it then, and it expires after
    /// `ttl`.
    pub async fn acquire(&self, name: &str, ttl: Duration, wait: Duration) -> Result<Grant, Error> {
        let body = json!({"ttl_ms": millis(ttl), "wait_ms": millis(wait)});
        let timeout = self.timeout.saturating_add(wait);
        self.post_for_grant(name, "", body, timeout).await
    }

    /// Renews the lease `lease` on `name` for `ttl` from now. The fence stays
    /// the same; a JWT token is re-signed for the new expiry.
    pub async fn renew(&self, name: &str, lease: &str, ttl: Duration) -> Result<Grant, Error> {
        self.renew_within(name, lease, ttl, self.timeout).await
    }

    async fn renew_within(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Grant, Error> {
        let body = json!({"lease": lease, "ttl_ms": millis(ttl)});
        self.post_for_grant(name, "/renew", body, timeout).await
    }

    /// An acquire or a renewal: both answer a grant, 201 or 200.
    async fn post_for_grant(
        &self,
        name: &str,
        suffix: &str,
        body: Value,
        timeout: Duration,
    ) -> Result<Grant, Error> {
        let answer = self
            .call(Method::POST, name, suffix, Some(body), timeout)
            .await?;
        match answer.status {
            StatusCode::CREATED | StatusCode::OK => answer.parse("grant"),
            _ => Err(answer.into_error()),
        }
    }

    /// Releases the lease `lease` on `name`, waking any waiting acquirer.
    pub async fn release(&self, name: &str, lease: &str) -> Result<(), Error> {
        let body = json!({ "lease": lease });
        let answer = self
            .call(Method::POST, name, "/release", Some(body), self.timeout)
            .await?;
        match answer.status {
            StatusCode::NO_CONTENT | StatusCode::OK => Ok(()),
            _ => Err(answer.into_error()),
        }
    }

    /// Reports whether `name` is held, and its fence.
    pub async fn status(&self, name: &str) -> Result<Status, Error> {
        let answer = self.call(Method::GET, name, "", None, self.timeout).await?;
        match answer.status {
            StatusCode::OK => answer.parse("status"),
            _ => Err(answer.into_error()),
        }
    }

    /// Acquires `name` (waiting up to `wait`) and starts a [`LeaseKeeper`]
    /// that renews it every `ttl / 3`.
    ///
    /// The keeper's first deadline counts from when the acquire request was
    /// sent, the latest moment the gateway's clock could have started the
    /// lease from. When the gateway made the request wait a good part of the
    /// ttl, the lease is renewed at once so the deadline counts from that
    /// renewal instead.
    pub async fn acquire_keeper(
        &self,
        name: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<LeaseKeeper, Error> {
        let sent = Instant::now();
        let grant = self.acquire(name, ttl, wait).await?;
        if sent.elapsed() < ttl / 3 {
            return Ok(LeaseKeeper::start(self.clone(), grant, ttl, sent));
        }
        let renew_sent = Instant::now();
        match self.renew(name, &grant.lease, ttl).await {
            Ok(renewed) => Ok(LeaseKeeper::start(self.clone(), renewed, ttl, renew_sent)),
            Err(e) if e.is_transient() && Instant::now() < valid_until(sent, &grant) => {
                // Still valid: the keeper retries.
                Ok(LeaseKeeper::start(self.clone(), grant, ttl, sent))
            }
            Err(e) => {
                if !matches!(e, Error::NotHolder) {
                    let _ = self.release(name, &grant.lease).await;
                }
                Err(e)
            }
        }
    }

    /// One request to `path` (from `/`, under the base URL) with an
    /// optional JSON body, bounded by the client's timeout: the answer as it
    /// came, whatever its status. For callers that want the body itself (the
    /// command line prints it), or a call this client has no method for (the
    /// admin API, with the admin listener as the base URL).
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Answer, Error> {
        self.exchange(method, path, body, self.timeout).await
    }

    /// One lock API request on `name`.
    async fn call(
        &self,
        method: Method,
        name: &str,
        suffix: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<Answer, Error> {
        if name.is_empty() {
            return Err(Error::BadRequest {
                field: Some("name".into()),
                detail: "name: must not be empty".into(),
            });
        }
        self.exchange(method, &lock_path(name, suffix), body, timeout)
            .await
    }

    /// One request; the whole exchange (connect, send, read the answer) is
    /// bounded by `timeout`.
    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<Answer, Error> {
        let url = format!("{}{path}", self.base);
        let uri: Uri = url
            .parse()
            .map_err(|e| Error::Http(format!("cannot form a request URI: {e}")))?;
        let mut req = Request::builder()
            .method(method.clone())
            .uri(uri)
            .header(header::ACCEPT, "application/json")
            .header(
                header::USER_AGENT,
                concat!("fencegate-client/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(auth) = &self.authorization {
            req = req.header(header::AUTHORIZATION, auth.clone());
        }
        let bytes = match body {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(bytes))
            .map_err(|e| Error::Http(format!("cannot form the request: {e}")))?;
        let exchange = async {
            let resp = self
                .http
                .request(req)
                .await
                .map_err(|e| Error::Http(format!("{method} {url}: {}", error_chain(&e))))?;
            let (parts, body) = resp.into_parts();
            let body = Limited::new(body, MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| Error::Http(format!("{method} {url}: reading the answer: {e}")))?
                .to_bytes();
            Ok(Answer {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(Error::Http(format!(
                "{method} {url}: no answer within {} ms",
                timeout.as_millis()
            ))),
        }
    }
}

/// Checks and normalizes a base URL to `http[s]://authority[/prefix]`.
fn normalize_base(base_url: &str) -> Result<String, Error> {
    let uri: Uri = base_url
        .trim()
        .parse()
        .map_err(|e| Error::InvalidBaseUrl(format!("{base_url:?}: {e}")))?;
    let scheme = match uri.scheme_str() {
        Some(s @ ("http" | "https")) => s,
        Some(other) => {
            return Err(Error::InvalidBaseUrl(format!(
                "{base_url:?}: scheme {other:?} is not supported (http or https)"
            )))
        }
        None => {
            return Err(Error::InvalidBaseUrl(format!(
                "{base_url:?}: expected an absolute URL such as http://127.0.0.1:8080"
            )))
        }
    };
    let Some(authority) = uri.authority() else {
        return Err(Error::InvalidBaseUrl(format!("{base_url:?}: no host")));
    };
    if uri.query().is_some() {
        return Err(Error::InvalidBaseUrl(format!(
            "{base_url:?}: must not have a query"
        )));
    }
    let prefix = uri.path().trim_end_matches('/');
    Ok(format!("{scheme}://{authority}{prefix}"))
}

/// A TLS connector trusting `trust` (PEM), else the platform's roots.
fn tls_connector(trust: Option<&[u8]>) -> Result<TlsConnector, Error> {
    let roots = match trust {
        Some(pem) => Arc::new(
            crate::tls::pem_roots(pem).map_err(|e| Error::Setup(format!("the CA file: {e}")))?,
        ),
        None => crate::tls::platform_roots()
            .map_err(|e| Error::Setup(format!("https: {e}; give a CA (e.g. --cacert)")))?,
    };
    let config = crate::tls::client_config(roots).map_err(Error::Setup)?;
    Ok(TlsConnector::from(Arc::new(config)))
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Connects over TCP, then TLS for `https` URLs.
#[derive(Clone)]
struct Connector {
    tcp: HttpConnector,
    /// Set when the base URL is https.
    tls: Option<TlsConnector>,
}

impl tower::Service<Uri> for Connector {
    type Response = Conn;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Conn, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = (uri.scheme_str() == Some("https")).then(|| self.tls.clone());
        let host = uri
            .host()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let connecting = self.tcp.call(uri);
        Box::pin(async move {
            let tcp = connecting.await?;
            let Some(tls) = tls else {
                return Ok(Conn::Plain(tcp));
            };
            let tls = tls.ok_or("an https URL, but the client was made for http")?;
            let name = ServerName::try_from(host)?;
            let stream = tls.connect(name, tcp.into_inner()).await?;
            Ok(Conn::Tls(Box::new(TokioIo::new(stream))))
        })
    }
}

/// A connection to the gateway, plain or TLS.
enum Conn {
    Plain(TokioIo<TcpStream>),
    /// Boxed: a TLS session is a kilobyte, a plain stream a few words.
    Tls(Box<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>),
}

impl hyper::rt::Read for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

impl Connection for Conn {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// `/_fencegate/locks/{name}{suffix}` with `name` as one encoded segment.
pub fn lock_path(name: &str, suffix: &str) -> String {
    format!("/_fencegate/locks/{}{suffix}", segment(name))
}

/// `text` percent-encoded as one path segment (every `/`, `?`, `%` and `.`
/// encoded), for names and keys in URLs.
pub fn segment(text: &str) -> String {
    utf8_percent_encode(text, SEGMENT).to_string()
}

/// A duration in whole milliseconds, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// An error and its sources, `: `-separated (hyper's own message is often
/// just "client error (Connect)").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// An answer as received.
pub struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl fmt::Debug for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The body may hold a lease id.
        f.debug_struct("Answer")
            .field("status", &self.status)
            .field("body_bytes", &self.body.len())
            .finish()
    }
}

impl Answer {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The body (at most 64 KiB are read).
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    fn parse<T: serde::de::DeserializeOwned>(self, what: &str) -> Result<T, Error> {
        // The error names the place and the expectation; the body (which may
        // hold the lease id) is not repeated.
        serde_json::from_slice(&self.body).map_err(|e| Error::Unexpected {
            status: self.status.as_u16(),
            body: format!("the {what} in the answer is not usable: {e}"),
        })
    }

    /// Maps a non-success answer to an error, reading problem+json bodies.
    pub fn into_error(self) -> Error {
        let problem: Option<Value> = serde_json::from_slice(&self.body).ok();
        let get = |k: &str| problem.as_ref().and_then(|p| p.get(k));
        let kind = get("type").and_then(Value::as_str).unwrap_or_default();
        let detail = get("detail").and_then(Value::as_str);
        match self.status {
            StatusCode::CONFLICT if kind.ends_with("lock-held") => Error::Held {
                expires_in: get("expires_in_ms")
                    .and_then(Value::as_u64)
                    .map(Duration::from_millis),
            },
            StatusCode::CONFLICT if kind.ends_with("not-holder") => Error::NotHolder,
            StatusCode::SERVICE_UNAVAILABLE => Error::Unavailable {
                retry_after: self
                    .headers
                    .get(header::RETRY_AFTER)
                    .and_then(parse_retry_after),
            },
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Error::Denied {
                status: self.status.as_u16(),
                detail: detail
                    .map(str::to_string)
                    .unwrap_or_else(|| shorten(&self.body)),
            },
            StatusCode::BAD_REQUEST => Error::BadRequest {
                field: get("field").and_then(Value::as_str).map(str::to_string),
                detail: detail
                    .map(str::to_string)
                    .unwrap_or_else(|| shorten(&self.body)),
            },
            status => Error::Unexpected {
                status: status.as_u16(),
                body: detail
                    .map(str::to_string)
                    .unwrap_or_else(|| shorten(&self.body)),
            },
        }
    }
}

/// `Retry-After` as delay-seconds or an HTTP-date.
fn parse_retry_after(v: &HeaderValue) -> Option<Duration> {
    let s = v.to_str().ok()?.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = DateTime::parse_from_rfc2822(s).ok()?.with_timezone(&Utc);
    Some((at - Utc::now()).to_std().unwrap_or(Duration::ZERO))
}

/// A body as text, cut to [`MAX_ERROR_BODY`] bytes on a char boundary.
fn shorten(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    if text.len() <= MAX_ERROR_BODY {
        return text.into_owned();
    }
    let mut end = MAX_ERROR_BODY;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// The safety margin taken off a lease's ttl: 1% for clock-rate differences
/// between client and backend, plus 2 ms.
fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// The last instant a grant obtained by a request sent at `sent` can be
/// trusted, by the client's monotonic clock. The backend started the lease
/// no earlier than `sent`, so it ends no earlier than `sent + ttl`.
fn valid_until(sent: Instant, grant: &Grant) -> Instant {
    let ttl = Duration::from_millis(grant.ttl_ms);
    sent + ttl.saturating_sub(drift(ttl))
}

/// Keeps a lease alive in the background and says when it is lost.
///
/// Renews every `ttl / 3`, counted from when the last successful renewal
/// request was sent. The lease is *lost*:
///
/// * as soon as a renewal is refused ([`Error::NotHolder`], or another
///   answer that retrying cannot fix, such as [`Error::BadRequest`]);
/// * once its deadline passes: the moment the last successful renewal (or
///   the acquire) was **sent**, plus the ttl, minus a drift margin of
///   `ttl / 100 + 2 ms`. Transient failures ([`Error::Unavailable`],
///   [`Error::Http`], 5xx) are retried until then.
///
/// Loss is final: a keeper never becomes held again. [`LeaseKeeper::is_held`]
/// checks the deadline against the clock itself, so it turns false on time
/// even if the background task is late.
///
/// Dropping the keeper stops renewing but does **not** release the lease:
/// drop may run while unwinding from a panic or outside an async context,
/// where a network call cannot be made (or awaited), and a holder that
/// panicked mid-work should not hand over what may be half-done state
/// before its lease runs out anyway. The lease then expires after its ttl.
/// Call [`LeaseKeeper::release`] to hand the lock over at once.
pub struct LeaseKeeper {
    client: LockClient,
    name: String,
    fence: i64,
    shared: Arc<Shared>,
    lost_rx: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

struct Shared {
    state: Mutex<KeeperState>,
    lost_tx: watch::Sender<bool>,
}

struct KeeperState {
    grant: Grant,
    valid_until: Instant,
    /// Why the lease was lost, once it is.
    lost: Option<String>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, KeeperState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lose(&self, why: String) {
        {
            let mut st = self.state();
            if st.lost.is_none() {
                st.lost = Some(why);
            }
        }
        self.lost_tx.send_replace(true);
    }

    /// Takes a renewal's grant, unless the deadline passed meanwhile (loss is
    /// final). Returns whether the lease is still held.
    fn renewed(&self, grant: Grant, valid_until: Instant) -> bool {
        let mut st = self.state();
        if st.lost.is_some() {
            return false;
        }
        if Instant::now() >= st.valid_until {
            drop(st);
            self.lose("the renewal succeeded only after the deadline".into());
            return false;
        }
        st.grant = grant;
        st.valid_until = st.valid_until.max(valid_until);
        true
    }
}

impl fmt::Debug for LeaseKeeper {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseKeeper")
            .field("name", &self.name)
            .field("fence", &self.fence)
            .field("held", &self.is_held())
            .finish()
    }
}

impl LeaseKeeper {
    /// Starts keeping `grant` alive, renewing it for `ttl` every `ttl / 3`.
    ///
    /// `acquired_at` is when the request that produced `grant` was **sent**
    /// (take `Instant::now()` just before calling
    /// [`acquire`](LockClient::acquire)); the first deadline is
    /// `acquired_at + grant.ttl_ms − drift`. If the acquire waited long, that
    /// deadline may be near or past: renew first, or use
    /// [`LockClient::acquire_keeper`], which does.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime (it spawns the renewing task).
    pub fn start(client: LockClient, grant: Grant, ttl: Duration, acquired_at: Instant) -> Self {
        let name = grant.name.clone();
        let fence = grant.fence;
        let (lost_tx, lost_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            state: Mutex::new(KeeperState {
                valid_until: valid_until(acquired_at, &grant),
                grant,
                lost: None,
            }),
            lost_tx,
        });
        let task = tokio::spawn(keep(
            client.clone(),
            name.clone(),
            fence,
            ttl,
            acquired_at,
            shared.clone(),
        ));
        Self {
            client,
            name,
            fence,
            shared,
            lost_rx,
            task,
        }
    }

    /// The lock name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fence of the lease; renewals keep it.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// The current token to send as `X-Fence-Token`. With JWT tokens it
    /// changes on renewal (a new expiry), so read it for each write.
    pub fn token(&self) -> String {
        self.shared.state().grant.token.clone()
    }

    /// Whether the lease can still be trusted: not lost, and its deadline
    /// (checked against the clock now) not passed.
    pub fn is_held(&self) -> bool {
        let st = self.shared.state();
        st.lost.is_none() && Instant::now() < st.valid_until
    }

    /// The current deadline: the lease is held at most until then, unless
    /// renewed again before.
    pub fn valid_until(&self) -> Instant {
        self.shared.state().valid_until
    }

    /// Why the lease was lost, once it is.
    pub fn loss_reason(&self) -> Option<String> {
        self.shared.state().lost.clone()
    }

    /// Resolves once the lease is lost (at once if it already is). The
    /// future does not borrow the keeper, so it can be moved into a task.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.lost_rx.clone();
        async move {
            // An error means the keeper is gone: not held either.
            let _ = rx.wait_for(|lost| *lost).await;
        }
    }

    /// A watch on loss: the value turns `true` when the lease is lost.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.lost_rx.clone()
    }

    /// Stops renewing and releases the lease, so a waiting acquirer gets the
    /// lock at once. Fails with [`Error::NotHolder`] if the lease had already
    /// ended; the keeper counts as lost from here on either way.
    pub async fn release(self) -> Result<(), Error> {
        self.task.abort();
        let lease = self.shared.state().grant.lease.clone();
        self.shared.lose("released".into());
        self.client.release(&self.name, &lease).await
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        // Stops renewing only; see the type's documentation for why the
        // lease is left to expire rather than released.
        self.task.abort();
    }
}

/// The renewing task.
async fn keep(
    client: LockClient,
    name: String,
    fence: i64,
    ttl: Duration,
    acquired_at: Instant,
    shared: Arc<Shared>,
) {
    let every = (ttl / 3).max(Duration::from_millis(1));
    let retry = (ttl / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut next = acquired_at + every;
    loop {
        let (deadline, lease) = {
            let st = shared.state();
            if st.lost.is_some() {
                return;
            }
            (st.valid_until, st.grant.lease.clone())
        };
        tokio::time::sleep_until(next.min(deadline).into()).await;
        let sent = Instant::now();
        if sent >= deadline {
            tracing::info!(lock = %name, fence, "lease lost: no successful renewal before the deadline");
            shared.lose("no successful renewal before the deadline".into());
            return;
        }
        // Never wait for an answer past the deadline.
        let timeout = (deadline - sent).min(client.timeout);
        match client.renew_within(&name, &lease, ttl, timeout).await {
            Ok(grant) if grant.fence != fence => {
                tracing::warn!(lock = %name, fence, renewed = grant.fence, "renewal changed the fence; treating the lease as lost");
                shared.lose(format!(
                    "the renewal answered fence {} instead of {fence}",
                    grant.fence
                ));
                return;
            }
            Ok(grant) => {
                let granted = Duration::from_millis(grant.ttl_ms).min(ttl);
                let until = sent + granted.saturating_sub(drift(granted));
                if !shared.renewed(grant, until) {
                    tracing::info!(lock = %name, fence, "lease lost: the renewal came too late");
                    return;
                }
                tracing::debug!(lock = %name, fence, "lease renewed");
                next = sent + every;
            }
            Err(e) if e.is_transient() => {
                tracing::warn!(lock = %name, fence, error = %e, "lease renewal failed; retrying until the deadline");
                next = Instant::now() + retry;
            }
            Err(e) => {
                tracing::info!(lock = %name, fence, error = %e, "lease lost: renewal refused");
                shared.lose(format!("renewal refused: {e}"));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_one_segment() {
        assert_eq!(lock_path("doc:a", ""), "/_fencegate/locks/doc%3Aa");
        assert_eq!(
            lock_path("jobs/nightly", "/renew"),
            "/_fencegate/locks/jobs%2Fnightly/renew"
        );
        assert_eq!(lock_path("..", ""), "/_fencegate/locks/%2E%2E");
        assert_eq!(
            lock_path("a b?c#d%e-f_g~h", ""),
            "/_fencegate/locks/a%20b%3Fc%23d%25e-f_g~h"
        );
        assert_eq!(lock_path("é", ""), "/_fencegate/locks/%C3%A9");
    }

    #[test]
    fn base_urls() {
        assert_eq!(
            normalize_base("http://127.0.0.1:8080").unwrap(),
            "http://127.0.0.1:8080"
        );
        assert_eq!(
            normalize_base("http://gw.local/prefix/").unwrap(),
            "http://gw.local/prefix"
        );
        assert_eq!(
            normalize_base("https://gw.local:8443/").unwrap(),
            "https://gw.local:8443"
        );
        for bad in ["ftp://gw", "127.0.0.1:8080", "http://gw/?q=1", "", "/x"] {
            assert!(
                matches!(normalize_base(bad), Err(Error::InvalidBaseUrl(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn grant_debug_hides_the_lease() {
        let g: Grant = serde_json::from_value(json!({
            "name": "doc:a", "lease": "0123456789abcdef0123456789abcdef",
            "fence": 7, "token": "7", "ttl_ms": 5000,
            "expires_at": "2030-01-01T00:00:00Z"
        }))
        .unwrap();
        let shown = format!("{g:?}");
        assert!(!shown.contains("0123456789abcdef"), "{shown}");
        assert!(shown.contains("fence: 7"), "{shown}");
    }

    fn answer(status: u16, headers: &[(&str, &str)], body: Value) -> Answer {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(
                header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        Answer {
            status: StatusCode::from_u16(status).unwrap(),
            headers: map,
            body: Bytes::from(body.to_string()),
        }
    }

    #[test]
    fn problems_map_to_errors() {
        let e = answer(
            409,
            &[],
            json!({"type": "urn:fencegate:problem:lock-held", "expires_in_ms": 1200}),
        )
        .into_error();
        assert!(
            matches!(e, Error::Held { expires_in: Some(d) } if d == Duration::from_millis(1200))
        );
        let e = answer(
            409,
            &[],
            json!({"type": "urn:fencegate:problem:not-holder"}),
        )
        .into_error();
        assert!(matches!(e, Error::NotHolder));
        let e = answer(503, &[("retry-after", "3")], json!({})).into_error();
        assert!(
            matches!(e, Error::Unavailable { retry_after: Some(d) } if d == Duration::from_secs(3))
        );
        let e = answer(
            400,
            &[],
            json!({"type": "urn:fencegate:problem:bad-lock-request", "field": "ttl_ms", "detail": "ttl_ms: too big"}),
        )
        .into_error();
        assert!(
            matches!(&e, Error::BadRequest { field: Some(f), detail } if f == "ttl_ms" && detail == "ttl_ms: too big")
        );
        let e = answer(409, &[], json!({"type": "other"})).into_error();
        assert!(matches!(e, Error::Unexpected { status: 409, .. }));
        let e = answer(502, &[], json!("bad gateway")).into_error();
        assert!(e.is_transient());
    }

    #[test]
    fn retry_after_as_date() {
        let later = (Utc::now() + chrono::Duration::seconds(60)).to_rfc2822();
        let d = parse_retry_after(&HeaderValue::from_str(&later).unwrap()).unwrap();
        assert!(d > Duration::from_secs(50) && d <= Duration::from_secs(60));
        assert_eq!(
            parse_retry_after(&HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT")),
            Some(Duration::ZERO)
        );
    }
}
