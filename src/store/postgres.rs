//! Postgres: the production store.
//!
//! # Failover
//!
//! `[store] url` may name a VIP, a DNS name or a TCP proxy in front of a
//! primary and its standbys, so the server behind one URL can change under a
//! running gateway. What keeps decisions right through that:
//!
//! * Every new connection, in every pool and the single-writer lock's own,
//!   asks the server whether it takes writes (`pg_is_in_recovery()`,
//!   `transaction_read_only`) before it is used. One that does not is
//!   closed: a standby's answer (its `stale`, say) never decides a write,
//!   and the pool keeps trying until a writable primary answers. A write
//!   refused later with SQLSTATE 25006 (a primary made read-only under open
//!   connections) is unavailable too (`StoreError::ReadOnly`).
//! * In `single` mode the single-writer lock is a session lock on one
//!   server. The watcher confirms every [`OWNER_CHECK`] that its session is
//!   alive on a writable primary, and each confirmation lets the instance
//!   decide for [`OWNER_LEASE`] from when it was asked, so a check that
//!   hangs (a partition without resets) stops decisions by itself. A check
//!   that outlives the store's timeout stops decisions, but the watcher
//!   keeps waiting for its answer (up to [`OWNER_PATIENCE`]) instead of
//!   giving the lock up: a late answer is what a machine that got no CPU
//!   for a while produces. After the
//!   session is gone the watcher takes the lock again, but only on a
//!   writable primary: an advisory lock on a standby excludes nobody writing
//!   the primary. Each acquisition starts a new generation: memory that was
//!   exact under the previous one is not trusted as exact any more (another
//!   instance may have written in between).
//! * Shared mode's in-flight markers are rows, so they fail over with the
//!   fences (see `admissions`).
//!
//! Nothing of this costs a round trip per decision: the checks run once per
//! new connection and on the watcher's timer; a decision reads an atomic.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

use tokio::task::JoinHandle;

use super::admissions::Entered;
use super::batch::Decision;
use super::link::{Links, PING_AFTER_IDLE};
use super::readiness::{Probe, ServerState, StoreReadiness, WriterLock, PROBE};
use super::{bounded, StoreError};
use crate::config::{redact_url, StoreConfig};

/// Advisory locks use the two-int4 form with this first half, so they never
/// collide with an application's one-bigint locks or with other namespaces.
/// ("FGAT" in ASCII.)
pub const LOCK_NAMESPACE: i32 = 0x4647_4154;
/// Second half of the single-writer lock.
const SINGLE_WRITER_ID: i32 = 1;

/// How long one confirmation of the single-writer lock lets this instance
/// decide, counted from when the confirming query was sent. A successor
/// that found this instance's run unfinished waits this long on top of the
/// longest forward (see `app`), so decisions this instance made after its
/// lock was really gone cannot overlap the successor's.
pub const OWNER_LEASE: Duration = Duration::from_secs(2);
/// How often the lock's session is asked whether it still holds the lock
/// on a writable primary. Well inside the lease, so a loaded machine that
/// delays a check by a second does not stop decisions.
const OWNER_CHECK: Duration = Duration::from_millis(250);
/// How often a lost single-writer lock is tried again.
const OWNER_RETRY: Duration = Duration::from_millis(500);
/// How long the watcher waits for its session's answer to a check that
/// outlived the store's timeout, before it gives that session up. A late
/// answer is what a shared machine produces: a process or a server that
/// got no CPU for seconds (a virtual machine's steal, a paused container),
/// a network that stalls and recovers. Decisions stop at the timeout (and
/// the lease lapses anyway), so waiting longer decides nothing; it keeps
/// the lock on the session that holds it, where giving it up would make
/// the next acquisition a new generation (memory no longer trusted as
/// exact) and would have to wait for the server to end the old session.
/// Meanwhile the lock is tried on new sessions every [`OWNER_RETRY`], so a
/// failover to a primary where the lock is free is not held up by this.
const OWNER_PATIENCE: Duration = Duration::from_secs(30);
/// How long a starting instance keeps trying for a single-writer lock that
/// another session holds before it refuses to start. A predecessor killed a
/// moment ago (a crash, `kill -9`, a supervisor's restart) holds the lock
/// until its server process has read the closed connection and ended,
/// which takes a moment, longer on a loaded machine; an instance restarted
/// at once must not be refused for that. An instance that is alive keeps
/// the lock, and the new one is refused after this wait.
const HELD_AT_START: Duration = Duration::from_secs(3);
/// Between two tries within [`HELD_AT_START`].
const HELD_AT_START_RETRY: Duration = Duration::from_millis(100);

/// Whether the server takes writes, asked of every new connection.
const WRITABLE: &str =
    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'";

