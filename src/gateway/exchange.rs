//! One fenced write's exchange with the upstream, and the moment its key may
//! open for another token.
//!
//! A key opens for a different token only when the upstream is *done* with
//! the older write. From a proxy's seat that is knowable in one case only:
//! the request was handed over in full (the upstream's TCP acknowledged
//! all of it), and then the upstream's answer ended normally. Every other
//! ending leaves the upstream possibly still at work — an answer that
//! breaks off, an answer that comes before the request was handed over
//! (the upstream may go on reading and applying it), a client that leaves
//! and an answer too long to drain for it — and then the key stays closed
//! until the forward's deadline, the bound on the whole exchange.
//!
//! The deadline (the route's `timeout_ms` from the start of the forward,
//! and in shared mode never later than the write's in-flight marker's end)
//! bounds the *whole* exchange, not just the wait for the response head:
//! when it passes, both body wrappers cut their streams, and the upstream
//! connection resets itself (`http1::client::cutoff`, which also covers bodies
//! nobody polls: a client that stopped reading, an upstream that stopped
//! reading), so nothing of this write moves in either direction afterwards,
//! and the connection then tells the exchange, which lets the key open.
//! That makes the deadline a true upper bound on the write's life at the
//! gateway, which is what a crash recovery waits out (shared mode's
//! `writer_until`, single mode's start-up quarantine).
//!
//! What the upstream has of the write is told by its connection, the only
//! place that knows ([`Witness`]): whether the request was written in full,
//! and whether the upstream's TCP had acknowledged all of it when its
//! answer began (an answer before that is an early answer: see
//! `http1::client::flight`). The response body wrapper (`proxy::RelayBody`)
//! reports the answer's normal end, which also covers a client that left:
//! the answer is then drained to its end, within a limit. The [`Exchange`]
//! holds the gate's admission; whoever completes the normal ending
//! releases it at once; if the exchange is dropped any other way, its
//! `Drop` keeps the admission until the deadline.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::gateway::fence::Admission;
use crate::gateway::live::GatedRoute;
use crate::http1::client::Witness;
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
    /// traffic worker writes (see `gateway::live::WorkerLive`).
    route: Arc<GatedRoute>,
}

struct State {
    /// Taken when released (now or at the deadline).
    admission: Option<Admission>,
    progress: Progress,
}

/// How far an exchange has come. Each event only ever adds to what is
/// known, whatever order the connection and the body wrapper report in.
#[derive(Debug, Default, Clone, Copy)]
struct Progress {
    /// The request was written into the upstream connection in full.
    request_written: bool,
    /// `None` until the answer began; then whether the request had been
    /// handed over (acknowledged in full by the upstream's TCP) by then.
    answer_began: Option<bool>,
    /// The answer ended normally, and the connection with it.
    response_ended: bool,
}

impl Progress {
    /// The upstream is done with the write: the key may open now.
    fn done(&self) -> bool {
        self.answer_began == Some(true) && self.response_ended
    }

    /// Why an exchange that ended here is not done (the first of the
    /// reasons that applies).
    fn hold_reason(&self) -> HoldReason {
        if self.answer_began == Some(false) {
            HoldReason::EarlyAnswer
        } else if !self.request_written {
            HoldReason::RequestUnfinished
        } else {
            HoldReason::AnswerUnfinished
        }
    }
}

impl Exchange {
    /// Starts tracking an exchange. `runtime`, `route`: see the fields.
    pub fn new(
        admission: Admission,
        deadline: Instant,
        runtime: Arc<tokio::runtime::Handle>,
        route: Arc<GatedRoute>,
    ) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                admission: Some(admission),
                progress: Progress::default(),
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

    /// The answer ended normally, and its connection with it (see
    /// `UpstreamBody::poll_finish`).
    pub fn response_ended(&self) {
        self.update(|s| s.progress.response_ended = true);
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

impl Witness for Exchange {
    fn request_written(&self) {
        self.update(|s| s.progress.request_written = true);
    }

    fn answer_began(&self, handed_over: bool) {
        self.update(|s| {
            s.progress.answer_began.get_or_insert(handed_over);
        });
    }

    /// The upstream connection reset itself at the deadline: nothing of
    /// this write can move any more, whether or not its bodies are ever
    /// polled again (a client that stopped reading the answer keeps the
    /// response body alive but idle). The key may open.
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
    use crate::metrics::HoldReason;

    #[test]
    fn a_normal_exchange_is_done_when_its_answer_ends_after_the_hand_over() {
        let mut p = Progress {
            request_written: true,
            answer_began: Some(true),
            response_ended: false,
        };
        assert!(!p.done());
        p.response_ended = true;
        assert!(p.done());
    }

    #[test]
    fn an_answer_before_the_hand_over_is_never_done() {
        let p = Progress {
            request_written: true,
            answer_began: Some(false),
            response_ended: true,
        };
        assert!(!p.done());
        assert_eq!(p.hold_reason(), HoldReason::EarlyAnswer);
    }

    /// The reason a hold is counted under: an early answer is one whatever
    /// else happened, then the first direction that did not finish.
    #[test]
    fn a_hold_is_counted_under_the_first_reason_that_applies() {
        let mut p = Progress::default();
        assert_eq!(p.hold_reason(), HoldReason::RequestUnfinished);
        p.request_written = true;
        assert_eq!(p.hold_reason(), HoldReason::AnswerUnfinished);
        p.answer_began = Some(true);
        assert_eq!(p.hold_reason(), HoldReason::AnswerUnfinished);
    }
}
