//! The upstream client: HTTP/1.1 connections to the upstreams, over TCP or
//! TLS, kept by each worker for its own requests.
//!
//! hyper-util's pooled client is general: a pool keyed by URI, a dispatch
//! channel per connection, a checkout race between a pooled connection and a
//! new one. A proxy with a handful of upstreams per worker needs less, and
//! every step costs CPU on every request. Here a worker keeps, per upstream,
//! a stack of idle `http1::SendRequest`s: a request pops one (or connects),
//! sends, and its response body hands the connection back when the exchange
//! is over.
//!
//! **Retries.** A request is retried on a new connection only when hyper
//! gives it back unsent (`try_send_request`: the connection turned out
//! closed before a byte of the request was written), which is what happens
//! when an upstream closes an idle connection just as it is reused. A
//! request of which any byte may have been written is never sent again —
//! the upstream may be applying it — with one exception: a bodiless GET,
//! HEAD or OPTIONS that failed on a reused connection, which HTTP lets a
//! client repeat (RFC 9110 §9.2.2) and which is how an idle connection the
//! upstream closed mid-send shows. Fenced writes are never among them.
//!
//! **When a connection is handed back** ([`Pooled`]): after the response
//! body ended *and* the connection is ready for the next request, which in
//! HTTP/1 means hyper has finished writing this request too. So "the
//! exchange is over" means both directions are, which is what the fenced
//! write's `Exchange` needs to hear (see `proxy::RelayBody`).
//!
//! **Deadlines a connection enforces itself.** A fenced write's exchange
//! must be over by its deadline in both directions (see `exchange`). The
//! body wrappers cut their streams at it, but only when they are polled,
//! and nobody polls them when the client stops reading the answer or the
//! upstream stops reading the request: hyper then waits on a full socket.
//! So each connection's driver task also watches the deadline of the
//! exchange it carries (`Cutoff`) and, when it passes with the exchange
//! not over, drops the connection, which closes the socket. After that
//! nothing of the write can move, whoever stalls.
//!
//! **TLS** upstreams (`https://`) are verified against the platform's trust
//! roots or the route's `upstream_ca_file`, with SNI and the hostname check
//! always on. The TLS stream plugs into the same HTTP/1 path as TCP: no
//! second, slower code path for plain HTTP.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::config::Upstream;

/// Longest a TCP connect (and TLS handshake) to an upstream may take: a
/// refused or unroutable upstream must fail fast as 502.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle connections kept per upstream and worker.
const MAX_IDLE: usize = 256;
/// An idle connection older than this is closed rather than reused: the
/// upstream has likely closed it already, or soon will.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// TLS to an `https://` upstream, built when the config is loaded.
#[derive(Clone)]
pub struct UpstreamTls {
    /// Trust roots (the platform's, or `upstream_ca_file`), ALPN http/1.1.
    pub config: Arc<rustls::ClientConfig>,
    /// Sent as SNI and checked against the certificate.
    pub server_name: rustls::pki_types::ServerName<'static>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl UpstreamTls {
    /// TLS for the upstream host `host`, trusting `ca_file` (PEM) or, without
    /// one, the platform's roots. The error says what is wrong.
    pub fn new(host: &str, ca_file: Option<&std::path::Path>) -> Result<Self, String> {
        let roots = match ca_file {
            None => {
                crate::tls::platform_roots().map_err(|e| format!("{e}; set upstream_ca_file"))?
            }
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|e| format!("upstream_ca_file {}: {e}", path.display()))?;
                let roots = crate::tls::pem_roots(&pem)
                    .map_err(|e| format!("upstream_ca_file {}: {e}", path.display()))?;
                Arc::new(roots)
            }
        };
        // An IP literal in brackets (`[::1]`) is named without them.
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let server_name = rustls::pki_types::ServerName::try_from(name.to_string())
            .map_err(|_| format!("'{host}' is not a name a certificate can be checked against"))?;
        let config = crate::tls::client_config(roots)?;
        Ok(Self {
            config: Arc::new(config),
            server_name,
        })
    }
}

