//! `backend = "store"`: leases in the `locks` table of the fence store's
//! database.
//!
//! Every change is one statement, and expiry is judged by the database's
//! clock (`now()` on Postgres, `julianday('now')` on SQLite), never by a
//! gateway's or a client's. The fence is a per-name counter in the same row:
//! it survives release and expiry, and each grant takes one above both it
//! and the highest token the gateway recorded for the resource key.
//!
//! Lock-delay needs no state of its own: a release clears the row's lease,
//! an expiry leaves it in place, so a row whose lease is set but past its
//! `expires_at` is one that expired, and it stays ungrantable until
//! `expires_at` plus the delay.
//!
//! Statements that write are stepped to the end (`fetch_all`) even for one
//! row, so that a failed commit on SQLite is reported, never acknowledged
//! (see the `store::sqlite` module docs).

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use super::backend::{Lease, LockBackend, LockError, LockResult, LockState};
use crate::store::sql::{highest_token, on_backend, pg_ms_until, sqlite_now_ms};
use crate::store::{bounded, FenceStore, StoreError};

/// Postgres: take the lock if it is released, or expired for longer than
/// the lock-delay (`$4` ms).
#[rustfmt::skip]
const PG_ACQUIRE: &str = concat!("\
INSERT INTO locks AS l (name, fence, lease, expires_at)
VALUES ($1, ", highest_token!("$1"), " + 1,
        $2, now() + $3 * interval '1 millisecond')
ON CONFLICT (name) DO UPDATE
    SET fence = GREATEST(l.fence, ", highest_token!("$1"), ") + 1,
        lease = EXCLUDED.lease,
        expires_at = EXCLUDED.expires_at
    WHERE l.lease IS NULL OR l.expires_at + $4 * interval '1 millisecond' <= now()
RETURNING fence, ", pg_ms_until!("expires_at"));

/// Postgres: extend a lease that is still ours and still valid; an expired
/// lease is never silently revived.
#[rustfmt::skip]
const PG_RENEW: &str = concat!("\
UPDATE locks SET expires_at = now() + $3 * interval '1 millisecond'
 WHERE name = $1 AND lease = $2 AND expires_at > now()
RETURNING fence, ", pg_ms_until!("expires_at"));

/// Postgres: release and wake waiters on every instance, in one statement
/// (the notification is delivered when it commits).
const PG_RELEASE: &str = "\
WITH r AS (
    UPDATE locks SET lease = NULL, expires_at = NULL
     WHERE name = $1 AND lease = $2 AND expires_at > now()
    RETURNING name
)
SELECT pg_notify('fencegate_locks', name) FROM r";

/// Postgres: end whatever lease holds the name (an admin break), waking
/// waiters on every instance.
const PG_BREAK: &str = "\
WITH r AS (
    UPDATE locks SET lease = NULL, expires_at = NULL
     WHERE name = $1 AND lease IS NOT NULL AND expires_at > now()
    RETURNING name
)
SELECT pg_notify('fencegate_locks', name) FROM r";

