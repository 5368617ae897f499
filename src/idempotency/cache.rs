//! Completed records' answers in memory, so that a replay costs no store
//! read.
//!
//! Why memory may answer for the store: a completed record is immutable
//! until it expires, on every instance. Nothing changes a `done` record:
//! storing an answer, marking a record unknown and forgetting one all match
//! `state = 'in_flight'`; a first use takes a record over only once it has
//! expired (`expires_at <= now()`), and the purge deletes only expired
//! records. So an answer this process has seen completed — it stored it,
//! or read it once from the store — is the record's answer, and the
//! fingerprint it was stored with is the record's fingerprint, until the
//! record expires: a replay with the same fingerprint gets the answer, and
//! another fingerprint is 422, exactly as the store would say, in single
//! and shared mode alike. What is not `done` (in flight, unknown) changes
//! and is never cached.
//!
//! Why an expired record is never replayed (purge safety): an entry's
//! `until` is a local lower bound of the record's `expires_at`. It is
//! anchored at an instant taken *before* the statement that wrote the
//! record (or read it) started on the store, plus the time to expiry the
//! statement set (or reported), less a margin for the two clocks' rates
//! ([`DRIFT_PER_MILLE`], above the 500 ppm an NTP-disciplined clock may be
//! slewed by, plus a millisecond for rounding). Past `until` the entry is
//! dead: a lookup removes it and goes to the store, which says whether the
//! record still lives. Stepping the store's clock forward is outside this,
//! as it is outside the records' time in flight.
//!
//! Bounds: [`MAX_ENTRIES`] entries and [`MAX_BYTES`] bytes, charged per
//! entry as an upper estimate of its heap (key, headers, body and the
//! fixed overhead of the map and the entry, [`ENTRY_OVERHEAD`]); an answer
//! whose entry would be charged more than [`MAX_ENTRY_BYTES`] is not
//! cached (its replays read the store). Eviction is CLOCK (second chance),
//! as in the gate: a bounded number of steps per insert, an expired entry
//! first when the hand meets it, an entry replayed since the hand last
//! passed kept once more.
//!
//! Concurrency: one `std::sync::Mutex`; a lookup holds it for a hash
//! lookup and an `Arc` clone, an insert for the insert and a few clock
//! steps. The response is built outside it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use crate::store::{RecordId, StoredAnswer};

/// Entries kept at most.
pub const MAX_ENTRIES: usize = 16_384;
/// Bytes charged at most, over all entries.
pub const MAX_BYTES: usize = 32 * 1024 * 1024;
/// Larger entries are not cached: one answer may not crowd out 64 others.
pub const MAX_ENTRY_BYTES: usize = MAX_BYTES / 64;
/// What an entry costs beyond the lengths of its key, headers and body:
/// the map's slot, the clock's, the entry and its `Arc`, the header map's
/// tables (per header, [`HEADER_OVERHEAD`] more). An upper estimate,
/// checked against the allocator by `examples/idempotency_cache_memory.rs`.
pub const ENTRY_OVERHEAD: usize = 512;
/// Per header of a cached answer, beyond its name's and value's lengths.
pub const HEADER_OVERHEAD: usize = 128;
/// How much earlier than its record an entry dies, per mille of its time
/// to live (see the module docs).
pub const DRIFT_PER_MILLE: u32 = 1;

/// Entries the eviction clock looks at, at most, per insert.
const CLOCK_STEPS: usize = 8;

/// A replayable answer and what it is judged by.
struct Answer {
    fingerprint: [u8; 32],
    status: StatusCode,
    /// The stored headers, and `Idempotent-Replayed: true`.
    headers: HeaderMap,
    body: Bytes,
    /// A local lower bound of the record's expiry.
    until: Instant,
    /// What the entry counts against [`MAX_BYTES`].
    charge: usize,
}

struct Entry {
    answer: Arc<Answer>,
    /// Replayed since it was cached or the clock last passed.
    used: bool,
}

