//! Postgres: the production store.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

use tokio::task::JoinHandle;

use super::sql::highest_token;
use super::{bounded, StoreError};
use crate::config::{redact_url, StoreConfig};

/// Advisory locks use the two-int4 form with this first half, so they never
/// collide with an application's one-bigint locks or with other namespaces.
/// ("FGAT" in ASCII.)
pub const LOCK_NAMESPACE: i32 = 0x4647_4154;
/// Second half of the single-writer lock.
const SINGLE_WRITER_ID: i32 = 1;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

/// Next fence for a lock name: above every fence issued for it and above the
/// highest token recorded for the resource key of the same name.
#[rustfmt::skip]
const ISSUE_FENCE: &str = concat!("\
INSERT INTO locks AS l (name, fence)
VALUES ($1, ", highest_token!("$1"), " + 1)
ON CONFLICT (name) DO UPDATE
    SET fence = GREATEST(l.fence, ", highest_token!("$1"), ") + 1
RETURNING fence");

/// The highest fence a grant for this name must exceed.
#[rustfmt::skip]
const FENCE_FLOOR: &str = concat!("\
SELECT GREATEST(
    COALESCE((SELECT fence FROM locks WHERE name = $1), 0),
    ", highest_token!("$1"), ")");

/// Records a fence issued elsewhere (Redis) if it is above the floor;
/// returns a row only when it was.
#[rustfmt::skip]
const RECORD_FENCE: &str = concat!("\
INSERT INTO locks AS l (name, fence)
SELECT $1, $2
 WHERE $2 > ", highest_token!("$1"), "
ON CONFLICT (name) DO UPDATE
    SET fence = EXCLUDED.fence
    WHERE l.fence < EXCLUDED.fence
RETURNING fence");

/// A batch of decisions in one statement. Keys are deduplicated keeping
/// the highest token (ON CONFLICT may not touch a row twice) and locked in
/// key order, so concurrent batches cannot deadlock. Only the keys the batch
/// inserted or raised come back; the caller reads the others (their token
/// was already at least as high) in a second statement. Raising is the
/// common case: stale tokens are mostly refused from memory before they get
/// here, so the second statement is rare, and the first stays a plain
/// index-driven upsert with no joins.
const RECORD_BATCH: &str = "\
INSERT INTO fences AS f (resource_key, highest_token, updated_at)
SELECT k, max(t), now() FROM UNNEST($1::text[], $2::bigint[]) AS i(k, t)
 GROUP BY k ORDER BY k
ON CONFLICT (resource_key) DO UPDATE
    SET highest_token = EXCLUDED.highest_token, updated_at = now()
    WHERE f.highest_token < EXCLUDED.highest_token
RETURNING f.resource_key, f.highest_token";

/// Largest batch; beyond it, requests wait for the next one.
const MAX_BATCH: usize = 256;
/// Batches in flight at once. One: while it commits, the next batch fills
/// up, and Postgres pays its per-statement and per-commit cost once per
/// batch. Measured with 64 clients raising tokens on this 2-core machine
/// (BENCHMARKS.md): Postgres CPU per decision 122 us with 4 in flight, ~90
/// with 2, ~60 with 1, at higher throughput; a lone request still runs at
/// once as a batch of one.
const BATCHES_IN_FLIGHT: usize = 1;

#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    /// Group commit for `record`, in single mode only: shared-mode writes
    /// are decided by `enter`, one statement each on a key-lock connection.
    batcher: Option<super::batch::Batcher>,
    /// `shared` mode: connections that hold the per-key advisory locks for
    /// the life of a forward, one per fenced write in flight.
    key_locks: Option<KeyLockPool>,
    /// Bound on every operation, including waiting for a pooled connection.
    timeout: Duration,
    /// Present in `single` mode: the advisory lock that makes this instance
    /// the only writer. Decisions are refused while it is not held.
    owner: Option<Arc<OwnerLock>>,
}

impl PgStore {
    pub async fn open(cfg: &StoreConfig, single: bool) -> Result<Self, StoreError> {
        let opts = connect_options(&cfg.url, cfg.timeout)?;
        let key_locks = if single {
            None
        } else {
            Some(KeyLockPool::new(&opts, cfg))
        };
        let pool = PgPoolOptions::new()
            .max_connections(cfg.pool_size)
            .acquire_timeout(cfg.timeout)
            .connect_with(opts.clone())
            .await
            .map_err(|e| {
                StoreError::Other(format!("cannot connect to {}: {e}", redact_url(&cfg.url)))
            })?;
        MIGRATOR.run(&pool).await?;
        let owner = if single {
            Some(OwnerLock::acquire(opts, cfg.timeout).await?)
        } else {
            None
        };
        let batcher = single.then(|| {
            let pool = pool.clone();
            super::batch::Batcher::spawn(MAX_BATCH, BATCHES_IN_FLIGHT, cfg.timeout, move |items| {
                let pool = pool.clone();
                async move { record_batch(&pool, items).await }
            })
        });
        Ok(Self {
            pool,
            batcher,
            key_locks,
            timeout: cfg.timeout,
            owner,
        })
    }

    /// Fails when, in `single` mode, the single-writer lock is not held.
    pub fn check_owner(&self) -> Result<(), StoreError> {
        match &self.owner {
            Some(o) if !o.held.load(Ordering::Acquire) => Err(StoreError::NotOwner),
            _ => Ok(()),
        }
    }

    /// One decision, group-committed with concurrent ones (see `batch`).
    pub async fn record(&self, key: &str, token: i64) -> Result<i64, StoreError> {
        self.check_owner()?;
        match &self.batcher {
            Some(b) => b.record(key, token).await,
            // Shared mode decides in `enter`, with the key's lock held.
            None => Err(StoreError::Other(
                "record is for single mode; shared mode decides in enter".into(),
            )),
        }
    }

    pub async fn issue_fence(&self, name: &str) -> Result<i64, StoreError> {
        self.check_owner()?;
        bounded(self.timeout, StoreError::Timeout, async {
            Ok(sqlx::query_scalar(ISSUE_FENCE)
                .bind(name)
                .fetch_one(&self.pool)
                .await?)
        })
        .await
    }

    pub async fn fence_floor(&self, name: &str) -> Result<i64, StoreError> {
        bounded(self.timeout, StoreError::Timeout, async {
            Ok(sqlx::query_scalar(FENCE_FLOOR)
                .bind(name)
                .fetch_one(&self.pool)
                .await?)
        })
        .await
    }

    pub async fn record_fence(&self, name: &str, fence: i64) -> Result<bool, StoreError> {
        self.check_owner()?;
        bounded(self.timeout, StoreError::Timeout, async {
            let raised: Option<i64> = sqlx::query_scalar(RECORD_FENCE)
                .bind(name)
                .bind(fence)
                .fetch_optional(&self.pool)
                .await?;
            Ok(raised.is_some())
        })
        .await
    }

    /// Shared mode: admits a fenced write of `token` on `key` across every
    /// instance (`fencegate_enter`: see migrations/postgres/0003 and 0005).
    /// On success the returned lock must be held until the write has
    /// finished at the upstream; `hold` bounds how long a crashed holder's
    /// write may be assumed in flight.
    /// `record`: a first use of an `Idempotency-Key`, whose in-flight
    /// record is written in the same statement (`fencegate_enter_keyed`,
    /// migrations/postgres/0009), so in the same transaction and commit as
    /// the fence's marker; [`Entered::Duplicate`] when a live record of the
    /// key exists.
    pub async fn enter(
        &self,
        key: &str,
        token: i64,
        hold: Duration,
        record: Option<&super::Begin<'_>>,
    ) -> Result<Entered, StoreError> {
        let key_locks = self
            .key_locks
            .as_ref()
            .ok_or_else(|| StoreError::Other("enter() needs mode = \"shared\"".into()))?;
        key_locks
            .enter(key, token, hold, record, self.timeout)
            .await
    }

    /// Marks the store as in use by a running single-mode instance; returns
    /// whether the previous instance stopped cleanly.
    pub async fn begin_run(&self) -> Result<bool, StoreError> {
        bounded(self.timeout, StoreError::Timeout, async {
            let was_running: Option<bool> =
                sqlx::query_scalar("SELECT running FROM gateway_state WHERE id = 1")
                    .fetch_optional(&self.pool)
                    .await?;
            sqlx::query(
                "INSERT INTO gateway_state (id, running, changed_at) VALUES (1, true, now()) \
                 ON CONFLICT (id) DO UPDATE SET running = true, changed_at = now()",
            )
            .execute(&self.pool)
            .await?;
            Ok(was_running != Some(true))
        })
        .await
    }

    /// Marks a clean stop: nothing of ours is in flight any more.
    pub async fn end_run(&self) -> Result<(), StoreError> {
        bounded(self.timeout, StoreError::Timeout, async {
            sqlx::query(
                "UPDATE gateway_state SET running = false, changed_at = now() WHERE id = 1",
            )
            .execute(&self.pool)
            .await?;
            Ok(())
        })
        .await
    }

    /// The bound on every operation (`[store] timeout_ms`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// True in `shared` mode.
    pub fn is_shared(&self) -> bool {
        self.key_locks.is_some()
    }

    /// The pool, for the table lock backend.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.check_owner()?;
        bounded(self.timeout, StoreError::Timeout, async {
            sqlx::query("SELECT 1").execute(&self.pool).await?;
            Ok(())
        })
        .await
    }

    pub async fn close(&self) {
        if let Some(o) = &self.owner {
            o.task.abort();
        }
        if let Some(g) = &self.key_locks {
            g.pool.close().await;
        }
        self.pool.close().await;
    }
}

