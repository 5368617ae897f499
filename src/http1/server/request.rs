//! The bytes of an HTTP/1.1 exchange with a client: the request head as
//! parsed, and the answer head as written.
//!
//! A request's framing decides where the next request begins, so every
//! rule here is the strict one (RFC 9112 §6), and a front end that reads
//! the bytes another way gets a refusal, never a second request:
//!
//! - Lines end in CRLF. httparse also takes a bare LF for a line end (RFC
//!   9112 §2.2 lets a recipient), and a front end that does not would see
//!   one field where the gateway sees two: a bare LF is 400.
//! - `Transfer-Encoding` wins, and it may only be `chunked`, once (RFC
//!   9112 §6.1): any other coding, before it or instead of it, is 501
//!   `unsupported-coding` (the gateway would otherwise forward coded bytes
//!   framed by a length, or read them by a framing the sender did not
//!   mean); an empty one, one with an empty list element (`chunked,`:
//!   some readers take the empty element for the last coding), or one in
//!   an HTTP/1.0 request, is 400. A `Content-Length` beside it is dropped
//!   from the request and the connection closes after the answer, so
//!   nothing can be smuggled behind such a message.
//! - `Content-Length`: plain digits, repeated fields only if equal;
//!   anything else is 400, a list in one field (`5, 5`) too (RFC 9110
//!   §8.6 lets a recipient refuse it, and hyper does). Neither header: no
//!   body.
//! - `Host` (RFC 9112 §3.2): exactly one, a valid `host[:port]` (RFC 3986:
//!   a registered name, an IPv4 address or a bracketed IP literal; no
//!   userinfo, nothing empty); missing, repeated or invalid is 400. An
//!   HTTP/1.0 request may lack it (HTTP/1.0 has no Host): the gateway
//!   never routes by it and sets the upstream's `Host` from its config.
//! - A chunked body is decoded by the strict [`Decoder`] (see
//!   `http1::client::answer`); one malformed before the service sees its request
//!   is 400 at once, and the connection closes.
//! - A head is at most [`MAX_HEAD_BYTES`] with at most [`MAX_HEADERS`]
//!   fields, else 431.
//!
//! [`frame_requests`] is this framing over a whole byte stream, as a
//! connection reads it (the differential tests hold it against hyper's).
//!
//! Answers are framed by the gateway's own knowledge of their body: the
//! `Content-Length` the answer carries (an upstream's), else the body's
//! exact size, else chunked (or, to an HTTP/1.0 client, to the close). No
//! body for HEAD, 1xx, 204 and 304.

use std::cell::RefCell;
use std::time::SystemTime;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Uri, Version};

use crate::http1::codec::{itoa, parse_length, tokens, BodyFields, ChunkError, Decoded, Decoder};
pub use crate::http1::codec::{MAX_HEADERS, MAX_HEAD_BYTES};

/// Why a request head is refused; answered by the server itself (see
/// `error`), and the connection closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("the request head is not valid HTTP/1.1")]
    Malformed,
    #[error("the request head is larger than 64 KiB or has more than 100 fields")]
    TooLarge,
    #[error("the request's Content-Length is not one plain number")]
    Length,
    #[error("the request's Transfer-Encoding is empty or has an empty element, or the request is HTTP/1.0")]
    Coding,
    #[error("the request's Transfer-Encoding lists a coding other than one chunked, the only one supported (RFC 9112 §6.1)")]
    UnsupportedCoding,
    #[error(
        "the request's Host header is missing, repeated or not a valid host[:port] (RFC 9112 §3.2)"
    )]
    Host,
    #[error("a line of the request head ends in a bare LF; lines end in CRLF")]
    BareLf,
    #[error("the request's chunked body is malformed: {0}")]
    Chunked(ChunkError),
    #[error("the request head did not arrive within the header-read timeout")]
    Timeout,
    /// The connection opened with HTTP/2's connection preface (RFC 9113
    /// §3.4): a listener that speaks HTTP/2 takes the connection over; one
    /// that does not refuses it as any other malformed head.
    #[error("the connection opened with HTTP/2's preface, and HTTP/2 is off on this listener")]
    Http2Preface,
}

