//! The fence decision: the durable store and the in-process gate together.
//!
//! Order matters (see `gate` for the full argument): take a ticket on the
//! key ([`Fence::arrive`]), record the token durably, then wait at the gate
//! ([`Fence::check`]). The token is durable before the write is forwarded,
//! so after a crash or restart anything lower than a forwarded token is
//! still refused.
//!
//! In `single` mode on Postgres, every decision (a refusal from memory
//! included) first checks that this instance holds the single-writer lock
//! on a writable primary, and an admission checks again after its wait at
//! the gate, the last moment before the write is forwarded. Across a
//! failover the lock is lost and taken again, possibly by another
//! instance in between; deciding nothing while it is not held is what keeps
//! two `single` instances from ever deciding at the same time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fencing::gate::{Arrival, Gate, NotAdmitted, Permit, Ticket};
use crate::gateway::error::{ClientError, GatewayError};
use crate::store::{Begin, Entered, Entry, FenceStore, InFlight, StoreError};

/// The right to forward one fenced write; drop it when the upstream is done
/// with the write (see `exchange`).
pub struct Admission {
    /// The in-process gate's permit.
    _permit: Permit,
    /// `shared` mode: the write counted in flight in the key's row, for
    /// every instance (it leaves after the permit is released, by field
    /// order).
    in_flight: Option<InFlight>,
    /// `shared` mode: other instances assume this write may be in flight
    /// until this instant if we crash, so the forward must end by then.
    pub must_end_by: Option<Instant>,
}

impl Admission {
    /// The write ended abnormally: the key stays closed until the deadline.
    /// In-process that is the permit, kept that long; across instances it
    /// is the write's in-flight marker, which outlasts the deadline, so it
    /// is never left (see `InFlight::abandon`).
    pub fn abandon_in_flight(&mut self) {
        if let Some(w) = self.in_flight.take() {
            w.abandon();
        }
    }
}

/// What the fence decides about: a fenced write's key and token, how long
/// its forward may take (`hold`, the route's timeout), and whether the
/// route accepts only tokens the lock API granted (`issued_only`, `token =
/// "issued"`: a higher one is refused before anything is recorded).
#[derive(Clone, Copy)]
pub struct Write<'a> {
    pub key: &'a str,
    pub token: i64,
    pub hold: Duration,
    pub issued_only: bool,
}

/// A fenced write that is the first use of an `Idempotency-Key`, decided
/// together with its in-flight record.
pub enum RecordCheck {
    /// Admitted, and the in-flight record written: it stays in flight (so
    /// no duplicate is forwarded) until at least `record_until`, a local
    /// lower bound of the record's `in_flight_until`.
    Admitted {
        admission: Admission,
        record_until: Instant,
    },
    /// A live record of the key exists (a concurrent duplicate wrote it
    /// first, or an earlier request's record: a replay that memory did not
    /// know): not admitted, and not to be forwarded.
    Duplicate,
    /// Refused before anything of the record was written (stale, not
    /// issued, the key busy, the store unavailable for the decision). The
    /// key may still have a record of an earlier request — a replay's token
    /// is stale once a newer one was recorded — which then answers instead.
    Refused(GatewayError),
}

/// How often a shared-mode instance looks for resets made elsewhere: a reset
/// takes effect on every instance within a second.
pub const RESET_POLL: Duration = Duration::from_millis(250);

/// How much longer than the forward's own bound a shared-mode in-flight
/// marker lasts: room for the time between writing the marker and starting
/// the forward.
const MARKER_SLACK: Duration = Duration::from_secs(1);

/// Cheap to clone: a store handle and the shared gate.
#[derive(Clone)]
pub struct Fence {
    pub store: FenceStore,
    pub gate: Arc<Gate>,
    /// Single mode after a crash of the previous instance: until this
    /// instant, writes of the crashed instance may still be in flight to the
    /// upstream (it forwarded them; we cannot know when they end), so no
    /// fenced write is forwarded before it.
    quarantine_until: Option<Instant>,
}

impl Fence {
    /// The same fence for one traffic worker: the gate's worker copy (see
    /// [`Gate::worker_copy`]), the same store.
    pub fn worker_copy(&self) -> Self {
        Self {
            gate: self.gate.worker_copy(),
            ..self.clone()
        }
    }

