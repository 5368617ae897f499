//! Idempotency-Key records in the fence store (see `idempotency` for what
//! they mean). Every judgement of time — whether a record expired, whether
//! an in-flight record's gateway ran out of time — is the database's clock,
//! so all instances of a shared store agree.
//!
//! Two rules keep a request from being forwarded twice under one key:
//!
//! * a record never expires before its `in_flight_until` (its expiry is the
//!   later of the TTL and that instant), so a key whose first request may
//!   still be at the upstream is never taken for a new first use, however
//!   short `idempotency_ttl_s` is;
//! * every change a gateway makes to its own in-flight record (the answer,
//!   "unknown", forgetting it) matches the record's `attempt`, a random
//!   number it wrote with it. A gateway that stalled past its record's time
//!   (after which a duplicate may have taken an expired record over) finds
//!   its attempt gone and changes nothing.
//!
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
//! Shared mode writes its in-flight records with the fence decision
//! (`fencegate_enter_keyed`) and stores answers one statement each: there
//! every write already has its own statement.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bytes::Bytes;
use sqlx::{PgConnection, SqliteConnection, SqlitePool};

use super::batch::{max_per_key, Answers, Batcher};
use super::sql::{on_backend, sqlite_now_ms};
use super::{bounded, FenceStore, StoreError};

/// Which record: a route, a method, a client's key.
#[derive(Debug, Clone, Copy)]
pub struct RecordId<'a> {
    pub route: &'a str,
    pub method: &'a str,
    pub key: &'a str,
}

/// An upstream answer as stored, and as replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAnswer {
    pub status: u16,
    /// Header names and values, hop-by-hop ones removed (stored as JSON).
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
}

/// What the store holds for a key (expired records are absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Absent,
    /// The same key with another request's fingerprint.
    Reused,
    /// The first request is still being forwarded, for up to this long.
    InFlight {
        for_ms: u64,
    },
    /// The first request may have reached the upstream, but no answer was
    /// stored (or its gateway ran out of time).
    Unknown,
    Done(StoredAnswer),
}

/// A record as read: what it says, and how long it lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub found: Found,
    /// From the statement's start on the store's clock until the record
    /// expires (zero when absent).
    pub expires_in: Duration,
    /// The record's attempt (none when absent): whether it is the record of
    /// a request its gateway never sent and is forgetting
    /// (`idempotency::Forgets`), whatever it says.
    pub attempt: Option<i64>,
}

/// The in-flight record a first use writes before it is forwarded.
#[derive(Debug, Clone, Copy)]
pub struct Begin<'a> {
    pub id: RecordId<'a>,
    pub fingerprint: &'a [u8],
    /// A random number identifying this attempt (see the module docs).
    pub attempt: i64,
    /// The record's time in flight: the latest its gateway may still store
    /// the answer, from when the record is written.
    pub in_flight: std::time::Duration,
    /// `idempotency_ttl_s`, from when the record is written; the record
    /// lives at least as long as it is in flight.
    pub ttl: std::time::Duration,
}

const PG_LOOKUP: &str = "\
SELECT fingerprint, state, in_flight_until > now(),
       GREATEST(0, EXTRACT(EPOCH FROM (in_flight_until - now())) * 1000)::bigint,
       GREATEST(0, EXTRACT(EPOCH FROM (expires_at - now())) * 1000)::bigint,
       status, headers, body, attempt
  FROM idempotency
 WHERE route = $1 AND method = $2 AND idem_key = $3 AND expires_at > now()";

