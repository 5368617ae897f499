//! The admin listener: health, readiness, metrics, fence and lock
//! inspection, and the break-glass admin actions; the dashboard's page and
//! reads ([`dashboard`]) and the API description ([`openapi`]) are merged
//! in, over the state they share ([`state`]).
//! Kept off the traffic listener so it can be bound to a private address.
//!
//! Reads (GET) are open: the listener is private. Actions (POST) need an
//! `admin = true` client's bearer key (see `auth`).

pub mod dashboard;
pub mod openapi;
pub mod state;

use state::bad_request;
pub use state::{About, AdminState};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{header, StatusCode, Uri};

use crate::gateway::error::Problem;
use crate::metrics::StoreOp;

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/fences", get(list_fences))
        .route("/fences/{*key}", get(fence).post(fence_action))
        .route("/locks", get(list_locks))
        .route("/locks/{*name}", post(lock_action))
        .route("/openapi.json", get(crate::admin::openapi::serve))
        .merge(crate::admin::dashboard::router())
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Largest admin request body; they are a few dozen bytes.
const MAX_BODY: usize = 16 * 1024;
/// The page size of a listing when none is asked for, and the largest.
const DEFAULT_PAGE: usize = 100;
const MAX_PAGE: usize = 1000;

async fn healthz() -> impl IntoResponse {
    Json(serde_json::json!({"status": "ok"}))
}

/// 200 when fenced writes can be decided, else a 503 problem; either way
/// `details` says what was found: the store (reachable, writable, the
/// single-writer lock, the durability check) and the lock backend.
async fn readyz(State(s): State<AdminState>) -> Response {
    let store = s.store.readiness().await;
    let store_problem = store.problem();
    if store_problem.is_some() {
        s.metrics.store_error(StoreOp::Ping);
    }
    // A failed lock-backend ping is counted by the lock service itself.
    let locks = match &s.locks {
        Some(l) => Some(l.ping().await.map_err(|e| e.to_string())),
        None => None,
    };
    let details = serde_json::json!({
        "store": store,
        "locks": match &locks {
            None => serde_json::Value::Null,
            Some(Ok(())) => "ok".into(),
            Some(Err(e)) => e.as_str().into(),
        },
    });
    let problem = store_problem.or(locks.and_then(|l| l.err()));
    match problem {
        None => Json(serde_json::json!({"status": "ready", "store": "ok", "details": details}))
            .into_response(),
        Some(e) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "Not ready",
            format!("not ready: {e}"),
        )
        .with("details", details)
        .retry_after(s.retry_after)
        .into_response(),
    }
}

async fn metrics(State(s): State<AdminState>) -> Response {
    s.metrics.gate_keys.set(s.gate.tracked_keys() as i64);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

/// The decoded rest of the path after `prefix`. Decoded by hand rather than
/// with the `Path` extractor, whose rejection would not be a problem document.
fn path_rest(uri: &Uri, prefix: &str) -> Result<String, Box<Response>> {
    let raw = uri.path().strip_prefix(prefix).unwrap_or_default();
    match percent_encoding::percent_decode_str(raw).decode_utf8() {
        Ok(k) => Ok(k.into_owned()),
        Err(_) => Err(Box::new(bad_request(
            "path",
            "the path does not decode to UTF-8".into(),
        ))),
    }
}

fn store_unavailable(s: &AdminState, op: StoreOp, e: impl std::fmt::Display) -> Response {
    s.metrics.store_error(op);
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        "Fence store unavailable",
        format!("the fence store could not be reached: {e}"),
    )
    .retry_after(s.retry_after)
    .into_response()
}

async fn fence(State(s): State<AdminState>, uri: Uri) -> Response {
    let key = match path_rest(&uri, "/fences/") {
        Ok(k) => k,
        Err(r) => return *r,
    };
    match s.store.get(&key).await {
        Ok(Some(rec)) => Json(rec).into_response(),
        Ok(None) => Problem::new(
            StatusCode::NOT_FOUND,
            "no-fence",
            "No fence recorded",
            format!("no token has been recorded for resource '{key}'"),
        )
        .with("resource_key", key)
        .into_response(),
        Err(e) => store_unavailable(&s, StoreOp::Get, e),
    }
}

/// `?prefix=P&after=K&limit=N` of a listing.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    #[serde(default)]
    prefix: String,
    after: Option<String>,
    limit: Option<String>,
}

/// The listing parameters, or the 400 naming the bad one.
fn list_query(uri: &Uri) -> Result<(String, Option<String>, usize), Box<Response>> {
    let q: ListQuery =
        serde_urlencoded::from_str(uri.query().unwrap_or_default()).map_err(|e| {
            Box::new(bad_request(
                "query",
                format!("{e} (allowed: prefix, after, limit)"),
            ))
        })?;
    let limit = match q.limit.as_deref() {
        None => DEFAULT_PAGE,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => {
                return Err(Box::new(bad_request(
                    "limit",
                    format!("must be a whole number from 1 to {MAX_PAGE}"),
                )))
            }
        },
    };
    Ok((q.prefix, q.after.filter(|a| !a.is_empty()), limit))
}

