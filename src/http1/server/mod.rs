//! The HTTP/1.1 server: what a listener's connections are served with
//! ([`session`]: a connection's phases; [`request`]: request heads read and
//! answer heads written; [`body`]: a request's body as the service reads
//! it; [`tls`]: the acceptor's config and the client's identity), and the
//! contract every connection's service keeps, whatever HTTP it speaks
//! ([`Service`], [`MakeService`], [`Limits`], [`Drain`]). The accept loop
//! and the worker threads are `listener`'s.
//!
//! An HTTP/1.1 of our own rather than hyper's server: one task per
//! connection, a head parsed once into the request, a body that came with
//! its head handed over whole, and one timer per connection instead of one
//! per request (see docs/internals/http1.md).

use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::Response;
use axum::Router;
use http::Request;
use tokio::sync::Notify;
use tower::ServiceExt;

pub mod body;
pub mod request;
pub mod session;
pub mod tls;

pub use body::RequestBody;
pub use request::HeadError;

/// Limits applied to every connection of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_grace: Duration,
}

/// What a service knows of the connection it serves.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub peer: SocketAddr,
    /// Set on a TLS connection, after the handshake.
    pub tls: Option<tls::TlsPeer>,
}

/// What answers one connection's requests, one at a time. Its future runs
/// in the connection's task; a request's body is a [`RequestBody`] inside
/// the [`Body`].
pub trait Service: Send + Sync + 'static {
    /// Unboxed: the traffic listener's answer is made with no allocation
    /// and no copy of its (large) future.
    fn call(&self, req: Request<Body>) -> impl Future<Output = Response> + Send + 'static;

    /// The answer to a request the server refused before the service saw
    /// it (a malformed head or body framing); the connection then closes.
    /// The service says how a refusal looks (a problem document), the
    /// server which one it is.
    fn refuse(&self, why: HeadError) -> Response;
}

/// A service for one accepted connection.
pub trait MakeService: Clone + Send + 'static {
    type Service: Service;

    fn make(&self, conn: ConnInfo) -> Self::Service;
}

/// An axum router as a [`MakeService`]; handlers see the peer as
/// `ConnectInfo<SocketAddr>`.
#[derive(Clone)]
pub struct RouterService {
    pub router: Router,
    /// The answer to a refused request (see [`Service::refuse`]).
    pub refuse: fn(HeadError) -> Response,
}

impl MakeService for RouterService {
    type Service = RouterConnection;

    fn make(&self, conn: ConnInfo) -> RouterConnection {
        RouterConnection {
            router: self.router.clone(),
            peer: conn.peer,
            refuse: self.refuse,
        }
    }
}

/// [`RouterService`] for one connection.
pub struct RouterConnection {
    router: Router,
    peer: SocketAddr,
    refuse: fn(HeadError) -> Response,
}

impl Service for RouterConnection {
    fn call(&self, mut req: Request<Body>) -> impl Future<Output = Response> + Send + 'static {
        req.extensions_mut()
            .insert(ConnectInfo::<SocketAddr>(self.peer));
        let answer = self.router.clone().oneshot(req);
        async move {
            match answer.await {
                Ok(resp) => resp,
                Err(never) => match never {},
            }
        }
    }

    fn refuse(&self, why: HeadError) -> Response {
        (self.refuse)(why)
    }
}

/// The graceful drain of one runtime's connections: once started, an idle
/// connection ends at once and a busy one after its answer.
///
/// Each connection registers its task's waker once, when it starts, and
/// checks the flag only where it would wait for a next head: nothing is
/// polled per request for the drain's sake (a watcher future polled with
/// every poll of the connection cost hundreds of instructions a request).
#[derive(Default)]
pub struct Drain {
    started: AtomicBool,
    /// The tasks of the open connections, woken when the drain starts.
    conns: Mutex<slab::Slab<Waker>>,
    /// Told when the last connection has ended.
    empty: Notify,
    /// Set when the grace period is over with connections still open:
    /// those that can end cleanly do so now (a tunnel sends its FINs both
    /// ways) rather than be dropped with their runtime.
    closing: AtomicBool,
    /// Told when `closing` is set. A tunnel may run in a task of its own
    /// (an HTTP/2 stream's), not the connection's registered one.
    close_now: Notify,
}

/// How long connections told to close at the end of the grace period
/// have to do so.
const CLOSE_TIME: Duration = Duration::from_secs(1);

/// A connection's place in its [`Drain`], for as long as it is open.
pub struct Entered {
    drain: Arc<Drain>,
    key: usize,
}

impl Drain {
    fn conns(&self) -> std::sync::MutexGuard<'_, slab::Slab<Waker>> {
        // Wakers are only inserted, woken and removed under the lock: a
        // poisoned lock still holds a consistent slab.
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the drain has started.
    pub fn started(&self) -> bool {
        self.started.load(Ordering::Acquire)
    }

    /// Resolves when the grace period is over and what is still open
    /// should close (see [`Drain::finish`]).
    pub async fn closing(&self) {
        loop {
            let told = self.close_now.notified();
            tokio::pin!(told);
            told.as_mut().enable();
            if self.closing.load(Ordering::Acquire) {
                return;
            }
            told.await;
        }
    }

    /// Registers the calling task as an open connection.
    pub async fn enter(self: &Arc<Self>) -> Entered {
        let waker = poll_fn(|cx| Poll::Ready(cx.waker().clone())).await;
        let key = self.conns().insert(waker);
        Entered {
            drain: self.clone(),
            key,
        }
    }

    /// Starts the drain, then waits until every connection has ended, for
    /// up to the grace period; then tells those still open to close, and
    /// gives them a moment to.
    pub async fn finish(&self, limits: Limits) {
        self.started.store(true, Ordering::Release);
        for (_, waker) in self.conns().iter() {
            waker.wake_by_ref();
        }
        let ended = || async {
            loop {
                let notified = self.empty.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.conns().is_empty() {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(limits.shutdown_grace, ended())
            .await
            .is_err()
        {
            tracing::warn!("shutdown grace period over; closing remaining connections");
            self.closing.store(true, Ordering::Release);
            self.close_now.notify_waiters();
            let _ = tokio::time::timeout(CLOSE_TIME, ended()).await;
        }
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        let mut conns = self.drain.conns();
        conns.remove(self.key);
        if conns.is_empty() {
            self.drain.empty.notify_waiters();
        }
    }
}
