//! Prometheus metrics, served as text on the admin listener.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub route: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamErrorLabels {
    pub route: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LockLabels {
    pub backend: &'static str,
    pub event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreErrorLabels {
    pub op: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Every metric the gateway exports. Cloning shares the same counters.
#[derive(Clone)]
pub struct Metrics {
    /// Fence decisions by route and outcome (`forwarded`, `stale`,
    /// `missing_token`, `malformed_token`, `store_unavailable`, `key_busy`,
    /// ...).
    pub decisions: Family<DecisionLabels, Counter>,
    /// Requests forwarded without a check (safe methods).
    pub passthrough: Family<RouteLabels, Counter>,
    /// Time from sending a request upstream to its response head.
    pub upstream_latency: HistogramFamily<RouteLabels>,
    /// Upstream failures by kind (`unreachable`, `timeout`).
    pub upstream_errors: Family<UpstreamErrorLabels, Counter>,
    /// Store failures by operation.
    pub store_errors: Family<StoreErrorLabels, Counter>,
    /// Time fenced writes spent being decided: the store write plus the wait
    /// at the gate for older tokens' writes to finish.
    pub gate_wait: Histogram,
    /// Keys with writes in flight or waiting.
    pub gate_keys: Gauge,
    /// Lock API outcomes by backend and event (`grant`, `held`, `renew`,
    /// `renew_refused`, `release`, `release_refused`, `expired`,
    /// `unavailable`).
    pub lock_events: Family<LockLabels, Counter>,
    registry: std::sync::Arc<Registry>,
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("fencegate");
        let decisions = Family::<DecisionLabels, Counter>::default();
        let passthrough = Family::<RouteLabels, Counter>::default();
        let upstream_latency: HistogramFamily<RouteLabels> =
            Family::new_with_constructor(latency_histogram);
        let upstream_errors = Family::<UpstreamErrorLabels, Counter>::default();
        let store_errors = Family::<StoreErrorLabels, Counter>::default();
        let gate_wait = latency_histogram();
        let gate_keys = Gauge::default();
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
            "gate_wait_seconds",
            "Time fenced writes spent being decided: store write plus waiting at the gate",
            gate_wait.clone(),
        );
        registry.register(
            "gate_keys",
            "Resource keys with writes in flight or waiting",
            gate_keys.clone(),
        );
        Self {
            decisions,
            passthrough,
            upstream_latency,
            upstream_errors,
            store_errors,
            gate_wait,
            gate_keys,
            lock_events,
            registry: std::sync::Arc::new(registry),
        }
    }

    pub fn decision(&self, route: &str, outcome: &'static str) {
        self.decisions
            .get_or_create(&DecisionLabels {
                route: route.to_string(),
                outcome,
            })
            .inc();
    }

    pub fn upstream_error(&self, route: &str, kind: &'static str) {
        self.upstream_errors
            .get_or_create(&UpstreamErrorLabels {
                route: route.to_string(),
                kind,
            })
            .inc();
    }

    pub fn lock_event(&self, backend: &'static str, event: &'static str) {
        self.lock_events
            .get_or_create(&LockLabels { backend, event })
            .inc();
    }

    pub fn store_error(&self, op: &'static str) {
        self.store_errors
            .get_or_create(&StoreErrorLabels { op })
            .inc();
    }

    pub fn upstream_latency(&self, route: &str, d: Duration) {
        self.upstream_latency
            .get_or_create(&RouteLabels {
                route: route.to_string(),
            })
            .observe(d.as_secs_f64());
    }

    /// One route's handles, for the request path.
    pub fn for_route(&self, route: &str) -> RouteMetrics {
        let labels = RouteLabels {
            route: route.to_string(),
        };
        let decision = |outcome| {
            self.decisions
                .get_or_create(&DecisionLabels {
                    route: route.to_string(),
                    outcome,
                })
                .clone()
        };
        RouteMetrics {
            passthrough: self.passthrough.get_or_create(&labels).clone(),
            upstream_latency: self.upstream_latency.get_or_create(&labels).clone(),
            forwarded: decision("forwarded"),
            stale: decision("stale"),
            route: route.to_string(),
            metrics: self.clone(),
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// One route's metrics, resolved when the gateway starts. Every request
/// touches some of them; looking a labelled metric up in its family per
/// request would cost a `String` for the label and a hash-map probe under a
/// lock. Clones share the same counters as the families.
#[derive(Clone)]
pub struct RouteMetrics {
    passthrough: Counter,
    upstream_latency: Histogram,
    /// The two decisions a busy route makes all the time.
    forwarded: Counter,
    stale: Counter,
    /// For the rarer labels, looked up when they happen.
    route: String,
    metrics: Metrics,
}

impl RouteMetrics {
    pub fn passthrough(&self) {
        self.passthrough.inc();
    }

    pub fn upstream_latency(&self, d: Duration) {
        self.upstream_latency.observe(d.as_secs_f64());
    }

    pub fn decision(&self, outcome: &'static str) {
        match outcome {
            "forwarded" => {
                self.forwarded.inc();
            }
            "stale" => {
                self.stale.inc();
            }
            _ => self.metrics.decision(&self.route, outcome),
        }
    }

    pub fn upstream_error(&self, kind: &'static str) {
        self.metrics.upstream_error(&self.route, kind);
    }
}
