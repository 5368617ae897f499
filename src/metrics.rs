//! Prometheus metrics, served as text on the admin listener.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::{
    EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder, MetricEncoder,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// A label enum's `as_str` and its Prometheus encoding, from one list of
/// each value's text.
macro_rules! label_values {
    ($ty:ident { $($variant:ident => $text:literal,)+ }) => {
        impl $ty {
            /// The label value.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $text,)+
                }
            }
        }

        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(encoder, self.as_str())
            }
        }
    };
}

/// How a fenced write was decided: the `outcome` label of
/// `fencegate_decisions_total`. Every fenced write gets exactly one.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// Recorded and sent to the upstream (whatever the upstream answered).
    Forwarded,
    /// Below the highest recorded token: 409.
    Stale,
    MissingToken,
    MalformedToken,
    /// A JWT that failed verification.
    InvalidToken,
    /// A valid JWT issued for another resource key.
    WrongSubject,
    /// The store could not decide in time: 503.
    StoreUnavailable,
    /// Shared mode: waited out `key_lock_wait_ms` behind another instance.
    KeyBusy,
    /// A declared `Content-Length` over `max_body_bytes`.
    TooLarge,
    /// The client left while its write waited; it was never started.
    ClientGone,
    /// Refused for its framing (conflicting or unparsable length headers).
    BadRequest,
    /// Shared mode: admitted, but this instance stalled too long before the
    /// forward could start within the write's in-flight marker.
    Late,
    /// A path spelling back ends resolve differently (`paths = "strict"`).
    AmbiguousPath,
    /// A key part from the query or a header missing, repeated or ambiguous.
    AmbiguousKey,
    /// `token = "issued"`: above every fence the lock API granted: 403.
    Unissued,
    /// An `Idempotency-Key` replay: the stored answer, nothing forwarded.
    Replayed,
    /// An `Idempotency-Key` refusal: in progress, reused, or outcome unknown.
    IdempotencyConflict,
}

impl Outcome {
    pub const ALL: [Outcome; 17] = [
        Outcome::Forwarded,
        Outcome::Stale,
        Outcome::MissingToken,
        Outcome::MalformedToken,
        Outcome::InvalidToken,
        Outcome::WrongSubject,
        Outcome::StoreUnavailable,
        Outcome::KeyBusy,
        Outcome::TooLarge,
        Outcome::ClientGone,
        Outcome::BadRequest,
        Outcome::Late,
        Outcome::AmbiguousPath,
        Outcome::AmbiguousKey,
        Outcome::Unissued,
        Outcome::Replayed,
        Outcome::IdempotencyConflict,
    ];
}

label_values!(Outcome {
    Forwarded => "forwarded",
    Stale => "stale",
    MissingToken => "missing_token",
    MalformedToken => "malformed_token",
    InvalidToken => "invalid_token",
    WrongSubject => "wrong_subject",
    StoreUnavailable => "store_unavailable",
    KeyBusy => "key_busy",
    TooLarge => "too_large",
    ClientGone => "client_gone",
    BadRequest => "bad_request",
    Late => "late",
    AmbiguousPath => "ambiguous_path",
    AmbiguousKey => "ambiguous_key",
    Unissued => "unissued",
    Replayed => "replayed",
    IdempotencyConflict => "idempotency_conflict",
});

/// The `outcome` label of `fencegate_idempotency_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum IdempotencyOutcome {
    /// A new key: recorded, then forwarded.
    First,
    Replayed,
    InProgress,
    Reused,
    OutcomeUnknown,
    /// A first use whose answer was not stored (too large, broken off, or
    /// the store failed): its duplicates will hear "outcome unknown".
    NotStored,
}

impl IdempotencyOutcome {
    pub const ALL: [IdempotencyOutcome; 6] = [
        IdempotencyOutcome::First,
        IdempotencyOutcome::Replayed,
        IdempotencyOutcome::InProgress,
        IdempotencyOutcome::Reused,
        IdempotencyOutcome::OutcomeUnknown,
        IdempotencyOutcome::NotStored,
    ];
}

