//! The `fencegate` binary's operator commands as real processes (`lock
//! run` supervises processes, so it is tested as one), and a canned HTTP
//! server for answers a test gateway does not give.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

use super::process::binary;

/// The variables the operator commands read; removed from every child so
/// that the test's own environment never leaks in.
const OUR_VARS: &[&str] = &[
    "FENCEGATE_URL",
    "FENCEGATE_ADMIN_URL",
    "FENCEGATE_API_KEY",
    "FENCEGATE_CACERT",
    "FENCEGATE_LEASE",
    "SSL_CERT_FILE",
];

/// A running `fencegate` command, its output captured.
pub struct Cli {
    child: tokio::process::Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Cli {
    /// Starts `fencegate ARGS` with `env` set.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Cli {
        let mut cmd = tokio::process::Command::new(binary());
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for var in OUR_VARS {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().copied());
        let mut child = cmd.spawn().expect("spawn fencegate");
        let stdout = collect(child.stdout.take().expect("stdout piped"));
        let stderr = collect(child.stderr.take().expect("stderr piped"));
        Cli {
            child,
            stdout,
            stderr,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({}, {sig}) failed", self.pid());
    }

    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Waits until stdout contains `needle`, up to `limit`.
    pub async fn wait_for_stdout(&self, needle: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.stdout().contains(needle) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Waits for the exit code, up to `limit` (then kills it and panics).
    pub async fn exit_code(&mut self, limit: Duration) -> i32 {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => {
                let status = status.expect("wait for fencegate");
                // Let the readers take the last of the output.
                tokio::time::sleep(Duration::from_millis(50)).await;
                status.code().unwrap_or(-1)
            }
            Err(_) => {
                let _ = self.child.start_kill();
                panic!(
                    "fencegate did not exit within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    self.stderr()
                );
            }
        }
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SIGCONT first in case a test left it stopped.
            if let Some(pid) = self.child.id() {
                unsafe {
                    libc::kill(pid as i32, libc::SIGCONT);
                }
            }
            let _ = self.child.start_kill();
        }
    }
}

fn collect(from: impl AsyncRead + Unpin + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = text.clone();
    tokio::spawn(async move {
        let mut lines = BufReader::new(from).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let mut t = sink.lock().unwrap();
            t.push_str(&line);
            t.push('\n');
        }
    });
    text
}

/// What a finished command did.
#[derive(Debug)]
pub struct Done {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Done {
    /// Stdout as one JSON document.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {self:?}"))
    }
}

/// Runs `fencegate ARGS` to its end (at most 30 s).
pub async fn cli(args: &[&str], env: &[(&str, &str)]) -> Done {
    let mut c = Cli::start(args, env);
    let code = c.exit_code(Duration::from_secs(30)).await;
    Done {
        code,
        stdout: c.stdout(),
        stderr: c.stderr(),
    }
}

/// Whether a process with this pid exists (a zombie counts).
pub fn process_exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether a process with this pid is alive: it exists and is not a zombie
/// (a grandchild of a test may wait a while for a reaper).
pub fn process_running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// An HTTP server answering every request with a problem document whose
/// status `decide` picks from the request's `Authorization` header; it
/// records the headers it saw.
pub struct CannedServer {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Option<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl CannedServer {
    pub async fn start(decide: fn(Option<&str>) -> u16) -> CannedServer {
        use axum::response::IntoResponse;
        let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
        let log = seen.clone();
        let app = axum::Router::new().fallback(move |headers: http::HeaderMap| {
            let auth = headers
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            log.lock().unwrap().push(auth.clone());
            let status = http::StatusCode::from_u16(decide(auth.as_deref())).unwrap();
            let body = serde_json::json!({
                "type": "urn:fencegate:problem:canned",
                "title": "Canned",
                "status": status.as_u16(),
                "detail": format!("canned {}", status.as_u16()),
            });
            async move {
                (
                    status,
                    [
                        ("content-type", "application/problem+json"),
                        ("www-authenticate", "Bearer"),
                    ],
                    body.to_string(),
                )
                    .into_response()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        CannedServer { addr, seen, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for CannedServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A port where nothing listens (bound, then let go).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}
