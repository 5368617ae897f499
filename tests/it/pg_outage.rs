//! Postgres goes away: fenced writes fail closed with 503 promptly, reads
//! still flow, `/readyz` says 503, and writes recover by themselves when
//! Postgres is back — with no stale write accepted afterwards. And the
//! gateway's connections are cut while in steady use: the same, without
//! a restart.
//!
//! Then one statement at a time is cut while it waits inside Postgres
//! (queued behind a test's transaction, its backend terminated): a fence
//! batch, a batch of Idempotency-Key records, a batch of records with a
//! fence decision, a shared-mode leave. And shared mode's connections are cut in
//! steady use, and while a write is at the upstream. Whatever the cut
//! statement carried is answered 503 and never forwarded; later attempts
//! recover by themselves; no write reaches the upstream twice, out of
//! order, or with a stale token.
//!
//! Last, a statement commits and its reply is lost on the way back (a
//! proxy swallows it, then breaks the connection): a fence batch, a batch
//! with a first use's in-flight record, a batch with its answer, a
//! shared-mode admission. The gateway cannot know the outcome, and must
//! act on what the store may hold: a stale token is refused, a request is
//! never forwarded twice, and a stored answer is replayed.
//!
//! And the store answers late (its replies held back, then delivered):
//! decisions pause and the single-writer lock stays with its session; or
//! the lock's session falls silent while its server lets the lock go: a
//! new session takes it within seconds; or it stays silent, alive on its
//! server, past the watcher's patience: it is given up, then replaced.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::support::app::{
    config_sections, docs_route, problem, until_not_503, TestApp, SHARED_STORE,
};
use crate::support::db::{Backend, PgHolder, TestStore};
use crate::support::fenced_put;
use crate::support::pg::PrivatePg;
use crate::support::reply_loss::ReplyLoss;
use crate::support::upstream::Upstream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_fails_closed_and_recovers() {
    let pg = tokio::task::spawn_blocking(PrivatePg::start).await.unwrap();
    let up = Upstream::start().await;
    let app = TestApp::spawn(&pg.url(), &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/a", Some("10"), "ok").await.status(), 200);

    let pg = tokio::task::spawn_blocking(move || {
        pg.stop_immediate();
        pg
    })
    .await
    .unwrap();

    let started = Instant::now();
    let resp = app.put("/docs/a", Some("11"), "during outage").await;
    let took = started.elapsed();
    assert_eq!(
        resp.headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap()),
        Some("1")
    );
    problem(resp, 503).await;
    assert!(
        took < Duration::from_secs(10),
        "503 must come promptly, took {took:?}"
    );
    let ready = app.admin_get("/readyz").await;
    assert_eq!(ready.status(), 503);
    // Reads do not need the store.
    let read = app.http.get(app.url("/docs/a")).send().await.unwrap();
    assert_eq!(read.status(), 200);
    assert_eq!(up.applied().len(), 1, "nothing forwarded during the outage");

    let _pg = tokio::task::spawn_blocking(move || {
        pg.start_again();
        pg
    })
    .await
    .unwrap();
    // Recovery without a restart, within a bounded time.
    let resp = app
        .put_until_not_503("/docs/a", "12", "after", Duration::from_secs(30))
        .await;
    assert_eq!(resp.status(), 200, "writes did not recover");
    app.assert_stale("/docs/a", "11", "stale", 12).await;
    let ready = app.admin_get("/readyz").await;
    assert_eq!(ready.status(), 200);
}

/// Connections in steady use are not pinged before each statement (only
/// those idle for a second are), so a write can meet one that Postgres (a
/// restart, a pooler, an operator's `pg_terminate_backend`) cut a moment
/// ago. Such a write fails closed: 503, nothing forwarded. The broken
/// connections are not used again, so writes go through after a few
/// refusals, forwarded once, and no stale write is accepted after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_in_use_fail_closed_and_are_replaced() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    // Several connections in use at once, each used just now.
    let paths: Vec<String> = (0..8).map(|i| format!("/docs/w{i}")).collect();
    let warm: Vec<_> = paths
        .iter()
        .map(|path| app.put(path, Some("1"), "warm"))
        .collect();
    for resp in futures_util::future::join_all(warm).await {
        assert_eq!(resp.status(), 200);
    }
    assert_eq!(app.put("/docs/a", Some("1"), "first").await.status(), 200);

    cut_connections(&store.url).await;

    // At once, well within a second of their last use: until a write is
    // accepted. One token throughout: a 503 whose decision committed
    // before its answer was lost leaves the key at 2, which the retry's
    // equal token passes.
    let limit = Duration::from_secs(30);
    let resp = app
        .put_until_not_503("/docs/a", "2", "after the cut", limit)
        .await;
    assert_eq!(resp.status(), 200, "a write after the cut");
    // The token accepted is durable: an older one is refused as stale once
    // this instance decides again. Until it has taken its single-writer
    // lock again (that session was cut too), it decides nothing, not even
    // a refusal from memory: 503, never a forward.
    let resp = app.put_until_not_503("/docs/a", "1", "stale", limit).await;
    let answer = problem(resp, 409).await;
    assert_eq!(answer["highest_token"], 2, "{answer}");
    // Only accepted writes reached the upstream, once each.
    assert_eq!(up.bodies_on("/docs/a"), ["first", "after the cut"]);
}

/// Connections cut while the gateway is quiet (a Postgres restart at
/// night, a pooler recycling its server connections) are found out before
/// a write meets them: each connection idle for a second is pinged before
/// it is used again, the batchers' own connections as much as the pool's.
/// So once the gateway has its single-writer lock back, the first write
/// after the quiet spell is accepted at once, with no 503. (A connection
/// used without that check fails the write that meets it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_while_idle_are_replaced_before_a_write_meets_them() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/a", Some("1"), "first").await.status(), 200);

    cut_connections(&store.url).await;

    // The writer lock's session was cut too: wait until it is held again
    // (`/readyz` runs on the pool, never on the batchers' connections).
    let deadline = Instant::now() + Duration::from_secs(30);
    while app.admin_get("/readyz").await.status() != 200 {
        assert!(Instant::now() < deadline, "/readyz never recovered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Past the idle threshold of every connection the write will use.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    assert_eq!(
        app.put("/docs/a", Some("2"), "after the quiet")
            .await
            .status(),
        200,
        "the first write after the quiet spell met a dead connection"
    );
    app.assert_stale("/docs/a", "1", "stale", 2).await;
    assert_eq!(up.bodies_on("/docs/a"), ["first", "after the quiet"]);
    // Nor did the stale write arrive there, refused or not.
    let arrived = up
        .requests()
        .iter()
        .filter(|r| r.path() == "/docs/a")
        .count();
    assert_eq!(arrived, 2, "requests that arrived on /docs/a");
}

