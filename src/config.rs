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

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Method;
use serde::Deserialize;

use crate::fencing::routing::{KeyTemplate, PathPattern};
pub use crate::http1::client::Upstream;

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

/// `[[routes]] idempotency`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum IdempotencyPolicy {
    Off,
    Optional,
    Required,
}

/// `[[routes]] key_case`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum KeyCase {
    Preserve,
    /// The upstream resolves paths case-insensitively: keys are lower-cased
    /// and literal path segments match in any case.
    Lower,
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
// Raw, as-written structures. Everything has a default so that a missing key
// means "the default", and unknown keys are caught by `serde_ignored`.

/// One of a closed set of values, as written. An unknown value is kept
/// rather than failing the whole parse, so that it is reported together with
/// every other problem of the file.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Choice<T> {
    Known(T),
    Unknown(toml::Value),
}

/// `[locks] backend`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum LockBackendKind {
    Store,
    Redis,
    Redlock,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    auth: RawAuth,
    log: RawLog,
    server: RawServer,
    store: RawStore,
    locks: RawLocks,
    tokens: Option<RawTokens>,
    routes: Vec<RawRoute>,
    demo: Option<RawDemo>,
}

#[derive(Debug, Deserialize)]
#[serde(default)]
struct RawServer {
    listen: String,
    admin_listen: String,
    max_body_bytes: u64,
    header_read_timeout_ms: u64,
    max_connections: u64,
    shutdown_grace_ms: u64,
    workers: Option<u64>,
    tls: Option<RawTls>,
}

#[derive(Debug, Deserialize)]
#[serde(default)]
struct RawLog {
    format: Choice<LogFormat>,
    access: bool,
}