#[rustfmt::skip]
const SQLITE_LOOKUP: &str = concat!("\
SELECT fingerprint, state, in_flight_until > ", sqlite_now_ms!(), ",
       MAX(0, in_flight_until - ", sqlite_now_ms!(), "),
       MAX(0, expires_at - ", sqlite_now_ms!(), "),
       status, headers, body, attempt
  FROM idempotency
 WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND expires_at > ", sqlite_now_ms!());

/// Writes a new in-flight record, or takes over an expired one; a live
/// record of the same key (a concurrent duplicate won) is left alone and no
/// row comes back. It expires at the later of its TTL and its time in
/// flight. (Shared mode writes it in `fencegate_enter_keyed` instead, with
/// the fence's in-flight marker: migrations/postgres/0009.)
const PG_BEGIN: &str = "\
INSERT INTO idempotency AS i
       (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt)
VALUES ($1, $2, $3, $4, 'in_flight', now() + $5 * interval '1 millisecond',
        now() + GREATEST($5, $6) * interval '1 millisecond', $7)
ON CONFLICT (route, method, idem_key) DO UPDATE
   SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',
       in_flight_until = EXCLUDED.in_flight_until, expires_at = EXCLUDED.expires_at,
       attempt = EXCLUDED.attempt, status = NULL, headers = NULL, body = NULL
 WHERE i.expires_at <= now()
RETURNING 1";

#[rustfmt::skip]
const SQLITE_BEGIN: &str = concat!("\
INSERT INTO idempotency
       (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt)
VALUES (?1, ?2, ?3, ?4, 'in_flight', ", sqlite_now_ms!(), " + ?5, ", sqlite_now_ms!(), " + MAX(?5, ?6), ?7)
ON CONFLICT (route, method, idem_key) DO UPDATE
   SET fingerprint = excluded.fingerprint, state = 'in_flight',
       in_flight_until = excluded.in_flight_until, expires_at = excluded.expires_at,
       attempt = excluded.attempt, status = NULL, headers = NULL, body = NULL
 WHERE idempotency.expires_at <= ", sqlite_now_ms!(), "
RETURNING 1");

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
const BATCHED_ANSWER_BYTES: usize = 64 * 1024;

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
    route: String,
    method: String,
    key: String,
    attempt: i64,
    status: i32,
    headers: Vec<u8>,
    body: Bytes,
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
    key: String,
    token: i64,
    begin: BeginItem,
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
    written: bool,
    /// A decision's key's highest token after the batch; `None` for the
    /// other writes, and for a decision whose key's answer the batch lost.
    highest: Option<i64>,
}

/// A first use's decision as the store made it ([`FenceStore::record_keyed`]).
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

const PG_COMPLETE: &str = "\
UPDATE idempotency SET state = 'done', status = $5, headers = $6, body = $7
 WHERE route = $1 AND method = $2 AND idem_key = $3 AND attempt = $4 AND state = 'in_flight'";

const SQLITE_COMPLETE: &str = "\
UPDATE idempotency SET state = 'done', status = ?5, headers = ?6, body = ?7
 WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND attempt = ?4 AND state = 'in_flight'
RETURNING 1";

/// Rows deleted per purge statement: small, so no purge holds locks long.
pub const PURGE_BATCH: i64 = 500;

/// One purge batch on Postgres, one short transaction: expired rows are
/// locked `SKIP LOCKED`, so instances purging at the same time take
/// disjoint batches instead of queueing behind each other, and a row that a
/// request is taking over at that moment is left to it (it will not be
/// expired once that commits). The rows stay locked from the sub-select to
/// the delete, so their `ctid`s cannot change in between.
const PG_PURGE: &str = "\
DELETE FROM idempotency WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency WHERE expires_at <= now()
     LIMIT $1 FOR UPDATE SKIP LOCKED))";

/// SQLite has one writer (this instance), so a batch only competes with
/// this instance's own writes: it holds the write lock for at most
/// [`PURGE_BATCH`] rows.
#[rustfmt::skip]
const SQLITE_PURGE: &str = concat!("\
DELETE FROM idempotency WHERE rowid IN (
    SELECT rowid FROM idempotency WHERE expires_at <= ", sqlite_now_ms!(), " LIMIT ?1)");

type Row = (
    Vec<u8>,
    String,
    bool,
    i64,
    i64,
    Option<i32>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    i64,
);

impl FenceStore {
    /// The record of `id`, judged against the request's `fingerprint`.
    pub async fn idem_lookup(
        &self,
        id: RecordId<'_>,
        fingerprint: &[u8],
    ) -> Result<Found, StoreError> {
        Ok(self.idem_read(id, fingerprint).await?.found)
    }

