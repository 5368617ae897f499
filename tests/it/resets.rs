//! An admin reset racing writes already decided (CONTRACT.md, third round:
//! "Resets, reloads, restarts"): a write recorded before a reset of its
//! key and still waiting at the gate is decided again against the store
//! after the reset, so no write is forwarded with a token above what the
//! store holds, and the store never ends below a token the upstream got.
//!
//! The race: token 5 is at the upstream (1.5 s of work), token 9 is
//! recorded and waits behind it, the key is reset to 3, and token 8
//! follows. Whatever order 8 and 9 then take, the upstream applies them in
//! token order, the store ends at 9 at least, and afterwards 8 is stale,
//! also with one key of memory and on a new instance (a restart), which
//! know only what the store says. Single mode on SQLite and on Postgres,
//! and shared mode.

use std::time::Duration;

use serde_json::{json, Value};
use sha2::Digest;

use crate::support::app::{config_sections, docs_route, TestApp, SHARED_STORE};
use crate::support::db::{Backend, TestStore};
use crate::support::upstream::Upstream;
use crate::support::{fenced_put, wait_for};

const ADMIN_KEY: &str = "reset-admin-key";

/// An admin client, so that resets can be made.
fn admin_section() -> String {
    let sha = hex::encode(sha2::Sha256::digest(ADMIN_KEY.as_bytes()));
    format!(
        "[[auth.clients]]\nname = \"ops\"\napi_key_sha256 = \"{sha}\"\nlocks = [\"*\"]\nadmin = true\n"
    )
}

fn config(store: &TestStore, up: &Upstream, shared: bool) -> String {
    // One key of memory: what the gate caches cannot hide the store.
    let store_lines = if shared {
        format!("{SHARED_STORE}cache_keys = 1\n")
    } else {
        "timeout_ms = 3000\ncache_keys = 1\n".to_string()
    };
    let rest = format!(
        "{}timeout_ms = 5000\n{}",
        docs_route(&up.url()),
        admin_section()
    );
    config_sections("", &store.url, &store_lines, &rest)
}

async fn reset(app: &TestApp, key: &str, to: i64) {
    let resp = app
        .http
        .post(app.admin_url(&format!("/fences/{key}/reset")))
        .bearer_auth(ADMIN_KEY)
        .json(&json!({"highest_token": to, "reason": "test"}))
        .send()
        .await
        .expect("the admin listener answers");
    assert_eq!(
        resp.status(),
        200,
        "{}",
        resp.text().await.unwrap_or_default()
    );
}

async fn highest(app: &TestApp, key: &str) -> i64 {
    let fence: Value = app
        .admin_get(&format!("/fences/{key}"))
        .await
        .json()
        .await
        .expect("the fence as JSON");
    fence["highest_token"].as_i64().expect("a highest token")
}

async fn a_reset_behind_a_decided_write(backend: Backend, shared: bool) {
    let store = TestStore::new(backend).await;
    let up = Upstream::start().await;
    let text = config(&store, &up, shared);
    let app = TestApp::from_text(&text).await;
    let put = |token: &str, delay: &str| {
        let req = fenced_put(&app.http, app.url("/docs/r"), token, format!("t{token}"))
            .header("x-test-delay-ms", delay)
            .send();
        tokio::spawn(async move { req.await.expect("the gateway answers").status().as_u16() })
    };
    let five = put("5", "1500");
    wait_for("token 5 at the upstream", || up.in_flight() == 1).await;
    let nine = put("9", "0");
    // Token 9 is recorded before it waits at the gate.
    let recorded = std::time::Instant::now() + Duration::from_secs(5);
    while highest(&app, "doc:r").await != 9 {
        assert!(std::time::Instant::now() < recorded, "9 was never recorded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    reset(&app, "doc:r", 3).await;
    let eight = put("8", "0");
    assert_eq!(five.await.unwrap(), 200);
    assert_eq!(
        nine.await.unwrap(),
        200,
        "9 is still the highest after the reset"
    );
    let eight = eight.await.unwrap();
    assert!(
        eight == 200 || eight == 409,
        "8 goes before 9 or is stale behind it: {eight}"
    );
    let tokens = up.bodies_on("/docs/r");
    let mut sorted = tokens.clone();
    sorted.sort_by_key(|t| t[1..].parse::<i64>().unwrap_or_default());
    assert_eq!(
        tokens, sorted,
        "the upstream applied the tokens out of order"
    );
    assert!(tokens.contains(&"t9".to_string()), "{tokens:?}");
    assert_eq!(
        tokens.contains(&"t8".to_string()),
        eight == 200,
        "8 was forwarded iff it was accepted: {tokens:?}"
    );
    assert!(
        highest(&app, "doc:r").await >= 9,
        "9 was forwarded after the reset: the store must hold it"
    );
    // Memory of one key and a new instance know only the store.
    let other = fenced_put(&app.http, app.url("/docs/other"), "1", "x")
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 200);
    let applied = up.applied_on("/docs/r").len();
    let stale = fenced_put(&app.http, app.url("/docs/r"), "8", "again")
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), 409, "8 after 9 was forwarded");
    app.stop().await;
    let restarted = TestApp::from_text(&text).await;
    let stale = fenced_put(&restarted.http, restarted.url("/docs/r"), "8", "again")
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), 409, "8 after a restart");
    assert_eq!(
        up.applied_on("/docs/r").len(),
        applied,
        "a refused write reached the upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_behind_a_decided_write_single_sqlite() {
    a_reset_behind_a_decided_write(Backend::Sqlite, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_behind_a_decided_write_single_postgres() {
    a_reset_behind_a_decided_write(Backend::Postgres, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_behind_a_decided_write_shared_postgres() {
    a_reset_behind_a_decided_write(Backend::Postgres, true).await;
}
