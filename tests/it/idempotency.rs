//! Idempotency-Key: a write is forwarded at most once per key, its answer
//! replayed, and when the gateway cannot know what happened it says so
//! instead of sending the write again. Counted at the upstream.

use std::sync::Arc;
use std::time::Duration;

use crate::support::app::{content_type, docs_route, problem, TestApp};
use crate::support::db::{Backend, PgHolder, TestStore};
use crate::support::pki::HttpsUpstream;
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

fn idem_route(upstream: &str, extra: &str) -> String {
    format!(
        "{}idempotency = \"optional\"\n{extra}",
        docs_route(upstream)
    )
}

/// A POST of `body` with `token` and, if given, `Idempotency-Key: key`
/// and the `extra` headers.
pub(crate) async fn with_idempotency_key(
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
        let first = with_idempotency_key(&app, "/docs/a", "1", Some("\"order-1\""), "A", &[]).await;
        assert_eq!(first.status(), 200);
        assert!(first.headers().get("idempotent-replayed").is_none());
        let first_body = first.text().await.unwrap();
        for _ in 0..3 {
            let again =
                with_idempotency_key(&app, "/docs/a", "1", Some("\"order-1\""), "A", &[]).await;
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
        let bare = with_idempotency_key(&app, "/docs/a", "1", Some("order-1"), "A", &[]).await;
        assert_eq!(bare.headers()["idempotent-replayed"], "true");
        let body = problem(
            with_idempotency_key(&app, "/docs/a", "1", Some("order-1"), "B", &[]).await,
            422,
        )
        .await;
        assert_eq!(body["type"], "urn:fencegate:problem:idempotency-key-reused");
        for bad in ["\"unterminated", "a b", "\"x\";p=1"] {
            let body = problem(
                with_idempotency_key(&app, "/docs/a", "1", Some(bad), "A", &[]).await,
                400,
            )
            .await;
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
    let body = problem(
        with_idempotency_key(&app, "/docs/a", "1", None, "A", &[]).await,
        400,
    )
    .await;
    assert_eq!(
        body["type"],
        "urn:fencegate:problem:idempotency-key-missing"
    );
    assert!(up.requests().is_empty());
    // An upstream 500 is an answer like any other: stored and replayed.
    let failing = [("x-test-status", "500")];
    assert_eq!(
        with_idempotency_key(&app, "/docs/a", "1", Some("k"), "A", &failing)
            .await
            .status(),
        500
    );
    let again = with_idempotency_key(&app, "/docs/a", "1", Some("k"), "A", &failing).await;
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
        with_idempotency_key(&app, "/docs/slow", "1", Some("s"), "A", &slow).await,
        504,
    )
    .await;
    let body = problem(
        with_idempotency_key(&app, "/docs/slow", "1", Some("s"), "A", &slow).await,
        409,
    )
    .await;
    assert_eq!(
        body["type"],
        "urn:fencegate:problem:idempotency-outcome-unknown"
    );

    let big = [("x-test-response-bytes", "1000")];
    let first = with_idempotency_key(&app, "/docs/big", "1", Some("b"), "A", &big).await;
    assert_eq!(first.status(), 200);
    assert_eq!(
        first.bytes().await.unwrap().len(),
        1000,
        "the first client gets it all"
    );
    let body = problem(
        with_idempotency_key(&app, "/docs/big", "1", Some("b"), "A", &big).await,
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
    assert_eq!(idem_count(&metrics, "outcome_unknown"), 2, "{metrics}");
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
        with_idempotency_key(&app, "/docs/x", "5", Some("five"), "A", &[])
            .await
            .status(),
        200
    );
    assert_eq!(
        with_idempotency_key(&app, "/docs/x", "6", None, "B", &[])
            .await
            .status(),
        200
    );
    let replay = with_idempotency_key(&app, "/docs/x", "5", Some("five"), "A", &[]).await;
    assert_eq!(replay.status(), 200, "the write with 5 did happen");
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    // A stale first use: 409, and its key is not taken.
    problem(
        with_idempotency_key(&app, "/docs/x", "4", Some("late"), "C", &[]).await,
        409,
    )
    .await;
    assert_eq!(
        with_idempotency_key(&app, "/docs/x", "7", Some("late"), "D", &[])
            .await
            .status(),
        200
    );
    let tokens: Vec<_> = up.applied().iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6), Some(7)]);
}

