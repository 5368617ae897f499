//! The fence store: the durable record of the highest token per resource key.
//!
//! Two backends share one shape of decision: a single conditional upsert that
//! raises a key's highest token only to a greater value and answers with the
//! highest token after the statement. The caller accepts its token iff that
//! answer equals it. Every call is bounded by `[store] timeout_ms` so a store
//! that hangs turns into a prompt 503 instead of a pile of stuck requests.
//!
//! A statement that timed out may still commit later. That is safe: a token
//! recorded but never forwarded only makes older tokens stale sooner, which
//! is what the newer holder's existence means anyway.
//!
//! # Layout
//!
//! * `postgres`: the production store, failover included.
//! * `link`: connections a Postgres batcher keeps for itself, outside the
//!   pool.
//! * `admissions`: shared mode: which fenced writes may go, across every
//!   instance on one Postgres.
//! * `sqlite`: the embedded store for a single instance.
//! * [`batch`]: group commit: concurrent writes of one kind in one statement.
//! * [`readiness`]: `/readyz`'s view of the store; the durability check.
//! * `records`: `Idempotency-Key` records: their types and statements;
//!   `record_batch`: their group commit in single mode; `record_store`:
//!   the store's operations on them.
//! * `lock_fences`: the fences of the Redis and Redlock lock backends.
//! * `admin`: fence records for the admin API: reads, listings, resets.
//! * `sql`: SQL fragments the statements share.

mod admin;
mod admissions;
pub mod batch;
mod link;
mod lock_fences;
mod owner;
mod postgres;
pub mod readiness;
mod record_batch;
mod record_store;
mod records;
pub(crate) mod sql;
mod sqlite;

use std::future::Future;
use std::time::Duration;

use crate::config::{StoreBackend, StoreConfig, StoreMode};

pub use admin::{prefix_end, FenceRecord, Page, ResetRecord};
pub use admissions::{Entered, Entry, InFlight};
pub use owner::OWNER_LEASE;
pub use postgres::PgStore;
pub use readiness::ReadOnly;
pub use readiness::StoreReadiness;
pub use record_batch::Decided;
pub use records::{Begin, Found, Read, RecordId, StoredAnswer, PURGE_BATCH};
pub use sqlite::SqliteStore;

/// Why the store could not answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Built by the `From` below, which tells a read-only server apart.
    #[error("database error: {0}")]
    Database(sqlx::Error),
    /// The server answered but takes no writes: a standby (a failover in
    /// progress, or a VIP not moved yet) or `default_transaction_read_only`.
    /// Unavailable, never success: nothing it says decides a write.
    #[error("the fence store is read-only: {0}")]
    ReadOnly(ReadOnly),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("this instance does not hold the store's single-writer lock on a writable primary")]
    NotOwner,
    /// Shared mode: older writes to the key stayed in flight (on any
    /// instance) longer than `key_lock_wait_ms`. The store itself is fine.
    #[error("older writes kept the key closed for more than {0:?} (key_lock_wait_ms)")]
    KeyBusy(Duration),
    /// The decision was reached, but too late to forward the write within
    /// its in-flight marker (shared mode) or its idempotency record's time
    /// in flight (the process stalled in between).
    #[error("the decision came too late to forward the write in time")]
    Late,
    #[error("{0}")]
    Other(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        // SQLSTATE 25006 read_only_sql_transaction: a write reached a
        // standby, or a primary that was made read-only under us.
        let read_only = e
            .as_database_error()
            .and_then(|d| d.code())
            .is_some_and(|c| c == "25006");
        if read_only {
            StoreError::ReadOnly(ReadOnly::WriteRefused)
        } else {
            StoreError::Database(e)
        }
    }
}

/// A handle on the configured store; cheap to clone (pools inside).
#[derive(Clone)]
pub enum FenceStore {
    Postgres(PgStore),
    Sqlite(SqliteStore),
}

macro_rules! dispatch {
    ($self:expr, $s:ident => $call:expr) => {
        match $self {
            FenceStore::Postgres($s) => $call,
            FenceStore::Sqlite($s) => $call,
        }
    };
}