/// Postgres: the fence, whether held, the ms left of the lease, and (for an
/// expired lease) the ms left of its lock-delay (`$2` ms), rounded up so a
/// delay with a fraction of a millisecond left still shows.
#[rustfmt::skip]
const PG_STATUS: &str = concat!("\
SELECT fence,
       lease IS NOT NULL AND expires_at > now(),
       ", pg_ms_until!("expires_at"), ",
       CASE WHEN lease IS NOT NULL AND expires_at <= now() THEN
           CEIL(EXTRACT(EPOCH FROM (expires_at + $2 * interval '1 millisecond' - now())) * 1000)::bigint
       END
  FROM locks WHERE name = $1");

/// SQLite: see [`PG_ACQUIRE`].
#[rustfmt::skip]
const SQLITE_ACQUIRE: &str = concat!("\
INSERT INTO locks (name, fence, lease, expires_at)
VALUES (?1, ", highest_token!("?1"), " + 1, ?2, ", sqlite_now_ms!(), " + ?3)
ON CONFLICT (name) DO UPDATE
    SET fence = MAX(locks.fence, ", highest_token!("?1"), ") + 1,
        lease = excluded.lease,
        expires_at = excluded.expires_at
    WHERE locks.lease IS NULL OR locks.expires_at + ?4 <= ", sqlite_now_ms!(), "
RETURNING fence, MAX(0, expires_at - ", sqlite_now_ms!(), ")");

/// SQLite: see [`PG_RENEW`].
#[rustfmt::skip]
const SQLITE_RENEW: &str = concat!("\
UPDATE locks SET expires_at = ", sqlite_now_ms!(), " + ?3
 WHERE name = ?1 AND lease = ?2 AND expires_at > ", sqlite_now_ms!(), "
RETURNING fence, MAX(0, expires_at - ", sqlite_now_ms!(), ")");

/// SQLite: release (a single instance has no one else to notify).
#[rustfmt::skip]
const SQLITE_RELEASE: &str = concat!("\
UPDATE locks SET lease = NULL, expires_at = NULL
 WHERE name = ?1 AND lease = ?2 AND expires_at > ", sqlite_now_ms!(), "
RETURNING name");

/// SQLite: see [`PG_BREAK`].
#[rustfmt::skip]
const SQLITE_BREAK: &str = concat!("\
UPDATE locks SET lease = NULL, expires_at = NULL
 WHERE name = ?1 AND lease IS NOT NULL AND expires_at > ", sqlite_now_ms!(), "
RETURNING name");

/// SQLite: see [`PG_STATUS`] (`'now'` is one instant within a statement).
#[rustfmt::skip]
const SQLITE_STATUS: &str = concat!("\
SELECT fence,
       lease IS NOT NULL AND expires_at > ", sqlite_now_ms!(), ",
       MAX(0, COALESCE(expires_at, 0) - ", sqlite_now_ms!(), "),
       CASE WHEN lease IS NOT NULL AND expires_at <= ", sqlite_now_ms!(), "
            THEN expires_at + ?2 - ", sqlite_now_ms!(), " END
  FROM locks WHERE name = ?1");

/// A status statement's row: the fence, whether held, the ms left of the
/// lease, the ms left of a lock-delay.
type StatusRow = (i64, Option<bool>, Option<i64>, Option<i64>);

/// The table backend: leases in the `locks` table of the fence store.
#[derive(Clone)]
pub struct TableLocks {
    store: FenceStore,
    timeout: Duration,
    /// `[locks] lock_delay_ms`; zero for none.
    delay: Duration,
}

fn ms(v: i64) -> Duration {
    Duration::from_millis(v.max(0) as u64)
}

impl TableLocks {
    pub fn new(store: FenceStore, timeout: Duration) -> Self {
        Self {
            store,
            timeout,
            delay: Duration::ZERO,
        }
    }

    /// Keeps a name ungrantable for `delay` after a lease of it expires.
    pub fn with_lock_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Runs one statement within the store's bound (`[store] timeout_ms`).
    async fn run<T>(
        &self,
        statement: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> LockResult<T> {
        let unavailable = |why: &dyn Display| LockError::Unavailable(format!("fence store: {why}"));
        bounded(
            self.timeout,
            |limit| unavailable(&StoreError::Timeout(limit)),
            async {
                statement
                    .await
                    .map_err(|e| match crate::store::is_overflow(&e) {
                        // fence + 1 past the largest bigint.
                        true => LockError::Exhausted,
                        false => unavailable(&e),
                    })
            },
        )
        .await
    }

    /// Runs the acquire or renew statement: the lease's `(fence, valid ms)`
    /// if it matched a row. `delay` is bound as the fourth parameter when
    /// the statement has one (acquire).
    async fn lease_statement(
        &self,
        pg_sql: &str,
        sqlite_sql: &str,
        name: &str,
        lease: &str,
        ttl: Duration,
        delay: Option<Duration>,
    ) -> LockResult<Option<(i64, i64)>> {
        self.store.check_writer()?;
        let ttl_ms = ttl.as_millis() as i64;
        let delay_ms = delay.map(|d| d.as_millis() as i64);
        match &self.store {
            FenceStore::Postgres(s) => {
                let mut q = sqlx::query_as(pg_sql)
                    .bind(name)
                    .bind(lease)
                    .bind(ttl_ms as f64);
                if let Some(d) = delay_ms {
                    q = q.bind(d as f64);
                }
                self.run(q.fetch_optional(s.pool())).await
            }
            FenceStore::Sqlite(s) => {
                let mut q = sqlx::query_as(sqlite_sql)
                    .bind(name)
                    .bind(lease)
                    .bind(ttl_ms);
                if let Some(d) = delay_ms {
                    q = q.bind(d);
                }
                self.run(q.fetch_all(s.pool()))
                    .await
                    .map(|rows| rows.into_iter().next())
            }
        }
    }

    fn lease(name: &str, lease: &str, (fence, valid): (i64, i64)) -> Lease {
        Lease {
            name: name.to_string(),
            lease: lease.to_string(),
            fence,
            valid_for: ms(valid),
        }
    }

    /// Why a renew or release by `lease` matched no row: the lease is still
    /// recorded (so it expired), or it is not (someone else's, or released).
    async fn refusal(&self, name: &str, lease: &str) -> LockError {
        let ours: LockResult<Option<bool>> = on_backend!(
            &self.store,
            (
                "SELECT lease = $2 FROM locks WHERE name = $1",
                "SELECT lease = ?2 FROM locks WHERE name = ?1"
            ),
            |pool, sql| {
                let query = sqlx::query_scalar(sql).bind(name).bind(lease);
                self.run(query.fetch_optional(pool)).await
            }
        );
        match ours {
            Ok(Some(true)) => LockError::Expired,
            _ => LockError::NotHolder,
        }
    }
}

impl LockBackend for TableLocks {
    async fn try_acquire(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Lease> {
        match self
            .lease_statement(
                PG_ACQUIRE,
                SQLITE_ACQUIRE,
                name,
                lease,
                ttl,
                Some(self.delay),
            )
            .await?
        {
            Some(row) => Ok(Self::lease(name, lease, row)),
            None => {
                let st = self.status(name).await?;
                Err(LockError::Held {
                    expires_in: st.expires_in.or(st.delayed_for),
                })
            }
        }
    }

    async fn renew(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Lease> {
        match self
            .lease_statement(PG_RENEW, SQLITE_RENEW, name, lease, ttl, None)
            .await?
        {
            Some(row) => Ok(Self::lease(name, lease, row)),
            None => Err(self.refusal(name, lease).await),
        }
    }

    /// Releases the lease; `NotHolder` or `Expired` when it held nothing.
    /// The caller wakes local waiters; Postgres also notifies other
    /// instances.
    async fn release(&self, name: &str, lease: &str) -> LockResult<()> {
        self.store.check_writer()?;
        let released = on_backend!(&self.store, (PG_RELEASE, SQLITE_RELEASE), |pool, sql| {
            let query = sqlx::query(sql).bind(name).bind(lease);
            !self.run(query.fetch_all(pool)).await?.is_empty()
        });
        if released {
            Ok(())
        } else {
            Err(self.refusal(name, lease).await)
        }
    }

    async fn break_lease(&self, name: &str) -> LockResult<bool> {
        self.store.check_writer()?;
        Ok(on_backend!(
            &self.store,
            (PG_BREAK, SQLITE_BREAK),
            |pool, sql| {
                let query = sqlx::query(sql).bind(name);
                !self.run(query.fetch_all(pool)).await?.is_empty()
            }
        ))
    }

    async fn status(&self, name: &str) -> LockResult<LockState> {
        let delay_ms = self.delay.as_millis() as i64;
        let row: Option<StatusRow> = match &self.store {
            FenceStore::Postgres(s) => {
                self.run(
                    sqlx::query_as(PG_STATUS)
                        .bind(name)
                        .bind(delay_ms as f64)
                        .fetch_optional(s.pool()),
                )
                .await?
            }
            FenceStore::Sqlite(s) => {
                self.run(
                    sqlx::query_as(SQLITE_STATUS)
                        .bind(name)
                        .bind(delay_ms)
                        .fetch_optional(s.pool()),
                )
                .await?
            }
        };
        Ok(match row {
            None => LockState {
                held: false,
                fence: 0,
                expires_in: None,
                delayed_for: None,
            },
            Some((fence, held, left, delay_left)) => {
                let held = held.unwrap_or(false);
                LockState {
                    held,
                    fence,
                    expires_in: if held { left.map(ms) } else { None },
                    delayed_for: delay_left.filter(|&d| !held && d > 0).map(ms),
                }
            }
        })
    }
}

/// Feeds Postgres `NOTIFY fencegate_locks` (sent by every instance's
/// release) into the local notifier, so waiters on this instance wake when
/// another instance releases. Reconnects by itself; while it is down, the
/// waiters' bounded re-check still finds the lock free.
pub fn spawn_pg_listener(
    pool: sqlx::PgPool,
    notifier: std::sync::Arc<super::notify::Notifier>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let mut listener = match sqlx::postgres::PgListener::connect_with(&pool).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::debug!(error = %e, "lock notification listener cannot connect; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            if let Err(e) = listener.listen("fencegate_locks").await {
                tracing::debug!(error = %e, "LISTEN failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            loop {
                match listener.recv().await {
                    Ok(n) => notifier.notify(n.payload()),
                    Err(e) => {
                        tracing::debug!(error = %e, "lock notification listener lost its connection");
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}