/// The retention policy as published: a key is remembered for
/// `idempotency_ttl_s` from its first use, and at least as long as that
/// request may be in flight (the route's timeout, two store timeouts and a
/// second); then it is forgotten and a request with it is a first use.
#[tokio::test]
async fn keys_are_forgotten_after_their_ttl() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    // In flight for at most 0.5 + 2 x 0.5 + 1 = 2.5 s; a TTL of 1 s.
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [store]\nurl = \"{}\"\ntimeout_ms = 500\n{}",
        store.url,
        idem_route(&up.url(), "idempotency_ttl_s = 1\ntimeout_ms = 500\n")
    );
    let app = TestApp::from_text(&text).await;
    let started = tokio::time::Instant::now();
    assert_eq!(
        with_idempotency_key(&app, "/docs/t", "1", Some("k"), "A", &[])
            .await
            .status(),
        200
    );
    problem(
        with_idempotency_key(&app, "/docs/t", "1", Some("k"), "B", &[]).await,
        422,
    )
    .await;
    // Past the TTL, within the time in flight: still remembered.
    tokio::time::sleep_until(started + Duration::from_millis(1300)).await;
    let replay = with_idempotency_key(&app, "/docs/t", "1", Some("k"), "A", &[]).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    tokio::time::sleep_until(started + Duration::from_millis(2900)).await;
    let reused = with_idempotency_key(&app, "/docs/t", "1", Some("k"), "B", &[]).await;
    assert_eq!(reused.status(), 200, "a forgotten key is a new key");
    assert!(reused.headers().get("idempotent-replayed").is_none());
    assert_eq!(up.applied().len(), 2);
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
        apps.push(Arc::new(TestApp::from_text(&text).await));
    }
    let mut tasks = Vec::new();
    for i in 0..10 {
        let app = apps[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let resp = with_idempotency_key(
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
            let kind = content_type(&resp);
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

/// In front of an external HTTPS API: writes with an Idempotency-Key through TLS, replayed.
#[tokio::test]
async fn idempotent_writes_to_an_https_upstream() {
    let store = TestStore::new(Backend::Sqlite).await;
    let (api, _ca, ca_file) = HttpsUpstream::with_new_ca("api CA", "api").await;
    let route = format!(
        "{}upstream_ca_file = \"{}\"\n",
        idem_route(&format!("https://{}", api.addr), ""),
        ca_file.display()
    );
    let app = TestApp::spawn(&store.url, &route).await;
    let first = with_idempotency_key(&app, "/docs/pay", "1", Some("pay-7"), "100 EUR", &[]).await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.text().await.unwrap(), "secure");
    let again = with_idempotency_key(&app, "/docs/pay", "1", Some("pay-7"), "100 EUR", &[]).await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        api.seen.lock().unwrap().len(),
        1,
        "the payment was sent once"
    );
}

/// Waits (bounded) until `done` holds.
async fn until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + limit;
    while !done() {
        assert!(
            tokio::time::Instant::now() < end,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of `fencegate_idempotency_total{route="docs",outcome=...}`.
fn idem_count(metrics: &str, outcome: &str) -> u64 {
    let prefix = format!("fencegate_idempotency_total{{route=\"docs\",outcome=\"{outcome}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A POST with an Idempotency-Key sent in the background (the first of a pair of duplicates).
fn in_background(
    app: &Arc<TestApp>,
    path: &'static str,
    key: &'static str,
    extra: &'static [(&'static str, &'static str)],
) -> tokio::task::JoinHandle<reqwest::Response> {
    let app = app.clone();
    tokio::spawn(async move { with_idempotency_key(&app, path, "1", Some(key), "A", extra).await })
}

/// While the first request is at the upstream, a duplicate is 409
/// `idempotency-in-progress` with a `Retry-After` no longer than the first
/// may still take, and is counted as `in_progress`; once the first is done,
/// its answer is replayed. Forwarded once.
#[tokio::test]
async fn a_duplicate_in_flight_is_told_when_to_retry() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app =
        Arc::new(TestApp::spawn(&store.url, &idem_route(&up.url(), "timeout_ms = 3000\n")).await);
    let first = in_background(&app, "/docs/p", "busy", &[("x-test-delay-ms", "1500")]);
    until(
        "the upstream holds the first request",
        Duration::from_secs(5),
        || up.requests().len() == 1,
    )
    .await;
    let dup = with_idempotency_key(&app, "/docs/p", "1", Some("busy"), "A", &[]).await;
    let retry_after: u64 = dup
        .headers()
        .get("retry-after")
        .expect("409 in progress carries Retry-After")
        .to_str()
        .unwrap()
        .parse()
        .expect("Retry-After in seconds");
    // The record's time: the route's 3 s, two store timeouts of 1.5 s, 1 s.
    assert!((1..=7).contains(&retry_after), "Retry-After: {retry_after}");
    let body = problem(dup, 409).await;
    assert_eq!(
        body["type"],
        "urn:fencegate:problem:idempotency-in-progress"
    );
    assert_eq!(first.await.unwrap().status(), 200);
    let again = with_idempotency_key(&app, "/docs/p", "1", Some("busy"), "A", &[]).await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(up.requests().len(), 1, "forwarded once");
    let metrics = app.metrics().await;
    assert_eq!(idem_count(&metrics, "in_progress"), 1, "{metrics}");
    assert_eq!(idem_count(&metrics, "first"), 1, "{metrics}");
    assert_eq!(idem_count(&metrics, "replayed"), 1, "{metrics}");
}

/// `idempotency_ttl_s` shorter than the route's timeout: a record never
/// expires while its request may still be in flight, so a duplicate sent
/// after the TTL, while the first is still at the upstream, is refused —
/// not taken for a new first use and forwarded a second time.
#[tokio::test]
async fn a_short_ttl_never_forwards_a_write_twice() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let app = Arc::new(
            TestApp::spawn(
                &store.url,
                &idem_route(&up.url(), "idempotency_ttl_s = 1\ntimeout_ms = 5000\n"),
            )
            .await,
        );
        let first = in_background(&app, "/docs/t", "short", &[("x-test-delay-ms", "2500")]);
        until(
            "the upstream holds the first request",
            Duration::from_secs(5),
            || up.requests().len() == 1,
        )
        .await;
        // Past the TTL, the first still in flight.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let dup = with_idempotency_key(&app, "/docs/t", "1", Some("short"), "A", &[]).await;
        assert_eq!(
            up.requests().len(),
            1,
            "{backend:?}: the duplicate was forwarded while the first was in flight"
        );
        assert!(dup.headers().contains_key("retry-after"), "{backend:?}");
        let body = problem(dup, 409).await;
        assert_eq!(
            body["type"], "urn:fencegate:problem:idempotency-in-progress",
            "{backend:?}"
        );
        assert_eq!(first.await.unwrap().status(), 200);
        assert_eq!(up.requests().len(), 1, "{backend:?}: forwarded once");
    }
}

/// A 502 after the request was sent leaves the outcome unknown, whether
/// the upstream reset the connection before any answer or broke its answer
/// off: a retry is 409 `idempotency-outcome-unknown` and never forwarded.
#[tokio::test]
async fn a_502_after_sending_is_never_forwarded_twice() {
    use crate::support::raw_upstream::{RawUpstream, BEHAVIOUR_HEADER};
    use crate::support::read_one_request;

    // Reads one request (head and Content-Length body), counts it, then
    // resets the connection (RST) without a byte of answer.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let resetting = listener.local_addr().unwrap();
    let arrived = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = arrived.clone();
    let server = tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                if read_one_request(&mut tcp).await.is_none() {
                    return;
                }
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = tcp.set_zero_linger();
            });
        }
    });
    let raw = RawUpstream::start().await;
    let store = TestStore::new(Backend::Postgres).await;
    let routes = format!(
        "{}idempotency = \"optional\"\n{}idempotency = \"optional\"\n",
        crate::support::app::route(
            "docs",
            "/docs/{id}",
            &format!("http://{resetting}"),
            "doc:{id}"
        ),
        crate::support::app::route("broken", "/broken/{id}", &raw.url(), "broken:{id}"),
    );
    let app = TestApp::spawn(&store.url, &routes).await;

    let body = problem(
        with_idempotency_key(&app, "/docs/r", "1", Some("reset"), "A", &[]).await,
        502,
    )
    .await;
    assert_eq!(body["type"], "urn:fencegate:problem:upstream-unreachable");
    let head = [(BEHAVIOUR_HEADER, "break-after-head")];
    let body = problem(
        with_idempotency_key(&app, "/broken/b", "1", Some("cut"), "A", &head).await,
        502,
    )
    .await;
    assert_eq!(body["type"], "urn:fencegate:problem:upstream-unreachable");
    for _ in 0..2 {
        let body = problem(
            with_idempotency_key(&app, "/docs/r", "1", Some("reset"), "A", &[]).await,
            409,
        )
        .await;
        assert_eq!(
            body["type"],
            "urn:fencegate:problem:idempotency-outcome-unknown"
        );
        let body = problem(
            with_idempotency_key(&app, "/broken/b", "1", Some("cut"), "A", &head).await,
            409,
        )
        .await;
        assert_eq!(
            body["type"],
            "urn:fencegate:problem:idempotency-outcome-unknown"
        );
    }
    raw.settle(Duration::from_secs(2)).await;
    assert_eq!(
        arrived.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "reset before an answer: forwarded once"
    );
    assert_eq!(raw.writes().len(), 1, "answer broken off: forwarded once");
    let metrics = app.metrics().await;
    assert_eq!(idem_count(&metrics, "outcome_unknown"), 2, "{metrics}");
    server.abort();
}

/// A request of which nothing was sent (the upstream is not listening: 502
/// before a byte left) is forgotten: the same key is a first use again, and
/// is forwarded once the upstream is up.
#[tokio::test]
async fn an_unsent_request_is_forgotten() {
    let store = TestStore::new(Backend::Sqlite).await;
    let held = crate::support::upstream::HeldPort::new();
    let addr = held.addr();
    let app = TestApp::spawn(&store.url, &idem_route(&format!("http://{addr}"), "")).await;
    let body = problem(
        with_idempotency_key(&app, "/docs/u", "1", Some("down"), "A", &[]).await,
        502,
    )
    .await;
    assert_eq!(body["type"], "urn:fencegate:problem:upstream-unreachable");
    let up = Upstream::start_on(held).await;
    let retry = with_idempotency_key(&app, "/docs/u", "1", Some("down"), "A", &[]).await;
    assert_eq!(retry.status(), 200, "forwarded once the upstream is up");
    assert!(retry.headers().get("idempotent-replayed").is_none());
    let again = with_idempotency_key(&app, "/docs/u", "1", Some("down"), "A", &[]).await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(up.applied().len(), 1, "forwarded once");
}

/// The test's own connection to a gateway's store, to plant records as a
/// gateway (or a crash) would have left them, and to count them.
enum Db {
    Pg(sqlx::PgConnection),
    Lite(sqlx::SqliteConnection),
}

impl Db {
    async fn open(store: &TestStore) -> Db {
        use sqlx::Connection;
        if store.url.starts_with("sqlite:") {
            Db::Lite(sqlx::SqliteConnection::connect(&store.url).await.unwrap())
        } else {
            Db::Pg(sqlx::PgConnection::connect(&store.url).await.unwrap())
        }
    }

    /// Writes `n` records of the route `docs` and method POST, keys
    /// `{prefix}1..={prefix}n`, in `state` with the given fingerprint,
    /// in flight until and expiring `in_flight_s` and `expires_s` seconds
    /// from now (negative: in the past).
    #[allow(clippy::too_many_arguments)]
    async fn plant(
        &mut self,
        prefix: &str,
        n: i64,
        state: &str,
        fingerprint: &[u8],
        in_flight_s: i64,
        expires_s: i64,
    ) {
        match self {
            Db::Pg(c) => {
                sqlx::query(
                    "INSERT INTO idempotency \
                     (route, method, idem_key, fingerprint, state, in_flight_until, expires_at) \
                     SELECT 'docs', 'POST', $1 || n, $2, $3, \
                            now() + $4 * interval '1 second', now() + $5 * interval '1 second' \
                       FROM generate_series(1, $6) AS n",
                )
                .bind(prefix)
                .bind(fingerprint)
                .bind(state)
                .bind(in_flight_s as f64)
                .bind(expires_s as f64)
                .bind(n)
                .execute(&mut *c)
                .await
                .unwrap();
            }
            Db::Lite(c) => {
                let now_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis() as i64;
                sqlx::query(
                    "WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < ?6) \
                     INSERT INTO idempotency \
                     (route, method, idem_key, fingerprint, state, in_flight_until, expires_at) \
                     SELECT 'docs', 'POST', ?1 || n, ?2, ?3, ?4, ?5 FROM s",
                )
                .bind(prefix)
                .bind(fingerprint)
                .bind(state)
                .bind(now_ms + in_flight_s * 1000)
                .bind(now_ms + expires_s * 1000)
                .bind(n)
                .execute(&mut *c)
                .await
                .unwrap();
            }
        }
    }

