//! Micro-benchmarks of the per-request hot paths that do not touch the
//! network: token parsing, JWT verification, key templating and the per-key
//! gate.
//!
//! `cargo bench --bench hot_paths`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use fencegate::fencing::jwt::{JwtKeys, KeySettings, TokensSettings};
use fencegate::fencing::routing::{KeyPartError, KeySource, KeyTemplate, PathPattern};

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/keys")
        .join(name)
}

fn token_parsing(c: &mut Criterion) {
    let mut g = c.benchmark_group("token");
    g.bench_function("parse 2 digits", |b| {
        b.iter(|| fencegate::fencing::token::parse_integer(black_box(b"34")))
    });
    g.bench_function("parse 19 digits", |b| {
        b.iter(|| fencegate::fencing::token::parse_integer(black_box(b"9223372036854775807")))
    });
    g.bench_function("reject malformed", |b| {
        b.iter(|| fencegate::fencing::token::parse_integer(black_box(b"12a4")))
    });
    g.finish();
}

/// What a request costs in routing before any I/O: its path matched, and
/// its key rendered from the captures (no query or header parts).
fn match_and_render(
    pattern: &PathPattern,
    key: &KeyTemplate,
    path: &str,
) -> Result<String, KeyPartError> {
    let caps = pattern.matches(black_box(path)).unwrap().unwrap();
    key.render(&KeySource {
        captures: &caps,
        query: None,
        headers: &http::HeaderMap::new(),
    })
}

fn key_templating(c: &mut Criterion) {
    let mut g = c.benchmark_group("routing");
    let simple = PathPattern::parse("/docs/{id}").unwrap();
    let simple_key = KeyTemplate::parse("doc:{id}", &simple).unwrap();
    let nested = PathPattern::parse("/t/{tenant}/docs/{id}/{*rest}").unwrap();
    let nested_key = KeyTemplate::parse("doc:{tenant}:{id}:{rest}", &nested).unwrap();
    g.bench_function("match + render /docs/{id}", |b| {
        b.iter(|| match_and_render(&simple, &simple_key, "/docs/report-2026"))
    });
    g.bench_function("match + render nested, percent-encoded", |b| {
        b.iter(|| match_and_render(&nested, &nested_key, "/t/acme/docs/%E2%9C%93-42/a/b/c.txt"))
    });
    g.bench_function("no match", |b| {
        b.iter(|| simple.matches(black_box("/other/x/y")).unwrap())
    });
    g.finish();
}

fn keys(
    alg: &str,
    private: Option<&str>,
    public: Option<&str>,
    secret_env: Option<&str>,
) -> JwtKeys {
    let settings = TokensSettings {
        issuer: "fencegate".into(),
        signing_kid: Some("k1".into()),
        leeway: Duration::from_secs(5),
        keys: vec![KeySettings {
            kid: "k1".into(),
            algorithm: alg.into(),
            private_key_file: private.map(fixture),
            public_key_file: public.map(fixture),
            secret_env: secret_env.map(str::to_string),
        }],
    };
    JwtKeys::load(&settings, &|_| {
        Some("0123456789abcdef0123456789abcdef-bench".into())
    })
    .unwrap_or_else(|e| panic!("{e:?}"))
}

fn jwt_verification(c: &mut Criterion) {
    let mut g = c.benchmark_group("jwt");
    let now = chrono::Utc::now().timestamp();
    for (name, k) in [
        (
            "EdDSA",
            keys("EdDSA", Some("ed25519.pem"), Some("ed25519.pub.pem"), None),
        ),
        (
            "ES256",
            keys("ES256", Some("p256.pem"), Some("p256.pub.pem"), None),
        ),
        ("HS256", keys("HS256", None, None, Some("BENCH_SECRET"))),
    ] {
        let token = k.sign("doc:report", 34, now, now + 3600).unwrap();
        g.bench_function(format!("verify {name}"), |b| {
            b.iter(|| k.verify(black_box(&token), "doc:report").unwrap())
        });
        // Flip one character well inside the signature.
        let mut forged = token.clone().into_bytes();
        let i = forged.len() - 10;
        forged[i] = if forged[i] == b'A' { b'B' } else { b'A' };
        let forged = String::from_utf8(forged).unwrap();
        g.bench_function(format!("reject bad signature {name}"), |b| {
            b.iter(|| k.verify(black_box(&forged), "doc:report").unwrap_err())
        });
    }
    g.finish();
}

/// Drives a gate future that does not wait (nothing else holds the key).
fn ready<T>(f: impl std::future::Future<Output = T>) -> T {
    let f = std::pin::pin!(f);
    match f.poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("the gate made an uncontended write wait"),
    }
}

fn gate(c: &mut Criterion) {
    use fencegate::fencing::gate::{Arrival, Gate};
    let mut g = c.benchmark_group("gate");
    let unsettled = Duration::from_secs(10);
    // One write's passes through the gate: arrive, (settle,) admit, release.
    let write = |gate: &std::sync::Arc<Gate>, key: &str, token: i64| match gate.arrive(key, token) {
        Ok(Arrival::Recorded(t)) => drop(ready(t.admit(token)).unwrap()),
        Ok(Arrival::Record(mut t)) => {
            t.settle(Some(token));
            drop(ready(t.admit(token)).unwrap())
        }
        Err(_) => panic!("stale"),
    };
    let cached = Gate::new(100_000, true, unsettled);
    write(&cached, "doc:hot", 7);
    g.bench_function("equal token, cached", |b| {
        b.iter(|| write(&cached, black_box("doc:hot"), 7))
    });
    let stale = Gate::new(100_000, true, unsettled);
    write(&stale, "doc:hot", 7);
    g.bench_function("stale token refused from memory", |b| {
        b.iter(|| stale.arrive(black_box("doc:hot"), 3).err().unwrap())
    });
    // Twice as many keys as the cache holds: every release past warm-up
    // has to make room.
    let full = Gate::new(100_000, true, unsettled);
    let keys: Vec<String> = (0..200_000).map(|i| format!("doc:{i}")).collect();
    let mut i = 0usize;
    g.bench_function("new key, cache full (200k keys over 100k)", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            write(&full, &keys[i], 1)
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    token_parsing,
    key_templating,
    jwt_verification,
    gate
);
criterion_main!(benches);
