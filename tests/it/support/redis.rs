//! Redis for tests: the shared server (`REDIS_URL`, for tests that only
//! use unique lock names), or a private `redis-server` child process (for
//! tests that FLUSHALL, stop or restart it).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The shared Redis: `REDIS_URL`, by default `redis://127.0.0.1:6379`.
pub fn shared_redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string())
}

/// The shared Redis's URL, after checking that it answers PING.
pub fn require_shared_redis() -> String {
    let url = shared_redis_url();
    if let Err(e) = ping(&url, Duration::from_secs(2)) {
        panic!(
            "cannot reach the shared Redis at {url}: {e}\n\
             start it with: redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 \
             --save \"\" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log\n\
             (or point REDIS_URL at a Redis server)"
        );
    }
    url
}

/// PING on a fresh connection.
pub fn ping(url: &str, timeout: Duration) -> Result<(), String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut con = client
        .get_connection_with_timeout(timeout)
        .map_err(|e| e.to_string())?;
    con.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    redis::cmd("PING")
        .query::<String>(&mut con)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Runs one command on `url` and returns its answer.
pub fn command<T: redis::FromRedisValue>(url: &str, cmd: &redis::Cmd) -> T {
    let client = redis::Client::open(url).expect("redis url");
    let mut con = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    cmd.query(&mut con)
        .unwrap_or_else(|e| panic!("redis command on {url}: {e}"))
}

/// A `redis-server` of this test's own, on a free port, with no persistence.
pub struct PrivateRedis {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl PrivateRedis {
    /// Starts one and waits until it answers PING.
    pub fn start() -> PrivateRedis {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut last = String::new();
        // The port is free when we look; another process may take it before
        // redis-server binds it, so try a few.
        for _ in 0..5 {
            let port = free_port();
            match spawn(port, &dir.path().to_path_buf()) {
                Ok(child) => {
                    return PrivateRedis {
                        port,
                        child: Some(child),
                        dir,
                    }
                }
                Err(e) => last = e,
            }
        }
        panic!("redis-server did not start: {last}");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills it (SIGKILL: a crash, and its data is gone).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port (empty: nothing was persisted).
    pub fn start_again(&mut self) {
        self.stop();
        let mut last = String::new();
        for _ in 0..20 {
            match spawn(self.port, &self.dir.path().to_path_buf()) {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis-server did not start again on {}: {last}", self.port);
    }

    /// Whether it answers PING now.
    pub fn is_running(&self) -> bool {
        self.child.is_some() && ping(&self.url(), Duration::from_millis(200)).is_ok()
    }

    pub fn flushall(&self) {
        command::<()>(&self.url(), &redis::cmd("FLUSHALL"));
    }

    /// Whether `key` exists on this server.
    pub fn exists(&self, key: &str) -> bool {
        command::<i64>(&self.url(), redis::cmd("EXISTS").arg(key)) == 1
    }
}

/// `n` private servers, started off the async runtime (starting one
/// blocks until it answers).
pub async fn private_nodes(n: usize) -> Vec<PrivateRedis> {
    tokio::task::spawn_blocking(move || (0..n).map(|_| PrivateRedis::start()).collect())
        .await
        .expect("redis-server start task")
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Starts `redis-server` on `port`; returns once it answers PING.
fn spawn(port: u16, dir: &PathBuf) -> Result<Child, String> {
    let log = dir.join(format!("redis-{port}.log"));
    let mut child = Command::new("redis-server")
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .args(["--daemonize", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run redis-server (is it installed?): {e}"))?;
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            return Err(format!("redis-server on {port} exited ({status}):\n{text}"));
        }
        if ping(&url, Duration::from_millis(200)).is_ok() {
            // Make sure it is ours, not another server that took the port.
            let info: String = command(&url, redis::cmd("INFO").arg("server"));
            if info.contains(&format!("process_id:{}\r\n", child.id())) {
                return Ok(child);
            }
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("port {port} is taken by another Redis"));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "redis-server on {port} did not answer PING within 10 s"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