fn connect_options(url: &str, timeout: Duration) -> Result<PgConnectOptions, StoreError> {
    let opts: PgConnectOptions = url
        .parse()
        .map_err(|e| StoreError::Other(format!("bad store URL {}: {e}", redact_url(url))))?;
    // A server-side bound too, so an abandoned statement does not hold row
    // locks long after the client gave up on it. And synchronous_commit on,
    // whatever the server or role default says: a decision must be on disk
    // before it is acknowledged, or the fence table could go backwards after
    // a crash.
    let ms = (timeout * super::STATEMENT_TIMEOUTS)
        .as_millis()
        .to_string();
    Ok(opts.application_name("fencegate").options([
        ("statement_timeout", ms.as_str()),
        ("synchronous_commit", "on"),
    ]))
}

/// The single-writer lock: a session advisory lock held on a connection we
/// own for the life of the process (never a pooled one, which a transaction
/// pooler could hand to someone else).
pub struct OwnerLock {
    /// False while the lock connection is gone; decisions answer 503 then.
    held: AtomicBool,
    /// Watches the lock connection and takes the lock again after an outage.
    task: JoinHandle<()>,
}

impl OwnerLock {
    async fn acquire(opts: PgConnectOptions, timeout: Duration) -> Result<Arc<Self>, StoreError> {
        let conn = match try_lock(&opts, timeout).await {
            Ok(Some(conn)) => conn,
            Ok(None) => {
                return Err(StoreError::Other(
                    "another fencegate instance in \"single\" mode is using this store; \
                     stop it first, or run every instance with [store] mode = \"shared\""
                        .into(),
                ))
            }
            Err(e) => return Err(e),
        };
        let held = AtomicBool::new(true);
        let (tx, rx) = tokio::sync::oneshot::channel::<Arc<OwnerLock>>();
        let task = tokio::spawn(async move {
            let Ok(me) = rx.await else { return };
            watch(me, conn, opts, timeout).await;
        });
        let lock = Arc::new(Self { held, task });
        let _ = tx.send(lock.clone());
        Ok(lock)
    }
}

