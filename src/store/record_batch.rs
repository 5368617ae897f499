//! In single mode (SQLite, or Postgres with one instance) the two writes of
//! a first use — its in-flight record before the forward, its answer after
//! it — are group-committed like fence decisions (`store::batch`): both
//! kinds go into the same batches of records, one batch in flight at a
//! time, one statement (Postgres, [`PG_RECORDS_BATCH`]) or one transaction
//! (SQLite) and one commit per batch, every answer sent only once its
//! batch has committed. (Batches of each kind apart, one of each in
//! flight, cost Postgres more CPU per first use, for the same first uses
//! per second: `bench/profile.sh --keyed`.) A first use whose
//! token the store must decide, on a key with no other write, brings its
//! fence decision into the batch of records with its in-flight record:
//! the decision and the record commit together, and the record is written
//! only if the token is accepted: one commit on one connection per batch
//! period for both of a first use's writes, which costs Postgres less than
//! a fence batch beside a batch of records (bench/analysis.md). Other
//! first uses (the token already the
//! key's durable one, or another write on the key) write their record in
//! a batch of records once admitted. Nothing about the guarantees changes:
//!
//! * **recorded durably before forwarding**: a first use is forwarded only
//!   after its batch committed and reported its record written;
//! * **stored durably before returned**: the answer is returned only after
//!   its batch committed, or after the store failed to say so (then the
//!   record stays in flight and becomes "unknown": never forwarded again);
//! * **a crash between statements**: each batch is one statement (one
//!   transaction), so all of it commits or none; one that Postgres refused
//!   runs as two statements, which each commit whole or not at all (see
//!   [`pg_records_batch`]). A crash after a batch with in-flight records
//!   committed, before their forwards, leaves records of
//!   requests that never left: duplicates
//!   hear "in progress", then "outcome unknown" (the gateway cannot know
//!   nothing was sent), exactly as with a statement of its own;
//! * **a batch that timed out and commits later**: its first uses were told
//!   503 and not forwarded, and forget their records in the background; a
//!   record the late commit writes after that stays in flight, then
//!   unknown — never forwarded twice. A late commit makes the records of
//!   its answers `done` (the answers were true); one that never commits
//!   leaves them to become unknown. Either way nothing is forwarded again;
//! * **two instances**: single mode has one writer, but even two gateways
//!   that both believed they were it would write the same rows: the
//!   primary key still decides which first use is forwarded, and attempts
//!   still keep a late answer out of a newer record.
//!
//! Each part of every batch statement locks its records in primary-key
//! order (an in-flight insert locks a live record it conflicts with), but
//! for the answers' update, which locks each record it completes in the
//! order its plan visits them: sorted by primary key, though Postgres
//! does not promise it (see [`PG_RECORDS_BATCH`]). Fence rows are locked
//! in key order (a
//! batch of records with fence decisions locks them before its in-flight
//! records). Fence batches lock fence rows only, so no fence batch and
//! batch of records can deadlock: their only common rows are fences, which
//! both lock in key order. A batch of records does not order its answers'
//! rows among its in-flight records', so two batches of records can
//! deadlock on records of both (a duplicate of a first use whose answer is
//! being stored, another duplicate pair beside it) — which takes two in
//! flight at once: one batch at a time runs, but one that timed out on our
//! side may still run on the server.
//! Postgres then refuses one of the two after `deadlock_timeout`, with an
//! `ERROR`, and a batch of records so refused runs its parts alone, each
//! in primary-key order, answers first.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use sqlx::{PgConnection, SqliteConnection, SqlitePool};

use super::batch::{max_per_key, Answers, Batcher};
use super::records::*;
use super::StoreError;

