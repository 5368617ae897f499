//! Idempotency-Key records in the fence store (see `idempotency` for what
//! they mean). Every judgement of time — whether a record expired, whether
//! an in-flight record's gateway ran out of time — is the database's clock,
//! so all instances of a shared store agree.

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
/// row comes back.
const PG_BEGIN: &str = "\
INSERT INTO idempotency AS i
       (route, method, idem_key, fingerprint, state, in_flight_until, expires_at)
VALUES ($1, $2, $3, $4, 'in_flight',
        now() + $5 * interval '1 millisecond', now() + $6 * interval '1 millisecond')
ON CONFLICT (route, method, idem_key) DO UPDATE
   SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',
       in_flight_until = EXCLUDED.in_flight_until, expires_at = EXCLUDED.expires_at,
       status = NULL, headers = NULL, body = NULL
 WHERE i.expires_at <= now()
RETURNING 1";

#[rustfmt::skip]
const SQLITE_BEGIN: &str = concat!("\
INSERT INTO idempotency
       (route, method, idem_key, fingerprint, state, in_flight_until, expires_at)
VALUES (?1, ?2, ?3, ?4, 'in_flight', ", sqlite_now_ms!(), " + ?5, ", sqlite_now_ms!(), " + ?6)
ON CONFLICT (route, method, idem_key) DO UPDATE
   SET fingerprint = excluded.fingerprint, state = 'in_flight',
       in_flight_until = excluded.in_flight_until, expires_at = excluded.expires_at,
       status = NULL, headers = NULL, body = NULL
 WHERE idempotency.expires_at <= ", sqlite_now_ms!(), "
RETURNING 1");

/// Rows deleted per purge statement: small, so no purge holds locks long.
pub const PURGE_BATCH: i64 = 500;

const PG_PURGE: &str = "\
DELETE FROM idempotency WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency WHERE expires_at <= now() LIMIT $1))";

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

    /// Writes the in-flight record of `id` before its request is forwarded.
    /// False when a live record exists already (a concurrent duplicate got
    /// there first): the caller must not forward.
    pub async fn idem_begin(
        &self,
        id: RecordId<'_>,
        fingerprint: &[u8],
        in_flight_ms: u64,
        ttl_ms: u64,
    ) -> Result<bool, StoreError> {
        self.check_writer()?;
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            let rows: Vec<(i32,)> = match self {
                FenceStore::Postgres(s) => {
                    sqlx::query_as(PG_BEGIN)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .bind(fingerprint)
                        .bind(in_flight_ms as i64)
                        .bind(ttl_ms as i64)
                        .fetch_all(s.pool())
                        .await?
                }
                FenceStore::Sqlite(s) => {
                    sqlx::query_as(SQLITE_BEGIN)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .bind(fingerprint)
                        .bind(in_flight_ms as i64)
                        .bind(ttl_ms as i64)
                        .fetch_all(s.pool())
                        .await?
                }
            };
            Ok(!rows.is_empty())
        })
        .await
    }

    /// Stores the upstream's answer: from now on duplicates replay it.
    pub async fn idem_complete(
        &self,
        id: RecordId<'_>,
        answer: &StoredAnswer,
    ) -> Result<(), StoreError> {
        let headers = serde_json::to_vec(&answer.headers)
            .map_err(|e| StoreError::Other(format!("cannot encode an answer's headers: {e}")))?;
        self.idem_set(
            id,
            "UPDATE idempotency SET state = 'done', status = $4, headers = $5, body = $6 \
             WHERE route = $1 AND method = $2 AND idem_key = $3 AND state = 'in_flight'",
            "UPDATE idempotency SET state = 'done', status = ?4, headers = ?5, body = ?6 \
             WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND state = 'in_flight'",
            Some((answer.status as i32, headers, answer.body.to_vec())),
        )
        .await
    }

    /// The request may have reached the upstream, but no answer is stored:
    /// duplicates are told so, and never forwarded.
    pub async fn idem_unknown(&self, id: RecordId<'_>) -> Result<(), StoreError> {
        self.idem_set(
            id,
            "UPDATE idempotency SET state = 'unknown' \
             WHERE route = $1 AND method = $2 AND idem_key = $3 AND state = 'in_flight'",
            "UPDATE idempotency SET state = 'unknown' \
             WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND state = 'in_flight'",
            None,
        )
        .await
    }

    /// Nothing of the request was sent: the key may be used again.
    pub async fn idem_forget(&self, id: RecordId<'_>) -> Result<(), StoreError> {
        self.idem_set(
            id,
            "DELETE FROM idempotency \
             WHERE route = $1 AND method = $2 AND idem_key = $3 AND state = 'in_flight'",
            "DELETE FROM idempotency \
             WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND state = 'in_flight'",
            None,
        )
        .await
    }

    async fn idem_set(
        &self,
        id: RecordId<'_>,
        pg: &'static str,
        sqlite: &'static str,
        answer: Option<(i32, Vec<u8>, Vec<u8>)>,
    ) -> Result<(), StoreError> {
        self.check_writer()?;
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            match self {
                FenceStore::Postgres(s) => {
                    let mut q = sqlx::query(pg).bind(id.route).bind(id.method).bind(id.key);
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
                        .bind(id.key);
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
