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
    // Logging starts in `cli::run`: `serve` logs in its config's format.
    fencegate::boot::cli::run(fencegate::boot::cli::Cli::parse()).await
}
