//! Closed-loop raising fenced writes, over HTTP/1.1 or HTTP/2 by prior
//! knowledge (h2c), with one client (hyper's) for both: what bench/run.sh
//! sets side by side to compare the gateway's two HTTPs on the same write,
//! at the same number of requests in flight. wrk speaks no HTTP/2, and
//! h2load sends one token for every request.
//!
//! Usage: `volley --protocol h1|h2c --connections C [--streams M]
//! --seconds S --keys N --prefix P http://HOST:PORT`
//!
//! C connections; over h2c, M streams in flight on each (over HTTP/1.1,
//! one). Each of the C x M workers owns the keys n with n % W == w (W the
//! number of workers, w its index) of `/docs/<P><n>` for n < N, and walks
//! them round robin with its own counter c, sending `X-Fence-Token:
//! 2 + c*W + w`: every write to a key carries a higher token than the one
//! before it on that key, as `bench/fenced.lua`'s raise mode does. Prints
//! one line `BENCHJSON {...}` in fenced.lua's fields.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

const BODY: &str = "written-by-bench";

struct Plan {
    addr: SocketAddr,
    h2: bool,
    connections: usize,
    streams: usize,
    run_for: Duration,
    keys: u64,
    prefix: String,
}

#[derive(Default)]
struct Tally {
    statuses: BTreeMap<u16, u64>,
    errors: u64,
    latencies_us: Vec<u32>,
}

fn main() {
    let plan = match parse(std::env::args().skip(1).collect()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("volley: {e}");
            eprintln!(
                "usage: volley --protocol h1|h2c --connections C [--streams M] --seconds S \
                 --keys N --prefix P http://HOST:PORT"
            );
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let (tally, secs) = runtime.block_on(run(std::sync::Arc::new(plan)));
    print(tally, secs);
}

fn parse(args: Vec<String>) -> Result<Plan, String> {
    let mut it = args.into_iter();
    let (mut h2, mut connections, mut streams) = (None, None, 1usize);
    let (mut seconds, mut keys, mut prefix, mut url) = (None, None, None, None);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--protocol" => {
                h2 = Some(match value()?.as_str() {
                    "h1" => false,
                    "h2c" => true,
                    p => return Err(format!("unknown protocol {p}")),
                })
            }
            "--connections" => connections = Some(num(&value()?)?),
            "--streams" => streams = num(&value()?)?,
            "--seconds" => seconds = Some(num::<f64>(&value()?)?),
            "--keys" => keys = Some(num(&value()?)?),
            "--prefix" => prefix = Some(value()?),
            u if url.is_none() && u.starts_with("http://") => url = Some(u.to_string()),
            other => return Err(format!("unexpected argument {other}")),
        }
    }
    let h2 = h2.ok_or("--protocol is required")?;
    let url = url.ok_or("a URL is required")?;
    let host = url.trim_start_matches("http://").trim_end_matches('/');
    let plan = Plan {
        addr: host.parse().map_err(|_| format!("{host} is not IP:PORT"))?,
        h2,
        connections: connections.filter(|&c| c > 0).ok_or("--connections C > 0")?,
        streams: if h2 { streams.max(1) } else { 1 },
        run_for: Duration::from_secs_f64(seconds.ok_or("--seconds is required")?),
        keys: keys.filter(|&k| k > 0).ok_or("--keys N > 0")?,
        prefix: prefix.ok_or("--prefix is required")?,
    };
    if plan.keys < (plan.connections * plan.streams) as u64 {
        return Err("--keys must be at least the number of workers".into());
    }
    Ok(plan)
}

fn num<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.parse().map_err(|_| format!("{s} is not a number"))
}

type Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// Either HTTP's request sender for one connection.
enum Conn {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(Sender),
}

