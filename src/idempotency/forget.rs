//! Records of first uses that were not sent after all, forgotten so that
//! the key can be used again, as the client's 503 told it.
//!
//! Why a record may need forgetting when the gateway does not know it
//! exists: a first use fails before it is forwarded — its statement timed
//! out, or committed and its reply was lost, or nothing of it reached the
//! upstream — and its in-flight record may have been written all the same.
//! The store is most often what failed, so the forget is tried again in
//! the background ([`Forgets::later`]), after pauses of [`PAUSES`], until
//! it succeeds or the record may have expired (where the upstream failed,
//! not the store, it is tried once before the answer:
//! [`Forgets::now_or_later`]). A forget that never
//! succeeds leaves the record in flight, then unknown, until it expires:
//! duplicates hear "outcome unknown", the safe side. Each forget names its
//! first use's attempt, so a late one never removes a newer first use's
//! record.
//!
//! Why a retry does not wait for the background: until the forget lands a
//! retry of the key finds the record in flight, and would hear 409 "in
//! progress" for a request this instance knows it never sent. So the
//! forgets still pending are kept by record id and attempt
//! ([`Forgets::forgetting`]). A request that finds the key's record to be
//! one of them does not take it for an answer: a first use (whose record
//! insert found the key taken) forgets it itself, inline
//! ([`Forgets::take_back`]), and claims the key again; a request refused before its record was written keeps its
//! refusal (`gateway`). A key may have several pending: each retry that
//! failed on the store before it was sent left one of its own, and the
//! record is whichever of them was written, if any. Only the instance
//! that failed the first use knows; a retry on another instance (shared
//! mode) hears "in progress" until the background forget lands.
//!
//! Bounds: at most [`RETRYING`] forgets wait to try again at once (a store
//! down for long under a flood of first uses would otherwise pile up
//! tasks); one that finds none free tries once only. The pending map holds
//! one attempt per forget task, removed when the task ends: so at most
//! [`RETRYING`] beside the forgets making their first try.
//!
//! Concurrency: one `std::sync::Mutex` around the pending map, held for a
//! hash insert, lookup or removal, never across a store call. A lookup
//! happens only when a record is read from the store (a first use found
//! its key taken, or a refusal is checked against the key's record), so
//! the common path never touches it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::store::{FenceStore, RecordId, StoreError};

/// The pauses between tries of a failed forget: the last repeats.
pub const PAUSES: [Duration; 5] = [
    Duration::from_millis(100),
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];

/// How many forgets may wait to try again at once.
pub const RETRYING: usize = 4096;

/// A record's id, owned: the pending map's key.
type OwnedId = (String, String, String);

fn owned(id: RecordId<'_>) -> OwnedId {
    (
        id.route.to_string(),
        id.method.to_string(),
        id.key.to_string(),
    )
}

/// The forgets of one gateway process, shared by every worker.
pub struct Forgets {
    /// Where the records are.
    store: FenceStore,
    /// The runtime that owns the store's connections, where the background
    /// forgets run (a worker's runtime may be busy, or gone at shutdown).
    runtime: tokio::runtime::Handle,
    /// Permits for forgets that wait to try again ([`RETRYING`]).
    retrying: Arc<Semaphore>,
    /// The records being forgotten, by id, with the attempts the forgets
    /// name: a retry of the key takes its record back at once instead of
    /// hearing "in progress" (see the module doc). Each forget's task
    /// removes its own attempt, and the id once it has none.
    pending: Mutex<HashMap<OwnedId, Vec<i64>>>,
}

impl Forgets {
    pub fn new(store: FenceStore, runtime: tokio::runtime::Handle) -> Self {
        Self {
            store,
            runtime,
            retrying: Arc::new(Semaphore::new(RETRYING)),
            pending: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<OwnedId, Vec<i64>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets `attempt`'s in-flight record of `id` in the background (the
    /// answer does not wait for it): its request was not sent, and the
    /// record may exist all the same. Tried again while it fails, until
    /// `until` (when the record may have expired) passes. The record is
    /// [`forgetting`](Self::forgetting) from this call on, so a retry
    /// answered after it finds it.
    pub fn later(self: &Arc<Self>, id: RecordId<'_>, attempt: i64, until: Instant) {
        let owned = owned(id);
        self.lock().entry(owned.clone()).or_default().push(attempt);
        let forgets = self.clone();
        self.runtime.spawn(async move {
            let (route, method, key) = &owned;
            let id = RecordId { route, method, key };
            forgets.tries(id, attempt, until).await;
            let mut pending = forgets.lock();
            if let Some(attempts) = pending.get_mut(&owned) {
                attempts.retain(|a| *a != attempt);
                if attempts.is_empty() {
                    pending.remove(&owned);
                }
            }
        });
    }

    /// [`later`](Self::later), but tried once first, before the answer:
    /// where the store is likely answering (the upstream failed, not the
    /// store), the key is free on every instance once the client hears.
    pub async fn now_or_later(self: &Arc<Self>, id: RecordId<'_>, attempt: i64, until: Instant) {
        if self.store.idem_forget(id, attempt).await.is_err() {
            self.later(id, attempt, until);
        }
    }

    /// Forgets `attempt`'s record of `id` now, one try: a retry taking back
    /// the record of a request this instance never sent
    /// ([`forgetting`](Self::forgetting)). Its background forget goes on
    /// (and finds nothing more to do).
    pub async fn take_back(&self, id: RecordId<'_>, attempt: i64) -> Result<(), StoreError> {
        self.store.idem_forget(id, attempt).await
    }

    /// Whether this instance is forgetting `attempt`'s record of `id`: the
    /// record of a request it never sent, which a retry may take back.
    pub fn forgetting(&self, id: RecordId<'_>, attempt: i64) -> bool {
        let pending = self.lock();
        !pending.is_empty()
            && pending
                .get(&owned(id))
                .is_some_and(|attempts| attempts.contains(&attempt))
    }

    async fn tries(&self, id: RecordId<'_>, attempt: i64, until: Instant) {
        let mut permit = None;
        for tried in 0.. {
            let Err(err) = self.store.idem_forget(id, attempt).await else {
                return;
            };
            let pause = PAUSES[tried.min(PAUSES.len() - 1)];
            if permit.is_none() {
                permit = self.retrying.clone().try_acquire_owned().ok();
            }
            if permit.is_none() || Instant::now() + pause >= until {
                tracing::warn!(error = %err, "cannot forget an unsent idempotency record; duplicates will see outcome unknown");
                return;
            }
            tokio::time::sleep(pause).await;
        }
    }
}
