//! The fence store's admin side: reading and listing fence records, and the
//! break-glass reset with its audit trail. None of it is on the decision
//! path; the statements live here, for both backends, so that the decision
//! modules stay about decisions.
//!
//! Listings page by key (keyset pagination: `key > after`, never `OFFSET`),
//! in byte order: a prefix is then one contiguous range, bounded above by the
//! prefix's successor ([`prefix_end`]), and each page is an index range scan
//! (Postgres compares with `COLLATE "C"`: since migration 0014 the key
//! columns' own collation, so the primary keys serve it; the statements
//! still name it, so that they say which order they page in).

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::sql::on_backend;
use super::{bounded, FenceStore, StoreError};

/// What the admin API shows for a key.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct FenceRecord {
    pub resource_key: String,
    pub highest_token: i64,
    pub updated_at: DateTime<Utc>,
    /// The latest admin reset of this key, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reset: Option<ResetRecord>,
}

/// One admin reset.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ResetRecord {
    pub at: DateTime<Utc>,
    /// The admin client that reset it.
    pub by: String,
    pub reason: String,
    /// The highest token before, if the key had one.
    pub from: Option<i64>,
    pub to: i64,
}

/// One page of a listing, and the key to continue after (`None` at the end).
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Option<String>,
}

impl<T> Page<T> {
    /// A page of at most `limit` items from a query that asked for one row
    /// more: that extra row, if it came, says a next page exists, which
    /// starts after the key of the last item kept.
    fn of(mut items: Vec<T>, limit: usize, key: impl Fn(&T) -> String) -> Self {
        let next = if items.len() > limit {
            items.truncate(limit);
            items.last().map(key)
        } else {
            None
        };
        Page { items, next }
    }
}

/// The smallest string above every string that starts with `prefix`, in
/// byte (code point) order; `None` when there is none (an empty prefix, or
/// one of only `char::MAX`).
pub fn prefix_end(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        // The next code point, skipping the surrogate gap.
        let next = match last as u32 {
            0xD7FF => Some('\u{E000}'),
            c => char::from_u32(c + 1),
        };
        if let Some(n) = next {
            chars.push(n);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

/// One page of a prefix listing: what its statement binds as `$1`..`$4`.
struct Window<'a> {
    prefix: &'a str,
    /// [`prefix_end`] of the prefix: the range's upper bound.
    end: Option<String>,
    /// The key the page continues after.
    after: Option<&'a str>,
    /// One more row than the page holds: whether there is a next page.
    take: i64,
}

impl<'a> Window<'a> {
    fn new(prefix: &'a str, after: Option<&'a str>, limit: usize) -> Self {
        Window {
            prefix,
            end: prefix_end(prefix),
            after,
            take: i64::try_from(limit).unwrap_or(i64::MAX - 1) + 1,
        }
    }

    /// The page's statements over `column`, for Postgres and SQLite, after
    /// each backend's `SELECT`.
    fn sql(pg_select: &str, sqlite_select: &str, column: &str) -> (String, String) {
        let c = column;
        (
            format!(
                "{pg_select} WHERE {c} COLLATE \"C\" >= $1 \
                   AND ($2::text IS NULL OR {c} COLLATE \"C\" < $2) \
                   AND ($3::text IS NULL OR {c} COLLATE \"C\" > $3) \
                 ORDER BY {c} COLLATE \"C\" LIMIT $4"
            ),
            format!(
                "{sqlite_select} WHERE {c} >= ?1 \
                   AND (?2 IS NULL OR {c} < ?2) AND (?3 IS NULL OR {c} > ?3) \
                 ORDER BY {c} LIMIT ?4"
            ),
        )
    }
}

/// Binds a [`Window`] to a statement from [`Window::sql`] (a macro: the
/// query types differ between backends and between `query`/`query_scalar`).
macro_rules! bind_window {
    ($query:expr, $window:expr) => {
        $query
            .bind($window.prefix)
            .bind($window.end.as_deref())
            .bind($window.after)
            .bind($window.take)
    };
}

const PG_RECORD: &str = "\
SELECT f.resource_key, f.highest_token, f.updated_at,
       r.at, r.by_client, r.reason, r.from_token, r.to_token
  FROM fences f
  LEFT JOIN LATERAL (SELECT at, by_client, reason, from_token, to_token FROM fence_resets
                      WHERE resource_key = f.resource_key ORDER BY id DESC LIMIT 1) r ON true";

const SQLITE_RECORD: &str = "\
SELECT f.resource_key, f.highest_token, f.updated_at,
       r.at, r.by_client, r.reason, r.from_token, r.to_token
  FROM fences f
  LEFT JOIN fence_resets r ON r.id = (SELECT max(id) FROM fence_resets WHERE resource_key = f.resource_key)";

/// Rows of a `*_RECORD` query as records; `at` converts each backend's time.
fn records<R: Row>(
    rows: Vec<R>,
    at: impl Fn(&R, usize) -> Result<Option<DateTime<Utc>>, sqlx::Error>,
) -> Result<Vec<FenceRecord>, sqlx::Error>
where
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    rows.into_iter()
        .map(|r| {
            let last_reset = match (at(&r, 3)?, r.try_get::<Option<String>, _>(4)?) {
                (Some(at), Some(by)) => Some(ResetRecord {
                    at,
                    by,
                    reason: r.try_get::<Option<String>, _>(5)?.unwrap_or_default(),
                    from: r.try_get(6)?,
                    to: r.try_get::<Option<i64>, _>(7)?.unwrap_or_default(),
                }),
                _ => None,
            };
            Ok(FenceRecord {
                resource_key: r.try_get(0)?,
                highest_token: r.try_get(1)?,
                updated_at: at(&r, 2)?.unwrap_or_default(),
                last_reset,
            })
        })
        .collect()
}

