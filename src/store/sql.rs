//! SQL pieces that several statements share, in the fence store and in the
//! table lock backend: macros, so that statements are composed with
//! `concat!` at compile time, and the few statements and checks that both a
//! backend and the idempotency records run.
//!
//! A parameter is named as each backend writes it: `"$1"` on Postgres,
//! `"?1"` on SQLite.

/// The highest token recorded for the resource key bound to `$key`, 0 if
/// none is.
macro_rules! highest_token {
    ($key:literal) => {
        concat!(
            "COALESCE((SELECT highest_token FROM fences WHERE resource_key = ",
            $key,
            "), 0)"
        )
    };
}

/// The last fence issued for the lock name bound to `$name`, 0 if none
/// was.
macro_rules! issued_fence {
    ($name:literal) => {
        concat!(
            "COALESCE((SELECT fence FROM locks WHERE name = ",
            $name,
            "), 0)"
        )
    };
}

/// Postgres: the whole milliseconds from now until the timestamp `$at`, 0
/// once it has passed.
macro_rules! pg_ms_until {
    ($at:literal) => {
        concat!(
            "GREATEST(0, (EXTRACT(EPOCH FROM (",
            $at,
            " - now())) * 1000))::bigint"
        )
    };
}

/// SQLite's clock in Unix milliseconds.
macro_rules! sqlite_now_ms {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
    };
}

/// Runs `$run` on the backend of the [`FenceStore`](super::FenceStore)
/// `$store`, with `$pool` bound to its pool and `$sql` to what is written
/// for that backend (a statement, or a statement and its helpers):
/// `(postgres, sqlite)`. A macro rather than a
/// function: each arm is typed for its own database.
macro_rules! on_backend {
    ($store:expr, ($pg:expr, $lite:expr), |$pool:ident, $sql:pat_param| $run:expr $(,)?) => {
        match $store {
            $crate::store::FenceStore::Postgres(s) => {
                let ($pool, $sql) = (s.pool(), $pg);
                $run
            }
            $crate::store::FenceStore::Sqlite(s) => {
                let ($pool, $sql) = (s.pool(), $lite);
                $run
            }
        }
    };
}

pub(crate) use {highest_token, issued_fence, on_backend, pg_ms_until, sqlite_now_ms};

use sqlx::SqliteConnection;

use super::StoreError;

/// Whether a failed statement is known to have written nothing: the server
/// refused it with an `ERROR` (a raised exception, a deadlock, a statement
/// timeout, a bad value), which rolls back the statement's transaction, and
/// keeps the session. Any other failure (the connection broke, the gateway
/// stopped waiting, a `FATAL` that may come after the commit) leaves the
/// outcome unknown.
pub(super) fn rolled_back(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .is_some_and(|pg| pg.severity() == sqlx::postgres::PgSeverity::Error)
}

/// One decision of a batch: returns a row only when it raised the token.
#[rustfmt::skip]
const RECORD: &str = concat!("\
INSERT INTO fences (resource_key, highest_token, updated_at)
VALUES (?1, ?2, ", sqlite_now_ms!(), ")
ON CONFLICT (resource_key) DO UPDATE
    SET highest_token = excluded.highest_token, updated_at = excluded.updated_at
    WHERE fences.highest_token < excluded.highest_token
RETURNING highest_token");

/// Records `token` for `key` within a transaction unless a higher one is
/// recorded: the key's highest token after it.
pub(super) async fn decide_in(
    conn: &mut SqliteConnection,
    key: &str,
    token: i64,
) -> Result<i64, StoreError> {
    let raised: Option<i64> = sqlx::query_scalar(RECORD)
        .bind(key)
        .bind(token)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(match raised {
        Some(h) => h,
        None => {
            sqlx::query_scalar("SELECT highest_token FROM fences WHERE resource_key = ?1")
                .bind(key)
                .fetch_one(&mut *conn)
                .await?
        }
    })
}
