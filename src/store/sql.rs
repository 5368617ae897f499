//! SQL pieces that several statements share, in the fence store and in the
//! table lock backend. They are macros so that statements are composed with
//! `concat!` at compile time.

/// The highest token recorded for the resource key bound to `$key` (`"$1"`
/// on Postgres, `"?1"` on SQLite), 0 if none is.
macro_rules! highest_token {
    ($key:literal) => {
        concat!(
            "COALESCE((SELECT highest_token FROM fences WHERE resource_key = ",
            $key,
            "), 0)"
        )
    };
}

/// SQLite's clock in Unix milliseconds.
macro_rules! sqlite_now_ms {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
    };
}

pub(crate) use {highest_token, sqlite_now_ms};
