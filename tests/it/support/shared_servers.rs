//! The Postgres and Redis that tests share (each test on a database or on
//! keys of its own): the server `DATABASE_URL` / `REDIS_URL` names; with the
//! variable unset, the one on the default port, if something accepts
//! connections there; and when nothing does, a private server that this test
//! binary starts when a test first needs it and every later test of the run
//! uses too, so that the suite needs the server binaries but no server.
//!
//! `FENCEGATE_TEST_PRIVATE_SERVERS=1` goes straight to the private servers,
//! whatever the variables say and whatever answers on the default ports: the
//! way to run that path on a machine whose shared servers are in use by
//! others and must stay up. A variable rather than probing configurable
//! addresses, so the probe itself always looks where the defaults point.
//!
//! A private server outlives every guard the tests could hold: statics are
//! never dropped, and a killed process runs no code at all. So each one is
//! stopped by a watchdog ([`at_exit`]) once the test process has gone,
//! however it went.

use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use super::pg::PrivatePg;
use super::redis::PrivateRedis;

/// Set to `1`, the tests start their own servers even when others answer.
pub const FORCE_PRIVATE: &str = "FENCEGATE_TEST_PRIVATE_SERVERS";

pub static POSTGRES: SharedServer = SharedServer {
    what: "Postgres",
    env: "DATABASE_URL",
    default_url: "postgres://postgres@127.0.0.1:5432/postgres",
    default_port: 5432,
    package: "postgresql",
    start_private: PrivatePg::start_for_the_run,
    url: OnceLock::new(),
};

pub static REDIS: SharedServer = SharedServer {
    what: "Redis",
    env: "REDIS_URL",
    default_url: "redis://127.0.0.1:6379",
    default_port: 6379,
    package: "redis-server",
    start_private: PrivateRedis::start_for_the_run,
    url: OnceLock::new(),
};

/// One kind of shared server, and where this run found it.
pub struct SharedServer {
    what: &'static str,
    /// The variable that names it.
    env: &'static str,
    default_url: &'static str,
    /// The port of `default_url`, on 127.0.0.1.
    default_port: u16,
    /// Debian's package with the server's binaries.
    package: &'static str,
    /// Starts a private one for the rest of the run, or panics saying why
    /// it cannot; returns its URL.
    start_private: fn() -> String,
    /// Decided once per run; a failure too, so that every test that needs
    /// the server reports it without trying again.
    url: OnceLock<Result<String, String>>,
}

impl SharedServer {
    /// The server's URL; panics, saying what to install or set, when there
    /// is none.
    pub fn url(&self) -> String {
        match self.url.get_or_init(|| self.find()) {
            Ok(url) => url.clone(),
            Err(why) => panic!("{why}"),
        }
    }

    fn find(&self) -> Result<String, String> {
        let why_private = if std::env::var(FORCE_PRIVATE).as_deref() == Ok("1") {
            format!("{FORCE_PRIVATE}=1 asks for")
        } else if let Ok(url) = std::env::var(self.env) {
            return Ok(url);
        } else if accepts(self.default_port) {
            return Ok(self.default_url.to_string());
        } else {
            format!(
                "{} is unset and nothing answers on 127.0.0.1:{}, so the tests start",
                self.env, self.default_port
            )
        };
        std::panic::catch_unwind(self.start_private).map_err(|panic| {
            let detail = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("");
            format!(
                "{why_private} a {what} of their own, which did not start: {detail}\n\
                 The server's binaries are in Debian's {package} package \
                 (apt-get install {package}); or set {env} to a running {what}.",
                what = self.what,
                package = self.package,
                env = self.env,
            )
        })
    }
}

/// Whether something accepts connections on 127.0.0.1:`port`.
fn accepts(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
}

/// Runs `cleanup` (its program and arguments), then removes `dir`, once
/// this process has exited, however it exits: a shell waits for the end of
/// a pipe whose only writer is this process, and the kernel closes that end
/// when the process is gone (an exit, a panic, SIGKILL alike).
///
/// Not `PR_SET_PDEATHSIG`: it fires when the thread that started the child
/// ends, and each test runs on a thread of its own. The shell has a process
/// group of its own so that a Ctrl-C, sent to the run's group, cannot stop
/// it before it has cleaned up.
pub fn at_exit(cleanup: &Command, dir: &Path) {
    let watchdog = Command::new("sh")
        .arg("-c")
        .arg(r#"dir=$1; shift; read -r _; "$@"; rm -rf -- "$dir""#)
        .arg("fencegate-test-watchdog")
        .arg(dir)
        .arg(cleanup.get_program())
        .args(cleanup.get_args())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the watchdog shell: {e}"));
    // Never dropped, so the write end stays open until the process ends
    // (std's pipes are close-on-exec: no other child holds it); the shell
    // exits only after that, and init reaps it.
    std::mem::forget(watchdog);
}
