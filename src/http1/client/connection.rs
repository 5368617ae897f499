//! One upstream connection: its socket (TCP, or TLS over TCP), the bytes
//! read from it and not yet used, and its deadline.
//!
//! The connection owns its socket and reads it through tokio's stream,
//! which takes a short read as proof that the socket is drained: the next
//! read waits for readiness instead of asking the kernel once more for
//! nothing. Its watchdog (see `cutoff`) knows the socket only by number.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::cutoff::{self, Cutoff};
use super::Upstream;
use super::{tcp, SendError, Witness};

/// Longest a TCP connect (and TLS handshake) to an upstream may take: a
/// refused or unroutable upstream must fail fast as 502.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Room made in the read buffer before each read. Most answers of an API
/// fit whole; a large body is read in pieces of at least this.
const READ_ROOM: usize = 16 * 1024;

pub(super) struct Connection {
    stream: Stream,
    /// Read from the upstream, not yet taken by a head or a body. Empty
    /// between exchanges: anything left over means the upstream sent more
    /// than its answer, and the connection is not reused.
    pub(super) read: BytesMut,
    cutoff: Arc<Cutoff>,
    /// Whether the watchdog runs (from the first fenced write on).
    watched: bool,
    /// The `TCP_USER_TIMEOUT` set on the socket, if any: lowered to each
    /// fenced exchange's time left when that is shorter, so that it is at
    /// most the timeout of every route that used the connection.
    unacknowledged_limit: Option<Duration>,
}