/// Cuts every connection to the test's database but the caller's own, as
/// `pg_terminate_backend` from an operator or a pooler would.
async fn cut_connections(url: &str) {
    let mut admin = PgConnection::connect(url).await.unwrap();
    let (cut,): (i64,) = sqlx::query_as(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(cut >= 2, "the gateway's connections were cut ({cut})");
}

/// Waits until a backend of the test database at `url` waits on a lock (a
/// gateway's statement queued behind a test's [`PgHolder`], which is idle
/// in its transaction, not waiting), for up to 10 s, then terminates every
/// such backend mid-statement, as `pg_terminate_backend` from an operator
/// or a pooler would. Answers the statements cut.
async fn cut_waiting(url: &str) -> Vec<String> {
    let mut admin = PgConnection::connect(url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Materialized: the backends are chosen first, and only those are
        // terminated.
        let cut: Vec<(String,)> = sqlx::query_as(
            "WITH waiting AS MATERIALIZED ( \
                 SELECT pid, query FROM pg_stat_activity \
                  WHERE datname = current_database() AND pid <> pg_backend_pid() \
                    AND wait_event_type = 'Lock') \
             SELECT query FROM waiting WHERE pg_terminate_backend(pid)",
        )
        .fetch_all(&mut admin)
        .await
        .unwrap();
        if !cut.is_empty() {
            return cut.into_iter().map(|(query,)| query).collect();
        }
        assert!(
            Instant::now() < deadline,
            "no statement of the gateway's waited on the test's lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One statement on the test database at `url`, from a connection of the
/// test's own: what the store itself holds, whatever the gateway's memory
/// says.
async fn on_store<T>(url: &str, sql: &str) -> T
where
    T: Send + Unpin + for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
    let mut conn = PgConnection::connect(url).await.unwrap();
    let row = sqlx::query_as(sql).fetch_one(&mut conn).await.unwrap();
    let _ = conn.close().await;
    row
}

/// The highest token the store itself holds for `key`.
async fn durable(url: &str, key: &str) -> Option<i64> {
    let (highest,): (Option<i64>,) = on_store(
        url,
        &format!("SELECT (SELECT highest_token FROM fences WHERE resource_key = '{key}')"),
    )
    .await;
    highest
}

/// How many requests (any method, any answer) reached the upstream on
/// `path`.
fn arrivals(up: &Upstream, path: &str) -> usize {
    up.requests().iter().filter(|r| r.path() == path).count()
}

/// How many requests reached the upstream with `Idempotency-Key: key`.
fn arrivals_keyed(up: &Upstream, key: &str) -> usize {
    up.requests()
        .iter()
        .filter(|r| r.header("idempotency-key") == Some(key))
        .count()
}

/// Each of the 503s `refused` (problem types) said that the store could
/// not decide, or that the key was busy behind an older write: nothing
/// else refuses a newer token.
fn assert_unavailable_or_busy(refused: &[String]) {
    let allowed = [
        "urn:fencegate:problem:store-unavailable",
        "urn:fencegate:problem:key-busy",
    ];
    assert!(
        refused.iter().all(|t| allowed.contains(&t.as_str())),
        "{refused:?}"
    );
}

/// A fenced PUT with an Idempotency-Key to `app`, to send (or to spawn).
fn keyed_put(
    app: &TestApp,
    path: &str,
    token: &str,
    key: &str,
    body: &str,
) -> reqwest::RequestBuilder {
    fenced_put(&app.http, app.url(path), token, body.to_string()).header("idempotency-key", key)
}

/// A single-mode gateway on `store` with `route`, whose store calls may
/// take 20 s: a statement that a test's lock holds up is still waiting when
/// the test cuts it, so the cut ends it, not the gateway giving up.
async fn patient_gateway(store: &TestStore, route: &str) -> TestApp {
    let text = config_sections("", &store.url, "timeout_ms = 20000\n", route);
    TestApp::from_text(&text).await
}

/// A test's transaction inserting, and holding uncommitted, an expired
/// record of `idem_key` on the route `docs` and method PUT: a gateway's
/// insert of the same record waits for it (and, once it commits, takes the
/// expired record over).
async fn hold_record(url: &str, idem_key: &str) -> PgHolder {
    PgHolder::begin(
        url,
        &format!(
            "INSERT INTO idempotency (route, method, idem_key, fingerprint, state, \
                                      in_flight_until, expires_at) \
             VALUES ('docs', 'PUT', '{idem_key}', '', 'done', \
                     now() - interval '1 hour', now() - interval '1 hour')"
        ),
    )
    .await
}

/// Single mode: the fence batch's statement is cut while it waits inside
/// Postgres (a transaction of the test holds the key's row, as an
/// operator's long transaction would, and the gateway's backend waiting
/// behind it is terminated). The write it carried is answered 503 and
/// never forwarded: a design that fails open, or reads a broken
/// connection as "no conflict", forwards it; one that reads it as a
/// refusal answers 409. The cut rolled the statement back (the store
/// still holds 5). Once the lock goes, the retry of the same token is
/// accepted, and that token is in the store itself, not only in memory (a
/// design that remembered the cut batch's token as durable would admit the
/// retry from memory without recording it); an older token is refused;
/// the upstream saw each accepted write once. The cut connection is not
/// used again (kept, it would fail every later batch, and the retries
/// would never stop being 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_batch_cut_mid_statement_fails_closed_and_recovers() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let app = patient_gateway(&store, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/x", Some("5"), "five").await.status(), 200);

    let holder = PgHolder::begin(
        &store.url,
        "SELECT 1 FROM fences WHERE resource_key = 'doc:x' FOR UPDATE",
    )
    .await;
    let seven = {
        let req = fenced_put(&app.http, app.url("/docs/x"), "7", "seven");
        tokio::spawn(async move { req.send().await })
    };
    let cut = cut_waiting(&store.url).await;
    assert!(
        cut.iter().all(|q| q.starts_with("INSERT INTO fences")),
        "the fence batch was cut: {cut:?}"
    );
    let resp = seven.await.unwrap().expect("gateway answered");
    let body = problem(resp, 503).await;
    assert_eq!(
        body["type"], "urn:fencegate:problem:store-unavailable",
        "{body}"
    );
    assert_eq!(
        durable(&store.url, "doc:x").await,
        Some(5),
        "the cut statement rolled back"
    );
    assert_eq!(
        up.bodies_on("/docs/x"),
        ["five"],
        "the cut write was not forwarded"
    );
    holder.commit().await;

    let limit = Duration::from_secs(30);
    let resp = app
        .put_until_not_503("/docs/x", "7", "seven again", limit)
        .await;
    assert_eq!(resp.status(), 200, "the retry after the cut");
    assert_eq!(
        durable(&store.url, "doc:x").await,
        Some(7),
        "the accepted token is in the store"
    );
    app.assert_stale("/docs/x", "6", "six", 7).await;
    assert_eq!(up.bodies_on("/docs/x"), ["five", "seven again"]);
    assert_eq!(
        arrivals(&up, "/docs/x"),
        2,
        "requests that arrived on /docs/x"
    );
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

/// Single mode, `idempotency = "required"`: a first use whose token memory
/// knows as the key's durable one writes its in-flight record in a batch
/// of records, on its own connection. That batch's statement is cut while
/// it waits inside Postgres (a transaction of the test is inserting the
/// same record). The first use is answered 503 and not forwarded: a design
/// that forwards without a durable record (fails open) sends it here and
/// again on the retry. The cut rolled the record back, so the retry with
/// the same key and payload is the key's first use: forwarded once, then
/// replayed. A design that took the failed insert for a live record (a
/// duplicate) would answer the retry "in progress", then "outcome
/// unknown", for a request that never left; one that kept the broken
/// connection would answer 503 for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_records_cut_mid_statement_is_forwarded_once_on_retry() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let route = format!("{}idempotency = \"required\"\n", docs_route(&up.url()));
    let app = patient_gateway(&store, &route).await;
    // Token 5 becomes the key's durable token, in memory too.
    let warm = keyed_put(&app, "/docs/k", "5", "warm", "warm").send().await;
    assert_eq!(warm.expect("gateway answered").status(), 200);

    let holder = cut_first_use(&store, &app, &up, "/docs/k", "5", "order-1", |q| {
        q.contains("INTO idempotency")
    })
    .await;
    let (records,): (i64,) = on_store(
        &store.url,
        "SELECT count(*) FROM idempotency WHERE idem_key = 'order-1'",
    )
    .await;
    assert_eq!(records, 0, "the cut statement wrote no record");
    holder.commit().await;

    retry_is_forwarded_once(&app, &up, "/docs/k", "5", "order-1").await;
    assert_eq!(up.bodies_on("/docs/k"), ["warm", "A"]);
    let stale = keyed_put(&app, "/docs/k", "4", "older", "B").send().await;
    let answer = problem(stale.expect("gateway answered"), 409).await;
    assert_eq!(answer["highest_token"], 5, "{answer}");
    assert_eq!(
        arrivals(&up, "/docs/k"),
        2,
        "requests that arrived on /docs/k"
    );
}

/// Single mode, `idempotency = "optional"`: a first use whose token the
/// store must decide brings its fence decision into the batch of records
/// with its in-flight record, one statement and one commit for both. That
/// statement is cut while it waits inside Postgres (its fence part has
/// run; its record part waits for a transaction of the test inserting the
/// same record). The first use is
/// answered 503 and not forwarded, and the cut took both parts back: the
/// store still holds the old token and no record. The retry with the same
/// key and payload is then the key's first use, forwarded once and
/// replayed after, and its token is in the store itself. A design that
/// wrote the decision and the record in separate commits, and forwarded on
/// the decision alone, or took the failed record for a duplicate, fails
/// here as in the test above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_records_with_a_decision_cut_mid_statement_is_forwarded_once_on_retry() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let route = format!("{}idempotency = \"optional\"\n", docs_route(&up.url()));
    let app = patient_gateway(&store, &route).await;
    assert_eq!(app.put("/docs/n", Some("5"), "five").await.status(), 200);

    let holder = cut_first_use(&store, &app, &up, "/docs/n", "7", "order-2", |q| {
        q.contains("INTO idempotency")
    })
    .await;
    assert_eq!(
        durable(&store.url, "doc:n").await,
        Some(5),
        "the decision went back with the record"
    );
    holder.commit().await;

    retry_is_forwarded_once(&app, &up, "/docs/n", "7", "order-2").await;
    assert_eq!(
        durable(&store.url, "doc:n").await,
        Some(7),
        "the accepted token is in the store"
    );
    app.assert_stale("/docs/n", "6", "six", 7).await;
    assert_eq!(up.bodies_on("/docs/n"), ["five", "A"]);
    assert_eq!(
        arrivals(&up, "/docs/n"),
        2,
        "requests that arrived on /docs/n"
    );
}

/// Sends a first use of `key` (token `token`, body "A") on `path` while a
/// transaction of the test holds its record, and cuts the statement that
/// waits behind it, which `cut_is` must recognize. The first use must be
/// answered 503 store-unavailable and not forwarded. Answers the holder,
/// still in its transaction.
async fn cut_first_use(
    store: &TestStore,
    app: &TestApp,
    up: &Upstream,
    path: &str,
    token: &str,
    key: &str,
    cut_is: impl Fn(&str) -> bool,
) -> PgHolder {
    let holder = hold_record(&store.url, key).await;
    let first = {
        let req = keyed_put(app, path, token, key, "A");
        tokio::spawn(async move { req.send().await })
    };
    let cut = cut_waiting(&store.url).await;
    assert!(cut.iter().all(|q| cut_is(q)), "the statement cut: {cut:?}");
    let resp = first.await.unwrap().expect("gateway answered");
    let body = problem(resp, 503).await;
    assert_eq!(
        body["type"], "urn:fencegate:problem:store-unavailable",
        "{body}"
    );
    assert_eq!(
        arrivals_keyed(up, key),
        0,
        "the first use was not forwarded"
    );
    holder
}

/// The retry of a first use that was cut (same key, same payload): after
/// 503s while the store recovers, it is the key's first use, forwarded;
/// the same request again is replayed; the key reached the upstream once.
async fn retry_is_forwarded_once(app: &TestApp, up: &Upstream, path: &str, token: &str, key: &str) {
    let limit = Duration::from_secs(30);
    let (retry, refused) = until_not_503(limit, || keyed_put(app, path, token, key, "A")).await;
    assert_eq!(retry.status(), 200, "the retry after 503s {refused:?}");
    assert!(
        retry.headers().get("idempotent-replayed").is_none(),
        "the retry is the key's first use"
    );
    let again = keyed_put(app, path, token, key, "A").send().await;
    let again = again.expect("gateway answered");
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(arrivals_keyed(up, key), 1, "forwarded once");
}

/// `n` shared-mode instances on `store`, their route's `timeout_ms` at
/// `route_timeout_ms` (an in-flight marker lasts a second longer), with
/// `store_extra` (whole lines) in their `[store]`.
async fn shared_gateways(
    store: &TestStore,
    up: &Upstream,
    n: usize,
    route_timeout_ms: u64,
    store_extra: &str,
) -> Vec<TestApp> {
    let route = format!("{}timeout_ms = {route_timeout_ms}\n", docs_route(&up.url()));
    let mut apps = Vec::new();
    for _ in 0..n {
        let store_lines = format!("{SHARED_STORE}{store_extra}");
        let text = config_sections("", &store.url, &store_lines, &route);
        apps.push(TestApp::from_text(&text).await);
    }
    apps
}

/// Shared mode: writes whose admissions are not counted in flight any more
/// (their leaves written), read from the store itself.
async fn until_all_left(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (in_flight,): (i64,) = on_store(
            url,
            "SELECT count(*) FROM fences WHERE inflight > 0 OR draining > 0",
        )
        .await;
        if in_flight == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{in_flight} keys still count writes in flight"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Shared mode, two instances: their connections are cut while in steady
/// use (each used a moment ago, so not pinged before its next statement;
/// every write's leave was written first, so nothing is counted in flight).
/// Writes that meet a cut connection fail closed: 503, nothing forwarded.
/// The broken connections are dropped, so each instance accepts writes
/// again by itself, without a restart; the accepted token is then the
/// threshold on both instances (an older one is 409, from the store), and
/// the upstream saw each accepted write once. A design that kept broken
/// connections in its pools would never recover; one that read a failed
/// admission as a refusal would answer 409 to the newer token; one that
/// failed open would forward during the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_mode_connections_cut_in_use_fail_closed_and_are_replaced() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = shared_gateways(&store, &up, 2, 3000, "").await;
    // Several connections in use at once on each instance.
    let warm: Vec<_> = (0..8)
        .map(|i| {
            let app = &apps[i % 2];
            fenced_put(&app.http, app.url(&format!("/docs/w{i}")), "1", "warm").send()
        })
        .collect();
    for resp in futures_util::future::join_all(warm).await {
        assert_eq!(resp.expect("gateway answered").status(), 200);
    }
    assert_eq!(
        apps[0].put("/docs/a", Some("1"), "first").await.status(),
        200
    );
    until_all_left(&store.url).await;

    cut_connections(&store.url).await;

    // A stale token first, through the instance that has not seen the
    // key, so that the store decides it: 503 while it meets broken
    // connections (never forwarded, as a design that fails open would),
    // then 409.
    let limit = Duration::from_secs(30);
    let resp = apps[1]
        .put_until_not_503("/docs/a", "0", "stale", limit)
        .await;
    let answer = problem(resp, 409).await;
    assert_eq!(answer["highest_token"], 1, "{answer}");
    // One token throughout: a 503 whose admission committed before its
    // answer was lost counts a writer of 2, which 2 may join.
    let resp = apps[0]
        .put_until_not_503("/docs/a", "2", "after the cut", limit)
        .await;
    assert_eq!(resp.status(), 200, "a write after the cut");
    for app in &apps {
        let resp = app.put_until_not_503("/docs/a", "1", "stale", limit).await;
        let answer = problem(resp, 409).await;
        assert_eq!(answer["highest_token"], 2, "{answer}");
    }
    // The other instance writes again too.
    let resp = apps[1]
        .put_until_not_503("/docs/w1", "2", "after the cut", limit)
        .await;
    assert_eq!(resp.status(), 200, "the other instance after the cut");
    assert_eq!(up.bodies_on("/docs/a"), ["first", "after the cut"]);
    assert_eq!(
        arrivals(&up, "/docs/a"),
        2,
        "requests that arrived on /docs/a"
    );
    assert_eq!(up.bodies_on("/docs/w1"), ["warm", "after the cut"]);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

/// Shared mode, two instances: every connection is cut while a write of
/// token 5 (through the first instance) is admitted and held at the
/// upstream. Its leave may be lost with them (then its key stays closed to
/// newer tokens until its in-flight marker ends), or written on a new
/// connection. Token 6, sent through both instances from the moment of
/// the cut, is answered 503 (the store unreachable, or the key busy behind
/// 5), never forwarded, until 5 is done: at the upstream, 6 never arrived
/// while 5 was still in flight there (the recorder's check), and it was
/// applied after 5, once. Then 5 is stale on both instances, and no stale
/// write reached the upstream. A design whose per-key ordering lived in the
/// connections (a session lock held for the forward, which the cut
/// releases), or that let a write go when the store could not be asked,
/// would forward 6 beside 5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_mode_connections_cut_while_a_write_is_at_the_upstream() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    // 5 is held 4 s at the upstream (room for the cut on a loaded
    // machine), inside the route's 6 s; 6 gives up waiting behind it after
    // 200 ms (503 key-busy), and asks again.
    let apps = shared_gateways(&store, &up, 2, 6000, "key_lock_wait_ms = 200\n").await;
    let five = up
        .held_write(apps[0].url("/docs/h"), "5", "five", 4000)
        .await;
    assert_eq!(up.in_flight(), 1, "5 is at the upstream");
    // The other instance's connections in use too, a moment before the cut.
    let other = apps[1].put("/docs/other", Some("1"), "other").await;
    assert_eq!(other.status(), 200);

    cut_connections(&store.url).await;
    assert_eq!(up.in_flight(), 1, "5 was at the upstream when the cut came");

    // 6 while 5 is held, then until it is accepted: through both instances,
    // first through the other one, which holds no write of the key and so
    // has nothing but the store to wait behind.
    let limit = Duration::from_secs(30);
    let mut attempt = 0;
    let (six, refused) = until_not_503(limit, || {
        attempt += 1;
        let app = &apps[attempt % 2];
        fenced_put(&app.http, app.url("/docs/h"), "6", "six")
    })
    .await;
    assert_eq!(six.status(), 200, "6 after 503s {refused:?}");
    assert_eq!(five.await.unwrap().unwrap(), 200, "5 was answered");
    assert_unavailable_or_busy(&refused);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
    let tokens: Vec<_> = up.applied_on("/docs/h").iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6)]);
    for app in &apps {
        let resp = app.put_until_not_503("/docs/h", "5", "stale", limit).await;
        let answer = problem(resp, 409).await;
        assert_eq!(answer["highest_token"], 6, "{answer}");
    }
    assert_eq!(
        arrivals(&up, "/docs/h"),
        2,
        "requests that arrived on /docs/h"
    );
}

