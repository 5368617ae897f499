//! What every lock backend provides, and the types they share.
//!
//! A backend only grants, renews, releases and reports leases. Fences come
//! from (or are checked against) the durable store by the backend itself, so
//! that no grant ever leaves the gateway without a durable fence.

use std::time::Duration;

/// A granted lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The lock name (also the resource key the fence protects).
    pub name: String,
    /// The secret lease id proving ownership.
    pub lease: String,
    /// The fencing token of this grant.
    pub fence: i64,
    /// How long the lease is valid from now, as judged by the backend's clock
    /// (for Redlock: the validity time, ttl minus elapsed minus drift).
    pub valid_for: Duration,
}

/// What `status` reports; never the lease id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockState {
    pub held: bool,
    /// The holder's fence when held; else the last fence issued for the
    /// name (0 if none ever was).
    pub fence: i64,
    /// Remaining lease time when held.
    pub expires_in: Option<Duration>,
}

/// Why a lock operation did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Someone else holds the lock; `expires_in` if known.
    #[error("the lock is held by another holder")]
    Held { expires_in: Option<Duration> },
    /// Renew or release by a lease that does not hold the lock (never did,
    /// or it expired or was released).
    #[error("this lease does not hold the lock (it expired, was released, or never held it)")]
    NotHolder,
    /// Renew or release by the lease that held the lock, after its expiry
    /// (the backend can tell; otherwise it answers `NotHolder`).
    #[error("this lease expired")]
    Expired,
    /// The backend (Redis, the store, too few Redlock nodes) could not
    /// answer; nothing was granted.
    #[error("lock backend unavailable: {0}")]
    Unavailable(String),
}

impl From<crate::store::StoreError> for LockError {
    fn from(e: crate::store::StoreError) -> Self {
        LockError::Unavailable(format!("fence store: {e}"))
    }
}
