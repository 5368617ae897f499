//! The bytes of an HTTP/1.1 exchange with an upstream: the request head as
//! written, the answer head as parsed, and how each body is framed.
//!
//! AnswerFields is where a proxy can be made to disagree with its upstream about
//! where one message ends and the next begins, so every rule here is the
//! strict one:
//!
//! - **Requests** are framed by what the gateway knows of the body, never
//!   by the client's headers: `Content-Length` when its size is known
//!   exactly, `Transfer-Encoding: chunked` otherwise, and neither for no
//!   body. A client's `Content-Length` is replaced, and `Transfer-Encoding`
//!   never passes (it is hop-by-hop, and dropped here again).
//! - **Answers**: no body for a HEAD, a 204 or a 304; `Transfer-Encoding`
//!   whose last coding is chunked is decoded, any other is read to the
//!   close; one valid `Content-Length` (equal repeats allowed); both headers
//!   together, or lengths that disagree, are refused. Informational answers
//!   (1xx) are skipped, except 101: it ends the HTTP on the connection,
//!   so it is taken only when an upgrade was asked for (the head keeps its
//!   `Upgrade`, which says what the connection now speaks), and refused
//!   otherwise.
//! - **Hop-by-hop fields** of an answer (the codec's list, and any a
//!   `Connection` names) belong to this connection and are consumed here:
//!   the answer's head comes out without them.
//! - **Chunked bodies** are decoded by [`codec`](super::super::codec)'s
//!   strict grammar.
//! - **Limits**: those of [`codec`](super::super::codec): an upstream cannot
//!   make the gateway buffer without end.

use bytes::{Buf, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};

use crate::http1::codec::{
    self, is_hop_by_hop, names_headers, strip_hop_by_hop, tokens, BodyFields, ChunkError, Decoder,
    MAX_HEADERS, MAX_HEAD_BYTES,
};

/// What is wrong with an upstream's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("the answer head is malformed")]
    Head,
    #[error("the answer head is larger than {MAX_HEAD_BYTES} bytes or has more than {MAX_HEADERS} fields")]
    HeadTooLarge,
    #[error("the answer switches protocols, which was not asked for")]
    Upgrade,
    #[error("the answer has both Transfer-Encoding and Content-Length")]
    BothFramings,
    #[error("the answer's Content-Length is invalid or ambiguous")]
    Length,
    #[error("the answer is HTTP/1.0 with a Transfer-Encoding, so its framing cannot be trusted")]
    Http10Coding,
    #[error("the answer's Transfer-Encoding has an empty element, so its last coding is unclear")]
    CodingGap,
    #[error("the chunked body is malformed: {0}")]
    Chunk(ChunkError),
}

impl From<ChunkError> for WireError {
    fn from(e: ChunkError) -> Self {
        WireError::Chunk(e)
    }
}

/// How the request's body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestFraming {
    /// No body.
    Empty,
    /// `Content-Length`: exactly this many bytes follow.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

impl RequestFraming {
    /// From what is known of the body: whether it has ended already, and
    /// its exact size if known.
    pub fn of(ended: bool, exact: Option<u64>) -> Self {
        match (ended, exact) {
            (true, _) => RequestFraming::Empty,
            (false, Some(n)) => RequestFraming::Length(n),
            (false, None) => RequestFraming::Chunked,
        }
    }
}

/// Appends the request head to `out`: the request line with the URI's path
/// and query (origin form), every header as the bytes it holds except the
/// framing ones, then this framing's own header.
pub fn encode_head(parts: &http::request::Parts, framing: RequestFraming, out: &mut Vec<u8>) {
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    match parts.uri.path_and_query() {
        Some(pq) if !pq.as_str().is_empty() => out.extend_from_slice(pq.as_str().as_bytes()),
        _ => out.push(b'/'),
    }
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let mut had_length = false;
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH {
            had_length = true;
            continue;
        }
        if name == header::TRANSFER_ENCODING {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        // A client that said "no body" explicitly is still heard saying so.
        RequestFraming::Empty if had_length => out.extend_from_slice(b"content-length: 0\r\n"),
        RequestFraming::Empty => {}
        RequestFraming::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(codec::itoa(n, &mut [0; 20]));
            out.extend_from_slice(b"\r\n");
        }
        RequestFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
}