    /// `cache_keys`: how many idle keys' durable tokens to keep in memory.
    pub fn new(store: FenceStore, cache_keys: usize) -> Self {
        // Single mode: nothing else writes the store, so a settled cached
        // token is exact. Shared mode: other instances raise tokens.
        let exact = !store.is_shared();
        let gate = match store.writer_generation() {
            Some(generation) => {
                Gate::exact_while(cache_keys, generation, store.late_commit_bound())
            }
            None => Gate::new(cache_keys, exact, store.late_commit_bound()),
        };
        Self {
            gate,
            store,
            quarantine_until: None,
        }
    }

    /// Holds back fenced writes until `until` (see `quarantine_until`).
    pub fn with_quarantine(mut self, until: Instant) -> Self {
        self.quarantine_until = Some(until);
        self
    }

    /// Whether fenced writes are held back now (see `quarantine_until`).
    pub fn holding_back(&self) -> bool {
        self.quarantine_until.is_some_and(|u| Instant::now() < u)
    }

    /// Whether a decision with an idempotency record (a first use of an `Idempotency-Key`) uses
    /// store connections directly from the calling task (shared mode's
    /// `fencegate_enter_keyed`), rather than only through a batcher's
    /// channel. Every other decision goes through a channel in both modes.
    pub fn record_check_talks_to_store(&self) -> bool {
        self.store.is_shared()
    }

