//! A private Postgres server, for tests that stop, restart, replicate and
//! promote it; and the one the tests share when no other answers
//! ([`PrivatePg::start_for_the_run`]).
//!
//! Every server is stopped when its `PrivatePg` is dropped, also when a test
//! panics (`pg_ctl stop -m immediate`), and its data directory removed; the
//! shared one, once the test process has exited.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::shared_servers;

/// initdb's options of every server here but a standby's.
const INITDB: &[&str] = &["--auth=trust", "-E", "UTF8"];

const STOP_IMMEDIATE: &[&str] = &["-m", "immediate", "-w", "stop"];

pub struct PrivatePg {
    pub port: u16,
    data: PathBuf,
    bin: PathBuf,
    _dir: tempfile::TempDir,
}

fn pg_bin() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    versions.sort();
    versions
        .pop()
        .filter(|p| p.join("initdb").exists())
        .unwrap_or_else(|| panic!("no PostgreSQL server binaries under /usr/lib/postgresql: apt-get install postgresql"))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A Postgres tool to run as the `postgres` user (initdb refuses root).
fn postgres_tool(bin: &std::path::Path, tool: &str) -> Command {
    assert!(
        bin.join(tool).exists(),
        "{tool} is missing from {}: apt-get install postgresql",
        bin.display()
    );
    let is_root = unsafe { libc::geteuid() } == 0;
    if is_root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin.join(tool));
        c
    } else {
        Command::new(bin.join(tool))
    }
}

/// Runs a Postgres tool as the `postgres` user.
fn as_postgres(bin: &std::path::Path, tool: &str, args: &[&str]) -> std::process::Output {
    let mut cmd = postgres_tool(bin, tool);
    cmd.args(args).output().unwrap_or_else(|e| {
        panic!(
            "run {tool}: {e} (running as root needs runuser, from util-linux, and a postgres user)"
        )
    })
}

/// A temp dir the `postgres` user owns.
fn postgres_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("fg-pg-")
        .tempdir_in("/tmp")
        .expect("temp dir");
    if unsafe { libc::geteuid() } == 0 {
        let st = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path())
            .status()
            .expect("chown");
        assert!(st.success(), "chown of the private Postgres dir failed");
    }
    dir
}

impl PrivatePg {
    pub fn start() -> PrivatePg {
        Self::start_with(&[])
    }

    /// A server with `settings` (name, value) added to its postgresql.conf.
    pub fn start_with(settings: &[(&str, &str)]) -> PrivatePg {
        let pg = Self::new_data(pg_bin(), "initdb", INITDB);
        pg.configure(settings);
        pg.start_again();
        pg
    }

    /// A server for the rest of this process, which its tests share
    /// (see [`shared_servers`]); returns its URL. No guard stops it: the
    /// watchdog armed before it starts does, once the process has exited,
    /// and removes its files.
    pub fn start_for_the_run() -> String {
        let pg = Self::new_data(pg_bin(), "initdb", INITDB);
        shared_servers::at_exit(&pg.stop_immediate_command(), pg._dir.path());
        pg.start_again();
        let url = pg.url();
        // Its Drop would stop it now.
        std::mem::forget(pg);
        url
    }

    /// A streaming standby of `primary`, made with `pg_basebackup -R` and
    /// started, with `settings` added (later lines win over the primary's,
    /// which the base backup copied).
    pub fn standby_of(primary: &PrivatePg, name: &str, settings: &[(&str, &str)]) -> PrivatePg {
        let port = primary.port.to_string();
        let pg = Self::new_data(
            primary.bin.clone(),
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
            ],
        );
        let mut all = vec![("cluster_name", name)];
        all.extend_from_slice(settings);
        pg.configure(&all);
        pg.start_again();
        pg
    }

    /// A server not started yet, on a free port, whose data directory `tool`
    /// (initdb or pg_basebackup, which take the same options for these)
    /// made with `args`: owned by the `postgres` user, not synced to disk
    /// (the tests crash servers, not machines).
    fn new_data(bin: PathBuf, tool: &str, args: &[&str]) -> PrivatePg {
        let dir = postgres_dir();
        let data = dir.path().join("data");
        let mut all = vec!["-D", data.to_str().unwrap(), "-U", "postgres", "--no-sync"];
        all.extend_from_slice(args);
        let out = as_postgres(&bin, tool, &all);
        assert!(
            out.status.success(),
            "{tool} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PrivatePg {
            port: free_port(),
            data,
            bin,
            _dir: dir,
        }
    }

    /// Appends settings to postgresql.conf (read at the next start, or
    /// reload).
    fn configure(&self, settings: &[(&str, &str)]) {
        use std::io::Write;
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.conf"))
            .expect("open postgresql.conf");
        for (name, value) in settings {
            writeln!(conf, "{name} = '{}'", value.replace('\'', "''"))
                .expect("write postgresql.conf");
        }
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `pg_ctl promote`: the standby becomes a primary; returns once it
    /// takes writes.
    pub fn promote(&self) {
        let out = self.pg_ctl(&["-w", "-t", "30", "promote"]);
        assert!(
            out.status.success(),
            "pg_ctl promote failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts (again) on the same port and data directory.
    pub fn start_again(&self) {
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=on",
            self.port,
            self.data.display()
        );
        let log = self.data.join("server.log");
        let out = self.pg_ctl(&[
            "-l",
            log.to_str().unwrap(),
            "-o",
            &opts,
            "-w",
            "-t",
            "30",
            "start",
        ]);
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "private Postgres did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A crash: `pg_ctl stop -m immediate`.
    pub fn stop_immediate(&self) {
        let _ = self.pg_ctl(STOP_IMMEDIATE);
    }

    /// `stop_immediate`'s command, for a watchdog to run.
    fn stop_immediate_command(&self) -> Command {
        let mut cmd = postgres_tool(&self.bin, "pg_ctl");
        cmd.arg("-D").arg(&self.data).args(STOP_IMMEDIATE);
        cmd
    }

    /// `pg_ctl` with `args` on this server's data directory.
    fn pg_ctl(&self, args: &[&str]) -> std::process::Output {
        let mut all = vec!["-D", self.data.to_str().unwrap()];
        all.extend_from_slice(args);
        as_postgres(&self.bin, "pg_ctl", &all)
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.stop_immediate();
    }
}