label_values!(IdempotencyOutcome {
    First => "first",
    Replayed => "replayed",
    InProgress => "in_progress",
    Reused => "reused",
    OutcomeUnknown => "outcome_unknown",
    NotStored => "not_stored",
});

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IdempotencyLabels {
    pub route: String,
    pub outcome: IdempotencyOutcome,
}

/// The `kind` label of `fencegate_upstream_errors_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum UpstreamFailure {
    Unreachable,
    Timeout,
}

impl UpstreamFailure {
    pub const ALL: [UpstreamFailure; 2] = [UpstreamFailure::Unreachable, UpstreamFailure::Timeout];
}

label_values!(UpstreamFailure {
    Unreachable => "unreachable",
    Timeout => "timeout",
});

/// Why a fenced write's exchange did not end normally, which kept its key
/// closed until the route's `timeout_ms` (see `exchange`): the `reason`
/// label of `fencegate_held_keys_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum HoldReason {
    /// The request body was not handed to the upstream in full: the client
    /// broke it off, or the upstream stopped taking it.
    RequestUnfinished,
    /// The answer began before the request body was handed over in full:
    /// the upstream may go on reading and applying it.
    EarlyAnswer,
    /// The answer did not end normally: the client left before it ended
    /// (before or after its head), or the upstream broke it off.
    AnswerUnfinished,
    /// The exchange was still going at the deadline, and was cut.
    Timeout,
}

impl HoldReason {
    pub const ALL: [HoldReason; 4] = [
        HoldReason::RequestUnfinished,
        HoldReason::EarlyAnswer,
        HoldReason::AnswerUnfinished,
        HoldReason::Timeout,
    ];
}

label_values!(HoldReason {
    RequestUnfinished => "request_unfinished",
    EarlyAnswer => "early_answer",
    AnswerUnfinished => "answer_unfinished",
    Timeout => "timeout",
});

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HoldLabels {
    pub route: String,
    pub reason: HoldReason,
}

/// How a SIGHUP reload ended: the `result` label of
/// `fencegate_config_reloads_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ReloadResult {
    /// Applied.
    Ok,
    /// A config with problems, or a change only a restart applies.
    Error,
    /// A valid config that would change a fenced route's key identity.
    Refused,
}

impl ReloadResult {
    pub const ALL: [ReloadResult; 3] =
        [ReloadResult::Ok, ReloadResult::Error, ReloadResult::Refused];
}

label_values!(ReloadResult {
    Ok => "ok",
    Error => "error",
    Refused => "refused",
});

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    pub result: ReloadResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub route: String,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamErrorLabels {
    pub route: String,
    pub kind: UpstreamFailure,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LockLabels {
    pub backend: &'static str,
    pub event: LockEvent,
}

/// The `event` label of `fencegate_lock_events_total`: what one lock API
/// call (or readiness probe of the lock backend) came to.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum LockEvent {
    Grant,
    /// An acquire refused: held by another holder (after its wait).
    Held,
    Renew,
    /// A renew by someone who is not the holder (or whose lease is gone,
    /// where the backend cannot tell that apart).
    RenewRefused,
    Release,
    ReleaseRefused,
    /// A renew or release of a lease that ran out.
    Expired,
    /// An admin break ended a lease.
    Break,
    /// An acquire refused because the fence reached its maximum.
    Exhausted,
    /// A lock call the backend could not answer.
    Unavailable,
    /// `/readyz` found the backend not answering.
    PingFailed,
}

impl LockEvent {
    pub const ALL: [LockEvent; 11] = [
        LockEvent::Grant,
        LockEvent::Held,
        LockEvent::Renew,
        LockEvent::RenewRefused,
        LockEvent::Release,
        LockEvent::ReleaseRefused,
        LockEvent::Expired,
        LockEvent::Break,
        LockEvent::Exhausted,
        LockEvent::Unavailable,
        LockEvent::PingFailed,
    ];
}

label_values!(LockEvent {
    Grant => "grant",
    Held => "held",
    Renew => "renew",
    RenewRefused => "renew_refused",
    Release => "release",
    ReleaseRefused => "release_refused",
    Expired => "expired",
    Break => "break",
    Exhausted => "exhausted",
    Unavailable => "unavailable",
    PingFailed => "ping_failed",
});

