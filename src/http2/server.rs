//! One HTTP/2 connection: its handshake, its accept loop, its end, and
//! each stream as one call of the listener's [`Service`].
//!
//! The protections, and whose they are:
//! - **CONTINUATION floods** (CVE-2024-27316) and oversized heads: h2
//!   bounds a header block by `SETTINGS_MAX_HEADER_LIST_SIZE`
//!   ([`Settings::max_header_list_bytes`]) and the number of CONTINUATION
//!   frames it may take, and answers more with GOAWAY.
//! - **Rapid reset** (CVE-2023-44487): h2 bounds the reset streams waiting
//!   to be accepted ([`PENDING_ACCEPT_RESETS`]) and the resets it must
//!   make itself for a client's protocol errors ([`LOCAL_ERROR_RESETS`]).
//!   A stream reset *after* it was accepted is counted here: past
//!   [`RESET_FLOOR`] resets, a connection whose resets outnumber its
//!   finished streams gets GOAWAY `ENHANCE_YOUR_CALM` and is closed.
//! - **SETTINGS and PING floods**: h2 holds one unanswered SETTINGS and
//!   one unanswered PING at a time and reads nothing more until the answer
//!   is written, so a flood costs the flooder its own reading, and a
//!   client that never reads is left with a connection that reads nothing,
//!   ended by the idle bound below.
//! - **Windows held open by a slow reader**: a stream's answer waits for
//!   the client's window one piece at a time, and h2 buffers at most
//!   [`SEND_BUFFER`] of it; a request body is given window space only as
//!   the service reads it ([`STREAM_WINDOW`], [`CONNECTION_WINDOW`]). What
//!   one connection holds is bounded by those and the stream limit.
//! - **Idle connections**: a connection without an open stream for the
//!   header-read timeout gets GOAWAY, as an idle HTTP/1.1 connection is
//!   closed; one that does not take its GOAWAY within that time again is
//!   dropped.
//!
//! A stop is a graceful GOAWAY: streams already open finish, new ones are
//! refused, as HTTP/1.1 connections finish their request in flight; a
//! tunnel (extended CONNECT, see [`super::tunnel`]) runs until the grace
//! period ends, then ends its stream with END_STREAM.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream};
use http::{header, Request, Uri};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use crate::http1::server::request::valid_host;
use crate::http1::server::{Drain, HeadError, Limits, Service};
use crate::http1::tunnel::{splice, Switched};

use super::body::{self, RecvBody, SendError};
use super::tunnel::{ExtendedConnect, StreamIo};

/// A listener's HTTP/2 settings (`[server] http2`, `h2_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`: requests in flight at once on one
    /// connection; more are refused with `REFUSED_STREAM`, which a client
    /// may retry.
    pub max_concurrent_streams: u32,
    /// `SETTINGS_MAX_HEADER_LIST_SIZE`: a request head's size, decoded;
    /// the HTTP/1.1 side's head limit, in HTTP/2's measure.
    pub max_header_list_bytes: u32,
}

/// What a client may send on one stream before the service reads it.
pub const STREAM_WINDOW: u32 = 256 * 1024;
/// What a client may send on all of a connection's streams before the
/// service reads it.
pub const CONNECTION_WINDOW: u32 = 1024 * 1024;
/// What h2 buffers of one stream's answer beyond what the client's window
/// lets go.
pub const SEND_BUFFER: usize = 64 * 1024;
/// Reset streams waiting to be accepted (h2's own rapid-reset guard).
pub const PENDING_ACCEPT_RESETS: usize = 20;
/// Streams h2 may reset for a client's protocol errors before it ends the
/// connection with `ENHANCE_YOUR_CALM`.
pub const LOCAL_ERROR_RESETS: usize = 64;
/// Resets a connection may make, whatever it finished, before its resets
/// are weighed against its finished streams.
pub const RESET_FLOOR: u64 = 100;
/// How long a connection told to go away for abuse has to take it.
const ABUSE_GRACE: Duration = Duration::from_secs(1);