fn pg_at(r: &sqlx::postgres::PgRow, i: usize) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    r.try_get(i)
}

fn sqlite_at(r: &sqlx::sqlite::SqliteRow, i: usize) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    let ms: Option<i64> = r.try_get(i)?;
    Ok(ms.and_then(DateTime::<Utc>::from_timestamp_millis))
}

impl FenceStore {
    /// A key's fence record, with its latest reset.
    pub async fn get(&self, key: &str) -> Result<Option<FenceRecord>, StoreError> {
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            let pg = (format!("{PG_RECORD} WHERE f.resource_key = $1"), pg_at);
            let sqlite = (
                format!("{SQLITE_RECORD} WHERE f.resource_key = ?1"),
                sqlite_at,
            );
            let found = on_backend!(self, (pg, sqlite), |pool, (sql, at)| {
                records(sqlx::query(&sql).bind(key).fetch_all(pool).await?, at)?
            });
            Ok(found.into_iter().next())
        })
        .await
    }

    /// Up to `limit` records whose key starts with `prefix`, after the key
    /// `after`, in byte order of the keys.
    pub async fn list(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<FenceRecord>, StoreError> {
        let window = Window::new(prefix, after, limit);
        let (pg, sqlite) = Window::sql(PG_RECORD, SQLITE_RECORD, "f.resource_key");
        let items = bounded(self.timeout(), StoreError::Timeout, async {
            let found = on_backend!(
                self,
                ((pg, pg_at), (sqlite, sqlite_at)),
                |pool, (sql, at)| {
                    let query = bind_window!(sqlx::query(&sql), window);
                    records(query.fetch_all(pool).await?, at)?
                }
            );
            Ok(found)
        })
        .await?;
        Ok(Page::of(items, limit, |r| r.resource_key.clone()))
    }

    /// Sets `key`'s highest token to `to` (lower or higher), durably, with
    /// an audit row naming the admin client `by` and the `reason`. Answers
    /// the record after the reset.
    pub async fn reset(
        &self,
        key: &str,
        to: i64,
        by: &str,
        reason: &str,
    ) -> Result<FenceRecord, StoreError> {
        self.check_writer()?;
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            match self {
                FenceStore::Postgres(s) => {
                    let mut tx = s.pool().begin().await?;
                    // Resets commit one at a time, so their ids commit in
                    // order: a watcher that has seen id N has then seen, or
                    // will never see, every id below it (`resets_after`).
                    // Without this, two overlapping resets could commit
                    // out of id order, and a watcher that polled between the
                    // two commits would skip the lower id for good. EXCLUSIVE
                    // blocks only other resets' inserts, never readers; the
                    // table is locked before the key's row, by every reset,
                    // so they cannot deadlock.
                    sqlx::query("LOCK TABLE fence_resets IN EXCLUSIVE MODE")
                        .execute(&mut *tx)
                        .await?;
                    // The key's writers in flight are kept track of
                    // across the reset (migrations/postgres/0012).
                    let from: Option<i64> =
                        sqlx::query_scalar("SELECT from_token FROM fencegate_reset_one($1, $2)")
                            .bind(key)
                            .bind(to)
                            .fetch_one(&mut *tx)
                            .await?;
                    sqlx::query(
                        "INSERT INTO fence_resets (resource_key, by_client, reason, from_token, to_token) \
                         VALUES ($1, $2, $3, $4, $5)",
                    )
                    .bind(key)
                    .bind(by)
                    .bind(reason)
                    .bind(from)
                    .bind(to)
                    .execute(&mut *tx)
                    .await?;
                    tx.commit().await?;
                }
                FenceStore::Sqlite(s) => {
                    let mut tx = s.pool().begin().await?;
                    let from: Option<i64> =
                        sqlx::query_scalar("SELECT highest_token FROM fences WHERE resource_key = ?1")
                            .bind(key)
                            .fetch_optional(&mut *tx)
                            .await?;
                    sqlx::query(concat!(
                        "INSERT INTO fences (resource_key, highest_token, updated_at) VALUES (?1, ?2, ",
                        super::sql::sqlite_now_ms!(),
                        ") ON CONFLICT (resource_key) DO UPDATE \
                            SET highest_token = excluded.highest_token, updated_at = excluded.updated_at"
                    ))
                    .bind(key)
                    .bind(to)
                    .execute(&mut *tx)
                    .await?;
                    sqlx::query(concat!(
                        "INSERT INTO fence_resets (resource_key, at, by_client, reason, from_token, to_token) \
                         VALUES (?1, ",
                        super::sql::sqlite_now_ms!(),
                        ", ?2, ?3, ?4, ?5)"
                    ))
                    .bind(key)
                    .bind(by)
                    .bind(reason)
                    .bind(from)
                    .bind(to)
                    .execute(&mut *tx)
                    .await?;
                    tx.commit().await?;
                }
            }
            Ok(())
        })
        .await?;
        self.get(key)
            .await?
            .ok_or_else(|| StoreError::Other("a reset record vanished".into()))
    }

    /// Up to `limit` lock names (every name a fence was ever issued for)
    /// starting with `prefix`, after the name `after`, in byte order.
    pub async fn list_lock_names(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<String>, StoreError> {
        let window = Window::new(prefix, after, limit);
        let (pg, sqlite) = Window::sql("SELECT name FROM locks", "SELECT name FROM locks", "name");
        let items: Vec<String> = bounded(self.timeout(), StoreError::Timeout, async {
            Ok(on_backend!(self, (pg, sqlite), |pool, sql| {
                bind_window!(sqlx::query_scalar(&sql), window)
                    .fetch_all(pool)
                    .await?
            }))
        })
        .await?;
        Ok(Page::of(items, limit, String::clone))
    }

    /// Resets after the one with id `after`, oldest first, as `(id, key)`:
    /// how an instance learns of resets made through another one. Exact
    /// because resets commit in id order (see `reset`): no reset with a
    /// lower id can commit after one with a higher id was seen.
    pub async fn resets_after(&self, after: i64) -> Result<Vec<(i64, String)>, StoreError> {
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            Ok(on_backend!(
                self,
                (
                    "SELECT id, resource_key FROM fence_resets WHERE id > $1 ORDER BY id LIMIT 1000",
                    "SELECT id, resource_key FROM fence_resets WHERE id > ?1 ORDER BY id LIMIT 1000"
                ),
                |pool, sql| sqlx::query_as(sql).bind(after).fetch_all(pool).await?
            ))
        })
        .await
    }

    /// The id of the latest reset (0 if none): where to start watching.
    pub async fn last_reset_id(&self) -> Result<i64, StoreError> {
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            let sql = "SELECT COALESCE(max(id), 0) FROM fence_resets";
            Ok(on_backend!(self, (sql, sql), |pool, sql| {
                sqlx::query_scalar(sql).fetch_one(pool).await?
            }))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_ends_bound_exactly_the_prefixed_strings() {
        assert_eq!(prefix_end("doc:"), Some("doc;".into()));
        assert_eq!(prefix_end("a\u{D7FF}"), Some("a\u{E000}".into()));
        assert_eq!(prefix_end("a\u{10FFFF}"), Some("b".into()));
        assert_eq!(prefix_end(""), None);
        assert_eq!(prefix_end("\u{10FFFF}"), None);
        for s in ["doc:", "doc:a", "doc:\u{10FFFF}x", "doc:zzz"] {
            assert!(s < prefix_end("doc:").unwrap().as_str(), "{s}");
        }
        assert!("doc;" >= prefix_end("doc:").unwrap().as_str());
    }
}
