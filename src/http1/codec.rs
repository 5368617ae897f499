//! What both sides of our HTTP/1.1 share: the limits of a head, the
//! fields that frame a body, the chunked codec, and which fields are
//! hop-by-hop. One definition each, so that the server and the client
//! cannot come to read one message two ways.
//!
//! **Chunked bodies** (requests the server reads, answers the client
//! reads) are decoded by RFC 9112 §7.1's grammar, not by a lenient one: a
//! chunk-size line has at least one hex digit, then optional whitespace,
//! then extensions after `;` holding no control character; every line of
//! the framing ends in CRLF (a bare CR or LF anywhere is refused); the
//! trailer section is field lines under the head's rules (a token name
//! right before its colon, field-value bytes) and limits, and is dropped.
//! Whatever one reader takes for a line end, a chunk boundary or the
//! body's end, another may not: that gap is request smuggling (Go's
//! CVE-2025-22871 is of this class: a bare LF in the chunk framing), so
//! anything off the grammar is refused ([`ChunkError`]) rather than read
//! one way.
//!
//! **Limits**: a head of at most [`MAX_HEAD_BYTES`] and [`MAX_HEADERS`]
//! fields, chunk-size lines and trailers bounded: a peer cannot make the
//! gateway buffer without end.

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName};

/// Most header fields a head may carry, a request's or an answer's
/// (hyper's limit too).
pub const MAX_HEADERS: usize = 100;
/// Longest head accepted, a request's or an answer's. Within `u16`: a
/// field's place in the head is kept as two of them while the head is
/// parsed.
pub const MAX_HEAD_BYTES: usize = u16::MAX as usize;
/// Longest chunk-size line, with its extensions.
pub const MAX_CHUNK_LINE: usize = 4096;
/// Longest trailer section of a chunked body (trailers are dropped), and
/// most field lines in it: a head's limits.
pub const MAX_TRAILERS: usize = 64 * 1024;
pub const MAX_TRAILER_FIELDS: usize = MAX_HEADERS;
/// What is wrong with a chunked body's framing (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("a chunk-size line has no hex digit, a byte that is neither one nor an extension, or a size beyond 64 bits")]
    Size,
    #[error("a chunk extension holds a control character")]
    Extension,
    #[error("a line of the chunk framing ends in a bare CR or LF")]
    LineEnd,
    #[error("a chunk's data is not followed by CRLF")]
    DataEnd,
    #[error("a trailer line is not a valid field line")]
    Trailer,
    #[error("a chunk-size line or the trailer section is longer than its limit")]
    TooLong,
}
/// `n` in decimal, written into the end of `buf`.
pub fn itoa(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// Appends one chunk of a chunked body (`data` must not be empty: an empty
/// chunk ends the body).
pub fn encode_chunk(data: &[u8], out: &mut Vec<u8>) {
    use std::io::Write;
    // Writing to a Vec cannot fail.
    let _ = write!(out, "{:X}\r\n", data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The end of a chunked body, without trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";
/// The fields that frame a message's body, read from a head's bytes as
/// they pass, by one rule for answers (the client's) and requests (the server's): asking a header map for them afterwards costs more.
#[derive(Debug, Default, Clone, Copy)]
pub struct BodyFields {
    /// `Content-Length`: `Some(Some(n))` for one valid length however
    /// often repeated, `Some(None)` for an invalid or ambiguous one.
    pub length: Option<Option<u64>>,
    /// A `Content-Length` field holds a list (`5, 5`), which a request may
    /// not (see the server's `request`).
    pub length_listed: bool,
    /// `Transfer-Encoding`: whether its last coding, over all its fields,
    /// is chunked.
    pub chunked: Option<bool>,
    /// How many codings `Transfer-Encoding` lists over all its fields
    /// (empty list elements aside), up to 255: a request may have only
    /// `chunked`, once.
    pub codings: u8,
    /// `Transfer-Encoding` has an empty list element (`chunked,`, or an
    /// empty field): readers disagree on which coding is the last (RFC
    /// 9110 §5.6.1 has them ignored; hyper takes the empty one).
    pub codings_gap: bool,
}

impl BodyFields {
    /// Takes in one field of a head; false if it is not a framing field.
    pub fn field(&mut self, name: &[u8], value: &[u8]) -> bool {
        match name.len() {
            14 if name.eq_ignore_ascii_case(b"content-length") => {
                self.length_listed |= value.contains(&b',');
                for part in tokens(value) {
                    self.length = Some(match (self.length, parse_length(part)) {
                        (Some(None), _) | (_, None) => None,
                        (Some(Some(l)), Some(n)) if l != n => None,
                        (_, Some(n)) => Some(n),
                    });
                }
                true
            }
            17 if name.eq_ignore_ascii_case(b"transfer-encoding") => {
                // Present, even empty, is present: never framed by a length.
                let listed = tokens(value).filter(|c| !c.is_empty()).count();
                self.codings_gap |= tokens(value).any(<[u8]>::is_empty);
                self.codings = self.codings.saturating_add(listed.min(255) as u8);
                match tokens(value).rfind(|c| !c.is_empty()) {
                    Some(last) => self.chunked = Some(last.eq_ignore_ascii_case(b"chunked")),
                    None => _ = self.chunked.get_or_insert(false),
                }
                true
            }
            _ => false,
        }
    }
}

/// A field value's comma-separated tokens, trimmed.
pub fn tokens(value: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    value.split(|&b| b == b',').map(<[u8]>::trim_ascii)
}

/// One `Content-Length` value: digits only (no sign, no spaces inside), at
/// most 19 of them.
pub fn parse_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        digits
            .iter()
            .fold(0u64, |n, d| n * 10 + u64::from(d - b'0')),
    )
}

/// Where the reading of a body is, a request's or an answer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Decoder {
    /// This many bytes are still to come.
    Length(u64),
    Chunked(Chunk),
    /// Everything until the upstream closes the connection.
    ToClose,
    /// The body has ended.
    #[default]
    Ended,
}

