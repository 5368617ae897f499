//! gRPC's view of a refusal. A gRPC client reads its status from
//! `grpc-status`, not from the HTTP status, and takes an answer without
//! one as a broken call: so a request with `content-type:
//! application/grpc*` that the gateway refuses is answered the gRPC way,
//! "trailers-only": HTTP 200, `content-type: application/grpc`, the status
//! in the head, and no body (on HTTP/2 the head ends the stream). The
//! problem's name goes along as `fencegate-problem`, so a client can tell
//! a stale token from any other `ABORTED`.

use http::{HeaderMap, HeaderValue, StatusCode};
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};

/// Whether a request is a gRPC call.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The gRPC status code of a refusal with HTTP `status` (the contract's
/// table; gRPC's own HTTP-to-status mapping for the rest).
pub fn code(status: StatusCode) -> u8 {
    match status.as_u16() {
        // ABORTED: gRPC's code for a failed sequencer check.
        409 => 10,
        428 => 9,
        400 | 422 => 3,
        401 => 16,
        403 => 7,
        404 | 405 | 501 => 12,
        413 | 429 | 431 => 8,
        408 | 504 => 4,
        502 | 503 => 14,
        500 => 13,
        _ => 2,
    }
}

/// What gRPC's `grpc-message` may carry as it is: printable ASCII but `%`.
const MESSAGE: &AsciiSet = &CONTROLS.add(b'%');

/// `detail` as a `grpc-message` value (percent-encoded UTF-8).
pub fn message(detail: &str) -> HeaderValue {
    let encoded = utf8_percent_encode(detail, MESSAGE).to_string();
    HeaderValue::from_str(&encoded).unwrap_or_else(|_| HeaderValue::from_static("refused"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_contract_table() {
        for (http, grpc) in [
            (409, 10),
            (428, 9),
            (400, 3),
            (401, 16),
            (403, 7),
            (413, 8),
            (503, 14),
            (502, 14),
            (504, 4),
        ] {
            assert_eq!(code(StatusCode::from_u16(http).unwrap()), grpc, "{http}");
        }
    }

    #[test]
    fn messages_are_percent_encoded_utf8() {
        assert_eq!(message("a 50% token é\n"), "a 50%25 token %C3%A9%0A");
    }

    #[test]
    fn grpc_is_any_application_grpc_type() {
        let mut h = HeaderMap::new();
        assert!(!is_grpc(&h));
        for ct in ["application/grpc", "application/grpc+proto"] {
            h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
            assert!(is_grpc(&h), "{ct}");
        }
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        assert!(!is_grpc(&h));
    }
}
