//! One resource, one key: a client must not reach a resource under a second
//! key by spelling its request differently. Every refusal is checked at the
//! upstream too: nothing of a refused write may arrive there.

use crate::support::app::{docs_route, problem, route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::fenced_put;
use crate::support::upstream::Upstream;

/// Every spelling that back ends resolve differently, on a fenced write of
/// a strict route (the default): 400 `ambiguous-path`, nothing forwarded.
#[tokio::test]
async fn ambiguous_path_spellings_are_refused_and_never_forwarded() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/report", Some("34"), "B").await.status(), 200);
    for spelling in [
        "/docs/report;x=1",
        "/docs/report;",
        "/docs/report%2F..",
        "/docs/a%2Fb",
        "/docs/a%2fb",
        "/docs/a%5Cb",
        "/docs/a%5cb",
        "/docs/a\\b",
        "/docs//report",
        "/docs/report%00",
        "/docs/report%0a",
        "/docs/report%7F",
        "/docs/report%",
        "/docs/report%2",
        "/docs/report%zz",
    ] {
        let raw = format!(
            "PUT {spelling} HTTP/1.1\r\nhost: t\r\nx-fence-token: 33\r\ncontent-length: 1\r\nconnection: close\r\n\r\nA"
        );
        let answer = crate::support::raw_request(app.addr, &raw).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{spelling}: {answer}");
        assert!(
            answer.contains("urn:fencegate:problem:ambiguous-path")
                || answer.contains("urn:fencegate:problem:bad-path"),
            "{spelling}: {answer}"
        );
    }
    // Through an HTTP client as well, with the problem document checked.
    let resp = app.put("/docs/report;x=1", Some("33"), "A").await;
    let body = problem(resp, 400).await;
    assert_eq!(body["type"], "urn:fencegate:problem:ambiguous-path");
    let arrived: Vec<_> = up
        .requests()
        .iter()
        .map(|r| r.path_and_query.clone())
        .collect();
    assert_eq!(
        arrived,
        vec!["/docs/report"],
        "only the plain write arrived"
    );
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("fencegate_decisions_total{route=\"docs\",outcome=\"ambiguous_path\"}"),
        "{metrics}"
    );
}

/// Reads are not fenced: an odd spelling of a GET is the upstream's business.
/// And `paths = "as-is"` forwards odd spellings of writes, fenced under the
/// key their decoded captures make.
#[tokio::test]
async fn as_is_routes_and_reads_forward_odd_spellings() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let routes = format!(
        "{}paths = \"as-is\"\n{}",
        route("raw", "/raw/{id}", &up.url(), "raw:{id}"),
        docs_route(&up.url())
    );
    let app = TestApp::spawn(&store.url, &routes).await;
    let get = app.http.get(app.url("/docs/a;x=1")).send().await.unwrap();
    assert_eq!(get.headers()["x-upstream"], "recorder");
    assert_eq!(app.put("/raw/a;x=1", Some("3"), "A").await.status(), 200);
    let fence = app.admin_get("/fences/raw:a;x=1").await;
    assert_eq!(fence.status(), 200);
    let arrived: Vec<_> = up
        .requests()
        .iter()
        .map(|r| r.path_and_query.clone())
        .collect();
    assert_eq!(arrived, vec!["/docs/a;x=1", "/raw/a;x=1"]);
}

/// `key_case = "lower"`: one key whatever the case, and literal segments
/// match in any case.
#[tokio::test]
async fn lower_case_keys_merge_spellings_that_differ_in_case() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let routes = format!("{}key_case = \"lower\"\n", docs_route(&up.url()));
    let app = TestApp::spawn(&store.url, &routes).await;
    assert_eq!(app.put("/docs/Report", Some("5"), "B").await.status(), 200);
    for spelling in [
        "/docs/report",
        "/DOCS/REPORT",
        "/Docs/rEpOrT",
        "/%64ocs/report",
    ] {
        let body = problem(app.put(spelling, Some("4"), "A").await, 409).await;
        assert_eq!(body["resource_key"], "doc:report", "{spelling}");
    }
    let arrived: Vec<_> = up
        .requests()
        .iter()
        .map(|r| r.path_and_query.clone())
        .collect();
    assert_eq!(arrived, vec!["/docs/Report"]);
}

/// Key parts from the query and from a header: missing, repeated or
/// ambiguous is 400 `ambiguous-key`, nothing forwarded.
#[tokio::test]
async fn query_and_header_key_parts_must_name_one_value() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let routes = route(
        "items",
        "/items/{id}",
        &up.url(),
        "item:{header.x-tenant}:{query.version}:{id}",
    );
    let app = TestApp::spawn(&store.url, &routes).await;
    let put = |path: &str, tenant: Vec<&str>, token: &str| {
        let mut req = fenced_put(&app.http, app.url(path), token, "x");
        for t in tenant {
            req = req.header("x-tenant", t);
        }
        req.send()
    };
    let ok = put("/items/7?version=v%31", vec!["acme"], "5")
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let fence = app.admin_get("/fences/item:acme:v1:7").await;
    assert_eq!(
        fence.status(),
        200,
        "the key is built from the decoded parts"
    );
    for (path, tenant, why) in [
        ("/items/7", vec!["acme"], "needs query parameter 'version'"),
        (
            "/items/7?version=",
            vec!["acme"],
            "needs query parameter 'version'",
        ),
        (
            "/items/7?version=v1&version=v2",
            vec!["acme"],
            "more than once",
        ),
        (
            "/items/7?version=v1&versio%6E=v2",
            vec!["acme"],
            "more than once",
        ),
        ("/items/7?version=v+1", vec!["acme"], "raw '+'"),
        ("/items/7?version=v1;version=v2", vec!["acme"], "';'"),
        ("/items/7?version=v%zz", vec!["acme"], "'%'"),
        ("/items/7?version=v1", vec![], "needs header 'x-tenant'"),
        (
            "/items/7?version=v1",
            vec!["acme", "evil"],
            "more than once",
        ),
        ("/items/7?version=v1", vec!["acme, evil"], "is a list"),
    ] {
        let resp = put(path, tenant.clone(), "4").await.unwrap();
        let body = problem(resp, 400).await;
        assert_eq!(
            body["type"], "urn:fencegate:problem:ambiguous-key",
            "{path} {tenant:?}"
        );
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains(why), "{path} {tenant:?}: {detail}");
    }
    assert_eq!(up.requests().len(), 1, "only the first write arrived");
}
