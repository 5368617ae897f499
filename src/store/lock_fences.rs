//! The fences of the Redis and Redlock lock backends, kept in the `locks`
//! table next to the table backend's leases: a lock name's counter, which
//! never goes below the highest token recorded for the resource key of the
//! same name.
//!
//! Statements that write are stepped to the end (`fetch_all`) even for one
//! row, so that a failed commit is reported on SQLite (see the `sqlite`
//! module docs); on Postgres it costs nothing.

use super::sql::{highest_token, issued_fence, on_backend};
use super::{bounded, FenceStore, StoreError};

/// Next fence for a lock name: above every fence issued for it and above the
/// highest token recorded for the resource key of the same name.
#[rustfmt::skip]
const PG_ISSUE_FENCE: &str = concat!("\
INSERT INTO locks AS l (name, fence)
VALUES ($1, ", highest_token!("$1"), " + 1)
ON CONFLICT (name) DO UPDATE
    SET fence = GREATEST(l.fence, ", highest_token!("$1"), ") + 1
RETURNING fence");

/// See [`PG_ISSUE_FENCE`].
#[rustfmt::skip]
const SQLITE_ISSUE_FENCE: &str = concat!("\
INSERT INTO locks (name, fence)
VALUES (?1, ", highest_token!("?1"), " + 1)
ON CONFLICT (name) DO UPDATE
    SET fence = MAX(locks.fence, ", highest_token!("?1"), ") + 1
RETURNING fence");

/// The highest fence a grant for this name must exceed.
#[rustfmt::skip]
const PG_FENCE_FLOOR: &str = concat!("\
SELECT GREATEST(
    ", issued_fence!("$1"), ",
    ", highest_token!("$1"), ")");

/// See [`PG_FENCE_FLOOR`].
#[rustfmt::skip]
const SQLITE_FENCE_FLOOR: &str = concat!("\
SELECT MAX(
    ", issued_fence!("?1"), ",
    ", highest_token!("?1"), ")");

/// Records a fence issued elsewhere (Redis) if it is above the floor;
/// returns a row only when it was.
#[rustfmt::skip]
const PG_RECORD_FENCE: &str = concat!("\
INSERT INTO locks AS l (name, fence)
SELECT $1, $2
 WHERE $2 > ", highest_token!("$1"), "
ON CONFLICT (name) DO UPDATE
    SET fence = EXCLUDED.fence
    WHERE l.fence < EXCLUDED.fence
RETURNING fence");

/// See [`PG_RECORD_FENCE`].
#[rustfmt::skip]
const SQLITE_RECORD_FENCE: &str = concat!("\
INSERT INTO locks (name, fence)
SELECT ?1, ?2
 WHERE ?2 > ", highest_token!("?1"), "
ON CONFLICT (name) DO UPDATE
    SET fence = excluded.fence
    WHERE locks.fence < excluded.fence
RETURNING fence");

impl FenceStore {
    /// Issues the next fence for a lock name, durably: above every fence
    /// issued for the name and above the highest token recorded for the
    /// resource key of the same name. Used by Redlock grants.
    pub async fn issue_fence(&self, name: &str) -> Result<i64, StoreError> {
        self.check_writer()?;
        bounded(self.timeout(), StoreError::Timeout, async {
            let issued: Vec<i64> =
                on_backend!(self, (PG_ISSUE_FENCE, SQLITE_ISSUE_FENCE), |pool, sql| {
                    sqlx::query_scalar(sql).bind(name).fetch_all(pool).await?
                });
            issued
                .into_iter()
                .next()
                .ok_or(sqlx::Error::RowNotFound.into())
        })
        .await
    }

    /// The value every new fence for `name` must exceed: the last fence
    /// issued for it, or the highest token recorded for the key, whichever is
    /// higher (0 if neither exists).
    pub async fn fence_floor(&self, name: &str) -> Result<i64, StoreError> {
        bounded(self.timeout(), StoreError::Timeout, async {
            Ok(on_backend!(
                self,
                (PG_FENCE_FLOOR, SQLITE_FENCE_FLOOR),
                |pool, sql| sqlx::query_scalar(sql).bind(name).fetch_one(pool).await?
            ))
        })
        .await
    }

    /// Durably records `fence` as issued for `name` if it is above the floor.
    /// Returns false (and records nothing) when it is not: a grant with that
    /// fence must then be withdrawn.
    pub async fn record_fence(&self, name: &str, fence: i64) -> Result<bool, StoreError> {
        self.check_writer()?;
        bounded(self.timeout(), StoreError::Timeout, async {
            let raised: Vec<i64> =
                on_backend!(self, (PG_RECORD_FENCE, SQLITE_RECORD_FENCE), |pool, sql| {
                    sqlx::query_scalar(sql)
                        .bind(name)
                        .bind(fence)
                        .fetch_all(pool)
                        .await?
                });
            Ok(!raised.is_empty())
        })
        .await
    }

    /// The highest fence the lock API has granted for the lock `name` (0 if
    /// none): `token = "issued"` routes accept no token above it.
    pub async fn issued_fence(&self, name: &str) -> Result<i64, StoreError> {
        bounded(self.timeout(), StoreError::Timeout, async {
            Ok(on_backend!(
                self,
                (
                    concat!("SELECT ", issued_fence!("$1")),
                    concat!("SELECT ", issued_fence!("?1"))
                ),
                |pool, sql| sqlx::query_scalar(sql).bind(name).fetch_one(pool).await?
            ))
        })
        .await
    }
}
