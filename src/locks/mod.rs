//! The lock API: leases whose grants carry fencing tokens.
//!
//! [`LockService`] is the facade the HTTP handlers ([`api`]) use. It checks
//! bounds, makes lease ids, runs the blocking-acquire loop, signs tokens and
//! counts metrics; the backends ([`table`], [`single_redis`], [`redlock`])
//! only grant, renew, release and report, under the contract of
//! [`LockBackend`].
//!
//! Fences are per lock name, and the lock name is the resource key the token
//! fences: a grant's fence is always above the highest token the gateway has
//! recorded for that key, so a fresh holder can write at once.
//!
//! # Layout
//!
//! * [`api`]: the HTTP handlers under `/_fencegate/locks/{name}`.
//! * [`backend`]: the [`LockBackend`] contract and the types backends share.
//! * [`table`]: `backend = "store"`: leases in the fence store.
//! * [`single_redis`]: `backend = "redis"`: leases in one Redis.
//! * [`redlock`]: `backend = "redlock"`: leases on several Redis servers.
//! * [`redis_node`]: the Redis backends' keys, scripts, connections, pub/sub.
//! * [`notify`]: wake-ups for blocking acquires.

pub mod api;
pub mod backend;
pub mod notify;
pub mod redis_node;
pub mod redlock;
pub mod single_redis;
pub mod table;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use rand::RngCore;

use crate::metrics::{LockEvent, Metrics};
pub use backend::{Lease, LockBackend, LockError, LockResult, LockState};
use notify::Notifier;
use table::TableLocks;

/// Bounds on what clients may ask for.
#[derive(Debug, Clone, Copy)]
pub struct LockLimits {
    pub min_ttl: Duration,
    pub max_ttl: Duration,
    /// Longest `wait_ms` a blocking acquire may ask for.
    pub max_wait: Duration,
}

/// The configured backend, dispatched statically.
#[derive(Clone)]
pub enum Backend {
    Table(TableLocks),
    Redis(single_redis::RedisLocks),
    Redlock(redlock::Redlock),
}

macro_rules! dispatch {
    ($self:expr, $b:ident => $call:expr) => {
        match $self {
            Backend::Table($b) => $call,
            Backend::Redis($b) => $call,
            Backend::Redlock($b) => $call,
        }
    };
}

impl Backend {
    fn label(&self) -> &'static str {
        match self {
            // Named after the config value (`backend = "store"`).
            Backend::Table(_) => "store",
            Backend::Redis(_) => "redis",
            Backend::Redlock(_) => "redlock",
        }
    }
}

