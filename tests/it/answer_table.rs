//! Every row of the contract's answer table, on both stores.

use std::time::Duration;

use crate::support::app::{docs_route, problem, route, TestApp};
use crate::support::db::{Backend, SqliteBlocker, TestStore};
use crate::support::fenced_put;
use crate::support::upstream::Upstream;

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test] async fn $name() { super::$name(super::Backend::Sqlite).await })*
        }
        mod postgres {
            $(#[tokio::test] async fn $name() { super::$name(super::Backend::Postgres).await })*
        }
    };
}

on_both_stores!(
    missing_token_is_428,
    malformed_tokens_are_400,
    stale_token_is_409_with_the_highest,
    equal_and_higher_tokens_are_forwarded,
    largest_token_is_accepted,
    safe_methods_pass_without_a_token,
    upstream_unreachable_is_502,
    upstream_timeout_is_504,
    admin_shows_fences,
    stale_zero_is_refused_once_its_key_left_the_cache,
);

async fn setup(b: Backend) -> (TestStore, Upstream, TestApp) {
    let store = TestStore::new(b).await;
    let upstream = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&upstream.url())).await;
    (store, upstream, app)
}

async fn missing_token_is_428(b: Backend) {
    let (_s, up, app) = setup(b).await;
    let body = problem(app.put("/docs/a", None, "x").await, 428).await;
    assert_eq!(body["resource_key"], "doc:a");
    for method in [
        reqwest::Method::POST,
        reqwest::Method::PATCH,
        reqwest::Method::DELETE,
    ] {
        let resp = app
            .http
            .request(method, app.url("/docs/a"))
            .send()
            .await
            .unwrap();
        problem(resp, 428).await;
    }
    assert!(up.requests().is_empty(), "nothing may be forwarded");
}

async fn malformed_tokens_are_400(b: Backend) {
    let (_s, up, app) = setup(b).await;
    for bad in [
        "",
        "-1",
        "+1",
        "1 2",
        "1.5",
        "0x10",
        "1e3",
        "abc",
        "9223372036854775808",
        "12345678901234567890",
        "1,2",
    ] {
        let resp = app.put("/docs/a", Some(bad), "x").await;
        let body = problem(resp, 400).await;
        assert!(
            body["detail"].as_str().unwrap().contains("X-Fence-Token"),
            "{bad:?}: {body}"
        );
    }
    // Two headers are ambiguous: refused.
    let resp = app
        .http
        .put(app.url("/docs/a"))
        .header("x-fence-token", "5")
        .header("x-fence-token", "6")
        .send()
        .await
        .unwrap();
    problem(resp, 400).await;
    assert!(up.requests().is_empty(), "nothing may be forwarded");
}

async fn stale_token_is_409_with_the_highest(b: Backend) {
    let (_s, up, app) = setup(b).await;
    assert_eq!(app.put("/docs/a", Some("34"), "B").await.status(), 200);
    let body = problem(app.put("/docs/a", Some("33"), "A late").await, 409).await;
    assert_eq!(body["resource_key"], "doc:a");
    assert_eq!(body["presented_token"], 33);
    assert_eq!(body["highest_token"], 34);
    // A refused write's body is never read, so the gateway closes that
    // connection after answering; the client's next request still works.
    let big = "x".repeat(256 * 1024);
    let resp = app.put("/docs/a", Some("33"), &big).await;
    assert_eq!(resp.headers()["connection"], "close");
    problem(resp, 409).await;
    // Other keys are independent.
    assert_eq!(app.put("/docs/b", Some("1"), "other").await.status(), 200);
    let applied = up.applied();
    assert_eq!(applied.len(), 2);
    assert_eq!(applied[0].token, Some(34));
    assert!(
        applied.iter().all(|a| a.body.len() < 1000),
        "the refused body was not forwarded"
    );
    assert_eq!(&applied[0].body[..], b"B");
}

