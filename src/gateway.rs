//! A request's life through the gateway, as named phases:
//!
//! match route → check framing and size → read token → check fence → forward
//! → respond.
//!
//! Non-fenced (safe) methods skip the token and fence phases. Fenced writes
//! run their fence check and forward in a spawned task: once a write has
//! started its way to the upstream it must not be cut off halfway by the
//! client leaving, and its key stays closed to other tokens until the
//! upstream is done with it (see `exchange`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::response::{IntoResponse, Response};
use http::{header, Method, Request};
use tokio::sync::oneshot;

use crate::config::{Route, TokenKind};
use crate::error::{ClientError, GatewayError, UpstreamError};
use crate::exchange::Exchange;
use crate::fence::{Admission, Fence};
use crate::gate::Arrival;
use crate::jwt::JwtRejection;
use crate::metrics::{Metrics, RouteMetrics};
use crate::proxy::{self, BodyOutcome, HoldingBody, LimitedBody, UpstreamClient};
use crate::routing::{self, PathError};
use crate::token::{self, TokenError};

/// A configured route with its metric handles.
pub struct GatedRoute {
    pub route: Route,
    pub metrics: RouteMetrics,
}

impl GatedRoute {
    pub fn new(route: Route, metrics: &Metrics) -> Self {
        Self {
            metrics: metrics.for_route(&route.name),
            route,
        }
    }
}

impl std::ops::Deref for GatedRoute {
    type Target = Route;

    fn deref(&self) -> &Route {
        &self.route
    }
}

/// Shared state of the traffic listener, behind one `Arc`: the router
/// clones it for every request.
#[derive(Clone)]
pub struct GatewayState {
    /// Routes in file order; the first match wins.
    pub routes: Arc<[Arc<GatedRoute>]>,
    /// Store plus gate: the fence decision.
    pub fence: Fence,
    /// Pooled upstream connections, shared by all routes.
    pub client: UpstreamClient,
    pub metrics: Metrics,
    /// `[server] max_body_bytes`.
    pub max_body_bytes: u64,
    /// Sent as `Retry-After` with 503 answers.
    pub retry_after: Duration,
    /// Verifies JWT fence tokens on `token = "jwt"` routes.
    pub jwt: Option<Arc<crate::jwt::JwtKeys>>,
    /// The runtime that owns the store's connections. Requests are served on
    /// worker threads with runtimes of their own; a fenced write that talks
    /// to the store directly (shared mode) runs here instead, and outlives
    /// the worker. Single mode reaches the store only through the batcher's
    /// channel, so its writes stay on the worker.
    pub store_runtime: tokio::runtime::Handle,
}

/// The gateway as an axum handler (a router's fallback), for requests that
/// arrive through a router; the peer comes from `ConnectInfo`.
pub async fn handle(State(state): State<Arc<GatewayState>>, req: Request<Body>) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    respond(state, req, peer).await
}

/// Every proxied request's answer: the upstream's, or a problem document.
pub async fn respond(
    state: Arc<GatewayState>,
    req: Request<Body>,
    peer: Option<SocketAddr>,
) -> Response {
    let retry_after = state.retry_after;
    let has_body = declares_body(req.headers());
    match serve(state, req, peer).await {
        Ok(resp) => resp,
        Err(e) => {
            let mut resp = e.to_problem(retry_after).into_response();
            if has_body {
                // The request body may be unread (a refused write is never
                // read) and too large for the server to discard from what it
                // has buffered: it will close the connection, so say so and
                // the client does not send its next request into a closing
                // socket. Small bodies are discarded and keep-alive goes on.
                resp.headers_mut()
                    .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
            }
            match &e {
                GatewayError::Store(err @ crate::store::StoreError::KeyBusy(_)) => {
                    tracing::info!(error = %err, "resource key busy; answering 503")
                }
                GatewayError::Store(err) => {
                    tracing::warn!(error = %err, "fence store unavailable; answering 503")
                }
                GatewayError::Internal(what) => tracing::error!(what, "internal error"),
                _ => tracing::debug!(error = %e, "request refused"),
            }
            resp
        }
    }
}