/// A final answer's head.
#[derive(Debug)]
pub struct AnswerHead {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Decoder,
    /// Whether the connection may carry another exchange after this one
    /// (HTTP/1.1 without `Connection: close`, and a body with its own end).
    pub keep_alive: bool,
}

/// Parses the answer head at the start of `buf`, taking its bytes out.
/// `None`: not all of it has arrived. Informational answers before it are
/// taken out and skipped. `method` is the request's (a HEAD's answer has
/// no body, whatever its headers say).
pub fn parse_head(buf: &mut BytesMut, method: &Method) -> Result<Option<AnswerHead>, WireError> {
    parse_head_asked(buf, method, false)
}

/// [`parse_head`] for a request that asked for an upgrade (`upgrade`):
/// a `101` is then its final answer, without a body, with its `Upgrade`.
pub fn parse_head_asked(
    buf: &mut BytesMut,
    method: &Method,
    upgrade: bool,
) -> Result<Option<AnswerHead>, WireError> {
    loop {
        if buf.is_empty() {
            return Ok(None);
        }
        // Uninitialised: zeroing a hundred fields for an answer that has
        // five cost more than parsing them.
        let mut fields = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
        let mut answer = httparse::Response::new(&mut []);
        let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut answer,
            buf,
            &mut fields,
        );
        let len = match parsed {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
                return Err(WireError::HeadTooLarge)
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => return Err(WireError::HeadTooLarge),
            Err(_) => return Err(WireError::Head),
        };
        if len > MAX_HEAD_BYTES {
            return Err(WireError::HeadTooLarge);
        }
        let code = answer.code.ok_or(WireError::Head)?;
        let status = StatusCode::from_u16(code).map_err(|_| WireError::Head)?;
        let switching = status == StatusCode::SWITCHING_PROTOCOLS;
        if switching && !upgrade {
            return Err(WireError::Upgrade);
        }
        if status.is_informational() && !switching {
            buf.advance(len);
            continue;
        }
        let version = match answer.version {
            Some(1) => Version::HTTP_11,
            Some(0) => Version::HTTP_10,
            _ => return Err(WireError::Head),
        };
        // Where each field lies in the head, so that its value can share
        // the head's bytes once they are taken out of `buf`.
        let base = buf.as_ptr() as usize;
        // Each within the head, whose length is checked above.
        let at = |s: &[u8]| (s.as_ptr() as usize - base) as u16;
        let mut spans = [(0u16, 0u16, 0u16, 0u16); MAX_HEADERS];
        let count = answer.headers.len();
        // The fields that frame the body, read from the bytes as they pass:
        // asking the header map for them afterwards cost more.
        let mut framing = AnswerFields::default();
        for (span, field) in spans.iter_mut().zip(answer.headers.iter()) {
            let (name, value) = (field.name.as_bytes(), field.value);
            *span = (at(name), name.len() as u16, at(value), value.len() as u16);
            framing.field(name, value);
        }
        let head = buf.split_to(len).freeze();
        let mut headers = HeaderMap::with_capacity(count);
        for &(name, name_len, value, value_len) in &spans[..count] {
            let (name, value) = (usize::from(name), usize::from(value));
            let name = &head[name..name + usize::from(name_len)];
            // This connection's own fields end here, unless a `Connection`
            // names others (rare): then the gateway's general rule takes
            // them all out below.
            if !framing.names_headers && is_hop_by_hop(name) {
                continue;
            }
            let name = HeaderName::from_bytes(name).map_err(|_| WireError::Head)?;
            let value = head.slice(value..value + usize::from(value_len));
            let value = HeaderValue::from_maybe_shared(value).map_err(|_| WireError::Head)?;
            headers.append(name, value);
        }
        if framing.names_headers {
            strip_hop_by_hop(&mut headers);
        }
        // A 101 ends the connection's HTTP: no body, and its `Upgrade`
        // (hop-by-hop, taken out above) says what the connection speaks.
        let (body, keep_alive) = if switching {
            put_back_upgrade(&head, &spans[..count], &mut headers)?;
            (Decoder::default(), false)
        } else {
            let body = framing.body(method, status, version)?;
            let keep =
                version == Version::HTTP_11 && !framing.close && !matches!(body, Decoder::ToClose);
            (body, keep)
        };
        return Ok(Some(AnswerHead {
            status,
            version,
            headers,
            body,
            keep_alive,
        }));
    }
}