/// `GET /fences?prefix=P&after=K&limit=N`.
async fn list_fences(State(s): State<AdminState>, uri: Uri) -> Response {
    let (prefix, after, limit) = match list_query(&uri) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    match s.store.list(&prefix, after.as_deref(), limit).await {
        Ok(page) => {
            Json(serde_json::json!({"fences": page.items, "next": page.next})).into_response()
        }
        Err(e) => store_unavailable(&s, StoreOp::Get, e),
    }
}

/// `GET /locks?prefix=P&after=K&limit=N`: every name a fence was issued
/// for, with its status from the lock backend.
async fn list_locks(State(s): State<AdminState>, uri: Uri) -> Response {
    let (prefix, after, limit) = match list_query(&uri) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    let Some(locks) = &s.locks else {
        return lock_api_disabled();
    };
    let page = match s
        .store
        .list_lock_names(&prefix, after.as_deref(), limit)
        .await
    {
        Ok(p) => p,
        Err(e) => return store_unavailable(&s, StoreOp::Get, e),
    };
    let statuses =
        futures_util::future::join_all(page.items.iter().map(|name| locks.status(name))).await;
    let mut out = Vec::with_capacity(statuses.len());
    for st in statuses {
        match st {
            Ok(st) => out.push(st),
            Err(e) => return crate::locks::api::lock_error("(listing)", e, s.retry_after),
        }
    }
    Json(serde_json::json!({"locks": out, "next": page.next})).into_response()
}

fn lock_api_disabled() -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        "locks-disabled",
        "Lock API disabled",
        "[locks] enabled = false: there are no locks to list or break",
    )
    .into_response()
}

/// The name of the admin client calling an action, or the answer refusing
/// it.
fn admin_client(s: &AdminState, headers: &http::HeaderMap) -> Result<String, Box<Response>> {
    let refused = |e| Box::new(crate::gateway::error::auth_problem(&e).into_response());
    let creds = crate::auth::Credentials::of(headers, None).map_err(refused)?;
    s.live
        .load()
        .auth
        .admin(creds)
        .map(|c| c.name.clone())
        .map_err(refused)
}

/// An admin action's caller and target: the admin client's name and the
/// decoded path between `prefix` and `suffix`; else the answer refusing it.
async fn action(
    s: &AdminState,
    headers: &http::HeaderMap,
    uri: &Uri,
    prefix: &str,
    suffix: &str,
) -> Result<(String, String), Box<Response>> {
    let admin = admin_client(s, headers)?;
    let rest = path_rest(uri, prefix)?;
    match rest.strip_suffix(suffix).filter(|t| !t.is_empty()) {
        Some(target) => Ok((admin, target.to_string())),
        None => Err(Box::new(not_found().await)),
    }
}

/// `POST /fences/{key}/reset` `{"highest_token": N, "reason": "..."}`.
async fn fence_action(
    State(s): State<AdminState>,
    uri: Uri,
    headers: http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (admin, key) = match action(&s, &headers, &uri, "/fences/", "/reset").await {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let key = key.as_str();
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Reset {
        highest_token: i64,
        reason: String,
    }
    let reset: Reset = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return bad_request(
                "body",
                format!("{e} (expected {{\"highest_token\": N, \"reason\": \"...\"}})"),
            )
        }
    };
    if reset.highest_token < 0 {
        return bad_request("highest_token", "must not be negative".into());
    }
    let reason = reset.reason.trim();
    if reason.is_empty() || reason.len() > 1000 {
        return bad_request("reason", "must say why, in 1 to 1000 bytes".into());
    }
    match s
        .store
        .reset(key, reset.highest_token, &admin, reason)
        .await
    {
        Ok(record) => {
            // This instance at once; others within a second (they watch the
            // store's reset log).
            s.gate.forget(key);
            let from = record.last_reset.as_ref().and_then(|r| r.from);
            tracing::warn!(
                resource_key = key,
                from,
                to = reset.highest_token,
                by = %admin,
                reason,
                "fence reset by an admin"
            );
            Json(record).into_response()
        }
        Err(e) => store_unavailable(&s, StoreOp::Record, e),
    }
}

/// `POST /locks/{name}/break`.
async fn lock_action(State(s): State<AdminState>, uri: Uri, headers: http::HeaderMap) -> Response {
    let (admin, name) = match action(&s, &headers, &uri, "/locks/", "/break").await {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let name = name.as_str();
    let Some(locks) = &s.locks else {
        return lock_api_disabled();
    };
    match locks.break_lease(name).await {
        Ok(true) => {
            tracing::warn!(lock = name, by = %admin, "lease broken by an admin");
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(false) => Problem::new(
            StatusCode::NOT_FOUND,
            "not-held",
            "Lock not held",
            format!("no lease holds the lock '{name}'"),
        )
        .with("name", name)
        .into_response(),
        Err(e) => crate::locks::api::lock_error(name, e, s.retry_after),
    }
}

async fn not_found() -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        "not-found",
        "Not found",
        "the admin API serves GET / (the dashboard), /healthz, /readyz, /metrics, /openapi.json, /instance, /routes, /refusals, /fences, /fences/{key}, /locks, and POST /fences/{key}/reset, /locks/{name}/break",
    )
    .into_response()
}

async fn method_not_allowed() -> Response {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        "reads are GET; the admin actions are POST /fences/{key}/reset and /locks/{name}/break",
    )
    .into_response()
}
