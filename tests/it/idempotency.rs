//! Idempotency-Key: a write is forwarded at most once per key, its answer
//! replayed, and when the gateway cannot know what happened it says so
//! instead of sending the write again. Counted at the upstream.

use std::sync::Arc;
use std::time::Duration;

use crate::support::app::{docs_route, problem, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::pki::{Ca, HttpsUpstream};
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

fn idem_route(upstream: &str, extra: &str) -> String {
    format!(
        "{}idempotency = \"optional\"\n{extra}",
        docs_route(upstream)
    )
}

async fn keyed(
    app: &TestApp,
    path: &str,
    token: &str,
    key: Option<&str>,
    body: &str,
    extra: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = app
        .http
        .post(app.url(path))
        .header("x-fence-token", token)
        .header("content-type", "text/plain")
        .body(body.to_string());
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    for (n, v) in extra {
        req = req.header(*n, *v);
    }
    req.send().await.expect("gateway answered")
}

#[tokio::test]
async fn a_replay_is_the_stored_answer_and_a_reuse_is_refused() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let app = TestApp::spawn(&store.url, &idem_route(&up.url(), "")).await;
        let first = keyed(&app, "/docs/a", "1", Some("\"order-1\""), "A", &[]).await;
        assert_eq!(first.status(), 200);
        assert!(first.headers().get("idempotent-replayed").is_none());
        let first_body = first.text().await.unwrap();
        for _ in 0..3 {
            let again = keyed(&app, "/docs/a", "1", Some("\"order-1\""), "A", &[]).await;
            assert_eq!(again.status(), 200);
            assert_eq!(again.headers()["idempotent-replayed"], "true");
            assert_eq!(
                again.headers()["x-upstream"],
                "recorder",
                "stored headers replayed"
            );
            assert_eq!(again.text().await.unwrap(), first_body);
        }
        // The bare spelling of the same key is the same key.
        let bare = keyed(&app, "/docs/a", "1", Some("order-1"), "A", &[]).await;
        assert_eq!(bare.headers()["idempotent-replayed"], "true");
        let body = problem(
            keyed(&app, "/docs/a", "1", Some("order-1"), "B", &[]).await,
            422,
        )
        .await;
        assert_eq!(body["type"], "urn:fencegate:problem:idempotency-key-reused");
        for bad in ["\"unterminated", "a b", "\"x\";p=1"] {
            let body = problem(keyed(&app, "/docs/a", "1", Some(bad), "A", &[]).await, 400).await;
            assert_eq!(
                body["type"], "urn:fencegate:problem:idempotency-key-malformed",
                "{bad}"
            );
        }
        assert_eq!(up.applied().len(), 1, "{backend:?}: forwarded once");
        let metrics = app.metrics().await;
        for line in [
            "fencegate_idempotency_total{route=\"docs\",outcome=\"first\"} 1",
            "fencegate_idempotency_total{route=\"docs\",outcome=\"replayed\"} 4",
            "fencegate_idempotency_total{route=\"docs\",outcome=\"reused\"} 1",
        ] {
            assert!(metrics.contains(line), "missing {line} in\n{metrics}");
        }
    }
}

#[tokio::test]
async fn required_keys_and_upstream_errors_replayed() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let route = format!("{}idempotency = \"required\"\n", docs_route(&up.url()));
    let app = TestApp::spawn(&store.url, &route).await;
    let body = problem(keyed(&app, "/docs/a", "1", None, "A", &[]).await, 400).await;
    assert_eq!(
        body["type"],
        "urn:fencegate:problem:idempotency-key-missing"
    );
    assert!(up.requests().is_empty());
    // An upstream 500 is an answer like any other: stored and replayed.
    let failing = [("x-test-status", "500")];
    assert_eq!(
        keyed(&app, "/docs/a", "1", Some("k"), "A", &failing)
            .await
            .status(),
        500
    );
    let again = keyed(&app, "/docs/a", "1", Some("k"), "A", &failing).await;
    assert_eq!(again.status(), 500);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(up.applied().len(), 1);
}

