//! Putting it together: `Application::build` opens the store and binds the
//! listeners (port 0 works, for tests); `run` serves until shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use tokio::net::TcpListener;

use crate::admin::{self, AdminState};
use crate::boot::load::{self, Loaded};
use crate::boot::traffic::{OnRuntime, Traffic};
use crate::config::{Config, ConfigError, LockBackendConfig};
use crate::gateway::fence::Fence;
use crate::gateway::GatewayState;
use crate::http1::server::{self, Limits};
use crate::listener::{self, Protocols, Workers};
use crate::locks::api::LockApiState;
use crate::locks::notify::Notifier;
use crate::locks::redlock::Redlock;
use crate::locks::single_redis::RedisLocks;
use crate::locks::table::TableLocks;
use crate::locks::{Backend, LockLimits, LockService};
use crate::metrics::Metrics;
use crate::store::{FenceStore, StoreError};

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot bind {what} {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("fence store: {0}")]
    Store(#[from] StoreError),
    #[error("lock backend: {0}")]
    Locks(#[from] crate::locks::LockError),
    #[error("cannot start the traffic worker threads: {0}")]
    Workers(std::io::Error),
    #[error("{0}")]
    Config(#[from] ConfigError),
}

/// A gateway ready to serve: store open, listeners bound.
pub struct Application {
    listeners: Listeners,
    core: Core,
}

/// The bound sockets, handed to their servers by `run`.
struct Listeners {
    traffic: TcpListener,
    admin: TcpListener,
    demo: Option<TcpListener>,
}

/// Everything else the servers share, and what shutdown needs.
struct Core {
    gateway: GatewayState,
    admin_state: AdminState,
    /// The lock API, when `[locks] enabled`.
    locks: Option<LockApiState>,
    /// The gate, to check that nothing is in flight before a clean stop.
    gate: std::sync::Arc<crate::fencing::gate::Gate>,
    /// Background tasks (notification listeners, the idempotency purge) to
    /// stop on shutdown.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    limits: Limits,
    /// What the traffic listener speaks besides HTTP/1.1.
    speaks: Protocols,
    /// `[server] workers`: threads serving the traffic listener.
    workers: usize,
    /// `[server.tls]`, when the traffic listener speaks HTTPS.
    tls: Option<Arc<crate::boot::tls::Tls>>,
    /// Applies SIGHUP reloads; moved into its task by `run`.
    reloader: Option<(crate::boot::reload::Reloader, Hangups)>,
}

impl Application {
    /// Loads what `config` names (see [`load::complete`]), with secrets
    /// from the process's environment, then builds.
    pub async fn build(config: Config) -> Result<Self, StartError> {
        Self::build_loaded(load::complete(config, &load::process_env())?).await
    }

    pub async fn build_loaded(loaded: Loaded) -> Result<Self, StartError> {
        let Loaded { config, tls, jwt } = loaded;
        // Bind first: a port conflict is the cheapest thing to find out.
        let traffic = bind("listener", config.server.listen).await?;
        let admin = bind("admin listener", config.server.admin_listen).await?;
        let demo = match &config.demo {
            Some(d) => Some(bind("demo backend", d.listen).await?),
            None => None,
        };
        let store = FenceStore::open(&config.store).await?;
        let metrics = Metrics::new();
        let fence = open_fence(&config, &store).await?;
        let mut tasks: Vec<tokio::task::JoinHandle<()>> =
            fence.watch_resets().into_iter().collect();
        // Expired Idempotency-Key records go, on every instance and whether
        // or not a route uses them now (a reload may add one, and records
        // outlive the routes that wrote them); aborted with the other tasks
        // on shutdown, before the store closes.
        tasks.push(tokio::spawn(crate::idempotency::purge_forever(
            store.clone(),
            config.store.idempotency_purge_interval,
        )));
        // Routes, token keys and auth clients; a reload swaps them at once.
        let live: crate::gateway::live::Shared = Arc::new(arc_swap::ArcSwap::from_pointee(
            crate::gateway::live::Live::new(&config, jwt.clone(), &metrics),
        ));
        let locks = if config.locks.enabled {
            let service = lock_service(&config, jwt, &store, &metrics, &mut tasks).await?;
            Some(LockApiState {
                locks: service,
                retry_after: config.store.retry_after,
                live: live.clone(),
            })
        } else {
            None
        };
        let refusals = Arc::new(crate::gateway::refusals::Refusals::new());
        let gateway = GatewayState {
            live: crate::gateway::live::WorkerLive::new(live.clone()),
            refusals: refusals.clone(),
            fence: fence.clone(),
            client: crate::http1::client::UpstreamClient::new(),
            h2: crate::http2::Http2Client::new(),
            store_runtime: Arc::new(tokio::runtime::Handle::current()),
            metrics: metrics.clone(),
            max_body_bytes: config.server.max_body_bytes,
            retry_after: config.store.retry_after,
            replays: Arc::new(crate::idempotency::ReplayCache::default()),
            forgets: Arc::new(crate::idempotency::Forgets::new(
                fence.store.clone(),
                tokio::runtime::Handle::current(),
            )),
        };
        let reloader = crate::boot::reload::Reloader::new(
            &config,
            live.clone(),
            locks.as_ref().map(|l| l.locks.clone()),
            tls.clone(),
            metrics.clone(),
            fence.store.clone(),
        );
        let admin_state = AdminState {
            store,
            metrics,
            gate: fence.gate.clone(),
            retry_after: config.store.retry_after,
            locks: locks.as_ref().map(|l| l.locks.clone()),
            live: live.clone(),
            refusals,
            about: crate::admin::About::of(&config),
        };
        Ok(Self {
            listeners: Listeners {
                traffic,
                admin,
                demo,
            },
            core: Core {
                gateway,
                admin_state,
                locks,
                gate: fence.gate.clone(),
                tasks,
                workers: config.server.workers,
                tls,
                reloader: hangups().map(|h| (reloader, h)),
                limits: Limits {
                    header_read_timeout: config.server.header_read_timeout,
                    max_connections: config.server.max_connections,
                    shutdown_grace: config.server.shutdown_grace,
                },
                speaks: Protocols {
                    http2: config.server.http2,
                },
            },
        })
    }

    /// Where proxy traffic is served.
    pub fn traffic_addr(&self) -> SocketAddr {
        self.listeners
            .traffic
            .local_addr()
            .expect("bound listener has an address")
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.listeners
            .admin
            .local_addr()
            .expect("bound listener has an address")
    }

    pub fn demo_addr(&self) -> Option<SocketAddr> {
        self.listeners
            .demo
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    /// Serves until `shutdown` resolves, then drains in-flight requests for
    /// up to the configured grace period and closes the store.
    /// Fails only if the worker threads cannot be started (then nothing was
    /// served).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), StartError> {
        let Application {
            listeners,
            mut core,
        } = self;
        let stop = Stop::new();
        if let Some((reloader, hangups)) = core.reloader.take() {
            core.tasks
                .push(tokio::spawn(reload_on_hangup(reloader, hangups)));
        }
        let workers = match core.start_traffic(listeners.traffic, &stop) {
            Ok(w) => w,
            Err(e) => {
                core.close().await;
                return Err(StartError::Workers(e));
            }
        };
        let admin = tokio::spawn(listener::serve(
            listeners.admin,
            server::RouterService {
                router: admin::router(core.admin_state.clone()),
                refuse: crate::gateway::error::refused_head,
            },
            core.limits,
            stop.stopped(),
        ));
        let demo = listeners
            .demo
            .map(|l| tokio::spawn(crate::demo::run(l, stop.stopped())));

        shutdown.await;
        tracing::info!("shutting down: no new connections; finishing in-flight requests");
        stop.now();
        workers.finished().await;
        let _ = admin.await;
        if let Some(d) = demo {
            let _ = d.await;
        }
        core.record_stop().await;
        core.close().await;
        tracing::info!("stopped");
        Ok(())
    }
}

impl Core {
    /// Starts the traffic listener's worker threads, each with its own
    /// gateway state and upstream pool; the reserved prefix (the lock API)
    /// is served by a router on this runtime, where the store's connections
    /// live (see `http1::server` and `traffic`).
    fn start_traffic(&self, listener: TcpListener, stop: &Stop) -> std::io::Result<Workers> {
        let reserved = traced(crate::boot::traffic::reserved_router(self.locks.clone()));
        let services = (0..self.workers)
            .map(|_| Traffic {
                // Each worker has its own upstream pool: its connections are
                // driven by the worker's runtime, next to the requests using
                // them.
                gateway: Arc::new(self.gateway.for_worker()),
                reserved: OnRuntime {
                    runtime: tokio::runtime::Handle::current(),
                    router: reserved.clone(),
                },
            })
            .collect();
        let gate = self.gate.clone();
        Workers::start(
            listener,
            services,
            self.tls.as_ref().map(|t| t.serving()),
            self.speaks,
            self.limits,
            stop.stopped(),
            move || settled(gate.clone()),
        )
    }

    /// Records a clean stop, but only if no write of ours can still reach an
    /// upstream: forwards that ended abnormally keep their key closed until
    /// their deadline, so wait for the gate to empty (within the grace
    /// period). Otherwise the next start waits as after a crash.
    async fn record_stop(&self) {
        let _ = tokio::time::timeout(self.limits.shutdown_grace, settled(self.gate.clone())).await;
        if self.gate.tracked_keys() > 0 {
            tracing::warn!(
                "writes still in flight at exit; the next start will wait as after a crash"
            );
            return;
        }
        if let Err(e) = self.admin_state.store.end_run().await {
            tracing::warn!(error = %e, "could not record the clean stop; the next start will wait as after a crash");
        }
    }

    /// Stops background tasks and closes the store (releasing the
    /// single-writer lock).
    async fn close(&self) {
        for t in &self.tasks {
            t.abort();
        }
        self.admin_state.store.close().await;
    }
}

/// SIGHUP: reloads the config file (see `reload`). Every problem of a
/// refused reload is logged; the running config stays.
async fn reload_on_hangup(reloader: crate::boot::reload::Reloader, mut hangups: Hangups) {
    while hangups.recv().await.is_some() {
        match reloader.reload().await {
            Ok(()) => tracing::info!(
                "SIGHUP: config reloaded (routes, token keys, auth clients, TLS files) for new requests"
            ),
            Err(refused) => {
                for c in &refused.key_identity {
                    tracing::error!(
                        route = %c.route,
                        change = %c.change,
                        "SIGHUP: config reload refused: it would change the key identity of a fenced route, and with it which writes are fenced against which; the running config stays (to change it, stop the route's writers and restart: see README, Reloading the config)"
                    );
                }
                for p in refused.problems {
                    tracing::error!(problem = %p, "SIGHUP: config not reloaded; the running config stays");
                }
            }
        }
    }
}

/// SIGHUP's stream, taken when the gateway is built: from then on a SIGHUP
/// is a reload, never the default action (which ends the process).
#[cfg(unix)]
type Hangups = tokio::signal::unix::Signal;

#[cfg(unix)]
fn hangups() -> Option<Hangups> {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; the config will not be reloaded");
            None
        }
    }
}

