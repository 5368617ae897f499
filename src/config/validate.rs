//! Raw config to validated plain data, every problem collected with the
//! key it concerns.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Method;

use super::raw::*;
use super::*;
use crate::fencing::routing::{KeyTemplate, PathPattern};

/// Collects problems while turning raw values into typed ones.
pub(super) struct Validator<'a> {
    pub(super) problems: Vec<ConfigProblem>,
    /// Deprecated keys in use, with what to write instead.
    pub(super) deprecations: Vec<String>,
    pub(super) describe: &'a dyn Fn(String) -> String,
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

    pub(super) fn config(&mut self, file: &str, raw: RawConfig) -> Config {
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
            http2: raw.http2.then(|| crate::http2::Settings {
                max_concurrent_streams: self.positive(
                    "server.h2_max_concurrent_streams",
                    raw.h2_max_concurrent_streams,
                    u32::MAX.into(),
                ) as u32,
                max_header_list_bytes: self.positive(
                    "server.h2_max_header_list_bytes",
                    raw.h2_max_header_list_bytes,
                    16 << 20,
                ) as u32,
            }),
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
            if let Some(route) = self.route(&base, i, r, &mut names) {
                routes.push(route);
            }
        }
        routes
    }

    /// `routes[i]`, when it has every part a route needs; its problems
    /// are collected either way.
    fn route(
        &mut self,
        base: &Path,
        i: usize,
        r: RawRoute,
        names: &mut HashSet<String>,
    ) -> Option<Route> {
        let at = |k: &str| format!("routes[{i}].{k}");
        let name = self.route_name(i, r.name, names);
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
        let pattern = self.route_pattern(i, &path, key_case);
        let key = self.route_key(i, r.key.as_deref(), pattern.as_ref(), key_case);
        let ca = r.upstream_ca_file.map(|p| relative_to(base, &p));
        let upstream = self.route_upstream(i, r.upstream.as_deref(), ca.as_deref());
        let upstream_protocol = self.route_protocol(i, r.upstream_protocol, upstream.as_ref());
        let fenced = self.route_methods(i, &r.methods);
        let token = self.choice(
            &at("token"),
            r.token,
            "a token kind",
            "\"integer\", \"jwt\" or \"issued\"",
            TokenKind::Integer,
        );
        let timeout =
            Duration::from_millis(self.positive(&at("timeout_ms"), r.timeout_ms, 3_600_000));
        let idempotency = self.route_idempotency(
            i,
            r.idempotency,
            r.idempotency_ttl_s,
            r.idempotency_max_response_bytes,
        );
        let upgrades = self.route_upgrades(
            i,
            (r.upgrades, r.upgrade_idle_timeout_ms),
            upstream_protocol,
            &fenced,
        );
        Some(Route {
            name,
            path,
            pattern: pattern?,
            key: key?,
            upstream: upstream?,
            fenced_methods: fenced,
            token,
            paths,
            idempotency,
            timeout,
            upstream_protocol,
            upgrades,
        })
    }

    /// `routes[i].upgrades` and its tunnels' idle bound. Tunnels are asked
    /// of the upstream over HTTP/1.1 (an `Upgrade` and its `101`), and only
    /// pass-through GETs upgrade: a route that fences GET would have none.
    fn route_upgrades(
        &mut self,
        i: usize,
        (upgrades, idle_ms): (bool, u64),
        protocol: UpstreamProtocol,
        fenced: &[Method],
    ) -> Option<Duration> {
        let at = |k: &str| format!("routes[{i}].{k}");
        let idle = Duration::from_millis(self.positive(
            &at("upgrade_idle_timeout_ms"),
            idle_ms,
            86_400_000,
        ));
        if !upgrades {
            return None;
        }
        if protocol != UpstreamProtocol::Http1 {
            self.problem(
                at("upgrades"),
                "tunnels reach the upstream over HTTP/1.1: set upstream_protocol = \"http1\" \
                 (a route of its own can carry the upgrades)",
            );
        }
        if fenced.contains(&Method::GET) {
            self.problem(
                at("upgrades"),
                "GET is a fenced method of this route, and fenced methods never upgrade",
            );
        }
        Some(idle)
    }

    /// `routes[i].upstream`: a URL (with `upstream_ca_file`, an https one).
    fn route_upstream(
        &mut self,
        i: usize,
        raw: Option<&str>,
        ca: Option<&Path>,
    ) -> Option<Upstream> {
        let at = format!("routes[{i}].upstream");
        match raw {
            None => {
                self.problem(at, "missing: every route needs an upstream URL");
                None
            }
            Some(u) => match Upstream::parse(u, ca) {
                Ok(up) => Some(up),
                Err(why) => {
                    self.problem(at, format!("'{u}' {why}"));
                    None
                }
            },
        }
    }

    /// `routes[i].upstream_protocol`: `"h2"` needs an `https://` upstream
    /// (ALPN), `"h2c"` an `http://` one (prior knowledge).
    fn route_protocol(
        &mut self,
        i: usize,
        raw: Choice<UpstreamProtocol>,
        upstream: Option<&Upstream>,
    ) -> UpstreamProtocol {
        let at = format!("routes[{i}].upstream_protocol");
        let protocol = self.choice(
            &at,
            raw,
            "an upstream protocol",
            "\"http1\", \"h2\" or \"h2c\"",
            UpstreamProtocol::Http1,
        );
        let https = upstream.map(|u| u.scheme == http::uri::Scheme::HTTPS);
        match (protocol, https) {
            (UpstreamProtocol::H2, Some(false)) => self.problem(
                at,
                "\"h2\" is HTTP/2 over TLS: the upstream must be https:// (use \"h2c\" for http://)",
            ),
            (UpstreamProtocol::H2c, Some(true)) => self.problem(
                at,
                "\"h2c\" is HTTP/2 in plain text: the upstream must be http:// (use \"h2\" for https://)",
            ),
            _ => {}
        }
        protocol
    }

    /// `routes[i].name`: present, not blank, unique.
    fn route_name(
        &mut self,
        i: usize,
        name: Option<String>,
        names: &mut HashSet<String>,
    ) -> String {
        let at = format!("routes[{i}].name");
        let name = match name {
            Some(n) if !n.trim().is_empty() => n,
            Some(_) => {
                self.problem(at.clone(), "must not be empty");
                String::new()
            }
            None => {
                self.problem(at.clone(), "missing: every route needs a name");
                String::new()
            }
        };
        if !name.is_empty() && !names.insert(name.clone()) {
            self.problem(at, format!("duplicate route name '{name}'"));
        }
        name
    }

    /// `routes[i].path`, outside the reserved prefix.
    fn route_pattern(&mut self, i: usize, path: &str, key_case: KeyCase) -> Option<PathPattern> {
        let at = format!("routes[{i}].path");
        if path.is_empty() {
            self.problem(at, "missing: every route needs a path pattern");
            return None;
        }
        if is_reserved(path) {
            self.problem(
                at,
                format!("'{path}' is under {RESERVED_PREFIX}/, which is reserved for the gateway"),
            );
            return None;
        }
        match PathPattern::parse(path) {
            Ok(p) if key_case == KeyCase::Lower => Some(p.ignoring_case()),
            Ok(p) => Some(p),
            Err(why) => {
                self.problem(at, format!("'{path}' {why}"));
                None
            }
        }
    }

    /// `routes[i].key`, a template over the route's pattern.
    fn route_key(
        &mut self,
        i: usize,
        key: Option<&str>,
        pattern: Option<&PathPattern>,
        key_case: KeyCase,
    ) -> Option<KeyTemplate> {
        let at = format!("routes[{i}].key");
        match (key, pattern) {
            (None, _) => {
                self.problem(at, "missing: every route needs a resource key template");
                None
            }
            (Some(k), Some(p)) => match KeyTemplate::parse(k, p) {
                Ok(t) if key_case == KeyCase::Lower => Some(t.lower_cased()),
                Ok(t) => Some(t),
                Err(why) => {
                    self.problem(at, format!("'{k}' {why}"));
                    None
                }
            },
            (Some(_), None) => None,
        }
    }

    /// `routes[i].methods`: the fenced methods, each once, in upper case.
    fn route_methods(&mut self, i: usize, methods: &[String]) -> Vec<Method> {
        let at = format!("routes[{i}].methods");
        let mut fenced = Vec::new();
        for m in methods {
            match Method::from_bytes(m.as_bytes()) {
                Ok(method) if m.bytes().all(|b| b.is_ascii_uppercase()) => {
                    if !fenced.contains(&method) {
                        fenced.push(method)
                    }
                }
                _ => self.problem(
                    at.clone(),
                    format!("'{m}' is not an HTTP method in upper case, like \"PUT\""),
                ),
            }
        }
        if methods.is_empty() {
            self.problem(at, "must list at least one fenced method");
        }
        fenced
    }

    /// `routes[i].idempotency` and its limits; `None` when it is off.
    fn route_idempotency(
        &mut self,
        i: usize,
        policy: Choice<IdempotencyPolicy>,
        ttl_s: u64,
        max_answer: u64,
    ) -> Option<IdempotencySettings> {
        let at = |k: &str| format!("routes[{i}].{k}");
        let policy = self.choice(
            &at("idempotency"),
            policy,
            "an idempotency policy",
            "\"off\", \"optional\" or \"required\"",
            IdempotencyPolicy::Off,
        );
        // A key is remembered for at most 30 days; an answer stored is
        // at most 64 MiB.
        let ttl_s = self.positive(&at("idempotency_ttl_s"), ttl_s, 30 * 86_400);
        let max_answer = self.positive(
            &at("idempotency_max_response_bytes"),
            max_answer,
            64 * 1024 * 1024,
        );
        (policy != IdempotencyPolicy::Off).then(|| IdempotencySettings {
            required: policy == IdempotencyPolicy::Required,
            ttl: Duration::from_secs(ttl_s),
            max_response_bytes: max_answer as usize,
        })
    }
}

/// The directory files named in a config are relative to: the config
/// file's own.
pub(super) fn config_dir(file: &str) -> PathBuf {
    Path::new(file)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

pub(super) fn relative_to(base: &Path, p: &str) -> PathBuf {
    let p = PathBuf::from(p);
    if p.is_absolute() {
        p
    } else {
        base.join(p)
    }
}
