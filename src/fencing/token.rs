//! Reading the `X-Fence-Token` header.
//!
//! The grammar is deliberately narrow: 1 to 19 ASCII digits whose value fits
//! in an `i64`. No sign, no whitespace, no leading `+`, no hex. Anything looser
//! would let two spellings of one number reach the store, and a lenient parser
//! in front of a strict one is how smuggling bugs start.

use http::{HeaderMap, HeaderName};

/// The header clients put their fencing token in; also part of an
/// Idempotency-Key's fingerprint.
pub const HEADER: HeaderName = HeaderName::from_static("x-fence-token");

/// Why a presented token was refused before it reached the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenError {
    /// No `X-Fence-Token` header at all.
    Missing,
    /// The header is present but is not a valid token; the string says why.
    Malformed(&'static str),
}

/// Parses an integer fencing token.
pub fn parse_integer(raw: &[u8]) -> Result<i64, TokenError> {
    if raw.is_empty() {
        return Err(TokenError::Malformed("the token is empty"));
    }
    if raw.len() > 19 {
        return Err(TokenError::Malformed("the token has more than 19 digits"));
    }
    let mut value: i64 = 0;
    for &b in raw {
        if !b.is_ascii_digit() {
            return Err(TokenError::Malformed(
                "the token must be ASCII digits only (no sign, spaces or other characters)",
            ));
        }
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_add(i64::from(b - b'0')))
            .ok_or(TokenError::Malformed(
                "the token is larger than 9223372036854775807",
            ))?;
    }
    Ok(value)
}

/// The header's raw value (for JWT tokens), refusing duplicates and values
/// that are not visible ASCII.
pub fn raw_from_headers(headers: &HeaderMap) -> Result<&str, TokenError> {
    let mut values = headers.get_all(&HEADER).iter();
    let first = values.next().ok_or(TokenError::Missing)?;
    if values.next().is_some() {
        return Err(TokenError::Malformed(
            "more than one X-Fence-Token header was sent",
        ));
    }
    first
        .to_str()
        .map_err(|_| TokenError::Malformed("the token is not visible ASCII"))
}

/// Reads and parses the token from a request's headers.
///
/// Several `X-Fence-Token` headers are refused rather than picking one: the
/// client and any intermediary could disagree on which one counts.
pub fn from_headers(headers: &HeaderMap) -> Result<i64, TokenError> {
    let mut values = headers.get_all(&HEADER).iter();
    let first = values.next().ok_or(TokenError::Missing)?;
    if values.next().is_some() {
        return Err(TokenError::Malformed(
            "more than one X-Fence-Token header was sent",
        ));
    }
    parse_integer(first.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_digits() {
        assert_eq!(parse_integer(b"0"), Ok(0));
        assert_eq!(parse_integer(b"34"), Ok(34));
        assert_eq!(parse_integer(b"0034"), Ok(34));
        assert_eq!(parse_integer(b"9223372036854775807"), Ok(i64::MAX));
    }

    #[test]
    fn refuses_everything_else() {
        for bad in [
            &b""[..],
            b"-1",
            b"+1",
            b" 1",
            b"1 ",
            b"1.0",
            b"0x10",
            b"1e3",
            b"9223372036854775808",
            b"99999999999999999999",
            b"00000000000000000001",
            "１".as_bytes(),
        ] {
            assert!(parse_integer(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn header_rules() {
        let mut h = HeaderMap::new();
        assert_eq!(from_headers(&h), Err(TokenError::Missing));
        h.append(HEADER, "7".parse().unwrap());
        assert_eq!(from_headers(&h), Ok(7));
        h.append(HEADER, "8".parse().unwrap());
        assert!(matches!(from_headers(&h), Err(TokenError::Malformed(_))));
    }
}
