//! The deadline a connection enforces itself, whoever stalls.
//!
//! An exchange sent with a deadline (the gateway sends every fenced write
//! with one) must be over by it in both directions. The exchange's own
//! futures and bodies cut it there, but only when they are polled, and nobody polls them when the
//! client stops reading the answer (the gateway's socket to it is full) or
//! the upstream stops reading the request. So a connection that carries an
//! exchange with a deadline has a watchdog task: when the deadline passes with the
//! exchange not over, it resets the connection (after that no byte moves
//! either way) and only then tells the exchange.
//!
//! A reset, not a shutdown: a shutdown lets the kernel send what it still
//! holds of the request and only then a FIN, and it tells an upstream that
//! is writing a long answer into a window the client no longer drains
//! nothing at all, so that upstream would wait for ever. A reset
//! ([`tcp::reset`]) drops both of the kernel's queues and sends RST without
//! closing the descriptor.
//!
//! The watchdog knows the socket only by its descriptor's number, so that
//! the connection can own its socket outright (and read it through
//! tokio's own stream, which knows a short read drained it). A number
//! outlives its descriptor and can be reused by another socket, so the
//! reset happens under the cutoff's lock and only while the connection has
//! not said it is closing, which it says under the same lock before its
//! socket is closed (see `Connection`'s drop).
//!
//! The watchdog is spawned with a connection's first exchange that has a
//! deadline and lives as long as the connection; exchanges without one
//! never start it.

use std::future::Future;
use std::os::fd::{BorrowedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Instant;

use super::tcp;
use super::Witness;

/// The deadline of the exchange a connection carries, if it has one. Armed
/// before a fenced request is written, cleared when the exchange is over
/// and the connection goes back to the pool; a connection dropped
/// mid-exchange is closed at once.
#[derive(Default)]
pub(super) struct Cutoff {
    state: Mutex<State>,
    /// Whether `state.armed` is set: written under the lock, read without
    /// it. A pass-through request never arms its connection, and so its
    /// writes (each asks `passed`) and its return to the pool take no lock.
    is_armed: AtomicBool,
    /// Wakes the watchdog to look at a deadline earlier than its timer, or
    /// at a connection that was dropped. A clear needs no wake: the
    /// watchdog finds it when its timer fires.
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    armed: Option<Armed>,
    /// When the watchdog's timer fires, as the watchdog last set it
    /// (`None`: it has none). An exchange whose deadline is no earlier
    /// needs no wake: the watchdog looks again when that timer fires, and
    /// sets it anew then. Deadlines of successive exchanges on a connection
    /// only grow (each is its start plus the route's timeout), so only a
    /// connection's first fenced exchange, or one on a route with a shorter
    /// timeout, wakes the watchdog: waking it for every fenced write cost a
    /// task poll and a timer moved in the wheel, each time.
    watching: Option<Instant>,
    /// The connection is closing: its descriptor may be closed from now on
    /// (see the module docs), and the watchdog ends.
    closed: bool,
    /// The watchdog reset the connection at a deadline: it must never go
    /// back to the pool (its watchdog has ended).
    cut: bool,
}

/// A deadline, and who to tell when the connection closed itself at it.
struct Armed {
    at: Instant,
    on_cut: Arc<dyn Witness>,
}

impl Cutoff {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the exchange's deadline has passed. The watchdog resets the
    /// connection then, but only once it runs: a process that was
    /// paused (SIGSTOP, a VM freeze) across the deadline may poll the
    /// connection before the timer, and by then other instances may have let
    /// a newer token through (shared mode's marker has ended). So no byte is
    /// written after the deadline, whatever runs first.
    pub(super) fn passed(&self) -> bool {
        self.is_armed.load(Ordering::Acquire)
            && self
                .lock()
                .armed
                .as_ref()
                .is_some_and(|a| Instant::now() >= a.at)
    }

    pub(super) fn arm(&self, at: Instant, on_cut: Arc<dyn Witness>) {
        let wake = {
            let mut state = self.lock();
            state.armed = Some(Armed { at, on_cut });
            self.is_armed.store(true, Ordering::Release);
            state.watching.is_none_or(|w| w > at)
        };
        if wake {
            self.changed.notify_one();
        }
    }

    /// Only the exchange's owner arms and clears (the connection is lent
    /// to one exchange at a time), so an unarmed cutoff stays unarmed
    /// while this looks.
    pub(super) fn clear(&self) {
        if self.is_armed.load(Ordering::Acquire) {
            let mut state = self.lock();
            state.armed = None;
            self.is_armed.store(false, Ordering::Release);
        }
    }

    /// Whether the watchdog has reset the connection.
    pub(super) fn was_cut(&self) -> bool {
        self.lock().cut
    }

    /// The connection is closing (before its socket is closed): its
    /// watchdog ends, and resets nothing any more.
    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_one();
    }

    /// For the watchdog: where its timer must be set, given that it is set
    /// for `timer` now (no later than the armed deadline, and left as it is
    /// when it already is: see `watching`); `Err` once the connection is
    /// dropped.
    fn watch(&self, timer: Option<Instant>) -> Result<Option<Instant>, ()> {
        let mut state = self.lock();
        if state.closed {
            return Err(());
        }
        let at = state.armed.as_ref().map(|a| a.at);
        let timer = match (timer, at) {
            (Some(t), Some(at)) => Some(t.min(at)),
            (t, at) => t.or(at),
        };
        state.watching = timer;
        Ok(timer)
    }

    /// If its deadline is `by` or earlier: disarms it, resets the
    /// connection on the socket `fd` unless the connection is closing (then
    /// the socket is closed, or about to be), and answers whom to tell.
    fn fire(&self, by: Instant, fd: RawFd) -> Option<Arc<dyn Witness>> {
        let mut state = self.lock();
        if state.armed.as_ref().is_none_or(|a| a.at > by) {
            return None;
        }
        self.is_armed.store(false, Ordering::Release);
        state.cut = true;
        if !state.closed {
            // SAFETY: under the lock, with the connection not closing, the
            // descriptor is open and is this connection's socket (see the
            // module docs): the borrow ends before the lock is let go.
            tcp::reset(unsafe { BorrowedFd::borrow_raw(fd) });
        }
        state.armed.take().map(|a| a.on_cut)
    }
}