impl Default for RawLog {
    fn default() -> Self {
        Self {
            format: Choice::Known(LogFormat::Text),
            access: false,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawAuth {
    clients: Vec<RawAuthClient>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawAuthClient {
    name: String,
    api_key_sha256: Option<String>,
    tls_subject: Option<String>,
    locks: Vec<String>,
    admin: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawTls {
    cert_file: Option<String>,
    key_file: Option<String>,
    client_ca_file: Option<String>,
    client_auth: Option<Choice<ClientAuth>>,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            admin_listen: "127.0.0.1:9090".into(),
            max_body_bytes: 16 * 1024 * 1024,
            header_read_timeout_ms: 10_000,
            max_connections: 4096,
            shutdown_grace_ms: 30_000,
            workers: None,
            tls: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default)]
struct RawStore {
    url: String,
    mode: Choice<StoreMode>,
    pool_size: u64,
    timeout_ms: u64,
    retry_after_s: u64,
    key_lock_connections: Option<u64>,
    key_lock_wait_ms: Option<u64>,
    /// Deprecated names of `key_lock_connections` and `key_lock_wait_ms`.
    gate_pool_size: Option<u64>,
    gate_wait_ms: Option<u64>,
    cache_keys: u64,
    idempotency_purge_interval_ms: u64,
}

impl Default for RawStore {
    fn default() -> Self {
        Self {
            url: "sqlite://fencegate.db".into(),
            mode: Choice::Known(StoreMode::Single),
            pool_size: 16,
            timeout_ms: 2_000,
            retry_after_s: 1,
            key_lock_connections: None,
            key_lock_wait_ms: None,
            gate_pool_size: None,
            gate_wait_ms: None,
            cache_keys: 100_000,
            idempotency_purge_interval_ms: DEFAULT_PURGE_INTERVAL.as_millis() as u64,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default)]
struct RawLocks {
    enabled: bool,
    backend: Choice<LockBackendKind>,
    /// Optional so that setting it next to `redis_sentinels` can be told
    /// from the default.
    redis_url: Option<String>,
    redis_urls: Vec<String>,
    redis_sentinels: Option<Vec<String>>,
    redis_master_name: Option<String>,
    min_ttl_ms: u64,
    max_ttl_ms: u64,
    max_wait_ms: u64,
    redis_timeout_ms: Option<u64>,
    lock_delay_ms: u64,
}

impl Default for RawLocks {
    fn default() -> Self {
        Self {
            enabled: true,
            backend: Choice::Known(LockBackendKind::Store),
            redis_url: None,
            redis_urls: Vec::new(),
            redis_sentinels: None,
            redis_master_name: None,
            min_ttl_ms: 100,
            max_ttl_ms: 600_000,
            max_wait_ms: 60_000,
            redis_timeout_ms: None,
            lock_delay_ms: 0,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default)]
struct RawTokens {
    issuer: String,
    signing_kid: Option<String>,
    leeway_s: u64,
    keys: Vec<RawTokenKey>,
}

impl Default for RawTokens {
    fn default() -> Self {
        Self {
            issuer: crate::fencing::jwt::DEFAULT_ISSUER.into(),
            signing_kid: None,
            leeway_s: crate::fencing::jwt::DEFAULT_LEEWAY.as_secs(),
            keys: Vec::new(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawTokenKey {
    kid: String,
    algorithm: String,
    private_key_file: Option<String>,
    public_key_file: Option<String>,
    secret_env: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(default)]
struct RawRoute {
    name: Option<String>,
    path: Option<String>,
    upstream: Option<String>,
    key: Option<String>,
    methods: Vec<String>,
    token: Choice<TokenKind>,
    paths: Choice<PathsMode>,
    key_case: Choice<KeyCase>,
    upstream_ca_file: Option<String>,
    idempotency: Choice<IdempotencyPolicy>,
    idempotency_ttl_s: u64,
    idempotency_max_response_bytes: u64,
    timeout_ms: u64,
}

impl Default for RawRoute {
    fn default() -> Self {
        Self {
            name: None,
            path: None,
            upstream: None,
            key: None,
            methods: ["POST", "PUT", "PATCH", "DELETE"]
                .into_iter()
                .map(String::from)
                .collect(),
            token: Choice::Known(TokenKind::Integer),
            paths: Choice::Known(PathsMode::Strict),
            key_case: Choice::Known(KeyCase::Preserve),
            upstream_ca_file: None,
            idempotency: Choice::Known(IdempotencyPolicy::Off),
            idempotency_ttl_s: 86_400,
            idempotency_max_response_bytes: 1024 * 1024,
            timeout_ms: 30_000,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawDemo {
    listen: Option<String>,
}

// ---------------------------------------------------------------------------

impl Config {
    /// Whether the lock API is open to the network: enabled, with no
    /// `[[auth.clients]]`, on a traffic listener that is not a loopback
    /// address. Worth a warning at start-up and after every reload.
    pub fn lock_api_open_to_network(&self) -> bool {
        self.locks.enabled && !self.auth.enabled() && !self.server.listen.ip().is_loopback()
    }

    /// Loads a config file with overrides from the process environment.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        // `vars_os`, not `vars`: the latter panics on a variable that is not
        // UTF-8, and an unrelated variable must not crash the gateway.
        let env = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
        Self::load_with_env(path, env)
    }

    /// Loads a config file with overrides from the given variables.
    pub fn load_with_env(
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            problems: vec![ConfigProblem {
                key: "-".into(),
                why: format!("cannot read the file: {e}"),
            }],
        })?;
        Self::from_toml(&file, &text, env)
    }

    /// Parses and validates config text; `file` is used in messages.
    pub fn from_toml(
        file: &str,
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let fail = |problems| ConfigError {
            file: file.to_string(),
            problems,
        };
        let mut table: toml::Table = toml::from_str(text).map_err(|e| {
            fail(vec![ConfigProblem {
                key: "-".into(),
                why: format!("not valid TOML: {}", e.message()),
            }])
        })?;
        let env: Vec<(String, String)> = env.into_iter().collect();
        let overridden = apply_env_overrides(&mut table, env.iter().cloned()).map_err(fail)?;
        let describe = |key: String| match overridden.get(&key) {
            Some(var) => format!("{key} (from {var})"),
            None => key,
        };

        let mut unknown = Vec::new();
        let raw: Result<RawConfig, _> = serde_path_to_error::deserialize(
            serde_ignored::Deserializer::new(toml::Value::Table(table), &mut |p| {
                unknown.push(p.to_string())
            }),
        );
        let mut problems: Vec<ConfigProblem> = unknown
            .into_iter()
            .map(|k| ConfigProblem {
                key: describe(normalize_path(&k)),
                why: "unknown key".into(),
            })
            .collect();
        let raw = match raw {
            Ok(raw) => raw,
            Err(e) => {
                problems.push(ConfigProblem {
                    key: describe(normalize_path(&e.path().to_string())),
                    why: e.inner().to_string(),
                });
                return Err(fail(problems));
            }
        };
        let mut v = Validator {
            problems,
            deprecations: Vec::new(),
            describe: &describe,
        };
        let mut config = v.config(file, raw);
        if v.problems.is_empty() {
            config.deprecations = v.deprecations;
            Ok(config)
        } else {
            Err(fail(v.problems))
        }
    }
}

/// Turns serde's `routes.0.key` into `routes[0].key`.
fn normalize_path(p: &str) -> String {
    let mut out = String::new();
    for seg in p.split('.') {
        if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) {
            out.push('[');
            out.push_str(seg);
            out.push(']');
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(seg);
        }
    }
    out
}

/// Applies `FENCEGATE__A__B=value` as `a.b = value`; a numeric segment
/// indexes an array (`FENCEGATE__ROUTES__0__UPSTREAM`). Values are read as
/// TOML when they parse as a TOML value (`5`, `true`, `["a"]`, `"quoted"`),
/// else taken as a plain string. Returns which dotted keys came from where.
fn apply_env_overrides(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<BTreeMap<String, String>, Vec<ConfigProblem>> {
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect();
    vars.sort();
    let mut applied = BTreeMap::new();
    let mut problems = Vec::new();
    for (var, raw) in vars {
        let segments: Vec<String> = var[ENV_PREFIX.len()..]
            .split("__")
            .map(|s| s.to_ascii_lowercase())
            .collect();
        if segments.iter().any(|s| s.is_empty()) {
            problems.push(ConfigProblem {
                key: var.clone(),
                why: "malformed override variable name".into(),
            });
            continue;
        }
        let value = parse_env_value(&raw);
        let dotted = normalize_path(&segments.join("."));
        match set_path(table, &segments, value) {
            Ok(()) => {
                applied.insert(dotted, var);
            }
            Err(why) => problems.push(ConfigProblem {
                key: format!("{dotted} (from {var})"),
                why,
            }),
        }
    }
    if problems.is_empty() {
        Ok(applied)
    } else {
        Err(problems)
    }
}

fn parse_env_value(raw: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

fn set_path(
    table: &mut toml::Table,
    segments: &[String],
    value: toml::Value,
) -> Result<(), String> {
    let (first, rest) = segments.split_first().ok_or("empty key")?;
    if rest.is_empty() {
        table.insert(first.clone(), value);
        return Ok(());
    }
    let next_is_index = rest[0].bytes().all(|b| b.is_ascii_digit());
    let entry = table.entry(first.clone()).or_insert_with(|| {
        if next_is_index {
            toml::Value::Array(Vec::new())
        } else {
            toml::Value::Table(toml::Table::new())
        }
    });
    set_in_value(entry, rest, value)
}

fn set_in_value(
    node: &mut toml::Value,
    segments: &[String],
    value: toml::Value,
) -> Result<(), String> {
    match node {
        toml::Value::Table(t) => set_path(t, segments, value),
        toml::Value::Array(items) => {
            let (idx, rest) = segments.split_first().ok_or("empty key")?;
            let i: usize = idx
                .parse()
                .map_err(|_| format!("'{idx}' is not an index into an array"))?;
            if i > items.len() {
                return Err(format!(
                    "index {i} skips entries: the array has {} entries",
                    items.len()
                ));
            }
            if i == items.len() {
                items.push(toml::Value::Table(toml::Table::new()));
            }
            if rest.is_empty() {
                items[i] = value;
                Ok(())
            } else {
                set_in_value(&mut items[i], rest, value)
            }
        }
        _ => Err("overrides a key that is not a table".into()),
    }
}

/// `[locks] redis_url` when not set.
/// How often expired idempotency records are purged, by default.
const DEFAULT_PURGE_INTERVAL: Duration = Duration::from_secs(60);

const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// The longest `[locks] lock_delay_ms`: a delay is a safety margin for a
/// write in flight, not a way to keep a name locked.
const MAX_LOCK_DELAY_MS: u64 = 60_000;

/// `[store] key_lock_connections` when not set.
const DEFAULT_KEY_LOCK_CONNECTIONS: u64 = 32;
/// `[store] key_lock_wait_ms` when not set.
const DEFAULT_KEY_LOCK_WAIT_MS: u64 = 10_000;
/// The shortest `idempotency_purge_interval_ms`: a purge round is a few
/// statements, not something to run in a tight loop.
const MIN_PURGE_INTERVAL_MS: u64 = 100;

/// Collects problems while turning raw values into typed ones.
struct Validator<'a> {
    problems: Vec<ConfigProblem>,
    /// Deprecated keys in use, with what to write instead.
    deprecations: Vec<String>,
    describe: &'a dyn Fn(String) -> String,
}

impl Validator<'_> {
    fn problem(&mut self, key: impl Into<String>, why: impl Into<String>) {
        let key = (self.describe)(key.into());
        self.problems.push(ConfigProblem {
            key,
            why: why.into(),
        });
    }

    fn addr(&mut self, key: &str, raw: &str) -> SocketAddr {
        raw.parse().unwrap_or_else(|_| {
            self.problem(
                key,
                format!("'{raw}' is not a socket address like 127.0.0.1:8080"),
            );
            SocketAddr::from(([127, 0, 0, 1], 0))
        })
    }

    /// The chosen value, or `fallback` after reporting an unknown one;
    /// `what` names the setting and `allowed` lists its values.
    fn choice<T>(
        &mut self,
        key: &str,
        choice: Choice<T>,
        what: &str,
        allowed: &str,
        fallback: T,
    ) -> T {
        match choice {
            Choice::Known(v) => v,
            Choice::Unknown(other) => {
                let shown = match &other {
                    toml::Value::String(s) => s.clone(),
                    v => v.to_string(),
                };
                self.problem(key, format!("'{shown}' is not {what}; use {allowed}"));
                fallback
            }
        }
    }

    /// A setting that was renamed: the value under its new name, or under
    /// its old one (noted as deprecated); both at once is a problem.
    fn renamed<T>(
        &mut self,
        old: &str,
        old_value: Option<T>,
        new: &str,
        new_value: Option<T>,
    ) -> Option<T> {
        match (old_value, new_value) {
            (Some(_), Some(v)) => {
                self.problem(
                    old,
                    format!("is the old name of {new}, which is set too; remove it"),
                );
                Some(v)
            }
            (Some(v), None) => {
                let shown = (self.describe)(old.to_string());
                self.deprecations
                    .push(format!("{shown} is deprecated; rename it to {new}"));
                Some(v)
            }
            (None, v) => v,
        }
    }

    /// A setting that may be 0, up to `max`.
    fn at_most(&mut self, key: &str, value: u64, max: u64) -> u64 {
        if value > max {
            self.problem(key, format!("must be at most {max}, got {value}"));
        }
        value.min(max)
    }

    fn between(&mut self, key: &str, value: u64, min: u64, max: u64) -> u64 {
        if value < min || value > max {
            self.problem(key, format!("must be between {min} and {max}, got {value}"));
        }
        value.clamp(min, max)
    }

    fn positive(&mut self, key: &str, value: u64, max: u64) -> u64 {
        if value == 0 || value > max {
            self.problem(key, format!("must be between 1 and {max}, got {value}"));
        }
        value.clamp(1, max)
    }

    fn config(&mut self, file: &str, raw: RawConfig) -> Config {
        let server = self.server(file, raw.server);
        let store = self.store(raw.store);
        let locks = self.locks(raw.locks);
        let tokens = raw.tokens.and_then(|t| self.tokens(file, t));
        let routes = self.routes(file, raw.routes);
        let client_certs = server
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_some());
        let auth = self.auth(raw.auth, client_certs);
        let log = LogConfig {
            format: self.choice(
                "log.format",
                raw.log.format,
                "a log format",
                "\"text\" or \"json\"",
                LogFormat::Text,
            ),
            access: raw.log.access,
        };
        for (i, r) in routes.iter().enumerate() {
            if r.token == TokenKind::Issued && !locks.enabled {
                self.problem(
                    format!("routes[{i}].token"),
                    "\"issued\" checks tokens against the lock API's grants: it needs [locks] enabled = true",
                );
            }
        }
        if tokens.is_none() {
            for (i, r) in routes.iter().enumerate() {
                if r.token == TokenKind::Jwt {
                    self.problem(
                        format!("routes[{i}].token"),
                        "\"jwt\" needs a [tokens] section with at least one key",
                    );
                }
            }
        }
        let demo = raw.demo.and_then(|d| match d.listen {
            Some(l) => Some(DemoConfig {
                listen: self.addr("demo.listen", &l),
            }),
            None => {
                self.problem("demo.listen", "the [demo] section needs a listen address");
                None
            }
        });
        if server.listen == server.admin_listen && server.listen.port() != 0 {
            self.problem(
                "server.admin_listen",
                "must differ from server.listen: the admin API is served on its own listener",
            );
        }
        if let Some(d) = &demo {
            if d.listen.port() != 0
                && (d.listen == server.listen || d.listen == server.admin_listen)
            {
                self.problem("demo.listen", "must differ from the gateway's listeners");
            }
        }
        Config {
            source: file.to_string(),
            server,
            store,
            routes,
            locks,
            tokens,
            demo,
            auth,
            log,
            deprecations: Vec::new(),
        }
    }

    fn locks(&mut self, raw: RawLocks) -> LocksConfig {
        let kind = self.choice(
            "locks.backend",
            raw.backend,
            "a lock backend",
            "\"store\", \"redis\" or \"redlock\"",
            LockBackendKind::Store,
        );
        if !matches!(kind, LockBackendKind::Redis) {
            for (key, set) in [
                ("locks.redis_sentinels", raw.redis_sentinels.is_some()),
                ("locks.redis_master_name", raw.redis_master_name.is_some()),
            ] {
                if set {
                    self.problem(
                        key,
                        "Sentinel discovery is for backend = \"redis\"; Redlock's nodes are independent servers listed in locks.redis_urls",
                    );
                }
            }
        }
        let backend = match kind {
            LockBackendKind::Store => LockBackendConfig::Store,
            LockBackendKind::Redis => LockBackendConfig::Redis {
                target: self.redis_target(
                    raw.redis_url,
                    raw.redis_sentinels,
                    raw.redis_master_name,
                ),
            },
            LockBackendKind::Redlock => {
                if raw.redis_urls.len() < 3 {
                    self.problem(
                        "locks.redis_urls",
                        format!(
                            "Redlock needs at least 3 independent Redis nodes, {} given",
                            raw.redis_urls.len()
                        ),
                    );
                }
                for (i, u) in raw.redis_urls.iter().enumerate() {
                    if !u.starts_with("redis://") {
                        self.problem(
                            format!("locks.redis_urls[{i}]"),
                            format!("'{}' is not a redis:// URL", redact_url(u)),
                        );
                    }
                }
                let mut seen = HashSet::new();
                for u in &raw.redis_urls {
                    if !seen.insert(u) {
                        self.problem(
                            "locks.redis_urls",
                            format!(
                                "'{}' is listed twice; Redlock's nodes must be independent",
                                redact_url(u)
                            ),
                        );
                    }
                }
                LockBackendConfig::Redlock {
                    urls: raw.redis_urls,
                }
            }
        };
        let min = self.positive("locks.min_ttl_ms", raw.min_ttl_ms, 86_400_000);
        let max = self.positive("locks.max_ttl_ms", raw.max_ttl_ms, 86_400_000);
        if min > max {
            self.problem(
                "locks.min_ttl_ms",
                format!("{min} is above locks.max_ttl_ms ({max})"),
            );
        }
        let default_timeout = match backend {
            LockBackendConfig::Redlock { .. } => 50,
            _ => 1000,
        };
        let redis_timeout = self.positive(
            "locks.redis_timeout_ms",
            raw.redis_timeout_ms.unwrap_or(default_timeout),
            60_000,
        );
        LocksConfig {
            enabled: raw.enabled,
            backend,
            min_ttl: Duration::from_millis(min),
            max_ttl: Duration::from_millis(max),
            max_wait: Duration::from_millis(raw.max_wait_ms.min(3_600_000)),
            redis_timeout: Duration::from_millis(redis_timeout),
            lock_delay: Duration::from_millis(self.at_most(
                "locks.lock_delay_ms",
                raw.lock_delay_ms,
                MAX_LOCK_DELAY_MS,
            )),
        }
    }

    /// `backend = "redis"`: one URL, or Sentinel discovery. Both at once
    /// would leave it unclear which one the gateway talks to, so it is a
    /// problem rather than a precedence rule.
    fn redis_target(
        &mut self,
        url: Option<String>,
        sentinels: Option<Vec<String>>,
        master_name: Option<String>,
    ) -> RedisTarget {
        let (sentinels, master_name) = match (sentinels, master_name) {
            (None, None) => {
                let url = url.unwrap_or_else(|| DEFAULT_REDIS_URL.to_string());
                if !url.starts_with("redis://") {
                    self.problem(
                        "locks.redis_url",
                        format!("'{}' is not a redis:// URL", redact_url(&url)),
                    );
                }
                return RedisTarget::Url(url);
            }
            (Some(s), None) => {
                self.problem(
                    "locks.redis_master_name",
                    "missing: locks.redis_sentinels is set, and Sentinel needs the name of the master to find",
                );
                (s, None)
            }
            (None, Some(n)) => {
                self.problem(
                    "locks.redis_sentinels",
                    "missing: locks.redis_master_name is set, and needs the Sentinels to ask (redis://host:port URLs)",
                );
                (Vec::new(), Some(n))
            }
            (Some(s), Some(n)) => {
                if s.is_empty() {
                    self.problem(
                        "locks.redis_sentinels",
                        "is empty: list at least one Sentinel (redis://host:port)",
                    );
                }
                (s, Some(n))
            }
        };
        if let Some(url) = url {
            self.problem(
                "locks.redis_url",
                format!(
                    "'{}' is set together with locks.redis_sentinels: the master is found through Sentinel; remove one of them",
                    redact_url(&url)
                ),
            );
        }
        for (i, u) in sentinels.iter().enumerate() {
            if !u.starts_with("redis://") {
                self.problem(
                    format!("locks.redis_sentinels[{i}]"),
                    format!("'{}' is not a redis:// URL", redact_url(u)),
                );
            } else if redis::Client::open(u.as_str()).is_err() {
                self.problem(
                    format!("locks.redis_sentinels[{i}]"),
                    format!("'{}' is not a valid Redis URL", redact_url(u)),
                );
            }
        }
        let mut seen = HashSet::new();
        for u in &sentinels {
            if !seen.insert(u) {
                self.problem(
                    "locks.redis_sentinels",
                    format!("'{}' is listed twice", redact_url(u)),
                );
            }
        }
        let named = master_name.is_some();
        let master_name = master_name.unwrap_or_default();
        let name_ok = !master_name.is_empty()
            && !master_name
                .chars()
                .any(|c| c.is_whitespace() || c.is_control());
        if named && !name_ok {
            self.problem(
                "locks.redis_master_name",
                format!(
                    "'{}' is not a master name: it must be non-empty, without spaces or control characters",
                    master_name.escape_debug()
                ),
            );
        }
        RedisTarget::Sentinel {
            sentinels,
            master_name,
        }
    }

    fn tokens(
        &mut self,
        file: &str,
        raw: RawTokens,
    ) -> Option<crate::fencing::jwt::TokensSettings> {
        let base = config_dir(file);
        let resolve = |p: Option<String>| p.map(|p| relative_to(&base, &p));
        let settings = crate::fencing::jwt::TokensSettings {
            issuer: raw.issuer,
            signing_kid: raw.signing_kid,
            leeway: Duration::from_secs(raw.leeway_s.min(3600)),
            keys: raw
                .keys
                .into_iter()
                .map(|k| crate::fencing::jwt::KeySettings {
                    kid: k.kid,
                    algorithm: k.algorithm,
                    private_key_file: resolve(k.private_key_file),
                    public_key_file: resolve(k.public_key_file),
                    secret_env: k.secret_env,
                })
                .collect(),
        };
        if settings.keys.is_empty() {
            self.problem(
                "tokens.keys",
                "the [tokens] section needs at least one [[tokens.keys]] entry",
            );
            return None;
        }
        Some(settings)
    }

    fn server(&mut self, file: &str, raw: RawServer) -> ServerConfig {
        let tls = raw.tls.and_then(|t| self.tls(file, t));
        ServerConfig {
            tls,
            listen: self.addr("server.listen", &raw.listen),
            admin_listen: self.addr("server.admin_listen", &raw.admin_listen),
            max_body_bytes: self.positive("server.max_body_bytes", raw.max_body_bytes, 1 << 40),
            header_read_timeout: Duration::from_millis(self.positive(
                "server.header_read_timeout_ms",
                raw.header_read_timeout_ms,
                3_600_000,
            )),
            max_connections: self.positive("server.max_connections", raw.max_connections, 1_000_000)
                as usize,
            shutdown_grace: Duration::from_millis(self.positive(
                "server.shutdown_grace_ms",
                raw.shutdown_grace_ms,
                3_600_000,
            )),
            workers: match raw.workers {
                Some(n) => self.positive("server.workers", n, 1024) as usize,
                None => std::thread::available_parallelism().map_or(1, |n| n.get()),
            },
        }
    }

    fn auth(&mut self, raw: RawAuth, client_certs: bool) -> crate::auth::Clients {
        let mut names = HashSet::new();
        let mut clients = Vec::new();
        for (i, c) in raw.clients.into_iter().enumerate() {
            let at = |k: &str| format!("auth.clients[{i}].{k}");
            if c.name.trim().is_empty() {
                self.problem(at("name"), "missing: every client needs a name");
            } else if !names.insert(c.name.clone()) {
                self.problem(at("name"), format!("duplicate client name '{}'", c.name));
            }
            if c.tls_subject.is_some() && !client_certs {
                self.problem(
                    at("tls_subject"),
                    "needs [server.tls] client_ca_file: client certificates are only asked for then",
                );
            }
            if c.locks.is_empty() && !c.admin {
                self.problem(
                    at("locks"),
                    "lists no lock name and the client is no admin: it could do nothing",
                );
            }
            match crate::auth::Client::new(
                c.name,
                c.api_key_sha256.as_deref(),
                c.tls_subject,
                &c.locks,
                c.admin,
            ) {
                Ok(client) => clients.push(client),
                Err(why) => self.problem(at("api_key_sha256"), why),
            }
        }
        crate::auth::Clients::new(clients)
    }

    fn tls(&mut self, file: &str, raw: RawTls) -> Option<TlsConfig> {
        let base = config_dir(file);
        let cert = raw.cert_file.map(|p| relative_to(&base, &p));
        let key = raw.key_file.map(|p| relative_to(&base, &p));
        if cert.is_none() {
            self.problem(
                "server.tls.cert_file",
                "missing: [server.tls] needs a certificate chain (PEM)",
            );
        }
        if key.is_none() {
            self.problem(
                "server.tls.key_file",
                "missing: [server.tls] needs a private key (PEM)",
            );
        }
        let client_ca_file = raw.client_ca_file.map(|p| relative_to(&base, &p));
        let client_auth = match raw.client_auth {
            None => ClientAuth::Optional,
            Some(c) => {
                if client_ca_file.is_none() {
                    self.problem(
                        "server.tls.client_auth",
                        "needs server.tls.client_ca_file: client certificates are verified against it",
                    );
                }
                self.choice(
                    "server.tls.client_auth",
                    c,
                    "a client-certificate policy",
                    "\"optional\" or \"required\"",
                    ClientAuth::Optional,
                )
            }
        };
        Some(TlsConfig {
            cert_file: cert?,
            key_file: key?,
            client_ca_file,
            client_auth,
        })
    }

    fn store(&mut self, raw: RawStore) -> StoreConfig {
        let backend = if let Some(rest) = raw.url.strip_prefix("sqlite:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            let path = path.split('?').next().unwrap_or_default();
            if path.is_empty() || path == ":memory:" || path.starts_with(":memory:") {
                self.problem(
                    "store.url",
                    "an in-memory SQLite database is not durable; name a file, e.g. sqlite://fencegate.db",
                );
            }
            StoreBackend::Sqlite(PathBuf::from(path))
        } else if raw.url.starts_with("postgres://") || raw.url.starts_with("postgresql://") {
            StoreBackend::Postgres
        } else {
            self.problem(
                "store.url",
                format!(
                    "'{}' is neither a sqlite:// nor a postgres:// URL",
                    redact_url(&raw.url)
                ),
            );
            StoreBackend::Postgres
        };
        let mode = self.choice(
            "store.mode",
            raw.mode,
            "a mode",
            "\"single\" or \"shared\"",
            StoreMode::Single,
        );
        if mode == StoreMode::Shared && matches!(backend, StoreBackend::Sqlite(_)) {
            self.problem(
                "store.mode",
                "\"shared\" needs a Postgres store; a SQLite file serves one instance",
            );
        }
        let key_lock_connections = self
            .renamed(
                "store.gate_pool_size",
                raw.gate_pool_size,
                "store.key_lock_connections",
                raw.key_lock_connections,
            )
            .unwrap_or(DEFAULT_KEY_LOCK_CONNECTIONS);
        let key_lock_wait_ms = self
            .renamed(
                "store.gate_wait_ms",
                raw.gate_wait_ms,
                "store.key_lock_wait_ms",
                raw.key_lock_wait_ms,
            )
            .unwrap_or(DEFAULT_KEY_LOCK_WAIT_MS);
        StoreConfig {
            url: raw.url,
            backend,
            mode,
            pool_size: self.positive("store.pool_size", raw.pool_size, 1000) as u32,
            timeout: Duration::from_millis(self.positive(
                "store.timeout_ms",
                raw.timeout_ms,
                60_000,
            )),
            retry_after: Duration::from_secs(self.positive(
                "store.retry_after_s",
                raw.retry_after_s,
                3600,
            )),
            key_lock_connections: self.positive(
                "store.key_lock_connections",
                key_lock_connections,
                10_000,
            ) as u32,
            cache_keys: raw.cache_keys.min(100_000_000) as usize,
            key_lock_wait: Duration::from_millis(self.positive(
                "store.key_lock_wait_ms",
                key_lock_wait_ms,
                3_600_000,
            )),
            idempotency_purge_interval: Duration::from_millis(self.between(
                "store.idempotency_purge_interval_ms",
                raw.idempotency_purge_interval_ms,
                MIN_PURGE_INTERVAL_MS,
                86_400_000,
            )),
        }
    }

    fn routes(&mut self, file: &str, raw: Vec<RawRoute>) -> Vec<Route> {
        let base = config_dir(file);
        let mut names = HashSet::new();
        let mut routes = Vec::new();
        for (i, r) in raw.into_iter().enumerate() {
            let at = |k: &str| format!("routes[{i}].{k}");
            let name = match r.name {
                Some(n) if !n.trim().is_empty() => n,
                Some(_) => {
                    self.problem(at("name"), "must not be empty");
                    String::new()
                }
                None => {
                    self.problem(at("name"), "missing: every route needs a name");
                    String::new()
                }
            };
            if !name.is_empty() && !names.insert(name.clone()) {
                self.problem(at("name"), format!("duplicate route name '{name}'"));
            }
            let path = r.path.unwrap_or_default();
            let key_case = self.choice(
                &at("key_case"),
                r.key_case,
                "a key case",
                "\"preserve\" or \"lower\"",
                KeyCase::Preserve,
            );
            let paths = self.choice(
                &at("paths"),
                r.paths,
                "a path policy",
                "\"strict\" or \"as-is\"",
                PathsMode::Strict,
            );
            let pattern = if path.is_empty() {
                self.problem(at("path"), "missing: every route needs a path pattern");
                None
            } else if is_reserved(&path) {
                self.problem(
                    at("path"),
                    format!(
                        "'{path}' is under {RESERVED_PREFIX}/, which is reserved for the gateway"
                    ),
                );
                None
            } else {
                match PathPattern::parse(&path) {
                    Ok(p) if key_case == KeyCase::Lower => Some(p.ignoring_case()),
                    Ok(p) => Some(p),
                    Err(why) => {
                        self.problem(at("path"), format!("'{path}' {why}"));
                        None
                    }
                }
            };
            let key = match (&r.key, &pattern) {
                (None, _) => {
                    self.problem(
                        at("key"),
                        "missing: every route needs a resource key template",
                    );
                    None
                }
                (Some(k), Some(p)) => match KeyTemplate::parse(k, p) {
                    Ok(t) if key_case == KeyCase::Lower => Some(t.lower_cased()),
                    Ok(t) => Some(t),
                    Err(why) => {
                        self.problem(at("key"), format!("'{k}' {why}"));
                        None
                    }
                },
                (Some(_), None) => None,
            };
            let ca = r.upstream_ca_file.map(|p| relative_to(&base, &p));
            let upstream = match r.upstream.as_deref() {
                None => {
                    self.problem(at("upstream"), "missing: every route needs an upstream URL");
                    None
                }
                Some(u) => match Upstream::parse(u, ca.as_deref()) {
                    Ok(up) => Some(up),
                    Err(why) => {
                        self.problem(at("upstream"), format!("'{u}' {why}"));
                        None
                    }
                },
            };
            let mut fenced = Vec::new();
            for m in &r.methods {
                match Method::from_bytes(m.as_bytes()) {
                    Ok(method) if m.bytes().all(|b| b.is_ascii_uppercase()) => {
                        if !fenced.contains(&method) {
                            fenced.push(method)
                        }
                    }
                    _ => self.problem(
                        at("methods"),
                        format!("'{m}' is not an HTTP method in upper case, like \"PUT\""),
                    ),
                }
            }
            if r.methods.is_empty() {
                self.problem(at("methods"), "must list at least one fenced method");
            }
            let token = self.choice(
                &at("token"),
                r.token,
                "a token kind",
                "\"integer\", \"jwt\" or \"issued\"",
                TokenKind::Integer,
            );
            let timeout =
                Duration::from_millis(self.positive(&at("timeout_ms"), r.timeout_ms, 3_600_000));
            let policy = self.choice(
                &at("idempotency"),
                r.idempotency,
                "an idempotency policy",
                "\"off\", \"optional\" or \"required\"",
                IdempotencyPolicy::Off,
            );
            // A key is remembered for at most 30 days; an answer stored is
            // at most 64 MiB.
            let ttl_s = self.positive(&at("idempotency_ttl_s"), r.idempotency_ttl_s, 30 * 86_400);
            let max_answer = self.positive(
                &at("idempotency_max_response_bytes"),
                r.idempotency_max_response_bytes,
                64 * 1024 * 1024,
            );
            let idempotency = (policy != IdempotencyPolicy::Off).then(|| IdempotencySettings {
                required: policy == IdempotencyPolicy::Required,
                ttl: Duration::from_secs(ttl_s),
                max_response_bytes: max_answer as usize,
            });
            if let (Some(pattern), Some(key), Some(upstream)) = (pattern, key, upstream) {
                routes.push(Route {
                    name,
                    path,
                    pattern,
                    key,
                    upstream,
                    fenced_methods: fenced,
                    token,
                    paths,
                    idempotency,
                    timeout,
                });
            }
        }
        routes
    }
}

/// The directory files named in a config are relative to: the config
/// file's own.
fn config_dir(file: &str) -> PathBuf {
    Path::new(file)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn relative_to(base: &Path, p: &str) -> PathBuf {
    let p = PathBuf::from(p);
    if p.is_absolute() {
        p
    } else {
        base.join(p)
    }
}

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

/// Every key a config file can set, as dotted paths with `[]` after an
/// array of tables (`server.tls.cert_file`, `routes[].timeout_ms`,
/// `tokens.keys[].kid`), read from the structs the loader deserializes, so
/// that the documentation can be checked against what the loader accepts
/// rather than against a list kept by hand: a field added to any of them,
/// at any depth, is listed here without a change to this function.
pub fn accepted_keys() -> Result<Vec<String>, String> {
    use serde::de::{self, IntoDeserializer, Visitor};
    use std::cell::RefCell;

    // Walks the structs the way serde offers them to a deserializer: a
    // struct asks for its fields by name, an option is present, a sequence
    // has one element, and anything else is a key whose path is recorded.
    struct Probe<'a> {
        path: String,
        keys: &'a RefCell<Vec<String>>,
    }

    impl Probe<'_> {
        fn key(&self) {
            let path = self.path.strip_suffix("[]").unwrap_or(&self.path);
            self.keys.borrow_mut().push(path.to_string());
        }

        fn below(&self, name: &str) -> Self {
            let path = if self.path.is_empty() {
                name.to_string()
            } else {
                format!("{}.{name}", self.path)
            };
            Probe {
                path,
                keys: self.keys,
            }
        }
    }

    impl<'de> de::Deserializer<'de> for Probe<'_> {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            self.key();
            v.visit_str("")
        }

        fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            self.key();
            v.visit_bool(false)
        }

        fn deserialize_u64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            self.key();
            v.visit_u64(0)
        }

        fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            v.visit_some(self)
        }

        fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            let element = Probe {
                path: format!("{}[]", self.path),
                keys: self.keys,
            };
            v.visit_seq(de::value::SeqDeserializer::new(std::iter::once(element)))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            v: V,
        ) -> Result<V::Value, Self::Error> {
            let entries = fields.iter().map(|&f| (f, self.below(f)));
            v.visit_map(de::value::MapDeserializer::new(entries))
        }

        serde::forward_to_deserialize_any! {
            i8 i16 i32 i64 i128 u8 u16 u32 u128 f32 f64 char str string bytes
            byte_buf unit unit_struct newtype_struct tuple tuple_struct map enum
            identifier ignored_any
        }
    }

    impl<'de, 'a> IntoDeserializer<'de, de::value::Error> for Probe<'a> {
        type Deserializer = Probe<'a>;

        fn into_deserializer(self) -> Probe<'a> {
            self
        }
    }

