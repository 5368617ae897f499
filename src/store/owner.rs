//! Single mode on Postgres: the advisory lock that makes one instance the
//! only writer, its lease, and the watch that gives decisions up the
//! moment the lock may be lost (a failover, a broken connection, a server
//! that turned read-only).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use tokio::task::JoinHandle;

use super::readiness::{writable, ReadOnly, ServerView, WriterLock};
use super::{bounded, StoreError};

/// Advisory locks use the two-int4 form with this first half, so they never
/// collide with an application's one-bigint locks or with other namespaces.
/// ("FGAT" in ASCII.)
pub const LOCK_NAMESPACE: i32 = 0x4647_4154;

/// Second half of the single-writer lock.
pub(super) const SINGLE_WRITER_ID: i32 = 1;

/// How long one confirmation of the single-writer lock lets this instance
/// decide, counted from when the confirming query was sent. A successor
/// that found this instance's run unfinished waits this long on top of the
/// longest forward (see `app`), so decisions this instance made after its
/// lock was really gone cannot overlap the successor's.
pub const OWNER_LEASE: Duration = Duration::from_secs(2);

/// How often the lock's session is asked whether it still holds the lock
/// on a writable primary. Well inside the lease, so a loaded machine that
/// delays a check by a second does not stop decisions.
pub(super) const OWNER_CHECK: Duration = Duration::from_millis(250);

/// How often a lost single-writer lock is tried again.
pub(super) const OWNER_RETRY: Duration = Duration::from_millis(500);

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
pub(super) const OWNER_PATIENCE: Duration = Duration::from_secs(30);

/// How long a starting instance keeps trying for a single-writer lock that
/// another session holds before it refuses to start. A predecessor killed a
/// moment ago (a crash, `kill -9`, a supervisor's restart) holds the lock
/// until its server process has read the closed connection and ended,
/// which takes a moment, longer on a loaded machine; an instance restarted
/// at once must not be refused for that. An instance that is alive keeps
/// the lock, and the new one is refused after this wait.
pub(super) const HELD_AT_START: Duration = Duration::from_secs(3);

/// Between two tries within [`HELD_AT_START`].
pub(super) const HELD_AT_START_RETRY: Duration = Duration::from_millis(100);

/// Takes the single-writer lock, but only on a writable primary (CASE
/// evaluates the branch it needs, so a standby's lock is never taken).
pub(super) const TRY_OWNER_LOCK: &str = "\
SELECT pg_is_in_recovery(),
       current_setting('transaction_read_only') = 'on',
       CASE WHEN pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'
            THEN NULL
            ELSE pg_try_advisory_lock($1, $2) END";

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
    pub(super) epoch: Instant,
    /// Milliseconds after `epoch` until which decisions may be made; 0 when
    /// the lock is known lost.
    pub(super) held_until: AtomicU64,
    /// Acquisitions so far (see `FenceStore::writer_generation`).
    pub(super) generation: Arc<AtomicU64>,
    /// Why the lock is not held, for `/readyz`.
    pub(super) why: Mutex<String>,
    /// Watches the lock connection and takes the lock again after an outage.
    pub(super) task: JoinHandle<()>,
}

impl OwnerLock {
    pub(super) async fn acquire(
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
    pub(super) fn held(&self) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64;
        now < self.held_until.load(Ordering::Acquire)
    }

    /// The session confirmed the lock on a writable primary when asked at
    /// `asked`.
    pub(super) fn confirm(&self, asked: Instant) {
        let until = asked.saturating_duration_since(self.epoch) + OWNER_LEASE;
        self.held_until
            .store(until.as_millis() as u64, Ordering::Release);
    }

    /// Stops decisions at once; `why` is what `/readyz` shows.
    pub(super) fn revoke(&self, why: String) {
        self.held_until.store(0, Ordering::Release);
        *self.why.lock().unwrap_or_else(|e| e.into_inner()) = why;
    }

    /// For `/readyz`.
    pub(super) fn state(&self) -> WriterLock {
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
pub(super) enum Attempt {
    /// Taken, on a writable primary; the lock lives with this connection.
    Taken(PgConnection),
    /// Another session holds it.
    HeldElsewhere,
}

pub(super) async fn try_lock(
    opts: &PgConnectOptions,
    timeout: Duration,
) -> Result<Attempt, StoreError> {
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
pub(super) async fn watch(
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
        conn = retake(&me, &opts, timeout, &view, &mut said).await;
    }
}

/// Stops decisions for `why`, logged when it differs from what was said
/// last.
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
/// The lock was taken on a new session, asked at `asked`.
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

/// One attempt to take the lock again on a new session: the session, when
/// it is taken; what stops it otherwise is said.
async fn retake(
    me: &OwnerLock,
    opts: &PgConnectOptions,
    timeout: Duration,
    view: &ServerView,
    said: &mut String,
) -> Option<PgConnection> {
    let asked = Instant::now();
    match try_lock(opts, timeout).await {
        Ok(Attempt::Taken(c)) => {
            taken_again(me, view, said, asked);
            return Some(c);
        }
        Ok(Attempt::HeldElsewhere) => say(
            me,
            said,
            "another session holds it: another fencegate instance in \"single\" mode, or this instance's previous session until the server notices it is gone".into(),
            true,
        ),
        Err(StoreError::ReadOnly(ro)) => {
            view.saw(Some(ro));
            say(
                me,
                said,
                format!("not taken: {ro}; waiting for a writable primary"),
                false,
            );
        }
        Err(e) => say(
            me,
            said,
            format!("not taken: the store is unreachable ({e})"),
            false,
        ),
    }
    None
}

/// One check of the lock's session, owning the connection so that a
/// check that outlives the store's timeout can still be waited for.
pub(super) type Check = Pin<Box<dyn Future<Output = (PgConnection, Checked)> + Send>>;

/// Whether the session's server takes writes, or how the session broke.
pub(super) type Checked = Result<Result<(), ReadOnly>, sqlx::Error>;

pub(super) fn check(mut conn: PgConnection) -> Check {
    Box::pin(async move {
        let answer = writable(&mut conn).await;
        (conn, answer)
    })
}

/// What became of a check that its session did not answer within the
/// store's timeout.
pub(super) enum Late {
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
pub(super) async fn outwait(
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
