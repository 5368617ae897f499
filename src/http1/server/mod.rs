//! The HTTP/1.1 server of both listeners: the accept loop, connections
//! served by an HTTP/1.1 of our own ([`session`]: a connection's phases;
//! [`request`]: request heads read and answer heads written; [`body`]: a
//! request's body as the service reads it; [`tls`]: handshakes), and the
//! traffic listener's worker threads.
//!
//! Three protections are the accept loop's and the connection's: a
//! header-read timeout (slow-loris clients, idle keep-alive connections), a
//! connection limit (a flood waits in the kernel backlog instead of
//! exhausting memory or file descriptors), and a bounded graceful drain.
//! An HTTP/1.1 of our own rather than hyper's server: one task per
//! connection as before, but a head parsed once into the request, a body
//! that came with its head handed over whole, and one timer per
//! connection instead of one per request (see BENCHMARKS.md).
//!
//! The traffic listener runs on [`Workers`]: `[server] workers` threads (one
//! per CPU by default), each with a current-thread runtime. One acceptor takes connections (within the
//! connection limit) and hands them round-robin to the workers; from then on
//! everything a connection's requests do (parse, forward on the worker's
//! pooled upstream connections, relay the answer) happens on that worker's
//! thread. On one shared multi-thread runtime the client side and the
//! upstream side of a request usually land on different threads, and the
//! cross-thread wake-ups (futex, IPIs) cost more than the proxying itself;
//! see BENCHMARKS.md. Handing off accepted connections, rather than giving
//! each worker its own `SO_REUSEPORT` socket, keeps the connection limit
//! exact and spreads even a handful of connections evenly.

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
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify, OwnedSemaphorePermit, Semaphore};
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
pub trait Service: Send + 'static {
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

/// Serves `service` on `listener` until `shutdown` resolves, then lets
/// in-flight requests finish for up to `limits.shutdown_grace`.
pub async fn serve(
    listener: TcpListener,
    service: impl MakeService,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let drain = Arc::new(Drain::default());
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    accept(listener, slots, shutdown, |stream, peer, permit| {
        connection(stream, peer, &service, limits, &drain, permit, None);
    })
    .await;
    drain.finish(limits).await;
}

/// Accepts connections until `shutdown` resolves, each with a slot of
/// `slots`, and gives them to `take`.
async fn accept(
    listener: TcpListener,
    slots: Arc<Semaphore>,
    shutdown: impl Future<Output = ()>,
    mut take: impl FnMut(TcpStream, SocketAddr, OwnedSemaphorePermit),
) {
    tokio::pin!(shutdown);
    loop {
        // Take a connection slot before accepting, so that at the limit new
        // connections queue in the backlog rather than being accepted and
        // starved.
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Typically EMFILE: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        take(stream, peer, permit);
    }
}

/// Serves one connection in a task of the current runtime; its slot is
/// freed when it ends. With `tls`, the handshake runs first, in the same
/// task and bounded by the header-read timeout (a client that stalls its
/// handshake is a slow-loris client too).
fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    service: &impl MakeService,
    limits: Limits,
    drain: &Arc<Drain>,
    permit: OwnedSemaphorePermit,
    tls: Option<&Arc<tls::ServerTls>>,
) {
    let drain = drain.clone();
    let Some(tls) = tls else {
        let service = service.make(ConnInfo { peer, tls: None });
        tokio::spawn(async move {
            session::serve(stream, service, limits, drain).await;
            drop(permit);
        });
        return;
    };
    let acceptor = tls.acceptor();
    // Made after the handshake, which tells who the client is; the
    // service factory is cloned into the task for that.
    let make = service.clone();
    tokio::spawn(async move {
        let handshake =
            tokio::time::timeout(limits.header_read_timeout, acceptor.accept(stream)).await;
        let stream = match handshake {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, %peer, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        };
        let info = ConnInfo {
            peer,
            tls: Some(tls::peer_of(stream.get_ref().1)),
        };
        session::serve(stream, make.make(info), limits, drain).await;
        drop(permit);
    });
}

/// The graceful drain of one runtime's connections: once started, an idle
/// connection ends at once and a busy one after its answer.
///
/// Each connection registers its task's waker once, when it starts, and
/// checks the flag only where it would wait for a next head: nothing is
/// polled per request for the drain's sake (a watcher future polled with
/// every poll of the connection cost hundreds of instructions a request).
#[derive(Default)]
pub(crate) struct Drain {
    started: AtomicBool,
    /// The tasks of the open connections, woken when the drain starts.
    conns: Mutex<slab::Slab<Waker>>,
    /// Told when the last connection has ended.
    empty: Notify,
}

/// A connection's place in its [`Drain`], for as long as it is open.
struct Entered {
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
    fn started(&self) -> bool {
        self.started.load(Ordering::Acquire)
    }

    /// Registers the calling task as an open connection.
    async fn enter(self: &Arc<Self>) -> Entered {
        let waker = poll_fn(|cx| Poll::Ready(cx.waker().clone())).await;
        let key = self.conns().insert(waker);
        Entered {
            drain: self.clone(),
            key,
        }
    }