    let keys = RefCell::new(Vec::new());
    let root = Probe {
        path: String::new(),
        keys: &keys,
    };
    RawConfig::deserialize(root).map_err(|e| e.to_string())?;
    let mut keys = keys.into_inner();
    keys.sort();
    keys.dedup();
    Ok(keys)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn load(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml("test.toml", text, Vec::new())
    }

    /// A minimal valid config: one route to `http://127.0.0.1:9000`.
    pub(crate) const GOOD: &str = r#"
        [server]
        listen = "127.0.0.1:8080"
        admin_listen = "127.0.0.1:9090"
        [store]
        url = "sqlite://x.db"
        [[routes]]
        name = "documents"
        path = "/docs/{id}"
        upstream = "http://127.0.0.1:9000"
        key = "doc:{id}"
    "#;

    #[test]
    fn good_config_loads() {
        let c = load(GOOD).unwrap();
        assert_eq!(c.routes.len(), 1);
        assert_eq!(c.routes[0].fenced_methods.len(), 4);
        assert_eq!(c.store.backend, StoreBackend::Sqlite("x.db".into()));
        assert_eq!(c.routes[0].timeout, Duration::from_secs(30));
    }

    #[test]
    fn lock_delay_is_bounded() {
        assert_eq!(load(GOOD).unwrap().locks.lock_delay, Duration::ZERO);
        let with = |ms: &str| {
            GOOD.replace(
                "[store]",
                &format!("[locks]\nlock_delay_ms = {ms}\n[store]"),
            )
        };
        let c = load(&with("60000")).unwrap();
        assert_eq!(c.locks.lock_delay, Duration::from_secs(60));
        let s = load(&with("60001")).unwrap_err().to_string();
        assert!(
            s.contains("locks.lock_delay_ms: must be at most 60000, got 60001"),
            "{s}"
        );
        let s = load(&with("-1")).unwrap_err().to_string();
        assert!(s.contains("lock_delay_ms"), "{s}");
    }

