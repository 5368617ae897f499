//! A request's body as the service sees it.
//!
//! Most bodies are already in the connection's buffer when their head is
//! parsed (a `Content-Length` body sent with its head), and are handed over
//! whole: no sharing, no waking. A body still on its way is read by the
//! connection's task and passed through a [`Pipe`], one piece at a time and
//! only when the body asks for it: the body may be read from another task
//! (a fenced write forwards from its own), and reading only on demand is
//! what lets `Expect: 100-continue` be answered when the body is first
//! wanted, and a refused write's body never be read.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

/// Why a request's body broke off.
#[derive(Debug, Clone, Copy, thiserror::Error)]
pub enum RequestBodyError {
    #[error("the client closed the connection before the request body ended")]
    Closed,
    #[error("the request's chunked body is malformed")]
    Chunk,
    #[error("the connection failed while the request body was read")]
    Io,
}

/// A request's body.
pub struct RequestBody(Kind);

enum Kind {
    /// No body, or a body already taken.
    Empty,
    /// The whole body, already read.
    Full(Bytes),
    /// Read by the connection's task as it is asked for.
    Piped(Arc<Pipe>),
}

impl RequestBody {
    pub(super) fn empty() -> Self {
        Self(Kind::Empty)
    }

    pub(super) fn full(bytes: Bytes) -> Self {
        Self(Kind::Full(bytes))
    }

    pub(super) fn piped(pipe: Arc<Pipe>) -> Self {
        Self(Kind::Piped(pipe))
    }
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RequestBodyError>>> {
        match &mut self.0 {
            Kind::Empty => Poll::Ready(None),
            Kind::Full(_) => {
                let Kind::Full(bytes) = std::mem::replace(&mut self.0, Kind::Empty) else {
                    unreachable!("matched above")
                };
                Poll::Ready(Some(Ok(Frame::data(bytes))))
            }
            Kind::Piped(pipe) => pipe.poll_piece(cx).map(|p| p.map(|r| r.map(Frame::data))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Kind::Empty => true,
            Kind::Full(_) => false,
            Kind::Piped(pipe) => pipe.lock().ended(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Kind::Empty => SizeHint::with_exact(0),
            Kind::Full(b) => SizeHint::with_exact(b.len() as u64),
            Kind::Piped(pipe) => {
                let state = pipe.lock();
                let mut hint = state.rest;
                if let Some(piece) = &state.piece {
                    hint = hint + SizeHint::with_exact(piece.len() as u64);
                }
                hint
            }
        }
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        if let Kind::Piped(pipe) = &self.0 {
            let mut state = pipe.lock();
            state.dropped = true;
            state.wake_conn();
        }
    }
}

/// Between a body still on its way and the connection's task that reads
/// it. One lock, taken a few times per piece, and only ever by the two of
/// them: both usually run on the same worker thread.
#[derive(Default)]
pub(super) struct Pipe(Mutex<PipeState>);

#[derive(Default)]
pub(super) struct PipeState {
    /// A piece read and not yet taken by the body.
    piece: Option<Bytes>,
    /// How the body ended: `Some(Ok)` read to its end, `Some(Err)` broken
    /// off. Set by the connection only.
    pub end: Option<Result<(), RequestBodyError>>,
    /// The body asked for a piece and has none.
    wanted: bool,
    /// The body was dropped: the connection stops passing pieces.
    pub dropped: bool,
    /// What is known of the length still to be read from the connection.
    rest: SizeHint,
    body: Option<Waker>,
    conn: Option<Waker>,
}

impl Pipe {
    pub(super) fn new(first: Option<Bytes>, rest: SizeHint) -> Self {
        Self(Mutex::new(PipeState {
            piece: first,
            rest,
            ..PipeState::default()
        }))
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, PipeState> {
        // Neither side panics while it holds the lock; a poisoned lock
        // still holds a consistent state.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poll_piece(&self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, RequestBodyError>>> {
        let mut state = self.lock();
        if let Some(piece) = state.piece.take() {
            state.wake_conn();
            return Poll::Ready(Some(Ok(piece)));
        }
        match state.end {
            Some(Ok(())) => return Poll::Ready(None),
            Some(Err(e)) => return Poll::Ready(Some(Err(e))),
            None => {}
        }
        if !state.body.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            state.body = Some(cx.waker().clone());
        }
        if !state.wanted {
            state.wanted = true;
            state.wake_conn();
        }
        Poll::Pending
    }
}

impl PipeState {
    /// Whether the body has nothing more to give.
    fn ended(&self) -> bool {
        self.piece.is_none() && matches!(self.end, Some(Ok(())))
    }

    /// The connection's side: whether it should read a piece now.
    pub fn wants(&self) -> bool {
        self.wanted && self.piece.is_none() && self.end.is_none() && !self.dropped
    }

    /// The connection's side: remembers its task to wake.
    pub fn conn_waits(&mut self, cx: &Context<'_>) {
        if !self.conn.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            self.conn = Some(cx.waker().clone());
        }
    }

    /// The connection's side: a piece read, and what is known of the rest.
    pub fn give(&mut self, piece: Bytes, rest: SizeHint) {
        self.wanted = false;
        self.rest = rest;
        self.piece = Some(piece);
        self.wake_body();
    }

    /// The connection's side: the body ended, or broke off.
    pub fn finish(&mut self, end: Result<(), RequestBodyError>) {
        if self.end.is_none() {
            if end.is_ok() {
                self.rest = SizeHint::with_exact(0);
            }
            self.end = Some(end);
            self.wake_body();
        }
    }

    fn wake_body(&mut self) {
        if let Some(w) = self.body.take() {
            w.wake();
        }
    }

    fn wake_conn(&mut self) {
        if let Some(w) = &self.conn {
            w.wake_by_ref();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_piped_body_gets_what_the_connection_gives_and_breaks_off_with_it() {
        let pipe = Arc::new(Pipe::new(
            Some(Bytes::from_static(b"ab")),
            SizeHint::with_exact(2),
        ));
        let mut body = RequestBody::piped(pipe.clone());
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(4));
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"ab");
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(f) = body.frame().await {
                match f {
                    Ok(f) => got.extend_from_slice(&f.into_data().unwrap()),
                    Err(e) => return Err((got, e)),
                }
            }
            Ok(got)
        });
        // The connection gives a piece only when one is wanted.
        loop {
            tokio::task::yield_now().await;
            let mut state = pipe.lock();
            if state.wants() {
                state.give(Bytes::from_static(b"cd"), SizeHint::with_exact(0));
                break;
            }
        }
        loop {
            tokio::task::yield_now().await;
            let mut state = pipe.lock();
            if state.wants() {
                state.finish(Err(RequestBodyError::Closed));
                break;
            }
        }
        let (got, e) = reader.await.unwrap().unwrap_err();
        assert_eq!(got, b"cd");
        assert!(matches!(e, RequestBodyError::Closed));
        assert!(pipe.lock().dropped, "the body is gone");
    }
}
