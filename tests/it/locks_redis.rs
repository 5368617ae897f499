//! The Redis and Redlock lock backends, called directly, each test with a
//! fresh SQLite fence store. Tests on the shared Redis use unique lock
//! names; tests that FLUSHALL or stop Redis use a private one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::locks::backend::{Lease, LockBackend, LockError};
use fencegate::locks::notify::Notifier;
use fencegate::locks::redis_node::{fence_key, lock_key};
use fencegate::locks::redlock::Redlock;
use fencegate::locks::single_redis::RedisLocks;
use fencegate::store::FenceStore;

use crate::support::app::{config_sections, parse_config};
use crate::support::db::{Backend, SqliteBlocker, TestStore};
use crate::support::redis::{command, require_shared_redis, PrivateRedis};

const OP_TIMEOUT: Duration = Duration::from_millis(500);

/// A fresh SQLite fence store (the guard deletes it).
async fn fence_store(timeout_ms: u64) -> (FenceStore, TestStore) {
    fence_store_on(Backend::Sqlite, timeout_ms).await
}

/// A fresh fence store on `backend` (the guard deletes it).
pub async fn fence_store_on(backend: Backend, timeout_ms: u64) -> (FenceStore, TestStore) {
    let db = TestStore::new(backend).await;
    let store_lines = format!("timeout_ms = {timeout_ms}\n");
    let config = parse_config(&config_sections("", &db.url, &store_lines, ""));
    let store = FenceStore::open(&config.store).await.expect("open store");
    (store, db)
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

fn new_lease() -> String {
    format!("{:032x}", rand::random::<u128>())
}

async fn redis_locks(url: &str, store: &FenceStore) -> (RedisLocks, Arc<Notifier>) {
    let notifier = Notifier::new();
    let locks = RedisLocks::connect(url, store.clone(), OP_TIMEOUT, notifier.clone())
        .await
        .expect("connect");
    (locks, notifier)
}

fn assert_unavailable<T: std::fmt::Debug>(r: Result<T, LockError>, what: &str) {
    match r {
        Err(LockError::Unavailable(_)) => {}
        other => panic!("{what}: expected Unavailable, got {other:?}"),
    }
}

fn assert_not_holder<T: std::fmt::Debug>(r: Result<T, LockError>, what: &str) {
    match r {
        Err(LockError::NotHolder) => {}
        other => panic!("{what}: expected NotHolder, got {other:?}"),
    }
}

#[tokio::test]
async fn grant_then_held() {
    let url = require_shared_redis();
    let (store, _db) = fence_store(2000).await;
    let (locks, _) = redis_locks(&url, &store).await;
    let name = unique("grant");
    let ttl = Duration::from_secs(5);

    let a = locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    assert_eq!(a.fence, 1, "the first fence of a new name");
    assert!(a.valid_for <= ttl && a.valid_for > ttl - Duration::from_secs(1));

    match locks.try_acquire(&name, &new_lease(), ttl).await {
        Err(LockError::Held { expires_in }) => {
            let left = expires_in.expect("the holder's time left");
            assert!(left <= ttl && left > Duration::from_secs(3), "{left:?}");
        }
        other => panic!("expected Held, got {other:?}"),
    }
    let s = locks.status(&name).await.unwrap();
    assert!(s.held);
    assert_eq!(s.fence, a.fence);
    assert!(s.expires_in.unwrap() <= ttl);

    // The grant's fence is durable.
    assert_eq!(store.fence_floor(&name).await.unwrap(), a.fence);
    // The value is "<lease>:<fence>".
    let value: String = command(&url, redis::cmd("GET").arg(lock_key(&name)));
    assert_eq!(value, format!("{}:{}", a.lease, a.fence));
    locks.release(&name, &a.lease).await.unwrap();
}

#[tokio::test]
async fn renew_by_the_holder_keeps_the_fence_and_extends() {
    let url = require_shared_redis();
    let (store, _db) = fence_store(2000).await;
    let (locks, _) = redis_locks(&url, &store).await;
    let name = unique("renew");
    let a = locks
        .try_acquire(&name, &new_lease(), Duration::from_secs(1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = locks
        .renew(&name, &a.lease, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(r.fence, a.fence);
    assert_eq!(r.lease, a.lease);
    assert!(r.valid_for > Duration::from_secs(9));
    let left = locks.status(&name).await.unwrap().expires_in.unwrap();
    assert!(
        left > Duration::from_secs(5),
        "renew extended the key: {left:?}"
    );
    locks.release(&name, &a.lease).await.unwrap();
}

#[tokio::test]
async fn another_lease_is_not_the_holder() {
    let url = require_shared_redis();
    let (store, _db) = fence_store(2000).await;
    let (locks, _) = redis_locks(&url, &store).await;
    let name = unique("other");
    let ttl = Duration::from_secs(5);
    let a = locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    let b = new_lease();

    assert_not_holder(locks.renew(&name, &b, ttl).await, "renew by another");
    assert_not_holder(locks.release(&name, &b).await, "release by another");
    // A prefix of the lease is not the lease.
    assert_not_holder(
        locks.release(&name, &a.lease[..8]).await,
        "release by a prefix",
    );
    assert!(locks.status(&name).await.unwrap().held, "still held");

    locks.release(&name, &a.lease).await.unwrap();
    assert_not_holder(locks.release(&name, &a.lease).await, "second release");
    assert_not_holder(
        locks.renew(&name, &a.lease, ttl).await,
        "renew after release",
    );
    let s = locks.status(&name).await.unwrap();
    assert!(!s.held);
    assert_eq!(s.fence, a.fence, "a free lock reports the last fence");
    assert_eq!(s.expires_in, None);
}

#[tokio::test]
async fn an_expired_lease_cannot_renew_and_the_next_grant_is_higher() {
    let url = require_shared_redis();
    let (store, _db) = fence_store(2000).await;
    let (locks, _) = redis_locks(&url, &store).await;
    let name = unique("expiry");
    let a = locks
        .try_acquire(&name, &new_lease(), Duration::from_millis(150))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!locks.status(&name).await.unwrap().held);
    assert_not_holder(
        locks.renew(&name, &a.lease, Duration::from_secs(5)).await,
        "renew after expiry",
    );
    assert_not_holder(locks.release(&name, &a.lease).await, "release after expiry");
    let b = locks
        .try_acquire(&name, &new_lease(), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(b.fence > a.fence, "{} then {}", a.fence, b.fence);
    // The renew refused above did not bring the old key back.
    assert_not_holder(
        locks.renew(&name, &a.lease, Duration::from_secs(5)).await,
        "old lease",
    );
    locks.release(&name, &b.lease).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_acquirers_get_one_grant_per_round_with_rising_fences() {
    let url = require_shared_redis();
    let (store, _db) = fence_store(5000).await;
    let (locks, _) = redis_locks(&url, &store).await;
    let name = unique("race");
    let mut fences = Vec::new();
    for round in 0..5 {
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let (locks, name) = (locks.clone(), name.clone());
                tokio::spawn(async move {
                    locks
                        .try_acquire(&name, &new_lease(), Duration::from_secs(10))
                        .await
                })
            })
            .collect();
        let mut grants: Vec<Lease> = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(l) => grants.push(l),
                Err(LockError::Held { .. }) => {}
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        assert_eq!(grants.len(), 1, "round {round}: exactly one grant");
        let g = grants.pop().unwrap();
        fences.push(g.fence);
        locks.release(&name, &g.lease).await.unwrap();
    }
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences rise: {fences:?}"
    );
}

#[tokio::test]
async fn flushall_does_not_send_fences_backwards() {
    let redis = PrivateRedis::start();
    let (store, _db) = fence_store(2000).await;
    let (locks, _) = redis_locks(&redis.url(), &store).await;
    let name = unique("flush");
    let ttl = Duration::from_secs(10);

    let mut last = 0;
    for _ in 0..3 {
        let g = locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
        assert!(g.fence > last);
        last = g.fence;
        locks.release(&name, &g.lease).await.unwrap();
    }
    assert_eq!(last, 3);

    // Redis forgets everything, counter included.
    redis.flushall();
    let g = locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    assert_eq!(g.fence, 4, "the store's floor, not the lost counter");
    // While held: the lock is lost too (Redis's weakness), but whoever gets
    // it next still gets a higher fence, so the old holder is fenced off.
    redis.flushall();
    let h = locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    assert!(h.fence > g.fence, "{} then {}", g.fence, h.fence);
    let n: i64 = command(&redis.url(), redis::cmd("GET").arg(fence_key(&name)));
    assert_eq!(n, h.fence, "the Redis counter was raised to the floor");
    let s = locks.status(&name).await.unwrap();
    assert!(s.held);
    assert_eq!(s.fence, h.fence);

    // Free and flushed: status still reports the last fence issued.
    locks.release(&name, &h.lease).await.unwrap();
    redis.flushall();
    let s = locks.status(&name).await.unwrap();
    assert!(!s.held);
    assert_eq!(s.fence, h.fence);
}

#[tokio::test]
async fn fences_start_above_the_gateways_recorded_token() {
    let url = require_shared_redis();
    let (store, _db) = fence_store(2000).await;
    let (locks, _) = redis_locks(&url, &store).await;
    let name = unique("recorded");
    assert_eq!(store.record(&name, 500).await.unwrap(), 500);
    let s = locks.status(&name).await.unwrap();
    assert_eq!((s.held, s.fence), (false, 500));
    let g = locks
        .try_acquire(&name, &new_lease(), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(g.fence, 501);
    locks.release(&name, &g.lease).await.unwrap();
}

#[tokio::test]
async fn a_token_recorded_during_an_acquire_still_leaves_the_grant_above_it() {
    // A second connection holds SQLite's write lock, so the acquire reads
    // the floor (0), runs its script (Redis fence 1), then waits to record
    // it; meanwhile the gateway records token 50 for the key. The record of
    // fence 1 is refused, the grant withdrawn, and the retry grants 51.
    let url = require_shared_redis();
    let (store, db) = fence_store(5000).await;
    let (locks, _) = redis_locks(&url, &store).await;
    let name = unique("moved");
    let mut blocker = SqliteBlocker::begin(&db.url, "IMMEDIATE").await;
    let task = {
        let (locks, name) = (locks.clone(), name.clone());
        tokio::spawn(async move {
            locks
                .try_acquire(&name, &new_lease(), Duration::from_secs(10))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    sqlx::query("INSERT INTO fences (resource_key, highest_token, updated_at) VALUES (?1, 50, 0)")
        .bind(&name)
        .execute(blocker.conn())
        .await
        .unwrap();
    blocker.commit().await;
    let g = task.await.unwrap().expect("granted after the retry");
    assert_eq!(g.fence, 51);
    let value: String = command(&url, redis::cmd("GET").arg(lock_key(&name)));
    assert_eq!(value, format!("{}:51", g.lease));
    locks.release(&name, &g.lease).await.unwrap();
}

#[tokio::test]
async fn no_grant_without_a_durable_fence() {
    // The store cannot write (another connection holds SQLite's write lock
    // past the store timeout): the Redis grant is withdrawn, the answer is
    // Unavailable.
    let url = require_shared_redis();
    let (store, db) = fence_store(300).await;
    let (locks, _) = redis_locks(&url, &store).await;
    let name = unique("nodurable");
    let blocker = SqliteBlocker::begin(&db.url, "IMMEDIATE").await;
    assert_unavailable(
        locks
            .try_acquire(&name, &new_lease(), Duration::from_secs(10))
            .await,
        "acquire while the store cannot record",
    );
    let exists: i64 = command(&url, redis::cmd("EXISTS").arg(lock_key(&name)));
    assert_eq!(exists, 0, "the grant was withdrawn from Redis");
    blocker.release().await;
    let g = locks
        .try_acquire(&name, &new_lease(), Duration::from_secs(10))
        .await
        .unwrap();
    assert!(g.fence >= 1);
    assert_eq!(store.fence_floor(&name).await.unwrap(), g.fence);
    locks.release(&name, &g.lease).await.unwrap();
}

/// Runs `f` and checks it answered Unavailable within the op timeout
/// (plus scheduling slack).
async fn unavailable_in_time<T: std::fmt::Debug>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, LockError>>,
) {
    let started = Instant::now();
    let r = f.await;
    let took = started.elapsed();
    assert_unavailable(r, what);
    assert!(
        took < OP_TIMEOUT + Duration::from_millis(400),
        "{what} took {took:?}"
    );
}

#[tokio::test]
async fn redis_down_is_unavailable_within_the_op_timeout_never_a_grant() {
    let mut redis = PrivateRedis::start();
    let (store, _db) = fence_store(2000).await;
    let (locks, _) = redis_locks(&redis.url(), &store).await;
    let name = unique("down");
    let ttl = Duration::from_secs(10);
    let g = locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    locks.ping().await.unwrap();

    redis.stop();
    for _ in 0..3 {
        unavailable_in_time("acquire", locks.try_acquire(&name, &new_lease(), ttl)).await;
    }
    unavailable_in_time("renew", locks.renew(&name, &g.lease, ttl)).await;
    unavailable_in_time("release", locks.release(&name, &g.lease)).await;
    unavailable_in_time("status", locks.status(&name)).await;
    unavailable_in_time("ping", locks.ping()).await;

    // Back, empty: grants resume, above the fence issued before.
    redis.start_again();
    let deadline = Instant::now() + Duration::from_secs(15);
    let h = loop {
        match locks.try_acquire(&name, &new_lease(), ttl).await {
            Ok(h) => break h,
            Err(LockError::Unavailable(e)) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("Redis is back but: {e}"),
        }
    };
    assert!(h.fence > g.fence, "{} then {}", g.fence, h.fence);
    locks.ping().await.unwrap();
}

#[tokio::test]
async fn starts_while_redis_is_down_and_grants_once_it_is_up() {
    let mut redis = PrivateRedis::start();
    redis.stop();
    let (store, _db) = fence_store(2000).await;
    let (locks, notifier) = redis_locks(&redis.url(), &store).await;
    let name = unique("late");
    unavailable_in_time(
        "acquire before Redis is up",
        locks.try_acquire(&name, &new_lease(), Duration::from_secs(5)),
    )
    .await;
    redis.start_again();
    let deadline = Instant::now() + Duration::from_secs(15);
    let g = loop {
        match locks
            .try_acquire(&name, &new_lease(), Duration::from_secs(5))
            .await
        {
            Ok(g) => break g,
            Err(LockError::Unavailable(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("Redis is up but: {e}"),
        }
    };
    // The subscription came up by itself too: a release wakes a waiter.
    let deadline = Instant::now() + Duration::from_secs(15);
    while !locks.subscribed() {
        assert!(Instant::now() < deadline, "never subscribed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waiter = notifier.register(&name);
    locks.release(&name, &g.lease).await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), waiter.wait())
        .await
        .expect("the waiter woke");
}

#[tokio::test]
async fn a_release_wakes_waiters_on_every_gateway_through_pubsub() {
    let url = require_shared_redis();
    let (store, _db) = fence_store(2000).await;
    // Two gateways on one Redis (and, here, one store).
    let (a, _) = redis_locks(&url, &store).await;
    let (_b, b_notifier) = redis_locks(&url, &store).await;
    assert!(a.subscribed());
    let name = unique("wake");
    let g = a
        .try_acquire(&name, &new_lease(), Duration::from_secs(30))
        .await
        .unwrap();
    let waiter = b_notifier.register(&name);
    let other = b_notifier.register(&unique("unrelated"));
    a.release(&name, &g.lease).await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), waiter.wait())
        .await
        .expect("the other gateway's waiter woke");
    // A release of one name wakes only that name's waiters.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), other.wait())
            .await
            .is_err()
    );
}

// --- Redlock -------------------------------------------------------------

struct Cluster {
    nodes: Vec<PrivateRedis>,
    locks: Redlock,
    notifier: Arc<Notifier>,
    _db: TestStore,
}

async fn cluster(n: usize) -> Cluster {
    let nodes: Vec<PrivateRedis> = (0..n).map(|_| PrivateRedis::start()).collect();
    let urls: Vec<String> = nodes.iter().map(|r| r.url()).collect();
    let (store, db) = fence_store(2000).await;
    let notifier = Notifier::new();
    let locks = Redlock::connect(&urls, store, Duration::from_millis(300), notifier.clone())
        .await
        .expect("connect");
    assert_eq!(locks.nodes(), n);
    assert_eq!(locks.quorum(), n / 2 + 1);
    Cluster {
        nodes,
        locks,
        notifier,
        _db: db,
    }
}

impl Cluster {
    fn holders(&self, name: &str) -> usize {
        let key = lock_key(name);
        self.nodes
            .iter()
            .filter(|n| n.is_running())
            .filter(|n| n.exists(&key))
            .count()
    }
}

#[tokio::test]
async fn redlock_three_nodes() {
    let mut c = cluster(3).await;
    let name = unique("rl3");
    let ttl = Duration::from_secs(5);

    // All up: a grant, with validity below the ttl.
    let g = c.locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    assert!(g.valid_for < ttl && g.valid_for > ttl - Duration::from_secs(1));
    assert_eq!(c.holders(&name), 3);
    match c.locks.try_acquire(&name, &new_lease(), ttl).await {
        Err(LockError::Held { expires_in }) => assert!(expires_in.unwrap() <= ttl),
        other => panic!("expected Held, got {other:?}"),
    }
    assert_eq!(c.holders(&name), 3, "the failed attempt took nothing");
    let s = c.locks.status(&name).await.unwrap();
    assert!(s.held);
    assert_eq!(s.fence, g.fence);
    assert!(s.expires_in.unwrap() <= ttl);

    let r = c.locks.renew(&name, &g.lease, ttl).await.unwrap();
    assert_eq!(r.fence, g.fence);
    assert!(r.valid_for < ttl);
    assert_not_holder(
        c.locks.renew(&name, &new_lease(), ttl).await,
        "renew by another",
    );
    assert_not_holder(
        c.locks.release(&name, &new_lease()).await,
        "release by another",
    );

    let waiter = c.notifier.register(&name);
    c.locks.release(&name, &g.lease).await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), waiter.wait())
        .await
        .expect("release woke the waiter");
    assert_eq!(c.holders(&name), 0);
    let s = c.locks.status(&name).await.unwrap();
    assert!(!s.held);
    // The last fence issued: the refused attempt above burnt one.
    assert_eq!(s.fence, g.fence + 1);

    // One stopped: a majority remains.
    c.nodes[0].stop();
    let h = c.locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    assert!(h.fence > g.fence);
    assert!(h.valid_for < ttl);
    assert_eq!(c.locks.status(&name).await.unwrap().fence, h.fence);
    let r = c.locks.renew(&name, &h.lease, ttl).await.unwrap();
    assert_eq!(r.fence, h.fence);
    c.locks.ping().await.unwrap();
    c.locks.release(&name, &h.lease).await.unwrap();

    // Two stopped: no majority, Unavailable within the per-node timeout, and
    // the surviving node is not left holding the key.
    c.nodes[1].stop();
    let started = Instant::now();
    assert_unavailable(
        c.locks.try_acquire(&name, &new_lease(), ttl).await,
        "acquire with 1 of 3",
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(c.nodes[2].is_running());
    assert!(!c.nodes[2].exists(&lock_key(&name)), "withdrawn");
    assert_unavailable(c.locks.ping().await, "ping with 1 of 3");

    // A node back (empty): grants resume, fences still rising.
    c.nodes[0].start_again();
    let deadline = Instant::now() + Duration::from_secs(15);
    let k = loop {
        match c.locks.try_acquire(&name, &new_lease(), ttl).await {
            Ok(k) => break k,
            Err(LockError::Unavailable(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("a majority is back but: {e}"),
        }
    };
    assert!(k.fence > h.fence);
}

#[tokio::test]
async fn redlock_five_nodes() {
    let mut c = cluster(5).await;
    let name = unique("rl5");
    let ttl = Duration::from_secs(5);

    c.nodes[0].stop();
    c.nodes[3].stop();
    let g = c.locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    assert!(g.valid_for < ttl);
    assert_eq!(c.holders(&name), 3);
    let s = c.locks.status(&name).await.unwrap();
    assert!(s.held);
    assert_eq!(s.fence, g.fence);
    c.locks.release(&name, &g.lease).await.unwrap();
    assert_eq!(c.holders(&name), 0);

    c.nodes[4].stop();
    assert_unavailable(
        c.locks.try_acquire(&name, &new_lease(), ttl).await,
        "acquire with 2 of 5",
    );
    assert_eq!(c.holders(&name), 0, "no node is left holding the key");
}

#[tokio::test]
async fn redlock_validity_is_below_the_ttl_and_a_split_is_not_a_grant() {
    let c = cluster(3).await;
    let name = unique("rlsplit");
    let ttl = Duration::from_millis(1000);
    let g = c.locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    // ttl - elapsed - (1 % + 2 ms)
    assert!(
        g.valid_for <= ttl - Duration::from_millis(12),
        "{:?}",
        g.valid_for
    );

    // Someone else holds one node only: with the other two, a grant.
    c.locks.release(&name, &g.lease).await.unwrap();
    let stranger = format!("{}:999", new_lease());
    command::<()>(
        &c.nodes[0].url(),
        redis::cmd("SET")
            .arg(lock_key(&name))
            .arg(&stranger)
            .arg("PX")
            .arg(10_000),
    );
    let h = c.locks.try_acquire(&name, &new_lease(), ttl).await.unwrap();
    assert!(h.fence > g.fence);
    c.locks.release(&name, &h.lease).await.unwrap();

    // Someone else holds two nodes: Held, and our third-node key withdrawn.
    command::<()>(
        &c.nodes[1].url(),
        redis::cmd("SET")
            .arg(lock_key(&name))
            .arg(&stranger)
            .arg("PX")
            .arg(10_000),
    );
    match c.locks.try_acquire(&name, &new_lease(), ttl).await {
        Err(LockError::Held { .. }) => {}
        other => panic!("expected Held, got {other:?}"),
    }
    assert!(!c.nodes[2].exists(&lock_key(&name)));
    let s = c.locks.status(&name).await.unwrap();
    assert!(s.held, "a majority holds the stranger's value");
    assert_eq!(s.fence, 999);
}

#[tokio::test]
async fn redlock_rejects_an_empty_or_duplicate_node_list() {
    let (store, _db) = fence_store(2000).await;
    let n = Notifier::new();
    assert!(matches!(
        Redlock::connect(&[], store.clone(), OP_TIMEOUT, n.clone()).await,
        Err(LockError::Unavailable(_))
    ));
    let url = "redis://127.0.0.1:1".to_string();
    assert!(matches!(
        Redlock::connect(&[url.clone(), url], store, OP_TIMEOUT, n).await,
        Err(LockError::Unavailable(_))
    ));
}
