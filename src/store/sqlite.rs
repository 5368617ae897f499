//! SQLite: the embedded, zero-setup store for a single instance.
//!
//! Durability: WAL journal with `synchronous = FULL`, so a commit is on disk
//! before the decision returns (`NORMAL` would lose recent commits on power
//! loss, and a fence table must never go backwards).
//!
//! One connection does all the work. SQLite has one writer anyway; a single
//! connection avoids busy-lock retries and keeps the two statements of a
//! refused decision (upsert, then read) free of interleavings.
//!
//! A statement that writes outside an explicit transaction is run with
//! `fetch_all`, never `fetch_one` or `fetch_optional`, even when it returns
//! one row: with a row limit sqlx stops stepping after the first row and
//! resets the statement, which commits but discards the commit's error.
//! Stepping to the end reports a failed commit instead of acknowledging it.
//! (Batches commit with an explicit `COMMIT`, whose error is reported.)

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, SqlitePool};

use super::batch::Decision;
use super::sql::sqlite_now_ms;
use super::{bounded, StoreError};
use crate::config::StoreConfig;

/// This backend's migrations (see [`super::accepting_later_migrations`]).
fn migrator() -> sqlx::migrate::Migrator {
    super::accepting_later_migrations(sqlx::migrate!("migrations/sqlite"))
}

/// After an unclean stop the stored bound is kept if larger: a crash
/// during the successor's wait must still wait it out.
#[rustfmt::skip]
const BEGIN_RUN: &str = concat!("\
INSERT INTO gateway_state (id, running, changed_at, longest_timeout_ms)
VALUES (1, 1, ", sqlite_now_ms!(), ", ?1)
ON CONFLICT (id) DO UPDATE SET running = 1, changed_at = excluded.changed_at,
    longest_timeout_ms = CASE WHEN gateway_state.running = 1
        THEN max(gateway_state.longest_timeout_ms, excluded.longest_timeout_ms)
        ELSE excluded.longest_timeout_ms END");

#[rustfmt::skip]
const END_RUN: &str = concat!("\
UPDATE gateway_state SET running = 0, changed_at = ", sqlite_now_ms!(), " WHERE id = 1");

#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// Group commit for `record`: one transaction (one fsync) per batch.
    batcher: super::batch::Fences,
    /// Group commit of Idempotency-Key records (see `store::idempotency`).
    records: super::record_batch::RecordBatcher,
    timeout: Duration,
    /// An exclusive lock on `<file>.lock`, held for the life of the process,
    /// so a second instance cannot write the same file. Dropped with the last
    /// clone of the store.
    _owner: Arc<File>,
}

impl SqliteStore {
    pub async fn open(path: &Path, cfg: &StoreConfig) -> Result<Self, StoreError> {
        let owner = lock_file(path)?;
        let pool = pool(path, connect_options(path, cfg.timeout), cfg.timeout).await?;
        migrator().run(&pool).await?;
        // One batch at a time: SQLite has one writer (and we one connection).
        let batcher = {
            let pool = pool.clone();
            super::batch::Fences::spawn(super::batch::MAX_BATCH, cfg.timeout, move |items| {
                let pool = pool.clone();
                async move { record_batch(&pool, items).await }
            })
        };
        let records = {
            let pool = pool.clone();
            super::batch::Batcher::spawn(super::batch::MAX_BATCH, cfg.timeout, move |items| {
                let pool = pool.clone();
                async move { super::record_batch::sqlite_records_batch(&pool, items).await }
            })
        };
        Ok(Self {
            pool,
            batcher,
            records,
            timeout: cfg.timeout,
            _owner: Arc::new(owner),
        })
    }

    /// The batcher of Idempotency-Key records.
    pub(super) fn record_batcher(&self) -> &super::record_batch::RecordBatcher {
        &self.records
    }

    /// See `PgStore::decide`; nothing here can lose the right to write.
    pub(super) async fn decide(&self, key: &str, token: i64) -> Result<i64, StoreError> {
        super::batch::decide(&self.batcher, key, token).await
    }