/// Where a chunked body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Before a chunk-size line, or inside one (what of it is checked).
    Size(SizeLine),
    /// Inside a chunk's data: this many bytes are still to come.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk: trailer lines (dropped).
    Trailers(TrailerLines),
}

/// What of a chunk-size line that has not all arrived is checked, so that
/// a line coming a byte at a time is not read again from its start each
/// time (a client could make that cost a thousandfold its bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeLine {
    /// Bytes of the line checked.
    checked: usize,
    size: u64,
    /// 0: in the digits, 1: in whitespace after them, 2: in the
    /// extensions.
    part: u8,
    /// A hex digit has come.
    digits: bool,
}

impl SizeLine {
    const START: SizeLine = SizeLine {
        checked: 0,
        size: 0,
        part: 0,
        digits: false,
    };
}

/// The trailer section so far: its bytes and field lines, and what of a
/// line that has not all arrived is checked (as [`SizeLine`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrailerLines {
    bytes: usize,
    fields: usize,
    checked: usize,
    /// The line's colon has not come yet.
    in_name: bool,
}

/// What [`Decoder::decode`] found in the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    Data(Bytes),
    /// More bytes must be read first.
    More,
    /// The body has ended.
    End,
}

impl Decoder {
    /// A chunked body, from its start.
    pub const fn chunked() -> Decoder {
        Decoder::Chunked(Chunk::Size(SizeLine::START))
    }

