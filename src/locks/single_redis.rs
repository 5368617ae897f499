//! `backend = "redis"`: leases in one Redis, fences made durable in the store.
//!
//! The single-instance pattern, done right:
//!
//! - every state change is one Lua script (run by EVALSHA, loaded on
//!   NOSCRIPT), so check-and-set is atomic and an expired key simply does not
//!   exist: an expired lease can never be renewed or released;
//! - expiry is judged by Redis's clock alone (`PX`, `PEXPIRE`, `PTTL`);
//! - the Redis fence counter is only a fast path. Before a grant leaves the
//!   gateway its fence is recorded in the durable store
//!   ([`FenceStore::record_fence`]), and every grant's fence is above the
//!   store's floor ([`FenceStore::fence_floor`]), so fences keep growing when
//!   Redis loses its data (FLUSHALL, a restart without persistence, a
//!   failover to a replica that missed the last INCR);
//! - every Redis call is bounded by `op_timeout`: a Redis that is down or
//!   hung answers [`LockError::Unavailable`] within that bound, never a grant;
//! - the server is found at one URL or through Sentinel, and found again
//!   after a failover: a connection is dropped on a failover's symptoms and
//!   every new one must reach a master, so a promoted replica is used
//!   without a restart and a replica is never granted from (see
//!   [`redis_node`](super::redis_node)).
//!
//! The keys, the renew and release scripts, the release subscription and
//! the way lock-delay is kept are shared with Redlock, in
//! [`redis_node`](super::redis_node).

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use redis::Script;
use tokio::sync::watch;

use super::backend::{Lease, LockBackend, LockError, LockResult, LockState};
use super::notify::Notifier;
use super::redis_node::{
    delay_key, delay_ms, fence_key, lock_key, parse_value, pttl, spawn_sentinel_watch,
    spawn_subscriber, ttl_ms, wait_subscribed, AbortOnDrop, Node, RELEASED_CHANNEL,
};
use crate::config::RedisTarget;
use crate::store::FenceStore;

/// Acquire (single instance). KEYS[1] the lock, KEYS[2] the fence counter,
/// KEYS[3] the delay key; ARGV[1] the lease, ARGV[2] the ttl in ms, ARGV[3]
/// the store's floor, ARGV[4] the lock-delay in ms (0: none). Returns
/// `{1, fence}` when granted, `{0, pttl}` when held or delayed (the time
/// left of the lease or of the delay).
///
/// Numbers are formatted with `%d` before they become strings: Lua 5.1
/// would write large numbers as `1e+15`.
const ACQUIRE_LUA: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('PTTL', KEYS[1])}
end
local delayed = redis.call('PTTL', KEYS[3])
if delayed > 0 then
  return {0, delayed}
end
local f = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if f <= floor then
  f = floor + 1
  redis.call('SET', KEYS[2], string.format('%d', f))
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. string.format('%d', f), 'PX', ARGV[2])
if tonumber(ARGV[4]) > 0 then
  redis.call('SET', KEYS[3], ARGV[1], 'PX', string.format('%d', tonumber(ARGV[2]) + tonumber(ARGV[4])))
end
return {1, f}
"#;

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));

/// The Redis backend (one server). Cheap to clone; the pub/sub task stops
/// when the last clone is dropped.
#[derive(Clone)]
pub struct RedisLocks {
    inner: Arc<Inner>,
    /// `[locks] lock_delay_ms`; zero for none.
    delay: Duration,
}

struct Inner {
    node: Node,
    store: FenceStore,
    subscribed: watch::Receiver<bool>,
    _subscriber: AbortOnDrop,
    /// Under Sentinel: the `+switch-master` listeners.
    _sentinel_watch: Vec<AbortOnDrop>,
}

/// What the acquire script answered.
enum Acquired {
    Granted(i64),
    Held(Option<Duration>),
}

impl RedisLocks {
    /// Prepares the connection to `url` and subscribes to releases.
    ///
    /// Fails only on an invalid URL: the connection is made on first use, so
    /// the gateway starts while Redis is down (see [`RedisLocks::ping`] for
    /// readiness). Waits up to `op_timeout` for the release subscription, so
    /// releases right after start-up already wake waiters.
    pub async fn connect(
        url: &str,
        store: FenceStore,
        op_timeout: Duration,
        notifier: Arc<Notifier>,
    ) -> LockResult<Self> {
        Self::on(Node::new(url, op_timeout)?, store, op_timeout, notifier).await
    }

