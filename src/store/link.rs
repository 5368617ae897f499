//! Postgres connections a batcher keeps for itself, outside any pool.
//!
//! A single-mode batcher runs one batch at a time (see `batch`),
//! one statement each, back to back, so it needs one connection, always
//! busy. Through sqlx's pool each batch paid for two things it does not
//! need: the hand-off (a semaphore, a queue, and often another backend
//! than the last batch's, whose caches are cold), and the ping sqlx sends
//! whenever a connection is given back (a `Sync` and its `ReadyForQuery`),
//! which wakes a Postgres backend a second time per batch, on the two cores
//! Postgres needs for its commits. A [`Links`] hands its connections out
//! and takes them back with neither.
//!
//! The pool's checks still hold, as a connection comes from the pool:
//! - a batcher's connection is taken from the pool once and detached
//!   from it (`checked_pool`: its server was asked whether it takes
//!   writes when it was opened, with the pool's retries until its acquire
//!   timeout, and one idle for `PING_AFTER_IDLE` was pinged); the pool may
//!   then open another in its place;
//! - one idle here for `PING_AFTER_IDLE` is pinged before it is used
//!   again: that is where a connection broken by a restart or failover
//!   hides;
//! - one kept for the pool's `max_lifetime` is replaced;
//! - one whose batch failed, or whose batch was abandoned mid-statement
//!   (the batcher's timeout drops the batch's future), is closed, never
//!   used again: its session's state is unknown. sqlx's release ping is
//!   how the pool found such connections; here a connection goes back only
//!   when its batch said it is fine ([`Link::keep`]).
//!
//! Taking a connection from the pool waits behind the pool's other users
//! (reads, the lock API) when all of `pool_size` are busy; it happens only
//! when a batcher has no connection (the first batch, and after one was
//! closed), never per batch.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};

/// A pooled connection idle this long is pinged before it is used again
/// (see `postgres::checked_pool`): long enough that connections in steady use are
/// never pinged, short enough that one a restart or failover broke while
/// the gateway was quiet is found out before a write meets it.
pub(super) const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Connections to one server for one batcher: at most as many as it has
/// batches in flight, since each batch takes one and gives it back.
pub struct Links {
    /// Where new connections come from, checked (see the module docs).
    pool: PgPool,
    /// How long a connection is kept before it is replaced: the pool's
    /// `max_lifetime`, counted from when a batcher took it.
    max_lifetime: Option<Duration>,
    /// Connections not in a batch. A std mutex: it is held only to push or
    /// pop, never across an await.
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    conn: PgConnection,
    taken: Instant,
    since: Instant,
}

/// A connection taken for one batch. Dropped without [`Link::keep`] (the
/// batch failed, or was abandoned mid-statement), it is closed.
pub struct Link<'a> {
    links: &'a Links,
    conn: PgConnection,
    taken: Instant,
}

impl Links {
    pub fn new(pool: PgPool) -> Self {
        Self {
            max_lifetime: pool.options().get_max_lifetime(),
            pool,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A connection for one batch: an idle one (pinged if it idled for
    /// `PING_AFTER_IDLE`), or one detached from the pool. Past the pool's
    /// acquire timeout, `PoolTimedOut`, which the store explains with what
    /// its view of the server saw.
    pub async fn take(&self) -> Result<Link<'_>, sqlx::Error> {
        while let Some(mut idle) = self.pop() {
            if self
                .max_lifetime
                .is_some_and(|max| idle.taken.elapsed() >= max)
            {
                let _ = idle.conn.close().await;
                continue;
            }
            if idle.since.elapsed() >= PING_AFTER_IDLE && idle.conn.ping().await.is_err() {
                // Broken while idle: not worth a graceful close.
                continue;
            }
            return Ok(self.link(idle.conn, idle.taken));
        }
        let conn = self.pool.acquire().await?.detach();
        Ok(self.link(conn, Instant::now()))
    }

    /// Closes the idle connections. One in a batch when this runs is given
    /// back when its batch ends and dropped with the batcher.
    pub async fn close(&self) {
        while let Some(idle) = self.pop() {
            let _ = idle.conn.close().await;
        }
    }

    fn pop(&self) -> Option<Idle> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    fn link(&self, conn: PgConnection, taken: Instant) -> Link<'_> {
        Link {
            links: self,
            conn,
            taken,
        }
    }
}

impl Link<'_> {
    /// Gives the connection back for the next batch: only after a batch
    /// that succeeded, so its session is in a known state.
    pub fn keep(self) {
        let now = Instant::now();
        self.links
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Idle {
                conn: self.conn,
                taken: self.taken,
                since: now,
            });
    }
}

impl Deref for Link<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for Link<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}