/// The text of [`PG_RECORDS_BATCH`] (`decide`) and
/// [`PG_RECORDS_ONLY_BATCH`] (`plain`): one statement, with or without its
/// fence part.
macro_rules! records_batch {
    (plain) => {
        records_batch!(@ "WITH ", "", "")
    };
    (decide) => {
        records_batch!(@ "\
WITH f AS (
    INSERT INTO fences AS f (resource_key, highest_token, updated_at)
    SELECT k, max(t), now() FROM UNNEST($17::text[], $18::bigint[]) AS d(k, t)
     GROUP BY k ORDER BY k
    ON CONFLICT (resource_key) DO UPDATE
        SET highest_token = GREATEST(f.highest_token, EXCLUDED.highest_token),
            updated_at = CASE WHEN f.highest_token < EXCLUDED.highest_token
                              THEN now() ELSE f.updated_at END
    RETURNING f.resource_key, f.highest_token),
",
            "
      LEFT JOIN f ON f.resource_key = b.fk
     WHERE b.fk IS NULL OR f.highest_token = b.ft",
            "
UNION ALL
SELECT 2, resource_key, NULL::text, NULL::text, highest_token FROM f")
    };
    (@ $head:literal, $join:literal, $tail:literal) => {
        concat!(
            $head,
            "w AS (
    INSERT INTO idempotency AS i
           (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt)
    SELECT b.r, b.m, b.k, b.fp, 'in_flight', now() + b.fl * interval '1 millisecond',
           now() + GREATEST(b.fl, b.t) * interval '1 millisecond', b.a
      FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bytea[], $5::bigint[], $6::bigint[],
                  $7::bigint[], $8::text[], $9::bigint[]) AS b(r, m, k, fp, fl, t, a, fk, ft)",
            $join,
            "
     ORDER BY b.r, b.m, b.k
    ON CONFLICT (route, method, idem_key) DO UPDATE
       SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',
           in_flight_until = EXCLUDED.in_flight_until, expires_at = EXCLUDED.expires_at,
           attempt = EXCLUDED.attempt, status = NULL, headers = NULL, body = NULL
     WHERE i.expires_at <= now()
    RETURNING i.route, i.method, i.idem_key, i.attempt),
c AS (
    UPDATE idempotency i SET state = 'done', status = b.s, headers = b.h, body = b.bd
      FROM (SELECT * FROM UNNEST($10::text[], $11::text[], $12::text[], $13::bigint[],
                                 $14::int[], $15::bytea[], $16::bytea[]) AS b(r, m, k, a, s, h, bd)
             ORDER BY r, m, k) b
     WHERE i.route = b.r AND i.method = b.m AND i.idem_key = b.k AND i.attempt = b.a
       AND i.state = 'in_flight'
    RETURNING i.route, i.method, i.idem_key, i.attempt)
SELECT 0, route, method, idem_key, attempt FROM w
UNION ALL
SELECT 1, route, method, idem_key, attempt FROM c",
            $tail
        )
    };
}

/// A batch of records (single mode): fence decisions, in-flight records
/// and answers in one statement, so one transaction and one commit for
/// all three kinds.
///
/// * Fence decisions (`f`): the first uses whose token memory does not
///   know is their key's durable one, one row per key with its highest
///   token asked. Every key's highest token must come back, raised or
///   not, for the records below: the update always runs (to the greater
///   of the two tokens, its time changed only when raised), which also
///   locks the row, so the value returned is the committed one even with
///   another transaction on the key (a plain fence batch, or one of ours
///   that timed out and commits late).
/// * In-flight records (`w`): [`PG_BEGIN`] for many. A record that comes
///   with a decision (its key and token in the last two columns) is
///   written only if its token is accepted, that is, equal to its key's
///   highest token after `f`; the others (those columns `NULL`) are
///   written as they are. Records repeated in the batch are sent once
///   ([`pg_records_batch`]: a statement may not insert and then update
///   one row), and written in primary-key order, which is also the order
///   the live records they conflict with are locked in. `w` reads all of
///   `f` before it writes a row (it sorts its rows first), so fence rows
///   are locked before records, as in every statement that locks both.
///   Only the records written come back.
/// * Answers (`c`): each stored in its attempt's record if that is
///   still in flight. Only the records completed come back. A record that
///   changed after the statement's snapshot (its state, or a newer attempt
///   took it over) is re-read when the update locks it, and dropped by
///   the same join (read committed's re-check). The update locks each row
///   as it writes it, in the order its plan visits the batch's rows: a
///   nested loop over them sorted by primary key, through the key's index.
///   Postgres does not promise that order; a row taken out of it can only
///   make a deadlock, which is handled below. Locking the rows first
///   (`FOR UPDATE` in primary-key order, then an update by `ctid`) cost a
///   WAL record per answer and more Postgres CPU per first use
///   (`bench/ab.sh`, fresh keys), for an order nothing depends on.
///
/// No record id is sent in both `w` and the answers
/// ([`pg_records_batch`]): the parts then touch disjoint rows, and neither
/// needs to see, or lock, what the other writes (the parts of one
/// statement share its snapshot, and Postgres does not say in which order
/// they run). The parts lock their rows in primary-key order each (the
/// answers as their plan does, see above), but the answers' rows are not
/// ordered among the in-flight records': against
/// another batch of records (one that timed out on our side and still
/// runs on the server), a deadlock is possible, and Postgres then refuses
/// one of the two with an `ERROR` (nothing written); if it is this one,
/// [`pg_records_batch`] runs the parts alone. Rows come back marked by
/// their part: 0 a record written, 1 an answer stored (each with the
/// record's id and attempt), 2 a fence decision (its key, and its highest
/// token in the last column).
const PG_RECORDS_BATCH: &str = records_batch!(decide);

