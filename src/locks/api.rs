//! HTTP handlers of the lock API, under `/_fencegate/locks/{name}` on the
//! traffic listener.
//!
//! Every refusal of a request names the field and the reason in a problem
//! document (`{"field": "ttl_ms", ...}`), and unknown fields are refused
//! instead of ignored (`"ttl": 5000` is a typo, not a default).
//!
//! With `[[auth.clients]]` configured, every call needs a known client (401
//! otherwise, before anything else is looked at), the name must be within
//! its lock globs (403), and renew and release need a lease this client
//! acquired (403). See `auth`.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use fencegate_client::problem;
use http::{header, HeaderValue, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use super::{LockError, LockService};
use crate::auth::{AuthError, Client, Clients, Credentials};
use crate::gateway::error::Problem;
use crate::http1::server::ConnInfo;

/// Largest lock-API request body; they are a few dozen bytes.
const MAX_BODY: usize = 16 * 1024;
/// Longest lock name, in bytes.
const MAX_NAME: usize = 512;

#[derive(Clone)]
pub struct LockApiState {
    pub locks: LockService,
    pub retry_after: Duration,
    /// Who may call (`auth`; open when no clients are configured), as the
    /// current config says: a reload swaps it.
    pub live: crate::gateway::live::Shared,
}

/// The caller's credentials: its `Authorization` header and, on a TLS
/// connection, its verified client certificate's CN; more than one
/// `Authorization` header is refused (400 `ambiguous-credentials`).
fn credentials<'a>(
    headers: &'a http::HeaderMap,
    conn: Option<&'a ConnInfo>,
) -> Result<Credentials<'a>, AuthError> {
    let cn = conn
        .and_then(|c| c.tls.as_ref())
        .and_then(|t| t.client_cn.as_deref());
    Credentials::of(headers, cn)
}

/// The lock API's routes, to be merged into the traffic router.
pub fn router(state: LockApiState) -> Router {
    Router::new()
        .route("/_fencegate/locks/{name}", post(acquire).get(status))
        .route("/_fencegate/locks/{name}/renew", post(renew))
        .route("/_fencegate/locks/{name}/release", post(release))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

/// A refused request: which field, and why.
struct BadBody {
    field: &'static str,
    why: String,
}

impl BadBody {
    fn new(field: &'static str, why: impl Into<String>) -> Self {
        Self {
            field,
            why: why.into(),
        }
    }

    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::BAD_REQUEST,
            problem::BAD_LOCK_REQUEST,
            "Bad lock request",
            format!("{}: {}", self.field, self.why),
        )
        .with(problem::FIELD, self.field)
        .into_response()
    }
}

/// A lock request body: a JSON object with no fields but its struct's.
trait Body: DeserializeOwned {
    /// The struct's fields, for the refusal of an unknown one.
    const FIELDS: &'static [&'static str];
}

/// `POST /_fencegate/locks/{name}`.
#[derive(Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct AcquireBody {
    ttl_ms: Field<Millis>,
    wait_ms: Field<Millis>,
}

impl Body for AcquireBody {
    const FIELDS: &'static [&'static str] = &["ttl_ms", "wait_ms"];
}

/// `POST /_fencegate/locks/{name}/renew`.
#[derive(Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RenewBody {
    lease: Field<LeaseId>,
    ttl_ms: Field<Millis>,
}

impl Body for RenewBody {
    const FIELDS: &'static [&'static str] = &["lease", "ttl_ms"];
}

/// `POST /_fencegate/locks/{name}/release`.
#[derive(Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct ReleaseBody {
    lease: Field<LeaseId>,
}

impl Body for ReleaseBody {
    const FIELDS: &'static [&'static str] = &["lease"];
}

/// A field as sent: absent or null, or a value that is a `T` or is not.
/// Reading the body refuses only unknown fields; a field's own fault is
/// reported when the handler takes the field, so that a body with several
/// faults is refused for the first in the handler's order whatever the
/// order of its keys.
struct Field<T>(Option<Result<T, &'static str>>);

impl<T> Default for Field<T> {
    fn default() -> Self {
        Self(None)
    }
}

impl<'de, T: TryFrom<Value, Error = &'static str>> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self(match Value::deserialize(d)? {
            Value::Null => None,
            v => Some(T::try_from(v)),
        }))
    }
}

