//! Configuration reload on SIGHUP: re-read the config file, check it with
//! the same validator as `fencegate check-config`, and swap what can change
//! under running traffic.
//!
//! [`Live`] is what changes: routes, token keys, auth clients and the
//! access-log switch, swapped in one atomic step ([`arc_swap`]), so a new
//! request sees either the old config or the new one, never a mix. A
//! request takes the current `Live` when it arrives and keeps it to its end:
//! requests in flight finish on the config they started with. The lock
//! API's signing keys and the TLS files are swapped just before (new
//! connections get the new certificate).
//!
//! A config with problems changes nothing: every problem is logged and the
//! reload is counted as an error. So is a change to a setting only a restart
//! can apply (a listener, the store, the lock backend, worker threads, the
//! log format): the log names each one.

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::config::Config;
use crate::gateway::GatedRoute;
use crate::metrics::Metrics;

/// What a reload swaps for new requests.
pub struct Live {
    /// Routes in file order; the first match wins.
    pub routes: Arc<[Arc<GatedRoute>]>,
    /// Verifies JWT fence tokens on `token = "jwt"` routes.
    pub jwt: Option<Arc<crate::jwt::JwtKeys>>,
    /// Who may call the lock API and the admin actions.
    pub auth: crate::auth::Clients,
    /// `[log] access`: one log line per request.
    pub access_log: bool,
}

/// The current [`Live`], shared by every worker, the lock API and the
/// admin listener.
pub type Shared = Arc<ArcSwap<Live>>;

impl Live {
    pub fn new(config: &Config, metrics: &Metrics) -> Self {
        Self {
            routes: config
                .routes
                .iter()
                .map(|r| Arc::new(GatedRoute::new(r.clone(), metrics)))
                .collect(),
            jwt: config.tokens.clone(),
            auth: config.auth.clone(),
            access_log: config.log.access,
        }
    }
}

/// Applies reloads of one config file to a running gateway.
pub struct Reloader {
    path: PathBuf,
    /// The running config's settings that only a restart can change.
    fixed: Vec<(&'static str, String)>,
    live: Shared,
    /// The lock service, for its signing keys.
    locks: Option<crate::locks::LockService>,
    /// The traffic listener's TLS, for its files.
    tls: Option<Arc<crate::tls::Tls>>,
    metrics: Metrics,
}

/// The settings a reload cannot change, each with its current value.
fn fixed(c: &Config) -> Vec<(&'static str, String)> {
    let s = &c.server;
    vec![
        ("server.listen", s.listen.to_string()),
        ("server.admin_listen", s.admin_listen.to_string()),
        ("server.max_body_bytes", s.max_body_bytes.to_string()),
        (
            "server.header_read_timeout_ms",
            format!("{:?}", s.header_read_timeout),
        ),
        ("server.max_connections", s.max_connections.to_string()),
        (
            "server.shutdown_grace_ms",
            format!("{:?}", s.shutdown_grace),
        ),
        ("server.workers", s.workers.to_string()),
        ("server.tls (on or off)", s.tls.is_some().to_string()),
        ("[store]", format!("{:?}", c.store)),
        ("[locks]", format!("{:?}", c.locks)),
        ("[demo]", format!("{:?}", c.demo)),
        ("log.format", format!("{:?}", c.log.format)),
    ]
}

impl Reloader {
    pub fn new(
        config: &Config,
        live: Shared,
        locks: Option<crate::locks::LockService>,
        tls: Option<Arc<crate::tls::Tls>>,
        metrics: Metrics,
    ) -> Self {
        Self {
            path: PathBuf::from(&config.source),
            fixed: fixed(config),
            live,
            locks,
            tls,
            metrics,
        }
    }

    /// Re-reads the file and applies it; on any problem, changes nothing
    /// and answers every problem.
    pub fn reload(&self) -> Result<(), Vec<String>> {
        let result = self.try_reload();
        self.metrics.config_reload(result.is_ok());
        result
    }

    fn try_reload(&self) -> Result<(), Vec<String>> {
        let config = Config::load(&self.path).map_err(|e| {
            e.to_string()
                .lines()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })?;
        let restart: Vec<String> = fixed(&config)
            .into_iter()
            .zip(&self.fixed)
            .filter(|(new, old)| new.1 != old.1)
            .map(|(new, _)| format!("{}: changed, and only a restart applies it", new.0))
            .collect();
        if !restart.is_empty() {
            return Err(restart);
        }
        if let (Some(tls), Some(new)) = (&self.tls, &config.server.tls) {
            tls.adopt(new);
        }
        if let Some(locks) = &self.locks {
            locks.set_signing_keys(config.tokens.clone());
        }
        self.live.store(Arc::new(Live::new(&config, &self.metrics)));
        warn_if_open(&config);
        Ok(())
    }
}

/// Warns when `config` leaves the lock API open to the network (see
/// [`Config::lock_api_open_to_network`]): at start-up, and after a reload
/// that removed the last client.
pub fn warn_if_open(config: &Config) {
    if config.lock_api_open_to_network() {
        tracing::warn!(
            listen = %config.server.listen,
            "the lock API is open to anyone who can reach this listener: no [[auth.clients]] are configured"
        );
    }
}