/// Shared mode, two instances: the leave of a write of token 5 is cut
/// while its statement waits inside Postgres (a transaction of the test
/// holds the key's row when 5's answer ends, and the backend waiting
/// behind it is terminated). The gateway cannot know whether a cut leave
/// committed (a `FATAL` may come after the commit), and a leave counted
/// twice could open a key under another write of the same token: so it is
/// not written again, 5 stays counted in flight (read in the store), and
/// the key stays closed to token 6 until 5's in-flight marker ends: 503
/// key-busy, nothing forwarded. Then 6 is admitted, not before the marker's
/// end (a lower bound taken from the store's clock), once; 5 is stale on
/// both instances. A design that wrote a failed leave again, or that
/// forgot a key's writers when their connection broke, admits 6 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_mode_a_leave_cut_mid_statement_keeps_the_key_closed_until_the_marker_ends() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    // Markers of 11 s: long enough that 6 surely asks while 5's runs. 5 is
    // held 2.5 s: room to lock its row before it ends, on a loaded machine.
    let apps = shared_gateways(&store, &up, 2, 10_000, "key_lock_wait_ms = 200\n").await;
    let five = up
        .held_write(apps[0].url("/docs/l"), "5", "five", 2500)
        .await;
    let holder = PgHolder::begin(
        &store.url,
        "SELECT 1 FROM fences WHERE resource_key = 'doc:l' FOR UPDATE",
    )
    .await;
    assert_eq!(
        up.in_flight(),
        1,
        "5 was still at the upstream when the row was locked"
    );
    assert_eq!(five.await.unwrap().unwrap(), 200, "5 was answered");
    let cut = cut_waiting(&store.url).await;
    assert!(
        cut.iter().all(|q| q.contains("fencegate_admit_batch")),
        "5's leave was cut: {cut:?}"
    );
    // The marker's end on the store's clock: the host's wall clock, which
    // the upstream's arrival times are also read from.
    let (in_flight, until_us): (i32, i64) = on_store(
        &store.url,
        "SELECT inflight, (EXTRACT(EPOCH FROM writer_until) * 1000000)::bigint \
           FROM fences WHERE resource_key = 'doc:l'",
    )
    .await;
    assert_eq!(in_flight, 1, "the cut leave was not written");
    let marker_ends = std::time::UNIX_EPOCH + Duration::from_micros(until_us as u64);
    holder.commit().await;

    let limit = Duration::from_secs(30);
    let mut attempt = 0;
    let (six, refused) = until_not_503(limit, || {
        attempt += 1;
        let app = &apps[attempt % 2];
        fenced_put(&app.http, app.url("/docs/l"), "6", "six")
    })
    .await;
    assert_eq!(six.status(), 200, "6 after 503s {refused:?}");
    assert!(
        refused
            .iter()
            .any(|t| t == "urn:fencegate:problem:key-busy"),
        "the key stayed closed behind 5's marker: {refused:?}"
    );
    assert_unavailable_or_busy(&refused);
    let requests = up.requests();
    let six = requests
        .iter()
        .find(|r| r.path() == "/docs/l" && r.header("x-fence-token") == Some("6"))
        .expect("6 arrived");
    assert!(
        six.arrived_wall >= marker_ends,
        "6 reached the upstream {:?} before 5's marker ended",
        marker_ends
            .duration_since(six.arrived_wall)
            .unwrap_or_default()
    );
    for app in &apps {
        app.assert_stale("/docs/l", "5", "stale", 6).await;
    }
    assert!(up.violations().is_empty(), "{:?}", up.violations());
    let tokens: Vec<_> = up.applied_on("/docs/l").iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6)]);
    assert_eq!(
        arrivals(&up, "/docs/l"),
        2,
        "requests that arrived on /docs/l"
    );
}

