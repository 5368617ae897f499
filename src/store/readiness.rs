//! What `/readyz` says about the store, and the durability check behind it.
//!
//! Readiness is more than reachability once Postgres has standbys. A
//! connection can land on a server that answers but takes no writes (a
//! standby behind a VIP that has not moved yet, or a primary with
//! `default_transaction_read_only`); in `single` mode the instance may be
//! connected but not hold the single-writer lock. Each of those makes fenced
//! writes answer 503, and `/readyz` names which one it is, so an operator
//! (or a load balancer's log) can tell a failover in progress from an
//! outage.
//!
//! The durability check answers a different question: if this primary
//! failed over now, would every fence it acknowledged still be there? Only
//! if a synchronous standby confirmed each commit before it was
//! acknowledged. That is the server's configuration, not something the
//! gateway can enforce, so it is a warning (at start-up and in `/readyz`),
//! never a reason to refuse writes.

use std::sync::atomic::{AtomicU8, Ordering};

use serde::Serialize;
use sqlx::PgConnection;

use super::StoreError;

/// The store's state as `/readyz` reports it (`details.store`).
#[derive(Debug, Clone, Serialize)]
pub struct StoreReadiness {
    /// `"postgres"` or `"sqlite"`.
    pub backend: &'static str,
    /// `"single"` or `"shared"`.
    pub mode: &'static str,
    pub server: ServerState,
    /// Why the server is read-only or unreachable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// `single` mode on Postgres: the single-writer lock.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub writer_lock: Option<WriterLock>,
    /// Postgres, when the server could be asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub durability: Option<Durability>,
}

/// Whether the server behind `[store] url` takes writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerState {
    Writable,
    /// Answers, but takes no writes (a standby; `transaction_read_only`).
    ReadOnly,
    Unreachable,
}

/// The single-writer lock of a `single`-mode instance on Postgres.
#[derive(Debug, Clone, Serialize)]
pub struct WriterLock {
    /// Held on a writable primary: this instance decides fenced writes.
    pub held: bool,
    /// Why it is not held.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl StoreReadiness {
    /// Why fenced writes cannot be decided now, if they cannot: the text of
    /// `/readyz`'s 503.
    pub fn problem(&self) -> Option<String> {
        let why = self.detail.as_deref().unwrap_or("no detail");
        match self.server {
            ServerState::Unreachable => {
                return Some(format!("the fence store is unreachable: {why}"))
            }
            ServerState::ReadOnly => return Some(format!("the fence store is read-only: {why}")),
            ServerState::Writable => {}
        }
        match &self.writer_lock {
            Some(WriterLock {
                held: false,
                detail,
            }) => Some(format!(
                "this instance does not hold the store's single-writer lock: {}",
                detail.as_deref().unwrap_or("not taken yet")
            )),
            _ => None,
        }
    }
}

/// Whether an acknowledged fence survives a failover of this primary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Durability {
    pub status: DurabilityStatus,
    /// Physical standbys streaming from this primary.
    pub replicas: i64,
    /// Those of them that confirm commits (`sync_state` `sync` or `quorum`).
    pub synchronous_replicas: i64,
    pub synchronous_standby_names: String,
    /// As fencegate's own sessions see it (they ask for `on`).
    pub synchronous_commit: String,
    /// What could lose an acknowledged fence, or stall writes; empty when
    /// `status` is `ok`.
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityStatus {
    /// No standby, or every acknowledged commit was confirmed by one.
    Ok,
    Warning,
    /// The role may not read `pg_stat_replication`'s details.
    Unknown,
}

/// What the server said, in the one query of [`PROBE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub in_recovery: bool,
    pub read_only: bool,
    pub synchronous_commit: String,
    pub synchronous_standby_names: String,
    pub replicas: i64,
    pub synchronous_replicas: i64,
    /// Standbys whose `sync_state` this role may not see.
    pub hidden_replicas: i64,
}

/// Writability and replication in one round trip. Standbys are the
/// physical WAL senders: logical replication (a CDC consumer) and a running
/// base backup are not failover targets, so they do not count.
pub const PROBE: &str = "\
SELECT pg_is_in_recovery(),
       current_setting('transaction_read_only') = 'on',
       current_setting('synchronous_commit'),
       current_setting('synchronous_standby_names'),
       count(r.pid),
       count(r.pid) FILTER (WHERE r.sync_state IN ('sync', 'quorum')),
       count(r.pid) FILTER (WHERE r.sync_state IS NULL)
  FROM (SELECT 1) AS one
  LEFT JOIN pg_stat_replication r
    ON r.state IS DISTINCT FROM 'backup'
   AND r.pid NOT IN (SELECT active_pid FROM pg_replication_slots
                      WHERE slot_type = 'logical' AND active_pid IS NOT NULL)";