    /// As [`RedisLocks::connect`], on the master that Sentinel names
    /// `master_name`, asking `sentinels` again after every failover.
    pub async fn connect_sentinel(
        sentinels: &[String],
        master_name: &str,
        store: FenceStore,
        op_timeout: Duration,
        notifier: Arc<Notifier>,
    ) -> LockResult<Self> {
        let node = Node::sentinel(sentinels, master_name, op_timeout)?;
        Self::on(node, store, op_timeout, notifier).await
    }

    /// As configured: `[locks] redis_url`, or Sentinel discovery.
    pub async fn connect_to(
        target: &RedisTarget,
        store: FenceStore,
        op_timeout: Duration,
        notifier: Arc<Notifier>,
    ) -> LockResult<Self> {
        match target {
            RedisTarget::Url(url) => Self::connect(url, store, op_timeout, notifier).await,
            RedisTarget::Sentinel {
                sentinels,
                master_name,
            } => Self::connect_sentinel(sentinels, master_name, store, op_timeout, notifier).await,
        }
    }

    async fn on(
        node: Node,
        store: FenceStore,
        op_timeout: Duration,
        notifier: Arc<Notifier>,
    ) -> LockResult<Self> {
        let (tx, rx) = watch::channel(false);
        let subscriber = spawn_subscriber(node.clone(), notifier, tx);
        let sentinel_watch = spawn_sentinel_watch(&node);
        let this = Self {
            inner: Arc::new(Inner {
                node,
                store,
                subscribed: rx.clone(),
                _subscriber: subscriber,
                _sentinel_watch: sentinel_watch,
            }),
            delay: Duration::ZERO,
        };
        let (ping, subscribed) =
            tokio::join!(this.inner.node.ping(), wait_subscribed(rx, op_timeout));
        if let Err(e) = ping {
            tracing::warn!(error = %e, "Redis is not reachable yet; lock calls answer 503 until it is");
        } else if !subscribed {
            tracing::warn!(redis = %this.inner.node.label(), "not subscribed to {RELEASED_CHANNEL} yet");
        }
        Ok(this)
    }

    /// Keeps a name ungrantable for `delay` after a lease of it expires.
    pub fn with_lock_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Whether the release subscription is live now.
    pub fn subscribed(&self) -> bool {
        *self.inner.subscribed.borrow()
    }