#[derive(Default)]
struct Entries {
    map: HashMap<Arc<[u8]>, Entry>,
    /// Every key of `map`, once, in the order the clock visits them.
    clock: VecDeque<Arc<[u8]>>,
    bytes: usize,
}

impl Entries {
    fn remove(&mut self, key: &[u8]) {
        if let Some(e) = self.map.remove(key) {
            self.bytes -= e.answer.charge;
        }
        // Its clock slot goes when the hand reaches it (the map no longer
        // has the key): no search of the queue.
    }

    /// Evicts until `extra` more bytes and one more entry fit, within a
    /// bounded number of steps. Stale clock slots (keys already removed)
    /// are dropped on the way; an expired entry goes whatever its use.
    fn make_room(&mut self, max_entries: usize, max_bytes: usize, extra: usize, now: Instant) {
        for _ in 0..CLOCK_STEPS {
            // The clock holds every live key (and perhaps stale ones), so
            // it is never shorter than the map.
            if self.map.len() < max_entries && self.bytes + extra <= max_bytes {
                return;
            }
            let Some(key) = self.clock.pop_front() else {
                return;
            };
            let Some(entry) = self.map.get_mut(&key) else {
                continue;
            };
            if entry.used && entry.answer.until > now {
                entry.used = false;
                self.clock.push_back(key);
            } else {
                self.remove(&key);
            }
        }
    }
}

/// What memory knows of a write with an Idempotency-Key.
pub enum Cached {
    /// A completed record with the same fingerprint: its answer, replayed.
    Replay(Response),
    /// A completed record with another fingerprint: 422.
    Reused,
    /// Nothing live: the store decides.
    Miss,
}

/// The bounded cache of completed records' answers (see the module docs).
pub struct ReplayCache {
    entries: Mutex<Entries>,
    max_entries: usize,
    max_bytes: usize,
    max_entry_bytes: usize,
}

impl Default for ReplayCache {
    fn default() -> Self {
        Self::new(MAX_ENTRIES, MAX_BYTES, MAX_ENTRY_BYTES)
    }
}

