//! The per-key gate: the in-process half of the ordering guarantee.
//!
//! The store makes tokens monotonic, but a store check alone is not enough:
//! a write with token 33 can pass its check, stall on the way to the upstream,
//! and arrive after a write with 34 that checked later. The gate closes that
//! window. For each resource key it admits writes of one token at a time:
//!
//! * writes with the *current* token run concurrently (one holder, many
//!   writes);
//! * a write with a *higher* token waits until every in-flight write with the
//!   current token has finished at the upstream, then becomes current;
//! * a write with a token *lower* than the highest one brought to the gate is
//!   refused, even if it is not current yet: that higher token is already
//!   durable in the store (see below), so the lower one is stale.
//!
//! The protocol around it, per request:
//!
//! 1. [`Gate::arrive`]: register interest in the key (a [`Ticket`]), and
//!    refuse or admit from memory when memory suffices (see below);
//! 2. record the token in the store (durable, conditional upsert), and
//!    [`Ticket::settle`] with the store's answer;
//! 3. [`Ticket::admit`]: wait for the gate, get a [`Permit`];
//! 4. forward; drop the permit when the upstream is done with the write
//!    (see `exchange`).
//!
//! Why the ticket comes *before* the store write: a key's slot is forgotten
//! when nothing references it, to keep memory flat. If a request could sit
//! between its store write and its admission without holding a reference, the
//! slot could be forgotten and re-created empty, and that request could be
//! admitted after a newer token had already been forwarded. With the ticket
//! taken first, every request admitted through a slot recorded its token
//! after that slot was created, so the store already refused anything lower
//! than what was forwarded before.
//!
//! Concurrency: the keys are split over shards, each a `std::sync::Mutex`
//! over a map of slots of its own; a key's shard is fixed by a keyed hash of
//! the key, so everything about one key happens under one shard's lock.
//! Critical sections are a few comparisons and never await, so a plain
//! mutex beats an async one; waiting happens on per-waiter oneshot channels
//! outside the lock. The shards are there for a map's growth, not for
//! contention: a hash map grows by moving every slot into a table twice as
//! large, under its lock. One map of a 100,000-key cache moved megabytes at
//! a time into memory touched for the first time, and every fenced write of
//! the process waited behind it while a new gateway's cache filled
//! (docs/internals/performance.md links the measurement). A shard's map is at
//! most a few thousand slots, and only writes
//! to its keys wait while it grows.
//!
//! The slots double as a bounded cache of each key's highest *durable*
//! token, which lets the fence skip the store ([`Gate::arrive`]):
//!
//! * a token below it is stale, in every mode: the cached value is a lower
//!   bound on the store's (it is only ever raised from a store answer, by a
//!   request holding a ticket, and tokens in the store only grow);
//! * in single mode (`exact`), a token equal to it is already recorded and
//!   still the highest, because nothing else writes the store — but only
//!   while the cached value is *exactly* the store's. It is not while a store
//!   call on the key is in flight (it may have committed a higher token whose
//!   answer has not arrived yet), nor for `unsettled_for` after a store call
//!   on the key ended without a known outcome: a statement that timed out on
//!   our side may still commit on the store's, later. In both cases the
//!   request goes to the store, which is always right.
//! * "nothing else writes the store" holds only while this instance holds
//!   the single-writer lock. On Postgres that lock can be lost and taken
//!   again (a failover, a broken connection), and in between another
//!   instance may have written. So each cached value remembers the lock's
//!   generation it was read under, and is exact only in that generation;
//!   after a new acquisition equal tokens go to the store until it has
//!   answered again. Lower bounds stay: they never depended on the lock.
//!
//! Idle slots are only evicted when no ticket references them and no
//! unknown outcome is pending on them, so neither a late, lower answer nor a
//! forgotten "unsettled" mark can make the cache run ahead of the store. Up
//! to `capacity` idle slots are kept, split evenly over the shards; beyond a
//! shard's share, a CLOCK (second chance) evicts that shard's idle slots
//! least recently arrived at, a bounded number of steps per release.

use std::collections::VecDeque;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hashbrown::hash_table::{Entry, HashTable};
use tokio::sync::oneshot;

/// The per-key admission state of one process. A clone is the same gate:
/// it shares the shards (see [`Gate::worker_copy`]).
#[derive(Clone)]
pub struct Gate {
    /// The slots, split by key (see the module docs); a power of two of
    /// them, so a key's shard is a few bits of its hash. Shared with this
    /// gate's worker copies ([`Gate::worker_copy`]).
    shards: Arc<[Shard]>,
    /// Hashes keys, once per arrival: the hash picks the key's shard, finds
    /// its slot there, and goes with the ticket and permit for every later
    /// lookup. std's SipHash with a random key: keys come from clients, and
    /// a hostile client must be able neither to make them collide in a
    /// shard's table nor to aim them at one shard, whose share of the cache
    /// they would then churn.
    hasher: RandomState,
    /// Idle slots kept as a cache of durable tokens, per shard: the
    /// configured capacity split evenly, rounded up.
    capacity: usize,
    /// Single mode: this process is the store's only writer, so a settled
    /// cached token is exactly the store's and equal tokens may be admitted
    /// from memory. Shared mode: other instances raise tokens too, and the
    /// cache is only a lower bound.
    exact: bool,
    /// Single mode on Postgres: the single-writer lock's generation
    /// (see the module docs); `None` when the lock cannot be lost.
    writer: Option<Arc<AtomicU64>>,
    /// How long a key stays unsettled after a store call on it ended without
    /// a known outcome: longer than such a call can still commit on the
    /// store's side (see `unsettled_until`).
    unsettled_for: Duration,
}

