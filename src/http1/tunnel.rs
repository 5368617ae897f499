//! A tunnel: once an upgrade is agreed (an upstream's `101` to an
//! HTTP/1.1 `Upgrade`, relayed as a `101`, or as a `200` to HTTP/2's
//! extended CONNECT), the client's connection or stream and the upstream's
//! connection carry bytes both ways, with no HTTP between them.
//!
//! The gateway decides whether a request may upgrade and asks the
//! upstream; the answer it gives the server carries the upstream's side in
//! its extensions ([`Switched`]); the server writes the answer's head and
//! splices its client's side to it ([`splice`]). So the server never asks
//! the upstream anything, and the gateway never touches the client's
//! connection.
//!
//! A tunnel ends when both sides have closed their sending halves (each
//! FIN is passed on as it comes, so a half-closed WebSocket or TCP-like
//! protocol works), when one side fails (the other is then closed too),
//! when no byte has moved either way for its idle timeout, or at the end
//! of a stop's grace period. The last two close both sides with a FIN,
//! never a reset: what each side had sent before is delivered.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::Instant;

/// A byte stream both ways: a connection, or an HTTP/2 stream.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// How long a tunnel's closing FINs may take to go out.
const SHUTDOWN_TIME: Duration = Duration::from_secs(1);

/// The upstream's side of an agreed upgrade, and the tunnel's bound.
pub struct Tunnel {
    /// The upstream connection, past the answer that agreed.
    pub upstream: Box<dyn Io>,
    /// No byte either way for this long ends the tunnel: an abandoned
    /// tunnel otherwise holds a client connection slot and an upstream
    /// connection for ever.
    pub idle_timeout: Duration,
    /// Kept while the tunnel lives and dropped when it ends: what the
    /// service counts open tunnels by.
    pub held: Box<dyn std::any::Any + Send>,
}

/// Carries a [`Tunnel`] in an answer's extensions, which must be `Clone`:
/// the server that writes the answer takes it out, once.
#[derive(Clone)]
pub struct Switched(Arc<Mutex<Option<Tunnel>>>);

impl Switched {
    pub fn new(tunnel: Tunnel) -> Self {
        Self(Arc::new(Mutex::new(Some(tunnel))))
    }

    /// The tunnel, the first time; `None` after.
    pub fn take(&self) -> Option<Tunnel> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// How a tunnel ended.
#[derive(Debug)]
pub enum Ended {
    /// Both sides closed their sending halves.
    Closed,
    /// No byte moved for the idle timeout.
    Idle,
    /// A stop's grace period ended.
    Stopped,
    /// A side failed; the other was closed.
    Failed(io::Error),
}

/// Passes bytes between `client` and the tunnel's upstream until the
/// tunnel ends (see the module docs). `stop` resolves when a stop's grace
/// period is over.
pub async fn splice<C>(mut client: C, tunnel: Tunnel, stop: impl Future<Output = ()>) -> Ended
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    // When a byte last moved, in milliseconds from `base`.
    let base = Instant::now();
    let moved = Arc::new(AtomicU64::new(0));
    let mut upstream = tunnel.upstream;
    let idle = tunnel.idle_timeout;
    let _held = tunnel.held;
    tokio::pin!(stop);
    let ended = {
        let mut client_side = Counted {
            io: &mut client,
            base,
            moved: moved.clone(),
        };
        let mut upstream_side = Counted {
            io: &mut upstream,
            base,
            moved: moved.clone(),
        };
        let copy = tokio::io::copy_bidirectional(&mut client_side, &mut upstream_side);
        tokio::pin!(copy);
        let sleep = tokio::time::sleep(idle);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                copied = &mut copy => break match copied {
                    Ok(_) => Ended::Closed,
                    Err(e) => Ended::Failed(e),
                },
                () = &mut stop => break Ended::Stopped,
                () = &mut sleep => {
                    // Moved on only here, not on every byte: one timer per
                    // tunnel, set again to the last byte's time plus the
                    // bound.
                    let last = base + Duration::from_millis(moved.load(Ordering::Relaxed));
                    if Instant::now() >= last + idle {
                        break Ended::Idle;
                    }
                    sleep.as_mut().reset(last + idle);
                }
            }
        }
    };
    if matches!(ended, Ended::Idle | Ended::Stopped) {
        let fins = async {
            let _ = client.shutdown().await;
            let _ = upstream.shutdown().await;
        };
        let _ = tokio::time::timeout(SHUTDOWN_TIME, fins).await;
    }
    ended
}

