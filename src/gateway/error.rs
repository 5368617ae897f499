//! Errors the gateway answers with, tagged by where they came from, and their
//! one mapping to HTTP: every answer the gateway itself produces is an RFC 9457
//! `application/problem+json` document.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use serde_json::Value;

use crate::store::StoreError;

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
    Head(#[from] crate::http1::server::HeadError),
    /// A fenced write whose path back ends may resolve differently.
    #[error("the path {0}")]
    AmbiguousPath(&'static str),
    /// A fenced write whose key part from the query or a header is missing,
    /// repeated or ambiguous.
    #[error(transparent)]
    AmbiguousKey(#[from] crate::fencing::routing::KeyPartError),
    /// `allow`: the route's methods, for the answer's `Allow`.
    #[error("method {method} is not allowed on route {route}")]
    MethodNotAllowed {
        method: String,
        route: String,
        allow: HeaderValue,
    },
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
    IdempotencyKey(#[from] crate::idempotency::IdempotencyKeyError),
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
    /// The `Connection` header names a header the gateway relies on (the
    /// token, the idempotency key, the credentials, a key part): a proxy
    /// would remove it before forwarding.
    #[error("the Connection header names {0}, which the gateway relies on")]
    ProtectedHeader(String),
    /// More than one `Authorization` header: which one counts is not clear.
    #[error("more than one Authorization header")]
    AmbiguousCredentials,
    /// A fenced write with a header name that has `_`: CGI, WSGI and Rack
    /// read `_` and `-` as one, so the application may read it in place of
    /// a header the gateway checked. `shadows`: the header the gateway
    /// relies on that it would stand in for (a key part, the token...).
    #[error("the header name {name} has '_'")]
    AmbiguousHeader {
        name: String,
        shadows: Option<String>,
    },
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
    /// Members beyond the standard four, in the order added; a later one
    /// of the same name replaces an earlier one.
    extra: Vec<(&'static str, Value)>,
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
            extra: Vec::new(),
            headers: Vec::new(),
        }
    }

    pub fn with(mut self, field: &'static str, value: impl Into<Value>) -> Self {
        self.extra.retain(|(name, _)| *name != field);
        self.extra.push((field, value.into()));
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

/// One member's value in a problem document.
enum Member<'a> {
    /// `type`: the URN of the problem's kind.
    Kind(&'static str),
    Str(&'a str),
    Status(u16),
    Json(&'a Value),
}

impl Problem {
    /// The document: its members in the order of their names, extras
    /// replacing standard members of the same name, which is what a JSON
    /// map of them gives, written without building one (a large part of
    /// a refusal's cost) and without
    /// escaping strings that need none (see `json_str`).
    fn document(&self) -> Vec<u8> {
        let mut members: Vec<(&str, Member<'_>)> = Vec::with_capacity(4 + self.extra.len());
        for (name, member) in [
            ("type", Member::Kind(self.kind)),
            ("title", Member::Str(self.title)),
            ("status", Member::Status(self.status.as_u16())),
            ("detail", Member::Str(&self.detail)),
        ] {
            if !self.extra.iter().any(|(n, _)| *n == name) {
                members.push((name, member));
            }
        }
        members.extend(self.extra.iter().map(|(n, v)| (*n, Member::Json(v))));
        members.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut out = Vec::with_capacity(192 + self.detail.len());
        out.push(b'{');
        for (i, (name, member)) in members.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            json_str(&mut out, name);
            out.push(b':');
            match member {
                Member::Kind(kind) if !needs_escape(kind) => {
                    out.extend_from_slice(b"\"urn:fencegate:problem:");
                    out.extend_from_slice(kind.as_bytes());
                    out.push(b'"');
                }
                Member::Kind(kind) => {
                    json_value(&mut out, &format!("urn:fencegate:problem:{kind}"))
                }
                Member::Str(v) => json_str(&mut out, v),
                Member::Status(v) => json_value(&mut out, v),
                Member::Json(Value::String(v)) => json_str(&mut out, v),
                Member::Json(v) => json_value(&mut out, v),
            }
        }
        out.push(b'}');
        out
    }
}

/// Whether a string has a byte JSON must escape (serde_json escapes
/// exactly these: control characters, `"` and `\`). One pass with no
/// early exit.
fn needs_escape(s: &str) -> bool {
    s.bytes().fold(false, |seen, b| {
        seen | (b < 0x20) | (b == b'"') | (b == b'\\')
    })
}

/// `s` as a JSON string: copied whole when nothing in it needs escaping
/// (nearly always), else escaped by serde_json, whose per-byte escaping
/// was the largest item of a refusal.
fn json_str(out: &mut Vec<u8>, s: &str) {
    if needs_escape(s) {
        json_value(out, s);
    } else {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    }
}

/// `v` written by serde_json.
fn json_value(out: &mut Vec<u8>, v: &(impl serde::Serialize + ?Sized)) {
    // Writing into a Vec fails only for a map key that is not a string,
    // and no value here has one.
    if let Err(e) = serde_json::to_writer(out, v) {
        tracing::error!(error = %e, "a problem document could not be written");
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut resp = Response::new(axum::body::Body::from(self.document()));
        *resp.status_mut() = self.status;
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        for (name, value) in self.headers {
            resp.headers_mut().insert(name, value);
        }
        resp
    }
}

impl Problem {
    /// The problem as a gRPC refusal (see [`super::grpc`]): trailers-only,
    /// with the problem's own headers (`Retry-After`, `Allow`) kept.
    pub fn into_grpc(self) -> Response {
        let mut resp = Response::new(axum::body::Body::empty());
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        h.insert(
            "grpc-status",
            HeaderValue::from(u16::from(super::grpc::code(self.status))),
        );
        h.insert("grpc-message", super::grpc::message(&self.detail));
        h.insert("fencegate-problem", HeaderValue::from_static(self.kind));
        for (name, value) in self.headers {
            h.insert(name, value);
        }
        resp
    }
}

/// 400 `ambiguous-credentials`: more than one `Authorization` header, on
/// a proxied request ([`ClientError::AmbiguousCredentials`]) or a call of
/// the lock API or an admin action ([`crate::auth::AuthError::Ambiguous`]).
fn ambiguous_credentials(status: StatusCode) -> Problem {
    Problem::new(
        status,
        "ambiguous-credentials",
        "Ambiguous credentials",
        "the request carries more than one Authorization header; servers disagree on which one counts, so it is refused and nothing was forwarded or done: send one",
    )
}

/// The answer to a request the server refused before any service saw it.
pub fn refused_head(e: crate::http1::server::HeadError) -> Response {
    GatewayError::from(ClientError::Head(e))
        .to_problem(Duration::from_secs(1))
        .into_response()
}

/// The problem document for a refused credential or permission: 401 with
/// `WWW-Authenticate: Bearer`, 403, or 400 for more than one credential.
pub fn auth_problem(e: &crate::auth::AuthError) -> Problem {
    match e {
        crate::auth::AuthError::Ambiguous => ambiguous_credentials(StatusCode::BAD_REQUEST),
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
    /// The status code of this error's answer: the single place where
    /// error origins become status codes (its problem document takes it
    /// from here). Without writing the document: a refusal is counted,
    /// logged and noted by its status, and writing a second document for
    /// that was a measurable part of a stale write's cost.
    pub fn status(&self) -> StatusCode {
        use ClientError as C;
        match self {
            GatewayError::Client(c) => match c {
                C::NoRoute { .. } => StatusCode::NOT_FOUND,
                C::BadPath(_)
                | C::AmbiguousPath(_)
                | C::AmbiguousKey(_)
                | C::MalformedToken(_)
                | C::BadRequest(_)
                | C::IdempotencyKey(_)
                | C::ClientGone
                | C::ProtectedHeader(_)
                | C::AmbiguousCredentials
                | C::AmbiguousHeader { .. } => StatusCode::BAD_REQUEST,
                C::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
                C::MissingToken { .. } => StatusCode::PRECONDITION_REQUIRED,
                C::InvalidJwt(_) => StatusCode::UNAUTHORIZED,
                C::JwtForOtherKey { .. } | C::UnissuedToken { .. } => StatusCode::FORBIDDEN,
                C::StaleToken { .. }
                | C::IdempotencyInProgress { .. }
                | C::IdempotencyOutcomeUnknown => StatusCode::CONFLICT,
                C::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
                C::Head(h) => h.status(),
                C::IdempotencyReused => StatusCode::UNPROCESSABLE_ENTITY,
            },
            GatewayError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            GatewayError::Upstream(UpstreamError::Unreachable { .. }) => StatusCode::BAD_GATEWAY,
            GatewayError::Upstream(UpstreamError::Timeout { .. }) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The problem document for this error, with [`GatewayError::status`]'s
    /// status.
    pub fn to_problem(&self, retry_after: Duration) -> Problem {
        let status = self.status();
        match self {
            GatewayError::Client(c) => c.to_problem(status),
            GatewayError::Store(e) => store_problem(e, status).retry_after(retry_after),
            GatewayError::Internal(what) => Problem::new(
                status,
                "internal",
                "Internal error",
                format!("the gateway failed internally ({what}); see its log"),
            ),
            GatewayError::Upstream(UpstreamError::Unreachable { route, detail, .. }) => Problem::new(
                status,
                "upstream-unreachable",
                "Upstream unreachable",
                format!("the upstream of route '{route}' could not be reached or broke off the exchange: {detail}"),
            ),
            GatewayError::Upstream(UpstreamError::Timeout { route, timeout }) => Problem::new(
                status,
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

impl ClientError {
    /// The problem document of a refusal of the request itself.
    pub fn to_problem(&self, status: StatusCode) -> Problem {
        use ClientError as C;
        match self {
        C::NoRoute { path } => Problem::new(
            status,
            "no-route",
            "No route",
            format!("no configured route matches the path {path}"),
        ),
        C::BadPath(why) => {
            Problem::new(status, "bad-path", "Bad request path", *why)
        }
        C::AmbiguousPath(why) => Problem::new(
            status,
            "ambiguous-path",
            "Ambiguous path",
            format!(
                "the path {why}, so it may name another resource at the upstream than the one its key names; send the plain spelling"
            ),
        ),
        C::AmbiguousKey(e) => Problem::new(
            status,
            "ambiguous-key",
            "Ambiguous resource key",
            format!("the resource key cannot be built unambiguously: {e}"),
        ),
        C::MethodNotAllowed {
            method,
            route,
            allow,
        } => Problem::new(
            status,
            "method-not-allowed",
            "Method not allowed",
            format!(
                "{method} is neither a fenced method of route '{route}' nor a safe method (GET, HEAD, OPTIONS); the gateway forwards no unchecked writes"
            ),
        )
        .header(header::ALLOW, allow.clone()),
        C::MissingToken { .. }
                | C::MalformedToken(_)
                | C::InvalidJwt(_)
                | C::JwtForOtherKey { .. }
                | C::StaleToken { .. }
                | C::UnissuedToken { .. } => self.token_problem(status).unwrap_or_else(|| self.plain(status)),
        C::BodyTooLarge { limit } => Problem::new(
            status,
            "body-too-large",
            "Request body too large",
            format!("the request body exceeds the limit of {limit} bytes"),
        ),
        C::Head(e) => head_problem(e, status),
        C::BadRequest(why) => {
            Problem::new(status, "bad-request", "Bad request", *why)
        }
        C::IdempotencyKey(_)
                | C::IdempotencyReused
                | C::IdempotencyInProgress { .. }
                | C::IdempotencyOutcomeUnknown => self
                .idempotency_problem(status)
                .unwrap_or_else(|| self.plain(status)),
        C::ClientGone => Problem::new(
            status,
            "client-gone",
            "Client gone",
            "the client left before its write was started; nothing was forwarded",
        ),
        C::ProtectedHeader(name) => Problem::new(
            status,
            "protected-header",
            "Protected header named in Connection",
            format!(
                "the Connection header names '{name}', which the gateway relies on (the fencing token, the Idempotency-Key, the credentials and the route's key parts are forwarded as checked), so it would be removed before forwarding; nothing was forwarded: send the request without '{name}' in Connection"
            ),
        ),
        C::AmbiguousCredentials => ambiguous_credentials(status),
        C::AmbiguousHeader { name, shadows } => Problem::new(
            status,
            "ambiguous-header",
            "Ambiguous header name",
            match shadows {
                Some(checked) => format!(
                    "the header name '{name}' has '_': CGI, WSGI and Rack read '_' and '-' as one, so the application may read it as '{checked}', which the gateway checked for this write (its fencing token, Idempotency-Key, credentials or resource key); nothing was forwarded: send the request without '{name}'"
                ),
                None => format!(
                    "the header name '{name}' has '_': CGI, WSGI and Rack read '_' and '-' as one, so the application may read it in place of another header; fenced writes carry no such names, and nothing was forwarded: send the request without '{name}'"
                ),
            },
        ),
        }
    }

    /// A problem that only says what the error says: the answer of a
    /// group's helper to an error it does not know (none reaches it).
    fn plain(&self, status: StatusCode) -> Problem {
        Problem::new(status, "bad-request", "Bad request", self.to_string())
    }

    /// The problem of a missing, malformed, stale or unissued token.
    fn token_problem(&self, status: StatusCode) -> Option<Problem> {
        use ClientError as C;
        Some(match self {
        C::MissingToken { key } => Problem::new(
            status,
            "missing-token",
            "Fencing token required",
            format!("this write needs an X-Fence-Token header for resource '{key}'"),
        )
        .with("resource_key", key.as_str()),
        C::MalformedToken(why) => Problem::new(
            status,
            "malformed-token",
            "Malformed fencing token",
            format!("X-Fence-Token must be 1 to 19 ASCII digits: {why}"),
        ),
        C::InvalidJwt(why) => Problem::new(
            status,
            "invalid-token",
            "Invalid fencing token",
            format!("the X-Fence-Token JWT was refused: {why}"),
        ),
        C::JwtForOtherKey {
            expected,
            presented,
        } => Problem::new(
            status,
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
            status,
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
            status,
            "unissued-token",
            "Token never issued",
            if *highest_issued == 0 {
                format!(
                    "the lock API never granted a fence for '{key}', so no token for it was issued, {presented} included: it is refused and not recorded; acquire the lock first"
                )
            } else {
                format!(
                    "token {presented} is above {highest_issued}, the highest fence the lock API granted for '{key}': it was never issued, so it is refused and not recorded"
                )
            },
        )
        .with("resource_key", key.as_str())
        .with("presented_token", *presented)
        .with("highest_issued", *highest_issued),
            _ => return None,
        })
    }

    /// The problem of an Idempotency-Key the request or its record refuses.
    fn idempotency_problem(&self, status: StatusCode) -> Option<Problem> {
        use ClientError as C;
        Some(match self {
        C::IdempotencyKey(e @ crate::idempotency::IdempotencyKeyError::Missing) => Problem::new(
            status,
            "idempotency-key-missing",
            "Idempotency-Key required",
            e.to_string(),
        ),
        C::IdempotencyKey(e) => Problem::new(
            status,
            "idempotency-key-malformed",
            "Malformed Idempotency-Key",
            format!("the Idempotency-Key header {e}"),
        ),
        C::IdempotencyReused => Problem::new(
            status,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            "this Idempotency-Key was used with another request (method, path and query, Content-Type, X-Fence-Token or body differ); use a new key for a new request",
        ),
        C::IdempotencyInProgress { retry_after } => Problem::new(
            status,
            "idempotency-in-progress",
            "Request in progress",
            "the first request with this Idempotency-Key is still being processed; retry later for its answer",
        )
        .retry_after(*retry_after),
        C::IdempotencyOutcomeUnknown => Problem::new(
            status,
            "idempotency-outcome-unknown",
            "Outcome unknown",
            "the first request with this Idempotency-Key may have reached the upstream, but its answer was not stored; it will not be sent again: read the resource to learn what happened, then decide",
        ),
            _ => return None,
        })
    }
}

/// The problem document of a request head the server refused.
fn head_problem(e: &crate::http1::server::HeadError, status: StatusCode) -> Problem {
    use crate::http1::server::HeadError as H;
    let (kind, title) = match e {
        H::TooLarge => ("head-too-large", "Request head too large"),
        H::Timeout => ("head-timeout", "Request head too slow"),
        H::UnsupportedCoding => ("unsupported-coding", "Unsupported transfer coding"),
        _ => ("bad-request", "Bad request"),
    };
    Problem::new(status, kind, title, e.to_string())
}

/// The problem document of a store that could not decide; every one
/// says to retry (the caller adds `Retry-After`).
fn store_problem(e: &StoreError, status: StatusCode) -> Problem {
    match e {
    StoreError::KeyBusy(waited) => Problem::new(
        status,
        "key-busy",
        "Resource key busy",
        format!(
            "an older write to this resource key is still in flight on another instance; waited {} ms (key_lock_wait_ms); nothing was forwarded",
            waited.as_millis()
        ),
    ),
    StoreError::Late => Problem::new(
        status,
        "decision-late",
        "Decision too late",
        "the write was admitted, but this instance stalled before it could be forwarded in time (within its in-flight marker, which other instances go by, or within its Idempotency-Key record's time in flight); nothing was forwarded",
    ),
    StoreError::ReadOnly(why) => Problem::new(
        status,
        "store-unavailable",
        "Fence store unavailable",
        format!(
            "the fence store is read-only ({why}): a failover may be in progress; fenced writes wait for a writable primary; nothing was forwarded"
        ),
    ),
    StoreError::NotOwner => Problem::new(
        status,
        "store-unavailable",
        "Fence store unavailable",
        "this single-mode instance does not hold the store's single-writer lock on a writable primary (lost with its connection, or during a failover), so it decides no fenced write until it takes the lock again; nothing was forwarded",
    ),
    _ => Problem::new(
        status,
        "store-unavailable",
        "Fence store unavailable",
        "the fence store could not be reached, so the token cannot be checked; nothing was forwarded",
    ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map};

    /// The document as a JSON map of its members gives it: how it was
    /// made before it was written directly.
    fn through_a_map(p: &Problem) -> String {
        let mut body = Map::new();
        body.insert(
            "type".into(),
            json!(format!("urn:fencegate:problem:{}", p.kind)),
        );
        body.insert("title".into(), json!(p.title));
        body.insert("status".into(), json!(p.status.as_u16()));
        body.insert("detail".into(), json!(p.detail));
        for (name, value) in &p.extra {
            body.insert((*name).into(), value.clone());
        }
        Value::Object(body).to_string()
    }

    #[tokio::test]
    async fn a_document_is_written_as_a_map_of_its_members_gives_it() {
        let odd = "quote \" backslash \\ tab \t nul \u{0} é ☃ \u{1F600} </script>";
        for p in [
            Problem::new(
                StatusCode::CONFLICT,
                "stale-token",
                "Stale fencing token",
                odd,
            )
            .with("resource_key", "doc:\"x\"")
            .with("presented_token", 3)
            .with("highest_token", i64::MAX)
            .with("a_first", Value::Null)
            .with("zz", json!({"b": [1, 2.5, true], "a": "x"})),
            Problem::new(StatusCode::NOT_FOUND, "no-route", "No route", ""),
            // Bytes next to those that need escaping (DEL, UTF-8 whose
            // bytes are all above ASCII), and each kind that does, alone.
            Problem::new(StatusCode::CONFLICT, "k", "del \u{7f} é", "☃ \u{7f} ~ !#")
                .with("resource_key", "\u{1F600}")
                .with("z_only_a_backslash", "a\\b")
                .with("z_only_a_quote", "a\"b")
                .with("z_only_a_newline", "a\nb"),
            // A kind that needs escaping takes the slow way, still right.
            Problem::new(StatusCode::BAD_REQUEST, "odd\"kind\\", "t\n", "d"),
            // An extra of a standard member's name replaces it, and a
            // repeated extra keeps its last value.
            Problem::new(StatusCode::BAD_REQUEST, "bad-request", "Bad", "d")
                .with("status", "four hundred")
                .with("x", 1)
                .with("x", 2),
        ] {
            let expected = through_a_map(&p);
            let resp = p.into_response();
            assert_eq!(
                resp.headers().get(header::CONTENT_TYPE).unwrap(),
                PROBLEM_JSON
            );
            let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
                .await
                .unwrap();
            assert_eq!(String::from_utf8(body.to_vec()).unwrap(), expected);
        }
    }
}