impl HeadError {
    /// The status a refusal of the head answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            HeadError::TooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            HeadError::Timeout => StatusCode::REQUEST_TIMEOUT,
            HeadError::UnsupportedCoding => StatusCode::NOT_IMPLEMENTED,
            HeadError::Malformed
            | HeadError::Length
            | HeadError::Coding
            | HeadError::Host
            | HeadError::BareLf
            | HeadError::Chunked(_)
            | HeadError::Http2Preface => StatusCode::BAD_REQUEST,
        }
    }
}

/// A request head, parsed.
#[derive(Debug)]
pub struct RequestHead {
    pub request: http::request::Parts,
    /// How the body is framed on the connection.
    pub body: Decoder,
    /// Whether the connection may carry another request after this one's
    /// answer: HTTP/1.1 without `Connection: close`, or HTTP/1.0 with
    /// `Connection: keep-alive`; never after a request framed both ways.
    pub keep_alive: bool,
    /// `Expect: 100-continue` (HTTP/1.1): the client waits for a `100`
    /// before it sends the body.
    pub expect_continue: bool,
}

/// The first line of HTTP/2's connection preface: a request line to an
/// HTTP/1.1 parser, with a version it refuses.
const PREFACE_LINE: &[u8] = b"PRI * HTTP/2.0\r\n";

/// Why httparse refused the head at the start of `buf`.
fn refused(e: httparse::Error, buf: &[u8]) -> HeadError {
    match e {
        httparse::Error::TooManyHeaders => HeadError::TooLarge,
        httparse::Error::Version if buf.starts_with(PREFACE_LINE) => HeadError::Http2Preface,
        _ => HeadError::Malformed,
    }
}

/// Parses the request head at the start of `buf`, taking its bytes out.
/// `None`: not all of it has arrived.
pub fn parse_head(buf: &mut BytesMut) -> Result<Option<RequestHead>, HeadError> {
    // Uninitialised: zeroing a hundred fields for a request that has five
    // costs more than parsing them.
    let mut fields = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut req,
        buf,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
            return Err(HeadError::TooLarge)
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(refused(e, buf)),
    };
    if len > MAX_HEAD_BYTES {
        return Err(HeadError::TooLarge);
    }
    if memchr::memchr_iter(b'\n', &buf[..len]).any(|i| i == 0 || buf[i - 1] != b'\r') {
        return Err(HeadError::BareLf);
    }
    let version = match req.version {
        Some(1) => Version::HTTP_11,
        Some(0) => Version::HTTP_10,
        _ => return Err(HeadError::Malformed),
    };
    let method = Method::from_bytes(req.method.ok_or(HeadError::Malformed)?.as_bytes())
        .map_err(|_| HeadError::Malformed)?;
    // Where the target and each field lie in the head, so that they can
    // share the head's bytes once it is taken out of `buf`.
    let base = buf.as_ptr() as usize;
    // Each within the head, whose length is checked above.
    let at = |s: &[u8]| (s.as_ptr() as usize - base) as u16;
    let target = req.path.ok_or(HeadError::Malformed)?.as_bytes();
    let target = (at(target), target.len() as u16);
    let mut spans = [(0u16, 0u16, 0u16, 0u16); MAX_HEADERS];
    let count = req.headers.len();
    let mut framing = RequestFields::default();
    for (span, field) in spans.iter_mut().zip(req.headers.iter()) {
        let (name, value) = (field.name.as_bytes(), field.value);
        *span = (at(name), name.len() as u16, at(value), value.len() as u16);
        framing.field(name, value);
    }
    let head = buf.split_to(len).freeze();
    let (start, target_len) = (usize::from(target.0), usize::from(target.1));
    let uri = Uri::from_maybe_shared(head.slice(start..start + target_len))
        .map_err(|_| HeadError::Malformed)?;
    // Room for what the gateway adds (`X-Forwarded-For`, `-Proto`,
    // `-Host`) without the map growing.
    let mut headers = HeaderMap::with_capacity(count + 3);
    for &(name, name_len, value, value_len) in &spans[..count] {
        let (name, value) = (usize::from(name), usize::from(value));
        let name = HeaderName::from_bytes(&head[name..name + usize::from(name_len)])
            .map_err(|_| HeadError::Malformed)?;
        let value =
            HeaderValue::from_maybe_shared(head.slice(value..value + usize::from(value_len)))
                .map_err(|_| HeadError::Malformed)?;
        headers.append(name, value);
    }
    match framing.hosts {
        0 if version == Version::HTTP_10 => {}
        1 if framing.host_valid => {}
        _ => return Err(HeadError::Host),
    }
    let body = match (framing.body.chunked, framing.body.length) {
        (Some(_), _) if version == Version::HTTP_10 => return Err(HeadError::Coding),
        (Some(_), _) if framing.body.codings == 0 || framing.body.codings_gap => {
            return Err(HeadError::Coding)
        }
        (Some(false), _) => return Err(HeadError::UnsupportedCoding),
        (Some(true), _) if framing.body.codings > 1 => return Err(HeadError::UnsupportedCoding),
        (Some(true), length) => {
            if length.is_some() {
                headers.remove(header::CONTENT_LENGTH);
            }
            Decoder::chunked()
        }
        (None, Some(_)) if framing.body.length_listed => return Err(HeadError::Length),
        (None, Some(None)) => return Err(HeadError::Length),
        (None, Some(Some(n))) => Decoder::Length(n),
        (None, None) => Decoder::Ended,
    };
    let both = framing.body.chunked.is_some() && framing.body.length.is_some();
    let keep_alive = !framing.close && !both && (version == Version::HTTP_11 || framing.keep_alive);
    let mut request = http::Request::new(()).into_parts().0;
    request.method = method;
    request.uri = uri;
    request.version = version;
    request.headers = headers;
    Ok(Some(RequestHead {
        request,
        body,
        keep_alive,
        expect_continue: framing.expect_continue && version == Version::HTTP_11,
    }))
}

