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

use bytes::Bytes;

use super::sql::sqlite_now_ms;
use super::{bounded, FenceStore, StoreError};

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

const PG_LOOKUP: &str = "\
SELECT fingerprint, state, in_flight_until > now(),
       GREATEST(0, EXTRACT(EPOCH FROM (in_flight_until - now())) * 1000)::bigint,
       status, headers, body
  FROM idempotency
 WHERE route = $1 AND method = $2 AND idem_key = $3 AND expires_at > now()";

#[rustfmt::skip]
const SQLITE_LOOKUP: &str = concat!("\
SELECT fingerprint, state, in_flight_until > ", sqlite_now_ms!(), ",
       MAX(0, in_flight_until - ", sqlite_now_ms!(), "),
       status, headers, body
  FROM idempotency
 WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND expires_at > ", sqlite_now_ms!());

/// Writes a new in-flight record, or takes over an expired one; a live
/// record of the same key (a concurrent duplicate won) is left alone and no
/// row comes back. It expires at the later of its TTL and its time in
/// flight. (Shared mode writes it in `fencegate_enter_keyed` instead, with
/// the fence's in-flight marker: migrations/postgres/0009.)
const PG_BEGIN: &str = "\
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
const SQLITE_BEGIN: &str = concat!("\
INSERT INTO idempotency
       (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt)
VALUES (?1, ?2, ?3, ?4, 'in_flight', ", sqlite_now_ms!(), " + ?5, ", sqlite_now_ms!(), " + MAX(?5, ?6), ?7)
ON CONFLICT (route, method, idem_key) DO UPDATE
   SET fingerprint = excluded.fingerprint, state = 'in_flight',
       in_flight_until = excluded.in_flight_until, expires_at = excluded.expires_at,
       attempt = excluded.attempt, status = NULL, headers = NULL, body = NULL
 WHERE idempotency.expires_at <= ", sqlite_now_ms!(), "
RETURNING 1");

/// Rows deleted per purge statement: small, so no purge holds locks long.
pub const PURGE_BATCH: i64 = 500;

/// One purge batch on Postgres, one short transaction: expired rows are
/// locked `SKIP LOCKED`, so instances purging at the same time take
/// disjoint batches instead of queueing behind each other, and a row that a
/// request is taking over at that moment is left to it (it will not be
/// expired once that commits). The rows stay locked from the sub-select to
/// the delete, so their `ctid`s cannot change in between.
const PG_PURGE: &str = "\
DELETE FROM idempotency WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency WHERE expires_at <= now()
     LIMIT $1 FOR UPDATE SKIP LOCKED))";

/// SQLite has one writer (this instance), so a batch only competes with
/// this instance's own writes: it holds the write lock for at most
/// [`PURGE_BATCH`] rows.
#[rustfmt::skip]
const SQLITE_PURGE: &str = concat!("\
DELETE FROM idempotency WHERE rowid IN (
    SELECT rowid FROM idempotency WHERE expires_at <= ", sqlite_now_ms!(), " LIMIT ?1)");

type Row = (
    Vec<u8>,
    String,
    bool,
    i64,
    Option<i32>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
);

impl FenceStore {
    /// The record of `id`, judged against the request's `fingerprint`.
    pub async fn idem_lookup(
        &self,
        id: RecordId<'_>,
        fingerprint: &[u8],
    ) -> Result<Found, StoreError> {
        let timeout = self.timeout();
        let row: Option<Row> = bounded(timeout, StoreError::Timeout, async {
            Ok(match self {
                FenceStore::Postgres(s) => {
                    sqlx::query_as(PG_LOOKUP)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .fetch_optional(s.pool())
                        .await?
                }
                FenceStore::Sqlite(s) => {
                    sqlx::query_as(SQLITE_LOOKUP)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .fetch_optional(s.pool())
                        .await?
                }
            })
        })
        .await?;
        let Some((fp, state, live, left_ms, status, headers, body)) = row else {
            return Ok(Found::Absent);
        };
        if fp != fingerprint {
            return Ok(Found::Reused);
        }
        Ok(match state.as_str() {
            "in_flight" if live => Found::InFlight {
                for_ms: left_ms.max(0) as u64,
            },
            "done" => {
                let headers =
                    serde_json::from_slice(headers.as_deref().unwrap_or(b"[]")).map_err(|e| {
                        StoreError::Other(format!("a stored answer's headers do not decode: {e}"))
                    })?;
                Found::Done(StoredAnswer {
                    status: status.unwrap_or(500) as u16,
                    headers,
                    body: Bytes::from(body.unwrap_or_default()),
                })
            }
            // 'unknown', or in flight past its gateway's time.
            _ => Found::Unknown,
        })
    }