    /// See `PgStore::begin_run`.
    pub async fn begin_run(
        &self,
        longest_timeout: Duration,
    ) -> Result<Option<Duration>, StoreError> {
        bounded(self.timeout, StoreError::Timeout, async {
            let before: Option<(i64, i64)> = sqlx::query_as(
                "SELECT running, longest_timeout_ms FROM gateway_state WHERE id = 1",
            )
            .fetch_optional(&self.pool)
            .await?;
            sqlx::query(BEGIN_RUN)
                .bind(super::millis(longest_timeout))
                .fetch_all(&self.pool)
                .await?;
            Ok(before.and_then(|(running, ms)| (running == 1).then(|| super::from_millis(ms))))
        })
        .await
    }

    /// See `PgStore::end_run`.
    pub async fn end_run(&self) -> Result<(), StoreError> {
        bounded(self.timeout, StoreError::Timeout, async {
            sqlx::query(END_RUN).fetch_all(&self.pool).await?;
            Ok(())
        })
        .await
    }

    /// The bound on every operation (`[store] timeout_ms`), also SQLite's
    /// busy timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The pool, for the table lock backend.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        bounded(self.timeout, StoreError::Timeout, async {
            sqlx::query("SELECT 1").execute(&self.pool).await?;
            Ok(())
        })
        .await
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// How the store connects to the file at `path`: WAL, and every commit
/// synced before it is acknowledged.
fn connect_options(path: &Path, timeout: Duration) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(timeout)
}

/// The store's one connection to `path`, with `opts`; waits up to `timeout`
/// for it.
async fn pool(
    path: &Path,
    opts: SqliteConnectOptions,
    timeout: Duration,
) -> Result<SqlitePool, StoreError> {
    // One connection: SQLite has one writer at a time anyway. It is not
    // pinged before each use (sqlx's default): a connection to a file
    // cannot break unseen as a socket can, and the ping is a round trip to
    // the connection's thread before every statement.
    SqlitePoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .acquire_timeout(timeout)
        .connect_with(opts)
        .await
        .map_err(|e| StoreError::Other(format!("cannot open {}: {e}", path.display())))
}

fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

fn lock_file(path: &Path) -> Result<File, StoreError> {
    let lp = lock_path(path);
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lp)
        .map_err(|e| StoreError::Other(format!("cannot open {}: {e}", lp.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Other(format!(
            "another fencegate instance is using {} (its lock file {} is held); \
             a SQLite store serves one instance",
            path.display(),
            lp.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => Err(StoreError::Other(format!(
            "cannot lock {}: {e}",
            lp.display()
        ))),
    }
}

/// `fencegate migrate` for a SQLite URL. Takes the file lock too, so it does
/// not race a running gateway.
pub async fn migrate_path(path: &Path) -> Result<(), StoreError> {
    let _owner = lock_file(path)?;
    // No statement logging, as for Postgres's `migrate_url` (and why).
    let timeout = super::MIGRATE_TIMEOUT;
    let opts = connect_options(path, timeout).disable_statement_logging();
    let pool = pool(path, opts, timeout).await?;
    migrator().run(&pool).await?;
    pool.close().await;
    Ok(())
}

/// Runs one batch of decisions in one transaction and answers each key's
/// highest token. The answers are sent only after the commit (and its
/// fsync) succeeded.
async fn record_batch(
    pool: &SqlitePool,
    items: Vec<Decision>,
) -> Result<Vec<Option<i64>>, StoreError> {
    let wanted = super::batch::max_per_key(items.iter().map(|d| (d.key.as_str(), d.token)));
    let mut tx = pool.begin().await?;
    let mut answers = super::batch::Answers::with_capacity(wanted.len());
    for (&key, &token) in &wanted {
        answers.insert(
            key.to_string(),
            super::sql::decide_in(&mut tx, key, token).await?,
        );
    }
    tx.commit().await?;
    Ok(super::batch::in_item_order(&items, &answers))
}
