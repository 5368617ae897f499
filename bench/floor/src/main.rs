//! The floor under an HTTP/1 path of fencegate's own: a reverse proxy that
//! does, per request, only what such a path could not leave out, on the
//! runtime and worker model fencegate uses. Measured next to nginx and
//! fencegate by `bench/floor.sh`, it answers one question before that path
//! is built: can a proxy on tokio pass GETs through faster than nginx on
//! this machine at all, and by how much?
//!
//! What it does per request, as fencegate's own path would:
//!
//! - one worker thread per CPU, each with a current-thread runtime, one
//!   acceptor handing connections to them in turn, and a connection served
//!   start to end on one worker;
//! - the request head parsed with `httparse` and written anew for the
//!   upstream: hop-by-hop headers dropped, `Host` set to the upstream,
//!   `X-Forwarded-For` set to the peer;
//! - the upstream connection taken from the worker's own stack of idle ones
//!   (or connected), the answer's head parsed with `httparse` and written
//!   anew without its hop-by-hop headers, head and body sent to the client
//!   in one write.
//!
//! What it leaves out, which fencegate's would have to do too: routing,
//! fences, deadlines, bodies other than `Content-Length` ones, timeouts,
//! limits, metrics, logs. So what it measures is a floor: fencegate's own
//! path would spend at least this.
//!
//! Usage: `floor LISTEN UPSTREAM [WORKERS]`, e.g. `floor 127.0.0.1:8080
//! 127.0.0.1:9000 2`.

use std::cell::RefCell;
use std::io;
use std::net::SocketAddr;
use std::rc::Rc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Headers a proxy never forwards (RFC 9110 §7.6.1), and the two it sets.
const DROPPED: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
    "host",
    "x-forwarded-for",
];

/// Most headers in one head.
const MAX_HEADERS: usize = 64;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: floor LISTEN UPSTREAM [WORKERS]");
        std::process::exit(2);
    }
    let listen: SocketAddr = args[1].parse().expect("LISTEN is host:port");
    let upstream: SocketAddr = args[2].parse().expect("UPSTREAM is host:port");
    let workers = args
        .get(3)
        .map(|w| w.parse().expect("WORKERS is a number"))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let listener = std::net::TcpListener::bind(listen).expect("bind LISTEN");
    let workers: Vec<_> = (0..workers)
        .map(|_| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, worker(rx, upstream));
            });
            tx
        })
        .collect();
    // One acceptor hands connections to the workers in turn, as fencegate's
    // does: 64 connections land 32 and 32, where workers accepting on one
    // shared socket split them however the wake-ups fall (40 and 24 leaves
    // one core idle while the other is the bottleneck).
    for (n, accepted) in listener.incoming().enumerate() {
        let Ok(client) = accepted else { continue };
        let _ = workers[n % workers.len()].send(client);
    }
}

/// One worker: serves the connections it is handed on its own thread, with
/// its own idle upstream connections.
async fn worker(
    mut accepted: tokio::sync::mpsc::UnboundedReceiver<std::net::TcpStream>,
    upstream: SocketAddr,
) {
    let idle: Rc<RefCell<Vec<TcpStream>>> = Rc::default();
    while let Some(client) = accepted.recv().await {
        let Ok(peer) = client.peer_addr() else { continue };
        if client.set_nonblocking(true).is_err() {
            continue;
        }
        let Ok(client) = TcpStream::from_std(client) else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let idle = idle.clone();
        tokio::task::spawn_local(async move {
            let _ = serve(client, peer, upstream, idle).await;
        });
    }
}