/// One shard's lock, on a cache line of its own: the two workers' writes to
/// keys of different shards should not contend for one line either.
#[repr(align(128))]
#[derive(Default)]
struct Shard(Mutex<Slots>);

impl Shard {
    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A panic while holding this lock would be a bug in the few lines
        // that take it; the map is still consistent then, so keep serving.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The most idle keys a shard caches, unless the cache is larger than
/// [`MAX_SHARDS`] of these: a shard's map that grows (see the module docs)
/// then moves a few thousand slots at most.
const KEYS_PER_SHARD: usize = 4096;

/// At most this many shards, however large the cache: locking them all (for
/// the metrics' count of active keys) stays cheap.
const MAX_SHARDS: usize = 256;

/// How many shards a cache of `capacity` idle keys is split into: the
/// fewest, a power of two, whose shares are at most [`KEYS_PER_SHARD`]
/// keys each (so more than half of that when there are several), and no
/// more than [`MAX_SHARDS`]. One for a small cache: nothing to gain.
fn shards_for(capacity: usize) -> usize {
    capacity
        .div_ceil(KEYS_PER_SHARD)
        .next_power_of_two()
        .min(MAX_SHARDS)
}

#[derive(Default)]
struct Slots {
    /// Each key's slot, under the key's hash from [`Gate::hash`]. hashbrown's
    /// table rather than a map, so that the caller's hash is used: a key
    /// memory holds is found, and its `Arc` cloned, in one lookup, without
    /// hashing again or allocating.
    map: HashTable<(Arc<str>, Slot)>,
    /// Slots with a live ticket or permit (the rest are cached idle).
    active: usize,
    /// Every key of `map`, once, with its hash, in the order the eviction
    /// clock visits them (see `make_room`).
    clock: VecDeque<(u64, Arc<str>)>,
}

/// Keys the eviction clock looks at, at most, per release: eviction costs
/// O(1) per request however large the cache.
const CLOCK_STEPS: usize = 8;

impl Slots {
    /// Evicts idle slots until the map fits `capacity`, within a bounded
    /// number of steps (CLOCK, second chance): a slot used since the hand
    /// last passed, busy, or unsettled goes to the back with its use
    /// forgotten; the first one that is none of these goes.
    fn make_room(&mut self, capacity: usize, now: Instant) {
        for _ in 0..CLOCK_STEPS {
            if self.map.len() <= capacity {
                return;
            }
            let Some((hash, key)) = self.clock.pop_front() else {
                return;
            };
            let Ok(mut entry) = self.map.find_entry(hash, |(k, _)| *k == key) else {
                continue;
            };
            let slot = &mut entry.get_mut().1;
            if slot.used || !slot.evictable(now) {
                slot.used = false;
                self.clock.push_back((hash, key));
            } else {
                entry.remove();
            }
        }
    }

    /// The slot of `key`, whose hash is `hash`.
    fn get_mut(&mut self, hash: u64, key: &str) -> Option<&mut Slot> {
        self.map
            .find_mut(hash, |(k, _)| **k == *key)
            .map(|(_, slot)| slot)
    }
}

#[derive(Default)]
struct Slot {
    /// Tickets and permits alive for this key; at zero the slot is idle,
    /// kept as a cached durable token until the eviction clock takes it.
    refs: usize,
    /// The token whose writes may be in flight now (0: none yet).
    current: i64,
    /// Forwards in flight with `current`.
    inflight: usize,
    /// The highest token admitted or waiting. Tokens below it are refused;
    /// every value here was durably recorded before it got here.
    highest: i64,
    /// The highest token the store has confirmed as recorded; `None` when
    /// not known. Not 0: 0 is a valid token, and an unknown key's token
    /// taken for 0 would let a stale 0 through as "already recorded".
    durable: Option<i64>,
    /// The single-writer lock's generation `durable` was read under.
    durable_generation: u64,
    /// Store calls on this key in flight. While one is, the store may hold a
    /// higher token than `durable` already (committed, answer on its way).
    recording: usize,
    /// A store call on this key ended without a known outcome (a timeout, a
    /// cancelled batch, a broken connection): until this instant it may still
    /// commit, so `durable` is only a lower bound. The slot is not evicted
    /// before then, or the mark would be forgotten.
    unsettled_until: Option<Instant>,
    /// Higher-token requests waiting for `inflight` to reach zero.
    waiters: Vec<oneshot::Sender<()>>,
    /// Arrived at again since it was cached or the eviction clock last
    /// passed (its second chance).
    used: bool,
    /// `token = "issued"` routes: the highest fence the lock API is known to
    /// have granted for the lock of this name (a lower bound; fences only
    /// grow, but for a reset).
    issued: Option<i64>,
    /// Admin resets of this key seen while the slot lived. A store answer
    /// read before a reset may be above the reset value; a ticket that saw
    /// another count does not note it.
    resets: u64,
}

impl Slot {
    /// Whether `durable` is exactly the store's highest token right now.
    /// The clock is read only for a key that has an unknown outcome behind
    /// it, which few have.
    fn settled(&self) -> bool {
        self.recording == 0 && self.unsettled_until.is_none_or(|u| u <= Instant::now())
    }

