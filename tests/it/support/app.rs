//! An in-process gateway for tests: `Application::build` on port 0.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fencegate::boot::app::{Application, StartError};
use fencegate::config::Config;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::fenced_put;

/// A `[[routes]]` entry as TOML.
pub fn route(name: &str, path: &str, upstream: &str, key: &str) -> String {
    format!(
        "[[routes]]\nname = \"{name}\"\npath = \"{path}\"\nupstream = \"{upstream}\"\nkey = \"{key}\"\n"
    )
}

/// The usual test route: `/docs/{id}` → `doc:{id}`.
pub fn docs_route(upstream: &str) -> String {
    route("docs", "/docs/{id}", upstream, "doc:{id}")
}

/// A whole config: listeners on port 0, the store, then `extra` (routes and
/// any other sections).
pub fn config_text(store_url: &str, extra: &str) -> String {
    config_sections("", store_url, "timeout_ms = 1500\n", extra)
}

/// A whole config, section by section: listeners on port 0 and the lines
/// `server` in `[server]`, the store at `store_url` and the lines `store` in
/// `[store]`, then `rest` (routes and any other sections). Each part ends
/// with a newline, or is empty.
pub fn config_sections(server: &str, store_url: &str, store: &str, rest: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{server}\
         [store]\nurl = \"{store_url}\"\n{store}{rest}"
    )
}

/// The `[store]` lines of shared mode, with a store timeout that a loaded
/// machine does not run into.
pub const SHARED_STORE: &str = "mode = \"shared\"\ntimeout_ms = 3000\n";

/// A test's config text as a config; it must be valid.
pub fn parse_config(text: &str) -> Config {
    Config::from_toml("test.toml", text, Vec::new())
        .unwrap_or_else(|e| panic!("test config is invalid:\n{e}\n---\n{text}"))
}

/// Why a test's config text is refused, the files it names loaded; it
/// must be invalid.
pub fn config_error(text: &str) -> String {
    match fencegate::boot::load::from_toml("test.toml", text, Vec::new()) {
        Ok(_) => panic!("test config was accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

pub struct TestApp {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub http: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl TestApp {
    pub async fn spawn(store_url: &str, extra: &str) -> TestApp {
        match Self::try_spawn(store_url, extra).await {
            Ok(a) => a,
            Err(e) => panic!("gateway did not start: {e}"),
        }
    }

    pub async fn try_spawn(store_url: &str, extra: &str) -> Result<TestApp, StartError> {
        Self::from_config(parse_config(&config_text(store_url, extra))).await
    }

    /// A gateway on the whole config `text`.
    pub async fn from_text(text: &str) -> TestApp {
        match Self::from_config(parse_config(text)).await {
            Ok(a) => a,
            Err(e) => panic!("gateway did not start: {e}"),
        }
    }

    pub async fn from_config(config: Config) -> Result<TestApp, StartError> {
        let app = Application::build(config).await?;
        let addr = app.traffic_addr();
        let admin = app.admin_addr();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let ran = app.run(async move {
                let _ = rx.await;
            });
            ran.await.expect("the gateway's worker threads start");
        });
        Ok(TestApp {
            addr,
            admin,
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()
                .expect("reqwest client"),
            stop: Some(tx),
            task: Some(task),
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// `GET path` on the admin listener, which must answer.
    pub async fn admin_get(&self, path: &str) -> reqwest::Response {
        let resp = self.http.get(self.admin_url(path)).send().await;
        resp.expect("admin answered")
    }

    /// The admin listener's Prometheus text.
    pub async fn metrics(&self) -> String {
        self.admin_get("/metrics")
            .await
            .text()
            .await
            .expect("metrics text")
    }

    /// A fenced PUT with an optional raw token header value.
    pub async fn put(&self, path: &str, token: Option<&str>, body: &str) -> reqwest::Response {
        let mut req = self.http.put(self.url(path)).body(body.to_string());
        if let Some(t) = token {
            req = req.header("x-fence-token", t);
        }
        req.send().await.expect("gateway answered")
    }

    /// PUTs `body` with `token` on `path` until the answer is not 503, for
    /// up to `limit`: a write while the store recovers. Every 503 must be
    /// a problem document (nothing is forwarded then); the first other
    /// answer is returned.
    pub async fn put_until_not_503(
        &self,
        path: &str,
        token: &str,
        body: &str,
        limit: Duration,
    ) -> reqwest::Response {
        let request = || fenced_put(&self.http, self.url(path), token, body.to_string());
        until_not_503(limit, request).await.0
    }

    /// A write of `token` on `path` that must be refused as stale: 409,
    /// naming `highest` as the highest token recorded for its key.
    pub async fn assert_stale(&self, path: &str, token: &str, body: &str, highest: i64) {
        let answer = problem(self.put(path, Some(token), body).await, 409).await;
        assert_eq!(
            answer["highest_token"], highest,
            "{token} on {path}: {answer}"
        );
    }

    /// `GET /_fencegate/locks/{name}`: the status document (200 asserted).
    pub async fn lock_status(&self, name: &str) -> serde_json::Value {
        let r = self
            .http
            .get(self.url(&format!("/_fencegate/locks/{name}")))
            .send()
            .await
            .expect("gateway answered");
        assert_eq!(r.status(), 200);
        r.json().await.expect("status is JSON")
    }

    /// Graceful stop; waits until the gateway has released its store.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// The answer's `Content-Type`, empty when it has none (or one that is not
/// text): tests compare it whole, so an absent header reads as a mismatch.
pub fn content_type(resp: &reqwest::Response) -> String {
    resp.headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// `answer`'s `detail` (a problem's, or /readyz's) mentions `phrase`.
pub fn assert_detail_says(answer: &serde_json::Value, phrase: &str) {
    let detail = answer["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(phrase), "{answer}");
}

/// Reads a problem+json answer, checking the content type and base fields.
pub async fn problem(resp: reqwest::Response, status: u16) -> serde_json::Value {
    assert_eq!(resp.status().as_u16(), status, "unexpected status");
    assert_eq!(content_type(&resp), "application/problem+json");
    let body: serde_json::Value = resp.json().await.expect("problem body is JSON");
    assert_eq!(body["status"], status);
    for field in ["type", "title", "detail"] {
        assert!(body[field].is_string(), "problem lacks {field}: {body}");
    }
    body
}

/// Sends what `request` builds until the answer is not 503, for up to
/// `limit`: every 503 must be a problem document. Answers the first other
/// answer, and the problem types of the 503s before it.
pub async fn until_not_503(
    limit: Duration,
    mut request: impl FnMut() -> reqwest::RequestBuilder,
) -> (reqwest::Response, Vec<String>) {
    let deadline = Instant::now() + limit;
    let mut refused = Vec::new();
    loop {
        let resp = request().send().await.expect("gateway answered");
        if resp.status() != 503 {
            return (resp, refused);
        }
        let body = problem(resp, 503).await;
        refused.push(body["type"].as_str().unwrap_or_default().to_string());
        assert!(
            Instant::now() < deadline,
            "still 503 after {limit:?}: {refused:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
