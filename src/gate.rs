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
//! 1. [`Gate::ticket`]: register interest in the key;
//! 2. record the token in the store (durable, conditional upsert);
//! 3. [`Ticket::admit`]: wait for the gate, get a [`Permit`];
//! 4. forward; drop the permit when the upstream has finished.
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
//! token ([`Ticket::durable`]), which lets the fence skip the store: a token
//! below it is stale (tokens only grow), and in single mode a token equal to
//! it is already recorded. The value is only ever raised from a store answer
//! by a request holding a ticket, and idle slots are only evicted when no
//! ticket references them, so a late, lower answer can never overwrite a
//! newer one after an eviction. Up to `capacity` idle slots are kept; beyond
//! that, idle slots are swept out in arbitrary order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// The per-key admission state of one process.
pub struct Gate {
    slots: Mutex<Slots>,
    /// Idle slots kept as a cache of durable tokens.
    capacity: usize,
}

#[derive(Default)]
struct Slots {
    map: HashMap<Arc<str>, Slot>,
    /// Slots with a live ticket or permit (the rest are cached idle).
    active: usize,
}

#[derive(Default)]
struct Slot {
    /// Tickets and permits alive for this key; the slot is removed at zero.
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
    /// Higher-token requests waiting for `inflight` to reach zero.
    waiters: Vec<oneshot::Sender<()>>,
}

/// Interest in a key, taken before the store write.
pub struct Ticket {
    gate: Arc<Gate>,
    key: Arc<str>,
    /// Moved into the permit on admission; a ticket that is dropped without
    /// being admitted releases its reference.
    live: bool,
}

/// The right to have one write in flight for a key with a token.
pub struct Permit {
    gate: Arc<Gate>,
    key: Arc<str>,
}

/// A refusal: a higher token than the presented one reached the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale {
    pub highest: i64,
}

impl Gate {
    pub fn new() -> Arc<Self> {
        Self::with_capacity(100_000)
    }

    /// A gate that keeps up to `capacity` idle keys' durable tokens.
    pub fn with_capacity(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            slots: Mutex::new(Slots::default()),
            capacity,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A panic while holding this lock would be a bug in the few lines
        // below; the map is still consistent then, so keep serving.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers interest in `key`. Take it before recording the token.
    pub fn ticket(self: &Arc<Self>, key: &str) -> Ticket {
        self.ticket_and_durable(key).0
    }

    /// [`Gate::ticket`], plus the key's known durable token read under the
    /// same lock (see [`Ticket::durable`]), to save the fast path a second
    /// trip through the mutex.
    pub fn ticket_and_durable(self: &Arc<Self>, key: &str) -> (Ticket, Option<i64>) {
        let mut slots = self.lock();
        let key: Arc<str> = match slots.map.get_key_value(key) {
            Some((k, _)) => k.clone(),
            None => Arc::from(key),
        };
        let slot = slots.map.entry(key.clone()).or_default();
        slot.refs += 1;
        let durable = slot.durable;
        if slot.refs == 1 {
            slots.active += 1;
        }
        let ticket = Ticket {
            gate: self.clone(),
            key,
            live: true,
        };
        (ticket, durable)
    }

    /// Keys with requests in flight or waiting; for metrics and shutdown.
    pub fn tracked_keys(&self) -> usize {
        self.lock().active
    }

    /// The known durable token of `key` without taking a ticket. Only good
    /// for refusing lower tokens, which it always may.
    pub fn peek_durable(&self, key: &str) -> Option<i64> {
        self.lock().map.get(key).and_then(|s| s.durable)
    }

    /// Keys held in memory, active or cached.
    #[cfg(test)]
    pub fn cached_keys(&self) -> usize {
        self.lock().map.len()
    }

    fn release(&self, key: &Arc<str>, inflight: bool) {
        let mut guard = self.lock();
        let slots = &mut *guard;
        let Some(slot) = slots.map.get_mut(key) else {
            return;
        };
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
                // Amortized: sweep down to 90% so this runs rarely.
                let target = self.capacity - self.capacity / 10;
                let mut excess = slots.map.len().saturating_sub(target);
                slots.map.retain(|_, s| {
                    if excess > 0 && s.refs == 0 {
                        excess -= 1;
                        false
                    } else {
                        true
                    }
                });
            }
        }
    }
}

