//! Wake-ups for blocking acquires: a waiter sleeps until the lock it wants
//! is released (here or, through Postgres LISTEN or Redis pub/sub, on
//! another instance) instead of polling. Expiry sends no event, so waiters
//! also wake when the holder's lease runs out (see `LockService::acquire`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;

/// Per-name wake-up channels, created on demand and dropped with their last
/// waiter so memory follows the number of waiting names, not all names.
#[derive(Default)]
pub struct Notifier {
    names: Mutex<HashMap<String, (Arc<Notify>, usize)>>,
}

/// A registered interest in one name's release. Register *before* trying to
/// acquire, then await [`Waiter::wait`], so a release between the failed try
/// and the wait is not missed.
pub struct Waiter {
    notifier: Arc<Notifier>,
    name: String,
    notified: std::pin::Pin<Box<OwnedNotified>>,
}

impl Notifier {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn register(self: &Arc<Self>, name: &str) -> Waiter {
        let notify = {
            let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
            let entry = names
                .entry(name.to_string())
                .or_insert_with(|| (Arc::new(Notify::new()), 0));
            entry.1 += 1;
            entry.0.clone()
        };
        let mut notified = Box::pin(notify.notified_owned());
        // Enabled now: a notify_waiters() from here on reaches it.
        notified.as_mut().enable();
        Waiter {
            notifier: self.clone(),
            name: name.to_string(),
            notified,
        }
    }

    /// Wakes everyone waiting for `name`.
    pub fn notify(&self, name: &str) {
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((n, _)) = names.get(name) {
            n.notify_waiters();
        }
    }

    /// Names with waiters, for tests and metrics.
    pub fn waiting_names(&self) -> usize {
        self.names.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Waiter {
    /// Resolves when the name is released (it may be taken again by then).
    pub async fn wait(mut self) {
        self.notified.as_mut().await;
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut names = self
            .notifier
            .names
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = names.get_mut(&self.name) {
            entry.1 -= 1;
            if entry.1 == 0 {
                names.remove(&self.name);
            }
        }
    }
}
