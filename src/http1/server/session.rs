//! One client connection of HTTP/1.1, served in one task, request after
//! request, each through the same phases:
//!
//! read head → hand over body → await answer → write answer → settle body
//!
//! - **Read head**, under the header-read timeout: it runs from when the
//!   connection starts waiting for a head, so it bounds an idle keep-alive
//!   connection as well as a slow one. One timer per connection, moved on
//!   only when it fires (see [`Session::read_head`]), not one per request.
//! - **Hand over body**: whole when it came with its head; otherwise
//!   through a [`Pipe`] that this task feeds only when the body asks.
//! - **Await answer**: the service's future runs in this task, while the
//!   body is fed and the client watched: a client that closes its side
//!   before the answer cancels the request (a fenced write goes on to its
//!   end regardless, in a task of its own: see `gateway`).
//! - **Write answer**: its head and as much of its body as is ready go out
//!   in one write; the body is still fed meanwhile (an answer may come
//!   before the request's body has been sent in full).
//! - **Settle body**: a body the service left unread is read and dropped
//!   if small ([`DISCARD_MAX`]); otherwise the connection closes, so that
//!   its bytes are never read as the next request.
//!
//! An answer that opens a tunnel (a `101` carrying one, see `tunnel`) ends
//! the phases: its head is written, and the connection is the tunnel's
//! client side from then on.
//!
//! Requests are answered one at a time, in order; pipelined heads wait in
//! the buffer. A closing connection sends its FIN and then reads what the
//! client still sends, for a moment ([`LINGER`]), so that the kernel does
//! not answer unread bytes with a reset that destroys the answer.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http::{Method, Request, StatusCode, Version};
use http_body::Body as _;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};

use super::body::{Pipe, RequestBody, RequestBodyError};
use super::request::{self, AnswerFraming, Asked, HeadError, RequestHead};
use super::{Drain, Limits, Service};
use crate::http1::codec::{encode_chunk, Decoded, Decoder, LAST_CHUNK, MAX_HEAD_BYTES};
use crate::http1::prefixed::Prefixed;
use crate::http1::tunnel::{splice, Switched};

/// Room made in the read buffer before a read.
const READ_ROOM: usize = 8 * 1024;
/// An answer's bytes are gathered up to this much before a write.
const GATHER: usize = 64 * 1024;
/// Most of a request body left unread by its answer that is read and
/// dropped to keep the connection; more closes it.
const DISCARD_MAX: u64 = 64 * 1024;
/// How long a closing connection reads what the client still sends.
const LINGER: Duration = Duration::from_secs(1);
/// What `Expect: 100-continue` is answered with when the body is wanted.
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// How a connection's HTTP/1.1 ended.
pub enum Served<I, S> {
    /// The connection is over.
    Ended,
    /// It opened with HTTP/2's preface, and `http2` said to hand such a
    /// connection back: here it is, with the bytes read from it so far.
    Http2 { io: I, read: BytesMut, service: S },
}

