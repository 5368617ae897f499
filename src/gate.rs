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
//! Concurrency: one `std::sync::Mutex` over a map of slots. Critical sections
//! are a few comparisons and never await, so a plain mutex beats an async
//! one; waiting happens on per-waiter oneshot channels outside the lock.
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
//! to `capacity` idle slots are kept; beyond that, a CLOCK (second chance)
//! evicts the idle slots least recently arrived at, a bounded number of
//! steps per release.

use std::collections::VecDeque;
use std::hash::RandomState;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hashbrown::hash_map::{Entry, EntryRef};
use tokio::sync::oneshot;

/// The per-key admission state of one process.
pub struct Gate {
    slots: Mutex<Slots>,
    /// Idle slots kept as a cache of durable tokens.
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

#[derive(Default)]
struct Slots {
    /// hashbrown's map for its `entry_ref`: a key memory holds is found,
    /// and its `Arc` cloned, in one lookup and without allocating. Hashed
    /// with std's SipHash: keys come from clients, and a hostile client
    /// must not be able to make them collide.
    map: hashbrown::HashMap<Arc<str>, Slot, RandomState>,
    /// Slots with a live ticket or permit (the rest are cached idle).
    active: usize,
    /// Every key of `map`, once, in the order the eviction clock visits
    /// them (see `make_room`).
    clock: VecDeque<Arc<str>>,
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
            let Some(key) = self.clock.pop_front() else {
                return;
            };
            let Entry::Occupied(mut entry) = self.map.entry(key) else {
                continue;
            };
            let slot = entry.get_mut();
            if slot.used || !slot.evictable(now) {
                slot.used = false;
                self.clock.push_back(Arc::clone(entry.key()));
            } else {
                entry.remove();
            }
        }
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

impl Gate {
    /// A gate that keeps up to `capacity` idle keys' durable tokens; `exact`
    /// in single mode (see the field); `unsettled_for` as long as a store
    /// call that timed out may still commit.
    pub fn new(capacity: usize, exact: bool, unsettled_for: Duration) -> Arc<Self> {
        Arc::new(Self {
            slots: Mutex::new(Slots::default()),
            capacity,
            exact,
            writer: None,
            unsettled_for,
        })
    }

    /// An exact gate whose memory is exact only within one generation of
    /// the single-writer lock, counted by `generation` (see the module
    /// docs).
    pub fn exact_while(
        capacity: usize,
        generation: Arc<AtomicU64>,
        unsettled_for: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            slots: Mutex::new(Slots::default()),
            capacity,
            exact: true,
            writer: Some(generation),
            unsettled_for,
        })
    }

    fn generation(&self) -> u64 {
        self.writer
            .as_ref()
            .map_or(0, |g| g.load(Ordering::Acquire))
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A panic while holding this lock would be a bug in the few lines
        // below; the map is still consistent then, so keep serving.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a fenced write of `token` on `key` and decides what memory
    /// can, in one pass through the lock: `Err` when the token is below the
    /// key's known durable token (stale wherever it came from). Take it
    /// before recording the token: see the module docs for why the ticket
    /// must come first.
    pub fn arrive(self: &Arc<Self>, key: &str, token: i64) -> Result<Arrival, Stale> {
        let generation = self.generation();
        let mut guard = self.lock();
        let slots = &mut *guard;
        let (key, slot) = match slots.map.entry_ref(key) {
            EntryRef::Occupied(entry) => {
                if let Some(highest) = entry.get().durable.filter(|d| token < *d) {
                    // Refused without a reference: nothing to release.
                    return Err(Stale { highest });
                }
                let key = Arc::clone(entry.key());
                let slot = entry.into_mut();
                // A key seen again earns its second chance.
                slot.used = true;
                (key, slot)
            }
            EntryRef::Vacant(entry) => {
                // A new key has none yet, so a stream of one-off keys does
                // not push out keys in use.
                let entry = entry.insert_entry(Slot::default());
                let key = Arc::clone(entry.key());
                slots.clock.push_back(Arc::clone(&key));
                (key, entry.into_mut())
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
        let mut slots = self.lock();
        if let Some(s) = slots.map.get_mut(key) {
            s.durable = None;
            s.issued = None;
            s.highest = 0;
            s.resets += 1;
        }
    }

    /// Keys with requests in flight or waiting; for metrics and shutdown.
    pub fn tracked_keys(&self) -> usize {
        self.lock().active
    }

    /// Keys held in memory, active or cached.
    #[cfg(test)]
    pub fn cached_keys(&self) -> usize {
        self.lock().map.len()
    }

    /// The known durable token of `key`, for tests.
    #[cfg(test)]
    fn durable(&self, key: &str) -> Option<i64> {
        self.lock().map.get(key).and_then(|s| s.durable)
    }

    fn release(&self, key: &Arc<str>, inflight: bool, recording: bool) {
        let mut guard = self.lock();
        let slots = &mut *guard;
        let Some(slot) = slots.map.get_mut(key) else {
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
    /// of another kind, as a keyed first use's decision goes into a batch
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
        let mut slots = self.gate.lock();
        if let Some(s) = slots.map.get_mut(&self.key) {
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
        }
    }

    /// `token = "issued"`: whether memory knows a fence at least `token` was
    /// granted for this key's lock.
    pub fn known_issued(&self, token: i64) -> bool {
        let slots = self.gate.lock();
        slots
            .map
            .get(&self.key)
            .and_then(|s| s.issued)
            .is_some_and(|i| i >= token)
    }

    /// Remembers that a fence `issued` was granted for this key's lock.
    pub fn note_issued(&self, issued: i64) {
        let mut slots = self.gate.lock();
        if let Some(s) = slots.map.get_mut(&self.key) {
            if s.resets == self.resets {
                s.issued = Some(s.issued.map_or(issued, |i| i.max(issued)));
            }
        }
    }

    /// Waits until a write with `token` may go to the upstream. `token` must
    /// have been durably recorded (the store answered with it as highest).
    pub async fn admit(mut self, token: i64) -> Result<Permit, Stale> {
        debug_assert!(!self.recording, "settle the store call before admission");
        loop {
            let wait = {
                let mut slots = self.gate.lock();
                let slot = slots
                    .map
                    .get_mut(&self.key)
                    .expect("a live ticket keeps its slot");
                slot.highest = slot.highest.max(token);
                if token < slot.highest {
                    return Err(Stale {
                        highest: slot.highest,
                    });
                }
                if token == slot.current || slot.inflight == 0 {
                    slot.current = token;
                    slot.inflight += 1;
                    self.live = false;
                    return Ok(Permit {
                        gate: self.gate.clone(),
                        key: self.key.clone(),
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
            self.gate.release(&self.key, false, self.recording);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.release(&self.key, true, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> Arc<Gate> {
        Gate::new(100, true, Duration::from_secs(30))
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
        assert_eq!(w2.await.unwrap().err(), Some(Stale { highest: 3 }));
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
        let in_clock = gate.lock().clock.len();
        assert_eq!(in_clock, gate.cached_keys());
        // The newest keys are kept, the oldest went.
        assert_eq!(gate.durable("k999"), Some(1000));
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
        assert!(gate.lock().map.contains_key("k"), "unsettled keys stay");
        assert!(gate.lock().map.contains_key("j"), "unsettled keys stay");
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
