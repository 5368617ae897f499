//! The admin listener: health, readiness, metrics and fence inspection.
//! Kept off the traffic listener so it can be bound to a private address.

use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::{header, HeaderValue, StatusCode, Uri};

use crate::error::Problem;
use crate::metrics::{Metrics, StoreOp};
use crate::store::FenceStore;

#[derive(Clone)]
pub struct AdminState {
    pub store: FenceStore,
    pub metrics: Metrics,
    pub gate: std::sync::Arc<crate::gate::Gate>,
    pub retry_after: Duration,
    /// Checked by `/readyz` too: a lock backend that cannot answer means the
    /// gateway cannot grant.
    pub locks: Option<crate::locks::LockService>,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/fences/{*key}", get(fence))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn healthz() -> impl IntoResponse {
    Json(serde_json::json!({"status": "ok"}))
}

async fn readyz(State(s): State<AdminState>) -> Response {
    let store = s.store.ping().await.map_err(|e| {
        s.metrics.store_error(StoreOp::Ping);
        e.to_string()
    });
    // A failed lock-backend ping is counted by the lock service itself.
    let locks = match &s.locks {
        Some(l) => l.ping().await.map_err(|e| e.to_string()),
        None => Ok(()),
    };
    match store.and(locks) {
        Ok(()) => Json(serde_json::json!({"status": "ready", "store": "ok"})).into_response(),
        Err(e) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "Not ready",
            format!("not ready: {e}"),
        )
        .header(
            header::RETRY_AFTER,
            HeaderValue::from(s.retry_after.as_secs().max(1)),
        )
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

async fn fence(State(s): State<AdminState>, uri: Uri) -> Response {
    // Decoded by hand rather than with the `Path` extractor, whose rejection
    // would not be a problem document.
    let raw = uri.path().strip_prefix("/fences/").unwrap_or_default();
    let key = match percent_encoding::percent_decode_str(raw).decode_utf8() {
        Ok(k) => k.into_owned(),
        Err(_) => {
            return Problem::new(
                StatusCode::BAD_REQUEST,
                "bad-path",
                "Bad request path",
                "the resource key does not decode to UTF-8",
            )
            .into_response()
        }
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
        Err(e) => {
            s.metrics.store_error(StoreOp::Get);
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Fence store unavailable",
                format!("the fence store could not be read: {e}"),
            )
            .header(
                header::RETRY_AFTER,
                HeaderValue::from(s.retry_after.as_secs().max(1)),
            )
            .into_response()
        }
    }
}

async fn not_found() -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        "not-found",
        "Not found",
        "the admin API serves /healthz, /readyz, /metrics and /fences/{key}",
    )
    .into_response()
}

async fn method_not_allowed() -> Response {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        "the admin API is read-only: use GET",
    )
    .into_response()
}
