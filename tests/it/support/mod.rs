#![allow(dead_code)]

pub mod app;
pub mod breaches;
pub mod browser;
pub mod cli;
pub mod db;
pub mod holders;
pub mod pg;
pub mod pki;
pub mod process;
pub mod raw_upstream;
pub mod redis;
pub mod reply_loss;
pub mod sessions;
pub mod setups;
pub mod shared_servers;
pub mod upstream;

/// One test per fence store of the case `$case(Backend)`, under the names
/// given: `per_store!(#[tokio::test] case => case_sqlite, case_postgres);`.
macro_rules! per_store {
    (#[$attr:meta] $case:ident => $sqlite:ident, $postgres:ident) => {
        #[$attr]
        async fn $sqlite() {
            $case($crate::support::db::Backend::Sqlite).await
        }

        #[$attr]
        async fn $postgres() {
            $case($crate::support::db::Backend::Postgres).await
        }
    };
}
pub(crate) use per_store;

/// The accessors and `Debug` of a test server that keeps the address it
/// listens on in its field `addr`: the recording upstreams all serve plain
/// HTTP on one address, and a test names them by it.
macro_rules! served_at_addr {
    ($server:ident) => {
        impl $server {
            /// The address the server listens on.
            pub fn addr(&self) -> std::net::SocketAddr {
                self.addr
            }

            /// The base URL, `"http://127.0.0.1:PORT"` (no trailing slash).
            pub fn url(&self) -> String {
                format!("http://{}", self.addr)
            }
        }

        impl std::fmt::Debug for $server {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($server))
                    .field("addr", &self.addr)
                    .finish()
            }
        }
    };
}
pub(crate) use served_at_addr;

/// Sends raw bytes on a new connection and returns what came back first.
pub async fn raw_request(addr: std::net::SocketAddr, raw: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(raw.as_bytes()).await.expect("write");
    let mut buf = vec![0u8; 8192];
    let n = s.read(&mut buf).await.unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Reads one whole request off `tcp` (its head, and a body of its
/// `Content-Length`), for the tests' hand-made upstreams, which must say
/// exactly when a connection ends: its headers as (lowercase name, value),
/// or `None` when the peer closed or broke the connection first.
pub async fn read_one_request(tcp: &mut tokio::net::TcpStream) -> Option<Vec<(String, String)>> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (end, headers) = loop {
        let n = tcp.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        if let Ok(httparse::Status::Complete(head)) = req.parse(&buf) {
            let headers = raw_upstream::lowercase_headers(req.headers);
            let body: usize = headers
                .iter()
                .find(|(name, _)| name == "content-length")
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(0);
            break (head + body, headers);
        }
    };
    while buf.len() < end {
        let n = tcp.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(headers)
}

/// A server on 127.0.0.1, port 0, that gives each connection it accepts
/// to `serve`, in a task of its own, for as long as the test runs.
pub async fn serve_each<F, Fut>(serve: F) -> std::net::SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(serve(tcp));
        }
    });
    addr
}

/// Waits until `cond` holds, or panics after 10 s naming `what`.
pub async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// A fenced write about to be sent: `PUT url` with `X-Fence-Token: token`
/// and `body`. Add headers (`x-test-delay-ms`, say) before sending.
pub fn fenced_put(
    http: &reqwest::Client,
    url: impl reqwest::IntoUrl,
    token: impl std::fmt::Display,
    body: impl Into<reqwest::Body>,
) -> reqwest::RequestBuilder {
    http.put(url)
        .header("x-fence-token", token.to_string())
        .body(body)
}
