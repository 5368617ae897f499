//! Bodies on a stream: the request's as the service reads it, and the
//! answer's as the peer's flow control lets it go.

use std::future::{poll_fn, Future as _};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

/// Why a stream's request body broke off.
#[derive(Debug, thiserror::Error)]
pub enum StreamBodyError {
    #[error("the client reset the stream before the request body ended")]
    Reset,
    #[error("the HTTP/2 connection failed while the request body was read: {0}")]
    Connection(h2::Error),
}

/// A stream's request body.
///
/// Window space is given back to the client as the service takes each
/// piece, not as it arrives: a service that does not read holds the
/// client to the stream's window, which bounds what a connection buffers.
pub struct RecvBody {
    recv: RecvStream,
    /// The request's `Content-Length`, which h2 holds the DATA frames to.
    length: Option<u64>,
    /// Bytes handed over so far, for the size hint.
    taken: u64,
    /// DATA has ended; trailers (if any) are next.
    data_done: bool,
}

impl RecvBody {
    pub fn new(recv: RecvStream, length: Option<u64>) -> Self {
        Self {
            recv,
            length,
            taken: 0,
            data_done: false,
        }
    }
}

fn body_error(e: h2::Error) -> StreamBodyError {
    if e.is_reset() || e.is_remote() {
        StreamBodyError::Reset
    } else {
        StreamBodyError::Connection(e)
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = StreamBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamBodyError>>> {
        let this = &mut *self;
        if !this.data_done {
            match this.recv.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    this.taken += data.len() as u64;
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(body_error(e)))),
                Poll::Ready(None) => this.data_done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
        match this.recv.poll_trailers(cx) {
            Poll::Ready(Ok(Some(trailers))) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(body_error(e)))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.length {
            Some(n) => SizeHint::with_exact(n.saturating_sub(self.taken)),
            None => SizeHint::default(),
        }
    }
}

/// How sending an answer's body ended early.
#[derive(Debug)]
pub enum SendError {
    /// The client reset the stream.
    Reset,
    /// The answer's body failed; the stream was reset.
    Body,
    /// The connection is gone.
    Connection,
}

/// Sends `body` on `tx` under the peer's flow control, then ends the
/// stream. A piece is taken from the body only once the one before it is
/// on its way, so what waits here for window space is one piece.
pub async fn send<B>(tx: &mut SendStream<Bytes>, body: B) -> Result<(), SendError>
where
    B: Body<Data = Bytes>,
{
    let mut body = std::pin::pin!(body);
    loop {
        let frame = {
            let next = body.frame();
            let mut next = std::pin::pin!(next);
            poll_fn(|cx| {
                if let Poll::Ready(r) = tx.poll_reset(cx) {
                    return Poll::Ready(Err(match r {
                        Ok(_) => SendError::Reset,
                        Err(_) => SendError::Connection,
                    }));
                }
                next.as_mut().poll(cx).map(Ok)
            })
            .await?
        };
        let frame = match frame {
            None => {
                return tx
                    .send_data(Bytes::new(), true)
                    .map_err(|_| SendError::Connection)
            }
            Some(Err(_)) => {
                tx.send_reset(h2::Reason::INTERNAL_ERROR);
                return Err(SendError::Body);
            }
            Some(Ok(frame)) => frame,
        };
        let frame = match frame.into_data() {
            Ok(data) => {
                let end = body.is_end_stream();
                if !data.is_empty() {
                    wait_for_window(tx).await?;
                }
                tx.send_data(data, end).map_err(|_| SendError::Connection)?;
                if end {
                    return Ok(());
                }
                continue;
            }
            Err(frame) => frame,
        };
        if let Ok(trailers) = frame.into_trailers() {
            tx.reserve_capacity(0);
            return tx
                .send_trailers(trailers)
                .map_err(|_| SendError::Connection);
        }
    }
}

/// Waits until the stream may send at least a byte. The claim is one byte,
/// not the piece's length: h2 raises it to what is buffered when the piece
/// is sent, and a large claim held while waiting would pin connection
/// window space that other streams could use.
async fn wait_for_window(tx: &mut SendStream<Bytes>) -> Result<(), SendError> {
    tx.reserve_capacity(1);
    poll_fn(|cx| loop {
        if tx.capacity() > 0 {
            return Poll::Ready(Ok(()));
        }
        if let Poll::Ready(r) = tx.poll_reset(cx) {
            return Poll::Ready(Err(match r {
                Ok(_) => SendError::Reset,
                Err(_) => SendError::Connection,
            }));
        }
        match tx.poll_capacity(cx) {
            Poll::Ready(Some(Ok(_))) => continue,
            Poll::Ready(Some(Err(_))) | Poll::Ready(None) => {
                return Poll::Ready(Err(SendError::Connection))
            }
            Poll::Pending => return Poll::Pending,
        }
    })
    .await
}
