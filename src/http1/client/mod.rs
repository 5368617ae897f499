//! The upstream client: HTTP/1.1 connections to the upstreams, over TCP or
//! TLS, kept by each worker for its own requests, and an exchange run in
//! the future that asks for it.
//!
//! A general client (hyper's) runs each connection in a task of its own:
//! a request goes to it through a channel, its answer comes back through
//! another, and its body through a third, with a task wake in each
//! direction. A proxy with a handful of upstreams per worker needs none of
//! that. Here a worker keeps, per upstream, a stack of idle connections; a
//! request pops one (or connects), writes itself and reads the answer's
//! head in its own future, and the answer's body reads itself from the
//! connection and hands it back when the exchange is over ([`flight`]).
//! Heads are parsed with `httparse` once, headers written as the bytes they
//! are, head and body sent in one write ([`answer`]).
//!
//! **Retries.** A request is sent again, once and on a new connection
//! (the pool's others may be as dead), only when not one byte of it was
//! written: a reused connection is first checked for a
//! close without waiting, and a write that fails at once is counted. A
//! request of which any byte may have been written is never sent again —
//! the upstream may be applying it — with one exception: a bodiless GET,
//! HEAD or OPTIONS that failed on a reused connection before its answer,
//! which HTTP lets a client repeat (RFC 9110 §9.2.2) and which is how an
//! idle connection the upstream closed mid-send shows. Fenced writes are
//! never among them.
//!
//! **When a connection is handed back**: after the answer's body ended
//! *and* the request was handed over before the answer began (the
//! upstream's TCP acknowledged all of it: see `flight`), so "the exchange
//! ended normally" means both directions are over at the upstream, which is
//! what the fenced write's `Exchange` needs to hear (see
//! `proxy::RelayBody`). A connection that cannot carry another exchange (an
//! answer read to the close, `Connection: close`, bytes past the answer, an
//! early answer, a request not finished) is closed instead, and every close
//! but one after a normal end resets it ([`tcp`]).
//!
//! **Deadlines a connection enforces itself**: see [`cutoff`].
//!
//! **TLS** upstreams (`https://`) are verified against the platform's trust
//! roots or the route's `upstream_ca_file`, with SNI and the hostname check
//! always on. TLS wraps the same socket, and the exchange runs over it on
//! the same path as plain TCP.
//!
//! # Layout
//!
//! * [`upstream`]: an upstream as the client reaches it: address, `Host`,
//!   TLS.
//! * [`answer`]: the bytes: request heads written, answer heads read, how
//!   each body is framed.
//! * [`connection`]: one connection: its socket, reads and writes.
//! * [`tcp`]: what the socket's TCP can tell and do: queued bytes, resets.
//! * [`flight`]: one exchange on a connection, and the answer's body.
//! * [`cutoff`]: an exchange's deadline, and the watchdog that cuts the
//!   connection at it.

pub mod answer;
mod connection;
mod cutoff;
mod flight;
mod tcp;
mod upstream;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Request, Response};

pub use answer::WireError;
use connection::Connection;
pub use connection::Upgraded;
pub use flight::UpstreamBody;
use flight::{Flight, RequestWriter};
pub use upstream::{Upstream, UpstreamTls};

/// Idle connections kept per upstream and worker.
const MAX_IDLE: usize = 256;
/// An idle connection older than this is closed rather than reused: the
/// upstream has likely closed it already, or soon will.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// One worker's connections; cheap to clone (clones share them).
#[derive(Clone, Default)]
pub struct UpstreamClient {
    idle: Arc<Mutex<HashMap<Arc<str>, Vec<Idle>>>>,
}

struct Idle {
    conn: Connection,
    since: Instant,
}

