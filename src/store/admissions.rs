//! Shared mode's admissions: which fenced writes may go to the upstream,
//! decided for every instance on one Postgres by the key's fence row
//! (`fencegate_admit_batch`: migrations/postgres/0010).
//!
//! The row counts the writes of its highest token in flight (`inflight`,
//! until `writer_until`), and, after a raise over writers still in flight,
//! those writers (`draining`) and the latest they can arrive (`open_at`).
//! A write of the highest token is admitted while no older writer may be in
//! flight; a higher token is recorded at once (older ones are refused from
//! then on) and admitted when the last older writer has left, or when their
//! markers have ended if they never leave (their instance crashed, or lost
//! Postgres).
//!
//! **Group commit.** Nothing holds a connection while a write is in flight:
//! admissions of concurrent writes and the leaves of finished ones share
//! one statement and one commit (see `batch`). So a shared-mode write costs
//! two items of a batch (its admission and its leave), where a single-mode
//! decision costs one.
//!
//! **Waiting.** A write that must wait for older writers is answered
//! `wait` and asks again, with a backoff from [`FIRST_POLL`] to
//! [`LAST_POLL`], for up to `key_lock_wait_ms`; then 503 `key-busy`. Asking
//! again costs an item in the next batch, not a held connection.
//!
//! **Nothing leaks.** An admission is an [`InFlight`], whose drop leaves.
//! One answered to a requester that has gone (its client left, its future
//! was dropped) is dropped by the batcher, which leaves at once, so a
//! client that gives up never keeps a key closed. Only a batch that
//! commits after the gateway gave up on it (an error, not an answer) counts
//! writes nobody will leave: their key stays closed to newer tokens until
//! their markers end, as after a crash. A batch the server refused (one
//! admission's error rolls back all of it) has its leaves written again on
//! their own, once: see [`leave_alone`].

use std::time::{Duration, Instant};

use sqlx::PgPool;

use super::batch::Batcher;
use super::record_batch::BeginItem;
use super::sql::rolled_back;
use super::{bounded, millis, StoreError};

/// The first wait before a write told `wait` asks again.
pub const FIRST_POLL: Duration = Duration::from_millis(1);
/// The longest wait between two asks: how late, at most, a write learns
/// that the older writers it waited for have left.
pub const LAST_POLL: Duration = Duration::from_millis(16);

const ADMIT_BATCH: &str = "SELECT ord, outcome, highest, wait_ms, entered_ms \
                             FROM fencegate_admit_batch($1, $2, $3, $4, $5)";

const ENTER_KEYED: &str = "SELECT outcome, highest, wait_ms, entered_ms \
                             FROM fencegate_enter_keyed($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

/// One admission asked of a batch.
pub(super) struct Enter {
    key: String,
    token: i64,
    /// The marker's length, from when the statement writes it.
    hold: Duration,
}

/// One item of a batch.
pub(super) enum Admit {
    Enter(Enter),
    /// A write of the token on the key has finished at the upstream.
    Leave(String, i64),
}

/// The batcher of admissions and leaves; a leave is answered `None`.
pub(super) type AdmitBatcher = Batcher<Admit, Option<Ruling>>;

/// What one ask decided.
pub(super) enum Ruling {
    Decided(Entered),
    /// Older writers may be in flight; the key opens within this at the
    /// latest, or sooner when they leave.
    Wait(Duration),
}

/// A fenced write that asks to be admitted in shared mode.
pub struct Entry<'a> {
    pub key: &'a str,
    pub token: i64,
    /// How long the write's in-flight marker lasts.
    pub hold: Duration,
    /// The first use of an Idempotency-Key: its record and the admission
    /// are one statement.
    pub record: Option<&'a super::Begin<'a>>,
}

/// What `enter` decided.
pub enum Entered {
    /// Admitted: keep the [`InFlight`] until the write has finished at the
    /// upstream. With an idempotency record to write, it is written.
    Admitted(InFlight),
    /// A higher token is recorded.
    Stale(i64),
    /// A live idempotency record of the key exists (a concurrent duplicate
    /// wrote it first): not admitted, nothing counted in flight, nothing
    /// written but perhaps the token.
    Duplicate,
}

/// A fenced write counted in flight in its key's row. Dropping it leaves
/// (in the next leave batch); [`InFlight::abandon`] does not.
pub struct InFlight {
    /// Where the leave goes; `None` once abandoned.
    leaves: Option<AdmitBatcher>,
    key: String,
    token: i64,
    /// A local lower bound of the moment the admitting statement wrote the
    /// in-flight marker (and, for a write with an Idempotency-Key, then its idempotency
    /// record).
    entered_at: Instant,
    /// A local lower bound of the end of the in-flight marker the admitting
    /// statement wrote (earlier asks that were told to wait do not count):
    /// if this instance crashes, other instances consider its write over
    /// then, so the forward must be over by this.
    marker_until: Instant,
}

impl InFlight {
    /// See the field.
    pub fn marker_until(&self) -> Instant {
        self.marker_until
    }

