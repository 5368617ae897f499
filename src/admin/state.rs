//! What every admin endpoint shares: the listener's state, what this
//! instance is, and the answer to a bad admin request.

use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use http::StatusCode;

use crate::config::{Config, LockBackendConfig, StoreBackend, StoreMode};
use crate::gateway::error::Problem;
use crate::metrics::Metrics;
use crate::store::FenceStore;

/// The admin listener's state, cloned into every handler.
#[derive(Clone)]
pub struct AdminState {
    pub store: FenceStore,
    pub metrics: Metrics,
    /// This instance's gate: a reset makes it forget the key.
    pub gate: std::sync::Arc<crate::fencing::gate::Gate>,
    pub retry_after: Duration,
    /// Checked by `/readyz` too: a lock backend that cannot answer means the
    /// gateway cannot grant.
    pub locks: Option<crate::locks::LockService>,
    /// Who may call the admin actions (`auth`), as the current config
    /// says: a reload swaps it.
    pub live: crate::gateway::live::Shared,
    /// The recent refusals, recorded by the traffic listener.
    pub refusals: std::sync::Arc<crate::gateway::refusals::Refusals>,
    /// This instance, for the dashboard.
    pub about: About,
}

/// What this instance is, fixed at start-up (a reload cannot change any of
/// it).
#[derive(Clone, Debug)]
pub struct About {
    pub started: Instant,
    pub started_at: DateTime<Utc>,
    pub store_backend: &'static str,
    pub store_mode: &'static str,
    pub lock_backend: Option<&'static str>,
}

impl About {
    pub fn of(config: &Config) -> Self {
        Self {
            started: Instant::now(),
            started_at: Utc::now(),
            store_backend: match config.store.backend {
                StoreBackend::Sqlite(_) => "sqlite",
                StoreBackend::Postgres => "postgres",
            },
            store_mode: match config.store.mode {
                StoreMode::Single => "single",
                StoreMode::Shared => "shared",
            },
            lock_backend: config.locks.enabled.then_some(match config.locks.backend {
                LockBackendConfig::Store => "store",
                LockBackendConfig::Redis { .. } => "redis",
                LockBackendConfig::Redlock { .. } => "redlock",
            }),
        }
    }
}

/// A malformed admin request: 400 naming the field.
pub(crate) fn bad_request(field: &str, why: String) -> Response {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "bad-admin-request",
        "Bad admin request",
        format!("{field}: {why}"),
    )
    .with("field", field)
    .into_response()
}
