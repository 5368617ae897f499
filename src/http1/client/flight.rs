//! One request and its answer on a connection: the request written out
//! (head, then body), the answer's head read, then its body, and the
//! connection handed back to the pool when both directions are over.
//!
//! Everything runs in the futures and bodies that ask for it, with no task
//! of its own: the request's future writes the request and reads the
//! answer's head; the answer's body ([`UpstreamBody`]) is read by whoever
//! polls it (the server's connection task) and goes on writing the request
//! body if the answer came early, as an upstream that answers before it has
//! read a streamed body expects.
//!
//! **When the upstream has the request.** Not when it was written: the
//! gateway's kernel takes megabytes the upstream has not read (see `tcp`).
//! The request is *handed over* when the upstream's TCP has acknowledged
//! all of it, and that is asked when the answer's first byte comes: an
//! upstream that answers after reading the whole request acknowledges it
//! in the same segment, so a normal exchange never waits for it. An answer
//! that begins before then is an early answer.
//!
//! **A fenced request's last bytes** go out only into an empty send queue
//! with the upstream's window open (waiting for it in steps of
//! [`DRAIN_STEP`]): until then all but the last byte is written. So what a
//! paused or dead gateway's kernel can still deliver is at most its send
//! buffer of the request's middle, never its end, and an upstream never
//! applies it.
//!
//! **Where a connection goes after an exchange**: back to the pool only
//! after an exchange that ended normally (handed over before the answer
//! began, and the answer ended); closed gracefully after one whose request
//! was written in full, when nothing is left queued; reset in every other
//! case (see `tcp`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::Method;
use http_body::{Body as _, Frame, SizeHint};

use super::answer::{self, RequestFraming};
use super::connection::Connection;
use super::{ExchangeError, UpstreamClient, Witness};
use crate::http1::codec::{self, Decoded, Decoder};

/// How much of a request body is gathered before it is written: the head
/// and a small body go out in one write.
const GATHER: usize = 64 * 1024;
/// How often a fenced request's last byte asks again whether the send
/// queue has drained: the kernel has no event for it. Only a body larger
/// than what the upstream takes at once waits at all.
const DRAIN_STEP: Duration = Duration::from_millis(1);