/// Bodies up to this size normally arrive with the request head, and the
/// server discards them after a refusal without closing the connection.
const DISCARDABLE_BODY: u64 = 4096;

/// Whether a request's body may be left unread by a refusal: chunked, or
/// declared larger than what is normally buffered with the head.
fn declares_body(headers: &http::HeaderMap) -> bool {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        return true;
    }
    match headers.get(header::CONTENT_LENGTH) {
        None => false,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_none_or(|n| n > DISCARDABLE_BODY),
    }
}

async fn serve(
    state: Arc<GatewayState>,
    req: Request<Body>,
    peer: Option<SocketAddr>,
) -> Result<Response, GatewayError> {
    // Phase: match route.
    let (route, captures) = match_route(&state.routes, req.uri().path())?;

    // Phase: framing and size, before anything touches the store.
    let fenced = route.fenced_methods.contains(req.method());
    if let Err(e) = check_framing(&req, state.max_body_bytes) {
        if fenced && matches!(e, GatewayError::Client(ClientError::BodyTooLarge { .. })) {
            route.metrics.decision("too_large");
        }
        return Err(e);
    }

    if !fenced {
        if !is_safe(req.method()) {
            return Err(ClientError::MethodNotAllowed {
                method: req.method().to_string(),
                route: route.name.clone(),
            }
            .into());
        }
        route.metrics.passthrough();
        return forward(&state, &route, req, peer, None, None).await;
    }

    // Phase: read token. Only fenced writes need the resource key.
    let key = route.key.render(&captures);
    let token = match read_token(&state, &route, &key, req.headers()) {
        Ok(t) => t,
        Err((outcome, e)) => {
            route.metrics.decision(outcome);
            return Err(e.into());
        }
    };

    // Phase: check fence, cheapest part first. A token below one already
    // known durable is stale (tokens only grow): refuse it here, without a
    // task or the store. Otherwise the key's ticket is taken here, before
    // the task, in the same pass through the gate.
    let arrival = match state.fence.arrive(&key, token) {
        Ok(a) => a,
        Err(e) => {
            route.metrics.decision("stale");
            return Err(e);
        }
    };

    // Phases: check fence, forward, respond — detached from the client.
    let (tx, rx) = oneshot::channel();
    let runtime = state
        .fence
        .talks_to_store()
        .then(|| state.store_runtime.clone());
    let task = async move {
        let result = fenced_write(&state, &route, key, arrival, token, req, peer, &tx).await;
        let _ = tx.send(result);
    };
    match runtime {
        Some(rt) => drop(rt.spawn(task)),
        None => drop(tokio::spawn(task)),
    }
    rx.await.unwrap_or(Err(GatewayError::Internal(
        "the fenced write task ended without an answer",
    )))
}

/// The fencing token of a request: a decimal number, or the `fence` claim of
/// a verified JWT issued for this resource key.
fn read_token(
    state: &GatewayState,
    route: &Route,
    key: &str,
    headers: &http::HeaderMap,
) -> Result<i64, (&'static str, ClientError)> {
    match route.token {
        TokenKind::Integer => token::from_headers(headers).map_err(|e| match e {
            TokenError::Missing => (
                "missing_token",
                ClientError::MissingToken {
                    key: key.to_string(),
                },
            ),
            TokenError::Malformed(why) => ("malformed_token", ClientError::MalformedToken(why)),
        }),
        TokenKind::Jwt => {
            let raw = token::raw_from_headers(headers).map_err(|e| match e {
                TokenError::Missing => (
                    "missing_token",
                    ClientError::MissingToken {
                        key: key.to_string(),
                    },
                ),
                TokenError::Malformed(why) => {
                    ("invalid_token", ClientError::InvalidJwt(why.into()))
                }
            })?;
            let keys = state.jwt.as_ref().ok_or((
                "invalid_token",
                ClientError::InvalidJwt("no JWT keys are configured".into()),
            ))?;
            match keys.verify(raw, key) {
                Ok(claims) => Ok(claims.fence),
                Err(JwtRejection::Invalid(why)) => {
                    Err(("invalid_token", ClientError::InvalidJwt(why)))
                }
                Err(JwtRejection::WrongSubject {
                    expected,
                    presented,
                }) => Err((
                    "wrong_subject",
                    ClientError::JwtForOtherKey {
                        expected,
                        presented,
                    },
                )),
            }
        }
    }
}

