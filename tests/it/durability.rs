//! The new highest token is durable before forwarding: it survives a
//! graceful restart and a kill -9, on both stores. And only one `single`
//! instance may use a store.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::idempotency::with_idempotency_key;
use crate::support::app::{config_text, docs_route, problem, TestApp};
use crate::support::db::{Backend, TestStore, SINGLE_WRITER_NAMESPACE};
use crate::support::fenced_put;
use crate::support::per_store;
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

per_store!(#[tokio::test] survives_restart => survives_restart_sqlite, survives_restart_postgres);

async fn survives_restart(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    assert_eq!(app.put("/docs/a", Some("34"), "B").await.status(), 200);
    app.stop().await;
    let app = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    app.assert_stale("/docs/a", "33", "A", 34).await;
    assert_eq!(
        app.put("/docs/a", Some("34"), "B again").await.status(),
        200
    );
}

per_store!(#[tokio::test] survives_kill_9 => survives_kill_9_sqlite, survives_kill_9_postgres);

/// Acknowledged tokens survive kill -9 of the gateway process, including
/// writes acknowledged the instant before the kill.
async fn survives_kill_9(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let config = config_text(&store.url, &docs_route(&up.url()));
    let mut gw = GatewayProcess::start(&config);
    let http = reqwest::Client::new();
    let mut last_acked = 0;
    for t in 1..=50 {
        let resp = fenced_put(&http, gw.url(&format!("/docs/k{}", t % 5)), t, "x")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        last_acked = t;
    }
    gw.kill9();
    let gw = GatewayProcess::start(&config);
    for k in 0..5 {
        // The highest acknowledged token for key k is the largest t ≤ 50 with t % 5 == k.
        let highest = (1..=last_acked).filter(|t| t % 5 == k).max().unwrap();
        let resp = fenced_put(&http, gw.url(&format!("/docs/k{k}")), highest - 1, "stale")
            .send()
            .await
            .unwrap();
        let body = problem(resp, 409).await;
        assert_eq!(body["highest_token"], highest, "key k{k}");
    }
    assert!(
        up.applied().iter().all(|a| &a.body[..] == b"x"),
        "no stale write reached the upstream"
    );
}

per_store!(#[tokio::test] second_single_instance_is_refused => second_single_instance_is_refused_sqlite, second_single_instance_is_refused_postgres);

async fn second_single_instance_is_refused(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let first = TestApp::spawn(&store.url, &docs_route(&up.url())).await;
    let second = TestApp::try_spawn(&store.url, &docs_route(&up.url())).await;
    let err = match second {
        Ok(_) => panic!("a second single-mode instance started on the same store"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("another fencegate instance"), "{err}");
    // Also as a process: it exits non-zero with the message.
    let config = config_text(&store.url, &docs_route(&up.url()));
    let log = match GatewayProcess::try_start(&config) {
        Ok(_) => panic!("a second single-mode process started"),
        Err(log) => log,
    };
    assert!(log.contains("another fencegate instance"), "{log}");
    // Once the first stops, a new instance may start.
    first.stop().await;
    TestApp::spawn(&store.url, &docs_route(&up.url())).await;
}

/// An instance started while the single-writer lock is still held by a
/// session that ends a moment later (a predecessor killed a moment ago,
/// whose server process has not yet noticed) waits for the lock instead
/// of refusing to start; then it decides.
#[tokio::test]
async fn a_restart_waits_for_a_crashed_instance_session_to_end() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    // The predecessor's session, holding the lock until it closes.
    let mut session = PgConnection::connect(&store.url).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1::int4, 1)")
        .bind(SINGLE_WRITER_NAMESPACE)
        .execute(&mut session)
        .await
        .unwrap();
    let held_for = Duration::from_millis(800);
    let ends = tokio::spawn(async move {
        tokio::time::sleep(held_for).await;
        session.close().await.unwrap();
    });
    let started = Instant::now();
    let app = TestApp::try_spawn(&store.url, &docs_route(&up.url()))
        .await
        .unwrap_or_else(|e| panic!("refused to start while the old session was ending: {e}"));
    assert!(
        started.elapsed() >= held_for,
        "started after {:?}, while the lock was still held",
        started.elapsed()
    );
    ends.await.unwrap();
    assert_eq!(app.put("/docs/a", Some("1"), "x").await.status(), 200);
    assert_eq!(up.applied().len(), 1);
}

per_store!(#[tokio::test] restart_after_crash_waits_for_in_flight_writes => restart_after_crash_waits_for_in_flight_writes_sqlite, restart_after_crash_waits_for_in_flight_writes_postgres);

/// A single-mode gateway killed while its write (token 5) is still being
/// applied upstream, restarted at once: a write with token 6 must not reach
/// the upstream while 5 may still be in flight. After a clean stop, no such
/// wait.
async fn restart_after_crash_waits_for_in_flight_writes(b: Backend) {
    let store = TestStore::new(b).await;
    let up = Upstream::start().await;
    let mut routes = docs_route(&up.url());
    routes.push_str("timeout_ms = 1500\n");
    let config = config_text(&store.url, &routes);
    let mut gw = GatewayProcess::start(&config);
    let slow = up.held_write(gw.url("/docs/q"), "5", "old", 1000).await;
    assert_eq!(
        up.in_flight(),
        1,
        "the slow write did not reach the upstream"
    );
    gw.kill9();
    let _ = slow.await;
    let gw = GatewayProcess::start(&config);
    assert!(gw.log().contains("did not stop cleanly"), "{}", gw.log());
    let resp = fenced_put(&reqwest::Client::new(), gw.url("/docs/q"), "6", "new")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let violations = up.violations();
    assert!(violations.is_empty(), "{violations:?}");
    let order: Vec<_> = up.applied().iter().map(|a| a.token).collect();
    assert_eq!(order, vec![Some(5), Some(6)]);

    // A clean stop (SIGTERM) leaves no such wait behind.
    let mut gw = gw;
    gw.signal(libc::SIGTERM);
    let exit =
        tokio::task::spawn_blocking(move || gw.wait_exit(std::time::Duration::from_secs(10)))
            .await
            .unwrap();
    assert_eq!(exit.and_then(|s| s.code()), Some(0));
    let gw = GatewayProcess::start(&config);
    assert!(!gw.log().contains("did not stop cleanly"), "{}", gw.log());
}

/// A Postgres store created before its keys were kept in byte order
/// (migration 0014) keeps what it holds through the upgrade: a key's
/// highest token still refuses older ones, at the upstream too, and a
/// stored answer still replays without a forward; afterwards its key
/// columns compare as bytes (`COLLATE "C"`), whatever the database's
/// collation, and the primary key is the listings' only index on them.
#[tokio::test]
async fn a_store_from_before_keys_compared_as_bytes_keeps_what_it_holds() {
    let store = TestStore::new(Backend::Postgres).await;
    let mut c = store_at_0013(&store.url).await;
    assert_eq!(collation_of(&mut c, "fences", "resource_key").await, None);
    // Data written by this version on that schema: 0014 marked as applied
    // for the while, so that the gateway starts without applying it.
    let current = sqlx::migrate!("./migrations/postgres");
    let bytes = current.iter().find(|m| m.version == 14).unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES ($1, $2, true, $3, 0)",
    )
    .bind(bytes.version)
    .bind(&*bytes.description)
    .bind(&*bytes.checksum)
    .execute(&mut c)
    .await
    .unwrap();
    let up = Upstream::start().await;
    let routes = format!("{}idempotency = \"optional\"\n", docs_route(&up.url()));
    let order = Some("\"order-1\"");
    let app = TestApp::spawn(&store.url, &routes).await;
    for key in ["/docs/a", "/docs/B", "/docs/%C3%A9"] {
        assert_eq!(app.put(key, Some("34"), "v34").await.status(), 200);
    }
    let first = with_idempotency_key(&app, "/docs/b", "7", order, "B7", &[]).await;
    assert_eq!(first.status(), 200);
    let first = first.text().await.unwrap();
    app.stop().await;
    assert_eq!(collation_of(&mut c, "idempotency", "idem_key").await, None);
    // The upgrade: this version starts and applies 0014.
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 14")
        .execute(&mut c)
        .await
        .unwrap();
    let forwarded = up.applied().len();
    let app = TestApp::spawn(&store.url, &routes).await;
    for (table, column) in [
        ("fences", "resource_key"),
        ("locks", "name"),
        ("idempotency", "route"),
        ("idempotency", "method"),
        ("idempotency", "idem_key"),
    ] {
        assert_eq!(
            collation_of(&mut c, table, column).await.as_deref(),
            Some("C"),
            "{table}.{column}"
        );
    }
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE tablename IN ('fences', 'locks') \
         ORDER BY indexname",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    assert_eq!(indexes, ["fences_pkey", "locks_pkey"]);
    for key in ["/docs/a", "/docs/B", "/docs/%C3%A9"] {
        app.assert_stale(key, "33", "v33", 34).await;
    }
    let again = with_idempotency_key(&app, "/docs/b", "7", order, "B7", &[]).await;
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), first);
    assert_eq!(
        up.applied().len(),
        forwarded,
        "a stale write or a replay was forwarded after the upgrade"
    );
    // Every key still has its one row, which new tokens raise.
    for key in ["/docs/a", "/docs/B", "/docs/%C3%A9"] {
        assert_eq!(app.put(key, Some("35"), "v35").await.status(), 200);
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM fences")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(rows, 4, "doc:a, doc:B, doc:é and doc:b");
    app.stop().await;
}

/// A connection to the Postgres store at `url`, migrated as the versions
/// before 0014 left it: the repository's own migrations up to 0013, applied
/// and recorded by sqlx.
async fn store_at_0013(url: &str) -> PgConnection {
    let earlier = tempfile::tempdir().unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.as_str() < "0014" {
            std::fs::copy(&path, earlier.path().join(&name)).unwrap();
        }
    }
    let mut c = PgConnection::connect(url).await.unwrap();
    sqlx::migrate::Migrator::new(earlier.path())
        .await
        .unwrap()
        .run(&mut c)
        .await
        .unwrap();
    c
}

