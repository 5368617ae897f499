//! Operating the gateway: JSON and access logs that a pipeline can parse
//! and that never carry a credential, SIGHUP reloads that change routes
//! under load without a failed request, or change nothing when the new
//! config is wrong or would change a fenced route's key identity, and a
//! gateway process that runs without transparent huge pages.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::app::{config_sections, docs_route, route};
use crate::support::db::{Backend, TestStore};
use crate::support::fenced_put;
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

fn config(store: &TestStore, extra: &str) -> String {
    config_sections("", &store.url, "", extra)
}

/// Rewrites `gw`'s config file to `text`, sends SIGHUP, and waits until
/// the log says `outcome` (reloaded, or why not).
async fn reload(gw: &GatewayProcess, text: &str, outcome: &str) {
    gw.rewrite_config(text);
    gw.signal(libc::SIGHUP);
    wait_for_log(gw, outcome).await;
}

/// A fenced write (token 1) on `path` through `gw`: its status.
async fn put_status(gw: &GatewayProcess, path: &str, body: &'static str) -> u16 {
    let resp = fenced_put(&reqwest::Client::new(), gw.url(path), "1", body)
        .send()
        .await
        .unwrap();
    resp.status().as_u16()
}

async fn wait_for_log(gw: &GatewayProcess, needle: &str) {
    for _ in 0..100 {
        if gw.log().contains(needle) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no '{needle}' in the log:\n{}", gw.log());
}

#[tokio::test]
async fn json_and_access_logs_parse_and_carry_no_secrets() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let extra = format!(
        "[log]\nformat = \"json\"\naccess = true\n{}",
        docs_route(&up.url())
    );
    let gw = GatewayProcess::start(&config(&store, &extra));
    let http = reqwest::Client::new();
    let put = fenced_put(
        &http,
        gw.url("/docs/report?secret=hunter2"),
        "34",
        "the body must not be logged",
    )
    .header("authorization", "Bearer top-secret-key")
    .send()
    .await
    .unwrap();
    assert_eq!(put.status(), 200);
    let stale = fenced_put(&http, gw.url("/docs/report"), "33", "x")
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), 409);
    assert_eq!(
        http.get(gw.url("/docs/report"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    wait_for_log(&gw, "\"outcome\":\"passthrough\"").await;

    let log = gw.log();
    for secret in ["hunter2", "top-secret-key", "the body must not be logged"] {
        assert!(
            !log.contains(secret),
            "'{secret}' leaked into the log:\n{log}"
        );
    }
    let mut access = Vec::new();
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(
            v["timestamp"].is_string() && v["level"].is_string(),
            "{line}"
        );
        if v["target"] == "fencegate::access" {
            access.push(v);
        }
    }
    assert_eq!(access.len(), 3, "one line per request: {access:?}");
    let put = &access[0];
    assert_eq!(put["method"], "PUT");
    assert_eq!(put["path"], "/docs/report", "no query in the access log");
    assert_eq!(put["route"], "docs");
    assert_eq!(put["status"], 200);
    assert_eq!(put["resource_key"], "doc:report");
    assert_eq!(put["token"], 34);
    assert_eq!(put["outcome"], "forwarded");
    assert!(put["duration_ms"].as_f64().is_some());
    assert_eq!(access[1]["status"], 409);
    assert_eq!(access[1]["outcome"], "stale");
    assert_eq!(access[2]["outcome"], "passthrough");
}

/// Routes change on SIGHUP while requests keep flowing: none fails, the new
/// route serves, and the reload is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sighup_changes_routes_under_load_without_a_failed_request() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let gw = Arc::new(GatewayProcess::start(&config(
        &store,
        &docs_route(&up.url()),
    )));
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut load = Vec::new();
    for client in 0..4 {
        let (gw, stop, ok, failed) = (gw.clone(), stop.clone(), ok.clone(), failed.clone());
        load.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                let path = format!("/docs/k{client}");
                let resp = fenced_put(&http, gw.url(&path), "1", "x").send().await;
                match resp.map(|r| r.status().as_u16()) {
                    Ok(200) => ok.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let more = format!(
        "{}{}",
        docs_route(&up.url()),
        route("more", "/more/{id}", &up.url(), "more:{id}")
    );
    reload(&gw, &config(&store, &more), "config reloaded").await;
    assert_eq!(
        put_status(&gw, "/more/x", "x").await,
        200,
        "the new route serves"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "no request failed across the reload"
    );
    assert!(ok.load(Ordering::Relaxed) > 20, "the load ran");
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("fencegate_config_reloads_total{result=\"ok\"} 1"),
        "{metrics}"
    );
}

