//! An open-loop HTTP/1.1 load generator for the latency runs of
//! `bench/run.sh`: requests at a fixed rate, each one's latency counted
//! from when it was due, recorded into a histogram of fixed size.
//!
//! Why not oha, which the other latency runs use: oha keeps every
//! request's result in one growing vector, and each time that vector
//! doubles (at 2^17 and 2^18 results: 2.6 s and 5.2 s into a run at
//! 50k/s) its requests stall for tens of milliseconds, whatever server
//! they are sent to. Measured on a 2-core machine with two probes at
//! real-time priority, one per CPU, that saw no stall of the machine at
//! those moments: 500 to 2,200 requests over 10 ms in each of those
//! moments, a third of a 10 s run's p99 budget, for nginx and fencegate
//! alike. Here each connection records into its own histogram, allocated
//! before the run starts; nothing grows while it runs.
//!
//! How a request's latency is counted (the correction for coordinated
//! omission, as wrk2 does it): request `i` is due at `start + i / rate`.
//! A free connection takes the next due request; if it is not due yet,
//! the connection sleeps until it is and counts from when it woke (so the
//! timer's granularity, up to a millisecond, is not counted against the
//! server); if it is overdue, because every connection was busy waiting
//! for the server, it is sent at once and counted from when it was due.
//!
//! Usage: `pace --rate R --seconds S [--connections C] [--threads T]
//! [-m METHOD] [-H "NAME: VALUE"]... [-d BODY] URL` (GET with no body by
//! default; a body is sent with its `Content-Length`).
//! URL is `http://HOST:PORT/PATH`, where PATH may hold one `{LO-HI}`: each
//! request replaces it with a number drawn uniformly from LO..=HI (e.g.
//! `http://127.0.0.1:8080/docs/k{1000-9999}`). Prints one JSON object:
//! requests, errors, seconds, achieved rate, answers by status, the
//! latency percentiles in milliseconds, and `slow_slices`: each tenth of a
//! second of the schedule (by when its requests were due) in which an
//! answer took longer than 10 ms, with its slowest answer and how many
//! did. A histogram says how long a run's tail is; this says when it came,
//! to be set beside what else happened then (a stall of the server, a
//! timer of its, the machine).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest latency a histogram holds, in µs; longer ones are recorded as
/// this (and the request also times out: see `REQUEST_TIMEOUT`).
const HIGHEST_US: u64 = 60_000_000;
/// A request with no complete answer by then is an error, and its
/// connection is replaced.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Most headers in an answer's head.
const MAX_HEADERS: usize = 64;
/// The schedule's slices for `slow_slices`.
const SLICE: Duration = Duration::from_millis(100);
/// An answer slower than this, in µs, counts in its slice.
const SLOW_US: u64 = 10_000;

/// What to send, parsed from the command line.
struct Plan {
    addr: SocketAddr,
    /// The path before and after `{LO-HI}` (all of it in `before` without one).
    before: String,
    after: String,
    /// The range `{LO-HI}` draws from, if the path has one.
    range: Option<(u64, u64)>,
    /// What goes after the path: the request line's end, every header
    /// (given ones, `Host`, and `Content-Length` with a body), the blank
    /// line and the body. The same for every request, so built once.
    tail: Vec<u8>,
    method: String,
    rate: f64,
    run_for: Duration,
    connections: usize,
}

