//! A restart after an unclean stop waits with the stopped instance's
//! bound (CONTRACT.md, third round: "After an unclean stop, single mode
//! waits for the larger of the longest route timeout recorded by the
//! stopped instance and its own").
//!
//! A write the crashed instance handed over may still be at work in the
//! upstream: here token 6's body reaches the upstream in full, the
//! upstream works 3 s before applying it, and the gateway (route
//! `timeout_ms` 4 s) is killed meanwhile. The restart comes with a config
//! whose route times out after 0.5 s: had it waited for its own timeouts,
//! token 7 would be applied before 6. Single mode, on SQLite and Postgres,
//! and with the crashed instance's 4 s coming from a reload (SIGHUP) of a
//! config that started with 0.5 s.

use std::time::{Duration, Instant};

use crate::support::app::{config_sections, docs_route};
use crate::support::db::{Backend, TestStore};
use crate::support::process::GatewayProcess;
use crate::support::raw_upstream::{RawUpstream, FENCE_HEADER, WORK_HEADER};
use crate::support::wait_for;

/// The crashed instance's route timeout.
const FIRST_TIMEOUT: Duration = Duration::from_millis(4000);
/// The upstream's work on token 6 before it applies it: within
/// `FIRST_TIMEOUT`, past the restart's own timeout and its wait.
const WORK: Duration = Duration::from_millis(3000);

fn config(store: &TestStore, up: &RawUpstream, timeout: Duration) -> String {
    let routes = format!(
        "{}timeout_ms = {}\n",
        docs_route(&up.url()),
        timeout.as_millis()
    );
    config_sections("", &store.url, "timeout_ms = 3000\n", &routes)
}

async fn the_restart_waits_for_the_crashed_instances_timeout(backend: Backend, reloaded: bool) {
    let store = TestStore::new(backend).await;
    let up = RawUpstream::start().await;
    let short = Duration::from_millis(500);
    let mut first = if reloaded {
        let first = GatewayProcess::start(&config(&store, &up, short));
        first.rewrite_config(&config(&store, &up, FIRST_TIMEOUT));
        first.signal(libc::SIGHUP);
        wait_for("the reload", || first.log().contains("config reloaded")).await;
        first
    } else {
        GatewayProcess::start(&config(&store, &up, FIRST_TIMEOUT))
    };
    let path = "/docs/restart";
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("reqwest client");
    let six = http
        .put(first.url(path))
        .header(FENCE_HEADER, "6")
        .header(WORK_HEADER, WORK.as_millis().to_string())
        .body("six")
        .send();
    let six = tokio::spawn(six);
    wait_for("token 6's body at the upstream", || {
        up.writes()
            .iter()
            .any(|w| w.path == path && w.token == Some(6) && w.body_complete)
    })
    .await;
    let handed_over = Instant::now();
    first.kill9();
    let _ = six.await;
    let restart = GatewayProcess::start(&config(&store, &up, short));
    assert!(
        restart.log().contains("did not stop cleanly"),
        "the restart must know the first process crashed:\n{}",
        restart.log()
    );
    let seven = http
        .put(restart.url(path))
        .header(FENCE_HEADER, "7")
        .body("seven")
        .send()
        .await
        .expect("the restart answers");
    assert_eq!(seven.status(), 200, "token 7 goes after the wait");
    up.settle(Duration::from_secs(15)).await;
    let timeline = up.timeline(path, handed_over);
    assert!(
        up.violations().is_empty(),
        "{:?}\n{timeline}",
        up.violations()
    );
    assert_eq!(up.applied_tokens(path), vec![6, 7], "{timeline}");
    let seven_at = up
        .write(path, 7)
        .started
        .saturating_duration_since(handed_over);
    assert!(
        seven_at >= FIRST_TIMEOUT,
        "token 7 reached the upstream {seven_at:?} after 6 was handed over: the restart \
         must wait out the crashed instance's timeout ({FIRST_TIMEOUT:?})\n{timeline}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_waits_for_the_crashed_instances_timeout_sqlite() {
    the_restart_waits_for_the_crashed_instances_timeout(Backend::Sqlite, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_waits_for_the_crashed_instances_timeout_postgres() {
    the_restart_waits_for_the_crashed_instances_timeout(Backend::Postgres, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_waits_for_a_timeout_a_reload_lengthened_sqlite() {
    the_restart_waits_for_the_crashed_instances_timeout(Backend::Sqlite, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_waits_for_a_timeout_a_reload_lengthened_postgres() {
    the_restart_waits_for_the_crashed_instances_timeout(Backend::Postgres, true).await;
}
