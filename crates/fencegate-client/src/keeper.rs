//! [`LeaseKeeper`]: a lease renewed in the background, and the moment it
//! can no longer be trusted.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{Error, Grant, LockClient};

/// The safety margin taken off a lease's ttl: 1% for clock-rate differences
/// between client and backend, plus 2 ms.
fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// The last instant a grant obtained by a request sent at `sent` can be
/// trusted, by the client's monotonic clock. The backend started the lease
/// no earlier than `sent`, so it ends no earlier than `sent + ttl`.
pub(crate) fn valid_until(sent: Instant, grant: &Grant) -> Instant {
    let ttl = Duration::from_millis(grant.ttl_ms);
    sent + ttl.saturating_sub(drift(ttl))
}

/// Keeps a lease alive in the background and says when it is lost.
///
/// Renews every `ttl / 3`, counted from when the last successful renewal
/// request was sent. The lease is *lost*:
///
/// * as soon as a renewal is refused ([`Error::NotHolder`], or another
///   answer that retrying cannot fix, such as [`Error::BadRequest`]);
/// * once its deadline passes: the moment the last successful renewal (or
///   the acquire) was **sent**, plus the ttl, minus a drift margin of
///   `ttl / 100 + 2 ms`. Transient failures ([`Error::Unavailable`],
///   [`Error::Http`], 5xx) are retried until then.
///
/// Loss is final: a keeper never becomes held again. [`LeaseKeeper::is_held`]
/// checks the deadline against the clock itself, so it turns false on time
/// even if the background task is late.
///
/// Dropping the keeper stops renewing but does **not** release the lease:
/// drop may run while unwinding from a panic or outside an async context,
/// where a network call cannot be made (or awaited), and a holder that
/// panicked mid-work should not hand over what may be half-done state
/// before its lease runs out anyway. The lease then expires after its ttl.
/// Call [`LeaseKeeper::release`] to hand the lock over at once.
pub struct LeaseKeeper {
    client: LockClient,
    name: String,
    fence: i64,
    shared: Arc<Shared>,
    lost_rx: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

struct Shared {
    state: Mutex<KeeperState>,
    lost_tx: watch::Sender<bool>,
}

struct KeeperState {
    grant: Grant,
    valid_until: Instant,
    /// Why the lease was lost, once it is.
    lost: Option<String>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, KeeperState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lose(&self, why: String) {
        {
            let mut st = self.state();
            if st.lost.is_none() {
                st.lost = Some(why);
            }
        }
        self.lost_tx.send_replace(true);
    }

    /// Takes a renewal's grant, unless the deadline passed meanwhile (loss is
    /// final). Returns whether the lease is still held.
    fn renewed(&self, grant: Grant, valid_until: Instant) -> bool {
        let mut st = self.state();
        if st.lost.is_some() {
            return false;
        }
        if Instant::now() >= st.valid_until {
            drop(st);
            self.lose("the renewal succeeded only after the deadline".into());
            return false;
        }
        st.grant = grant;
        st.valid_until = st.valid_until.max(valid_until);
        true
    }
}

impl fmt::Debug for LeaseKeeper {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseKeeper")
            .field("name", &self.name)
            .field("fence", &self.fence)
            .field("held", &self.is_held())
            .finish()
    }
}

