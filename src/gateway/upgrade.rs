//! Phase: tunnel. A pass-through GET that asks for an upgrade on a route
//! with `upgrades = true` (HTTP/1.1's `Connection: upgrade` and `Upgrade`,
//! or HTTP/2's extended CONNECT, which the server hands over as such a
//! GET) is sent to the upstream with its upgrade, over HTTP/1.1. The
//! upstream's `101` opens the tunnel: the answer carries the upstream's
//! side ([`Switched`]), and the client's server splices its side to it.
//! Any other answer is relayed as usual.
//!
//! Only here do the two HTTPs differ: HTTP/1.1's `101` goes back as a
//! `101`; an extended CONNECT is answered `200` (RFC 8441 §5). A WebSocket
//! over HTTP/2 has no `Sec-WebSocket-Key`, which an HTTP/1.1 upstream
//! needs: one is made here, and the upstream's `Sec-WebSocket-Accept` must
//! match it, or the upstream did not agree to that handshake (RFC 6455
//! §4.1) and nothing is tunnelled.
//!
//! Fenced methods never upgrade: only a safe, bodiless GET gets here (see
//! `admit`), so no write goes through a tunnel, where the gateway could
//! not see it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use base64::Engine as _;
use http::header::{self, HeaderValue};
use http::{Method, Request, StatusCode, Version};
use sha1::{Digest, Sha1};

use super::error::{ClientError, GatewayError, UpstreamError};
use super::forward::failed;
use super::live::GatedRoute;
use super::proxy::{self, Answer, Downstream, RelayBody};
use super::state::GatewayState;
use crate::config::Route;
use crate::http1::client::Upgrade;
use crate::http1::codec;
use crate::http1::tunnel::{Switched, Tunnel};
use crate::http2::tunnel::ExtendedConnect;

/// RFC 6455 §1.3: what a WebSocket server appends to the key it hashes.
const WEBSOCKET_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// An extended CONNECT that cannot be had: it is nothing but a tunnel, and
/// passed on as the GET it was handed over as it would be answered as a
/// plain GET. Answered 405.
pub(super) struct NotATunnel;

/// Phase: upgrade. `Ok(Some(idle))`: a tunnel is asked of the upstream,
/// with this idle bound; `Ok(None)`: none was asked, or an HTTP/1.1
/// upgrade that cannot be had, dropped with the other hop-by-hop fields.
/// Only a bodiless, pass-through GET on a route with `upgrades` upgrades,
/// and never to a protocol that carries HTTP itself ([`carries_http`]).
pub(super) fn decide(
    route: &Route,
    req: &Request<Body>,
    fenced: bool,
) -> Result<Option<Duration>, NotATunnel> {
    let connect = req.extensions().get::<ExtendedConnect>();
    if connect.is_none() && !asked(req) {
        return Ok(None);
    }
    let protocols: Vec<&[u8]> = match connect {
        Some(c) => vec![c.protocol.as_bytes()],
        None => upgrade_tokens(req.headers()).collect(),
    };
    let allowed = !fenced
        && req.method() == Method::GET
        && http_body::Body::is_end_stream(req.body())
        && !protocols.iter().any(|p| carries_http(p));
    match (route.upgrades, allowed) {
        (Some(idle), true) => Ok(Some(idle)),
        _ if connect.is_some() => Err(NotATunnel),
        _ => Ok(None),
    }
}

/// Whether an HTTP/1.1 request asks for an upgrade: an `Upgrade` field,
/// and `Connection` naming it (RFC 9110 §7.8). Without the latter, the
/// `Upgrade` is a stray hop-by-hop field, dropped like the others.
fn asked(req: &Request<Body>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().contains_key(header::UPGRADE)
        && codec::connection_tokens(req.headers()).any(|t| t.eq_ignore_ascii_case(b"upgrade"))
}

/// The protocols of every `Upgrade` field.
fn upgrade_tokens(headers: &http::HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::UPGRADE)
        .iter()
        .flat_map(|v| codec::tokens(v.as_bytes()))
        .filter(|t| !t.is_empty())
}