/// The `op` label of `fencegate_store_errors_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum StoreOp {
    /// Recording a fenced write's token.
    Record,
    /// Reading a fence for the admin API.
    Get,
    /// The readiness check.
    Ping,
}

label_values!(StoreOp {
    Record => "record",
    Get => "get",
    Ping => "ping",
});

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreErrorLabels {
    pub op: StoreOp,
}

type HistogramFamily<L> = Family<L, Latency, fn() -> Latency>;

/// Every metric the gateway exports. Cloning shares the same counters.
#[derive(Clone)]
pub struct Metrics {
    /// `Idempotency-Key` outcomes by route.
    pub idempotency: Family<IdempotencyLabels, ShardedCounter>,
    /// Config reloads (SIGHUP) by result (`ok`, `error`, `refused`).
    pub config_reloads: Family<ReloadLabels, Counter>,
    /// Fence decisions by route and [`Outcome`].
    pub decisions: Family<DecisionLabels, ShardedCounter>,
    /// Requests forwarded without a check (safe methods).
    pub passthrough: Family<RouteLabels, ShardedCounter>,
    /// Time from sending a request upstream to its response head.
    pub upstream_latency: HistogramFamily<RouteLabels>,
    /// Upstream failures by kind (`unreachable`, `timeout`).
    pub upstream_errors: Family<UpstreamErrorLabels, ShardedCounter>,
    /// Store failures by operation.
    pub store_errors: Family<StoreErrorLabels, Counter>,
    /// Fenced writes whose exchange did not end normally, by route and
    /// reason: each kept its key closed until the route's `timeout_ms`, and
    /// the key's next writes waited for it. Counted when it happens (rare),
    /// so a plain `Counter`.
    pub held_keys: Family<HoldLabels, Counter>,
    /// Time fenced writes spent being decided, from arrival to admission:
    /// the store (shared mode: including waits for other instances' older
    /// writes) plus the wait at the gate for this instance's older writes.
    pub decision_time: Latency,
    /// Keys with writes in flight or waiting.
    pub gate_keys: Gauge,
    /// Tunnels open (upgrades the upstream switched to), by route: each
    /// holds a client connection or stream and an upstream connection.
    pub tunnels_open: Family<RouteLabels, Gauge>,
    /// Lock API outcomes by backend and event (`grant`, `held`, `renew`,
    /// `renew_refused`, `release`, `release_refused`, `expired`,
    /// `unavailable`).
    pub lock_events: Family<LockLabels, Counter>,
    /// Each route name's counters, shared by every [`RouteMetrics`] made
    /// for that name: a reload makes new ones, and the dashboard reads
    /// them (a family cannot be read without creating the series).
    routes: Arc<Mutex<HashMap<String, Arc<RouteCells>>>>,
    registry: std::sync::Arc<Registry>,
}

/// One route's labelled counters, each looked up in its family the first
/// time it happens, so a label appears in the exposition only once it has.
#[derive(Default)]
struct RouteCells {
    /// In `Outcome::ALL` order.
    decisions: [OnceLock<ShardedCounter>; Outcome::ALL.len()],
    /// In `UpstreamFailure::ALL` order.
    upstream_errors: [OnceLock<ShardedCounter>; UpstreamFailure::ALL.len()],
    /// In `IdempotencyOutcome::ALL` order.
    idempotency: [OnceLock<ShardedCounter>; IdempotencyOutcome::ALL.len()],
    /// In `HoldReason::ALL` order. Rare: a plain `Counter`.
    held_keys: [OnceLock<Counter>; HoldReason::ALL.len()],
}

/// What one route has counted since the process started, for the
/// dashboard.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RouteCounts {
    /// Fenced writes by outcome label; outcomes that never happened are
    /// left out.
    pub decisions: std::collections::BTreeMap<&'static str, u64>,
    /// Requests forwarded without a check.
    pub passthrough: u64,
    /// Upstream failures by kind label.
    pub upstream_errors: std::collections::BTreeMap<&'static str, u64>,
    /// Fenced writes whose key stayed closed until `timeout_ms`
    /// (`fencegate_held_keys_total`), by reason label.
    pub held_keys: std::collections::BTreeMap<&'static str, u64>,
}

