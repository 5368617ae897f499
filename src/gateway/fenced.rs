//! A fenced write on its way: arrival at the gate, the fence decision, and
//! the forward, detached from the client once it has started. Writes with
//! an `Idempotency-Key` take the flow in `idempotent`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use http::Request;
use tokio::sync::oneshot;

use super::accounting::{Access, Ended, PendingAccount};
use super::detach::{spawn_on, ClientPresence, DetachOnDrop};
use super::error::{ClientError, GatewayError};
use super::fence::{Admission, Write};
use super::forward::forward;
use super::live::GatedRoute;
use super::proxy::Downstream;
use super::state::GatewayState;
use crate::config::TokenKind;
use crate::fencing::gate::Arrival;
use crate::store::StoreError;

/// A fenced write on its way: the store and the gate decide, then forward.
pub(super) struct FencedWrite {
    pub(super) route: Arc<GatedRoute>,
    pub(super) key: String,
    pub(super) token: i64,
    /// The key's ticket from the memory-only step; `None` for a write with an Idempotency-Key
    /// until memory has no answer for its key.
    pub(super) arrival: Option<Arrival>,
    /// The `Idempotency-Key`, on routes that use them.
    pub(super) idem: Option<String>,
    pub(super) req: Request<Body>,
}

impl FencedWrite {
    /// Phases: check fence, forward, respond — detached from the client: once
    /// a write has started its way to the upstream it must not be cut off
    /// halfway by the client leaving. The task accounts for the write itself
    /// (the client may be gone by the time it ends).
    ///
    /// A write without an `Idempotency-Key` is polled here, on this worker,
    /// in either mode: its decision reaches the store only through a
    /// batcher's channel (single mode's fence batches, shared mode's
    /// admissions and leaves), whose answers come back to this worker, and
    /// its forward uses this worker's upstream connections. A write with an Idempotency-Key
    /// first asks memory for a completed record of its key
    /// ([`FencedWrite::ask_memory`]), on this worker: a replay from memory
    /// (or its 422) needs neither the store nor, in shared mode, a hop to
    /// the store's runtime.
    pub(super) async fn run(
        mut self: Box<Self>,
        state: Arc<GatewayState>,
        peer: Downstream,
        access: Option<Access>,
    ) -> Result<Response, GatewayError> {
        let Some(key) = self.idem.take() else {
            let books = self.pending_account(access, false);
            return DetachOnDrop::new(|client| async move {
                let (forwarded, ended) = self.decide_and_forward(&state, peer, &*client).await;
                books.settle(&state, forwarded, &ended);
                ended
            })
            .await;
        };
        let (answer, answered) = oneshot::channel();
        self.start(key, state, peer, access, answer);
        answered.await.unwrap_or(Err(GatewayError::Internal(
            "the fenced write task ended without an answer",
        )))
    }

    /// Spawns a write with an Idempotency-Key's task. Not part of `run`'s future on purpose:
    /// the task's state would then count in the request's future too, which
    /// is moved into its box on every request.
    pub(super) fn start(
        self: Box<Self>,
        key: String,
        state: Arc<GatewayState>,
        peer: Downstream,
        access: Option<Access>,
        answer: oneshot::Sender<Ended>,
    ) {
        // Where the store's part runs: in shared mode on the store's
        // runtime (the decision with its record uses its connections directly), after
        // the memory step, which runs here.
        let store_rt = state
            .fence
            .record_check_talks_to_store()
            .then(|| (*state.store_runtime).clone());
        let books = self.pending_account(access, true);
        let mut write = self;
        spawn_on(None, async move {
            let first = match Box::pin(write.ask_memory(&state, key)).await {
                Ok(first) => first,
                Err(ended) => {
                    books.settle(&state, false, &ended);
                    let _ = answer.send(ended);
                    return;
                }
            };
            let rest = async move {
                let (forwarded, ended) = write
                    .decide_with_record_and_forward(&state, peer, first, &answer)
                    .await;
                books.settle(&state, forwarded, &ended);
                let _ = answer.send(ended);
            };
            match store_rt {
                rt @ Some(_) => spawn_on(rt, rest),
                None => rest.await,
            }
        });
    }

    /// What accounting needs of the write once its request is consumed.
    /// `with_idempotency_key`: the write came with an `Idempotency-Key` (which `run` has
    /// taken out of it by then).
    pub(super) fn pending_account(
        &self,
        access: Option<Access>,
        with_idempotency_key: bool,
    ) -> PendingAccount {
        PendingAccount {
            route: self.route.clone(),
            method: self.req.method().clone(),
            with_idempotency_key,
            access,
        }
    }

    /// What the fence decides about this write.
    pub(super) fn write(&self) -> Write<'_> {
        Write {
            key: &self.key,
            token: self.token,
            hold: self.route.timeout,
            issued_only: self.route.token == TokenKind::Issued,
        }
    }

    /// The write's arrival at the gate: the one the admit phase already
    /// took, or a new one.
    pub(super) fn arrival(&mut self, state: &GatewayState) -> Result<Arrival, GatewayError> {
        match self.arrival.take() {
            Some(a) => Ok(a),
            None => state.fence.arrive(&self.key, self.token),
        }
    }

    /// A write without an `Idempotency-Key`: check the fence, then forward
    /// while holding the key's admission. Answers whether the write was
    /// forwarded, and the result. Its own future, apart from that of a
    /// write with an Idempotency-Key: the write's task holds it, and moves it at its spawn and
    /// its end, so what the plain path does not need is not in it.
    pub(super) async fn decide_and_forward(
        mut self: Box<Self>,
        state: &GatewayState,
        peer: Downstream,
        client: &dyn ClientPresence,
    ) -> (bool, Ended) {
        let arrival = match self.arrival(state) {
            Ok(a) => a,
            Err(e) => return (false, Err(e)),
        };
        let decided = Instant::now();
        let check = state.fence.check(self.write(), arrival);
        let admission = match check.await {
            Ok(a) => a,
            Err(e) => return (false, Err(e)),
        };
        state.metrics.decision_time.observe(decided.elapsed());
        if let Err(e) = self.may_start(&admission, client, None) {
            return (false, Err(e));
        }
        let result = forward(state, &self.route, self.req, peer, Some(admission)).await;
        (true, result)
    }

    /// Whether an admitted write may still start its forward: not when its
    /// client left while it waited (nobody would see the answer; the token
    /// stays recorded, which only ever makes older holders stale sooner),
    /// and not when this instance stalled so long that the write's
    /// in-flight marker (shared mode) or its idempotency record (`record`:
    /// when it stops being in flight, and the store's timeout for storing
    /// the answer) would end before its exchange could. Nothing was sent in
    /// either case; the key opens again.
    pub(super) fn may_start(
        &self,
        admission: &Admission,
        client: &dyn ClientPresence,
        record: Option<(Instant, Duration)>,
    ) -> Result<(), GatewayError> {
        if client.left() {
            return Err(ClientError::ClientGone.into());
        }
        let left = |end: Instant| end.saturating_duration_since(Instant::now());
        if let Some(end) = admission.must_end_by {
            if left(end) < self.route.timeout {
                return Err(StoreError::Late.into());
            }
        }
        if let Some((until, store_timeout)) = record {
            // The exchange and the storing of its answer must be over while
            // the record is in flight. Past it, duplicates hear "outcome
            // unknown", and once it expired one may take the key over and
            // be forwarded.
            if left(until) < self.route.timeout + store_timeout {
                return Err(StoreError::Late.into());
            }
        }
        Ok(())
    }
}