// --- Replies lost after a commit ----------------------------------------------

/// A single-mode gateway whose store connections pass through `loss`, with
/// `route` and store calls that may take 20 s: a statement whose reply is
/// swallowed is still waiting for it when the test cuts its connection.
async fn gateway_behind(loss: &ReplyLoss, store: &TestStore, route: &str) -> TestApp {
    let url = loss.url(&store.url);
    let text = config_sections("", &url, "timeout_ms = 20000\n", route);
    TestApp::from_text(&text).await
}

/// Waits, for up to 10 s, until `sql` (a count, on a connection of the
/// test's own, not through the proxy) answers 1: the statement whose
/// reply is being swallowed has committed.
async fn until_committed(url: &str, what: &str, sql: &str) {
    until_counted(
        url,
        sql,
        1,
        Duration::from_secs(10),
        &format!("{what} committed"),
    )
    .await;
}

/// Waits, for up to `limit`, until `sql` (a count, on a connection of the
/// test's own) answers `n`; `what` names it in the failure.
async fn until_counted(url: &str, sql: &str, n: i64, limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    loop {
        let (counted,): (i64,) = on_store(url, sql).await;
        if counted == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: counted {counted}, not {n}, after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `req` while Postgres's replies are swallowed; once the statement
/// it causes has committed (`committed`, see [`until_committed`]), breaks
/// the connections with `cut`. The gateway cannot know the outcome: the
/// request must be answered 503 store-unavailable.
async fn unknown_to_the_gateway(
    loss: &ReplyLoss,
    url: &str,
    req: reqwest::RequestBuilder,
    what: &str,
    committed: &str,
    cut: impl FnOnce(&ReplyLoss),
) {
    loss.swallow();
    let sent = tokio::spawn(async move { req.send().await });
    until_committed(url, what, committed).await;
    cut(loss);
    let resp = sent.await.unwrap().expect("gateway answered");
    let body = problem(resp, 503).await;
    assert_eq!(
        body["type"], "urn:fencegate:problem:store-unavailable",
        "{body}"
    );
}

/// After a write raising `path`'s key to `highest` was lost on its way
/// back (`unknown_to_the_gateway`), with `(stale, highest, body)`: the
/// older token `stale` is refused with 409 naming `highest`, and `highest`
/// again is forwarded with `body`, each after any 503s. A 503 may still
/// come for the second (a loaded machine can delay the single-writer
/// lock's confirmation past its lease, and the gateway then decides
/// nothing); it forwards nothing, and the client retries. The upstream
/// then saw exactly `bodies` on `path`, and no overlap. Answers the 503s
/// before the second was forwarded.
async fn stale_refused_then_forwarded(
    app: &TestApp,
    up: &Upstream,
    path: &str,
    (stale, highest, body): (&str, i64, &str),
    bodies: &[&str],
) -> Vec<String> {
    let limit = Duration::from_secs(30);
    let (refusal, refused) = until_not_503(limit, || {
        fenced_put(&app.http, app.url(path), stale, "stale".to_string())
    })
    .await;
    let answer = problem(refusal, 409).await;
    assert_eq!(
        answer["highest_token"], highest,
        "after 503s {refused:?}: {answer}"
    );
    let token = highest.to_string();
    let (again, refused) = until_not_503(limit, || {
        fenced_put(&app.http, app.url(path), &token, body.to_string())
    })
    .await;
    assert_eq!(
        again.status(),
        200,
        "{highest} again after 503s {refused:?}"
    );
    assert_eq!(up.bodies_on(path), bodies);
    assert_eq!(
        arrivals(up, path),
        bodies.len(),
        "requests that arrived on {path}"
    );
    assert!(up.violations().is_empty(), "{:?}", up.violations());
    refused
}

/// Single mode: a fence batch raises `doc:x` from 5 to 7 and commits, and
/// its reply is lost on the way back; the connection then breaks. The
/// gateway cannot know the outcome: the write is answered 503 and not
/// forwarded. The store holds 7, so token 5 must be refused from then on.
/// Memory last saw 5 as the key's durable token, and a design that took
/// the broken connection for "nothing written" (a rollback) would admit 5
/// from memory and forward a stale write: the cut batch-timeout test
/// cannot show this, as a terminated backend never commits. Token 7 then
/// goes through, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_batch_whose_commit_reply_is_lost_is_not_outrun_by_the_cache() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let loss = ReplyLoss::start(&store.url).await;
    let app = gateway_behind(&loss, &store, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/x", Some("5"), "five").await.status(), 200);
    assert_eq!(app.put("/docs/x", Some("5"), "cached").await.status(), 200);

    unknown_to_the_gateway(
        &loss,
        &store.url,
        fenced_put(&app.http, app.url("/docs/x"), "7", "seven".to_string()),
        "the fence batch raising doc:x to 7",
        "SELECT count(*) FROM fences WHERE resource_key = 'doc:x' AND highest_token = 7",
        ReplyLoss::cut,
    )
    .await;
    assert_eq!(
        up.bodies_on("/docs/x"),
        ["five", "cached"],
        "7 not forwarded"
    );

    let bodies = ["five", "cached", "seven"];
    stale_refused_then_forwarded(&app, &up, "/docs/x", ("5", 7, "seven"), &bodies).await;
}

/// The in-flight record of `order-1`, counted on the test's own
/// connection.
const ORDER_1_RECORD: &str = "SELECT count(*) FROM idempotency WHERE idem_key = 'order-1'";

/// Single mode, `idempotency = "required"`, `/docs/k` warmed at token 5: a
/// first use of `order-1` whose in-flight record commits and whose reply
/// is lost, after which Postgres is out of reach (`cut_and_refuse`) until
/// the test admits it again. The first use was answered 503 and not
/// forwarded.
async fn unsent_first_use() -> (TestStore, Upstream, ReplyLoss, TestApp) {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let loss = ReplyLoss::start(&store.url).await;
    let route = format!("{}idempotency = \"required\"\n", docs_route(&up.url()));
    let app = gateway_behind(&loss, &store, &route).await;
    let warm = keyed_put(&app, "/docs/k", "5", "warm", "warm").send().await;
    assert_eq!(warm.expect("gateway answered").status(), 200);
    unknown_to_the_gateway(
        &loss,
        &store.url,
        keyed_put(&app, "/docs/k", "5", "order-1", "A"),
        "the in-flight record of order-1",
        ORDER_1_RECORD,
        ReplyLoss::cut_and_refuse,
    )
    .await;
    assert_eq!(arrivals_keyed(&up, "order-1"), 0, "not forwarded");
    (store, up, loss, app)
}

/// Waits, for up to 30 s, until the record of `order-1` is gone from the
/// store (counted on the test's own connection).
async fn until_forgotten(url: &str) {
    let limit = Duration::from_secs(30);
    until_counted(
        url,
        ORDER_1_RECORD,
        0,
        limit,
        "the record of order-1, forgotten",
    )
    .await;
}

/// After [`unsent_first_use`] and a retry answered 200 as the key's first
/// use: the next retry is replayed, and the upstream saw `order-1` once.
async fn forwarded_once_then_replayed(app: &TestApp, up: &Upstream) {
    let again = keyed_put(app, "/docs/k", "5", "order-1", "A").send().await;
    let again = again.expect("gateway answered");
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(arrivals_keyed(up, "order-1"), 1, "forwarded once");
    assert_eq!(up.bodies_on("/docs/k"), ["warm", "A"]);
}

/// Single mode, `idempotency = "required"`: a first use's in-flight record
/// is written and committed, and the batch's reply is lost. The first use
/// is answered 503 and not forwarded (the gateway cannot know the record
/// exists), and the gateway forgets the record it may have written, in
/// the background: Postgres stays out of reach for half a second after
/// the reply is lost, so the forget's first tries fail, and it must try
/// again. No request comes meanwhile: the record must go all the same (a
/// design that tried once would leave it, for duplicates to hear "in
/// progress", then "outcome unknown", for a request that never left). The
/// retry is then the key's first use: forwarded once, replayed after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsent_first_use_whose_record_reply_is_lost_is_forgotten_in_the_background() {
    let (store, up, loss, app) = unsent_first_use().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    loss.admit();

    until_forgotten(&store.url).await;
    let retry = keyed_put(&app, "/docs/k", "5", "order-1", "A").send().await;
    let retry = retry.expect("gateway answered");
    assert_eq!(retry.status(), 200);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    forwarded_once_then_replayed(&app, &up).await;
}

/// Single mode, `idempotency = "required"`: as above, a first use's
/// record commits and its reply is lost, and Postgres stays out of reach,
/// now for 2.5 s (a retry then is 503 again). The gateway lost its
/// single-writer lock with the connection, so its background forget
/// cannot land until it is the writer again, and a retry comes first: the
/// gateway reads the key's record, sees the attempt of a request it never
/// sent and is forgetting, and answers the retry as if there were no
/// record — 503 while it is not the writer, then the key's first use: it
/// forgets the record then and there and forwards the retry, once. A
/// design that left the record to the background answers such a retry 409
/// "in progress" although nothing is in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_takes_back_the_record_of_its_unsent_first_use() {
    let (store, up, loss, app) = unsent_first_use().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = keyed_put(&app, "/docs/k", "5", "order-1", "A").send().await;
    let body = problem(during.expect("gateway answered"), 503).await;
    assert_eq!(
        body["type"], "urn:fencegate:problem:store-unavailable",
        "{body}"
    );
    tokio::time::sleep(Duration::from_millis(2200)).await;
    loss.admit();
    let (n,): (i64,) = on_store(&store.url, ORDER_1_RECORD).await;
    assert_eq!(n, 1, "the background forget has not landed yet");

    let limit = Duration::from_secs(30);
    let (retry, refused) =
        until_not_503(limit, || keyed_put(&app, "/docs/k", "5", "order-1", "A")).await;
    let status = retry.status();
    assert_eq!(
        status,
        200,
        "after 503s {refused:?}: {}",
        retry.text().await.unwrap_or_default()
    );
    forwarded_once_then_replayed(&app, &up).await;
}

