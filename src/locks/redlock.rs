//! `backend = "redlock"`: leases on N independent Redis servers (Redlock),
//! fences from the durable store.
//!
//! Redlock alone gives no fencing token: its keys hold random values, and
//! its safety rests on timing assumptions (bounded pauses, bounded clock
//! drift). Here every attempt first takes a fresh fence from the store
//! ([`FenceStore::issue_fence`], durable, strictly increasing), and the
//! gateway checks that fence on every write. So even when Redlock's timing
//! assumptions fail and two clients believe they hold the lock, the older
//! one's writes are refused. An attempt that fails burns its fence; fences
//! need only grow, not be dense.
//!
//! Acquire sets `"<lease>:<fence>"` with `NX PX ttl` on every node at once,
//! each call bounded by the per-node timeout, and grants only with a
//! majority (N/2 + 1) and a positive validity time: `ttl - elapsed - drift`,
//! with `drift = ttl/100 + 2 ms`. A failed attempt is withdrawn on every
//! node. Expiry is judged by each node's own clock; a lease is valid while
//! a majority still holds its key.
//!
//! Lock-delay is kept on every node as for a single Redis (see
//! [`redis_node`](super::redis_node)): a node whose delay key for the name
//! exists refuses the name to other leases, so the name is granted again
//! only once a majority of nodes have neither the lock nor a running delay,
//! each by its own clock.
//!
//! Every node has its own `fencegate:released` subscription (a release is
//! published on all of them); a message from any node wakes local waiters.
//! The subscription tasks stop when the last clone of [`Redlock`] is
//! dropped.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use redis::Script;
use tokio::sync::watch;

use super::backend::{Lease, LockBackend, LockError, LockResult, LockState};
use super::notify::Notifier;
use super::redis_node::{
    delay_key, delay_ms, lock_key, on_lock, parse_value, pttl, spawn_subscriber, ttl_ms,
    wait_subscribed, AbortOnDrop, Node, RELEASED_CHANNEL,
};
use crate::store::FenceStore;

/// Acquire on one node. KEYS[1] the lock, KEYS[2] the delay key; ARGV[1]
/// `"<lease>:<fence>"`, ARGV[2] the ttl in ms, ARGV[3] the lease, ARGV[4]
/// the lock-delay in ms (0: none). Returns `{1, 0}` when set, `{0, pttl}`
/// when another lease holds the key or its delay runs (the time left).
///
/// Keys already holding this same lease are overwritten: they are left
/// over from an earlier attempt of the same acquire (a blocking acquire
/// retries with one lease id) whose withdrawal did not reach this node.
const NODE_ACQUIRE_LUA: &str = r#"
local v = redis.call('GET', KEYS[1])
if v then
  local lease = string.match(v, '^(.*):%d+$')
  if lease ~= ARGV[3] then
    return {0, redis.call('PTTL', KEYS[1])}
  end
end
local d = redis.call('GET', KEYS[2])
if d and d ~= ARGV[3] then
  return {0, redis.call('PTTL', KEYS[2])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if tonumber(ARGV[4]) > 0 then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', string.format('%d', tonumber(ARGV[2]) + tonumber(ARGV[4])))
end
return {1, 0}
"#;

static NODE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(NODE_ACQUIRE_LUA));

/// What one node answered to an acquire.
enum NodeAcquire {
    Set,
    Held(Option<Duration>),
    Failed(LockError),
}

/// The Redlock backend. Cheap to clone.
#[derive(Clone)]
pub struct Redlock {
    inner: Arc<Inner>,
    /// `[locks] lock_delay_ms`; zero for none.
    delay: Duration,
}

struct Inner {
    nodes: Vec<Node>,
    quorum: usize,
    store: FenceStore,
    subscribed: Vec<watch::Receiver<bool>>,
    _subscribers: Vec<AbortOnDrop>,
}

/// The clock drift allowance for a ttl: 1 % plus 2 ms.
fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