    fn evictable(&self, now: Instant) -> bool {
        self.refs == 0 && self.unsettled_until.is_none_or(|u| u <= now)
    }
}

/// A fenced write memory did not refuse ([`Gate::arrive`]).
pub enum Arrival {
    /// Single mode: equal to the key's settled durable token, so already
    /// recorded and still the highest. No store call is needed.
    Recorded(Ticket),
    /// The store must decide. The ticket counts as a store call in flight
    /// until [`Ticket::settle`] (or its drop, which counts as an unknown
    /// outcome).
    Record(Ticket),
}

/// Interest in a key, taken before the store write.
pub struct Ticket {
    gate: Arc<Gate>,
    key: Arc<str>,
    /// The key's hash, computed once on arrival.
    hash: u64,
    /// Moved into the permit on admission; a ticket that is dropped without
    /// being admitted releases its reference.
    live: bool,
    /// A store call for this ticket is in flight (see [`Arrival::Record`]).
    recording: bool,
    /// The slot's reset count when the ticket was taken.
    resets: u64,
    /// The single-writer lock's generation when the ticket was taken.
    generation: u64,
    /// No other ticket or permit was alive on the key when this one was
    /// taken (see [`Ticket::alone`]).
    alone: bool,
}

/// The right to have one write in flight for a key with a token.
pub struct Permit {
    gate: Arc<Gate>,
    key: Arc<str>,
    hash: u64,
}

/// How a ticket's store call ended.
enum CallEnd {
    /// The store answered: this is the key's highest token.
    Answered(i64),
    /// No answer: the call may still commit.
    Unknown,
    /// Refused before the store was written.
    NeverMade,
}

/// A refusal: a higher token than the presented one reached the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale {
    pub highest: i64,
}

/// Why [`Ticket::admit`] did not admit.
pub enum NotAdmitted {
    /// A higher token reached the gate.
    Stale(Stale),
    /// Single mode: an admin reset of the key came after the ticket's
    /// token was recorded, and may have set the store below it. The
    /// token is recorded again ([`Ticket::record_again`]) and the ticket
    /// admitted after that, so that no write is forwarded with a token
    /// above what the store holds.
    Reset(Ticket),
}

impl std::fmt::Debug for NotAdmitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotAdmitted::Stale(s) => s.fmt(f),
            NotAdmitted::Reset(t) => write!(f, "Reset({})", t.key()),
        }
    }
}

impl Gate {
    /// A gate that keeps up to `capacity` idle keys' durable tokens; `exact`
    /// in single mode (see the field); `unsettled_for` as long as a store
    /// call that timed out may still commit.
    pub fn new(capacity: usize, exact: bool, unsettled_for: Duration) -> Arc<Self> {
        Self::sharded(capacity, shards_for(capacity), exact, None, unsettled_for)
    }

    /// An exact gate whose memory is exact only within one generation of
    /// the single-writer lock, counted by `generation` (see the module
    /// docs).
    pub fn exact_while(
        capacity: usize,
        generation: Arc<AtomicU64>,
        unsettled_for: Duration,
    ) -> Arc<Self> {
        let shards = shards_for(capacity);
        Self::sharded(capacity, shards, true, Some(generation), unsettled_for)
    }

    /// A gate of `shards` shards (a power of two) sharing `capacity`.
    fn sharded(
        capacity: usize,
        shards: usize,
        exact: bool,
        writer: Option<Arc<AtomicU64>>,
        unsettled_for: Duration,
    ) -> Arc<Self> {
        debug_assert!(shards.is_power_of_two());
        Arc::new(Self {
            shards: (0..shards).map(|_| Shard::default()).collect(),
            hasher: RandomState::new(),
            capacity: capacity.div_ceil(shards),
            exact,
            writer,
            unsettled_for,
        })
    }

    /// The same gate for one traffic worker: the same shards, hashed the
    /// same way, behind an `Arc` of the worker's own. Every ticket and
    /// permit holds an `Arc` of its gate, taken and dropped once per fenced
    /// write; on one `Arc` shared by every worker that count's cache line
    /// would move between the workers' cores on every write. A write's
    /// ordering is its key's slot's, in the shared shards, whichever copy
    /// it came through.
    pub fn worker_copy(&self) -> Arc<Gate> {
        Arc::new(self.clone())
    }

    fn generation(&self) -> u64 {
        self.writer
            .as_ref()
            .map_or(0, |g| g.load(Ordering::Acquire))
    }

    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard of the key hashed to `hash`. Bits 32 and up: hashbrown
    /// finds a bucket by a hash's low bits and tags it with its top seven,
    /// so bits taken from either would be the same for every key of a
    /// shard, and its table would use a fraction of its buckets.
    fn shard_of(&self, hash: u64) -> usize {
        (hash >> 32) as usize & (self.shards.len() - 1)
    }

