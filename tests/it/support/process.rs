//! Real gateway processes, for behaviour that is about processes: kill -9,
//! SIGTERM, SIGSTOP.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fencegate"))
}

pub struct GatewayProcess {
    child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// Everything the process wrote to stderr so far.
    pub log: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

impl GatewayProcess {
    /// Writes `config` to a temp file and starts `fencegate serve` on it;
    /// returns once it logged its listening addresses.
    pub fn start(config: &str) -> GatewayProcess {
        Self::try_start(config)
            .unwrap_or_else(|log| panic!("gateway process did not start:\n{log}"))
    }

    /// Like `start`, but returns the log if the process exits instead.
    pub fn try_start(config: &str) -> Result<GatewayProcess, String> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("fencegate.toml");
        std::fs::write(&path, config).expect("write config");
        let mut child = Command::new(binary())
            .args(["serve", "--config"])
            .arg(&path)
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn fencegate");
        let stderr = child.stderr.take().expect("stderr piped");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains(" listening ") || line.contains("\"listening\"") {
                    let _ = tx.send(line.clone());
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
                let (addr, admin) = listening_addresses(&line);
                return Ok(GatewayProcess {
                    child,
                    addr,
                    admin,
                    log,
                    _dir: dir,
                });
            }
            if let Ok(Some(_)) = child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                return Err(log.lock().unwrap().clone());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err(format!(
                    "no 'listening' line within 30 s\n{}",
                    log.lock().unwrap()
                ));
            }
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// The admin listener's Prometheus text.
    pub async fn metrics(&self) -> String {
        let resp = reqwest::get(self.admin_url("/metrics")).await;
        resp.expect("admin answered")
            .text()
            .await
            .expect("metrics text")
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({}, {sig}) failed", self.pid());
    }

    /// kill -9 and reap.
    pub fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// Waits for the process to exit, up to `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The config file it was started with.
    pub fn config_path(&self) -> PathBuf {
        self._dir.path().join("fencegate.toml")
    }

    /// Replaces its config file (for a SIGHUP reload).
    pub fn rewrite_config(&self, config: &str) {
        std::fs::write(self.config_path(), config).expect("rewrite config");
    }

    /// Whether the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SIGCONT first in case a test left it stopped.
            unsafe {
                libc::kill(self.pid(), libc::SIGCONT);
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The traffic and admin addresses of the "listening" log line, text or
/// JSON.
fn listening_addresses(line: &str) -> (SocketAddr, SocketAddr) {
    if line.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
        let addr = |k: &str| {
            v[k].as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("{k} address in {line}"))
        };
        return (addr("traffic"), addr("admin"));
    }
    (
        field(line, "traffic=").expect("traffic address in log"),
        field(line, "admin=").expect("admin address in log"),
    )
}

fn field(line: &str, name: &str) -> Option<SocketAddr> {
    let start = line.find(name)? + name.len();
    let rest = &line[start..];
    let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Runs the binary with arguments and returns (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(binary())
        .args(args)
        .output()
        .expect("run fencegate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
