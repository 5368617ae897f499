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
//!   hung answers [`LockError::Unavailable`] within that bound, never a grant.
//!
//! Keys: the lock `fencegate:lock:{<name>}` holds `"<lease>:<fence>"`, the
//! counter is `fencegate:fence:{<name>}`. The braces are literal: they are a
//! Redis Cluster hash tag, so a name's two keys live in the same slot and
//! the acquire script may touch both. Releases publish the name on
//! `fencegate:released`; every gateway subscribed to it wakes its local
//! waiters for that name.
//!
//! The subscription runs in a background task owned by the [`RedisLocks`]:
//! it stops when the last clone is dropped. It reconnects with backoff when
//! the subscription drops (and pings it, so a silently dead connection is
//! noticed too). Releases published while it is down are missed; waiters
//! then find the lock free at their bounded re-check instead.

use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{RedisResult, Script};
use futures_util::StreamExt;
use tokio::sync::{watch, OnceCell};

use super::backend::{Lease, LockError, LockState};
use super::notify::Notifier;
use crate::store::FenceStore;

/// The channel releases are published on; the payload is the lock name.
pub const RELEASED_CHANNEL: &str = "fencegate:released";

/// The lock key of `name` (the braces are a literal Cluster hash tag).
pub fn lock_key(name: &str) -> String {
    format!("fencegate:lock:{{{name}}}")
}

/// The Redis fence counter of `name`.
pub fn fence_key(name: &str) -> String {
    format!("fencegate:fence:{{{name}}}")
}

/// Acquire (single instance). KEYS[1] the lock, KEYS[2] the fence counter;
/// ARGV[1] the lease, ARGV[2] the ttl in ms, ARGV[3] the store's floor.
/// Returns `{1, fence}` when granted, `{0, pttl}` when held.
///
/// Numbers are formatted with `%d` before they become strings: Lua 5.1
/// would write large numbers as `1e+15`.
const ACQUIRE_LUA: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('PTTL', KEYS[1])}
end
local f = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if f <= floor then
  f = floor + 1
  redis.call('SET', KEYS[2], string.format('%d', f))
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. string.format('%d', f), 'PX', ARGV[2])
return {1, f}
"#;

/// Renew. KEYS[1] the lock; ARGV[1] the lease, ARGV[2] the ttl in ms.
/// Returns the fence when the lease holds the lock (and extends it), else -1.
/// The lease is everything before the last ':' (the fence is digits only).
const RENEW_LUA: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return -1 end
local lease, fence = string.match(v, '^(.*):(%d+)$')
if lease ~= ARGV[1] then return -1 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return tonumber(fence)
"#;

/// Release: compare-and-delete, then publish. KEYS[1] the lock; ARGV[1] the
/// lease, ARGV[2] the channel, ARGV[3] the name. Returns 1 if released.
const RELEASE_LUA: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local lease = string.match(v, '^(.*):%d+$')
if lease ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"#;

pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_LUA));
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));

/// Splits a lock value `"<lease>:<fence>"` into its parts.
pub(crate) fn parse_value(v: &str) -> Option<(&str, i64)> {
    let (lease, fence) = v.rsplit_once(':')?;
    Some((lease, fence.parse().ok()?))
}

/// A PTTL answer as a remaining time (-1 "no expiry" and -2 "no key" are
/// not remaining times).
pub(crate) fn pttl(ms: i64) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

/// A ttl as Redis milliseconds (at least 1: `PX 0` is an error).
pub(crate) fn ttl_ms(ttl: Duration) -> u64 {
    (ttl.as_millis().min(u64::MAX as u128) as u64).max(1)
}

/// One Redis server: a lazily made, self-reconnecting connection, and the
/// bound on every call to it.
///
/// The connection is made on first use rather than at start-up, so a
/// gateway starts (and proxies) while Redis is down; lock calls answer
/// `Unavailable` until it is back.
pub(crate) struct Node {
    client: redis::Client,
    conn: OnceCell<ConnectionManager>,
    timeout: Duration,
    /// host:port, for messages (never the URL: it may hold a password).
    pub(crate) label: String,
}

