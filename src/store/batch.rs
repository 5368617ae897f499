//! Group commit: concurrent store writes of one kind share one statement
//! (or one transaction) and one durable commit.
//!
//! A request hands its item to the batcher and waits for the answer. The
//! batcher takes whatever has queued up (at most `max_batch`), runs it as
//! one batch while the next requests queue, and fans the per-item answers
//! back out. A request arriving while no batch is in flight runs at once as
//! a batch of one; one arriving while a batch is committing goes with the
//! next batch.
//!
//! One batch at a time, in the batcher's own task, back to back: while a
//! batch commits, the next one fills up, and the store pays its
//! per-statement and per-commit cost once per batch. More batches in
//! flight made each smaller and cost Postgres more per decision, at lower
//! throughput (bench/analysis.md has the measurements). And no task
//! spawned per batch: a task and a slot to wait for would put two
//! wake-ups of the store's runtime (often one on each of its threads)
//! between a batch's answer and the next batch's statement, the one
//! stretch of a batcher's cycle that nothing overlaps, which every raising
//! write and first use waits through.
//!
//! The batchers of every kind come from this one mechanism: fence decisions
//! `(key, token)` answered with the key's highest token, and, in single
//! mode, the writes of `Idempotency-Key` first uses, which share batches of
//! records (a first use's in-flight record, with its fence decision when
//! memory does not know its token is the key's durable one, and the
//! answers first uses store after their forwards: see
//! `store::idempotency`); shared mode's admissions and leaves are a third
//! (`admissions`).
//!
//! Nothing about durability changes: a batch's answers are sent only after
//! its statement has committed (synchronous_commit stays on; SQLite commits
//! its one transaction per batch with synchronous=FULL). A batch that does
//! not answer within the timeout is answered with an error, and may still
//! commit later: each kind says why that is safe for it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot};

use super::{bounded, StoreError};

/// Largest batch of any batcher, Postgres or SQLite; beyond it, requests
/// wait for the next one.
pub const MAX_BATCH: usize = 256;

/// The answers of one fence batch: each key's highest token after the batch.
pub type Answers = HashMap<String, i64>;

type Reply<A> = oneshot::Sender<Result<A, String>>;

struct Item<T, A> {
    what: T,
    reply: Reply<A>,
    /// The requester's thread and runtime, to deliver answers in bulk.
    home: Option<(ThreadId, Handle)>,
    /// Sent by `post`: counted in `Batcher::posted` until its batch ran.
    posted: bool,
}

/// A handle on a running batcher of items `T` answered with `A`; cheap to
/// clone.
pub struct Batcher<T, A> {
    tx: mpsc::Sender<Item<T, A>>,
    timeout: Duration,
    /// Posted items whose batch has not run yet (see [`Batcher::drain`]).
    posted: Arc<AtomicUsize>,
}

/// A handle on a batcher that does not keep it running: for the batch
/// runner itself, whose answers carry handles on the batcher they came
/// from (see `admissions`).
pub struct WeakBatcher<T, A> {
    tx: mpsc::WeakSender<Item<T, A>>,
    timeout: Duration,
    posted: Arc<AtomicUsize>,
}

impl<T, A> Batcher<T, A> {
    pub fn downgrade(&self) -> WeakBatcher<T, A> {
        WeakBatcher {
            tx: self.tx.downgrade(),
            timeout: self.timeout,
            posted: self.posted.clone(),
        }
    }
}

impl<T, A> WeakBatcher<T, A> {
    /// The batcher, unless every handle on it has gone.
    pub fn upgrade(&self) -> Option<Batcher<T, A>> {
        Some(Batcher {
            tx: self.tx.upgrade()?,
            timeout: self.timeout,
            posted: self.posted.clone(),
        })
    }
}

impl<T, A> Clone for Batcher<T, A> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            timeout: self.timeout,
            posted: self.posted.clone(),
        }
    }
}

impl<T: Send + 'static, A: Send + 'static> Batcher<T, A> {
    /// Starts the batching task. `run` writes a batch of items and answers
    /// each, in the items' order, only once the batch has committed.
    pub fn spawn<F, Fut>(max_batch: usize, timeout: Duration, run: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<A>, StoreError>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::channel::<Item<T, A>>(max_batch * 4);
        let posted = Arc::new(AtomicUsize::new(0));
        let ran = posted.clone();
        tokio::spawn(async move {
            // Each batch ends before the queue is drained again: meanwhile
            // requests pile up into the next, bigger batch (see the module
            // docs).
            while let Some(first) = rx.recv().await {
                let items = take_queued(first, &mut rx, max_batch);
                let posts = items.iter().filter(|i| i.posted).count();
                // A panic in `run` must not stop the batcher: that batch's
                // requesters are told (their replies dropped, so they
                // answer 503), and the next batch runs.
                let batch = run_batch(items, &run, timeout);
                if std::panic::AssertUnwindSafe(batch)
                    .catch_unwind()
                    .await
                    .is_err()
                {
                    tracing::error!(
                        "a store batch panicked; its requests were answered as if the store \
                         were unavailable (a bug: please report it)"
                    );
                }
                // Through a batch, written or failed with it, a panic
                // included: `drain` must not wait for them until its limit.
                ran.fetch_sub(posts, Ordering::AcqRel);
            }
        });
        Self {
            tx,
            timeout,
            posted,
        }
    }

