//! Lock-delay on each backend, called directly: an expiry leaves the name
//! ungrantable for the delay, a release or an admin break does not.

use std::time::Duration;

use fencegate::locks::backend::{LockBackend, LockError};
use fencegate::locks::notify::Notifier;
use fencegate::locks::redlock::Redlock;
use fencegate::locks::single_redis::RedisLocks;
use fencegate::locks::table::TableLocks;
use fencegate::locks::Backend as Locks;

use crate::locks_redis::fence_store_on;
use crate::support::db::{Backend, TestStore};
use crate::support::redis::PrivateRedis;

const DELAY: Duration = Duration::from_millis(800);
const TTL: Duration = Duration::from_millis(200);

/// The backend under test and what it needs kept alive.
struct Under {
    locks: Locks,
    _db: TestStore,
    _redis: Vec<PrivateRedis>,
}

async fn under(kind: &str) -> Under {
    let store_backend = if kind == "postgres" {
        Backend::Postgres
    } else {
        Backend::Sqlite
    };
    let (store, db) = fence_store_on(store_backend, 2000).await;
    let nodes = match kind {
        "redis" => 1,
        "redlock" => 3,
        _ => 0,
    };
    let redis = crate::support::redis::private_nodes(nodes).await;
    let urls: Vec<String> = redis.iter().map(|r| r.url()).collect();
    let timeout = Duration::from_millis(300);
    let locks = match kind {
        "redis" => Locks::Redis(
            RedisLocks::connect(&urls[0], store, timeout, Notifier::new())
                .await
                .unwrap()
                .with_lock_delay(DELAY),
        ),
        "redlock" => Locks::Redlock(
            Redlock::connect(&urls, store, timeout, Notifier::new())
                .await
                .unwrap()
                .with_lock_delay(DELAY),
        ),
        _ => Locks::Table(TableLocks::new(store, timeout).with_lock_delay(DELAY)),
    };
    Under {
        locks,
        _db: db,
        _redis: redis,
    }
}

fn lease() -> String {
    format!("{:032x}", rand::random::<u128>())
}

async fn delay_after_expiry_only(kind: &str) {
    let u = under(kind).await;
    let l = &u.locks;

    // Expired: refused for the delay, which status reports.
    l.try_acquire("d:e", &lease(), TTL).await.unwrap();
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let st = l.status("d:e").await.unwrap();
    assert!(!st.held, "{kind}: {st:?}");
    let left = st
        .delayed_for
        .unwrap_or_else(|| panic!("{kind}: no delay: {st:?}"));
    assert!(left <= DELAY, "{kind}: {left:?}");
    match l.try_acquire("d:e", &lease(), TTL).await {
        Err(LockError::Held {
            expires_in: Some(d),
        }) => assert!(d <= DELAY, "{kind}: {d:?}"),
        other => panic!("{kind}: expected Held during the delay, got {other:?}"),
    }
    tokio::time::sleep(left + Duration::from_millis(50)).await;
    assert_eq!(l.status("d:e").await.unwrap().delayed_for, None, "{kind}");
    l.try_acquire("d:e", &lease(), TTL).await.unwrap();

    // Released or broken: granted again at once.
    let a = l.try_acquire("d:r", &lease(), TTL).await.unwrap();
    l.release("d:r", &a.lease).await.unwrap();
    assert_eq!(l.status("d:r").await.unwrap().delayed_for, None, "{kind}");
    l.try_acquire("d:r", &lease(), TTL).await.unwrap();
    l.try_acquire("d:b", &lease(), TTL).await.unwrap();
    assert!(l.break_lease("d:b").await.unwrap(), "{kind}");
    assert_eq!(l.status("d:b").await.unwrap().delayed_for, None, "{kind}");
    l.try_acquire("d:b", &lease(), TTL).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_on_sqlite() {
    delay_after_expiry_only("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_on_postgres() {
    delay_after_expiry_only("postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    delay_after_expiry_only("redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock() {
    delay_after_expiry_only("redlock").await;
}