impl FenceStore {
    /// Connects, applies migrations and, in `single` mode, takes the
    /// single-writer lock. Fails if another instance holds it.
    pub async fn open(cfg: &StoreConfig) -> Result<Self, StoreError> {
        match &cfg.backend {
            StoreBackend::Sqlite(path) => Ok(Self::Sqlite(SqliteStore::open(path, cfg).await?)),
            StoreBackend::Postgres => {
                let single = cfg.mode == StoreMode::Single;
                Ok(Self::Postgres(PgStore::open(cfg, single).await?))
            }
        }
    }

    /// Records `token` for `key` unless a higher one is recorded; returns the
    /// highest token after the statement (equal to `token` iff accepted).
    /// The returned value is durable: the statement has committed.
    pub async fn record(&self, key: &str, token: i64) -> Result<i64, StoreError> {
        dispatch!(self, s => s.decide(key, token).await)
    }

    /// The bound on every operation (`[store] timeout_ms`).
    pub fn timeout(&self) -> Duration {
        dispatch!(self, s => s.timeout())
    }

    /// `shared` mode: several instances write this store.
    pub fn is_shared(&self) -> bool {
        matches!(self, Self::Postgres(s) if s.is_shared())
    }

    /// How long after a call gave up on it a statement may still commit on
    /// the store's side: a caller that saw a timeout must treat the outcome
    /// as unknown for this long.
    pub fn late_commit_bound(&self) -> Duration {
        // Both stores bound a statement by STATEMENT_TIMEOUTS x timeout on
        // their side (Postgres: statement_timeout; SQLite: busy_timeout per
        // statement, and a batch waits once for the write lock and once to
        // commit). Double it, plus a margin for a statement that reached the
        // server late.
        let timeout = dispatch!(self, s => s.timeout());
        timeout * (2 * STATEMENT_TIMEOUTS) + Duration::from_secs(5)
    }

    /// Fails when this instance may not write the store now (in `single`
    /// mode on Postgres: the single-writer lock is not held on a writable
    /// primary). An atomic load and a clock read: cheap enough for every
    /// decision, including the ones made from memory.
    pub fn check_writer(&self) -> Result<(), StoreError> {
        match self {
            Self::Postgres(s) => s.check_owner(),
            Self::Sqlite(_) => Ok(()),
        }
    }

    /// `single` mode on Postgres: counts the acquisitions of the
    /// single-writer lock. Between two of them another instance may have
    /// written the store, so memory that was exact under one is not under
    /// the next (see `gate`). `None` where the lock cannot be lost and taken
    /// again (SQLite's file lock lives as long as the process) or in
    /// `shared` mode.
    pub fn writer_generation(&self) -> Option<std::sync::Arc<std::sync::atomic::AtomicU64>> {
        match self {
            Self::Postgres(s) => s.writer_generation(),
            Self::Sqlite(_) => None,
        }
    }

    /// How long after its last confirmation this instance may still decide
    /// writes as the single writer ([`OWNER_LEASE`] on Postgres in `single`
    /// mode). A successor that finds the previous run unfinished must wait
    /// this much longer than the crashed instance's forwards could last.
    pub fn writer_lease(&self) -> Duration {
        match self {
            Self::Postgres(s) if !s.is_shared() => OWNER_LEASE,
            _ => Duration::ZERO,
        }
    }

    /// Single mode: records that an instance runs on this store, and
    /// `longest_timeout`, its longest route timeout. After an unclean stop
    /// (a crash) answers the stopped instance's recorded bound: its
    /// forwards may reach the upstream until then. Shared mode keeps
    /// per-write markers instead and always answers `None`.
    pub async fn begin_run(
        &self,
        longest_timeout: Duration,
    ) -> Result<Option<Duration>, StoreError> {
        match self {
            Self::Postgres(s) if s.is_shared() => Ok(None),
            Self::Postgres(s) => s.begin_run(longest_timeout).await,
            Self::Sqlite(s) => s.begin_run(longest_timeout).await,
        }
    }

    /// Single mode: raises the recorded longest route timeout (see
    /// [`FenceStore::begin_run`]) before a reload lets writes run as long.
    pub async fn raise_run_bound(&self, longest_timeout: Duration) -> Result<(), StoreError> {
        if self.is_shared() {
            return Ok(());
        }
        self.check_writer()?;
        let longest = millis(longest_timeout);
        bounded(self.timeout(), StoreError::Timeout, async {
            sql::on_backend!(
                self,
                (
                    "UPDATE gateway_state \
                     SET longest_timeout_ms = greatest(longest_timeout_ms, $1) WHERE id = 1",
                    "UPDATE gateway_state \
                     SET longest_timeout_ms = max(longest_timeout_ms, ?1) WHERE id = 1"
                ),
                |pool, sql| {
                    sqlx::query(sql).bind(longest).execute(pool).await?;
                }
            );
            Ok(())
        })
        .await
    }