    /// See the field.
    pub fn entered_at(&self) -> Instant {
        self.entered_at
    }

    /// The write ended abnormally and the upstream may still be at work on
    /// it until the forward's deadline: it must not leave. Its marker
    /// stays, and other instances hold the key until its `writer_until`,
    /// the same path as after a crash, which the marker outlasts the
    /// deadline for.
    pub fn abandon(mut self) {
        self.leaves = None;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(leaves) = self.leaves.take() else {
            return;
        };
        if !leaves.post(Admit::Leave(std::mem::take(&mut self.key), self.token)) {
            // Safe: the key stays closed to newer tokens until the marker
            // ends, as if this instance had crashed.
            tracing::warn!("a leave could not be queued; its key opens when its marker ends");
        }
    }
}

/// Shared mode's admissions on one instance.
pub struct Admissions {
    /// The connections that run the batches and admissions with a record
    /// (`key_lock_connections`); none is held while a write is in flight.
    pool: PgPool,
    /// Admissions and leaves of unkeyed writes, group-committed; every
    /// admission it answers carries a handle on it for its leave.
    batcher: AdmitBatcher,
    /// `key_lock_wait_ms`: the longest a write waits for older writers.
    wait: Duration,
    /// `[store] timeout_ms`: the bound on one statement.
    timeout: Duration,
}

impl Admissions {
    /// Wraps a batcher made by the store (it runs [`admit_batch`] on
    /// `pool`).
    pub(super) fn new(
        pool: PgPool,
        batcher: AdmitBatcher,
        wait: Duration,
        timeout: Duration,
    ) -> Self {
        Self {
            pool,
            batcher,
            wait,
            timeout,
        }
    }

    pub(super) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Waits, up to the store's timeout, until the leaves queued so far
    /// have been through a batch: at a clean shutdown, so that other
    /// instances do not wait for this instance's last writes' markers to
    /// end. (A leave whose batch failed is not written; its marker ends on
    /// its own, as the warning below says of those not yet through.)
    pub(super) async fn drain(&self) {
        if !self.batcher.drain(self.timeout).await {
            tracing::warn!(
                "leaves of the last fenced writes were not all written; their keys open \
                 on other instances when those writes' markers end"
            );
        }
    }

    /// Admits a fenced write, waiting for older writers on any instance for
    /// up to `key_lock_wait_ms`.
    pub async fn enter(&self, entry: Entry<'_>) -> Result<Entered, StoreError> {
        let Entry {
            key,
            token,
            hold,
            record,
        } = entry;
        let give_up = Instant::now() + self.wait;
        let record = record.map(|r| std::sync::Arc::new(BeginItem::of(r)));
        let mut nap = FIRST_POLL;
        loop {
            let ruling = match &record {
                None => self
                    .batcher
                    .submit(Admit::Enter(Enter {
                        key: key.to_string(),
                        token,
                        hold,
                    }))
                    .await?
                    .ok_or_else(|| {
                        StoreError::Other("an admission was answered as a leave".into())
                    })?,
                Some(r) => self.enter_keyed(key, token, hold, r.clone()).await?,
            };
            match ruling {
                Ruling::Decided(entered) => return Ok(entered),
                Ruling::Wait(opens_in) => {
                    let now = Instant::now();
                    if now >= give_up {
                        return Err(StoreError::KeyBusy(self.wait));
                    }
                    tokio::time::sleep(nap.min(opens_in).min(give_up - now)).await;
                    nap = (nap * 2).min(LAST_POLL);
                }
            }
        }
    }

    /// One admission with a record, in a task of its own: if the requester goes
    /// away meanwhile, the task still ends, and an admission nobody takes
    /// is dropped, which leaves.
    async fn enter_keyed(
        &self,
        key: &str,
        token: i64,
        hold: Duration,
        r: std::sync::Arc<BeginItem>,
    ) -> Result<Ruling, StoreError> {
        let (pool, leaves, timeout) = (self.pool.clone(), self.batcher.clone(), self.timeout);
        let key = key.to_string();
        let task = tokio::spawn(async move {
            let sent_at = Instant::now();
            let row: (String, i64, i64, i64) = bounded(timeout, StoreError::Timeout, async {
                Ok(sqlx::query_as(ENTER_KEYED)
                    .bind(&key)
                    .bind(token)
                    .bind(millis(hold))
                    .bind(&r.route)
                    .bind(&r.method)
                    .bind(&r.key)
                    .bind(&r.fingerprint)
                    .bind(r.attempt)
                    .bind(r.in_flight_ms)
                    .bind(r.ttl_ms)
                    .fetch_one(&pool)
                    .await?)
            })
            .await?;
            Ok(ruling(&leaves, key, token, hold, sent_at, row))
        });
        task.await.map_err(|e| {
            StoreError::Other(format!("a with_idempotency_key admission failed: {e}"))
        })?
    }
}