/// Watches a connection's deadlines until the connection closes; at a
/// deadline that passes with its exchange not over, resets the connection
/// on the socket `fd` and only then tells the exchange.
pub(super) async fn watchdog(cutoff: Arc<Cutoff>, fd: RawFd) {
    // One timer for the connection's life, moved (not made anew) when a
    // deadline earlier than it is armed; `set_for`: when it fires, if set.
    let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
    let mut set_for: Option<Instant> = None;
    let on_cut = loop {
        // Created before the state is read: a deadline armed from now on
        // that is earlier than the timer wakes it (`notify_one` keeps a
        // permit until then).
        let changed = cutoff.changed.notified();
        let Ok(want) = cutoff.watch(set_for) else {
            // Closed with the exchange not over: when that is past its
            // deadline, it is the cut, and the exchange must hear of it as
            // if the timer had fired. Otherwise the exchange is let go (its
            // own drop keeps the key closed until then).
            match cutoff.fire(Instant::now(), fd) {
                Some(on_cut) => break on_cut,
                None => return,
            }
        };
        if want != set_for {
            if let Some(at) = want {
                match timer.as_mut() {
                    Some(t) => t.as_mut().reset(at.into()),
                    None => timer = Some(Box::pin(tokio::time::sleep_until(at.into()))),
                }
            }
            set_for = want;
        }
        let fired = std::future::poll_fn(|cx| match (timer.as_mut(), set_for) {
            (Some(t), Some(_)) => t.as_mut().poll(cx),
            _ => Poll::Pending,
        });
        tokio::select! {
            biased;
            () = changed => {}
            () = fired => {
                // Set no later than the armed deadline: one due by then
                // has passed. A later one (the exchange it was set for is
                // over, and another began) sets it again.
                let by = set_for.take();
                if let Some(on_cut) = by.and_then(|by| cutoff.fire(by, fd)) {
                    break on_cut;
                }
            }
        }
    };
    tracing::debug!("upstream connection reset at its fenced write's deadline");
    on_cut.cut();
}

