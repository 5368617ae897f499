//! `fencegate lock run NAME -- CMD [ARGS...]`: a command that runs only
//! while its lock is held, for cron jobs on several machines and leaders.
//!
//! The lock is taken and kept by a [`LeaseKeeper`], which renews it every
//! third of the ttl and says, from this process's monotonic clock, when the
//! lease can no longer be trusted: a refused renewal, or a deadline passed
//! without a successful one (this process was paused, the network was
//! down). CMD runs in a process group of its own, so that on loss the whole
//! group (CMD and whatever it started) gets SIGTERM and, after the grace
//! period, SIGKILL. CMD writes through the gateway with
//! `$FENCEGATE_FENCE_TOKEN`; a write that slips out after the loss is
//! refused there once the next holder has written.
//!
//! SIGINT, SIGTERM and SIGHUP sent to the wrapper go to CMD's group, as a
//! terminal would send them if the wrapper were not there: CMD may trap
//! them and decide when to end, and the wrapper keeps the lease until it
//! does.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitCode, ExitStatus};
use std::time::{Duration, Instant};

use clap::Args;
use fencegate_client::{Error, LeaseKeeper, LockClient};
use tokio::process::Child;
use tokio::signal::unix::{signal, Signal, SignalKind};

use super::exit;
use super::reach::{GatewayArgs, DEFAULT_TTL_MS};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The lock name (the resource key its fence protects).
    pub name: String,
    #[command(flatten)]
    pub gateway: GatewayArgs,
    /// Lease time; renewed every third of it.
    #[arg(long, default_value_t = DEFAULT_TTL_MS)]
    pub ttl_ms: u64,
    /// How long to wait while another holder has the lock (0: give up at
    /// once, exit 75).
    #[arg(long, default_value_t = 0)]
    pub wait_ms: u64,
    /// After the lease is lost: how long CMD's process group has between
    /// SIGTERM and SIGKILL.
    #[arg(long, default_value_t = 5000)]
    pub kill_grace_ms: u64,
    /// The command to run, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// Longest wait asked of the gateway in one acquire: a longer `--wait-ms`
/// is waited in several, each within the gateway's default `max_wait_ms`
/// (60 s) and below the idle timeouts of proxies in between.
const MAX_WAIT_CHUNK: Duration = Duration::from_secs(30);
/// Pause before retrying an acquire that failed for a reason that may pass
/// (the gateway restarting), while `--wait-ms` lasts.
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// Shortest time between two acquires while waiting, should a gateway
/// answer "held" without waiting.
const MIN_ATTEMPT: Duration = Duration::from_millis(50);
/// How long the wrapper waits for CMD to be reaped after SIGKILL (a process
/// stuck in the kernel cannot die at once).
const REAP_LIMIT: Duration = Duration::from_secs(5);
/// How often the wrapper checks, during the grace period, whether CMD's
/// group is empty after CMD itself ended.
const GROUP_POLL: Duration = Duration::from_millis(20);

pub async fn run(args: RunArgs) -> ExitCode {
    ExitCode::from(run_code(args).await)
}

async fn run_code(args: RunArgs) -> u8 {
    let name = args.name.as_str();
    let client = match args.gateway.trust.client(&args.gateway.gateway) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fencegate: lock run: {e}");
            return exit::for_error(&e);
        }
    };
    let mut signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fencegate: lock run: cannot handle signals: {e}");
            return exit::OS_ERROR;
        }
    };
    let ttl = Duration::from_millis(args.ttl_ms);
    let wait = Duration::from_millis(args.wait_ms);
    let keeper = match acquire(&client, name, ttl, wait, &mut signals).await {
        Ok(k) => k,
        Err(code) => return code,
    };

    let mut child = match spawn(&args, &keeper) {
        Ok(c) => c,
        Err(code) => {
            release(keeper, name).await;
            return code;
        }
    };
    // CMD leads its own group: its pid is the group's id. Never 0 or
    // negative: killpg(0) would signal the wrapper's own group.
    let Some(group) = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .filter(|&g| g > 0)
    else {
        eprintln!("fencegate: lock run: the command's process id is unknown");
        return exit::SOFTWARE;
    };

    let lost = keeper.lost();
    tokio::pin!(lost);
    loop {
        let deadline = keeper.valid_until();
        tokio::select! {
            biased;
            status = child.wait() => {
                // Judged when CMD's end is seen: its exit code counts only
                // if the lease held until then.
                let held = keeper.is_held();
                let code = match status {
                    Ok(status) => exit_code(status),
                    Err(e) => {
                        eprintln!("fencegate: lock run: waiting for the command: {e}");
                        exit::SOFTWARE
                    }
                };
                if held {
                    release(keeper, name).await;
                    return code;
                }
                eprintln!(
                    "fencegate: lock run: lost the lock {name} before the command ended ({})",
                    keeper.loss_reason().unwrap_or_else(|| "deadline passed".into())
                );
                // Refused as a rule: the lease is gone.
                let _ = keeper.release().await;
                return exit::LOST;
            }
            _ = &mut lost => break,
            _ = tokio::time::sleep_until(deadline.into()) => {
                if !keeper.is_held() {
                    break;
                }
            }
            sig = signals.recv() => signal_group(group, sig),
        }
    }
    eprintln!(
        "fencegate: lock run: lost the lock {name} ({}); stopping the command",
        keeper
            .loss_reason()
            .unwrap_or_else(|| "no successful renewal before the deadline".into())
    );
    stop(&mut child, group, Duration::from_millis(args.kill_grace_ms)).await;
    // The gateway may still count the lease (this side's deadline is the
    // earlier one): handing it over now spares the next holder the wait.
    // Usually refused: the lease is gone.
    let _ = keeper.release().await;
    exit::LOST
}