async fn equal_and_higher_tokens_are_forwarded(b: Backend) {
    let (_s, up, app) = setup(b).await;
    for (t, body) in [
        ("7", "a"),
        ("7", "b"),
        ("0008", "c"),
        ("8", "d"),
        ("100", "e"),
    ] {
        let resp = app.put("/docs/a", Some(t), body).await;
        assert_eq!(resp.status(), 200, "token {t}");
        assert_eq!(
            resp.headers()["x-upstream"],
            "recorder",
            "upstream's answer is relayed"
        );
    }
    let tokens: Vec<_> = up.applied().iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(7), Some(7), Some(8), Some(8), Some(100)]);
    // The header reaches the upstream exactly as the client sent it.
    let sent: Vec<String> = up
        .requests()
        .iter()
        .map(|r| {
            r.headers
                .get("x-fence-token")
                .unwrap()
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(sent, ["7", "7", "0008", "8", "100"]);
}

async fn largest_token_is_accepted(b: Backend) {
    let (_s, _up, app) = setup(b).await;
    assert_eq!(
        app.put("/docs/a", Some("9223372036854775807"), "max")
            .await
            .status(),
        200
    );
    let body = problem(
        app.put("/docs/a", Some("9223372036854775806"), "x").await,
        409,
    )
    .await;
    assert_eq!(body["highest_token"], i64::MAX);
}

async fn safe_methods_pass_without_a_token(b: Backend) {
    let (_s, up, app) = setup(b).await;
    assert_eq!(app.put("/docs/a", Some("3"), "hello").await.status(), 200);
    let resp = app.http.get(app.url("/docs/a")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "hello");
    let resp = app.http.head(app.url("/docs/a")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    // A stale token on a read does not matter: reads are not fenced.
    let resp = app
        .http
        .get(app.url("/docs/a"))
        .header("x-fence-token", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // An unmatched path is 404 and never forwarded.
    let before = up.requests().len();
    problem(app.http.get(app.url("/other")).send().await.unwrap(), 404).await;
    problem(app.put("/other/x", Some("5"), "x").await, 404).await;
    problem(
        app.http
            .get(app.url("/_fencegate/anything"))
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
    assert_eq!(up.requests().len(), before);
}

async fn upstream_unreachable_is_502(b: Backend) {
    let store = TestStore::new(b).await;
    // A port nobody listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let app = TestApp::spawn(&store.url, &docs_route(&format!("http://{dead}"))).await;
    problem(app.put("/docs/a", Some("5"), "x").await, 502).await;
    problem(app.http.get(app.url("/docs/a")).send().await.unwrap(), 502).await;
    // The token was recorded before forwarding: it still counts.
    problem(app.put("/docs/a", Some("4"), "x").await, 409).await;
}

async fn upstream_timeout_is_504(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let mut routes = docs_route(&up.url());
    routes.push_str("timeout_ms = 200\n");
    let app = TestApp::spawn(&store.url, &routes).await;
    let resp = fenced_put(&app.http, app.url("/docs/a"), "5", "slow")
        .header("x-test-delay-ms", "2000")
        .send()
        .await
        .unwrap();
    let body = problem(resp, 504).await;
    assert!(body["detail"].as_str().unwrap().contains("200 ms"));
}

async fn admin_shows_fences(b: Backend) {
    let (_s, _up, app) = setup(b).await;
    let resp = app.admin_get("/fences/doc:a").await;
    problem(resp, 404).await;
    app.put("/docs/a", Some("12"), "x").await;
    let v: serde_json::Value = app.admin_get("/fences/doc:a").await.json().await.unwrap();
    assert_eq!(v["resource_key"], "doc:a");
    assert_eq!(v["highest_token"], 12);
    assert!(v["updated_at"].is_string());
    let ready = app.admin_get("/readyz").await;
    assert_eq!(ready.status(), 200);
    let health = app.admin_get("/healthz").await;
    assert_eq!(health.status(), 200);
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("fencegate_decisions_total{route=\"docs\",outcome=\"forwarded\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("fencegate_upstream_response_seconds_bucket"),
        "{metrics}"
    );
}

/// Several routes: the first match wins, keys come from the template, and a
/// route can fence only some methods.
#[tokio::test]
async fn first_matching_route_wins() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let mut routes = route("special", "/docs/special", &up.url(), "special");
    routes.push_str(&route(
        "tenant",
        "/t/{tenant}/docs/{id}",
        &up.url(),
        "doc:{tenant}:{id}",
    ));
    routes.push_str(&docs_route(&up.url()));
    routes.push_str(&route("files", "/files/{*path}", &up.url(), "file:{path}"));
    routes.push_str("methods = [\"PUT\"]\n");
    let app = TestApp::spawn(&store.url, &routes).await;
    assert_eq!(app.put("/docs/special", Some("5"), "x").await.status(), 200);
    // Same token on doc:special via the generic route would be a different
    // key; the special route took it.
    let v: serde_json::Value = app.admin_get("/fences/special").await.json().await.unwrap();
    assert_eq!(v["highest_token"], 5);
    assert_eq!(
        app.put("/t/acme/docs/1", Some("9"), "x").await.status(),
        200
    );
    problem(app.put("/t/acme/docs/1", Some("8"), "x").await, 409).await;
    // Percent-encoding does not make a new key.
    let body = problem(app.put("/t/%61cme/docs/%31", Some("8"), "x").await, 409).await;
    assert_eq!(body["resource_key"], "doc:acme:1");
    assert_eq!(
        app.put("/files/a/b/c.txt", Some("2"), "x").await.status(),
        200
    );
    problem(app.put("/files/a/b/c.txt", Some("1"), "x").await, 409).await;
    // POST is not fenced on /files and not a safe method: refused, not forwarded.
    let before = up.requests().len();
    let resp = app
        .http
        .post(app.url("/files/a"))
        .body("x")
        .send()
        .await
        .unwrap();
    problem(resp, 405).await;
    // Dot segments are refused (raw, since URL libraries resolve them).
    for path in ["/files/a/%2e%2e/b", "/files/a/../b", "/docs/."] {
        let head = crate::support::raw_request(
            app.addr,
            &format!(
                "PUT {path} HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 3\r\nContent-Length: 0\r\n\r\n"
            ),
        )
        .await;
        assert!(head.starts_with("HTTP/1.1 400"), "{path}: {head}");
    }
    assert_eq!(up.requests().len(), before);
}

/// 503 while the store cannot decide, nothing forwarded, and recovery
/// without a restart. SQLite flavour: another connection holds the database's
/// write lock.
#[tokio::test]
async fn sqlite_store_unavailable_is_503_then_recovers() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/a", Some("1"), "x").await.status(), 200);
    let blocker = SqliteBlocker::begin(&store.url, "EXCLUSIVE").await;
    let started = std::time::Instant::now();
    let resp = app.put("/docs/a", Some("2"), "x").await;
    let elapsed = started.elapsed();
    let body = problem(resp, 503).await;
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("nothing was forwarded"));
    assert!(
        elapsed < Duration::from_secs(10),
        "503 must come promptly, took {elapsed:?}"
    );
    assert_eq!(
        up.applied().len(),
        1,
        "nothing forwarded while the store is down"
    );
    blocker.release().await;
    let resp = app.put("/docs/a", Some("2"), "x").await;
    assert_eq!(resp.status(), 200, "recovers by itself");
}

/// What the gateway can decide from memory needs no store: a token below a
/// known durable one is stale, and (single mode) the current token is
/// already recorded. With the store locked, those still answer; a new token
/// fails closed.
#[tokio::test]
async fn memory_fast_paths_need_no_store() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/a", Some("5"), "first").await.status(), 200);
    let blocker = SqliteBlocker::begin(&store.url, "EXCLUSIVE").await;
    app.assert_stale("/docs/a", "4", "stale", 5).await;
    assert_eq!(app.put("/docs/a", Some("5"), "again").await.status(), 200);
    problem(app.put("/docs/a", Some("6"), "new").await, 503).await;
    blocker.release().await;
    let bodies: Vec<_> = up.applied().iter().map(|a| a.body.clone()).collect();
    assert_eq!(bodies, vec!["first", "again"]);
}