    /// The shard of the key hashed to `hash`, locked.
    fn lock(&self, hash: u64) -> MutexGuard<'_, Slots> {
        self.shards[self.shard_of(hash)].lock()
    }

    /// `f` on the slot of `key` (hashed to `hash`) under its shard's lock;
    /// `None` when memory holds no slot for it.
    fn with_slot<R>(&self, hash: u64, key: &str, f: impl FnOnce(&mut Slot) -> R) -> Option<R> {
        self.lock(hash).get_mut(hash, key).map(f)
    }

    /// Registers a fenced write of `token` on `key` and decides what memory
    /// can, in one pass through the lock: `Err` when the token is below the
    /// key's known durable token (stale wherever it came from). Take it
    /// before recording the token: see the module docs for why the ticket
    /// must come first.
    pub fn arrive(self: &Arc<Self>, key: &str, token: i64) -> Result<Arrival, Stale> {
        let generation = self.generation();
        let hash = self.hash(key);
        let mut guard = self.lock(hash);
        let slots = &mut *guard;
        let entry = slots
            .map
            .entry(hash, |(k, _)| **k == *key, |(k, _)| self.hash(k));
        let (key, slot) = match entry {
            Entry::Occupied(entry) => {
                if let Some(highest) = entry.get().1.durable.filter(|d| token < *d) {
                    // Refused without a reference: nothing to release.
                    return Err(Stale { highest });
                }
                let (key, slot) = entry.into_mut();
                // A key seen again earns its second chance.
                slot.used = true;
                (Arc::clone(key), slot)
            }
            Entry::Vacant(entry) => {
                // A new key has none yet, so a stream of one-off keys does
                // not push out keys in use.
                let key: Arc<str> = Arc::from(key);
                slots.clock.push_back((hash, Arc::clone(&key)));
                let (_, slot) = entry.insert((Arc::clone(&key), Slot::default())).into_mut();
                (key, slot)
            }
        };
        slot.refs += 1;
        let resets = slot.resets;
        let recorded = self.exact
            && slot.durable == Some(token)
            && slot.durable_generation == generation
            && slot.settled();
        if !recorded {
            slot.recording += 1;
        }
        if slot.refs == 1 {
            slots.active += 1;
        }
        let ticket = Ticket {
            gate: self.clone(),
            key,
            hash,
            live: true,
            recording: !recorded,
            resets,
            generation,
            alone: slot.refs == 1,
        };
        Ok(if recorded {
            Arrival::Recorded(ticket)
        } else {
            Arrival::Record(ticket)
        })
    }

    /// An admin reset set `key`'s highest token (possibly lower): forget
    /// what memory knew of it, so nothing cached refuses the tokens the reset
    /// allows again. Writes in flight keep the key closed to other tokens
    /// until they are done, as always.
    pub fn forget(&self, key: &str) {
        self.with_slot(self.hash(key), key, |s| {
            s.durable = None;
            s.issued = None;
            s.highest = 0;
            s.resets += 1;
        });
    }

    /// Keys with requests in flight or waiting; for metrics and shutdown.
    /// The shards are counted one after another, not at one instant; that
    /// loses nothing a single count would have: a key counted in one shard
    /// cannot move to another, and a write that arrives while the shards
    /// are counted could as well have arrived just after a single count.
    pub fn tracked_keys(&self) -> usize {
        self.shards.iter().map(|s| s.lock().active).sum()
    }

    /// Keys held in memory, active or cached.
    #[cfg(test)]
    pub fn cached_keys(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// The known durable token of `key`, for tests.
    #[cfg(test)]
    fn durable(&self, key: &str) -> Option<i64> {
        self.with_slot(self.hash(key), key, |s| s.durable).flatten()
    }

    /// Whether memory holds a slot for `key`, for tests.
    #[cfg(test)]
    fn holds(&self, key: &str) -> bool {
        self.with_slot(self.hash(key), key, |_| ()).is_some()
    }

    fn release(&self, hash: u64, key: &str, inflight: bool, recording: bool) {
        let mut guard = self.lock(hash);
        let slots = &mut *guard;
        let Some(slot) = slots.get_mut(hash, key) else {
            return;
        };
        if recording {
            // Dropped while its store call was in flight: outcome unknown.
            slot.recording -= 1;
            slot.unsettled_until = Some(Instant::now() + self.unsettled_for);
        }
        slot.refs -= 1;
        if inflight {
            slot.inflight -= 1;
            if slot.inflight == 0 {
                // Wake every waiter; they re-check under the lock and the
                // highest of them wins, the rest are refused or join it.
                for w in slot.waiters.drain(..) {
                    let _ = w.send(());
                }
            }
        }
        if slot.refs == 0 {
            slots.active -= 1;
            if slots.map.len() > self.capacity {
                slots.make_room(self.capacity, Instant::now());
            }
        }
    }
}

impl Ticket {
    /// The key this ticket is for.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether the key had no other write in flight or waiting when this
    /// ticket was taken. Then, in single mode, this write's admission
    /// almost never waits once the store accepted its token: a write that
    /// arrives after it and goes to the store is decided in the same batch
    /// or a later one (each batcher runs one batch at a time), so a lower
    /// token is refused there, an equal one runs alongside, and a higher
    /// one makes this one stale. (A later arrival can overtake it on the
    /// way to the store, rarely: on the way to the batcher, or in a batch
    /// of another kind, as a first use of an Idempotency-Key's decision goes into a batch
    /// of records and a plain write's into a fence batch; then it waits as
    /// usual.) A hint for planning, never something the ordering relies
    /// on.
    pub fn alone(&self) -> bool {
        self.alone
    }