/// Serves HTTP/2 on `io` (past the preface, or about to read it) until the
/// client leaves, the connection idles or is abused, or the server drains.
pub async fn serve<I, S>(io: I, service: S, settings: Settings, limits: Limits, drain: Arc<Drain>)
where
    I: AsyncRead + AsyncWrite + Unpin,
    S: Service + Sync,
{
    let _entered = drain.enter().await;
    let mut builder = h2::server::Builder::new();
    builder
        .max_concurrent_streams(settings.max_concurrent_streams)
        .max_header_list_size(settings.max_header_list_bytes)
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_send_buffer_size(SEND_BUFFER)
        .max_pending_accept_reset_streams(PENDING_ACCEPT_RESETS)
        .max_local_error_reset_streams(Some(LOCAL_ERROR_RESETS))
        // Extended CONNECT (RFC 8441): whether a route takes one is the
        // service's to say, as for an HTTP/1.1 `Upgrade`.
        .enable_connect_protocol();
    let handshake = builder.handshake::<_, Bytes>(io);
    let mut conn = match tokio::time::timeout(limits.header_read_timeout, handshake).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "HTTP/2 handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!("HTTP/2 handshake timed out");
            return;
        }
    };
    let service = Arc::new(service);
    let streams = Arc::new(Streams::default());
    let mut idle = pin!(tokio::time::sleep(limits.header_read_timeout));
    // Set once the connection is told to go: past it, it is dropped.
    let mut hard_end: Option<Instant> = None;
    let mut draining = false;
    loop {
        let event = poll_fn(|cx| {
            if let Poll::Ready(accepted) = conn.poll_accept(cx) {
                return Poll::Ready(Event::Accepted(accepted.map(|a| a.map(Box::new))));
            }
            if !draining && drain.started() {
                return Poll::Ready(Event::Drain);
            }
            if idle.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Event::Idle);
            }
            Poll::Pending
        })
        .await;
        match event {
            Event::Accepted(Some(Ok(opened))) => {
                let (req, respond) = *opened;
                if streams.abused() {
                    tracing::debug!("HTTP/2 client reset too many streams; GOAWAY");
                    conn.abrupt_shutdown(Reason::ENHANCE_YOUR_CALM);
                    hard_end = Some(Instant::now() + ABUSE_GRACE);
                    idle.as_mut().reset(Instant::now() + ABUSE_GRACE);
                    continue;
                }
                idle.as_mut()
                    .reset(Instant::now() + limits.header_read_timeout);
                let open = Open::new(&streams);
                tokio::spawn(stream(service.clone(), req, respond, open, drain.clone()));
            }
            Event::Accepted(Some(Err(e))) => {
                tracing::debug!(error = %e, "HTTP/2 connection ended");
                return;
            }
            Event::Accepted(None) => return,
            Event::Drain => {
                draining = true;
                conn.graceful_shutdown();
            }
            Event::Idle => {
                let now = Instant::now();
                if hard_end.is_some_and(|end| now >= end) {
                    return;
                }
                if streams.open.load(Ordering::Acquire) == 0 && hard_end.is_none() {
                    conn.graceful_shutdown();
                    hard_end = Some(now + limits.header_read_timeout);
                }
                idle.as_mut().reset(now + limits.header_read_timeout);
            }
        }
    }
}

/// A stream the client opened: its request, and where its answer goes.
type Opened = (Request<RecvStream>, SendResponse<Bytes>);

/// What woke the accept loop. The opened stream is boxed: it is the rare,
/// large case, and the event is made on every wake.
enum Event {
    Accepted(Option<Result<Box<Opened>, h2::Error>>),
    Drain,
    Idle,
}

/// A connection's stream counts, shared with its stream tasks.
#[derive(Default)]
struct Streams {
    /// Streams accepted and not yet ended.
    open: AtomicUsize,
    /// Streams the client reset before their answer was sent whole.
    resets: AtomicU64,
    /// Streams whose answer was handed to h2 whole (what the rapid-reset
    /// rule weighs resets against; not a claim about the client).
    finished: AtomicU64,
}

impl Streams {
    /// Whether the client resets more streams than it lets finish, past
    /// the floor: the shape of a rapid-reset attack, which makes the
    /// server start work for every stream and never takes an answer.
    fn abused(&self) -> bool {
        let resets = self.resets.load(Ordering::Relaxed);
        resets > RESET_FLOOR && resets > self.finished.load(Ordering::Relaxed)
    }
}

/// One open stream's place in its connection's counts.
struct Open(Arc<Streams>);

impl Open {
    fn new(streams: &Arc<Streams>) -> Self {
        streams.open.fetch_add(1, Ordering::AcqRel);
        Self(streams.clone())
    }

    fn reset(&self) {
        self.0.resets.fetch_add(1, Ordering::Relaxed);
    }