/// Takes the single-writer lock, but only on a writable primary (CASE
/// evaluates the branch it needs, so a standby's lock is never taken).
const TRY_OWNER_LOCK: &str = "\
SELECT pg_is_in_recovery(),
       current_setting('transaction_read_only') = 'on',
       CASE WHEN pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'
            THEN NULL
            ELSE pg_try_advisory_lock($1, $2) END";

/// This backend's migrations (see [`super::accepting_later_migrations`]).
fn migrator() -> sqlx::migrate::Migrator {
    super::accepting_later_migrations(sqlx::migrate!("migrations/postgres"))
}

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

#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    /// Group commit for `record`, in single mode only: shared-mode writes
    /// are decided by `enter` (see `admissions`).
    batcher: Option<super::batch::Fences>,
    /// Group commit of Idempotency-Key records, in single mode only (see
    /// `store::idempotency`).
    records: Option<super::idempotency::RecordBatcher>,
    /// The connections of the single-mode batchers, one set each: kept
    /// here to be closed with the pool.
    links: Vec<Arc<Links>>,
    /// `shared` mode: admissions and leaves of fenced writes across every
    /// instance, group-committed on connections of their own.
    admissions: Option<Arc<super::admissions::Admissions>>,
    /// Bound on every operation, including waiting for a pooled connection.
    timeout: Duration,
    /// Present in `single` mode: the advisory lock that makes this instance
    /// the only writer. Decisions are refused while it is not held.
    owner: Option<Arc<OwnerLock>>,
    /// What the latest connections learned about the server's writability.
    view: Arc<ServerView>,
    /// For `/readyz`'s own connection while the server looks read-only.
    opts: Arc<PgConnectOptions>,
}

impl PgStore {
    pub async fn open(cfg: &StoreConfig, single: bool) -> Result<Self, StoreError> {
        let opts = connect_options(&cfg.url, cfg.timeout)?;
        let view = Arc::new(ServerView::default());
        let pool = checked_pool(&view, cfg.pool_size, cfg.timeout)
            .connect_with(opts.clone())
            .await
            .map_err(|e| match view.read_only() {
                // The pool retried until its timeout; say what it found.
                Some(ro) => StoreError::Other(format!(
                    "{} is read-only: {ro}; point [store] url at the primary (or the address that follows it)",
                    redact_url(&cfg.url)
                )),
                None => {
                    StoreError::Other(format!("cannot connect to {}: {e}", redact_url(&cfg.url)))
                }
            })?;
        migrator().run(&pool).await?;
        let owner = if single {
            Some(OwnerLock::acquire(opts.clone(), cfg.timeout, view.clone()).await?)
        } else {
            None
        };
        warn_of_durability(&pool, cfg.timeout).await;
        // Every batcher runs its batches on connections of its own (see
        // `link`), and each outcome tells the view whether the server still
        // takes writes.
        let mut links = Vec::new();
        macro_rules! batcher {
            ($batcher:ty, $run:path) => {{
                let mine = Arc::new(Links::new(pool.clone()));
                links.push(mine.clone());
                let view = view.clone();
                <$batcher>::spawn(super::batch::MAX_BATCH, cfg.timeout, move |items| {
                    let (links, view) = (mine.clone(), view.clone());
                    async move {
                        let run = async {
                            let mut link = links.take().await?;
                            let answers = $run(&mut link, items).await;
                            if answers.is_ok() {
                                link.keep();
                            }
                            answers
                        };
                        view.learn(run.await)
                    }
                })
            }};
        }
        let batcher = single.then(|| batcher!(super::batch::Fences, record_batch));
        let admissions = (!single).then(|| Arc::new(admissions(&opts, cfg, &view)));
        let records = single.then(|| {
            batcher!(
                super::idempotency::RecordBatcher,
                super::idempotency::pg_records_batch
            )
        });
        Ok(Self {
            pool,
            batcher,
            records,
            links,
            admissions,
            timeout: cfg.timeout,
            owner,
            view,
            opts: Arc::new(opts),
        })
    }

    /// Fails when, in `single` mode, the single-writer lock is not held on a
    /// writable primary (as of a confirmation younger than [`OWNER_LEASE`]).
    pub fn check_owner(&self) -> Result<(), StoreError> {
        match &self.owner {
            Some(o) if !o.held() => Err(StoreError::NotOwner),
            _ => Ok(()),
        }
    }

    /// See `FenceStore::writer_generation`.
    pub fn writer_generation(&self) -> Option<Arc<AtomicU64>> {
        self.owner.as_ref().map(|o| o.generation.clone())
    }