    /// Waits until every item posted so far has been through a batch
    /// (written, or failed with it), for up to `limit`: for a clean
    /// shutdown. False if some had not by then.
    pub async fn drain(&self, limit: Duration) -> bool {
        let until = tokio::time::Instant::now() + limit;
        while self.posted.load(Ordering::Acquire) > 0 {
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        true
    }

    /// Writes `what` as part of a coming batch, answering nobody: for
    /// writes whose loss is safe and whose requester does not wait (see
    /// `admissions`' leaves). A full queue is waited for in a task of the
    /// current runtime. False when the batcher stopped, or the queue is
    /// full outside a runtime: the item is then not written.
    pub fn post(&self, what: T) -> bool {
        let (reply, _) = oneshot::channel();
        let item = Item {
            what,
            reply,
            home: None,
            posted: true,
        };
        // Counted before it can reach a batch, which counts it out.
        self.posted.fetch_add(1, Ordering::AcqRel);
        let sent = match self.tx.try_send(item) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(item)) => match Handle::try_current() {
                Ok(rt) => {
                    let (tx, posted) = (self.tx.clone(), self.posted.clone());
                    drop(rt.spawn(async move {
                        if tx.send(item).await.is_err() {
                            posted.fetch_sub(1, Ordering::AcqRel);
                        }
                    }));
                    true
                }
                Err(_) => false,
            },
        };
        if !sent {
            self.posted.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }

