//! Per-request accounting, in one place: metrics by outcome, the access
//! log line, and the ring of recent refusals the dashboard shows. A fenced
//! write is accounted when it ends, which may be after its client left
//! ([`PendingAccount`]).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use http::{Method, Request};

use super::error::{ClientError, GatewayError, UpstreamError};
use super::live::GatedRoute;
use super::state::GatewayState;
use crate::metrics::{IdempotencyOutcome, Outcome, StoreOp, UpstreamFailure};
use crate::store::StoreError;

/// How a fenced write ended.
pub(super) type Ended = Result<Response, GatewayError>;

/// What one request came to, for [`account`].
#[derive(Clone, Copy)]
pub(super) struct Summary<'a> {
    pub(super) route: Option<&'a GatedRoute>,
    pub(super) fenced: bool,
    pub(super) forwarded: bool,
    /// A fenced write with an `Idempotency-Key`.
    pub(super) with_idempotency_key: bool,
    pub(super) method: &'a Method,
    /// The path, when a refusal is about its spelling.
    pub(super) path: Option<&'a str>,
}

/// The access-log line of a request, filled in as its phases learn more.
/// Only the path, never the query (it may carry secrets), never a JWT
/// (its fence number instead), never a body or a credential.
pub struct Access {
    pub(super) method: Method,
    pub(super) path: String,
    pub(super) started: Instant,
    pub(super) key: Option<String>,
    pub(super) token: Option<i64>,
}

impl Access {
    pub(super) fn of(req: &Request<Body>) -> Self {
        Self {
            method: req.method().clone(),
            path: req.uri().path().to_string(),
            started: Instant::now(),
            key: None,
            token: None,
        }
    }
}

/// Per-request accounting, the one place where a request's end is counted
/// and logged: for fenced writes its [`Outcome`] (exactly one per write),
/// for the rest pass-through counts; upstream failures; the recent
/// refusals the dashboard shows; error logs; the access-log line.
pub(super) fn account(
    state: &GatewayState,
    summary: Summary<'_>,
    access: Option<Access>,
    result: &Result<Response, GatewayError>,
) {
    let Summary {
        route,
        fenced,
        forwarded,
        with_idempotency_key,
        method,
        path,
    } = summary;
    let mut decided = None;
    if let Some(route) = route {
        if fenced {
            let outcome = match result {
                _ if forwarded => Some(Outcome::Forwarded),
                // Only a replay answers a fenced write it did not forward.
                Ok(_) => Some(Outcome::Replayed),
                Err(e) => refusal_outcome(e),
            };
            if let Some(o) = with_idempotency_key
                .then(|| idempotency_outcome(forwarded, result))
                .flatten()
            {
                route.metrics.idempotency(o);
            }
            decided = outcome;
            if let Some(outcome) = outcome {
                route.metrics.decision(outcome);
                if outcome == Outcome::StoreUnavailable {
                    state.metrics.store_error(StoreOp::Record);
                }
            }
        } else if forwarded {
            route.metrics.passthrough();
        }
        if let Err(GatewayError::Upstream(e)) = result {
            route.metrics.upstream_error(match e {
                UpstreamError::Unreachable { .. } => UpstreamFailure::Unreachable,
                UpstreamError::Timeout { .. } => UpstreamFailure::Timeout,
            });
        }
    }
    if let Some(a) = access {
        let status = match result {
            Ok(r) => r.status().as_u16(),
            Err(e) => e.status().as_u16(),
        };
        let outcome = match (decided, route) {
            (Some(o), _) => o.as_str(),
            (None, Some(_)) if !fenced && forwarded => "passthrough",
            (None, Some(_)) => "refused",
            (None, None) => "no_route",
        };
        tracing::info!(
            target: "fencegate::access",
            method = %a.method,
            path = %a.path,
            route = route.map_or("-", |r| r.name.as_str()),
            status,
            resource_key = a.key.as_deref(),
            token = a.token,
            outcome,
            duration_ms = a.started.elapsed().as_secs_f64() * 1000.0,
            "request"
        );
    }
    let Err(e) = result else { return };
    let seen = crate::gateway::refusals::Seen {
        route: route.map(|r| r.name.as_str()),
        method,
        path: path.unwrap_or_default(),
    };
    state.refusals.note(seen, e);
    log_failure(e);
}

