//! Redis for tests: the shared server (`REDIS_URL`, or see
//! [`shared_servers`], for tests that only use unique lock names), or a
//! private `redis-server` child process (for tests that FLUSHALL, stop,
//! pause, restart, replicate or promote it), a private Sentinel group
//! ([`SentinelGroup`]), and a TCP proxy the test switches from one server to
//! another ([`SwitchProxy`], a VIP's stand-in).
//!
//! Every process here is a child killed by its guard's `Drop`, so a failing
//! test leaves none behind, but for the shared server when the tests started
//! it, killed once the test process has exited; every wait is bounded.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::sessions::Sessions;
use super::shared_servers;

/// The shared Redis: `REDIS_URL`, by default `redis://127.0.0.1:6379`, or
/// the tests' own when nothing answers there.
pub fn shared_redis_url() -> String {
    shared_servers::REDIS.url()
}

/// The shared Redis's URL, after checking that it answers PING.
pub fn require_shared_redis() -> String {
    let url = shared_redis_url();
    if let Err(e) = ping(&url, Duration::from_secs(2)) {
        panic!(
            "cannot reach the shared Redis at {url}: {e}\n\
             point REDIS_URL at a Redis server, or unset it: with nothing answering on \
             127.0.0.1:6379 the tests start a Redis of their own (Debian's redis-server package)"
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

/// What to install when `redis-server` is missing.
const INSTALL: &str = "install Redis: apt-get install redis-server (Debian's package also \
     provides Sentinel, run as redis-server --sentinel; on other systems install redis-sentinel too)";

/// A `redis-server` of this test's own, on a free port, with no persistence.
pub struct PrivateRedis {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Arguments beyond the defaults (`--replicaof ...`), kept for restarts.
    extra: Vec<String>,
}

impl PrivateRedis {
    /// Starts one and waits until it answers PING.
    pub fn start() -> PrivateRedis {
        Self::start_with(&[])
    }

    /// Starts one with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> PrivateRedis {
        let dir = tempfile::tempdir().expect("temp dir");
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let mut last = String::new();
        // The port is free when we look; another process may take it before
        // redis-server binds it, so try a few.
        for _ in 0..5 {
            let port = free_port();
            match spawn(port, dir.path(), &extra) {
                Ok(child) => {
                    return PrivateRedis {
                        port,
                        child: Some(child),
                        dir,
                        extra,
                    }
                }
                Err(e) => last = e,
            }
        }
        panic!("redis-server did not start: {last}");
    }

    /// A server for the rest of this process, which its tests share (see
    /// [`shared_servers`]); returns its URL. No guard kills it: a watchdog
    /// does, once the process has exited, and removes its directory.
    pub fn start_for_the_run() -> String {
        let redis = Self::start();
        let pid = redis.child.as_ref().expect("a started server").id();
        let mut kill = Command::new("kill");
        kill.args(["-KILL", &pid.to_string()]);
        shared_servers::at_exit(&kill, redis.dir.path());
        let url = redis.url();
        // Its Drop would kill it now.
        std::mem::forget(redis);
        url
    }

    /// A replica of `master` (`--replicaof`), once its link to the master
    /// is up and the first sync is done.
    pub fn replica_of(master: &PrivateRedis) -> PrivateRedis {
        Self::replica_of_port(master.port)
    }

    /// A replica of the master at `port` on 127.0.0.1 (which may be a
    /// [`SwitchProxy`] in front of it, so the test can cut the link).
    pub fn replica_of_port(port: u16) -> PrivateRedis {
        let master = port;
        let port = port.to_string();
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &port]);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let info: String = command(&replica.url(), redis::cmd("INFO").arg("replication"));
            if info.contains("master_link_status:up") {
                return replica;
            }
            assert!(
                Instant::now() < deadline,
                "the replica on {} did not sync with {master}:\n{info}",
                replica.port,
            );
            std::thread::sleep(Duration::from_millis(50));
        }
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
            match spawn(self.port, self.dir.path(), &self.extra) {
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

    /// `ROLE`'s first word: "master" or "slave".
    pub fn role(&self) -> String {
        let v: Vec<redis::Value> = command(&self.url(), &redis::cmd("ROLE"));
        match v.first() {
            Some(first) => redis::from_redis_value(first).expect("a role name"),
            None => panic!("ROLE answered nothing"),
        }
    }

    /// `REPLICAOF NO ONE`: a replica becomes a master with what it has.
    pub fn promote(&self) {
        command::<()>(&self.url(), redis::cmd("REPLICAOF").arg("NO").arg("ONE"));
        assert_eq!(self.role(), "master");
    }

    /// `REPLICAOF 127.0.0.1 <master>`: a master becomes a replica (and, once
    /// it syncs, takes the other's data).
    pub fn demote_to(&self, master: &PrivateRedis) {
        command::<()>(
            &self.url(),
            redis::cmd("REPLICAOF").arg("127.0.0.1").arg(master.port),
        );
        assert_eq!(self.role(), "slave");
    }

    /// Blocks until `n` replicas acknowledged every write so far (`WAIT`),
    /// at most 5 s; panics otherwise.
    pub fn wait_replicated(&self, n: i64) {
        // Not WAIT: it waits for the writes of the connection it is sent
        // on, and this one has made none. Compare offsets instead: every
        // write made so far, by any client, is below the master's offset.
        let info = |url: &str| -> String { command(url, redis::cmd("INFO").arg("replication")) };
        let field = |text: &str, name: &str| -> Option<i64> {
            text.lines()
                .find_map(|l| l.trim().strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
        };
        let target = field(&info(&self.url()), "master_repl_offset:")
            .expect("master_repl_offset in INFO replication");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = info(&self.url());
            // Lines like `slave0:ip=...,port=...,state=online,offset=123,lag=0`.
            let caught_up = text
                .lines()
                .filter(|l| l.starts_with("slave"))
                .filter_map(|l| l.split(',').find_map(|kv| kv.strip_prefix("offset=")))
                .filter_map(|o| o.trim().parse::<i64>().ok())
                .filter(|&o| o >= target)
                .count() as i64;
            if caught_up >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{caught_up} of {n} replicas reached offset {target}:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// How many times `command` (lower case) ran on this server
    /// (`INFO commandstats`).
    pub fn calls(&self, command_name: &str) -> u64 {
        let info: String = command(&self.url(), redis::cmd("INFO").arg("commandstats"));
        let prefix = format!("cmdstat_{command_name}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// How many clients of this server are subscribed to `channel`.
    pub fn subscribers(&self, channel: &str) -> i64 {
        let v: Vec<redis::Value> =
            command(&self.url(), redis::cmd("PUBSUB").arg("NUMSUB").arg(channel));
        match v.get(1) {
            Some(n) => redis::from_redis_value(n).expect("a count"),
            None => 0,
        }
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
fn spawn(port: u16, dir: &Path, extra: &[String]) -> Result<Child, String> {
    let log = dir.join(format!("redis-{port}.log"));
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .args(["--daemonize", "no"])
        // A replica's first sync starts at once, not after Redis's 5 s
        // wait for more replicas to share it.
        .args(["--repl-diskless-sync-delay", "0"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run redis-server ({e}): {INSTALL}"))?;
    answering(child, port, &log)
}

/// Waits until the server `child` started on `port` answers PING, and is
/// the one we started; kills it otherwise.
fn answering(mut child: Child, port: u16, log: &Path) -> Result<Child, String> {
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
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

// --- Sentinel --------------------------------------------------------------

/// A `redis-server --sentinel` of this test's own.
pub struct PrivateSentinel {
    pub port: u16,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl PrivateSentinel {
    /// Starts a Sentinel watching `master_port` as `name`, with the quorum
    /// and short timings of [`SentinelGroup`].
    fn start(name: &str, master_port: u16, quorum: usize) -> PrivateSentinel {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port();
            let conf = dir.path().join(format!("sentinel-{port}.conf"));
            let log = dir.path().join(format!("sentinel-{port}.log"));
            // Sentinel rewrites its config file: it must be writable.
            let text = format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {log}\n\
                 sentinel resolve-hostnames no\n\
                 sentinel monitor {name} 127.0.0.1 {master_port} {quorum}\n\
                 sentinel down-after-milliseconds {name} {down}\n\
                 sentinel failover-timeout {name} {failover}\n\
                 sentinel parallel-syncs {name} 1\n",
                dir = dir.path().display(),
                log = log.display(),
                down = SENTINEL_DOWN_AFTER_MS,
                failover = SENTINEL_FAILOVER_TIMEOUT_MS,
            );
            std::fs::write(&conf, text).expect("write sentinel.conf");
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match child {
                Ok(c) => c,
                Err(e) => panic!("cannot run redis-server --sentinel ({e}): {INSTALL}"),
            };
            match answering(child, port, &log) {
                Ok(child) => {
                    return PrivateSentinel {
                        port,
                        child: Some(child),
                        _dir: dir,
                    }
                }
                Err(e) => last = e,
            }
        }
        panic!("redis-server --sentinel did not start (Sentinel mode needs Debian's redis-server 6.2 or later, or redis-sentinel): {last}");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateSentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// How long a master may not answer before a Sentinel calls it down.
pub const SENTINEL_DOWN_AFTER_MS: u64 = 1000;
/// Sentinel's failover-timeout (also how long before a failed failover is
/// tried again).
pub const SENTINEL_FAILOVER_TIMEOUT_MS: u64 = 5000;

/// A master, one replica and three Sentinels (quorum 2) watching them under
/// one name: the smallest group in which a failover is agreed on by a
/// majority, as in production.
pub struct SentinelGroup {
    pub name: String,
    /// Started as the master; may be killed by the test.
    pub first: PrivateRedis,
    /// Started as its replica; Sentinel promotes it when `first` dies.
    pub second: PrivateRedis,
    pub sentinels: Vec<PrivateSentinel>,
}

impl SentinelGroup {
    /// Starts the group and waits until every Sentinel knows the replica
    /// and the two other Sentinels, so that a failover can be agreed on.
    pub fn start(name: &str) -> SentinelGroup {
        let first = PrivateRedis::start();
        let second = PrivateRedis::replica_of(&first);
        let sentinels: Vec<PrivateSentinel> = (0..3)
            .map(|_| PrivateSentinel::start(name, first.port, 2))
            .collect();
        let group = SentinelGroup {
            name: name.to_string(),
            first,
            second,
            sentinels,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        for s in &group.sentinels {
            loop {
                let peers: Vec<redis::Value> =
                    command(&s.url(), redis::cmd("SENTINEL").arg("SENTINELS").arg(name));
                let replicas: Vec<redis::Value> =
                    command(&s.url(), redis::cmd("SENTINEL").arg("REPLICAS").arg(name));
                if peers.len() == 2 && !replicas.is_empty() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "Sentinel {} knows {} peers and {} replicas after 30 s",
                    s.port,
                    peers.len(),
                    replicas.len()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        group
    }

    /// `redis_sentinels = [...]` as TOML.
    pub fn toml_list(&self) -> String {
        let urls: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("\"{}\"", s.url()))
            .collect();
        format!("[{}]", urls.join(", "))
    }

    pub fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(|s| s.url()).collect()
    }

    /// The master's port as each answering Sentinel names it.
    pub fn named_masters(&self) -> Vec<u16> {
        self.sentinels
            .iter()
            .filter_map(|s| {
                let client = redis::Client::open(s.url()).ok()?;
                let mut con = client
                    .get_connection_with_timeout(Duration::from_millis(500))
                    .ok()?;
                let (_, port): (String, u16) = redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(&self.name)
                    .query(&mut con)
                    .ok()?;
                Some(port)
            })
            .collect()
    }

    /// Waits until every Sentinel names `port` as the master and that
    /// server says it is one, at most `limit`.
    pub fn wait_master(&self, port: u16, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let named = self.named_masters();
            let url = format!("redis://127.0.0.1:{port}");
            let is_master = ping(&url, Duration::from_millis(200)).is_ok() && {
                let v: Vec<redis::Value> = command(&url, &redis::cmd("ROLE"));
                v.first()
                    .and_then(|r| redis::from_redis_value::<String>(r).ok())
                    .as_deref()
                    == Some("master")
            };
            if is_master && named.len() == self.sentinels.len() && named.iter().all(|p| *p == port)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no failover to {port} within {limit:?}: the Sentinels name {named:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

// --- A switchable TCP proxy -------------------------------------------------

/// A TCP proxy on a free port that forwards each new connection to the
/// current target port on 127.0.0.1: the stand-in for a VIP, a DNS name or
/// HAProxy in front of whichever server is the master. The test switches
/// it; whether open sessions are cut at the switch (a VIP moving) or kept
/// (a proxy that leaves them to the old backend) is the test's choice.
/// Runs on the test's runtime; dropping it stops it and every session.
pub struct SwitchProxy {
    pub port: u16,
    target: Arc<AtomicU16>,
    sessions: Sessions,
    accept: tokio::task::AbortHandle,
}

impl SwitchProxy {
    pub async fn start(target: u16) -> SwitchProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let target = Arc::new(AtomicU16::new(target));
        let sessions = Sessions::default();
        let accept = {
            let (target, sessions) = (target.clone(), sessions.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((mut client, _)) = listener.accept().await else {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    let to = target.load(Ordering::SeqCst);
                    let session = tokio::spawn(async move {
                        // A backend that refuses (or none, port 0): the
                        // client sees its connection closed, as through a
                        // real proxy.
                        if to == 0 {
                            return;
                        }
                        if let Ok(mut server) =
                            tokio::net::TcpStream::connect(("127.0.0.1", to)).await
                        {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    sessions.track(session.abort_handle());
                }
            })
            .abort_handle()
        };
        SwitchProxy {
            port,
            target,
            sessions,
            accept,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Closes every session and refuses new ones (by closing them at once):
    /// a partition between the two sides.
    pub fn cut_off(&self) {
        self.switch(0, true);
    }

    /// New connections go to `port` from now on; with `cut`, every open
    /// session is closed too.
    pub fn switch(&self, port: u16, cut: bool) {
        self.target.store(port, Ordering::SeqCst);
        if cut {
            self.sessions.close_all();
        }
    }
}

impl Drop for SwitchProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.sessions.close_all();
    }
}