    /// An error, explained by what connections learned: a pool that timed
    /// out because every server it reached was read-only reports that.
    /// Only failures to reach a server are explained: an error the server
    /// itself gave stays what it is.
    pub(super) fn explain(&self, e: StoreError) -> StoreError {
        let unreached = matches!(
            e,
            StoreError::Timeout(_)
                // The batcher passes its errors on as text.
                | StoreError::Other(_)
                | StoreError::Database(
                    sqlx::Error::PoolTimedOut
                        | sqlx::Error::Io(_)
                        | sqlx::Error::Configuration(_)
                        | sqlx::Error::Protocol(_)
                )
        );
        match self.view.read_only() {
            Some(ro) if unreached => StoreError::ReadOnly(ro),
            _ => e,
        }
    }

    /// Single mode: the batcher of Idempotency-Key records.
    pub(super) fn record_batcher(&self) -> Option<&super::idempotency::RecordBatcher> {
        self.records.as_ref()
    }

    /// One decision, group-committed with concurrent ones (see `batch`):
    /// the key's highest token after it.
    pub(super) async fn decide(&self, key: &str, token: i64) -> Result<i64, StoreError> {
        self.check_owner()?;
        match &self.batcher {
            Some(b) => super::batch::decide(b, key, token)
                .await
                .map_err(|e| self.explain(e)),
            // Shared mode decides in `enter`, with the key's lock held.
            None => Err(StoreError::Other(
                "record is for single mode; shared mode decides in enter".into(),
            )),
        }
    }

    /// Shared mode: admits a fenced write of `token` on `key` across every
    /// instance (see `admissions`).
    /// On success the returned [`InFlight`](super::admissions::InFlight) must be kept until the write
    /// has finished at the upstream; `hold` bounds how long a crashed
    /// instance's write may be assumed in flight.
    /// `record`: a first use of an `Idempotency-Key`, whose in-flight
    /// record is written in the same statement (`fencegate_enter_keyed`,
    /// migrations/postgres/0010), so in the same transaction and commit as
    /// the fence's marker; [`Entered::Duplicate`] when a live record of the
    /// key exists.
    pub async fn enter(
        &self,
        key: &str,
        token: i64,
        hold: Duration,
        record: Option<&super::Begin<'_>>,
    ) -> Result<Entered, StoreError> {
        let admissions = self
            .admissions
            .as_ref()
            .ok_or_else(|| StoreError::Other("enter() needs mode = \"shared\"".into()))?;
        admissions
            .enter(key, token, hold, record)
            .await
            .map_err(|e| self.explain(e))
    }

    /// Marks the store as in use by a running single-mode instance; returns
    /// whether the previous instance stopped cleanly.
    pub async fn begin_run(
        &self,
        longest_timeout: Duration,
    ) -> Result<Option<Duration>, StoreError> {
        self.check_owner()?;
        bounded(self.timeout, StoreError::Timeout, async {
            let before: Option<(bool, i64)> = sqlx::query_as(
                "SELECT running, longest_timeout_ms FROM gateway_state WHERE id = 1",
            )
            .fetch_optional(&self.pool)
            .await?;
            // After an unclean stop the stored bound is kept if larger: a
            // crash during this instance's wait must still wait it out.
            sqlx::query(
                "INSERT INTO gateway_state (id, running, changed_at, longest_timeout_ms) \
                 VALUES (1, true, now(), $1) \
                 ON CONFLICT (id) DO UPDATE SET running = true, changed_at = now(), \
                 longest_timeout_ms = CASE WHEN gateway_state.running \
                 THEN greatest(gateway_state.longest_timeout_ms, excluded.longest_timeout_ms) \
                 ELSE excluded.longest_timeout_ms END",
            )
            .bind(super::millis(longest_timeout))
            .execute(&self.pool)
            .await?;
            Ok(before.and_then(|(running, ms)| running.then(|| super::from_millis(ms))))
        })
        .await
    }

    /// Raises the running instance's recorded longest route timeout to
    /// `longest_timeout` (see `FenceStore::begin_run`), before a reload
    /// lets writes run that long.
    pub async fn raise_run_bound(&self, longest_timeout: Duration) -> Result<(), StoreError> {
        self.check_owner()?;
        bounded(self.timeout, StoreError::Timeout, async {
            sqlx::query(
                "UPDATE gateway_state \
                 SET longest_timeout_ms = greatest(longest_timeout_ms, $1) WHERE id = 1",
            )
            .bind(super::millis(longest_timeout))
            .execute(&self.pool)
            .await?;
            Ok(())
        })
        .await
    }

    /// Marks a clean stop: nothing of ours is in flight any more.
    pub async fn end_run(&self) -> Result<(), StoreError> {
        // Only the lock's holder may say that nothing of the single writer
        // is in flight: an instance that lost the lock to another must
        // leave the mark for that one's successor.
        self.check_owner()?;
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
        self.admissions.is_some()
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
        .map_err(|e| self.explain(e))
    }

