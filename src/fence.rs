//! The fence decision: the durable store and the in-process gate together.
//!
//! Order matters (see `gate` for the full argument): take a ticket on the
//! key ([`Fence::arrive`]), record the token durably, then wait at the gate
//! ([`Fence::check`]). The token is durable before the write is forwarded,
//! so after a crash or restart anything lower than a forwarded token is
//! still refused.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{ClientError, GatewayError};
use crate::gate::{Arrival, Gate, Permit};
use crate::store::{Entered, FenceStore, KeyLock, StoreError};

/// The right to forward one fenced write; drop it when the upstream is done
/// with the write (see `exchange`).
pub struct Admission {
    /// The in-process gate's permit.
    _permit: Permit,
    /// `shared` mode: the key's cross-instance lock (released after the
    /// permit, by field order).
    _lock: Option<KeyLock>,
    /// `shared` mode: other instances assume this write may be in flight
    /// until this instant if we crash, so the forward must end by then.
    pub must_end_by: Option<Instant>,
}

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
    /// `cache_keys`: how many idle keys' durable tokens to keep in memory.
    pub fn new(store: FenceStore, cache_keys: usize) -> Self {
        // Single mode: nothing else writes the store, so a settled cached
        // token is exact. Shared mode: other instances raise tokens.
        let exact = !store.is_shared();
        Self {
            gate: Gate::new(cache_keys, exact, store.late_commit_bound()),
            store,
            quarantine_until: None,
        }
    }

    /// Holds back fenced writes until `until` (see `quarantine_until`).
    pub fn with_quarantine(mut self, until: Instant) -> Self {
        self.quarantine_until = Some(until);
        self
    }

    /// Whether a decision uses store connections directly from the calling
    /// task (shared mode), rather than only through the batcher's channel.
    pub fn talks_to_store(&self) -> bool {
        self.store.is_shared()
    }

    /// The first, memory-only step of a decision: takes the key's ticket and
    /// refuses a token below the key's known durable token, without a store
    /// call or a task. Cheap enough for the request's own task.
    pub fn arrive(&self, key: &str, token: i64) -> Result<Arrival, GatewayError> {
        self.gate
            .arrive(key, token)
            .map_err(|s| stale(key, token, s.highest))
    }

    /// Decides a fenced write of `token` that [`Fence::arrive`] let through.
    /// On success the returned admission must live until the upstream is
    /// done with the write. `hold` is how long the forward may take (the
    /// route's timeout).
    pub async fn check(
        &self,
        key: &str,
        arrival: Arrival,
        token: i64,
        hold: Duration,
    ) -> Result<Admission, GatewayError> {
        if let FenceStore::Postgres(pg) = &self.store {
            if pg.is_shared() {
                return self.check_shared(pg, key, arrival, token, hold).await;
            }
        }
        let permit = self.check_single(key, arrival, token).await?;
        Ok(Admission {
            _permit: permit,
            _lock: None,
            must_end_by: None,
        })
    }

    /// `shared` mode: Postgres orders writes across instances (advisory
    /// locks, see migrations/postgres/0003_shared_mode.sql); the in-process
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
    ) -> Result<Admission, GatewayError> {
        // The shared gate is not exact: every write goes to Postgres.
        let (Arrival::Record(mut ticket) | Arrival::Recorded(mut ticket)) = arrival;
        // A little more than the forward's own bound, for the time between
        // the marker's write and the forward's start (a forward that would
        // run past the marker is not started: see `must_end_by`).
        let marker = hold + MARKER_SLACK;
        let entered = pg.enter(key, token, marker).await;
        let lock = match entered {
            Ok(Entered::Stale(highest)) => {
                ticket.settle(Some(highest));
                return Err(stale(key, token, highest));
            }
            Ok(Entered::Admitted(lock)) => {
                ticket.settle(Some(token));
                lock
            }
            Err(e) => {
                ticket.settle(None);
                return Err(e.into());
            }
        };
        let permit = ticket
            .admit(token)
            .await
            .map_err(|s| stale(key, token, s.highest))?;
        Ok(Admission {
            _permit: permit,
            must_end_by: Some(lock.marker_until()),
            _lock: Some(lock),
        })
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
                let highest = answer?;
                if highest > token {
                    return Err(stale(key, token, highest));
                }
                if highest < token {
                    return Err(StoreError::Other(format!(
                        "the store answered {highest} for a decision on {token}"
                    ))
                    .into());
                }
                ticket
            }
        };
        if let Some(until) = self.quarantine_until {
            if Instant::now() < until {
                tokio::time::sleep_until(until.into()).await;
            }
        }
        ticket
            .admit(token)
            .await
            .map_err(|s| stale(key, token, s.highest))
    }
}

fn stale(key: &str, presented: i64, highest: i64) -> GatewayError {
    ClientError::StaleToken {
        key: key.to_string(),
        presented,
        highest,
    }
    .into()
}
