//! The guarantee against hostile clients: an authenticated lock API, admin
//! actions only for admins, integer tokens that cannot be forged on
//! `issued` routes, poisoned keys recovered by a reset that reaches every
//! instance, exhausted fences answered as such, broken leases, listings.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::Digest;

use crate::support::app::{
    assert_detail_says, config_sections, docs_route, problem, route, TestApp, SHARED_STORE,
};
use crate::support::db::{Backend, TestStore};
use crate::support::redis::{require_shared_redis, PrivateRedis};
use crate::support::upstream::Upstream;

const MAX: &str = "9223372036854775807";

fn sha(key: &str) -> String {
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

/// Two clients: `billing` (billing locks and doc:4?) and `ops` (admin, any
/// lock).
pub(crate) fn auth_section() -> String {
    format!(
        "[[auth.clients]]\nname = \"billing\"\napi_key_sha256 = \"{}\"\nlocks = [\"billing:*\", \"doc:4?\"]\n\
         [[auth.clients]]\nname = \"ops\"\napi_key_sha256 = \"{}\"\nlocks = [\"*\"]\nadmin = true\n",
        sha("key-billing"),
        sha("key-ops")
    )
}

/// An open read of the admin listener, as JSON.
async fn read(app: &TestApp, path: &str) -> Value {
    let resp = call(app, "GET", path, None, None).await;
    resp.json().await.expect("a JSON answer")
}

/// An admin reset of `key`'s highest token to `to` by the client `ops`.
async fn ops_reset(app: &TestApp, key: &str, to: i64, reason: &str) -> reqwest::Response {
    let body = json!({"highest_token": to, "reason": reason});
    let path = format!("/fences/{key}/reset");
    call(app, "POST", &path, Some("key-ops"), Some(body)).await
}

/// Listing `listing` with a `limit` out of bounds (0, 5000), or with any
/// of `more` as its query, is 400.
async fn bad_queries_are_400(app: &TestApp, listing: &str, more: &[&str]) {
    for query in ["limit=0", "limit=5000"].iter().chain(more) {
        let path = format!("{listing}?{query}");
        problem(call(app, "GET", &path, None, None).await, 400).await;
    }
}

async fn call(
    app: &TestApp,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> reqwest::Response {
    let url = if path.starts_with("/_fencegate") {
        app.url(path)
    } else {
        app.admin_url(path)
    };
    let mut req = app.http.request(method.parse().unwrap(), url);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    req.send().await.expect("gateway answered")
}

async fn acquire(app: &TestApp, name: &str, key: Option<&str>) -> reqwest::Response {
    call(
        app,
        "POST",
        &format!("/_fencegate/locks/{name}"),
        key,
        Some(json!({"ttl_ms": 10000})),
    )
    .await
}

/// Every lock API call × no credential / unknown key / a client outside
/// its globs / the right client; and another client's lease.
#[tokio::test]
async fn the_lock_api_needs_a_known_client_within_its_globs() {
    let store = TestStore::new(Backend::Sqlite).await;
    let app = TestApp::spawn(&store.url, &auth_section()).await;
    let name = "billing:invoice-7";
    // Acquire.
    for (key, status) in [(None, 401), (Some("wrong"), 401)] {
        let resp = acquire(&app, name, key).await;
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        let body = problem(resp, status).await;
        assert_eq!(body["type"], "urn:fencegate:problem:unauthenticated");
    }
    let body = problem(acquire(&app, "ops:deploy", Some("key-billing")).await, 403).await;
    assert_eq!(body["type"], "urn:fencegate:problem:forbidden");
    let resp = acquire(&app, name, Some("key-billing")).await;
    assert_eq!(resp.status(), 201);
    let grant: Value = resp.json().await.unwrap();
    let lease = grant["lease"].as_str().unwrap().to_string();
    // Status.
    let status_path = format!("/_fencegate/locks/{name}");
    for (key, code) in [(None, 401), (Some("wrong"), 401)] {
        problem(call(&app, "GET", &status_path, key, None).await, code).await;
    }
    problem(
        call(
            &app,
            "GET",
            "/_fencegate/locks/doc:420",
            Some("key-billing"),
            None,
        )
        .await,
        403,
    )
    .await;
    let st = call(&app, "GET", &status_path, Some("key-billing"), None).await;
    assert_eq!(st.status(), 200);
    // Renew and release: credentials, globs, and the lease's owner.
    for action in ["renew", "release"] {
        let path = format!("/_fencegate/locks/{name}/{action}");
        let body = json!({"lease": lease, "ttl_ms": 10000});
        let body = if action == "release" {
            json!({"lease": lease})
        } else {
            body
        };
        for (key, code) in [(None, 401), (Some("wrong"), 401)] {
            problem(
                call(&app, "POST", &path, key, Some(body.clone())).await,
                code,
            )
            .await;
        }
        // ops may use any lock, but this lease is billing's: 403, right id
        // or not.
        let other = problem(
            call(&app, "POST", &path, Some("key-ops"), Some(body.clone())).await,
            403,
        )
        .await;
        assert_detail_says(&other, "not acquired by client 'ops'");
        // billing on a name outside its globs: 403 before any lease is
        // looked at.
        let outside = format!("/_fencegate/locks/ops:deploy/{action}");
        let refused = problem(
            call(
                &app,
                "POST",
                &outside,
                Some("key-billing"),
                Some(body.clone()),
            )
            .await,
            403,
        )
        .await;
        assert_eq!(refused["type"], "urn:fencegate:problem:forbidden");
    }
    let renewed = call(
        &app,
        "POST",
        &format!("/_fencegate/locks/{name}/renew"),
        Some("key-billing"),
        Some(json!({"lease": lease, "ttl_ms": 10000})),
    )
    .await;
    assert_eq!(renewed.status(), 200);
    let released = call(
        &app,
        "POST",
        &format!("/_fencegate/locks/{name}/release"),
        Some("key-billing"),
        Some(json!({"lease": lease})),
    )
    .await;
    assert_eq!(released.status(), 204);
    // Without any client configured, the API is open.
    let open = TestApp::spawn(&TestStore::new(Backend::Sqlite).await.url, "").await;
    assert_eq!(acquire(&open, "any:thing", None).await.status(), 201);
}

/// Admin actions need an admin client's bearer key: 401 without a known
/// key, 403 for a client that is no admin, 403 when no admin exists.
#[tokio::test]
async fn admin_actions_need_an_admin_key() {
    let store = TestStore::new(Backend::Sqlite).await;
    let app = TestApp::spawn(&store.url, &auth_section()).await;
    let reset = json!({"highest_token": 3, "reason": "test"});
    for (path, body) in [
        ("/fences/doc:1/reset", Some(reset.clone())),
        ("/locks/doc:1/break", None),
    ] {
        for (key, code) in [
            (None, 401),
            (Some("wrong"), 401),
            (Some("key-billing"), 403),
        ] {
            problem(call(&app, "POST", path, key, body.clone()).await, code).await;
        }
    }
    assert_eq!(ops_reset(&app, "doc:1", 3, "test").await.status(), 200);
    let no_admin = format!(
        "[[auth.clients]]\nname = \"billing\"\napi_key_sha256 = \"{}\"\nlocks = [\"*\"]\n",
        sha("key-billing")
    );
    let app = TestApp::spawn(&TestStore::new(Backend::Sqlite).await.url, &no_admin).await;
    let body = problem(
        call(
            &app,
            "POST",
            "/fences/doc:1/reset",
            Some("key-billing"),
            Some(reset),
        )
        .await,
        403,
    )
    .await;
    assert_detail_says(&body, "admin actions are disabled");
    // Reads stay open.
    assert_eq!(call(&app, "GET", "/fences", None, None).await.status(), 200);
}

/// Two `Authorization` headers are 400 `ambiguous-credentials`, whatever
/// they hold and wherever the gateway reads them: a lock API call (with
/// clients configured or open) and an admin action, each refused before
/// anything is done. Before, the first one was used: an admin key sent
/// with a billing key got 200.
#[tokio::test]
async fn two_authorization_headers_are_refused_by_the_lock_api_and_admin_actions() {
    let store = TestStore::new(Backend::Sqlite).await;
    let app = TestApp::spawn(&store.url, &auth_section()).await;
    let open = TestApp::spawn(&TestStore::new(Backend::Sqlite).await.url, "").await;
    assert_eq!(ops_reset(&app, "doc:1", 7, "set up").await.status(), 200);
    let ttl = json!({"ttl_ms": 10000});
    let reset = json!({"highest_token": 3, "reason": "test"});
    let calls = [
        (
            &app,
            "POST",
            app.url("/_fencegate/locks/billing:x"),
            Some(&ttl),
        ),
        (&app, "GET", app.url("/_fencegate/locks/billing:x"), None),
        (
            &open,
            "POST",
            open.url("/_fencegate/locks/any:thing"),
            Some(&ttl),
        ),
        (
            &app,
            "POST",
            app.admin_url("/fences/doc:1/reset"),
            Some(&reset),
        ),
        (&app, "POST", app.admin_url("/locks/doc:1/break"), None),
    ];
    for (on, method, url, body) in calls {
        // The admin key first or last.
        for (first, second) in [("key-ops", "key-billing"), ("key-billing", "key-ops")] {
            let mut req = on
                .http
                .request(method.parse().unwrap(), &url)
                .header("authorization", format!("Bearer {first}"))
                .header("authorization", format!("Bearer {second}"));
            if let Some(b) = body {
                req = req.json(b);
            }
            let body = problem(req.send().await.unwrap(), 400).await;
            assert_eq!(
                body["type"], "urn:fencegate:problem:ambiguous-credentials",
                "{method} {url}"
            );
        }
    }
    let locks = read(&app, "/locks").await;
    assert_eq!(locks["locks"], json!([]), "nothing was granted: {locks}");
    let fence = read(&app, "/fences/doc:1").await;
    assert_eq!(fence["highest_token"], 7, "no reset was done: {fence}");
    // One key still works.
    let one = acquire(&app, "billing:x", Some("key-billing")).await;
    assert_eq!(one.status(), 201);
}

/// `token = "issued"` on a name the lock API never granted: no token is
/// issued, 0 included, so 0 is 403 `unissued-token` (highest issued 0),
/// not recorded and not forwarded (before, 0 got 200). Once fence 1 was
/// granted, 0 and 1 pass. On both stores.
async fn issued_zero_needs_a_grant(backend: Backend) {
    let store = TestStore::new(backend).await;
    let up = Upstream::start().await;
    let routes = format!("{}token = \"issued\"\n", docs_route(&up.url()));
    let app = TestApp::spawn(&store.url, &routes).await;
    for _ in 0..2 {
        let body = problem(app.put("/docs/never", Some("0"), "forged").await, 403).await;
        assert_eq!(body["type"], "urn:fencegate:problem:unissued-token");
        assert_eq!(body["resource_key"], "doc:never");
        assert_eq!(body["presented_token"], 0);
        assert_eq!(body["highest_issued"], 0);
        assert_detail_says(&body, "never granted a fence");
    }
    assert!(up.requests().is_empty(), "nothing was forwarded");
    let fence = call(&app, "GET", "/fences/doc:never", None, None).await;
    assert_eq!(fence.status(), 404, "a refused token is not recorded");
    let grant: Value = acquire(&app, "doc:never", None).await.json().await.unwrap();
    assert_eq!(grant["fence"], 1);
    for token in ["0", "1", "1"] {
        assert_eq!(
            app.put("/docs/never", Some(token), token).await.status(),
            200
        );
    }
    problem(app.put("/docs/never", Some("2"), "early").await, 403).await;
    let tokens: Vec<_> = up.applied().iter().map(|a| a.token).collect();
    assert_eq!(tokens, [Some(0), Some(1), Some(1)]);
}

crate::support::per_store!(#[tokio::test] issued_zero_needs_a_grant =>
    issued_zero_needs_a_grant_sqlite, issued_zero_needs_a_grant_postgres);

/// On a `token = "issued"` route a forged integer is refused (403), never
/// recorded and never forwarded; a granted fence is accepted. On the table
/// backend of both stores, and on Redis and Redlock, whose grants the
/// store learns as their durable floor.
#[tokio::test]
async fn issued_routes_refuse_tokens_nobody_was_granted() {
    let redis = require_shared_redis();
    let nodes: Vec<PrivateRedis> = (0..3).map(|_| PrivateRedis::start()).collect();
    let urls: Vec<String> = nodes.iter().map(|n| format!("\"{}\"", n.url())).collect();
    for (backend, locks) in [
        (Backend::Sqlite, String::new()),
        (Backend::Postgres, String::new()),
        (
            Backend::Sqlite,
            format!("[locks]\nbackend = \"redis\"\nredis_url = \"{redis}\"\n"),
        ),
        (
            Backend::Postgres,
            format!(
                "[locks]\nbackend = \"redlock\"\nredis_urls = [{}]\n",
                urls.join(", ")
            ),
        ),
    ] {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let routes = format!("{}token = \"issued\"\n{locks}", docs_route(&up.url()));
        let app = TestApp::spawn(&store.url, &routes).await;
        // A name of its own: the shared Redis outlives every test.
        let id = format!("victim-{:016x}", rand::random::<u64>());
        let (path, lock) = (format!("/docs/{id}"), format!("doc:{id}"));
        let body = problem(app.put(&path, Some(MAX), "forged").await, 403).await;
        assert_eq!(body["type"], "urn:fencegate:problem:unissued-token");
        assert_eq!(body["highest_issued"], 0);
        assert_eq!(body["presented_token"], i64::MAX);
        let fence = call(&app, "GET", &format!("/fences/{lock}"), None, None).await;
        assert_eq!(fence.status(), 404, "a refused token is not recorded");
        let grant: Value = acquire(&app, &lock, None).await.json().await.unwrap();
        let fence = grant["fence"].as_i64().unwrap();
        assert_eq!(
            app.put(&path, Some(&fence.to_string()), "ok")
                .await
                .status(),
            200
        );
        let next = (fence + 1).to_string();
        problem(app.put(&path, Some(&next), "early").await, 403).await;
        // A second grant makes the next fence valid, also on a key whose
        // issued fence memory already knows.
        let release = call(
            &app,
            "POST",
            &format!("/_fencegate/locks/{lock}/release"),
            None,
            Some(json!({"lease": grant["lease"]})),
        )
        .await;
        assert_eq!(release.status(), 204);
        let again: Value = acquire(&app, &lock, None).await.json().await.unwrap();
        assert_eq!(again["fence"].as_i64(), Some(fence + 1));
        assert_eq!(app.put(&path, Some(&next), "again").await.status(), 200);
        let bodies: Vec<_> = up.applied().iter().map(|a| a.body.clone()).collect();
        assert_eq!(
            bodies,
            vec!["ok", "again"],
            "{backend:?} {locks}: only granted writes arrived"
        );
    }
}

/// A forged maximal token on an integer route disables the key: writes get
/// 409 and the lock answers 409 `fence-exhausted` (not 503). An admin reset
/// recovers it, and is shown and counted.
async fn poisoned_key_is_recovered_by_a_reset(locks: &str, backend: Backend) {
    let store = TestStore::new(backend).await;
    let up = Upstream::start().await;
    let extra = format!("{}{locks}{}", docs_route(&up.url()), auth_section());
    let app = TestApp::spawn(&store.url, &extra).await;
    assert_eq!(
        app.put("/docs/victim", Some(MAX), "forged").await.status(),
        200
    );
    problem(app.put("/docs/victim", Some("7"), "real").await, 409).await;
    let body = problem(acquire(&app, "doc:victim", Some("key-ops")).await, 409).await;
    assert_eq!(
        body["type"], "urn:fencegate:problem:fence-exhausted",
        "{locks}: {body}"
    );

    let resp = ops_reset(&app, "doc:victim", 5, "forged token from a test").await;
    assert_eq!(resp.status(), 200);
    let record: Value = resp.json().await.unwrap();
    assert_eq!(record["highest_token"], 5);
    assert_eq!(record["last_reset"]["by"], "ops");
    assert_eq!(record["last_reset"]["from"], i64::MAX);
    assert_eq!(record["last_reset"]["to"], 5);
    assert_eq!(record["last_reset"]["reason"], "forged token from a test");
    let shown: Value = read(&app, "/fences/doc:victim").await;
    assert_eq!(shown["last_reset"], record["last_reset"]);

    // Memory forgot the forged token at once: the lock grants again, above
    // the reset value, and its holder writes.
    let grant: Value = acquire(&app, "doc:victim", Some("key-ops"))
        .await
        .json()
        .await
        .unwrap();
    let fence = grant["fence"].as_i64().unwrap();
    assert!(
        fence > 5,
        "{locks}: the next grant is above the reset value: {grant}"
    );
    let token = fence.to_string();
    assert_eq!(
        app.put("/docs/victim", Some(&token), "recovered")
            .await
            .status(),
        200
    );
    problem(app.put("/docs/victim", Some("5"), "stale").await, 409).await;
    let bodies: Vec<_> = up.applied().iter().map(|a| a.body.clone()).collect();
    assert_eq!(bodies, vec!["forged", "recovered"]);
}

#[tokio::test]
async fn poisoned_key_on_the_store_backend_sqlite() {
    poisoned_key_is_recovered_by_a_reset("", Backend::Sqlite).await;
}

#[tokio::test]
async fn poisoned_key_on_the_store_backend_postgres() {
    poisoned_key_is_recovered_by_a_reset("", Backend::Postgres).await;
}

#[tokio::test]
async fn poisoned_key_on_the_redis_backend() {
    let url = require_shared_redis();
    let locks = format!("[locks]\nbackend = \"redis\"\nredis_url = \"{url}\"\n");
    poisoned_key_is_recovered_by_a_reset(&locks, Backend::Sqlite).await;
}

#[tokio::test]
async fn poisoned_key_on_the_redlock_backend() {
    let nodes: Vec<PrivateRedis> = (0..3).map(|_| PrivateRedis::start()).collect();
    let urls: Vec<String> = nodes.iter().map(|n| format!("\"{}\"", n.url())).collect();
    let locks = format!(
        "[locks]\nbackend = \"redlock\"\nredis_urls = [{}]\n",
        urls.join(", ")
    );
    poisoned_key_is_recovered_by_a_reset(&locks, Backend::Postgres).await;
}

/// Two shared-mode instances on one Postgres store, with the clients of
/// [`auth_section`].
async fn shared_pair(store: &TestStore, up: &Upstream) -> Vec<TestApp> {
    let mut apps = Vec::new();
    for _ in 0..2 {
        let rest = docs_route(&up.url()) + &auth_section();
        let text = config_sections("", &store.url, SHARED_STORE, &rest);
        apps.push(TestApp::from_text(&text).await);
    }
    apps
}

/// Waits until `app` accepts token 3 on `path`: the reset has reached its
/// memory. The promise is one second from the reset's answer.
async fn accepted_within_a_second(app: &TestApp, path: &str, since: Instant) {
    loop {
        let status = app.put(path, Some("3"), "after").await.status();
        if status == 200 {
            return;
        }
        assert!(
            since.elapsed() < Duration::from_secs(1),
            "the other instance still refuses 3 on {path} {:?} after the reset",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Shared mode: a reset through one instance reaches the other's memory
/// within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_every_shared_instance_within_a_second() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = shared_pair(&store, &up).await;
    assert_eq!(
        apps[0].put("/docs/x", Some(MAX), "forged").await.status(),
        200
    );
    // Instance 1 learns the forged token (and caches it).
    problem(apps[1].put("/docs/x", Some("3"), "a").await, 409).await;
    problem(apps[1].put("/docs/x", Some("3"), "b").await, 409).await;
    let reset = ops_reset(&apps[0], "doc:x", 2, "test").await;
    assert_eq!(reset.status(), 200);
    accepted_within_a_second(&apps[1], "/docs/x", Instant::now()).await;
    let bodies: Vec<_> = up.applied().iter().map(|a| a.body.clone()).collect();
    assert_eq!(bodies, vec!["forged", "after"]);
}

/// The upstream never had writes of two tokens of a key in flight at once.
/// The recorder also counts a lower token applied after a higher one as a
/// breach of monotonic tokens, which is what a reset is for: only the
/// first kind of breach is one here.
fn no_two_tokens_in_flight(up: &Upstream) {
    let beside: Vec<String> = up
        .violations()
        .into_iter()
        .filter(|v| v.contains("in flight"))
        .collect();
    assert_eq!(beside, Vec::<String>::new());
}

/// Shared mode: a reset to 2 while a write of the old (forged) token is
/// still at the upstream, then a write of `next` through the other
/// instance. It must not run beside the old write, and must go as soon as
/// that write has ended: the old write's leave still names the old token,
/// which the key no longer has, and must still count, or the key stays
/// closed until that write's marker runs out (the route's timeout and then
/// some: past `key_lock_wait_ms`, a 503).
async fn a_reset_during_a_write_of_the_old_token(next: &str) {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = shared_pair(&store, &up).await;
    let held = crate::support::fenced_put(&apps[0].http, apps[0].url("/docs/w"), MAX, "forged")
        .header("x-test-delay-ms", "1500")
        .send();
    let held = tokio::spawn(held);
    crate::support::wait_for("the forged write at the upstream", || up.in_flight() == 1).await;
    assert_eq!(ops_reset(&apps[0], "doc:w", 2, "test").await.status(), 200);
    let asked = Instant::now();
    let after = apps[1].put("/docs/w", Some(next), "after").await;
    assert_eq!(after.status(), 200, "token {next} after the reset");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "token {next} waited {:?}: the forged write's leave did not open the key",
        asked.elapsed()
    );
    assert_eq!(held.await.unwrap().unwrap().status(), 200);
    no_two_tokens_in_flight(&up);
    assert_eq!(up.bodies_on("/docs/w"), vec!["forged", "after"]);
}

/// A token above the reset value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_during_a_write_of_the_old_token_opens_the_key_when_it_ends() {
    a_reset_during_a_write_of_the_old_token("3").await;
}

/// The reset value itself: the key's token now, so it would be admitted at
/// once, beside the old write, if the reset had turned that write into one
/// of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_during_a_write_of_the_old_token_keeps_the_reset_value_behind_it() {
    a_reset_during_a_write_of_the_old_token("2").await;
}

/// A reset while the key drains: a write of 5 is at the upstream, a write
/// of 7 has raised the key over it and waits, and the key is reset to 6
/// between the two. The drain is kept: the write of 7, which asks again,
/// is admitted when the write of 5 has left, not beside it (as it would be
/// if the reset had opened the key), and not only when its marker ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_while_the_key_drains_keeps_the_drain() {
    use sqlx::Connection;
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = shared_pair(&store, &up).await;
    let old = crate::support::fenced_put(&apps[0].http, apps[0].url("/docs/w"), 5, "old")
        .header("x-test-delay-ms", "1500")
        .send();
    let old = tokio::spawn(old);
    crate::support::wait_for("the write of 5 at the upstream", || up.in_flight() == 1).await;
    let asked = Instant::now();
    let raised = crate::support::fenced_put(&apps[1].http, apps[1].url("/docs/w"), 7, "raised");
    let raised = tokio::spawn(raised.send());
    let mut db = sqlx::PgConnection::connect(&store.url).await.unwrap();
    loop {
        let draining: Option<i64> = sqlx::query_scalar(
            "SELECT draining_token FROM fences WHERE resource_key = 'doc:w' AND open_at > now()",
        )
        .fetch_optional(&mut db)
        .await
        .unwrap()
        .flatten();
        if draining == Some(5) {
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(5),
            "the key never drained"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(ops_reset(&apps[0], "doc:w", 6, "test").await.status(), 200);
    assert_eq!(old.await.unwrap().unwrap().status(), 200);
    assert_eq!(raised.await.unwrap().unwrap().status(), 200);
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "token 7 waited {:?}: the write of 5 did not open the key when it left",
        asked.elapsed()
    );
    no_two_tokens_in_flight(&up);
    assert_eq!(up.bodies_on("/docs/w"), vec!["old", "raised"]);
}

/// A reset over a write that will never leave: its instance crashed with
/// it at the upstream, and only its marker's end says it is over. The
/// reset keeps the crash bound: a write of the reset value waits for the
/// marker to end, as a raise over that write would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_over_a_crashed_write_waits_for_its_marker() {
    use crate::support::db::PgHolder;
    use sqlx::Connection;
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = shared_pair(&store, &up).await;
    assert_eq!(apps[0].put("/docs/w", Some("5"), "a").await.status(), 200);
    // The write of 5 leaves in a batch after its answer: a leave still on
    // its way would take back the crashed write's count planted below.
    let mut db = sqlx::PgConnection::connect(&store.url).await.unwrap();
    let waited = Instant::now();
    loop {
        let inflight: i64 =
            sqlx::query_scalar("SELECT inflight::bigint FROM fences WHERE resource_key = 'doc:w'")
                .fetch_one(&mut db)
                .await
                .unwrap();
        if inflight == 0 {
            break;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(5),
            "the write of 5 never left"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // What an instance that crashed during a write of 5 leaves behind.
    let marker_ends = Instant::now() + Duration::from_secs(2);
    PgHolder::begin(
        &store.url,
        "UPDATE fences SET inflight = 1, writer_until = clock_timestamp() + interval '2 seconds' \
         WHERE resource_key = 'doc:w'",
    )
    .await
    .commit()
    .await;
    assert_eq!(ops_reset(&apps[0], "doc:w", 3, "test").await.status(), 200);
    assert_eq!(apps[1].put("/docs/w", Some("3"), "b").await.status(), 200);
    let early = marker_ends.saturating_duration_since(Instant::now());
    assert!(
        early < Duration::from_millis(100),
        "the write of 3 was admitted {early:?} before the crashed write's marker ended"
    );
    assert_eq!(up.bodies_on("/docs/w"), vec!["a", "b"]);
}

/// Two resets that overlap: the one with the lower id commits last. Other
/// instances learn of resets by id, so if ids could commit out of order, a
/// watcher that polled between the two commits would skip the lower id and
/// keep refusing its key from memory for good. The first reset here is
/// made by hand: its row is written (its id taken) and its transaction held
/// open while the second is made through the gateway, which must wait for
/// it rather than commit a higher id first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_that_commits_after_a_later_one_still_reaches_every_instance() {
    use crate::support::db::PgHolder;
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = shared_pair(&store, &up).await;
    for key in ["/docs/y", "/docs/z"] {
        assert_eq!(apps[0].put(key, Some(MAX), "forged").await.status(), 200);
        problem(apps[1].put(key, Some("3"), "a").await, 409).await;
    }

    let mut slow = PgHolder::begin(
        &store.url,
        "UPDATE fences SET highest_token = 2 WHERE resource_key = 'doc:y'",
    )
    .await;
    slow.run(
        "INSERT INTO fence_resets (resource_key, by_client, reason, from_token, to_token) \
         VALUES ('doc:y', 'ops', 'slow', 9223372036854775807, 2)",
    )
    .await;

    let admin = apps[0].admin_url("/fences/doc:z/reset");
    let http = apps[0].http.clone();
    let later = tokio::spawn(async move {
        http.post(admin)
            .bearer_auth("key-ops")
            .json(&json!({"highest_token": 2, "reason": "later"}))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    // Several watcher polls while the first reset is still open.
    tokio::time::sleep(Duration::from_millis(800)).await;
    slow.commit().await;
    let committed = Instant::now();
    assert_eq!(later.await.unwrap().unwrap(), 200);
    accepted_within_a_second(&apps[1], "/docs/y", committed).await;
    accepted_within_a_second(&apps[1], "/docs/z", committed).await;
}

/// An admin break ends the lease: the holder's renew and release answer
/// 409, the next grant has a higher fence, and a second break finds none.
#[tokio::test]
async fn breaking_a_lease_ends_it_on_every_backend() {
    let url = require_shared_redis();
    let nodes: Vec<PrivateRedis> = (0..3).map(|_| PrivateRedis::start()).collect();
    for (locks, backend) in [
        (String::new(), Backend::Sqlite),
        (String::new(), Backend::Postgres),
        (
            format!("[locks]\nbackend = \"redis\"\nredis_url = \"{url}\"\n"),
            Backend::Sqlite,
        ),
        (
            format!(
                "[locks]\nbackend = \"redlock\"\nredis_urls = [{}]\n",
                nodes
                    .iter()
                    .map(|n| format!("\"{}\"", n.url()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Backend::Postgres,
        ),
    ] {
        let store = TestStore::new(backend).await;
        let name = format!("doc:break-{}", rand::random::<u32>());
        let app = TestApp::spawn(&store.url, &format!("{locks}{}", auth_section())).await;
        let grant: Value = acquire(&app, &name, Some("key-ops"))
            .await
            .json()
            .await
            .unwrap();
        let path = format!("/locks/{name}/break");
        assert_eq!(
            call(&app, "POST", &path, Some("key-ops"), None)
                .await
                .status(),
            204
        );
        let renew = call(
            &app,
            "POST",
            &format!("/_fencegate/locks/{name}/renew"),
            Some("key-ops"),
            Some(json!({"lease": grant["lease"], "ttl_ms": 10000})),
        )
        .await;
        problem(renew, 409).await;
        let release = call(
            &app,
            "POST",
            &format!("/_fencegate/locks/{name}/release"),
            Some("key-ops"),
            Some(json!({"lease": grant["lease"]})),
        )
        .await;
        problem(release, 409).await;
        let next: Value = acquire(&app, &name, Some("key-ops"))
            .await
            .json()
            .await
            .unwrap();
        assert!(
            next["fence"].as_i64() > grant["fence"].as_i64(),
            "{next} after {grant}"
        );
        assert_eq!(
            call(&app, "POST", &path, Some("key-ops"), None)
                .await
                .status(),
            204
        );
        let body = problem(call(&app, "POST", &path, Some("key-ops"), None).await, 404).await;
        assert_eq!(body["type"], "urn:fencegate:problem:not-held");
    }
}

/// Listings page by key with no overlap and no gap, within a prefix, and
/// refuse bad parameters.
#[tokio::test]
async fn listings_page_through_more_keys_than_one_page() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let routes = route("pages", "/p/{id}", &up.url(), "{id}");
        let app = TestApp::spawn(&store.url, &routes).await;
        let mut want = Vec::new();
        for i in 0..250 {
            let key = format!("page:{i:03}");
            assert_eq!(
                app.put(&format!("/p/{key}"), Some("1"), "x").await.status(),
                200
            );
            want.push(key);
        }
        for other in ["pagf:0", "pag", "zzz"] {
            assert_eq!(
                app.put(&format!("/p/{other}"), Some("1"), "x")
                    .await
                    .status(),
                200
            );
        }
        let mut got = Vec::new();
        let mut after: Option<String> = None;
        let mut pages = 0;
        loop {
            let mut path = "/fences?prefix=page:&limit=100".to_string();
            if let Some(a) = &after {
                path.push_str(&format!("&after={a}"));
            }
            let page: Value = read(&app, &path).await;
            pages += 1;
            for f in page["fences"].as_array().unwrap() {
                got.push(f["resource_key"].as_str().unwrap().to_string());
            }
            match page["next"].as_str() {
                Some(n) => after = Some(n.to_string()),
                None => break,
            }
            assert!(pages < 10, "pagination does not end");
        }
        assert_eq!(pages, 3);
        assert_eq!(got, want, "{backend:?}: every key once, in order");
        bad_queries_are_400(&app, "/fences", &["limit=x", "colour=red"]).await;
        // Locks: names a fence was issued for, with their status.
        for n in ["lk:a", "lk:b", "lk:c"] {
            assert_eq!(acquire(&app, n, None).await.status(), 201);
        }
        let page: Value = read(&app, "/locks?prefix=lk:&limit=2").await;
        let names: Vec<_> = page["locks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["name"].clone())
            .collect();
        assert_eq!(names, vec![json!("lk:a"), json!("lk:b")]);
        assert_eq!(page["locks"][0]["held"], true);
        assert_eq!(page["next"], "lk:b");
        let rest: Value = read(&app, "/locks?prefix=lk:&after=lk:b").await;
        assert_eq!(rest["locks"][0]["name"], "lk:c");
        assert_eq!(rest["next"], Value::Null);
    }
}

/// `GET /locks` on the Redis and Redlock backends (names come from the
/// store, which learns every grant as its durable floor; status from the
/// backend), and its bad parameters.
#[tokio::test]
async fn lock_listings_on_redis_and_redlock_and_their_bad_parameters() {
    let redis = require_shared_redis();
    let nodes: Vec<PrivateRedis> = (0..3).map(|_| PrivateRedis::start()).collect();
    let urls: Vec<String> = nodes.iter().map(|n| format!("\"{}\"", n.url())).collect();
    for locks in [
        format!("[locks]\nbackend = \"redis\"\nredis_url = \"{redis}\"\n"),
        format!(
            "[locks]\nbackend = \"redlock\"\nredis_urls = [{}]\n",
            urls.join(", ")
        ),
    ] {
        let store = TestStore::new(Backend::Sqlite).await;
        let app = TestApp::spawn(&store.url, &locks).await;
        // A prefix of its own: the shared Redis outlives every test.
        let prefix = format!("ls{:08x}:", rand::random::<u32>());
        for n in ["a", "b", "c"] {
            assert_eq!(
                acquire(&app, &format!("{prefix}{n}"), None).await.status(),
                201
            );
        }
        let page: Value = read(&app, &format!("/locks?prefix={prefix}&limit=2")).await;
        let names: Vec<_> = page["locks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            names,
            vec![format!("{prefix}a"), format!("{prefix}b")],
            "{locks}"
        );
        assert_eq!(page["locks"][0]["held"], true, "{locks}");
        assert!(page["locks"][0]["fence"].as_i64().unwrap() >= 1);
        let next = page["next"].as_str().unwrap().to_string();
        let rest: Value = read(&app, &format!("/locks?prefix={prefix}&after={next}")).await;
        assert_eq!(rest["locks"][0]["name"], format!("{prefix}c"), "{locks}");
        assert_eq!(rest["next"], Value::Null);
        bad_queries_are_400(&app, "/locks", &["limit=-1", "owner=me"]).await;
    }
}

/// Without `[[auth.clients]]` the lock API is open: `serve` warns when the
/// traffic listener is not a loopback address, and so does a reload that
/// removes the last client. A loopback listener, or a config with a client,
/// gets no warning. (The process listens on every address but is sent no
/// traffic.)
#[tokio::test]
async fn an_open_lock_api_on_a_reachable_listener_is_warned_about() {
    use crate::support::process::GatewayProcess;
    const WARNING: &str = "the lock API is open to anyone who can reach this listener";
    let (one, two) = (
        TestStore::new(Backend::Sqlite).await,
        TestStore::new(Backend::Sqlite).await,
    );
    let config = |store: &TestStore, listen: &str, auth: &str| {
        format!(
            "[server]\nlisten = \"{listen}\"\nadmin_listen = \"127.0.0.1:0\"\n\
             [store]\nurl = \"{}\"\n{auth}",
            store.url
        )
    };
    let text = |listen: &str, auth: &str| config(&two, listen, auth);
    let quiet = GatewayProcess::start(&config(&one, "127.0.0.1:0", ""));
    let open = GatewayProcess::start(&text("0.0.0.0:0", ""));
    assert_eq!(open.log().matches(WARNING).count(), 1, "{}", open.log());
    reload(&open, &text("0.0.0.0:0", &auth_section()), 1).await;
    assert_eq!(open.log().matches(WARNING).count(), 1, "{}", open.log());
    reload(&open, &text("0.0.0.0:0", ""), 2).await;
    assert_eq!(open.log().matches(WARNING).count(), 2, "{}", open.log());
    assert!(!quiet.log().contains(WARNING), "{}", quiet.log());
}

/// Rewrites a gateway process's config, sends SIGHUP, and waits until it has
/// logged its `reloads`-th successful reload.
async fn reload(gw: &crate::support::process::GatewayProcess, config: &str, reloads: usize) {
    gw.rewrite_config(config);
    gw.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(5);
    while gw.log().matches("config reloaded").count() < reloads {
        assert!(Instant::now() < deadline, "no reload:\n{}", gw.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
