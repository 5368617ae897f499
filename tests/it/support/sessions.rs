//! The open sessions of a test's TCP proxy, so the test can close them all
//! at once (a partition, a moved address) and dropping the proxy closes
//! them too.

use std::sync::{Arc, Mutex};

use tokio::task::AbortHandle;

/// The tasks relaying a proxy's open sessions; cloned into its accept loop.
#[derive(Clone, Default)]
pub struct Sessions(Arc<Mutex<Vec<AbortHandle>>>);

impl Sessions {
    /// Adds a session's task, dropping those that ended.
    pub fn track(&self, session: AbortHandle) {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|s| !s.is_finished());
        open.push(session);
    }

    /// Ends every session tracked now: its connections close.
    pub fn close_all(&self) {
        let open = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        for s in open {
            s.abort();
        }
    }
}
