//! The fence decision: the durable store and the in-process gate together.
//!
//! Order matters (see `gate` for the full argument): take a ticket on the
//! key, record the token durably, then wait at the gate. The token is durable
//! before the write is forwarded, so after a crash or restart anything lower
//! than a forwarded token is still refused.

use std::sync::Arc;

use crate::error::{ClientError, GatewayError};
use crate::gate::{Gate, Permit};
use crate::store::{FenceStore, StoreError};

/// Cheap to clone: a store handle and the shared gate.
#[derive(Clone)]
pub struct Fence {
    pub store: FenceStore,
    pub gate: Arc<Gate>,
}

impl Fence {
    pub fn new(store: FenceStore) -> Self {
        Self {
            store,
            gate: Gate::new(),
        }
    }

    /// Decides a fenced write of `token` on `key`. On success the returned
    /// permit must live until the upstream has finished with the write.
    pub async fn check(&self, key: &str, token: i64) -> Result<Permit, GatewayError> {
        let ticket = self.gate.ticket(key);
        let highest = self.store.record(key, token).await?;
        if highest > token {
            return Err(stale(key, token, highest));
        }
        if highest < token {
            return Err(StoreError::Other(format!(
                "the store answered {highest} for a decision on {token}"
            ))
            .into());
        }
        ticket
            .admit(token)
            .await
            .map_err(|s| stale(key, token, s.highest))
    }
}

fn stale(key: &str, presented: i64, highest: i64) -> GatewayError {
    ClientError::StaleToken {
        key: key.to_string(),
        presented,
        highest,
    }
    .into()
}