enum Stream {
    Tcp(TcpStream),
    /// Boxed: TLS state is kilobytes, and plain TCP should not carry it.
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connection {
    /// A new connection to `upstream`.
    pub(super) async fn connect(upstream: &Upstream) -> Result<Connection, SendError> {
        let connected = tokio::time::timeout(CONNECT_TIMEOUT, async {
            let tcp = TcpStream::connect(upstream.address()).await.map_err(|e| {
                SendError::Connect(format!("cannot connect to {}: {e}", upstream.authority))
            })?;
            tcp::configure(&tcp);
            let https = upstream.scheme == http::uri::Scheme::HTTPS;
            let stream = match &upstream.tls {
                // Fail closed: an https upstream whose trust was never
                // loaded (see `Upstream::load_tls`) is never spoken to in
                // plain text.
                None if https => {
                    return Err(SendError::Connect(format!(
                        "{} is https, but its TLS was not loaded",
                        upstream.authority
                    )))
                }
                None => Stream::Tcp(tcp),
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
                    Stream::Tls(Box::new(stream))
                }
            };
            Ok(Connection::over(stream))
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

    fn over(stream: Stream) -> Connection {
        Connection {
            stream,
            read: BytesMut::new(),
            cutoff: Arc::new(Cutoff::default()),
            watched: false,
            unacknowledged_limit: None,
        }
    }

    fn tcp(&self) -> &TcpStream {
        match &self.stream {
            Stream::Tcp(tcp) => tcp,
            Stream::Tls(tls) => tls.get_ref().0,
        }
    }

    fn socket(&self) -> BorrowedFd<'_> {
        self.tcp().as_fd()
    }

    /// Bytes written that the upstream's TCP has not acknowledged (see
    /// `tcp::unacknowledged`).
    pub(super) fn unacknowledged(&self) -> usize {
        tcp::unacknowledged(self.socket())
    }

    /// Whether a request's last bytes may be written now (see
    /// `tcp::may_write_last`).
    pub(super) fn may_write_last(&self) -> bool {
        tcp::may_write_last(self.socket())
    }

    /// The connection is closed after exchanges that all ended normally:
    /// with a FIN if nothing is queued (see `tcp::close_gracefully`).
    pub(super) fn close_gracefully(self) {
        tcp::close_gracefully(self.socket());
    }

    /// Arms the deadline of the exchange about to be written (see
    /// `cutoff`), starting the watchdog with the first one, and bounds the
    /// time written bytes may stay unacknowledged by the time left.
    pub(super) fn arm(&mut self, at: Instant, on_cut: Arc<dyn Witness>) {
        let left = at.saturating_duration_since(Instant::now());
        if self.unacknowledged_limit.is_none_or(|l| l > left) {
            tcp::limit_unacknowledged(self.socket(), left);
            self.unacknowledged_limit = Some(left);
        }
        if !self.watched {
            self.watched = true;
            tokio::spawn(cutoff::watchdog(
                self.cutoff.clone(),
                self.tcp().as_raw_fd(),
            ));
        }
        self.cutoff.arm(at, on_cut);
    }

    /// The exchange is over: its deadline no longer applies. Answers
    /// whether the connection may carry another (its watchdog did not
    /// reset it).
    pub(super) fn disarm(&self) -> bool {
        self.cutoff.clear();
        !self.watched || !self.cutoff.was_cut()
    }

    /// Whether an idle connection is still open, as far as can be told
    /// without waiting: the upstream has not closed it, nor sent anything
    /// (an idle connection has nothing to say). Asks the kernel only when
    /// the socket was reported readable since the last read.
    pub(super) fn is_open(&mut self) -> bool {
        match &mut self.stream {
            Stream::Tcp(tcp) => matches!(
                tcp.try_read(&mut [0u8; 1]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock
            ),
            Stream::Tls(tls) => {
                let mut cx = Context::from_waker(std::task::Waker::noop());
                let mut byte = [0u8; 1];
                let mut buf = ReadBuf::new(&mut byte);
                Pin::new(tls.as_mut())
                    .poll_read(&mut cx, &mut buf)
                    .is_pending()
            }
        }
    }

    /// Reads what the upstream has sent into `read`; `Ok(0)` at the end of
    /// the stream.
    pub(super) fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.read.capacity() - self.read.len() < READ_ROOM / 4 {
            self.read.reserve(READ_ROOM);
        }
        match &mut self.stream {
            Stream::Tcp(tcp) => tokio_util::io::poll_read_buf(Pin::new(tcp), cx, &mut self.read),
            Stream::Tls(tls) => {
                tokio_util::io::poll_read_buf(Pin::new(tls.as_mut()), cx, &mut self.read)
            }
        }
    }

    /// Writes some of `buf`, unless the exchange's deadline has passed
    /// (see `Cutoff::passed`).
    pub(super) fn poll_write(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.cutoff.passed() {
            return Poll::Ready(Err(past_deadline()));
        }
        match &mut self.stream {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_write(cx, buf),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, buf),
        }
    }

    /// Sends what TLS holds back (a TCP socket holds nothing), unless the
    /// deadline has passed.
    pub(super) fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.stream {
            Stream::Tcp(_) => Poll::Ready(Ok(())),
            Stream::Tls(_) if self.cutoff.passed() => Poll::Ready(Err(past_deadline())),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }
}

/// A connection an upstream's `101` took out of HTTP, as a tunnel's
/// upstream side: the bytes read past the answer's head first, then the
/// socket's. Dropped without a shutdown (a tunnel that failed), it resets
/// like every upstream socket; shut down, it sends a FIN and closes
/// normally.
pub struct Upgraded {
    conn: Connection,
}

impl Upgraded {
    pub(super) fn new(conn: Connection) -> Self {
        Self { conn }
    }
}

impl AsyncRead for Upgraded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let conn = &mut self.conn;
        if !conn.read.is_empty() {
            let n = conn.read.len().min(buf.remaining());
            buf.put_slice(&conn.read.split_to(n));
            return Poll::Ready(Ok(()));
        }
        match &mut conn.stream {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Upgraded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.conn.stream {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_write(cx, buf),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.conn.stream {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_flush(cx),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // What the tunnel sent is the upstream's to have: the close after
        // this FIN is a normal one.
        let _ = socket2::SockRef::from(&self.conn.socket()).set_linger(None);
        match &mut self.conn.stream {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Stream::Tls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
        }
    }
}

impl Drop for Connection {
    /// Says so to the watchdog before the socket closes (the fields are
    /// dropped after this), so that it never resets a descriptor the number
    /// of which a new socket may have taken. The close itself resets the
    /// connection, unless `close_gracefully` said otherwise (see `tcp`).
    fn drop(&mut self) {
        if self.watched {
            self.cutoff.close();
        }
    }
}

fn past_deadline() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the fenced write's deadline has passed",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// An https upstream whose TLS was never loaded is refused before a
    /// byte goes out: never spoken to in plain text.
    #[tokio::test]
    async fn an_https_upstream_without_its_tls_gets_no_plain_byte() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let upstream =
            Upstream::parse(&format!("https://127.0.0.1:{port}"), None).expect("a valid URL");
        let refused = match Connection::connect(&upstream).await {
            Ok(_) => panic!("connected to an https upstream without TLS"),
            Err(e) => e.to_string(),
        };
        assert!(refused.contains("TLS was not loaded"), "{refused}");
        let (mut theirs, _) = listener.accept().await.expect("accept");
        // Every upstream socket closes with a reset (`tcp`): the read ends
        // with it, or with the end of the stream, and nothing before.
        let mut got = Vec::new();
        match theirs.read_to_end(&mut got).await {
            Ok(_) => {}
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
        }
        assert!(got.is_empty(), "the upstream received {got:?}");
    }