    /// See `FenceStore::readiness`. The probe runs on a pooled connection,
    /// which passed the writability check when it was opened; the probe
    /// asks again, for a primary made read-only since. While the server
    /// looks read-only the pool would only retry (and refuse) connections
    /// until its timeout, so the probe opens one of its own and answers at
    /// once.
    pub async fn readiness(&self) -> StoreReadiness {
        let mut r = StoreReadiness {
            backend: "postgres",
            mode: if self.is_shared() { "shared" } else { "single" },
            server: ServerState::Writable,
            detail: None,
            writer_lock: self.owner.as_ref().map(|o| o.state()),
            durability: None,
        };
        let probed = match self.view.read_only() {
            None => probe(&self.pool, self.timeout).await,
            Some(_) => {
                let probed = bounded(self.timeout, StoreError::Timeout, async {
                    let mut conn = PgConnection::connect_with(&self.opts).await?;
                    let p = probe(&mut conn, self.timeout).await;
                    let _ = conn.close().await;
                    p
                })
                .await;
                if matches!(&probed, Ok(p) if !p.in_recovery && !p.read_only) {
                    self.view.saw(None);
                }
                probed
            }
        };
        match probed {
            Ok(p) => {
                let read_only = if p.in_recovery {
                    Some(ReadOnly::InRecovery)
                } else if p.read_only {
                    Some(ReadOnly::ReadOnlyTransactions)
                } else {
                    None
                };
                match read_only {
                    Some(ro) => {
                        r.server = ServerState::ReadOnly;
                        r.detail = Some(ro.to_string());
                    }
                    None => r.durability = Some(p.durability()),
                }
            }
            Err(e) => match self.explain(e) {
                StoreError::ReadOnly(ro) => {
                    r.server = ServerState::ReadOnly;
                    r.detail = Some(ro.to_string());
                }
                e => {
                    r.server = ServerState::Unreachable;
                    r.detail = Some(e.to_string());
                }
            },
        }
        r
    }

    pub async fn close(&self) {
        if let Some(o) = &self.owner {
            o.task.abort();
        }
        if let Some(a) = &self.admissions {
            a.drain().await;
            a.pool().close().await;
        }
        for l in &self.links {
            l.close().await;
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
    //
    // And no sequential scans where an index can serve. Every statement
    // here finds its rows by a primary key or an index, but the batch
    // statements are prepared once per connection, and after five runs
    // Postgres keeps a generic plan, planned against the table as it was
    // then. Planned against a new or small table (never analyzed: a few
    // pages), a join of a batch's rows with `idempotency` is a hash join
    // over a sequential scan, and the cached plan keeps scanning the whole
    // table as it grows, until autovacuum next analyzes it: measured, a
    // store answering first uses twice as slowly after 10 s of them, with
    // Postgres's CPU per first use at 125 us instead of 51. With
    // sequential scans off, the planner takes the index whatever the
    // table's size (a sequential scan stays possible where no index
    // applies: it only becomes the last resort).
    let ms = (timeout * super::STATEMENT_TIMEOUTS)
        .as_millis()
        .to_string();
    Ok(opts.application_name("fencegate").options([
        ("statement_timeout", ms.as_str()),
        ("synchronous_commit", "on"),
        ("enable_seqscan", "off"),
    ]))
}

/// Why a server takes no writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOnly {
    /// `pg_is_in_recovery()`: a standby, or one not promoted yet.
    InRecovery,
    /// `transaction_read_only` is on (`default_transaction_read_only`).
    ReadOnlyTransactions,
    /// A write failed with SQLSTATE 25006 (`read_only_sql_transaction`).
    WriteRefused,
}

impl std::fmt::Display for ReadOnly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReadOnly::InRecovery => "the server is in recovery (a standby, not the primary)",
            ReadOnly::ReadOnlyTransactions => {
                "the server takes only read-only transactions (default_transaction_read_only is on)"
            }
            ReadOnly::WriteRefused => "the server refused a write as read-only (SQLSTATE 25006)",
        })
    }
}

/// What the latest evidence said about the server behind the URL: set by
/// each new connection's check and by a write refused as read-only,
/// cleared by a connection that passed the check or a batch that committed.
/// It only explains failures (what a 503 and `/readyz` say): no decision
/// relies on it.
#[derive(Default)]
struct ServerView(AtomicU8);

impl ServerView {
    fn saw(&self, read_only: Option<ReadOnly>) {
        let code = match read_only {
            None => 0,
            Some(ReadOnly::InRecovery) => 1,
            Some(ReadOnly::ReadOnlyTransactions) => 2,
            Some(ReadOnly::WriteRefused) => 3,
        };
        // A load first: on the hot path (every committed batch) this stays
        // a read of a shared cache line.
        if self.0.load(Ordering::Relaxed) != code {
            self.0.store(code, Ordering::Relaxed);
        }
    }

