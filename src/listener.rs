//! The listeners: the accept loop with its connection limit, the traffic
//! listener's worker threads, and each connection's start: the TLS
//! handshake, then the HTTP it speaks (HTTP/2 by ALPN on TLS, or by its
//! preface on plaintext; HTTP/1.1 otherwise).
//!
//! Three protections are the accept loop's and the connection's: a
//! header-read timeout (slow-loris clients, idle keep-alive connections,
//! stalled handshakes), a connection limit (a flood waits in the kernel
//! backlog instead of exhausting memory or file descriptors), and a bounded
//! graceful drain.
//!
//! The traffic listener runs on [`Workers`]: `[server] workers` threads (one
//! per CPU by default), each with a current-thread runtime. One acceptor
//! takes connections (within the connection limit) and hands them
//! round-robin to the workers; from then on everything a connection's
//! requests do (parse, forward on the worker's pooled upstream connections,
//! relay the answer) happens on that worker's thread. On one shared
//! multi-thread runtime the client side and the upstream side of a request
//! usually land on different threads, and the cross-thread wake-ups (futex,
//! IPIs) cost more than the proxying itself; see
//! docs/internals/performance.md. Handing off accepted connections, rather
//! than giving each worker its own `SO_REUSEPORT` socket, keeps the
//! connection limit exact and spreads even a handful of connections evenly.
//!
//! Imports `http1` and `http2`; nothing else of the crate.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::http1::server::session::{self, Served};
use crate::http1::server::tls::{self, ServerTls};
use crate::http1::server::{ConnInfo, Drain, Limits, MakeService};
use crate::http2;

/// How a listener speaks.
#[derive(Debug, Clone, Copy)]
pub struct Protocols {
    /// Offered on TLS by ALPN and taken on plaintext by its preface; `None`:
    /// HTTP/1.1 only.
    pub http2: Option<http2::Settings>,
}

/// Serves `service` on `listener` until `shutdown` resolves, then lets
/// in-flight requests finish for up to `limits.shutdown_grace`.
pub async fn serve(
    listener: TcpListener,
    service: impl MakeService,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let speaks = Protocols { http2: None };
    let drain = Arc::new(Drain::default());
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    accept(listener, slots, shutdown, |stream, peer, permit| {
        connection(stream, peer, &service, limits, speaks, &drain, permit, None);
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
#[allow(clippy::too_many_arguments)]
fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    service: &impl MakeService,
    limits: Limits,
    speaks: Protocols,
    drain: &Arc<Drain>,
    permit: OwnedSemaphorePermit,
    tls: Option<&Arc<ServerTls>>,
) {
    let drain = drain.clone();
    let Some(tls) = tls else {
        let service = service.make(ConnInfo { peer, tls: None });
        tokio::spawn(async move {
            let served = session::serve(
                stream,
                service,
                limits,
                drain.clone(),
                speaks.http2.is_some(),
            )
            .await;
            if let (Served::Http2 { io, read, service }, Some(settings)) = (served, speaks.http2) {
                let io = crate::http1::prefixed::Prefixed::new(read, io);
                http2::serve(io, service, settings, limits, drain).await;
            }
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
        let session = stream.get_ref().1;
        let info = ConnInfo {
            peer,
            tls: Some(tls::peer_of(session)),
        };
        // ALPN offers h2 only where HTTP/2 is on (see `boot::tls`).
        let alpn_h2 = session.alpn_protocol() == Some(b"h2");
        let service = make.make(info);
        match speaks.http2 {
            Some(settings) if alpn_h2 => {
                http2::serve(stream, service, settings, limits, drain).await
            }
            _ => {
                // A preface without ALPN's h2 is refused as HTTP/1.1.
                session::serve(stream, service, limits, drain, false).await;
            }
        }
        drop(permit);
    });
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
        tls: Option<Arc<ServerTls>>,
        speaks: Protocols,
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
                                    speaks,
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
