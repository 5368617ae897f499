//! The traffic listener's shared state, one per worker: what every phase
//! of a request reads.

use std::sync::Arc;
use std::time::Duration;

use super::fence::Fence;
use super::live;
use crate::http1::client::UpstreamClient;
use crate::idempotency;
use crate::metrics::Metrics;

/// Shared state of the traffic listener, behind one `Arc`: the router
/// clones it for every request.
#[derive(Clone)]
pub struct GatewayState {
    /// The reloadable part: this worker's copy of what every worker (and
    /// the lock API and admin listener, for the auth clients) shares.
    pub live: live::WorkerLive,
    /// Store plus gate: the fence decision.
    pub fence: Fence,
    /// Pooled upstream connections, shared by all routes.
    pub client: UpstreamClient,
    /// HTTP/2 upstream connections (`upstream_protocol = "h2"`, `"h2c"`),
    /// one per upstream.
    pub h2: crate::http2::Http2Client,
    pub metrics: Metrics,
    /// The recent refusals the dashboard shows.
    pub refusals: Arc<crate::gateway::refusals::Refusals>,
    /// `[server] max_body_bytes`.
    pub max_body_bytes: u64,
    /// Sent as `Retry-After` with 503 answers.
    pub retry_after: Duration,
    /// Completed Idempotency-Key records' answers, replayed without a store
    /// read (see `idempotency::cache`).
    pub replays: Arc<idempotency::ReplayCache>,
    /// The runtime that owns the store's connections. Requests are served on
    /// worker threads with runtimes of their own; a first use of an Idempotency-Key in
    /// shared mode, whose statement uses the store's connections directly,
    /// runs its store part and forward here instead, and outlives the
    /// worker. Every other fenced write reaches the store only through a
    /// batcher's channel, so it stays on its worker. Each worker has its own
    /// `Arc` of it: every fenced write's exchange clones it, and a clone of
    /// the runtime's own handle would write to the count all workers share
    /// (see `gateway::live::WorkerLive`).
    pub store_runtime: Arc<tokio::runtime::Handle>,
    /// Unsent first uses' records being forgotten; shared by every worker,
    /// so that a retry on any of them takes its record back at once.
    pub forgets: Arc<idempotency::Forgets>,
}

impl GatewayState {
    /// The state of one traffic worker: its own upstream pool, and its own
    /// copies of what every request would otherwise clone from memory all
    /// workers share (the live config, the gate's handle, the store
    /// runtime's handle).
    pub fn for_worker(&self) -> Self {
        // The clone of `live` is a copy of its own (see its `Clone`).
        Self {
            client: UpstreamClient::new(),
            h2: crate::http2::Http2Client::new(),
            store_runtime: Arc::new((*self.store_runtime).clone()),
            fence: self.fence.worker_copy(),
            ..self.clone()
        }
    }
}