/// Migration 0014 rebuilds the key indexes, which takes time in proportion
/// to the rows, on a gateway's connection, which carries a statement
/// timeout of a few store timeouts: the migration lifts it, so a large
/// store is migrated however short its timeout. Here 300,000 keys and a
/// statement timeout of 50 ms (the rebuild alone takes several times that).
#[tokio::test]
async fn migration_0014_is_not_cut_by_the_statement_timeout() {
    let store = TestStore::new(Backend::Postgres).await;
    let mut c = store_at_0013(&store.url).await;
    sqlx::query(
        "INSERT INTO fences (resource_key, highest_token, updated_at) \
         SELECT 'doc:' || md5(g::text), g, now() FROM generate_series(1, 300000) g",
    )
    .execute(&mut c)
    .await
    .unwrap();
    let opts: sqlx::postgres::PgConnectOptions = store.url.parse().unwrap();
    let mut short = PgConnection::connect_with(&opts.options([("statement_timeout", "50")]))
        .await
        .unwrap();
    // The bound holds for the rest: a statement as long as the rebuild is
    // cut on this connection.
    let cut = sqlx::query("SELECT pg_sleep(0.5)")
        .execute(&mut short)
        .await;
    assert!(cut.is_err(), "the connection has no statement timeout");
    applies_0014(&mut short, "on a connection with a 50 ms statement timeout").await;
}

