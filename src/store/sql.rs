//! SQL pieces that several statements share, in the fence store and in the
//! table lock backend. They are macros so that statements are composed with
//! `concat!` at compile time.
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