/// A route's counts of one family by label: each of `labels` whose cell
/// was ever written (`value` is `None` for the others, which are left out,
/// as a reason that never happened has no series either).
fn by_label<L: Copy>(
    labels: &[L],
    name: impl Fn(L) -> &'static str,
    value: impl Fn(L) -> Option<u64>,
) -> std::collections::BTreeMap<&'static str, u64> {
    labels
        .iter()
        .filter_map(|&l| Some((name(l), value(l)?)))
        .collect()
}

/// Upper bound of a [`Latency`] histogram's first bucket: 0.5 ms.
const FIRST_BOUND_NS: u64 = 500_000;
/// Buckets with an upper bound, each twice the one before: 0.5 ms to
/// 16.384 s. One more counts what is above them (`+Inf`).
const BOUNDS: usize = 16;
/// Shards of a [`Latency`] or a [`ShardedCounter`]: more than the threads
/// that count at once (the traffic workers, one per CPU by default, and the
/// store's runtime), so that two threads rarely share one.
const SHARDS: usize = 8;

/// A counter written on the request path: passed-through requests, fence
/// decisions, `Idempotency-Key` outcomes and upstream failures, by every
/// traffic worker at once.
///
/// prometheus-client's `Counter` is one atomic, and every worker adds to
/// it: each add on one core takes the counter's cache line from the other
/// cores, so two workers counting the same route pass that line back and
/// forth on every request, one of the writes to memory the workers share
/// that nginx's worker processes never make. Here each thread adds into a
/// shard of its own, a cache line apart, as [`Latency`] does; a read sums
/// the shards. The sum is exact once the counting has stopped; while it
/// goes on, a read may miss an add that an earlier read of another shard
/// saw, which no rate over a window can tell.
/// Clones share the counts, as prometheus-client's metrics do.
#[derive(Clone, Default)]
pub struct ShardedCounter {
    shards: Arc<[CounterShard; SHARDS]>,
}

/// One thread's count, alone on its cache line.
#[derive(Default)]
#[repr(align(128))]
struct CounterShard(AtomicU64);

impl std::fmt::Debug for ShardedCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ShardedCounter").field(&self.get()).finish()
    }
}

impl ShardedCounter {
    pub fn inc(&self) {
        self.shards[my_shard()].0.fetch_add(1, Ordering::Relaxed);
    }

    /// The count: every shard's, summed.
    pub fn get(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

impl TypedMetric for ShardedCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for ShardedCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<(), _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A latency histogram written on the request path: per forward
/// (`upstream_response_seconds`) and per fenced write
/// (`decision_seconds`), by every traffic worker at once.
///
/// prometheus-client's `Histogram` takes a write lock per observation, and
/// every worker thread takes the same one. A lock on the request path that
/// every core takes is a stall waiting to happen on a loaded machine: a
/// thread preempted while it holds the lock (a wake-up on its CPU is
/// enough) leaves the other workers, and every connection they serve,
/// waiting until it runs again. Here an observation is two relaxed atomic
/// adds and nothing waits, and each thread adds into a shard of its own
/// (a cache line apart), so the workers do not even pass the counters'
/// cache lines between cores on every request.
///
/// A scrape sums the shards, and its count is the sum of its buckets, so
/// `_count` and the `+Inf` bucket always agree; `_sum` may include an
/// observation whose bucket the same scrape missed (or the reverse),
/// which no rate over a window can tell.
/// Clones share the counts, as prometheus-client's metrics do.
#[derive(Clone, Default)]
pub struct Latency {
    shards: Arc<[Shard; SHARDS]>,
}

/// One thread's counts: nanoseconds summed, and a count per bucket.
#[derive(Default)]
#[repr(align(128))]
struct Shard {
    sum_ns: AtomicU64,
    buckets: [AtomicU64; BOUNDS + 1],
}

impl std::fmt::Debug for Latency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Latency").finish_non_exhaustive()
    }
}

