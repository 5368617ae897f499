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
//! Failover: a server is reached at a URL (which must follow failovers by
//! itself: a VIP, a DNS name, a proxy) or through Sentinel. Either way the
//! connection in use is dropped as soon as an answer casts doubt on it (a
//! broken socket, a timeout, `READONLY`), and the next call connects again,
//! asking Sentinel anew; every new connection must be to a master (`ROLE`).
//! A replica's answer is never taken for a grant: the scripts write, and a
//! replica refuses writes. What a failover loses (recent leases, the fence
//! counter's last increments) the fence floor in the store makes up for:
//! see [`single_redis`](super::single_redis).
//!
//! A subscription runs in a background task that stops when its
//! `AbortOnDrop` is dropped (with the last clone of the backend owning it).
//! It reconnects with backoff when the subscription drops, pings it so
//! that a silently dead connection is noticed too, and subscribes again
//! whenever the command connection was made again (so that it follows the
//! commands to a new master). Releases published while it is down are
//! missed; waiters then find the lock free at their bounded re-check
//! instead.

use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{
    AsyncConnectionConfig, ErrorKind, FromRedisValue, RedisError, RedisResult, Script,
    ScriptInvocation,
};
use tokio::sync::watch;

use super::backend::{LockError, LockResult};
use super::notify::Notifier;

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

/// Where a node's server is found.
enum Target {
    /// One address (a server, or a VIP or proxy that follows failovers).
    Url(redis::Client),
    /// The master that Sentinel names `master_name`.
    Sentinel {
        master_name: String,
        sentinels: Vec<Sentinel>,
    },
}

/// One Sentinel, as discovery and the switch watch use it.
///
/// One [`SentinelClient`] per Sentinel, each asked on its own and all at
/// once: the crate's client asks its Sentinels one after another on a
/// connection without timeouts, so one Sentinel that hangs (a host gone
/// without a reset) would hold up every discovery behind it. Each client
/// confirms with `ROLE` that the address it was given is a master before
/// answering.
struct Sentinel {
    discovery: tokio::sync::Mutex<SentinelClient>,
    /// The Sentinel itself, for its `+switch-master` events.
    client: redis::Client,
}

impl Target {
    /// The server to connect to now. For Sentinel, the first Sentinel to
    /// name a master that confirms its role wins; during a failover a
    /// Sentinel may still name the old master, which then fails the role
    /// check (demoted) or the connection (dead), and another answer wins.
    async fn locate(&self) -> RedisResult<redis::Client> {
        match self {
            Target::Url(client) => Ok(client.clone()),
            Target::Sentinel { sentinels, .. } => {
                let asks = sentinels.iter().map(|s| {
                    Box::pin(async move { s.discovery.lock().await.async_get_client().await })
                });
                futures_util::future::select_ok(asks)
                    .await
                    .map(|(client, _)| client)
            }
        }
    }
}

/// One Redis server: a lazily made connection that is replaced whenever it
/// may no longer lead to a writable master, and the bound on every call.
///
/// The connection is made on first use rather than at start-up, so a
/// gateway starts (and proxies) while Redis is down; lock calls answer
/// `Unavailable` until it is back.
///
/// Why not the crate's `ConnectionManager`: it reconnects only after a
/// broken socket, to the same address. A failover also shows itself as a
/// call that times out (the old master gone without a reset, or hung) or as
/// a `READONLY` answer (the connection still reaches the old master, now a
/// replica, as through a proxy that switched backends but kept its old
/// sessions), and with Sentinel the next connection must go to wherever
/// Sentinel says the master is now. So any answer that casts doubt on the
/// connection ([`suspect`]) drops it, and the next call makes a new one,
/// locating the master again. Every new connection is checked with `ROLE`:
/// a replica is unavailable, never a place to grant from.
///
/// Cheap to clone (the release subscription holds a clone).
#[derive(Clone)]
pub(crate) struct Node(Arc<NodeInner>);

struct NodeInner {
    target: Target,
    timeout: Duration,
    /// For messages (never the URL: it may hold a password): host:port, or
    /// the master's name under Sentinel.
    label: String,
    /// The connection in use, if any.
    current: Mutex<Option<Live>>,
    /// One connection attempt at a time; callers that arrive meanwhile use
    /// its result.
    connecting: tokio::sync::Mutex<()>,
    /// Numbers the connections, so that dropping one never drops its
    /// successor (a slow call may report a failure after the replacement).
    generations: AtomicU64,
    /// A connection was dropped and none made since.
    lost: AtomicBool,
    /// Bumped when a connection replaces a dropped one: the release
    /// subscription then subscribes again, so that it follows the commands
    /// to the new master (see [`spawn_subscriber`]).
    reconnects: watch::Sender<u64>,
}

