//! Postgres connections a batcher keeps for itself, outside any pool.
//!
//! A single-mode batcher runs one batch at a time (`BATCHES_IN_FLIGHT`),
//! one statement each, back to back, so it needs one connection, always
//! busy. Through sqlx's pool each batch paid for two things it does not
//! need: the hand-off (a semaphore, a queue, and often another backend
//! than the last batch's, whose caches are cold), and the ping sqlx sends
//! whenever a connection is given back (a `Sync` and its `ReadyForQuery`),
//! which wakes a Postgres backend a second time per batch, on the two cores
//! Postgres needs for its commits. A [`Links`] hands its connections out
//! and takes them back with neither.
//!
//! What the pool's checks were for still holds:
//! - a new connection is asked whether its server takes writes before a
//!   batch uses it (as `checked_pool`'s are), and refused if not;
//! - one idle for `PING_AFTER_IDLE` is pinged before it is used again:
//!   that is where a connection broken by a restart or failover hides;
//! - one whose batch failed, or whose batch was abandoned mid-statement
//!   (the batcher's timeout drops the batch's future), is closed, never
//!   used again: its session's state is unknown. sqlx's release ping is
//!   how the pool found such connections; here a connection goes back only
//!   when its batch said it is fine ([`Link::keep`]).

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use super::postgres::{writable, ServerView, PING_AFTER_IDLE};

/// How long a connection is kept before it is replaced (sqlx's pool's
/// default `max_lifetime`): a backend's caches grow with its age, and a
/// connection that lives forever never sees a changed server setting.
const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// Connections to one server for one batcher: at most as many as it has
/// batches in flight, since each batch takes one and gives it back.
pub struct Links {
    opts: PgConnectOptions,
    /// Told what each new connection found about writability, as the
    /// pool's connections tell it.
    view: Arc<ServerView>,
    /// Bound on opening a connection, retries included (the store's
    /// timeout, as the pool's acquire timeout is).
    timeout: Duration,
    /// Connections not in a batch. A std mutex: it is held only to push or
    /// pop, never across an await.
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    conn: PgConnection,
    opened: Instant,
    since: Instant,
}

/// A connection taken for one batch. Dropped without [`Link::keep`] (the
/// batch failed, or was abandoned mid-statement), it is closed.
pub struct Link<'a> {
    links: &'a Links,
    conn: PgConnection,
    opened: Instant,
}

impl Links {
    pub fn new(opts: PgConnectOptions, view: Arc<ServerView>, timeout: Duration) -> Self {
        Self {
            opts,
            view,
            timeout,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A connection for one batch: an idle one (pinged if it idled for
    /// `PING_AFTER_IDLE`), or a new one checked for writability.
    pub async fn take(&self) -> Result<Link<'_>, sqlx::Error> {
        loop {
            let Some(mut idle) = self.pop() else { break };
            if idle.opened.elapsed() >= MAX_LIFETIME {
                let _ = idle.conn.close().await;
                continue;
            }
            if idle.since.elapsed() >= PING_AFTER_IDLE && idle.conn.ping().await.is_err() {
                // Broken while idle: not worth a graceful close.
                continue;
            }
            return Ok(self.link(idle.conn, idle.opened));
        }
        let conn = self.open().await?;
        Ok(self.link(conn, Instant::now()))
    }

    /// Closes the idle connections (a batch still running closes its own
    /// when it ends, as nothing takes it back after a shutdown's drain).
    pub async fn close(&self) {
        while let Some(idle) = self.pop() {
            let _ = idle.conn.close().await;
        }
    }

    fn pop(&self) -> Option<Idle> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    fn link(&self, conn: PgConnection, opened: Instant) -> Link<'_> {
        Link {
            links: self,
            conn,
            opened,
        }
    }

    /// Opens a connection to a writable server, retrying as sqlx's pool
    /// does (a refused connection, a transient error, a server that takes
    /// no writes) with a growing pause, until the timeout; past it,
    /// `PoolTimedOut`, which the store explains with what the view saw.
    async fn open(&self) -> Result<PgConnection, sqlx::Error> {
        let until = Instant::now() + self.timeout;
        let mut pause = Duration::from_millis(10);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.connect()).await {
                Err(_) => return Err(sqlx::Error::PoolTimedOut),
                Ok(Ok(Some(conn))) => return Ok(conn),
                // Read-only: the view says so; a failover may be on its way.
                Ok(Ok(None)) => {}
                Ok(Err(sqlx::Error::Io(e)))
                    if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                Ok(Err(sqlx::Error::Database(e))) if e.is_transient_in_connect_phase() => {}
                Ok(Err(e)) => return Err(e),
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(sqlx::Error::PoolTimedOut);
            }
            tokio::time::sleep(pause.min(left)).await;
            pause = (pause * 2).min(self.timeout / 5);
        }
    }

    /// One connection attempt; `None` if the server takes no writes.
    async fn connect(&self) -> Result<Option<PgConnection>, sqlx::Error> {
        let mut conn = PgConnection::connect_with(&self.opts).await?;
        let answer = writable(&mut conn).await?;
        self.view.saw(answer.err());
        if answer.is_ok() {
            return Ok(Some(conn));
        }
        let _ = conn.close().await;
        Ok(None)
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
                opened: self.opened,
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
