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
//! (`detach::DetachOnDrop`); where it must run on the store's runtime, it
//! is spawned there.
//!
//! # Layout
//!
//! This file holds the phases up to the fence (match route, check framing
//! and headers, read token, admit). Then:
//!
//! * [`fence`]: the decision: the durable record in the store, then the
//!   gate; what an admitted write holds ([`fence::Admission`]).
//! * `fenced`: a fenced write on its way, from arrival to forward.
//! * `idempotent`: the `Idempotency-Key` flow of a fenced write.
//! * `forward`: phase forward: the upstream exchange under its deadline.
//! * `upgrade`: phase tunnel: a pass-through GET's upgrade asked of the
//!   upstream, and its `101` made the answer that opens the tunnel.
//! * [`exchange`]: one fenced write's exchange, the one owner of "when is
//!   the upstream done with it", and so when its key may open.
//! * [`proxy`]: header hygiene and the body wrappers of a forward.
//! * `detach`: running a write to its end whatever its client does.
//! * `accounting`: metrics, the access log, refusals: per request, in one
//!   place.
//! * [`error`]: errors by origin, and their one mapping to problem
//!   documents.
//! * [`grpc`]: a refusal as a gRPC client reads one (`grpc-status`).
//! * [`refusals`]: the bounded ring of recent refusals the dashboard shows.
//! * [`live`]: what a request reads of the running config.
//!
//! Imports among them go one way: this file → `fenced` → `idempotent` →
//! `forward` → `detach`, `accounting` → `error`; this file → `upgrade` →
//! `forward`.

mod accounting;
mod detach;
pub mod error;
pub mod exchange;
pub mod fence;
mod fenced;
mod forward;
pub mod grpc;
mod idempotent;
pub mod live;
pub mod proxy;
pub mod refusals;
mod state;
mod upgrade;

pub use state::GatewayState;

use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::header::HeaderName;
use http::{header, Method, Request};

use crate::config::{PathsMode, Route, TokenKind};
use crate::fencing::jwt::JwtRejection;
use crate::fencing::routing::{self, PathError};
use crate::fencing::token::{self, TokenError};
use crate::gateway::error::{ClientError, GatewayError};
use crate::http1::codec;
use crate::idempotency;
use accounting::{account, Access, Summary};
use detach::YieldOnce;
use fenced::FencedWrite;
use forward::forward;
use live::{GatedRoute, Live};
use proxy::Downstream;

/// Every proxied request's answer: the upstream's, or a problem document.
pub async fn respond(state: Arc<GatewayState>, req: Request<Body>, peer: Downstream) -> Response {
    let retry_after = state.retry_after;
    let has_body = declares_body(req.headers());
    let grpc = grpc::is_grpc(req.headers());
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
            YieldOnce::default().await;
            let result = Err(error);
            let summary = Summary {
                route: route.as_deref(),
                fenced,
                forwarded: false,
                with_idempotency_key: false,
                method: &method,
                path: path.as_deref(),
            };
            account(&state, summary, access, &result);
            result
        }
        Admitted::PassThrough { route, req, tunnel } => {
            let method = req.method().clone();
            let result = match tunnel {
                None => forward(&state, &route, req, peer, None).await,
                Some(idle) => upgrade::open(&state, &route, req, peer, idle).await,
            };
            let summary = Summary {
                route: Some(&route),
                fenced: false,
                forwarded: true,
                with_idempotency_key: false,
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
        Err(e) if grpc => e.to_problem(retry_after).into_grpc(),
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
        /// A GET asking for an upgrade its route allows: the tunnel's idle
        /// bound.
        tunnel: Option<std::time::Duration>,
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
        Err(e) => return refused(None, false, unmatched(live, &req, e)),
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
    // Phase: upgrade (see `upgrade::decide`).
    let Ok(tunnel) = upgrade::decide(&route, &req, fenced) else {
        let e = not_allowed(&route, &Method::CONNECT);
        return refused(Some(&route), fenced, e.into());
    };
    if !fenced {
        if !is_safe(req.method()) {
            let e = not_allowed(&route, req.method());
            return refused(Some(&route), false, e.into());
        }
        return Admitted::PassThrough { route, req, tunnel };
    }
    let key = match resource_key(&route, &captures, &req) {
        Ok(k) => k,
        Err(e) => return refused(Some(&route), true, e),
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

/// Why no route matched: a write no route matches may well be an odd
/// spelling of a fenced resource (`/docs//x` for `/docs/{id}`), and then
/// the answer says so.
fn unmatched(live: &Live, req: &Request<Body>, e: GatewayError) -> GatewayError {
    let write = !is_safe(req.method());
    let strict = live.routes.iter().any(|r| r.paths == PathsMode::Strict);
    match (write, strict, routing::ambiguity(req.uri().path())) {
        (true, true, Some(why)) => ClientError::AmbiguousPath(why).into(),
        _ => e,
    }
}

/// Phase: resource key. Only fenced writes need it, and only for them
/// does a path spelling that could name another resource matter.
fn resource_key(
    route: &Route,
    captures: &routing::Captures,
    req: &Request<Body>,
) -> Result<String, GatewayError> {
    if route.paths == PathsMode::Strict {
        if let Some(why) = routing::ambiguity(req.uri().path()) {
            return Err(ClientError::AmbiguousPath(why).into());
        }
    }
    let source = routing::KeySource {
        captures,
        query: req.uri().query(),
        headers: req.headers(),
    };
    route
        .key
        .render(&source)
        .map_err(|e| ClientError::from(e).into())
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

/// 405: `method` is neither fenced nor safe on `route` (or, CONNECT, is a
/// tunnel the route does not open).
fn not_allowed(route: &Route, method: &Method) -> ClientError {
    ClientError::MethodNotAllowed {
        method: method.to_string(),
        route: route.name.clone(),
        allow: allow(route),
    }
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