/// What an upstream connection tells a fenced write's exchange, which
/// decides from it when the upstream is done with the write (see
/// `exchange`). Only the connection can tell: whether the upstream has the
/// request is a question about its TCP, not about what was written.
pub trait Witness: Send + Sync {
    /// The request was written into the connection in full (which is not
    /// yet handed over: the upstream's TCP may not have acknowledged it).
    fn request_written(&self);
    /// The answer's first byte came. `handed_over`: the upstream's TCP had
    /// acknowledged the whole request by then; otherwise this is an early
    /// answer, and the upstream may go on reading and applying the request
    /// after it.
    fn answer_began(&self, handed_over: bool);
    /// The connection reset itself at the exchange's deadline: from then
    /// on nothing of the exchange can reach the upstream, even if its
    /// bodies are never polled again.
    fn cut(&self);
}

/// Why an upstream request failed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Nothing was sent: the connection (or its TLS handshake) failed, or
    /// closed before a byte of the request was written.
    #[error("{0}")]
    Connect(String),
    /// The exchange failed after the request may have been (partly) sent.
    #[error("{0}")]
    Exchange(ExchangeError),
    /// The exchange failed before a byte of the request was written: its
    /// body broke off while its head was held back for it (see `flight`).
    #[error("{0}")]
    Unsent(ExchangeError),
}

impl SendError {
    /// Whether nothing of the request can have reached the upstream.
    pub fn nothing_sent(&self) -> bool {
        matches!(self, SendError::Connect(_) | SendError::Unsent(_))
    }
}

/// Why an exchange on a connection broke off.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("upstream connection: {0}")]
    Io(std::io::Error),
    #[error("the upstream closed the connection before its answer was complete")]
    Closed,
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("request body: {0}")]
    Body(axum::Error),
    #[error("the request body's length differs from the length announced")]
    BodyLength,
}

impl UpstreamClient {
    pub fn new() -> Self {
        Self::default()
    }