/// A 504 or an answer too large to store leaves the outcome unknown: the
/// write is never forwarded again under its key.
#[tokio::test]
async fn an_unknown_outcome_is_never_forwarded_again() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let route = idem_route(
        &up.url(),
        "idempotency_max_response_bytes = 100\ntimeout_ms = 500\n",
    );
    let app = TestApp::spawn(&store.url, &route).await;
    let slow = [("x-test-delay-ms", "1000")];
    problem(
        keyed(&app, "/docs/slow", "1", Some("s"), "A", &slow).await,
        504,
    )
    .await;
    let body = problem(
        keyed(&app, "/docs/slow", "1", Some("s"), "A", &slow).await,
        409,
    )
    .await;
    assert_eq!(
        body["type"],
        "urn:fencegate:problem:idempotency-outcome-unknown"
    );

    let big = [("x-test-response-bytes", "1000")];
    let first = keyed(&app, "/docs/big", "1", Some("b"), "A", &big).await;
    assert_eq!(first.status(), 200);
    assert_eq!(
        first.bytes().await.unwrap().len(),
        1000,
        "the first client gets it all"
    );
    let body = problem(
        keyed(&app, "/docs/big", "1", Some("b"), "A", &big).await,
        409,
    )
    .await;
    assert_eq!(
        body["type"],
        "urn:fencegate:problem:idempotency-outcome-unknown"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    for path in ["/docs/slow", "/docs/big"] {
        assert_eq!(
            up.requests().iter().filter(|r| r.path() == path).count(),
            1,
            "{path}"
        );
    }
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("fencegate_idempotency_total{route=\"docs\",outcome=\"not_stored\"} 2"),
        "{metrics}"
    );
}

/// Fencing and idempotency together: a replay is served even after a newer
/// token was recorded (the write did happen), and a stale first use is
/// refused and not recorded.
#[tokio::test]
async fn replays_bypass_the_fence_and_refusals_are_not_recorded() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &idem_route(&up.url(), "")).await;
    assert_eq!(
        keyed(&app, "/docs/x", "5", Some("five"), "A", &[])
            .await
            .status(),
        200
    );
    assert_eq!(
        keyed(&app, "/docs/x", "6", None, "B", &[]).await.status(),
        200
    );
    let replay = keyed(&app, "/docs/x", "5", Some("five"), "A", &[]).await;
    assert_eq!(replay.status(), 200, "the write with 5 did happen");
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    // A stale first use: 409, and its key is not taken.
    problem(
        keyed(&app, "/docs/x", "4", Some("late"), "C", &[]).await,
        409,
    )
    .await;
    assert_eq!(
        keyed(&app, "/docs/x", "7", Some("late"), "D", &[])
            .await
            .status(),
        200
    );
    let tokens: Vec<_> = up.applied().iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6), Some(7)]);
}

#[tokio::test]
async fn keys_are_forgotten_after_their_ttl() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(
        &store.url,
        &idem_route(&up.url(), "idempotency_ttl_s = 1\n"),
    )
    .await;
    assert_eq!(
        keyed(&app, "/docs/t", "1", Some("k"), "A", &[])
            .await
            .status(),
        200
    );
    problem(keyed(&app, "/docs/t", "1", Some("k"), "B", &[]).await, 422).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let reused = keyed(&app, "/docs/t", "1", Some("k"), "B", &[]).await;
    assert_eq!(reused.status(), 200, "a forgotten key is a new key");
    assert!(reused.headers().get("idempotent-replayed").is_none());
    assert_eq!(up.applied().len(), 2);

    // Purging: expired records go, in small batches.
    let store_handle = fencegate::store::FenceStore::open(
        &fencegate::config::Config::from_toml(
            "t.toml",
            &format!("[store]\nurl = \"{}\"\nmode = \"shared\"\n", store.url),
            Vec::new(),
        )
        .unwrap()
        .store,
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let purged = store_handle.idem_purge().await.unwrap();
    assert_eq!(purged, 1, "the second record expired too");
    assert_eq!(store_handle.idem_purge().await.unwrap(), 0);
}