impl<T> Field<T> {
    fn optional(self, name: &'static str) -> Result<Option<T>, BadBody> {
        self.0.transpose().map_err(|why| BadBody::new(name, why))
    }

    fn required(self, name: &'static str) -> Result<T, BadBody> {
        self.optional(name)?
            .ok_or_else(|| BadBody::new(name, "missing"))
    }
}

/// Milliseconds.
struct Millis(u64);

impl TryFrom<Value> for Millis {
    type Error = &'static str;

    fn try_from(v: Value) -> Result<Self, Self::Error> {
        v.as_u64()
            .map(Millis)
            .ok_or("must be a non-negative integer number of milliseconds")
    }
}

/// A lease id as a client sends it back.
struct LeaseId(String);

impl TryFrom<Value> for LeaseId {
    type Error = &'static str;

    fn try_from(v: Value) -> Result<Self, Self::Error> {
        match v {
            Value::String(s) if !s.is_empty() && s.len() <= 128 => Ok(LeaseId(s)),
            Value::String(_) => Err("must be 1 to 128 characters"),
            _ => Err("must be a string"),
        }
    }
}

fn parse<B: Body>(body: &Bytes) -> Result<B, BadBody> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| BadBody::new("body", format!("not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(BadBody::new("body", "must be a JSON object"));
    }
    // Fields never fail to deserialize: serde refuses only unknown ones.
    serde_path_to_error::deserialize(value).map_err(|e| {
        let key = e.path().iter().next().map(ToString::to_string);
        BadBody::new(
            "body",
            format!(
                "unknown field '{}' (allowed: {})",
                key.unwrap_or_default(),
                B::FIELDS.join(", ")
            ),
        )
    })
}

fn ttl(locks: &LockService, ttl_ms: Field<Millis>) -> Result<Duration, BadBody> {
    let Millis(ms) = ttl_ms.required("ttl_ms")?;
    let l = locks.limits();
    let d = Duration::from_millis(ms);
    if d < l.min_ttl || d > l.max_ttl {
        return Err(BadBody::new(
            "ttl_ms",
            format!(
                "{ms} is outside the allowed range {} to {} ms",
                l.min_ttl.as_millis(),
                l.max_ttl.as_millis()
            ),
        ));
    }
    Ok(d)
}

fn check_name(name: &str) -> Result<(), BadBody> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(BadBody::new(
            "name",
            format!("must be 1 to {MAX_NAME} bytes"),
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(BadBody::new("name", "must not contain control characters"));
    }
    Ok(())
}

/// A refused lock call's answer, boxed: a response is large, and most
/// calls are not refused.
struct Refused(Box<Response>);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        *self.0
    }
}

impl From<BadBody> for Refused {
    fn from(b: BadBody) -> Self {
        Self(Box::new(b.into_response()))
    }
}

impl From<AuthError> for Refused {
    fn from(e: AuthError) -> Self {
        Self(Box::new(
            crate::gateway::error::auth_problem(&e).into_response(),
        ))
    }
}

/// A lock call's name and client: the whole input of `status`.
struct Named {
    name: String,
    client: Option<Client>,
}

/// A lock call with a body: its name, its client and the body read as `B`.
struct Call<B> {
    name: String,
    client: Option<Client>,
    body: B,
}

impl FromRequestParts<LockApiState> for Named {
    type Rejection = Refused;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        s: &LockApiState,
    ) -> Result<Self, Refused> {
        let name = Path::from_request_parts(parts, s).await;
        authorize(s, &parts.headers, conn_info(parts).as_deref(), name)
    }
}

impl<B: Body> FromRequest<LockApiState> for Call<B> {
    type Rejection = Refused;