/// Adds a `101`'s `Upgrade` fields, from the head's bytes at `spans`
/// (name and value offsets and lengths), back to its `headers`.
fn put_back_upgrade(
    head: &bytes::Bytes,
    spans: &[(u16, u16, u16, u16)],
    headers: &mut HeaderMap,
) -> Result<(), WireError> {
    for &(name, name_len, value, value_len) in spans {
        let (name, value) = (usize::from(name), usize::from(value));
        if head[name..name + usize::from(name_len)].eq_ignore_ascii_case(b"upgrade") {
            let value = head.slice(value..value + usize::from(value_len));
            let value = HeaderValue::from_maybe_shared(value).map_err(|_| WireError::Head)?;
            headers.append(header::UPGRADE, value);
        }
    }
    Ok(())
}

/// What an answer head's framing fields say (see the module docs).
#[derive(Default)]
struct AnswerFields {
    /// `Content-Length` and `Transfer-Encoding`.
    body: BodyFields,
    /// `Connection` names `close`.
    close: bool,
    /// `Connection` names other fields, which go with it.
    names_headers: bool,
}

impl AnswerFields {
    /// Takes in one field of the head.
    fn field(&mut self, name: &[u8], value: &[u8]) {
        if self.body.field(name, value) {
            return;
        }
        if name.len() == 10 && name.eq_ignore_ascii_case(b"connection") {
            self.close |= tokens(value).any(|t| t.eq_ignore_ascii_case(b"close"));
            self.names_headers |= names_headers(value);
        }
    }

