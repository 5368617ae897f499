//! A request's life through the gateway, as named phases:
//!
//! match route → check framing and size → read token → check fence → forward
//! → respond.
//!
//! Non-fenced (safe) methods skip the token and fence phases. A fenced
//! write's fence check and forward run to their end whatever the client
//! does: once a write has started its way to the upstream it must not be
//! cut off halfway by the client leaving, and its key stays closed to other
//! tokens until the upstream is done with it (see `exchange`). Where the
//! write's store part runs on this worker, it is polled in the request's
//! own future and spawned only if the client leaves first
//! ([`ToTheEnd`]); where it must run on the store's runtime, it is spawned
//! there.

pub mod error;
pub mod exchange;
pub mod fence;
pub mod live;
pub mod proxy;
pub mod refusals;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::header::HeaderName;
use http::{header, Method, Request};
use tokio::sync::oneshot;

use crate::config::{PathsMode, Route, TokenKind};
use crate::fencing::gate::Arrival;
use crate::fencing::jwt::JwtRejection;
use crate::fencing::routing::{self, PathError};
use crate::fencing::token::{self, TokenError};
use crate::gateway::error::{ClientError, GatewayError, UpstreamError};
use crate::gateway::exchange::Exchange;
use crate::gateway::fence::Keyed;
use crate::gateway::fence::{Admission, Fence};
use crate::http1::client::UpstreamClient;
use crate::http1::codec;
use crate::idempotency::{self, Cached};
use crate::metrics::IdempotencyOutcome;
use crate::metrics::{Metrics, Outcome, StoreOp, UpstreamFailure};
use crate::store::{Begin, Found, RecordId, StoreError, StoredAnswer};
use live::{GatedRoute, Live};
use proxy::Downstream;
use proxy::{BodyOutcome, LimitedBody, RelayBody};

/// Shared state of the traffic listener, behind one `Arc`: the router
/// clones it for every request.
#[derive(Clone)]
pub struct GatewayState {
    /// The reloadable part: this worker's copy of what every worker (and
    /// the lock API and admin listener, for the auth clients) shares.
    pub live: live::WorkerLive,
    /// Store plus gate: the fence decision.
    pub fence: Fence,
    /// Pooled upstream connections, shared by all routes.
    pub client: UpstreamClient,
    pub metrics: Metrics,
    /// The recent refusals the dashboard shows.
    pub refusals: Arc<crate::gateway::refusals::Refusals>,
    /// `[server] max_body_bytes`.
    pub max_body_bytes: u64,
    /// Sent as `Retry-After` with 503 answers.
    pub retry_after: Duration,
    /// Completed Idempotency-Key records' answers, replayed without a store
    /// read (see `idempotency::cache`).
    pub replays: Arc<idempotency::ReplayCache>,
    /// The runtime that owns the store's connections. Requests are served on
    /// worker threads with runtimes of their own; a keyed first use in
    /// shared mode, whose statement uses the store's connections directly,
    /// runs its store part and forward here instead, and outlives the
    /// worker. Every other fenced write reaches the store only through a
    /// batcher's channel, so it stays on its worker. Each worker has its own
    /// `Arc` of it: every fenced write's exchange clones it, and a clone of
    /// the runtime's own handle would write to the count all workers share
    /// (see `reload::WorkerLive`).
    pub store_runtime: Arc<tokio::runtime::Handle>,
    /// Unsent first uses' records being forgotten; shared by every worker,
    /// so that a retry on any of them takes its record back at once.
    pub forgets: Arc<idempotency::Forgets>,
}

impl GatewayState {
    /// The state of one traffic worker: its own upstream pool, and its own
    /// copies of what every request would otherwise clone from memory all
    /// workers share (the live config, the gate's handle, the store
    /// runtime's handle).
    pub fn for_worker(&self) -> Self {
        // The clone of `live` is a copy of its own (see its `Clone`).
        Self {
            client: UpstreamClient::new(),
            store_runtime: Arc::new((*self.store_runtime).clone()),
            fence: self.fence.worker_copy(),
            ..self.clone()
        }
    }
}

/// Every proxied request's answer: the upstream's, or a problem document.
pub async fn respond(state: Arc<GatewayState>, req: Request<Body>, peer: Downstream) -> Response {
    let retry_after = state.retry_after;
    let has_body = declares_body(req.headers());
    let live = state.live.load();
    let mut access = live.access_log.then(|| Access::of(&req));
    let result = match admit(&state, &live, req, &mut access) {
        Admitted::Refused {
            route,
            fenced,
            error,
            method,
            path,
        } => {
            Behind::default().await;
            let result = Err(error);
            let summary = Summary {
                route: route.as_deref(),
                fenced,
                forwarded: false,
                keyed: false,
                method: &method,
                path: path.as_deref(),
            };
            account(&state, summary, access, &result);
            result
        }
        Admitted::PassThrough { route, req } => {
            let method = req.method().clone();
            let result = forward(&state, &route, req, peer, None).await;
            let summary = Summary {
                route: Some(&route),
                fenced: false,
                forwarded: true,
                keyed: false,
                method: &method,
                path: None,
            };
            account(&state, summary, access, &result);
            result
        }
        Admitted::Fenced(write) => write.run(state, peer, access).await,
    };
    match result {
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
            resp
        }
    }
}

/// What one request came to, for [`account`].
#[derive(Clone, Copy)]
struct Summary<'a> {
    route: Option<&'a GatedRoute>,
    fenced: bool,
    forwarded: bool,
    /// A fenced write with an `Idempotency-Key`.
    keyed: bool,
    method: &'a Method,
    /// The path, when a refusal is about its spelling.
    path: Option<&'a str>,
}