#[derive(Clone)]
struct Live {
    conn: MultiplexedConnection,
    generation: u64,
    /// host:port of the server it reached.
    addr: String,
}

/// Whether an error casts doubt on the connection it came from, so that
/// the next call should make a new one (and, with Sentinel, ask again where
/// the master is). A script's own error (a bug, a type mismatch) does not.
fn suspect(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || matches!(
            e.kind(),
            ErrorKind::ReadOnly
                | ErrorKind::MasterDown
                | ErrorKind::BusyLoadingError
                | ErrorKind::TryAgain
                | ErrorKind::ClusterDown
                | ErrorKind::AuthenticationFailed
        )
}

/// An error reply from a server that answered (an unknown or forbidden
/// command), as opposed to a connection that failed.
fn server_refused(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ResponseError | ErrorKind::ExtensionError
    ) && !e.is_io_error()
}

/// The first word of `ROLE`: "master", "slave" or "sentinel".
async fn role(conn: &mut MultiplexedConnection) -> RedisResult<String> {
    let answer: redis::Value = redis::cmd("ROLE").query_async(conn).await?;
    if let redis::Value::Array(items) = &answer {
        if let Some(first) = items.first() {
            return redis::from_redis_value(first);
        }
    }
    Err(RedisError::from((
        ErrorKind::TypeError,
        "ROLE answered something else than a role",
    )))
}

/// Checks that the server behind `conn` is a writable master. A server
/// that refuses `ROLE` (a managed Redis that renamed it, an ACL without
/// it) is taken as it is; a replica still answers `READONLY` to every
/// grant, which [`suspect`] handles.
async fn check_master(conn: &mut MultiplexedConnection) -> RedisResult<()> {
    let role = match role(conn).await {
        Ok(role) => role,
        Err(e) if server_refused(&e) => return Ok(()),
        Err(e) => return Err(e),
    };
    match role.as_str() {
        "slave" => Err(RedisError::from((
            ErrorKind::ReadOnly,
            "the server is a read-only replica, not the master",
        ))),
        "sentinel" => Err(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "the server is a Sentinel, not a Redis server (for Sentinel discovery set \
             [locks] redis_sentinels and redis_master_name)",
        ))),
        _ => Ok(()),
    }
}

impl Node {
    pub(crate) fn new(url: &str, timeout: Duration) -> LockResult<Self> {
        let client = redis::Client::open(url)
            .map_err(|e| LockError::Unavailable(format!("invalid Redis URL: {e}")))?;
        let label = client.get_connection_info().addr.to_string();
        Ok(Self::with_target(Target::Url(client), label, timeout))
    }

    /// The master Sentinel names `master_name`, asking each of `sentinels`
    /// (redis:// URLs, with the Sentinel's own credentials if it has any).
    pub(crate) fn sentinel(
        sentinels: &[String],
        master_name: &str,
        timeout: Duration,
    ) -> LockResult<Self> {
        if sentinels.is_empty() {
            return Err(LockError::Unavailable(
                "Sentinel discovery needs at least one Sentinel".into(),
            ));
        }
        let invalid = |e: RedisError| LockError::Unavailable(format!("invalid Sentinel URL: {e}"));
        let clients = sentinels
            .iter()
            .map(|url| {
                let discovery = SentinelClient::build(
                    vec![url.as_str()],
                    master_name.to_string(),
                    None,
                    SentinelServerType::Master,
                )
                .map_err(invalid)?;
                Ok(Sentinel {
                    discovery: tokio::sync::Mutex::new(discovery),
                    client: redis::Client::open(url.as_str()).map_err(invalid)?,
                })
            })
            .collect::<LockResult<Vec<_>>>()?;
        Ok(Self::with_target(
            Target::Sentinel {
                master_name: master_name.to_string(),
                sentinels: clients,
            },
            format!("master '{master_name}' (Sentinel)"),
            timeout,
        ))
    }

    fn with_target(target: Target, label: String, timeout: Duration) -> Self {
        Self(Arc::new(NodeInner {
            target,
            timeout,
            label,
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            generations: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            reconnects: watch::channel(0).0,
        }))
    }

    /// host:port, or the master's name under Sentinel.
    pub(crate) fn label(&self) -> &str {
        &self.0.label
    }