/// Serves HTTP/1.1 on `io` until the client leaves, a request asks for the
/// end, the server drains, or something fails. With `http2`, a connection
/// that opens with HTTP/2's preface is handed back instead.
pub async fn serve<I, S>(
    io: I,
    service: S,
    limits: Limits,
    drain: Arc<Drain>,
    http2: bool,
) -> Served<I, S>
where
    I: AsyncRead + AsyncWrite + Unpin,
    S: Service,
{
    let mut conn = Session::new(io);
    let _entered = drain.enter().await;
    let mut timer = HeadTimer {
        sleep: pin!(tokio::time::sleep(limits.header_read_timeout)),
        armed: false,
    };
    // The first head of the connection: the only place a preface can be.
    let mut first = true;
    loop {
        // Phase: read head.
        let deadline = Instant::now() + limits.header_read_timeout;
        let head = match conn.read_head(&mut timer, deadline, &drain).await {
            Ok(Some(head)) => head,
            Ok(None) => return Served::Ended,
            Err(HeadError::Http2Preface) if http2 && first => {
                return Served::Http2 {
                    io: conn.io,
                    read: conn.buf,
                    service,
                }
            }
            Err(e) => {
                conn.refuse(service.refuse(e)).await;
                return Served::Ended;
            }
        };
        first = false;
        let RequestHead {
            request,
            body,
            keep_alive,
            expect_continue,
        } = head;
        let asked = Asked {
            head: request.method == Method::HEAD,
            http10: request.version == Version::HTTP_10,
            keep_alive,
        };
        // Phase: hand over body.
        let (body, mut piping) = match conn.hand_over(body, expect_continue) {
            Ok(handed) => handed,
            Err(e) => {
                conn.refuse(service.refuse(e)).await;
                return Served::Ended;
            }
        };
        let req = Request::from_parts(request, Body::new(body));
        // Phase: await answer. Pinned here, where it is made: the
        // service's future is large, and every move of it is a copy.
        let answer = pin!(service.call(req));
        let Some(answer) = conn.await_answer(answer, &mut piping).await else {
            return Served::Ended;
        };
        if answer.status() == StatusCode::SWITCHING_PROTOCOLS {
            // Phase: tunnel; the connection's HTTP is over.
            conn.switch(answer, piping.is_none(), &drain).await;
            return Served::Ended;
        }
        // Phase: write answer. A client still waiting for `100 Continue`
        // may or may not send its body now: the connection cannot go on.
        let owed = piping.as_ref().is_some_and(|p| p.continue_owed);
        let asked = Asked {
            keep_alive: asked.keep_alive && !owed && !drain.started(),
            ..asked
        };
        let keep = match conn.write_answer(answer, asked, &mut piping).await {
            Ok(keep) => keep,
            Err(e) => {
                tracing::debug!(error = %e, "the answer could not be written");
                return Served::Ended;
            }
        };
        // Phase: settle body.
        let settled = match piping {
            None => true,
            Some(p) => conn.settle(p, limits.header_read_timeout).await,
        };
        if !keep || !settled || conn.eof || conn.broken {
            conn.close().await;
            return Served::Ended;
        }
    }
}

/// The connection's own state; the request's is in the phases.
struct Session<I> {
    io: I,
    /// Bytes read and not yet used: the next head, a body's bytes,
    /// pipelined requests.
    buf: BytesMut,
    /// Bytes on their way out: an answer, or a `100 Continue`.
    out: Vec<u8>,
    /// How much of `out` is written.
    sent: usize,
    /// The client closed its side.
    eof: bool,
    /// The request's body was malformed or its reading failed: what
    /// follows in the buffer cannot be trusted as a next request.
    broken: bool,
}

/// A body still on its way, as the connection feeds it.
struct Piping {
    pipe: Arc<Pipe>,
    decoder: Decoder,
    /// `Expect: 100-continue` and no `100` sent yet.
    continue_owed: bool,
}

/// A connection's one header-read timer. It is left where it is while
/// heads come in time, and moved to the current deadline only when it
/// fires before it: a request neither makes nor moves a timer of its own.
struct HeadTimer<'a> {
    sleep: Pin<&'a mut Sleep>,
    /// Polled since it was last set: it holds this task's waker until it
    /// fires, so a wait only looks at whether it has (polling it again on
    /// every wait would register the same waker again).
    armed: bool,
}

impl HeadTimer<'_> {
    /// Whether `deadline` has passed; if not, this task is woken by then.
    fn passed(&mut self, cx: &mut Context<'_>, deadline: Instant) -> bool {
        loop {
            let fired = if self.armed {
                self.sleep.is_elapsed()
            } else {
                self.sleep.as_mut().poll(cx).is_ready()
            };
            if !fired {
                self.armed = true;
                return false;
            }
            if Instant::now() >= deadline {
                return true;
            }
            self.sleep.as_mut().reset(deadline);
            self.armed = false;
        }
    }
}

