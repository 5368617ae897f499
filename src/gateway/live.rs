//! What a request reads of the running config: the routes with their
//! metric handles, the JWT keys, the API clients. A reload swaps it whole
//! (see `boot::reload`); each worker keeps a copy of its own.

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::config::{Config, Route};
use crate::fencing::jwt::JwtKeys;
use crate::metrics::{Metrics, RouteMetrics};

/// A configured route with its metric handles.
pub struct GatedRoute {
    pub route: Route,
    pub metrics: RouteMetrics,
}

impl GatedRoute {
    pub fn new(route: Route, metrics: &Metrics) -> Self {
        Self {
            metrics: metrics.for_route(&route.name),
            route,
        }
    }

    /// A copy for one traffic worker, with its own upstream pool key and
    /// `Host` value (see `gateway::live::WorkerLive`); the same metrics.
    pub fn worker_copy(&self) -> Self {
        Self {
            route: Route {
                upstream: self.route.upstream.worker_copy(),
                ..self.route.clone()
            },
            metrics: self.metrics.clone(),
        }
    }
}

impl std::ops::Deref for GatedRoute {
    type Target = Route;

    fn deref(&self) -> &Route {
        &self.route
    }
}

/// What a reload swaps for new requests.
pub struct Live {
    /// Routes in file order; the first match wins.
    pub routes: Arc<[Arc<GatedRoute>]>,
    /// Verifies JWT fence tokens on `token = "jwt"` routes.
    pub jwt: Option<Arc<crate::fencing::jwt::JwtKeys>>,
    /// Who may call the lock API and the admin actions.
    pub auth: crate::auth::Clients,
    /// `[log] access`: one log line per request.
    pub access_log: bool,
}

/// The current [`Live`], shared by every worker, the lock API and the
/// admin listener.
pub type Shared = Arc<ArcSwap<Live>>;

/// One traffic worker's view of the current [`Live`]: a copy of its own,
/// made the first time the worker sees a new one.
///
/// Each request keeps its `Live` and its route to its end, and clones its
/// route's upstream pool key and `Host` value: reference counts, each one
/// added to and taken from once per request. On the one shared `Live`
/// those counts sit in memory every worker writes, so each request takes
/// their cache lines from the core the last one ran on: the sharing
/// nginx's worker processes never do. On a worker's copy only that worker
/// writes them. What a request reads of the shared `Live` is its pointer,
/// which only a reload writes.
///
/// A clone is another worker's view: it makes its own copy.
pub struct WorkerLive {
    shared: Shared,
    /// The `Live` the copy was made of, and the copy. The source is kept,
    /// so that a new `Live` at the address of a freed one cannot pass for
    /// it. Only this worker's thread takes the lock.
    copy: std::sync::Mutex<(Arc<Live>, Arc<Live>)>,
}

impl WorkerLive {
    pub fn new(shared: Shared) -> Self {
        let source = shared.load_full();
        let copy = Arc::new(source.worker_copy());
        Self {
            shared,
            copy: std::sync::Mutex::new((source, copy)),
        }
    }

    /// This worker's copy of the current `Live`.
    pub fn load(&self) -> Arc<Live> {
        let current = self.shared.load();
        // A poisoned lock only means a panic while copying; the pair is
        // still whole (it is assigned at once).
        let mut copy = self.copy.lock().unwrap_or_else(|e| e.into_inner());
        if !Arc::ptr_eq(&copy.0, &current) {
            let source = arc_swap::Guard::into_inner(current);
            let fresh = Arc::new(source.worker_copy());
            *copy = (source, fresh);
        }
        Arc::clone(&copy.1)
    }
}

impl Clone for WorkerLive {
    fn clone(&self) -> Self {
        Self::new(self.shared.clone())
    }
}

impl Live {
    /// `jwt`: the config's `[tokens]`, loaded.
    pub fn new(config: &Config, jwt: Option<Arc<JwtKeys>>, metrics: &Metrics) -> Self {
        Self {
            routes: config
                .routes
                .iter()
                .map(|r| Arc::new(GatedRoute::new(r.clone(), metrics)))
                .collect(),
            jwt,
            auth: config.auth.clone(),
            access_log: config.log.access,
        }
    }

    /// A copy for one worker (see [`WorkerLive`]): routes of its own, the
    /// rest shared.
    fn worker_copy(&self) -> Live {
        Live {
            routes: self
                .routes
                .iter()
                .map(|r| Arc::new(r.worker_copy()))
                .collect(),
            jwt: self.jwt.clone(),
            auth: self.auth.clone(),
            access_log: self.access_log,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// config's sample, forwarding to `upstream`.
    fn config(upstream: &str) -> Config {
        let text = crate::config::tests::GOOD.replace("http://127.0.0.1:9000", upstream);
        Config::from_toml("t.toml", &text, Vec::new()).unwrap()
    }

    /// A worker's copy has routes, pool keys and `Host` values of its own
    /// (what each request clones), equal to the shared ones; it stays the
    /// same copy until a reload, and after one the next load is a copy of
    /// the new `Live`. Another worker's view (a clone) has copies of its own.
    #[test]
    fn a_worker_copies_the_live_config_once_per_reload() {
        let metrics = Metrics::new();
        let shared: Shared = Arc::new(ArcSwap::from_pointee(Live::new(
            &config("http://127.0.0.1:9000"),
            None,
            &metrics,
        )));
        let worker = WorkerLive::new(shared.clone());
        let first = worker.load();
        let (mine, theirs) = (&first.routes[0], &shared.load().routes[0]);
        assert!(!Arc::ptr_eq(mine, theirs));
        assert!(!Arc::ptr_eq(
            &mine.upstream.pool_key,
            &theirs.upstream.pool_key
        ));
        assert_eq!(mine.upstream.pool_key, theirs.upstream.pool_key);
        assert_eq!(mine.upstream.host, theirs.upstream.host);
        assert_ne!(
            mine.upstream.host.as_bytes().as_ptr(),
            theirs.upstream.host.as_bytes().as_ptr()
        );
        assert!(
            Arc::ptr_eq(&first, &worker.load()),
            "one copy until a reload"
        );

        let other = worker.clone();
        assert!(!Arc::ptr_eq(&other.load().routes[0], mine));

        shared.store(Arc::new(Live::new(
            &config("http://127.0.0.1:9001"),
            None,
            &metrics,
        )));
        let after = worker.load();
        assert!(!Arc::ptr_eq(&first, &after));
        assert_eq!(
            after.routes[0].upstream.authority.as_str(),
            "127.0.0.1:9001"
        );
        assert!(Arc::ptr_eq(&after, &worker.load()));
        // A request that started before the reload keeps its copy.
        assert_eq!(
            first.routes[0].upstream.authority.as_str(),
            "127.0.0.1:9000"
        );
    }
}