    fn with_locks(locks: &str) -> String {
        GOOD.replace("[store]", &format!("[locks]\n{locks}\n[store]"))
    }

    #[test]
    fn redis_url_or_sentinels() {
        let c = load(&with_locks("backend = \"redis\"")).unwrap();
        assert_eq!(
            c.locks.backend,
            LockBackendConfig::Redis {
                target: RedisTarget::Url("redis://127.0.0.1:6379".into())
            }
        );
        let c = load(&with_locks(
            "backend = \"redis\"\nredis_sentinels = [\"redis://10.0.0.1:26379\", \"redis://10.0.0.2:26379\"]\nredis_master_name = \"locks\"",
        ))
        .unwrap();
        assert_eq!(
            c.locks.backend,
            LockBackendConfig::Redis {
                target: RedisTarget::Sentinel {
                    sentinels: vec![
                        "redis://10.0.0.1:26379".into(),
                        "redis://10.0.0.2:26379".into()
                    ],
                    master_name: "locks".into(),
                }
            }
        );
    }

    #[test]
    fn sentinel_keys_are_checked() {
        let cases: &[(&str, &[&str])] = &[
            (
                "backend = \"redis\"\nredis_sentinels = [\"redis://h:26379\"]",
                &["test.toml: locks.redis_master_name: missing: locks.redis_sentinels is set"],
            ),
            (
                "backend = \"redis\"\nredis_master_name = \"m\"",
                &["test.toml: locks.redis_sentinels: missing: locks.redis_master_name is set"],
            ),
            (
                "backend = \"redis\"\nredis_sentinels = []\nredis_master_name = \"m\"",
                &["test.toml: locks.redis_sentinels: is empty"],
            ),
            (
                "backend = \"redis\"\nredis_url = \"redis://h:6379\"\nredis_sentinels = [\"redis://h:26379\"]\nredis_master_name = \"m\"",
                &["test.toml: locks.redis_url: 'redis://h:6379' is set together with locks.redis_sentinels"],
            ),
            (
                "backend = \"redis\"\nredis_sentinels = [\"http://h:26379\", \"redis://a:1\", \"redis://a:1\"]\nredis_master_name = \"my master\"",
                &[
                    "test.toml: locks.redis_sentinels[0]: 'http://h:26379' is not a redis:// URL",
                    "test.toml: locks.redis_sentinels: 'redis://a:1' is listed twice",
                    "test.toml: locks.redis_master_name: 'my master' is not a master name",
                ],
            ),
            (
                "backend = \"redlock\"\nredis_urls = [\"redis://a:1\", \"redis://b:1\", \"redis://c:1\"]\nredis_sentinels = [\"redis://h:26379\"]\nredis_master_name = \"m\"",
                &[
                    "test.toml: locks.redis_sentinels: Sentinel discovery is for backend = \"redis\"",
                    "test.toml: locks.redis_master_name: Sentinel discovery is for backend = \"redis\"",
                ],
            ),
            (
                "redis_master_name = \"m\"",
                &["test.toml: locks.redis_master_name: Sentinel discovery is for backend = \"redis\""],
            ),
        ];
        for (locks, needles) in cases {
            let s = load(&with_locks(locks)).unwrap_err().to_string();
            for needle in *needles {
                assert!(s.contains(needle), "missing {needle:?} in:\n{s}");
            }
            // One problem per needle: no echo of the same mistake.
            assert_eq!(s.lines().count(), needles.len(), "{s}");
        }
    }

