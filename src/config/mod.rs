//! Typed configuration, loaded from TOML with `FENCEGATE__SECTION__KEY`
//! environment overrides and validated before anything starts.
//!
//! Loading happens in three steps so that a user sees every problem at once
//! instead of fixing them one run at a time:
//!
//! 1. parse the file into a TOML table and apply environment overrides;
//! 2. deserialize into the raw structs below, collecting every unknown key
//!    (a typo such as `timout_ms` must not silently fall back to a default);
//! 3. validate values and compile routes, collecting every problem.
//!
//! What it hands over is plain data: paths, numbers, enums, URL parts. The
//! files a config names (certificates, keys, CA files) are read by
//! `boot::load`.
//!
//! # Layout
//!
//! * this file: the validated types, and the defaults defined once;
//! * `raw`: the structures as written, with serde's defaults;
//! * `parse`: text to raw, with environment overrides and unknown keys;
//! * `validate`: raw to validated, every problem collected;
//! * `keys`: every key the loader accepts, for the reference's test.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::Method;
use serde::Deserialize;

use crate::fencing::routing::{KeyTemplate, PathPattern};
pub use crate::http1::client::Upstream;

mod keys;
mod parse;
mod raw;
#[cfg(test)]
pub(crate) mod tests;
mod validate;

pub use keys::accepted_keys;

/// Prefix of environment variables that override config keys.
pub const ENV_PREFIX: &str = "FENCEGATE__";

/// Where gateway-owned paths live; routes may not use them.
pub const RESERVED_PREFIX: &str = "/_fencegate";

/// Whether `path` is the gateway's own (`/_fencegate` or below it).
pub fn is_reserved(path: &str) -> bool {
    path.strip_prefix(RESERVED_PREFIX)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it came from, for messages.
    pub source: String,
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub routes: Vec<Route>,
    pub locks: LocksConfig,
    /// `[tokens]`: the keys of JWT fence tokens, as written; `boot` loads
    /// them.
    pub tokens: Option<crate::fencing::jwt::TokensSettings>,
    /// A built-in demo backend to start next to the gateway, if any.
    pub demo: Option<DemoConfig>,
    /// `[[auth.clients]]`: who may use the lock API and admin actions.
    pub auth: crate::auth::Clients,
    /// `[log]`.
    pub log: LogConfig,
    /// Deprecated keys in use, each with what to write instead; `serve` and
    /// `check-config` print them.
    pub deprecations: Vec<String>,
}

/// `[locks]`: the lock API.
#[derive(Debug, Clone)]
pub struct LocksConfig {
    /// Serve `/_fencegate/locks/...` at all.
    pub enabled: bool,
    pub backend: LockBackendConfig,
    /// Bounds on a lease's ttl, so a client cannot take a lock forever (or
    /// for a time too short to be meaningful).
    pub min_ttl: Duration,
    pub max_ttl: Duration,
    /// Longest `wait_ms` of a blocking acquire.
    pub max_wait: Duration,
    /// Bound on one Redis operation (`backend = "redis"`), or on each
    /// node's answer (`backend = "redlock"`): Redlock needs it short next to
    /// the ttl, since time spent waiting is taken from the lease's validity.
    pub redis_timeout: Duration,
    /// How long a name stays ungrantable after a lease ends by expiry (not
    /// by release): a holder that lost its lease involuntarily may still be
    /// finishing a write it started in time, and the delay keeps the next
    /// holder from starting its own on top of it (Chubby's lock-delay).
    pub lock_delay: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockBackendConfig {
    /// The `[store]` database.
    Store,
    Redis {
        target: RedisTarget,
    },
    Redlock {
        urls: Vec<String>,
    },
}

/// Where `backend = "redis"` finds its server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis_url`: one address. After a failover it must lead to the new
    /// master by itself (a VIP, a DNS name or a TCP proxy that follows it).
    Url(String),
    /// `redis_sentinels` and `redis_master_name`: the master is the one
    /// Sentinel names, asked again whenever the connection to it is lost or
    /// it turns out to be a replica.
    Sentinel {
        sentinels: Vec<String>,
        master_name: String,
    },
}