/// Shared mode: of concurrent duplicates on two instances exactly one is
/// forwarded; the others are told it is in progress, or get its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_of_concurrent_duplicates_across_instances_is_forwarded() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let mut apps = Vec::new();
    for _ in 0..2 {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             [store]\nurl = \"{}\"\nmode = \"shared\"\ntimeout_ms = 3000\n{}",
            store.url,
            idem_route(&up.url(), "")
        );
        let config = fencegate::config::Config::from_toml("t.toml", &text, Vec::new()).unwrap();
        apps.push(Arc::new(TestApp::from_config(config).await.unwrap()));
    }
    let mut tasks = Vec::new();
    for i in 0..10 {
        let app = apps[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let resp = keyed(
                &app,
                "/docs/d",
                "1",
                Some("dup"),
                "A",
                &[("x-test-delay-ms", "300")],
            )
            .await;
            let status = resp.status().as_u16();
            let replayed = resp.headers().contains_key("idempotent-replayed");
            let kind = resp
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let text = resp.text().await.unwrap_or_default();
            (status, replayed, kind, text)
        }));
    }
    let mut firsts = 0;
    for t in tasks {
        let (status, replayed, kind, text) = t.await.unwrap();
        match status {
            200 if !replayed => firsts += 1,
            200 => {}
            409 => assert!(text.contains("idempotency-in-progress"), "{kind}: {text}"),
            s => panic!("unexpected {s}: {text}"),
        }
    }
    assert_eq!(firsts, 1, "exactly one duplicate was the first use");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        up.requests().len(),
        1,
        "forwarded once across both instances"
    );
}

/// kill -9 of the gateway while the upstream holds the request: after a
/// restart, the retry is not forwarded again.
#[tokio::test]
async fn a_crash_mid_forward_is_never_forwarded_twice() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [store]\nurl = \"{}\"\ntimeout_ms = 500\n{}",
        store.url,
        idem_route(&up.url(), "timeout_ms = 1000\n")
    );
    let mut gw = GatewayProcess::start(&config);
    let http = reqwest::Client::new();
    let url = gw.url("/docs/c");
    let pending = tokio::spawn({
        let http = http.clone();
        async move {
            http.post(url)
                .header("x-fence-token", "1")
                .header("idempotency-key", "crash")
                .header("x-test-delay-ms", "1500")
                .body("A")
                .send()
                .await
        }
    });
    for _ in 0..100 {
        if !up.requests().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(up.requests().len(), 1, "the upstream holds the request");
    gw.kill9();
    assert!(
        pending.await.unwrap().is_err(),
        "the client lost its answer"
    );

    let gw = GatewayProcess::start(&config);
    // While the crashed forward's time may not be over: in progress; after
    // it: unknown. Never forwarded again.
    let mut seen = Vec::new();
    for _ in 0..6 {
        let resp = http
            .post(gw.url("/docs/c"))
            .header("x-fence-token", "1")
            .header("idempotency-key", "crash")
            .header("x-test-delay-ms", "1500")
            .body("A")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 409);
        let body: serde_json::Value = resp.json().await.unwrap();
        seen.push(body["type"].as_str().unwrap().to_string());
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    assert_eq!(
        seen.last().map(String::as_str),
        Some("urn:fencegate:problem:idempotency-outcome-unknown"),
        "{seen:?}"
    );
    assert!(
        seen.iter().all(|t| t.ends_with("idempotency-in-progress")
            || t.ends_with("idempotency-outcome-unknown")),
        "{seen:?}"
    );
    assert_eq!(up.requests().len(), 1, "forwarded once, crash or not");
}

/// In front of an external HTTPS API: keyed writes through TLS, replayed.
#[tokio::test]
async fn idempotent_writes_to_an_https_upstream() {
    let store = TestStore::new(Backend::Sqlite).await;
    let ca = Ca::new("api CA");
    let ca_file = ca.write("ca.pem", &ca.pem());
    let api = HttpsUpstream::start(&ca.server("api")).await;
    let route = format!(
        "{}upstream_ca_file = \"{}\"\n",
        idem_route(&format!("https://{}", api.addr), ""),
        ca_file.display()
    );
    let app = TestApp::spawn(&store.url, &route).await;
    let first = keyed(&app, "/docs/pay", "1", Some("pay-7"), "100 EUR", &[]).await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.text().await.unwrap(), "secure");
    let again = keyed(&app, "/docs/pay", "1", Some("pay-7"), "100 EUR", &[]).await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        api.seen.lock().unwrap().len(),
        1,
        "the payment was sent once"
    );
}