/// Single mode, `idempotency = "required"`: a first use's record commits
/// and its forward starts, to an HTTPS upstream that accepts the
/// connection and never answers the TLS handshake; Postgres goes out of
/// reach meanwhile. After the connect timeout (5 s) nothing of the
/// request was sent: the client hears 502 upstream-unreachable, and the
/// gateway forgets the record inline, which fails (the store is away).
/// The forget must then be tried again in the background: once Postgres
/// is back the record goes, and the key can be used again. A design that
/// forgot inline once and gave up would leave the record in flight, then
/// "outcome unknown", for a request that never left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsent_forward_whose_inline_forget_fails_is_forgotten_later() {
    let store = TestStore::new(Backend::Postgres).await;
    let loss = ReplyLoss::start(&store.url).await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    let upstream = format!("https://{addr}");
    let route = format!("{}idempotency = \"required\"\n", docs_route(&upstream));
    let app = gateway_behind(&loss, &store, &route).await;

    let first = {
        let req = keyed_put(&app, "/docs/k", "5", "order-1", "A");
        tokio::spawn(async move { req.send().await })
    };
    until_committed(
        &store.url,
        "the in-flight record of order-1",
        ORDER_1_RECORD,
    )
    .await;
    loss.cut_and_refuse();
    let resp = first.await.unwrap().expect("gateway answered");
    let body = problem(resp, 502).await;
    assert_eq!(
        body["type"], "urn:fencegate:problem:upstream-unreachable",
        "{body}"
    );
    let (n,): (i64,) = on_store(&store.url, ORDER_1_RECORD).await;
    assert_eq!(n, 1, "the inline forget could not reach the store");
    tokio::time::sleep(Duration::from_millis(500)).await;
    loss.admit();
    until_forgotten(&store.url).await;
    holding.abort();
}

