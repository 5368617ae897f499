//! One fenced write's exchange with the upstream, and the moment its key may
//! open for another token.
//!
//! A key opens for a different token only when the upstream is *done* with
//! the older write. From a proxy's seat that is knowable in one case only:
//! the request body was handed over in full, and then the upstream's answer
//! ended normally. Every other ending leaves the upstream possibly still at
//! work — an answer that breaks off, a client that leaves (before or after
//! the head, which drops the upstream connection mid-exchange), an answer
//! that comes while the request body is still being sent (the upstream may
//! go on reading and applying it) — and then the key stays closed until the
//! forward's deadline, the bound on the whole exchange.
//!
//! The deadline (the route's `timeout_ms` from the start of the forward)
//! bounds the *whole* exchange, not just the wait for the response head:
//! when it passes, both body wrappers cut their streams, and the upstream
//! connection closes itself (`upstream`'s cutoff, which also covers bodies
//! nobody polls: a client that stopped reading, an upstream that stopped
//! reading), so nothing of this write moves in either direction afterwards,
//! and the connection then tells the exchange, which lets the key open.
//! That makes the deadline a true upper bound on the write's life at the
//! gateway, which is what a crash recovery waits out (shared mode's
//! `writer_until`, single mode's start-up quarantine).
//!
//! The [`Exchange`] holds the gate's admission. The request body wrapper
//! (`proxy::LimitedBody`) reports when the body was handed over in full, the
//! forward when the head arrives, the response body wrapper
//! (`proxy::RelayBody`) when the answer ended. Whoever completes the
//! normal ending releases the admission at once; if the exchange is dropped
//! any other way, its `Drop` keeps the admission until the deadline.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::fence::Admission;
use crate::gateway::GatedRoute;
use crate::metrics::HoldReason;

/// The state of one fenced exchange; shared by the forward and both body
/// wrappers through an `Arc`.
pub struct Exchange {
    state: Mutex<State>,
    /// When the exchange must be over; see the module docs.
    deadline: Instant,
    /// Where to keep the admission until the deadline after an abnormal end:
    /// the store's runtime, which outlives the worker threads. The clean-stop
    /// bookkeeping waits for the gate to empty, so a held key is never
    /// mistaken for a finished write at shutdown. Behind the worker's own
    /// `Arc` (see `GatewayState::store_runtime`).
    runtime: Arc<tokio::runtime::Handle>,
    /// Where a hold is counted (`fencegate_held_keys_total`). The copy of
    /// the route of the worker the write came in on, as the write's
    /// accounting holds it: its reference count is not one that every
    /// traffic worker writes (see `reload::WorkerLive`).
    route: Arc<GatedRoute>,
}

struct State {
    /// Taken when released (now or at the deadline).
    admission: Option<Admission>,
    progress: Progress,
    /// What the upstream connection has heard since this request began:
    /// any byte of an answer before the request body is handed over in full
    /// makes it an early answer, however late its head is complete.
    heard: Option<crate::upstream::Heard>,
}

/// How far an exchange has come. Each event only ever adds to what is
/// known: an early answer, once seen, is never forgotten, whatever order
/// the body wrapper and the forward report their events in.
#[derive(Debug, Default, Clone, Copy)]
struct Progress {
    /// The request body was handed to the upstream connection in full.
    request_sent: bool,
    /// The response body ended normally.
    response_ended: bool,
    /// The answer began before the request body was sent in full.
    early_answer: bool,
}

impl Progress {
    /// The request body is handed over; `heard`: the upstream had already
    /// sent something.
    fn request_sent(&mut self, heard: bool) {
        self.request_sent = true;
        self.early_answer |= heard;
    }

    /// The response head arrived.
    fn response_head(&mut self) {
        self.early_answer |= !self.request_sent;
    }

    fn response_ended(&mut self) {
        self.response_ended = true;
    }

    /// The upstream is done with the write: the key may open now.
    fn done(&self) -> bool {
        self.request_sent && self.response_ended && !self.early_answer
    }

    /// Why an exchange that ended here is not done (the first of the
    /// reasons that applies).
    fn hold_reason(&self) -> HoldReason {
        if self.early_answer {
            HoldReason::EarlyAnswer
        } else if !self.request_sent {
            HoldReason::RequestUnfinished
        } else {
            HoldReason::AnswerUnfinished
        }
    }
}