/// The shutdown signal, fanned out to every listener.
struct Stop(tokio::sync::watch::Sender<bool>);

impl Stop {
    fn new() -> Self {
        Self(tokio::sync::watch::channel(false).0)
    }

    /// Resolves once [`Stop::now`] was called.
    fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.0.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    fn now(&self) {
        self.0.send_replace(true);
    }
}

/// The fence on `store`, held back after an unclean stop of the previous
/// instance until that instance's writes can no longer arrive.
async fn open_fence(config: &Config, store: &FenceStore) -> Result<Fence, StartError> {
    let mut fence = Fence::new(store.clone(), config.store.cache_keys);
    let longest = config
        .routes
        .iter()
        .map(|r| r.timeout)
        .max()
        .unwrap_or_default();
    if let Some(recorded) = store.begin_run(longest).await? {
        // The previous single-mode instance crashed (or lost the store
        // in a failover and has not stopped): its forwards may still
        // reach the upstream until its longest route timeout (the one
        // it recorded, which a new config cannot shorten), and it may
        // have admitted writes until its lease on the lock ran out
        // after its last confirmation (see `store::OWNER_LEASE`).
        let wait = longest.max(recorded) + std::time::Duration::from_secs(1) + store.writer_lease();
        tracing::warn!(
            wait_ms = wait.as_millis() as u64,
            "the previous instance on this store did not stop cleanly; fenced writes wait until its writes can no longer arrive"
        );
        fence = fence.with_quarantine(std::time::Instant::now() + wait);
    }
    Ok(fence)
}