/// Starts CMD in a process group of its own, told the lock, its fence and
/// token in its environment; the exit code when it cannot start.
fn spawn(args: &RunArgs, keeper: &LeaseKeeper) -> Result<Child, u8> {
    let program = &args.command[0];
    let mut command = tokio::process::Command::new(program);
    command
        .args(&args.command[1..])
        .env("FENCEGATE_LOCK", &args.name)
        .env("FENCEGATE_FENCE", keeper.fence().to_string())
        .env("FENCEGATE_FENCE_TOKEN", keeper.token())
        .process_group(0)
        .kill_on_drop(false);
    command.spawn().map_err(|e| {
        eprintln!(
            "fencegate: lock run: cannot run {}: {e}",
            program.to_string_lossy()
        );
        match e.kind() {
            std::io::ErrorKind::NotFound => exit::COMMAND_NOT_FOUND,
            _ => exit::CANNOT_EXECUTE,
        }
    })
}

/// Takes the lock, waiting up to `wait` in all: the keeper, or the exit
/// code.
async fn acquire(
    client: &LockClient,
    name: &str,
    ttl: Duration,
    wait: Duration,
    signals: &mut Signals,
) -> Result<LeaseKeeper, u8> {
    let deadline = Instant::now() + wait;
    loop {
        let started = Instant::now();
        let chunk = deadline
            .saturating_duration_since(started)
            .min(MAX_WAIT_CHUNK);
        let tried = tokio::select! {
            r = client.acquire_keeper(name, ttl, chunk) => r,
            sig = signals.recv() => return Err(128 + sig as u8),
        };
        let e = match tried {
            Ok(keeper) => return Ok(keeper),
            Err(e) => e,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let pause = match &e {
            Error::Held { .. } if !left.is_zero() => MIN_ATTEMPT.saturating_sub(started.elapsed()),
            e if e.is_transient() && left > RETRY_PAUSE => {
                eprintln!("fencegate: lock run: {e}; retrying");
                RETRY_PAUSE
            }
            e => {
                eprintln!("fencegate: lock run: {name}: {e}");
                return Err(exit::for_error(e));
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(pause.min(left)) => {}
            sig = signals.recv() => return Err(128 + sig as u8),
        }
    }
}

/// Releases the lease, saying on stderr when that fails (it then expires
/// with its ttl).
async fn release(keeper: LeaseKeeper, name: &str) {
    if let Err(e) = keeper.release().await {
        eprintln!("fencegate: lock run: releasing {name}: {e}");
    }
}

/// SIGTERM to the group, SIGKILL to what is left of it after `grace`, and
/// CMD reaped.
async fn stop(child: &mut Child, group: i32, grace: Duration) {
    signal_group(group, libc::SIGTERM);
    let until = tokio::time::Instant::now() + grace;
    let ended = tokio::time::timeout_at(until, child.wait()).await.is_ok();
    // CMD may end at once and leave children that ignore SIGTERM.
    while ended && group_alive(group) && tokio::time::Instant::now() < until {
        tokio::time::sleep(GROUP_POLL).await;
    }
    if !ended || group_alive(group) {
        signal_group(group, libc::SIGKILL);
    }
    if !ended
        && tokio::time::timeout(REAP_LIMIT, child.wait())
            .await
            .is_err()
    {
        eprintln!("fencegate: lock run: the command did not end after SIGKILL");
    }
}

/// Sends `sig` to the process group `group`; a group that is gone already
/// is not an error.
fn signal_group(group: i32, sig: i32) {
    // SAFETY: killpg(2) has no memory effects; `group` is CMD's group id,
    // checked positive when CMD was started.
    unsafe {
        libc::killpg(group, sig);
    }
}

/// Whether any process is left in the group `group`.
fn group_alive(group: i32) -> bool {
    // SAFETY: as in `signal_group`; signal 0 only checks.
    let rc = unsafe { libc::killpg(group, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// CMD's exit code as a shell reports it: its own, or 128 + the signal
/// that ended it.
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(sig)) => (128 + sig) as u8,
        (None, None) => exit::SOFTWARE,
    }
}

/// The signals passed on to CMD, received by the wrapper.
struct Signals {
    interrupt: Signal,
    terminate: Signal,
    hangup: Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    /// The next signal received.
    async fn recv(&mut self) -> i32 {
        tokio::select! {
            Some(()) = self.interrupt.recv() => libc::SIGINT,
            Some(()) = self.terminate.recv() => libc::SIGTERM,
            Some(()) = self.hangup.recv() => libc::SIGHUP,
            else => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_as_a_shell_reports_them() {
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(42 << 8)), 42);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGTERM)), 143);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
    }
}