/// `[server]`: listeners and the limits that protect them.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Proxy traffic and the lock API.
    pub listen: SocketAddr,
    /// Metrics, health and the admin API; kept apart so it can stay private.
    pub admin_listen: SocketAddr,
    /// Larger request bodies are answered with 413.
    pub max_body_bytes: u64,
    /// A client must send its whole request head within this time, so
    /// slow-loris clients cannot hold connections open for free.
    pub header_read_timeout: Duration,
    /// Connections accepted at once; further clients wait in the backlog.
    pub max_connections: usize,
    /// How long in-flight requests may run after SIGTERM before we exit.
    pub shutdown_grace: Duration,
    /// `[server.tls]`: the traffic listener speaks only HTTPS. Its files
    /// are loaded by `boot` (at start and on SIGHUP).
    pub tls: Option<TlsConfig>,
    /// Threads serving the traffic listener, each with its own runtime and
    /// upstream pool, taking accepted connections in turn from one acceptor,
    /// so a request's client and upstream connections are driven by one
    /// thread without cross-thread wake-ups. Defaults to the number of CPUs.
    pub workers: usize,
    /// `[server] http2`: HTTP/2 on the traffic listener (ALPN `h2` on TLS,
    /// prior knowledge on plaintext), with its `h2_*` limits; `None`:
    /// HTTP/1.1 only.
    pub http2: Option<crate::http2::Settings>,
}

/// `[log]`: how the gateway logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// One line per request (method, path, route, status, resource key,
    /// token, outcome, duration), at info level, target `fencegate::access`.
    pub access: bool,
}

/// `[log] format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `[server.tls]` as written, with paths resolved against the config file's
/// directory.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// Client certificates are asked for (and verified against this CA)
    /// only when it is set.
    pub client_ca_file: Option<PathBuf>,
    pub client_auth: ClientAuth,
}

/// `[server.tls] client_auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// A client may present a certificate; one that does is verified.
    Optional,
    /// The handshake fails without a verified client certificate.
    Required,
}

/// `[store]`: the durable record of the highest token per key.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub url: String,
    pub backend: StoreBackend,
    pub mode: StoreMode,
    /// Connections in the store pool.
    pub pool_size: u32,
    /// Upper bound on one store operation, including waiting for a pooled
    /// connection: past it the request fails closed with 503.
    pub timeout: Duration,
    /// The `Retry-After` value sent with 503 answers.
    pub retry_after: Duration,
    /// `shared` mode: Postgres connections that run admissions (one batch
    /// at a time, and Idempotency-Key first uses one statement each).
    pub key_lock_connections: u32,
    /// Idle keys whose durable token is kept in memory (fast paths).
    pub cache_keys: usize,
    /// `shared` mode: how long a write may wait for older tokens' writes
    /// to the key, on any instance, to finish, before a 503.
    pub key_lock_wait: Duration,
    /// How often expired `Idempotency-Key` records are purged (every
    /// instance purges; see `idempotency::purge_forever`).
    pub idempotency_purge_interval: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// A SQLite file at this path.
    Sqlite(PathBuf),
    Postgres,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreMode {
    /// This instance is the only writer of the store (enforced at start-up).
    Single,
    /// Several instances share one Postgres store.
    Shared,
}

/// `[demo]`: a tiny in-process document store for trying the gateway out.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    pub listen: SocketAddr,
}

