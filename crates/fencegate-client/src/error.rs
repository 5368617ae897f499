//! What can go wrong in a lock API call.

use std::time::Duration;

/// What can go wrong in a lock API call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// 409 `lock-held`: another holder has the lock (after waiting up to the
    /// `wait` asked for).
    #[error("the lock is held by another holder{}", expiry_note(.expires_in))]
    Held {
        /// Time left on the holder's lease, when the gateway said.
        expires_in: Option<Duration>,
    },
    /// 409 `not-holder`: the lease expired, was released, or never held the
    /// lock.
    #[error("this lease does not hold the lock: it expired, was released, or never held it")]
    NotHolder,
    /// 503: the gateway cannot reach its lock backend or fence store; nothing
    /// was granted.
    #[error("the lock service is unavailable{}", retry_note(.retry_after))]
    Unavailable {
        /// The answer's `Retry-After`, if it had one.
        retry_after: Option<Duration>,
    },
    /// 400: the gateway refused the request (a ttl or wait out of bounds, a
    /// bad name...).
    #[error("bad lock request: {detail}")]
    BadRequest {
        /// The refused field (`ttl_ms`, `wait_ms`, `lease`, `name`, `body`).
        field: Option<String>,
        /// The gateway's explanation.
        detail: String,
    },
    /// The request did not get an answer: connection refused or broken,
    /// timeout, unreadable body.
    #[error("lock request failed: {0}")]
    Http(String),
    /// An answer this client does not know what to do with.
    #[error("unexpected answer from the gateway: {status}: {body}")]
    Unexpected {
        /// The HTTP status code.
        status: u16,
        /// The answer's body (shortened), or why a success body was unusable.
        body: String,
    },
    /// The base URL given to [`LockClient::new`](crate::LockClient::new) is
    /// not usable.
    #[error("invalid base URL: {0}")]
    InvalidBaseUrl(String),
    /// 401 or 403: the gateway does not know this client (no or a wrong
    /// bearer key), or does not let it use this name.
    #[error("{} by the gateway: {detail}", if *.status == 401 { "not authenticated" } else { "forbidden" })]
    Denied {
        /// 401 or 403.
        status: u16,
        /// The gateway's explanation.
        detail: String,
    },
    /// The client cannot be set up as asked: a CA file that cannot be read
    /// or holds no certificate, no trust roots for https, an API key that
    /// cannot be sent in a header.
    #[error("cannot set up the client: {0}")]
    Setup(String),
}

fn expiry_note(d: &Option<Duration>) -> String {
    d.map(|d| format!(" (expires in {} ms)", d.as_millis()))
        .unwrap_or_default()
}

fn retry_note(d: &Option<Duration>) -> String {
    d.map(|d| format!(" (retry after {} s)", d.as_secs()))
        .unwrap_or_default()
}

impl Error {
    /// Whether trying again later may succeed: [`Error::Unavailable`],
    /// [`Error::Http`], and unexpected 5xx, 408 and 429 answers (say, from a
    /// load balancer in front of the gateway).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Unavailable { .. } | Error::Http(_) => true,
            Error::Unexpected { status, .. } => *status >= 500 || matches!(status, 408 | 429),
            _ => false,
        }
    }
}
