//! Errors the gateway answers with, tagged by where they came from, and their
//! one mapping to HTTP: every answer the gateway itself produces is an RFC 9457
//! `application/problem+json` document.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use serde_json::{json, Map, Value};

/// Media type of problem documents.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Everything that can stop a request at the gateway.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The client sent something we refuse; nothing was forwarded.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The fence store could not decide; we fail closed.
    #[error("fence store unavailable: {0}")]
    Store(#[from] crate::store::StoreError),
    /// The upstream failed after the fence check passed.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// A bug of ours; the string says where.
    #[error("internal error: {0}")]
    Internal(&'static str),
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no route matches {path}")]
    NoRoute { path: String },
    #[error("{0}")]
    BadPath(&'static str),
    /// A request head the server refused before any route saw it.
    #[error(transparent)]
    Head(#[from] crate::server::wire::HeadError),
    /// A fenced write whose path back ends may resolve differently.
    #[error("the path {0}")]
    AmbiguousPath(&'static str),
    /// A fenced write whose key part from the query or a header is missing,
    /// repeated or ambiguous.
    #[error(transparent)]
    AmbiguousKey(#[from] crate::routing::KeyError),
    #[error("method {method} is not allowed on route {route}")]
    MethodNotAllowed { method: String, route: String },
    #[error("missing X-Fence-Token for {key}")]
    MissingToken { key: String },
    #[error("malformed X-Fence-Token: {0}")]
    MalformedToken(&'static str),
    #[error("invalid JWT fence token: {0}")]
    InvalidJwt(String),
    #[error("JWT fence token for {presented}, not {expected}")]
    JwtForOtherKey { expected: String, presented: String },
    #[error("stale token {presented} for {key}; highest is {highest}")]
    StaleToken {
        key: String,
        presented: i64,
        highest: i64,
    },
    /// `token = "issued"`: above every fence the lock API granted.
    #[error("token {presented} for {key} was never issued; the highest is {highest_issued}")]
    UnissuedToken {
        key: String,
        presented: i64,
        highest_issued: i64,
    },
    #[error("request body larger than {limit} bytes")]
    BodyTooLarge { limit: u64 },
    /// A missing or malformed `Idempotency-Key`.
    #[error(transparent)]
    IdempotencyKey(#[from] crate::idempotency::KeyError),
    /// The same `Idempotency-Key` with another request.
    #[error("the idempotency key was used with another request")]
    IdempotencyReused,
    /// The first request with this key is still in flight.
    #[error("the first request with this idempotency key is in flight")]
    IdempotencyInProgress { retry_after: Duration },
    /// The first request may have reached the upstream, but its answer was
    /// not stored.
    #[error("the outcome of the first request with this idempotency key is unknown")]
    IdempotencyOutcomeUnknown,
    /// The client left while its write waited at the gate; nobody reads this.
    #[error("the client left before its write was started")]
    ClientGone,
    #[error("{0}")]
    BadRequest(&'static str),
}

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// `sent`: some of the request may have reached the upstream.
    #[error("upstream of route {route} unreachable: {detail}")]
    Unreachable {
        route: String,
        detail: String,
        sent: bool,
    },
    #[error("upstream of route {route} did not answer within {timeout:?}")]
    Timeout { route: String, timeout: Duration },
}

/// A problem document under construction.
pub struct Problem {
    status: StatusCode,
    kind: &'static str,
    title: &'static str,
    detail: String,
    extra: Map<String, Value>,
    headers: Vec<(header::HeaderName, HeaderValue)>,
}

impl Problem {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            title,
            detail: detail.into(),
            extra: Map::new(),
            headers: Vec::new(),
        }
    }

    pub fn with(mut self, field: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(field.to_string(), value.into());
        self
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn header(mut self, name: header::HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// `Retry-After` in whole seconds, at least 1 (0 would invite a retry
    /// at once).
    pub fn retry_after(self, after: std::time::Duration) -> Self {
        self.header(
            header::RETRY_AFTER,
            HeaderValue::from(after.as_secs().max(1)),
        )
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = Map::new();
        body.insert(
            "type".into(),
            json!(format!("urn:fencegate:problem:{}", self.kind)),
        );
        body.insert("title".into(), json!(self.title));
        body.insert("status".into(), json!(self.status.as_u16()));
        body.insert("detail".into(), json!(self.detail));
        body.extend(self.extra);
        let mut resp = (self.status, Value::Object(body).to_string()).into_response();
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        for (name, value) in self.headers {
            resp.headers_mut().insert(name, value);
        }
        resp
    }
}

/// The problem document for a refused credential or permission: 401 with
/// `WWW-Authenticate: Bearer`, or 403.
pub fn auth_problem(e: &crate::auth::AuthError) -> Problem {
    match e {
        crate::auth::AuthError::Unauthenticated(why) => Problem::new(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "Authentication required",
            format!("{why}: send Authorization: Bearer KEY (or a known client certificate)"),
        )
        .header(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")),
        crate::auth::AuthError::Forbidden(why) => {
            Problem::new(StatusCode::FORBIDDEN, "forbidden", "Forbidden", why.clone())
        }
    }
}

impl GatewayError {
    /// The status code its problem document has.
    pub fn status(&self) -> StatusCode {
        self.to_problem(Duration::from_secs(1)).status()
    }

    /// The problem document for this error: the single place where error
    /// origins become status codes.
    pub fn to_problem(&self, retry_after: Duration) -> Problem {
        use ClientError as C;
        match self {
            GatewayError::Client(c) => match c {
                C::NoRoute { path } => Problem::new(
                    StatusCode::NOT_FOUND,
                    "no-route",
                    "No route",
                    format!("no configured route matches the path {path}"),
                ),
                C::BadPath(why) => {
                    Problem::new(StatusCode::BAD_REQUEST, "bad-path", "Bad request path", *why)
                }
                C::AmbiguousPath(why) => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "ambiguous-path",
                    "Ambiguous path",
                    format!(
                        "the path {why}, so it may name another resource at the upstream than the one its key names; send the plain spelling"
                    ),
                ),
                C::AmbiguousKey(e) => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "ambiguous-key",
                    "Ambiguous resource key",
                    format!("the resource key cannot be built unambiguously: {e}"),
                ),
                C::MethodNotAllowed { method, route } => Problem::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method-not-allowed",
                    "Method not allowed",
                    format!(
                        "{method} is neither a fenced method of route '{route}' nor a safe method (GET, HEAD, OPTIONS); the gateway forwards no unchecked writes"
                    ),
                ),
                C::MissingToken { key } => Problem::new(
                    StatusCode::PRECONDITION_REQUIRED,
                    "missing-token",
                    "Fencing token required",
                    format!("this write needs an X-Fence-Token header for resource '{key}'"),
                )
                .with("resource_key", key.as_str()),
                C::MalformedToken(why) => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "malformed-token",
                    "Malformed fencing token",
                    format!("X-Fence-Token must be 1 to 19 ASCII digits: {why}"),
                ),
                C::InvalidJwt(why) => Problem::new(
                    StatusCode::UNAUTHORIZED,
                    "invalid-token",
                    "Invalid fencing token",
                    format!("the X-Fence-Token JWT was refused: {why}"),
                ),
                C::JwtForOtherKey {
                    expected,
                    presented,
                } => Problem::new(
                    StatusCode::FORBIDDEN,
                    "token-for-other-resource",
                    "Token for another resource",
                    format!(
                        "the X-Fence-Token JWT was issued for resource '{presented}', not '{expected}'"
                    ),
                )
                .with("resource_key", expected.as_str()),
                C::StaleToken {
                    key,
                    presented,
                    highest,
                } => Problem::new(
                    StatusCode::CONFLICT,
                    "stale-token",
                    "Stale fencing token",
                    format!(
                        "token {presented} is lower than {highest}, the highest token recorded for resource '{key}'; the lock was taken over by a newer holder"
                    ),
                )
                .with("resource_key", key.as_str())
                .with("presented_token", *presented)
                .with("highest_token", *highest),
                C::UnissuedToken {
                    key,
                    presented,
                    highest_issued,
                } => Problem::new(
                    StatusCode::FORBIDDEN,
                    "unissued-token",
                    "Token never issued",
                    format!(
                        "token {presented} is above {highest_issued}, the highest fence the lock API granted for '{key}': it was never issued, so it is refused and not recorded"
                    ),
                )
                .with("resource_key", key.as_str())
                .with("presented_token", *presented)
                .with("highest_issued", *highest_issued),
                C::BodyTooLarge { limit } => Problem::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body-too-large",
                    "Request body too large",
                    format!("the request body exceeds the limit of {limit} bytes"),
                ),
                C::Head(e) => {
                    use crate::server::wire::HeadError as H;
                    let (status, kind, title) = match e {
                        H::TooLarge => (
                            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                            "head-too-large",
                            "Request head too large",
                        ),
                        H::Timeout => (
                            StatusCode::REQUEST_TIMEOUT,
                            "head-timeout",
                            "Request head too slow",
                        ),
                        H::Malformed | H::Length | H::Coding => {
                            (StatusCode::BAD_REQUEST, "bad-request", "Bad request")
                        }
                    };
                    Problem::new(status, kind, title, e.to_string())
                }
                C::BadRequest(why) => {
                    Problem::new(StatusCode::BAD_REQUEST, "bad-request", "Bad request", *why)
                }
                C::IdempotencyKey(e @ crate::idempotency::KeyError::Missing) => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "idempotency-key-missing",
                    "Idempotency-Key required",
                    e.to_string(),
                ),
                C::IdempotencyKey(e) => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "idempotency-key-malformed",
                    "Malformed Idempotency-Key",
                    format!("the Idempotency-Key header {e}"),
                ),
                C::IdempotencyReused => Problem::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency-key-reused",
                    "Idempotency-Key reused",
                    "this Idempotency-Key was used with another request (method, path and query, Content-Type, X-Fence-Token or body differ); use a new key for a new request",
                ),
                C::IdempotencyInProgress { retry_after } => Problem::new(
                    StatusCode::CONFLICT,
                    "idempotency-in-progress",
                    "Request in progress",
                    "the first request with this Idempotency-Key is still being processed; retry later for its answer",
                )
                .retry_after(*retry_after),
                C::IdempotencyOutcomeUnknown => Problem::new(
                    StatusCode::CONFLICT,
                    "idempotency-outcome-unknown",
                    "Outcome unknown",
                    "the first request with this Idempotency-Key may have reached the upstream, but its answer was not stored; it will not be sent again: read the resource to learn what happened, then decide",
                ),
                C::ClientGone => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "client-gone",
                    "Client gone",
                    "the client left before its write was started; nothing was forwarded",
                ),
            },
            GatewayError::Store(crate::store::StoreError::KeyBusy(waited)) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "key-busy",
                "Resource key busy",
                format!(
                    "an older write to this resource key is still in flight on another instance; waited {} ms (key_lock_wait_ms); nothing was forwarded",
                    waited.as_millis()
                ),
            )
            .retry_after(retry_after),
            GatewayError::Store(crate::store::StoreError::Late) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "decision-late",
                "Decision too late",
                "the write was admitted, but this instance stalled before it could be forwarded in time (within its in-flight marker, which other instances go by, or within its Idempotency-Key record's time in flight); nothing was forwarded",
            )
            .retry_after(retry_after),
            GatewayError::Store(crate::store::StoreError::ReadOnly(why)) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Fence store unavailable",
                format!(
                    "the fence store is read-only ({why}): a failover may be in progress; fenced writes wait for a writable primary; nothing was forwarded"
                ),
            )
            .retry_after(retry_after),
            GatewayError::Store(crate::store::StoreError::NotOwner) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Fence store unavailable",
                "this single-mode instance does not hold the store's single-writer lock on a writable primary (lost with its connection, or during a failover), so it decides no fenced write until it takes the lock again; nothing was forwarded",
            )
            .retry_after(retry_after),
            GatewayError::Store(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Fence store unavailable",
                "the fence store could not be reached, so the token cannot be checked; nothing was forwarded",
            )
            .retry_after(retry_after),
            GatewayError::Internal(what) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                format!("the gateway failed internally ({what}); see its log"),
            ),
            GatewayError::Upstream(UpstreamError::Unreachable { route, detail, .. }) => Problem::new(
                StatusCode::BAD_GATEWAY,
                "upstream-unreachable",
                "Upstream unreachable",
                format!("the upstream of route '{route}' could not be reached or broke off the exchange: {detail}"),
            ),
            GatewayError::Upstream(UpstreamError::Timeout { route, timeout }) => Problem::new(
                StatusCode::GATEWAY_TIMEOUT,
                "upstream-timeout",
                "Upstream timeout",
                format!(
                    "the upstream of route '{route}' did not answer within {} ms",
                    timeout.as_millis()
                ),
            ),
        }
    }
}
