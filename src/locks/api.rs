//! HTTP handlers of the lock API, under `/_fencegate/locks/{name}` on the
//! traffic listener.
//!
//! Bodies are parsed by hand from JSON values rather than with a typed
//! extractor, so that every refusal names the field and the reason in a
//! problem document (`{"field": "ttl_ms", ...}`), and unknown fields are
//! refused instead of ignored (`"ttl": 5000` is a typo, not a default).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use http::{header, HeaderValue, StatusCode};
use serde_json::{Map, Value};

use super::{LockError, LockService};
use crate::error::Problem;

/// Largest lock-API request body; they are a few dozen bytes.
const MAX_BODY: usize = 16 * 1024;
/// Longest lock name, in bytes.
const MAX_NAME: usize = 512;

#[derive(Clone)]
pub struct LockApiState {
    pub locks: LockService,
    pub retry_after: Duration,
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

/// A refused request body: which field, and why.
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
            "bad-lock-request",
            "Bad lock request",
            format!("{}: {}", self.field, self.why),
        )
        .with("field", self.field)
        .into_response()
    }
}

fn parse_object(body: &Bytes, allowed: &[&str]) -> Result<Map<String, Value>, BadBody> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| BadBody::new("body", format!("not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(BadBody::new("body", "must be a JSON object"));
    };
    for key in map.keys() {
        if !allowed.contains(&key.as_str()) {
            return Err(BadBody::new(
                "body",
                format!("unknown field '{key}' (allowed: {})", allowed.join(", ")),
            ));
        }
    }
    Ok(map)
}

fn millis(
    map: &Map<String, Value>,
    field: &'static str,
    required: bool,
) -> Result<Option<u64>, BadBody> {
    match map.get(field) {
        None | Some(Value::Null) if !required => Ok(None),
        None | Some(Value::Null) => Err(BadBody::new(field, "missing")),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            BadBody::new(
                field,
                "must be a non-negative integer number of milliseconds",
            )
        }),
    }
}

fn ttl(locks: &LockService, map: &Map<String, Value>) -> Result<Duration, BadBody> {
    let ms = millis(map, "ttl_ms", true)?.unwrap_or_default();
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

fn lease(map: &Map<String, Value>) -> Result<String, BadBody> {
    match map.get("lease") {
        None | Some(Value::Null) => Err(BadBody::new("lease", "missing")),
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 128 => Ok(s.clone()),
        Some(Value::String(_)) => Err(BadBody::new("lease", "must be 1 to 128 characters")),
        Some(_) => Err(BadBody::new("lease", "must be a string")),
    }
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

type NameParam = Result<Path<String>, PathRejection>;
type BodyParam = Result<Bytes, BytesRejection>;

/// Unwraps the extractors, turning their rejections into problem documents.
fn inputs(name: NameParam, body: Option<BodyParam>) -> Result<(String, Bytes), Box<Response>> {
    let name = match name {
        Ok(Path(n)) => n,
        Err(e) => {
            return Err(Box::new(
                BadBody::new("name", e.body_text()).into_response(),
            ))
        }
    };
    check_name(&name).map_err(|b| Box::new(b.into_response()))?;
    let body = match body {
        None => Bytes::new(),
        Some(Ok(b)) => b,
        Some(Err(e)) => {
            // The body was not read to its end: close the connection after
            // this answer so the client does not reuse it.
            return Err(Box::new(
                Problem::new(
                    e.status(),
                    "bad-lock-request",
                    "Bad lock request",
                    format!("body: {}", e.body_text()),
                )
                .with("field", "body")
                .header(header::CONNECTION, HeaderValue::from_static("close"))
                .into_response(),
            ));
        }
    };
    Ok((name, body))
}

async fn acquire(State(s): State<LockApiState>, name: NameParam, body: BodyParam) -> Response {
    let (name, body) = match inputs(name, Some(body)) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let parsed = check_name(&name).and_then(|_| {
        let map = parse_object(&body, &["ttl_ms", "wait_ms"])?;
        let ttl = ttl(&s.locks, &map)?;
        let wait = millis(&map, "wait_ms", false)?.unwrap_or(0);
        let max = s.locks.limits().max_wait;
        if Duration::from_millis(wait) > max {
            return Err(BadBody::new(
                "wait_ms",
                format!(
                    "{wait} is above the allowed maximum of {} ms",
                    max.as_millis()
                ),
            ));
        }
        Ok((ttl, Duration::from_millis(wait)))
    });
    let (ttl, wait) = match parsed {
        Ok(v) => v,
        Err(b) => return b.into_response(),
    };
    match s.locks.acquire(&name, ttl, wait).await {
        Ok(grant) => (StatusCode::CREATED, Json(grant)).into_response(),
        Err(e) => lock_error(&name, e, s.retry_after),
    }
}

async fn renew(State(s): State<LockApiState>, name: NameParam, body: BodyParam) -> Response {
    let (name, body) = match inputs(name, Some(body)) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let parsed = check_name(&name).and_then(|_| {
        let map = parse_object(&body, &["lease", "ttl_ms"])?;
        Ok((lease(&map)?, ttl(&s.locks, &map)?))
    });
    let (lease, ttl) = match parsed {
        Ok(v) => v,
        Err(b) => return b.into_response(),
    };
    match s.locks.renew(&name, &lease, ttl).await {
        Ok(grant) => Json(grant).into_response(),
        Err(e) => lock_error(&name, e, s.retry_after),
    }
}

async fn release(State(s): State<LockApiState>, name: NameParam, body: BodyParam) -> Response {
    let (name, body) = match inputs(name, Some(body)) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let parsed = check_name(&name).and_then(|_| lease(&parse_object(&body, &["lease"])?));
    let lease = match parsed {
        Ok(v) => v,
        Err(b) => return b.into_response(),
    };
    match s.locks.release(&name, &lease).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => lock_error(&name, e, s.retry_after),
    }
}

async fn status(State(s): State<LockApiState>, name: NameParam) -> Response {
    let (name, _) = match inputs(name, None) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    match s.locks.status(&name).await {
        Ok(st) => Json(st).into_response(),
        Err(e) => lock_error(&name, e, s.retry_after),
    }
}

/// The one mapping of lock errors to answers.
fn lock_error(name: &str, e: LockError, retry_after: Duration) -> Response {
    match e {
        LockError::Held { expires_in } => {
            let mut p = Problem::new(
                StatusCode::CONFLICT,
                "lock-held",
                "Lock held",
                format!("the lock '{name}' is held by another holder"),
            )
            .with("name", name);
            if let Some(d) = expires_in {
                p = p.with("expires_in_ms", d.as_millis() as u64);
            }
            p.into_response()
        }
        LockError::NotHolder => Problem::new(
            StatusCode::CONFLICT,
            "not-holder",
            "Not the holder",
            format!(
                "this lease does not hold the lock '{name}': it expired, was released, or never held it"
            ),
        )
        .with("name", name)
        .into_response(),
        LockError::Expired => Problem::new(
            StatusCode::CONFLICT,
            "not-holder",
            "Not the holder",
            format!("this lease of the lock '{name}' expired; acquire the lock again"),
        )
        .with("name", name)
        .with("expired", true)
        .into_response(),
        LockError::Unavailable(why) => {
            tracing::warn!(lock = %name, error = %why, "lock backend unavailable; answering 503");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "lock-backend-unavailable",
                "Lock backend unavailable",
                "the lock backend or the fence store could not be reached; nothing was granted",
            )
            .header(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after.as_secs().max(1)),
            )
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
