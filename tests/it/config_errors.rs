//! `check-config` and `serve` on bad configs: every problem is named with
//! file, key and reason, and the exit code says so.

use crate::support::process::run;

fn write(text: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path.display().to_string())
}

#[test]
fn check_config_lists_every_problem() {
    let (_d, path) = write(
        r#"
[server]
listen = "not-an-address"
admin_listen = "127.0.0.1:9090"
colour = "blue"
workers = 0

[store]
url = "mysql://db"
mode = "sometimes"
idempotency_purge_interval_ms = 5

[[routes]]
name = "docs"
path = "/docs/{id}"
upstream = "http://127.0.0.1:9000"
key = "doc:{doc_id}"

[[routes]]
name = "docs"
path = "/_fencegate/locks/{name}"
upstream = "127.0.0.1:9000"
key = "x"
timeout_ms = 0

[[routes]]
name = "nothing"
path = "/n/{id}"
key = "n:{id}"
methods = ["put"]
"#,
    );
    let (code, _out, err) = run(&["check-config", &path]);
    assert_eq!(code, 1, "{err}");
    for needle in [
        "server.listen: 'not-an-address' is not a socket address",
        "server.colour: unknown key",
        "server.workers: must be between 1 and 1024, got 0",
        "store.url: 'mysql://db' is neither",
        "store.mode: 'sometimes' is not a mode",
        "store.idempotency_purge_interval_ms: must be between 100 and 86400000, got 5",
        "routes[0].key: 'doc:{doc_id}' uses capture '{doc_id}', which the route's path does not define (it defines: {id})",
        "routes[1].name: duplicate route name 'docs'",
        "routes[1].path: '/_fencegate/locks/{name}' is under /_fencegate/, which is reserved",
        "routes[1].upstream: '127.0.0.1:9000'",
        "routes[1].timeout_ms: must be between 1 and",
        "routes[2].upstream: missing",
        "routes[2].methods: 'put' is not an HTTP method in upper case",
    ] {
        assert!(err.contains(&format!("{path}: {needle}")), "missing {needle:?} in:\n{err}");
    }
}

#[test]
fn serve_refuses_a_bad_config() {
    let (_d, path) = write("[server]\nlisten = \"nowhere\"\n");
    let (code, _out, err) = run(&["serve", "--config", &path]);
    assert_eq!(code, 1);
    assert!(err.contains("server.listen"), "{err}");
    assert!(err.contains("not starting"), "{err}");
}

#[test]
fn unreadable_and_invalid_toml_files() {
    let (code, _o, err) = run(&["check-config", "/nonexistent/fencegate.toml"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("/nonexistent/fencegate.toml: -: cannot read the file"),
        "{err}"
    );
    let (_d, path) = write("[server\nlisten = 1");
    let (code, _o, err) = run(&["check-config", &path]);
    assert_eq!(code, 1);
    assert!(err.contains("not valid TOML"), "{err}");
    let (_d, path) = write("[server]\nmax_body_bytes = \"lots\"\n");
    let (code, _o, err) = run(&["check-config", &path]);
    assert_eq!(code, 1);
    assert!(err.contains("server.max_body_bytes"), "{err}");
}

#[test]
fn the_shipped_configs_are_valid() {
    let root = env!("CARGO_MANIFEST_DIR");
    for file in ["config/fencegate.toml", "config/docker.toml"] {
        let (code, out, err) = run(&["check-config", &format!("{root}/{file}")]);
        assert_eq!(code, 0, "{file}: {out}{err}");
    }
}

#[test]
fn env_overrides_are_validated_too() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = std::process::Command::new(crate::support::process::binary())
        .args(["check-config", &format!("{root}/config/fencegate.toml")])
        .env("FENCEGATE__STORE__MODE", "weird")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("store.mode (from FENCEGATE__STORE__MODE)"),
        "{err}"
    );
}

