//! The admin listener's dashboard: one page (`GET /`) and the small JSON
//! reads it polls (`/instance`, `/routes`, `/refusals`, besides `/readyz`,
//! `/locks` and `/fences/{key}`).
//!
//! The page, its style sheet and its script are compiled into the binary
//! (`include_str!`) and served with a Content-Security-Policy that allows
//! nothing but this listener: the admin listener is private, often
//! reached through a tunnel or a port-forward with no way out, so the page
//! must not depend on a CDN, and the policy makes a stray external asset
//! fail loudly in the browser instead of quietly working on a developer's
//! laptop. The script polls rather than streams (Server-Sent Events would
//! hold a connection per open tab against `max_connections`); each poll is
//! a few hundred bytes.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::{header, HeaderValue, Uri};

use crate::admin::state::{bad_request, AdminState};
use crate::config::TokenKind;
use crate::metrics::ReloadResult;

const PAGE: &str = include_str!("dashboard/index.html");
const STYLE: &str = include_str!("dashboard/dashboard.css");
const SCRIPT: &str = include_str!("dashboard/dashboard.js");

/// Everything from this listener, nothing from anywhere else; no inline
/// script or style (the page has none), no framing by other sites.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The dashboard's routes, merged into the admin router.
pub fn router() -> Router<AdminState> {
    Router::new()
        .route("/", get(page))
        .route("/dashboard.css", get(style))
        .route("/dashboard.js", get(script))
        .route("/instance", get(instance))
        .route("/routes", get(routes))
        .route("/refusals", get(refusals))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(POLICY),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            // A new binary may bring a new page: never serve an old one.
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        body,
    )
        .into_response()
}

async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

/// `GET /instance`: version, uptime, store and lock backend, reloads.
async fn instance(State(s): State<AdminState>) -> Response {
    let a = &s.about;
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "started_at": a.started_at,
        "uptime_s": a.started.elapsed().as_secs(),
        "store": {"backend": a.store_backend, "mode": a.store_mode},
        "locks": {"enabled": a.lock_backend.is_some(), "backend": a.lock_backend},
        "config_reloads": {
            "ok": s.metrics.config_reloads(ReloadResult::Ok),
            "error": s.metrics.config_reloads(ReloadResult::Error),
            "refused": s.metrics.config_reloads(ReloadResult::Refused),
        },
        "gate_keys": s.gate.tracked_keys(),
    }))
    .into_response()
}

/// `GET /routes`: the routes the current config serves, in match order,
/// with what each has counted since start-up. Counts only grow (a route
/// renamed by a reload starts again at zero); rates are the reader's
/// difference between two polls.
async fn routes(State(s): State<AdminState>) -> Response {
    let live = s.live.load();
    let routes: Vec<_> = live
        .routes
        .iter()
        .map(|r| {
            let u = &r.upstream;
            // The authority's host and port only: never user info.
            let host = u.authority.host();
            let port = u.authority.port_u16().map(|p| format!(":{p}"));
            serde_json::json!({
                "name": r.name,
                "path": r.path,
                "upstream": format!("{}://{host}{}{}", u.scheme, port.unwrap_or_default(), u.base_path),
                "methods": r.fenced_methods.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
                "token": match r.token {
                    TokenKind::Integer => "integer",
                    TokenKind::Jwt => "jwt",
                    TokenKind::Issued => "issued",
                },
                "counts": r.metrics.counts(),
            })
        })
        .collect();
    Json(serde_json::json!({ "routes": routes })).into_response()
}

/// Refusals in one answer when none is asked for.
const DEFAULT_REFUSALS: usize = 50;

/// `GET /refusals?after=SEQ&limit=N`: the most recent refusals, newest
/// first, only those after `SEQ` (the `last_seq` of an earlier answer).
async fn refusals(State(s): State<AdminState>, uri: Uri) -> Response {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Query {
        after: Option<String>,
        limit: Option<String>,
    }
    let q: Query = match serde_urlencoded::from_str(uri.query().unwrap_or_default()) {
        Ok(q) => q,
        Err(e) => return bad_request("query", format!("{e} (allowed: after, limit)")),
    };
    let after = match q.after.as_deref().map(str::parse::<u64>) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => return bad_request("after", "must be a whole number".into()),
    };
    let cap = crate::gateway::refusals::CAPACITY;
    let limit = match q.limit.as_deref().map(str::parse::<usize>) {
        None => DEFAULT_REFUSALS,
        Some(Ok(n)) if (1..=cap).contains(&n) => n,
        Some(_) => return bad_request("limit", format!("must be a whole number from 1 to {cap}")),
    };
    Json(s.refusals.recent(after, limit)).into_response()
}