async fn try_lock(
    opts: &PgConnectOptions,
    timeout: Duration,
) -> Result<Option<PgConnection>, StoreError> {
    bounded(timeout, StoreError::Timeout, async {
        let mut conn = PgConnection::connect_with(opts).await?;
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
            .bind(LOCK_NAMESPACE)
            .bind(SINGLE_WRITER_ID)
            .fetch_one(&mut conn)
            .await?;
        Ok(got.then_some(conn))
    })
    .await
}

/// Pings the lock connection every second. When it breaks, the session (and
/// with it the lock) is gone: stop deciding at once, then reconnect and take
/// the lock again, unless another instance took it meanwhile.
async fn watch(
    me: Arc<OwnerLock>,
    mut conn: PgConnection,
    opts: PgConnectOptions,
    timeout: Duration,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let alive = tokio::time::timeout(timeout, conn.ping()).await;
        if matches!(alive, Ok(Ok(()))) {
            continue;
        }
        me.held.store(false, Ordering::Release);
        tracing::error!("lost the store connection holding the single-writer lock; fenced writes answer 503 until it is back");
        loop {
            tick.tick().await;
            match try_lock(&opts, timeout).await {
                Ok(Some(c)) => {
                    conn = c;
                    me.held.store(true, Ordering::Release);
                    tracing::info!("single-writer lock taken again; fenced writes resume");
                    break;
                }
                Ok(None) => tracing::error!(
                    "another fencegate instance took the single-writer lock of this store; this instance keeps answering 503"
                ),
                Err(e) => tracing::warn!(error = %e, "store still unreachable"),
            }
        }
    }
}

