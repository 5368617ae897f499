//! The fence decision: the durable store and the in-process gate together.
//!
//! Order matters (see `gate` for the full argument): take a ticket on the
//! key, record the token durably, then wait at the gate. The token is durable
//! before the write is forwarded, so after a crash or restart anything lower
//! than a forwarded token is still refused.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{ClientError, GatewayError};
use crate::gate::{Gate, Permit};
use crate::store::{Entered, FenceStore, KeyLock, StoreError};

/// The right to forward one fenced write; drop it when the upstream has
/// finished with the write.
pub struct Admission {
    /// The in-process gate's permit.
    _permit: Permit,
    /// `shared` mode: the key's cross-instance lock (released after the
    /// permit, by field order).
    _lock: Option<KeyLock>,
    /// `shared` mode: other instances assume this write may be in flight
    /// until this instant if we crash, so the forward must end by then.
    pub deadline: Option<Instant>,
}

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
    pub fn new(store: FenceStore) -> Self {
        Self::with_cache(store, 100_000)
    }

    /// `cache_keys`: how many idle keys' durable tokens to keep in memory.
    pub fn with_cache(store: FenceStore, cache_keys: usize) -> Self {
        Self {
            store,
            gate: Gate::with_capacity(cache_keys),
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
        matches!(&self.store, FenceStore::Postgres(pg) if pg.is_shared())
    }

    /// Decides a fenced write of `token` on `key`. On success the returned
    /// admission must live until the upstream has finished with the write.
    /// `hold` is how long the forward may take (the route's timeout).
    pub async fn check(
        &self,
        key: &str,
        token: i64,
        hold: Duration,
    ) -> Result<Admission, GatewayError> {
        if let FenceStore::Postgres(pg) = &self.store {
            if pg.is_shared() {
                return self.check_shared(pg, key, token, hold).await;
            }
        }
        let permit = self.check_single(key, token).await?;
        Ok(Admission {
            _permit: permit,
            _lock: None,
            deadline: None,
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
        token: i64,
        hold: Duration,
    ) -> Result<Admission, GatewayError> {
        // Memory fast path, valid across instances: tokens only grow, so one
        // below a known durable token is stale wherever it came from.
        let (ticket, known) = self.gate.ticket_and_durable(key);
        if let Some(known) = known.filter(|k| token < *k) {
            return Err(stale(key, token, known));
        }
        // A little more than the forward's own bound, for the time between
        // this statement and the forward's start.
        let marker = hold + Duration::from_secs(1);
        let entered_at = Instant::now();
        let lock = match pg.enter(key, token, marker).await? {
            Entered::Stale(highest) => {
                ticket.note_durable(highest);
                return Err(stale(key, token, highest));
            }
            Entered::Admitted(lock) => lock,
        };
        ticket.note_durable(token);
        let permit = ticket
            .admit(token)
            .await
            .map_err(|s| stale(key, token, s.highest))?;
        Ok(Admission {
            _permit: permit,
            _lock: Some(lock),
            deadline: Some(entered_at + hold),
        })
    }

    async fn check_single(&self, key: &str, token: i64) -> Result<Permit, GatewayError> {
        // Memory fast paths. Below a known durable token: stale. Equal to
        // it: already recorded — and in single mode nobody else writes the
        // store, so it is still the highest. Either way no store round trip.
        let (ticket, known) = self.gate.ticket_and_durable(key);
        if let Some(known) = known.filter(|k| token < *k) {
            return Err(stale(key, token, known));
        }
        let highest = if known == Some(token) {
            // Only while we are provably the single writer.
            self.store.check_writer()?;
            token
        } else {
            let h = self.store.record(key, token).await?;
            ticket.note_durable(h);
            h
        };
        if highest > token {
            return Err(stale(key, token, highest));
        }
        if highest < token {
            return Err(StoreError::Other(format!(
                "the store answered {highest} for a decision on {token}"
            ))
            .into());
        }
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