/// Check the fence, then forward while holding the key's permit.
#[allow(clippy::too_many_arguments)]
async fn fenced_write(
    state: &GatewayState,
    route: &GatedRoute,
    key: String,
    arrival: Arrival,
    token: i64,
    req: Request<Body>,
    peer: Option<SocketAddr>,
    client: &oneshot::Sender<Result<Response, GatewayError>>,
) -> Result<Response, GatewayError> {
    let waited = Instant::now();
    let permit = match state.fence.check(&key, arrival, token, route.timeout).await {
        Ok(p) => p,
        Err(e) => {
            let outcome = match &e {
                GatewayError::Client(ClientError::StaleToken { .. }) => "stale",
                GatewayError::Store(crate::store::StoreError::KeyBusy(_)) => "key_busy",
                _ => {
                    state.metrics.store_error("record");
                    "store_unavailable"
                }
            };
            route.metrics.decision(outcome);
            return Err(e);
        }
    };
    state
        .metrics
        .gate_wait
        .observe(waited.elapsed().as_secs_f64());
    if client.is_closed() {
        // The client left while we waited: nobody would see the answer, so
        // do not start a write on its behalf. The token stays recorded,
        // which only ever makes older holders stale sooner.
        route.metrics.decision("client_gone");
        return Err(ClientError::BadRequest("client disconnected").into());
    }
    route.metrics.decision("forwarded");
    let deadline = permit.deadline;
    forward(state, route, req, peer, Some(permit), deadline).await
}

/// Phase: forward, and build the response.
async fn forward(
    state: &GatewayState,
    route: &GatedRoute,
    req: Request<Body>,
    peer: Option<SocketAddr>,
    permit: Option<Admission>,
    cap: Option<Instant>,
) -> Result<Response, GatewayError> {
    let started = Instant::now();
    // In shared mode other instances assume this write is over by `cap`.
    let deadline = match cap {
        Some(c) => c.min(started + route.timeout),
        None => started + route.timeout,
    };
    if Instant::now() >= deadline {
        // Shared mode, after a long stall (a paused process): other
        // instances already consider this write over, so it must not start.
        route.metrics.upstream_error("timeout");
        return Err(UpstreamError::Timeout {
            route: route.name.clone(),
            timeout: route.timeout,
        }
        .into());
    }
    let (parts, body) = req.into_parts();
    // No body (a GET, or Content-Length: 0): nothing to limit or watch.
    let has_body = !http_body::Body::is_end_stream(&body);
    let outcome = has_body.then(BodyOutcome::default);
    // A fenced write's permit lives in its exchange until the upstream is
    // done with the write, or the deadline.
    let exchange =
        permit.map(|p| Exchange::new(p, deadline, !has_body, state.store_runtime.clone()));
    let body = match &outcome {
        None => Body::empty(),
        Some(o) => Body::new(LimitedBody::new(
            body,
            state.max_body_bytes,
            o.clone(),
            exchange.clone(),
        )),
    };
    let upstream_req =
        proxy::upstream_request(Request::from_parts(parts, body), &route.upstream, peer)
            .map_err(|_| ClientError::BadRequest("the request cannot be forwarded as given"))?;

    let sent = tokio::time::timeout_at(deadline.into(), state.client.request(upstream_req)).await;
    match sent {
        Ok(Ok(resp)) => {
            route.metrics.upstream_latency(started.elapsed());
            let (mut parts, body) = resp.into_parts();
            proxy::strip_hop_by_hop(&mut parts.headers);
            let body = match exchange {
                Some(x) => {
                    x.response_head();
                    Body::new(HoldingBody::new(body, x))
                }
                None => Body::new(body),
            };
            Ok(Response::from_parts(parts, body))
        }
        Ok(Err(e)) => {
            // A connect error means nothing was sent: the key may open.
            // Anything else: the upstream may have received part or all of
            // the request and be working on it; dropping the exchange keeps
            // the key closed to other tokens until the deadline.
            if e.is_connect() {
                if let Some(x) = &exchange {
                    x.not_sent();
                }
            }
            drop(exchange);
            if outcome.as_ref().is_some_and(BodyOutcome::too_large) {
                // Already counted as `forwarded`: the upstream saw the start
                // of the body before it was cut off.
                return Err(ClientError::BodyTooLarge {
                    limit: state.max_body_bytes,
                }
                .into());
            }
            if outcome.as_ref().is_some_and(BodyOutcome::client_failed) {
                return Err(
                    ClientError::BadRequest("the client broke off the request body").into(),
                );
            }
            route.metrics.upstream_error("unreachable");
            tracing::warn!(route = %route.name, error = %e, "upstream request failed");
            Err(UpstreamError::Unreachable {
                route: route.name.clone(),
                detail: e.to_string(),
            }
            .into())
        }
        Err(_) => {
            route.metrics.upstream_error("timeout");
            Err(UpstreamError::Timeout {
                route: route.name.clone(),
                timeout: route.timeout,
            }
            .into())
        }
    }
}

