//! Store calls whose outcome the gateway cannot know: a statement that timed
//! out on the gateway's side but commits later on the store's, a SQLite
//! batch cut off mid-transaction, a `fencegate_leave` that fails. Memory
//! must never run ahead of the store in the dangerous direction: a token
//! lower than the highest the store has recorded is refused, whatever the
//! cache last saw.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::support::app::{config_sections, docs_route, problem, TestApp, SHARED_STORE};
use crate::support::db::{Backend, PgHolder, SqliteBlocker, TestStore};
use crate::support::upstream::Upstream;

/// A single-mode gateway with a short store timeout.
async fn gateway(store: &TestStore, up: &Upstream, store_timeout_ms: u64) -> TestApp {
    let store_lines = format!("timeout_ms = {store_timeout_ms}\n");
    let text = config_sections("", &store.url, &store_lines, &docs_route(&up.url()));
    TestApp::from_text(&text).await
}

/// A single-mode gateway (store timeout `store_timeout_ms`) on `backend`
/// whose store and cache both hold token 5 for `doc:x`: the cache has
/// answered a write of 5 already, so it could admit 5 again on its own.
async fn cached_at_5(backend: Backend, store_timeout_ms: u64) -> (TestStore, Upstream, TestApp) {
    let store = TestStore::new(backend).await;
    let up = Upstream::start().await;
    let app = gateway(&store, &up, store_timeout_ms).await;
    assert_eq!(app.put("/docs/x", Some("5"), "five").await.status(), 200);
    assert_eq!(app.put("/docs/x", Some("5"), "cached").await.status(), 200);
    (store, up, app)
}

/// The highest token the store holds for `key`, through the admin API.
async fn recorded(app: &TestApp, key: &str) -> i64 {
    let resp = app.admin_get(&format!("/fences/{key}")).await;
    assert_eq!(resp.status(), 200);
    resp.json::<serde_json::Value>().await.unwrap()["highest_token"]
        .as_i64()
        .unwrap()
}

/// Single mode on Postgres: token 5 is recorded and cached; token 7's batch
/// waits on a row lock held from another connection, the gateway gives up
/// (503), and the statement commits once the lock goes. Token 5 must then be
/// refused: the store holds 7, whatever the cache last saw. (Before the
/// fix, the cache's equality fast path forwarded it with 200.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_batch_that_commits_later_is_not_outrun_by_the_cache() {
    let (store, up, app) = cached_at_5(Backend::Postgres, 1000).await;

    let blocker = PgHolder::begin(
        &store.url,
        "SELECT 1 FROM fences WHERE resource_key = 'doc:x' FOR UPDATE",
    )
    .await;
    let seven = app.put("/docs/x", Some("7"), "seven").await;
    problem(seven, 503).await;
    // The gateway gave up after 1 s; the statement is still waiting on the
    // row lock (statement_timeout is twice the store timeout) and commits
    // when it goes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    blocker.commit().await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while recorded(&app, "doc:x").await != 7 {
        assert!(
            Instant::now() < deadline,
            "the abandoned batch never committed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    app.assert_stale("/docs/x", "5", "stale", 7).await;
    let bodies: Vec<_> = up.applied().iter().map(|a| a.body.clone()).collect();
    assert_eq!(
        bodies,
        vec!["five", "cached"],
        "only the first two were forwarded"
    );
    // The key goes on working: 7 is current now, 8 raises it.
    assert_eq!(app.put("/docs/x", Some("7"), "seven").await.status(), 200);
    assert_eq!(app.put("/docs/x", Some("8"), "eight").await.status(), 200);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

/// SQLite: a batch cut off by its timeout in the middle of its transaction
/// (another connection holds the database's write lock, so the batch waits
/// for it inside its transaction) ends without a known outcome, and memory
/// must not outrun the store afterwards. The writer that held the lock
/// stands for the cut-off batch committing late: it commits token 7 after
/// the gateway gave up on it. Token 5 is then decided by the store (409),
/// not admitted from the cache that last saw 5 (200 on a design that trusts
/// its cache after a timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_batch_cut_off_mid_transaction_is_not_outrun_by_the_cache() {
    let (store, up, app) = cached_at_5(Backend::Sqlite, 800).await;

    let mut blocker = SqliteBlocker::begin(&store.url, "IMMEDIATE").await;
    let late_commit = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        sqlx::query("UPDATE fences SET highest_token = 7 WHERE resource_key = 'doc:x'")
            .execute(blocker.conn())
            .await
            .unwrap();
        blocker.commit().await;
    });
    problem(app.put("/docs/x", Some("7"), "seven").await, 503).await;
    late_commit.await.unwrap();

    // Once the store answers again, token 5 is decided by the store.
    let mut answered = None;
    for _ in 0..50 {
        let resp = app.put("/docs/x", Some("5"), "again").await;
        match resp.status().as_u16() {
            503 => tokio::time::sleep(Duration::from_millis(100)).await,
            s => {
                answered = Some((s, resp.text().await.unwrap_or_default()));
                break;
            }
        }
    }
    let (status, body) = answered.expect("the store answers again");
    assert_eq!(status, 409, "token 5 after the late commit of 7: {body}");
    assert_eq!(recorded(&app, "doc:x").await, 7);
    assert_eq!(app.put("/docs/x", Some("8"), "eight").await.status(), 200);
    problem(app.put("/docs/x", Some("7"), "late").await, 409).await;
    let bodies: Vec<_> = up.applied().iter().map(|a| a.body.clone()).collect();
    assert_eq!(bodies, vec!["five", "cached", "eight"]);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