    /// Takes the next piece of the body out of `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, ChunkError> {
        loop {
            match self {
                Decoder::Ended | Decoder::Length(0) => {
                    *self = Decoder::Ended;
                    return Ok(Decoded::End);
                }
                Decoder::Length(left) => return Ok(take(buf, left)),
                Decoder::ToClose if buf.is_empty() => return Ok(Decoded::More),
                Decoder::ToClose => return Ok(Decoded::Data(buf.split().freeze())),
                Decoder::Chunked(Chunk::Size(line)) => {
                    let Some((used, size)) = size_line(buf, line)? else {
                        return Ok(Decoded::More);
                    };
                    buf.advance(used);
                    *self = Decoder::Chunked(match size {
                        0 => Chunk::Trailers(TrailerLines {
                            bytes: 0,
                            fields: 0,
                            checked: 0,
                            in_name: true,
                        }),
                        n => Chunk::Data(n),
                    });
                }
                Decoder::Chunked(Chunk::Data(left)) => {
                    let piece = take(buf, left);
                    if *left == 0 {
                        *self = Decoder::Chunked(Chunk::DataEnd);
                    }
                    return Ok(piece);
                }
                Decoder::Chunked(Chunk::DataEnd) => {
                    match (buf.first(), buf.get(1)) {
                        (None, _) | (Some(b'\r'), None) => return Ok(Decoded::More),
                        (Some(b'\r'), Some(b'\n')) => {}
                        (Some(b'\n' | b'\r'), _) => return Err(ChunkError::LineEnd),
                        _ => return Err(ChunkError::DataEnd),
                    }
                    buf.advance(2);
                    *self = Decoder::chunked();
                }
                Decoder::Chunked(Chunk::Trailers(section)) => {
                    let Some(line) = trailer_line(buf, section)? else {
                        return Ok(Decoded::More);
                    };
                    buf.advance(line);
                    if line == 2 {
                        *self = Decoder::Ended;
                        return Ok(Decoded::End);
                    }
                    section.bytes += line;
                    section.fields += 1;
                    section.checked = 0;
                    section.in_name = true;
                    if section.fields > MAX_TRAILER_FIELDS {
                        return Err(ChunkError::TooLong);
                    }
                }
            }
        }
    }

    /// Whether the body has been read to its end.
    pub fn ended(&self) -> bool {
        matches!(self, Decoder::Ended | Decoder::Length(0))
    }

    /// What is known of the rest of the body's length.
    pub fn size_hint(&self) -> http_body::SizeHint {
        match self {
            Decoder::Length(n) => http_body::SizeHint::with_exact(*n),
            Decoder::Ended => http_body::SizeHint::with_exact(0),
            _ => http_body::SizeHint::default(),
        }
    }
}

/// The chunk-size line at the start of `buf`: its length with its CRLF,
/// and the size. `None`: the line has not all arrived, and what has is
/// valid so far (a wrong byte is refused as soon as it is in).
///
/// `chunk = chunk-size [ chunk-ext ] CRLF` (RFC 9112 §7.1): at least one
/// hex digit, then whitespace only before a `;`, then extensions of any
/// bytes but controls (HTAB aside). The extensions are ignored, so their
/// inner grammar is not checked; a control character, a bare CR or LF
/// among them is what readers disagree about. `line` is what an earlier
/// call checked of it, and is kept up to date.
fn size_line(buf: &[u8], line: &mut SizeLine) -> Result<Option<(usize, u64)>, ChunkError> {
    for (i, &b) in buf.iter().enumerate().skip(line.checked) {
        if i >= MAX_CHUNK_LINE {
            return Err(ChunkError::TooLong);
        }
        match (line.part, b) {
            (_, b'\r') => {
                if !line.digits {
                    return Err(ChunkError::Size);
                }
                // Checked up to the CR: it is looked at again with the
                // byte after it.
                line.checked = i;
                return match buf.get(i + 1) {
                    None => Ok(None),
                    Some(b'\n') => Ok(Some((i + 2, line.size))),
                    Some(_) => Err(ChunkError::LineEnd),
                };
            }
            (_, b'\n') => return Err(ChunkError::LineEnd),
            (0, b) if b.is_ascii_hexdigit() => {
                let digit = (b as char).to_digit(16).unwrap_or(0);
                line.size = line
                    .size
                    .checked_mul(16)
                    .and_then(|s| s.checked_add(u64::from(digit)))
                    .ok_or(ChunkError::Size)?;
                line.digits = true;
            }
            (0 | 1, b' ' | b'\t') if line.digits => line.part = 1,
            (0 | 1, b';') if line.digits => line.part = 2,
            (0 | 1, _) => return Err(ChunkError::Size),
            (_, b) if is_ctl(b) => return Err(ChunkError::Extension),
            _ => {}
        }
    }
    line.checked = buf.len();
    if buf.len() > MAX_CHUNK_LINE {
        return Err(ChunkError::TooLong);
    }
    Ok(None)
}