    /// The highest token the store holds for `key`.
    async fn fence(&mut self, key: &str) -> Option<i64> {
        let sql = "SELECT highest_token FROM fences WHERE resource_key = $1";
        match self {
            Db::Pg(c) => sqlx::query_scalar(sql).bind(key).fetch_optional(c).await,
            Db::Lite(c) => sqlx::query_scalar(sql).bind(key).fetch_optional(c).await,
        }
        .unwrap()
    }

    /// Runs `sql`, written for this backend.
    async fn run(&mut self, sql: &str) {
        match self {
            Db::Pg(c) => sqlx::raw_sql(sql).execute(c).await.map(drop),
            Db::Lite(c) => sqlx::raw_sql(sql).execute(c).await.map(drop),
        }
        .unwrap()
    }

    /// Records whose key starts with `prefix`.
    async fn count(&mut self, prefix: &str) -> i64 {
        let like = format!("{prefix}%");
        match self {
            Db::Pg(c) => {
                sqlx::query_scalar("SELECT count(*) FROM idempotency WHERE idem_key LIKE $1")
                    .bind(like)
                    .fetch_one(&mut *c)
                    .await
                    .unwrap()
            }
            Db::Lite(c) => {
                sqlx::query_scalar("SELECT count(*) FROM idempotency WHERE idem_key LIKE ?1")
                    .bind(like)
                    .fetch_one(&mut *c)
                    .await
                    .unwrap()
            }
        }
    }
}

/// A gateway with `[store] idempotency_purge_interval_ms = 100`, its store
/// timeout at 1.5 s, in `mode`.
async fn purging_gateway(store: &TestStore, mode: &str, upstream: &str) -> TestApp {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [store]\nurl = \"{}\"\nmode = \"{mode}\"\ntimeout_ms = 1500\n\
         idempotency_purge_interval_ms = 100\n{}",
        store.url,
        idem_route(upstream, "")
    );
    TestApp::from_text(&text).await
}

/// A running gateway purges expired records by itself, more than one
/// batch's worth (batches of `PURGE_BATCH`), and leaves live ones alone —
/// those it wrote and those it did not.
#[tokio::test]
async fn a_running_gateway_purges_expired_records() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let app = purging_gateway(&store, "single", &up.url()).await;
        assert_eq!(
            with_idempotency_key(&app, "/docs/l", "1", Some("live-by-gateway"), "A", &[])
                .await
                .status(),
            200
        );
        let mut db = Db::open(&store).await;
        let expired = 3 * fencegate::store::PURGE_BATCH + 7;
        db.plant("old-", expired, "done", b"x", -3600, -3600).await;
        db.plant("live-", 50, "done", b"x", -3600, 3600).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while db.count("old-").await > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{backend:?}: expired records left: {}",
                db.count("old-").await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            db.count("live-").await,
            51,
            "{backend:?}: live records stay"
        );
        let replay =
            with_idempotency_key(&app, "/docs/l", "1", Some("live-by-gateway"), "A", &[]).await;
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(up.applied().len(), 1);
    }
}

/// Shared mode: two instances purge the same store at once, and neither
/// waits on rows another transaction holds locked (the batches skip them):
/// while a transaction keeps some expired rows locked, every other expired
/// row goes; the locked ones go once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_purging_at_once_skip_locked_rows() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let a = purging_gateway(&store, "shared", &up.url()).await;
    let b = purging_gateway(&store, "shared", &up.url()).await;
    let mut db = Db::open(&store).await;
    // Rows that expire in 2 s, locked before then (the purges run every
    // 100 ms), and expired while locked; written first, they come first in
    // the batches. Then a few batches' worth of expired rows.
    db.plant("held-", 20, "done", b"x", 2, 2).await;
    let holder = PgHolder::begin(
        &store.url,
        "SELECT 1 FROM idempotency WHERE idem_key LIKE 'held-%' FOR UPDATE",
    )
    .await;
    db.plant("live-", 20, "unknown", b"x", -3600, 3600).await;
    tokio::time::sleep(Duration::from_millis(2300)).await;
    db.plant(
        "old-",
        4 * fencegate::store::PURGE_BATCH,
        "done",
        b"x",
        -3600,
        -3600,
    )
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while db.count("old-").await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expired records left while others were locked: {}",
            db.count("old-").await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(db.count("held-").await, 20, "locked rows are skipped");
    holder.commit().await;
    while db.count("held-").await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "rows no longer locked were not purged"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(db.count("live-").await, 20, "live records stay");
    // Both instances still serve writes with an Idempotency-Key.
    for (app, key) in [(&a, "after-a"), (&b, "after-b")] {
        assert_eq!(
            with_idempotency_key(app, "/docs/s", "1", Some(key), "A", &[])
                .await
                .status(),
            200
        );
    }
}

/// What a crash between writing a first use's in-flight record and
/// forwarding it leaves (single mode writes them in separate statements;
/// shared mode in one, with the fence's marker): a record in flight for a
/// request that never left. Duplicates hear "in progress" (with
/// Retry-After) while its time runs, then "outcome unknown": the gateway
/// cannot know that nothing was sent, and never forwards it.
#[tokio::test]
async fn a_record_left_by_a_crash_before_the_forward_is_never_forwarded() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let app = TestApp::spawn(&store.url, &idem_route(&up.url(), "")).await;
        let mut headers = http::HeaderMap::new();
        headers.insert("x-fence-token", "1".parse().unwrap());
        headers.insert("content-type", "text/plain".parse().unwrap());
        let fp = fencegate::idempotency::fingerprint(
            &http::Method::POST,
            "/docs/c",
            &headers,
            &bytes::Bytes::from_static(b"A"),
        );
        let mut db = Db::open(&store).await;
        db.plant("running", 1, "in_flight", &fp, 30, 3600).await;
        db.plant("crashed", 1, "in_flight", &fp, -1, 3600).await;
        let running = with_idempotency_key(&app, "/docs/c", "1", Some("running1"), "A", &[]).await;
        assert!(running.headers().contains_key("retry-after"));
        let body = problem(running, 409).await;
        assert_eq!(
            body["type"],
            "urn:fencegate:problem:idempotency-in-progress"
        );
        let body = problem(
            with_idempotency_key(&app, "/docs/c", "1", Some("crashed1"), "A", &[]).await,
            409,
        )
        .await;
        assert_eq!(
            body["type"], "urn:fencegate:problem:idempotency-outcome-unknown",
            "{backend:?}"
        );
        assert!(up.requests().is_empty(), "{backend:?}: nothing forwarded");
    }
}

/// Shared mode writes the fence's marker and the in-flight record in one
/// statement: a stale first use is refused and leaves no record (its key
/// stays free), a first use is forwarded once and replayed after, also by
/// the other instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_mode_decides_the_fence_and_the_record_together() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let a = purging_gateway(&store, "shared", &up.url()).await;
    let b = purging_gateway(&store, "shared", &up.url()).await;
    assert_eq!(a.put("/docs/f", Some("5"), "plain").await.status(), 200);
    problem(
        with_idempotency_key(&b, "/docs/f", "4", Some("stale"), "A", &[]).await,
        409,
    )
    .await;
    let mut db = Db::open(&store).await;
    assert_eq!(db.count("stale").await, 0, "a refusal leaves no record");
    let first = with_idempotency_key(&b, "/docs/f", "6", Some("stale"), "B", &[]).await;
    assert_eq!(first.status(), 200, "the key was not taken");
    assert!(first.headers().get("idempotent-replayed").is_none());
    let replay = with_idempotency_key(&a, "/docs/f", "6", Some("stale"), "B", &[]).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let tokens: Vec<_> = up.applied().iter().map(|w| w.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6)]);
}