/// Whether a protocol carries HTTP itself (`h2c`, `h2`, `HTTP/2.0`, or
/// TLS that then carries it, RFC 2817). A tunnel to one would let a client
/// speak HTTP straight to the upstream, its writes never fenced: the
/// "h2c smuggling" of a proxy that tunnels any upgrade.
fn carries_http(protocol: &[u8]) -> bool {
    let starts =
        |p: &[u8]| protocol.len() >= p.len() && protocol[..p.len()].eq_ignore_ascii_case(p);
    protocol.eq_ignore_ascii_case(b"h2c")
        || protocol.eq_ignore_ascii_case(b"h2")
        || starts(b"http/")
        || starts(b"tls/")
}

/// Sends the upgrade to the upstream; its `101` becomes the answer that
/// opens the tunnel, with `idle` as the tunnel's idle bound.
pub(super) async fn open(
    state: &GatewayState,
    route: &Arc<GatedRoute>,
    mut req: Request<Body>,
    peer: Downstream,
    idle: Duration,
) -> Result<Response, GatewayError> {
    let started = Instant::now();
    let connect = req.extensions_mut().remove::<ExtendedConnect>();
    let asked: Vec<HeaderValue> = match &connect {
        Some(c) => vec![HeaderValue::from_str(&c.protocol)
            .map_err(|_| ClientError::BadRequest("the :protocol is not a valid token"))?],
        None => req
            .headers()
            .get_all(header::UPGRADE)
            .iter()
            .cloned()
            .collect(),
    };
    // A WebSocket over HTTP/2 has no key of its own (see the module docs).
    let key = connect
        .as_ref()
        .filter(|c| c.protocol.eq_ignore_ascii_case("websocket"))
        .map(|_| websocket_key());
    let mut up = proxy::upstream_request(req, &route.upstream, peer)
        .map_err(|_| ClientError::BadRequest("the request cannot be forwarded as given"))?;
    let headers = up.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    for protocol in &asked {
        headers.append(header::UPGRADE, protocol.clone());
    }
    if let Some(key) = &key {
        headers.insert(header::SEC_WEBSOCKET_KEY, key.clone());
        headers
            .entry(header::SEC_WEBSOCKET_VERSION)
            .or_insert(HeaderValue::from_static("13"));
    }
    let sent = tokio::time::timeout(route.timeout, state.client.upgrade(&route.upstream, up));
    let upgraded = match sent.await {
        Ok(Ok(u)) => u,
        Ok(Err(e)) => return Err(failed(state, route, e, None, None)),
        Err(_) => {
            return Err(UpstreamError::Timeout {
                route: route.name.clone(),
                timeout: route.timeout,
            }
            .into())
        }
    };
    route.metrics.upstream_latency(started.elapsed());
    let unreachable = |detail: &str| {
        GatewayError::from(UpstreamError::Unreachable {
            route: route.name.clone(),
            detail: detail.to_string(),
            sent: true,
        })
    };
    let (mut agreed, upstream) = match upgraded {
        Upgrade::Switched(agreed, upstream) => (agreed, upstream),
        // A 2xx to an extended CONNECT means "the tunnel is open".
        Upgrade::Refused(answer) if connect.is_some() && answer.status().is_success() => {
            return Err(unreachable(
                "the upstream answered the upgrade without switching protocols",
            ))
        }
        Upgrade::Refused(answer) => {
            let (parts, body) = answer.into_parts();
            let body = Body::new(RelayBody::new(Answer::Http1(body), None));
            return Ok(Response::from_parts(parts, body));
        }
    };
    if !switched_to_one_asked(&asked, agreed.headers()) {
        return Err(unreachable(
            "the upstream's 101 does not name one of the protocols asked for",
        ));
    }
    if let Some(key) = &key {
        let accept = agreed.headers_mut().remove(header::SEC_WEBSOCKET_ACCEPT);
        if accept.as_ref().map(HeaderValue::as_bytes) != Some(websocket_accept(key).as_bytes()) {
            return Err(unreachable(
                "the upstream's Sec-WebSocket-Accept does not match the key it was sent",
            ));
        }
    }
    if connect.is_some() {
        *agreed.status_mut() = StatusCode::OK;
        agreed.headers_mut().remove(header::UPGRADE);
    }
    let tunnel = Tunnel {
        upstream: Box::new(upstream),
        idle_timeout: idle,
        held: Box::new(route.metrics.tunnel_opened()),
    };
    let (mut parts, ()) = agreed.into_parts();
    parts.extensions.insert(Switched::new(tunnel));
    Ok(Response::from_parts(parts, Body::empty()))
}

