//! Command-line interface: `serve`, `check-config`, `migrate`,
//! `demo-backend`, and the operators' commands: `lock run` ([`run`](mod@run)), and
//! `lock acquire|renew|release|status` and `fence get|reset` ([`calls`]),
//! whose exit codes are in [`exit`].

pub mod calls;
pub mod exit;
pub mod locked;
pub mod reach;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::boot::app::Application;

#[derive(Debug, Parser)]
#[command(
    name = "fencegate",
    version,
    about = "A reverse proxy that enforces fencing tokens"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway.
    Serve {
        /// Config file.
        #[arg(long, default_value = "config/fencegate.toml")]
        config: PathBuf,
    },
    /// Validate a config file: exit 0, or print every problem and exit 1.
    CheckConfig {
        /// Config file.
        path: PathBuf,
    },
    /// Apply the store's migrations and exit.
    Migrate {
        /// postgres://... or sqlite://FILE
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
    },
    /// Run only the built-in demo document store.
    DemoBackend {
        #[arg(long, default_value = "127.0.0.1:9000")]
        listen: SocketAddr,
    },
    /// Use a gateway's lock API: run a command under a lock, or make one
    /// call and print its JSON answer.
    Lock {
        #[command(subcommand)]
        command: calls::LockCommand,
    },
    /// Read or reset a key's fence on a gateway's admin listener; prints
    /// the JSON answer.
    Fence {
        #[command(subcommand)]
        command: calls::FenceCommand,
    },
}

/// Runs a parsed command line; the process exit code is the result.
pub async fn run(cli: Cli) -> ExitCode {
    if !matches!(cli.command, Command::Serve { .. }) {
        crate::boot::logging::init(crate::config::LogFormat::Text);
    }
    match cli.command {
        Command::Serve { config } => serve(config).await,
        Command::CheckConfig { path } => match crate::boot::load::load(&path) {
            Ok(crate::boot::load::Loaded { config: c, .. }) => {
                for d in &c.deprecations {
                    eprintln!("{}: warning: {d}", path.display());
                }
                println!(
                    "{}: ok ({} route{})",
                    path.display(),
                    c.routes.len(),
                    if c.routes.len() == 1 { "" } else { "s" }
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        },
        Command::Migrate { database_url } => match crate::store::migrate_url(&database_url).await {
            Ok(()) => {
                println!(
                    "migrations applied to {}",
                    crate::config::redact_url(&database_url)
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("migrate: {e}");
                ExitCode::FAILURE
            }
        },
        Command::DemoBackend { listen } => {
            let listener = match tokio::net::TcpListener::bind(listen).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("demo-backend: cannot bind {listen}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            tracing::info!(listen = %listen, "demo backend listening");
            crate::demo::run(listener, shutdown_signal()).await;
            ExitCode::SUCCESS
        }
        Command::Lock { command } => calls::lock(command).await,
        Command::Fence { command } => calls::fence(command).await,
    }
}

async fn serve(path: PathBuf) -> ExitCode {
    let loaded = match crate::boot::load::load(&path) {
        Ok(l) => {
            crate::boot::logging::init(l.config.log.format);
            l
        }
        Err(e) => {
            eprintln!("{e}");
            eprintln!("fencegate: not starting: the config has problems (see above)");
            return ExitCode::FAILURE;
        }
    };
    let config = &loaded.config;
    for d in &config.deprecations {
        tracing::warn!(config = %path.display(), "{d}");
    }
    no_transparent_huge_pages();
    crate::boot::reload::warn_if_open(config);
    let store_url = crate::config::redact_url(&config.store.url);
    let app = match Application::build_loaded(loaded).await {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fencegate: not starting: {e}");
            return ExitCode::FAILURE;
        }
    };
    tracing::info!(
        traffic = %app.traffic_addr(),
        admin = %app.admin_addr(),
        demo = ?app.demo_addr(),
        store = %store_url,
        "listening"
    );
    match app.run(shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fencegate: not starting: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Turns transparent huge pages off for the gateway's process (Linux's
/// `PR_SET_THP_DISABLE`; only `serve` does it, because the flag is
/// inherited by child processes, and `lock run` starts the operator's
/// command). mimalloc asks for huge pages on its large regions, and the
/// kernel then fills each one by zeroing 2 MiB at the first touch of any
/// byte of it, or compacts memory to find one, while the touching thread
/// waits. When that thread holds a lock of the gate, every fenced write that
/// needs that lock waits too. Over a gateway's first seconds that shows
/// as a p99 of raising writes ten times higher with huge pages, for a few
/// MiB of resident memory less (docs/internals/performance.md links the
/// measurement). Databases and caches advise the same for their latency
/// (Redis warns at start when they are on).
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: PR_SET_THP_DISABLE takes plain integers and touches no
        // memory of ours.
        let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        if rc != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "cannot turn transparent huge pages off for this process; \
                 the first touch of new memory may pause requests"
            );
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