/// What a request head's framing fields say (see the module docs).
#[derive(Default)]
struct RequestFields {
    /// `Content-Length` and `Transfer-Encoding`.
    body: BodyFields,
    /// `Connection` names `close`.
    close: bool,
    /// `Connection` names `keep-alive` (what keeps an HTTP/1.0 one open).
    keep_alive: bool,
    /// `Expect: 100-continue`.
    expect_continue: bool,
    /// How many `Host` fields, and whether the last was valid.
    hosts: u8,
    host_valid: bool,
}

impl RequestFields {
    /// Takes in one field of the head.
    fn field(&mut self, name: &[u8], value: &[u8]) {
        if self.body.field(name, value) {
            return;
        }
        match name.len() {
            10 if name.eq_ignore_ascii_case(b"connection") => {
                for t in tokens(value) {
                    self.close |= t.eq_ignore_ascii_case(b"close");
                    self.keep_alive |= t.eq_ignore_ascii_case(b"keep-alive");
                }
            }
            6 if name.eq_ignore_ascii_case(b"expect") => {
                self.expect_continue |= value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
            }
            4 if name.eq_ignore_ascii_case(b"host") => {
                self.hosts = self.hosts.saturating_add(1);
                self.host_valid = valid_host(value);
            }
            _ => {}
        }
    }
}

/// Whether a `Host` value is `uri-host [ ":" port ]` (RFC 9110 §7.2, RFC
/// 3986 §3.2.2-3): a registered name (unreserved characters, sub-delims,
/// percent-encodings; an IPv4 address is one) or a bracketed IP literal,
/// then an optional port of digits. No userinfo (`@`), no whitespace, no
/// path; not empty (an `http` URI has a host, RFC 9110 §4.2.1).
pub fn valid_host(value: &[u8]) -> bool {
    let (host, port) = match value {
        [b'[', rest @ ..] => {
            let Some(close) = rest.iter().position(|&b| b == b']') else {
                return false;
            };
            if !valid_ip_literal(&rest[..close]) {
                return false;
            }
            (None, &rest[close + 1..])
        }
        _ => {
            let end = value.iter().position(|&b| b == b':').unwrap_or(value.len());
            (Some(&value[..end]), &value[end..])
        }
    };
    let port_ok = match port {
        [] => true,
        [b':', digits @ ..] => digits.iter().all(u8::is_ascii_digit),
        _ => false,
    };
    port_ok && host.is_none_or(valid_reg_name)
}

