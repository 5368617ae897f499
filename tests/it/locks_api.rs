//! The lock API over HTTP, on every backend: `store` on SQLite and on
//! Postgres, `redis` (a private redis-server) and `redlock` (three private
//! redis-servers); fences always durable in a SQLite store.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::app::{docs_route, problem, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::redis::PrivateRedis;
use crate::support::upstream::Upstream;

/// Which lock backend a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Locks {
    Sqlite,
    Postgres,
    Redis,
    Redlock,
}

impl Locks {
    fn label(self) -> &'static str {
        match self {
            Locks::Sqlite | Locks::Postgres => "store",
            Locks::Redis => "redis",
            Locks::Redlock => "redlock",
        }
    }
}

macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(super::Locks::Sqlite).await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(super::Locks::Postgres).await })*
        }
        mod redis {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(super::Locks::Redis).await })*
        }
        mod redlock {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(super::Locks::Redlock).await })*
        }
    };
}

on_every_backend!(
    grant_hold_renew_release,
    expiry_ends_the_lease,
    blocking_acquire_wakes_on_release_and_expiry,
    blocking_acquire_times_out,
    racing_acquirers_never_overlap,
    fences_start_above_recorded_tokens,
    expired_holder_is_fenced_off_end_to_end,
    bad_bodies_name_the_field,
    lock_delay_follows_expiry_only,
);

struct Setup {
    _store: TestStore,
    up: Upstream,
    app: Arc<TestApp>,
    redis: Vec<PrivateRedis>,
}

async fn setup(l: Locks) -> Setup {
    setup_with(l, "").await
}

/// `locks` goes into the `[locks]` section (after the backend's keys).
async fn setup_with(l: Locks, locks: &str) -> Setup {
    let store = TestStore::new(if l == Locks::Postgres {
        Backend::Postgres
    } else {
        Backend::Sqlite
    })
    .await;
    let nodes = match l {
        Locks::Redis => 1,
        Locks::Redlock => 3,
        _ => 0,
    };
    let redis = crate::support::redis::private_nodes(nodes).await;
    let up = Upstream::start().await;
    let mut extra = docs_route(&up.url());
    extra.push_str("[locks]\n");
    match l {
        Locks::Redis => extra.push_str(&format!(
            "backend = \"redis\"\nredis_url = \"{}\"\n",
            redis[0].url()
        )),
        Locks::Redlock => {
            let urls: Vec<String> = redis.iter().map(|r| format!("\"{}\"", r.url())).collect();
            // Above the 50 ms default: on a loaded two-core machine a node
            // can take that long, and these tests are about the API.
            extra.push_str(&format!(
                "backend = \"redlock\"\nredis_urls = [{}]\nredis_timeout_ms = 250\n",
                urls.join(", ")
            ));
        }
        _ => {}
    }
    extra.push_str(locks);
    let app = TestApp::spawn(&store.url, &extra).await;
    Setup {
        _store: store,
        up,
        app: Arc::new(app),
        redis,
    }
}

impl Setup {
    async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        self.app
            .http
            .post(self.app.url(&format!("/_fencegate/locks/{path}")))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn acquire(&self, name: &str, ttl_ms: u64, wait_ms: u64) -> reqwest::Response {
        self.post(name, json!({"ttl_ms": ttl_ms, "wait_ms": wait_ms}))
            .await
    }

    async fn status(&self, name: &str) -> Value {
        self.app.lock_status(name).await
    }
}

async fn granted(resp: reqwest::Response) -> Value {
    let status = resp.status();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 201, "{v}");
    v
}