/// A control character as a field value or chunk extension must not hold
/// one: below 0x20 but HTAB, and DEL.
fn is_ctl(b: u8) -> bool {
    (b < 0x20 && b != b'\t') || b == 0x7f
}

/// The trailer line at the start of `buf`: its length with its CRLF (2:
/// the empty line that ends the section). `None`: not all of it has
/// arrived, and what has is valid so far (a wrong byte is refused as soon
/// as it is in, as in [`size_line`]).
///
/// A trailer line is a field line as in a head (RFC 9112 §7.1.2, §5): a
/// token, the colon right after it, a value of field-value bytes (no
/// controls but HTAB); no obs-fold (a line that begins with whitespace has
/// no token).
fn trailer_line(buf: &[u8], section: &mut TrailerLines) -> Result<Option<usize>, ChunkError> {
    // A line may end one byte past the limit (its LF).
    let room = MAX_TRAILERS.saturating_sub(section.bytes);
    for (i, &b) in buf.iter().enumerate().skip(section.checked) {
        if i >= room {
            return Err(ChunkError::TooLong);
        }
        match b {
            b'\r' => {
                // Checked up to the CR, as in `size_line`.
                section.checked = i;
                return match buf.get(i + 1) {
                    None => Ok(None),
                    Some(b'\n') if i == 0 => Ok(Some(2)),
                    Some(b'\n') if section.in_name => Err(ChunkError::Trailer),
                    Some(b'\n') => Ok(Some(i + 2)),
                    Some(_) => Err(ChunkError::LineEnd),
                };
            }
            b'\n' => return Err(ChunkError::LineEnd),
            b':' if section.in_name && i > 0 => section.in_name = false,
            b if section.in_name && is_tchar(b) => {}
            b if !section.in_name && !is_ctl(b) => {}
            _ => return Err(ChunkError::Trailer),
        }
    }
    section.checked = buf.len();
    if buf.len() >= room {
        return Err(ChunkError::TooLong);
    }
    Ok(None)
}

/// A byte of a token (RFC 9110 §5.6.2).
pub fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Up to `left` bytes from `buf`, counted off `left`.
fn take(buf: &mut BytesMut, left: &mut u64) -> Decoded {
    if buf.is_empty() {
        return Decoded::More;
    }
    let n = usize::try_from(*left).map_or(buf.len(), |l| l.min(buf.len()));
    *left -= n as u64;
    Decoded::Data(buf.split_to(n).freeze())
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus `Proxy-Connection`, which old
/// clients still send. `Expect` is answered by our own server side. Typed
/// names: a `&str` name would be parsed again on every lookup.
pub const HOP_BY_HOP: [HeaderName; HOP_BY_HOP_NAMES] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::EXPECT,
];

/// How many names [`HOP_BY_HOP`] holds: `strip_hop_by_hop` marks those it
/// finds in a message as bits of a u16.
const HOP_BY_HOP_NAMES: usize = 10;
const _: () = assert!(HOP_BY_HOP_NAMES <= 16);

/// Whether a header of this name (as sent, in any case) is hop-by-hop
/// itself (not counting those a `Connection` header names).
pub fn is_hop_by_hop(name: &[u8]) -> bool {
    HOP_BY_HOP
        .iter()
        .any(|h| h.as_str().as_bytes().eq_ignore_ascii_case(name))
}