/// `reg-name = 1*( unreserved / pct-encoded / sub-delims )` (non-empty:
/// see [`valid_host`]).
fn valid_reg_name(name: &[u8]) -> bool {
    let mut i = 0;
    while i < name.len() {
        match name[i] {
            b'%' if name
                .get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) =>
            {
                i += 3;
                continue;
            }
            b if is_unreserved(b) || is_sub_delim(b) => {}
            _ => return false,
        }
        i += 1;
    }
    !name.is_empty()
}

/// `IP-literal`'s inside: an IPv6 address (RFC 4291's text forms, as the
/// standard library reads them) or `IPvFuture`.
fn valid_ip_literal(inside: &[u8]) -> bool {
    if let [b'v' | b'V', rest @ ..] = inside {
        let Some(dot) = rest.iter().position(|&b| b == b'.') else {
            return false;
        };
        let (version, tail) = (&rest[..dot], &rest[dot + 1..]);
        return !version.is_empty()
            && version.iter().all(u8::is_ascii_hexdigit)
            && !tail.is_empty()
            && tail
                .iter()
                .all(|&b| is_unreserved(b) || is_sub_delim(b) || b == b':');
    }
    std::str::from_utf8(inside).is_ok_and(|s| s.parse::<std::net::Ipv6Addr>().is_ok())
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn is_sub_delim(b: u8) -> bool {
    matches!(
        b,
        b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b';' | b'='
    )
}

/// Takes out of `buf` what it holds of a body being decoded: the data
/// (`None` if none yet), and how the body stands: `Some(Ok)` ended,
/// `Some(Err)` malformed, `None` more is to come. The connection hands a
/// body over with this, and [`frame_requests`] frames a stream with it.
pub fn gather(
    decoder: &mut Decoder,
    buf: &mut BytesMut,
) -> (Option<Bytes>, Option<Result<(), ChunkError>>) {
    let mut first: Option<Bytes> = None;
    let mut more: Option<BytesMut> = None;
    let end = loop {
        match decoder.decode(buf) {
            Ok(Decoded::Data(piece)) => match (&mut first, &mut more) {
                (None, _) => first = Some(piece),
                (Some(f), None) => {
                    let mut joined = BytesMut::from(&f[..]);
                    joined.extend_from_slice(&piece);
                    more = Some(joined);
                }
                (Some(_), Some(joined)) => joined.extend_from_slice(&piece),
            },
            Ok(Decoded::End) => break Some(Ok(())),
            Ok(Decoded::More) => break None,
            Err(e) => break Some(Err(e)),
        }
    };
    (more.map(BytesMut::freeze).or(first), end)
}

/// A request framed out of a byte stream: its head, and its whole body.
#[derive(Debug)]
pub struct Framed {
    pub request: http::request::Parts,
    pub body: Bytes,
}

/// How [`frame_requests`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// Every byte was a request's, or a request ended the connection (what
    /// follows it is never read).
    Done,
    /// The bytes ended inside a request's head or body.
    Incomplete,
    /// Refused: the server answers with a problem and closes.
    Refused(HeadError),
}