    /// Closed choices are typed, yet an unknown value is reported together
    /// with every other problem rather than ending the parse.
    #[test]
    fn unknown_choices_are_reported_together() {
        let text = r#"
            [server]
            listen = "nowhere"
            [store]
            url = "sqlite://x.db"
            mode = "sometimes"
            [locks]
            backend = 7
            [[routes]]
            name = "a"
            path = "/a/{id}"
            upstream = "http://127.0.0.1:1"
            key = "a:{id}"
            token = "paper"
        "#;
        let s = load(text).unwrap_err().to_string();
        for needle in [
            "test.toml: server.listen: 'nowhere'",
            "test.toml: store.mode: 'sometimes' is not a mode; use \"single\" or \"shared\"",
            "test.toml: locks.backend: '7' is not a lock backend",
            "test.toml: routes[0].token: 'paper' is not a token kind",
        ] {
            assert!(s.contains(needle), "missing {needle:?} in:\n{s}");
        }
        let c = load(&GOOD.replace("[store]", "[store]\nmode = \"single\"")).unwrap();
        assert_eq!(c.store.mode, StoreMode::Single);
    }

    /// Renamed keys keep working under their old names, with a deprecation
    /// note; the old and the new name together are a problem.
    #[test]
    fn renamed_store_keys_have_deprecated_aliases() {
        let old = GOOD.replace("[store]", "[store]\ngate_wait_ms = 300\ngate_pool_size = 4");
        let c = load(&old).unwrap();
        assert_eq!(c.store.key_lock_wait, Duration::from_millis(300));
        assert_eq!(c.store.key_lock_connections, 4);
        assert_eq!(c.deprecations.len(), 2, "{:?}", c.deprecations);
        assert!(
            c.deprecations[0].contains("rename it to store."),
            "{:?}",
            c.deprecations
        );
        let new = GOOD.replace("[store]", "[store]\nkey_lock_wait_ms = 300");
        let c = load(&new).unwrap();
        assert_eq!(c.store.key_lock_wait, Duration::from_millis(300));
        assert!(c.deprecations.is_empty());
        let both = GOOD.replace(
            "[store]",
            "[store]\nkey_lock_wait_ms = 300\ngate_wait_ms = 200",
        );
        let s = load(&both).unwrap_err().to_string();
        assert!(
            s.contains("store.gate_wait_ms: is the old name of store.key_lock_wait_ms"),
            "{s}"
        );
    }

