//! The admin dashboard in a real headless chromium: it fills with live data
//! without a reload, looks a key's fence up, shows a refusal soon after it
//! is provoked, loads nothing from anywhere but the admin listener, and
//! fits a phone's width. Screenshots are kept in `target/test-artifacts/`.

use std::time::Duration;

use serde_json::json;

use crate::support::app::{docs_route, TestApp};
use crate::support::browser::Browser;
use crate::support::db::{Backend, TestStore};
use crate::support::upstream::Upstream;

/// Long enough for a loaded two-core machine; the page polls every second.
const PATIENCE: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_live_data_looks_up_fences_and_shows_refusals() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    assert_eq!(
        app.put("/docs/report", Some("34"), "v1").await.status(),
        200
    );
    let grant: serde_json::Value = app
        .http
        .post(app.url("/_fencegate/locks/doc:held"))
        .json(&json!({"ttl_ms": 60000}))
        .send()
        .await
        .expect("lock API answered")
        .json()
        .await
        .expect("a grant");
    let fence = grant["fence"].as_i64().expect("a fence");

    let browser = Browser::start().await;
    browser
        .client
        .goto(&app.admin_url("/"))
        .await
        .expect("the page loads");

    // Live data: the route's counts, then a rate (two polls), the holder.
    browser
        .wait_for("the first poll", PATIENCE, || async {
            let live = browser
                .eval("return document.body.dataset.live;", vec![])
                .await;
            (live == "yes").then_some(())
        })
        .await;
    let row = r#"#routes tr[data-route="docs"]"#;
    browser
        .wait_for("1 forwarded write on route docs", PATIENCE, || async {
            let t = browser.text(&format!("{row} td.forwarded")).await?;
            (t == "1").then_some(())
        })
        .await;
    browser
        .wait_for("a write rate on route docs", PATIENCE, || async {
            let t = browser.text(&format!("{row} td.rate")).await?;
            (t != "–").then_some(())
        })
        .await;
    let holder = r#"#locks tr[data-lock="doc:held"]"#;
    let shown = browser
        .wait_for("the lock holder doc:held", PATIENCE, || async {
            browser.text(&format!("{holder} td:nth-child(2)")).await
        })
        .await;
    assert_eq!(shown, fence.to_string(), "the holder's fence");
    let left = browser
        .text(&format!("{holder} td.left"))
        .await
        .expect("time left");
    assert!(
        left.contains("min") || left.ends_with(" s"),
        "time left: {left}"
    );

    // A fence lookup, typed and submitted as a person would.
    let input = browser
        .client
        .find(fantoccini::Locator::Css("#fence-key"))
        .await
        .expect("the lookup field");
    input.send_keys("doc:report").await.expect("typing");
    browser
        .client
        .find(fantoccini::Locator::Css("#fence-lookup"))
        .await
        .expect("the lookup button")
        .click()
        .await
        .expect("a click");
    browser
        .wait_for("the fence of doc:report", PATIENCE, || async {
            let t = browser.text("#fence-result .highest-token").await?;
            (t == "34").then_some(())
        })
        .await;

    // A stale write, provoked now, appears without a reload.
    let stale = app.put("/docs/report", Some("33"), "late").await;
    assert_eq!(stale.status(), 409);
    let refusal = r#"#refusals tr[data-outcome="stale"]"#;
    browser
        .wait_for("the stale refusal", PATIENCE, || async {
            browser.text(&format!("{refusal} td.key")).await
        })
        .await;
    for (cell, shown) in [
        ("key", "doc:report"),
        ("presented", "33"),
        ("highest", "34"),
    ] {
        let text = browser.text(&format!("{refusal} td.{cell}")).await;
        assert_eq!(text.as_deref(), Some(shown), "the refusal's {cell}");
    }
    browser
        .wait_for("1 stale write on route docs", PATIENCE, || async {
            let t = browser.text(&format!("{row} td.stale")).await?;
            (t == "1").then_some(())
        })
        .await;

    // A write whose client leaves before its answer, an answer larger than
    // the gateway drains for a client that left (4 MiB), holds its key
    // until the route's timeout: the route's row counts it, by reason. (An
    // answer that ends normally would open the key at once.)
    // It leaves once the upstream has the write (500 ms of work), not
    // after a fixed time that a slow forward could outlast.
    let gone = tokio::spawn(
        crate::support::fenced_put(&reqwest::Client::new(), app.url("/docs/gone"), "1", "w")
            .header("x-test-delay-ms", "500")
            .header("x-test-response-bytes", (4 << 20).to_string())
            .send(),
    );
    crate::support::wait_for("the write at the upstream", || up.in_flight() == 1).await;
    gone.abort();
    assert!(
        gone.await.is_err_and(|e| e.is_cancelled()),
        "the client left before its answer"
    );
    browser
        .wait_for("1 held key on route docs", PATIENCE, || async {
            let t = browser.text(&format!("{row} td.held")).await?;
            (t == "1").then_some(())
        })
        .await;
    let reasons = browser
        .eval(
            &format!("return document.querySelector('{row} td.held').title;"),
            vec![],
        )
        .await;
    assert_eq!(
        reasons.as_str(),
        Some("answer_unfinished: 1"),
        "the hold's reason"
    );

    // Self-contained: everything the page loaded came from the admin
    // listener (its Content-Security-Policy would block anything else).
    let origin = format!("http://{}", app.admin);
    let loaded = browser
        .eval(
            "return performance.getEntriesByType('resource').map(e => e.name);",
            vec![],
        )
        .await;
    let loaded = loaded.as_array().expect("resource entries");
    assert!(!loaded.is_empty(), "the page loaded its assets");
    for url in loaded {
        let url = url.as_str().unwrap_or_default();
        assert!(url.starts_with(&origin), "loaded from elsewhere: {url}");
    }
    let desk = browser.screenshot("dashboard.png").await;

    // A phone: one column, nothing wider than the screen.
    browser
        .client
        .set_window_size(390, 844)
        .await
        .expect("a phone-sized window");
    let overflow = browser
        .wait_for("a layout as wide as a phone", PATIENCE, || async {
            let v = browser
                .eval(
                    "return [document.documentElement.scrollWidth, window.innerWidth];",
                    vec![],
                )
                .await;
            let (scroll, inner) = (v[0].as_i64()?, v[1].as_i64()?);
            (inner <= 420).then_some(scroll - inner)
        })
        .await;
    assert!(
        overflow <= 0,
        "the page is {overflow} px wider than a phone"
    );
    let phone = browser.screenshot("dashboard-phone.png").await;
    for shot in [&desk, &phone] {
        let len = std::fs::metadata(shot).map(|m| m.len()).unwrap_or(0);
        assert!(len > 10_000, "{} looks empty ({len} bytes)", shot.display());
    }
    browser.close().await;
}
