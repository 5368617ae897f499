//! `[store] mode = "shared"`: several gateways on one Postgres keep the
//! per-key ordering guarantee between them.

use crate::support::app::{config_sections, docs_route, problem, TestApp, SHARED_STORE};
use crate::support::db::{Backend, TestStore};
use crate::support::fenced_put;
use crate::support::holders::{self, Workload};
use crate::support::upstream::Upstream;

async fn gateways(store: &TestStore, up: &Upstream, n: usize) -> Vec<TestApp> {
    gateways_with(store, up, n, "").await
}

/// `n` shared-mode gateways; `store_extra` is added to their `[store]`.
async fn gateways_with(
    store: &TestStore,
    up: &Upstream,
    n: usize,
    store_extra: &str,
) -> Vec<TestApp> {
    let mut apps = Vec::new();
    for _ in 0..n {
        let store_lines = format!("{SHARED_STORE}{store_extra}\n");
        let text = config_sections("", &store.url, &store_lines, &docs_route(&up.url()));
        apps.push(TestApp::from_text(&text).await);
    }
    apps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_keep_per_key_order() {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::with_write_delays(0, 8).await;
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
    apps[1].assert_stale("/docs/a", "33", "A", 34).await;
    assert_eq!(apps[1].put("/docs/a", Some("34"), "B2").await.status(), 200);
    assert_eq!(apps[1].put("/docs/a", Some("35"), "C").await.status(), 200);
    problem(apps[0].put("/docs/a", Some("34"), "B3").await, 409).await;
}

/// Sends token 5 to `path` through `app`, applied by the upstream after
/// 1.5 s, so that the key is held meanwhile; returns once the write is in
/// flight. The task answers the write's status.
async fn hold_key(app: &TestApp, path: &str) -> tokio::task::JoinHandle<reqwest::Result<u16>> {
    let req = fenced_put(&app.http, app.url(path), "5", "five").header("x-test-delay-ms", "1500");
    let task = tokio::spawn(async move { req.send().await.map(|r| r.status().as_u16()) });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    task
}

/// Two instances on a Postgres store with `key_lock_wait_ms = wait_ms`,
/// the first holding `path`'s key for a slow token 5 (see [`hold_key`]).
async fn held_by_the_first(
    path: &str,
    wait_ms: u64,
) -> (
    TestStore,
    Upstream,
    Vec<TestApp>,
    tokio::task::JoinHandle<reqwest::Result<u16>>,
) {
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let wait = format!("key_lock_wait_ms = {wait_ms}");
    let apps = gateways_with(&store, &up, 2, &wait).await;
    let slow = hold_key(&apps[0], path).await;
    (store, up, apps, slow)
}

/// A client that gives up while its write waits for another instance's
/// older write: its write is never started, and nothing of it is left
/// counted in flight — a newer token gets through at once instead of
/// waiting out `key_lock_wait_ms` or a marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_while_waiting_in_postgres_leaks_no_lock() {
    // Instance 0 forwards token 5 slowly, holding the key.
    let (_store, up, apps, slow) = held_by_the_first("/docs/w", 3000).await;
    // Token 6 on instance 1 waits for it; its client gives up.
    let gave_up = fenced_put(&apps[1].http, apps[1].url("/docs/w"), "6", "six")
        .timeout(std::time::Duration::from_millis(300))
        .send()
        .await;
    assert!(
        gave_up.is_err(),
        "token 6 was answered while 5 held the key"
    );
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    // Token 7 is let in, not held up by a lock token 6 left behind (that
    // would be a 503 after key_lock_wait_ms).
    let status = apps[0].put("/docs/w", Some("7"), "seven").await.status();
    assert_eq!(status, 200);
    let tokens: Vec<_> = up.applied_on("/docs/w").iter().map(|a| a.token).collect();
    assert_eq!(
        tokens,
        vec![Some(5), Some(7)],
        "token 6 must never be applied"
    );
    // 6's decision ends on its own: admitted once 5 has left, and then not
    // started because its client is gone; or refused, when 7 was recorded
    // before 6 asked again (it asks every few ms while it waits).
    let gone = "fencegate_decisions_total{route=\"docs\",outcome=\"client_gone\"} 1";
    let stale = "fencegate_decisions_total{route=\"docs\",outcome=\"stale\"} 1";
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = apps[1].metrics().await;
        if metrics.contains(gone) || metrics.contains(stale) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("token 6's decision was never counted as {gone} or {stale}:\n{metrics}");
}

