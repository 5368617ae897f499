//! `[store] mode = "shared"`: several gateways on one Postgres keep the
//! per-key ordering guarantee between them.

use crate::support::app::{docs_route, problem, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::holders::{self, Workload};
use crate::support::upstream::{Upstream, UpstreamOptions};

async fn gateways(store: &TestStore, up: &Upstream, n: usize) -> Vec<TestApp> {
    let mut apps = Vec::new();
    for _ in 0..n {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             [store]\nurl = \"{}\"\nmode = \"shared\"\ntimeout_ms = 3000\n{}",
            store.url,
            docs_route(&up.url())
        );
        let config = fencegate::config::Config::from_toml("t.toml", &text, Vec::new()).unwrap();
        apps.push(TestApp::from_config(config).await.unwrap());
    }
    apps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_keep_per_key_order() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start_with(UpstreamOptions {
        write_delay_ms: (0, 8),
    })
    .await;
    let apps = gateways(&store, &up, 3).await;
    let targets = apps.iter().map(|a| a.url("")).collect::<Vec<_>>();
    let out = holders::run_fixed(
        targets,
        Workload {
            clients: 24,
            rounds: 10,
            docs: 3,
            max_pause_ms: 15,
        },
    )
    .await;
    holders::check(&up, &out);
    assert!(out.acked.len() > 24, "{:?}", out.statuses);
    assert!(
        out.statuses.get(&409).copied().unwrap_or(0) > 0,
        "{:?}",
        out.statuses
    );
    assert_eq!(out.statuses.get(&503), None, "{:?}", out.statuses);
}

#[tokio::test]
async fn shared_instances_see_each_others_tokens() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = gateways(&store, &up, 2).await;
    assert_eq!(apps[0].put("/docs/a", Some("34"), "B").await.status(), 200);
    let body = problem(apps[1].put("/docs/a", Some("33"), "A").await, 409).await;
    assert_eq!(body["highest_token"], 34);
    assert_eq!(apps[1].put("/docs/a", Some("34"), "B2").await.status(), 200);
    assert_eq!(apps[1].put("/docs/a", Some("35"), "C").await.status(), 200);
    problem(apps[0].put("/docs/a", Some("34"), "B3").await, 409).await;
}