/// Token 0 is a valid token. A key whose durable token is not in the
/// in-memory cache (a restart, or an eviction) must not be taken as "known
/// to be 0": a stale 0 would then pass as the current token and be forwarded
/// without asking the store.
async fn stale_zero_is_refused_once_its_key_left_the_cache(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let text = format!("cache_keys = 1\n{}", docs_route(&up.url()));
    let app = TestApp::spawn(&store.url, &text).await;
    assert_eq!(app.put("/docs/a", Some("5"), "five").await.status(), 200);
    app.stop().await;
    // A new process: nothing cached.
    let app = TestApp::spawn(&store.url, &text).await;
    let body = problem(app.put("/docs/a", Some("0"), "stale").await, 409).await;
    assert_eq!(body["presented_token"], 0);
    assert_eq!(body["highest_token"], 5);
    // Evicted: with room for one idle key, 'b' goes as others come and go.
    assert_eq!(app.put("/docs/b", Some("3"), "three").await.status(), 200);
    for i in 0..40 {
        let path = format!("/docs/other{i}");
        assert_eq!(app.put(&path, Some("1"), "x").await.status(), 200);
    }
    problem(app.put("/docs/b", Some("0"), "stale").await, 409).await;
    // The first zero on a new key is current, and a second one equal to it.
    assert_eq!(app.put("/docs/z", Some("0"), "z").await.status(), 200);
    assert_eq!(app.put("/docs/z", Some("0"), "z2").await.status(), 200);
    for (path, token) in [("/docs/a", 5), ("/docs/b", 3)] {
        let applied = up.applied_on(path);
        assert!(
            applied.iter().all(|a| a.token == Some(token)),
            "a stale write reached the upstream: {applied:?}"
        );
    }
}