/// What a wait for a head came to.
enum Waited {
    Read(io::Result<usize>),
    Drained,
    TimedOut,
}

impl<I: AsyncRead + AsyncWrite + Unpin> Session<I> {
    fn new(io: I) -> Self {
        Session {
            io,
            buf: BytesMut::with_capacity(READ_ROOM),
            out: Vec::new(),
            sent: 0,
            eof: false,
            broken: false,
        }
    }

    /// Reads into the buffer; a read of 0 is the client's close.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_ROOM / 2 {
            self.buf.reserve(READ_ROOM);
        }
        let n = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.io),
            cx,
            &mut self.buf
        ))?;
        if n == 0 {
            self.eof = true;
        }
        Poll::Ready(Ok(n))
    }

    /// Writes out what `out` holds.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            match ready!(Pin::new(&mut self.io).poll_write(cx, &self.out[self.sent..]))? {
                0 => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                n => self.sent += n,
            }
        }
        self.out.clear();
        self.sent = 0;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Phase: read head. `None`: the connection ends quietly (the client
    /// closed it, it was idle when the server began to drain, or it stayed
    /// idle past the timeout).
    ///
    /// `timer` is the connection's one timer (see [`HeadTimer`]).
    async fn read_head(
        &mut self,
        timer: &mut HeadTimer<'_>,
        deadline: Instant,
        drain: &Drain,
    ) -> Result<Option<RequestHead>, HeadError> {
        loop {
            if !self.buf.is_empty() {
                if let Some(head) = request::parse_head(&mut self.buf)? {
                    return Ok(Some(head));
                }
            }
            if self.eof {
                return Ok(None);
            }
            let waited = poll_fn(|cx| {
                if let Poll::Ready(r) = self.poll_read(cx) {
                    return Poll::Ready(Waited::Read(r));
                }
                if self.buf.is_empty() && drain.started() {
                    return Poll::Ready(Waited::Drained);
                }
                if timer.passed(cx, deadline) {
                    return Poll::Ready(Waited::TimedOut);
                }
                Poll::Pending
            })
            .await;
            match waited {
                Waited::Read(Ok(_)) => {}
                Waited::Read(Err(e)) => {
                    tracing::debug!(error = %e, "reading a request head failed");
                    return Ok(None);
                }
                Waited::Drained => return Ok(None),
                Waited::TimedOut if self.buf.is_empty() => return Ok(None),
                Waited::TimedOut => return Err(HeadError::Timeout),
            }
        }
    }

    /// Answers a refused head with the service's answer to it, and closes.
    async fn refuse(mut self, problem: Response) {
        let asked = Asked {
            head: false,
            http10: false,
            keep_alive: false,
        };
        if let Err(e) = self.write_answer(problem, asked, &mut None).await {
            tracing::debug!(error = %e, "a refusal could not be written");
        }
        self.broken = true;
        self.close().await;
    }

    /// Phase: hand over body. A body that is all in the buffer is handed
    /// over whole; the rest of one that is not comes through a pipe. A
    /// chunked body already malformed in the buffer is refused before the
    /// service sees its request: nothing of it is forwarded.
    fn hand_over(
        &mut self,
        mut decoder: Decoder,
        expect: bool,
    ) -> Result<(RequestBody, Option<Piping>), HeadError> {
        if decoder.ended() {
            return Ok((RequestBody::empty(), None));
        }
        match request::gather(&mut decoder, &mut self.buf) {
            (first, Some(Ok(()))) => Ok((
                first.map_or_else(RequestBody::empty, RequestBody::full),
                None,
            )),
            (_, Some(Err(e))) => Err(HeadError::Chunked(e)),
            (first, None) => {
                let pipe = Arc::new(Pipe::new(first, decoder.size_hint()));
                let piping = Piping {
                    pipe: pipe.clone(),
                    decoder,
                    continue_owed: expect,
                };
                Ok((RequestBody::piped(pipe), Some(piping)))
            }
        }
    }

    /// Feeds a piped body a piece when it wants one, reading the
    /// connection for it. Never blocks; registers this task to be woken
    /// when there is more to do. `answering`: the answer has begun, so a
    /// `100 Continue` can no longer be sent.
    fn feed(&mut self, cx: &mut Context<'_>, p: &mut Piping, answering: bool) {
        let pipe = p.pipe.clone();
        let mut state = pipe.lock();
        state.conn_waits(cx);
        if !state.wants() {
            return;
        }
        if p.continue_owed && !answering {
            p.continue_owed = false;
            if self.buf.is_empty() {
                self.out.extend_from_slice(CONTINUE);
            }
        }
        loop {
            match p.decoder.decode(&mut self.buf) {
                Ok(Decoded::Data(piece)) => return state.give(piece, p.decoder.size_hint()),
                Ok(Decoded::End) => return state.finish(Ok(())),
                Ok(Decoded::More) => {}
                Err(_) => {
                    self.broken = true;
                    return state.finish(Err(RequestBodyError::Chunk));
                }
            }
            if self.eof {
                self.broken = true;
                return state.finish(Err(RequestBodyError::Closed));
            }
            match self.poll_read(cx) {
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => {
                    tracing::debug!(error = %e, "reading a request body failed");
                    self.broken = true;
                    return state.finish(Err(RequestBodyError::Io));
                }
                Poll::Pending => return,
            }
        }
    }

    /// Whether the connection's reads are the body's (it is still being
    /// fed), rather than free to look ahead for the client's close.
    fn reads_for_body(piping: &Option<Piping>) -> bool {
        piping.as_ref().is_some_and(|p| {
            let state = p.pipe.lock();
            state.end.is_none() && !state.dropped
        })
    }

    /// Phase: await answer. `None`: the client left first (or the
    /// connection failed); the request's future is dropped.
    async fn await_answer(
        &mut self,
        mut answer: Pin<&mut impl Future<Output = Response>>,
        piping: &mut Option<Piping>,
    ) -> Option<Response> {
        poll_fn(|cx| {
            if let Poll::Ready(resp) = answer.as_mut().poll(cx) {
                return Poll::Ready(Some(resp));
            }
            if let Some(p) = piping {
                self.feed(cx, p, false);
            }
            if !self.out.is_empty() {
                if let Poll::Ready(Err(e)) = self.poll_send(cx) {
                    tracing::debug!(error = %e, "100 Continue could not be written");
                    return Poll::Ready(None);
                }
            }
            // Looking ahead notices the client's close, and takes in a
            // pipelined request (up to a head's worth).
            if !Self::reads_for_body(piping) {
                while !self.eof && self.buf.len() < MAX_HEAD_BYTES {
                    match self.poll_read(cx) {
                        Poll::Ready(Ok(_)) => {}
                        Poll::Ready(Err(_)) => return Poll::Ready(None),
                        Poll::Pending => break,
                    }
                }
            }
            if self.eof {
                return Poll::Ready(None);
            }
            Poll::Pending
        })
        .await
    }

    /// Phase: tunnel. Writes the `101`, then splices the connection (and
    /// what the client sent behind its request) to the upstream's. A `101`
    /// without a tunnel, or to a request with a body still coming (whose
    /// bytes could not be told from the tunnel's), ends the connection
    /// instead: the service never makes one.
    async fn switch(mut self, answer: Response, bodiless: bool, drain: &Drain) {
        let tunnel = answer
            .extensions()
            .get::<Switched>()
            .and_then(Switched::take);
        let Some(tunnel) = tunnel.filter(|_| bodiless) else {
            tracing::error!("a 101 answer without a tunnel; connection closed");
            return;
        };
        let (parts, _) = answer.into_parts();
        request::encode_switching_head(&parts, &mut self.out);
        if let Err(e) = poll_fn(|cx| self.poll_send(cx)).await {
            tracing::debug!(error = %e, "a 101 could not be written");
            return;
        }
        let client = Prefixed::new(self.buf, self.io);
        let ended = splice(client, tunnel, drain.closing()).await;
        tracing::debug!(?ended, "HTTP/1.1 tunnel ended");
    }

    /// Phase: write answer. Returns whether the connection may stay open.
    async fn write_answer(
        &mut self,
        answer: Response,
        asked: Asked,
        piping: &mut Option<Piping>,
    ) -> io::Result<bool> {
        let (parts, mut body) = answer.into_parts();
        let (mut framing, keep) =
            request::encode_head(&parts, body.size_hint().exact(), asked, &mut self.out);
        drop(parts);
        let mut ended = framing == AnswerFraming::Empty;
        poll_fn(|cx| loop {
            if let Some(p) = piping {
                self.feed(cx, p, true);
            }
            let mut waiting = false;
            while !ended && self.out.len() < GATHER {
                match Pin::new(&mut body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        let Ok(data) = frame.into_data() else {
                            // Trailers are not passed on.
                            continue;
                        };
                        put(&mut framing, data, &mut self.out)?;
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(io::Error::other(e))),
                    Poll::Ready(None) => {
                        match framing {
                            AnswerFraming::Length(n) if n > 0 => {
                                return Poll::Ready(Err(io::Error::other(
                                    "the answer's body ended before its length",
                                )))
                            }
                            AnswerFraming::Chunked => self.out.extend_from_slice(LAST_CHUNK),
                            _ => {}
                        }
                        ended = true;
                    }
                    Poll::Pending => {
                        waiting = true;
                        break;
                    }
                }
            }
            ready!(self.poll_send(cx))?;
            if ended {
                return Poll::Ready(Ok(keep));
            }
            if waiting {
                return Poll::Pending;
            }
        })
        .await
    }

    /// Phase: settle body. Waits, within `bound`, until a piped body has
    /// ended or was dropped, feeding it meanwhile; reads and drops a small
    /// unread rest. Returns whether the connection can take another
    /// request.
    async fn settle(&mut self, mut p: Piping, bound: Duration) -> bool {
        let pipe = p.pipe.clone();
        let settled = tokio::time::timeout(
            bound,
            poll_fn(|cx| {
                self.feed(cx, &mut p, true);
                let state = pipe.lock();
                if state.end.is_some() || state.dropped {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            }),
        )
        .await;
        if settled.is_err() || self.broken {
            return false;
        }
        if pipe.lock().end.is_some() {
            return true;
        }
        // Dropped unread. A client that waits for `100 Continue` may never
        // send the rest; one that does is read past, if the rest is small.
        if p.continue_owed {
            return false;
        }
        let discard = async {
            let mut left = DISCARD_MAX;
            loop {
                match p.decoder.decode(&mut self.buf) {
                    Ok(Decoded::Data(piece)) if (piece.len() as u64) <= left => {
                        left -= piece.len() as u64;
                    }
                    Ok(Decoded::End) => return true,
                    Ok(Decoded::More) => {
                        if self.eof || poll_fn(|cx| self.poll_read(cx)).await.is_err() {
                            return false;
                        }
                    }
                    _ => return false,
                }
            }
        };
        tokio::time::timeout(bound, discard).await.unwrap_or(false)
    }

    /// Ends the connection: its FIN, then what the client still sends is
    /// read and dropped for a moment (see the module docs).
    async fn close(mut self) {
        let linger = async {
            if poll_fn(|cx| Pin::new(&mut self.io).poll_shutdown(cx))
                .await
                .is_err()
            {
                return;
            }
            while !self.eof {
                self.buf.clear();
                if poll_fn(|cx| self.poll_read(cx)).await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(LINGER, linger).await;
    }
}

/// Appends a piece of an answer's body, framed.
fn put(framing: &mut AnswerFraming, data: Bytes, out: &mut Vec<u8>) -> Result<(), io::Error> {
    if data.is_empty() {
        return Ok(());
    }
    match framing {
        AnswerFraming::Empty => {}
        AnswerFraming::Length(left) => {
            let n = data.len() as u64;
            if n > *left {
                return Err(io::Error::other(
                    "the answer's body is longer than its length",
                ));
            }
            *left -= n;
            out.extend_from_slice(&data);
        }
        AnswerFraming::Chunked => encode_chunk(&data, out),
        AnswerFraming::ToClose => out.extend_from_slice(&data),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Interleavings of a body and its answer that need a service no
    //! gateway route is: one that keeps a body past its answer, and a
    //! client that does not read.

    use std::sync::Mutex;

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;

    /// A service made of a function.
    struct Fn<F>(F);

    impl<F, A> Service for Fn<F>
    where
        F: std::ops::Fn(Request<Body>) -> A + Send + Sync + 'static,
        A: Future<Output = Response> + Send + 'static,
    {
        fn call(&self, req: Request<Body>) -> impl Future<Output = Response> + Send + 'static {
            (self.0)(req)
        }

        fn refuse(&self, _: HeadError) -> Response {
            axum::response::IntoResponse::into_response(http::StatusCode::BAD_REQUEST)
        }
    }

    /// A request whose body has 3 of its 10 bytes, and then the other 7
    /// with a request behind them.
    const HALF_A_BODY: &[u8] = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc";
    const REST_THEN_NEXT: &[u8] = b"defghijGET /b HTTP/1.1\r\nhost: x\r\n\r\n";

    /// A connection served by `service` over a pipe with `room` bytes of
    /// buffer each way; the client's end, and the connection's task.
    fn open<S: Service>(service: S, room: usize) -> (DuplexStream, tokio::task::JoinHandle<()>) {
        let (client, server) = tokio::io::duplex(room);
        let conn = tokio::spawn(async move {
            let served = serve(server, service, limits(), Arc::default(), false).await;
            assert!(matches!(served, Served::Ended));
        });
        (client, conn)
    }

    /// Waits for the connection's task to end, for a few seconds at most.
    async fn ended(conn: tokio::task::JoinHandle<()>) {
        tokio::time::timeout(Duration::from_secs(5), conn)
            .await
            .expect("the connection's task ended")
            .unwrap();
    }

    fn limits() -> Limits {
        Limits {
            header_read_timeout: Duration::from_millis(300),
            max_connections: 8,
            shutdown_grace: Duration::from_secs(1),
        }
    }

    /// Reads until `until` has been seen `times` times, or fails after
    /// a few seconds.
    async fn read_until(client: &mut DuplexStream, got: &mut Vec<u8>, until: &str, times: usize) {
        let seen = |got: &[u8]| String::from_utf8_lossy(got).matches(until).count();
        tokio::time::timeout(Duration::from_secs(5), async {
            while seen(got) < times {
                let mut piece = [0u8; 256];
                let n = client.read(&mut piece).await.expect("read");
                assert!(n > 0, "closed early: {:?}", String::from_utf8_lossy(got));
                got.extend_from_slice(&piece[..n]);
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no {until:?}: {:?}", String::from_utf8_lossy(got)));
    }

    /// A body the service keeps, unread, after its answer: its bytes
    /// must never be read as the next request, and the connection must
    /// not wait for it forever.
    #[tokio::test]
    async fn a_body_kept_unread_after_its_answer_ends_the_connection_within_the_bound() {
        let kept = Arc::new(Mutex::new(Vec::new()));
        let keeper = kept.clone();
        let service = Fn(move |req: Request<Body>| {
            keeper.lock().unwrap().push(req.into_body());
            async { Response::new(Body::from("first")) }
        });
        let (mut client, conn) = open(service, 64 * 1024);
        client.write_all(HALF_A_BODY).await.unwrap();
        let mut got = Vec::new();
        read_until(&mut client, &mut got, "first", 1).await;
        // The body's rest and a request behind it.
        client.write_all(REST_THEN_NEXT).await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut got))
            .await
            .expect("the connection waited past its bound")
            .unwrap();
        let text = String::from_utf8_lossy(&got);
        assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "{text}");
        ended(conn).await;
        assert_eq!(kept.lock().unwrap().len(), 1);
    }

    /// The same body, read by the service's own task after the answer
    /// and within the bound: the connection feeds it, then goes on.
    #[tokio::test]
    async fn a_body_read_after_its_answer_is_fed_and_the_connection_goes_on() {
        let (read_tx, read_rx) = tokio::sync::oneshot::channel();
        let read_tx = Mutex::new(Some(read_tx));
        let service = Fn(move |req: Request<Body>| {
            if let Some(tx) = read_tx.lock().unwrap().take() {
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let body = req.into_body().collect().await.map(|b| b.to_bytes());
                    let _ = tx.send(body);
                });
            }
            async { Response::new(Body::from("done")) }
        });
        let (mut client, conn) = open(service, 64 * 1024);
        client.write_all(HALF_A_BODY).await.unwrap();
        let mut got = Vec::new();
        read_until(&mut client, &mut got, "done", 1).await;
        client.write_all(REST_THEN_NEXT).await.unwrap();
        read_until(&mut client, &mut got, "done", 2).await;
        let body = read_rx.await.unwrap().expect("the body arrived whole");
        assert_eq!(&body[..], b"abcdefghij");
        drop(client);
        ended(conn).await;
    }

    /// A client that shuts down its writing side before its answer has
    /// left: the request is cancelled, not answered.
    #[tokio::test]
    async fn a_client_that_half_closes_before_its_answer_cancels_it() {
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let done_tx = Arc::new(Mutex::new(Some(done_tx)));
        let service = Fn(move |_req: Request<Body>| {
            let done_tx = done_tx.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                // Reached only if the request was not cancelled.
                let _ = done_tx.lock().unwrap().take().map(|tx| tx.send(()));
                Response::new(Body::from("late"))
            }
        });
        let (mut client, conn) = open(service, 64 * 1024);
        client
            .write_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut got))
            .await
            .expect("the connection ended")
            .unwrap();
        assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
        ended(conn).await;
        assert!(done_rx.await.is_err(), "the request ran to its answer");
    }

    /// A `100 Continue` the client has not taken in full when the answer
    /// comes: the answer follows it intact, and the body the client then
    /// sends is read past, not taken for a request.
    #[tokio::test]
    async fn an_answer_follows_a_partly_written_100_continue_intact() {
        let service = Fn(|req: Request<Body>| async move {
            let mut body = req.into_body();
            // Asks for the body (so `100 Continue` is sent), then answers
            // without it.
            let _ = tokio::time::timeout(Duration::from_millis(100), body.frame()).await;
            Response::new(Body::from("early"))
        });
        // Eight bytes of room: the 25 bytes of `100 Continue` cannot go
        // out in one write while the client does not read.
        let (mut client, conn) = open(service, 8);
        client
            .write_all(
                b"PUT /a HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n",
            )
            .await
            .unwrap();
        // The answer is made while the client still does not read.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mut got = Vec::new();
        read_until(&mut client, &mut got, "early", 1).await;
        let text = String::from_utf8_lossy(&got).into_owned();
        assert!(
            text.starts_with("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"),
            "{text}"
        );
        assert!(text.ends_with("\r\n\r\nearly"), "{text}");
        assert!(!text.contains("connection: close"), "{text}");
        // The client, having had its `100`, sends the body; then a request.
        client
            .write_all(b"helloGET /b HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        read_until(&mut client, &mut got, "early", 2).await;
        let text = String::from_utf8_lossy(&got);
        assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
        assert_eq!(text.matches("100 Continue").count(), 1, "{text}");
        drop(client);
        ended(conn).await;
    }
}