/// One worker's connections; cheap to clone (clones share them).
#[derive(Clone, Default)]
pub struct UpstreamClient {
    idle: Arc<Mutex<HashMap<Arc<str>, Vec<Idle>>>>,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// One upstream connection: the request side of hyper's HTTP/1 driver,
/// what the socket has heard, and the deadline its driver enforces.
struct Conn {
    sender: SendRequest<Body>,
    heard: Heard,
    cutoff: Arc<Cutoff>,
}

/// The deadline of the exchange a connection carries, if it has one (see
/// the module docs). Set before a fenced request is sent, cleared when the
/// exchange is over and the connection goes back to the pool; a connection
/// dropped mid-exchange keeps it, so its driver still closes it in time.
#[derive(Default)]
struct Cutoff {
    state: Mutex<CutoffState>,
    /// Whether `state.armed` is set: written under the lock, read without
    /// it. A pass-through request never arms its connection, and so its
    /// writes (each asks `passed`) and its return to the pool take no lock.
    is_armed: AtomicBool,
    /// Wakes the driver to look at a deadline earlier than its timer. A
    /// clear needs no wake: the driver finds it when its timer fires.
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct CutoffState {
    armed: Option<Armed>,
    /// When the driver's timer fires, as the driver last set it (`None`:
    /// it has none). An exchange whose deadline is no earlier needs no wake:
    /// the driver looks again when that timer fires, and sets it anew then.
    /// Deadlines of successive exchanges on a connection only grow (each is
    /// its start plus the route's timeout), so only a connection's first
    /// fenced exchange, or one on a route with a shorter timeout, wakes the
    /// driver: waking it for every fenced write cost a task poll and a
    /// timer moved in the wheel, each time.
    watching: Option<Instant>,
}

/// A deadline, and who to tell when the connection closed itself at it.
struct Armed {
    at: Instant,
    on_cut: Arc<dyn OnCut>,
}

/// Told when a connection has closed itself at its exchange's deadline:
/// from then on nothing of the exchange can reach the upstream, even if its
/// bodies are never polled again.
pub trait OnCut: Send + Sync {
    fn cut(&self);
}

impl Cutoff {
    fn lock(&self) -> std::sync::MutexGuard<'_, CutoffState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn at(&self) -> Option<Instant> {
        self.lock().armed.as_ref().map(|a| a.at)
    }

    /// Whether the exchange's deadline has passed. The driver closes the
    /// connection then, but only once it runs: a process that was paused
    /// (SIGSTOP, a VM freeze) across the deadline may poll the connection
    /// before the timer, and by then other instances may have let a newer
    /// token through (shared mode's marker has ended). So no byte is written
    /// after the deadline, whatever runs first.
    fn passed(&self) -> bool {
        self.is_armed.load(Ordering::Acquire) && self.at().is_some_and(|at| Instant::now() >= at)
    }

    fn arm(&self, at: Instant, on_cut: Arc<dyn OnCut>) {
        let wake = {
            let mut state = self.lock();
            state.armed = Some(Armed { at, on_cut });
            self.is_armed.store(true, Ordering::Release);
            state.watching.is_none_or(|w| w > at)
        };
        if wake {
            self.changed.notify_one();
        }
    }

    /// Only the exchange's owner arms and clears (the connection is lent
    /// to one exchange at a time), so an unarmed cutoff stays unarmed
    /// while this looks.
    fn clear(&self) {
        if self.is_armed.load(Ordering::Acquire) {
            let mut state = self.lock();
            state.armed = None;
            self.is_armed.store(false, Ordering::Release);
        }
    }

    /// For the driver: the armed deadline, and where its timer must be
    /// set, given that it is set for `timer` now: no later than the
    /// deadline, and left as it is when it already is (see `watching`).
    fn watch(&self, timer: Option<Instant>) -> Option<Instant> {
        let mut state = self.lock();
        let at = state.armed.as_ref().map(|a| a.at);
        let timer = match (timer, at) {
            (Some(t), Some(at)) => Some(t.min(at)),
            (t, at) => t.or(at),
        };
        state.watching = timer;
        timer
    }

    /// Disarms it if its deadline is `by` or earlier, answering whom to
    /// tell.
    fn fire(&self, by: Instant) -> Option<Arc<dyn OnCut>> {
        let mut state = self.lock();
        if state.armed.as_ref().is_some_and(|a| a.at <= by) {
            self.is_armed.store(false, Ordering::Release);
            state.armed.take().map(|a| a.on_cut)
        } else {
            None
        }
    }
}

/// Whether any byte came from the upstream since the current request began.
/// hyper may hold an answer back until it has written the request; the
/// socket cannot: an answer that starts arriving while the request body is
/// still being handed over is an early answer, whatever hyper reports when.
#[derive(Clone, Default)]
pub struct Heard(Arc<AtomicBool>);

impl Heard {
    /// A request begins: nothing heard yet.
    fn arm(&self) {
        self.0.store(false, Ordering::Release);
    }

