//! A real headless browser for tests: Debian's chromium, driven through
//! chromedriver over WebDriver (fantoccini). Missing binaries fail the test
//! with what to install; they never skip it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder};
use serde_json::{json, Value};

/// What to install when a binary is missing.
const INSTALL: &str = "the dashboard test drives a real browser: install Debian's chromium and \
     chromedriver with `apt-get install -y chromium chromium-driver` (.ci/run does), or point \
     CHROMIUM and CHROMEDRIVER at the binaries";

/// `var` if set, else the first of `names` on PATH or in /usr/bin.
fn find(var: &str, names: &[&str]) -> PathBuf {
    if let Some(p) = std::env::var_os(var).map(PathBuf::from) {
        assert!(
            p.is_file(),
            "{var}={} is not a file; {INSTALL}",
            p.display()
        );
        return p;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .collect();
    for name in names {
        for dir in &dirs {
            let p = dir.join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!("no {} found; {INSTALL}", names.join(" or "));
}

/// Where tests leave files for people to look at: `target/test-artifacts`.
pub fn artifacts_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    let dir = target.join("test-artifacts");
    std::fs::create_dir_all(&dir).expect("create target/test-artifacts");
    dir
}

pub struct Browser {
    pub client: Client,
    /// chromedriver, leader of its own process group (chromium runs in it).
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver on a free port and opens a headless chromium
    /// session with a fresh profile and a laptop-sized window.
    pub async fn start() -> Browser {
        let chromium = find("CHROMIUM", &["chromium", "chromium-browser"]);
        let chromedriver = find("CHROMEDRIVER", &["chromedriver"]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own group, so that dropping the browser ends chromium too.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}; {INSTALL}", chromedriver.display()));
        let profile = tempfile::tempdir().expect("temp dir");
        let client = connect(port, &chromium, profile.path(), &mut driver).await;
        Browser {
            client,
            driver,
            _profile: profile,
        }
    }

    /// Evaluates `script` (a function body; `arguments` are `args`).
    pub async fn eval(&self, script: &str, args: Vec<Value>) -> Value {
        self.client
            .execute(script, args)
            .await
            .unwrap_or_else(|e| panic!("script failed: {e}\n{script}"))
    }

    /// The text of the first element matching `css`, if there is one.
    pub async fn text(&self, css: &str) -> Option<String> {
        let v = self
            .eval(
                "const e = document.querySelector(arguments[0]); return e ? e.textContent.trim() : null;",
                vec![json!(css)],
            )
            .await;
        v.as_str().map(str::to_string)
    }

    /// Waits up to `limit` for `check` to answer `Some`; on timeout, saves
    /// a screenshot named after `what` and fails saying what was awaited.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, limit: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(v) = check().await {
                return v;
            }
            if Instant::now() > deadline {
                let shot = self.screenshot("dashboard-failure.png").await;
                panic!(
                    "the page did not show {what} within {limit:?}; screenshot: {}",
                    shot.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Saves a PNG of the window under `target/test-artifacts/`.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("a screenshot");
        let path = artifacts_dir().join(name);
        std::fs::write(&path, png).expect("write the screenshot");
        path
    }

    /// Ends the session (chromium exits) and chromedriver.
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

async fn connect(port: u16, chromium: &Path, profile: &Path, driver: &mut Child) -> Client {
    // Flags for a closed network and a root user: no sandbox (root), no
    // GPU, and nothing that phones home and stalls without a network.
    let args = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ]
    .map(String::from)
    .into_iter()
    .chain([format!("--user-data-dir={}", profile.display())])
    .collect::<Vec<_>>();
    let caps = json!({
        "browserName": "chrome",
        "goog:chromeOptions": {"binary": chromium, "args": args},
    });
    let serde_json::Value::Object(caps) = caps else {
        unreachable!("a JSON object literal")
    };
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut builder =
            ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new());
        let failed = match builder.capabilities(caps.clone()).connect(&url).await {
            Ok(c) => return c,
            Err(e) => e,
        };
        if let Ok(Some(status)) = driver.try_wait() {
            panic!("chromedriver exited ({status}) before a session opened: {failed}; {INSTALL}");
        }
        // chromedriver is still starting: its port does not answer yet.
        if Instant::now() > deadline {
            panic!(
                "no chromium session through chromedriver on port {port} within 30 s: {failed}; {INSTALL}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The whole group: chromedriver and the chromium it started. Only
        // our own child's group, by its id.
        let pgid = self.driver.id() as i32;
        // SAFETY: kill(2) on a process group we created has no memory
        // effects.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
        let _ = self.driver.wait();
    }
}