    struct Nobody;
    impl Witness for Nobody {
        fn request_written(&self) {}
        fn answer_began(&self, _: bool) {}
        fn cut(&self) {}
    }

    /// Writes all of `bytes` without yielding to the runtime (so the
    /// watchdog does not run meanwhile), or fails.
    fn write_now(conn: &mut Connection, mut bytes: &[u8]) -> io::Result<()> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        while !bytes.is_empty() {
            match conn.poll_write(&mut cx, bytes) {
                Poll::Ready(Ok(n)) => bytes = &bytes[n..],
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => panic!("a socket this empty takes a few bytes at once"),
            }
        }
        Ok(())
    }

    /// Past its exchange's deadline a connection writes nothing, even
    /// before its watchdog has reset it (a process resumed after a
    /// pause may poll the connection before the timer), and it flushes
    /// nothing either.
    #[tokio::test]
    async fn nothing_is_written_past_the_deadline() {
        let (ours, mut theirs) = super::super::socket_pair().await;
        let mut conn = Connection::over(Stream::Tcp(ours));
        write_now(&mut conn, b"before").expect("no deadline yet");
        conn.arm(Instant::now() + Duration::from_secs(60), Arc::new(Nobody));
        write_now(&mut conn, b" armed").expect("deadline ahead");
        conn.arm(Instant::now(), Arc::new(Nobody));
        let err = write_now(&mut conn, b" late").expect_err("past the deadline");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(conn.disarm(), "the watchdog has not run: nothing was cut");
        write_now(&mut conn, b" next").expect("the next exchange");
        drop(conn);
        let mut got = String::new();
        theirs.read_to_string(&mut got).await.expect("read");
        assert_eq!(got, "before armed next");
    }

    /// Arming a fenced exchange bounds how long its bytes may stay
    /// unacknowledged by the time left, and a later, longer exchange does
    /// not raise it: it stays at most every fenced route's timeout.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn unacknowledged_bytes_are_bounded_by_the_time_left() {
        let user_timeout = |conn: &Connection| {
            let mut ms: libc::c_uint = 0;
            let mut len = std::mem::size_of::<libc::c_uint>() as libc::socklen_t;
            // SAFETY: an open socket; the kernel writes one c_uint.
            let r = unsafe {
                libc::getsockopt(
                    conn.tcp().as_raw_fd(),
                    libc::IPPROTO_TCP,
                    libc::TCP_USER_TIMEOUT,
                    (&mut ms as *mut libc::c_uint).cast(),
                    &mut len,
                )
            };
            assert_eq!(r, 0);
            ms
        };
        let (ours, _theirs) = super::super::socket_pair().await;
        let mut conn = Connection::over(Stream::Tcp(ours));
        assert_eq!(user_timeout(&conn), 0, "the kernel's default until armed");
        conn.arm(Instant::now() + Duration::from_secs(2), Arc::new(Nobody));
        let first = user_timeout(&conn);
        assert!((1..=2000).contains(&first), "{first} ms");
        assert!(conn.disarm());
        conn.arm(Instant::now() + Duration::from_secs(30), Arc::new(Nobody));
        assert_eq!(user_timeout(&conn), first, "never raised");
        assert!(conn.disarm());
        conn.arm(
            Instant::now() + Duration::from_millis(500),
            Arc::new(Nobody),
        );
        assert!(user_timeout(&conn) <= 500, "lowered for a shorter timeout");
    }
}
