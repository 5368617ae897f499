//! Phase: forward. The request goes to the upstream with its deadline, a
//! fenced write's admission held in its exchange until the upstream is
//! done with it; the answer comes back with its body relayed.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use http::Request;

use super::detach::YieldOnce;
use super::error::{ClientError, GatewayError, UpstreamError};
use super::exchange::Exchange;
use super::fence::Admission;
use super::live::GatedRoute;
use super::proxy::{self, Answer, BodyOutcome, Downstream, LimitedBody, RelayBody};
use super::state::GatewayState;
use crate::config::UpstreamProtocol;
use crate::http1::client::Witness;
use crate::http2::client::Dial;

/// Phase: forward, and build the response.
pub(super) async fn forward(
    state: &GatewayState,
    route: &Arc<GatedRoute>,
    req: Request<Body>,
    peer: Downstream,
    permit: Option<Admission>,
) -> Result<Response, GatewayError> {
    YieldOnce::default().await;
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

    // Dropped at the deadline, the exchange's connection (or stream)
    // resets (see `http1::client::tcp`, `http2::client`): nothing of it
    // queued is delivered afterwards.
    let witness = exchange
        .as_ref()
        .map(|x| (x.deadline(), x.clone() as Arc<dyn Witness>));
    let sent = tokio::time::timeout_at(deadline.into(), async {
        match route.upstream_protocol {
            UpstreamProtocol::Http1 => state
                .client
                .send(&route.upstream, upstream_req, witness)
                .await
                .map(|r| r.map(Answer::Http1)),
            UpstreamProtocol::H2 | UpstreamProtocol::H2c => {
                let dial = match route.upstream_protocol {
                    UpstreamProtocol::H2 => Dial::Tls,
                    _ => Dial::Plain,
                };
                state
                    .h2
                    .send(&route.upstream, dial, upstream_req, witness)
                    .await
                    .map(|r| r.map(Answer::Http2))
            }
        }
    })
    .await;
    match sent {
        Ok(Ok(resp)) => {
            route.metrics.upstream_latency(started.elapsed());
            // Hop-by-hop fields of the answer are consumed by the upstream
            // client (see `http1::client::answer`).
            let (parts, body) = resp.into_parts();
            let body = Body::new(RelayBody::new(body, exchange));
            Ok(Response::from_parts(parts, body))
        }
        Ok(Err(e)) => Err(failed(state, route, e, exchange, outcome.as_ref())),
        Err(_) => Err(UpstreamError::Timeout {
            route: route.name.clone(),
            timeout: route.timeout,
        }
        .into()),
    }
}

/// What a forward that failed before its answer's head came ends in; a
/// fenced write's exchange is told whether anything was sent.
pub(super) fn failed(
    state: &GatewayState,
    route: &GatedRoute,
    e: crate::http1::client::SendError,
    exchange: Option<Arc<Exchange>>,
    outcome: Option<&BodyOutcome>,
) -> GatewayError {
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
    if outcome.is_some_and(BodyOutcome::too_large) {
        // Already counted as `forwarded`: the upstream saw the start
        // of the body before it was cut off.
        return ClientError::BodyTooLarge {
            limit: state.max_body_bytes,
        }
        .into();
    }
    if outcome.is_some_and(BodyOutcome::client_failed) {
        return ClientError::BadRequest("the client broke off the request body").into();
    }
    UpstreamError::Unreachable {
        route: route.name.clone(),
        detail: e.to_string(),
        sent: !e.nothing_sent(),
    }
    .into()
}