impl ReplayCache {
    /// A cache of at most `max_entries` entries and `max_bytes` bytes, of
    /// entries of at most `max_entry_bytes` each.
    pub fn new(max_entries: usize, max_bytes: usize, max_entry_bytes: usize) -> Self {
        Self {
            entries: Mutex::new(Entries::default()),
            max_entries,
            max_bytes,
            max_entry_bytes: max_entry_bytes.min(max_bytes),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        // Critical sections do not panic midway; a poisoned lock holds
        // consistent entries.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What memory knows of `id` for a request of `fingerprint`, at `now`.
    pub fn get(&self, id: RecordId<'_>, fingerprint: &[u8; 32], now: Instant) -> Cached {
        let key = key_of(id);
        let answer = {
            let mut entries = self.lock();
            let Some(entry) = entries.map.get_mut(&key[..]) else {
                return Cached::Miss;
            };
            if entry.answer.until <= now {
                entries.remove(&key);
                return Cached::Miss;
            }
            entry.used = true;
            entry.answer.clone()
        };
        if answer.fingerprint != *fingerprint {
            return Cached::Reused;
        }
        let mut resp = Response::new(Body::from(answer.body.clone()));
        *resp.status_mut() = answer.status;
        *resp.headers_mut() = answer.headers.clone();
        Cached::Replay(resp)
    }

    /// Remembers `answer`, the answer of the completed record `id` stored
    /// with `fingerprint`, until `until`: a local lower bound of the
    /// record's expiry (see [`until`]). An answer too large is not kept.
    pub fn insert(
        &self,
        id: RecordId<'_>,
        fingerprint: [u8; 32],
        answer: &StoredAnswer,
        until: Instant,
        now: Instant,
    ) {
        if until <= now {
            return;
        }
        let key: Arc<[u8]> = key_of(id).into();
        let charge = charge(key.len(), answer);
        if charge > self.max_entry_bytes {
            return;
        }
        let (status, headers) = super::replay_head(answer);
        let answer = Arc::new(Answer {
            fingerprint,
            status,
            headers,
            body: answer.body.clone(),
            until,
            charge,
        });
        let mut entries = self.lock();
        if entries.map.contains_key(&key) {
            // Another request cached the same record meanwhile: the same
            // answer (records are immutable), or a newer record of the key
            // whose expiry is later. Keep the later.
            entries.remove(&key);
        }
        entries.make_room(self.max_entries, self.max_bytes, charge, now);
        if entries.map.len() >= self.max_entries || entries.bytes + charge > self.max_bytes {
            // The clock ran out of steps on entries replayed recently:
            // this one is not cached rather than evicting without bound.
            return;
        }
        entries.bytes += charge;
        entries.clock.push_back(key.clone());
        entries.map.insert(
            key,
            Entry {
                answer,
                used: false,
            },
        );
    }

    /// Entries cached now (live or not yet evicted).
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes charged now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

/// The local lower bound of a record's expiry: `anchor`, an instant before
/// the statement that wrote or read it started, plus `expires_in`, the
/// time to expiry on the store's clock from that statement's start, less
/// the margin for the clocks (see the module docs).
pub fn until(anchor: Instant, expires_in: Duration) -> Instant {
    let margin = expires_in / 1000 * DRIFT_PER_MILLE + Duration::from_millis(1);
    anchor + expires_in.saturating_sub(margin)
}

/// The map's key: route, method and key, each length-prefixed, so that no
/// two ids share one.
fn key_of(id: RecordId<'_>) -> Vec<u8> {
    let mut k = Vec::with_capacity(12 + id.route.len() + id.method.len() + id.key.len());
    for part in [id.route, id.method, id.key] {
        k.extend_from_slice(&(part.len() as u32).to_le_bytes());
        k.extend_from_slice(part.as_bytes());
    }
    k
}

/// What an entry counts against the byte bound: an upper estimate of its
/// heap (see [`ENTRY_OVERHEAD`]).
fn charge(key_len: usize, answer: &StoredAnswer) -> usize {
    let headers: usize = answer
        .headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + HEADER_OVERHEAD)
        .sum();
    // The replay header, added to every entry's map.
    let replayed = super::REPLAYED.as_str().len() + 4 + HEADER_OVERHEAD;
    ENTRY_OVERHEAD + 2 * key_len + headers + replayed + answer.body.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str) -> RecordId<'_> {
        RecordId {
            route: "docs",
            method: "POST",
            key,
        }
    }

    fn answer(body: &'static str) -> StoredAnswer {
        StoredAnswer {
            status: 201,
            headers: vec![("x-upstream".into(), b"recorder".to_vec())],
            body: Bytes::from_static(body.as_bytes()),
        }
    }

    const FP: [u8; 32] = [7; 32];

    fn replayed(c: &ReplayCache, key: &str, now: Instant) -> bool {
        match c.get(id(key), &FP, now) {
            Cached::Replay(r) => {
                assert_eq!(r.status(), 201);
                assert_eq!(r.headers()["idempotent-replayed"], "true");
                assert_eq!(r.headers()["x-upstream"], "recorder");
                true
            }
            _ => false,
        }
    }

    #[test]
    fn replays_judge_the_fingerprint_and_die_with_their_record() {
        let c = ReplayCache::default();
        let now = Instant::now();
        c.insert(
            id("a"),
            FP,
            &answer("A"),
            now + Duration::from_secs(10),
            now,
        );
        assert!(replayed(&c, "a", now));
        assert!(matches!(c.get(id("a"), &[8; 32], now), Cached::Reused));
        assert!(matches!(c.get(id("b"), &FP, now), Cached::Miss));
        // Another route, method or key is another record.
        let other = RecordId {
            route: "docs2",
            method: "POST",
            key: "a",
        };
        assert!(matches!(c.get(other, &FP, now), Cached::Miss));
        // At its expiry it is gone, and removed.
        let later = now + Duration::from_secs(10);
        assert!(matches!(c.get(id("a"), &FP, later), Cached::Miss));
        assert!(c.is_empty());
        assert_eq!(c.bytes(), 0);
        // Already expired: not cached at all.
        c.insert(id("c"), FP, &answer("C"), now, now);
        assert!(c.is_empty());
    }