    /// Ends this ticket's store call: `Some(highest)` when the store answered
    /// that `highest` is recorded for the key, `None` when the outcome is
    /// unknown (the call may still commit later). A ticket that needed no
    /// store call ignores this.
    pub fn settle(&mut self, answer: Option<i64>) {
        self.end_call(match answer {
            Some(highest) => CallEnd::Answered(highest),
            None => CallEnd::Unknown,
        });
    }

    /// Ends this ticket's store call as never made (refused before the
    /// store was written): nothing can commit later.
    pub fn settle_unrecorded(&mut self) {
        self.end_call(CallEnd::NeverMade);
    }

    fn end_call(&mut self, end: CallEnd) {
        if !self.recording {
            return;
        }
        self.recording = false;
        self.gate.with_slot(self.hash, &self.key, |s| {
            s.recording -= 1;
            match end {
                // An answer from before a reset may be above its value.
                CallEnd::Answered(_) if s.resets != self.resets => {}
                // A late, lower answer changes nothing. Otherwise the answer
                // is the store's value under this ticket's generation.
                CallEnd::Answered(highest) if s.durable.is_some_and(|d| d > highest) => {}
                CallEnd::Answered(highest) => {
                    s.durable = Some(highest);
                    s.durable_generation = self.generation;
                }
                CallEnd::Unknown => {
                    s.unsettled_until = Some(Instant::now() + self.gate.unsettled_for)
                }
                CallEnd::NeverMade => {}
            }
        });
    }

    /// `token = "issued"`: whether memory knows a fence at least `token` was
    /// granted for this key's lock.
    pub fn known_issued(&self, token: i64) -> bool {
        self.gate
            .with_slot(self.hash, &self.key, |s| s.issued)
            .flatten()
            .is_some_and(|i| i >= token)
    }

    /// Remembers that a fence `issued` was granted for this key's lock.
    pub fn note_issued(&self, issued: i64) {
        self.gate.with_slot(self.hash, &self.key, |s| {
            if s.resets == self.resets {
                s.issued = Some(s.issued.map_or(issued, |i| i.max(issued)));
            }
        });
    }

    /// A reset came between this ticket's store call and its admission
    /// ([`NotAdmitted::Reset`]): a new store call begins, under the reset
    /// count of now. Settle it as the first.
    pub fn record_again(&mut self) {
        debug_assert!(!self.recording, "one store call at a time");
        let resets = self.gate.with_slot(self.hash, &self.key, |s| {
            s.recording += 1;
            s.resets
        });
        self.resets = resets.unwrap_or(self.resets);
        self.recording = true;
    }