impl Node {
    pub(crate) fn new(url: &str, timeout: Duration) -> Result<Self, LockError> {
        let client = redis::Client::open(url)
            .map_err(|e| LockError::Unavailable(format!("invalid Redis URL: {e}")))?;
        let label = client.get_connection_info().addr.to_string();
        Ok(Self {
            client,
            conn: OnceCell::new(),
            timeout,
            label,
        })
    }

    pub(crate) fn client(&self) -> &redis::Client {
        &self.client
    }

    async fn manager(&self) -> RedisResult<ConnectionManager> {
        self.conn
            .get_or_try_init(|| async {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(self.timeout)
                    .set_response_timeout(self.timeout)
                    .set_number_of_retries(4)
                    .set_factor(50)
                    .set_max_delay(1000);
                ConnectionManager::new_with_config(self.client.clone(), config).await
            })
            .await
            .cloned()
    }

    /// Runs `op` on this node's connection, bounded by the node's timeout.
    pub(crate) async fn run<T, F, Fut>(&self, op: F) -> Result<T, LockError>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let work = async {
            let conn = self.manager().await?;
            op(conn).await
        };
        match tokio::time::timeout(self.timeout, work).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(LockError::Unavailable(format!("redis {}: {e}", self.label))),
            Err(_) => Err(LockError::Unavailable(format!(
                "redis {}: no answer within {:?}",
                self.label, self.timeout
            ))),
        }
    }

    pub(crate) async fn ping(&self) -> Result<(), LockError> {
        self.run(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .map(|_| ())
    }

    /// The release script: compare-and-delete, publishing on success.
    pub(crate) async fn release(&self, name: &str, lease: &str) -> Result<bool, LockError> {
        let key = lock_key(name);
        self.run(|mut c| async move {
            RELEASE
                .key(&key)
                .arg(lease)
                .arg(RELEASED_CHANNEL)
                .arg(name)
                .invoke_async::<i64>(&mut c)
                .await
        })
        .await
        .map(|n| n == 1)
    }

    /// The renew script: the fence if `lease` holds the lock (now extended).
    pub(crate) async fn renew(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
    ) -> Result<Option<i64>, LockError> {
        let key = lock_key(name);
        let ms = ttl_ms(ttl);
        self.run(|mut c| async move {
            RENEW
                .key(&key)
                .arg(lease)
                .arg(ms)
                .invoke_async::<i64>(&mut c)
                .await
        })
        .await
        .map(|f| (f >= 0).then_some(f))
    }
}

/// Aborts a background task when dropped.
pub(crate) struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How often a live subscription is pinged, to notice a dead connection
/// that sent no FIN.
const SUBSCRIPTION_PING: Duration = Duration::from_secs(5);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Starts the task that feeds `fencegate:released` on `client` into
/// `notifier`. `subscribed` turns true while the subscription is live.
pub(crate) fn spawn_subscriber(
    client: redis::Client,
    label: String,
    timeout: Duration,
    notifier: Arc<Notifier>,
    subscribed: watch::Sender<bool>,
) -> AbortOnDrop {
    let task = tokio::spawn(async move {
        let mut backoff = BACKOFF_MIN;
        loop {
            let connect = async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(RELEASED_CHANNEL).await?;
                RedisResult::Ok(pubsub)
            };
            match tokio::time::timeout(timeout.max(Duration::from_secs(1)), connect).await {
                Ok(Ok(pubsub)) => {
                    backoff = BACKOFF_MIN;
                    subscribed.send_replace(true);
                    tracing::debug!(redis = %label, "subscribed to {RELEASED_CHANNEL}");
                    let (mut sink, mut stream) = pubsub.split();
                    let mut ping = tokio::time::interval(SUBSCRIPTION_PING);
                    ping.tick().await;
                    loop {
                        tokio::select! {
                            msg = stream.next() => match msg {
                                Some(msg) => {
                                    if let Ok(name) = msg.get_payload::<String>() {
                                        notifier.notify(&name);
                                    }
                                }
                                None => break,
                            },
                            _ = ping.tick() => {
                                let pong = tokio::time::timeout(
                                    timeout.max(Duration::from_secs(1)),
                                    sink.ping::<redis::Value>(),
                                )
                                .await;
                                if !matches!(pong, Ok(Ok(_))) {
                                    break;
                                }
                            }
                        }
                    }
                    subscribed.send_replace(false);
                    tracing::warn!(redis = %label, "lost the {RELEASED_CHANNEL} subscription; resubscribing");
                }
                Ok(Err(e)) => {
                    tracing::debug!(redis = %label, error = %e, "cannot subscribe to {RELEASED_CHANNEL}; retrying");
                }
                Err(_) => {
                    tracing::debug!(redis = %label, "subscribing to {RELEASED_CHANNEL} timed out; retrying");
                }
            }
            // Full jitter, so many gateways do not reconnect in step.
            let nap = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0);
            tokio::time::sleep(nap).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    });
    AbortOnDrop(task.abort_handle())
}