    #[test]
    fn the_expiry_bound_is_below_the_records() {
        let anchor = Instant::now();
        let day = Duration::from_secs(86_400);
        let u = until(anchor, day);
        assert!(u < anchor + day);
        // 1 per mille of a day, and a millisecond.
        assert_eq!(anchor + day - u, Duration::from_millis(86_401));
        assert_eq!(until(anchor, Duration::ZERO), anchor);
    }

    #[test]
    fn entries_are_bounded_by_count() {
        let c = ReplayCache::new(100, usize::MAX, usize::MAX);
        let now = Instant::now();
        let until = now + Duration::from_secs(60);
        for i in 0..1000 {
            c.insert(id(&format!("k{i}")), FP, &answer("x"), until, now);
            assert!(c.len() <= 100, "{i}: {}", c.len());
        }
        assert_eq!(c.len(), 100);
        // The newest are there; the oldest went.
        assert!(replayed(&c, "k999", now));
        assert!(!replayed(&c, "k0", now));
    }

    #[test]
    fn entries_are_bounded_by_bytes_and_large_answers_are_not_cached() {
        let body: &'static str = Box::leak("b".repeat(1000).into_boxed_str());
        let one = charge(key_of(id("k0")).len(), &answer(body));
        let c = ReplayCache::new(usize::MAX, 10 * one, one);
        let now = Instant::now();
        let until = now + Duration::from_secs(60);
        for i in 0..100 {
            c.insert(id(&format!("k{i}")), FP, &answer(body), until, now);
            assert!(c.bytes() <= 10 * one, "{i}: {}", c.bytes());
        }
        assert_eq!(c.len(), 10);
        let big: &'static str = Box::leak("b".repeat(1001).into_boxed_str());
        c.insert(id("big"), FP, &answer(big), until, now);
        assert!(!replayed(&c, "big", now), "over the entry limit");
    }

    #[test]
    fn a_replayed_entry_gets_a_second_chance() {
        let c = ReplayCache::new(4, usize::MAX, usize::MAX);
        let now = Instant::now();
        let long = now + Duration::from_secs(60);
        for k in ["hot", "a", "b", "c"] {
            c.insert(id(k), FP, &answer("x"), long, now);
        }
        assert!(replayed(&c, "hot", now));
        // Full: the hand spares "hot" (replayed) once and takes "a".
        c.insert(id("d"), FP, &answer("x"), long, now);
        assert!(replayed(&c, "hot", now));
        assert!(!replayed(&c, "a", now));
        assert!(replayed(&c, "b", now) && replayed(&c, "c", now) && replayed(&c, "d", now));
    }

    #[test]
    fn an_expired_entry_is_evicted_though_it_was_replayed() {
        let c = ReplayCache::new(4, usize::MAX, usize::MAX);
        let now = Instant::now();
        let long = now + Duration::from_secs(60);
        c.insert(
            id("dying"),
            FP,
            &answer("x"),
            now + Duration::from_secs(1),
            now,
        );
        for k in ["a", "b", "c"] {
            c.insert(id(k), FP, &answer("x"), long, now);
        }
        assert!(replayed(&c, "dying", now));
        let later = now + Duration::from_secs(2);
        c.insert(id("d"), FP, &answer("x"), long, later);
        // "dying" went, not "a" (which a second chance for it would take).
        assert_eq!(c.len(), 4);
        for k in ["a", "b", "c", "d"] {
            assert!(replayed(&c, k, later), "{k}");
        }
        assert!(!replayed(&c, "dying", later));
    }

    #[test]
    fn the_same_record_cached_twice_counts_once() {
        let c = ReplayCache::default();
        let now = Instant::now();
        let until = now + Duration::from_secs(60);
        c.insert(id("a"), FP, &answer("A"), until, now);
        let bytes = c.bytes();
        c.insert(id("a"), FP, &answer("A"), until, now);
        assert_eq!(c.len(), 1);
        assert_eq!(c.bytes(), bytes);
    }
}
