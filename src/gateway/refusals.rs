//! The most recent refusals that say something about a holder or a client,
//! kept in memory for the dashboard: a stale token (a holder fenced off), a
//! token the lock API never issued, a JWT for another resource, and a path
//! or key spelled ambiguously. Metrics count these; at 3 a.m. the first
//! question is which key, which tokens, and when, and that is what an entry
//! says.
//!
//! Bounded: the last [`CAPACITY`] entries, older ones dropped. A request
//! that is not such a refusal costs one `match` on its error; a refusal
//! costs its entry (a few small strings) and a short lock.

use std::collections::VecDeque;
use std::sync::Mutex;

use chrono::{DateTime, Utc};

use crate::gateway::error::{ClientError, GatewayError};
use crate::metrics::Outcome;

/// How many refusals are kept.
pub const CAPACITY: usize = 200;

/// One refusal, as the admin listener's `GET /refusals` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Refusal {
    /// Rises by one per refusal recorded by this process, from 1.
    pub seq: u64,
    pub at: DateTime<Utc>,
    /// The decision outcome (the `outcome` label of
    /// `fencegate_decisions_total`): `stale`, `unissued`, `wrong_subject`,
    /// `ambiguous_path` or `ambiguous_key`.
    pub outcome: &'static str,
    /// The answer's status code.
    pub status: u16,
    /// `None` for a write no route matched (an ambiguous path).
    pub route: Option<String>,
    pub method: String,
    /// The path as sent, without its query; only for ambiguous paths (a
    /// key was never made from it).
    pub path: Option<String>,
    pub resource_key: Option<String>,
    pub presented_token: Option<i64>,
    /// Stale: the highest token recorded for the key.
    pub highest_token: Option<i64>,
    /// Unissued: the highest fence the lock API granted.
    pub highest_issued: Option<i64>,
    /// Why, in words (the problem document's reason, shortened).
    pub detail: String,
}

/// The ring of recent refusals, shared by every worker and the admin
/// listener.
#[derive(Default)]
pub struct Refusals {
    ring: Mutex<Ring>,
}

#[derive(Default)]
struct Ring {
    /// The last `seq` handed out.
    last: u64,
    /// Oldest first.
    entries: VecDeque<Refusal>,
}

/// A stale or unissued token's reason is all in its entry's other fields:
/// it is put into words here, when the entry is shown, rather than at
/// every refusal (refusals come at the rate of the load, reads at a
/// dashboard's).
fn shown(kept: &Refusal) -> Refusal {
    let mut r = kept.clone();
    let (Some(key), Some(presented)) = (&r.resource_key, r.presented_token) else {
        return r;
    };
    let key = key.clone();
    let why = match (r.outcome, r.highest_token, r.highest_issued) {
        (STALE, Some(highest), _) => ClientError::StaleToken {
            key,
            presented,
            highest,
        },
        (UNISSUED, _, Some(highest_issued)) => ClientError::UnissuedToken {
            key,
            presented,
            highest_issued,
        },
        _ => return r,
    };
    r.detail = truncate(why.to_string());
    r
}

/// The outcomes whose reason [`shown`] puts into words.
const STALE: &str = Outcome::Stale.as_str();
const UNISSUED: &str = Outcome::Unissued.as_str();

/// A page of [`Refusals::recent`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct Recent {
    /// Newest first.
    pub refusals: Vec<Refusal>,
    /// The highest `seq` so far (0: none yet). A client polling with
    /// `after` that sees this go below its own has met a restarted process.
    pub last_seq: u64,
    pub capacity: usize,
}

/// Where a refused request came in, for its entry.
pub struct Seen<'a> {
    pub route: Option<&'a str>,
    pub method: &'a http::Method,
    pub path: &'a str,
}

impl Refusals {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `error` if it is one of the kinds kept; every other error
    /// returns at once.
    pub fn note(&self, seen: Seen<'_>, error: &GatewayError) {
        use ClientError as C;
        let GatewayError::Client(c) = error else {
            return;
        };
        // A path or key spelled ambiguously: no key was made; the path is
        // what the entry shows.
        let ambiguous = |o: Outcome| (o.as_str(), None, None, None, None, Some(seen.path));
        let (outcome, key, presented, highest, issued, path) = match c {
            C::StaleToken {
                key,
                presented,
                highest,
            } => (
                STALE,
                Some(key),
                Some(*presented),
                Some(*highest),
                None,
                None,
            ),
            C::UnissuedToken {
                key,
                presented,
                highest_issued,
            } => (
                UNISSUED,
                Some(key),
                Some(*presented),
                None,
                Some(*highest_issued),
                None,
            ),
            C::JwtForOtherKey { expected, .. } => (
                Outcome::WrongSubject.as_str(),
                Some(expected),
                None,
                None,
                None,
                None,
            ),
            C::AmbiguousPath(_) => ambiguous(Outcome::AmbiguousPath),
            C::AmbiguousKey(_) => ambiguous(Outcome::AmbiguousKey),
            _ => return,
        };
        let entry = Refusal {
            seq: 0,
            at: Utc::now(),
            outcome,
            status: error.status().as_u16(),
            route: seen.route.map(str::to_string),
            method: seen.method.as_str().to_owned(),
            path: path.map(str::to_string),
            resource_key: key.cloned(),
            presented_token: presented,
            highest_token: highest,
            highest_issued: issued,
            // Put into words when shown (see `shown`).
            detail: if matches!(outcome, STALE | UNISSUED) {
                String::new()
            } else {
                truncate(c.to_string())
            },
        };
        self.push(entry);
    }