/// One connection's tally: kept apart per connection so that recording
/// takes no lock, merged at the end.
struct Tally {
    latency: Histogram<u64>,
    statuses: BTreeMap<u16, u64>,
    errors: BTreeMap<String, u64>,
    /// Per slice of the schedule: the slowest answer (µs) and how many were
    /// slower than [`SLOW_US`]. Sized before the run: nothing grows in it.
    slices: Vec<(u64, u64)>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (plan, threads) = match parse(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("pace: {e}");
            eprintln!(
                "usage: pace --rate R --seconds S [--connections C] [--threads T] \
                 [-m METHOD] [-H 'NAME: VALUE']... [-d BODY] http://HOST:PORT/PATH"
            );
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let (tally, seconds) = runtime.block_on(run(Arc::new(plan)));
    print(&tally, seconds);
}

fn parse(args: &[String]) -> Result<(Plan, usize), String> {
    let mut rate = None;
    let mut seconds = None;
    let mut connections = 64usize;
    let mut threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut url = None;
    let mut method = "GET".to_string();
    let mut headers = Vec::new();
    let mut body = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value"))
                .cloned()
        };
        match a.as_str() {
            "--rate" => rate = Some(num::<f64>("--rate", &value("--rate")?)?),
            "--seconds" => seconds = Some(num::<f64>("--seconds", &value("--seconds")?)?),
            "--connections" => connections = num("--connections", &value("--connections")?)?,
            "--threads" => threads = num("--threads", &value("--threads")?)?,
            "-m" => method = value("-m")?,
            "-H" => headers.push(value("-H")?),
            "-d" => body = Some(value("-d")?),
            u if url.is_none() && !u.starts_with("--") => url = Some(u.to_string()),
            other => return Err(format!("unexpected argument {other}")),
        }
    }
    let rate = rate
        .filter(|r| *r > 0.0)
        .ok_or("--rate R (> 0) is required")?;
    let seconds = seconds
        .filter(|s| *s > 0.0)
        .ok_or("--seconds S (> 0) is required")?;
    if connections == 0 || threads == 0 {
        return Err("--connections and --threads must be at least 1".into());
    }
    let url = url.ok_or("a URL is required")?;
    let rest = url
        .strip_prefix("http://")
        .ok_or("the URL must start with http://")?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr: SocketAddr = host
        .parse()
        .map_err(|_| format!("{host} is not an IP address and port"))?;
    let (before, after, range) = match (path.find('{'), path.find('}')) {
        (Some(open), Some(close)) if open < close => {
            let (lo, hi) = path[open + 1..close]
                .split_once('-')
                .ok_or("a placeholder is {LO-HI}")?;
            let (lo, hi) = (num::<u64>("LO", lo)?, num::<u64>("HI", hi)?);
            if lo > hi {
                return Err("in {LO-HI}, LO must not exceed HI".into());
            }
            (
                path[..open].to_string(),
                path[close + 1..].to_string(),
                Some((lo, hi)),
            )
        }
        _ => (path.to_string(), String::new(), None),
    };
    let mut tail = format!(" HTTP/1.1\r\nHost: {host}\r\n");
    for h in &headers {
        if !h.contains(':') || h.contains('\r') || h.contains('\n') {
            return Err(format!("-H {h:?} is not one NAME: VALUE header"));
        }
        tail.push_str(h);
        tail.push_str("\r\n");
    }
    if let Some(b) = &body {
        tail.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    tail.push_str("\r\n");
    tail.push_str(body.as_deref().unwrap_or(""));
    let plan = Plan {
        addr,
        before,
        after,
        range,
        tail: tail.into_bytes(),
        method,
        rate,
        run_for: Duration::from_secs_f64(seconds),
        connections,
    };
    Ok((plan, threads))
}

fn num<T: std::str::FromStr>(name: &str, s: &str) -> Result<T, String> {
    s.parse()
        .map_err(|_| format!("{name}: {s} is not a number"))
}

/// Connects every connection, then runs the schedule on all of them.
async fn run(plan: Arc<Plan>) -> (Tally, f64) {
    let mut streams = Vec::with_capacity(plan.connections);
    for _ in 0..plan.connections {
        match connect(plan.addr).await {
            Ok(s) => streams.push(s),
            Err(e) => {
                eprintln!("pace: cannot connect to {}: {e}", plan.addr);
                std::process::exit(1);
            }
        }
    }
    // Shortly ahead, so that every task is running when the first request
    // is due.
    let start = Instant::now() + Duration::from_millis(20);
    let next = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = streams
        .into_iter()
        .map(|s| tokio::spawn(connection(plan.clone(), s, next.clone(), start)))
        .collect();
    let mut total = Tally::new(&plan);
    for t in tasks {
        let t = t.await.expect("a connection task panicked");
        total
            .latency
            .add(&t.latency)
            .expect("histograms of one shape");
        for (k, v) in t.statuses {
            *total.statuses.entry(k).or_default() += v;
        }
        for (k, v) in t.errors {
            *total.errors.entry(k).or_default() += v;
        }
        for (all, one) in total.slices.iter_mut().zip(&t.slices) {
            *all = (all.0.max(one.0), all.1 + one.1);
        }
    }
    (total, start.elapsed().as_secs_f64())
}

async fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    Ok(s)
}

impl Tally {
    fn new(plan: &Plan) -> Self {
        let slices = plan.run_for.as_nanos().div_ceil(SLICE.as_nanos()).max(1) as usize;
        Self {
            latency: Histogram::new_with_bounds(1, HIGHEST_US, 3).expect("valid bounds"),
            statuses: BTreeMap::new(),
            errors: BTreeMap::new(),
            slices: vec![(0, 0); slices],
        }
    }

    /// An answer that took `us`, to a request due `since` the start.
    fn record(&mut self, since: Duration, us: u64) {
        self.latency.saturating_record(us.max(1));
        // Requests are due before the run's end, so within the slices; the
        // last one takes any rounding past it.
        let last = self.slices.len() - 1;
        let slice = &mut self.slices[((since.as_nanos() / SLICE.as_nanos()) as usize).min(last)];
        slice.0 = slice.0.max(us);
        slice.1 += u64::from(us > SLOW_US);
    }
}

