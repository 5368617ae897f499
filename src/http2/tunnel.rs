//! HTTP/2's tunnels: a stream opened by an extended CONNECT (RFC 8441:
//! `:method CONNECT` with a `:protocol`, what WebSockets over HTTP/2 use)
//! carries the tunnel's bytes in its DATA frames once it is answered with
//! a `2xx`.
//!
//! The server hands such a request to the service as the HTTP/1.1 upgrade
//! it stands for: a bodiless `GET` of the `:path`, marked
//! [`ExtendedConnect`] with its protocol. The service decides, and asks
//! the upstream, as for an HTTP/1.1 `Upgrade`; a tunnel in its answer
//! ([`crate::http1::tunnel::Switched`]) is spliced to the stream as a byte
//! stream ([`StreamIo`]).

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Marks a request that came as an extended CONNECT: its answer opens a
/// tunnel with a `2xx`, never a `101`, and a `2xx` without a tunnel would
/// tell the client a tunnel is open that is not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtendedConnect {
    /// The `:protocol` pseudo-header: what the tunnel speaks (`websocket`).
    pub protocol: String,
}

/// The most asked of the peer's window for one write: a tunnel's writes
/// are what the other side read, and a larger claim would pin connection
/// window space that other streams could use.
const PIECE: usize = 16 * 1024;

/// An HTTP/2 stream as a byte stream both ways: DATA frames in, DATA
/// frames out under the peer's flow control, END_STREAM for a shutdown.
pub struct StreamIo {
    recv: RecvStream,
    send: SendStream<Bytes>,
    /// Received and not yet read.
    pending: Bytes,
    /// The peer ended its side (END_STREAM).
    recv_ended: bool,
    /// This side was ended.
    send_ended: bool,
}

impl StreamIo {
    pub fn new(recv: RecvStream, send: SendStream<Bytes>) -> Self {
        Self {
            recv,
            send,
            pending: Bytes::new(),
            recv_ended: false,
            send_ended: false,
        }
    }
}

fn broken(e: h2::Error) -> io::Error {
    match e.get_io() {
        Some(_) => io::Error::new(io::ErrorKind::BrokenPipe, e.to_string()),
        None => io::Error::new(io::ErrorKind::ConnectionReset, e.to_string()),
    }
}

impl AsyncRead for StreamIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                buf.put_slice(&self.pending[..n]);
                self.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            if self.recv_ended {
                return Poll::Ready(Ok(()));
            }
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // Window space is given back as a frame is taken: what
                    // waits here is at most that one frame.
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    self.pending = data;
                }
                Some(Err(e)) => return Poll::Ready(Err(broken(e))),
                None => self.recv_ended = true,
            }
        }
    }
}

impl AsyncWrite for StreamIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if self.send_ended {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        loop {
            let room = self.send.capacity();
            if room > 0 {
                let n = room.min(buf.len());
                self.send
                    .send_data(Bytes::copy_from_slice(&buf[..n]), false)
                    .map_err(broken)?;
                return Poll::Ready(Ok(n));
            }
            self.send.reserve_capacity(buf.len().min(PIECE));
            if let Poll::Ready(r) = self.send.poll_reset(cx) {
                let e = match r {
                    Ok(reason) => io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!("the stream was reset: {reason:?}"),
                    ),
                    Err(e) => broken(e),
                };
                return Poll::Ready(Err(e));
            }
            match ready!(self.send.poll_capacity(cx)) {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Poll::Ready(Err(broken(e))),
                None => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // h2 sends what it buffered as the connection is polled.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.send_ended {
            self.send_ended = true;
            self.send.send_data(Bytes::new(), true).map_err(broken)?;
        }
        Poll::Ready(Ok(()))
    }
}