/// The shard the calling thread adds into: threads take shards in turn,
/// the first time they observe.
fn my_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    MINE.with(|m| *m)
}

impl Latency {
    pub fn observe(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // The first bucket whose upper bound is at least `ns` (`le`).
        let mut bound = FIRST_BOUND_NS;
        let mut i = 0;
        while i < BOUNDS && ns > bound {
            bound *= 2;
            i += 1;
        }
        let shard = &self.shards[my_shard()];
        shard.buckets[i].fetch_add(1, Ordering::Relaxed);
        shard.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The count, the sum in seconds, and each bucket's own count with its
    /// upper bound in seconds, the last one's `f64::MAX` (`+Inf`): the
    /// shape prometheus-client's encoder takes, which makes the counts
    /// cumulative itself.
    fn snapshot(&self) -> (u64, f64, Vec<(f64, u64)>) {
        let mut per_bucket = [0u64; BOUNDS + 1];
        let mut sum_ns = 0u64;
        for shard in self.shards.iter() {
            sum_ns = sum_ns.wrapping_add(shard.sum_ns.load(Ordering::Relaxed));
            for (total, b) in per_bucket.iter_mut().zip(&shard.buckets) {
                *total += b.load(Ordering::Relaxed);
            }
        }
        let mut bound_ns = FIRST_BOUND_NS;
        let mut buckets = Vec::with_capacity(BOUNDS + 1);
        for n in &per_bucket[..BOUNDS] {
            buckets.push((bound_ns as f64 / 1e9, *n));
            bound_ns *= 2;
        }
        buckets.push((f64::MAX, per_bucket[BOUNDS]));
        let count = per_bucket.iter().sum();
        (count, sum_ns as f64 / 1e9, buckets)
    }
}

impl TypedMetric for Latency {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Latency {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (count, sum, buckets) = self.snapshot();
        encoder.encode_histogram::<()>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// The gauges: keys in the gate, and tunnels open by route.
fn gauges(registry: &mut Registry) -> (Gauge, Family<RouteLabels, Gauge>) {
    let gate_keys = Gauge::default();
    registry.register(
        "gate_keys",
        "Resource keys with writes in flight or waiting",
        gate_keys.clone(),
    );
    let tunnels_open = Family::<RouteLabels, Gauge>::default();
    registry.register(
        "tunnels_open",
        "Tunnels open (upgrades the upstream switched to), by route",
        tunnels_open.clone(),
    );
    (gate_keys, tunnels_open)
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("fencegate");
        let decisions = Family::<DecisionLabels, ShardedCounter>::default();
        let idempotency = Family::<IdempotencyLabels, ShardedCounter>::default();
        let config_reloads = Family::<ReloadLabels, Counter>::default();
        // Every result from the start: an alert on the increase of a
        // counter sees its first failure only if the series existed before.
        for result in ReloadResult::ALL {
            let _ = config_reloads.get_or_create(&ReloadLabels { result });
        }
        registry.register(
            "config_reloads",
            "Config reloads on SIGHUP, by result",
            config_reloads.clone(),
        );
        registry.register(
            "idempotency",
            "Idempotency-Key outcomes on fenced writes, by route",
            idempotency.clone(),
        );
        let passthrough = Family::<RouteLabels, ShardedCounter>::default();
        let upstream_latency: HistogramFamily<RouteLabels> =
            Family::new_with_constructor(Latency::default);
        let upstream_errors = Family::<UpstreamErrorLabels, ShardedCounter>::default();
        let store_errors = Family::<StoreErrorLabels, Counter>::default();
        // Every operation from the start, at 0, for the same reason as the
        // reloads: the store-unavailable alert rates this counter.
        for op in [StoreOp::Record, StoreOp::Get, StoreOp::Ping] {
            let _ = store_errors.get_or_create(&StoreErrorLabels { op });
        }
        let held_keys = Family::<HoldLabels, Counter>::default();
        registry.register(
            "held_keys",
            "Fenced writes whose exchange did not end normally, so that their key stayed closed until the route's timeout_ms, by route and reason",
            held_keys.clone(),
        );
        let decision_time = Latency::default();
        let (gate_keys, tunnels_open) = gauges(&mut registry);
        let lock_events = Family::<LockLabels, Counter>::default();
        registry.register(
            "lock_events",
            "Lock API outcomes by backend and event",
            lock_events.clone(),
        );
        registry.register(
            "decisions",
            "Fence decisions on fenced writes, by route and outcome",
            decisions.clone(),
        );
        registry.register(
            "passthrough_requests",
            "Requests forwarded without a fence check (non-fenced methods)",
            passthrough.clone(),
        );
        registry.register(
            "upstream_response_seconds",
            "Time from forwarding to the upstream's response head",
            upstream_latency.clone(),
        );
        registry.register(
            "upstream_errors",
            "Upstream failures by kind",
            upstream_errors.clone(),
        );
        registry.register(
            "store_errors",
            "Fence store failures by operation",
            store_errors.clone(),
        );
        registry.register(
            "decision_seconds",
            "Time fenced writes spent being decided, from arrival to admission: the store plus waiting for older tokens' writes",
            decision_time.clone(),
        );
        Self {
            config_reloads,
            idempotency,
            decisions,
            passthrough,
            upstream_latency,
            upstream_errors,
            store_errors,
            held_keys,
            decision_time,
            gate_keys,
            tunnels_open,
            lock_events,
            routes: Default::default(),
            registry: std::sync::Arc::new(registry),
        }
    }