impl LeaseKeeper {
    /// Starts keeping `grant` alive, renewing it for `ttl` every `ttl / 3`.
    ///
    /// `acquired_at` is when the request that produced `grant` was **sent**
    /// (take `Instant::now()` just before calling
    /// [`acquire`](LockClient::acquire)); the first deadline is
    /// `acquired_at + grant.ttl_ms − drift`. If the acquire waited long, that
    /// deadline may be near or past: renew first, or use
    /// [`LockClient::acquire_keeper`], which does.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime (it spawns the renewing task).
    pub fn start(client: LockClient, grant: Grant, ttl: Duration, acquired_at: Instant) -> Self {
        let name = grant.name.clone();
        let fence = grant.fence;
        let (lost_tx, lost_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            state: Mutex::new(KeeperState {
                valid_until: valid_until(acquired_at, &grant),
                grant,
                lost: None,
            }),
            lost_tx,
        });
        let task = tokio::spawn(keep(
            client.clone(),
            name.clone(),
            fence,
            ttl,
            acquired_at,
            shared.clone(),
        ));
        Self {
            client,
            name,
            fence,
            shared,
            lost_rx,
            task,
        }
    }

    /// The lock name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fence of the lease; renewals keep it.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// The current token to send as `X-Fence-Token`. With JWT tokens it
    /// changes on renewal (a new expiry), so read it for each write.
    pub fn token(&self) -> String {
        self.shared.state().grant.token.clone()
    }

    /// Whether the lease can still be trusted: not lost, and its deadline
    /// (checked against the clock now) not passed.
    pub fn is_held(&self) -> bool {
        let st = self.shared.state();
        st.lost.is_none() && Instant::now() < st.valid_until
    }

    /// The current deadline: the lease is held at most until then, unless
    /// renewed again before.
    pub fn valid_until(&self) -> Instant {
        self.shared.state().valid_until
    }

    /// Why the lease was lost, once it is.
    pub fn loss_reason(&self) -> Option<String> {
        self.shared.state().lost.clone()
    }

    /// Resolves once the lease is lost (at once if it already is). The
    /// future does not borrow the keeper, so it can be moved into a task.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.lost_rx.clone();
        async move {
            // An error means the keeper is gone: not held either.
            let _ = rx.wait_for(|lost| *lost).await;
        }
    }

    /// A watch on loss: the value turns `true` when the lease is lost.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.lost_rx.clone()
    }

    /// Stops renewing and releases the lease, so a waiting acquirer gets the
    /// lock at once. Fails with [`Error::NotHolder`] if the lease had already
    /// ended; the keeper counts as lost from here on either way.
    pub async fn release(self) -> Result<(), Error> {
        self.task.abort();
        let lease = self.shared.state().grant.lease.clone();
        self.shared.lose("released".into());
        self.client.release(&self.name, &lease).await
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        // Stops renewing only; see the type's documentation for why the
        // lease is left to expire rather than released.
        self.task.abort();
    }
}

/// The renewing task.
async fn keep(
    client: LockClient,
    name: String,
    fence: i64,
    ttl: Duration,
    acquired_at: Instant,
    shared: Arc<Shared>,
) {
    let every = (ttl / 3).max(Duration::from_millis(1));
    let retry = (ttl / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut next = acquired_at + every;
    loop {
        let (deadline, lease) = {
            let st = shared.state();
            if st.lost.is_some() {
                return;
            }
            (st.valid_until, st.grant.lease.clone())
        };
        tokio::time::sleep_until(next.min(deadline).into()).await;
        let sent = Instant::now();
        if sent >= deadline {
            tracing::info!(lock = %name, fence, "lease lost: no successful renewal before the deadline");
            shared.lose("no successful renewal before the deadline".into());
            return;
        }
        // Never wait for an answer past the deadline.
        let timeout = (deadline - sent).min(client.timeout());
        match client.renew_within(&name, &lease, ttl, timeout).await {
            Ok(grant) if grant.fence != fence => {
                tracing::warn!(lock = %name, fence, renewed = grant.fence, "renewal changed the fence; treating the lease as lost");
                shared.lose(format!(
                    "the renewal answered fence {} instead of {fence}",
                    grant.fence
                ));
                return;
            }
            Ok(grant) => {
                let granted = Duration::from_millis(grant.ttl_ms).min(ttl);
                let until = sent + granted.saturating_sub(drift(granted));
                if !shared.renewed(grant, until) {
                    tracing::info!(lock = %name, fence, "lease lost: the renewal came too late");
                    return;
                }
                tracing::debug!(lock = %name, fence, "lease renewed");
                next = sent + every;
            }
            Err(e) if e.is_transient() => {
                tracing::warn!(lock = %name, fence, error = %e, "lease renewal failed; retrying until the deadline");
                next = Instant::now() + retry;
            }
            Err(e) => {
                tracing::info!(lock = %name, fence, error = %e, "lease lost: renewal refused");
                shared.lose(format!("renewal refused: {e}"));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(ttl_ms: u64) -> Grant {
        Grant {
            name: "doc:a".into(),
            lease: "0".repeat(32),
            fence: 1,
            token: "1".into(),
            ttl_ms,
            expires_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn a_grant_is_trusted_until_sent_plus_ttl_less_drift() {
        let sent = Instant::now();
        // 1% of 10 s is 100 ms, plus 2 ms.
        assert_eq!(
            valid_until(sent, &grant(10_000)),
            sent + Duration::from_millis(9_898)
        );
        // A ttl shorter than the margin is never trusted past the send.
        assert_eq!(valid_until(sent, &grant(1)), sent);
    }
}