/// One connection: takes the next due request, sends it, reads its
/// answer, records it; until the requests due within the run are taken.
async fn connection(
    plan: Arc<Plan>,
    stream: TcpStream,
    next: Arc<AtomicU64>,
    start: Instant,
) -> Tally {
    let mut tally = Tally::new(&plan);
    let mut stream = Some(stream);
    let mut rng = fastrand::Rng::new();
    let mut request = Vec::with_capacity(256);
    let mut buf = vec![0u8; 16 * 1024];
    let period = 1.0 / plan.rate;
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let due = start + Duration::from_secs_f64(i as f64 * period);
        if due >= start + plan.run_for {
            break;
        }
        let from = if due > Instant::now() {
            tokio::time::sleep_until(due.into()).await;
            Instant::now()
        } else {
            due
        };
        request.clear();
        request.extend_from_slice(plan.method.as_bytes());
        request.push(b' ');
        request.extend_from_slice(plan.before.as_bytes());
        if let Some((lo, hi)) = plan.range {
            request.extend_from_slice(rng.u64(lo..=hi).to_string().as_bytes());
        }
        request.extend_from_slice(plan.after.as_bytes());
        request.extend_from_slice(&plan.tail);
        let s = match stream.take() {
            Some(s) => s,
            None => match connect(plan.addr).await {
                Ok(s) => s,
                Err(e) => {
                    *tally.errors.entry(format!("connect: {e}")).or_default() += 1;
                    continue;
                }
            },
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, exchange(s, &request, &mut buf)).await {
            Ok(Ok((status, s, keep))) => {
                let us = from.elapsed().as_micros().min(u128::from(HIGHEST_US)) as u64;
                tally.record(due - start, us);
                *tally.statuses.entry(status).or_default() += 1;
                if keep {
                    stream = Some(s);
                }
            }
            Ok(Err(e)) => *tally.errors.entry(e).or_default() += 1,
            Err(_) => *tally.errors.entry("timeout".into()).or_default() += 1,
        }
    }
    tally
}

/// Sends one request and reads its answer: the status, the stream back,
/// and whether it may be used again.
async fn exchange(
    mut s: TcpStream,
    request: &[u8],
    buf: &mut [u8],
) -> Result<(u16, TcpStream, bool), String> {
    s.write_all(request)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut filled = 0;
    loop {
        let n = s
            .read(&mut buf[filled..])
            .await
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("closed before a whole answer".into());
        }
        filled += n;
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut head = httparse::Response::new(&mut headers);
        let head_len = match head.parse(&buf[..filled]) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if filled < buf.len() => continue,
            Ok(httparse::Status::Partial) => return Err("answer head too large".into()),
            Err(e) => return Err(format!("bad answer: {e}")),
        };
        let status = head.code.unwrap_or(0);
        let mut length = None;
        let mut keep = true;
        for h in head.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                length = std::str::from_utf8(h.value)
                    .ok()
                    .and_then(|v| v.trim().parse::<usize>().ok());
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                return Err("chunked answers are not supported".into());
            } else if h.name.eq_ignore_ascii_case("connection")
                && h.value.eq_ignore_ascii_case(b"close")
            {
                keep = false;
            }
        }
        let length = length.ok_or("an answer without Content-Length")?;
        let mut body = filled - head_len;
        while body < length {
            let n = s.read(buf).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err("closed within a body".into());
            }
            body += n;
        }
        if body > length {
            return Err("more bytes than the answer's length (pipelined?)".into());
        }
        return Ok((status, s, keep));
    }
}

/// The run's answer as one JSON object. serde_json writes it, so an error
/// message with any character in it still makes a line the report can read.
fn print(t: &Tally, seconds: f64) {
    let requests: u64 = t.statuses.values().sum();
    let errors: u64 = t.errors.values().sum();
    let ms = |q: f64| t.latency.value_at_quantile(q) as f64 / 1000.0;
    let answer = serde_json::json!({
        "requests": requests,
        "errors": errors,
        "seconds": seconds,
        "rate": requests as f64 / seconds,
        "statuses": t.statuses.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        "error_kinds": &t.errors,
        "p50_ms": ms(0.5),
        "p90_ms": ms(0.9),
        "p99_ms": ms(0.99),
        "p999_ms": ms(0.999),
        "max_ms": t.latency.max() as f64 / 1000.0,
        "slow_slices": t.slices.iter().enumerate()
            .filter(|(_, s)| s.1 > 0)
            .map(|(i, s)| serde_json::json!({
                // Exact in ms whatever SLICE is (a product of f64s is not).
                "at_s": (i as u128 * SLICE.as_millis()) as f64 / 1000.0,
                "max_ms": s.0 as f64 / 1000.0,
                "over_10ms": s.1,
            }))
            .collect::<Vec<_>>(),
    });
    println!("{answer}");
}