    #[test]
    fn every_problem_is_named() {
        let text = r#"
            [server]
            listen = "nowhere"
            lisen = "x"
            [[routes]]
            name = "a"
            path = "/_fencegate/x"
            upstream = "ftp://x"
            key = "k"
            timout_ms = 5
            [[routes]]
            name = "a"
            path = "/b/{id}"
            upstream = "http://127.0.0.1:1"
            key = "b:{nope}"
        "#;
        let err = load(text).unwrap_err();
        let s = err.to_string();
        for needle in [
            "test.toml: server.lisen: unknown key",
            "test.toml: routes[0].timout_ms: unknown key",
            "test.toml: server.listen: 'nowhere'",
            "test.toml: routes[0].path:",
            "test.toml: routes[0].upstream:",
            "test.toml: routes[1].name: duplicate route name 'a'",
            "test.toml: routes[1].key: 'b:{nope}' uses capture '{nope}'",
        ] {
            assert!(s.contains(needle), "missing {needle:?} in:\n{s}");
        }
    }

    #[test]
    fn env_overrides_apply_and_are_named() {
        let env = vec![
            (
                "FENCEGATE__STORE__URL".to_string(),
                "sqlite://other.db".to_string(),
            ),
            (
                "FENCEGATE__ROUTES__0__TIMEOUT_MS".to_string(),
                "250".to_string(),
            ),
            (
                "FENCEGATE__SERVER__MAX_BODY_BYTES".to_string(),
                "0".to_string(),
            ),
            ("UNRELATED".to_string(), "1".to_string()),
        ];
        let err = Config::from_toml("t.toml", GOOD, env.clone()).unwrap_err();
        assert!(err
            .to_string()
            .contains("server.max_body_bytes (from FENCEGATE__SERVER__MAX_BODY_BYTES)"));
        let c = Config::from_toml("t.toml", GOOD, env.into_iter().take(2)).unwrap();
        assert_eq!(c.store.backend, StoreBackend::Sqlite("other.db".into()));
        assert_eq!(c.routes[0].timeout, Duration::from_millis(250));
    }

    #[test]
    fn type_errors_name_the_key() {
        let err = load("[server]\nmax_body_bytes = \"big\"").unwrap_err();
        assert!(err.to_string().contains("server.max_body_bytes"), "{err}");
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://u:secret@h/db"),
            "postgres://u:***@h/db"
        );
    }
}