    async fn from_request(req: Request, s: &LockApiState) -> Result<Self, Refused> {
        let (mut parts, body) = req.into_parts();
        let name = Path::from_request_parts(&mut parts, s).await;
        let (headers, conn) = (parts.headers.clone(), conn_info(&parts));
        // Read before the checks; a failure to read it is answered after
        // them, so an unknown caller is refused (401) first.
        let body = Bytes::from_request(Request::from_parts(parts, body), s).await;
        let Named { name, client } = authorize(s, &headers, conn.as_deref(), name)?;
        let body = body.map_err(|e| {
            // The body was not read to its end: close the connection after
            // this answer so the client does not reuse it.
            Refused(Box::new(
                Problem::new(
                    e.status(),
                    problem::BAD_LOCK_REQUEST,
                    "Bad lock request",
                    format!("body: {}", e.body_text()),
                )
                .with(problem::FIELD, "body")
                .header(header::CONNECTION, HeaderValue::from_static("close"))
                .into_response(),
            ))
        })?;
        Ok(Call {
            name,
            client,
            body: parse(&body)?,
        })
    }
}

/// The connection's details, which the server puts in every request.
fn conn_info(parts: &http::request::Parts) -> Option<std::sync::Arc<ConnInfo>> {
    parts.extensions.get().cloned()
}

/// Authorizes the caller against the current config's clients, then checks
/// the name: a request without a known client is refused (401) before its
/// name or body is looked at.
fn authorize(
    s: &LockApiState,
    headers: &http::HeaderMap,
    conn: Option<&ConnInfo>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Named, Refused> {
    let live = s.live.load();
    let creds = credentials(headers, conn)?;
    let client = live.auth.authenticate(creds)?;
    let Path(name) = name.map_err(|e| BadBody::new("name", e.body_text()))?;
    check_name(&name)?;
    Clients::may_lock(client, &name)?;
    Ok(Named {
        name,
        client: client.cloned(),
    })
}

async fn acquire(
    State(s): State<LockApiState>,
    Call { name, client, body }: Call<AcquireBody>,
) -> Result<Response, Refused> {
    let ttl = ttl(&s.locks, body.ttl_ms)?;
    let wait = body.wait_ms.optional("wait_ms")?.map_or(0, |Millis(ms)| ms);
    let max = s.locks.limits().max_wait;
    if Duration::from_millis(wait) > max {
        return Err(BadBody::new(
            "wait_ms",
            format!(
                "{wait} is above the allowed maximum of {} ms",
                max.as_millis()
            ),
        )
        .into());
    }
    let lease = Clients::lease_id(client.as_ref(), super::new_lease_id());
    let wait = Duration::from_millis(wait);
    Ok(match s.locks.acquire(&name, &lease, ttl, wait).await {
        Ok(grant) => (StatusCode::CREATED, Json(grant)).into_response(),
        Err(e) => lock_error(&name, e, s.retry_after),
    })
}

async fn renew(
    State(s): State<LockApiState>,
    Call { name, client, body }: Call<RenewBody>,
) -> Result<Response, Refused> {
    let LeaseId(lease) = body.lease.required("lease")?;
    let ttl = ttl(&s.locks, body.ttl_ms)?;
    Clients::owns_lease(client.as_ref(), &lease)?;
    Ok(match s.locks.renew(&name, &lease, ttl).await {
        Ok(grant) => Json(grant).into_response(),
        Err(e) => lock_error(&name, e, s.retry_after),
    })
}

async fn release(
    State(s): State<LockApiState>,
    Call { name, client, body }: Call<ReleaseBody>,
) -> Result<Response, Refused> {
    let LeaseId(lease) = body.lease.required("lease")?;
    Clients::owns_lease(client.as_ref(), &lease)?;
    Ok(match s.locks.release(&name, &lease).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => lock_error(&name, e, s.retry_after),
    })
}

async fn status(State(s): State<LockApiState>, Named { name, .. }: Named) -> Response {
    match s.locks.status(&name).await {
        Ok(st) => Json(st).into_response(),
        Err(e) => lock_error(&name, e, s.retry_after),
    }
}

