//! A private Postgres server, for tests that stop and restart it. Never the
//! shared one.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

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

/// Runs a Postgres tool as the `postgres` user (initdb refuses root).
fn as_postgres(bin: &std::path::Path, tool: &str, args: &[&str]) -> std::process::Output {
    let is_root = unsafe { libc::geteuid() } == 0;
    let mut cmd = if is_root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin.join(tool));
        c
    } else {
        Command::new(bin.join(tool))
    };
    cmd.args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {tool}: {e}"))
}

impl PrivatePg {
    pub fn start() -> PrivatePg {
        let bin = pg_bin();
        let dir = tempfile::Builder::new()
            .prefix("fg-pg-")
            .tempdir_in("/tmp")
            .expect("temp dir");
        let data = dir.path().join("data");
        if unsafe { libc::geteuid() } == 0 {
            let st = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .expect("chown");
            assert!(st.success(), "chown of the private Postgres dir failed");
        }
        let out = as_postgres(
            &bin,
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let pg = PrivatePg {
            port: free_port(),
            data,
            bin,
            _dir: dir,
        };
        pg.start_again();
        pg
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts (again) on the same port and data directory.
    pub fn start_again(&self) {
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=on",
            self.port,
            self.data.display()
        );
        let log = self.data.join("server.log");
        let out = as_postgres(
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-o",
                &opts,
                "-w",
                "-t",
                "30",
                "start",
            ],
        );
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
        let _ = as_postgres(
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.stop_immediate();
    }
}