    fn finished(&self) {
        self.0.finished.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One stream: its request through the service, its answer back; or, for
/// an extended CONNECT the service agreed to, the tunnel.
async fn stream<S: Service + Sync>(
    service: Arc<S>,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    open: Open,
    drain: Arc<Drain>,
) {
    let mut connect = None;
    let answer = match request(req) {
        Ok((req, recv)) => {
            connect = recv;
            let mut call = pin!(service.call(req));
            // A reset before the answer drops the request's future: the
            // client left, as when an HTTP/1.1 client closes its connection.
            let answered = poll_fn(|cx| {
                if let Poll::Ready(answer) = call.as_mut().poll(cx) {
                    return Poll::Ready(Some(answer));
                }
                match respond.poll_reset(cx) {
                    Poll::Ready(_) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match answered {
                Some(answer) => answer,
                None => return open.reset(),
            }
        }
        Err(why) => service.refuse(why),
    };
    let (mut parts, body) = answer.into_parts();
    super::connection_specific(&mut parts.headers);
    if let Some(recv) = connect {
        let tunnel = parts.extensions.remove::<Switched>().and_then(|s| s.take());
        match tunnel {
            Some(tunnel) if parts.status.is_success() => {
                let Ok(send) = respond.send_response(Response::from_parts(parts, ()), false) else {
                    return open.reset();
                };
                open.finished();
                let ended = splice(StreamIo::new(recv, send), tunnel, drain.closing()).await;
                tracing::debug!(?ended, "HTTP/2 tunnel ended");
                return;
            }
            // A 2xx would tell the client its tunnel is open.
            None if parts.status.is_success() => {
                respond.send_reset(Reason::INTERNAL_ERROR);
                return;
            }
            _ => {}
        }
    }
    let end = http_body::Body::is_end_stream(&body);
    let mut tx = match respond.send_response(Response::from_parts(parts, ()), end) {
        Ok(tx) => tx,
        Err(e) => {
            tracing::debug!(error = %e, "an HTTP/2 answer head could not be sent");
            return open.reset();
        }
    };
    if end {
        return open.finished();
    }
    match body::send(&mut tx, body).await {
        Ok(()) => open.finished(),
        Err(SendError::Reset) => open.reset(),
        Err(SendError::Body | SendError::Connection) => {}
    }
}

/// A stream's request as an HTTP/1.1 connection would hand it over:
/// origin-form target, one valid `Host` (the `:authority`, which a `host`
/// field must not contradict), the body as a [`RecvBody`]. An extended
/// CONNECT becomes the bodiless `GET` it stands for, marked
/// [`ExtendedConnect`]; its stream's DATA is kept for the tunnel.
fn request(req: Request<RecvStream>) -> Result<(Request<Body>, Option<RecvStream>), HeadError> {
    let (mut parts, recv) = req.into_parts();
    let mut recv = Some(recv);
    let mut tunnel = None;
    if parts.method == http::Method::CONNECT {
        // A plain CONNECT (a proxy's TCP tunnel to any host) is not
        // proxied: no route carries one.
        let Some(protocol) = parts.extensions.remove::<h2::ext::Protocol>() else {
            return Err(HeadError::Malformed);
        };
        parts.method = http::Method::GET;
        parts.extensions.insert(ExtendedConnect {
            protocol: protocol.as_str().to_owned(),
        });
        parts.headers.remove(header::CONTENT_LENGTH);
        tunnel = recv.take();
    }
    let authority = parts.uri.authority().map(|a| a.as_str().to_owned());
    let mut hosts = parts.headers.get_all(header::HOST).iter();
    let host = match (hosts.next(), hosts.next(), authority) {
        (Some(_), Some(_), _) => return Err(HeadError::Host),
        (Some(h), None, Some(a)) if !h.as_bytes().eq_ignore_ascii_case(a.as_bytes()) => {
            return Err(HeadError::Host)
        }
        (Some(h), None, _) => h.clone(),
        (None, _, Some(a)) => http::HeaderValue::from_str(&a).map_err(|_| HeadError::Host)?,
        (None, _, None) => return Err(HeadError::Host),
    };
    if !valid_host(host.as_bytes()) {
        return Err(HeadError::Host);
    }
    parts.headers.insert(header::HOST, host);
    let target = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    parts.uri = Uri::try_from(target).map_err(|_| HeadError::Malformed)?;
    let Some(recv) = recv else {
        return Ok((Request::from_parts(parts, Body::empty()), tunnel));
    };
    let length = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    Ok((
        Request::from_parts(parts, Body::new(RecvBody::new(recv, length))),
        None,
    ))
}