impl Redlock {
    /// Prepares connections to every node and subscribes to releases on
    /// each. Fails on an empty list, a duplicate or an invalid URL; nodes
    /// that are down are connected to on first use (a majority suffices).
    pub async fn connect(
        urls: &[String],
        store: FenceStore,
        per_node_timeout: Duration,
        notifier: Arc<Notifier>,
    ) -> LockResult<Self> {
        if urls.is_empty() {
            return Err(LockError::Unavailable(
                "redlock needs at least one Redis URL".into(),
            ));
        }
        let mut nodes = Vec::with_capacity(urls.len());
        for url in urls {
            let node = Node::new(url, per_node_timeout)?;
            if nodes.iter().any(|n: &Node| n.label() == node.label()) {
                return Err(LockError::Unavailable(format!(
                    "redlock lists {} twice: the nodes must be independent",
                    node.label()
                )));
            }
            nodes.push(node);
        }
        let mut subscribed = Vec::with_capacity(nodes.len());
        let mut subscribers = Vec::with_capacity(nodes.len());
        for node in &nodes {
            let (tx, rx) = watch::channel(false);
            subscribers.push(spawn_subscriber(node.clone(), notifier.clone(), tx));
            subscribed.push(rx);
        }
        let quorum = nodes.len() / 2 + 1;
        let this = Self {
            inner: Arc::new(Inner {
                nodes,
                quorum,
                store,
                subscribed,
                _subscribers: subscribers,
            }),
            delay: Duration::ZERO,
        };
        let pings = join_all(this.inner.nodes.iter().map(|n| n.ping()));
        let subs = join_all(
            this.inner
                .subscribed
                .iter()
                .map(|rx| wait_subscribed(rx.clone(), per_node_timeout)),
        );
        let (pings, _) = tokio::join!(pings, subs);
        for (node, ping) in this.inner.nodes.iter().zip(pings) {
            if let Err(e) = ping {
                tracing::warn!(redis = %node.label(), error = %e, "redlock node not reachable yet");
            }
        }
        Ok(this)
    }

    /// Keeps a name ungrantable for `delay` after a lease of it expires.
    pub fn with_lock_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// How many nodes a grant needs.
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// How many nodes there are.
    pub fn nodes(&self) -> usize {
        self.inner.nodes.len()
    }

    /// How many nodes' release subscriptions are live now.
    pub fn subscribed(&self) -> usize {
        self.inner
            .subscribed
            .iter()
            .filter(|rx| *rx.borrow())
            .count()
    }

    /// Compare-and-delete on every node at once, ignoring errors.
    async fn release_everywhere(&self, name: &str, lease: &str) {
        join_all(self.inner.nodes.iter().map(|n| n.release(name, lease))).await;
    }
}