impl Probe {
    /// The durability check (see the module docs): pure, so every case is
    /// unit-tested below.
    pub fn durability(&self) -> Durability {
        let mut warnings = Vec::new();
        let commit = self.synchronous_commit.as_str();
        if !matches!(commit, "on" | "remote_apply") {
            // fencegate asks for `on` in its startup options; seeing
            // anything else means something in between (a pooler with
            // ignore_startup_parameters) dropped them.
            warnings.push(format!(
                "synchronous_commit is '{commit}' in fencegate's sessions (it asks for 'on'; is a pooler dropping its startup options?): a commit is acknowledged before it is flushed{}, so an acknowledged fence can be lost",
                if commit == "remote_write" { " on a standby" } else { " on a standby, or even locally" }
            ));
        }
        let names = self.synchronous_standby_names.trim();
        if self.hidden_replicas > 0 {
            warnings.push(format!(
                "{} standby(s) stream from this primary, but this role may not read their sync_state in pg_stat_replication (grant it pg_monitor): whether each commit is confirmed by a standby is unknown",
                self.hidden_replicas
            ));
        } else if self.synchronous_replicas == 0 {
            if names.is_empty() && self.replicas > 0 {
                warnings.push(format!(
                    "{} standby(s) stream from this primary, none synchronously (synchronous_standby_names is empty): a fence acknowledged now can be lost if one of them is promoted",
                    self.replicas
                ));
            } else if !names.is_empty() {
                warnings.push(format!(
                    "synchronous_standby_names is '{names}', but no synchronous standby is connected ({} asynchronous): commits wait for one, so fenced writes answer 503 until it connects",
                    self.replicas
                ));
            }
        }
        let status = if self.hidden_replicas > 0 && warnings.len() == 1 {
            DurabilityStatus::Unknown
        } else if warnings.is_empty() {
            DurabilityStatus::Ok
        } else {
            DurabilityStatus::Warning
        };
        Durability {
            status,
            replicas: self.replicas + self.hidden_replicas,
            synchronous_replicas: self.synchronous_replicas,
            synchronous_standby_names: self.synchronous_standby_names.clone(),
            synchronous_commit: self.synchronous_commit.clone(),
            warnings,
        }
    }
}

/// Whether the server takes writes, asked of every new connection.
const WRITABLE: &str =
    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'";

/// Why a server takes no writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOnly {
    /// `pg_is_in_recovery()`: a standby, or one not promoted yet.
    InRecovery,
    /// `transaction_read_only` is on (`default_transaction_read_only`).
    ReadOnlyTransactions,
    /// A write failed with SQLSTATE 25006 (`read_only_sql_transaction`).
    WriteRefused,
}

impl std::fmt::Display for ReadOnly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReadOnly::InRecovery => "the server is in recovery (a standby, not the primary)",
            ReadOnly::ReadOnlyTransactions => {
                "the server takes only read-only transactions (default_transaction_read_only is on)"
            }
            ReadOnly::WriteRefused => "the server refused a write as read-only (SQLSTATE 25006)",
        })
    }
}

/// What the latest evidence said about the server behind the URL: set by
/// each new connection's check and by a write refused as read-only,
/// cleared by a connection that passed the check or a batch that committed.
/// It only explains failures (what a 503 and `/readyz` say): no decision
/// relies on it.
#[derive(Default)]
pub(super) struct ServerView(AtomicU8);

impl ServerView {
    pub(super) fn saw(&self, read_only: Option<ReadOnly>) {
        let code = match read_only {
            None => 0,
            Some(ReadOnly::InRecovery) => 1,
            Some(ReadOnly::ReadOnlyTransactions) => 2,
            Some(ReadOnly::WriteRefused) => 3,
        };
        // A load first: on the hot path (every committed batch) this stays
        // a read of a shared cache line.
        if self.0.load(Ordering::Relaxed) != code {
            self.0.store(code, Ordering::Relaxed);
        }
    }