/// Single mode, on both backends: a first use whose token the store must
/// decide (memory does not know it as the key's durable one) has its
/// in-flight record written in the fence decision's own transaction. So a
/// record that cannot be written takes the decision with it: the key's
/// token is not recorded either (written in two commits, the token would
/// be). A stale token of a key memory does not know is refused by the
/// store and leaves no record; the key stays free for the right token.
#[tokio::test]
async fn single_mode_decides_the_fence_and_the_record_together() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let app = purging_gateway(&store, "single", &up.url()).await;
        let mut db = Db::open(&store).await;
        // Any insert of the record `poisoned` fails.
        db.run(match backend {
            Backend::Sqlite => {
                "CREATE TRIGGER poison BEFORE INSERT ON idempotency \
                 WHEN NEW.idem_key = 'poisoned' BEGIN SELECT RAISE(ABORT, 'poisoned'); END"
            }
            Backend::Postgres => {
                "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ \
                 BEGIN IF NEW.idem_key = 'poisoned' THEN RAISE EXCEPTION 'poisoned'; END IF; \
                 RETURN NEW; END $$; \
                 CREATE TRIGGER poison BEFORE INSERT ON idempotency \
                 FOR EACH ROW EXECUTE FUNCTION poison()"
            }
        })
        .await;
        let body = problem(
            with_idempotency_key(&app, "/docs/atom", "7", Some("poisoned"), "A", &[]).await,
            503,
        )
        .await;
        assert_eq!(
            body["type"], "urn:fencegate:problem:store-unavailable",
            "{backend:?}"
        );
        assert_eq!(
            db.fence("doc:atom").await,
            None,
            "{backend:?}: the decision went with the record"
        );
        assert_eq!(db.count("poisoned").await, 0, "{backend:?}");
        db.run(match backend {
            Backend::Sqlite => "DROP TRIGGER poison",
            Backend::Postgres => "DROP TRIGGER poison ON idempotency",
        })
        .await;
        let first = with_idempotency_key(&app, "/docs/atom", "7", Some("poisoned"), "A", &[]).await;
        assert_eq!(first.status(), 200, "{backend:?}: the retry is a first use");
        assert_eq!(db.fence("doc:atom").await, Some(7), "{backend:?}");

        // A key memory has never seen, its token recorded at 10.
        db.run(match backend {
            Backend::Sqlite => {
                "INSERT INTO fences (resource_key, highest_token, updated_at) \
                 VALUES ('doc:cold', 10, 0)"
            }
            Backend::Postgres => {
                "INSERT INTO fences (resource_key, highest_token, updated_at) \
                 VALUES ('doc:cold', 10, now())"
            }
        })
        .await;
        let body = problem(
            with_idempotency_key(&app, "/docs/cold", "5", Some("cold"), "A", &[]).await,
            409,
        )
        .await;
        assert_eq!(body["type"], "urn:fencegate:problem:stale-token");
        assert_eq!(db.count("cold").await, 0, "{backend:?}: no record");
        let first = with_idempotency_key(&app, "/docs/cold", "10", Some("cold"), "B", &[]).await;
        assert_eq!(first.status(), 200, "{backend:?}: the key stayed free");
        let replay = with_idempotency_key(&app, "/docs/cold", "10", Some("cold"), "B", &[]).await;
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        let tokens: Vec<_> = up.applied().iter().map(|w| w.token).collect();
        assert_eq!(tokens, vec![Some(7), Some(10)], "{backend:?}");
    }
}

/// The store of `test_store`, opened as a single-mode gateway would.
async fn open_store(test_store: &TestStore) -> Arc<fencegate::store::FenceStore> {
    let config = fencegate::config::Config::from_toml(
        "t.toml",
        &crate::support::app::config_text(&test_store.url, ""),
        Vec::new(),
    )
    .unwrap();
    Arc::new(
        fencegate::store::FenceStore::open(&config.store)
            .await
            .unwrap(),
    )
}

/// The record of `key` on the route `docs`, method POST.
fn docs_post(key: &str) -> fencegate::store::RecordId<'_> {
    fencegate::store::RecordId {
        route: "docs",
        method: "POST",
        key,
    }
}

/// An in-flight record of `id` (fingerprint `fp`) that no test outlives:
/// in flight for 30 s, kept for 60.
fn long_lived(id: fencegate::store::RecordId<'_>, attempt: i64) -> fencegate::store::Begin<'_> {
    fencegate::store::Begin {
        id,
        fingerprint: b"fp",
        attempt,
        in_flight: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    }
}

/// The store's statements find their rows by index however the tables
/// grew since their plans were cached. Postgres keeps a generic plan per
/// prepared statement after five runs, planned against the table as it was
/// then: a batch statement first planned against a new, small table would
/// scan the whole table on every run once it has grown (until autovacuum
/// next analyzes it). Counted by Postgres itself: first uses and replays
/// on a table that grew by 30,000 rows under the gateway's cached plans
/// cause no sequential scan of `idempotency` or `fences`.
#[tokio::test]
async fn cached_plans_never_scan_a_grown_table() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let mut db = Db::open(&store).await;
    let Db::Pg(pg) = &mut db else {
        unreachable!("a Postgres store")
    };
    // Read once every gateway connection is gone: a backend flushes its
    // statistics when it exits, so counts read earlier could miss scans.
    async fn scans(pg: &mut sqlx::PgConnection) -> Vec<(String, i64)> {
        let mut left = i64::MAX;
        for _ in 0..200 {
            left = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = 'fencegate'",
            )
            .fetch_one(&mut *pg)
            .await
            .unwrap();
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(left, 0, "the gateway's connections are still open");
        sqlx::query_as(
            "SELECT relname::text, seq_scan FROM pg_stat_user_tables \
             WHERE relname IN ('idempotency', 'fences') ORDER BY relname",
        )
        .fetch_all(&mut *pg)
        .await
        .unwrap()
    }
    // Migrations (index builds read the new tables) are counted before.
    TestApp::spawn(&store.url, &idem_route(&up.url(), ""))
        .await
        .stop()
        .await;
    let before = scans(pg).await;

    let app = TestApp::spawn(&store.url, &idem_route(&up.url(), "")).await;
    // Twenty first uses, each followed by its replay (which this instance
    // answers from memory).
    async fn round(app: &TestApp, from: usize) {
        for n in from..from + 20 {
            let (path, key) = (format!("/docs/g{}", n % 5), format!("w{n}"));
            for _ in 0..2 {
                let resp = with_idempotency_key(app, &path, "1", Some(&key), "A", &[]).await;
                assert_eq!(resp.status(), 200);
            }
        }
    }
    round(&app, 0).await;
    // The table grows under the cached plans.
    sqlx::query(
        "INSERT INTO idempotency \
         (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt, \
          status, headers, body) \
         SELECT 'docs', 'POST', 'bulk-' || n, '\\x00'::bytea, 'done', now(), \
                now() + interval '1 hour', n, 200, '[]'::bytea, 'ok'::bytea \
           FROM generate_series(1, 30000) AS n",
    )
    .execute(&mut *pg)
    .await
    .unwrap();
    round(&app, 20).await;
    app.stop().await;
    let after = scans(pg).await;
    assert_eq!(up.requests().len(), 40, "one forward per first use");
    assert_eq!(after, before, "sequential scans of the store's tables");
}

