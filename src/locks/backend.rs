//! What every lock backend provides ([`LockBackend`]), and the types the
//! backends share.

use std::future::Future;
use std::time::Duration;

/// A lock backend: it grants, renews, releases and reports leases, and no
/// more. [`LockService`](super::LockService) does the rest (bounds, lease
/// ids, waiting, tokens, metrics).
///
/// Every backend keeps this contract:
///
/// - **Fences are durable before they leave.** A grant's fence comes from
///   the fence store, or is checked against it and recorded there, before
///   `try_acquire` answers. It is above every fence issued for the name and
///   above the highest token the gateway recorded for the resource key of
///   the same name, so a fresh holder can write at once, and fences keep
///   growing whatever happens to the backend's own state.
/// - **One clock judges expiry**: the backend's (the database's, Redis's,
///   each Redlock node's), never a gateway's or a client's;
///   [`Lease::valid_for`] is measured by it.
/// - **An expired lease stays expired**: renewing or releasing it fails with
///   [`LockError::NotHolder`] (or [`LockError::Expired`] where the backend
///   can tell); it is never revived.
/// - **Every call is bounded**: a store or server that is down or hung
///   makes the call answer [`LockError::Unavailable`] promptly, never a
///   grant.
/// - **Lock-delay after an expiry**: with a delay configured (`[locks]
///   lock_delay_ms`, given to the backend when it is made), a lease that
///   ends by expiry leaves its name ungrantable until its expiry plus the
///   delay, judged by the same clock as the expiry. A release (or an admin
///   break) ends a lease without a delay, and a release that comes too late
///   (the lease expired) does not end a running delay. While a delay runs,
///   `try_acquire` answers [`LockError::Held`] with the time left of the
///   delay, and `status` reports it in [`LockState::delayed_for`]. With no
///   delay configured nothing changes. A backend that loses its state (a
///   Redis restart without persistence) may lose a running delay with it;
///   fences still grow.
/// - `try_acquire` does not wait: a lock held by another lease (or in its
///   lock-delay) answers [`LockError::Held`] at once, and the service does
///   the waiting.
/// - A release wakes waiters on other gateways through the backend's own
///   channel (Postgres NOTIFY, Redis pub/sub); the service wakes local ones.
pub trait LockBackend: Send + Sync {
    /// Grants `name` to `lease` for `ttl` if no other lease holds it.
    fn try_acquire(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
    ) -> impl Future<Output = LockResult<Lease>> + Send;

    /// Extends the lease `lease` holds on `name` to `ttl` from now, keeping
    /// its fence.
    fn renew(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
    ) -> impl Future<Output = LockResult<Lease>> + Send;

    /// Ends the lease `lease` holds on `name`.
    fn release(&self, name: &str, lease: &str) -> impl Future<Output = LockResult<()>> + Send;

    /// Whether `name` is held, and its fence.
    fn status(&self, name: &str) -> impl Future<Output = LockResult<LockState>> + Send;

    /// Ends whatever lease holds `name` (an admin break); true when one
    /// did. The broken holder's renew and release then answer `NotHolder`,
    /// and waiters wake as on a release. It is not an expiry: no lock-delay
    /// follows it.
    fn break_lease(&self, name: &str) -> impl Future<Output = LockResult<bool>> + Send;

    /// Whether the backend answers, for `/readyz`. By default it does: a
    /// backend kept in the fence store is as ready as the store, which
    /// `/readyz` checks by itself.
    fn ping(&self) -> impl Future<Output = LockResult<()>> + Send {
        async { Ok(()) }
    }
}

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
    /// When not held because the last lease expired and its lock-delay is
    /// still running: the time left of the delay. Operators need it to tell
    /// "free" from "free soon" (an acquire now would be refused).
    pub delayed_for: Option<Duration>,
}

/// What a lock operation answers.
pub type LockResult<T> = Result<T, LockError>;

/// Why a lock operation did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Someone else holds the lock, or its lock-delay runs; `expires_in`:
    /// when it may be granted, if known.
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
    /// The name's fence (or its key's highest token) is already the largest
    /// there is (9223372036854775807): no grant can carry a higher one. Only
    /// an admin reset of the key ends this.
    #[error("the fence of this lock is exhausted")]
    Exhausted,
}

impl From<crate::store::StoreError> for LockError {
    fn from(e: crate::store::StoreError) -> Self {
        match e {
            crate::store::StoreError::Database(e) if crate::store::is_overflow(&e) => {
                LockError::Exhausted
            }
            e => LockError::Unavailable(format!("fence store: {e}")),
        }
    }
}