impl LockBackend for Redlock {
    async fn try_acquire(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Lease> {
        let store = &self.inner.store;
        store.check_writer()?;
        let fence = store.issue_fence(name).await?;
        let mut script = on_lock(&NODE_ACQUIRE, name);
        script
            .arg(format!("{lease}:{fence}"))
            .arg(ttl_ms(ttl))
            .arg(lease)
            .arg(delay_ms(self.delay));

        let started = Instant::now();
        let answers = join_all(self.inner.nodes.iter().map(|node| {
            let script = &script;
            async move {
                match node.invoke::<(i64, i64)>(script).await {
                    Ok((1, _)) => NodeAcquire::Set,
                    Ok((_, left)) => NodeAcquire::Held(pttl(left)),
                    Err(e) => NodeAcquire::Failed(e),
                }
            }
        }))
        .await;
        let elapsed = started.elapsed();

        let set = answers
            .iter()
            .filter(|a| matches!(a, NodeAcquire::Set))
            .count();
        let validity = ttl.checked_sub(elapsed + drift(ttl)).unwrap_or_default();
        if set >= self.inner.quorum && !validity.is_zero() {
            return Ok(Lease {
                name: name.to_string(),
                lease: lease.to_string(),
                fence,
                valid_for: validity,
            });
        }

        // No grant: withdraw everywhere, including nodes that failed to
        // answer (the SET may have landed after the timeout).
        self.release_everywhere(name, lease).await;

        let held: Vec<Option<Duration>> = answers
            .iter()
            .filter_map(|a| match a {
                NodeAcquire::Held(left) => Some(*left),
                _ => None,
            })
            .collect();
        let failed: Vec<String> = answers
            .iter()
            .filter_map(|a| match a {
                NodeAcquire::Failed(e) => Some(e.to_string()),
                _ => None,
            })
            .collect();
        let answered = self.inner.nodes.len() - failed.len();
        if answered < self.inner.quorum {
            Err(LockError::Unavailable(format!(
                "redlock: {} of {} nodes answered, {} needed: {}",
                answered,
                self.inner.nodes.len(),
                self.inner.quorum,
                failed.join("; ")
            )))
        } else if !held.is_empty() {
            // The soonest a node frees up: a hint for when to retry.
            Err(LockError::Held {
                expires_in: held.into_iter().flatten().min(),
            })
        } else {
            Err(LockError::Unavailable(format!(
                "redlock: acquiring took {elapsed:?}, no validity left of a {ttl:?} ttl"
            )))
        }
    }

    /// Extends the lease on every node that still holds it. Succeeds only
    /// when a majority did within the validity time; otherwise the lease is
    /// released everywhere (best effort) and the answer is `NotHolder`.
    async fn renew(&self, name: &str, lease: &str, ttl: Duration) -> LockResult<Lease> {
        let started = Instant::now();
        let answers = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| n.renew(name, lease, ttl, self.delay)),
        )
        .await;
        let elapsed = started.elapsed();
        let fences: Vec<i64> = answers
            .iter()
            .filter_map(|a| match a {
                Ok(Some(f)) => Some(*f),
                _ => None,
            })
            .collect();
        let validity = ttl.checked_sub(elapsed + drift(ttl)).unwrap_or_default();
        if fences.len() >= self.inner.quorum && !validity.is_zero() {
            // Every node holding this lease holds the same value.
            let fence = fences.iter().copied().max().unwrap_or_default();
            return Ok(Lease {
                name: name.to_string(),
                lease: lease.to_string(),
                fence,
                valid_for: validity,
            });
        }
        if !fences.is_empty() {
            self.release_everywhere(name, lease).await;
        }
        Err(LockError::NotHolder)
    }

    /// Deletes the lock on every node; true if any node had it. Too few
    /// nodes answering to tell is unavailable.
    async fn break_lease(&self, name: &str) -> LockResult<bool> {
        let answers = join_all(self.inner.nodes.iter().map(|n| n.break_lease(name))).await;
        if answers.iter().any(|a| matches!(a, Ok(true))) {
            return Ok(true);
        }
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        if answered < self.inner.quorum {
            return Err(LockError::Unavailable(format!(
                "redlock: {answered} of {} nodes answered",
                self.inner.nodes.len()
            )));
        }
        Ok(false)
    }

    /// Compare-and-delete on every node. Succeeds if any node still had the
    /// lease; the name is then published on every node that answered (the
    /// release script publishes where it deleted; the others get a PUBLISH),
    /// so every gateway hears of it whichever node it is subscribed to.
    async fn release(&self, name: &str, lease: &str) -> LockResult<()> {
        let answers = join_all(self.inner.nodes.iter().map(|n| n.release(name, lease))).await;
        if answers.iter().any(|a| matches!(a, Ok(true))) {
            let others = self
                .inner
                .nodes
                .iter()
                .zip(&answers)
                .filter(|(_, a)| matches!(a, Ok(false)))
                .map(|(node, _)| {
                    node.run(|mut c| async move {
                        redis::cmd("PUBLISH")
                            .arg(RELEASED_CHANNEL)
                            .arg(name)
                            .query_async::<i64>(&mut c)
                            .await
                    })
                });
            join_all(others).await;
            return Ok(());
        }
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        if answered < self.inner.quorum {
            // Nobody confirmed, and too few answered to say it is not held.
            let why: Vec<String> = answers
                .iter()
                .filter_map(|a| a.as_ref().err().map(|e| e.to_string()))
                .collect();
            return Err(LockError::Unavailable(format!(
                "redlock: {} of {} nodes answered: {}",
                answered,
                self.inner.nodes.len(),
                why.join("; ")
            )));
        }
        Err(LockError::NotHolder)
    }

    /// Held when a majority of nodes hold the same value; its fence, and the
    /// least time left among those nodes. When free, the fence is the
    /// store's floor (the store issues every Redlock fence); delayed while
    /// some node's lock-delay runs and fewer than a majority of nodes could
    /// take the name now, until a majority could.
    async fn status(&self, name: &str) -> LockResult<LockState> {
        let (key, delay) = (lock_key(name), delay_key(name));
        let answers = join_all(self.inner.nodes.iter().map(|node| {
            let (key, delay) = (&key, &delay);
            node.run(move |mut c| async move {
                redis::pipe()
                    .atomic()
                    .get(key)
                    .pttl(key)
                    .pttl(delay)
                    .query_async::<(Option<String>, i64, i64)>(&mut c)
                    .await
            })
        }))
        .await;
        let mut by_value: HashMap<&str, Vec<i64>> = HashMap::new();
        let mut failed = 0;
        // Per answering node: how long until it would take the name.
        let mut busy: Vec<Duration> = Vec::new();
        let mut delaying = false;
        for a in &answers {
            match a {
                Ok((value, left, delay_left)) => {
                    if let Some(v) = value {
                        by_value.entry(v.as_str()).or_default().push(*left);
                    }
                    let lock = value.as_ref().and(pttl(*left)).unwrap_or_default();
                    let delay = pttl(*delay_left).unwrap_or_default();
                    delaying |= delay > lock;
                    busy.push(lock.max(delay));
                }
                Err(_) => failed += 1,
            }
        }
        let best = by_value.iter().max_by_key(|(_, lefts)| lefts.len());
        if let Some((value, lefts)) = best {
            if lefts.len() >= self.inner.quorum {
                if let Some((_, fence)) = parse_value(value) {
                    return Ok(LockState {
                        held: true,
                        fence,
                        expires_in: lefts.iter().copied().filter_map(pttl).min(),
                        delayed_for: None,
                    });
                }
            }
        }
        let most = best.map(|(_, l)| l.len()).unwrap_or(0);
        if most + failed >= self.inner.quorum && failed > 0 {
            // The nodes that did not answer could make it a majority.
            return Err(LockError::Unavailable(format!(
                "redlock: {failed} of {} nodes did not answer",
                self.inner.nodes.len()
            )));
        }
        busy.sort();
        let delayed_for = busy
            .get(self.inner.quorum - 1)
            .copied()
            .filter(|d| delaying && !d.is_zero());
        Ok(LockState {
            held: false,
            fence: self.inner.store.fence_floor(name).await?,
            expires_in: None,
            delayed_for,
        })
    }

    /// Readiness: a majority of nodes answer PING.
    async fn ping(&self) -> LockResult<()> {
        let answers = join_all(self.inner.nodes.iter().map(|n| n.ping())).await;
        let up = answers.iter().filter(|a| a.is_ok()).count();
        if up >= self.inner.quorum {
            Ok(())
        } else {
            let why: Vec<String> = answers
                .into_iter()
                .filter_map(|a| a.err().map(|e| e.to_string()))
                .collect();
            Err(LockError::Unavailable(format!(
                "redlock: {up} of {} nodes up, {} needed: {}",
                self.inner.nodes.len(),
                self.inner.quorum,
                why.join("; ")
            )))
        }
    }
}