/// Fence decisions that carry records, group-committed, straight against
/// the store on both backends: 240 at once over 12 keys, with tokens that
/// rise and fall and 48 records, four per key. A record is written only
/// with a token its batch accepted, at most once; a decision whose token
/// was accepted but whose record was not lost to a duplicate that wrote
/// it; every key ends at its highest token, and every record the store
/// holds was written by exactly one decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_decisions_write_records_only_with_accepted_tokens() {
    use fencegate::store::Found;
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let test_store = TestStore::new(backend).await;
        let store = open_store(&test_store).await;
        let mut tasks = Vec::new();
        for i in 0..240i64 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                // Record `k{n}` always goes with key `r{n % 12}`.
                let (record, key, token) = (i % 48, format!("r{}", i % 12), (i * 7) % 13);
                let idem_key = format!("k{record}");
                let begin = long_lived(docs_post(&idem_key), i);
                let decided = store.decide_with_record(&key, token, &begin).await.unwrap();
                (record, key, token, decided)
            }));
        }
        let mut highest = std::collections::HashMap::new();
        let mut writers = std::collections::HashMap::new();
        let mut lost = Vec::new();
        for t in tasks {
            let (record, key, token, decided) = t.await.unwrap();
            let top = highest.entry(key.clone()).or_insert(token);
            *top = (*top).max(token);
            assert!(
                decided.highest >= token,
                "{backend:?}: {key} answered {} below {token}",
                decided.highest
            );
            if decided.written {
                assert_eq!(
                    decided.highest, token,
                    "{backend:?}: record k{record} written with a refused token"
                );
                assert!(
                    writers.insert(record, token).is_none(),
                    "{backend:?}: record k{record} written twice"
                );
            } else if decided.highest == token {
                lost.push(record);
            }
        }
        for record in lost {
            assert!(
                writers.contains_key(&record),
                "{backend:?}: k{record}'s token was accepted, its record not written, \
                 and nobody wrote it"
            );
        }
        for (key, top) in &highest {
            assert_eq!(store.record(key, 0).await.unwrap(), *top, "{backend:?}");
        }
        for record in 0..48 {
            let idem_key = format!("k{record}");
            let found = store
                .idem_lookup(docs_post(&idem_key), b"fp")
                .await
                .unwrap();
            match writers.contains_key(&record) {
                true => assert!(
                    matches!(found, Found::InFlight { .. }),
                    "{backend:?} k{record}: {found:?}"
                ),
                false => assert_eq!(found, Found::Absent, "{backend:?} k{record}"),
            }
        }
        assert!(
            !writers.is_empty(),
            "{backend:?}: some records were written"
        );
        store.close().await;
    }
}

/// A gateway that stalled past its record's time (so that a duplicate took
/// the expired record over) cannot write into the newer attempt: its late
/// answer, "unknown" or forgetting match its own attempt only.
#[tokio::test]
async fn a_late_answer_never_lands_in_a_newer_attempt() {
    use fencegate::store::{Begin, Found, StoredAnswer};
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let test_store = TestStore::new(backend).await;
        let store = open_store(&test_store).await;
        let id = docs_post("k");
        let begin = |attempt| Begin {
            id,
            fingerprint: b"fp",
            attempt,
            in_flight: Duration::from_millis(100),
            ttl: Duration::from_millis(100),
        };
        let answer = |body: &'static [u8]| StoredAnswer {
            status: 200,
            headers: Vec::new(),
            body: bytes::Bytes::from_static(body),
        };
        assert!(store.idem_begin(&begin(1)).await.unwrap());
        assert!(
            !store.idem_begin(&begin(2)).await.unwrap(),
            "live: not taken"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(
            store.idem_begin(&begin(2)).await.unwrap(),
            "expired: taken over"
        );
        // The first attempt's gateway wakes up late.
        store.idem_complete(id, 1, &answer(b"late")).await.unwrap();
        store.idem_unknown(id, 1).await.unwrap();
        store.idem_forget(id, 1).await.unwrap();
        assert!(
            matches!(
                store.idem_lookup(id, b"fp").await.unwrap(),
                Found::InFlight { .. }
            ),
            "{backend:?}: the newer attempt is untouched"
        );
        store.idem_complete(id, 2, &answer(b"mine")).await.unwrap();
        assert_eq!(
            store.idem_lookup(id, b"fp").await.unwrap(),
            Found::Done(answer(b"mine"))
        );
        store.close().await;
    }
}

/// Single mode on Postgres: a record that another transaction inserts
/// while a batch of records runs, after the batch's snapshot (one of the
/// gateway's batches that timed out and still runs, or a second gateway
/// that believes it is the single writer). The batch's upsert waits for
/// that transaction and then finds its record live: the first use is
/// answered by that record (another request's: 422) and not forwarded. A
/// batch whose insert did not check the key again (a plain insert after a
/// lookup in its snapshot, with no fallback) answers 503; one that
/// overwrote the record would forward.
#[tokio::test]
async fn a_record_inserted_while_its_batch_runs_is_found_live() {
    use sqlx::Connection;
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &idem_route(&up.url(), "")).await;
    let warm = with_idempotency_key(&app, "/docs/x", "5", Some("warm"), "warm", &[]).await;
    assert_eq!(warm.status(), 200);

    let mut other = sqlx::PgConnection::connect(&store.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency \
         (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt) \
         VALUES ('docs', 'POST', 'held', '\\x00', 'in_flight', now() + interval '1 minute', \
                 now() + interval '1 day', 42)",
    )
    .execute(&mut other)
    .await
    .unwrap();
    let (resp, ()) = tokio::join!(
        with_idempotency_key(&app, "/docs/x", "5", Some("held"), "A", &[]),
        async {
            // The batch has started, and waits for this transaction.
            tokio::time::sleep(Duration::from_millis(300)).await;
            sqlx::query("COMMIT").execute(&mut other).await.unwrap();
        }
    );
    // The record found is another request's (its fingerprint): 422.
    let body = problem(resp, 422).await;
    assert_eq!(
        body["type"], "urn:fencegate:problem:idempotency-key-reused",
        "{body}"
    );
    assert_eq!(up.bodies_on("/docs/x"), ["warm"], "not forwarded");
}

/// The forgets of records of requests never sent (`idempotency::Forgets`)
/// are known per record and attempt from the moment they are asked for
/// until they land, and a read of the record names its attempt, which is
/// how a retry tells such a record from a live first use's. Two forgets of
/// one key (a first use and a retry that both failed before forwarding)
/// are both known; the one whose record does not exist lands at once, the
/// other waits while the test holds the record's row locked and lands once
/// the lock goes. A forget of another
/// attempt or key is not taken for them.
#[tokio::test]
async fn forgets_are_known_per_attempt_until_they_land() {
    use fencegate::store::{Begin, Found};
    use sqlx::Connection;
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_store(&test_store).await;
    let (id, other) = (docs_post("k"), docs_post("other"));
    let begin = Begin {
        id,
        fingerprint: b"fp",
        attempt: 1,
        in_flight: Duration::from_secs(60),
        ttl: Duration::from_secs(60),
    };
    assert!(store.idem_begin(&begin).await.unwrap());
    let read = store.idem_read(id, b"fp").await.unwrap();
    assert_eq!(read.attempt, Some(1), "a read names the record's attempt");
    let absent = store.idem_read(other, b"fp").await.unwrap();
    assert_eq!(absent.attempt, None);

    let mut holder = sqlx::PgConnection::connect(&test_store.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency WHERE idem_key = 'k' FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();

    let runtime = tokio::runtime::Handle::current();
    let forgets = Arc::new(fencegate::idempotency::Forgets::new(
        (*store).clone(),
        runtime,
    ));
    let until = std::time::Instant::now() + Duration::from_secs(60);
    // This test's runtime has one thread: neither task runs before the
    // first await below, so both forgets are still to land here.
    forgets.later(id, 1, until);
    forgets.later(id, 2, until);
    assert!(forgets.forgetting(id, 1) && forgets.forgetting(id, 2));
    assert!(!forgets.forgetting(id, 3), "another attempt");
    assert!(!forgets.forgetting(other, 1), "another key");

    let waiting = |attempt| {
        let forgets = forgets.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while forgets.forgetting(id, attempt) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the forget of attempt {attempt} never landed"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    waiting(2).await;
    // Attempt 1's tries wait on the locked row (and time out, and try
    // again) for as long as it is locked.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        forgets.forgetting(id, 1),
        "attempt 1's record is still there"
    );
    assert!(matches!(
        store.idem_lookup(id, b"fp").await.unwrap(),
        Found::InFlight { .. }
    ));
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    waiting(1).await;
    assert_eq!(store.idem_lookup(id, b"fp").await.unwrap(), Found::Absent);
    store.close().await;
}

/// Runs `sql` on the store from the test's own connection (a store that
/// lost records, a table held locked).
async fn on_store(store: &TestStore, sql: &str) {
    use sqlx::Connection;
    if store.url.starts_with("sqlite:") {
        let mut c = sqlx::SqliteConnection::connect(&store.url).await.unwrap();
        sqlx::query(sql).execute(&mut c).await.unwrap();
    } else {
        let mut c = sqlx::PgConnection::connect(&store.url).await.unwrap();
        sqlx::query(sql).execute(&mut c).await.unwrap();
    }
}

/// A gateway whose records live 2.5 s: a TTL of 1 s, in flight for at
/// most 0.5 + 2 x 0.5 + 1 s.
async fn short_lived(store: &TestStore, mode: &str, upstream: &str) -> TestApp {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [store]\nurl = \"{}\"\nmode = \"{mode}\"\ntimeout_ms = 500\n{}",
        store.url,
        idem_route(upstream, "idempotency_ttl_s = 1\ntimeout_ms = 500\n")
    );
    TestApp::from_text(&text).await
}