/// The request on its way out.
pub(super) struct RequestWriter {
    /// Bytes not yet written, from `at`: the head, then the body as it
    /// comes, framed. For a request without a body it keeps the whole head
    /// (a bodiless GET may be sent again on another connection).
    out: Vec<u8>,
    at: usize,
    /// The body still to be read from the client; `None` once it ended (or
    /// for no body).
    body: Option<Body>,
    framing: RequestFraming,
    /// Body bytes still owed under `Content-Length`.
    owed: u64,
    /// Bytes written to the connection so far: a request of which not one
    /// byte was written may be sent on another connection.
    pub(super) written: u64,
    /// Everything was written (and flushed).
    pub(super) finished: bool,
    /// A fenced write's exchange: told when the request is written, and
    /// its last bytes wait for an empty send queue (see the module docs).
    witness: Option<Arc<dyn Witness>>,
    /// While the last bytes wait for the send queue to drain.
    drain: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl RequestWriter {
    pub(super) fn new(
        parts: &http::request::Parts,
        body: Body,
        witness: Option<Arc<dyn Witness>>,
    ) -> Self {
        let hint = http_body::Body::size_hint(&body);
        let framing = RequestFraming::of(http_body::Body::is_end_stream(&body), hint.exact());
        let mut out = Vec::with_capacity(512);
        answer::encode_head(parts, framing, &mut out);
        let owed = match framing {
            RequestFraming::Length(n) => n,
            _ => 0,
        };
        Self {
            out,
            at: 0,
            body: (framing != RequestFraming::Empty).then_some(body),
            framing,
            owed,
            written: 0,
            finished: false,
            witness,
            drain: None,
        }
    }

    /// Whether the request may be sent again after it failed on a reused
    /// connection with some of it written: a safe method without a body,
    /// which HTTP lets a client repeat (RFC 9110 §9.2.2), and which is how
    /// an idle connection the upstream closed mid-send shows. Fenced writes
    /// are never among them.
    pub(super) fn repeatable(&self, method: &Method) -> bool {
        self.framing == RequestFraming::Empty
            && matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
    }

    /// For a repeatable request: from the start again.
    pub(super) fn rewind(&mut self) {
        self.at = 0;
        self.written = 0;
        self.finished = false;
    }

    /// Writes what there is to write; ready once everything is written.
    pub(super) fn poll_send(
        &mut self,
        conn: &mut Connection,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), ExchangeError>> {
        if self.finished {
            return Poll::Ready(Ok(()));
        }
        loop {
            // Gather what the body has ready, so that the head and a body
            // that is already here go out in one write.
            let mut waiting = false;
            while let Some(body) = self.body.as_mut() {
                if self.out.len() - self.at >= GATHER {
                    break;
                }
                match Pin::new(body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Ok(data) = frame.into_data() {
                            self.frame(data)?;
                        }
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(ExchangeError::Body(e))),
                    Poll::Ready(None) => {
                        self.end()?;
                        self.body = None;
                    }
                    Poll::Pending => {
                        waiting = true;
                        break;
                    }
                }
            }
            if waiting && self.written == 0 && self.small() {
                // Not the head alone (see `small`).
                return Poll::Pending;
            }
            if self.at < self.out.len() {
                let mut end = self.out.len();
                if self.body.is_none() && self.witness.is_some() {
                    // The request's end: only into an empty queue (TLS
                    // holds nothing back either).
                    std::task::ready!(conn.poll_flush(cx)).map_err(ExchangeError::Io)?;
                    if !conn.may_write_last() {
                        if end - self.at > 1 {
                            end -= 1;
                        } else {
                            let step = self
                                .drain
                                .get_or_insert_with(|| Box::pin(tokio::time::sleep(DRAIN_STEP)));
                            std::task::ready!(step.as_mut().poll(cx));
                            self.drain = None;
                            continue;
                        }
                    }
                }
                match conn.poll_write(cx, &self.out[self.at..end]) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(ExchangeError::Io(
                            std::io::ErrorKind::WriteZero.into(),
                        )))
                    }
                    Poll::Ready(Ok(n)) => {
                        self.at += n;
                        self.written += n as u64;
                        // Room for more of the body; a bodiless request
                        // keeps its head (see `out`).
                        if self.at == self.out.len() && self.body.is_some() {
                            self.out.clear();
                            self.at = 0;
                        }
                        continue;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(ExchangeError::Io(e))),
                    Poll::Pending => return Poll::Pending,
                }
            }
            if self.body.is_some() {
                // All written; the body has nothing more yet.
                return Poll::Pending;
            }
            std::task::ready!(conn.poll_flush(cx)).map_err(ExchangeError::Io)?;
            self.finished = true;
            if let Some(w) = &self.witness {
                w.request_written();
            }
            return Poll::Ready(Ok(()));
        }
    }

    /// Whether the body is small enough to go out whole with its head: a
    /// length known and within one gather. Such a request is written only
    /// once its body is all here, as nginx buffers a request before it
    /// forwards it: an upstream given the head alone may answer before the
    /// body (nginx's `return` does), and an answer before the request was
    /// handed over is an early answer, which keeps a fenced write's key
    /// closed to its deadline. A body that comes apart from its head (an
    /// HTTP/2 stream's DATA after its HEADERS, a client's second segment)
    /// would otherwise make that the common case.
    fn small(&self) -> bool {
        matches!(self.framing, RequestFraming::Length(n) if n <= GATHER as u64)
    }

    /// Frames a piece of the body (only a request with a body has one).
    fn frame(&mut self, data: Bytes) -> Result<(), ExchangeError> {
        match self.framing {
            RequestFraming::Length(_) => {
                let n = data.len() as u64;
                if n > self.owed {
                    return Err(ExchangeError::BodyLength);
                }
                self.owed -= n;
                self.out.extend_from_slice(&data);
            }
            // An empty piece would be read as the last chunk.
            RequestFraming::Chunked if !data.is_empty() => {
                codec::encode_chunk(&data, &mut self.out);
            }
            RequestFraming::Chunked | RequestFraming::Empty => {}
        }
        Ok(())
    }

    /// The body has ended.
    fn end(&mut self) -> Result<(), ExchangeError> {
        match self.framing {
            RequestFraming::Length(_) if self.owed != 0 => Err(ExchangeError::BodyLength),
            RequestFraming::Chunked => {
                self.out.extend_from_slice(codec::LAST_CHUNK);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// A connection lent to one exchange.
pub(super) struct Flight {
    pub(super) conn: Connection,
    pub(super) request: RequestWriter,
    /// `None` until the answer's first byte; then whether the request had
    /// been handed over by then (see the module docs).
    pub(super) answer_began: Option<bool>,
    /// Where the connection goes back to, under which key.
    pub(super) client: UpstreamClient,
    pub(super) key: std::sync::Arc<str>,
}

impl Flight {
    /// Writes the request and reads the answer's head, both at once: an
    /// answer may come before the request body is written in full (the
    /// rest of the body is then written as the answer's body is read).
    /// `upgrade`: the request asked for one, and a `101` is its answer.
    pub(super) fn poll_head(
        &mut self,
        cx: &mut Context<'_>,
        method: &Method,
        upgrade: bool,
    ) -> Poll<Result<answer::AnswerHead, ExchangeError>> {
        loop {
            if let Poll::Ready(Err(e)) = self.request.poll_send(&mut self.conn, cx) {
                return Poll::Ready(Err(e));
            }
            if let Some(head) = answer::parse_head_asked(&mut self.conn.read, method, upgrade)? {
                return Poll::Ready(Ok(head));
            }
            match std::task::ready!(self.poll_fill(cx)) {
                Ok(0) => return Poll::Ready(Err(ExchangeError::Closed)),
                Ok(_) => {}
                Err(e) => return Poll::Ready(Err(ExchangeError::Io(e))),
            }
        }
    }

    /// Reads what the upstream sent; at the answer's first byte, asks
    /// whether the request was handed over (see the module docs).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        let n = std::task::ready!(self.conn.poll_fill(cx))?;
        if n > 0 && self.answer_began.is_none() {
            let handed_over = self.request.finished && self.conn.unacknowledged() == 0;
            self.answer_began = Some(handed_over);
            if let Some(w) = &self.request.witness {
                w.answer_began(handed_over);
            }
        }
        Poll::Ready(Ok(n))
    }

    /// Whether the exchange ended normally so far: the request was handed
    /// over before the answer began.
    fn handed_over(&self) -> bool {
        self.answer_began == Some(true)
    }
}

/// An upstream's answer body, read from its connection as it is polled.
/// When the answer has ended and the request is written in full, the
/// connection goes back to the pool or is closed
/// ([`UpstreamBody::poll_finish`]). Dropped before that, it resets the
/// connection.
#[derive(Default)]
pub struct UpstreamBody {
    /// `None` once the connection is handed back or closed. Held inline:
    /// the body is boxed once as the server's body already.
    flight: Option<Flight>,
    /// `Ended` for an empty (default) body.
    decoder: Decoder,
    keep_alive: bool,
}

impl UpstreamBody {
    pub(super) fn new(flight: Flight, decoder: Decoder, keep_alive: bool) -> Self {
        Self {
            flight: Some(flight),
            decoder,
            keep_alive,
        }
    }

    /// The answer has ended: ready once the request is written in full
    /// too, and the connection handed back if it can carry another
    /// exchange (or closed). An exchange whose request could not be
    /// finished is over as well: its connection is reset. Answers whether
    /// the exchange ended normally: the request was handed over before the
    /// answer began, the answer ended, and the deadline did not cut it.
    pub fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        let Some(flight) = self.flight.as_mut() else {
            return Poll::Ready(false);
        };
        let sent = std::task::ready!(flight.request.poll_send(&mut flight.conn, cx)).is_ok();
        let Some(flight) = self.flight.take() else {
            return Poll::Ready(false);
        };
        let normal = sent && self.decoder.ended() && flight.handed_over();
        let Flight {
            conn, client, key, ..
        } = flight;
        // A watchdog that reset the connection ended with it.
        if !conn.disarm() {
            return Poll::Ready(false);
        }
        // Anything the upstream sent past its answer is a broken upstream.
        if normal && self.keep_alive && conn.read.is_empty() {
            client.give_back(key, conn);
        } else if sent {
            conn.close_gracefully();
        }
        Poll::Ready(normal)
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = ExchangeError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ExchangeError>>> {
        let this = &mut *self;
        let decoder = &mut this.decoder;
        let Some(flight) = this.flight.as_mut() else {
            return Poll::Ready(None);
        };
        // An early answer: the rest of the request body goes on meanwhile.
        if let Poll::Ready(Err(e)) = flight.request.poll_send(&mut flight.conn, cx) {
            this.flight = None;
            return Poll::Ready(Some(Err(e)));
        }
        loop {
            match decoder.decode(&mut flight.conn.read) {
                Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(Decoded::End) => return Poll::Ready(None),
                Ok(Decoded::More) => {}
                Err(e) => {
                    this.flight = None;
                    return Poll::Ready(Some(Err(ExchangeError::Wire(e.into()))));
                }
            }
            match std::task::ready!(flight.poll_fill(cx)) {
                Ok(0) if *decoder == Decoder::ToClose => *decoder = Decoder::Ended,
                Ok(0) => {
                    this.flight = None;
                    return Poll::Ready(Some(Err(ExchangeError::Closed)));
                }
                Ok(_) => {}
                Err(e) => {
                    this.flight = None;
                    return Poll::Ready(Some(Err(ExchangeError::Io(e))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.decoder.ended()
    }

    fn size_hint(&self) -> SizeHint {
        self.decoder.size_hint()
    }
}