/// The one mapping of lock errors to answers.
pub(crate) fn lock_error(name: &str, e: LockError, retry_after: Duration) -> Response {
    match e {
        LockError::Held { expires_in } => {
            let mut p = Problem::new(
                StatusCode::CONFLICT,
                problem::LOCK_HELD,
                "Lock held",
                format!("the lock '{name}' is held by another holder"),
            )
            .with("name", name);
            if let Some(d) = expires_in {
                p = p.with(problem::EXPIRES_IN_MS, d.as_millis() as u64);
            }
            p.into_response()
        }
        LockError::NotHolder => Problem::new(
            StatusCode::CONFLICT,
            problem::NOT_HOLDER,
            "Not the holder",
            format!(
                "this lease does not hold the lock '{name}': it expired, was released, or never held it"
            ),
        )
        .with("name", name)
        .into_response(),
        LockError::Expired => Problem::new(
            StatusCode::CONFLICT,
            problem::NOT_HOLDER,
            "Not the holder",
            format!("this lease of the lock '{name}' expired; acquire the lock again"),
        )
        .with("name", name)
        .with("expired", true)
        .into_response(),
        LockError::Exhausted => Problem::new(
            StatusCode::CONFLICT,
            "fence-exhausted",
            "Fence exhausted",
            format!(
                "the lock '{name}' cannot be granted: its fence (or its resource key's highest token) is already 9223372036854775807; an admin must reset the key (POST /fences/{{key}}/reset on the admin listener)"
            ),
        )
        .with("name", name)
        .into_response(),
        LockError::Unavailable(why) => {
            tracing::warn!(lock = %name, error = %why, "lock backend unavailable; answering 503");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "lock-backend-unavailable",
                "Lock backend unavailable",
                "the lock backend or the fence store could not be reached; nothing was granted",
            )
            .retry_after(retry_after)
            .into_response()
        }
    }
}

/// 405 as a problem document, for the lock API's routes and the rest.
pub async fn method_not_allowed() -> Response {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        "this method is not served on this path",
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal<T>(r: Result<T, BadBody>) -> String {
        match r {
            Ok(_) => panic!("accepted"),
            Err(b) => format!("{}: {}", b.field, b.why),
        }
    }

    /// `FIELDS` lists what the struct has: serde names the same fields when
    /// it refuses an unknown one.
    fn fields_are_the_structs<B: Body>() {
        let serde_says = serde_json::from_str::<B>(r#"{"?": 0}"#)
            .err()
            .expect("an unknown field is refused")
            .to_string();
        for f in B::FIELDS {
            assert!(serde_says.contains(&format!("`{f}`")), "{serde_says}");
        }
        assert_eq!(serde_says.matches('`').count(), 2 * (B::FIELDS.len() + 1));
    }

    #[test]
    fn bodies_list_their_fields() {
        fields_are_the_structs::<AcquireBody>();
        fields_are_the_structs::<RenewBody>();
        fields_are_the_structs::<ReleaseBody>();
    }

    #[test]
    fn unknown_fields_first_then_fields_in_the_handlers_order() {
        let body = Bytes::from_static(br#"{"ttl_ms": "x", "zzz": 1}"#);
        assert_eq!(
            refusal(parse::<AcquireBody>(&body)),
            "body: unknown field 'zzz' (allowed: ttl_ms, wait_ms)"
        );
        let body = Bytes::from_static(br#"{"wait_ms": -1}"#);
        let b: AcquireBody = parse(&body).unwrap_or_else(|_| panic!("parsed"));
        assert_eq!(refusal(b.ttl_ms.required("ttl_ms")), "ttl_ms: missing");
        let body = Bytes::from_static(br#"{"ttl_ms": 1.5, "lease": null}"#);
        let b: RenewBody = parse(&body).unwrap_or_else(|_| panic!("parsed"));
        assert_eq!(refusal(b.lease.required("lease")), "lease: missing");
        assert_eq!(
            refusal(b.ttl_ms.required("ttl_ms")),
            "ttl_ms: must be a non-negative integer number of milliseconds"
        );
    }
}
