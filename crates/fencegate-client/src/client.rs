//! [`LockClient`]: the four calls of the lock API, over http or https.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde_json::{json, Value};

use crate::answer::{Answer, MAX_ANSWER};
use crate::connect::{tls_connector, Connector};
use crate::keeper::valid_until;
use crate::{Error, Grant, LeaseKeeper, Status};

/// Default time limit for one request (plus the `wait` of an acquire).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything but RFC 3986 unreserved characters, and `.` too (so that a
/// name of `.` or `..` is never taken for a dot-segment): a lock name is
/// always exactly one path segment, whatever `/`, `:`, `?` or `%` it holds.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'~');

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

    pub(crate) async fn renew_within(
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
}