    /// An idle connection to `upstream` that is still open, if one is kept.
    fn take_idle(&self, key: &str) -> Option<Connection> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let stack = idle.get_mut(key)?;
        while let Some(mut c) = stack.pop() {
            // Newest first; anything this old below it is older still.
            if c.since.elapsed() > IDLE_TIMEOUT {
                stack.push(c);
                stack.drain(..).for_each(|c| c.conn.close_gracefully());
                return None;
            }
            if c.conn.is_open() {
                return Some(c.conn);
            }
            c.conn.close_gracefully();
        }
        None
    }

    /// Returns a connection whose exchange ended normally to its pool (or
    /// closes it, when the pool is full).
    fn give_back(&self, key: Arc<str>, conn: Connection) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let stack = idle.entry(key).or_default();
        if stack.len() < MAX_IDLE {
            stack.push(Idle {
                conn,
                since: Instant::now(),
            });
        } else {
            conn.close_gracefully();
        }
    }

    /// Sends `req` to `upstream` (its URI in origin form, `Host` set) and
    /// reads the answer's head; the answer's body reads the rest, and hands
    /// the connection back when the exchange is over. `fenced`: a fenced
    /// write's deadline, past which the connection resets itself, and the
    /// exchange told what the connection sees (see [`Witness`],
    /// [`cutoff`]); its request's last bytes are written only once the
    /// send queue has drained (see `flight`).
    pub async fn send(
        &self,
        upstream: &Upstream,
        req: Request<Body>,
        fenced: Option<(Instant, Arc<dyn Witness>)>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        let (flight, head) = self.exchange(upstream, req, fenced, false).await?;
        Ok(answer_of(flight, head))
    }

    /// Sends a request that asks for an upgrade (its `Connection: upgrade`
    /// and `Upgrade` set, no body) and reads the answer's head. A `101`
    /// takes the connection out of HTTP and out of the pool: it becomes
    /// the tunnel's upstream side, with the head the upstream agreed with.
    /// Any other answer is an ordinary one.
    pub async fn upgrade(
        &self,
        upstream: &Upstream,
        req: Request<Body>,
    ) -> Result<Upgrade, SendError> {
        let (flight, head) = self.exchange(upstream, req, None, true).await?;
        if head.status != http::StatusCode::SWITCHING_PROTOCOLS {
            return Ok(Upgrade::Refused(answer_of(flight, head)));
        }
        let mut agreed = Response::new(());
        *agreed.status_mut() = head.status;
        *agreed.version_mut() = head.version;
        *agreed.headers_mut() = head.headers;
        Ok(Upgrade::Switched(agreed, Upgraded::new(flight.conn)))
    }

    /// Writes `req` on a connection and reads its answer's head.
    async fn exchange(
        &self,
        upstream: &Upstream,
        req: Request<Body>,
        fenced: Option<(Instant, Arc<dyn Witness>)>,
        upgrade: bool,
    ) -> Result<(Flight, answer::AnswerHead), SendError> {
        let (parts, body) = req.into_parts();
        let witness = fenced.as_ref().map(|(_, w)| w.clone());
        let mut request = RequestWriter::new(&parts, body, witness);
        // Only the method is needed from here on: the rest of the head goes
        // now, and does not sit in this future's state.
        let method = {
            let parts = parts;
            parts.method
        };
        let repeatable = request.repeatable(&method);
        // A retry goes on a new connection: the pool's others are likely as
        // dead as the one that failed, and so a request is sent at most
        // twice, however many of them there are.
        let mut pooled = true;
        loop {
            let idle = if pooled {
                self.take_idle(&upstream.pool_key)
            } else {
                None
            };
            let (mut conn, reused) = match idle {
                Some(c) => (c, true),
                // Boxed: connecting (TCP, TLS) is the rare case, and its
                // state would otherwise make every request's future, moved
                // into its task and out of it, kilobytes larger.
                None => (Box::pin(Connection::connect(upstream)).await?, false),
            };
            if let Some((at, witness)) = &fenced {
                conn.arm(*at, witness.clone());
            }
            let mut flight = Flight {
                conn,
                request,
                answer_began: None,
                client: self.clone(),
                key: upstream.pool_key.clone(),
            };
            match std::future::poll_fn(|cx| flight.poll_head(cx, &method, upgrade)).await {
                Ok(head) => return Ok((flight, head)),
                Err(e) => {
                    let Flight {
                        conn, request: r, ..
                    } = flight;
                    // Reset now: nothing more of this attempt moves, and
                    // nothing of it still queued is delivered later.
                    drop(conn);
                    let io = matches!(e, ExchangeError::Io(_) | ExchangeError::Closed);
                    request = r;
                    match (io, request.written, reused) {
                        // The upstream had closed the reused connection
                        // before a byte was written: once more, on a new
                        // one (which, not being reused, is not retried).
                        (true, 0, true) => pooled = false,
                        (true, 0, false) => {
                            return Err(SendError::Connect(format!(
                                "the new connection closed before the request was sent: {e}"
                            )))
                        }
                        (true, _, true) if repeatable => {
                            request.rewind();
                            pooled = false;
                        }
                        (_, 0, _) => return Err(SendError::Unsent(e)),
                        _ => return Err(SendError::Exchange(e)),
                    }
                }
            }
        }
    }
}

/// What [`UpstreamClient::upgrade`] came to.
pub enum Upgrade {
    /// The upstream switched protocols: its `101`'s head, and the
    /// connection, now the tunnel's upstream side.
    Switched(Response<()>, Upgraded),
    /// Any other answer, relayed as usual.
    Refused(Response<UpstreamBody>),
}

/// An answer whose body reads itself from the flight's connection.
fn answer_of(flight: Flight, head: answer::AnswerHead) -> Response<UpstreamBody> {
    let mut answer = Response::new(UpstreamBody::new(flight, head.body, head.keep_alive));
    *answer.status_mut() = head.status;
    *answer.version_mut() = head.version;
    *answer.headers_mut() = head.headers;
    answer
}

/// A connected TCP socket and its peer, for the unit tests of this module.
#[cfg(test)]
async fn socket_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let ours = tokio::net::TcpStream::connect(listener.local_addr().expect("addr"))
        .await
        .expect("connect");
    let (theirs, _) = listener.accept().await.expect("accept");
    (ours, theirs)
}