async fn grant_hold_renew_release(l: Locks) {
    let s = setup(l).await;
    let g = granted(s.acquire("doc:a", 5000, 0).await).await;
    assert_eq!(g["name"], "doc:a");
    assert_eq!(g["fence"], 1);
    assert_eq!(
        g["token"], "1",
        "without signing keys the token is the decimal fence"
    );
    assert_eq!(g["ttl_ms"], 5000);
    assert!(g["expires_at"].is_string());
    let lease = g["lease"].as_str().unwrap().to_string();
    assert_eq!(lease.len(), 32, "128-bit lease id");
    assert!(lease.bytes().all(|c| c.is_ascii_hexdigit()));

    // Held by A: B is refused at once.
    let body = problem(s.acquire("doc:a", 5000, 0).await, 409).await;
    assert_eq!(body["name"], "doc:a");
    assert!(body["expires_in_ms"].as_u64().unwrap() > 0);

    // Status shows the holder's fence, never the lease.
    let st = s.status("doc:a").await;
    assert_eq!(st["held"], true);
    assert_eq!(st["fence"], 1);
    assert!(st["expires_in_ms"].as_u64().unwrap() <= 5000);
    assert!(
        !st.to_string().contains(&lease),
        "status leaks the lease id"
    );

    // Renew by the holder: same fence.
    let r = s
        .post("doc:a/renew", json!({"lease": lease, "ttl_ms": 8000}))
        .await;
    assert_eq!(r.status(), 200);
    let r: Value = r.json().await.unwrap();
    assert_eq!(r["fence"], 1);
    assert_eq!(r["lease"], lease.as_str());
    assert_eq!(r["ttl_ms"], 8000);

    // Somebody else's lease: 409 for renew and release.
    let other = "0".repeat(32);
    problem(
        s.post("doc:a/renew", json!({"lease": other, "ttl_ms": 1000}))
            .await,
        409,
    )
    .await;
    problem(s.post("doc:a/release", json!({"lease": other})).await, 409).await;

    // Release, then a second release is refused, and the next grant is higher.
    let r = s.post("doc:a/release", json!({"lease": lease})).await;
    assert_eq!(r.status(), 204);
    problem(s.post("doc:a/release", json!({"lease": lease})).await, 409).await;
    let st = s.status("doc:a").await;
    assert_eq!(st["held"], false);
    // The fence survives release. (Redlock burns a fence on every attempt,
    // including the refused one above, so it may show a higher one.)
    assert!(st["fence"].as_i64().unwrap() >= 1, "{st}");
    assert_eq!(st["expires_in_ms"], Value::Null);
    let g2 = granted(s.acquire("doc:a", 5000, 0).await).await;
    assert!(
        g2["fence"].as_i64().unwrap() > st["fence"].as_i64().unwrap().max(1),
        "{g2}"
    );
    // Never-used names.
    let st = s.status("never-used").await;
    assert_eq!(
        st,
        json!({"name": "never-used", "held": false, "fence": 0, "expires_in_ms": null})
    );
}

async fn expiry_ends_the_lease(l: Locks) {
    let s = setup(l).await;
    let g = granted(s.acquire("doc:e", 150, 0).await).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(s.status("doc:e").await["held"], false);
    // An expired lease is never silently revived.
    problem(
        s.post("doc:e/renew", json!({"lease": g["lease"], "ttl_ms": 5000}))
            .await,
        409,
    )
    .await;
    problem(
        s.post("doc:e/release", json!({"lease": g["lease"]})).await,
        409,
    )
    .await;
    let g2 = granted(s.acquire("doc:e", 5000, 0).await).await;
    assert!(
        g2["fence"].as_i64() > g["fence"].as_i64(),
        "the fence survives expiry"
    );
    let metrics = s.app.metrics().await;
    // The store tells expiry apart (renew and release both counted as
    // expired); Redis only knows the key is gone.
    let refusals: &[(&str, u32)] = if l.label() == "store" {
        &[("expired", 2)]
    } else {
        &[("renew_refused", 1), ("release_refused", 1)]
    };
    let mut lines = vec![format!(
        "fencegate_lock_events_total{{backend=\"{}\",event=\"grant\"}} 2",
        l.label()
    )];
    for (event, n) in refusals {
        lines.push(format!(
            "fencegate_lock_events_total{{backend=\"{}\",event=\"{event}\"}} {n}",
            l.label()
        ));
    }
    for line in lines {
        assert!(metrics.contains(&line), "missing {line} in\n{metrics}");
    }
}

