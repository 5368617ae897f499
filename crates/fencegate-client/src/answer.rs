//! An answer as received, and the mapping of refusals (problem documents) to
//! [`Error`]s.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::{header, HeaderMap, HeaderValue, StatusCode};
use serde_json::Value;

use crate::problem;
use crate::Error;

/// Largest answer body read; lock API answers are a few hundred bytes.
pub(crate) const MAX_ANSWER: usize = 64 * 1024;
/// How much of an unexpected answer body is kept in [`Error::Unexpected`].
const MAX_ERROR_BODY: usize = 2048;

/// An answer as received.
pub struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl fmt::Debug for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The body may hold a lease id.
        f.debug_struct("Answer")
            .field("status", &self.status)
            .field("body_bytes", &self.body.len())
            .finish()
    }
}

impl Answer {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The body (at most 64 KiB are read).
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    pub(crate) fn parse<T: serde::de::DeserializeOwned>(self, what: &str) -> Result<T, Error> {
        // The error names the place and the expectation; the body (which may
        // hold the lease id) is not repeated.
        serde_json::from_slice(&self.body).map_err(|e| Error::Unexpected {
            status: self.status.as_u16(),
            body: format!("the {what} in the answer is not usable: {e}"),
        })
    }

    /// Maps a non-success answer to an error, reading problem+json bodies.
    pub fn into_error(self) -> Error {
        let doc: Option<Value> = serde_json::from_slice(&self.body).ok();
        let get = |k: &str| doc.as_ref().and_then(|p| p.get(k));
        let kind = get("type").and_then(Value::as_str).unwrap_or_default();
        let detail = get("detail").and_then(Value::as_str);
        match self.status {
            StatusCode::CONFLICT if kind.ends_with(problem::LOCK_HELD) => Error::Held {
                expires_in: get(problem::EXPIRES_IN_MS)
                    .and_then(Value::as_u64)
                    .map(Duration::from_millis),
            },
            StatusCode::CONFLICT if kind.ends_with(problem::NOT_HOLDER) => Error::NotHolder,
            StatusCode::SERVICE_UNAVAILABLE => Error::Unavailable {
                retry_after: self
                    .headers
                    .get(header::RETRY_AFTER)
                    .and_then(parse_retry_after),
            },
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Error::Denied {
                status: self.status.as_u16(),
                detail: detail
                    .map(str::to_string)
                    .unwrap_or_else(|| shorten(&self.body)),
            },
            StatusCode::BAD_REQUEST => Error::BadRequest {
                field: get(problem::FIELD)
                    .and_then(Value::as_str)
                    .map(str::to_string),
                detail: detail
                    .map(str::to_string)
                    .unwrap_or_else(|| shorten(&self.body)),
            },
            status => Error::Unexpected {
                status: status.as_u16(),
                body: detail
                    .map(str::to_string)
                    .unwrap_or_else(|| shorten(&self.body)),
            },
        }
    }
}

/// `Retry-After` as delay-seconds or an HTTP-date.
fn parse_retry_after(v: &HeaderValue) -> Option<Duration> {
    let s = v.to_str().ok()?.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = DateTime::parse_from_rfc2822(s).ok()?.with_timezone(&Utc);
    Some((at - Utc::now()).to_std().unwrap_or(Duration::ZERO))
}

/// A body as text, cut to [`MAX_ERROR_BODY`] bytes on a char boundary.
fn shorten(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    if text.len() <= MAX_ERROR_BODY {
        return text.into_owned();
    }
    let mut end = MAX_ERROR_BODY;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn answer(status: u16, headers: &[(&str, &str)], body: Value) -> Answer {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(
                header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        Answer {
            status: StatusCode::from_u16(status).unwrap(),
            headers: map,
            body: Bytes::from(body.to_string()),
        }
    }

    #[test]
    fn problems_map_to_errors() {
        let e = answer(
            409,
            &[],
            json!({"type": "urn:fencegate:problem:lock-held", "expires_in_ms": 1200}),
        )
        .into_error();
        assert!(
            matches!(e, Error::Held { expires_in: Some(d) } if d == Duration::from_millis(1200))
        );
        let e = answer(
            409,
            &[],
            json!({"type": "urn:fencegate:problem:not-holder"}),
        )
        .into_error();
        assert!(matches!(e, Error::NotHolder));
        let e = answer(503, &[("retry-after", "3")], json!({})).into_error();
        assert!(
            matches!(e, Error::Unavailable { retry_after: Some(d) } if d == Duration::from_secs(3))
        );
        let e = answer(
            400,
            &[],
            json!({"type": "urn:fencegate:problem:bad-lock-request", "field": "ttl_ms", "detail": "ttl_ms: too big"}),
        )
        .into_error();
        assert!(
            matches!(&e, Error::BadRequest { field: Some(f), detail } if f == "ttl_ms" && detail == "ttl_ms: too big")
        );
        let e = answer(409, &[], json!({"type": "other"})).into_error();
        assert!(matches!(e, Error::Unexpected { status: 409, .. }));
        let e = answer(502, &[], json!("bad gateway")).into_error();
        assert!(e.is_transient());
    }

    #[test]
    fn denials_keep_the_detail() {
        let e = answer(
            401,
            &[],
            json!({"type": "urn:fencegate:problem:unauthenticated", "detail": "no key"}),
        )
        .into_error();
        assert!(matches!(&e, Error::Denied { status: 401, detail } if detail == "no key"));
        assert!(!e.is_transient());
        assert_eq!(e.to_string(), "not authenticated by the gateway: no key");
    }

    #[test]
    fn long_bodies_are_shortened_on_a_char_boundary() {
        let body = "é".repeat(MAX_ERROR_BODY);
        let short = shorten(body.as_bytes());
        assert!(short.ends_with("..."));
        assert!(short.len() <= MAX_ERROR_BODY + 3);
        assert_eq!(shorten(b"short"), "short");
    }

    #[test]
    fn retry_after_as_date() {
        let later = (Utc::now() + chrono::Duration::seconds(60)).to_rfc2822();
        let d = parse_retry_after(&HeaderValue::from_str(&later).unwrap()).unwrap();
        assert!(d > Duration::from_secs(50) && d <= Duration::from_secs(60));
        assert_eq!(
            parse_retry_after(&HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT")),
            Some(Duration::ZERO)
        );
    }
}