/// A compiled `[[routes]]` entry.
#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub path: String,
    pub pattern: PathPattern,
    pub key: KeyTemplate,
    pub upstream: Upstream,
    /// Methods that need a valid, current fencing token.
    pub fenced_methods: Vec<Method>,
    pub token: TokenKind,
    /// Whether fenced writes with an ambiguous path spelling are refused.
    pub paths: PathsMode,
    /// `Idempotency-Key` handling on fenced writes; `None` when `"off"`.
    pub idempotency: Option<IdempotencySettings>,
    /// Upper bound on one upstream exchange: until the response head for
    /// pass-through requests; the whole exchange, both bodies included, for
    /// fenced writes (see `exchange`).
    pub timeout: Duration,
    /// How the upstream is spoken to; HTTP/2 is what gRPC upstreams need.
    pub upstream_protocol: UpstreamProtocol,
    /// `upgrades = true`: the idle bound of the tunnels a pass-through GET
    /// with `Upgrade` (or an HTTP/2 extended CONNECT) opens; `None`: no
    /// request on the route upgrades.
    pub upgrades: Option<Duration>,
}

/// A route's `idempotency` settings, when it is not `"off"`.
#[derive(Debug, Clone, Copy)]
pub struct IdempotencySettings {
    /// `"required"`: a fenced write without the header is 400.
    pub required: bool,
    /// `idempotency_ttl_s`: how long a key is remembered.
    pub ttl: Duration,
    /// `idempotency_max_response_bytes`: larger answers are not stored.
    pub max_response_bytes: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenKind {
    /// A decimal number.
    Integer,
    /// A JWT signed by one of the `[tokens]` keys, whose `fence` claim is
    /// the number and whose `sub` must be the route's resource key.
    Jwt,
    /// A decimal number that this gateway's lock API has granted (a fence at
    /// least that high) for the lock named by the resource key.
    Issued,
}

/// `[[routes]] paths`: what to do with path spellings that back ends
/// resolve differently (see `routing::ambiguity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PathsMode {
    /// Refuse them on fenced writes (400 `ambiguous-path`).
    Strict,
    /// Forward them, fenced under the key their decoded captures make: only
    /// for upstreams known to treat `;`, `%2F`, `\\` and `//` as plain
    /// characters.
    AsIs,
}

/// `[[routes]] upstream_protocol`: how the gateway speaks to the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamProtocol {
    /// HTTP/1.1, a pool of connections (the default).
    Http1,
    /// HTTP/2 over TLS (ALPN `h2`): an `https://` upstream.
    H2,
    /// HTTP/2 by prior knowledge: an `http://` upstream.
    H2c,
}

/// One problem found while loading a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// Dotted key, e.g. `routes[1].key`; `-` when it concerns the whole file.
    pub key: String,
    pub why: String,
}

/// Every problem found in a config file.
#[derive(Debug, Clone)]
pub struct ConfigError {
    pub file: String,
    pub problems: Vec<ConfigProblem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}: {}: {}", self.file, p.key, p.why)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

// ---------------------------------------------------------------------------
/// `[locks] redis_url` when not set.
/// How often expired idempotency records are purged, by default.
pub(crate) const DEFAULT_PURGE_INTERVAL: Duration = Duration::from_secs(60);

pub(crate) const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// The longest `[locks] lock_delay_ms`: a delay is a safety margin for a
/// write in flight, not a way to keep a name locked.
pub(crate) const MAX_LOCK_DELAY_MS: u64 = 60_000;

/// `[store] key_lock_connections` when not set.
pub(crate) const DEFAULT_KEY_LOCK_CONNECTIONS: u64 = 32;
/// `[store] key_lock_wait_ms` when not set.
pub(crate) const DEFAULT_KEY_LOCK_WAIT_MS: u64 = 10_000;
/// The shortest `idempotency_purge_interval_ms`: a purge round is a few
/// statements, not something to run in a tight loop.
pub(crate) const MIN_PURGE_INTERVAL_MS: u64 = 100;

/// Hides a password in a database URL before it goes into a message.
pub fn redact_url(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        if let Some((userinfo, host)) = rest.split_once('@') {
            let user = userinfo.split(':').next().unwrap_or_default();
            return format!("{scheme}://{user}:***@{host}");
        }
    }
    url.to_string()
}