async fn blocking_acquire_wakes_on_release_and_expiry(l: Locks) {
    let s = Arc::new(setup(l).await);
    // Release wakes the waiter.
    let a = granted(s.acquire("doc:w", 10_000, 0).await).await;
    let waiter = {
        let s = s.clone();
        tokio::spawn(async move { s.acquire("doc:w", 5000, 8000).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter must wait while A holds the lock"
    );
    let r = s.post("doc:w/release", json!({"lease": a["lease"]})).await;
    assert_eq!(r.status(), 204);
    let started = std::time::Instant::now();
    let b_grant = granted(waiter.await.unwrap()).await;
    assert!(b_grant["fence"].as_i64() > a["fence"].as_i64());
    // It was woken, not left to its deadline (8 s).
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "waiter was not woken by the release"
    );

    // Expiry wakes the waiter too (no event is sent for expiry).
    let first = granted(s.acquire("doc:x", 300, 0).await).await;
    let c = granted(s.acquire("doc:x", 5000, 8000).await).await;
    assert!(c["fence"].as_i64() > first["fence"].as_i64());
}

/// A wall-clock time from an answer (RFC 3339).
fn time(v: &Value) -> chrono::DateTime<chrono::Utc> {
    let text = v.as_str().unwrap_or_else(|| panic!("not a time: {v}"));
    chrono::DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("{text}: {e}"))
        .to_utc()
}

/// `lock_delay_ms`: after an expiry (measured from the last renewal) the
/// name is refused until expiry + delay, a late release does not end the
/// delay, status shows `delayed_until` only while it runs, a waiter gets the
/// name when it ends; after a release there is no delay.
async fn lock_delay_follows_expiry_only(l: Locks) {
    const DELAY_MS: i64 = 1000;
    let s = setup_with(l, &format!("lock_delay_ms = {DELAY_MS}\n")).await;
    let a = granted(s.acquire("doc:d", 300, 0).await).await;
    let r = s
        .post("doc:d/renew", json!({"lease": a["lease"], "ttl_ms": 300}))
        .await;
    assert_eq!(r.status(), 200);
    let renewed: Value = r.json().await.unwrap();
    let expires_at = time(&renewed["expires_at"]);

    // Expired: not held, and delayed from the renewed expiry.
    let mut st = s.status("doc:d").await;
    for _ in 0..100 {
        if st["held"] == false {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        st = s.status("doc:d").await;
    }
    assert_eq!(st["held"], false, "{st}");
    assert_eq!(st["expires_in_ms"], Value::Null, "{st}");
    let delayed_until = time(&st["delayed_until"]);
    let off = (delayed_until - expires_at).num_milliseconds() - DELAY_MS;
    assert!(off.abs() < 250, "delayed_until is {off} ms off: {st}");

    // Refused while the delay runs, with the time left as the hint.
    let refused = problem(s.acquire("doc:d", 5000, 0).await, 409).await;
    let left = refused["expires_in_ms"].as_u64().unwrap_or_default();
    assert!(left > 0 && left <= DELAY_MS as u64, "{refused}");
    // The expired holder's release is refused and does not end the delay.
    problem(
        s.post("doc:d/release", json!({"lease": a["lease"]})).await,
        409,
    )
    .await;
    problem(s.acquire("doc:d", 5000, 0).await, 409).await;

    // A waiter gets the name once the delay is over, not before.
    let b = granted(s.acquire("doc:d", 5000, 4000).await).await;
    let granted_at = chrono::Utc::now();
    assert!(
        (granted_at - delayed_until).num_milliseconds() > -100,
        "granted {} ms before the delay ended",
        (delayed_until - granted_at).num_milliseconds()
    );
    assert!(b["fence"].as_i64() > a["fence"].as_i64());
    let st = s.status("doc:d").await;
    assert_eq!(st["held"], true);
    assert!(st.get("delayed_until").is_none(), "{st}");

    // Released: no delay; the next acquire is granted at once.
    let r = s.post("doc:d/release", json!({"lease": b["lease"]})).await;
    assert_eq!(r.status(), 204);
    let st = s.status("doc:d").await;
    assert!(st.get("delayed_until").is_none(), "{st}");
    granted(s.acquire("doc:d", 5000, 0).await).await;
}

async fn blocking_acquire_times_out(l: Locks) {
    let s = setup(l).await;
    granted(s.acquire("doc:t", 10_000, 0).await).await;
    let started = std::time::Instant::now();
    problem(s.acquire("doc:t", 1000, 300).await, 409).await;
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "answered before its wait_ms"
    );
}