/// The requests a connection reads from `stream` when all of it has
/// arrived, by the connection's own steps: [`parse_head`], then
/// [`gather`] for the body, until the bytes end, a request is refused, or
/// one does not keep the connection open.
pub fn frame_requests(stream: &[u8]) -> (Vec<Framed>, StreamEnd) {
    let mut buf = BytesMut::from(stream);
    let mut framed = Vec::new();
    while !buf.is_empty() {
        let head = match parse_head(&mut buf) {
            Ok(Some(head)) => head,
            Ok(None) => return (framed, StreamEnd::Incomplete),
            Err(e) => return (framed, StreamEnd::Refused(e)),
        };
        let mut decoder = head.body;
        let body = if decoder.ended() {
            Bytes::new()
        } else {
            match gather(&mut decoder, &mut buf) {
                (body, Some(Ok(()))) => body.unwrap_or_default(),
                (_, Some(Err(e))) => return (framed, StreamEnd::Refused(HeadError::Chunked(e))),
                (_, None) => return (framed, StreamEnd::Incomplete),
            }
        };
        framed.push(Framed {
            request: head.request,
            body,
        });
        if !head.keep_alive {
            break;
        }
    }
    (framed, StreamEnd::Done)
}

/// How an answer's body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerFraming {
    /// No body is written (HEAD, 1xx, 204, 304), whatever the answer has.
    Empty,
    /// Exactly this many bytes are still to be written.
    Length(u64),
    Chunked,
    /// Written as it comes; the connection's close ends it (an HTTP/1.0
    /// client, a body of unknown size).
    ToClose,
}

/// What an answer's head is written for.
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    /// The request was a HEAD: the answer's head only.
    pub head: bool,
    /// The request was HTTP/1.0: no chunked answers.
    pub http10: bool,
    /// Whether the connection stays open after the answer, as far as the
    /// request and the server go (the answer may still close it).
    pub keep_alive: bool,
}

/// Writes an answer's head into `out`. `exact` is the body's exact size
/// when known. Returns how the body is framed, and whether the connection
/// stays open after it.
pub fn encode_head(
    parts: &http::response::Parts,
    exact: Option<u64>,
    asked: Asked,
    out: &mut Vec<u8>,
) -> (AnswerFraming, bool) {
    let status = parts.status;
    let no_length = status.is_informational() || status == StatusCode::NO_CONTENT;
    let bodiless = no_length || status == StatusCode::NOT_MODIFIED;
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    // One pass over the fields, written as they come, except those that
    // frame the body or the connection: framing is ours, and what those
    // say is noted on the way (a lookup per name cost more than the pass).
    let mut keep_alive = asked.keep_alive;
    let mut declared = None;
    let mut dated = false;
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH {
            // An answer's own length (an upstream's) stands, also for a
            // HEAD; an unreadable or repeated one is dropped.
            match parse_length(value.as_bytes()) {
                Some(n) if declared.is_none() && !no_length => declared = Some(n),
                _ => continue,
            }
        } else if name == header::TRANSFER_ENCODING {
            continue;
        } else if name == header::CONNECTION {
            keep_alive &= !tokens(value.as_bytes()).any(|t| t.eq_ignore_ascii_case(b"close"));
            continue;
        } else if name == header::DATE {
            dated = true;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let (framing, length) = if bodiless {
        (AnswerFraming::Empty, None)
    } else if asked.head {
        let known = declared.is_none().then_some(exact).flatten();
        (AnswerFraming::Empty, known.filter(|&n| n > 0))
    } else {
        match declared.or(exact) {
            Some(n) => (AnswerFraming::Length(n), declared.is_none().then_some(n)),
            None if asked.http10 => (AnswerFraming::ToClose, None),
            None => (AnswerFraming::Chunked, None),
        }
    };
    if framing == AnswerFraming::ToClose {
        keep_alive = false;
    }
    if let Some(n) = length {
        let mut digits = [0; 20];
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa(n, &mut digits));
        out.extend_from_slice(b"\r\n");
    }
    if framing == AnswerFraming::Chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    if !dated {
        out.extend_from_slice(b"date: ");
        with_date(|d| out.extend_from_slice(d));
        out.extend_from_slice(b"\r\n");
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    } else if asked.http10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
    (framing, keep_alive)
}

/// Writes the head of a `101` that opens a tunnel: its fields (the
/// `Upgrade` the upstream agreed to among them) but those that would frame
/// a body or speak for this connection, then `connection: upgrade`.
pub fn encode_switching_head(parts: &http::response::Parts, out: &mut Vec<u8>) {
    out.extend_from_slice(b"HTTP/1.1 101 Switching Protocols\r\n");
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::CONNECTION
            || name.as_str() == "keep-alive"
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"connection: upgrade\r\n\r\n");
}

