//! Idempotency-Key records in the fence store (see `idempotency` for what
//! they mean). Every judgement of time — whether a record expired, whether
//! an in-flight record's gateway ran out of time — is the database's clock,
//! so all instances of a shared store agree.
//!
//! Two rules keep a request from being forwarded twice under one key:
//!
//! * a record never expires before its `in_flight_until` (its expiry is the
//!   later of the TTL and that instant), so a key whose first request may
//!   still be at the upstream is never taken for a new first use, however
//!   short `idempotency_ttl_s` is;
//! * every change a gateway makes to its own in-flight record (the answer,
//!   "unknown", forgetting it) matches the record's `attempt`, a random
//!   number it wrote with it. A gateway that stalled past its record's time
//!   (after which a duplicate may have taken an expired record over) finds
//!   its attempt gone and changes nothing.
//!
//! Single mode group-commits the writes of records: see `record_batch`.
//!
//! Shared mode writes its in-flight records with the fence decision
//! (`fencegate_enter_keyed`) and stores answers one statement each: there
//! every write already has its own statement.

use std::time::Duration;

use bytes::Bytes;

use super::sql::sqlite_now_ms;

/// Which record: a route, a method, a client's key.
#[derive(Debug, Clone, Copy)]
pub struct RecordId<'a> {
    pub route: &'a str,
    pub method: &'a str,
    pub key: &'a str,
}

/// An upstream answer as stored, and as replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAnswer {
    pub status: u16,
    /// Header names and values, hop-by-hop ones removed (stored as JSON).
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
}

/// What the store holds for a key (expired records are absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Absent,
    /// The same key with another request's fingerprint.
    Reused,
    /// The first request is still being forwarded, for up to this long.
    InFlight {
        for_ms: u64,
    },
    /// The first request may have reached the upstream, but no answer was
    /// stored (or its gateway ran out of time).
    Unknown,
    Done(StoredAnswer),
}

/// A record as read: what it says, and how long it lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub found: Found,
    /// From the statement's start on the store's clock until the record
    /// expires (zero when absent).
    pub expires_in: Duration,
    /// The record's attempt (none when absent): whether it is the record of
    /// a request its gateway never sent and is forgetting
    /// (`idempotency::Forgets`), whatever it says.
    pub attempt: Option<i64>,
}

/// The in-flight record a first use writes before it is forwarded.
#[derive(Debug, Clone, Copy)]
pub struct Begin<'a> {
    pub id: RecordId<'a>,
    pub fingerprint: &'a [u8],
    /// A random number identifying this attempt (see the module docs).
    pub attempt: i64,
    /// The record's time in flight: the latest its gateway may still store
    /// the answer, from when the record is written.
    pub in_flight: std::time::Duration,
    /// `idempotency_ttl_s`, from when the record is written; the record
    /// lives at least as long as it is in flight.
    pub ttl: std::time::Duration,
}

pub(super) const PG_LOOKUP: &str = "\
SELECT fingerprint, state, in_flight_until > now(),
       GREATEST(0, EXTRACT(EPOCH FROM (in_flight_until - now())) * 1000)::bigint,
       GREATEST(0, EXTRACT(EPOCH FROM (expires_at - now())) * 1000)::bigint,
       status, headers, body, attempt
  FROM idempotency
 WHERE route = $1 AND method = $2 AND idem_key = $3 AND expires_at > now()";

#[rustfmt::skip]
pub(super) const SQLITE_LOOKUP: &str = concat!("\
SELECT fingerprint, state, in_flight_until > ", sqlite_now_ms!(), ",
       MAX(0, in_flight_until - ", sqlite_now_ms!(), "),
       MAX(0, expires_at - ", sqlite_now_ms!(), "),
       status, headers, body, attempt
  FROM idempotency
 WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND expires_at > ", sqlite_now_ms!());

/// Writes a new in-flight record, or takes over an expired one; a live
/// record of the same key (a concurrent duplicate won) is left alone and no
/// row comes back. It expires at the later of its TTL and its time in
/// flight. (Shared mode writes it in `fencegate_enter_keyed` instead, with
/// the fence's in-flight marker: migrations/postgres/0009.)
pub(super) const PG_BEGIN: &str = "\
INSERT INTO idempotency AS i
       (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt)
VALUES ($1, $2, $3, $4, 'in_flight', now() + $5 * interval '1 millisecond',
        now() + GREATEST($5, $6) * interval '1 millisecond', $7)
ON CONFLICT (route, method, idem_key) DO UPDATE
   SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',
       in_flight_until = EXCLUDED.in_flight_until, expires_at = EXCLUDED.expires_at,
       attempt = EXCLUDED.attempt, status = NULL, headers = NULL, body = NULL
 WHERE i.expires_at <= now()
RETURNING 1";

#[rustfmt::skip]
pub(super) const SQLITE_BEGIN: &str = concat!("\
INSERT INTO idempotency
       (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt)
VALUES (?1, ?2, ?3, ?4, 'in_flight', ", sqlite_now_ms!(), " + ?5, ", sqlite_now_ms!(), " + MAX(?5, ?6), ?7)
ON CONFLICT (route, method, idem_key) DO UPDATE
   SET fingerprint = excluded.fingerprint, state = 'in_flight',
       in_flight_until = excluded.in_flight_until, expires_at = excluded.expires_at,
       attempt = excluded.attempt, status = NULL, headers = NULL, body = NULL
 WHERE idempotency.expires_at <= ", sqlite_now_ms!(), "
RETURNING 1");

pub(super) const PG_COMPLETE: &str = "\
UPDATE idempotency SET state = 'done', status = $5, headers = $6, body = $7
 WHERE route = $1 AND method = $2 AND idem_key = $3 AND attempt = $4 AND state = 'in_flight'";

pub(super) const SQLITE_COMPLETE: &str = "\
UPDATE idempotency SET state = 'done', status = ?5, headers = ?6, body = ?7
 WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND attempt = ?4 AND state = 'in_flight'
RETURNING 1";

/// Rows deleted per purge statement: small, so no purge holds locks long.
pub const PURGE_BATCH: i64 = 500;

/// One purge batch on Postgres, one short transaction: expired rows are
/// locked `SKIP LOCKED`, so instances purging at the same time take
/// disjoint batches instead of queueing behind each other, and a row that a
/// request is taking over at that moment is left to it (it will not be
/// expired once that commits). The rows stay locked from the sub-select to
/// the delete, so their `ctid`s cannot change in between.
pub(super) const PG_PURGE: &str = "\
DELETE FROM idempotency WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency WHERE expires_at <= now()
     LIMIT $1 FOR UPDATE SKIP LOCKED))";

/// SQLite has one writer (this instance), so a batch only competes with
/// this instance's own writes: it holds the write lock for at most
/// [`PURGE_BATCH`] rows.
#[rustfmt::skip]
pub(super) const SQLITE_PURGE: &str = concat!("\
DELETE FROM idempotency WHERE rowid IN (
    SELECT rowid FROM idempotency WHERE expires_at <= ", sqlite_now_ms!(), " LIMIT ?1)");