/// Shared mode: when the leave fails after a write, its in-flight
/// marker stays behind. The key must then stay closed to a newer token until
/// the marker's deadline (the safe direction: the instance cannot tell that
/// write from one that is still running), and work normally afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_leave_keeps_the_key_closed_until_the_marker_expires() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let route = format!("{}timeout_ms = 1500\n", docs_route(&up.url()));
    let mut apps = Vec::new();
    for _ in 0..2 {
        let text = config_sections("", &store.url, SHARED_STORE, &route);
        apps.push(TestApp::from_text(&text).await);
    }
    // Migrations have run: break the leave, whichever statement writes it
    // (a leave is the one write that counts a key's writers down under the
    // same highest token).
    let mut conn = PgConnection::connect(&store.url).await.unwrap();
    sqlx::raw_sql(
        "CREATE FUNCTION no_leave() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             IF NEW.highest_token = OLD.highest_token \
                AND (NEW.inflight < OLD.inflight OR NEW.draining < OLD.draining) THEN \
                 RAISE EXCEPTION 'leave broken'; \
             END IF; \
             RETURN NEW; \
         END $$; \
         CREATE TRIGGER no_leave BEFORE UPDATE ON fences \
             FOR EACH ROW EXECUTE FUNCTION no_leave();",
    )
    .execute(&mut conn)
    .await
    .unwrap();

    let five_sent = Instant::now();
    assert_eq!(
        apps[0].put("/docs/l", Some("5"), "five").await.status(),
        200
    );
    // The failed leave leaves the marker behind. Token 6 on the other instance is
    // recorded at once but held until the marker's deadline (the route's
    // timeout plus 1 s after 5 entered).
    let six = apps[1].put("/docs/l", Some("6"), "six").await;
    assert_eq!(six.status(), 200);
    let requests = up.requests();
    let six_at = requests
        .iter()
        .position(|r| r.header("x-fence-token") == Some("6"))
        .expect("6 arrived");
    assert_eq!(six_at, 1);
    // When 6 reached the upstream, not when its answer came back.
    let six_arrived = requests[six_at].arrived.duration_since(five_sent);
    assert!(
        six_arrived >= Duration::from_millis(2500),
        "6 reached the upstream {six_arrived:?} after 5 was sent, before 5's marker expired"
    );
    problem(apps[0].put("/docs/l", Some("5"), "stale").await, 409).await;
    let tokens: Vec<_> = up.applied().iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6)]);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}