/// A write that waits inside Postgres longer than `key_lock_wait_ms` (another
/// instance holds the key for a slow older write) is answered 503 with
/// `Retry-After`, is never forwarded, and leaves nothing behind: its gate
/// connection, whose lock state is unknown after the `lock_timeout` error,
/// is closed rather than pooled, and later writes on the key go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_wait_past_key_lock_wait_is_503_and_leaves_nothing_behind() {
    let (_store, up, apps, slow) = held_by_the_first("/docs/t", 300).await;
    let resp = apps[1].put("/docs/t", Some("6"), "six").await;
    assert!(resp.headers().contains_key("retry-after"), "{resp:?}");
    // Postgres's lock_timeout: the gateway's own bound on the statement
    // (key_lock_wait_ms + timeout_ms = 3.3 s) is longer than the slow write.
    let body = problem(resp, 503).await;
    assert_eq!(body["type"], "urn:fencegate:problem:key-busy", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("300 ms"),
        "{body}"
    );
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    // Both instances go on serving the key, and the client's retry of 6
    // is the one that lands.
    assert_eq!(apps[1].put("/docs/t", Some("6"), "six").await.status(), 200);
    assert_eq!(
        apps[0].put("/docs/t", Some("7"), "seven").await.status(),
        200
    );
    let tokens: Vec<_> = up.applied_on("/docs/t").iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6), Some(7)]);
    let line = "fencegate_decisions_total{route=\"docs\",outcome=\"key_busy\"} 1";
    let metrics = apps[1].metrics().await;
    assert!(metrics.contains(line), "missing {line} in\n{metrics}");
}

/// A fresh Postgres test database with the store's migrations applied,
/// and a connection to it, for tests that call the SQL protocol directly.
async fn migrated_db() -> (TestStore, sqlx::PgConnection) {
    use sqlx::Connection;
    let store = TestStore::new(Backend::Postgres).await;
    fencegate::store::migrate_url(&store.url)
        .await
        .expect("migrations");
    let db = sqlx::PgConnection::connect(&store.url)
        .await
        .expect("connect to the test database");
    (store, db)
}

/// The admission protocol itself (migrations/postgres/0010), statement by
/// statement, as instances call it: a write that never leaves (a crashed
/// instance) holds a raise until its marker ends; the raise is recorded at
/// once; and a writer that outlived its marker cannot open a key that the
/// next token's writers hold when it finally leaves. A protocol that let
/// any older token's leave count down would open the key under token 6's
/// write here.
#[tokio::test]
async fn the_admission_protocol_counts_each_tokens_writers() {
    let (_store, mut db) = migrated_db().await;
    async fn enter(db: &mut sqlx::PgConnection, token: i64, hold_ms: i64) -> (String, i64) {
        let (outcome, highest): (String, i64) = sqlx::query_as(
            "SELECT outcome, highest FROM fencegate_admit_batch('{}', '{}', \
             ARRAY['k'], ARRAY[$1::bigint], ARRAY[$2::bigint])",
        )
        .bind(token)
        .bind(hold_ms)
        .fetch_one(&mut *db)
        .await
        .expect("enter");
        (outcome, highest)
    }
    async fn leave(db: &mut sqlx::PgConnection, token: i64) {
        sqlx::query("SELECT count(*) FROM fencegate_admit_batch(ARRAY['k'], ARRAY[$1::bigint], '{}', '{}', '{}')")
            .bind(token)
            .execute(&mut *db)
            .await
            .expect("leave");
    }
    let ok = |t: i64| ("ok".to_string(), t);
    let wait = |t: i64| ("wait".to_string(), t);

    // Token 5 enters with a short marker, and never leaves.
    assert_eq!(enter(&mut db, 5, 300).await, ok(5));
    assert_eq!(enter(&mut db, 5, 300).await, ok(5), "equal tokens share");
    // 6 is recorded at once (5 is stale from now on) but waits.
    assert_eq!(enter(&mut db, 6, 60_000).await, wait(6));
    assert_eq!(
        enter(&mut db, 5, 300).await,
        ("stale".to_string(), 6),
        "a raise is recorded while it waits"
    );
    // One of the two writers of 5 leaves; the other never does.
    leave(&mut db, 5).await;
    assert_eq!(enter(&mut db, 6, 60_000).await, wait(6));
    // Their markers end: 6 is admitted, with a long marker of its own.
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    assert_eq!(enter(&mut db, 6, 60_000).await, ok(6));
    // 7 waits for 6's writer. The straggler of 5 leaves at last: that must
    // not open the key, which 6's write holds.
    assert_eq!(enter(&mut db, 7, 60_000).await, wait(7));
    leave(&mut db, 5).await;
    assert_eq!(enter(&mut db, 7, 60_000).await, wait(7));
    // 6's writer leaves: 7 goes at once, long before 6's marker ends.
    leave(&mut db, 6).await;
    assert_eq!(enter(&mut db, 7, 60_000).await, ok(7));
    // A still higher token while 7's write is in flight, then one more: the
    // last takes over the waiting, and 7's leave opens the key for it.
    assert_eq!(enter(&mut db, 8, 60_000).await, wait(8));
    assert_eq!(enter(&mut db, 9, 60_000).await, wait(9));
    assert_eq!(enter(&mut db, 8, 60_000).await, ("stale".to_string(), 9));
    leave(&mut db, 7).await;
    assert_eq!(enter(&mut db, 9, 60_000).await, ok(9));
    sqlx::Connection::close(db).await.ok();
}