async fn connect(plan: &Plan) -> Conn {
    let tcp = TcpStream::connect(plan.addr).await.expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let io = TokioIo::new(tcp);
    if plan.h2 {
        let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .expect("an h2c handshake");
        tokio::spawn(conn);
        Conn::H2(send)
    } else {
        let (send, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .expect("an HTTP/1.1 connection");
        tokio::spawn(conn);
        Conn::H1(send)
    }
}

async fn run(plan: std::sync::Arc<Plan>) -> (Tally, f64) {
    let workers = (plan.connections * plan.streams) as u64;
    let mut conns = Vec::new();
    for _ in 0..plan.connections {
        conns.push(connect(&plan).await);
    }
    let start = Instant::now();
    let end = start + plan.run_for;
    let mut tasks = Vec::new();
    let mut w = 0u64;
    for conn in conns {
        match conn {
            Conn::H1(send) => {
                tasks.push(tokio::spawn(worker(plan.clone(), Conn::H1(send), w, workers, end)));
                w += 1;
            }
            Conn::H2(send) => {
                for _ in 0..plan.streams {
                    let c = Conn::H2(send.clone());
                    tasks.push(tokio::spawn(worker(plan.clone(), c, w, workers, end)));
                    w += 1;
                }
            }
        }
    }
    let mut total = Tally::default();
    for t in tasks {
        let t = t.await.expect("a worker panicked");
        for (k, v) in t.statuses {
            *total.statuses.entry(k).or_default() += v;
        }
        total.errors += t.errors;
        total.latencies_us.extend(t.latencies_us);
    }
    (total, start.elapsed().as_secs_f64())
}

async fn worker(plan: std::sync::Arc<Plan>, mut conn: Conn, w: u64, workers: u64, end: Instant) -> Tally {
    let mut tally = Tally::default();
    let mine: Vec<u64> = (0..plan.keys).filter(|n| n % workers == w).collect();
    let paths: Vec<String> = mine.iter().map(|n| format!("/docs/{}{n}", plan.prefix)).collect();
    let host = plan.addr.to_string();
    let mut c = 0u64;
    while Instant::now() < end {
        let path = &paths[(c as usize) % paths.len()];
        let token = 2 + c * workers + w;
        c += 1;
        let mut req = http::Request::put(path.as_str())
            .header("x-fence-token", token.to_string())
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))
            .expect("a request");
        let sent = Instant::now();
        let answer = match &mut conn {
            Conn::H1(send) => {
                req.headers_mut().insert(http::header::HOST, host.parse().expect("host"));
                if send.ready().await.is_err() {
                    tally.errors += 1;
                    conn = connect(&plan).await;
                    continue;
                }
                send.send_request(req).await
            }
            Conn::H2(send) => {
                *req.uri_mut() = format!("http://{host}{path}").parse().expect("a URI");
                if send.ready().await.is_err() {
                    tally.errors += 1;
                    break;
                }
                send.send_request(req).await
            }
        };
        match answer {
            Ok(resp) => {
                let status = resp.status().as_u16();
                if resp.into_body().collect().await.is_err() {
                    tally.errors += 1;
                    continue;
                }
                *tally.statuses.entry(status).or_default() += 1;
                tally
                    .latencies_us
                    .push(sent.elapsed().as_micros().min(u32::MAX as u128) as u32);
            }
            Err(_) => tally.errors += 1,
        }
    }
    tally
}

fn print(mut t: Tally, secs: f64) {
    t.latencies_us.sort_unstable();
    let pct = |q: f64| {
        let l = &t.latencies_us;
        if l.is_empty() {
            0
        } else {
            l[((q * l.len() as f64) as usize).min(l.len() - 1)]
        }
    };
    let count = |f: &dyn Fn(u16) -> bool| -> u64 {
        t.statuses.iter().filter(|(k, _)| f(**k)).map(|(_, v)| v).sum()
    };
    let s2xx = count(&|s| (200..300).contains(&s));
    let s409 = count(&|s| s == 409);
    let requests: u64 = t.statuses.values().sum();
    println!(
        "BENCHJSON {}",
        serde_json::json!({
            "duration_us": (secs * 1e6) as u64,
            "requests": requests,
            "s2xx": s2xx,
            "s409": s409,
            "sother": requests - s2xx - s409,
            "err_connect": 0,
            "err_read": t.errors,
            "err_write": 0,
            "err_timeout": 0,
            "p50_us": pct(0.50),
            "p99_us": pct(0.99),
            "max_us": t.latencies_us.last().copied().unwrap_or(0),
        })
    );
}