/// Completed records are answered from memory: with every record gone from
/// the store, a replay still gets its answer and a reuse its 422, without
/// a store read — but only while the record would live. Once it has
/// expired (whether the store still holds it, expired, or lost or purged
/// it), memory does not replay it: the same request is a first use again,
/// forwarded a second time, as the retention policy says.
#[tokio::test]
async fn an_expired_record_is_not_replayed_from_memory() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let app = short_lived(&store, "single", &up.url()).await;
        let started = tokio::time::Instant::now();
        for key in ["lost", "kept"] {
            let first = with_idempotency_key(&app, "/docs/m", "1", Some(key), "A", &[]).await;
            assert_eq!(first.status(), 200, "{backend:?}");
        }
        // The store loses one record; memory knows both.
        on_store(&store, "DELETE FROM idempotency WHERE idem_key = 'lost'").await;
        for key in ["lost", "kept"] {
            let replay = with_idempotency_key(&app, "/docs/m", "1", Some(key), "A", &[]).await;
            assert_eq!(
                replay.headers()["idempotent-replayed"],
                "true",
                "{backend:?} {key}"
            );
            problem(
                with_idempotency_key(&app, "/docs/m", "1", Some(key), "B", &[]).await,
                422,
            )
            .await;
        }
        assert_eq!(up.applied().len(), 2, "{backend:?}");
        // Past the records' 2.5 s.
        tokio::time::sleep_until(started + Duration::from_millis(2900)).await;
        for key in ["lost", "kept"] {
            let again = with_idempotency_key(&app, "/docs/m", "1", Some(key), "A", &[]).await;
            assert_eq!(again.status(), 200, "{backend:?} {key}");
            assert!(
                again.headers().get("idempotent-replayed").is_none(),
                "{backend:?} {key}: an expired record was replayed"
            );
        }
        assert_eq!(up.applied().len(), 4, "{backend:?}: forwarded again");
        let metrics = app.metrics().await;
        assert_eq!(idem_count(&metrics, "replayed"), 2, "{metrics}");
        assert_eq!(idem_count(&metrics, "reused"), 2, "{metrics}");
        assert_eq!(idem_count(&metrics, "first"), 4, "{metrics}");
    }
}

/// Shared mode: an instance replays what another completed, reading the
/// store once; from then on memory answers it (the records gone from the
/// store, both still replay and refuse a reuse). Forwarded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_replays_what_one_completed() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let a = purging_gateway(&store, "shared", &up.url()).await;
    let b = purging_gateway(&store, "shared", &up.url()).await;
    let first = with_idempotency_key(&a, "/docs/s", "3", Some("shared-1"), "A", &[]).await;
    assert_eq!(first.status(), 200);
    let from_store = with_idempotency_key(&b, "/docs/s", "3", Some("shared-1"), "A", &[]).await;
    assert_eq!(from_store.headers()["idempotent-replayed"], "true");
    on_store(&store, "DELETE FROM idempotency").await;
    for app in [&a, &b] {
        let replay = with_idempotency_key(app, "/docs/s", "3", Some("shared-1"), "A", &[]).await;
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.headers()["x-upstream"], "recorder");
        problem(
            with_idempotency_key(app, "/docs/s", "3", Some("shared-1"), "B", &[]).await,
            422,
        )
        .await;
    }
    assert_eq!(up.applied().len(), 1, "forwarded once");
    assert_eq!(idem_count(&b.metrics().await, "replayed"), 2);
}

/// A replay memory does not know (here: an answer too large to cache,
/// 600 KB, stored but read from the store each time) whose token is stale
/// by now, in single mode; and one on an instance that never saw the
/// record, in shared mode: the fence refuses the token, and the key's
/// record answers instead — the write did happen. A stale first use is
/// still refused and leaves no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_memory_does_not_know_is_served_whatever_the_fence_says() {
    let big = [("x-test-response-bytes", "600000")];
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &idem_route(&up.url(), "")).await;
    let first = with_idempotency_key(&app, "/docs/x", "5", Some("big"), "A", &big).await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.bytes().await.unwrap().len(), 600_000);
    assert_eq!(app.put("/docs/x", Some("6"), "newer").await.status(), 200);
    for _ in 0..2 {
        let replay = with_idempotency_key(&app, "/docs/x", "5", Some("big"), "A", &big).await;
        assert_eq!(replay.status(), 200, "the write with 5 did happen");
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.bytes().await.unwrap().len(), 600_000);
    }
    problem(
        with_idempotency_key(&app, "/docs/x", "5", Some("other"), "A", &[]).await,
        409,
    )
    .await;
    let mut db = Db::open(&store).await;
    assert_eq!(db.count("other").await, 0, "a refusal leaves no record");
    assert_eq!(up.applied().len(), 2);

    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let a = purging_gateway(&store, "shared", &up.url()).await;
    let b = purging_gateway(&store, "shared", &up.url()).await;
    assert_eq!(
        with_idempotency_key(&a, "/docs/y", "5", Some("five"), "A", &[])
            .await
            .status(),
        200
    );
    assert_eq!(a.put("/docs/y", Some("6"), "newer").await.status(), 200);
    let replay = with_idempotency_key(&b, "/docs/y", "5", Some("five"), "A", &[]).await;
    assert_eq!(replay.status(), 200, "the write with 5 did happen");
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(up.applied().len(), 2);
}

/// Group commit of records, straight against the store on both backends:
/// 300 first uses at once over 20 keys, each with its own attempt. Exactly
/// one per key writes its record (batches hold duplicates of one key, and
/// the others lose to it); only that attempt's answer is stored, the
/// losers' answers change nothing; the record replays the winner's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_records_admit_one_first_use_per_key() {
    use fencegate::store::{Found, StoredAnswer};
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let test_store = TestStore::new(backend).await;
        let store = open_store(&test_store).await;
        let mut tasks = Vec::new();
        for i in 0..300i64 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let key = format!("k{}", i % 20);
                let id = docs_post(&key);
                let begin = long_lived(id, i);
                let won = store.idem_begin(&begin).await.unwrap();
                let answer = StoredAnswer {
                    status: 200,
                    headers: vec![("x-attempt".into(), i.to_string().into_bytes())],
                    body: bytes::Bytes::from(format!("answer of {i}")),
                };
                let stored = store.idem_complete(id, i, &answer).await.unwrap();
                assert_eq!(stored, won, "{backend:?} attempt {i}");
                (key, i, won)
            }));
        }
        let mut winners = std::collections::HashMap::new();
        for t in tasks {
            let (key, attempt, won) = t.await.unwrap();
            if won {
                assert!(
                    winners.insert(key.clone(), attempt).is_none(),
                    "{backend:?}: two first uses of {key}"
                );
            }
        }
        assert_eq!(winners.len(), 20, "{backend:?}: one first use per key");
        for (key, attempt) in winners {
            let id = docs_post(&key);
            match store.idem_lookup(id, b"fp").await.unwrap() {
                Found::Done(a) => {
                    assert_eq!(a.body, format!("answer of {attempt}"), "{backend:?}")
                }
                other => panic!("{backend:?} {key}: {other:?}"),
            }
        }
        store.close().await;
    }
}

/// A trigger on `idempotency` that refuses the first row of `events`
/// (`INSERT`, `INSERT OR UPDATE`) matching `when` with an `ERROR`, and lets
/// every later one through; [`refusals`] counts the rows it saw. The count
/// is a sequence's, which no rollback takes back.
async fn refuse_once(pg: &mut sqlx::PgConnection, events: &str, when: &str) {
    sqlx::raw_sql(&format!(
        "CREATE SEQUENCE refusals;
         CREATE FUNCTION refuse_once() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('refusals') = 1 THEN RAISE EXCEPTION 'refused once'; END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_once BEFORE {events} ON idempotency FOR EACH ROW
             WHEN ({when}) EXECUTE FUNCTION refuse_once();"
    ))
    .execute(pg)
    .await
    .unwrap();
}

