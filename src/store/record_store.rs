//! The fence store's operations on Idempotency-Key records: lookups,
//! reads, the first use's record, its answer, "unknown", forgetting, and
//! the purge of expired records. Single mode sends its writes through the
//! group commit (`record_batch`).

use std::time::Duration;

use bytes::Bytes;

use super::record_batch::{
    BeginItem, CompleteItem, DecideItem, Decided, RecordBatcher, RecordWrite, BATCHED_ANSWER_BYTES,
};
use super::records::*;
use super::sql::on_backend;
use super::{bounded, FenceStore, StoreError};

type Row = (
    Vec<u8>,
    String,
    bool,
    i64,
    i64,
    Option<i32>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    i64,
);

impl FenceStore {
    /// The record of `id`, judged against the request's `fingerprint`.
    pub async fn idem_lookup(
        &self,
        id: RecordId<'_>,
        fingerprint: &[u8],
    ) -> Result<Found, StoreError> {
        Ok(self.idem_read(id, fingerprint).await?.found)
    }

    /// [`FenceStore::idem_lookup`], with how long the record lives.
    pub async fn idem_read(
        &self,
        id: RecordId<'_>,
        fingerprint: &[u8],
    ) -> Result<Read, StoreError> {
        let timeout = self.timeout();
        let row: Option<Row> = bounded(timeout, StoreError::Timeout, async {
            Ok(on_backend!(
                self,
                (PG_LOOKUP, SQLITE_LOOKUP),
                |pool, sql| {
                    sqlx::query_as(sql)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .fetch_optional(pool)
                        .await?
                }
            ))
        })
        .await?;
        let Some((fp, state, live, left_ms, expires_ms, status, headers, body, attempt)) = row
        else {
            return Ok(Read {
                found: Found::Absent,
                expires_in: Duration::ZERO,
                attempt: None,
            });
        };
        let expires_in = Duration::from_millis(expires_ms.max(0) as u64);
        let attempt = Some(attempt);
        if fp != fingerprint {
            return Ok(Read {
                found: Found::Reused,
                expires_in,
                attempt,
            });
        }
        let found = match state.as_str() {
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
        };
        Ok(Read {
            found,
            expires_in,
            attempt,
        })
    }

    /// Single mode's batcher of idempotency records.
    fn record_batcher(&self) -> Option<&RecordBatcher> {
        match self {
            FenceStore::Postgres(s) => s.record_batcher(),
            FenceStore::Sqlite(s) => Some(s.record_batcher()),
        }
    }

    /// A batcher's error, explained by what the store's connections learned
    /// (see `PgStore::explain`).
    fn explain(&self, e: StoreError) -> StoreError {
        match self {
            FenceStore::Postgres(s) => s.explain(e),
            FenceStore::Sqlite(_) => e,
        }
    }

    /// Single mode: [`FenceStore::record`] for the first use of an
    /// `Idempotency-Key`, with its in-flight record, in a batch of records:
    /// one transaction and commit for the decision and the record, which
    /// is written only if the token is accepted. `written` is false when
    /// the token was refused or a live record of the key exists (a
    /// concurrent duplicate got there first): the caller must not forward.
    /// Both answers are durable.
    pub async fn decide_with_record(
        &self,
        key: &str,
        token: i64,
        record: &Begin<'_>,
    ) -> Result<Decided, StoreError> {
        self.check_writer()?;
        let Some(b) = self.record_batcher() else {
            return Err(StoreError::Other(
                "decide_with_record is for single mode; shared mode decides in enter".into(),
            ));
        };
        let item = DecideItem {
            key: key.to_string(),
            token,
            begin: BeginItem::of(record),
        };
        let done = b
            .submit(RecordWrite::Decide(item))
            .await
            .map_err(|e| self.explain(e))?;
        let highest = done
            .highest
            .ok_or_else(|| StoreError::Other("a batch lost a key's answer".into()))?;
        Ok(Decided {
            highest,
            written: done.written,
        })
    }