/// A config with problems, or one changing what only a restart can change,
/// changes nothing: the old routes keep serving, every problem is logged,
/// and the reload counts as an error.
#[tokio::test]
async fn a_bad_reload_keeps_serving() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let gw = GatewayProcess::start(&config(&store, &docs_route(&up.url())));
    let bad = format!(
        "{}[[routes]]\nname = \"docs\"\npath = \"nope\"\nupstream = \"ftp://x\"\nkey = \"k\"\n",
        docs_route(&up.url())
    );
    reload(&gw, &config(&store, &bad), "config not reloaded").await;
    let log = gw.log();
    for problem in [
        "duplicate route name",
        "routes[1].path",
        "routes[1].upstream",
    ] {
        assert!(log.contains(problem), "'{problem}' not logged:\n{log}");
    }
    // A new listen address needs a restart: refused as a whole.
    let moved = format!(
        "[server]\nlisten = \"127.0.0.1:1\"\nadmin_listen = \"127.0.0.1:0\"\n[store]\nurl = \"{}\"\n{}{}",
        store.url,
        docs_route(&up.url()),
        route("more", "/more/{id}", &up.url(), "more:{id}")
    );
    reload(
        &gw,
        &moved,
        "server.listen: changed, and only a restart applies it",
    )
    .await;
    let put = put_status(&gw, "/docs/a", "x").await;
    assert_eq!(put, 200, "the old config keeps serving");
    let more = put_status(&gw, "/more/a", "").await;
    assert_eq!(more, 404, "nothing of a refused reload applies");
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("fencegate_config_reloads_total{result=\"error\"} 2"),
        "{metrics}"
    );
}

/// A reload that would change how a fenced route forms its keys is refused:
/// the running config stays, the log names the route and what changed, and
/// `fencegate_config_reloads_total{result="refused"}` counts it. The case
/// of the issue: token 100 in flight on `doc:{id}`, a reload to
/// `document:{id}`, then token 1 on the same path; before, 1 was recorded
/// under a key of its own, forwarded, and applied after 100. A reload that
/// changes something harmless (the route's timeout) still applies.
#[tokio::test]
async fn a_reload_never_changes_a_fenced_routes_key_identity() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let docs = |key: &str, timeout_ms: u64| {
        route("docs", "/docs/{id}", &up.url(), key) + &format!("timeout_ms = {timeout_ms}\n")
    };
    let gw = GatewayProcess::start(&config(&store, &docs("doc:{id}", 5000)));
    let in_flight = up
        .held_write(gw.url("/docs/a"), "100", "hundred", 1500)
        .await;
    assert_eq!(up.in_flight(), 1, "token 100 is in flight");
    reload(
        &gw,
        &config(&store, &docs("document:{id}", 5000)),
        "config reload refused",
    )
    .await;
    let log = gw.log();
    assert!(
        log.contains("route=docs")
            && log.contains("key template changed from 'doc:{id}' to 'document:{id}'"),
        "the log names the route and the change:\n{log}"
    );
    assert!(!log.contains("config reloaded"), "{log}");
    // The old key is still in force: 1 is stale against 100, in flight or
    // done.
    assert_eq!(put_status(&gw, "/docs/a", "one").await, 409);
    assert_eq!(in_flight.await.unwrap().unwrap(), 200);
    assert_eq!(put_status(&gw, "/docs/a", "one").await, 409);
    let tokens: Vec<_> = up.applied_on("/docs/a").iter().map(|a| a.token).collect();
    assert_eq!(tokens, [Some(100)], "only 100 was applied");
    let http = reqwest::Client::new();
    let fence = |key: &str| http.get(gw.admin_url(&format!("/fences/{key}"))).send();
    assert_eq!(fence("doc:a").await.unwrap().status(), 200);
    assert_eq!(fence("document:a").await.unwrap().status(), 404);
    let metrics = gw.metrics().await;
    for (result, count) in [("refused", 1), ("error", 0), ("ok", 0)] {
        let line = format!("fencegate_config_reloads_total{{result=\"{result}\"}} {count}");
        assert!(metrics.contains(&line), "no '{line}':\n{metrics}");
    }
    // A harmless change applies: the new timeout cuts a slow write.
    reload(
        &gw,
        &config(&store, &docs("doc:{id}", 400)),
        "config reloaded",
    )
    .await;
    let slow = fenced_put(&http, gw.url("/docs/b"), "1", "slow")
        .header("x-test-delay-ms", "1500")
        .send()
        .await
        .unwrap();
    assert_eq!(slow.status(), 504, "the new timeout applies");
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("fencegate_config_reloads_total{result=\"ok\"} 1"),
        "{metrics}"
    );
}

/// `serve` turns transparent huge pages off for its own process, so that
/// the first touch of new memory never zeroes 2 MiB while a thread holds
/// a lock of the gate (docs/internals/performance.md, "Memory and huge
/// pages"). The kernel reports
/// the flag per process; the test runner's own stays as it was.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_gateway_process_runs_without_transparent_huge_pages() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let gw = GatewayProcess::start(&config(&store, &docs_route(&up.url())));
    assert_eq!(put_status(&gw, "/docs/a", "x").await, 200, "it serves");
    let thp = |pid: String| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("THP_enabled:").map(|v| v.trim().to_string()))
            .unwrap_or_else(|| panic!("no THP_enabled line in /proc/{pid}/status:\n{status}"))
    };
    assert_eq!(thp(gw.pid().to_string()), "0", "the gateway's process");
    assert_eq!(thp("self".into()), "1", "the test runner's, untouched");
}