    /// [`FenceStore::idem_lookup`], with how long the record lives.
    pub async fn idem_read(
        &self,
        id: RecordId<'_>,
        fingerprint: &[u8],
    ) -> Result<Read, StoreError> {
        let timeout = self.timeout();
        let row: Option<Row> = bounded(timeout, StoreError::Timeout, async {
            Ok(on_backend!(
                self,
                (PG_LOOKUP, SQLITE_LOOKUP),
                |pool, sql| {
                    sqlx::query_as(sql)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .fetch_optional(pool)
                        .await?
                }
            ))
        })
        .await?;
        let Some((fp, state, live, left_ms, expires_ms, status, headers, body, attempt)) = row
        else {
            return Ok(Read {
                found: Found::Absent,
                expires_in: Duration::ZERO,
                attempt: None,
            });
        };
        let expires_in = Duration::from_millis(expires_ms.max(0) as u64);
        let attempt = Some(attempt);
        if fp != fingerprint {
            return Ok(Read {
                found: Found::Reused,
                expires_in,
                attempt,
            });
        }
        let found = match state.as_str() {
            "in_flight" if live => Found::InFlight {
                for_ms: left_ms.max(0) as u64,
            },
            "done" => {
                let headers =
                    serde_json::from_slice(headers.as_deref().unwrap_or(b"[]")).map_err(|e| {
                        StoreError::Other(format!("a stored answer's headers do not decode: {e}"))
                    })?;
                Found::Done(StoredAnswer {
                    status: status.unwrap_or(500) as u16,
                    headers,
                    body: Bytes::from(body.unwrap_or_default()),
                })
            }
            // 'unknown', or in flight past its gateway's time.
            _ => Found::Unknown,
        };
        Ok(Read {
            found,
            expires_in,
            attempt,
        })
    }

    /// Single mode's batcher of idempotency records.
    fn record_batcher(&self) -> Option<&RecordBatcher> {
        match self {
            FenceStore::Postgres(s) => s.record_batcher(),
            FenceStore::Sqlite(s) => Some(s.record_batcher()),
        }
    }

    /// A batcher's error, explained by what the store's connections learned
    /// (see `PgStore::explain`).
    fn explain(&self, e: StoreError) -> StoreError {
        match self {
            FenceStore::Postgres(s) => s.explain(e),
            FenceStore::Sqlite(_) => e,
        }
    }

    /// Single mode: [`FenceStore::record`] for the first use of an
    /// `Idempotency-Key`, with its in-flight record, in a batch of records:
    /// one transaction and commit for the decision and the record, which
    /// is written only if the token is accepted. `written` is false when
    /// the token was refused or a live record of the key exists (a
    /// concurrent duplicate got there first): the caller must not forward.
    /// Both answers are durable.
    pub async fn record_keyed(
        &self,
        key: &str,
        token: i64,
        record: &Begin<'_>,
    ) -> Result<Decided, StoreError> {
        self.check_writer()?;
        let Some(b) = self.record_batcher() else {
            return Err(StoreError::Other(
                "record_keyed is for single mode; shared mode decides in enter".into(),
            ));
        };
        let item = DecideItem {
            key: key.to_string(),
            token,
            begin: BeginItem::of(record),
        };
        let done = b
            .submit(RecordWrite::Decide(item))
            .await
            .map_err(|e| self.explain(e))?;
        let highest = done
            .highest
            .ok_or_else(|| StoreError::Other("a batch lost a key's answer".into()))?;
        Ok(Decided {
            highest,
            written: done.written,
        })
    }

    /// Writes the in-flight record of `begin` before its request is
    /// forwarded (group-committed in single mode: see the module docs).
    /// False when a live record exists already (a concurrent duplicate got
    /// there first): the caller must not forward. True only once the
    /// record is durable.
    pub async fn idem_begin(&self, begin: &Begin<'_>) -> Result<bool, StoreError> {
        self.check_writer()?;
        if let Some(b) = self.record_batcher() {
            return b
                .submit(RecordWrite::Begin(BeginItem::of(begin)))
                .await
                .map(|r| r.written)
                .map_err(|e| self.explain(e));
        }
        let timeout = self.timeout();
        let in_flight_ms = begin.in_flight.as_millis() as i64;
        let ttl_ms = begin.ttl.as_millis() as i64;
        let id = begin.id;
        bounded(timeout, StoreError::Timeout, async {
            let rows: Vec<(i32,)> = on_backend!(self, (PG_BEGIN, SQLITE_BEGIN), |pool, sql| {
                sqlx::query_as(sql)
                    .bind(id.route)
                    .bind(id.method)
                    .bind(id.key)
                    .bind(begin.fingerprint)
                    .bind(in_flight_ms)
                    .bind(ttl_ms)
                    .bind(begin.attempt)
                    .fetch_all(pool)
                    .await?
            });
            Ok(!rows.is_empty())
        })
        .await
    }