/// Runs one batch of leaves and admissions (on the store's batcher).
pub(super) async fn admit_batch(
    pool: &PgPool,
    batcher: &AdmitBatcher,
    items: Vec<Admit>,
) -> Result<Vec<Option<Ruling>>, StoreError> {
    let (mut leave_keys, mut leave_tokens) = (Vec::new(), Vec::new());
    let (mut keys, mut tokens, mut holds) = (Vec::new(), Vec::new(), Vec::new());
    for item in &items {
        match item {
            Admit::Leave(k, t) => {
                leave_keys.push(k.as_str());
                leave_tokens.push(*t);
            }
            Admit::Enter(e) => {
                keys.push(e.key.as_str());
                tokens.push(e.token);
                holds.push(millis(e.hold));
            }
        }
    }
    // Before the statement starts on the server: with the time it reports
    // between its start and each marker, a local lower bound of the
    // marker's end.
    let sent_at = Instant::now();
    let rows = match admit_statement(&leave_keys, &leave_tokens, &keys, &tokens, &holds)
        .fetch_all(pool)
        .await
    {
        Ok(rows) => rows,
        Err(e) => {
            if !leave_keys.is_empty() && !keys.is_empty() && rolled_back(&e) {
                leave_alone(pool, &leave_keys, &leave_tokens).await;
            }
            return Err(e.into());
        }
    };
    // The admissions' answers by their position among the admissions.
    let enters: Vec<&Enter> = items
        .iter()
        .filter_map(|i| match i {
            Admit::Enter(e) => Some(e),
            Admit::Leave(..) => None,
        })
        .collect();
    let mut answers: Vec<Option<Ruling>> = enters.iter().map(|_| None).collect();
    for (ord, outcome, highest, wait_ms, entered_ms) in rows {
        let n = usize::try_from(ord).ok().and_then(|o| o.checked_sub(1));
        let (Some(slot), Some(e)) = (
            n.and_then(|n| answers.get_mut(n)),
            n.and_then(|n| enters.get(n)),
        ) else {
            continue;
        };
        *slot = Some(ruling(
            batcher,
            e.key.clone(),
            e.token,
            e.hold,
            sent_at,
            (outcome, highest, wait_ms, entered_ms),
        ));
    }
    // A missing answer fails the batch; the admissions it did answer are
    // dropped with it, and leave.
    if answers.iter().any(Option::is_none) {
        return Err(StoreError::Other(
            "an admission batch lost an answer".into(),
        ));
    }
    let mut answers = answers.into_iter();
    Ok(items
        .iter()
        .map(|i| match i {
            Admit::Enter(_) => answers.next().flatten(),
            Admit::Leave(..) => None,
        })
        .collect())
}

/// One `fencegate_admit_batch` statement: leaves, then admissions, by
/// column.
fn admit_statement<'q>(
    leave_keys: &'q [&'q str],
    leave_tokens: &'q [i64],
    keys: &'q [&'q str],
    tokens: &'q [i64],
    holds: &'q [i64],
) -> sqlx::query::QueryAs<
    'q,
    sqlx::Postgres,
    (i64, String, i64, i64, i64),
    sqlx::postgres::PgArguments,
> {
    sqlx::query_as(ADMIT_BATCH)
        .bind(leave_keys)
        .bind(leave_tokens)
        .bind(keys)
        .bind(tokens)
        .bind(holds)
}

/// Writes the leaves of a batch that the server refused because of its
/// admissions (one admission's error rolls the whole statement back), in a
/// statement of their own, once: so that an admission's error does not keep
/// unrelated keys closed until their writes' markers end. Only for a batch
/// known to have written nothing ([`rolled_back`]): a leave is not
/// idempotent, and one counted twice could open a key while another write
/// of its token is still in flight. If this one fails too, the leaves are
/// lost, which is safe: their keys open when the markers end.
async fn leave_alone(pool: &PgPool, leave_keys: &[&str], leave_tokens: &[i64]) {
    let written = admit_statement(leave_keys, leave_tokens, &[], &[], &[])
        .fetch_all(pool)
        .await;
    if let Err(e) = written {
        tracing::warn!(
            error = %e,
            leaves = leave_keys.len(),
            "the leaves of a failed admission batch could not be written; their keys open \
             when their writes' markers end"
        );
    }
}

/// The store's answer `(outcome, highest, wait_ms, entered_ms)` to an ask
/// sent at `sent_at`.
fn ruling(
    leaves: &AdmitBatcher,
    key: String,
    token: i64,
    hold: Duration,
    sent_at: Instant,
    (outcome, highest, wait_ms, entered_ms): (String, i64, i64, i64),
) -> Ruling {
    let ms = super::from_millis;
    match outcome.as_str() {
        "ok" => {
            let entered_at = sent_at + ms(entered_ms);
            Ruling::Decided(Entered::Admitted(InFlight {
                leaves: Some(leaves.clone()),
                key,
                token,
                entered_at,
                marker_until: entered_at + hold,
            }))
        }
        "stale" => Ruling::Decided(Entered::Stale(highest)),
        "duplicate" => Ruling::Decided(Entered::Duplicate),
        // "wait", and anything else: not admitted.
        _ => Ruling::Wait(ms(wait_ms).max(FIRST_POLL)),
    }
}
