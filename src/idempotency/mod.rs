//! Idempotency-Key on fenced writes (draft-ietf-httpapi-idempotency-key-
//! header): safe retries for writes to upstreams that can check neither
//! tokens nor duplicates.
//!
//! A record is kept per route, method and key, with a fingerprint of the
//! request (method, path and query, `Content-Type`, `X-Fence-Token`, and the
//! body's SHA-256):
//!
//! * **first use**: the record is written durably, in flight, *before* the
//!   request is forwarded; the upstream's answer is stored durably *before*
//!   it is returned;
//! * **replay** of the same key and fingerprint: the stored answer, with
//!   `Idempotent-Replayed: true`; nothing is forwarded and no fence is
//!   checked (the write did happen);
//! * **reuse** with another fingerprint: 422;
//! * **in flight** on any instance: 409 with `Retry-After`;
//! * **outcome unknown** — the request may have reached the upstream but no
//!   answer was stored (502 after sending, 504, an answer over the size
//!   limit, a gateway that crashed or stalled mid-forward): 409, and the
//!   request is never forwarded again while the record lives. A client
//!   should read the resource and decide;
//! * refused before forwarding (400, 409 stale, 413, 428, 503), or nothing
//!   of it sent: no record stays; the key can be used again. A record the
//!   failed first use may have written all the same is forgotten
//!   ([`Forgets`]), and a retry on the same instance takes it back at once.
//!
//! Exactly one of concurrent duplicates is forwarded, on any instance: the
//! in-flight record is written with the store's primary key as the referee.
//! The record's `in_flight_until` is the latest instant its gateway may
//! still store an answer ([`in_flight`]: the forward's deadline plus two
//! store timeouts and a second); a record still in flight after it is
//! unknown, which is how a crashed gateway's write is never forwarded
//! twice. A record never expires before that instant, whatever
//! `idempotency_ttl_s` says, and a gateway that is past it (a stalled
//! process) does not start its forward: a key is never taken over while
//! its first request may still be on its way.
//!
//! The round trips. A first use is checked against memory, then the
//! fence, then its in-flight record is inserted; the insert is the lookup
//! too (a live record of the key makes it find a duplicate, and only then
//! is the record read), so a first use costs no separate read. In shared
//! mode on Postgres the fence decision and the record are one statement
//! (`fencegate_enter_keyed`), so one transaction and one commit; in single
//! mode the record's insert and the answer's update are group-committed
//! with other first uses' (see `store::idempotency` for the interleavings:
//! a crash between statements, a batch that times out and commits later,
//! two instances), and the fence decision is group-committed with other
//! keys' (see `Fence::check_with_record` for what a crash between them leaves:
//! never a second forward). Then the forward, then the answer stored.
//!
//! A write refused before its record was written (a stale token, say) is
//! answered by the key's record if it has one: that is how a replay memory
//! does not know is still served after a newer token was recorded.
//!
//! Replays from memory: a completed record is immutable until it expires,
//! on every instance, so its answer is cached ([`ReplayCache`]) by any
//! instance that stored it or read it once, and replayed without the
//! store until a local lower bound of its expiry. Expired records are
//! purged by [`purge_forever`].

mod cache;
mod forget;

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, Method};
use sha2::{Digest, Sha256};

pub use cache::{
    until as cached_until, Cached, ReplayCache, MAX_BYTES as CACHE_MAX_BYTES,
    MAX_ENTRIES as CACHE_MAX_ENTRIES,
};
pub use forget::Forgets;

use crate::config::IdempotencySettings;
use crate::store::{FenceStore, StoredAnswer};

/// The request header.
pub const IDEMPOTENCY_KEY: header::HeaderName = header::HeaderName::from_static("idempotency-key");
/// Set on a replayed answer.
pub const REPLAYED: header::HeaderName = header::HeaderName::from_static("idempotent-replayed");

/// Why an `Idempotency-Key` header is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdempotencyKeyError {
    #[error("this route requires an Idempotency-Key header on writes")]
    Missing,
    #[error("{0}")]
    Malformed(&'static str),
}