    /// Starts the drain, then waits until every connection has ended, for
    /// up to the grace period.
    async fn finish(&self, limits: Limits) {
        self.started.store(true, Ordering::Release);
        for (_, waker) in self.conns().iter() {
            waker.wake_by_ref();
        }
        let ended = async {
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
        if tokio::time::timeout(limits.shutdown_grace, ended)
            .await
            .is_err()
        {
            tracing::warn!("shutdown grace period over; closing remaining connections");
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

/// Keeps a near timer pending on a worker's runtime, so that the runtime
/// never parks with no timer due soon.
///
/// tokio's timer wheel wakes the runtime's driver (a write to its eventfd,
/// and a later `epoll_wait` that returns only for it) whenever a timer is
/// registered that is due before the earliest one the driver knew of when
/// it last parked, or when it parked with none at all: and a worker with
/// no request in flight has none, so the route timeout of the next request
/// it takes paid that wake. With this tick pending, the driver always parks
/// with a timer at most `TIMER_FLOOR` away, and the request timers (the
/// route timeout, the header-read timeout: seconds) are later than it.
async fn timer_floor() {
    let mut tick = tokio::time::interval(TIMER_FLOOR);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

/// See [`timer_floor`]: shorter than any request timer worth a wake, long
/// enough that the tick itself costs nothing.
const TIMER_FLOOR: Duration = Duration::from_millis(500);

/// An accepted connection on its way to a worker.
type HandOff = (std::net::TcpStream, SocketAddr, OwnedSemaphorePermit);

/// The traffic listener's worker threads; see the module docs.
pub struct Workers {
    /// The acceptor, on the runtime that started the workers.
    acceptor: tokio::task::JoinHandle<()>,
    /// One per thread: completes when that thread has finished serving and
    /// its in-flight writes are done (or the grace period ran out).
    done: Vec<oneshot::Receiver<()>>,
}

impl Workers {
    /// Starts one thread per service, and an acceptor task on the current
    /// runtime that hands them `listener`'s connections in turn. When
    /// `shutdown` resolves the acceptor stops; each thread then drains its
    /// connections and keeps its runtime alive until `settled` resolves or
    /// the grace period ends: a fenced write it runs must not be cut off
    /// halfway by the runtime going away.
    pub fn start<M: MakeService, D>(
        listener: TcpListener,
        services: Vec<M>,
        tls: Option<Arc<tls::ServerTls>>,
        limits: Limits,
        shutdown: impl Future<Output = ()> + Send + 'static,
        settled: impl Fn() -> D,
    ) -> std::io::Result<Self>
    where
        D: Future<Output = ()> + Send + 'static,
    {
        let mut handoffs = Vec::with_capacity(services.len());
        let mut done = Vec::with_capacity(services.len());
        for (i, service) in services.into_iter().enumerate() {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (give, mut take) = mpsc::unbounded_channel::<HandOff>();
            let (tx, rx) = oneshot::channel();
            let settle = settled();
            let tls = tls.clone();
            std::thread::Builder::new()
                .name(format!("fencegate-worker-{i}"))
                .spawn(move || {
                    runtime.block_on(async move {
                        tokio::spawn(timer_floor());
                        let drain = Arc::new(Drain::default());
                        // Ends when the acceptor stops (shutdown).
                        while let Some((stream, peer, permit)) = take.recv().await {
                            // Registers the socket with this thread's runtime.
                            match TcpStream::from_std(stream) {
                                Ok(s) => connection(
                                    s,
                                    peer,
                                    &service,
                                    limits,
                                    &drain,
                                    permit,
                                    tls.as_ref(),
                                ),
                                Err(e) => {
                                    tracing::warn!(error = %e, "worker cannot take a connection")
                                }
                            }
                        }
                        drain.finish(limits).await;
                        let _ = tokio::time::timeout(limits.shutdown_grace, settle).await;
                    });
                    let _ = tx.send(());
                })?;
            handoffs.push(give);
            done.push(rx);
        }
        let slots = Arc::new(Semaphore::new(limits.max_connections));
        let mut next = 0;
        let acceptor = tokio::spawn(accept(
            listener,
            slots,
            shutdown,
            move |stream, peer, permit| {
                let Ok(stream) = stream.into_std() else {
                    return;
                };
                // A worker whose thread died is skipped; its slot comes back
                // with the dropped permit.
                let mut handoff = (stream, peer, permit);
                for _ in 0..handoffs.len() {
                    let worker = &handoffs[next];
                    next = (next + 1) % handoffs.len();
                    match worker.send(handoff) {
                        Ok(()) => return,
                        Err(mpsc::error::SendError(back)) => handoff = back,
                    }
                }
                tracing::error!("no worker thread is running; connection dropped");
            },
        ));
        Ok(Self { acceptor, done })
    }

    /// Waits until the acceptor and every worker thread have finished.
    pub async fn finished(self) {
        let _ = self.acceptor.await;
        for d in self.done {
            let _ = d.await;
        }
    }
}