    /// Shared mode: watches the store's reset log so that a reset made
    /// through any instance makes this one forget the key within
    /// [`RESET_POLL`] (twice that after a failed poll). Single mode needs
    /// none: the only instance resets through its own admin listener.
    pub fn watch_resets(&self) -> Option<tokio::task::JoinHandle<()>> {
        if !self.store.is_shared() {
            return None;
        }
        let (store, gate) = (self.store.clone(), self.gate.clone());
        Some(tokio::spawn(async move {
            let mut seen = None;
            let mut tick = tokio::time::interval(RESET_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(after) = seen else {
                    // Resets before this instance started are in the store
                    // already, and memory starts empty.
                    seen = store.last_reset_id().await.ok();
                    continue;
                };
                match store.resets_after(after).await {
                    Ok(rows) => {
                        for (id, key) in rows {
                            gate.forget(&key);
                            seen = Some(id);
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "cannot read the reset log; retrying"),
                }
            }
        }))
    }

    /// The first, memory-only step of a decision: takes the key's ticket and
    /// refuses a token below the key's known durable token, without a store
    /// call or a task. Cheap enough for the request's own task.
    pub fn arrive(&self, key: &str, token: i64) -> Result<Arrival, GatewayError> {
        // Even a refusal is a decision: none is made from memory while this
        // instance is not the store's single writer (an atomic load).
        self.store.check_writer()?;
        self.gate
            .arrive(key, token)
            .map_err(|s| stale(key, token, s.highest))
    }

    /// Decides a fenced write that [`Fence::arrive`] let through. On
    /// success the returned admission must live until the upstream is done
    /// with the write.
    pub async fn check(
        &self,
        write: Write<'_>,
        mut arrival: Arrival,
    ) -> Result<Admission, GatewayError> {
        let (key, token, hold) = (write.key, write.token, write.hold);
        // The issued and shared-mode steps are boxed: they are the larger
        // futures, and inline they would make every decision's future (and
        // the write's task, which moves it) as large as they are.
        if write.issued_only {
            arrival = Box::pin(self.check_issued(key, arrival, token)).await?;
        }
        if let FenceStore::Postgres(pg) = &self.store {
            if pg.is_shared() {
                return match Box::pin(self.check_shared(pg, key, arrival, token, hold, None))
                    .await
                    .map_err(Shared::into_error)?
                {
                    Some((admission, _)) => Ok(admission),
                    None => Err(GatewayError::Internal(
                        "a fence decision without an idempotency record found a duplicate",
                    )),
                };
            }
        }
        let permit = self.check_single(key, arrival, token).await?;
        Ok(Admission {
            _permit: permit,
            in_flight: None,
            must_end_by: None,
        })
    }

    /// [`Fence::check`] for the first use of an `Idempotency-Key`: decides
    /// the write and writes `record`, its in-flight record, which a caller
    /// that does not forward after all must forget.
    ///
    /// The decision and the record are written in one transaction, with
    /// one commit: shared mode writes both in one statement (each write has
    /// its own statement there anyway), and single mode puts the decision
    /// with the record into a batch of records, so it commits with that
    /// batch's records and answers. A crash leaves both or neither. In
    /// single mode the record goes without a decision, once the write is
    /// admitted, when memory already knows the token is the key's durable
    /// one (then no fence statement is written at all) or another write is
    /// on the key (below: then the decision is a fence batch's);
    /// a crash between the two leaves a recorded token and no record
    /// (nothing was forwarded: a retry is a first use, forwarded once), and
    /// a crash after the record but before the forward leaves a record that
    /// duplicates see in progress, then "outcome unknown" — never forwarded
    /// twice.
    ///
    /// The record is written only if the fence accepts the token, so a
    /// refusal of the fence (`RecordCheck::Refused`) leaves no record: a stale
    /// first use is not recorded. The record's insert is also what finds an
    /// existing record (`RecordCheck::Duplicate`): a first use costs no separate
    /// lookup. A record is written with the decision only when no other
    /// write is on the key, so that no wait at the gate comes between the
    /// record and its forward and eats into its time in flight; otherwise
    /// (and during the start-up quarantine) it is written on its own, after
    /// the wait.
    ///
    /// After an error the record may exist all the same (the gate refused
    /// the write after the store wrote it, or a statement or batch timed
    /// out and commits later): the caller forgets it, and where that comes
    /// too late, duplicates hear "outcome unknown", the safe side.
    pub async fn check_with_record(
        &self,
        write: Write<'_>,
        mut arrival: Arrival,
        record: &Begin<'_>,
    ) -> Result<RecordCheck, GatewayError> {
        let (key, token, hold) = (write.key, write.token, write.hold);
        if write.issued_only {
            arrival = match self.check_issued(key, arrival, token).await {
                Ok(a) => a,
                Err(e) => return Ok(RecordCheck::Refused(e)),
            };
        }
        if let FenceStore::Postgres(pg) = &self.store {
            if pg.is_shared() {
                let checked = match self
                    .check_shared(pg, key, arrival, token, hold, Some(record))
                    .await
                {
                    Ok(c) => c,
                    // The statement refused the write, or never ran it
                    // (lock_timeout aborts it): no record.
                    Err(Shared::Refused(e)) => return Ok(RecordCheck::Refused(e)),
                    Err(Shared::Failed(e)) => return Err(e),
                };
                return Ok(match checked {
                    Some((admission, entered_at)) => RecordCheck::Admitted {
                        admission,
                        // The record is written after the marker, in the
                        // same statement.
                        record_until: entered_at + record.in_flight,
                    },
                    None => RecordCheck::Duplicate,
                });
            }
        }
        let admitted = |permit, sent_at: Instant, in_flight| RecordCheck::Admitted {
            admission: Admission {
                _permit: permit,
                in_flight: None,
                must_end_by: None,
            },
            record_until: sent_at + in_flight,
        };
        let mut ticket = match arrival {
            // With no other write on the key, the record goes with the
            // decision: see below.
            Arrival::Record(ticket) if ticket.alone() && !self.holding_back() => ticket,
            arrival => {
                // The token is the key's durable one (no fence statement at
                // all), or the write may wait at the gate behind another
                // (or the quarantine): the record gets a statement (a batch)
                // of its own, once the write is admitted, so no wait eats
                // into its time in flight.
                let permit = match self.check_single(key, arrival, token).await {
                    Ok(p) => p,
                    Err(e) => return Ok(RecordCheck::Refused(e)),
                };
                let sent_at = Instant::now();
                // The record's time counts from the statement's start on
                // the store's clock, after this.
                if !self.store.idem_begin(record).await? {
                    // Nothing was forwarded: the permit goes with it.
                    return Ok(RecordCheck::Duplicate);
                }
                return Ok(admitted(permit, sent_at, record.in_flight));
            }
        };
        // The store decides the token, and nothing else is on the key: the
        // record goes into the same batch, so one transaction and one
        // commit with the decision. The admission then (almost always)
        // does not wait (see `Ticket::alone`); when it does after all, a
        // wait too long for the record's time in flight ends before the
        // forward (`decision-late`), never past the record.
        let sent_at = Instant::now();
        let answer = self.store.decide_with_record(key, token, record).await;
        ticket.settle(answer.as_ref().ok().map(|d| d.highest));
        // An error leaves the outcome unknown, the record's too: the caller
        // forgets it.
        let decided = answer?;
        if let Err(e) = accepted(key, token, decided.highest) {
            // A record is written only with an accepted token.
            return Ok(RecordCheck::Refused(e));
        }
        if !decided.written {
            return Ok(RecordCheck::Duplicate);
        }
        // From here the record is written: a refusal leaves it to be
        // forgotten (an error, not `Refused`).
        let permit = self.admit(key, ticket, token).await?;
        // As in `check_single`: the last moment before the write may go.
        self.store.check_writer()?;
        Ok(admitted(permit, sent_at, record.in_flight))
    }

    /// `token = "issued"`: refuses a token above the highest fence the lock
    /// API granted for the key's lock, and every token on a lock never
    /// granted (0 included: no grant issued it), from memory when it knows
    /// a fence at least that high was granted, else from the store (a grant
    /// may be newer than memory, or made by another instance). Fences only
    /// grow, so what memory knows stays true (a reset makes it forget).
    /// Every grant's fence is at least 1, so the store's 0 means "never
    /// granted", and memory only ever learns a granted one.
    async fn check_issued(
        &self,
        key: &str,
        mut arrival: Arrival,
        token: i64,
    ) -> Result<Arrival, GatewayError> {
        let ticket = match &mut arrival {
            Arrival::Recorded(t) | Arrival::Record(t) => t,
        };
        if ticket.known_issued(token) {
            return Ok(arrival);
        }
        let issued = match self.store.issued_fence(key).await {
            Ok(i) => i,
            Err(e) => {
                // Nothing was recorded: the ticket's store call never began.
                ticket.settle_unrecorded();
                return Err(e.into());
            }
        };
        if issued > 0 {
            ticket.note_issued(issued);
        }
        if issued == 0 || token > issued {
            ticket.settle_unrecorded();
            return Err(ClientError::UnissuedToken {
                key: key.to_string(),
                presented: token,
                highest_issued: issued,
            }
            .into());
        }
        Ok(arrival)
    }

    /// `shared` mode: Postgres orders writes across instances (the fence
    /// row's in-flight counts, see `store::admissions`); the in-process
    /// gate still orders this instance's own writes, and relies on nothing
    /// another instance could have changed: every admission went through
    /// Postgres first.
    async fn check_shared(
        &self,
        pg: &crate::store::PgStore,
        key: &str,
        arrival: Arrival,
        token: i64,
        hold: Duration,
        record: Option<&Begin<'_>>,
    ) -> Result<Option<(Admission, Instant)>, Shared> {
        // The shared gate is not exact: every write goes to Postgres.
        let (Arrival::Record(mut ticket) | Arrival::Recorded(mut ticket)) = arrival;
        // A little more than the forward's own bound, for the time between
        // the marker's write and the forward's start (a forward that would
        // run past the marker is not started: see `must_end_by`).
        let marker = hold + MARKER_SLACK;
        let entered = pg
            .enter(Entry {
                key,
                token,
                hold: marker,
                record,
            })
            .await;
        let lock = match entered {
            Ok(Entered::Stale(highest)) => {
                ticket.settle(Some(highest));
                return Err(Shared::Refused(stale(key, token, highest)));
            }
            Ok(Entered::Duplicate) => {
                // The fence part went through: the token is the key's
                // durable one (or was raised to it); nothing is admitted.
                ticket.settle(Some(token));
                return Ok(None);
            }
            Ok(Entered::Admitted(lock)) => {
                ticket.settle(Some(token));
                lock
            }
            Err(e @ StoreError::KeyBusy(_)) => {
                // Not admitted; the token may be recorded (a raise waits
                // with its token written), so memory learns nothing.
                ticket.settle(None);
                return Err(Shared::Refused(e.into()));
            }
            Err(e) => {
                ticket.settle(None);
                return Err(Shared::Failed(e.into()));
            }
        };
        // Admitted by the store, and the record (if any) written: a refusal
        // by this instance's gate now leaves it to be forgotten.
        let permit = ticket.admit(token).await.map_err(|refused| {
            Shared::Failed(match refused {
                NotAdmitted::Stale(s) => stale(key, token, s.highest),
                NotAdmitted::Reset(_) => {
                    GatewayError::Internal("shared mode's gate refused a write for a reset")
                }
            })
        })?;
        let entered_at = lock.entered_at();
        Ok(Some((
            Admission {
                _permit: permit,
                must_end_by: Some(lock.marker_until()),
                in_flight: Some(lock),
            },
            entered_at,
        )))
    }

    async fn check_single(
        &self,
        key: &str,
        arrival: Arrival,
        token: i64,
    ) -> Result<Permit, GatewayError> {
        let ticket = match arrival {
            // Equal to the key's settled durable token: already recorded,
            // and still the highest — but only while we are provably the
            // store's single writer.
            Arrival::Recorded(ticket) => {
                self.store.check_writer()?;
                ticket
            }
            Arrival::Record(mut ticket) => {
                let answer = self.store.record(key, token).await;
                // An error leaves the outcome unknown: the statement may
                // still commit, and the gate stops trusting its cache for
                // the key until it no longer can.
                ticket.settle(answer.as_ref().ok().copied());
                accepted(key, token, answer?)?;
                ticket
            }
        };
        if let Some(until) = self.quarantine_until {
            if Instant::now() < until {
                tokio::time::sleep_until(until.into()).await;
            }
        }
        let permit = self.admit(key, ticket, token).await?;
        // The wait at the gate (or the quarantine) may have outlasted the
        // lock: checked again right before the write may go, and the permit
        // dropped unused if it is gone. The token stays recorded, which only
        // makes older tokens stale sooner.
        self.store.check_writer()?;
        Ok(permit)
    }
}

impl Fence {
    /// Single mode: admits `ticket`'s write of `token`, recorded already.
    /// An admin reset of the key since then may have set the store below
    /// `token` (see `NotAdmitted::Reset`): the token is then decided again
    /// against the store, and admitted only if it is still the highest, so
    /// that no write is forwarded with a token above what the store holds.
    async fn admit(&self, key: &str, ticket: Ticket, token: i64) -> Result<Permit, GatewayError> {
        let mut ticket = ticket;
        loop {
            match ticket.admit(token).await {
                Ok(permit) => return Ok(permit),
                Err(NotAdmitted::Stale(s)) => return Err(stale(key, token, s.highest)),
                Err(NotAdmitted::Reset(t)) => {
                    ticket = t;
                    ticket.record_again();
                    let answer = self.store.record(key, token).await;
                    ticket.settle(answer.as_ref().ok().copied());
                    accepted(key, token, answer?)?;
                }
            }
        }
    }
}

/// Why a shared-mode decision did not admit.
enum Shared {
    /// Before the statement wrote anything but perhaps the token.
    Refused(GatewayError),
    /// The statement's writes may stand (it timed out, or the gate refused
    /// after it).
    Failed(GatewayError),
}

impl Shared {
    fn into_error(self) -> GatewayError {
        match self {
            Shared::Refused(e) | Shared::Failed(e) => e,
        }
    }
}

/// The store's answer to a decision on `token`: `highest`, the key's highest
/// token after it, equals `token` iff it was accepted; a higher one makes it
/// stale, and a lower one is an answer the store cannot give.
fn accepted(key: &str, token: i64, highest: i64) -> Result<(), GatewayError> {
    if highest > token {
        return Err(stale(key, token, highest));
    }
    if highest < token {
        return Err(StoreError::Other(format!(
            "the store answered {highest} for a decision on {token}"
        ))
        .into());
    }
    Ok(())
}

fn stale(key: &str, presented: i64, highest: i64) -> GatewayError {
    ClientError::StaleToken {
        key: key.to_string(),
        presented,
        highest,
    }
    .into()
}