/// [`PG_RECORDS_BATCH`] for a batch without fence decisions (`$17` and
/// `$18` not bound, `$8` and `$9` all `NULL`): the same statement without
/// its fence part, which costs Postgres even when it has no rows
/// (`bench/ab.sh`).
const PG_RECORDS_ONLY_BATCH: &str = records_batch!(plain);

/// Answers larger than this (body and encoded headers) are stored by a
/// statement of their own, not in a batch: a batch of records then stays
/// within `batch::MAX_BATCH` times this.
pub(super) const BATCHED_ANSWER_BYTES: usize = 64 * 1024;

/// An in-flight record, owned, as a batch carries it.
pub(super) struct BeginItem {
    pub(super) route: String,
    pub(super) method: String,
    pub(super) key: String,
    pub(super) fingerprint: Vec<u8>,
    pub(super) attempt: i64,
    pub(super) in_flight_ms: i64,
    pub(super) ttl_ms: i64,
}

impl BeginItem {
    pub(super) fn of(b: &Begin<'_>) -> Self {
        Self {
            route: b.id.route.to_string(),
            method: b.id.method.to_string(),
            key: b.id.key.to_string(),
            fingerprint: b.fingerprint.to_vec(),
            attempt: b.attempt,
            in_flight_ms: b.in_flight.as_millis() as i64,
            ttl_ms: b.ttl.as_millis() as i64,
        }
    }

    fn id(&self) -> (&str, &str, &str) {
        (&self.route, &self.method, &self.key)
    }

    fn attempt(&self) -> Written<'_> {
        (&self.route, &self.method, &self.key, self.attempt)
    }
}

/// A record's id and attempt, as a batch statement returns them.
type Written<'a> = (&'a str, &'a str, &'a str, i64);

/// An answer to store, owned, as a batch carries it.
pub(super) struct CompleteItem {
    pub(super) route: String,
    pub(super) method: String,
    pub(super) key: String,
    pub(super) attempt: i64,
    pub(super) status: i32,
    pub(super) headers: Vec<u8>,
    pub(super) body: Bytes,
}

impl CompleteItem {
    fn id(&self) -> (&str, &str, &str) {
        (&self.route, &self.method, &self.key)
    }

    fn attempt(&self) -> Written<'_> {
        (&self.route, &self.method, &self.key, self.attempt)
    }
}

/// A fence decision with the in-flight record of its first use, owned, as
/// a batch carries it.
pub(super) struct DecideItem {
    pub(super) key: String,
    pub(super) token: i64,
    pub(super) begin: BeginItem,
}

/// A write to a record, as single mode's batches of records carry it.
pub(super) enum RecordWrite {
    /// An in-flight record before its forward, its token known to be its
    /// key's durable one; answered whether it was written (false: a live
    /// record of the key exists).
    Begin(BeginItem),
    /// A fence decision on `token` for `key` and, if the token is
    /// accepted, the in-flight record of its first use; answered with the
    /// key's highest token after the batch and whether the record was
    /// written (false: the token was refused, or a live record of the key
    /// exists).
    Decide(DecideItem),
    /// An answer after the forward; answered whether it was stored
    /// (false: the record is no longer this attempt's in flight).
    Complete(CompleteItem),
}