/// Whether a `Connection` header's value names any header besides the
/// usual `keep-alive` and `close` (which name none that is not hop-by-hop
/// already).
pub fn names_headers(connection: &[u8]) -> bool {
    connection
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .any(|t| {
            !t.is_empty()
                && !t.eq_ignore_ascii_case(b"keep-alive")
                && !t.eq_ignore_ascii_case(b"close")
        })
}

/// The tokens of every `Connection` header of a message, in order, trimmed,
/// empty ones skipped (`Connection: a,,b` and two `Connection` headers are
/// one list, RFC 9110 §5.3).
pub fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether a header's name has `_` (see [`upstream_request`]).
pub fn is_underscored(name: &HeaderName) -> bool {
    name.as_str().as_bytes().contains(&b'_')
}

/// Removes hop-by-hop headers, including every header `Connection` names.
///
/// On a request, `Connection` never names a header the gateway relies on
/// (the token, the idempotency key, the credentials, a key part): such a
/// request was refused before it got here (`gateway::check_headers`), so
/// what is forwarded is what was checked.
///
/// One pass over the message's few names finds which hop-by-hop ones it
/// carries (usually none in a request, and only `Connection: keep-alive`
/// in an answer), and only those are removed: a removal is a hashed lookup,
/// and doing one per hop-by-hop name cost more than the rest of the header
/// rewriting together.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip(headers, false)
}

/// [`strip_hop_by_hop`], and the names with `_` too, found in the same
/// pass.
pub fn strip_hop_by_hop_and_underscored(headers: &mut HeaderMap) {
    strip(headers, true)
}

fn strip(headers: &mut HeaderMap, underscored: bool) {
    let mut present = 0u16;
    let mut odd = false;
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            present |= 1 << i;
        }
        odd |= underscored && is_underscored(name);
    }
    if odd {
        let names: Vec<HeaderName> = headers
            .keys()
            .filter(|n| is_underscored(n))
            .cloned()
            .collect();
        for name in names {
            headers.remove(name);
        }
    }
    if present == 0 {
        return;
    }
    // Headers named by `Connection` (present only with it: it is one of
    // them). Its usual tokens need no lookup: `close` names no header, and
    // `keep-alive`'s header is one of them already.
    let named: Vec<HeaderName> = connection_tokens(headers)
        .filter(|t| !t.eq_ignore_ascii_case(b"keep-alive") && !t.eq_ignore_ascii_case(b"close"))
        .filter_map(|t| HeaderName::from_bytes(t).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "close, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("x-fence-token", "7".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["x-fence-token"], "7");
    }

    /// Every hop-by-hop header goes, whichever of them a message carries
    /// and in whatever case it was sent; a message without one is left as
    /// it is.
    #[test]
    fn strips_each_hop_by_hop_header_alone_and_all_together() {
        for name in &HOP_BY_HOP {
            let mut h = HeaderMap::new();
            h.insert(name.clone(), "x".parse().unwrap());
            h.insert("x-fence-token", "7".parse().unwrap());
            strip_hop_by_hop(&mut h);
            assert_eq!(h.len(), 1, "{name} stayed");
        }
        let mut h = HeaderMap::new();
        for name in &HOP_BY_HOP {
            h.append(name.clone(), "x".parse().unwrap());
            h.append(name.clone(), "y".parse().unwrap());
        }
        h.insert(
            header::CONNECTION,
            "Keep-Alive, Upgrade, X-Named".parse().unwrap(),
        );
        h.insert("x-named", "1".parse().unwrap());
        h.insert("x-fence-token", "7".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().collect::<Vec<_>>(), ["x-fence-token"]);
        let mut h = HeaderMap::new();
        h.insert("x-fence-token", "7".parse().unwrap());
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }
}