/// The request's idempotency key: `None` when it sends none (and the route
/// does not require one).
pub fn key_of(
    headers: &HeaderMap,
    settings: &IdempotencySettings,
) -> Result<Option<String>, IdempotencyKeyError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return match settings.required {
            true => Err(IdempotencyKeyError::Missing),
            false => Ok(None),
        };
    };
    if values.next().is_some() {
        return Err(IdempotencyKeyError::Malformed("sent more than once"));
    }
    let raw = value.as_bytes();
    let key = if raw.first() == Some(&b'"') {
        // A structured-field string (RFC 8941), without parameters.
        match sfv::Parser::parse_item(raw) {
            Ok(item) if item.params.is_empty() => match item.bare_item {
                sfv::BareItem::String(s) => s.to_string(),
                _ => {
                    return Err(IdempotencyKeyError::Malformed(
                        "is not a structured-field string",
                    ))
                }
            },
            Ok(_) => return Err(IdempotencyKeyError::Malformed("has parameters")),
            Err(_) => {
                return Err(IdempotencyKeyError::Malformed(
                    "is not a valid structured-field string",
                ))
            }
        }
    } else {
        if !raw.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(IdempotencyKeyError::Malformed(
                "must be a quoted string or visible ASCII characters",
            ));
        }
        // Checked: visible ASCII.
        String::from_utf8_lossy(raw).into_owned()
    };
    if key.is_empty() || key.len() > 255 {
        return Err(IdempotencyKeyError::Malformed(
            "must be 1 to 255 characters",
        ));
    }
    Ok(Some(key))
}

/// The fingerprint a reuse of the key is judged by.
pub fn fingerprint(
    method: &Method,
    path_and_query: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> [u8; 32] {
    let mut h = Sha256::new();
    // Length-prefixed parts: no two requests share one byte string.
    let mut part = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    };
    part(method.as_str().as_bytes());
    part(path_and_query.as_bytes());
    for name in [header::CONTENT_TYPE, crate::fencing::token::HEADER] {
        match headers.get(&name) {
            Some(v) => part(v.as_bytes()),
            None => part(b"\\0none"),
        }
    }
    part(&Sha256::digest(body));
    h.finalize().into()
}

/// The status and headers a replay of `stored` answers with: the stored
/// ones, and `Idempotent-Replayed: true`. From the store or from memory,
/// the same.
pub fn replay_head(stored: &StoredAnswer) -> (http::StatusCode, HeaderMap) {
    let status = http::StatusCode::from_u16(stored.status).unwrap_or(http::StatusCode::OK);
    let mut headers = HeaderMap::with_capacity(stored.headers.len() + 1);
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            header::HeaderValue::from_bytes(value),
        ) {
            headers.append(n, v);
        }
    }
    headers.insert(REPLAYED, header::HeaderValue::from_static("true"));
    (status, headers)
}

/// Pause between two purge batches of one round: room for traffic.
const PURGE_PAUSE: Duration = Duration::from_millis(20);

/// Slack in a record's time in flight, for the moments between its steps.
const IN_FLIGHT_SLACK: Duration = Duration::from_secs(1);

/// How long a first use's record stays in flight: the latest its gateway
/// may still store the answer. A store timeout to write the record, the
/// route's `timeout_ms` for the whole exchange (both bodies: the deadline
/// cuts them), a store timeout to store the answer, and a second's slack.
pub fn in_flight(route_timeout: Duration, store_timeout: Duration) -> Duration {
    route_timeout + store_timeout * 2 + IN_FLIGHT_SLACK
}

/// An upstream answer read for storing.
pub enum Buffered {
    /// All of it, within the limit.
    Whole(Bytes),
    /// Over the limit: the part read and the rest, to relay unstored.
    TooLarge(axum::body::Body),
}