/// One item of an admission batch, for the tests that call the SQL
/// protocol with batches of their own.
#[derive(Clone, Debug)]
enum Item {
    Leave(String, i64),
    Enter(String, i64, i64),
}

/// Runs one `fencegate_admit_batch` on keys prefixed with `prefix`, and
/// answers each admission's `(outcome, highest)` in item order.
async fn admit_batch(
    db: &mut sqlx::PgConnection,
    prefix: &str,
    items: &[Item],
) -> Result<Vec<(String, i64)>, sqlx::Error> {
    let (mut lk, mut lt, mut k, mut t, mut h) = (vec![], vec![], vec![], vec![], vec![]);
    for item in items {
        match item {
            Item::Leave(key, token) => {
                lk.push(format!("{prefix}{key}"));
                lt.push(*token);
            }
            Item::Enter(key, token, hold) => {
                k.push(format!("{prefix}{key}"));
                t.push(*token);
                h.push(*hold);
            }
        }
    }
    let rows: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT ord, outcome, highest FROM fencegate_admit_batch($1, $2, $3, $4, $5) ORDER BY ord",
    )
    .bind(&lk)
    .bind(&lt)
    .bind(&k)
    .bind(&t)
    .bind(&h)
    .fetch_all(db)
    .await?;
    assert_eq!(rows.len(), k.len(), "one answer per admission");
    Ok(rows.into_iter().map(|(_, o, h)| (o, h)).collect())
}

