//! `fencegate lock acquire|renew|release|status` and `fencegate fence
//! get|reset`: one HTTP call each, whose JSON answer is printed as it came
//! (one line on stdout, for `jq`), problem documents included; a line on
//! stderr says what failed, and the exit code says it to scripts (see
//! [`exit`]).

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use fencegate_client::{lock_path, segment, Error};
use http::Method;
use serde_json::{json, Value};

use super::exit;
use super::locked::RunArgs;
use super::reach::{AdminArgs, GatewayArgs, Trust, DEFAULT_TTL_MS};

#[derive(Debug, Subcommand)]
pub enum LockCommand {
    /// Take the lock, run a command while holding it, release it when the
    /// command ends; stop the command if the lock is lost.
    Run(RunArgs),
    /// Take the lock; prints the grant (its lease id is a secret).
    Acquire {
        /// The lock name (the resource key its fence protects).
        name: String,
        #[command(flatten)]
        gateway: GatewayArgs,
        /// Lease time.
        #[arg(long, default_value_t = DEFAULT_TTL_MS)]
        ttl_ms: u64,
        /// How long the gateway may wait for another holder to let go.
        #[arg(long, default_value_t = 0)]
        wait_ms: u64,
    },
    /// Extend a lease to ttl from now; prints the grant (same fence).
    Renew {
        name: String,
        #[command(flatten)]
        gateway: GatewayArgs,
        /// The lease id from the grant.
        #[arg(long, env = "FENCEGATE_LEASE", hide_env_values = true)]
        lease: String,
        /// Lease time from now.
        #[arg(long, default_value_t = DEFAULT_TTL_MS)]
        ttl_ms: u64,
    },
    /// Give a lease back; prints nothing (the gateway answers 204).
    Release {
        name: String,
        #[command(flatten)]
        gateway: GatewayArgs,
        /// The lease id from the grant.
        #[arg(long, env = "FENCEGATE_LEASE", hide_env_values = true)]
        lease: String,
    },
    /// Whether the lock is held, its fence, and any running lock-delay.
    Status {
        name: String,
        #[command(flatten)]
        gateway: GatewayArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum FenceCommand {
    /// The highest token recorded for a resource key.
    Get {
        /// The resource key.
        key: String,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Break-glass: set a key's highest token (needs an admin client's
    /// key in $FENCEGATE_API_KEY).
    Reset {
        /// The resource key.
        key: String,
        #[command(flatten)]
        admin: AdminArgs,
        /// The new highest token (it may be lower than the current one).
        #[arg(long, value_parser = clap::value_parser!(i64).range(0..))]
        highest_token: i64,
        /// Why, for the record and the log.
        #[arg(long)]
        reason: String,
    },
}

pub async fn lock(command: LockCommand) -> ExitCode {
    match command {
        LockCommand::Run(args) => super::locked::run(args).await,
        LockCommand::Acquire {
            name,
            gateway,
            ttl_ms,
            wait_ms,
        } => {
            // The gateway may wait `wait_ms` before it answers.
            let wait = Duration::from_millis(wait_ms);
            let call = Call::post(
                lock_path(&name, ""),
                json!({"ttl_ms": ttl_ms, "wait_ms": wait_ms}),
            )
            .waiting(wait);
            call.print(&gateway.trust, &gateway.gateway).await
        }
        LockCommand::Renew {
            name,
            gateway,
            lease,
            ttl_ms,
        } => {
            let call = Call::post(
                lock_path(&name, "/renew"),
                json!({"lease": lease, "ttl_ms": ttl_ms}),
            );
            call.print(&gateway.trust, &gateway.gateway).await
        }
        LockCommand::Release {
            name,
            gateway,
            lease,
        } => {
            let call = Call::post(lock_path(&name, "/release"), json!({ "lease": lease }));
            call.print(&gateway.trust, &gateway.gateway).await
        }
        LockCommand::Status { name, gateway } => {
            let call = Call::get(lock_path(&name, ""));
            call.print(&gateway.trust, &gateway.gateway).await
        }
    }
}

pub async fn fence(command: FenceCommand) -> ExitCode {
    match command {
        FenceCommand::Get { key, admin } => {
            let call = Call::get(format!("/fences/{}", segment(&key)));
            call.print(&admin.trust, &admin.admin).await
        }
        FenceCommand::Reset {
            key,
            admin,
            highest_token,
            reason,
        } => {
            let call = Call::post(
                format!("/fences/{}/reset", segment(&key)),
                json!({"highest_token": highest_token, "reason": reason}),
            );
            call.print(&admin.trust, &admin.admin).await
        }
    }
}

/// One call to make and print.
struct Call {
    method: Method,
    path: String,
    body: Option<Value>,
    /// How long the gateway may take on purpose (a blocking acquire), on
    /// top of the usual time limit.
    wait: Duration,
}

impl Call {
    fn get(path: String) -> Self {
        Self {
            method: Method::GET,
            path,
            body: None,
            wait: Duration::ZERO,
        }
    }

    fn post(path: String, body: Value) -> Self {
        Self {
            method: Method::POST,
            path,
            body: Some(body),
            wait: Duration::ZERO,
        }
    }

    fn waiting(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Makes the call on `base`, prints the answer's JSON on stdout, and
    /// returns the exit code.
    async fn print(self, trust: &Trust, base: &str) -> ExitCode {
        let code = match self.make(trust, base).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("fencegate: {e}");
                exit::for_error(&e)
            }
        };
        ExitCode::from(code)
    }

    async fn make(self, trust: &Trust, base: &str) -> Result<(), Error> {
        let client = trust.client(base)?;
        let client = client.clone().with_timeout(client.timeout() + self.wait);
        let answer = client.send(self.method, &self.path, self.body).await?;
        let body = answer.body();
        let json = !body.is_empty() && serde_json::from_slice::<Value>(body).is_ok();
        if json {
            let mut out = std::io::stdout().lock();
            // A closed stdout (`| head -c0`) is the reader's choice; the
            // exit code still tells what happened.
            let _ = out.write_all(body).and_then(|()| out.write_all(b"\n"));
        }
        if answer.status().is_success() {
            if json || body.is_empty() {
                return Ok(());
            }
            return Err(Error::Unexpected {
                status: answer.status().as_u16(),
                body: "the answer is not JSON".into(),
            });
        }
        Err(answer.into_error())
    }
}