    /// Writes the in-flight record of `begin` before its request is
    /// forwarded. False when a live record exists already (a concurrent
    /// duplicate got there first): the caller must not forward.
    pub async fn idem_begin(&self, begin: &Begin<'_>) -> Result<bool, StoreError> {
        self.check_writer()?;
        let timeout = self.timeout();
        let in_flight_ms = begin.in_flight.as_millis() as i64;
        let ttl_ms = begin.ttl.as_millis() as i64;
        let id = begin.id;
        bounded(timeout, StoreError::Timeout, async {
            let rows: Vec<(i32,)> = match self {
                FenceStore::Postgres(s) => {
                    sqlx::query_as(PG_BEGIN)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .bind(begin.fingerprint)
                        .bind(in_flight_ms)
                        .bind(ttl_ms)
                        .bind(begin.attempt)
                        .fetch_all(s.pool())
                        .await?
                }
                FenceStore::Sqlite(s) => {
                    sqlx::query_as(SQLITE_BEGIN)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .bind(begin.fingerprint)
                        .bind(in_flight_ms)
                        .bind(ttl_ms)
                        .bind(begin.attempt)
                        .fetch_all(s.pool())
                        .await?
                }
            };
            Ok(!rows.is_empty())
        })
        .await
    }

    /// Stores the upstream's answer in `attempt`'s record: from now on
    /// duplicates replay it.
    pub async fn idem_complete(
        &self,
        id: RecordId<'_>,
        attempt: i64,
        answer: &StoredAnswer,
    ) -> Result<(), StoreError> {
        let headers = serde_json::to_vec(&answer.headers)
            .map_err(|e| StoreError::Other(format!("cannot encode an answer's headers: {e}")))?;
        self.idem_set(
            id,
            attempt,
            "UPDATE idempotency SET state = 'done', status = $5, headers = $6, body = $7 \
             WHERE route = $1 AND method = $2 AND idem_key = $3 AND attempt = $4 \
               AND state = 'in_flight'",
            "UPDATE idempotency SET state = 'done', status = ?5, headers = ?6, body = ?7 \
             WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND attempt = ?4 \
               AND state = 'in_flight'",
            Some((answer.status as i32, headers, answer.body.to_vec())),
        )
        .await
    }

    /// The request may have reached the upstream, but no answer is stored:
    /// duplicates are told so, and never forwarded.
    pub async fn idem_unknown(&self, id: RecordId<'_>, attempt: i64) -> Result<(), StoreError> {
        self.idem_set(
            id,
            attempt,
            "UPDATE idempotency SET state = 'unknown' \
             WHERE route = $1 AND method = $2 AND idem_key = $3 AND attempt = $4 \
               AND state = 'in_flight'",
            "UPDATE idempotency SET state = 'unknown' \
             WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND attempt = ?4 \
               AND state = 'in_flight'",
            None,
        )
        .await
    }

    /// Nothing of the request was sent: the key may be used again.
    pub async fn idem_forget(&self, id: RecordId<'_>, attempt: i64) -> Result<(), StoreError> {
        self.idem_set(
            id,
            attempt,
            "DELETE FROM idempotency \
             WHERE route = $1 AND method = $2 AND idem_key = $3 AND attempt = $4 \
               AND state = 'in_flight'",
            "DELETE FROM idempotency \
             WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND attempt = ?4 \
               AND state = 'in_flight'",
            None,
        )
        .await
    }

    async fn idem_set(
        &self,
        id: RecordId<'_>,
        attempt: i64,
        pg: &'static str,
        sqlite: &'static str,
        answer: Option<(i32, Vec<u8>, Vec<u8>)>,
    ) -> Result<(), StoreError> {
        self.check_writer()?;
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            match self {
                FenceStore::Postgres(s) => {
                    let mut q = sqlx::query(pg)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .bind(attempt);
                    if let Some((status, headers, body)) = answer {
                        q = q.bind(status).bind(headers).bind(body);
                    }
                    q.execute(s.pool()).await?;
                }
                FenceStore::Sqlite(s) => {
                    // fetch_all: see the module docs of `store::sqlite`.
                    let mut q = sqlx::query(sqlite)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .bind(attempt);
                    if let Some((status, headers, body)) = answer {
                        q = q.bind(status).bind(headers).bind(body);
                    }
                    q.fetch_all(s.pool()).await?;
                }
            }
            Ok(())
        })
        .await
    }

    /// Deletes up to [`PURGE_BATCH`] expired records; answers how many.
    pub async fn idem_purge(&self) -> Result<u64, StoreError> {
        // Single mode on Postgres without the single-writer lock (a
        // failover): another instance may be the writer now.
        self.check_writer()?;
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            Ok(match self {
                FenceStore::Postgres(s) => sqlx::query(PG_PURGE)
                    .bind(PURGE_BATCH)
                    .execute(s.pool())
                    .await?
                    .rows_affected(),
                FenceStore::Sqlite(s) => sqlx::query(SQLITE_PURGE)
                    .bind(PURGE_BATCH)
                    .execute(s.pool())
                    .await?
                    .rows_affected(),
            })
        })
        .await
    }
}
