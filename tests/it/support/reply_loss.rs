//! A TCP proxy in front of the shared Postgres server that can lose the
//! server's replies: the stand-in for a network that breaks after a
//! statement reached the server, and committed, but before its answer came
//! back. Terminating a backend cannot stage that (it cuts before the
//! commit); only the path between the two can.
//!
//! While replies are swallowed, every byte from the server is read and
//! dropped, so a client waits for an answer that will never come, as
//! behind a partition. [`ReplyLoss::cut`] then closes every session, as
//! the partition's end or the client's own keepalive would. It can also
//! hold the server's replies back and deliver them later
//! ([`ReplyLoss::hold`]): a network, or a machine, that stalls and
//! recovers. Runs on the test's runtime; dropping it stops it and every
//! session.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

use super::sessions::Sessions;

pub struct ReplyLoss {
    /// The proxy's port on 127.0.0.1.
    pub port: u16,
    /// Whether the server's bytes are dropped, read by every session as it
    /// relays each chunk: a reply in progress is lost from the next chunk.
    swallow: Arc<AtomicBool>,
    /// Whether new sessions are closed at once, as by a server that is
    /// not there.
    refusing: Arc<AtomicBool>,
    /// Which sessions' server bytes wait until this changes; nothing is
    /// lost.
    held: tokio::sync::watch::Sender<Held>,
    /// The open sessions, for [`ReplyLoss::cut`].
    sessions: Sessions,
    accept: AbortHandle,
}

impl ReplyLoss {
    /// A proxy to the server of `store_url` (a `postgres://` URL).
    pub async fn start(store_url: &str) -> ReplyLoss {
        let url = reqwest::Url::parse(store_url).expect("a store URL");
        let server = format!(
            "{}:{}",
            url.host_str().expect("the store URL names a host"),
            url.port().unwrap_or(5432)
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("proxy address").port();
        let swallow = Arc::new(AtomicBool::new(false));
        let refusing = Arc::new(AtomicBool::new(false));
        let sessions = Sessions::default();
        let (held, _) = tokio::sync::watch::channel(Held::Nothing);
        let accept = {
            let held = held.clone();
            let (swallow, sessions) = (swallow.clone(), sessions.clone());
            let refusing = refusing.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    if refusing.load(Ordering::SeqCst) {
                        continue;
                    }
                    let (server, swallow) = (server.clone(), swallow.clone());
                    let held = held.subscribe();
                    let session = tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(server).await {
                            relay(client, server, &swallow, held).await;
                        }
                    });
                    sessions.track(session.abort_handle());
                }
            })
            .abort_handle()
        };
        ReplyLoss {
            port,
            swallow,
            refusing,
            held,
            sessions,
            accept,
        }
    }

    /// `store_url` with its host and port replaced by the proxy's.
    pub fn url(&self, store_url: &str) -> String {
        let mut url = reqwest::Url::parse(store_url).expect("a store URL");
        url.set_host(Some("127.0.0.1")).expect("a URL with a host");
        url.set_port(Some(self.port)).expect("a URL with a host");
        url.to_string()
    }

    /// From now on, the server's bytes are dropped.
    pub fn swallow(&self) {
        self.swallow.store(true, Ordering::SeqCst);
    }

    /// From now on, the server's bytes wait in every session (new ones
    /// too) until [`ReplyLoss::release`].
    pub fn hold(&self) {
        self.held.send_replace(Held::All);
    }

    /// From now on, the server's bytes wait in the one session whose
    /// backend sees the proxy at `client_port` (`pg_stat_activity`'s
    /// `client_port`), until [`ReplyLoss::release`].
    pub fn hold_session(&self, client_port: u16) {
        self.held.send_replace(Held::Session(client_port));
    }

    /// Delivers what was held, and relays as before.
    pub fn release(&self) {
        self.held.send_replace(Held::Nothing);
    }

    /// Relays the server's bytes again, then closes every session open now:
    /// their clients see their connections broken (and those that waited
    /// for a reply never get it). Sessions opened from here on are relayed
    /// whole, so a client that reconnects finds the server again.
    pub fn cut(&self) {
        self.refusing.store(false, Ordering::SeqCst);
        self.close_all();
    }

    /// [`ReplyLoss::cut`], and new sessions are closed at once until
    /// [`ReplyLoss::admit`]: the server is gone for a while.
    pub fn cut_and_refuse(&self) {
        self.refusing.store(true, Ordering::SeqCst);
        self.close_all();
    }

    /// New sessions are relayed again.
    pub fn admit(&self) {
        self.refusing.store(false, Ordering::SeqCst);
    }

    fn close_all(&self) {
        self.swallow.store(false, Ordering::SeqCst);
        self.sessions.close_all();
    }
}

/// Whose replies wait.
#[derive(Clone, Copy, PartialEq)]
enum Held {
    Nothing,
    All,
    /// The session whose connection to the server has this local port.
    Session(u16),
}

/// Relays one session until either side closes: the client's bytes whole,
/// the server's unless `swallow` is set, and once `held` lets them by.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    swallow: &AtomicBool,
    mut held: tokio::sync::watch::Receiver<Held>,
) {
    let port = server.local_addr().map(|a| a.port()).unwrap_or(0);
    let waits = move |held: &Held| match *held {
        Held::Nothing => false,
        Held::All => true,
        Held::Session(p) => p == port,
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = tokio::io::copy(&mut client_read, &mut server_write);
    let replies = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if held.wait_for(|h| !waits(h)).await.is_err() {
                return;
            }
            if !swallow.load(Ordering::SeqCst) && client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = requests => {}
        _ = replies => {}
    }
}

impl Drop for ReplyLoss {
    fn drop(&mut self) {
        self.accept.abort();
        self.sessions.close_all();
    }
}
