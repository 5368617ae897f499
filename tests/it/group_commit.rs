//! Group commit under concurrency: many decisions on overlapping keys at
//! once, straight against the store, on both backends.

use std::collections::HashMap;
use std::sync::Arc;

use fencegate::store::FenceStore;
use rand::Rng;

use crate::support::app::{config_text, parse_config};
use crate::support::db::{Backend, TestStore};
use crate::support::per_store;

per_store!(#[tokio::test(flavor = "multi_thread", worker_threads = 4)] concurrent_decisions => concurrent_decisions_sqlite, concurrent_decisions_postgres);

/// 400 decisions from 400 tasks at once over 8 keys with random tokens:
/// every answer is at least the presented token; a token is accepted only if
/// no higher token was accepted for its key *before* it was recorded...
/// which, seen from outside, means: the final value of each key is the
/// highest token presented for it, and the highest presented token of each
/// key was accepted.
async fn concurrent_decisions(b: Backend) {
    let test_store = TestStore::new(b).await;
    let config = parse_config(&config_text(&test_store.url, ""));
    let store = Arc::new(FenceStore::open(&config.store).await.unwrap());
    let mut tasks = Vec::new();
    for i in 0..400 {
        let store = store.clone();
        let (key, token) = {
            let mut rng = rand::thread_rng();
            (
                format!("k{}", rng.gen_range(0..8)),
                rng.gen_range(1..1_000_000i64) * 1000 + i,
            )
        };
        tasks.push(tokio::spawn(async move {
            let highest = store.record(&key, token).await.unwrap();
            (key, token, highest)
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let mut max_presented: HashMap<String, i64> = HashMap::new();
    for (key, token, highest) in &results {
        assert!(highest >= token, "{key}: answered {highest} for {token}");
        let e = max_presented.entry(key.clone()).or_insert(*token);
        *e = (*e).max(*token);
    }
    for (key, max) in &max_presented {
        let rec = store.get(key).await.unwrap().unwrap();
        assert_eq!(rec.highest_token, *max, "{key}");
        let winner = results
            .iter()
            .find(|(k, t, _)| k == key && t == max)
            .unwrap();
        assert_eq!(winner.2, *max, "the highest token of {key} was accepted");
    }
    store.close().await;
}