    async fn acquire_script(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
        floor: i64,
    ) -> LockResult<Acquired> {
        let (lock, fence, delay) = (lock_key(name), fence_key(name), delay_key(name));
        let ms = ttl_ms(ttl);
        let delay_ms = delay_ms(self.delay);
        let (granted, n): (i64, i64) = self
            .inner
            .node
            .run(|mut c| async move {
                ACQUIRE
                    .key(&lock)
                    .key(&fence)
                    .key(&delay)
                    .arg(lease)
                    .arg(ms)
                    .arg(floor)
                    .arg(delay_ms)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(if granted == 1 {
            Acquired::Granted(n)
        } else {
            Acquired::Held(pttl(n))
        })
    }

    /// Takes back a grant that must not leave the gateway. Best effort: if
    /// Redis cannot be reached the key expires with its ttl.
    async fn withdraw(&self, name: &str, lease: &str) {
        if let Err(e) = self.inner.node.release(name, lease).await {
            tracing::warn!(lock = name, error = %e, "cannot withdraw a grant; it will expire with its ttl");
        }
    }
}

impl LockBackend for RedisLocks {
    async fn try_acquire(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Lease> {
        let store = &self.inner.store;
        store.check_writer()?;
        // Twice at most: a refused record means the store's floor moved past
        // what we read (Redis lost its counter while another grant was
        // recorded, or the gateway recorded a higher token for the key).
        // The second pass reads the new floor, which the script raises the
        // Redis counter to.
        for attempt in 0..2 {
            let floor = store.fence_floor(name).await?;
            if floor == i64::MAX {
                return Err(LockError::Exhausted);
            }
            let started = Instant::now();
            let fence = match self.acquire_script(name, lease, ttl, floor).await {
                Ok(Acquired::Held(expires_in)) => return Err(LockError::Held { expires_in }),
                Ok(Acquired::Granted(f)) => f,
                Err(e) => {
                    // The script may have run and only its answer been lost
                    // (timeout): take back a grant nobody will see. In the
                    // background, so the answer keeps its time bound.
                    let this = self.clone();
                    let (name, lease) = (name.to_string(), lease.to_string());
                    tokio::spawn(async move {
                        if let Err(e) = this.inner.node.release(&name, &lease).await {
                            tracing::debug!(lock = %name, error = %e, "cannot withdraw a possibly granted lease");
                        }
                    });
                    return Err(e);
                }
            };
            match store.record_fence(name, fence).await {
                Ok(true) => {
                    // The key's ttl started after `started`: what is left of
                    // it now is at least this much.
                    let valid_for = ttl.saturating_sub(started.elapsed());
                    if valid_for.is_zero() {
                        self.withdraw(name, lease).await;
                        return Err(LockError::Unavailable(
                            "the grant took longer than its ttl".into(),
                        ));
                    }
                    return Ok(Lease {
                        name: name.to_string(),
                        lease: lease.to_string(),
                        fence,
                        valid_for,
                    });
                }
                Ok(false) => {
                    self.withdraw(name, lease).await;
                    tracing::warn!(
                        lock = name,
                        fence,
                        attempt,
                        "Redis issued a fence the store had already passed; raising the Redis counter"
                    );
                }
                Err(e) => {
                    self.withdraw(name, lease).await;
                    return Err(e.into());
                }
            }
        }
        Err(LockError::Unavailable(
            "the store's fence floor kept moving past Redis's counter".into(),
        ))
    }

    async fn renew(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Lease> {
        let started = Instant::now();
        match self.inner.node.renew(name, lease, ttl, self.delay).await? {
            Some(fence) => Ok(Lease {
                name: name.to_string(),
                lease: lease.to_string(),
                fence,
                valid_for: ttl.saturating_sub(started.elapsed()),
            }),
            None => Err(LockError::NotHolder),
        }
    }

    /// Releases and publishes the name (in the same script), so waiters on
    /// every gateway wake.
    async fn release(&self, name: &str, lease: &str) -> LockResult<()> {
        if self.inner.node.release(name, lease).await? {
            Ok(())
        } else {
            Err(LockError::NotHolder)
        }
    }

    async fn break_lease(&self, name: &str) -> LockResult<bool> {
        self.inner.node.break_lease(name).await
    }

    async fn status(&self, name: &str) -> LockResult<LockState> {
        let (lock, fence, delay) = (lock_key(name), fence_key(name), delay_key(name));
        let (value, left, counter, delay_left): (Option<String>, i64, Option<i64>, i64) = self
            .inner
            .node
            .run(|mut c| async move {
                redis::pipe()
                    .atomic()
                    .get(&lock)
                    .pttl(&lock)
                    .get(&fence)
                    .pttl(&delay)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        if let Some((_, fence)) = value.as_deref().and_then(parse_value) {
            return Ok(LockState {
                held: true,
                fence,
                expires_in: pttl(left),
                delayed_for: None,
            });
        }
        // Free: "the last fence issued". The Redis counter alone may be
        // behind (Redis lost it; the next grant raises it to the floor), and
        // the store's floor alone may be behind by a fence that Redis
        // counted but whose grant was withdrawn (burnt, never used). The
        // higher of the two is never below the last fence granted, and the
        // next grant is above both.
        let floor = self.inner.store.fence_floor(name).await?;
        Ok(LockState {
            held: false,
            fence: floor.max(counter.unwrap_or(0)),
            expires_in: None,
            delayed_for: pttl(delay_left).filter(|d| !d.is_zero()),
        })
    }

    /// Readiness: Redis answers PING within the op timeout.
    async fn ping(&self) -> LockResult<()> {
        self.inner.node.ping().await
    }
}