/// What a batch of records answers one write (see [`RecordWrite`]'s
/// variants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Recorded {
    /// The in-flight record was written, or the answer stored.
    pub(super) written: bool,
    /// A decision's key's highest token after the batch; `None` for the
    /// other writes, and for a decision whose key's answer the batch lost.
    pub(super) highest: Option<i64>,
}

/// A first use's decision as the store made it ([`FenceStore::decide_with_record`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decided {
    /// The key's highest token after the batch: equal to the item's token
    /// iff it was accepted.
    pub highest: i64,
    /// The first use's in-flight record was written (false when the token
    /// was refused, or when a live record of the key exists).
    pub written: bool,
}

/// Single mode's group commit of idempotency records: in-flight records
/// (with their fence decisions, where the store must decide) and answers
/// go into the same batches, one statement (Postgres) or one transaction
/// (SQLite) and one commit for all, instead of one batch of each kind in
/// flight at a time.
pub(super) type RecordBatcher = Batcher<RecordWrite, Recorded>;

/// `$query` with one array bound per column, the column `$col` of every row
/// of `$rows` (evaluated once a column): the batch statements `unnest` the
/// arrays back into the batch's rows, one statement for the whole batch.
macro_rules! bind_columns {
    ($query:expr, $rows:expr, $($col:expr),+ $(,)?) => {
        $query$(.bind($rows.map($col).collect::<Vec<_>>()))+
    };
}

/// Which part of a batch of records writes what (the first column of
/// [`PG_RECORDS_BATCH`]'s rows).
const PART_BEGIN: i32 = 0;
const PART_COMPLETE: i32 = 1;
const PART_DECIDE: i32 = 2;

/// A record write's id and attempt, and its part (a batch answers each
/// write by its own part's rows).
fn write_of(w: &RecordWrite) -> (i32, Written<'_>) {
    match w {
        RecordWrite::Begin(b) | RecordWrite::Decide(DecideItem { begin: b, .. }) => {
            (PART_BEGIN, b.attempt())
        }
        RecordWrite::Complete(c) => (PART_COMPLETE, c.attempt()),
    }
}

/// Runs a batch of record writes on Postgres: [`PG_RECORDS_BATCH`], one
/// statement. A record with writes of both kinds in the batch (a
/// duplicate's in-flight record beside the first use's answer) would have
/// both parts change one row, which one statement may not do: then, and
/// when Postgres refused the statement with an `ERROR` (it wrote nothing,
/// see [`PG_RECORDS_BATCH`]), the parts run as statements of their own,
/// each its own commit, as separate batches of each kind would. Answers
/// first: if the second statement fails, the batch fails whole, and a
/// lost answer costs more (its record becomes "outcome unknown") than a
/// lost in-flight record (its first use is answered 503, not forwarded,
/// and may be retried); a stored answer whose batch fails is safe, only
/// not known to its gateway, which then neither remembers nor counts it.
pub(super) async fn pg_records_batch(
    conn: &mut PgConnection,
    items: Vec<RecordWrite>,
) -> Result<Vec<Recorded>, StoreError> {
    let plan = Plan::of(&items);
    let begins = || plan.begins(&items);
    let completes = || {
        items.iter().filter_map(|w| match w {
            RecordWrite::Complete(c) => Some(c),
            _ => None,
        })
    };
    let decisions = || plan.wanted.iter().map(|(k, t)| (*k, *t));
    let together = !completes().any(|c| plan.begun.contains(&c.id()));
    let rows = match together {
        true => match pg_records_statement(conn, begins(), completes(), decisions()).await {
            Ok(rows) => Some(rows),
            Err(e) if super::sql::rolled_back(&e) => None,
            Err(e) => return Err(e.into()),
        },
        false => None,
    };
    let rows = match rows {
        Some(rows) => rows,
        None => {
            use std::iter::empty;
            let mut rows = Vec::new();
            if completes().next().is_some() {
                rows = pg_records_statement(conn, empty(), completes(), empty()).await?;
            }
            if begins().next().is_some() || !plan.wanted.is_empty() {
                rows.extend(pg_records_statement(conn, begins(), empty(), decisions()).await?);
            }
            rows
        }
    };
    let mut highest = Answers::with_capacity(plan.wanted.len());
    let mut written = Vec::with_capacity(rows.len());
    for (part, r, m, k, a) in &rows {
        match (*part, m, k) {
            (PART_DECIDE, None, None) => {
                highest.insert(r.clone(), *a);
            }
            (PART_BEGIN | PART_COMPLETE, Some(m), Some(k)) => {
                written.push((*part, (r.as_str(), m.as_str(), k.as_str(), *a)))
            }
            _ => return Err(StoreError::Other("a batch answered a malformed row".into())),
        }
    }
    let written = answered(&items, &plan.sent, written, write_of);
    Ok(recorded(&items, written, &highest))
}