impl Ticket {
    /// The key this ticket is for.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The highest token the store is known to have recorded for the key, if
    /// known. A lower bound on the true highest token. (The fence reads it
    /// with the ticket, in [`Gate::ticket_and_durable`].)
    #[cfg(test)]
    pub fn durable(&self) -> Option<i64> {
        let slots = self.gate.lock();
        slots.map.get(&self.key).and_then(|s| s.durable)
    }

    /// Remembers a store answer: `highest` is recorded for the key.
    pub fn note_durable(&self, highest: i64) {
        let mut slots = self.gate.lock();
        if let Some(s) = slots.map.get_mut(&self.key) {
            s.durable = Some(s.durable.map_or(highest, |d| d.max(highest)));
        }
    }

    /// Waits until a write with `token` may go to the upstream. `token` must
    /// have been durably recorded (the store answered with it as highest).
    pub async fn admit(mut self, token: i64) -> Result<Permit, Stale> {
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
            self.gate.release(&self.key, false);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.release(&self.key, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn equal_tokens_share_higher_waits_lower_refused() {
        let gate = Gate::new();
        let a1 = gate.ticket("k").admit(33).await.unwrap();
        let a2 = gate.ticket("k").admit(33).await.unwrap();
        let b = gate.ticket("k");
        let waiting = tokio::spawn(b.admit(34));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "34 must wait for 33 to drain");
        // 33 is now lower than the waiting 34: refused.
        assert_eq!(
            gate.ticket("k").admit(33).await.err(),
            Some(Stale { highest: 34 })
        );
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
        let gate = Gate::new();
        let a = gate.ticket("k").admit(1).await.unwrap();
        let w2 = tokio::spawn(gate.ticket("k").admit(2));
        tokio::time::sleep(Duration::from_millis(10)).await;
        let w3 = tokio::spawn(gate.ticket("k").admit(3));
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a);
        assert_eq!(w2.await.unwrap().err(), Some(Stale { highest: 3 }));
        let p3 = w3.await.unwrap().unwrap();
        drop(p3);
        assert_eq!(gate.tracked_keys(), 0);
    }

    #[tokio::test]
    async fn keys_are_independent() {
        let gate = Gate::new();
        let _a = gate.ticket("a").admit(5).await.unwrap();
        let _b = gate.ticket("b").admit(1).await.unwrap();
        assert_eq!(gate.tracked_keys(), 2);
    }
}

#[cfg(test)]
mod cache_tests {
    use super::*;

    #[tokio::test]
    async fn durable_tokens_are_cached_and_bounded() {
        let gate = Gate::with_capacity(100);
        for i in 0..1000 {
            let t = gate.ticket(&format!("k{i}"));
            t.note_durable(i + 1);
        }
        assert!(gate.cached_keys() <= 100, "{}", gate.cached_keys());
        assert_eq!(gate.tracked_keys(), 0);
        // A recent key is likely still cached; any cached value is exact.
        let t = gate.ticket("k999");
        assert!(matches!(t.durable(), Some(1000) | None));
    }

    #[tokio::test]
    async fn notes_only_raise() {
        let gate = Gate::new();
        let t = gate.ticket("k");
        assert_eq!(t.durable(), None, "unknown is not 0");
        t.note_durable(5);
        t.note_durable(3);
        assert_eq!(t.durable(), Some(5));
        t.note_durable(0);
        assert_eq!(gate.peek_durable("k"), Some(5));
        assert_eq!(gate.peek_durable("other"), None);
    }

    #[tokio::test]
    async fn a_recorded_zero_is_known() {
        let gate = Gate::new();
        let t = gate.ticket("k");
        t.note_durable(0);
        assert_eq!(t.durable(), Some(0));
    }
}
