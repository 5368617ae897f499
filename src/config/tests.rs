//! The loader's own tests; `GOOD` is a sample config other tests build on.

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