/// What a batch of records sends of its items.
struct Plan<'a> {
    /// Per item: whether its write goes into the statement (see
    /// [`Plan::of`]).
    sent: Vec<bool>,
    /// The records of the in-flight records sent.
    begun: HashSet<(&'a str, &'a str, &'a str)>,
    /// The highest token asked per key by the batch's decisions.
    wanted: HashMap<&'a str, i64>,
}

impl<'a> Plan<'a> {
    /// Answers go in, each: answers for one record may share a batch (a
    /// stalled attempt's and the newer one's), and each is judged by its
    /// own attempt. Of the in-flight records, a record repeated in the
    /// batch (concurrent duplicates) goes in once, with its first item —
    /// whether that writes the record or finds a live one, the others are
    /// duplicates — and a decision's record goes in only with the highest
    /// token asked for its key (a lower one is refused, whatever the store
    /// holds). The others of that key and token share its fate: refused
    /// with it, or duplicates of it.
    fn of(items: &'a [RecordWrite]) -> Self {
        let wanted = max_per_key(items.iter().filter_map(|w| match w {
            RecordWrite::Decide(d) => Some((d.key.as_str(), d.token)),
            _ => None,
        }));
        let mut begun = HashSet::with_capacity(items.len());
        let sent = items
            .iter()
            .map(|w| match w {
                RecordWrite::Begin(b) => begun.insert(b.id()),
                RecordWrite::Decide(d) => {
                    wanted.get(d.key.as_str()) == Some(&d.token) && begun.insert(d.begin.id())
                }
                RecordWrite::Complete(_) => true,
            })
            .collect();
        Self {
            sent,
            begun,
            wanted,
        }
    }

    /// The in-flight records sent, each with its decision's key and token
    /// if it has one.
    fn begins(
        &self,
        items: &'a [RecordWrite],
    ) -> impl Iterator<Item = (&'a BeginItem, Option<(&'a str, i64)>)> + Clone + '_ {
        items
            .iter()
            .zip(&self.sent)
            .filter_map(|(w, sent)| match w {
                RecordWrite::Begin(b) if *sent => Some((b, None)),
                RecordWrite::Decide(d) if *sent => {
                    Some((&d.begin, Some((d.key.as_str(), d.token))))
                }
                _ => None,
            })
    }
}

/// Each item's answer of a batch of records: `written` by item, and for a
/// decision its key's highest token from `highest`.
fn recorded(items: &[RecordWrite], written: Vec<bool>, highest: &Answers) -> Vec<Recorded> {
    items
        .iter()
        .zip(written)
        .map(|(w, written)| Recorded {
            written,
            highest: match w {
                RecordWrite::Decide(d) => highest.get(&d.key).copied(),
                _ => None,
            },
        })
        .collect()
}

