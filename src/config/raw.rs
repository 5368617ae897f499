//! The config as written: every section and key serde reads, each with
//! its default, before anything is checked.

use serde::Deserialize;

use super::*;

/// `[[routes]] idempotency`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum IdempotencyPolicy {
    Off,
    Optional,
    Required,
}

/// `[[routes]] key_case`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum KeyCase {
    Preserve,
    /// The upstream resolves paths case-insensitively: keys are lower-cased
    /// and literal path segments match in any case.
    Lower,
}

// Raw, as-written structures. Everything has a default so that a missing key
// means "the default", and unknown keys are caught by `serde_ignored`.

/// One of a closed set of values, as written. An unknown value is kept
/// rather than failing the whole parse, so that it is reported together with
/// every other problem of the file.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Choice<T> {
    Known(T),
    Unknown(toml::Value),
}

/// `[locks] backend`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum LockBackendKind {
    Store,
    Redis,
    Redlock,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawConfig {
    pub(super) auth: RawAuth,
    pub(super) log: RawLog,
    pub(super) server: RawServer,
    pub(super) store: RawStore,
    pub(super) locks: RawLocks,
    pub(super) tokens: Option<RawTokens>,
    pub(super) routes: Vec<RawRoute>,
    pub(super) demo: Option<RawDemo>,
}

#[derive(Debug, Deserialize)]
#[serde(default)]
pub(super) struct RawServer {
    pub(super) listen: String,
    pub(super) admin_listen: String,
    pub(super) max_body_bytes: u64,
    pub(super) header_read_timeout_ms: u64,
    pub(super) max_connections: u64,
    pub(super) shutdown_grace_ms: u64,
    pub(super) workers: Option<u64>,
    pub(super) tls: Option<RawTls>,
    pub(super) http2: bool,
    pub(super) h2_max_concurrent_streams: u64,
    pub(super) h2_max_header_list_bytes: u64,
}

#[derive(Debug, Deserialize)]
#[serde(default)]
pub(super) struct RawLog {
    pub(super) format: Choice<LogFormat>,
    pub(super) access: bool,
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
pub(super) struct RawAuth {
    pub(super) clients: Vec<RawAuthClient>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawAuthClient {
    pub(super) name: String,
    pub(super) api_key_sha256: Option<String>,
    pub(super) tls_subject: Option<String>,
    pub(super) locks: Vec<String>,
    pub(super) admin: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawTls {
    pub(super) cert_file: Option<String>,
    pub(super) key_file: Option<String>,
    pub(super) client_ca_file: Option<String>,
    pub(super) client_auth: Option<Choice<ClientAuth>>,
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
            http2: true,
            h2_max_concurrent_streams: 256,
            h2_max_header_list_bytes: crate::http1::codec::MAX_HEAD_BYTES as u64,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default)]
pub(super) struct RawStore {
    pub(super) url: String,
    pub(super) mode: Choice<StoreMode>,
    pub(super) pool_size: u64,
    pub(super) timeout_ms: u64,
    pub(super) retry_after_s: u64,
    pub(super) key_lock_connections: Option<u64>,
    pub(super) key_lock_wait_ms: Option<u64>,
    /// Deprecated names of `key_lock_connections` and `key_lock_wait_ms`.
    pub(super) gate_pool_size: Option<u64>,
    pub(super) gate_wait_ms: Option<u64>,
    pub(super) cache_keys: u64,
    pub(super) idempotency_purge_interval_ms: u64,
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
pub(super) struct RawLocks {
    pub(super) enabled: bool,
    pub(super) backend: Choice<LockBackendKind>,
    /// Optional so that setting it next to `redis_sentinels` can be told
    /// from the default.
    pub(super) redis_url: Option<String>,
    pub(super) redis_urls: Vec<String>,
    pub(super) redis_sentinels: Option<Vec<String>>,
    pub(super) redis_master_name: Option<String>,
    pub(super) min_ttl_ms: u64,
    pub(super) max_ttl_ms: u64,
    pub(super) max_wait_ms: u64,
    pub(super) redis_timeout_ms: Option<u64>,
    pub(super) lock_delay_ms: u64,
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
pub(super) struct RawTokens {
    pub(super) issuer: String,
    pub(super) signing_kid: Option<String>,
    pub(super) leeway_s: u64,
    pub(super) keys: Vec<RawTokenKey>,
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
pub(super) struct RawTokenKey {
    pub(super) kid: String,
    pub(super) algorithm: String,
    pub(super) private_key_file: Option<String>,
    pub(super) public_key_file: Option<String>,
    pub(super) secret_env: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(default)]
pub(super) struct RawRoute {
    pub(super) name: Option<String>,
    pub(super) path: Option<String>,
    pub(super) upstream: Option<String>,
    pub(super) key: Option<String>,
    pub(super) methods: Vec<String>,
    pub(super) token: Choice<TokenKind>,
    pub(super) paths: Choice<PathsMode>,
    pub(super) key_case: Choice<KeyCase>,
    pub(super) upstream_ca_file: Option<String>,
    pub(super) upstream_protocol: Choice<UpstreamProtocol>,
    pub(super) idempotency: Choice<IdempotencyPolicy>,
    pub(super) idempotency_ttl_s: u64,
    pub(super) idempotency_max_response_bytes: u64,
    pub(super) timeout_ms: u64,
    pub(super) upgrades: bool,
    pub(super) upgrade_idle_timeout_ms: u64,
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
            upstream_protocol: Choice::Known(UpstreamProtocol::Http1),
            idempotency: Choice::Known(IdempotencyPolicy::Off),
            idempotency_ttl_s: 86_400,
            idempotency_max_response_bytes: 1024 * 1024,
            timeout_ms: 30_000,
            upgrades: false,
            upgrade_idle_timeout_ms: 60_000,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawDemo {
    pub(super) listen: Option<String>,
}