/// How many rows [`refuse_once`]'s trigger saw.
async fn refusals(pg: &mut sqlx::PgConnection) -> i64 {
    let (seen,): (i64,) = sqlx::query_as("SELECT last_value FROM refusals")
        .fetch_one(pg)
        .await
        .unwrap();
    seen
}

/// Record writes that queue into one batch of records (single mode,
/// Postgres): a batch with a duplicate of the record `blocker` waits for
/// the test's lock on that record, and whatever `queue` submits meanwhile
/// goes into the next batch, whole, once the lock goes. Returns what
/// `queue`'s tasks answered.
async fn in_one_batch<T: Send + 'static>(
    test_store: &TestStore,
    store: &Arc<fencegate::store::FenceStore>,
    queue: impl FnOnce() -> Vec<tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    let blocker = docs_post("blocker");
    assert!(store.idem_begin(&long_lived(blocker, 1)).await.unwrap());
    let holder = PgHolder::begin(
        &test_store.url,
        "SELECT 1 FROM idempotency WHERE idem_key = 'blocker' FOR UPDATE",
    )
    .await;
    let s = store.clone();
    let waiting = tokio::spawn(async move { s.idem_begin(&long_lived(blocker, 2)).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let queued = queue();
    tokio::time::sleep(Duration::from_millis(200)).await;
    holder.commit().await;
    assert!(
        !waiting.await.unwrap().unwrap(),
        "blocker is live: not taken"
    );
    let mut answers = Vec::new();
    for q in queued {
        answers.push(q.await.unwrap());
    }
    answers
}

/// A first use's answer and a duplicate's in-flight record of the same
/// record in one batch of records: the batch runs as two statements,
/// answers first, since Postgres does not say in which order the parts of
/// one statement run, nor what one sees of a row the other changed (15
/// happens to run the in-flight part first, and then gives the same
/// answers in one statement). The answer is stored, the duplicate finds
/// the record live and is not written.
#[tokio::test]
async fn an_answer_and_a_duplicate_in_one_batch() {
    use fencegate::store::{Found, StoredAnswer};
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_store(&test_store).await;
    let x = docs_post("x");
    assert!(store.idem_begin(&long_lived(x, 1)).await.unwrap());
    let answer = StoredAnswer {
        status: 201,
        headers: vec![("x-answer".into(), b"first".to_vec())],
        body: bytes::Bytes::from_static(b"created"),
    };
    let stored = answer.clone();
    let answers = in_one_batch(&test_store, &store, || {
        let (s1, s2) = (store.clone(), store.clone());
        vec![
            tokio::spawn(async move { s1.idem_complete(x, 1, &stored).await.unwrap() }),
            tokio::spawn(async move { s2.idem_begin(&long_lived(x, 2)).await.unwrap() }),
        ]
    })
    .await;
    assert_eq!(
        answers,
        vec![true, false],
        "stored; the duplicate not written"
    );
    assert_eq!(
        store.idem_lookup(x, b"fp").await.unwrap(),
        Found::Done(answer)
    );
    store.close().await;
}

/// A plain answer to store: 200, no headers, `done`.
fn done_answer() -> fencegate::store::StoredAnswer {
    fencegate::store::StoredAnswer {
        status: 200,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"done"),
    }
}

/// Every kind of write in one batch of records (single mode, Postgres:
/// one statement): two first uses' decisions on one key with their
/// records (tokens 7 and 9), a first use's record whose token memory knew
/// (no decision), and an answer. Only the higher token's record is
/// written, and the lower decision hears the key's highest token (9) and
/// that its record was not; the plain record is written and the answer
/// stored; the key ends at 9. A statement that wrote a record for every
/// decision, or judged a record by its own token alone, fails here.
#[tokio::test]
async fn decisions_records_and_answers_in_one_batch() {
    use fencegate::store::Found;
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_store(&test_store).await;
    let (lower, higher, plain, done) = (
        docs_post("lower"),
        docs_post("higher"),
        docs_post("plain"),
        docs_post("done"),
    );
    assert!(store.idem_begin(&long_lived(done, 1)).await.unwrap());
    let answer = done_answer();
    let stored = answer.clone();
    let answers = in_one_batch(&test_store, &store, || {
        let s = [store.clone(), store.clone(), store.clone(), store.clone()];
        let [s1, s2, s3, s4] = s;
        vec![
            tokio::spawn(async move {
                let d = s1
                    .decide_with_record("doc:m", 7, &long_lived(lower, 1))
                    .await;
                let d = d.unwrap();
                (Some(d.highest), d.written)
            }),
            tokio::spawn(async move {
                let d = s2
                    .decide_with_record("doc:m", 9, &long_lived(higher, 1))
                    .await;
                let d = d.unwrap();
                (Some(d.highest), d.written)
            }),
            tokio::spawn(
                async move { (None, s3.idem_begin(&long_lived(plain, 1)).await.unwrap()) },
            ),
            tokio::spawn(async move { (None, s4.idem_complete(done, 1, &stored).await.unwrap()) }),
        ]
    })
    .await;
    assert_eq!(
        answers,
        vec![
            (Some(9), false),
            (Some(9), true),
            (None, true),
            (None, true)
        ],
        "the lower token refused, the higher written; the plain record written; the answer stored"
    );
    assert_eq!(
        store.idem_lookup(lower, b"fp").await.unwrap(),
        Found::Absent
    );
    for id in [higher, plain] {
        let found = store.idem_lookup(id, b"fp").await.unwrap();
        assert!(matches!(found, Found::InFlight { .. }), "{found:?}");
    }
    assert_eq!(
        store.idem_lookup(done, b"fp").await.unwrap(),
        Found::Done(answer)
    );
    assert_eq!(store.record("doc:m", 0).await.unwrap(), 9);
    store.close().await;
}

/// A first use of an Idempotency-Key's decision waits in a batch of records while a plain
/// write's higher token is decided by a fence batch, on another
/// connection, and commits first: the first use's token is then refused
/// when its batch runs (the key's highest token comes back, and no record
/// is written), however the two batchers' statements interleave. A batch
/// of records that judged its token by what memory or its own rows said
/// would write the record, and its first use would be forwarded under a
/// stale token.
#[tokio::test]
async fn a_plain_decision_that_commits_first_refuses_a_waiting_first_use() {
    use fencegate::store::Found;
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_store(&test_store).await;
    let first = docs_post("first");
    let answers = in_one_batch(&test_store, &store, || {
        let (s1, s2) = (store.clone(), store.clone());
        let with_idempotency_key = tokio::spawn(async move {
            let d = s1
                .decide_with_record("doc:p", 7, &long_lived(first, 1))
                .await;
            let d = d.unwrap();
            (d.highest, d.written)
        });
        let plain = tokio::spawn(async move { (s2.record("doc:p", 9).await.unwrap(), true) });
        vec![with_idempotency_key, plain]
    })
    .await;
    assert_eq!(
        answers,
        vec![(9, false), (9, true)],
        "the first use refused at 9, the plain write accepted"
    );
    assert_eq!(
        store.idem_lookup(first, b"fp").await.unwrap(),
        Found::Absent
    );
    store.close().await;
}

/// A batch of records that Postgres refuses with an `ERROR` (here a
/// trigger, once; in the field, a deadlock with another batch of records,
/// one that timed out on the gateway's side and still runs on the server)
/// wrote nothing, so its parts run again alone: the in-flight record is
/// written and the answer stored, and the client of neither hears of the
/// refusal. Counted by the trigger: it fired once in the refused
/// statement, then once in each part.
#[tokio::test]
async fn a_refused_batch_of_records_runs_its_parts_alone() {
    use fencegate::store::Found;
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_store(&test_store).await;
    let (a, b) = (docs_post("a"), docs_post("b"));
    assert!(store.idem_begin(&long_lived(b, 1)).await.unwrap());
    let mut db = Db::open(&test_store).await;
    let Db::Pg(pg) = &mut db else {
        unreachable!("a Postgres store")
    };
    refuse_once(pg, "INSERT OR UPDATE", "NEW.idem_key IN ('a', 'b')").await;
    let answer = done_answer();
    let stored = answer.clone();
    let answers = in_one_batch(&test_store, &store, || {
        let (s1, s2) = (store.clone(), store.clone());
        vec![
            tokio::spawn(async move { s1.idem_begin(&long_lived(a, 1)).await.unwrap() }),
            tokio::spawn(async move { s2.idem_complete(b, 1, &stored).await.unwrap() }),
        ]
    })
    .await;
    assert_eq!(answers, vec![true, true], "written; stored");
    assert!(matches!(
        store.idem_lookup(a, b"fp").await.unwrap(),
        Found::InFlight { .. }
    ));
    assert_eq!(
        store.idem_lookup(b, b"fp").await.unwrap(),
        Found::Done(answer)
    );
    let fired = refusals(pg).await;
    assert_eq!(fired, 3, "refused once, then each part alone");
    store.close().await;
}