    /// Writes the in-flight record of `begin` before its request is
    /// forwarded (group-committed in single mode: see the module docs).
    /// False when a live record exists already (a concurrent duplicate got
    /// there first): the caller must not forward. True only once the
    /// record is durable.
    pub async fn idem_begin(&self, begin: &Begin<'_>) -> Result<bool, StoreError> {
        self.check_writer()?;
        if let Some(b) = self.record_batcher() {
            return b
                .submit(RecordWrite::Begin(BeginItem::of(begin)))
                .await
                .map(|r| r.written)
                .map_err(|e| self.explain(e));
        }
        let timeout = self.timeout();
        let in_flight_ms = begin.in_flight.as_millis() as i64;
        let ttl_ms = begin.ttl.as_millis() as i64;
        let id = begin.id;
        bounded(timeout, StoreError::Timeout, async {
            let rows: Vec<(i32,)> = on_backend!(self, (PG_BEGIN, SQLITE_BEGIN), |pool, sql| {
                sqlx::query_as(sql)
                    .bind(id.route)
                    .bind(id.method)
                    .bind(id.key)
                    .bind(begin.fingerprint)
                    .bind(in_flight_ms)
                    .bind(ttl_ms)
                    .bind(begin.attempt)
                    .fetch_all(pool)
                    .await?
            });
            Ok(!rows.is_empty())
        })
        .await
    }

    /// Stores the upstream's answer in `attempt`'s record: from now on
    /// duplicates replay it (group-committed in single mode, but for large
    /// answers: see the module docs). True once the answer is durable in
    /// the record; false when the record is no longer `attempt`'s in
    /// flight (this gateway stalled past its time), and nothing changed.
    pub async fn idem_complete(
        &self,
        id: RecordId<'_>,
        attempt: i64,
        answer: &StoredAnswer,
    ) -> Result<bool, StoreError> {
        let headers = serde_json::to_vec(&answer.headers)
            .map_err(|e| StoreError::Other(format!("cannot encode an answer's headers: {e}")))?;
        if let Some(b) = self.record_batcher() {
            if headers.len() + answer.body.len() <= BATCHED_ANSWER_BYTES {
                self.check_writer()?;
                let item = CompleteItem {
                    route: id.route.to_string(),
                    method: id.method.to_string(),
                    key: id.key.to_string(),
                    attempt,
                    status: answer.status as i32,
                    headers,
                    body: answer.body.clone(),
                };
                return b
                    .submit(RecordWrite::Complete(item))
                    .await
                    .map(|r| r.written)
                    .map_err(|e| self.explain(e));
            }
        }
        let changed = self
            .idem_set(
                id,
                attempt,
                PG_COMPLETE,
                SQLITE_COMPLETE,
                Some((answer.status as i32, headers, answer.body.clone())),
            )
            .await?;
        Ok(changed > 0)
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
               AND state = 'in_flight' RETURNING 1",
            None,
        )
        .await
        .map(drop)
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
               AND state = 'in_flight' RETURNING 1",
            None,
        )
        .await
        .map(drop)
    }

    /// One statement on `attempt`'s record of `id`; answers the rows it
    /// changed (the SQLite statement returns one row per row changed).
    async fn idem_set(
        &self,
        id: RecordId<'_>,
        attempt: i64,
        pg: &'static str,
        sqlite: &'static str,
        answer: Option<(i32, Vec<u8>, Bytes)>,
    ) -> Result<u64, StoreError> {
        self.check_writer()?;
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            Ok(on_backend!(
                self,
                ((pg, false), (sqlite, true)),
                |pool, (sql, lite)| {
                    let mut q = sqlx::query(sql)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .bind(attempt);
                    if let Some((status, headers, body)) = answer {
                        q = q.bind(status).bind(headers).bind(body.to_vec());
                    }
                    if lite {
                        // fetch_all: see the module docs of `store::sqlite`.
                        q.fetch_all(pool).await?.len() as u64
                    } else {
                        q.execute(pool).await?.rows_affected()
                    }
                }
            ))
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