#[cfg(test)]
mod tests {
    use super::super::socket_pair;
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    /// Records when it was told, and which exchange it was.
    struct Told(
        &'static str,
        tokio::sync::mpsc::UnboundedSender<(&'static str, Instant)>,
    );
    impl Witness for Told {
        fn request_written(&self) {}
        fn answer_began(&self, _: bool) {}
        fn cut(&self) {
            let _ = self.1.send((self.0, Instant::now()));
        }
    }

    /// On a fresh connection: an exchange armed `first` from now, over as
    /// soon as the watchdog has set its timer for it, then one armed
    /// `second` from then. Answers which exchange the watchdog cut, and
    /// whether it did so at or after the second's deadline; the watchdog
    /// must end at the cut, and a peer writing a long answer must then
    /// fail.
    /// (The test's runtime has one thread: the watchdog runs only while the
    /// test yields, so no sleep has to be long enough.)
    async fn cut_after(first: Duration, second: Duration) -> (&'static str, bool) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let cutoff = Arc::new(Cutoff::default());
        let (socket, mut peer) = socket_pair().await;
        // Writes until the connection fails (nobody reads it on this side).
        let writer = tokio::spawn(async move {
            let piece = vec![b'x'; 64 * 1024];
            loop {
                if let Err(e) = tokio::io::AsyncWriteExt::write_all(&mut peer, &piece).await {
                    return e;
                }
            }
        });
        let dog = tokio::spawn(watchdog(cutoff.clone(), socket.as_raw_fd()));
        cutoff.arm(Instant::now() + first, Arc::new(Told("first", tx.clone())));
        tokio::task::yield_now().await;
        assert!(
            cutoff.lock().watching.is_some(),
            "the watchdog set its timer"
        );
        cutoff.clear();
        let at = Instant::now() + second;
        cutoff.arm(at, Arc::new(Told("second", tx)));
        let (who, when) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("cut within 10 s: well before a 60 s first deadline")
            .expect("told");
        dog.await.expect("the watchdog ends at the cut");
        assert!(cutoff.was_cut());
        // The peer was writing a long answer into a window nobody drains:
        // its writes fail now, it is not left waiting.
        let failed = tokio::time::timeout(Duration::from_secs(10), writer)
            .await
            .expect("the peer's writes fail soon after the cut")
            .expect("the writer ran");
        assert!(
            matches!(
                failed.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "{failed}"
        );
        cutoff.close();
        drop(socket);
        (who, when >= at)
    }

    /// The watchdog keeps its timer across exchanges, so each deadline must
    /// still be met: one earlier than the timer wakes the watchdog at once,
    /// one later is waited for when the timer fires first, and an exchange
    /// that was over is never cut.
    #[tokio::test]
    async fn each_exchange_is_cut_at_its_own_deadline() {
        // A long timeout's timer stays set; a short one is met anyway.
        let (who, in_time) = cut_after(Duration::from_secs(60), Duration::from_millis(150)).await;
        assert_eq!(who, "second");
        assert!(in_time, "cut before its deadline");
        // The timer fires for the first, finds it over, and is set again.
        let (who, in_time) =
            cut_after(Duration::from_millis(300), Duration::from_millis(800)).await;
        assert_eq!(who, "second", "an exchange that was over is never cut");
        assert!(in_time, "cut at the first's timer, before its deadline");
    }

    /// A connection dropped before its deadline ends its watchdog without
    /// telling the exchange (its own drop keeps the key closed until the
    /// deadline); dropped past it, the exchange is told.
    #[tokio::test]
    async fn a_dropped_connection_ends_its_watchdog() {
        for (ahead, told) in [(Duration::from_secs(60), false), (Duration::ZERO, true)] {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let cutoff = Arc::new(Cutoff::default());
            let (socket, mut peer) = socket_pair().await;
            let dog = tokio::spawn(watchdog(cutoff.clone(), socket.as_raw_fd()));
            cutoff.arm(Instant::now() + ahead, Arc::new(Told("it", tx)));
            cutoff.close();
            drop(socket);
            tokio::time::timeout(Duration::from_secs(10), dog)
                .await
                .expect("the watchdog ends")
                .expect("cleanly");
            assert_eq!(rx.try_recv().is_ok(), told, "deadline {ahead:?} ahead");
            let mut byte = [0u8; 1];
            let read = tokio::io::AsyncReadExt::read(&mut peer, &mut byte).await;
            assert!(matches!(read, Ok(0) | Err(_)), "closed");
        }
    }
}