/// The Idempotency-Key outcome of a fenced write with a key, when it has
/// one (a refusal of the fence has none).
fn idempotency_outcome(
    forwarded: bool,
    result: &Result<Response, GatewayError>,
) -> Option<IdempotencyOutcome> {
    match result {
        _ if forwarded => Some(IdempotencyOutcome::First),
        Ok(_) => Some(IdempotencyOutcome::Replayed),
        Err(GatewayError::Client(ClientError::IdempotencyReused)) => {
            Some(IdempotencyOutcome::Reused)
        }
        Err(GatewayError::Client(ClientError::IdempotencyInProgress { .. })) => {
            Some(IdempotencyOutcome::InProgress)
        }
        Err(GatewayError::Client(ClientError::IdempotencyOutcomeUnknown)) => {
            Some(IdempotencyOutcome::OutcomeUnknown)
        }
        Err(_) => None,
    }
}

/// The log line of a request that failed: at the level its cause deserves.
fn log_failure(e: &GatewayError) {
    match e {
        GatewayError::Store(err @ crate::store::StoreError::KeyBusy(_)) => {
            tracing::info!(error = %err, "resource key busy; answering 503")
        }
        GatewayError::Store(err) => {
            tracing::warn!(error = %err, "fence store unavailable; answering 503")
        }
        GatewayError::Upstream(UpstreamError::Unreachable { route, detail, .. }) => {
            tracing::warn!(%route, error = %detail, "upstream request failed")
        }
        GatewayError::Internal(what) => tracing::error!(what, "internal error"),
        _ => tracing::debug!(error = %e, "request refused"),
    }
}

/// The outcome of a fenced write refused before it was forwarded.
pub(super) fn refusal_outcome(e: &GatewayError) -> Option<Outcome> {
    use ClientError as C;
    Some(match e {
        GatewayError::Client(c) => match c {
            C::StaleToken { .. } => Outcome::Stale,
            C::MissingToken { .. } => Outcome::MissingToken,
            C::MalformedToken(_) => Outcome::MalformedToken,
            C::InvalidJwt(_) => Outcome::InvalidToken,
            C::JwtForOtherKey { .. } => Outcome::WrongSubject,
            C::BodyTooLarge { .. } => Outcome::TooLarge,
            C::ClientGone => Outcome::ClientGone,
            C::BadRequest(_) => Outcome::BadRequest,
            C::AmbiguousPath(_) => Outcome::AmbiguousPath,
            C::AmbiguousKey(_) => Outcome::AmbiguousKey,
            C::UnissuedToken { .. } => Outcome::Unissued,
            C::IdempotencyKey(_)
            | C::ProtectedHeader(_)
            | C::AmbiguousCredentials
            | C::AmbiguousHeader { .. } => Outcome::BadRequest,
            C::IdempotencyReused
            | C::IdempotencyInProgress { .. }
            | C::IdempotencyOutcomeUnknown => Outcome::IdempotencyConflict,
            // Not fenced writes: no route, refused before the method was
            // known to be fenced, or a head the server refused before any
            // route saw it.
            C::NoRoute { .. } | C::BadPath(_) | C::MethodNotAllowed { .. } | C::Head(_) => {
                return None
            }
        },
        GatewayError::Store(StoreError::KeyBusy(_)) => Outcome::KeyBusy,
        GatewayError::Store(StoreError::Late) => Outcome::Late,
        GatewayError::Store(_) => Outcome::StoreUnavailable,
        // Counted where they happen (upstream) or a bug (internal).
        GatewayError::Upstream(_) | GatewayError::Internal(_) => return None,
    })
}

/// What [`account`] needs of a fenced write, kept apart from the write
/// (whose request the forward consumes).
pub(super) struct PendingAccount {
    pub(super) route: Arc<GatedRoute>,
    pub(super) method: Method,
    pub(super) with_idempotency_key: bool,
    pub(super) access: Option<Access>,
}

impl PendingAccount {
    pub(super) fn settle(self, state: &GatewayState, forwarded: bool, ended: &Ended) {
        let summary = Summary {
            route: Some(&self.route),
            fenced: true,
            forwarded,
            with_idempotency_key: self.with_idempotency_key,
            method: &self.method,
            path: None,
        };
        account(state, summary, self.access, ended);
    }
}
