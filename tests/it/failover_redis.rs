//! Redis failovers under a running gateway, with real servers: a replica
//! promoted behind a TCP proxy the test switches (a VIP's stand-in), a
//! demoted master still reached through an old proxy session, a Sentinel
//! group that fails over by itself, and Redlock nodes that lose their data.
//!
//! What every test checks: fences only grow across the failover (the
//! durable floor in the store makes up for what Redis lost), the old
//! holder's writes are refused once the new holder has written, and the
//! recording upstream never sees them; the gateway reaches the new master
//! without a restart, and its release subscription with it.
//!
//! Every server is a private child process stopped by its guard, also when
//! a test fails; every wait is bounded in time and in tries.

use std::time::{Duration, Instant};

use fencegate::locks::backend::{LockBackend, LockError};
use fencegate::locks::notify::Notifier;
use fencegate::locks::redis_node::{fence_key, lock_key, RELEASED_CHANNEL};
use fencegate::locks::single_redis::RedisLocks;
use serde_json::{json, Value};

use crate::locks_redis::fence_store_on;
use crate::support::app::{docs_route, problem, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::redis::{command, private_nodes, PrivateRedis, SentinelGroup, SwitchProxy};
use crate::support::upstream::Upstream;

/// `[locks] redis_timeout_ms` in these tests: short, so that a call to a
/// dead master gives up quickly, yet roomy for a loaded two-core machine.
const REDIS_TIMEOUT_MS: u64 = 500;

/// How long a test waits for the gateway to grant again after a failover.
const RECOVERY: Duration = Duration::from_secs(30);

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

fn new_lease() -> String {
    format!("{:032x}", rand::random::<u128>())
}

async fn acquire(app: &TestApp, name: &str, ttl_ms: u64, wait_ms: u64) -> reqwest::Response {
    post(
        &app.http,
        &app.url(&format!("/_fencegate/locks/{name}")),
        json!({"ttl_ms": ttl_ms, "wait_ms": wait_ms}),
    )
    .await
}

async fn post(http: &reqwest::Client, url: &str, body: Value) -> reqwest::Response {
    http.post(url)
        .json(&body)
        .send()
        .await
        .expect("gateway answered")
}

/// A 201 grant's body.
async fn granted(resp: reqwest::Response) -> Value {
    let status = resp.status();
    let v: Value = resp.json().await.expect("JSON answer");
    assert_eq!(status, 201, "{v}");
    v
}

/// Acquires `name` (no wait), trying again while the gateway answers 503
/// (no master yet) or 409 (a node not back yet, for Redlock), within
/// [`RECOVERY`].
async fn grant_after_failover(app: &TestApp, name: &str, ttl_ms: u64) -> Value {
    let deadline = Instant::now() + RECOVERY;
    let mut tries = 0;
    loop {
        tries += 1;
        let r = acquire(app, name, ttl_ms, 0).await;
        let status = r.status().as_u16();
        if status == 201 {
            return r.json().await.expect("grant JSON");
        }
        let body = r.text().await.unwrap_or_default();
        assert!(
            matches!(status, 503 | 409),
            "acquire {name} after the failover: {status} {body}"
        );
        assert!(
            Instant::now() < deadline && tries < 600,
            "no grant of {name} within {RECOVERY:?} ({tries} tries); last: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The holder `h` releases `name` (after a failover) and the waiter `w`,
/// in line since before it, is granted the lock, with a higher fence.
async fn handed_over(
    app: &TestApp,
    name: &str,
    h: &Value,
    w: tokio::task::JoinHandle<reqwest::Response>,
) -> Value {
    release_after_failover(app, name, h["lease"].as_str().unwrap()).await;
    let answer = tokio::time::timeout(RECOVERY, w).await.expect("W answered");
    let wg = granted(answer.unwrap()).await;
    assert!(fence(&wg) > fence(h), "{} then {}", fence(h), fence(&wg));
    wg
}

/// Releases, trying again while the gateway answers 503.
async fn release_after_failover(app: &TestApp, name: &str, lease: &str) {
    let url = app.url(&format!("/_fencegate/locks/{name}/release"));
    let deadline = Instant::now() + RECOVERY;
    loop {
        let r = post(&app.http, &url, json!({ "lease": lease })).await;
        match r.status().as_u16() {
            204 => return,
            503 if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            s => panic!(
                "release of {name} after the failover: {s} {}",
                r.text().await.unwrap_or_default()
            ),
        }
    }
}

fn fence(grant: &Value) -> i64 {
    grant["fence"].as_i64().expect("a numeric fence")
}

fn token(grant: &Value) -> &str {
    grant["token"].as_str().expect("a token")
}

/// A write to `path` under `grant`'s token, which the gateway must forward:
/// the tests check the holder's writes go through before they check the
/// stale ones are refused.
async fn write_as(app: &TestApp, path: &str, grant: &Value, body: &str) {
    let status = app.put(path, Some(token(grant)), body).await.status();
    assert_eq!(status, 200, "{body} on {path}");
}

/// Starts a blocking acquire of `name` in the background and returns once
/// it has asked Redis at least once (its acquire script ran on `server`),
/// so that it is waiting on that server when the test fails it over.
async fn waiter_on(
    app: &TestApp,
    server: &PrivateRedis,
    name: &str,
    wait_ms: u64,
) -> tokio::task::JoinHandle<reqwest::Response> {
    let before = server.calls("evalsha");
    let (http, url) = (
        app.http.clone(),
        app.url(&format!("/_fencegate/locks/{name}")),
    );
    let task = tokio::spawn(async move {
        post(&http, &url, json!({"ttl_ms": 10_000, "wait_ms": wait_ms})).await
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.calls("evalsha") <= before {
        assert!(
            Instant::now() < deadline,
            "the blocking acquire never reached Redis"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let its answer (held) get back before the server goes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!task.is_finished(), "the blocking acquire did not wait");
    task
}

/// Waits until `server` has at least `n` subscribers to the release
/// channel: the gateway subscribed again on the new master.
async fn wait_subscribers(server: &PrivateRedis, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let have = server.subscribers(RELEASED_CHANNEL);
        if have >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{have} of {n} subscriptions to {RELEASED_CHANNEL} on {} after 20 s",
            server.port
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The writes the upstream applied on `path`: their bodies in order, after
/// checking it saw no breach (no lower token after a higher one, never two
/// tokens in flight at once).
fn applied_bodies(up: &Upstream, path: &str) -> Vec<String> {
    assert_eq!(up.violations(), Vec::<String>::new());
    let applied = up.applied_on(path);
    let tokens: Vec<i64> = applied.iter().filter_map(|a| a.token).collect();
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "tokens applied on {path}: {tokens:?}"
    );
    // Nothing arrived that was not applied (no write cut short, no stale
    // write that reached the upstream some other way).
    let arrived = up.requests().iter().filter(|r| r.path() == path).count();
    assert_eq!(arrived, applied.len(), "requests that arrived on {path}");
    applied
        .iter()
        .map(|a| String::from_utf8_lossy(&a.body).into_owned())
        .collect()
}

async fn ready(app: &TestApp) -> u16 {
    let r = app.http.get(app.admin_url("/readyz")).send().await;
    r.expect("admin answered").status().as_u16()
}

/// Waits for `/readyz` to answer 200 again.
async fn wait_ready(app: &TestApp) {
    let deadline = Instant::now() + RECOVERY;
    while ready(app).await != 200 {
        assert!(
            Instant::now() < deadline,
            "/readyz not 200 after {RECOVERY:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The master dies with writes its replica never got (the link between
/// them is cut first, as when a replica lags); the test promotes the replica
/// with `REPLICAOF NO ONE` and moves the proxy (the gateway's `redis_url`)
/// to it, cutting open sessions as a VIP does.
///
/// - While there is no master: 503 with Retry-After, no grant.
/// - The lease and the counter increment the replica missed are lost, yet
///   the next grant's fence is above every fence granted before (the
///   store's floor), and the Redis counter is raised to it.
/// - The old holder's write after the new holder's is 409 and never reaches
///   the upstream; its renew is 409 (its lease is gone).
/// - A blocking acquire waiting on the old master when it died is still in
///   line afterwards, and granted with a higher fence when the holder of a
///   lease the replica did get releases it after the failover.
/// - The gateway subscribed to releases on the new master by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_promoted_behind_a_proxy_keeps_fences_rising_and_refuses_the_old_holder() {
    let mut master = PrivateRedis::start();
    // The replica replicates through a link of its own that the test cuts,
    // so that what the master writes afterwards never reaches it.
    let link = SwitchProxy::start(master.port).await;
    let replica = tokio::task::block_in_place(|| PrivateRedis::replica_of_port(link.port));
    let proxy = SwitchProxy::start(master.port).await;
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let extra = format!(
        "{}[locks]\nbackend = \"redis\"\nredis_url = \"{}\"\nredis_timeout_ms = {REDIS_TIMEOUT_MS}\n",
        docs_route(&up.url()),
        proxy.url()
    );
    let app = TestApp::spawn(&store.url, &extra).await;
    let lost = "doc:lost";
    let kept = "doc:kept";
    let mut fences = Vec::new();

    // Two grants both servers know of (the counter is 2 on each).
    for _ in 0..2 {
        let g = granted(acquire(&app, lost, 10_000, 0).await).await;
        fences.push(fence(&g));
        release_after_failover(&app, lost, g["lease"].as_str().unwrap()).await;
    }
    // A lease the replica will have: H holds `kept`.
    let h = granted(acquire(&app, kept, 60_000, 0).await).await;
    master.wait_replicated(1);

    // The replica stops replicating; the old holder O's grant and write
    // reach the master only.
    link.cut_off();
    let o = granted(acquire(&app, lost, 60_000, 0).await).await;
    fences.push(fence(&o));
    assert_eq!(fences, vec![1, 2, 3]);
    write_as(&app, "/docs/lost", &o, "O before").await;
    // W waits for `kept`, on the old master.
    let w = waiter_on(&app, &master, kept, 30_000).await;

    // The master dies. No master: 503 with Retry-After, nothing granted.
    master.stop();
    let r = acquire(&app, &unique("doc:none"), 5_000, 0).await;
    assert!(r.headers().contains_key("retry-after"), "{:?}", r.headers());
    problem(r, 503).await;

    // Promotion; the proxy now leads to the new master, which never got
    // O's lease nor the third increment.
    replica.promote();
    proxy.switch(replica.port, true);
    assert!(
        !replica.exists(&lock_key(lost)),
        "O's lease was not replicated"
    );
    let behind: i64 = command(&replica.url(), redis::cmd("GET").arg(fence_key(lost)));
    assert_eq!(behind, 2, "the new master's counter is behind");

    // The new holder N: O's lease and the third increment were lost, yet
    // N's fence is above O's.
    let n = grant_after_failover(&app, lost, 60_000).await;
    assert!(
        fences.iter().all(|f| fence(&n) > *f),
        "{} after {fences:?}",
        fence(&n)
    );
    fences.push(fence(&n));
    let counter: i64 = command(&replica.url(), redis::cmd("GET").arg(fence_key(lost)));
    assert_eq!(counter, fence(&n), "the new master's counter was raised");
    write_as(&app, "/docs/lost", &n, "N after").await;

    // O, unaware, writes and renews: refused.
    app.assert_stale("/docs/lost", token(&o), "O stale", fence(&n))
        .await;
    let renew = post(
        &app.http,
        &app.url(&format!("/_fencegate/locks/{lost}/renew")),
        json!({"lease": o["lease"], "ttl_ms": 10_000}),
    )
    .await;
    problem(renew, 409).await;
    assert_eq!(
        applied_bodies(&up, "/docs/lost"),
        vec!["O before", "N after"]
    );

    // The release subscription is back, on the new master.
    wait_subscribers(&replica, 1).await;
    // H's lease survived (it was replicated); H releases it, and W, which
    // waited through the failover, gets it with a higher fence.
    handed_over(&app, kept, &h, w).await;
    assert_eq!(ready(&app).await, 200);
    app.stop().await;
}

/// The master is demoted (`REPLICAOF` the promoted replica) while the
/// proxy in front keeps its old sessions to it, as HAProxy does without
/// `on-marked-down shutdown-sessions`: the gateway's connection still
/// reaches a server that now refuses writes.
///
/// - A grant attempt there is unavailable (`READONLY`), never a grant, and
///   leaves no lock behind.
/// - The connection is then dropped and the next call reaches the new
///   master through the proxy: grants and renewals resume.
/// - Readiness (`ROLE`) reports a replica as unavailable, and moves on too.
/// - The release subscription follows: a release on the new master wakes a
///   waiter of another gateway, which hears of releases only through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_answers_unavailable_and_the_gateway_moves_to_the_new_one() {
    let old = PrivateRedis::start();
    let new = PrivateRedis::replica_of(&old);
    let proxy = SwitchProxy::start(old.port).await;
    let (store, _db) = fence_store_on(Backend::Sqlite, 2000).await;
    let timeout = Duration::from_millis(REDIS_TIMEOUT_MS);
    let a = RedisLocks::connect(&proxy.url(), store.clone(), timeout, Notifier::new())
        .await
        .expect("connect a");
    let b_notifier = Notifier::new();
    let b = RedisLocks::connect(&proxy.url(), store.clone(), timeout, b_notifier.clone())
        .await
        .expect("connect b");
    let name = unique("demoted");
    let ttl = Duration::from_secs(30);
    let g = a
        .try_acquire(&name, &new_lease(), ttl)
        .await
        .expect("grant");
    b.ping().await.expect("b is connected");
    old.wait_replicated(1);

    // Failover by hand; the proxy's new sessions go to the new master, its
    // old ones stay with the old one, which becomes a replica.
    new.promote();
    proxy.switch(new.port, false);
    old.demote_to(&new);
    wait_synced(&old).await;

    let other = unique("demoted-other");
    match a.try_acquire(&other, &new_lease(), ttl).await {
        Err(LockError::Unavailable(why)) => {
            assert!(why.contains("read only replica"), "{why}")
        }
        r => panic!("a write on the demoted master: expected Unavailable, got {r:?}"),
    }
    assert!(
        !new.exists(&lock_key(&other)),
        "nothing granted on the new master"
    );
    let h = a
        .try_acquire(&other, &new_lease(), ttl)
        .await
        .expect("the next call reaches the new master");
    assert!(new.exists(&lock_key(&other)));
    assert_eq!(h.fence, 1);
    // G's lease was replicated: it renews on the new master.
    let r = a.renew(&name, &g.lease, ttl).await.expect("renew");
    assert_eq!(r.fence, g.fence);

    // b's connection still reaches the demoted master: readiness says so.
    match b.ping().await {
        Err(LockError::Unavailable(why)) => assert!(why.contains("replica"), "{why}"),
        r => panic!("ping through the stale session: expected Unavailable, got {r:?}"),
    }
    b.ping().await.expect("b reaches the new master");

    // Both gateways' subscriptions moved to the new master; a's release
    // there wakes b's waiter, which only b's subscription can wake.
    wait_subscribers(&new, 2).await;
    let waiter = b_notifier.register(&name);
    a.release(&name, &g.lease).await.expect("release");
    tokio::time::timeout(Duration::from_secs(10), waiter.wait())
        .await
        .expect("b's waiter woke through the new master's pub/sub");
    let s = b.status(&name).await.expect("status");
    assert!(!s.held);
    assert_eq!(s.fence, g.fence);
}

/// Waits until `replica` has synced with its master.
async fn wait_synced(replica: &PrivateRedis) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let info: String = command(&replica.url(), redis::cmd("INFO").arg("replication"));
        if info.contains("master_link_status:up") {
            return;
        }
        assert!(Instant::now() < deadline, "no sync within 15 s:\n{info}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A 3-Sentinel group, and a gateway that finds the master through it,
/// ready.
async fn on_sentinels() -> (SentinelGroup, TestStore, Upstream, TestApp) {
    let name = unique("fg");
    let group = tokio::task::spawn_blocking(move || SentinelGroup::start(&name))
        .await
        .expect("sentinel group");
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let extra = format!(
        "{}[locks]\nbackend = \"redis\"\nredis_sentinels = {}\nredis_master_name = \"{}\"\n\
         redis_timeout_ms = {REDIS_TIMEOUT_MS}\n",
        docs_route(&up.url()),
        group.toml_list(),
        group.name
    );
    let app = TestApp::spawn(&store.url, &extra).await;
    wait_ready(&app).await;
    (group, store, up, app)
}

/// `redis_sentinels` and `redis_master_name`: the gateway finds the master
/// through a 3-Sentinel group; the master is killed and the Sentinels
/// promote the replica by themselves.
///
/// - Before: grants and writes, `/readyz` 200.
/// - After: grants resume without a restart, on the master Sentinel names
///   now; the release subscription moved there too; a blocking acquire
///   waiting when the master died is granted with a higher fence once the
///   holder releases; the holder's old token is 409 after the new one
///   wrote, and the upstream never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_discovery_follows_the_master_through_a_failover() {
    let (mut group, _store, up, app) = on_sentinels().await;

    let h = granted(acquire(&app, "doc:s", 60_000, 0).await).await;
    write_as(&app, "/docs/s", &h, "H before").await;
    wait_subscribers(&group.first, 1).await;
    group.first.wait_replicated(1);
    let w = waiter_on(&app, &group.first, "doc:s", 60_000).await;

    // The master dies; the Sentinels agree and promote the replica.
    group.first.stop();
    let promoted = group.second.port;
    {
        let group = &group;
        tokio::task::block_in_place(|| group.wait_master(promoted, RECOVERY));
    }

    // Without a restart: grants on the new master, and the subscription.
    let n = grant_after_failover(&app, "doc:t", 10_000).await;
    assert_eq!(fence(&n), 1);
    assert!(group.second.exists(&lock_key("doc:t")));
    wait_subscribers(&group.second, 1).await;
    wait_ready(&app).await;

    // H releases; W, in line since before the failover, gets the lock.
    let wg = handed_over(&app, "doc:s", &h, w).await;
    write_as(&app, "/docs/s", &wg, "W after").await;
    problem(app.put("/docs/s", Some(token(&h)), "H stale").await, 409).await;
    assert_eq!(applied_bodies(&up, "/docs/s"), vec!["H before", "W after"]);
    app.stop().await;
    drop(group);
}

/// `SENTINEL FAILOVER`: a switch while the old master stays up, still a
/// master that accepts writes until Sentinel makes it a replica of the new
/// one, seconds later. The gateway follows at Sentinel's `+switch-master`
/// event: grants on the new master within a few tries, the subscription
/// there, the lease granted before renewed and released there (it was
/// replicated), the next fence higher, `/readyz` 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_command_moves_the_gateway_to_the_new_master() {
    let (group, _store, _up, app) = on_sentinels().await;
    let h = granted(acquire(&app, "doc:f", 60_000, 0).await).await;
    group.first.wait_replicated(1);

    command::<()>(
        &group.sentinels[0].url(),
        redis::cmd("SENTINEL").arg("FAILOVER").arg(&group.name),
    );
    {
        let group = &group;
        tokio::task::block_in_place(|| group.wait_master(group.second.port, RECOVERY));
    }

    // Grants go to the new master, though the old one accepts writes until
    // Sentinel makes it a replica, seconds later: the gateway moved on
    // Sentinel's +switch-master event. (A grant that raced the event is
    // on the old master; its fence is still durable, and unique.)
    let mut tries = 0;
    let g = loop {
        tries += 1;
        let name = unique("doc:g");
        let g = grant_after_failover(&app, &name, 10_000).await;
        if group.second.exists(&lock_key(&name)) {
            break g;
        }
        assert!(tries < 20, "grants still land on the old master");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(fence(&g), 1);
    wait_subscribers(&group.second, 1).await;
    let renew_url = app.url("/_fencegate/locks/doc:f/renew");
    let r = post(
        &app.http,
        &renew_url,
        json!({"lease": h["lease"], "ttl_ms": 60_000}),
    )
    .await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    release_after_failover(&app, "doc:f", h["lease"].as_str().unwrap()).await;
    let next = granted(acquire(&app, "doc:f", 10_000, 0).await).await;
    assert!(
        fence(&next) > fence(&h),
        "{} then {}",
        fence(&h),
        fence(&next)
    );
    wait_ready(&app).await;
    app.stop().await;
}

/// Redlock: one node loses its data (FLUSHALL) and another restarts empty
/// while a lease is held. Only one node still has the holder's key, so a
/// majority grants the lock to someone else (Redlock's known weakness):
/// that grant's fence is above the holder's, and the holder's writes are
/// refused once the new holder wrote. Then every node loses everything:
/// the next fence is higher still, and status never reports a lower one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_nodes_losing_their_data_never_lower_a_fence() {
    let mut nodes = private_nodes(3).await;
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let urls: Vec<String> = nodes.iter().map(|r| format!("\"{}\"", r.url())).collect();
    let extra = format!(
        "{}[locks]\nbackend = \"redlock\"\nredis_urls = [{}]\nredis_timeout_ms = 250\n",
        docs_route(&up.url()),
        urls.join(", ")
    );
    let app = TestApp::spawn(&store.url, &extra).await;
    let name = "doc:rl";

    let h = granted(acquire(&app, name, 60_000, 0).await).await;
    write_as(&app, "/docs/rl", &h, "H before").await;
    assert!(nodes.iter().all(|n| n.exists(&lock_key(name))));

    nodes[0].flushall();
    tokio::task::block_in_place(|| nodes[1].start_again());
    let n = grant_after_failover(&app, name, 60_000).await;
    assert!(fence(&n) > fence(&h), "{} then {}", fence(&h), fence(&n));
    write_as(&app, "/docs/rl", &n, "N after").await;
    problem(app.put("/docs/rl", Some(token(&h)), "H stale").await, 409).await;
    assert_eq!(applied_bodies(&up, "/docs/rl"), vec!["H before", "N after"]);

    // Everything lost, everywhere.
    for node in &nodes {
        node.flushall();
    }
    let status = app.lock_status(name).await;
    assert_eq!(status["held"], false);
    assert!(status["fence"].as_i64().unwrap() >= fence(&n), "{status}");
    let m = grant_after_failover(&app, name, 10_000).await;
    assert!(fence(&m) > fence(&n), "{} then {}", fence(&n), fence(&m));
    assert_eq!(app.lock_status(name).await["fence"], fence(&m));
    app.stop().await;
}

/// The backend called directly: a Redlock node that restarts empty under
/// a running backend is reconnected to, and no grant ever carries a fence
/// at or below one granted before, through any mix of flushed and
/// restarted nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_fences_rise_through_every_node_losing_its_data_in_turn() {
    let mut nodes = private_nodes(3).await;
    let urls: Vec<String> = nodes.iter().map(|r| r.url()).collect();
    let (store, _db) = fence_store_on(Backend::Sqlite, 2000).await;
    let locks = fencegate::locks::redlock::Redlock::connect(
        &urls,
        store,
        Duration::from_millis(250),
        Notifier::new(),
    )
    .await
    .expect("connect");
    let name = unique("rl-turns");
    let ttl = Duration::from_secs(30);
    let mut fences: Vec<i64> = Vec::new();
    for round in 0..6 {
        // Granted while the previous holder still believes it holds: the
        // nodes that lost its key are a majority with the untouched one
        // (or the previous grant was on nodes that lost it all).
        let deadline = Instant::now() + RECOVERY;
        let g = loop {
            match locks.try_acquire(&name, &new_lease(), ttl).await {
                Ok(g) => break g,
                Err(LockError::Held { .. } | LockError::Unavailable(_))
                    if Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => panic!("round {round}: {e}"),
            }
        };
        assert!(
            fences.iter().all(|f| g.fence > *f),
            "round {round}: {} after {fences:?}",
            g.fence
        );
        fences.push(g.fence);
        let s = locks.status(&name).await.expect("status");
        assert!(s.held && s.fence == g.fence, "round {round}: status {s:?}");
        // Two nodes lose the key: one flushed, one restarted empty.
        let (flushed, restarted) = (round % 3, (round + 1) % 3);
        nodes[flushed].flushall();
        tokio::task::block_in_place(|| nodes[restarted].start_again());
    }
}