    /// How the answer's body is framed.
    fn body(
        &self,
        method: &Method,
        status: StatusCode,
        version: Version,
    ) -> Result<Decoder, WireError> {
        if method == Method::HEAD
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            return Ok(Decoder::Length(0));
        }
        // RFC 9112 §6.1: HTTP/1.0 has no transfer codings, so such an
        // answer was likely passed on by something that did not decode
        // them: its framing is faulty.
        if version == Version::HTTP_10 && self.body.chunked.is_some() {
            return Err(WireError::Http10Coding);
        }
        match (self.body.chunked, self.body.length) {
            (Some(_), Some(_)) => Err(WireError::BothFramings),
            (Some(_), None) if self.body.codings_gap => Err(WireError::CodingGap),
            (Some(true), None) => Ok(Decoder::chunked()),
            (Some(false), None) | (None, None) => Ok(Decoder::ToClose),
            (None, Some(length)) => length.map(Decoder::Length).ok_or(WireError::Length),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http1::codec::*;

    fn head(raw: &str, method: &Method) -> Result<Option<AnswerHead>, WireError> {
        parse_head(&mut BytesMut::from(raw), method)
    }

    fn body_of(raw: &str) -> Result<Decoder, WireError> {
        Ok(head(raw, &Method::GET)?.expect("complete").body)
    }

    /// Everything a decoder yields from `input` fed in pieces of `step`
    /// bytes, and how it ended.
    fn decode_all(mut d: Decoder, input: &[u8], step: usize) -> Result<(Vec<u8>, bool), WireError> {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fed = 0;
        loop {
            match d.decode(&mut buf)? {
                Decoded::Data(b) => out.extend_from_slice(&b),
                Decoded::End => return Ok((out, true)),
                Decoded::More if fed == input.len() => return Ok((out, false)),
                Decoded::More => {
                    let n = step.min(input.len() - fed);
                    buf.extend_from_slice(&input[fed..fed + n]);
                    fed += n;
                }
            }
        }
    }

    #[test]
    fn a_request_is_framed_by_its_body_not_by_the_client_headers() {
        let (mut parts, ()) = http::Request::put("/a?b=1")
            .header("host", "up")
            .header("content-length", "999")
            .header("transfer-encoding", "chunked")
            .header("x-fence-token", "7")
            .body(())
            .unwrap()
            .into_parts();
        let mut out = Vec::new();
        encode_head(&parts, RequestFraming::Length(5), &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "PUT /a?b=1 HTTP/1.1\r\nhost: up\r\nx-fence-token: 7\r\ncontent-length: 5\r\n\r\n"
        );
        let mut out = Vec::new();
        encode_head(&parts, RequestFraming::Chunked, &mut out);
        assert!(String::from_utf8(out)
            .unwrap()
            .ends_with("x-fence-token: 7\r\ntransfer-encoding: chunked\r\n\r\n"));
        let mut out = Vec::new();
        encode_head(&parts, RequestFraming::Empty, &mut out);
        assert!(String::from_utf8(out)
            .unwrap()
            .ends_with("x-fence-token: 7\r\ncontent-length: 0\r\n\r\n"));
        parts.headers.remove("content-length");
        parts.method = Method::GET;
        let mut out = Vec::new();
        encode_head(&parts, RequestFraming::Empty, &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET /a?b=1 HTTP/1.1\r\nhost: up\r\nx-fence-token: 7\r\n\r\n"
        );
        let mut out = Vec::new();
        encode_chunk(b"hello, world", &mut out);
        assert_eq!(out, b"C\r\nhello, world\r\n");
        assert_eq!(itoa(0, &mut [0; 20]), b"0");
        assert_eq!(itoa(u64::MAX, &mut [0; 20]), b"18446744073709551615");
    }

    #[test]
    fn answer_heads_are_parsed_after_informational_ones() {
        let raw = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n\
                   HTTP/1.1 201 Created\r\nContent-Length: 2\r\nX-A: 1\r\nx-a: 2\r\n\r\nokHTTP";
        let mut buf = BytesMut::from(raw);
        let h = parse_head(&mut buf, &Method::PUT).unwrap().unwrap();
        assert_eq!(h.status, StatusCode::CREATED);
        assert_eq!(h.version, Version::HTTP_11);
        assert_eq!(h.body, Decoder::Length(2));
        assert!(h.keep_alive);
        let xa: Vec<_> = h.headers.get_all("x-a").iter().collect();
        assert_eq!(xa, ["1", "2"]);
        let raw = "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nKeep-Alive: timeout=5\r\n\
                   X-Hop: 1\r\nUpgrade: h2c\r\nX-Kept: 1\r\nContent-Length: 0\r\n\r\n";
        let h = head(raw, &Method::GET).unwrap().unwrap();
        let mut names: Vec<_> = h.headers.keys().map(|n| n.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            ["content-length", "x-kept"],
            "hop-by-hop fields are consumed"
        );
        assert!(h.keep_alive);
        assert_eq!(&buf[..], b"okHTTP", "only the head is taken");
        assert!(head("HTTP/1.1 200 OK\r\nContent-Le", &Method::GET)
            .unwrap()
            .is_none());
        assert!(head("HTTP/1.1 100 Continue\r\n\r\n", &Method::GET)
            .unwrap()
            .is_none());
    }

    #[test]
    fn answer_framing_is_strict() {
        let both = "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(body_of(both).unwrap_err(), WireError::BothFramings);
        for bad in ["+3", "3 3", "0x3", "", "-1", "99999999999999999999", "3, 4"] {
            let raw = format!("HTTP/1.1 200 OK\r\nContent-Length: {bad}\r\n\r\n");
            assert_eq!(body_of(&raw).unwrap_err(), WireError::Length, "{bad:?}");
        }
        let raw = "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n";
        assert_eq!(body_of(raw).unwrap_err(), WireError::Length);
        let raw = "HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\nContent-Length: 3\r\n\r\n";
        assert_eq!(body_of(raw).unwrap(), Decoder::Length(3));
        let raw = "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n";
        assert_eq!(body_of(raw).unwrap(), Decoder::chunked());
        let raw = "HTTP/1.1 200 OK\r\nTransfer-Encoding:\r\nContent-Length: 3\r\n\r\n";
        assert_eq!(body_of(raw).unwrap_err(), WireError::BothFramings);
        // An empty element: chunked to some readers, not to others.
        for te in [
            "chunked\r\nTransfer-Encoding: ",
            "chunked,",
            "chunked, ,gzip",
        ] {
            let raw = format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: {te}\r\n\r\n");
            assert_eq!(body_of(&raw).unwrap_err(), WireError::CodingGap, "{te}");
        }
        let raw = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n";
        assert_eq!(body_of(raw).unwrap(), Decoder::ToClose);
        // HTTP/1.0 has no codings: such an answer's framing is faulty.
        for te in ["chunked", "gzip"] {
            let raw = format!("HTTP/1.0 200 OK\r\nTransfer-Encoding: {te}\r\n\r\n");
            assert_eq!(body_of(&raw).unwrap_err(), WireError::Http10Coding, "{te}");
        }
        let h = head("HTTP/1.1 200 OK\r\n\r\n", &Method::GET)
            .unwrap()
            .unwrap();
        assert_eq!(h.body, Decoder::ToClose);
        assert!(
            !h.keep_alive,
            "a body read to the close ends the connection"
        );
        let h = head(
            "HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n",
            &Method::HEAD,
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.body, Decoder::Length(0), "a HEAD's answer has no body");
        for status in [204, 304] {
            let raw = format!("HTTP/1.1 {status} X\r\nContent-Length: 9\r\n\r\n");
            assert_eq!(body_of(&raw).unwrap(), Decoder::Length(0));
        }
        let h = head(
            "HTTP/1.1 200 OK\r\nConnection: x, Close\r\nContent-Length: 0\r\n\r\n",
            &Method::GET,
        )
        .unwrap()
        .unwrap();
        assert!(!h.keep_alive);
        let h = head("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", &Method::GET)
            .unwrap()
            .unwrap();
        assert!(!h.keep_alive);
        assert_eq!(
            head("HTTP/1.1 101 Switching Protocols\r\n\r\n", &Method::GET).unwrap_err(),
            WireError::Upgrade
        );
        assert_eq!(
            head("HTTP/1.1 2000 OK\r\n\r\n", &Method::GET).unwrap_err(),
            WireError::Head
        );
        assert_eq!(
            head("HTTP/1.1 200 OK\r\nBad Name: 1\r\n\r\n", &Method::GET).unwrap_err(),
            WireError::Head
        );
    }

    #[test]
    fn answer_heads_are_bounded() {
        let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: 1\r\n")).collect();
        let raw = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
        assert_eq!(
            head(&raw, &Method::GET).unwrap_err(),
            WireError::HeadTooLarge
        );
        let long = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD_BYTES + 1));
        assert_eq!(
            head(&long, &Method::GET).unwrap_err(),
            WireError::HeadTooLarge
        );
    }

    #[test]
    fn bodies_decode_in_any_pieces() {
        let chunked = b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n";
        for step in [1, 2, 3, 7, 100] {
            let d = Decoder::chunked();
            assert_eq!(
                decode_all(d, chunked, step).unwrap(),
                (b"hello, world".to_vec(), true),
                "pieces of {step}"
            );
            let (got, ended) = decode_all(Decoder::Length(5), b"hello", step).unwrap();
            assert_eq!((got.as_slice(), ended), (&b"hello"[..], true));
        }
        let (got, ended) = decode_all(Decoder::ToClose, b"all of it", 4).unwrap();
        assert_eq!((got.as_slice(), ended), (&b"all of it"[..], false));
        // What follows a body is left for whoever reads next.
        let mut buf = BytesMut::from(&b"0\r\n\r\nHTTP/1.1"[..]);
        let mut d = Decoder::chunked();
        assert_eq!(d.decode(&mut buf).unwrap(), Decoded::End);
        assert_eq!(&buf[..], b"HTTP/1.1");
    }

    #[test]
    fn malformed_or_endless_chunks_are_refused() {
        for (bad, why) in [
            (&b"5\r\nhelloXX"[..], ChunkError::DataEnd),
            (b"zz\r\n", ChunkError::Size),
            (b"fffffffffffffffff\r\n", ChunkError::Size),
        ] {
            let d = Decoder::chunked();
            assert_eq!(
                decode_all(d, bad, 100).unwrap_err(),
                WireError::Chunk(why),
                "{bad:?}"
            );
        }
        let mut input = b"1;".to_vec();
        input.extend(std::iter::repeat_n(b'a', MAX_CHUNK_LINE + 1));
        let d = Decoder::chunked();
        assert_eq!(
            decode_all(d, &input, 512).unwrap_err(),
            WireError::Chunk(ChunkError::TooLong)
        );
        let mut trailers = b"0\r\nx: ".to_vec();
        trailers.extend(std::iter::repeat_n(b'a', MAX_TRAILERS + 1));
        let d = Decoder::chunked();
        assert_eq!(
            decode_all(d, &trailers, 4096).unwrap_err(),
            WireError::Chunk(ChunkError::TooLong)
        );
        // Lines that end right at the limit, then more: refused, not a
        // count past it.
        let mut full = b"0\r\n".to_vec();
        let line = format!("x: {}\r\n", "a".repeat(MAX_TRAILERS - 6));
        full.extend_from_slice(line.as_bytes());
        full.extend_from_slice(b"y: 1\r\n\r\n");
        for step in [1, 4096, full.len()] {
            let d = Decoder::chunked();
            assert_eq!(
                decode_all(d, &full, step).unwrap_err(),
                WireError::Chunk(ChunkError::TooLong)
            );
        }
        let mut many = b"0\r\n".to_vec();
        for i in 0..=MAX_TRAILER_FIELDS {
            many.extend_from_slice(format!("x-{i}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        let d = Decoder::chunked();
        assert_eq!(
            decode_all(d, &many, 4096).unwrap_err(),
            WireError::Chunk(ChunkError::TooLong)
        );
    }

    /// A chunked body decoded whole and byte by byte: what each way gives
    /// must be the same, data and ending or error.
    fn chunked(input: &[u8]) -> Result<(Vec<u8>, bool), WireError> {
        let whole = decode_all(Decoder::chunked(), input, input.len().max(1));
        let bytewise = decode_all(Decoder::chunked(), input, 1);
        assert_eq!(whole, bytewise, "{:?}", String::from_utf8_lossy(input));
        whole
    }

    /// Each of `inputs` is refused, for `why`.
    fn all_refused(inputs: &[&[u8]], why: ChunkError) {
        for input in inputs {
            let shown = String::from_utf8_lossy(input);
            match chunked(input) {
                Err(WireError::Chunk(e)) => assert_eq!(e, why, "{shown:?}"),
                other => panic!("{shown:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_chunk_size_line_has_a_hex_digit_and_nothing_but_whitespace_before_extensions() {
        for ok in [
            &b"5\r\nhello\r\n0\r\n\r\n"[..],
            b"005\r\nhello\r\n000\r\n\r\n",
            b"5 \t\r\nhello\r\n0\r\n\r\n",
            b"5 ; a=b\r\nhello\r\n0;last\r\n\r\n",
            b"5;a=\"q \\\" \xff\"\r\nhello\r\n0\r\n\r\n",
            b"5;\tx\r\nhello\r\n0\r\n\r\n",
            b"ffffffffffffffff\r\n",
        ] {
            assert!(chunked(ok).is_ok(), "{:?}", String::from_utf8_lossy(ok));
        }
        // D2: an empty size line is not the last chunk.
        all_refused(&[b"5\r\nhello\r\n\r\n\r\n"], ChunkError::Size);
        all_refused(
            &[
                &b"\r\n"[..],
                b";ext\r\n",
                b" 5\r\n",
                b"5 5\r\n",
                b"0x5\r\n",
                b"+5\r\n",
                b"-5\r\n",
                b"5_\r\n",
                b"10000000000000000\r\n",
            ],
            ChunkError::Size,
        );
    }

    #[test]
    fn chunk_extensions_hold_no_control_characters() {
        all_refused(
            &[
                &b"5;a\x00\r\nhello\r\n0\r\n\r\n"[..],
                b"5;a\x1b[31m\r\nhello\r\n0\r\n\r\n",
                b"5;a\x7f\r\nhello\r\n0\r\n\r\n",
                b"5;\x0b\r\nhello\r\n0\r\n\r\n",
                b"0;\x0c\r\n\r\n",
            ],
            ChunkError::Extension,
        );
    }

    #[test]
    fn bare_cr_or_lf_is_refused_everywhere_in_the_framing() {
        all_refused(
            &[
                // D1: a bare LF ends the size line for some readers, not others.
                &b"2;\nxx\r\n50\r\n0\r\n\r\n"[..],
                b"2\nxx\r\n0\r\n\r\n",
                b"2;a\rb\r\nxx\r\n0\r\n\r\n",
                b"2\rxx\r\n0\r\n\r\n",
                // After a chunk's data.
                b"2\r\nxx\n0\r\n\r\n",
                b"2\r\nxx\r0\r\n\r\n",
                b"2\r\nxx\n\r\n0\r\n\r\n",
                // The last chunk's line.
                b"0\n\r\n",
                b"0\r\r\n\r\n",
                // D3: the trailer section's end, and its lines.
                b"5\r\nhello\r\n0\r\n\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
                b"0\r\n\n",
                b"0\r\nx: 1\n\r\n",
                b"0\r\nx: 1\r\n\n",
                b"0\r\nx: a\rb\r\n\r\n",
                b"0\r\n\rP",
            ],
            ChunkError::LineEnd,
        );
    }

    #[test]
    fn trailers_are_field_lines_under_the_heads_rules_and_dropped() {
        let (body, ended) =
            chunked(b"2\r\nok\r\n0\r\nx-sum: abc\r\nEmpty:\r\nx-t:\t a b \xff\t\r\n\r\nNEXT")
                .unwrap();
        assert_eq!((body.as_slice(), ended), (&b"ok"[..], true));
        all_refused(
            &[
                &b"0\r\nx y: 1\r\n\r\n"[..],
                b"0\r\nx : 1\r\n\r\n",
                b"0\r\n: 1\r\n\r\n",
                b"0\r\nx\r\n\r\n",
                b"0\r\nGET /smuggled HTTP/1.1\r\n\r\n",
                b"0\r\nx: 1\r\n folded\r\n\r\n",
                b"0\r\n\tx: 1\r\n\r\n",
                b"0\r\nx: a\x00b\r\n\r\n",
                b"0\r\nx: a\x7f\r\n\r\n",
                b"0\r\nx\x80: 1\r\n\r\n",
                // Refused before the line ends.
                b"0\r\nGET ",
                b"0\r\nx: \x00",
            ],
            ChunkError::Trailer,
        );
    }
}