    /// Whether the upstream has sent anything since the request began.
    pub fn anything(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

pin_project_lite::pin_project! {
    /// A stream that notes, in its [`Heard`], every read that returns data,
    /// and refuses every write once its [`Cutoff`] has passed (see
    /// `Cutoff::passed`).
    struct Watched<I> {
        #[pin]
        inner: I,
        heard: Heard,
        cutoff: Arc<Cutoff>,
    }
}

impl<I: AsyncRead> AsyncRead for Watched<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let polled = this.inner.poll_read(cx, buf);
        if buf.filled().len() > before {
            this.heard.0.store(true, Ordering::Release);
        }
        polled
    }
}

impl<I: AsyncWrite> AsyncWrite for Watched<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.cutoff.passed() {
            return Poll::Ready(Err(past_deadline()));
        }
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.cutoff.passed() {
            return Poll::Ready(Err(past_deadline()));
        }
        self.project().inner.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // A TLS stream may hold records it has not sent yet.
        if self.cutoff.passed() {
            return Poll::Ready(Err(past_deadline()));
        }
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

fn past_deadline() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the fenced write's deadline has passed",
    )
}

/// Why an upstream request failed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Nothing was sent: the connection (or its TLS handshake) failed.
    #[error("{0}")]
    Connect(String),
    /// The exchange failed after the request may have been (partly) sent.
    #[error("{0}")]
    Exchange(hyper::Error),
}

impl SendError {
    /// Whether nothing of the request can have reached the upstream.
    pub fn nothing_sent(&self) -> bool {
        matches!(self, SendError::Connect(_))
    }
}

/// A connection lent to one exchange, to be handed back when it is over.
pub struct Pooled {
    conn: Conn,
    client: UpstreamClient,
    key: Arc<str>,
}

impl Pooled {
    /// Ready once the connection can take another request (both directions
    /// of this exchange are done): it goes back to the pool. An error means
    /// the connection is closed; it is dropped.
    pub fn poll_done(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        match self.conn.sender.poll_ready(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(true),
            Poll::Ready(Err(_)) => Poll::Ready(false),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Returns the connection to its pool.
    pub fn give_back(self) {
        self.conn.cutoff.clear();
        let mut idle = self.client.idle.lock().unwrap_or_else(|e| e.into_inner());
        let stack = idle.entry(self.key).or_default();
        if stack.len() < MAX_IDLE {
            stack.push(Idle {
                conn: self.conn,
                since: Instant::now(),
            });
        }
    }
}

impl UpstreamClient {
    pub fn new() -> Self {
        Self::default()
    }

    /// A ready idle connection to `upstream`, if one is kept.
    fn take_idle(&self, key: &str) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let stack = idle.get_mut(key)?;
        while let Some(c) = stack.pop() {
            // Newest first; anything this old below it is older still.
            if c.since.elapsed() > IDLE_TIMEOUT {
                stack.clear();
                return None;
            }
            if c.conn.sender.is_ready() {
                return Some(c.conn);
            }
        }
        None
    }

    /// Sends `req` to `upstream` (its URI in origin form, `Host` set). The
    /// response comes with the connection it was read from, to hand back
    /// when the exchange is over. `cut`: a fenced write's deadline, past
    /// which the connection closes itself and then tells the exchange (see
    /// the module docs). `listen` learns the connection's [`Heard`] before
    /// the request is written.
    pub async fn send(
        &self,
        upstream: &Upstream,
        mut req: Request<Body>,
        cut: Option<(Instant, Arc<dyn OnCut>)>,
        listen: impl Fn(Heard),
    ) -> Result<(Response<Incoming>, Pooled), SendError> {
        loop {
            let (mut conn, reused) = match self.take_idle(&upstream.pool_key) {
                Some(c) => (c, true),
                // Boxed: connecting (TCP, TLS) is the rare case, and its
                // state would otherwise make every request's future, moved
                // into its task and out of it, kilobytes larger.
                None => (Box::pin(connect(upstream)).await?, false),
            };
            if let Some((at, on_cut)) = &cut {
                conn.cutoff.arm(*at, on_cut.clone());
            }
            conn.heard.arm();
            listen(conn.heard.clone());
            // A copy to repeat a safe request with, should the reused
            // connection turn out dead after all.
            let again = reused.then(|| repeatable(&req)).flatten();
            match conn.sender.try_send_request(req).await {
                Ok(resp) => {
                    let pooled = Pooled {
                        conn,
                        client: self.clone(),
                        key: upstream.pool_key.clone(),
                    };
                    return Ok((resp, pooled));
                }
                Err(mut e) => match e.take_message() {
                    // Given back unsent: a reused connection the upstream
                    // had just closed. Once more, on a new one (which, not
                    // being reused, is not retried again).
                    Some(unsent) if reused => req = unsent,
                    Some(_) => {
                        return Err(SendError::Connect(format!(
                            "the new connection closed before the request was sent: {}",
                            e.into_error()
                        )))
                    }
                    None => match again {
                        Some(copy) => req = copy,
                        None => return Err(SendError::Exchange(e.into_error())),
                    },
                },
            }
        }
    }
}

/// A copy of `req` when it may be sent again: a safe method without a body.
fn repeatable(req: &Request<Body>) -> Option<Request<Body>> {
    let safe = matches!(
        *req.method(),
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    );
    if !safe || !http_body::Body::is_end_stream(req.body()) {
        return None;
    }
    let mut copy = Request::new(Body::empty());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    Some(copy)
}

/// A new connection to `upstream`, its HTTP/1 driver running on the current
/// runtime.
async fn connect(upstream: &Upstream) -> Result<Conn, SendError> {
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, async {
        let tcp = TcpStream::connect(upstream.address()).await.map_err(|e| {
            SendError::Connect(format!("cannot connect to {}: {e}", upstream.authority))
        })?;
        let _ = tcp.set_nodelay(true);
        match &upstream.tls {
            None => handshake(tcp).await,
            Some(tls) => {
                let stream = tokio_rustls::TlsConnector::from(tls.config.clone())
                    .connect(tls.server_name.clone(), tcp)
                    .await
                    .map_err(|e| {
                        SendError::Connect(format!(
                            "TLS handshake with {} failed: {e}",
                            upstream.authority
                        ))
                    })?;
                handshake(stream).await
            }
        }
    })
    .await;
    match connected {
        Ok(r) => r,
        Err(_) => Err(SendError::Connect(format!(
            "connecting to {} took longer than {CONNECT_TIMEOUT:?}",
            upstream.authority
        ))),
    }
}