#[tokio::test]
async fn migrate_command_creates_the_schema() {
    use crate::support::db::{Backend, TestStore};
    use sqlx::Connection;
    for b in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(b).await;
        let (code, out, err) = run(&["migrate", "--database-url", &store.url]);
        assert_eq!(code, 0, "{b:?}: {out}{err}");
        assert!(out.contains("migrations applied"), "{out}");
        // Twice is fine.
        let (code, _, err) = run(&["migrate", "--database-url", &store.url]);
        assert_eq!(code, 0, "{err}");
        // The same query on each backend's own connection type.
        macro_rules! fence_rows {
            ($connection:ty) => {{
                let mut c = <$connection>::connect(&store.url).await.unwrap();
                sqlx::query_scalar("SELECT count(*) FROM fences")
                    .fetch_one(&mut c)
                    .await
                    .unwrap()
            }};
        }
        let n: i64 = match b {
            Backend::Sqlite => fence_rows!(sqlx::SqliteConnection),
            Backend::Postgres => fence_rows!(sqlx::PgConnection),
        };
        assert_eq!(n, 0);
        // A later version migrated the store further (a rolling upgrade, or
        // a roll back): this binary, now the earlier one, still migrates
        // and starts. sqlx's default fails with VersionMissing here.
        macro_rules! later_migration {
            ($connection:ty) => {{
                let mut c = <$connection>::connect(&store.url).await.unwrap();
                sqlx::query(
                    "INSERT INTO _sqlx_migrations \
                     (version, description, success, checksum, execution_time) \
                     VALUES (999999, 'from a later version', true, $1, 0)",
                )
                .bind(vec![0_u8])
                .execute(&mut c)
                .await
                .unwrap();
            }};
        }
        match b {
            Backend::Sqlite => later_migration!(sqlx::SqliteConnection),
            Backend::Postgres => later_migration!(sqlx::PgConnection),
        }
        let (code, out, err) = run(&["migrate", "--database-url", &store.url]);
        assert_eq!(
            code, 0,
            "{b:?} after a later version's migration: {out}{err}"
        );
        let up = crate::support::upstream::Upstream::start().await;
        let app = crate::support::app::TestApp::spawn(
            &store.url,
            &crate::support::app::docs_route(&up.url()),
        )
        .await;
        assert_eq!(app.put("/docs/a", Some("1"), "a").await.status(), 200);
        assert_eq!(up.applied_on("/docs/a").len(), 1);
        app.stop().await;
    }
    let (code, _, err) = run(&[
        "migrate",
        "--database-url",
        "postgres://postgres@127.0.0.1:1/none",
    ]);
    assert_eq!(code, 1);
    assert!(err.starts_with("migrate:"), "{err}");
}

/// A migration that has to wait is not reported as a slow statement with
/// the migration's SQL: `migrate` says what it did itself. Here it waits
/// for another session for 1.5 s, longer than sqlx's slow-statement
/// threshold (1 s): on Postgres one creating sqlx's bookkeeping table (its
/// uncommitted row in the catalog blocks ours) and rolling back; on SQLite
/// one holding the write lock of the store's file.
#[tokio::test]
async fn a_migration_that_waits_prints_no_statement() {
    use crate::support::db::{Backend, TestStore};
    use sqlx::{Connection, Executor};
    for b in [Backend::Sqlite, Backend::Postgres] {
        let store = TestStore::new(b).await;
        let begin = "CREATE TABLE _sqlx_migrations (version bigint PRIMARY KEY)";
        let mut pg = None;
        let mut lite = None;
        match b {
            Backend::Postgres => {
                let mut c = sqlx::PgConnection::connect(&store.url).await.unwrap();
                c.execute("BEGIN").await.unwrap();
                c.execute(begin).await.unwrap();
                pg = Some(c);
            }
            Backend::Sqlite => {
                // In WAL mode already, as the gateway leaves it, so that the
                // migration's own first statement is what waits.
                let url = format!("{}?mode=rwc", store.url);
                let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
                c.execute("PRAGMA journal_mode = WAL").await.unwrap();
                c.execute("BEGIN IMMEDIATE").await.unwrap();
                lite = Some(c);
            }
        }
        let url = store.url.clone();
        let migrate =
            tokio::task::spawn_blocking(move || run(&["migrate", "--database-url", &url]));
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        assert!(!migrate.is_finished(), "{b:?}: migrate did not wait");
        if let Some(mut c) = pg {
            c.execute("ROLLBACK").await.unwrap();
        }
        if let Some(mut c) = lite {
            c.execute("ROLLBACK").await.unwrap();
        }
        let (code, out, err) = migrate.await.unwrap();
        assert_eq!(code, 0, "{b:?}: {out}{err}");
        assert!(out.contains("migrations applied"), "{b:?}: {out}");
        assert!(
            !err.contains("slow statement") && !err.contains("CREATE"),
            "{b:?}: migrate printed a statement: {err}"
        );
    }
}