/// Serves one client connection's requests, one after another.
async fn serve(
    mut client: TcpStream,
    peer: SocketAddr,
    upstream: SocketAddr,
    idle: Rc<RefCell<Vec<TcpStream>>>,
) -> io::Result<()> {
    let mut from_client = Vec::with_capacity(8192);
    let mut to_upstream = Vec::with_capacity(8192);
    let mut from_upstream = Vec::with_capacity(16384);
    let mut to_client = Vec::with_capacity(16384);
    let peer_ip = peer.ip().to_string();
    loop {
        // The request head, written anew for the upstream.
        let (head_len, body_len) = loop {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&from_client).map_err(bad)? {
                httparse::Status::Complete(n) => {
                    to_upstream.clear();
                    let body_len = content_length(req.headers)?;
                    write_head_line(
                        &mut to_upstream,
                        &[req.method.unwrap_or("GET"), " ", req.path.unwrap_or("/"), " HTTP/1.1"],
                    );
                    forward_headers(&mut to_upstream, req.headers);
                    write_head_line(&mut to_upstream, &["host: ", &upstream.to_string()]);
                    write_head_line(&mut to_upstream, &["x-forwarded-for: ", &peer_ip]);
                    to_upstream.extend_from_slice(b"\r\n");
                    break (n, body_len);
                }
                httparse::Status::Partial => {
                    if read_more(&mut client, &mut from_client).await? == 0 {
                        return Ok(());
                    }
                }
            }
        };
        while from_client.len() < head_len + body_len {
            if read_more(&mut client, &mut from_client).await? == 0 {
                return Ok(());
            }
        }
        to_upstream.extend_from_slice(&from_client[head_len..head_len + body_len]);
        from_client.drain(..head_len + body_len);

        // The exchange, on an idle connection if there is one. A reused
        // connection the upstream closed meanwhile fails before any answer
        // (nothing read): the request goes once more on a new one.
        let pooled = idle.borrow_mut().pop();
        let (mut up, keep) = match pooled {
            Some(mut up) => match exchange(&mut up, &to_upstream, &mut from_upstream, &mut to_client).await {
                Ok(keep) => (up, keep),
                Err(_) => {
                    let mut up = connect(upstream).await?;
                    let keep = exchange(&mut up, &to_upstream, &mut from_upstream, &mut to_client).await?;
                    (up, keep)
                }
            },
            None => {
                let mut up = connect(upstream).await?;
                let keep = exchange(&mut up, &to_upstream, &mut from_upstream, &mut to_client).await?;
                (up, keep)
            }
        };
        client.write_all(&to_client).await?;
        if keep {
            idle.borrow_mut().push(up);
        } else {
            let _ = up.shutdown().await;
        }
    }
}

async fn connect(upstream: SocketAddr) -> io::Result<TcpStream> {
    let up = TcpStream::connect(upstream).await?;
    up.set_nodelay(true)?;
    Ok(up)
}

/// Sends `request` on `up` and puts the answer, its head written anew, in
/// `to_client`. Whether `up` may carry another request.
async fn exchange(
    up: &mut TcpStream,
    request: &[u8],
    from_upstream: &mut Vec<u8>,
    to_client: &mut Vec<u8>,
) -> io::Result<bool> {
    up.write_all(request).await?;
    from_upstream.clear();
    let (head_len, body_len, keep) = loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(from_upstream).map_err(bad)? {
            httparse::Status::Complete(n) => {
                let body_len = content_length(resp.headers)?;
                let keep = !resp
                    .headers
                    .iter()
                    .any(|h| h.name.eq_ignore_ascii_case("connection") && h.value.eq_ignore_ascii_case(b"close"));
                to_client.clear();
                let code = resp.code.unwrap_or(502).to_string();
                write_head_line(to_client, &["HTTP/1.1 ", &code, " ", resp.reason.unwrap_or("")]);
                forward_headers(to_client, resp.headers);
                to_client.extend_from_slice(b"\r\n");
                break (n, body_len, keep);
            }
            httparse::Status::Partial => {
                if read_more(up, from_upstream).await? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
        }
    };
    while from_upstream.len() < head_len + body_len {
        if read_more(up, from_upstream).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    to_client.extend_from_slice(&from_upstream[head_len..head_len + body_len]);
    Ok(keep)
}

/// Reads what the socket has into the end of `buf`; 0 at its end.
async fn read_more(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 4096 {
        buf.reserve(8192);
    }
    s.read_buf(buf).await
}

fn content_length(headers: &[httparse::Header<'_>]) -> io::Result<usize> {
    let mut len = 0;
    for h in headers {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(bad("transfer-encoding is not supported here"));
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            len = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| bad("bad content-length"))?;
        }
    }
    Ok(len)
}

fn forward_headers(out: &mut Vec<u8>, headers: &[httparse::Header<'_>]) {
    for h in headers {
        if DROPPED.iter().any(|d| h.name.eq_ignore_ascii_case(d)) {
            continue;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
}

fn write_head_line(out: &mut Vec<u8>, parts: &[&str]) {
    for p in parts {
        out.extend_from_slice(p.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

fn bad(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}