/// [`PG_RECORDS_BATCH`] with these in-flight records (each with its
/// decision's key and token, if it has one), answers and decisions (any
/// may be none; [`PG_RECORDS_ONLY_BATCH`] without decisions); the rows
/// written, stored and decided, each marked with its part.
async fn pg_records_statement<'a>(
    conn: &mut PgConnection,
    begins: impl Iterator<Item = (&'a BeginItem, Option<(&'a str, i64)>)> + Clone,
    completes: impl Iterator<Item = &'a CompleteItem> + Clone,
    decisions: impl Iterator<Item = (&'a str, i64)> + Clone,
) -> Result<Vec<(i32, String, Option<String>, Option<String>, i64)>, sqlx::Error> {
    let decide = decisions.clone().next().is_some();
    let sql = if decide {
        PG_RECORDS_BATCH
    } else {
        PG_RECORDS_ONLY_BATCH
    };
    let q = bind_columns!(
        sqlx::query_as(sql),
        begins.clone(),
        |(i, _)| i.route.as_str(),
        |(i, _)| i.method.as_str(),
        |(i, _)| i.key.as_str(),
        |(i, _)| i.fingerprint.as_slice(),
        |(i, _)| i.in_flight_ms,
        |(i, _)| i.ttl_ms,
        |(i, _)| i.attempt,
        |(_, d)| d.map(|(k, _)| k),
        |(_, d)| d.map(|(_, t)| t),
    );
    let q = bind_columns!(
        q,
        completes.clone(),
        |i| i.route.as_str(),
        |i| i.method.as_str(),
        |i| i.key.as_str(),
        |i| i.attempt,
        |i| i.status,
        |i| i.headers.as_slice(),
        |i| &i.body[..],
    );
    let q = match decide {
        true => bind_columns!(q, decisions.clone(), |(k, _)| k, |(_, t)| t),
        false => q,
    };
    q.fetch_all(conn).await
}

/// Writes one in-flight record within a SQLite transaction; whether it
/// was written (false: a live record of the key exists).
pub(super) async fn sqlite_begin_in(
    conn: &mut SqliteConnection,
    i: &BeginItem,
) -> Result<bool, StoreError> {
    let rows: Vec<(i32,)> = sqlx::query_as(SQLITE_BEGIN)
        .bind(&i.route)
        .bind(&i.method)
        .bind(&i.key)
        .bind(&i.fingerprint)
        .bind(i.in_flight_ms)
        .bind(i.ttl_ms)
        .bind(i.attempt)
        .fetch_all(conn)
        .await?;
    Ok(!rows.is_empty())
}

/// Which items' records came back from a batch statement: those whose
/// item went into it (`sent`) and whose row, as `written` names it (id
/// and attempt, and in a batch of records the part), is among the rows
/// returned.
fn answered<'a, T, R: Eq + std::hash::Hash>(
    items: &'a [T],
    sent: &[bool],
    rows: impl IntoIterator<Item = R>,
    written: impl Fn(&'a T) -> R,
) -> Vec<bool> {
    let rows: HashSet<R> = rows.into_iter().collect();
    items
        .iter()
        .zip(sent)
        .map(|(i, sent)| *sent && rows.contains(&written(i)))
        .collect()
}

/// Runs a batch of record writes on SQLite: one transaction, the
/// decisions first (one statement per key, with its highest token asked),
/// then one statement per write, in the batch's order — as if each ran
/// alone in that order after the decisions. Which writes go in is what
/// [`Plan::of`] says, as on Postgres: a repeat of a record among the
/// in-flight records is not sent (it would find the record its first item
/// wrote, or was refused with, and not be written either).
pub(super) async fn sqlite_records_batch(
    pool: &SqlitePool,
    items: Vec<RecordWrite>,
) -> Result<Vec<Recorded>, StoreError> {
    let plan = Plan::of(&items);
    let mut tx = pool.begin().await?;
    let mut highest = Answers::with_capacity(plan.wanted.len());
    for (&key, &token) in &plan.wanted {
        highest.insert(
            key.to_string(),
            super::sql::decide_in(&mut tx, key, token).await?,
        );
    }
    let mut written = Vec::with_capacity(items.len());
    for (w, sent) in items.iter().zip(&plan.sent) {
        let done = match w {
            RecordWrite::Begin(i) => *sent && sqlite_begin_in(&mut tx, i).await?,
            RecordWrite::Decide(d) => {
                let accepted = highest.get(&d.key) == Some(&d.token);
                *sent && accepted && sqlite_begin_in(&mut tx, &d.begin).await?
            }
            RecordWrite::Complete(i) => {
                let done = sqlx::query(SQLITE_COMPLETE)
                    .bind(&i.route)
                    .bind(&i.method)
                    .bind(&i.key)
                    .bind(i.attempt)
                    .bind(i.status)
                    .bind(&i.headers)
                    .bind(&i.body[..])
                    .fetch_all(&mut *tx)
                    .await?;
                !done.is_empty()
            }
        };
        written.push(done);
    }
    tx.commit().await?;
    Ok(recorded(&items, written, &highest))
}
