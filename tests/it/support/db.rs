//! Databases for tests: a fresh Postgres database per test on the shared
//! server (`DATABASE_URL`, or see [`shared_servers`]), or a SQLite file in a
//! temp dir.

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::{Connection, PgConnection};

use super::shared_servers;

/// Which fence store a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The server that tests create their databases on: `DATABASE_URL`, by
/// default user postgres on 127.0.0.1:5432, or the tests' own when nothing
/// answers there.
pub fn admin_url() -> String {
    shared_servers::POSTGRES.url()
}

/// The single-writer lock's first key (`classid` in `pg_locks`, "FGAT");
/// its second is 1.
pub const SINGLE_WRITER_NAMESPACE: i64 = 0x4647_4154;

/// A store for one test; removed when dropped.
pub struct TestStore {
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    pg_name: Option<String>,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl TestStore {
    pub async fn new(backend: Backend) -> Self {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let url = format!("sqlite://{}", dir.path().join("fences.db").display());
                Self {
                    url,
                    _dir: Some(dir),
                    pg_name: None,
                }
            }
            Backend::Postgres => {
                let name = format!(
                    "fg_test_{}_{}_{}",
                    std::process::id(),
                    COUNTER.fetch_add(1, Ordering::Relaxed),
                    rand::random::<u32>()
                );
                create_database(&name).await;
                let url = database_url(&name);
                Self {
                    url,
                    _dir: None,
                    pg_name: Some(name),
                }
            }
        }
    }
}

/// `admin_url()` with its database replaced by `name`.
pub fn database_url(name: &str) -> String {
    let base = admin_url();
    let (prefix, query) = match base.split_once('?') {
        Some((p, q)) => (p.to_string(), format!("?{q}")),
        None => (base.clone(), String::new()),
    };
    let after_scheme = prefix.find("://").map(|i| i + 3).unwrap_or(0);
    let root = match prefix[after_scheme..].find('/') {
        Some(i) => &prefix[..after_scheme + i],
        None => prefix.as_str(),
    };
    format!("{root}/{name}{query}")
}

async fn connect_admin() -> PgConnection {
    let url = admin_url();
    match PgConnection::connect(&url).await {
        Ok(c) => c,
        Err(e) => panic!(
            "cannot reach Postgres at {url}: {e}\n\
             point DATABASE_URL at a Postgres server where this user may CREATE DATABASE, \
             or unset it: with nothing answering on 127.0.0.1:5432 the tests start a \
             Postgres of their own (Debian's postgresql package)"
        ),
    }
}

async fn create_database(name: &str) {
    let mut conn = connect_admin().await;
    sqlx::query(&format!("CREATE DATABASE \"{name}\""))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
    let _ = conn.close().await;
}

impl Drop for TestStore {
    fn drop(&mut self) {
        if let Some(name) = self.pg_name.take() {
            // Best effort, on a thread of its own: Drop cannot await and may
            // run inside a runtime.
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(rt) = rt {
                    rt.block_on(async {
                        if let Ok(mut c) = PgConnection::connect(&admin_url()).await {
                            let _ = sqlx::query(&format!(
                                "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                            ))
                            .execute(&mut c)
                            .await;
                        }
                    });
                }
            })
            .join();
        }
    }
}

/// A transaction of another connection on a Postgres store that has run a
/// statement (a row or table lock, a write) and holds what it took until
/// [`commit`]: the gateway's statements on the same rows wait for it, and
/// see its writes only then.
///
/// [`commit`]: PgHolder::commit
pub struct PgHolder(PgConnection);

impl PgHolder {
    pub async fn begin(url: &str, statement: &str) -> Self {
        let mut conn = PgConnection::connect(url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        let mut holder = Self(conn);
        holder.run(statement).await;
        holder
    }

    /// Runs one more statement within the transaction.
    pub async fn run(&mut self, statement: &str) {
        sqlx::query(statement).execute(&mut self.0).await.unwrap();
    }

    /// Commits the transaction, and closes the connection.
    pub async fn commit(mut self) {
        sqlx::query("COMMIT").execute(&mut self.0).await.unwrap();
    }
}

/// A transaction of another connection on a SQLite store, holding its write
/// lock (`IMMEDIATE`) or all its locks (`EXCLUSIVE`) until [`release`]: the
/// store is then as good as down for the gateway.
///
/// [`release`]: SqliteBlocker::release
pub struct SqliteBlocker(sqlx::SqliteConnection);

impl SqliteBlocker {
    pub async fn begin(url: &str, mode: &str) -> Self {
        let mut conn = sqlx::SqliteConnection::connect(url).await.unwrap();
        sqlx::query(&format!("BEGIN {mode}"))
            .execute(&mut conn)
            .await
            .unwrap();
        Self(conn)
    }

    /// The connection, to write within the transaction.
    pub fn conn(&mut self) -> &mut sqlx::SqliteConnection {
        &mut self.0
    }

    /// Rolls the transaction back, and closes the connection.
    pub async fn release(mut self) {
        sqlx::query("ROLLBACK").execute(&mut self.0).await.unwrap();
    }

    /// Commits the transaction, and closes the connection.
    pub async fn commit(mut self) {
        sqlx::query("COMMIT").execute(&mut self.0).await.unwrap();
    }
}