/// The access-log line of a request, filled in as its phases learn more.
/// Only the path, never the query (it may carry secrets), never a JWT
/// (its fence number instead), never a body or a credential.
pub struct Access {
    method: Method,
    path: String,
    started: Instant,
    key: Option<String>,
    token: Option<i64>,
}

impl Access {
    fn of(req: &Request<Body>) -> Self {
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
fn account(
    state: &GatewayState,
    summary: Summary<'_>,
    access: Option<Access>,
    result: &Result<Response, GatewayError>,
) {
    let Summary {
        route,
        fenced,
        forwarded,
        keyed,
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
            if keyed {
                let idem = match result {
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
                };
                if let Some(o) = idem {
                    route.metrics.idempotency(o);
                }
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
fn refusal_outcome(e: &GatewayError) -> Option<Outcome> {
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

/// Bodies up to this size normally arrive with the request head, and the
/// server discards them after a refusal without closing the connection.
const DISCARDABLE_BODY: u64 = 4096;

/// How often a first use claims its key's record when the live record its
/// claim found has gone by the time it is read (see
/// `decide_keyed_and_forward`). The claim after taking back a record of a
/// request never sent does not count.
const MAX_CLAIMS: u32 = 2;

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

/// What the phases before the forward decided.
enum Admitted {
    /// Refused before anything was forwarded.
    Refused {
        route: Option<Arc<GatedRoute>>,
        fenced: bool,
        error: GatewayError,
        method: Method,
        /// Only for a refusal of the path's spelling, which the dashboard
        /// shows: nothing is copied for the rest.
        path: Option<String>,
    },
    /// A safe method: forwarded without a check.
    PassThrough {
        route: Arc<GatedRoute>,
        req: Request<Body>,
    },
    /// A fenced write whose token memory did not refuse; the store and the
    /// gate decide the rest. Boxed: the write (its request among it) moves
    /// from here into the request's future and on into its own task, and a
    /// box moves as a pointer.
    Fenced(Box<FencedWrite>),
}

/// Phases: match route → check framing and size → read token → the fence's
/// memory-only step. All synchronous and cheap; nothing touches the store.
fn admit(
    state: &GatewayState,
    live: &Live,
    req: Request<Body>,
    access: &mut Option<Access>,
) -> Admitted {
    let refused = |route: Option<&Arc<GatedRoute>>, fenced, error: GatewayError| {
        let about_path = matches!(
            error,
            GatewayError::Client(ClientError::AmbiguousPath(_) | ClientError::AmbiguousKey(_))
        );
        Admitted::Refused {
            route: route.cloned(),
            fenced,
            path: about_path.then(|| req.uri().path().to_string()),
            method: req.method().clone(),
            error,
        }
    };
    // Phase: match route.
    let (route, captures) = match match_route(&live.routes, req.uri().path()) {
        Ok(m) => m,
        Err(e) => {
            // A write no route matches may well be an odd spelling of a
            // fenced resource (`/docs//x` for `/docs/{id}`): say so.
            let write = !is_safe(req.method());
            let strict = live.routes.iter().any(|r| r.paths == PathsMode::Strict);
            if let (true, true, Some(why)) = (write, strict, routing::ambiguity(req.uri().path())) {
                return refused(None, false, ClientError::AmbiguousPath(why).into());
            }
            return refused(None, false, e);
        }
    };
    // Phase: framing and size, before anything touches the store; then
    // the headers the gateway relies on, which must reach the upstream as
    // they were checked.
    let fenced = route.fenced_methods.contains(req.method());
    if let Err(e) = check_framing(&req, state.max_body_bytes) {
        return refused(Some(&route), fenced, e);
    }
    if let Err(e) = check_headers(&route, req.headers(), fenced) {
        return refused(Some(&route), fenced, e.into());
    }
    if !fenced {
        if !is_safe(req.method()) {
            let e = ClientError::MethodNotAllowed {
                method: req.method().to_string(),
                route: route.name.clone(),
                allow: allow(&route),
            };
            return refused(Some(&route), false, e.into());
        }
        return Admitted::PassThrough { route, req };
    }
    // Phase: resource key. Only fenced writes need it, and only for them
    // does a path spelling that could name another resource matter.
    if route.paths == PathsMode::Strict {
        if let Some(why) = routing::ambiguity(req.uri().path()) {
            return refused(Some(&route), true, ClientError::AmbiguousPath(why).into());
        }
    }
    let source = routing::KeySource {
        captures: &captures,
        query: req.uri().query(),
        headers: req.headers(),
    };
    let key = match route.key.render(&source) {
        Ok(k) => k,
        Err(e) => return refused(Some(&route), true, ClientError::from(e).into()),
    };
    // Phase: read token.
    if let Some(a) = access.as_mut() {
        a.key = Some(key.clone());
    }
    let token = match read_token(live, &route, &key, req.headers()) {
        Ok(t) => t,
        Err(e) => return refused(Some(&route), true, e.into()),
    };
    if let Some(a) = access.as_mut() {
        a.token = Some(token);
    }
    // Phase: idempotency key. A write that carries one may be a replay of
    // one that happened, so memory must not refuse it as stale before its
    // record is looked up: its fence step waits until then.
    let idem = match &route.idempotency {
        None => None,
        Some(settings) => match idempotency::key_of(req.headers(), settings) {
            Ok(k) => k,
            Err(e) => return refused(Some(&route), true, ClientError::from(e).into()),
        },
    };
    if idem.is_some() {
        return Admitted::Fenced(Box::new(FencedWrite {
            route,
            key,
            token,
            arrival: None,
            idem,
            req,
        }));
    }
    // Phase: the fence's memory-only step. A token below one already known
    // durable is stale (tokens only grow): refused here, without a task or
    // the store. Otherwise the key's ticket is taken here, in the same pass
    // through the gate.
    match state.fence.arrive(&key, token) {
        Ok(arrival) => Admitted::Fenced(Box::new(FencedWrite {
            route,
            key,
            token,
            arrival: Some(arrival),
            idem: None,
            req,
        })),
        Err(e) => refused(Some(&route), true, e),
    }
}

/// The fencing token of a request: a decimal number, or the `fence` claim of
/// a verified JWT issued for this resource key.
fn read_token(
    live: &Live,
    route: &Route,
    key: &str,
    headers: &http::HeaderMap,
) -> Result<i64, ClientError> {
    let missing = || ClientError::MissingToken {
        key: key.to_string(),
    };
    match route.token {
        TokenKind::Integer | TokenKind::Issued => {
            token::from_headers(headers).map_err(|e| match e {
                TokenError::Missing => missing(),
                TokenError::Malformed(why) => ClientError::MalformedToken(why),
            })
        }
        TokenKind::Jwt => {
            let raw = token::raw_from_headers(headers).map_err(|e| match e {
                TokenError::Missing => missing(),
                TokenError::Malformed(why) => ClientError::InvalidJwt(why.into()),
            })?;
            let keys = live
                .jwt
                .as_ref()
                .ok_or_else(|| ClientError::InvalidJwt("no JWT keys are configured".into()))?;
            match keys.verify(raw, key) {
                Ok(claims) => Ok(claims.fence),
                Err(JwtRejection::Invalid(why)) => Err(ClientError::InvalidJwt(why)),
                Err(JwtRejection::WrongSubject {
                    expected,
                    presented,
                }) => Err(ClientError::JwtForOtherKey {
                    expected,
                    presented,
                }),
            }
        }
    }
}

/// A fenced write on its way: the store and the gate decide, then forward.
struct FencedWrite {
    route: Arc<GatedRoute>,
    key: String,
    token: i64,
    /// The key's ticket from the memory-only step; `None` for a keyed write
    /// until memory has no answer for its key.
    arrival: Option<Arrival>,
    /// The `Idempotency-Key`, on routes that use them.
    idem: Option<String>,
    req: Request<Body>,
}

/// A first use of an idempotency key, as far as memory knows: its body
/// read and fingerprinted, no completed record of its key cached.
struct FirstUse {
    settings: crate::config::IdempotencySettings,
    key: String,
    fingerprint: [u8; 32],
}

/// How a fenced write ended.
type Ended = Result<Response, GatewayError>;

/// What [`account`] needs of a fenced write, kept apart from the write
/// (whose request the forward consumes).
struct Books {
    route: Arc<GatedRoute>,
    method: Method,
    keyed: bool,
    access: Option<Access>,
}

impl Books {
    fn close(self, state: &GatewayState, forwarded: bool, ended: &Ended) {
        let summary = Summary {
            route: Some(&self.route),
            fenced: true,
            forwarded,
            keyed: self.keyed,
            method: &self.method,
            path: None,
        };
        account(state, summary, self.access, ended);
    }
}

/// Spawns a fenced write's task on `rt`, or on this worker's runtime.
///
/// The task's future is boxed: it is a few kilobytes (the forward's state
/// is in it), and tokio moves a task's stage whole each time it changes
/// (spawned, finished), where a box moves as a pointer. One allocation
/// costs less than those copies (`bench/profile.sh --instructions`
/// counts both).
fn spawn_on(
    rt: Option<tokio::runtime::Handle>,
    task: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let task = Box::pin(task);
    match rt {
        Some(rt) => drop(rt.spawn(task)),
        None => drop(tokio::spawn(task)),
    }
}

/// Whether the client a fenced write answers has left: then a write still
/// waiting to start never starts (see [`FencedWrite::may_start`]).
trait Audience: Sync {
    fn left(&self) -> bool;
}

/// A write spawned on its own: its answer's receiver is the client.
impl Audience for oneshot::Sender<Ended> {
    fn left(&self) -> bool {
        self.is_closed()
    }
}

/// A write in the request's future: set when that future is dropped.
impl Audience for AtomicBool {
    fn left(&self) -> bool {
        self.load(Ordering::Acquire)
    }
}

/// A fenced write polled in the request's own future, on the connection's
/// task, and spawned to run to its end only if that future is dropped
/// before it (the client left).
///
/// Why not always spawn: a task per write costs its spawn, a second task
/// woken when the upstream answers, and a channel to hand the answer back,
/// on every fenced write, for a departure that few have. The write's future
/// is boxed either way, so handing it to a task on drop moves a pointer;
/// what it holds (its ticket or permit, the upstream exchange) goes on
/// exactly as in a task spawned at the start.
struct ToTheEnd {
    /// `None` once it has ended (or was handed to a task).
    write: Option<Pin<Box<dyn Future<Output = Ended> + Send>>>,
    /// Set when the request's future is dropped before the write ended.
    left: Arc<AtomicBool>,
}

impl ToTheEnd {
    fn new(
        write: Box<FencedWrite>,
        state: Arc<GatewayState>,
        peer: Downstream,
        access: Option<Access>,
    ) -> Self {
        let left = Arc::new(AtomicBool::new(false));
        let client = left.clone();
        let books = write.books(access, false);
        let write = Box::pin(async move {
            let (forwarded, ended) = write.decide_and_forward(&state, peer, &*client).await;
            books.close(&state, forwarded, &ended);
            ended
        });
        Self {
            write: Some(write),
            left,
        }
    }
}

impl Future for ToTheEnd {
    type Output = Ended;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Ended> {
        let Some(write) = self.write.as_mut() else {
            return Poll::Ready(Err(GatewayError::Internal(
                "a fenced write was polled after its end",
            )));
        };
        let ended = ready!(write.as_mut().poll(cx));
        self.write = None;
        Poll::Ready(ended)
    }
}

impl Drop for ToTheEnd {
    fn drop(&mut self) {
        let Some(write) = self.write.take() else {
            return;
        };
        self.left.store(true, Ordering::Release);
        // A write that panicked is not polled again; outside a runtime
        // (it is shutting down) nothing would run a task.
        if std::thread::panicking() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            drop(rt.spawn(async move { drop(write.await) }));
        }
    }
}

impl FencedWrite {
    /// Phases: check fence, forward, respond — detached from the client: once
    /// a write has started its way to the upstream it must not be cut off
    /// halfway by the client leaving. The task accounts for the write itself
    /// (the client may be gone by the time it ends).
    ///
    /// A write without an `Idempotency-Key` is polled here, on this worker,
    /// in either mode: its decision reaches the store only through a
    /// batcher's channel (single mode's fence batches, shared mode's
    /// admissions and leaves), whose answers come back to this worker, and
    /// its forward uses this worker's upstream connections. A keyed write
    /// first asks memory for a completed record of its key
    /// ([`FencedWrite::ask_memory`]), on this worker: a replay from memory
    /// (or its 422) needs neither the store nor, in shared mode, a hop to
    /// the store's runtime.
    async fn run(
        mut self: Box<Self>,
        state: Arc<GatewayState>,
        peer: Downstream,
        access: Option<Access>,
    ) -> Result<Response, GatewayError> {
        let Some(key) = self.idem.take() else {
            return ToTheEnd::new(self, state, peer, access).await;
        };
        let (answer, answered) = oneshot::channel();
        self.start(key, state, peer, access, answer);
        answered.await.unwrap_or(Err(GatewayError::Internal(
            "the fenced write task ended without an answer",
        )))
    }

    /// Spawns a keyed write's task. Not part of `run`'s future on purpose:
    /// the task's state would then count in the request's future too, which
    /// is moved into its box on every request.
    fn start(
        self: Box<Self>,
        key: String,
        state: Arc<GatewayState>,
        peer: Downstream,
        access: Option<Access>,
        answer: oneshot::Sender<Ended>,
    ) {
        // Where the store's part runs: in shared mode on the store's
        // runtime (the keyed decision uses its connections directly), after
        // the memory step, which runs here.
        let store_rt = state
            .fence
            .keyed_talks_to_store()
            .then(|| (*state.store_runtime).clone());
        let books = self.books(access, true);
        let mut write = self;
        spawn_on(None, async move {
            let first = match Box::pin(write.ask_memory(&state, key)).await {
                Ok(first) => first,
                Err(ended) => {
                    books.close(&state, false, &ended);
                    let _ = answer.send(ended);
                    return;
                }
            };
            let rest = async move {
                let (forwarded, ended) = write
                    .decide_keyed_and_forward(&state, peer, first, &answer)
                    .await;
                books.close(&state, forwarded, &ended);
                let _ = answer.send(ended);
            };
            match store_rt {
                rt @ Some(_) => spawn_on(rt, rest),
                None => rest.await,
            }
        });
    }

    /// What accounting needs of the write once its request is consumed.
    /// `keyed`: the write came with an `Idempotency-Key` (which `run` has
    /// taken out of it by then).
    fn books(&self, access: Option<Access>, keyed: bool) -> Books {
        Books {
            route: self.route.clone(),
            method: self.req.method().clone(),
            keyed,
            access,
        }
    }

    /// The write's arrival at the gate: the one the admit phase already
    /// took, or a new one.
    fn arrival(&mut self, state: &GatewayState) -> Result<Arrival, GatewayError> {
        match self.arrival.take() {
            Some(a) => Ok(a),
            None => state.fence.arrive(&self.key, self.token),
        }
    }

    /// Phase: idempotency key, from memory. Reads the body (keyed writes
    /// are buffered: the fingerprint covers it), then asks the cache of
    /// completed records: a replay or a 422 ends here (`Err`), without the
    /// store; otherwise the write goes on as a first use, as far as memory
    /// knows (the record's insert will tell the truth).
    async fn ask_memory(&mut self, state: &GatewayState, key: String) -> Result<FirstUse, Ended> {
        let settings = self.route.idempotency.ok_or(Err(GatewayError::Internal(
            "an idempotency key on a route without idempotency",
        )))?;
        let body = std::mem::take(self.req.body_mut());
        let limit = state.max_body_bytes as usize;
        let bytes =
            match http_body_util::BodyExt::collect(http_body_util::Limited::new(body, limit)).await
            {
                Ok(c) => c.to_bytes(),
                Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                    return Err(Err(ClientError::BodyTooLarge {
                        limit: state.max_body_bytes,
                    }
                    .into()))
                }
                Err(_) => {
                    return Err(Err(ClientError::BadRequest(
                        "the client broke off the request body",
                    )
                    .into()))
                }
            };
        let pq = self
            .req
            .uri()
            .path_and_query()
            .map_or("/", |pq| pq.as_str());
        let fingerprint =
            idempotency::fingerprint(self.req.method(), pq, self.req.headers(), &bytes);
        *self.req.body_mut() = Body::from(bytes);
        match state
            .replays
            .get(self.record_id(&key), &fingerprint, Instant::now())
        {
            Cached::Replay(resp) => Err(Ok(resp)),
            Cached::Reused => Err(Err(ClientError::IdempotencyReused.into())),
            Cached::Miss => Ok(FirstUse {
                settings,
                key,
                fingerprint,
            }),
        }
    }

    /// A write without an `Idempotency-Key`: check the fence, then forward
    /// while holding the key's admission. Answers whether the write was
    /// forwarded, and the result. Its own future, apart from a keyed
    /// write's: the write's task holds it, and moves it at its spawn and
    /// its end, so what the plain path does not need is not in it.
    async fn decide_and_forward(
        mut self: Box<Self>,
        state: &GatewayState,
        peer: Downstream,
        client: &dyn Audience,
    ) -> (bool, Ended) {
        let arrival = match self.arrival(state) {
            Ok(a) => a,
            Err(e) => return (false, Err(e)),
        };
        let decided = Instant::now();
        let issued_only = self.route.token == TokenKind::Issued;
        let check = state.fence.check(
            &self.key,
            arrival,
            self.token,
            self.route.timeout,
            issued_only,
        );
        let admission = match check.await {
            Ok(a) => a,
            Err(e) => return (false, Err(e)),
        };
        state.metrics.decision_time.observe(decided.elapsed());
        if let Err(e) = self.may_start(&admission, client, None) {
            return (false, Err(e));
        }
        let result = forward(state, &self.route, self.req, peer, Some(admission)).await;
        (true, result)
    }

    /// Whether an admitted write may still start its forward: not when its
    /// client left while it waited (nobody would see the answer; the token
    /// stays recorded, which only ever makes older holders stale sooner),
    /// and not when this instance stalled so long that the write's
    /// in-flight marker (shared mode) or its idempotency record (`record`:
    /// when it stops being in flight, and the store's timeout for storing
    /// the answer) would end before its exchange could. Nothing was sent in
    /// either case; the key opens again.
    fn may_start(
        &self,
        admission: &Admission,
        client: &dyn Audience,
        record: Option<(Instant, Duration)>,
    ) -> Result<(), GatewayError> {
        if client.left() {
            return Err(ClientError::ClientGone.into());
        }
        let left = |end: Instant| end.saturating_duration_since(Instant::now());
        if let Some(end) = admission.must_end_by {
            if left(end) < self.route.timeout {
                return Err(StoreError::Late.into());
            }
        }
        if let Some((until, store_timeout)) = record {
            // The exchange and the storing of its answer must be over while
            // the record is in flight. Past it, duplicates hear "outcome
            // unknown", and once it expired one may take the key over and
            // be forwarded.
            if left(until) < self.route.timeout + store_timeout {
                return Err(StoreError::Late.into());
            }
        }
        Ok(())
    }

    /// A first use of an `Idempotency-Key`: check the fence and write the
    /// key's record, forward, and store the answer before returning it.
    /// Answers whether the write was forwarded, and the result.
    async fn decide_keyed_and_forward(
        mut self: Box<Self>,
        state: &GatewayState,
        peer: Downstream,
        first: FirstUse,
        client: &dyn Audience,
    ) -> (bool, Ended) {
        // Owned handles, so that the record's id does not borrow `self`,
        // whose request the forward consumes (an `Arc` and, for the usual
        // methods, no allocation).
        let route = self.route.clone();
        let route_name = route.name.as_str();
        let method = self.req.method().clone();
        let id = || RecordId {
            route: route_name,
            method: method.as_str(),
            key: &first.key,
        };
        // While this instance holds fenced writes back after a crash (the
        // quarantine), a first use waits before its record is written; a
        // replay must not wait with it, so then the store is asked first.
        if state.fence.holding_back() {
            match Box::pin(recorded(state, id(), &first.fingerprint)).await {
                // A record of a request never sent is taken back below.
                Ok(Said::Nothing | Said::Unsent(_)) => {}
                Ok(Said::Ended(ended)) => return (false, ended),
                Err(e) => return (false, Err(e)),
            }
        }
        let decided = Instant::now();
        let issued_only = self.route.token == TokenKind::Issued;
        let store_timeout = state.fence.store.timeout();
        // A claim that finds a live record whose read then finds none: the
        // record went in between (its own first use was refused before
        // anything was sent and forgot it, or it expired). Nothing holds
        // the key's record any more, so this request is its first use and
        // claims it again; only a record that vanishes a second time is
        // answered 503, for the client to retry.
        let mut claims = 1;
        // Whether a record of a request never sent was taken back (once).
        let mut took_back = false;
        let (admission, record_until, expires, attempt) = loop {
            let arrival = match self.arrival(state) {
                Ok(a) => a,
                Err(e) => {
                    let record = (id(), first.fingerprint);
                    return (false, Box::pin(unless_recorded(state, record, e)).await);
                }
            };
            let attempt: i64 = rand::random();
            // The record: written once the fence admits the write, in one
            // transaction with it where the store allows it (see
            // `Fence::check_keyed`). Its insert is also the lookup: a live
            // record of the key (a duplicate, or a replay memory did not
            // know) is found only then, and read.
            let begin = Begin {
                id: id(),
                fingerprint: &first.fingerprint,
                attempt,
                in_flight: idempotency::in_flight(self.route.timeout, store_timeout),
                ttl: first.settings.ttl,
            };
            // Before the record's statement starts: with the record's
            // lifetime, a local lower bound of its expiry.
            let begun = Instant::now();
            let lives = Duration::from_millis(begin.in_flight.max(begin.ttl).as_millis() as u64);
            let check = Box::pin(state.fence.check_keyed(
                &self.key,
                arrival,
                self.token,
                self.route.timeout,
                issued_only,
                &begin,
            ));
            match check.await {
                Ok(Keyed::Admitted {
                    admission,
                    record_until,
                }) => {
                    break (
                        admission,
                        record_until,
                        idempotency::cached_until(begun, lives),
                        attempt,
                    )
                }
                // A live record of the key: tell what it says. When it is
                // the record of a request this instance never sent (whose
                // client was told 503) and is forgetting, it is forgotten
                // now and the key claimed again, once: the client's retry
                // is the key's first use, not "in progress" until the
                // background forget lands. A store that cannot forget it
                // now is 503 again.
                Ok(Keyed::Duplicate) => {
                    match Box::pin(recorded(state, begin.id, &first.fingerprint)).await {
                        Ok(Said::Ended(ended)) => return (false, ended),
                        Ok(Said::Unsent(unsent)) if !took_back => {
                            took_back = true;
                            if let Err(e) = state.forgets.take_back(begin.id, unsent).await {
                                return (false, Err(e.into()));
                            }
                            continue;
                        }
                        Ok(Said::Unsent(_)) => {
                            let e = "the key's record of a request never sent outlived its forget";
                            return (false, Err(StoreError::Other(e.into()).into()));
                        }
                        Ok(Said::Nothing) if claims < MAX_CLAIMS => {
                            claims += 1;
                            continue;
                        }
                        Ok(Said::Nothing) => {
                            return (
                                false,
                                Err(StoreError::Other(
                                    "the key's idempotency record vanished twice while it was read"
                                        .into(),
                                )
                                .into()),
                            )
                        }
                        Err(e) => return (false, Err(e)),
                    }
                }
                Ok(Keyed::Refused(e)) => {
                    let record = (begin.id, first.fingerprint);
                    return (false, Box::pin(unless_recorded(state, record, e)).await);
                }
                Err(e) => {
                    // Nothing was forwarded; the record may have been
                    // written all the same (see `check_keyed`).
                    state.forgets.later(begin.id, attempt, begun + lives);
                    return (false, Err(e));
                }
            }
        };
        state.metrics.decision_time.observe(decided.elapsed());
        let record = Some((record_until, store_timeout));
        if let Err(e) = self.may_start(&admission, client, record) {
            // Nothing was sent: the key's record goes.
            state.forgets.later(id(), attempt, expires);
            return (false, Err(e));
        }
        // Phase: forward, then store the answer before returning it.
        let result = forward(state, &self.route, self.req, peer, Some(admission)).await;
        let end = FirstEnd {
            id: id(),
            attempt,
            fingerprint: first.fingerprint,
            expires,
        };
        (
            true,
            Box::pin(idempotency_answer(
                state,
                &self.route,
                end,
                &first.settings,
                result,
            ))
            .await,
        )
    }

    fn record_id<'a>(&'a self, key: &'a str) -> RecordId<'a> {
        RecordId {
            route: &self.route.name,
            method: self.req.method().as_str(),
            key,
        }
    }
}

/// What a key's record says to a request ([`recorded`]).
enum Said {
    /// No live record.
    Nothing,
    /// The record of a request this instance never sent, which it is
    /// forgetting (the record's attempt): an answer to no one.
    Unsent(i64),
    /// A completed record's answer, or a refusal.
    Ended(Ended),
}

/// What the store's record `id` says to a request of `fingerprint`: a
/// completed record's answer (remembered in memory from now on), or a
/// refusal; nothing when there is no live record, or when it is the
/// record of a request this instance never sent and is forgetting.
async fn recorded(
    state: &GatewayState,
    id: RecordId<'_>,
    fingerprint: &[u8; 32],
) -> Result<Said, GatewayError> {
    // Before the read's statement starts: with the time to expiry it
    // reports, a local lower bound of the record's expiry.
    let anchor = Instant::now();
    let read = state.fence.store.idem_read(id, fingerprint).await?;
    if let Some(attempt) = read.attempt.filter(|a| state.forgets.forgetting(id, *a)) {
        return Ok(Said::Unsent(attempt));
    }
    Ok(match read.found {
        Found::Absent => Said::Nothing,
        Found::Done(stored) => {
            let until = idempotency::cached_until(anchor, read.expires_in);
            state
                .replays
                .insert(id, *fingerprint, &stored, until, Instant::now());
            Said::Ended(Ok(replay(stored)))
        }
        Found::Reused => Said::Ended(Err(ClientError::IdempotencyReused.into())),
        Found::InFlight { for_ms } => Said::Ended(Err(ClientError::IdempotencyInProgress {
            retry_after: Duration::from_millis(for_ms),
        }
        .into())),
        Found::Unknown => Said::Ended(Err(ClientError::IdempotencyOutcomeUnknown.into())),
    })
}

/// A keyed write refused before its record (its id and fingerprint) was
/// written: the refusal stands only if the key has no live record, or only
/// the record of a request this instance never sent. A record of an
/// earlier request answers instead — a replay's token is stale once a
/// newer one was recorded, and a replay is served all the same (the write
/// did happen); a duplicate in flight is 409 in progress. When the store
/// cannot be read, its error: the gateway cannot tell which it is.
async fn unless_recorded(
    state: &GatewayState,
    (id, fingerprint): (RecordId<'_>, [u8; 32]),
    refusal: GatewayError,
) -> Ended {
    match recorded(state, id, &fingerprint).await {
        Ok(Said::Nothing | Said::Unsent(_)) => Err(refusal),
        Ok(Said::Ended(ended)) => ended,
        Err(e) => Err(e),
    }
}

/// A stored answer, replayed.
fn replay(stored: StoredAnswer) -> Response {
    let (status, headers) = idempotency::replay_head(&stored);
    let mut resp = Response::new(Body::from(stored.body));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

/// A forwarded first use's record, for its end.
struct FirstEnd<'a> {
    id: RecordId<'a>,
    attempt: i64,
    fingerprint: [u8; 32],
    /// A local lower bound of the record's expiry.
    expires: Instant,
}

/// The end of a first use: the upstream's answer stored durably before it
/// is returned, and remembered for replays once it is; or, when it cannot
/// be stored, the record told what is known.
async fn idempotency_answer(
    state: &GatewayState,
    route: &GatedRoute,
    end: FirstEnd<'_>,
    settings: &crate::config::IdempotencySettings,
    result: Result<Response, GatewayError>,
) -> Result<Response, GatewayError> {
    let FirstEnd {
        id,
        attempt,
        fingerprint,
        expires,
    } = end;
    let store = &state.fence.store;
    let resp = match result {
        Ok(resp) => resp,
        // Nothing of it was sent (the connection failed): the key may be
        // used again (once forgotten, which is tried in the background when
        // the store fails now).
        Err(e @ GatewayError::Upstream(UpstreamError::Unreachable { sent: false, .. })) => {
            state.forgets.now_or_later(id, attempt, expires).await;
            return Err(e);
        }
        Err(e) => {
            route.metrics.idempotency(IdempotencyOutcome::NotStored);
            if let Err(err) = store.idem_unknown(id, attempt).await {
                tracing::warn!(error = %err, "cannot mark an idempotency record unknown; it becomes so when its time runs out");
            }
            return Err(e);
        }
    };
    let (parts, body) = resp.into_parts();
    match idempotency::buffer(body, settings.max_response_bytes).await {
        Ok(idempotency::Buffered::Whole(bytes)) => {
            let stored = StoredAnswer {
                status: parts.status.as_u16(),
                headers: parts
                    .headers
                    .iter()
                    .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
                    .collect(),
                body: bytes.clone(),
            };
            match store.idem_complete(id, attempt, &stored).await {
                // Durable in the record, which nothing changes until it
                // expires: replays may come from memory until then.
                Ok(true) => state
                    .replays
                    .insert(id, fingerprint, &stored, expires, Instant::now()),
                // The record is no longer this attempt's (this gateway
                // stalled past its time and a duplicate took the expired
                // record over): nothing stored, nothing remembered.
                Ok(false) => {
                    route.metrics.idempotency(IdempotencyOutcome::NotStored);
                    tracing::warn!(
                        "an idempotency answer came after its record's time; not stored"
                    );
                }
                Err(err) => {
                    // The answer is the truth: give it; duplicates will hear
                    // "outcome unknown" once the record's time runs out.
                    route.metrics.idempotency(IdempotencyOutcome::NotStored);
                    tracing::warn!(error = %err, "cannot store an idempotency answer");
                }
            }
            Ok(Response::from_parts(parts, Body::from(bytes)))
        }
        Ok(idempotency::Buffered::TooLarge(body)) => {
            route.metrics.idempotency(IdempotencyOutcome::NotStored);
            if let Err(err) = store.idem_unknown(id, attempt).await {
                tracing::warn!(error = %err, "cannot mark an idempotency record unknown; it becomes so when its time runs out");
            }
            Ok(Response::from_parts(parts, body))
        }
        Err(()) => {
            route.metrics.idempotency(IdempotencyOutcome::NotStored);
            if let Err(err) = store.idem_unknown(id, attempt).await {
                tracing::warn!(error = %err, "cannot mark an idempotency record unknown; it becomes so when its time runs out");
            }
            Err(UpstreamError::Unreachable {
                route: route.name.clone(),
                detail: "the upstream's answer broke off".into(),
                sent: true,
            }
            .into())
        }
    }
}

/// Steps behind the tasks already ready on this worker, once: the
/// requests that arrived together are read and decided first, and then
/// go to the upstream together (or, refused, get their answers together).
///
/// Why: under load each send to an upstream on the same machine wakes the
/// upstream's process, which on few cores then takes a core from the
/// gateway's worker in the middle of its batch of ready connections.
/// Sends made one after another wake it once for all of them. Without the
/// step, passed-through GETs and fenced writes polled in the request's
/// future ([`ToTheEnd`]) were measurably slower (`bench/ab.sh`; the runs
/// are in `bench/analysis.md`); a spawned write takes the same step by
/// being queued behind the ready connections. Under light load nothing
/// else is ready, and the step costs one more poll of the request's task,
/// not a wait.
#[derive(Default)]
struct Behind {
    stepped: bool,
}

impl Future for Behind {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.stepped {
            return Poll::Ready(());
        }
        self.stepped = true;
        // Woken while it runs: the task goes to the back of the worker's
        // queue, behind the tasks already ready there.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Phase: forward, and build the response.
async fn forward(
    state: &GatewayState,
    route: &Arc<GatedRoute>,
    req: Request<Body>,
    peer: Downstream,
    permit: Option<Admission>,
) -> Result<Response, GatewayError> {
    Behind::default().await;
    let started = Instant::now();
    // In shared mode other instances take the write's in-flight marker as
    // the bound on its life: the exchange must be over by its end, however
    // long this instance stalled since the admission.
    let deadline = match permit.as_ref().and_then(|p| p.must_end_by) {
        Some(end) => end.min(started + route.timeout),
        None => started + route.timeout,
    };
    let (parts, body) = req.into_parts();
    // No body (a GET, or Content-Length: 0): nothing to limit or watch.
    let has_body = !http_body::Body::is_end_stream(&body);
    let outcome = has_body.then(BodyOutcome::default);
    // A fenced write's permit lives in its exchange until the upstream is
    // done with the write, or the deadline.
    let exchange = permit.map(|p| {
        let runtime = state.store_runtime.clone();
        Exchange::new(p, deadline, runtime, route.clone())
    });
    let body = match &outcome {
        None => Body::empty(),
        Some(o) => Body::new(LimitedBody::new(
            body,
            state.max_body_bytes,
            o.clone(),
            exchange.as_ref().map(|x| x.deadline()),
        )),
    };
    let upstream_req =
        proxy::upstream_request(Request::from_parts(parts, body), &route.upstream, peer)
            .map_err(|_| ClientError::BadRequest("the request cannot be forwarded as given"))?;

    // Dropped at the deadline, the exchange's connection resets (see
    // `upstream::tcp`): nothing of it queued is delivered afterwards.
    let sent = tokio::time::timeout_at(
        deadline.into(),
        state.client.send(
            &route.upstream,
            upstream_req,
            exchange.as_ref().map(|x| {
                (
                    x.deadline(),
                    x.clone() as Arc<dyn crate::http1::client::Witness>,
                )
            }),
        ),
    )
    .await;
    match sent {
        Ok(Ok(resp)) => {
            route.metrics.upstream_latency(started.elapsed());
            // Hop-by-hop fields of the answer are consumed by the upstream
            // client (see `upstream::wire`).
            let (parts, body) = resp.into_parts();
            let body = Body::new(RelayBody::new(body, exchange));
            Ok(Response::from_parts(parts, body))
        }
        Ok(Err(e)) => {
            // Nothing sent (the connection or its TLS handshake failed): the
            // key may open. Anything else: the upstream may have received
            // part or all of the request and be working on it; dropping the
            // exchange keeps the key closed to other tokens until the
            // deadline.
            if e.nothing_sent() {
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
            Err(UpstreamError::Unreachable {
                route: route.name.clone(),
                detail: e.to_string(),
                sent: !e.nothing_sent(),
            }
            .into())
        }
        Err(_) => Err(UpstreamError::Timeout {
            route: route.name.clone(),
            timeout: route.timeout,
        }
        .into()),
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

/// Phase: the headers the gateway relies on, on every proxied request
/// (fenced or not). It reads the credentials, the fencing token, the
/// `Idempotency-Key` and the route's `{header.NAME}` key parts, and
/// forwards them as it read them; so
///
/// * more than one `Authorization` header is refused (400
///   `ambiguous-credentials`): servers disagree on which one counts, so
///   the upstream and anything else on the way may each judge the
///   request by another one;
/// * a `Connection` header naming one of them is refused (400
///   `protected-header`): a proxy removes what `Connection` names, so the
///   upstream would get the write without the very header it was fenced
///   by (a key part missing there may default to another resource, a
///   token missing there cannot be checked again).
///
/// * on a fenced write, a header name with `_` is refused (400
///   `ambiguous-header`): CGI, WSGI and Rack turn `-` into `_`, so
///   `X_Tenant` reaches such an application as the very variable
///   `X-Tenant` does, and it may read the one the gateway did not check
///   (Puma's CVE-2024-45614). A pass-through request's are dropped
///   instead (`proxy::upstream_request`), as nginx does by default.
///
/// All cost next to nothing on the usual request: one lookup for
/// `Connection`, the `Authorization` values are counted only when some
/// header is repeated (see [`crate::auth::two_authorizations`]), and a
/// fenced write's names are looked through once for `_`.
fn check_headers(
    route: &Route,
    headers: &http::HeaderMap,
    fenced: bool,
) -> Result<(), ClientError> {
    if crate::auth::two_authorizations(headers) {
        return Err(ClientError::AmbiguousCredentials);
    }
    if fenced {
        if let Some(name) = headers.keys().find(|n| codec::is_underscored(n)) {
            let dashed = name.as_str().replace('_', "-");
            return Err(ClientError::AmbiguousHeader {
                name: name.to_string(),
                shadows: protected(route, dashed.as_bytes()).map(str::to_string),
            });
        }
    }
    if !headers.contains_key(header::CONNECTION) {
        return Ok(());
    }
    for token in codec::connection_tokens(headers) {
        if let Some(name) = protected(route, token) {
            return Err(ClientError::ProtectedHeader(name.to_string()));
        }
    }
    Ok(())
}

/// The headers every proxied request's `Connection` must leave alone,
/// whatever its route.
static PROTECTED: [HeaderName; 3] = [
    token::HEADER,
    idempotency::IDEMPOTENCY_KEY,
    header::AUTHORIZATION,
];

/// The header `token` (a `Connection` token, in any case) names, if the
/// gateway relies on it on `route`.
fn protected<'a>(route: &'a Route, token: &[u8]) -> Option<&'a str> {
    PROTECTED
        .iter()
        .map(HeaderName::as_str)
        .chain(route.key.header_names().map(HeaderName::as_str))
        .find(|name| name.as_bytes().eq_ignore_ascii_case(token))
}

/// A 405's `Allow` (RFC 9110 §15.5.6): the safe methods, passed through,
/// and the route's fenced ones.
fn allow(route: &Route) -> http::HeaderValue {
    let mut methods = String::from("GET, HEAD, OPTIONS");
    for m in &route.fenced_methods {
        if !is_safe(m) {
            methods.push_str(", ");
            methods.push_str(m.as_str());
        }
    }
    http::HeaderValue::try_from(methods)
        .unwrap_or(http::HeaderValue::from_static("GET, HEAD, OPTIONS"))
}

fn is_safe(m: &Method) -> bool {
    m == Method::GET || m == Method::HEAD || m == Method::OPTIONS
}
