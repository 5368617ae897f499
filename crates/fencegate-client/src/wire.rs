//! The lock API's answers. The gateway serializes these very types, so the
//! two sides share one definition of the wire format.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// A grant, as `POST /_fencegate/locks/{name}` (201) and `.../renew` (200)
/// answer it. `Debug` shows everything but the lease id, which is a secret.
#[derive(Clone, Serialize, Deserialize)]
pub struct Grant {
    /// The lock name.
    pub name: String,
    /// Secret: proves ownership for renew and release.
    pub lease: String,
    /// The fence: above every token the gateway has recorded for the
    /// resource key of the same name.
    pub fence: i64,
    /// What to send as `X-Fence-Token`: a JWT when signing keys are
    /// configured, else the decimal fence.
    pub token: String,
    /// The ttl granted, in milliseconds.
    pub ttl_ms: u64,
    /// When the lease ends by the gateway's clock at grant time; the
    /// backend's clock decides.
    pub expires_at: DateTime<Utc>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("name", &self.name)
            .field("lease", &"<redacted>")
            .field("fence", &self.fence)
            .field("token", &self.token)
            .field("ttl_ms", &self.ttl_ms)
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// What `GET /_fencegate/locks/{name}` shows (never the lease id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The lock name.
    pub name: String,
    /// Whether a lease holds it now.
    pub held: bool,
    /// The holder's fence when held; else the last fence granted for the
    /// name (0 if none ever was).
    pub fence: i64,
    /// Time left on the holder's lease, when held.
    pub expires_in_ms: Option<u64>,
    /// While a lock-delay runs after an expiry: when the name may be granted
    /// again (RFC 3339; the backend's clock decides, this is its reading
    /// turned into wall time by the gateway). Absent otherwise, so that
    /// answers without a delay keep their shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delayed_until: Option<DateTime<Utc>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn grant_debug_hides_the_lease() {
        let g: Grant = serde_json::from_value(json!({
            "name": "doc:a", "lease": "0123456789abcdef0123456789abcdef",
            "fence": 7, "token": "7", "ttl_ms": 5000,
            "expires_at": "2030-01-01T00:00:00Z"
        }))
        .unwrap();
        let shown = format!("{g:?}");
        assert!(!shown.contains("0123456789abcdef"), "{shown}");
        assert!(shown.contains("fence: 7"), "{shown}");
    }

    #[test]
    fn status_without_a_delay_has_no_delayed_until() {
        let st = Status {
            name: "doc:a".into(),
            held: false,
            fence: 3,
            expires_in_ms: None,
            delayed_until: None,
        };
        let v = serde_json::to_value(&st).unwrap();
        assert_eq!(
            v,
            json!({"name": "doc:a", "held": false, "fence": 3, "expires_in_ms": null})
        );
        assert_eq!(serde_json::from_value::<Status>(v).unwrap(), st);
    }
}