    fn current(&self) -> Option<Live> {
        self.0
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The connection in use, or a new one (located anew, role-checked).
    async fn connection(&self) -> RedisResult<Live> {
        if let Some(live) = self.current() {
            return Ok(live);
        }
        let _one = self.0.connecting.lock().await;
        // Made by the caller we waited for?
        if let Some(live) = self.current() {
            return Ok(live);
        }
        let client = self.0.target.locate().await?;
        // Boxed, so that the future of every Redis call does not nest the
        // deep type of connecting (the integration tests' futures reach the
        // compiler's query depth limit then). Only connection attempts pay
        // for the allocation.
        let mut conn = Box::pin(connect_within(&client, self.0.timeout)).await?;
        check_master(&mut conn).await?;
        let live = Live {
            conn,
            generation: self.0.generations.fetch_add(1, Ordering::Relaxed) + 1,
            addr: client.get_connection_info().addr.to_string(),
        };
        *self.0.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(live.clone());
        if self.0.lost.swap(false, Ordering::AcqRel) {
            tracing::info!(redis = %self.0.label, addr = %live.addr, "connected again");
            self.0.reconnects.send_modify(|n| *n += 1);
        }
        Ok(live)
    }

    /// Drops `live` if it is still the connection in use: the next call
    /// makes a new one.
    fn forget(&self, live: &Live, why: &dyn Display) {
        let mut current = self.0.current.lock().unwrap_or_else(|e| e.into_inner());
        if current
            .as_ref()
            .is_some_and(|c| c.generation == live.generation)
        {
            *current = None;
            self.0.lost.store(true, Ordering::Release);
            tracing::warn!(
                redis = %self.0.label,
                addr = %live.addr,
                error = %why,
                "dropping the Redis connection; the next call connects again"
            );
        }
    }

    fn unavailable(&self, addr: Option<&str>, why: &dyn Display) -> LockError {
        match (&self.0.target, addr) {
            (Target::Sentinel { .. }, Some(addr)) => {
                LockError::Unavailable(format!("redis {} at {addr}: {why}", self.0.label))
            }
            _ => LockError::Unavailable(format!("redis {}: {why}", self.0.label)),
        }
    }

    /// Sentinel names `addr` (host:port) the master now: a connection to
    /// another server is dropped, so the next call goes there.
    fn master_named(&self, addr: &str) {
        if let Some(live) = self.current() {
            if live.addr != addr {
                self.forget(&live, &format_args!("Sentinel names {addr} the master now"));
            }
        }
    }

    /// Runs `op` on this node's connection, connecting first if need be,
    /// all within the node's timeout. A failure that casts doubt on the
    /// connection drops it ([`suspect`]; a timeout does too: a connection
    /// that does not answer may be to a server that is gone).
    pub(crate) async fn run<T, F, Fut>(&self, op: F) -> LockResult<T>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let limit = self.0.timeout;
        let deadline = tokio::time::Instant::now() + limit;
        let live = match tokio::time::timeout_at(deadline, self.connection()).await {
            Ok(Ok(live)) => live,
            Ok(Err(e)) => return Err(self.unavailable(None, &e)),
            Err(_) => {
                return Err(self.unavailable(None, &format_args!("no connection within {limit:?}")))
            }
        };
        match tokio::time::timeout_at(deadline, op(live.conn.clone())).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if suspect(&e) {
                    self.forget(&live, &e);
                }
                Err(self.unavailable(Some(&live.addr), &e))
            }
            Err(_) => {
                let why = format_args!("no answer within {limit:?}");
                self.forget(&live, &why);
                Err(self.unavailable(Some(&live.addr), &why))
            }
        }
    }

    /// Readiness: the server answers, and as a master (`ROLE`; `PING` where
    /// `ROLE` is refused). A connection that now reaches a replica is
    /// dropped and reported unavailable.
    pub(crate) async fn ping(&self) -> LockResult<()> {
        self.run(|mut c| async move {
            match check_master(&mut c).await {
                Ok(()) => redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Runs a script invocation (see [`on_lock`]) on this node.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        script: &ScriptInvocation<'_>,
    ) -> LockResult<T> {
        self.run(|mut c| async move { script.invoke_async(&mut c).await })
            .await
    }

    /// The release script: compare-and-delete, publishing on success.
    pub(crate) async fn release(&self, name: &str, lease: &str) -> LockResult<bool> {
        let mut script = on_lock(&RELEASE, name);
        script.arg(lease).arg(RELEASED_CHANNEL).arg(name);
        self.invoke(&script).await.map(|n: i64| n == 1)
    }

    /// The break script: true if a lease held the lock (now deleted).
    pub(crate) async fn break_lease(&self, name: &str) -> LockResult<bool> {
        let mut script = on_lock(&BREAK, name);
        script.arg(RELEASED_CHANNEL).arg(name);
        self.invoke(&script).await.map(|n: i64| n == 1)
    }

    /// The renew script: the fence if `lease` holds the lock (now extended,
    /// and its lock-delay key with it).
    pub(crate) async fn renew(
        &self,
        name: &str,
        lease: &str,
        ttl: Duration,
        lock_delay: Duration,
    ) -> LockResult<Option<i64>> {
        let mut script = on_lock(&RENEW, name);
        script.arg(lease).arg(ttl_ms(ttl)).arg(delay_ms(lock_delay));
        self.invoke(&script)
            .await
            .map(|f: i64| (f >= 0).then_some(f))
    }
}

/// An invocation of `script` with `name`'s lock key as `KEYS[1]` and its
/// lock-delay key as `KEYS[2]`, the layout every script but single Redis's
/// acquire has; the caller adds the `ARGV`.
pub(crate) fn on_lock<'a>(script: &'a Script, name: &str) -> ScriptInvocation<'a> {
    let mut invocation = script.key(lock_key(name));
    invocation.key(delay_key(name));
    invocation
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

/// Starts the task that feeds `fencegate:released` on `node` into
/// `notifier`. `subscribed` turns true while the subscription is live.
///
/// The subscription has a connection of its own (a subscribed connection
/// takes no other commands), located like the node's: the URL, or the
/// master Sentinel names now, confirmed by `ROLE`. It is made again when
/// it drops, when a ping goes unanswered, and whenever the node's command
/// connection was replaced ([`Node`] drops it on a failover's symptoms):
/// the two may have parted ways, the commands on the new master and the
/// subscription still on the old one, now a replica, or on a socket that
/// has not noticed yet. The release script publishes where it deletes the
/// lock key, so only a subscription on the same server as the commands
/// hears every release.
pub(crate) fn spawn_subscriber(
    node: Node,
    notifier: Arc<Notifier>,
    subscribed: watch::Sender<bool>,
) -> AbortOnDrop {
    let task = tokio::spawn(async move {
        let label = node.0.label.clone();
        let bound = node.0.timeout.max(Duration::from_secs(1));
        let mut reconnects = node.0.reconnects.subscribe();
        let mut backoff = BACKOFF_MIN;
        loop {
            reconnects.borrow_and_update();
            let connect = async {
                let client = node.0.target.locate().await?;
                let mut probe = connect_within(&client, bound).await?;
                check_master(&mut probe).await?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(RELEASED_CHANNEL).await?;
                let addr = client.get_connection_info().addr.to_string();
                RedisResult::Ok((pubsub, addr))
            };
            match tokio::time::timeout(bound, Box::pin(connect)).await {
                Ok(Ok((pubsub, addr))) => {
                    backoff = BACKOFF_MIN;
                    subscribed.send_replace(true);
                    tracing::debug!(redis = %label, %addr, "subscribed to {RELEASED_CHANNEL}");
                    let moved = listen(
                        pubsub,
                        bound,
                        |name| notifier.notify(&name),
                        changed(&mut reconnects),
                    )
                    .await;
                    subscribed.send_replace(false);
                    if moved {
                        tracing::info!(redis = %label, %addr, "the lock connection was made again; subscribing to {RELEASED_CHANNEL} again");
                        continue;
                    }
                    tracing::warn!(redis = %label, %addr, "lost the {RELEASED_CHANNEL} subscription; resubscribing");
                }
                Ok(Err(e)) => {
                    tracing::debug!(redis = %label, error = %e, "cannot subscribe to {RELEASED_CHANNEL}; retrying");
                }
                Err(_) => {
                    tracing::debug!(redis = %label, "subscribing to {RELEASED_CHANNEL} timed out; retrying");
                }
            }
            // Full jitter, so many gateways do not reconnect in step. A new
            // command connection cuts the wait short: the master is back
            // (or was found elsewhere), and every release until the
            // subscription is back is heard by no one here.
            let nap = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0);
            tokio::select! {
                _ = tokio::time::sleep(nap) => {
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
                _ = changed(&mut reconnects) => {
                    backoff = BACKOFF_MIN;
                }
            }
        }
    });
    AbortOnDrop(task.abort_handle())
}

/// The channel on which Sentinels announce a new master.
const SWITCH_MASTER: &str = "+switch-master";

/// Under Sentinel, starts one task per Sentinel that listens for its
/// `+switch-master` events and moves the node's connection at once.
///
/// Why: in a failover where the old master stays up (`SENTINEL FAILOVER`,
/// or a master that comes back), nothing breaks the gateway's connection to
/// it, and it keeps accepting writes until Sentinel makes it a replica,
/// seconds later: grants there would be lost with its data. The event comes
/// when the new master is chosen. A Sentinel's event missed while its
/// listener was down is made up for when it subscribes again (it asks that
/// Sentinel which master it names now), and else by the usual symptoms
/// (`READONLY`, the connections Sentinel closes as it reconfigures the old
/// master). Nothing for a node at one URL: empty.
pub(crate) fn spawn_sentinel_watch(node: &Node) -> Vec<AbortOnDrop> {
    let Target::Sentinel { sentinels, .. } = &node.0.target else {
        return Vec::new();
    };
    (0..sentinels.len())
        .map(|i| {
            let node = node.clone();
            AbortOnDrop(tokio::spawn(watch_sentinel(node, i)).abort_handle())
        })
        .collect()
}

/// A new connection to `client`'s server, where connecting and every answer
/// are bounded by `bound`: no call on it can hang on a server that went
/// silent.
async fn connect_within(
    client: &redis::Client,
    bound: Duration,
) -> RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(bound)
        .set_response_timeout(bound);
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// The loop of one Sentinel's listener (see [`spawn_sentinel_watch`]).
async fn watch_sentinel(node: Node, index: usize) {
    let Target::Sentinel {
        master_name,
        sentinels,
    } = &node.0.target
    else {
        return;
    };
    let Some(sentinel) = sentinels.get(index) else {
        return;
    };
    let client = &sentinel.client;
    let label = client.get_connection_info().addr.to_string();
    let bound = node.0.timeout.max(Duration::from_secs(1));
    let mut backoff = BACKOFF_MIN;
    loop {
        let connect = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(SWITCH_MASTER).await?;
            RedisResult::Ok(pubsub)
        };
        match tokio::time::timeout(bound, Box::pin(connect)).await {
            Ok(Ok(pubsub)) => {
                backoff = BACKOFF_MIN;
                // A switch while nobody listened: what it names now.
                let named = async {
                    let mut c = connect_within(client, bound).await?;
                    redis::cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(master_name)
                        .query_async::<Option<(String, u16)>>(&mut c)
                        .await
                };
                if let Ok(Ok(Some((host, port)))) =
                    tokio::time::timeout(bound, Box::pin(named)).await
                {
                    node.master_named(&format!("{host}:{port}"));
                }
                // "<name> <old ip> <old port> <new ip> <new port>"
                let switched = |text: String| {
                    let words: Vec<&str> = text.split_whitespace().collect();
                    if let [name, _, _, host, port] = words[..] {
                        if name == master_name {
                            tracing::info!(redis = %node.0.label, sentinel = %label, master = %format_args!("{host}:{port}"), "Sentinel switched the master");
                            node.master_named(&format!("{host}:{port}"));
                        }
                    }
                };
                listen(pubsub, bound, switched, std::future::pending()).await;
                tracing::debug!(sentinel = %label, "lost the {SWITCH_MASTER} subscription; resubscribing");
            }
            Ok(Err(e)) => {
                tracing::debug!(sentinel = %label, error = %e, "cannot subscribe to {SWITCH_MASTER}; retrying");
            }
            Err(_) => {
                tracing::debug!(sentinel = %label, "subscribing to {SWITCH_MASTER} timed out; retrying");
            }
        }
        let nap = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0);
        tokio::time::sleep(nap).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Hands every message's payload on `pubsub` to `on_payload` until the
/// subscription is lost (false) or `moved` resolves (true). It is pinged
/// every [`SUBSCRIPTION_PING`], so that a connection that died silently is
/// noticed too.
async fn listen(
    pubsub: redis::aio::PubSub,
    bound: Duration,
    mut on_payload: impl FnMut(String),
    moved: impl Future<Output = ()>,
) -> bool {
    let (mut sink, mut stream) = pubsub.split();
    let mut ping = tokio::time::interval(SUBSCRIPTION_PING);
    ping.tick().await;
    let mut moved = std::pin::pin!(moved);
    loop {
        tokio::select! {
            msg = stream.next() => match msg {
                Some(msg) => {
                    if let Ok(payload) = msg.get_payload::<String>() {
                        on_payload(payload);
                    }
                }
                None => return false,
            },
            _ = ping.tick() => {
                let pong = tokio::time::timeout(bound, sink.ping::<redis::Value>()).await;
                if !matches!(pong, Ok(Ok(_))) {
                    return false;
                }
            }
            _ = &mut moved => return true,
        }
    }
}

/// Resolves when `rx` sees a new value; never, once its sender is gone (it
/// lives as long as the node, which the subscription task holds).
async fn changed(rx: &mut watch::Receiver<u64>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
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
