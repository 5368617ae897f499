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
//! when it passes, both body wrappers cut their streams, so nothing of this
//! write moves in either direction afterwards. That makes the deadline a
//! true upper bound on the write's life at the gateway, which is what a
//! crash recovery waits out (shared mode's `writer_until`, single mode's
//! start-up quarantine).
//!
//! The [`Exchange`] holds the gate's admission. The request body wrapper
//! (`proxy::LimitedBody`) reports when the body was handed over in full, the
//! forward when the head arrives, the response body wrapper
//! (`proxy::HoldingBody`) when the answer ended. Whoever completes the
//! normal ending releases the admission at once; if the exchange is dropped
//! any other way, its `Drop` keeps the admission until the deadline.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::fence::Admission;

/// The state of one fenced exchange; shared by the forward and both body
/// wrappers through an `Arc`.
pub struct Exchange {
    state: Mutex<State>,
    /// When the exchange must be over; see the module docs.
    deadline: Instant,
    /// Where to keep the admission until the deadline after an abnormal end:
    /// the store's runtime, which outlives the worker threads. The clean-stop
    /// bookkeeping waits for the gate to empty, so a held key is never
    /// mistaken for a finished write at shutdown.
    runtime: tokio::runtime::Handle,
}

struct State {
    /// Taken when released (now or at the deadline).
    admission: Option<Admission>,
    /// The request body was handed to the upstream connection in full.
    request_sent: bool,
    /// The response body ended normally.
    response_ended: bool,
    /// The answer began before the request body was sent in full.
    early_answer: bool,
    /// What the upstream connection has heard since this request began:
    /// any byte of an answer before the request body is handed over in full
    /// makes it an early answer, however late hyper reports the head.
    heard: Option<crate::upstream::Heard>,
}

impl Exchange {
    /// Starts tracking an exchange; `request_sent` when the request has no
    /// body. `runtime`: see the field.
    pub fn new(
        admission: Admission,
        deadline: Instant,
        request_sent: bool,
        runtime: tokio::runtime::Handle,
    ) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                admission: Some(admission),
                request_sent,
                response_ended: false,
                early_answer: false,
                heard: None,
            }),
            deadline,
            runtime,
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
            if s.request_sent && s.response_ended && !s.early_answer {
                s.admission.take()
            } else {
                None
            }
        };
        // Dropped outside the lock: a shared-mode key lock spawns its leave.
        drop(released);
    }

    /// The connection the request goes out on (again, after a retry).
    pub fn listen_to(&self, heard: crate::upstream::Heard) {
        self.update(|s| s.heard = Some(heard));
    }

    /// The request body has been handed to the upstream connection in full.
    pub fn request_sent(&self) {
        self.update(|s| {
            s.request_sent = true;
            if s.heard.as_ref().is_some_and(|h| h.anything()) {
                s.early_answer = true;
            }
        });
    }

    /// The response head has arrived.
    pub fn response_head(&self) {
        self.update(|s| s.early_answer = !s.request_sent);
    }

    /// The response body has ended normally.
    pub fn response_ended(&self) {
        self.update(|s| s.response_ended = true);
    }

    /// Nothing of the request reached the upstream (the connection could not
    /// be made): the key may open at once.
    pub fn not_sent(&self) {
        let admission = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admission
            .take();
        drop(admission);
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let Some(mut admission) = state.admission.take() else {
            return;
        };
        // Ended any other way than normally: the upstream may still be at
        // work on this write until the deadline.
        let deadline = self.deadline;
        if Instant::now() >= deadline {
            return;
        }
        admission.abandon_key_lock();
        drop(self.runtime.spawn(async move {
            tokio::time::sleep_until(deadline.into()).await;
            drop(admission);
        }));
    }
}