    /// Writes `what` as part of the next batch; answers once that batch
    /// has committed.
    pub async fn submit(&self, what: T) -> Result<A, StoreError> {
        let (reply, answer) = oneshot::channel();
        let item = Item {
            what,
            reply,
            home: Handle::try_current()
                .ok()
                .map(|rt| (std::thread::current().id(), rt)),
            posted: false,
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

/// One fence decision of a batch: `token` for `key`.
pub struct Decision {
    pub(super) key: String,
    pub(super) token: i64,
}

/// Fence decisions (keys may repeat), each answered with its key's highest
/// token after the batch (equal to the item's token iff it was accepted);
/// `None` when the batch lost the key's answer.
pub type Fences = Batcher<Decision, Option<i64>>;

/// A fence batch's answers in its items' order.
pub fn in_item_order(items: &[Decision], answers: &Answers) -> Vec<Option<i64>> {
    items.iter().map(|d| answers.get(&d.key).copied()).collect()
}

/// Records `token` for `key` as part of the next fence batch; answers the
/// key's highest token once the batch has committed.
pub(super) async fn decide(fences: &Fences, key: &str, token: i64) -> Result<i64, StoreError> {
    fences
        .submit(Decision {
            key: key.to_string(),
            token,
        })
        .await?
        .ok_or_else(|| StoreError::Other("a batch lost a key's answer".into()))
}

/// `first` and whatever else is queued, up to `max_batch` items in all.
fn take_queued<T, A>(
    first: Item<T, A>,
    rx: &mut mpsc::Receiver<Item<T, A>>,
    max_batch: usize,
) -> Vec<Item<T, A>> {
    let mut items = vec![first];
    while items.len() < max_batch {
        match rx.try_recv() {
            Ok(i) => items.push(i),
            Err(_) => break,
        }
    }
    items
}

/// Runs one batch and answers its items: each with its answer once the
/// batch has committed, or all with the batch's error (a failure, a lost
/// answer, or none within `timeout`).
async fn run_batch<T, A, F, Fut>(items: Vec<Item<T, A>>, run: &F, timeout: Duration)
where
    A: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = Result<Vec<A>, StoreError>>,
{
    let mut whats = Vec::with_capacity(items.len());
    let mut waiting = Vec::with_capacity(items.len());
    for item in items {
        whats.push(item.what);
        waiting.push((item.reply, item.home));
    }
    let count = waiting.len();
    let result = match tokio::time::timeout(timeout, run(whats)).await {
        Ok(Ok(answers)) if answers.len() == count => Ok(answers),
        Ok(Ok(_)) => Err("a batch lost an answer".to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    };
    let (mut answers, failed) = match result {
        Ok(a) => (a.into_iter(), None),
        Err(e) => (Vec::new().into_iter(), Some(e)),
    };
    let mut homes: Homes<A> = HashMap::new();
    for (reply, home) in waiting {
        let answer = match &failed {
            Some(e) => Err(e.clone()),
            None => answers
                .next()
                .ok_or_else(|| "a batch lost an answer".to_string()),
        };
        match home {
            Some((thread, rt)) => {
                let home = homes.entry(thread).or_insert_with(|| (rt, Vec::new()));
                home.1.push((reply, answer));
            }
            None => drop(reply.send(answer)),
        }
    }
    deliver(homes);
}

type Answer<A> = Result<A, String>;

/// A batch's answers by the requesters' threads.
type Homes<A> = HashMap<ThreadId, (Handle, Vec<(Reply<A>, Answer<A>)>)>;

/// Sends a batch's answers. Waking a task on another thread's runtime costs
/// a syscall (the runtime's eventfd) per wake-up; a worker thread usually
/// has many requests in one batch, so its answers go to it together, as one
/// task that then wakes each request locally.
fn deliver<A: Send + 'static>(homes: Homes<A>) {
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

/// The highest token requested per key in a batch, from its items' keys
/// and tokens.
pub fn max_per_key<'a>(items: impl IntoIterator<Item = (&'a str, i64)>) -> HashMap<&'a str, i64> {
    let mut m: HashMap<&str, i64> = HashMap::new();
    for (key, token) in items {
        let e = m.entry(key).or_insert(token);
        *e = (*e).max(token);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// `drain` waits for posted items to go through a batch, and says so
    /// when they have not within its limit.
    #[tokio::test]
    async fn drain_waits_for_posted_items() {
        let written = Arc::new(Mutex::new(Vec::new()));
        let open = Arc::new(tokio::sync::Notify::new());
        let batcher: Batcher<u32, ()> = {
            let (written, open) = (written.clone(), open.clone());
            Batcher::spawn(8, Duration::from_secs(5), move |items: Vec<u32>| {
                let (written, open) = (written.clone(), open.clone());
                async move {
                    open.notified().await;
                    let n = items.len();
                    written.lock().unwrap().extend(items);
                    Ok(vec![(); n])
                }
            })
        };
        assert!(batcher.post(1));
        assert!(batcher.post(2));
        // The batch is held open: not drained.
        assert!(!batcher.drain(Duration::from_millis(50)).await);
        open.notify_one();
        // The second item may be in a batch of its own.
        let opener = {
            let open = open.clone();
            tokio::spawn(async move {
                loop {
                    open.notify_one();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        assert!(batcher.drain(Duration::from_secs(5)).await);
        opener.abort();
        let mut got = written.lock().unwrap().clone();
        got.sort_unstable();
        assert_eq!(got, vec![1, 2]);
    }

    /// A batcher whose batches record their sizes, and whose first batch
    /// waits until `open` is notified.
    fn sized(open: Arc<tokio::sync::Notify>) -> (Batcher<u32, u32>, Arc<Mutex<Vec<usize>>>) {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let batcher = {
            let sizes = sizes.clone();
            Batcher::spawn(64, Duration::from_secs(5), move |items: Vec<u32>| {
                let (sizes, open) = (sizes.clone(), open.clone());
                async move {
                    let first = sizes.lock().unwrap().is_empty();
                    sizes.lock().unwrap().push(items.len());
                    if first {
                        open.notified().await;
                    }
                    if items.contains(&0) {
                        panic!("a batch that panics");
                    }
                    Ok(items.iter().map(|i| i * 10).collect())
                }
            })
        };
        (batcher, sizes)
    }

    /// One batch at a time: what queues while a batch commits goes out
    /// together in the next one, and each item gets its own answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_queues_during_a_batch_goes_in_the_next_one() {
        let open = Arc::new(tokio::sync::Notify::new());
        let (batcher, sizes) = sized(open.clone());
        // Bounded: a batcher that never runs a batch or never takes the
        // requests fails the test instead of hanging the run.
        let run = async {
            let first = tokio::spawn({
                let b = batcher.clone();
                async move { b.submit(1).await }
            });
            while sizes.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let queued: Vec<_> = (2..=9)
                .map(|i| {
                    let b = batcher.clone();
                    tokio::spawn(async move { b.submit(i).await })
                })
                .collect();
            // Every one of them is in the queue before the first batch ends.
            while batcher.tx.capacity() > batcher.tx.max_capacity() - 8 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            open.notify_one();
            assert_eq!(first.await.unwrap().unwrap(), 10);
            for (i, q) in (2..=9).zip(queued) {
                assert_eq!(q.await.unwrap().unwrap(), i * 10);
            }
        };
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("the two batches ran within 10 s");
        assert_eq!(*sizes.lock().unwrap(), vec![1, 8]);
    }

    /// A batch that panics fails its own items and no others: the batcher
    /// goes on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_that_panics_fails_its_items_and_the_batcher_goes_on() {
        let open = Arc::new(tokio::sync::Notify::new());
        open.notify_one();
        let (batcher, _) = sized(open);
        assert!(batcher.submit(0).await.is_err());
        assert_eq!(batcher.submit(4).await.unwrap(), 40);
    }

    /// A posted item whose batch panicked has been through a batch (it
    /// failed with it): a drain does not wait for it until its limit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_drain_does_not_wait_for_a_batch_that_panicked() {
        let open = Arc::new(tokio::sync::Notify::new());
        open.notify_one();
        let (batcher, sizes) = sized(open);
        assert!(batcher.post(0));
        assert!(batcher.drain(Duration::from_secs(5)).await);
        assert_eq!(*sizes.lock().unwrap(), vec![1]);
    }
}