/// Reads `body` up to `limit` bytes. `Err` when it broke off (the relay
/// has already treated the exchange as abnormal).
pub async fn buffer(body: axum::body::Body, limit: usize) -> Result<Buffered, ()> {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut read = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ())?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if read.len() + data.len() > limit {
            read.extend_from_slice(&data);
            let head = futures_util::stream::once(async move {
                Ok::<_, axum::Error>(http_body::Frame::data(read.freeze()))
            });
            let rest = futures_util::StreamExt::map(body.into_data_stream(), |r| {
                r.map(http_body::Frame::data)
            });
            let stream = futures_util::StreamExt::chain(head, rest);
            return Ok(Buffered::TooLarge(axum::body::Body::new(
                http_body_util::StreamBody::new(stream),
            )));
        }
        read.extend_from_slice(&data);
    }
    Ok(Buffered::Whole(read.freeze()))
}

/// Purges expired records every `every`, in small batches, until the task
/// is aborted (on shutdown): each statement deletes at most
/// `store::PURGE_BATCH` rows in a transaction of its own, so no purge holds
/// locks long, and a pause between batches leaves room for traffic. A round
/// goes on while batches come back full. Every instance of a shared store
/// runs its own: on Postgres their batches skip each other's locked rows
/// (see `store::idempotency`), so they share the work instead of queueing.
/// A failed batch ends the round; the next one tries again.
pub async fn purge_forever(store: FenceStore, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        loop {
            match store.idem_purge().await {
                Ok(n) if n as i64 >= crate::store::PURGE_BATCH => {
                    tokio::time::sleep(PURGE_PAUSE).await;
                }
                Ok(_) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot purge expired idempotency records; next round");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(required: bool) -> IdempotencySettings {
        IdempotencySettings {
            required,
            ttl: Duration::from_secs(60),
            max_response_bytes: 1024,
        }
    }

    fn with(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, value.parse().unwrap());
        h
    }

    #[test]
    fn keys_are_strings_or_bare_visible_ascii() {
        let s = settings(false);
        assert_eq!(key_of(&with("\"a b\\\"c\""), &s), Ok(Some("a b\"c".into())));
        assert_eq!(
            key_of(&with("order-42:x"), &s),
            Ok(Some("order-42:x".into()))
        );
        assert_eq!(key_of(&HeaderMap::new(), &s), Ok(None));
        assert_eq!(
            key_of(&HeaderMap::new(), &settings(true)),
            Err(IdempotencyKeyError::Missing)
        );
        for bad in ["\"unterminated", "\"\"", "\"x\";a=1", "a b", "\"x\" y"] {
            assert!(
                matches!(
                    key_of(&with(bad), &s),
                    Err(IdempotencyKeyError::Malformed(_))
                ),
                "{bad}"
            );
        }
        assert!(key_of(&with(&"k".repeat(256)), &s).is_err());
        assert!(key_of(&with(&"k".repeat(255)), &s).is_ok());
        let mut twice = with("a");
        twice.append(IDEMPOTENCY_KEY, "b".parse().unwrap());
        assert!(key_of(&twice, &s).is_err());
    }

    #[test]
    fn fingerprints_cover_what_the_draft_names() {
        let body = Bytes::from_static(b"{}");
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        h.insert(crate::fencing::token::HEADER, "7".parse().unwrap());
        let base = fingerprint(&Method::POST, "/a?x=1", &h, &body);
        assert_eq!(base, fingerprint(&Method::POST, "/a?x=1", &h, &body));
        assert_ne!(base, fingerprint(&Method::PUT, "/a?x=1", &h, &body));
        assert_ne!(base, fingerprint(&Method::POST, "/a?x=2", &h, &body));
        assert_ne!(
            base,
            fingerprint(&Method::POST, "/a?x=1", &h, &Bytes::from_static(b"[]"))
        );
        let mut other = h.clone();
        other.insert(crate::fencing::token::HEADER, "8".parse().unwrap());
        assert_ne!(base, fingerprint(&Method::POST, "/a?x=1", &other, &body));
        other.remove(crate::fencing::token::HEADER);
        assert_ne!(base, fingerprint(&Method::POST, "/a?x=1", &other, &body));
    }
}