/// Behind a transaction that holds a lock on `fences` (an operator's
/// session left open), migration 0014 gives up after its lock timeout
/// instead of waiting on, with every write of every instance queued behind
/// it; nothing of it stays, and once that transaction ended it applies.
#[tokio::test]
async fn migration_0014_gives_up_behind_a_long_transaction() {
    let store = TestStore::new(Backend::Postgres).await;
    let mut c = store_at_0013(&store.url).await;
    let mut blocker = PgConnection::connect(&store.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query("SELECT count(*) FROM fences")
        .execute(&mut blocker)
        .await
        .unwrap();
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        sqlx::migrate!("./migrations/postgres").run(&mut c),
    )
    .await
    .expect("0014 waited on behind the transaction");
    let why = format!("{refused:?}");
    assert!(
        why.contains("55P03"),
        "0014 did not give up on the lock (lock_not_available): {why}"
    );
    assert_eq!(collation_of(&mut c, "fences", "resource_key").await, None);
    sqlx::query("COMMIT").execute(&mut blocker).await.unwrap();
    applies_0014(&mut c, "once the lock was free").await;
}

/// Runs this version's migrations on `c`, which must apply 0014 (`when`
/// says in which case): the keys compare as bytes afterwards.
async fn applies_0014(c: &mut PgConnection, when: &str) {
    if let Err(e) = sqlx::migrate!("./migrations/postgres").run(&mut *c).await {
        panic!("0014 was not applied {when}: {e}");
    }
    assert_eq!(
        collation_of(c, "fences", "resource_key").await.as_deref(),
        Some("C"),
        "{when}"
    );
}

/// The collation of a column of the store's tables, if it has its own.
async fn collation_of(c: &mut PgConnection, table: &str, column: &str) -> Option<String> {
    sqlx::query_scalar(
        "SELECT collation_name::text FROM information_schema.columns \
         WHERE table_name = $1 AND column_name = $2",
    )
    .bind(table)
    .bind(column)
    .fetch_one(c)
    .await
    .unwrap()
}