/// Phase: find the first route whose pattern matches, and its resource key.
fn match_route(
    routes: &[Arc<GatedRoute>],
    path: &str,
) -> Result<(Arc<GatedRoute>, routing::Captures), GatewayError> {
    if crate::config::is_reserved(path) {
        return Err(ClientError::NoRoute {
            path: path.to_string(),
        }
        .into());
    }
    if routing::has_dot_segment(path) {
        return Err(ClientError::BadPath(
            "the path has a '.' or '..' segment; send the normalized path",
        )
        .into());
    }
    for route in routes.iter() {
        match route.pattern.matches(path) {
            Ok(Some(captures)) => return Ok((route.clone(), captures)),
            Ok(None) => continue,
            Err(PathError::NotUtf8) => {
                return Err(ClientError::BadPath("a path segment does not decode to UTF-8").into())
            }
            Err(PathError::DotSegment) => {
                return Err(ClientError::BadPath(
                    "the path has a '.' or '..' segment; send the normalized path",
                )
                .into())
            }
        }
    }
    Err(ClientError::NoRoute {
        path: path.to_string(),
    }
    .into())
}

/// Phase: refuse ambiguous framing and bodies declared too large.
fn check_framing(req: &Request<Body>, max_body: u64) -> Result<(), GatewayError> {
    let headers = req.headers();
    if headers.contains_key(header::TRANSFER_ENCODING)
        && headers.contains_key(header::CONTENT_LENGTH)
    {
        return Err(ClientError::BadRequest(
            "both Content-Length and Transfer-Encoding were sent (RFC 9112 §6.1)",
        )
        .into());
    }
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    if let Some(len) = lengths.next() {
        let declared: u64 = len
            .to_str()
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(ClientError::BadRequest("Content-Length is not a number"))?;
        if lengths.next().is_some() {
            return Err(ClientError::BadRequest("more than one Content-Length header").into());
        }
        if declared > max_body {
            return Err(ClientError::BodyTooLarge { limit: max_body }.into());
        }
    }
    Ok(())
}

fn is_safe(m: &Method) -> bool {
    m == Method::GET || m == Method::HEAD || m == Method::OPTIONS
}
