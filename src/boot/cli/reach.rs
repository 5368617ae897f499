//! Where a gateway's listeners are and how to trust them, as the `lock`
//! and `fence` commands take them from flags and the environment.

use std::path::PathBuf;

use clap::Args;
use fencegate_client::{ClientOptions, Error, LockClient};

/// The default lease time of `lock acquire` and `lock run`: long enough that
/// a renewal every third of it rides out a gateway restart, short enough
/// that a crashed holder's lock frees up soon.
pub const DEFAULT_TTL_MS: u64 = 15_000;

/// Where the lock API is, and how to trust it.
#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// The gateway's traffic listener, where the lock API is.
    #[arg(long, env = "FENCEGATE_URL", default_value = "http://127.0.0.1:8080")]
    pub gateway: String,
    #[command(flatten)]
    pub trust: Trust,
}

/// Where the admin API is, and how to trust it.
#[derive(Debug, Args)]
pub struct AdminArgs {
    /// The gateway's admin listener.
    #[arg(
        long,
        env = "FENCEGATE_ADMIN_URL",
        default_value = "http://127.0.0.1:9090"
    )]
    pub admin: String,
    #[command(flatten)]
    pub trust: Trust,
}

/// TLS trust for https URLs.
#[derive(Debug, Args)]
pub struct Trust {
    /// PEM file of the CA certificate(s) to trust for https, instead of the
    /// platform's trust roots.
    #[arg(long, env = "FENCEGATE_CACERT", value_name = "PATH")]
    pub cacert: Option<PathBuf>,
}

impl Trust {
    /// A client of `base`, with the CA and the bearer key from
    /// `$FENCEGATE_API_KEY` (an environment variable only, so the key never
    /// shows in `ps`).
    pub fn client(&self, base: &str) -> Result<LockClient, Error> {
        let mut options = ClientOptions::new();
        if let Some(path) = &self.cacert {
            options = options.trust_file(path)?;
        }
        if let Some(key) = std::env::var("FENCEGATE_API_KEY")
            .ok()
            .filter(|k| !k.is_empty())
        {
            options = options.api_key(key);
        }
        LockClient::with_options(base, &options)
    }
}
