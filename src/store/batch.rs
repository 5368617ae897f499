//! Group commit: concurrent fence decisions for different keys share one
//! statement and one durable commit.
//!
//! A request hands its `(key, token)` to the batcher and waits for the
//! answer. The batcher takes whatever has queued up (at most `max_batch`),
//! runs it as one statement while the next requests queue, and fans the
//! per-key answers back out. A request arriving while no batch is in flight
//! runs at once as a batch of one; one arriving while `concurrency` batches
//! are committing waits for a slot and goes with the next batch.
//!
//! Nothing about durability changes: a batch's answers are sent only after
//! its statement has committed (synchronous_commit stays on; SQLite commits
//! its one transaction per batch with synchronous=FULL).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::{bounded, StoreError};

/// The answers of one batch: each key's highest token after the batch.
pub type Answers = HashMap<String, i64>;

type Reply = oneshot::Sender<Result<i64, String>>;

struct Item {
    key: String,
    token: i64,
    reply: Reply,
    /// The requester's thread and runtime, to deliver answers in bulk.
    home: Option<(ThreadId, Handle)>,
}

/// A handle on a running batcher; cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Item>,
    timeout: Duration,
}

impl Batcher {
    /// Starts the batching task. `run` records a batch of `(key, token)`
    /// pairs (keys may repeat) and answers every key's highest token.
    pub fn spawn<F, Fut>(max_batch: usize, concurrency: usize, timeout: Duration, run: F) -> Self
    where
        F: Fn(Vec<(String, i64)>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Answers, StoreError>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::channel::<Item>(max_batch * concurrency * 4);
        let run = Arc::new(run);
        tokio::spawn(async move {
            let slots = Arc::new(Semaphore::new(concurrency));
            while let Some(first) = rx.recv().await {
                // Wait for a free slot *before* draining the queue: while all
                // slots are busy committing, requests pile up into the next,
                // bigger batch. That is the whole point.
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let mut items = vec![first];
                while items.len() < max_batch {
                    match rx.try_recv() {
                        Ok(i) => items.push(i),
                        Err(_) => break,
                    }
                }
                let run = run.clone();
                tokio::spawn(async move {
                    let pairs = items.iter().map(|i| (i.key.clone(), i.token)).collect();
                    let result = tokio::time::timeout(timeout, run(pairs)).await;
                    let mut homes: HashMap<ThreadId, (Handle, Vec<(Reply, Answer)>)> =
                        HashMap::new();
                    for item in items {
                        let answer = match &result {
                            Ok(Ok(answers)) => answers
                                .get(&item.key)
                                .copied()
                                .ok_or_else(|| "a batch lost a key's answer".to_string()),
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(_) => Err(format!("no answer within {timeout:?}")),
                        };
                        match item.home {
                            Some((thread, rt)) => {
                                let home = homes.entry(thread).or_insert_with(|| (rt, Vec::new()));
                                home.1.push((item.reply, answer));
                            }
                            None => drop(item.reply.send(answer)),
                        }
                    }
                    deliver(homes);
                    drop(slot);
                });
            }
        });
        Self { tx, timeout }
    }

    /// Records `token` for `key` as part of the next batch; answers the
    /// key's highest token after it (equal to `token` iff accepted).
    pub async fn record(&self, key: &str, token: i64) -> Result<i64, StoreError> {
        let (reply, answer) = oneshot::channel();
        let item = Item {
            key: key.to_string(),
            token,
            reply,
            home: Handle::try_current()
                .ok()
                .map(|rt| (std::thread::current().id(), rt)),
        };
        let wait = async {
            self.tx
                .send(item)
                .await
                .map_err(|_| StoreError::Other("the batcher stopped".into()))?;
            answer
                .await
                .map_err(|_| StoreError::Other("the batcher dropped a request".into()))?
                .map_err(StoreError::Other)
        };
        bounded(self.timeout, StoreError::Timeout, wait).await
    }
}

type Answer = Result<i64, String>;

/// Sends a batch's answers. Waking a task on another thread's runtime costs
/// a syscall (the runtime's eventfd) per wake-up; a worker thread usually
/// has many requests in one batch, so its answers go to it together, as one
/// task that then wakes each request locally.
fn deliver(homes: HashMap<ThreadId, (Handle, Vec<(Reply, Answer)>)>) {
    for (_, (rt, replies)) in homes {
        if replies.len() == 1 {
            for (reply, answer) in replies {
                let _ = reply.send(answer);
            }
            continue;
        }
        // If that runtime is shutting down the task may never run: its
        // requests then see the batcher drop them and answer 503, which is
        // safe (their fences are recorded; nothing was forwarded).
        drop(rt.spawn(async move {
            for (reply, answer) in replies {
                let _ = reply.send(answer);
            }
        }));
    }
}

/// The highest token requested per key in a batch.
pub fn max_per_key(items: &[(String, i64)]) -> HashMap<&str, i64> {
    let mut m: HashMap<&str, i64> = HashMap::new();
    for (k, t) in items {
        let e = m.entry(k.as_str()).or_insert(*t);
        *e = (*e).max(*t);
    }
    m
}