/// HTTP/1.1 over `io` (TCP, or TLS over TCP: the watch sits above TLS, so
/// only the upstream's HTTP bytes count as heard).
async fn handshake<I>(io: I) -> Result<Conn, SendError>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let heard = Heard::default();
    let cutoff = Arc::new(Cutoff::default());
    let watched = Watched {
        inner: io,
        heard: heard.clone(),
        cutoff: cutoff.clone(),
    };
    let (sender, conn) = http1::Builder::new()
        // One buffer per write, as the server side (see `server::serve_io`).
        .writev(false)
        .handshake(TokioIo::new(watched))
        .await
        .map_err(|e| SendError::Connect(format!("HTTP/1.1 handshake failed: {e}")))?;
    tokio::spawn(drive(conn, cutoff.clone()));
    Ok(Conn {
        sender,
        heard,
        cutoff,
    })
}

/// Runs a connection until it ends, or until the deadline of the exchange
/// it carries passes: then it drops the connection, which closes the
/// socket, and only then tells the exchange.
async fn drive<F>(conn: F, cutoff: Arc<Cutoff>)
where
    F: Future<Output = hyper::Result<()>>,
{
    let mut conn = Box::pin(conn);
    // One timer for the connection's life, moved (not made anew) when a
    // deadline earlier than it is armed; `set_for`: when it fires, if set.
    let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
    let mut set_for: Option<Instant> = None;
    let on_cut = loop {
        // Created before the state is read: a deadline armed from now on
        // that is earlier than the timer wakes it (`notify_one` keeps a
        // permit until then).
        let changed = cutoff.changed.notified();
        let want = cutoff.watch(set_for);
        if want != set_for {
            if let Some(at) = want {
                match timer.as_mut() {
                    Some(t) => t.as_mut().reset(at.into()),
                    None => timer = Some(Box::pin(tokio::time::sleep_until(at.into()))),
                }
            }
            set_for = want;
        }
        let fired = std::future::poll_fn(|cx| match (timer.as_mut(), set_for) {
            (Some(t), Some(_)) => t.as_mut().poll(cx),
            _ => Poll::Pending,
        });
        tokio::select! {
            biased;
            ended = &mut conn => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "upstream connection ended with an error");
                }
                // Ended past its deadline (its writes were refused there:
                // see `Cutoff::passed`) with the exchange not over: that
                // is the cut, and the exchange must hear of it as if the
                // timer had fired.
                match cutoff.fire(Instant::now()) {
                    Some(on_cut) => break on_cut,
                    None => return,
                }
            }
            () = changed => {}
            () = fired => {
                // Set no later than the armed deadline: one due by then
                // has passed. A later one (the exchange it was set for is
                // over, and another began) sets it again.
                let by = set_for.take();
                if let Some(on_cut) = by.and_then(|by| cutoff.fire(by)) {
                    break on_cut;
                }
            }
        }
    };
    drop(conn);
    tracing::debug!("upstream connection closed at its fenced write's deadline");
    on_cut.cut();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Nobody;
    impl OnCut for Nobody {
        fn cut(&self) {}
    }

    /// Records when it was told, and which exchange it was.
    struct Told(
        &'static str,
        tokio::sync::mpsc::UnboundedSender<(&'static str, Instant)>,
    );
    impl OnCut for Told {
        fn cut(&self) {
            let _ = self.1.send((self.0, Instant::now()));
        }
    }

    /// A connection whose driver runs until cut: the future of a
    /// connection that never ends by itself (a stalled exchange).
    fn stalled(cutoff: &Arc<Cutoff>) -> tokio::task::JoinHandle<()> {
        let conn = std::future::pending::<hyper::Result<()>>();
        tokio::spawn(drive(conn, cutoff.clone()))
    }

    /// On a fresh connection: an exchange armed `first` from now, over as
    /// soon as the driver has set its timer for it, then one armed
    /// `second` from then. Answers which exchange the driver cut, and
    /// whether it did so at or after the second's deadline; the driver must
    /// end at the cut. (The test's runtime has one thread: the driver runs
    /// only while the test yields, so no sleep has to be long enough.)
    async fn cut_after(first: Duration, second: Duration) -> (&'static str, bool) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let cutoff = Arc::new(Cutoff::default());
        let driver = stalled(&cutoff);
        cutoff.arm(Instant::now() + first, Arc::new(Told("first", tx.clone())));
        tokio::task::yield_now().await;
        assert!(cutoff.lock().watching.is_some(), "the driver set its timer");
        cutoff.clear();
        let at = Instant::now() + second;
        cutoff.arm(at, Arc::new(Told("second", tx)));
        let (who, when) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("cut within 10 s: well before a 60 s first deadline")
            .expect("told");
        driver.await.expect("the driver ends at the cut");
        (who, when >= at)
    }

    /// The driver keeps its timer across exchanges, so each deadline must
    /// still be met: one earlier than the timer wakes the driver at once,
    /// one later is waited for when the timer fires first, and an exchange
    /// that was over is never cut.
    #[tokio::test]
    async fn each_exchange_is_cut_at_its_own_deadline() {
        // A long timeout's timer stays set; a short one is met anyway.
        let (who, in_time) = cut_after(Duration::from_secs(60), Duration::from_millis(150)).await;
        assert_eq!(who, "second");
        assert!(in_time, "cut before its deadline");
        // The timer fires for the first, finds it over, and is set again.
        let (who, in_time) =
            cut_after(Duration::from_millis(300), Duration::from_millis(800)).await;
        assert_eq!(who, "second", "an exchange that was over is never cut");
        assert!(in_time, "cut at the first's timer, before its deadline");
    }

    /// Past its exchange's deadline a connection writes nothing, even
    /// before its driver has closed it (a process resumed after a pause
    /// may poll the connection before the timer).
    #[tokio::test]
    async fn nothing_is_written_past_the_deadline() {
        let (ours, mut theirs) = tokio::io::duplex(1024);
        let cutoff = Arc::new(Cutoff::default());
        let mut watched = Watched {
            inner: ours,
            heard: Heard::default(),
            cutoff: cutoff.clone(),
        };
        watched.write_all(b"before").await.expect("no deadline yet");
        cutoff.arm(Instant::now() + Duration::from_secs(60), Arc::new(Nobody));
        watched.write_all(b" armed").await.expect("deadline ahead");
        cutoff.arm(Instant::now(), Arc::new(Nobody));
        let err = watched
            .write_all(b" late")
            .await
            .expect_err("past the deadline");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(watched.flush().await.is_err(), "no flush past the deadline");
        cutoff.clear();
        watched
            .write_all(b" next")
            .await
            .expect("the next exchange");
        drop(watched);
        let mut got = String::new();
        theirs.read_to_string(&mut got).await.expect("read");
        assert_eq!(got, "before armed next");
    }
}
