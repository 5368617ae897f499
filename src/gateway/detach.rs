//! Running a fenced write to its end whatever its client does: polled in
//! the request's own future, and detached into a task of its own only if
//! that future is dropped first ([`DetachOnDrop`]); spawning on the
//! store's runtime where the write must run there ([`spawn_on`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::sync::oneshot;

use super::accounting::Ended;
use super::error::GatewayError;

/// Spawns a fenced write's task on `rt`, or on this worker's runtime.
///
/// The task's future is boxed: it is a few kilobytes (the forward's state
/// is in it), and tokio moves a task's stage whole each time it changes
/// (spawned, finished), where a box moves as a pointer. One allocation
/// costs less than those copies (`bench/profile.sh --instructions`
/// counts both).
pub(super) fn spawn_on(
    rt: Option<tokio::runtime::Handle>,
    task: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let task = Box::pin(task);
    match rt {
        Some(rt) => drop(rt.spawn(task)),
        None => drop(tokio::spawn(task)),
    }
}

/// Whether the client a fenced write answers has left: then a write still
/// waiting to start never starts (see [`FencedWrite::may_start`]).
pub(super) trait ClientPresence: Sync {
    fn left(&self) -> bool;
}

/// A write spawned on its own: its answer's receiver is the client.
impl ClientPresence for oneshot::Sender<Ended> {
    fn left(&self) -> bool {
        self.is_closed()
    }
}

/// A write in the request's future: set when that future is dropped.
impl ClientPresence for AtomicBool {
    fn left(&self) -> bool {
        self.load(Ordering::Acquire)
    }
}

/// A fenced write polled in the request's own future, on the connection's
/// task, and spawned to run to its end only if that future is dropped
/// before it (the client left).
///
/// Why not always spawn: a task per write costs its spawn, a second task
/// woken when the upstream answers, and a channel to hand the answer back,
/// on every fenced write, for a departure that few have. The write's future
/// is boxed either way, so handing it to a task on drop moves a pointer;
/// what it holds (its ticket or permit, the upstream exchange) goes on
/// exactly as in a task spawned at the start.
pub(super) struct DetachOnDrop {
    /// `None` once it has ended (or was handed to a task).
    pub(super) write: Option<Pin<Box<dyn Future<Output = Ended> + Send>>>,
    /// Set when the request's future is dropped before the write ended.
    pub(super) left: Arc<AtomicBool>,
}

impl DetachOnDrop {
    /// `write` as made by `make`, which is handed the flag that says its
    /// client has left (set when this is dropped before the write ended).
    pub(super) fn new<F>(make: impl FnOnce(Arc<AtomicBool>) -> F) -> Self
    where
        F: Future<Output = Ended> + Send + 'static,
    {
        let left = Arc::new(AtomicBool::new(false));
        Self {
            write: Some(Box::pin(make(left.clone()))),
            left,
        }
    }
}

impl Future for DetachOnDrop {
    type Output = Ended;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Ended> {
        let Some(write) = self.write.as_mut() else {
            return Poll::Ready(Err(GatewayError::Internal(
                "a fenced write was polled after its end",
            )));
        };
        let ended = ready!(write.as_mut().poll(cx));
        self.write = None;
        Poll::Ready(ended)
    }
}

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        let Some(write) = self.write.take() else {
            return;
        };
        self.left.store(true, Ordering::Release);
        // A write that panicked is not polled again; outside a runtime
        // (it is shutting down) nothing would run a task.
        if std::thread::panicking() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            drop(rt.spawn(async move { drop(write.await) }));
        }
    }
}

/// Steps behind the tasks already ready on this worker, once: the
/// requests that arrived together are read and decided first, and then
/// go to the upstream together (or, refused, get their answers together).
///
/// Why: under load each send to an upstream on the same machine wakes the
/// upstream's process, which on few cores then takes a core from the
/// gateway's worker in the middle of its batch of ready connections.
/// Sends made one after another wake it once for all of them. Without the
/// step, passed-through GETs and fenced writes polled in the request's
/// future ([`DetachOnDrop`]) were measurably slower (`bench/ab.sh`; the runs
/// are in `bench/analysis.md`); a spawned write takes the same step by
/// being queued behind the ready connections. Under light load nothing
/// else is ready, and the step costs one more poll of the request's task,
/// not a wait.
#[derive(Default)]
pub(super) struct YieldOnce {
    pub(super) stepped: bool,
}

impl Future for YieldOnce {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.stepped {
            return Poll::Ready(());
        }
        self.stepped = true;
        // Woken while it runs: the task goes to the back of the worker's
        // queue, behind the tasks already ready there.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
