//! What the two Redis backends ([`single_redis`](super::single_redis) and
//! [`redlock`](super::redlock)) share: the key layout, the renew and release
//! scripts, one server's connection, and the release subscription.
//!
//! Keys: the lock `fencegate:lock:{<name>}` holds `"<lease>:<fence>"`, the
//! single-Redis fence counter is `fencegate:fence:{<name>}`, and with a
//! lock-delay `fencegate:delay:{<name>}` holds the lease id and outlives the
//! lock key by the delay. The braces are literal: they are a Redis Cluster
//! hash tag, so a name's keys live in the same slot and a script may touch
//! them all. Releases publish the name on `fencegate:released`; every
//! gateway subscribed to it wakes its local waiters for that name.
//!
//! Lock-delay: Redis forgets an expired key, so the delay is arranged when
//! the lease is granted or renewed: the delay key is set (or extended) with
//! the lock key, for the ttl plus the delay. An acquire refuses while either
//! exists; a release deletes both, so only an expiry leaves a delay behind.
//! Anything else that ends a lease on purpose (an admin break) must delete
//! both too.
//!
//! A subscription runs in a background task that stops when its
//! `AbortOnDrop` is dropped (with the last clone of the backend owning it).
//! It reconnects with backoff when the subscription drops, and pings it so
//! that a silently dead connection is noticed too. Releases published while
//! it is down are missed; waiters then find the lock free at their bounded
//! re-check instead.

use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisResult, Script};
use tokio::sync::{watch, OnceCell};

use super::backend::LockError;
use super::notify::Notifier;
use crate::store::bounded;

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

/// The lock-delay key of `name`: it exists from a grant until the lease's
/// expiry plus the delay, unless the lease is released.
pub fn delay_key(name: &str) -> String {
    format!("fencegate:delay:{{{name}}}")
}

/// Renew. KEYS[1] the lock, KEYS[2] the delay key; ARGV[1] the lease,
/// ARGV[2] the ttl in ms, ARGV[3] the lock-delay in ms (0: none). Returns
/// the fence when the lease holds the lock (and extends it), else -1.
/// The lease is everything before the last ':' (the fence is digits only).
const RENEW_LUA: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return -1 end
local lease, fence = string.match(v, '^(.*):(%d+)$')
if lease ~= ARGV[1] then return -1 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', string.format('%d', tonumber(ARGV[2]) + tonumber(ARGV[3])))
end
return tonumber(fence)
"#;

/// Release: compare-and-delete (the lock-delay key with it), then publish.
/// KEYS[1] the lock, KEYS[2] the delay key; ARGV[1] the lease, ARGV[2] the
/// channel, ARGV[3] the name. Returns 1 if released.
const RELEASE_LUA: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local lease = string.match(v, '^(.*):%d+$')
if lease ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"#;

/// Break: delete whoever's lease (and its lock-delay key: a break is not
/// an expiry), then publish. KEYS[1] the lock, KEYS[2] the delay key;
/// ARGV[1] the channel, ARGV[2] the name. Returns 1 if a lease was held.
const BREAK_LUA: &str = r#"
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"#;

static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_LUA));
static BREAK: LazyLock<Script> = LazyLock::new(|| Script::new(BREAK_LUA));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));

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

/// A lock-delay as milliseconds for the scripts (0: none).
pub(crate) fn delay_ms(delay: Duration) -> u64 {
    delay.as_millis().min(u64::MAX as u128) as u64
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
                // Boxed, so that the future of every Redis call does not
                // nest the deep type of connecting (the integration tests'
                // futures reach the compiler's query depth limit then).
                // Only connection attempts pay for the allocation.
                Box::pin(ConnectionManager::new_with_config(
                    self.client.clone(),
                    config,
                ))
                .await
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
        let unavailable =
            |why: &dyn Display| LockError::Unavailable(format!("redis {}: {why}", self.label));
        let work = async {
            let conn = self.manager().await?;
            op(conn).await
        };
        bounded(
            self.timeout,
            |limit| unavailable(&format_args!("no answer within {limit:?}")),
            async { work.await.map_err(|e| unavailable(&e)) },
        )
        .await
    }

    pub(crate) async fn ping(&self) -> Result<(), LockError> {
        self.run(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .map(|_| ())
    }

    /// The release script: compare-and-delete, publishing on success.
    pub(crate) async fn release(&self, name: &str, lease: &str) -> Result<bool, LockError> {
        let (key, delay) = (lock_key(name), delay_key(name));
        self.run(|mut c| async move {
            RELEASE
                .key(&key)
                .key(&delay)
                .arg(lease)
                .arg(RELEASED_CHANNEL)
                .arg(name)
                .invoke_async::<i64>(&mut c)
                .await
        })
        .await
        .map(|n| n == 1)
    }

    /// The break script: true if a lease held the lock (now deleted).
    pub(crate) async fn break_lease(&self, name: &str) -> Result<bool, LockError> {
        let (key, delay) = (lock_key(name), delay_key(name));
        self.run(|mut c| async move {
            BREAK
                .key(&key)
                .key(&delay)
                .arg(RELEASED_CHANNEL)
                .arg(name)
                .invoke_async::<i64>(&mut c)
                .await
        })
        .await
        .map(|n| n == 1)
    }

    /// The renew script: the fence if `lease` holds the lock (now extended,
    /// and its lock-delay key with it).
    pub(crate) async fn renew(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
        lock_delay: Duration,
    ) -> Result<Option<i64>, LockError> {
        let (key, delay) = (lock_key(name), delay_key(name));
        let ms = ttl_ms(ttl);
        let delay_ms = delay_ms(lock_delay);
        self.run(|mut c| async move {
            RENEW
                .key(&key)
                .key(&delay)
                .arg(lease)
                .arg(ms)
                .arg(delay_ms)
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
