use std::process::ExitCode;

use clap::Parser;

/// glibc's malloc gives every thread an arena that it trims with madvise and
/// regrows with mprotect: syscalls on the request path of a proxy whose
/// per-request allocations come and go on several threads. mimalloc keeps
/// per-thread free lists without those (see BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    fencegate::cli::run(fencegate::cli::Cli::parse()).await
}