    pub(super) fn read_only(&self) -> Option<ReadOnly> {
        match self.0.load(Ordering::Relaxed) {
            1 => Some(ReadOnly::InRecovery),
            2 => Some(ReadOnly::ReadOnlyTransactions),
            3 => Some(ReadOnly::WriteRefused),
            _ => None,
        }
    }

    /// Notes what a statement's outcome says, and passes it on.
    pub(super) fn learn<T>(&self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        match &r {
            Ok(_) => self.saw(None),
            Err(StoreError::ReadOnly(ro)) => self.saw(Some(*ro)),
            Err(_) => {}
        }
        r
    }
}

/// Asks a connection whether its server takes writes.
pub(super) async fn writable(conn: &mut PgConnection) -> Result<Result<(), ReadOnly>, sqlx::Error> {
    let (in_recovery, read_only): (bool, bool) =
        sqlx::query_as(WRITABLE).fetch_one(&mut *conn).await?;
    Ok(if in_recovery {
        Err(ReadOnly::InRecovery)
    } else if read_only {
        Err(ReadOnly::ReadOnlyTransactions)
    } else {
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(names: &str, replicas: i64, sync: i64) -> Probe {
        Probe {
            in_recovery: false,
            read_only: false,
            synchronous_commit: "on".into(),
            synchronous_standby_names: names.into(),
            replicas,
            synchronous_replicas: sync,
            hidden_replicas: 0,
        }
    }

    #[test]
    fn no_standby_is_as_durable_as_the_server() {
        let d = probe("", 0, 0).durability();
        assert_eq!(d.status, DurabilityStatus::Ok);
        assert!(d.warnings.is_empty());
    }

    #[test]
    fn a_synchronous_standby_is_ok() {
        for names in ["*", "standby1", "ANY 1 (a, b)"] {
            let d = probe(names, 2, 1).durability();
            assert_eq!(d.status, DurabilityStatus::Ok, "{names}: {:?}", d.warnings);
        }
    }

    #[test]
    fn asynchronous_standbys_warn_of_loss() {
        let d = probe("", 1, 0).durability();
        assert_eq!(d.status, DurabilityStatus::Warning);
        assert!(
            d.warnings[0].contains("none synchronously"),
            "{:?}",
            d.warnings
        );
    }

    #[test]
    fn names_without_a_connected_synchronous_standby_warn_of_stalls() {
        for replicas in [0, 1] {
            let d = probe("standby1", replicas, 0).durability();
            assert_eq!(d.status, DurabilityStatus::Warning);
            assert!(d.warnings[0].contains("commits wait"), "{:?}", d.warnings);
        }
    }

    #[test]
    fn a_weak_synchronous_commit_warns_even_with_a_synchronous_standby() {
        for commit in ["off", "local", "remote_write"] {
            let mut p = probe("*", 1, 1);
            p.synchronous_commit = commit.into();
            let d = p.durability();
            assert_eq!(d.status, DurabilityStatus::Warning, "{commit}");
            assert!(d.warnings[0].contains(commit), "{:?}", d.warnings);
        }
        let mut p = probe("*", 1, 1);
        p.synchronous_commit = "remote_apply".into();
        assert_eq!(p.durability().status, DurabilityStatus::Ok);
    }

    #[test]
    fn hidden_replication_details_are_unknown() {
        let mut p = probe("", 0, 0);
        p.hidden_replicas = 1;
        let d = p.durability();
        assert_eq!(d.status, DurabilityStatus::Unknown);
        assert!(d.warnings[0].contains("pg_monitor"));
        p.synchronous_commit = "off".into();
        assert_eq!(p.durability().status, DurabilityStatus::Warning);
    }

    #[test]
    fn problems_name_the_cause() {
        let mut r = StoreReadiness {
            backend: "postgres",
            mode: "single",
            server: ServerState::Writable,
            detail: None,
            writer_lock: Some(WriterLock {
                held: true,
                detail: None,
            }),
            durability: None,
        };
        assert_eq!(r.problem(), None);
        r.writer_lock = Some(WriterLock {
            held: false,
            detail: Some("another instance holds it".into()),
        });
        assert!(r.problem().unwrap().contains("single-writer lock"));
        r.server = ServerState::ReadOnly;
        r.detail = Some("in recovery".into());
        assert!(r.problem().unwrap().contains("read-only: in recovery"));
    }
}