impl LockBackend for Backend {
    async fn try_acquire(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Lease> {
        dispatch!(self, b => b.try_acquire(name, lease, ttl).await)
    }

    async fn renew(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Lease> {
        dispatch!(self, b => b.renew(name, lease, ttl).await)
    }

    async fn release(&self, name: &str, lease: &str) -> LockResult<()> {
        dispatch!(self, b => b.release(name, lease).await)
    }

    async fn status(&self, name: &str) -> LockResult<LockState> {
        dispatch!(self, b => b.status(name).await)
    }

    async fn ping(&self) -> LockResult<()> {
        dispatch!(self, b => b.ping().await)
    }

    async fn break_lease(&self, name: &str) -> LockResult<bool> {
        dispatch!(self, b => b.break_lease(name).await)
    }
}

/// Grants and statuses are written with the client crate's types, so that
/// the answers and what `fencegate_client` reads are one wire format.
pub use fencegate_client::{Grant, Status};

/// Cheap to clone.
#[derive(Clone)]
pub struct LockService {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Backend,
    /// Wakes blocking acquires on release (fed locally and by the backend's
    /// cross-instance channel).
    notifier: Arc<Notifier>,
    /// Signs grant tokens when `[tokens]` names a signing key. A reload
    /// swaps it.
    jwt: arc_swap::ArcSwapOption<crate::fencing::jwt::JwtKeys>,
    limits: LockLimits,
    metrics: Metrics,
}

/// Longest a waiter sleeps without re-checking: expiry sends no event, and a
/// lost notification must cost at most this much.
const FALLBACK_RECHECK: Duration = Duration::from_millis(500);

impl LockService {
    pub fn new(
        backend: Backend,
        notifier: Arc<Notifier>,
        jwt: Option<Arc<crate::fencing::jwt::JwtKeys>>,
        limits: LockLimits,
        metrics: Metrics,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                backend,
                notifier,
                jwt: arc_swap::ArcSwapOption::new(jwt.filter(|k| k.can_sign())),
                limits,
                metrics,
            }),
        }
    }

    /// New keys to sign grant tokens with (a config reload).
    pub fn set_signing_keys(&self, jwt: Option<Arc<crate::fencing::jwt::JwtKeys>>) {
        self.inner.jwt.store(jwt.filter(|k| k.can_sign()));
    }

    /// Whether the backend answers, for `/readyz`; a failure counts as
    /// `ping_failed`.
    pub async fn ping(&self) -> LockResult<()> {
        let pinged = self.inner.backend.ping().await;
        if pinged.is_err() {
            self.count(LockEvent::PingFailed);
        }
        pinged
    }

    pub fn limits(&self) -> LockLimits {
        self.inner.limits
    }

    /// Acquires `name` for `ttl`, waiting up to `wait` for a holder to
    /// release or expire. Waiting sleeps on release notifications (and, for
    /// expiry, until the holder's lease runs out), never busy-polls.
    /// `lease` is the new lease's id: secret and unique (see
    /// [`new_lease_id`]; the API tags it with the client that asked).
    ///
    /// A backend that cannot answer on the first try is `Unavailable` at
    /// once. Once the lock was seen held, the acquire keeps waiting through
    /// an outage (a Redis failover, a store restart), trying again at the
    /// re-check interval, and answers `Unavailable` only if the outage
    /// outlasts the wait: the waiter is still in line when the backend is
    /// back, as a client retrying by itself would be, without one more
    /// round trip.
    pub async fn acquire(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
        wait: Duration,
    ) -> LockResult<Grant> {
        let deadline = Instant::now() + wait;
        let mut seen_held = false;
        loop {
            // Register before trying, so a release in between is not missed.
            let waiter = self.inner.notifier.register(name);
            let mut nap = FALLBACK_RECHECK;
            match self.inner.backend.try_acquire(name, lease, ttl).await {
                Ok(l) => {
                    self.count(LockEvent::Grant);
                    return self.grant(l, ttl);
                }
                Err(LockError::Held { expires_in }) => {
                    if Instant::now() >= deadline {
                        self.count(LockEvent::Held);
                        return Err(LockError::Held { expires_in });
                    }
                    seen_held = true;
                    if let Some(e) = expires_in {
                        nap = nap.min(e + Duration::from_millis(2));
                    }
                }
                Err(e @ LockError::Unavailable(_)) if seen_held && Instant::now() < deadline => {
                    tracing::debug!(lock = name, error = %e, "lock backend unavailable while waiting; still waiting");
                }
                Err(e) => {
                    self.count(match e {
                        LockError::Exhausted => LockEvent::Exhausted,
                        _ => LockEvent::Unavailable,
                    });
                    return Err(e);
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::select! {
                _ = waiter.wait() => {}
                _ = tokio::time::sleep(nap.min(left)) => {}
            }
        }
    }

    pub async fn renew(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Grant> {
        match self.inner.backend.renew(name, lease, ttl).await {
            Ok(l) => {
                self.count(LockEvent::Renew);
                self.grant(l, ttl)
            }
            Err(e) => {
                self.count(match e {
                    LockError::NotHolder => LockEvent::RenewRefused,
                    LockError::Expired => LockEvent::Expired,
                    _ => LockEvent::Unavailable,
                });
                Err(e)
            }
        }
    }

    pub async fn release(&self, name: &str, lease: &str) -> LockResult<()> {
        let r = self.inner.backend.release(name, lease).await;
        match &r {
            Ok(()) => {
                self.count(LockEvent::Release);
                self.inner.notifier.notify(name);
            }
            Err(LockError::NotHolder) => self.count(LockEvent::ReleaseRefused),
            Err(LockError::Expired) => self.count(LockEvent::Expired),
            Err(_) => self.count(LockEvent::Unavailable),
        }
        r
    }

    /// Ends whatever lease holds `name` (an admin break); true when one did.
    pub async fn break_lease(&self, name: &str) -> LockResult<bool> {
        let broken = self.inner.backend.break_lease(name).await;
        match &broken {
            Ok(true) => {
                self.count(LockEvent::Break);
                self.inner.notifier.notify(name);
            }
            Ok(false) => {}
            Err(_) => self.count(LockEvent::Unavailable),
        }
        broken
    }

    pub async fn status(&self, name: &str) -> LockResult<Status> {
        let s = self.inner.backend.status(name).await?;
        Ok(Status {
            name: name.to_string(),
            held: s.held,
            fence: s.fence,
            expires_in_ms: s.expires_in.map(|d| d.as_millis() as u64),
            delayed_until: s.delayed_for.map(|d| Utc::now() + chrono_duration(d)),
        })
    }

    fn grant(&self, l: Lease, ttl: Duration) -> LockResult<Grant> {
        let now = Utc::now();
        let expires_at = now + chrono_duration(l.valid_for);
        let token = match &*self.inner.jwt.load() {
            Some(keys) => {
                // exp in whole seconds, rounded up so the token never ends
                // before the lease.
                let exp_ms = expires_at.timestamp_millis();
                let exp = (exp_ms + 999).div_euclid(1000);
                keys.sign(&l.name, l.fence, now.timestamp(), exp)
                    .map_err(|e| LockError::Unavailable(format!("cannot sign the token: {e}")))?
            }
            None => l.fence.to_string(),
        };
        Ok(Grant {
            name: l.name,
            lease: l.lease,
            fence: l.fence,
            token,
            ttl_ms: ttl.as_millis() as u64,
            expires_at,
        })
    }

    fn count(&self, event: LockEvent) {
        self.inner
            .metrics
            .lock_event(self.inner.backend.label(), event);
    }
}

/// A std duration as a chrono one (zero if it does not fit, which no lease
/// or delay comes near).
fn chrono_duration(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or_else(|_| chrono::Duration::zero())
}

/// 128 random bits from the OS, as 32 hex characters.
pub fn new_lease_id() -> String {
    let mut bytes = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