/// One side of a tunnel, noting when it last gave a byte (either side's
/// reads are all that moves).
struct Counted<'a, T> {
    io: &'a mut T,
    base: Instant,
    /// Milliseconds from `base` to the last read that gave bytes.
    moved: Arc<AtomicU64>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<'_, T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut *self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            let at = self.base.elapsed().as_millis() as u64;
            self.moved.store(at, Ordering::Relaxed);
        }
        read
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<'_, T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn tunnel(upstream: tokio::io::DuplexStream, idle: Duration) -> Tunnel {
        Tunnel {
            upstream: Box::new(upstream),
            idle_timeout: idle,
            held: Box::new(()),
        }
    }

    /// Bytes go both ways, each FIN is passed on, and the tunnel ends
    /// when both sides have closed.
    #[tokio::test]
    async fn bytes_and_fins_pass_both_ways() {
        let (mut client, client_end) = tokio::io::duplex(64);
        let (upstream_end, mut upstream) = tokio::io::duplex(64);
        let spliced = tokio::spawn(splice(
            client_end,
            tunnel(upstream_end, Duration::from_secs(5)),
            std::future::pending(),
        ));
        client.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        upstream.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        upstream.write_all(b"pong").await.unwrap();
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        // The client's FIN reaches the upstream, which still answers.
        client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        upstream.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        upstream.write_all(b"bye").await.unwrap();
        upstream.shutdown().await.unwrap();
        client.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"bye");
        assert!(matches!(spliced.await.unwrap(), Ended::Closed));
    }

    /// A tunnel where nothing moves ends after its idle timeout, with a
    /// FIN to each side; one where bytes keep moving does not.
    #[tokio::test(start_paused = true)]
    async fn an_idle_tunnel_ends_with_fins_both_ways() {
        let (mut client, client_end) = tokio::io::duplex(64);
        let (upstream_end, mut upstream) = tokio::io::duplex(64);
        let idle = Duration::from_secs(10);
        let spliced = tokio::spawn(splice(
            client_end,
            tunnel(upstream_end, idle),
            std::future::pending(),
        ));
        // Traffic every 6 s for a minute: never idle for 10.
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs(6)).await;
            client.write_all(b"x").await.unwrap();
            let mut got = [0u8; 1];
            upstream.read_exact(&mut got).await.unwrap();
        }
        assert!(!spliced.is_finished());
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        upstream.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        assert!(matches!(spliced.await.unwrap(), Ended::Idle));
    }

    /// A stop closes a busy tunnel with a FIN to each side, after what
    /// was already sent.
    #[tokio::test]
    async fn a_stop_closes_both_sides_cleanly() {
        let (mut client, client_end) = tokio::io::duplex(64);
        let (upstream_end, mut upstream) = tokio::io::duplex(64);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let spliced = tokio::spawn(splice(
            client_end,
            tunnel(upstream_end, Duration::from_secs(60)),
            async move {
                let _ = stopped.await;
            },
        ));
        upstream.write_all(b"last words").await.unwrap();
        let mut got = [0u8; 10];
        client.read_exact(&mut got).await.unwrap();
        stop.send(()).unwrap();
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        upstream.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        assert!(matches!(spliced.await.unwrap(), Ended::Stopped));
    }
}