thread_local! {
    /// This thread's `Date` value and the second it is for: formatted once
    /// a second, not once an answer.
    static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
}

/// Gives the current `Date` value (IMF-fixdate, always 29 bytes) to `f`.
fn with_date(f: impl FnOnce(&[u8])) {
    let now = SystemTime::now();
    let second = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, value)| {
        if *at != second {
            let text = httpdate::fmt_http_date(now);
            if text.len() == value.len() {
                value.copy_from_slice(text.as_bytes());
                *at = second;
            }
        }
        f(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(raw: &str) -> Result<Option<RequestHead>, HeadError> {
        parse_head(&mut BytesMut::from(raw))
    }

    #[test]
    fn request_framing_is_strict() {
        let h = head("PUT /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.body, Decoder::Length(5));
        assert!(h.keep_alive);
        let h =
            head("PUT /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n")
                .unwrap()
                .unwrap();
        assert_eq!(h.body, Decoder::Length(5));
        let h = head("GET /a HTTP/1.1\r\nHost: x\r\n\r\n").unwrap().unwrap();
        assert_eq!(h.body, Decoder::Ended);
        // Both framings: chunked wins, the length goes, the connection ends.
        let h = head(
            "PUT /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.body, Decoder::chunked());
        assert!(!h.keep_alive);
        assert!(!h.request.headers.contains_key(header::CONTENT_LENGTH));
        let put = |field: &str, value: &str| {
            format!("PUT /a HTTP/1.1\r\nHost: x\r\n{field}: {value}\r\n\r\n")
        };
        for cl in [
            "5\r\nContent-Length: 6",
            "5, 6",
            "5, 5",
            "5,",
            "-5",
            "+5",
            "0x5",
            "",
            "99999999999999999999",
        ] {
            let raw = put("Content-Length", cl);
            assert_eq!(head(&raw).unwrap_err(), HeadError::Length, "{raw}");
        }
        for te in [
            "",
            ",",
            // An empty element: the last coding is chunked to some readers
            // and the empty one to others.
            "chunked,",
            ", chunked",
            "chunked\r\nTransfer-Encoding:",
        ] {
            let raw = put("Transfer-Encoding", te);
            assert_eq!(head(&raw).unwrap_err(), HeadError::Coding, "{raw}");
        }
        let raw = "PUT /a HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(head(raw).unwrap_err(), HeadError::Coding, "{raw}");
        // Any coding but one chunked: 501 (RFC 9112 §6.1).
        for te in [
            "gzip",
            "chunked, gzip",
            "gzip, chunked",
            "chunked, chunked",
            "chunked;q=1",
            "identity",
            "x-unknown, chunked",
            "chunked\r\nTransfer-Encoding: chunked",
            "gzip\r\nTransfer-Encoding: chunked",
        ] {
            let raw = put("Transfer-Encoding", te);
            assert_eq!(
                head(&raw).unwrap_err(),
                HeadError::UnsupportedCoding,
                "{te}"
            );
        }
        for te in ["chunked", "Chunked", " CHUNKED "] {
            let raw = format!("PUT /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: {te}\r\n\r\n");
            let h = head(&raw).unwrap().unwrap();
            assert_eq!(h.body, Decoder::chunked(), "{te}");
        }
    }

    #[test]
    fn host_is_one_valid_authority() {
        for host in [
            "a",
            "example.com",
            "example.com:8080",
            "EXAMPLE.com:",
            "127.0.0.1",
            "127.0.0.1:80",
            "[::1]",
            "[::1]:443",
            "[2001:db8::7]:1",
            "[::ffff:192.0.2.1]",
            "[v1.fe80::a+en1]",
            "a-b_c~d.e!$&'()*+,;=",
            "%41%2a",
            "xn--nxasmq6b",
        ] {
            let raw = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
            assert!(head(&raw).is_ok_and(|h| h.is_some()), "{host:?}");
        }
        for host in [
            "",
            ":80",
            "a b",
            "a b@c",
            "user@a",
            "user:pw@a",
            "a:b",
            "a:80:80",
            "a/b",
            "a?b",
            "a#b",
            "%4",
            "%zz",
            "[::1",
            "::1",
            "[::1]x",
            "[::1]:x",
            "[1.2.3.4]",
            "[::1%25eth0]",
            "[v.x]",
            "[v1.]",
            "\"a\"",
            "a\\b",
            "é",
        ] {
            let raw = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
            assert_eq!(head(&raw).unwrap_err(), HeadError::Host, "{host:?}");
        }
        for raw in [
            "GET / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n",
            "GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.0\r\nHost: a b\r\n\r\n",
        ] {
            assert_eq!(head(raw).unwrap_err(), HeadError::Host, "{raw:?}");
        }
        // HTTP/1.0 has no Host: one without is served.
        assert!(head("GET / HTTP/1.0\r\n\r\n").unwrap().is_some());
    }

    #[test]
    fn a_bare_lf_anywhere_in_a_head_is_refused() {
        for raw in [
            "GET / HTTP/1.1\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\nX: b\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nX: b\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\n\n",
            "GET / HTTP/1.1\nHost: a\n\n",
            "\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
            "\r\n\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            assert_eq!(head(raw).unwrap_err(), HeadError::BareLf, "{raw:?}");
        }
        // An empty line before the request line is skipped (RFC 9112 §2.2).
        assert!(head("\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n")
            .unwrap()
            .is_some());
    }

    fn framed(stream: &str) -> (Vec<(String, String)>, StreamEnd) {
        let (requests, end) = frame_requests(stream.as_bytes());
        let requests = requests
            .into_iter()
            .map(|f| {
                (
                    format!("{} {}", f.request.method, f.request.uri),
                    String::from_utf8_lossy(&f.body).into_owned(),
                )
            })
            .collect();
        (requests, end)
    }

    #[test]
    fn a_stream_is_framed_as_the_connection_reads_it() {
        let two = "PUT /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
                   3;x=y\r\nabc\r\n0\r\nx-sum: 1\r\n\r\n\
                   GET /b HTTP/1.1\r\nHost: x\r\n\r\n";
        let (got, end) = framed(two);
        assert_eq!(end, StreamEnd::Done);
        assert_eq!(
            got,
            [
                ("PUT /a".to_string(), "abc".to_string()),
                ("GET /b".to_string(), String::new())
            ]
        );
        // What follows a request that ends the connection is never read.
        let (got, end) =
            framed("GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGARBAGE\r\n\r\n");
        assert_eq!((got.len(), end), (1, StreamEnd::Done));
        let (got, end) = framed("GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\n");
        assert_eq!((got.len(), end), (1, StreamEnd::Incomplete));
        let (got, end) = framed("PUT /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabc");
        assert_eq!((got.len(), end), (0, StreamEnd::Incomplete));
        // D1 of issue 49: the bare LF after `;` is refused, and the GET
        // inside the body is never a request.
        let d1 = format!(
            "PUT /docs/x HTTP/1.1\r\nHost: a\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n\
             2;\nxx\r\n50\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n{}\r\n0\r\n\r\n",
            "Z".repeat(40)
        );
        let (got, end) = framed(&d1);
        assert!(got.is_empty(), "{got:?}");
        assert_eq!(
            end,
            StreamEnd::Refused(HeadError::Chunked(ChunkError::LineEnd))
        );
    }

    #[test]
    fn connection_and_expect_are_read() {
        let h = head("GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!h.keep_alive);
        let h = head("GET / HTTP/1.0\r\n\r\n").unwrap().unwrap();
        assert!(!h.keep_alive);
        let h = head("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(h.keep_alive);
        let h =
            head("PUT / HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\nContent-Length: 1\r\n\r\n")
                .unwrap()
                .unwrap();
        assert!(h.expect_continue);
        let h = head("PUT / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!h.expect_continue);
    }

    #[test]
    fn heads_are_bounded_and_checked() {
        assert_eq!(
            head("GET / HTTP/1.1\r\nHost: x\r\n").unwrap().map(|_| ()),
            None
        );
        let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: 1\r\n")).collect();
        assert_eq!(
            head(&format!("GET / HTTP/1.1\r\n{many}\r\n")).unwrap_err(),
            HeadError::TooLarge
        );
        let long = format!("GET / HTTP/1.1\r\nx-long: {}", "a".repeat(MAX_HEAD_BYTES));
        assert_eq!(head(&long).unwrap_err(), HeadError::TooLarge);
        for raw in [
            "GARBAGE\r\n\r\n",
            "GET / HTTP/2.0\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: x\r\nBad Name: x\r\n\r\n",
            "GET / HTTP/1.1\r\nX: a\rb\r\n\r\n",
            "GET /\x01 HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(head(raw).unwrap_err(), HeadError::Malformed, "{raw:?}");
        }
        // The head is taken out; what follows stays.
        let mut buf =
            BytesMut::from("GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nx-a: 2\r\n\r\nNEXT");
        let h = parse_head(&mut buf).unwrap().unwrap();
        assert_eq!(&buf[..], b"NEXT");
        assert_eq!(h.request.uri, "/a?b=1");
        assert_eq!(h.request.headers.get_all("x-a").iter().count(), 2);
    }

    fn answer(
        status: u16,
        headers: &[(&str, &str)],
        exact: Option<u64>,
        asked: Asked,
    ) -> (String, AnswerFraming, bool) {
        let mut resp = http::Response::new(());
        *resp.status_mut() = StatusCode::from_u16(status).unwrap();
        for (n, v) in headers {
            resp.headers_mut().append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        let (parts, ()) = resp.into_parts();
        let mut out = Vec::new();
        let (framing, keep) = encode_head(&parts, exact, asked, &mut out);
        (String::from_utf8(out).unwrap(), framing, keep)
    }

    const PLAIN: Asked = Asked {
        head: false,
        http10: false,
        keep_alive: true,
    };

    #[test]
    fn answers_are_framed_by_what_is_known() {
        let (text, framing, keep) = answer(200, &[], Some(5), PLAIN);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(
            text.contains("content-length: 5\r\n") && text.contains("date: "),
            "{text}"
        );
        assert_eq!((framing, keep), (AnswerFraming::Length(5), true));
        let (text, framing, _) = answer(200, &[("content-length", "7")], Some(7), PLAIN);
        assert_eq!(text.matches("content-length").count(), 1, "{text}");
        assert_eq!(framing, AnswerFraming::Length(7));
        let (text, framing, _) = answer(200, &[("transfer-encoding", "gzip")], None, PLAIN);
        assert!(
            text.contains("transfer-encoding: chunked\r\n") && !text.contains("gzip"),
            "{text}"
        );
        assert_eq!(framing, AnswerFraming::Chunked);
        let (text, framing, keep) = answer(
            200,
            &[],
            None,
            Asked {
                http10: true,
                ..PLAIN
            },
        );
        assert!(text.contains("connection: close\r\n"), "{text}");
        assert_eq!((framing, keep), (AnswerFraming::ToClose, false));
        let (text, framing, _) = answer(
            200,
            &[("content-length", "9")],
            Some(0),
            Asked {
                head: true,
                ..PLAIN
            },
        );
        assert!(text.contains("content-length: 9\r\n"), "{text}");
        assert_eq!(framing, AnswerFraming::Empty);
        let (text, framing, _) = answer(204, &[("content-length", "0")], Some(0), PLAIN);
        assert!(!text.contains("content-length"), "{text}");
        assert_eq!(framing, AnswerFraming::Empty);
        let (text, _, keep) = answer(409, &[("connection", "close")], Some(3), PLAIN);
        assert_eq!(text.matches("connection").count(), 1, "{text}");
        assert!(!keep);
        let (text, _, _) = answer(200, &[("date", "then")], Some(0), PLAIN);
        assert_eq!(text.matches("date").count(), 1, "{text}");
    }
}
