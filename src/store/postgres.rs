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

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

use super::admissions::Entered;
use super::batch::Decision;
use super::link::{Links, PING_AFTER_IDLE};
use super::owner::OwnerLock;
use super::readiness::{writable, Probe, ReadOnly, ServerState, ServerView, StoreReadiness, PROBE};
use super::{bounded, StoreError};
use crate::config::{redact_url, StoreConfig};

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
    records: Option<super::record_batch::RecordBatcher>,
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
                super::record_batch::RecordBatcher,
                super::record_batch::pg_records_batch
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
    pub(super) fn record_batcher(&self) -> Option<&super::record_batch::RecordBatcher> {
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

    /// Shared mode: admits a fenced write across every instance (see
    /// `admissions`). On success the returned
    /// [`InFlight`](super::admissions::InFlight) must be kept until the
    /// write has finished at the upstream; `entry.hold` bounds how long a
    /// crashed instance's write may be assumed in flight.
    /// `entry.record`: a first use of an `Idempotency-Key`, whose in-flight
    /// record is written in the same statement (`fencegate_enter_keyed`,
    /// migrations/postgres/0010), so in the same transaction and commit as
    /// the fence's marker; [`Entered::Duplicate`] when a live record of the
    /// key exists.
    pub async fn enter(&self, entry: super::Entry<'_>) -> Result<Entered, StoreError> {
        let admissions = self
            .admissions
            .as_ref()
            .ok_or_else(|| StoreError::Other("enter() needs mode = \"shared\"".into()))?;
        admissions.enter(entry).await.map_err(|e| self.explain(e))
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