    fn push(&self, mut entry: Refusal) {
        // A poisoned lock only means a panic elsewhere mid-push; the ring
        // is still a valid ring.
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.last += 1;
        entry.seq = ring.last;
        if ring.entries.len() == CAPACITY {
            ring.entries.pop_front();
        }
        ring.entries.push_back(entry);
    }

    /// Up to `limit` refusals with a `seq` above `after`, newest first.
    pub fn recent(&self, after: u64, limit: usize) -> Recent {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        Recent {
            refusals: ring
                .entries
                .iter()
                .rev()
                .take_while(|r| r.seq > after)
                .take(limit)
                .map(shown)
                .collect(),
            last_seq: ring.last,
            capacity: CAPACITY,
        }
    }
}

/// Longest `detail` kept; a refusal's reason is one sentence.
const MAX_DETAIL: usize = 300;

fn truncate(mut s: String) -> String {
    if s.len() > MAX_DETAIL {
        let mut end = MAX_DETAIL;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stale(presented: i64) -> GatewayError {
        ClientError::StaleToken {
            key: "doc:a".into(),
            presented,
            highest: 9,
        }
        .into()
    }

    fn seen() -> Seen<'static> {
        Seen {
            route: Some("docs"),
            method: &http::Method::PUT,
            path: "/docs/a",
        }
    }

    #[test]
    fn keeps_the_last_capacity_newest_first() {
        let r = Refusals::new();
        for t in 0..(CAPACITY as i64 + 5) {
            r.note(seen(), &stale(t));
        }
        let page = r.recent(0, usize::MAX);
        assert_eq!(page.refusals.len(), CAPACITY);
        assert_eq!(page.last_seq, CAPACITY as u64 + 5);
        assert_eq!(page.refusals[0].presented_token, Some(CAPACITY as i64 + 4));
        assert_eq!(page.refusals[0].highest_token, Some(9));
        assert_eq!(page.refusals[0].status, 409);
        let newer = r.recent(page.last_seq - 2, 10);
        assert_eq!(
            newer.refusals.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [page.last_seq, page.last_seq - 1]
        );
    }

    #[test]
    fn a_reason_put_into_words_when_shown_is_the_refusals_own() {
        let r = Refusals::new();
        let errors = [
            stale(3),
            ClientError::UnissuedToken {
                key: "doc:b".into(),
                presented: 12,
                highest_issued: 11,
            }
            .into(),
            ClientError::JwtForOtherKey {
                expected: "doc:c".into(),
                presented: "doc:d".into(),
            }
            .into(),
        ];
        for e in &errors {
            r.note(seen(), e);
        }
        let shown = r.recent(0, 10).refusals;
        let details: Vec<_> = shown.iter().rev().map(|e| e.detail.clone()).collect();
        let expected: Vec<_> = errors
            .iter()
            .map(|e| match e {
                GatewayError::Client(c) => c.to_string(),
                _ => unreachable!("only client errors above"),
            })
            .collect();
        assert_eq!(details, expected);
        assert_eq!(shown[2].method, "PUT");
    }

    #[test]
    fn other_errors_are_not_kept() {
        let r = Refusals::new();
        r.note(seen(), &ClientError::MalformedToken("x").into());
        r.note(seen(), &GatewayError::Internal("x"));
        assert_eq!(r.recent(0, 10).last_seq, 0);
    }

    #[test]
    fn an_ambiguous_path_keeps_its_path() {
        let r = Refusals::new();
        r.note(
            Seen {
                route: None,
                method: &http::Method::POST,
                path: "/docs/a;b",
            },
            &ClientError::AmbiguousPath("has a ';'").into(),
        );
        let e = &r.recent(0, 1).refusals[0];
        assert_eq!(
            (e.outcome, e.path.as_deref(), e.status),
            ("ambiguous_path", Some("/docs/a;b"), 400)
        );
        assert!(e.resource_key.is_none());
    }
}