    /// Single mode: records a clean stop (nothing in flight).
    pub async fn end_run(&self) -> Result<(), StoreError> {
        match self {
            Self::Postgres(s) if s.is_shared() => Ok(()),
            Self::Postgres(s) => s.end_run().await,
            Self::Sqlite(s) => s.end_run().await,
        }
    }

    /// Cheap reachability check.
    pub async fn ping(&self) -> Result<(), StoreError> {
        dispatch!(self, s => s.ping().await)
    }

    /// What `/readyz` reports: reachable, writable, the single-writer lock,
    /// and on Postgres the durability check, from one round trip.
    pub async fn readiness(&self) -> StoreReadiness {
        match self {
            Self::Postgres(s) => s.readiness().await,
            Self::Sqlite(s) => {
                let answer = s.ping().await;
                StoreReadiness {
                    backend: "sqlite",
                    mode: "single",
                    server: match answer {
                        Ok(()) => readiness::ServerState::Writable,
                        Err(_) => readiness::ServerState::Unreachable,
                    },
                    detail: answer.err().map(|e| e.to_string()),
                    writer_lock: None,
                    durability: None,
                }
            }
        }
    }

    /// Closes the pools (and releases the single-writer lock).
    pub async fn close(&self) {
        dispatch!(self, s => s.close().await)
    }
}

/// Whether a statement failed because an integer went past the largest
/// bigint (a fence of 9223372036854775807 plus one): Postgres's
/// `numeric_value_out_of_range`, or SQLite's refusal to store the REAL it
/// turns the sum into in a STRICT table's INTEGER column.
pub fn is_overflow(e: &sqlx::Error) -> bool {
    let Some(db) = e.as_database_error() else {
        return false;
    };
    match db.code().as_deref() {
        Some("22003") => true,
        // SQLITE_CONSTRAINT_DATATYPE
        Some("3091") => true,
        _ => db
            .message()
            .contains("cannot store REAL value in INTEGER column"),
    }
}

/// A statement may run on the store's side for this many times the
/// configured `timeout_ms` before the store itself gives up on it.
pub(crate) const STATEMENT_TIMEOUTS: u32 = 2;

/// Runs `fut` for at most `limit`, the bound on every call to the store and
/// to a lock backend's servers: one that hangs turns into a prompt error
/// (`timed_out(limit)`) instead of a pile of stuck requests.
pub(crate) async fn bounded<T, E>(
    limit: Duration,
    timed_out: impl FnOnce(Duration) -> E,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(timed_out(limit)),
    }
}

/// The migrations a binary carries, made to run against a database that
/// later binaries have migrated further: their migrations are applied in
/// order and skipped once applied (checksums checked), and a migration
/// the binary does not know is not an error. Migrations keep what the
/// versions before them call working (functions replaced with the same
/// signatures and outcomes, tables and columns added with defaults; none
/// drops or renames anything since Postgres's 0005), so during a rolling
/// upgrade, or after a roll back, an instance of the earlier version that
/// restarts after a later one migrated the store must still start, and
/// sqlx's default refuses to start it (`VersionMissing`).
pub(super) fn accepting_later_migrations(
    mut migrator: sqlx::migrate::Migrator,
) -> sqlx::migrate::Migrator {
    migrator.set_ignore_missing(true);
    migrator
}

/// How long `fencegate migrate` waits for the store: to connect, for a
/// lock another session holds, and for each statement.
const MIGRATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Applies the migrations for the backend a URL names, then exits; used by
/// `fencegate migrate`.
pub async fn migrate_url(url: &str) -> Result<(), StoreError> {
    if let Some(rest) = url.strip_prefix("sqlite:") {
        let path = rest.strip_prefix("//").unwrap_or(rest);
        sqlite::migrate_path(std::path::Path::new(path)).await
    } else {
        postgres::migrate_url(url).await
    }
}

/// A duration as the store's milliseconds (saturating).
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The store's milliseconds as a duration (a negative value as none).
fn from_millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