/// A batch of records with a fence decision and its in-flight record that
/// Postgres refuses with an `ERROR` (a trigger, once; in the field, a
/// deadlock with another batch of records) wrote nothing, and runs again
/// (its part with records, the only one it has): the token is decided and
/// the record written, and the write never hears of the refusal.
#[tokio::test]
async fn a_refused_batch_of_records_with_a_decision_runs_again() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_store(&test_store).await;
    let mut db = Db::open(&test_store).await;
    let Db::Pg(pg) = &mut db else {
        unreachable!("a Postgres store")
    };
    refuse_once(pg, "INSERT", "true").await;
    let decided = store
        .decide_with_record("doc:x", 7, &long_lived(docs_post("x"), 1))
        .await
        .unwrap();
    assert_eq!((decided.highest, decided.written), (7, true));
    let fired = refusals(pg).await;
    assert_eq!(fired, 2, "refused once, then written");
    store.close().await;
}

/// A batch of in-flight records that times out on the gateway's side and
/// may commit later (Postgres holds the table locked past the store
/// timeout, not past its statement timeout): the first use was answered
/// 503 and not forwarded; whatever the late commit leaves (a record the
/// gateway then forgets, or one in flight, then unknown), retries are never
/// forwarded more than once. Likewise a batch of answers that times out
/// after its request was answered: the answer was given; the record
/// becomes `done` late (a duplicate after that replays it), or stays in
/// flight if the statement never ran (a connection that had not prepared
/// it sends the prepare alone first, and the gateway gave up while that
/// waited too); until then duplicates hear "in progress", never forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_that_commit_late_never_forward_twice() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = Arc::new(short_lived(&store, "single", &up.url()).await);
    let holder = PgHolder::begin(&store.url, "LOCK TABLE idempotency IN EXCLUSIVE MODE").await;
    let held = tokio::time::Instant::now();
    let body = problem(
        with_idempotency_key(&app, "/docs/late", "1", Some("late-begin"), "A", &[]).await,
        503,
    )
    .await;
    assert_eq!(body["type"], "urn:fencegate:problem:store-unavailable");
    assert!(up.requests().is_empty(), "not forwarded");
    // Released before the server's statement timeout (2 x 500 ms): the
    // insert commits after the gateway gave up on it, or never runs (its
    // prepare waited for the lock too).
    tokio::time::sleep_until(held + Duration::from_millis(800)).await;
    holder.commit().await;
    let mut seen = Vec::new();
    for _ in 0..10 {
        let resp =
            with_idempotency_key(&app, "/docs/late", "1", Some("late-begin"), "A", &[]).await;
        seen.push(resp.status().as_u16());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        up.requests().len() <= 1,
        "forwarded more than once: {seen:?}"
    );
    assert!(
        seen.iter().all(|s| [200, 409].contains(s)),
        "retries: {seen:?}"
    );

    // The answer's batch: the upstream holds the request while the table
    // gets locked, so the answer cannot be stored in time. The record is
    // written after this instant and lives 2.5 s.
    let started = tokio::time::Instant::now();
    let first = in_background(
        &app,
        "/docs/late",
        "late-answer",
        &[("x-test-delay-ms", "200")],
    );
    until("the upstream holds it", Duration::from_secs(5), || {
        up.requests()
            .iter()
            .any(|r| r.header("idempotency-key") == Some("late-answer"))
    })
    .await;
    let holder = PgHolder::begin(&store.url, "LOCK TABLE idempotency IN EXCLUSIVE MODE").await;
    let held = tokio::time::Instant::now();
    let answered = first.await.unwrap();
    assert_eq!(answered.status(), 200, "the answer is the truth: given");
    assert!(
        held.elapsed() < Duration::from_millis(800),
        "answered before the store"
    );
    // The gateway has given up on storing the answer (it answered without
    // it): let the statement commit now, well before the server's own
    // statement timeout, which counts from when the statement began and a
    // loaded machine can make that long before `held`.
    holder.commit().await;
    // The answer's statement then runs, and lands a moment later — or never
    // ran at all: a connection that had not prepared it yet sends only the
    // prepare first, which waited for the lock too, and the gateway gave up
    // before the statement itself was sent. Either way, while the record
    // lives every duplicate hears "in progress" or gets the answer, and
    // nothing is forwarded again.
    while tokio::time::Instant::now() < started + Duration::from_millis(2200) {
        let resp =
            with_idempotency_key(&app, "/docs/late", "1", Some("late-answer"), "A", &[]).await;
        if resp.headers().get("idempotent-replayed").is_some() {
            assert_eq!(resp.headers()["idempotent-replayed"], "true");
            assert_eq!(resp.status(), 200, "the stored answer");
            break;
        }
        let body = problem(resp, 409).await;
        assert_eq!(
            body["type"], "urn:fencegate:problem:idempotency-in-progress",
            "while the record lives, without its answer"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let forwarded = up
        .requests()
        .iter()
        .filter(|r| r.header("idempotency-key") == Some("late-answer"))
        .count();
    assert_eq!(forwarded, 1, "forwarded once");
}

/// A first use whose claim finds a live record of its key that is gone by
/// the time it is read (its own first use was refused before sending and
/// forgot it, or it expired in between): nothing holds the key's record any
/// more, so the request claims it again and is forwarded, once, instead of
/// answering 503. A statement-level trigger deletes the live record right
/// after the first claim's statement, in its transaction: the claim has
/// seen it, the read cannot. Both Postgres modes (their claims are
/// different statements).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_vanishes_after_the_claim_is_claimed_again() {
    for mode in ["single", "shared"] {
        let store = TestStore::new(Backend::Postgres).await;
        let up = Upstream::start().await;
        let app = TestApp::from_text(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             [store]\nurl = \"{}\"\nmode = \"{mode}\"\ntimeout_ms = 1500\n{}",
            store.url,
            idem_route(&up.url(), "")
        ))
        .await;
        let mut db = Db::open(&store).await;
        db.run(
            "INSERT INTO idempotency (route, method, idem_key, fingerprint, state,
                                      in_flight_until, expires_at, attempt)
             VALUES ('docs', 'POST', 'gone', 'not this one', 'in_flight',
                     now() + interval '1 hour', now() + interval '1 hour', 42);
             CREATE TABLE vanish (done boolean NOT NULL); INSERT INTO vanish VALUES (false);
             CREATE FUNCTION vanish_once() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NOT (SELECT done FROM vanish) THEN
                     UPDATE vanish SET done = true;
                     DELETE FROM idempotency WHERE idem_key = 'gone' AND attempt = 42;
                 END IF;
                 RETURN NULL;
             END $$;
             CREATE TRIGGER vanish AFTER INSERT ON idempotency
                 FOR EACH STATEMENT EXECUTE FUNCTION vanish_once();",
        )
        .await;
        let first = with_idempotency_key(&app, "/docs/v", "5", Some("gone"), "A", &[]).await;
        assert_eq!(
            first.status(),
            200,
            "{mode}: forwarded as the key's first use"
        );
        assert!(first.headers().get("idempotent-replayed").is_none());
        let replay = with_idempotency_key(&app, "/docs/v", "5", Some("gone"), "A", &[]).await;
        assert_eq!(replay.status(), 200);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        let Db::Pg(c) = &mut db else { unreachable!() };
        let (vanished, records): (bool, i64) = sqlx::query_as(
            "SELECT (SELECT done FROM vanish), \
                    (SELECT count(*) FROM idempotency WHERE idem_key = 'gone' AND attempt <> 42)",
        )
        .fetch_one(&mut *c)
        .await
        .unwrap();
        assert!(vanished, "{mode}: the trigger deleted the live record");
        assert_eq!(records, 1, "{mode}: the gateway's own record");
        assert_eq!(up.applied().len(), 1, "{mode}: forwarded once");
    }
}