    pub fn config_reload(&self, result: ReloadResult) {
        self.config_reloads
            .get_or_create(&ReloadLabels { result })
            .inc();
    }

    /// A config reload's count by result.
    pub fn config_reloads(&self, result: ReloadResult) -> u64 {
        self.config_reloads
            .get_or_create(&ReloadLabels { result })
            .get()
    }

    pub fn lock_event(&self, backend: &'static str, event: LockEvent) {
        self.lock_events
            .get_or_create(&LockLabels { backend, event })
            .inc();
    }

    pub fn store_error(&self, op: StoreOp) {
        self.store_errors
            .get_or_create(&StoreErrorLabels { op })
            .inc();
    }

    /// One route's handles, for the request path.
    pub fn for_route(&self, route: &str) -> RouteMetrics {
        let labels = RouteLabels {
            route: route.to_string(),
        };
        RouteMetrics {
            passthrough: self.passthrough.get_or_create(&labels).clone(),
            upstream_latency: self.upstream_latency.get_or_create(&labels).clone(),
            cells: self.cells(route),
            route: route.to_string(),
            metrics: self.clone(),
        }
    }

    /// The named route's counters, made on first use.
    fn cells(&self, route: &str) -> Arc<RouteCells> {
        // A poisoned lock only means a panic elsewhere while inserting; the
        // map is still whole.
        let mut routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        routes.entry(route.to_string()).or_default().clone()
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `m`'s exposition holds every one of `lines`; a failure shows it whole.
    fn assert_rendered(m: &Metrics, lines: &[&str]) {
        let text = m.render();
        for line in lines {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    /// A `Latency` renders as prometheus-client's histogram did: the same
    /// `le` bounds, cumulative counts, a `+Inf` bucket equal to the count,
    /// and the sum in seconds; an observation on a bound counts in it.
    #[test]
    fn latency_renders_cumulative_buckets() {
        let m = Metrics::new();
        m.decision_time.observe(Duration::from_micros(500)); // on the first bound
        m.decision_time.observe(Duration::from_micros(501)); // the next bucket
        m.decision_time.observe(Duration::from_millis(3));
        m.decision_time.observe(Duration::from_secs(60)); // above every bound
        assert_rendered(
            &m,
            &[
                "fencegate_decision_seconds_bucket{le=\"0.0005\"} 1\n",
                "fencegate_decision_seconds_bucket{le=\"0.001\"} 2\n",
                "fencegate_decision_seconds_bucket{le=\"0.002\"} 2\n",
                "fencegate_decision_seconds_bucket{le=\"0.004\"} 3\n",
                "fencegate_decision_seconds_bucket{le=\"16.384\"} 3\n",
                "fencegate_decision_seconds_bucket{le=\"+Inf\"} 4\n",
                "fencegate_decision_seconds_count 4\n",
                "fencegate_decision_seconds_sum 60.004001\n",
                "# TYPE fencegate_decision_seconds histogram",
            ],
        );
    }

    /// A route's counters, added to from more threads than there are
    /// shards, count every add, and render as counters with their labels:
    /// passed-through requests, decisions and Idempotency-Key outcomes.
    #[test]
    fn sharded_counters_count_every_thread_and_render() {
        let m = Metrics::new();
        let route = m.for_route("docs");
        std::thread::scope(|s| {
            for _ in 0..(2 * SHARDS) {
                let route = route.clone();
                s.spawn(move || {
                    for _ in 0..1000 {
                        route.passthrough();
                        route.decision(Outcome::Forwarded);
                        route.idempotency(IdempotencyOutcome::Replayed);
                    }
                });
            }
        });
        let n = 2000 * SHARDS as u64;
        let counts = m.for_route("docs").counts();
        assert_eq!(counts.passthrough, n);
        assert_eq!(counts.decisions.get("forwarded"), Some(&n));
        assert_rendered(
            &m,
            &[
                "# TYPE fencegate_passthrough_requests counter\n",
                &format!("fencegate_passthrough_requests_total{{route=\"docs\"}} {n}\n"),
                &format!("fencegate_decisions_total{{route=\"docs\",outcome=\"forwarded\"}} {n}\n"),
                &format!(
                    "fencegate_idempotency_total{{route=\"docs\",outcome=\"replayed\"}} {n}\n"
                ),
            ],
        );
    }

    /// Observations from many threads at once are all counted, whichever
    /// shards they land in, and clones count into the same histogram.
    #[test]
    fn latency_counts_every_thread() {
        let latency = Latency::default();
        std::thread::scope(|s| {
            for t in 0..(2 * SHARDS as u64) {
                let latency = latency.clone();
                s.spawn(move || {
                    for _ in 0..1000 {
                        latency.observe(Duration::from_millis(t));
                    }
                });
            }
        });
        let (count, sum, buckets) = latency.snapshot();
        assert_eq!(count, 2000 * SHARDS as u64);
        let expected: u64 = (0..2 * SHARDS as u64).map(|t| t * 1000).sum();
        assert!((sum - expected as f64 / 1000.0).abs() < 1e-6, "sum {sum}");
        assert_eq!(buckets.len(), BOUNDS + 1);
        assert_eq!(buckets.iter().map(|b| b.1).sum::<u64>(), count);
    }

    #[test]
    fn every_counted_kind_indexes_its_counters() {
        fn in_order<T: Copy + std::fmt::Debug>(all: &[T], index: impl Fn(T) -> usize) {
            for (i, v) in all.iter().enumerate() {
                assert_eq!(index(*v), i, "{v:?} is out of order in its ALL");
            }
        }
        in_order(&Outcome::ALL, |o| o as usize);
        in_order(&IdempotencyOutcome::ALL, |o| o as usize);
        in_order(&UpstreamFailure::ALL, |k| k as usize);
        in_order(&HoldReason::ALL, |r| r as usize);
        in_order(&ReloadResult::ALL, |r| r as usize);
        in_order(&LockEvent::ALL, |e| e as usize);
    }

    #[test]
    fn a_reloaded_route_keeps_its_counts() {
        let m = Metrics::new();
        let before = m.for_route("docs");
        before.decision(Outcome::Stale);
        before.decision(Outcome::Stale);
        before.upstream_error(UpstreamFailure::Unreachable);
        let after = m.for_route("docs");
        after.decision(Outcome::Forwarded);
        let c = after.counts();
        assert_eq!(c.decisions.get("stale"), Some(&2));
        assert_eq!(c.decisions.get("forwarded"), Some(&1));
        assert_eq!(c.decisions.get("late"), None, "never happened");
        assert_eq!(c.upstream_errors.get("unreachable"), Some(&1));
        assert_rendered(
            &m,
            &["fencegate_decisions_total{route=\"docs\",outcome=\"stale\"} 2"],
        );
    }

    #[test]
    fn labels_render_as_documented() {
        let m = Metrics::new();
        let r = m.for_route("docs");
        r.decision(Outcome::MissingToken);
        r.upstream_error(UpstreamFailure::Timeout);
        m.store_error(StoreOp::Ping);
        assert_rendered(
            &m,
            &[
                "fencegate_decisions_total{route=\"docs\",outcome=\"missing_token\"} 1",
                "fencegate_upstream_errors_total{route=\"docs\",kind=\"timeout\"} 1",
                "fencegate_store_errors_total{op=\"ping\"} 1",
            ],
        );
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// One open tunnel in `fencegate_tunnels_open`, for as long as it lives.
pub struct TunnelOpen(Gauge);

impl Drop for TunnelOpen {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One route's metrics, resolved when the gateway starts. Every request
/// touches some of them; looking a labelled metric up in its family per
/// request would cost a `String` for the label and a hash-map probe under a
/// lock. Clones share the same counters as the families.
#[derive(Clone)]
pub struct RouteMetrics {
    passthrough: ShardedCounter,
    upstream_latency: Latency,
    /// Decisions and upstream failures, shared with every other
    /// `RouteMetrics` of this route name.
    cells: Arc<RouteCells>,
    /// For the rarer labels, looked up when they happen.
    route: String,
    metrics: Metrics,
}

impl RouteMetrics {
    pub fn passthrough(&self) {
        self.passthrough.inc();
    }

    pub fn upstream_latency(&self, d: Duration) {
        self.upstream_latency.observe(d);
    }

    /// A tunnel of this route opened; it counts as open until the guard
    /// is dropped, with the tunnel.
    pub fn tunnel_opened(&self) -> TunnelOpen {
        let gauge = self
            .metrics
            .tunnels_open
            .get_or_create(&RouteLabels {
                route: self.route.clone(),
            })
            .clone();
        gauge.inc();
        TunnelOpen(gauge)
    }

    pub fn decision(&self, outcome: Outcome) {
        self.cells.decisions[outcome as usize]
            .get_or_init(|| {
                self.metrics
                    .decisions
                    .get_or_create(&DecisionLabels {
                        route: self.route.clone(),
                        outcome,
                    })
                    .clone()
            })
            .inc();
    }

    pub fn upstream_error(&self, kind: UpstreamFailure) {
        self.cells.upstream_errors[kind as usize]
            .get_or_init(|| {
                self.metrics
                    .upstream_errors
                    .get_or_create(&UpstreamErrorLabels {
                        route: self.route.clone(),
                        kind,
                    })
                    .clone()
            })
            .inc();
    }

    /// A fenced write's exchange ended other than normally, and its key
    /// stays closed until the deadline.
    pub fn held_key(&self, reason: HoldReason) {
        self.cells.held_keys[reason as usize]
            .get_or_init(|| {
                self.metrics
                    .held_keys
                    .get_or_create(&HoldLabels {
                        route: self.route.clone(),
                        reason,
                    })
                    .clone()
            })
            .inc();
    }

    /// Everything counted for this route name so far.
    pub fn counts(&self) -> RouteCounts {
        let read = |cell: &OnceLock<ShardedCounter>| cell.get().map(ShardedCounter::get);
        let cells = &self.cells;
        RouteCounts {
            decisions: by_label(&Outcome::ALL, Outcome::as_str, |o| {
                read(&cells.decisions[o as usize])
            }),
            passthrough: self.passthrough.get(),
            upstream_errors: by_label(&UpstreamFailure::ALL, UpstreamFailure::as_str, |k| {
                read(&cells.upstream_errors[k as usize])
            }),
            held_keys: by_label(&HoldReason::ALL, HoldReason::as_str, |r| {
                cells.held_keys[r as usize].get().map(Counter::get)
            }),
        }
    }

    pub fn idempotency(&self, outcome: IdempotencyOutcome) {
        self.cells.idempotency[outcome as usize]
            .get_or_init(|| {
                self.metrics
                    .idempotency
                    .get_or_create(&IdempotencyLabels {
                        route: self.route.clone(),
                        outcome,
                    })
                    .clone()
            })
            .inc();
    }
}