/// A small deterministic generator, so that a failing batch can be found
/// again from its round.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A batch decides, for every item, what the items decide one at a time in
/// the batch's order (0010's loop: by key, leaves first, then the lower
/// token), whether its items are alone on their key (decided together, by
/// set) or share it (one at a time), and leaves every row as they would.
/// The reference runs `fencegate_enter_one` and `fencegate_leave_one`, in
/// that order, in one transaction, on a second set of keys. Random batches
/// over four keys walk through every state: equal tokens joining, raises
/// over writers in flight or over markers that ended (`hold` 0), waits,
/// stale tokens, leaves of the highest and of a draining token.
#[tokio::test]
async fn a_batch_decides_what_its_items_decide_one_at_a_time() {
    use sqlx::Connection;
    let (_store, mut db) = migrated_db().await;
    let mut dice = Dice(0x2545_f491_4f6c_dd1d);
    let state = "SELECT substr(resource_key, 3), highest_token, inflight, writer_until IS NULL, \
                 open_at IS NULL, coalesce(open_at > clock_timestamp(), false), \
                 draining_token, draining \
                 FROM fences WHERE resource_key LIKE $1 ORDER BY 1";
    type Row = (String, i64, i32, bool, bool, bool, Option<i64>, i32);
    for round in 0..200_i64 {
        let base = 1 + round / 10;
        let items: Vec<Item> = (0..1 + dice.below(8))
            .map(|_| {
                let key = format!("k{}", dice.below(4));
                let token = base + i64::try_from(dice.below(3)).unwrap();
                match dice.below(3) {
                    0 => Item::Leave(key, token),
                    _ => Item::Enter(key, token, [0, 60_000][usize::from(dice.below(4) > 0)]),
                }
            })
            .collect();
        let batch = admit_batch(&mut db, "b:", &items)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {items:?}: {e}"));

        // The reference: the same items, one at a time, in the loop's order.
        let mut order: Vec<(usize, &Item)> = items.iter().enumerate().collect();
        let sort_key = |item: &Item| match item {
            Item::Leave(k, t) => (k.clone(), false, *t),
            Item::Enter(k, t, _) => (k.clone(), true, *t),
        };
        order.sort_by_key(|(_, item)| sort_key(item));
        let mut answers = vec![None; items.len()];
        let mut tx = db.begin().await.unwrap();
        for (i, item) in order {
            match item {
                Item::Leave(k, t) => {
                    sqlx::query("SELECT fencegate_leave_one($1, $2)")
                        .bind(format!("r:{k}"))
                        .bind(t)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                Item::Enter(k, t, h) => {
                    let answer: (String, i64) = sqlx::query_as(
                        "SELECT outcome, highest FROM fencegate_enter_one($1, $2, $3)",
                    )
                    .bind(format!("r:{k}"))
                    .bind(t)
                    .bind(h)
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                    answers[i] = Some(answer);
                }
            }
        }
        tx.commit().await.unwrap();
        let reference: Vec<(String, i64)> = answers.into_iter().flatten().collect();
        assert_eq!(batch, reference, "round {round}: {items:?}");

        let rows = |prefix: &'static str| sqlx::query_as::<_, Row>(state).bind(prefix);
        let batch_rows = rows("b:%").fetch_all(&mut db).await.unwrap();
        let reference_rows = rows("r:%").fetch_all(&mut db).await.unwrap();
        assert_eq!(batch_rows, reference_rows, "round {round}: {items:?}");
    }
    db.close().await.ok();
}

/// Batches on several connections at once, on overlapping keys named in
/// every order and on keys with no row yet: no two wait for each other in
/// a cycle. A batch whose statements locked rows in a different order than
/// another's would deadlock here, and Postgres would abort one of them
/// (after `deadlock_timeout`, set short for the test) with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_never_wait_for_each_other_in_a_cycle() {
    use sqlx::Connection;
    let (store, db) = migrated_db().await;
    db.close().await.ok();
    let workers: Vec<_> = (0..4_u64)
        .map(|w| {
            let url = store.url.clone();
            tokio::spawn(async move {
                let mut db = sqlx::PgConnection::connect(&url).await.unwrap();
                sqlx::query("SET deadlock_timeout = '20ms'")
                    .execute(&mut db)
                    .await
                    .unwrap();
                let mut dice = Dice(0x9e37_79b9_7f4a_7c15 ^ (w + 1));
                for round in 0..240_i64 {
                    // Six keys; every twentieth round a new set of them,
                    // inserted by whichever batch comes first.
                    let items: Vec<Item> = (0..2 + dice.below(12))
                        .map(|_| {
                            let key = format!("{}:{}", round / 20, dice.below(6));
                            let token = 1 + round / 4 + i64::try_from(dice.below(2)).unwrap();
                            match dice.below(2) {
                                0 => Item::Leave(key, token),
                                _ => Item::Enter(key, token, 60_000),
                            }
                        })
                        .collect();
                    if let Err(e) = admit_batch(&mut db, "c", &items).await {
                        panic!("worker {w}, round {round}: {items:?}: {e}");
                    }
                }
                db.close().await.ok();
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("no batch failed");
    }
}

/// The protocol as an earlier gateway calls it during a rolling upgrade
/// (`fencegate_enter`, `fencegate_leave`, one write each): the same
/// counts, and a `wait` short enough for its sleep-then-ask loop.
#[tokio::test]
async fn earlier_gateways_speak_the_same_admission_protocol() {
    let (_store, mut db) = migrated_db().await;
    async fn enter(db: &mut sqlx::PgConnection, token: i64) -> (String, i64, i64) {
        sqlx::query_as("SELECT outcome, highest, wait_ms FROM fencegate_enter('k', $1, 60000)")
            .bind(token)
            .fetch_one(&mut *db)
            .await
            .expect("enter")
    }
    assert_eq!(enter(&mut db, 5).await.0, "ok");
    let (outcome, highest, wait_ms) = enter(&mut db, 6).await;
    assert_eq!((outcome.as_str(), highest), ("wait", 6));
    assert!(
        wait_ms <= 10,
        "an earlier gateway sleeps {wait_ms} ms before it asks again"
    );
    // The new batch form sees the old form's writer, and the reverse.
    let (batch_outcome,): (String,) = sqlx::query_as(
        "SELECT outcome FROM fencegate_admit_batch('{}', '{}', \
         ARRAY['k'], ARRAY[6::bigint], ARRAY[60000::bigint])",
    )
    .fetch_one(&mut db)
    .await
    .expect("enter_batch");
    assert_eq!(batch_outcome, "wait");
    sqlx::query("SELECT fencegate_leave('k', 5)")
        .execute(&mut db)
        .await
        .expect("leave");
    assert_eq!(enter(&mut db, 6).await.0, "ok");
    sqlx::Connection::close(db).await.ok();
}

/// Across instances a higher token waits for the older write only as long
/// as that write is at the upstream: it goes as soon as the write has
/// finished there (its leave opens the key), not when the write's marker
/// ends (the route's 30 s timeout plus a second). Meanwhile its token is
/// recorded, so the older token is refused on every instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_token_goes_when_the_older_write_has_left() {
    let (_store, up, apps, slow) = held_by_the_first("/docs/h", 10_000).await;
    let started = std::time::Instant::now();
    let six = {
        let req = fenced_put(&apps[1].http, apps[1].url("/docs/h"), "6", "six");
        tokio::spawn(async move { req.send().await.map(|r| r.status().as_u16()) })
    };
    // While 6 waits, 5 is stale everywhere (6 is recorded), and nothing of
    // that refusal is forwarded.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    apps[0].assert_stale("/docs/h", "5", "five again", 6).await;
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    assert_eq!(six.await.unwrap().unwrap(), 200);
    let waited = started.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(10),
        "token 6 waited {waited:?}: for the marker, not for the write"
    );
    let applied = up.applied_on("/docs/h");
    let tokens: Vec<_> = applied.iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6)]);
}