    fn read_only(&self) -> Option<ReadOnly> {
        match self.0.load(Ordering::Relaxed) {
            1 => Some(ReadOnly::InRecovery),
            2 => Some(ReadOnly::ReadOnlyTransactions),
            3 => Some(ReadOnly::WriteRefused),
            _ => None,
        }
    }

    /// Notes what a statement's outcome says, and passes it on.
    fn learn<T>(&self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        match &r {
            Ok(_) => self.saw(None),
            Err(StoreError::ReadOnly(ro)) => self.saw(Some(*ro)),
            Err(_) => {}
        }
        r
    }
}

/// Asks a connection whether its server takes writes.
async fn writable(conn: &mut PgConnection) -> Result<Result<(), ReadOnly>, sqlx::Error> {
    let (in_recovery, read_only): (bool, bool) =
        sqlx::query_as(WRITABLE).fetch_one(&mut *conn).await?;
    Ok(if in_recovery {
        Err(ReadOnly::InRecovery)
    } else if read_only {
        Err(ReadOnly::ReadOnlyTransactions)
    } else {
        Ok(())
    })
}

/// Pool options whose connections are checked once, when opened: a
/// connection to a server that takes no writes is closed before anyone
/// uses it, and the pool keeps trying (until its acquire timeout) for one
/// that does. Checking on connect rather than before each use keeps the
/// decision path at one round trip; a primary made read-only under open
/// connections is caught by its 25006 instead.
///
/// sqlx's pool would also ping every connection it hands out (a `Sync`
/// and its `ReadyForQuery`), a round trip before every batch's statement,
/// on the decision path. Only a connection idle for [`PING_AFTER_IDLE`]
/// is pinged here: that is where a dead one hides (a server restarted or
/// failed over while nobody wrote). A connection that breaks moments after
/// its last use fails its statement instead, which every caller handles
/// already, since a connection can break between a ping and the statement
/// too: nothing of such a statement is forwarded (its writes are refused
/// with 503), and sqlx's own ping when the connection is given back finds
/// it broken and closes it. What the ping cost: `bench/analysis.md`, "A
/// round trip less per batch".
fn checked_pool(view: &Arc<ServerView>, max: u32, timeout: Duration) -> PgPoolOptions {
    let view = view.clone();
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_AFTER_IDLE {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .after_connect(move |conn, _meta| {
            let view = view.clone();
            Box::pin(async move {
                let answer = writable(conn).await?;
                view.saw(answer.err());
                answer.map_err(|ro| {
                    sqlx::Error::Configuration(
                        format!("connection refused by fencegate: {ro}").into(),
                    )
                })
            })
        })
}

/// Runs the readiness probe (writability and replication).
async fn probe<'c, E>(on: E, timeout: Duration) -> Result<Probe, StoreError>
where
    E: sqlx::Executor<'c, Database = sqlx::Postgres>,
{
    bounded(timeout, StoreError::Timeout, async {
        let row: (bool, bool, String, String, i64, i64, i64) =
            sqlx::query_as(PROBE).fetch_one(on).await?;
        Ok(Probe {
            in_recovery: row.0,
            read_only: row.1,
            synchronous_commit: row.2,
            synchronous_standby_names: row.3,
            replicas: row.4,
            synchronous_replicas: row.5,
            hidden_replicas: row.6,
        })
    })
    .await
}

/// The durability check at start-up: every warning logged (see
/// `readiness`). A check that cannot run is logged too, but does not stop
/// the start: the server's configuration is the operator's.
async fn warn_of_durability(pool: &PgPool, timeout: Duration) {
    match probe(pool, timeout).await {
        Ok(p) => {
            let d = p.durability();
            for w in &d.warnings {
                tracing::warn!(
                    replicas = d.replicas,
                    synchronous_replicas = d.synchronous_replicas,
                    "fence store durability: {w}"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "fence store durability: could not be checked"),
    }
}

/// The single-writer lock: a session advisory lock held on a connection we
/// own for the life of the process (never a pooled one, which a transaction
/// pooler could hand to someone else).
///
/// Holding the lock is only proof of being the only writer while the
/// session lives on a writable primary, and the process learns that a
/// session died only when it next asks. So the right to decide is a lease:
/// each confirmation (the session answered that its server is a writable
/// primary) lets decisions run until [`OWNER_LEASE`] after the question was
/// sent. A decision loads one atomic and reads the clock.
pub struct OwnerLock {
    /// The origin of `held_until`.
    epoch: Instant,
    /// Milliseconds after `epoch` until which decisions may be made; 0 when
    /// the lock is known lost.
    held_until: AtomicU64,
    /// Acquisitions so far (see `FenceStore::writer_generation`).
    generation: Arc<AtomicU64>,
    /// Why the lock is not held, for `/readyz`.
    why: Mutex<String>,
    /// Watches the lock connection and takes the lock again after an outage.
    task: JoinHandle<()>,
}

impl OwnerLock {
    async fn acquire(
        opts: PgConnectOptions,
        timeout: Duration,
        view: Arc<ServerView>,
    ) -> Result<Arc<Self>, StoreError> {
        let first = Instant::now();
        let (conn, asked) = loop {
            let asked = Instant::now();
            match try_lock(&opts, timeout).await {
                Ok(Attempt::Taken(conn)) => break (conn, asked),
                // Held by a session that may be ending: see `HELD_AT_START`.
                Ok(Attempt::HeldElsewhere) if first.elapsed() < HELD_AT_START => {
                    tokio::time::sleep(HELD_AT_START_RETRY).await
                }
                Ok(Attempt::HeldElsewhere) => {
                    return Err(StoreError::Other(
                        "another fencegate instance in \"single\" mode is using this store; \
                         stop it first, or run every instance with [store] mode = \"shared\""
                            .into(),
                    ))
                }
                Err(e) => return Err(e),
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<Arc<OwnerLock>>();
        let task = tokio::spawn(async move {
            let Ok(me) = rx.await else { return };
            watch(me, conn, opts, timeout, view).await;
        });
        let epoch = asked;
        let lock = Arc::new(Self {
            epoch,
            held_until: AtomicU64::new(0),
            generation: Arc::new(AtomicU64::new(1)),
            why: Mutex::new(String::new()),
            task,
        });
        lock.confirm(asked);
        let _ = tx.send(lock.clone());
        Ok(lock)
    }

    /// Whether decisions may be made now.
    fn held(&self) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64;
        now < self.held_until.load(Ordering::Acquire)
    }

    /// The session confirmed the lock on a writable primary when asked at
    /// `asked`.
    fn confirm(&self, asked: Instant) {
        let until = asked.saturating_duration_since(self.epoch) + OWNER_LEASE;
        self.held_until
            .store(until.as_millis() as u64, Ordering::Release);
    }

    /// Stops decisions at once; `why` is what `/readyz` shows.
    fn revoke(&self, why: String) {
        self.held_until.store(0, Ordering::Release);
        *self.why.lock().unwrap_or_else(|e| e.into_inner()) = why;
    }

    /// For `/readyz`.
    fn state(&self) -> WriterLock {
        if self.held() {
            return WriterLock {
                held: true,
                detail: None,
            };
        }
        let why = self.why.lock().unwrap_or_else(|e| e.into_inner()).clone();
        WriterLock {
            held: false,
            detail: Some(if why.is_empty() {
                format!(
                    "its session has not confirmed it within {} ms",
                    OWNER_LEASE.as_millis()
                )
            } else {
                why
            }),
        }
    }
}

/// What an attempt to take the single-writer lock found.
enum Attempt {
    /// Taken, on a writable primary; the lock lives with this connection.
    Taken(PgConnection),
    /// Another session holds it.
    HeldElsewhere,
}

async fn try_lock(opts: &PgConnectOptions, timeout: Duration) -> Result<Attempt, StoreError> {
    bounded(timeout, StoreError::Timeout, async {
        let mut conn = PgConnection::connect_with(opts).await?;
        let (in_recovery, read_only, got): (bool, bool, Option<bool>) =
            sqlx::query_as(TRY_OWNER_LOCK)
                .bind(LOCK_NAMESPACE)
                .bind(SINGLE_WRITER_ID)
                .fetch_one(&mut conn)
                .await?;
        if in_recovery {
            return Err(StoreError::ReadOnly(ReadOnly::InRecovery));
        }
        if read_only {
            return Err(StoreError::ReadOnly(ReadOnly::ReadOnlyTransactions));
        }
        Ok(if got == Some(true) {
            Attempt::Taken(conn)
        } else {
            Attempt::HeldElsewhere
        })
    })
    .await
}

/// Confirms the lock every [`OWNER_CHECK`] on its own session. When the
/// session breaks, the lock is gone with it: stop deciding at once, then
/// take the lock again every [`OWNER_RETRY`] — on a writable primary only,
/// and unless another instance took it meanwhile. A session whose server
/// became read-only keeps the lock (nobody else can take it) but decides
/// nothing until the server takes writes again. A session that answers
/// late keeps it too (see [`OWNER_PATIENCE`]).
async fn watch(
    me: Arc<OwnerLock>,
    conn: PgConnection,
    opts: PgConnectOptions,
    timeout: Duration,
    view: Arc<ServerView>,
) {
    let mut conn = Some(conn);
    let mut tick = tokio::time::interval(OWNER_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_try = Instant::now();
    // What was logged last: a state is logged when it changes, not on
    // every tick.
    let mut said = String::new();
    fn say(me: &OwnerLock, said: &mut String, why: String, error: bool) {
        if why != *said {
            if error {
                tracing::error!("single-writer lock: {why}; fenced writes answer 503");
            } else {
                tracing::warn!("single-writer lock: {why}; fenced writes answer 503");
            }
            *said = why.clone();
        }
        me.revoke(why);
    }
    // The lock was taken on a new session, asked at `asked`.
    fn taken_again(me: &OwnerLock, view: &ServerView, said: &mut String, asked: Instant) {
        // Before the confirmation: a decision that sees the lock held must
        // see the new generation too.
        let generation = me.generation.fetch_add(1, Ordering::AcqRel) + 1;
        view.saw(None);
        me.confirm(asked);
        tracing::info!(
            generation,
            "single-writer lock taken again on a writable primary; fenced writes resume"
        );
        said.clear();
    }
    loop {
        tick.tick().await;
        if let Some(c) = conn.take() {
            let asked = Instant::now();
            let mut check = check(c);
            let (c, answer) = match tokio::time::timeout(timeout, &mut check).await {
                Ok(answered) => answered,
                Err(_) => {
                    // The lease lapses by itself [`OWNER_LEASE`] after
                    // `asked`; stop now, as a check this slow confirms
                    // nothing in time.
                    say(
                        &me,
                        &mut said,
                        format!(
                            "paused: its session has not answered within {} ms (a slow or \
                             unreachable store, or a machine that got no CPU); waiting up to \
                             {} s for it",
                            timeout.as_millis(),
                            OWNER_PATIENCE.as_secs()
                        ),
                        false,
                    );
                    match outwait(check, &opts, timeout, &view).await {
                        Late::Answered(answered) => answered,
                        Late::Taken(c, asked) => {
                            conn = Some(c);
                            taken_again(&me, &view, &mut said, asked);
                            continue;
                        }
                        Late::GaveUp => {
                            // Dropping the check closes the session, so the
                            // lock is free for the next attempt, ours, once
                            // its server notices.
                            say(
                                &me,
                                &mut said,
                                format!(
                                    "lost: its session did not answer within {} s",
                                    OWNER_PATIENCE.as_secs()
                                ),
                                true,
                            );
                            continue;
                        }
                    }
                }
            };
            match answer {
                Ok(Ok(())) => {
                    me.confirm(asked);
                    // A late answer confirms a lease that has lapsed
                    // already: writes resume with the next check's answer.
                    if !said.is_empty() && me.held() {
                        tracing::info!("single-writer lock: its session answers and its server takes writes; fenced writes resume");
                        said.clear();
                    }
                    conn = Some(c);
                }
                Ok(Err(ro)) => {
                    view.saw(Some(ro));
                    say(&me, &mut said, format!("held, but {ro}"), false);
                    conn = Some(c);
                }
                Err(e) => say(&me, &mut said, format!("lost with its session ({e})"), true),
            }
            continue;
        }
        if Instant::now() < next_try {
            continue;
        }
        next_try = Instant::now() + OWNER_RETRY;
        let asked = Instant::now();
        match try_lock(&opts, timeout).await {
            Ok(Attempt::Taken(c)) => {
                conn = Some(c);
                taken_again(&me, &view, &mut said, asked);
            }
            Ok(Attempt::HeldElsewhere) => say(
                &me,
                &mut said,
                "another session holds it: another fencegate instance in \"single\" mode, or this instance's previous session until the server notices it is gone".into(),
                true,
            ),
            Err(StoreError::ReadOnly(ro)) => {
                view.saw(Some(ro));
                say(
                    &me,
                    &mut said,
                    format!("not taken: {ro}; waiting for a writable primary"),
                    false,
                );
            }
            Err(e) => say(
                &me,
                &mut said,
                format!("not taken: the store is unreachable ({e})"),
                false,
            ),
        }
    }
}

/// One check of the lock's session, owning the connection so that a
/// check that outlives the store's timeout can still be waited for.
type Check = Pin<Box<dyn Future<Output = (PgConnection, Checked)> + Send>>;
/// Whether the session's server takes writes, or how the session broke.
type Checked = Result<Result<(), ReadOnly>, sqlx::Error>;

fn check(mut conn: PgConnection) -> Check {
    Box::pin(async move {
        let answer = writable(&mut conn).await;
        (conn, answer)
    })
}

/// What became of a check that its session did not answer within the
/// store's timeout.
enum Late {
    /// The session answered after all.
    Answered((PgConnection, Checked)),
    /// The lock was free on a new session, asked at the instant: the old
    /// session's server no longer has it (a failover, or the session ended
    /// there), so the old session is let go.
    Taken(PgConnection, Instant),
    /// Neither within [`OWNER_PATIENCE`].
    GaveUp,
}

/// Waits for a late check while trying the lock on new sessions every
/// [`OWNER_RETRY`]. An attempt that finds the lock held is most likely
/// finding this instance's own slow session, and changes nothing.
async fn outwait(
    mut check: Check,
    opts: &PgConnectOptions,
    timeout: Duration,
    view: &ServerView,
) -> Late {
    let patience = tokio::time::sleep(OWNER_PATIENCE);
    tokio::pin!(patience);
    loop {
        let asked = Instant::now();
        // An attempt dropped because the check answered first may have
        // taken the lock on its new session: dropping that session gives it
        // back, and the old one is confirmed on the next tick.
        tokio::select! {
            answered = &mut check => return Late::Answered(answered),
            () = &mut patience => return Late::GaveUp,
            attempt = try_lock(opts, timeout) => match attempt {
                Ok(Attempt::Taken(c)) => return Late::Taken(c, asked),
                Err(StoreError::ReadOnly(ro)) => view.saw(Some(ro)),
                Ok(Attempt::HeldElsewhere) | Err(_) => {}
            },
        }
        tokio::select! {
            answered = &mut check => return Late::Answered(answered),
            () = &mut patience => return Late::GaveUp,
            () = tokio::time::sleep(OWNER_RETRY) => {}
        }
    }
}

pub async fn migrate_url(url: &str) -> Result<(), StoreError> {
    // No statement logging: a migration that waits (on a slow disk, or on
    // another migrator's lock) is expected to, and sqlx's slow-statement
    // warning would print the whole migration's SQL to the operator.
    // `migrate` says what it did, or its error, itself.
    let opts = connect_options(url, super::MIGRATE_TIMEOUT)?.disable_statement_logging();
    let mut conn = PgConnection::connect_with(&opts).await?;
    migrator().run(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

/// Shared mode's admissions, on `key_lock_connections` connections of
/// their own (so a burst of fenced writes never waits for the pool that
/// serves lock grants and Idempotency-Key reads), with the store's
/// connection settings.
fn admissions(
    opts: &PgConnectOptions,
    cfg: &StoreConfig,
    view: &Arc<ServerView>,
) -> super::admissions::Admissions {
    use super::admissions::{admit_batch, Admissions, Admit, AdmitBatcher, Ruling};
    use super::batch::WeakBatcher;
    use std::sync::OnceLock;
    let opts = opts.clone().application_name("fencegate-admissions");
    let pool = checked_pool(view, cfg.key_lock_connections, cfg.timeout).connect_lazy_with(opts);
    // Each admission a batch answers carries a handle on the batcher for
    // its leave: the batch runner needs the batcher it runs under (a weak
    // handle, or the batcher would keep itself running forever).
    let me: Arc<OnceLock<WeakBatcher<Admit, Option<Ruling>>>> = Arc::new(OnceLock::new());
    let batcher = {
        let (pool, view, me) = (pool.clone(), view.clone(), me.clone());
        AdmitBatcher::spawn(super::batch::MAX_BATCH, cfg.timeout, move |items| {
            let (pool, view, me) = (pool.clone(), view.clone(), me.clone());
            async move {
                let Some(batcher) = me.get().and_then(WeakBatcher::upgrade) else {
                    return Err(StoreError::Other(
                        "the admission batcher is starting".into(),
                    ));
                };
                view.learn(admit_batch(&pool, &batcher, items).await)
            }
        })
    };
    let _ = me.set(batcher.downgrade());
    Admissions::new(pool, batcher, cfg.key_lock_wait, cfg.timeout)
}

/// Runs one batch of decisions and answers each item's key's highest token.
async fn record_batch(
    conn: &mut PgConnection,
    items: Vec<Decision>,
) -> Result<Vec<Option<i64>>, StoreError> {
    let wanted = super::batch::max_per_key(items.iter().map(|d| (d.key.as_str(), d.token)));
    let (keys, tokens): (Vec<&str>, Vec<i64>) = wanted.iter().map(|(k, t)| (*k, *t)).unzip();
    let rows: Vec<(String, i64)> = sqlx::query_as(RECORD_BATCH)
        .bind(&keys)
        .bind(&tokens)
        .fetch_all(&mut *conn)
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
        .fetch_all(&mut *conn)
        .await?;
        answers.extend(fresh);
    }
    Ok(super::batch::in_item_order(&items, &answers))
}