impl Exchange {
    /// Starts tracking an exchange; `request_sent` when the request has no
    /// body. `runtime`, `route`: see the fields.
    pub fn new(
        admission: Admission,
        deadline: Instant,
        request_sent: bool,
        runtime: Arc<tokio::runtime::Handle>,
        route: Arc<GatedRoute>,
    ) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                admission: Some(admission),
                progress: Progress {
                    request_sent,
                    ..Progress::default()
                },
                heard: None,
            }),
            deadline,
            runtime,
            route,
        })
    }

    /// When the exchange must be over.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        let released = {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut s);
            if s.progress.done() {
                s.admission.take()
            } else {
                None
            }
        };
        // Dropped outside the lock: a shared-mode admission queues its leave.
        drop(released);
    }

    /// The connection the request goes out on (again, after a retry).
    pub fn listen_to(&self, heard: crate::upstream::Heard) {
        self.update(|s| s.heard = Some(heard));
    }

    /// The request body has been handed to the upstream connection in full.
    pub fn request_sent(&self) {
        self.update(|s| {
            let heard = s.heard.as_ref().is_some_and(|h| h.anything());
            s.progress.request_sent(heard);
        });
    }

    /// The response head has arrived.
    pub fn response_head(&self) {
        self.update(|s| s.progress.response_head());
    }

    /// The response body has ended normally.
    pub fn response_ended(&self) {
        self.update(|s| s.progress.response_ended());
    }

    /// Nothing of the request reached the upstream (the connection could not
    /// be made): the key may open at once.
    pub fn not_sent(&self) {
        self.release_now();
    }

    /// Lets the key open now, whatever the exchange's progress; answers
    /// whether it was still closed.
    fn release_now(&self) -> bool {
        let admission = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admission
            .take();
        let was_closed = admission.is_some();
        // Dropped outside the lock, as in `update`.
        drop(admission);
        was_closed
    }
}

/// The upstream connection closed itself at the deadline (see `upstream`):
/// nothing of this write can move any more, whether or not its bodies are
/// ever polled again (a client that stopped reading the answer keeps the
/// response body alive but idle). The key may open.
impl crate::upstream::OnCut for Exchange {
    fn cut(&self) {
        if self.release_now() {
            self.route.metrics.held_key(HoldReason::Timeout);
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let Some(mut admission) = state.admission.take() else {
            return;
        };
        // Ended any other way than normally: the upstream may still be at
        // work on this write until the deadline. One that lasted to the
        // deadline was cut there, whichever of its parts let go last.
        let deadline = self.deadline;
        if Instant::now() >= deadline {
            self.route.metrics.held_key(HoldReason::Timeout);
            return;
        }
        self.route.metrics.held_key(state.progress.hold_reason());
        admission.abandon_in_flight();
        drop(self.runtime.spawn(async move {
            tokio::time::sleep_until(deadline.into()).await;
            drop(admission);
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::Progress;

    fn with_body() -> Progress {
        Progress::default()
    }

    #[test]
    fn a_normal_exchange_is_done_when_both_directions_are() {
        let mut p = with_body();
        p.request_sent(false);
        p.response_head();
        assert!(!p.done());
        p.response_ended();
        assert!(p.done());
    }

    #[test]
    fn a_head_before_the_body_is_handed_over_is_an_early_answer() {
        let mut p = with_body();
        p.response_head();
        p.request_sent(false);
        p.response_ended();
        assert!(!p.done());
    }

    /// The client may read an early answer, then take the body's last frame,
    /// and only then let the forward see the head: the head must not clear what
    /// the socket already told.
    #[test]
    fn an_answer_heard_before_the_body_ends_stays_early_whenever_the_head_is_reported() {
        let mut p = with_body();
        p.request_sent(true);
        p.response_head();
        p.response_ended();
        assert!(!p.done());
    }

    /// The reason a hold is counted under: an early answer is one whatever
    /// else happened, then the first direction that did not finish.
    #[test]
    fn a_hold_is_counted_under_the_first_reason_that_applies() {
        use crate::metrics::HoldReason;
        let mut p = with_body();
        assert_eq!(p.hold_reason(), HoldReason::RequestUnfinished);
        p.request_sent(false);
        assert_eq!(p.hold_reason(), HoldReason::AnswerUnfinished);
        let mut early = with_body();
        early.response_head();
        assert_eq!(early.hold_reason(), HoldReason::EarlyAnswer);
        early.request_sent(false);
        early.response_ended();
        assert_eq!(early.hold_reason(), HoldReason::EarlyAnswer);
    }

    #[test]
    fn a_bodiless_request_is_done_when_its_answer_ends() {
        let mut p = Progress {
            request_sent: true,
            ..Progress::default()
        };
        p.response_head();
        assert!(!p.done());
        p.response_ended();
        assert!(p.done());
    }
}