pub async fn migrate_url(url: &str) -> Result<(), StoreError> {
    let opts = connect_options(url, Duration::from_secs(30))?;
    let mut conn = PgConnection::connect_with(&opts).await?;
    MIGRATOR.run(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

/// What `enter` decided.
pub enum Entered {
    /// Admitted; hold the lock until the write has finished upstream. With
    /// an idempotency record to write, it is written.
    Admitted(KeyLock),
    /// A higher token is recorded.
    Stale(i64),
    /// A live idempotency record of the key exists (a concurrent duplicate
    /// wrote it first): not admitted, no lock held, nothing written but
    /// perhaps the token.
    Duplicate,
}

/// The per-key lock connections of `shared` mode.
///
/// Session advisory locks belong to a connection, so a write keeps its
/// connection out of the pool for as long as it is in flight: the pool size
/// bounds the fenced writes in flight per instance. The connections are ours
/// (never a transaction pooler's), and a connection whose state we are not
/// sure of is closed rather than returned, since closing is what releases
/// its locks.
#[derive(Clone)]
struct KeyLockPool {
    pool: PgPool,
    /// Longest a write waits for writes of older tokens (on any instance)
    /// to finish; past it, 503.
    wait: Duration,
}

impl KeyLockPool {
    fn new(opts: &PgConnectOptions, cfg: &StoreConfig) -> Self {
        let lock_timeout = format!("{}ms", cfg.key_lock_wait.as_millis());
        // The waits happen inside Postgres (pg_advisory_lock): bound them
        // there with lock_timeout, so a wait ends with an error on a healthy
        // connection instead of a cancelled query on a connection that might
        // still take the lock later.
        let opts = opts
            .clone()
            .application_name("fencegate-key-locks")
            .options([
                ("statement_timeout", "0"),
                ("lock_timeout", lock_timeout.as_str()),
                ("synchronous_commit", "on"),
            ]);
        let pool = PgPoolOptions::new()
            .max_connections(cfg.key_lock_connections)
            .acquire_timeout(cfg.timeout)
            .connect_lazy_with(opts);
        Self {
            pool,
            wait: cfg.key_lock_wait,
        }
    }

    async fn enter(
        &self,
        key: &str,
        token: i64,
        hold: Duration,
        record: Option<&super::Begin<'_>>,
        timeout: Duration,
    ) -> Result<Entered, StoreError> {
        let deadline = tokio::time::Instant::now() + self.wait + timeout;
        loop {
            let mut conn = bounded(timeout, StoreError::Timeout, async {
                Ok(self.pool.acquire().await?)
            })
            .await?;
            // The statement starts on the server after this; with the time
            // it reports between its start and the marker, this gives a
            // local lower bound of the marker's end.
            let sent_at = std::time::Instant::now();
            let query = match record {
                None => sqlx::query_as::<_, (String, i64, i64, i64)>(
                    "SELECT outcome, highest, wait_ms, entered_ms FROM fencegate_enter($1, $2, $3)",
                )
                .bind(key)
                .bind(token)
                .bind(hold.as_millis() as i64),
                Some(r) => sqlx::query_as::<_, (String, i64, i64, i64)>(
                    "SELECT outcome, highest, wait_ms, entered_ms \
                       FROM fencegate_enter_keyed($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                )
                .bind(key)
                .bind(token)
                .bind(hold.as_millis() as i64)
                .bind(r.id.route)
                .bind(r.id.method)
                .bind(r.id.key)
                .bind(r.fingerprint)
                .bind(r.attempt)
                .bind(r.in_flight.as_millis() as i64)
                .bind(r.ttl.as_millis() as i64),
            }
            .fetch_one(&mut *conn);
            let answer = match tokio::time::timeout_at(deadline, query).await {
                Ok(Ok(a)) => a,
                Ok(Err(e)) => {
                    // Any error (lock_timeout, a broken connection): this
                    // session's lock state is unknown, so close it.
                    conn.close_on_drop();
                    let lock_timeout = e
                        .as_database_error()
                        .and_then(|d| d.code())
                        .is_some_and(|c| c == "55P03");
                    return Err(if lock_timeout {
                        StoreError::KeyBusy(self.wait)
                    } else {
                        e.into()
                    });
                }
                Err(_) => {
                    conn.close_on_drop();
                    return Err(StoreError::Timeout(self.wait + timeout));
                }
            };
            match answer.0.as_str() {
                "ok" => {
                    let entered_at = sent_at + Duration::from_millis(answer.3.max(0) as u64);
                    return Ok(Entered::Admitted(KeyLock {
                        conn: Some(conn),
                        key: key.to_string(),
                        token,
                        timeout,
                        runtime: tokio::runtime::Handle::try_current().ok(),
                        entered_at,
                        marker_until: entered_at + hold,
                    }));
                }
                "stale" => return Ok(Entered::Stale(answer.1)),
                "duplicate" => return Ok(Entered::Duplicate),
                _ => {
                    // "wait": writers that never left may still arrive.
                    drop(conn);
                    let nap = Duration::from_millis(answer.2.max(1) as u64);
                    if tokio::time::Instant::now() + nap > deadline {
                        return Err(StoreError::Timeout(self.wait + timeout));
                    }
                    tokio::time::sleep(nap).await;
                }
            }
        }
    }
}

/// A key's shared advisory lock, held by a fenced write in flight. Dropping
/// it leaves (decrements the in-flight marker and unlocks) in the background;
/// if that fails, the connection is closed, which releases the lock too.
pub struct KeyLock {
    conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    key: String,
    token: i64,
    timeout: Duration,
    /// The runtime the connection was taken on, where it must be used again:
    /// the lock is often dropped on a worker thread (with the relayed
    /// response body), whose runtime may end before the leave has run.
    runtime: Option<tokio::runtime::Handle>,
    /// A local lower bound of the moment the admitting statement wrote the
    /// in-flight marker (and, for a keyed write, then its idempotency
    /// record).
    entered_at: std::time::Instant,
    /// A local lower bound of the end of the in-flight marker the admitting
    /// statement wrote (earlier attempts that were told to wait do not
    /// count): if this instance crashes, other instances consider its write
    /// over then, so the forward must be over by this.
    marker_until: std::time::Instant,
}

impl KeyLock {
    /// See the field.
    pub fn marker_until(&self) -> std::time::Instant {
        self.marker_until
    }

    /// See the field.
    pub fn entered_at(&self) -> std::time::Instant {
        self.entered_at
    }
}

impl KeyLock {
    /// The write ended abnormally and the upstream may still be at work on
    /// it until the forward's deadline. Instead of holding this connection
    /// (and so one of the few key-lock connections) that long, close it:
    /// Postgres releases the advisory lock, while the in-flight marker
    /// stays (no `fencegate_leave`), so other instances see a writer that
    /// never left and hold the key until its `writer_until` — the same path
    /// as after a crash, which the marker outlasts the deadline for.
    pub fn abandon(mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.close_on_drop();
        }
    }
}

impl Drop for KeyLock {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let Some(rt) = self.runtime.take() else {
            conn.close_on_drop();
            return;
        };
        let (key, token, timeout) = (std::mem::take(&mut self.key), self.token, self.timeout);
        rt.spawn(async move {
            let left = tokio::time::timeout(
                timeout,
                sqlx::query("SELECT fencegate_leave($1, $2)")
                    .bind(&key)
                    .bind(token)
                    .execute(&mut *conn),
            )
            .await;
            if !matches!(left, Ok(Ok(_))) {
                conn.close_on_drop();
            }
        });
    }
}

/// Runs one batch of decisions and answers each key's highest token.
async fn record_batch(
    pool: &PgPool,
    items: Vec<(String, i64)>,
) -> Result<super::batch::Answers, StoreError> {
    let wanted = super::batch::max_per_key(&items);
    let (keys, tokens): (Vec<&str>, Vec<i64>) = items.iter().map(|(k, t)| (k.as_str(), *t)).unzip();
    let rows: Vec<(String, i64)> = sqlx::query_as(RECORD_BATCH)
        .bind(&keys)
        .bind(&tokens)
        .fetch_all(pool)
        .await?;
    let mut answers = super::batch::Answers::with_capacity(wanted.len());
    answers.extend(rows);
    // Keys not raised by the batch: their committed token is already at
    // least what was asked. Read it now, after our commit.
    let recheck: Vec<&str> = wanted
        .keys()
        .copied()
        .filter(|k| !answers.contains_key(*k))
        .collect();
    if !recheck.is_empty() {
        let fresh: Vec<(String, i64)> = sqlx::query_as(
            "SELECT resource_key, highest_token FROM fences WHERE resource_key = ANY($1)",
        )
        .bind(&recheck)
        .fetch_all(pool)
        .await?;
        answers.extend(fresh);
    }
    Ok(answers)
}