/// An admission that the server refuses (here a trigger raises for its
/// key) rolls back its whole batch, leaves of other keys' finished writes
/// included. Those leaves are then written on their own, so the other keys
/// open at once instead of staying closed until their writes' markers end
/// (the route's `timeout_ms` + 1 s: 31 s here). The leave and the failing
/// admission are made to share a batch: a test transaction holds the row
/// lock of a third key while its admission runs, so both queue behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_admission_does_not_keep_other_keys_closed() {
    use crate::support::db::PgHolder;
    let store = TestStore::new(Backend::Postgres).await;
    let up = Upstream::start().await;
    let apps = gateways_with(&store, &up, 1, "key_lock_wait_ms = 2000").await;
    let app = &apps[0];
    assert_eq!(app.put("/docs/slow", Some("1"), "one").await.status(), 200);
    let mut conn = {
        use sqlx::Connection;
        sqlx::PgConnection::connect(&store.url).await.unwrap()
    };
    sqlx::raw_sql(
        "CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'no admissions for doc:boom'; END $$;
         CREATE TRIGGER boom BEFORE INSERT OR UPDATE ON fences FOR EACH ROW
             WHEN (NEW.resource_key = 'doc:boom') EXECUTE FUNCTION boom();",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let spawn_put = |path: &str, token: &str, delay_ms: u64| {
        let req = fenced_put(&app.http, app.url(path), token, "w")
            .header("x-test-delay-ms", delay_ms.to_string());
        tokio::spawn(async move { req.send().await.map(|r| r.status().as_u16()) })
    };
    let pause = |ms| tokio::time::sleep(std::time::Duration::from_millis(ms));
    // 5 on x is admitted and at the upstream for 600 ms.
    let x5 = spawn_put("/docs/x", "5", 600);
    pause(200).await;
    // The next batch (an admission on slow) waits for the test's row lock.
    let holder = PgHolder::begin(
        &store.url,
        "SELECT 1 FROM fences WHERE resource_key = 'doc:slow' FOR UPDATE",
    )
    .await;
    let slow2 = spawn_put("/docs/slow", "2", 0);
    pause(100).await;
    // 5's leave, then boom's admission, queue behind it: one batch.
    assert_eq!(x5.await.unwrap().unwrap(), 200);
    pause(100).await;
    let boom = spawn_put("/docs/boom", "1", 0);
    pause(100).await;
    holder.commit().await;
    assert_eq!(slow2.await.unwrap().unwrap(), 200);
    assert_eq!(boom.await.unwrap().unwrap(), 503, "boom's admission failed");
    // x is open: 6 goes at once (without its leave, 6 would wait for 5's
    // marker and give up after key_lock_wait_ms: 503 key-busy).
    assert_eq!(app.put("/docs/x", Some("6"), "six").await.status(), 200);
    let tokens: Vec<_> = up.applied_on("/docs/x").iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(5), Some(6)]);
    assert!(up.applied_on("/docs/boom").is_empty());
}