/// Builds the lock service for the configured backend.
async fn lock_service(
    config: &Config,
    jwt: Option<Arc<crate::fencing::jwt::JwtKeys>>,
    store: &FenceStore,
    metrics: &Metrics,
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> Result<LockService, StartError> {
    let notifier = Notifier::new();
    let backend = match &config.locks.backend {
        LockBackendConfig::Store => {
            if let FenceStore::Postgres(pg) = store {
                tasks.push(crate::locks::table::spawn_pg_listener(
                    pg.pool().clone(),
                    notifier.clone(),
                ));
            }
            Backend::Table(
                TableLocks::new(store.clone(), config.store.timeout)
                    .with_lock_delay(config.locks.lock_delay),
            )
        }
        LockBackendConfig::Redis { target } => Backend::Redis(
            RedisLocks::connect_to(
                target,
                store.clone(),
                config.locks.redis_timeout,
                notifier.clone(),
            )
            .await?
            .with_lock_delay(config.locks.lock_delay),
        ),
        LockBackendConfig::Redlock { urls } => Backend::Redlock(
            Redlock::connect(
                urls,
                store.clone(),
                config.locks.redis_timeout,
                notifier.clone(),
            )
            .await?
            .with_lock_delay(config.locks.lock_delay),
        ),
    };
    Ok(LockService::new(
        backend,
        notifier,
        jwt,
        LockLimits {
            min_ttl: config.locks.min_ttl,
            max_ttl: config.locks.max_ttl,
            max_wait: config.locks.max_wait,
        },
        metrics.clone(),
    ))
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { what, addr, source })
}

/// Request spans at DEBUG: free when that level is off, and a per-request
/// trace when chasing a problem (RUST_LOG=tower_http=debug).
fn traced(router: Router) -> Router {
    router.layer(
        // 5xx answers are the gateway's normal fail-closed answers and are
        // logged where they arise; not again as errors here.
        tower_http::trace::TraceLayer::new_for_http()
            .on_failure(tower_http::trace::DefaultOnFailure::new().level(tracing::Level::DEBUG)),
    )
}

/// Resolves once no fenced write holds a key: nothing of ours can still
/// reach an upstream.
async fn settled(gate: Arc<crate::fencing::gate::Gate>) {
    while gate.tracked_keys() > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