/// Ten clients loop: acquire (blocking), check nobody else holds it, hold
/// briefly, release. Fences must be unique and increase in grant order, and
/// two holders never overlap.
async fn racing_acquirers_never_overlap(l: Locks) {
    let s = Arc::new(setup(l).await);
    // One round of 20 simultaneous non-blocking tries: exactly one wins.
    let mut tries = Vec::new();
    for _ in 0..20 {
        let s = s.clone();
        tries.push(tokio::spawn(async move {
            s.acquire("doc:r0", 10_000, 0).await.status()
        }));
    }
    let mut wins = 0;
    for t in tries {
        match t.await.unwrap().as_u16() {
            201 => wins += 1,
            409 => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(wins, 1);

    let busy = Arc::new(AtomicBool::new(false));
    let fences = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (s, busy, fences) = (s.clone(), busy.clone(), fences.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                let g = granted(s.acquire("doc:r", 5000, 20_000).await).await;
                assert!(!busy.swap(true, Ordering::SeqCst), "two holders at once");
                fences.lock().unwrap().push(g["fence"].as_i64().unwrap());
                tokio::time::sleep(Duration::from_millis(3)).await;
                busy.store(false, Ordering::SeqCst);
                let r = s.post("doc:r/release", json!({"lease": g["lease"]})).await;
                assert_eq!(r.status(), 204);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let fences = fences.lock().unwrap().clone();
    assert_eq!(fences.len(), 40);
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences not increasing: {fences:?}"
    );
}

async fn fences_start_above_recorded_tokens(l: Locks) {
    let s = setup(l).await;
    assert_eq!(s.app.put("/docs/big", Some("500"), "x").await.status(), 200);
    let g = granted(s.acquire("doc:big", 5000, 0).await).await;
    assert_eq!(
        g["fence"], 501,
        "a grant's fence is above the highest recorded token"
    );
    // And the grant's token works at once.
    assert_eq!(
        s.app
            .put("/docs/big", Some(g["token"].as_str().unwrap()), "y")
            .await
            .status(),
        200
    );
}

/// The classic scenario: A's lease expires while it is paused, B acquires
/// and writes, A's late write is refused.
async fn expired_holder_is_fenced_off_end_to_end(l: Locks) {
    let s = setup(l).await;
    let a = granted(s.acquire("doc:report", 200, 0).await).await;
    tokio::time::sleep(Duration::from_millis(400)).await; // A's GC pause
    let bg = granted(s.acquire("doc:report", 5000, 0).await).await;
    assert!(bg["fence"].as_i64() > a["fence"].as_i64());
    let r = s
        .app
        .put("/docs/report", Some(bg["token"].as_str().unwrap()), "by B")
        .await;
    assert_eq!(r.status(), 200);
    let body = problem(
        s.app
            .put("/docs/report", Some(a["token"].as_str().unwrap()), "by A")
            .await,
        409,
    )
    .await;
    assert_eq!(body["highest_token"], bg["fence"]);
    let applied = s.up.applied();
    assert_eq!(applied.len(), 1);
    assert_eq!(&applied[0].body[..], b"by B");
}

async fn bad_bodies_name_the_field(l: Locks) {
    let s = setup(l).await;
    let raw = |path: &'static str, body: &'static str| {
        let app = s.app.clone();
        async move {
            app.http
                .post(app.url(&format!("/_fencegate/locks/{path}")))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        }
    };
    for (path, body, field) in [
        ("n", "not json", "body"),
        ("n", "[1]", "body"),
        ("n", "{}", "ttl_ms"),
        ("n", r#"{"ttl_ms": "5000"}"#, "ttl_ms"),
        ("n", r#"{"ttl_ms": -1}"#, "ttl_ms"),
        ("n", r#"{"ttl_ms": 1.5}"#, "ttl_ms"),
        ("n", r#"{"ttl_ms": 50}"#, "ttl_ms"),
        ("n", r#"{"ttl_ms": 600001}"#, "ttl_ms"),
        ("n", r#"{"ttl_ms": 1000, "wait_ms": "x"}"#, "wait_ms"),
        ("n", r#"{"ttl_ms": 1000, "wait_ms": 99999999}"#, "wait_ms"),
        ("n", r#"{"ttl": 1000}"#, "body"),
        ("n/renew", r#"{"ttl_ms": 1000}"#, "lease"),
        ("n/renew", r#"{"lease": 5, "ttl_ms": 1000}"#, "lease"),
        ("n/renew", r#"{"lease": "abc"}"#, "ttl_ms"),
        ("n/release", "{}", "lease"),
        ("n/release", r#"{"lease": ""}"#, "lease"),
    ] {
        let v = problem(raw(path, body).await, 400).await;
        assert_eq!(v["field"], field, "{path} {body}: {v}");
    }
    // Larger than any lock request: refused without reading it all.
    let big = "x".repeat(64 * 1024);
    let r = s
        .app
        .http
        .post(s.app.url("/_fencegate/locks/n"))
        .body(big)
        .send()
        .await
        .unwrap();
    problem(r, 413).await;
    // Wrong method on a lock path, unknown gateway path.
    let r = s
        .app
        .http
        .delete(s.app.url("/_fencegate/locks/n"))
        .send()
        .await
        .unwrap();
    problem(r, 405).await;
    problem(
        s.app
            .http
            .get(s.app.url("/_fencegate/nope"))
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
}

/// Redis down: every lock call answers 503 promptly, /readyz says so, and
/// nothing is granted; when Redis is back, grants resume with a higher fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_503_and_recovers() {
    let mut s = setup(Locks::Redis).await;
    let g = granted(s.acquire("doc:d", 5000, 0).await).await;
    let mut node = s.redis.pop().unwrap();
    let node = tokio::task::spawn_blocking(move || {
        node.stop();
        node
    })
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let r = s.acquire("doc:d2", 5000, 0).await;
    assert_eq!(
        r.headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string()),
        Some("1".into())
    );
    problem(r, 503).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "503 must come promptly"
    );
    problem(
        s.post("doc:d/renew", json!({"lease": g["lease"], "ttl_ms": 5000}))
            .await,
        503,
    )
    .await;
    let ready = s.app.admin_get("/readyz").await;
    assert_eq!(ready.status(), 503);
    // Redis comes back empty (it keeps nothing on disk): the fence still grows.
    let mut node = node;
    let node = tokio::task::spawn_blocking(move || {
        node.start_again();
        node
    })
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let g2 = loop {
        let r = s.acquire("doc:d", 5000, 0).await;
        if r.status() == 201 {
            break r.json::<Value>().await.unwrap();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no recovery after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        g2["fence"].as_i64() > g["fence"].as_i64(),
        "fence went backwards: {g} then {g2}"
    );
    drop(node);
}