/// Whether a `101`'s `Upgrade` names one protocol, one of those `asked`
/// (RFC 9110 §7.8). Anything else, HTTP itself among it, is not what
/// [`decide`] let through.
fn switched_to_one_asked(asked: &[HeaderValue], agreed: &http::HeaderMap) -> bool {
    let mut switched_to = upgrade_tokens(agreed);
    match (switched_to.next(), switched_to.next()) {
        (Some(p), None) => asked
            .iter()
            .flat_map(|v| codec::tokens(v.as_bytes()))
            .any(|a| a.eq_ignore_ascii_case(p)),
        _ => false,
    }
}

/// A fresh `Sec-WebSocket-Key`: 16 random bytes, base64 (RFC 6455 §4.1).
fn websocket_key() -> HeaderValue {
    let bytes: [u8; 16] = rand::random();
    let key = base64::engine::general_purpose::STANDARD.encode(bytes);
    HeaderValue::from_str(&key).unwrap_or(HeaderValue::from_static("dGhlIHNhbXBsZSBub25jZQ=="))
}

/// The `Sec-WebSocket-Accept` a server owes `key` (RFC 6455 §4.2.2).
fn websocket_accept(key: &HeaderValue) -> String {
    let mut sha = Sha1::new();
    sha.update(key.as_bytes());
    sha.update(WEBSOCKET_GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(sha.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 6455 §1.3's own example.
    #[test]
    fn the_accept_of_the_rfc_example_key() {
        let key = HeaderValue::from_static("dGhlIHNhbXBsZSBub25jZQ==");
        assert_eq!(websocket_accept(&key), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn keys_are_sixteen_random_bytes() {
        let (a, b) = (websocket_key(), websocket_key());
        assert_ne!(a, b);
        let raw = base64::engine::general_purpose::STANDARD
            .decode(a.as_bytes())
            .unwrap();
        assert_eq!(raw.len(), 16);
    }

    fn request(headers: &[(&str, &str)]) -> Request<Body> {
        let mut req = Request::get("/ws").body(Body::empty()).unwrap();
        for (n, v) in headers {
            req.headers_mut().append(
                header::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        req
    }

    #[test]
    fn protocols_that_carry_http_are_known_in_any_case() {
        for p in ["h2c", "H2C", "h2", "HTTP/2.0", "http/1.1", "TLS/1.2"] {
            assert!(carries_http(p.as_bytes()), "{p}");
        }
        for p in ["websocket", "WebSocket", "echo", "h2c-not", "xhttp/1"] {
            assert!(!carries_http(p.as_bytes()), "{p}");
        }
    }

    #[test]
    fn an_upgrade_is_asked_only_with_connection_naming_it() {
        assert!(asked(&request(&[
            ("upgrade", "websocket"),
            ("connection", "keep-alive, Upgrade")
        ])));
        assert!(!asked(&request(&[("upgrade", "websocket")])));
        assert!(!asked(&request(&[("connection", "upgrade")])));
        let mut old = request(&[("upgrade", "websocket"), ("connection", "upgrade")]);
        *old.version_mut() = Version::HTTP_10;
        assert!(!asked(&old));
    }
}