/// Single mode, `idempotency = "required"`: a first use is forwarded, and
/// its answer is stored and committed, but the batch's reply is lost. The
/// gateway cannot know the answer is stored; the answer is still the
/// truth, and the client gets it. The retry is then replayed from the
/// store, the same answer: the request reached the upstream once. A design
/// that took the broken connection for "not stored" and marked the record
/// "outcome unknown" would refuse the retry with 409 although the store
/// holds the answer; one that forwarded again would send it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_whose_commit_reply_is_lost_is_replayed_on_retry() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let loss = ReplyLoss::start(&store.url).await;
    let route = format!("{}idempotency = \"required\"\n", docs_route(&up.url()));
    let app = gateway_behind(&loss, &store, &route).await;
    let warm = keyed_put(&app, "/docs/a", "5", "warm", "warm").send().await;
    assert_eq!(warm.expect("gateway answered").status(), 200);

    // Held at the upstream for 300 ms: replies are swallowed from then
    // on, after the in-flight record's reply came back and before the
    // answer is stored. (Not longer: a batch connection idle for a second
    // is pinged first, and the ping's reply would be the one lost.)
    let first = {
        let req = keyed_put(&app, "/docs/a", "5", "order-2", "A").header("x-test-delay-ms", "300");
        tokio::spawn(async move { req.send().await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while up.in_flight() == 0 {
        assert!(
            Instant::now() < deadline,
            "the first use never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    loss.swallow();
    until_committed(
        &store.url,
        "the answer of order-2",
        "SELECT count(*) FROM idempotency WHERE idem_key = 'order-2' AND state = 'done'",
    )
    .await;
    loss.cut();
    let first = first.await.unwrap().expect("gateway answered");
    assert_eq!(first.status(), 200, "the upstream's answer");
    assert!(first.headers().get("idempotent-replayed").is_none());
    let answer = first.bytes().await.expect("the answer's body");

    let limit = Duration::from_secs(30);
    let (retry, refused) =
        until_not_503(limit, || keyed_put(&app, "/docs/a", "5", "order-2", "A")).await;
    assert_eq!(retry.status(), 200, "the retry after 503s {refused:?}");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.bytes().await.expect("the replay's body"), answer);
    assert_eq!(arrivals_keyed(&up, "order-2"), 1, "forwarded once");
    assert_eq!(up.bodies_on("/docs/a"), ["warm", "A"]);
}

/// Shared mode: a write's admission raises `doc:s` from 5 to 6 and enters
/// its in-flight marker, commits, and its reply is lost. The write is
/// answered 503 and not forwarded; its marker is never left (the gateway
/// cannot know it was entered), so it counts until it ends. Token 5 is
/// refused from then on: the store holds 6, whatever this instance last
/// saw. Token 6 again is admitted (writers of one token may run together)
/// and forwarded once; the upstream never sees 5 after 6, nor two
/// writes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_admission_whose_commit_reply_is_lost_is_not_forwarded() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let loss = ReplyLoss::start(&store.url).await;
    let route = format!("{}timeout_ms = 1000\n", docs_route(&up.url()));
    let text = config_sections("", &loss.url(&store.url), SHARED_STORE, &route);
    let app = TestApp::from_text(&text).await;
    assert_eq!(app.put("/docs/s", Some("5"), "five").await.status(), 200);
    until_all_left(&store.url).await;

    unknown_to_the_gateway(
        &loss,
        &store.url,
        fenced_put(&app.http, app.url("/docs/s"), "6", "lost".to_string()),
        "the admission raising doc:s to 6",
        "SELECT count(*) FROM fences \
          WHERE resource_key = 'doc:s' AND highest_token = 6 AND inflight = 1",
        ReplyLoss::cut,
    )
    .await;
    assert_eq!(up.bodies_on("/docs/s"), ["five"], "6 not forwarded");

    let bodies = ["five", "six"];
    let refused =
        stale_refused_then_forwarded(&app, &up, "/docs/s", ("5", 6, "six"), &bodies).await;
    assert_unavailable_or_busy(&refused);
}

// --- A store that answers late ------------------------------------------------

/// The session holding the single-writer lock on `url`'s database, asked
/// on a connection of the test's own: its backend's pid, and the port it
/// sees the client (the proxy) at.
async fn lock_holder(url: &str) -> Option<(i32, i32)> {
    let (pid, port): (Option<i32>, Option<i32>) = on_store(
        url,
        "SELECT l.pid, a.client_port FROM (SELECT 1) one \
           LEFT JOIN pg_locks l ON l.locktype = 'advisory' \
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND l.classid = x'46474154'::int::oid AND l.objid = 1 AND l.objsubid = 2 \
             AND l.granted \
           LEFT JOIN pg_stat_activity a ON a.pid = l.pid",
    )
    .await;
    pid.zip(port)
}

/// A single-mode gateway whose store connections pass through a proxy,
/// with the default store timeout (2 s), `/docs/x` at token 5.
async fn behind_with_default_timeout() -> (TestStore, Upstream, ReplyLoss, TestApp) {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let loss = ReplyLoss::start(&store.url).await;
    let text = config_sections("", &loss.url(&store.url), "", &docs_route(&up.url()));
    let app = TestApp::from_text(&text).await;
    assert_eq!(app.put("/docs/x", Some("5"), "five").await.status(), 200);
    (store, up, loss, app)
}

/// Sends an equal token (5, recorded) until decisions stop, for up to 5 s:
/// answers how many were forwarded (200) before the first 503.
async fn until_decisions_stop(app: &TestApp) -> usize {
    let since = Instant::now();
    let mut forwarded = 0;
    loop {
        let resp = app.put("/docs/x", Some("5"), "held").await;
        if resp.status() == 503 {
            let body = problem(resp, 503).await;
            assert_eq!(body["type"], "urn:fencegate:problem:store-unavailable");
            return forwarded;
        }
        assert_eq!(resp.status(), 200, "an equal token before decisions stop");
        forwarded += 1;
        assert!(
            since.elapsed() < Duration::from_secs(5),
            "decisions did not stop while the lock's session was silent"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// At the upstream, after [`until_decisions_stop`] and a write "after":
/// of the writes "held", only the `forwarded` answered 200 arrived, and
/// "after" came last.
fn nothing_refused_was_forwarded(up: &Upstream, forwarded: usize) {
    let bodies = up.bodies_on("/docs/x");
    let held = bodies.iter().filter(|b| *b == "held").count();
    assert_eq!(held, forwarded, "no 503 was forwarded");
    assert_eq!(bodies.last().map(String::as_str), Some("after"));
}

/// Single mode with the default 2 s store timeout, the store behind a
/// proxy that holds its replies back for a few seconds and then delivers
/// them: a machine that got no CPU, or a network that stalled, and
/// recovered. While the single-writer lock's check goes unanswered,
/// decisions stop: even a token memory knows is recorded is 503 and not
/// forwarded. Once the replies flow, writes resume on the same session:
/// the lock was never given up. (A watcher that gives its session up when
/// a check outlives the timeout takes the lock again on a new session, a
/// new backend, and starts a new generation.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_answers_late_pauses_decisions_and_keeps_the_single_writer_lock() {
    let (store, up, loss, app) = behind_with_default_timeout().await;
    let holder = lock_holder(&store.url).await;
    assert!(holder.is_some(), "the gateway holds the single-writer lock");

    loss.hold();
    let held = Instant::now();
    let forwarded_while_held = until_decisions_stop(&app).await;
    // Past the store's timeout and the lease, well short of the patience.
    tokio::time::sleep(Duration::from_secs(4).saturating_sub(held.elapsed())).await;
    let resp = app.put("/docs/x", Some("5"), "held").await;
    problem(resp, 503).await;
    loss.release();

    let (resp, _) = until_not_503(Duration::from_secs(10), || {
        fenced_put(&app.http, app.url("/docs/x"), "5", "after".to_string())
    })
    .await;
    assert_eq!(
        resp.status(),
        200,
        "decisions resume once the store answers"
    );
    assert_eq!(
        lock_holder(&store.url).await,
        holder,
        "the single-writer lock stayed with its session"
    );
    nothing_refused_was_forwarded(&up, forwarded_while_held);
}

/// Single mode behind the proxy: the single-writer lock's session falls
/// silent (its replies held back) and its server ends it, so the lock is
/// free there: as when a primary vanishes without a reset and the address
/// leads to a new primary where nobody holds the lock. Decisions stop,
/// then resume on a new session a few seconds later, long before the
/// watcher would give the silent session up (30 s): while it waits for a
/// late answer it tries the lock on new sessions too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_lock_session_is_replaced_when_the_lock_is_free_on_a_new_one() {
    let (store, up, loss, app) = behind_with_default_timeout().await;
    let (pid, port) = lock_holder(&store.url)
        .await
        .expect("the gateway holds the single-writer lock");

    loss.hold_session(u16::try_from(port).expect("a port"));
    let (ended,): (bool,) =
        on_store(&store.url, &format!("SELECT pg_terminate_backend({pid})")).await;
    assert!(ended, "the lock's backend ended");
    let forwarded_while_held = until_decisions_stop(&app).await;
    let (resp, _) = until_not_503(Duration::from_secs(12), || {
        fenced_put(&app.http, app.url("/docs/x"), "5", "after".to_string())
    })
    .await;
    assert_eq!(resp.status(), 200, "decisions resume on a new session");
    let (now, _) = lock_holder(&store.url)
        .await
        .expect("the gateway holds the single-writer lock again");
    assert_ne!(now, pid, "a new session holds it");
    nothing_refused_was_forwarded(&up, forwarded_while_held);
    loss.release();
}

/// Single mode behind the proxy: only the single-writer lock's session
/// falls silent (its replies held back), and stays silent past the
/// watcher's patience (30 s) while its server keeps it alive. Until then,
/// the watcher's attempts on new sessions find the lock held, by that same
/// session, and change nothing: decisions stay stopped and the lock stays
/// where it was. Then the watcher gives the session up; closing it frees
/// the lock on the server, and a new session takes it. (A watcher that
/// never gave up would stop decisions for good; one whose attempts took
/// the lock while its session lived cannot, as the server refuses them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_session_silent_past_the_patience_is_given_up_and_replaced() {
    let (store, up, loss, app) = behind_with_default_timeout().await;
    let (pid, port) = lock_holder(&store.url)
        .await
        .expect("the gateway holds the single-writer lock");

    loss.hold_session(u16::try_from(port).expect("a port"));
    let held = Instant::now();
    let forwarded_while_held = until_decisions_stop(&app).await;
    // Well inside the patience.
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(held.elapsed())).await;
    problem(app.put("/docs/x", Some("5"), "held").await, 503).await;
    assert_eq!(
        lock_holder(&store.url).await.map(|(p, _)| p),
        Some(pid),
        "attempts on new sessions left the lock with the silent one"
    );

    let (resp, _) = until_not_503(Duration::from_secs(30), || {
        fenced_put(&app.http, app.url("/docs/x"), "5", "after".to_string())
    })
    .await;
    assert_eq!(resp.status(), 200, "decisions resume on a new session");
    assert!(
        held.elapsed() >= Duration::from_secs(30),
        "the silent session was given up only after the patience"
    );
    let (now, _) = lock_holder(&store.url)
        .await
        .expect("the gateway holds the single-writer lock again");
    assert_ne!(now, pid, "a new session holds it");
    nothing_refused_was_forwarded(&up, forwarded_while_held);
    loss.release();
}