    /// Stores the upstream's answer in `attempt`'s record: from now on
    /// duplicates replay it (group-committed in single mode, but for large
    /// answers: see the module docs). True once the answer is durable in
    /// the record; false when the record is no longer `attempt`'s in
    /// flight (this gateway stalled past its time), and nothing changed.
    pub async fn idem_complete(
        &self,
        id: RecordId<'_>,
        attempt: i64,
        answer: &StoredAnswer,
    ) -> Result<bool, StoreError> {
        let headers = serde_json::to_vec(&answer.headers)
            .map_err(|e| StoreError::Other(format!("cannot encode an answer's headers: {e}")))?;
        if let Some(b) = self.record_batcher() {
            if headers.len() + answer.body.len() <= BATCHED_ANSWER_BYTES {
                self.check_writer()?;
                let item = CompleteItem {
                    route: id.route.to_string(),
                    method: id.method.to_string(),
                    key: id.key.to_string(),
                    attempt,
                    status: answer.status as i32,
                    headers,
                    body: answer.body.clone(),
                };
                return b
                    .submit(RecordWrite::Complete(item))
                    .await
                    .map(|r| r.written)
                    .map_err(|e| self.explain(e));
            }
        }
        let changed = self
            .idem_set(
                id,
                attempt,
                PG_COMPLETE,
                SQLITE_COMPLETE,
                Some((answer.status as i32, headers, answer.body.clone())),
            )
            .await?;
        Ok(changed > 0)
    }

    /// The request may have reached the upstream, but no answer is stored:
    /// duplicates are told so, and never forwarded.
    pub async fn idem_unknown(&self, id: RecordId<'_>, attempt: i64) -> Result<(), StoreError> {
        self.idem_set(
            id,
            attempt,
            "UPDATE idempotency SET state = 'unknown' \
             WHERE route = $1 AND method = $2 AND idem_key = $3 AND attempt = $4 \
               AND state = 'in_flight'",
            "UPDATE idempotency SET state = 'unknown' \
             WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND attempt = ?4 \
               AND state = 'in_flight' RETURNING 1",
            None,
        )
        .await
        .map(drop)
    }

    /// Nothing of the request was sent: the key may be used again.
    pub async fn idem_forget(&self, id: RecordId<'_>, attempt: i64) -> Result<(), StoreError> {
        self.idem_set(
            id,
            attempt,
            "DELETE FROM idempotency \
             WHERE route = $1 AND method = $2 AND idem_key = $3 AND attempt = $4 \
               AND state = 'in_flight'",
            "DELETE FROM idempotency \
             WHERE route = ?1 AND method = ?2 AND idem_key = ?3 AND attempt = ?4 \
               AND state = 'in_flight' RETURNING 1",
            None,
        )
        .await
        .map(drop)
    }

    /// One statement on `attempt`'s record of `id`; answers the rows it
    /// changed (the SQLite statement returns one row per row changed).
    async fn idem_set(
        &self,
        id: RecordId<'_>,
        attempt: i64,
        pg: &'static str,
        sqlite: &'static str,
        answer: Option<(i32, Vec<u8>, Bytes)>,
    ) -> Result<u64, StoreError> {
        self.check_writer()?;
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            Ok(on_backend!(
                self,
                ((pg, false), (sqlite, true)),
                |pool, (sql, lite)| {
                    let mut q = sqlx::query(sql)
                        .bind(id.route)
                        .bind(id.method)
                        .bind(id.key)
                        .bind(attempt);
                    if let Some((status, headers, body)) = answer {
                        q = q.bind(status).bind(headers).bind(body.to_vec());
                    }
                    if lite {
                        // fetch_all: see the module docs of `store::sqlite`.
                        q.fetch_all(pool).await?.len() as u64
                    } else {
                        q.execute(pool).await?.rows_affected()
                    }
                }
            ))
        })
        .await
    }

    /// Deletes up to [`PURGE_BATCH`] expired records; answers how many.
    pub async fn idem_purge(&self) -> Result<u64, StoreError> {
        // Single mode on Postgres without the single-writer lock (a
        // failover): another instance may be the writer now.
        self.check_writer()?;
        let timeout = self.timeout();
        bounded(timeout, StoreError::Timeout, async {
            Ok(match self {
                FenceStore::Postgres(s) => sqlx::query(PG_PURGE)
                    .bind(PURGE_BATCH)
                    .execute(s.pool())
                    .await?
                    .rows_affected(),
                FenceStore::Sqlite(s) => sqlx::query(SQLITE_PURGE)
                    .bind(PURGE_BATCH)
                    .execute(s.pool())
                    .await?
                    .rows_affected(),
            })
        })
        .await
    }
}