/// Waits until `subscribed` is true, at most `within`.
pub(crate) async fn wait_subscribed(
    mut subscribed: watch::Receiver<bool>,
    within: Duration,
) -> bool {
    tokio::time::timeout(within, subscribed.wait_for(|s| *s))
        .await
        .map(|r| r.is_ok())
        .unwrap_or(false)
}

/// The Redis backend (one server). Cheap to clone; the pub/sub task stops
/// when the last clone is dropped.
#[derive(Clone)]
pub struct RedisLocks {
    inner: Arc<Inner>,
}

struct Inner {
    node: Node,
    store: FenceStore,
    subscribed: watch::Receiver<bool>,
    _subscriber: AbortOnDrop,
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
    ) -> Result<Self, LockError> {
        let node = Node::new(url, op_timeout)?;
        let (tx, rx) = watch::channel(false);
        let subscriber = spawn_subscriber(
            node.client().clone(),
            node.label.clone(),
            op_timeout,
            notifier,
            tx,
        );
        let this = Self {
            inner: Arc::new(Inner {
                node,
                store,
                subscribed: rx.clone(),
                _subscriber: subscriber,
            }),
        };
        let (ping, subscribed) =
            tokio::join!(this.inner.node.ping(), wait_subscribed(rx, op_timeout));
        if let Err(e) = ping {
            tracing::warn!(error = %e, "Redis is not reachable yet; lock calls answer 503 until it is");
        } else if !subscribed {
            tracing::warn!(redis = %this.inner.node.label, "not subscribed to {RELEASED_CHANNEL} yet");
        }
        Ok(this)
    }

    /// Whether the release subscription is live now.
    pub fn subscribed(&self) -> bool {
        *self.inner.subscribed.borrow()
    }

    pub async fn try_acquire(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        let store = &self.inner.store;
        store.check_writer()?;
        // Twice at most: a refused record means the store's floor moved past
        // what we read (Redis lost its counter while another grant was
        // recorded, or the gateway recorded a higher token for the key).
        // The second pass reads the new floor, which the script raises the
        // Redis counter to.
        for attempt in 0..2 {
            let floor = store.fence_floor(name).await?;
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

    async fn acquire_script(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
        floor: i64,
    ) -> Result<Acquired, LockError> {
        let (lock, fence) = (lock_key(name), fence_key(name));
        let ms = ttl_ms(ttl);
        let (granted, n): (i64, i64) = self
            .inner
            .node
            .run(|mut c| async move {
                ACQUIRE
                    .key(&lock)
                    .key(&fence)
                    .arg(lease)
                    .arg(ms)
                    .arg(floor)
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

    pub async fn renew(&self, name: &str, lease: &str, ttl: Duration) -> Result<Lease, LockError> {
        let started = Instant::now();
        match self.inner.node.renew(name, lease, ttl).await? {
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
    pub async fn release(&self, name: &str, lease: &str) -> Result<(), LockError> {
        if self.inner.node.release(name, lease).await? {
            Ok(())
        } else {
            Err(LockError::NotHolder)
        }
    }

    pub async fn status(&self, name: &str) -> Result<LockState, LockError> {
        let (lock, fence) = (lock_key(name), fence_key(name));
        let (value, left, counter): (Option<String>, i64, Option<i64>) = self
            .inner
            .node
            .run(|mut c| async move {
                redis::pipe()
                    .atomic()
                    .get(&lock)
                    .pttl(&lock)
                    .get(&fence)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        if let Some((_, fence)) = value.as_deref().and_then(parse_value) {
            return Ok(LockState {
                held: true,
                fence,
                expires_in: pttl(left),
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
        })
    }

    /// Readiness: Redis answers PING within the op timeout.
    pub async fn ping(&self) -> Result<(), LockError> {
        self.inner.node.ping().await
    }
}