    /// Waits until a write with `token` may go to the upstream. `token` must
    /// have been durably recorded (the store answered with it as highest).
    pub async fn admit(mut self, token: i64) -> Result<Permit, NotAdmitted> {
        debug_assert!(!self.recording, "settle the store call before admission");
        loop {
            let wait = {
                let mut slots = self.gate.lock(self.hash);
                let slot = slots
                    .get_mut(self.hash, &self.key)
                    .expect("a live ticket keeps its slot");
                // Only single mode's gate decides from what it knows of the
                // store; shared mode's admissions went through Postgres,
                // which orders them against resets itself.
                if self.gate.exact && slot.resets != self.resets {
                    drop(slots);
                    return Err(NotAdmitted::Reset(self));
                }
                slot.highest = slot.highest.max(token);
                if token < slot.highest {
                    return Err(NotAdmitted::Stale(Stale {
                        highest: slot.highest,
                    }));
                }
                if token == slot.current || slot.inflight == 0 {
                    slot.current = token;
                    slot.inflight += 1;
                    self.live = false;
                    return Ok(Permit {
                        gate: self.gate.clone(),
                        key: self.key.clone(),
                        hash: self.hash,
                    });
                }
                let (tx, rx) = oneshot::channel();
                slot.waiters.push(tx);
                rx
            };
            // The sender is dropped only with the slot, which this ticket
            // keeps alive; either way, re-check.
            let _ = wait.await;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.live {
            self.gate
                .release(self.hash, &self.key, false, self.recording);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.release(self.hash, &self.key, true, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sharded, so that these tests also show that a key's whole life
    /// stays in its shard.
    fn gate() -> Arc<Gate> {
        Gate::sharded(100, 4, true, None, Duration::from_secs(30))
    }

    /// A ticket for a write the store has recorded (its answer: `token`).
    fn recorded(gate: &Arc<Gate>, key: &str, token: i64) -> Ticket {
        match gate.arrive(key, token) {
            Ok(Arrival::Record(mut t)) => {
                t.settle(Some(token));
                t
            }
            Ok(Arrival::Recorded(t)) => t,
            Err(Stale { highest }) => panic!("{token} refused below {highest}"),
        }
    }

    #[tokio::test]
    async fn equal_tokens_share_higher_waits_lower_refused() {
        let gate = gate();
        let a1 = recorded(&gate, "k", 33).admit(33).await.unwrap();
        let a2 = recorded(&gate, "k", 33).admit(33).await.unwrap();
        let b = recorded(&gate, "k", 34);
        let waiting = tokio::spawn(b.admit(34));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "34 must wait for 33 to drain");
        // 33 is now lower than the recorded 34: refused from memory.
        assert!(matches!(gate.arrive("k", 33), Err(Stale { highest: 34 })));
        drop(a1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        drop(a2);
        let b = waiting.await.unwrap().unwrap();
        drop(b);
        assert_eq!(gate.tracked_keys(), 0, "no key is active when idle");
    }

    /// Two workers' copies of one gate are one gate: a write through one
    /// orders against a write through the other, memory decided through one
    /// is known through the other, and both count the same keys.
    #[tokio::test]
    async fn worker_copies_are_one_gate() {
        let shared = gate();
        let (one, two) = (shared.worker_copy(), shared.worker_copy());
        assert!(!Arc::ptr_eq(&one, &two));
        let a = recorded(&one, "k", 33).admit(33).await.unwrap();
        assert_eq!(
            two.durable("k"),
            Some(33),
            "a copy sees what the other cached"
        );
        let b = recorded(&two, "k", 34);
        let waiting = tokio::spawn(b.admit(34));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "34 through one copy waits for 33 through the other"
        );
        assert!(matches!(one.arrive("k", 33), Err(Stale { highest: 34 })));
        assert_eq!(shared.tracked_keys(), 1);
        drop(a);
        let b = waiting.await.unwrap().unwrap();
        drop(b);
        assert_eq!(shared.tracked_keys(), 0);
        assert_eq!(one.durable("k"), Some(34));
    }

    #[tokio::test]
    async fn highest_waiter_wins() {
        let gate = gate();
        let a = recorded(&gate, "k", 1).admit(1).await.unwrap();
        // Tokens recorded but not yet cached as durable: the gate itself
        // orders them.
        let mut t2 = match gate.arrive("k", 2) {
            Ok(Arrival::Record(t)) => t,
            _ => panic!("2 needs the store"),
        };
        let mut t3 = match gate.arrive("k", 3) {
            Ok(Arrival::Record(t)) => t,
            _ => panic!("3 needs the store"),
        };
        t2.settle(Some(2));
        let w2 = tokio::spawn(t2.admit(2));
        tokio::time::sleep(Duration::from_millis(10)).await;
        t3.settle(Some(3));
        let w3 = tokio::spawn(t3.admit(3));
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a);
        assert!(matches!(
            w2.await.unwrap(),
            Err(NotAdmitted::Stale(Stale { highest: 3 }))
        ));
        let p3 = w3.await.unwrap().unwrap();
        drop(p3);
        assert_eq!(gate.tracked_keys(), 0);
    }

    /// A ticket is alone while no other ticket or permit lives on its key,
    /// whatever other keys hold.
    #[tokio::test]
    async fn a_ticket_knows_whether_the_key_was_otherwise_idle() {
        let gate = gate();
        let first = recorded(&gate, "k", 1);
        assert!(first.alone());
        let _other_key = recorded(&gate, "j", 1);
        let second = recorded(&gate, "k", 1);
        assert!(!second.alone(), "a ticket lives on the key");
        let permit = first.admit(1).await.unwrap();
        drop(second);
        assert!(!recorded(&gate, "k", 2).alone(), "a permit lives on it");
        drop(permit);
        assert!(recorded(&gate, "k", 2).alone(), "idle again");
    }

    #[tokio::test]
    async fn keys_are_independent() {
        let gate = gate();
        let _a = recorded(&gate, "a", 5).admit(5).await.unwrap();
        let _b = recorded(&gate, "b", 1).admit(1).await.unwrap();
        assert_eq!(gate.tracked_keys(), 2);
    }
}

#[cfg(test)]
mod cache_tests {
    use super::*;

    const UNSETTLED: Duration = Duration::from_millis(200);

    fn record(gate: &Arc<Gate>, key: &str, token: i64) -> Ticket {
        match gate.arrive(key, token) {
            Ok(Arrival::Record(t)) => t,
            Ok(Arrival::Recorded(_)) => panic!("{token} on {key} admitted from memory"),
            Err(Stale { highest }) => panic!("{token} refused below {highest}"),
        }
    }

    #[tokio::test]
    async fn durable_tokens_are_cached_and_bounded() {
        let gate = Gate::new(100, true, UNSETTLED);
        for i in 0..1000 {
            record(&gate, &format!("k{i}"), i + 1).settle(Some(i + 1));
        }
        assert!(gate.cached_keys() <= 100, "{}", gate.cached_keys());
        assert_eq!(gate.tracked_keys(), 0);
        let in_clock = gate.shards[0].lock().clock.len();
        assert_eq!(in_clock, gate.cached_keys());
        // The newest keys are kept, the oldest went.
        assert_eq!(gate.durable("k999"), Some(1000));
        assert_eq!(gate.durable("k0"), None);
    }

    /// A small cache is one shard; the default's 100,000 keys are 32 of
    /// 3,125, and no cache is split further than `MAX_SHARDS`.
    #[test]
    fn shards_follow_the_capacity() {
        assert_eq!(shards_for(0), 1);
        assert_eq!(shards_for(100), 1);
        assert_eq!(shards_for(KEYS_PER_SHARD), 1);
        assert_eq!(shards_for(KEYS_PER_SHARD + 1), 2);
        assert_eq!(shards_for(2 * KEYS_PER_SHARD + 1), 4);
        assert_eq!(shards_for(100_000), 32);
        assert_eq!(shards_for(100_000_000), MAX_SHARDS);
        for capacity in (1..300_000).step_by(997) {
            let shards = shards_for(capacity);
            let share = capacity.div_ceil(shards);
            assert!(share <= KEYS_PER_SHARD, "{capacity}: {shards} of {share}");
            assert!(
                shards == 1 || share > KEYS_PER_SHARD / 2,
                "{capacity}: {shards} of {share}"
            );
        }
    }

    /// Split over shards, the cache stays within its capacity in all, every
    /// shard takes its share of new keys, and each shard's clock holds
    /// exactly its own keys.
    #[tokio::test]
    async fn a_sharded_cache_is_bounded_and_spread() {
        let gate = Gate::sharded(1000, 8, true, None, UNSETTLED);
        for i in 0..10_000 {
            record(&gate, &format!("k{i}"), i + 1).settle(Some(i + 1));
        }
        assert!(gate.cached_keys() <= 1000, "{}", gate.cached_keys());
        assert!(gate.cached_keys() >= 900, "{}", gate.cached_keys());
        assert_eq!(gate.tracked_keys(), 0);
        for (i, shard) in gate.shards.iter().enumerate() {
            let slots = shard.lock();
            assert!(slots.map.len() > 50, "shard {i}: {}", slots.map.len());
            assert!(slots.map.len() <= 125, "shard {i}: {}", slots.map.len());
            assert_eq!(slots.clock.len(), slots.map.len(), "shard {i}");
            assert!(slots
                .clock
                .iter()
                .all(|(h, k)| *h == gate.hash(k) && gate.shard_of(*h) == i));
        }
        assert_eq!(gate.durable("k9999"), Some(10_000));
        assert_eq!(gate.durable("k0"), None);
    }

    /// Second chance: a key in use keeps its place while others churn
    /// through the cache.
    #[tokio::test]
    async fn a_hot_key_survives_churn() {
        let gate = Gate::new(10, true, UNSETTLED);
        record(&gate, "hot", 5).settle(Some(5));
        for i in 0..200 {
            record(&gate, &format!("k{i}"), 1).settle(Some(1));
            {
                assert!(
                    matches!(gate.arrive("hot", 5), Ok(Arrival::Recorded(_))),
                    "the hot key was evicted after {i} others"
                );
            }
        }
        assert!(gate.cached_keys() <= 10, "{}", gate.cached_keys());
    }

    #[tokio::test]
    async fn answers_only_raise_and_unknown_is_not_zero() {
        let gate = Gate::new(100, true, UNSETTLED);
        assert!(
            matches!(gate.arrive("fresh", 0), Ok(Arrival::Record(_))),
            "unknown is not 0"
        );
        let mut six = record(&gate, "k", 6);
        record(&gate, "k", 5).settle(Some(5));
        // A late answer, lower than one already noted, changes nothing.
        six.settle(Some(3));
        assert_eq!(gate.durable("k"), Some(5));
        assert!(matches!(gate.arrive("k", 0), Err(Stale { highest: 5 })));
        assert!(matches!(gate.arrive("k", 5), Ok(Arrival::Recorded(_))));
        assert_eq!(gate.durable("other"), None);
    }

    #[tokio::test]
    async fn a_recorded_zero_is_known() {
        let gate = Gate::new(100, true, UNSETTLED);
        record(&gate, "k", 0).settle(Some(0));
        assert!(matches!(gate.arrive("k", 0), Ok(Arrival::Recorded(_))));
    }

    /// The store may hold a higher token than the cache while a store call
    /// is in flight: equal tokens then go to the store too.
    #[tokio::test]
    async fn no_equal_fast_path_while_a_store_call_is_in_flight() {
        let gate = Gate::new(100, true, UNSETTLED);
        record(&gate, "k", 5).settle(Some(5));
        let mut seven = record(&gate, "k", 7);
        let mut five = record(&gate, "k", 5);
        seven.settle(Some(7));
        five.settle(Some(7));
        assert!(matches!(gate.arrive("k", 5), Err(Stale { highest: 7 })));
        assert!(matches!(gate.arrive("k", 7), Ok(Arrival::Recorded(_))));
    }

    /// A store call whose outcome is unknown may commit later: until the
    /// unsettled period is over, equal tokens go to the store — also after
    /// the key's slot would otherwise have been evicted.
    #[tokio::test]
    async fn unknown_outcome_unsettles_the_key() {
        let gate = Gate::new(2, true, UNSETTLED);
        record(&gate, "k", 5).settle(Some(5));
        record(&gate, "k", 7).settle(None);
        assert!(matches!(gate.arrive("k", 5), Ok(Arrival::Record(_))));
        // Dropping a ticket mid-call counts as unknown too.
        drop(record(&gate, "j", 1));
        for i in 0..50 {
            record(&gate, &format!("x{i}"), 1).settle(Some(1));
        }
        assert!(gate.holds("k"), "unsettled keys stay");
        assert!(gate.holds("j"), "unsettled keys stay");
        assert!(matches!(gate.arrive("k", 5), Ok(Arrival::Record(_))));
        tokio::time::sleep(UNSETTLED + Duration::from_millis(20)).await;
        assert!(matches!(gate.arrive("k", 5), Ok(Arrival::Recorded(_))));
    }

    /// A reset may lower a key: memory forgets it, and an answer read
    /// before the reset is not noted after it.
    #[tokio::test]
    async fn a_reset_forgets_the_key() {
        let gate = Gate::new(100, true, UNSETTLED);
        record(&gate, "k", 9).settle(Some(9));
        let in_flight = match gate.arrive("k", 9) {
            Ok(Arrival::Recorded(t)) => t.admit(9).await.unwrap(),
            _ => panic!("9 is recorded"),
        };
        let mut before = record(&gate, "k", 10);
        before.note_issued(12);
        gate.forget("k");
        before.settle(Some(10));
        before.note_issued(12);
        drop(before);
        assert_eq!(gate.durable("k"), None);
        // 5 (the reset allows it) waits for 9's write to finish.
        let mut five = record(&gate, "k", 5);
        assert!(!five.known_issued(5));
        five.settle(Some(5));
        let waiting = tokio::spawn(five.admit(5));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "5 must wait for 9's write");
        drop(in_flight);
        drop(waiting.await.unwrap().unwrap());
        assert!(matches!(gate.arrive("k", 5), Ok(Arrival::Recorded(_))));
    }

    /// A write recorded before a reset and waiting at the gate is not
    /// admitted on what the store said before the reset: it must be
    /// recorded again, and is admitted after that; the reset does not
    /// raise the key's highest in memory meanwhile, so a lower token the
    /// reset allows is not refused on its account.
    #[tokio::test]
    async fn a_write_recorded_before_a_reset_is_recorded_again() {
        let gate = Gate::new(100, true, UNSETTLED);
        let mut five = record(&gate, "k", 5);
        five.settle(Some(5));
        let in_flight = five.admit(5).await.unwrap();
        let mut nine = record(&gate, "k", 9);
        nine.settle(Some(9));
        let waiting = tokio::spawn(nine.admit(9));
        tokio::time::sleep(Duration::from_millis(20)).await;
        gate.forget("k");
        drop(in_flight);
        let mut nine = match waiting.await.unwrap() {
            Err(NotAdmitted::Reset(t)) => t,
            Err(other) => panic!("refused: {other:?}"),
            Ok(_) => panic!("admitted across a reset"),
        };
        // Recorded again: admitted now.
        nine.record_again();
        nine.settle(Some(9));
        let permit = nine.admit(9).await.unwrap();
        drop(permit);
        assert!(matches!(gate.arrive("k", 9), Ok(Arrival::Recorded(_))));
        // Shared mode's gate leaves resets to Postgres.
        let shared = Gate::new(100, false, UNSETTLED);
        let mut one = record(&shared, "k", 1);
        one.settle(Some(1));
        shared.forget("k");
        drop(one.admit(1).await.unwrap());
    }

    /// Single mode on Postgres: once the single-writer lock was taken again,
    /// another instance may have written in between, so memory from the
    /// previous generation only refuses (a lower bound), never admits,
    /// until the store has answered again.
    #[tokio::test]
    async fn a_new_writer_generation_ends_the_equal_fast_path() {
        // Asserts that the store must decide, without leaving an unknown
        // outcome behind.
        fn needs_store(gate: &Arc<Gate>, token: i64) {
            match gate.arrive("k", token) {
                Ok(Arrival::Record(mut t)) => t.settle_unrecorded(),
                Ok(Arrival::Recorded(_)) => panic!("{token} admitted from memory"),
                Err(Stale { highest }) => panic!("{token} refused below {highest}"),
            }
        }
        let generation = Arc::new(AtomicU64::new(1));
        let gate = Gate::exact_while(100, generation.clone(), UNSETTLED);
        record(&gate, "k", 5).settle(Some(5));
        assert!(matches!(gate.arrive("k", 5), Ok(Arrival::Recorded(_))));
        // Arrived under generation 1, answered after generation 2 began.
        let mut late = record(&gate, "k", 6);
        generation.store(2, Ordering::Release);
        late.settle(Some(6));
        drop(late);
        needs_store(&gate, 6);
        assert!(matches!(gate.arrive("k", 4), Err(Stale { highest: 6 })));
        // The store answers under generation 2: exact again.
        record(&gate, "k", 6).settle(Some(6));
        assert!(matches!(gate.arrive("k", 6), Ok(Arrival::Recorded(_))));
        // A lower answer in the new generation (the old primary's last
        // commits did not reach the new one) keeps the bound, not exactness.
        generation.store(3, Ordering::Release);
        record(&gate, "k", 6).settle(Some(5));
        needs_store(&gate, 6);
        assert!(matches!(gate.arrive("k", 5), Err(Stale { highest: 6 })));
    }

    /// Shared mode: other instances raise tokens, so equal is never enough.
    #[tokio::test]
    async fn shared_mode_never_admits_from_memory() {
        let gate = Gate::new(100, false, UNSETTLED);
        record(&gate, "k", 5).settle(Some(5));
        assert!(matches!(gate.arrive("k", 5), Ok(Arrival::Record(_))));
        assert!(matches!(gate.arrive("k", 4), Err(Stale { highest: 5 })));
    }
}
