//! A tiny document store to put behind the gateway when trying it out.
//!
//! It keeps documents in memory by path: writes (`PUT`, `POST`, `PATCH`)
//! store the body along with the `X-Fence-Token` that came with it, `DELETE`
//! removes, `GET` shows the document and which token wrote it. It checks
//! nothing itself — that is the gateway's job — so it shows exactly what a
//! backend behind fencegate sees.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use http::{HeaderMap, Method, StatusCode, Uri};
use serde_json::json;
use tokio::net::TcpListener;

/// A stored document: its content, the token that wrote it, its version.
type Doc = (String, Option<String>, u64);

#[derive(Clone, Default)]
struct Docs {
    /// Documents by request path.
    inner: Arc<Mutex<HashMap<String, Doc>>>,
}

/// The demo backend's router.
pub fn router() -> Router {
    Router::new().fallback(handle).with_state(Docs::default())
}

/// Serves the demo backend until `shutdown` resolves.
pub async fn run(listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) {
    let _ = axum::serve(listener, router())
        .with_graceful_shutdown(shutdown)
        .await;
}

async fn handle(
    State(docs): State<Docs>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    let token = headers
        .get("x-fence-token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut map = docs.inner.lock().unwrap_or_else(|e| e.into_inner());
    match method {
        Method::GET | Method::HEAD => match map.get(&path) {
            Some((content, token, version)) => Json(json!({
                "path": path,
                "content": content,
                "written_with_token": token,
                "version": version,
            }))
            .into_response(),
            None => (
                StatusCode::NOT_FOUND,
                Json(json!({"path": path, "error": "no such document"})),
            )
                .into_response(),
        },
        Method::PUT | Method::POST | Method::PATCH => {
            let content = String::from_utf8_lossy(&body).into_owned();
            let version = map.get(&path).map(|d| d.2 + 1).unwrap_or(1);
            tracing::info!(%path, token = ?token, version, "demo backend applied a write");
            map.insert(path.clone(), (content, token.clone(), version));
            Json(json!({"path": path, "written_with_token": token, "version": version}))
                .into_response()
        }
        Method::DELETE => {
            map.remove(&path);
            StatusCode::NO_CONTENT.into_response()
        }
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            [(http::header::ALLOW, "GET, HEAD, PUT, POST, PATCH, DELETE")],
        )
            .into_response(),
    }
}
