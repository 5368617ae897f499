//! The HTTP/1.1 accept loop shared by both listeners.
//!
//! We drive hyper directly instead of `axum::serve` for three protections
//! axum's helper does not offer: a header-read timeout (slow-loris clients),
//! a connection limit (a flood waits in the kernel backlog instead of
//! exhausting memory or file descriptors), and a bounded graceful shutdown.
//!
//! The traffic listener runs on [`Workers`]: one thread per CPU, each with a
//! current-thread runtime and its own `SO_REUSEPORT` socket on the same
//! address. The kernel spreads connections over the sockets, and everything a
//! proxied request does (parse, forward on a pooled upstream connection,
//! relay the answer) happens on the thread that accepted it. On one shared
//! multi-thread runtime the client side and the upstream side of a request
//! usually land on different threads, and the cross-thread wake-ups (futex,
//! IPIs) cost more than the proxying itself; see BENCHMARKS.md.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{oneshot, Semaphore};
use tower::ServiceExt;

/// Limits applied to every connection of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_grace: Duration,
}

/// A service for one accepted connection, given its peer's address.
pub trait MakeService: Send + 'static {
    type Service: hyper::service::Service<
            http::Request<Incoming>,
            Response = http::Response<axum::body::Body>,
            Error = std::convert::Infallible,
            Future: Send,
        > + Send
        + 'static;

    fn make(&self, peer: SocketAddr) -> Self::Service;
}

/// An axum router as a [`MakeService`]; handlers see the peer as
/// `ConnectInfo<SocketAddr>`.
pub struct RouterService(pub Router);

impl MakeService for RouterService {
    type Service = RouterConnection;

    fn make(&self, peer: SocketAddr) -> RouterConnection {
        RouterConnection {
            router: self.0.clone(),
            peer,
        }
    }
}

/// [`RouterService`] for one connection.
pub struct RouterConnection {
    router: Router,
    peer: SocketAddr,
}

impl hyper::service::Service<http::Request<Incoming>> for RouterConnection {
    type Response = http::Response<axum::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tower::util::Oneshot<Router, http::Request<axum::body::Body>>;

    fn call(&self, req: http::Request<Incoming>) -> Self::Future {
        let mut req = req.map(axum::body::Body::new);
        req.extensions_mut()
            .insert(ConnectInfo::<SocketAddr>(self.peer));
        self.router.clone().oneshot(req)
    }
}

/// Serves `service` on `listener` until `shutdown` resolves, then lets
/// in-flight requests finish for up to `limits.shutdown_grace`. `slots` is
/// the connection limit, shared by the listeners it covers.
pub async fn serve(
    listener: TcpListener,
    service: impl MakeService,
    limits: Limits,
    slots: Arc<Semaphore>,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
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
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .keep_alive(true)
            .serve_connection(TokioIo::new(stream), service.make(peer));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!("shutdown grace period over; closing remaining connections");
        }
    }
}

/// Binds `n` listening sockets on one address with `SO_REUSEPORT`, so that
/// each worker thread accepts on its own socket. With port 0 the first
/// socket picks the port and the others join it.
pub fn bind_shared(addr: SocketAddr, n: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    let mut bound = Vec::with_capacity(n);
    let mut at = addr;
    for _ in 0..n.max(1) {
        let socket = match at {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(true)?;
        socket.bind(at)?;
        let listener = socket.listen(1024)?.into_std()?;
        at = listener.local_addr()?;
        bound.push(listener);
    }
    Ok(bound)
}

/// The traffic listener's worker threads; see the module docs.
pub struct Workers {
    /// One per thread: completes when that thread has finished serving and
    /// its in-flight writes are done (or the grace period ran out).
    done: Vec<oneshot::Receiver<()>>,
}

impl Workers {
    /// Starts one thread per listener. `services[i]` serves `listeners[i]`
    /// (each carries its own upstream pool, used from its thread).
    /// When `shutdown` resolves, each thread stops accepting, drains its
    /// connections, and then keeps its runtime alive until `settled`
    /// resolves or the grace period ends: a fenced write it runs must not be
    /// cut off halfway by the runtime going away.
    pub fn start<M: MakeService, S, D>(
        listeners: Vec<std::net::TcpListener>,
        services: Vec<M>,
        limits: Limits,
        shutdown: impl Fn() -> S,
        settled: impl Fn() -> D,
    ) -> std::io::Result<Self>
    where
        S: Future<Output = ()> + Send + 'static,
        D: Future<Output = ()> + Send + 'static,
    {
        let slots = Arc::new(Semaphore::new(limits.max_connections));
        let mut done = Vec::with_capacity(listeners.len());
        for (i, (listener, service)) in listeners.into_iter().zip(services).enumerate() {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (tx, rx) = oneshot::channel();
            let (slots, stop, settle) = (slots.clone(), shutdown(), settled());
            std::thread::Builder::new()
                .name(format!("fencegate-worker-{i}"))
                .spawn(move || {
                    runtime.block_on(async move {
                        match TcpListener::from_std(listener) {
                            Ok(l) => serve(l, service, limits, slots, stop).await,
                            Err(e) => tracing::error!(error = %e, "worker cannot listen"),
                        }
                        let _ = tokio::time::timeout(limits.shutdown_grace, settle).await;
                    });
                    let _ = tx.send(());
                })?;
            done.push(rx);
        }
        Ok(Self { done })
    }

    /// Waits until every worker thread has finished.
    pub async fn finished(self) {
        for d in self.done {
            let _ = d.await;
        }
    }
}
