//! The store's fence batch statement (`RECORD_BATCH` in
//! `src/store/postgres.rs`, read from there at build time) run through two Postgres clients, to decide
//! with numbers whether sqlx, or its lack of pipelining, is what limits
//! raising writes:
//!
//! - `sqlx`: one `PgConnection`, one batch at a time, as the gateway's
//!   single-mode batcher runs it (`BATCHES_IN_FLIGHT = 1`);
//! - `sqlx-2conn`: two connections, a batch in flight on each (what
//!   `BATCHES_IN_FLIGHT = 2` does);
//! - `tokio-pg`: tokio-postgres, one connection, one batch at a time;
//! - `tokio-pg-pipe2`: tokio-postgres, one connection, two batches
//!   pipelined (the second is on the wire while the first commits).
//!
//! Every batch raises every one of its keys (a token above any sent
//! before), so every row is written and committed, as in the benchmark's
//! scenario (e). Measured per variant and batch size: wall time, the CPU
//! of this process (the client: encoding, decoding, the socket; the
//! runtime is current-thread, so nothing else runs here) and the CPU of
//! the Postgres backends serving it (`/proc/<pid>/schedstat`). Variants
//! are alternated within each round, on one table, so a machine that
//! slows down during the run slows every variant alike.
//!
//! Usage: `pgclients [URL] [--batches 8,32,128] [--rows N] [--rounds R]
//! [--variants sqlx,tokio-pg,...] [--fillfactor F]`,
//! URL defaulting to postgres://postgres@127.0.0.1:5432/postgres (the
//! server must be on this machine: its backends' CPU is read from /proc).

use futures_util::stream::{FuturesUnordered, StreamExt};
use sqlx::{Connection, PgConnection};
use std::time::{Duration, Instant};

/// The gateway's source, from which the statement is taken (see
/// [`record_batch`]), so that what is measured is what the gateway runs.
const GATEWAY_STORE: &str = include_str!("../../../src/store/postgres.rs");

/// The statement, taken from the source once (in `main`).
static STATEMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn statement() -> &'static str {
    STATEMENT
        .get()
        .expect("main sets the statement before any batch")
}

/// The gateway's `RECORD_BATCH` statement, as written in its source.
fn record_batch() -> Result<String, Error> {
    let start = "const RECORD_BATCH: &str = \"\\\n";
    let from = GATEWAY_STORE
        .find(start)
        .ok_or("src/store/postgres.rs has no RECORD_BATCH")?
        + start.len();
    let len = GATEWAY_STORE[from..]
        .find("\";")
        .ok_or("RECORD_BATCH does not end")?;
    Ok(GATEWAY_STORE[from..from + len].to_string())
}

/// Keys seeded with token 1; batches walk them round robin.
const KEYS: usize = 10_000;

const VARIANTS: [&str; 4] = ["sqlx", "sqlx-2conn", "tokio-pg", "tokio-pg-pipe2"];

type Error = Box<dyn std::error::Error>;

/// Hands out batches: distinct keys, round robin, and a token above every
/// token handed out before, so every row of every batch is raised.
struct Source {
    next_key: usize,
    token: i64,
}

impl Source {
    fn batch(&mut self, size: usize) -> (Vec<String>, Vec<i64>) {
        self.token += 1;
        let keys = (0..size)
            .map(|i| format!("k{}", (self.next_key + i) % KEYS))
            .collect();
        self.next_key = (self.next_key + size) % KEYS;
        (keys, vec![self.token; size])
    }
}

/// What one variant cost for one batch size.
struct Sample {
    rows: usize,
    batches: usize,
    wall: Duration,
    client: Duration,
    server: Duration,
}

fn process_cpu() -> Duration {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Time on CPU of the given processes (nanoseconds, first field of
/// schedstat).
fn backends_cpu(pids: &[i32]) -> Result<Duration, Error> {
    let mut sum = Duration::ZERO;
    for pid in pids {
        let text = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).map_err(|e| {
            format!("cannot read /proc/{pid}/schedstat ({e}): is Postgres on this machine?")
        })?;
        let ns: u64 = text.split_whitespace().next().unwrap_or("0").parse()?;
        sum += Duration::from_nanos(ns);
    }
    Ok(sum)
}

fn check(rows: usize, size: usize) -> Result<(), Error> {
    if rows == size {
        Ok(())
    } else {
        Err(format!("a batch of {size} raised {rows} rows: tokens did not rise").into())
    }
}

async fn sqlx_batch(conn: &mut PgConnection, batch: (Vec<String>, Vec<i64>)) -> Result<(), Error> {
    let rows: Vec<(String, i64)> = sqlx::query_as(statement())
        .bind(&batch.0)
        .bind(&batch.1)
        .fetch_all(conn)
        .await?;
    check(rows.len(), batch.0.len())
}

async fn pg_batch(
    client: &tokio_postgres::Client,
    stmt: &tokio_postgres::Statement,
    batch: (Vec<String>, Vec<i64>),
) -> Result<(), Error> {
    let rows = client.query(stmt, &[&batch.0, &batch.1]).await?;
    // Decoded as the gateway decodes its answers.
    let answers: Vec<(String, i64)> = rows
        .iter()
        .map(|r| Ok((r.try_get::<_, String>(0)?, r.try_get::<_, i64>(1)?)))
        .collect::<Result<_, tokio_postgres::Error>>()?;
    check(answers.len(), batch.0.len())
}

async fn sqlx_conn(url: &str) -> Result<(PgConnection, i32), Error> {
    let mut conn = PgConnection::connect(url).await?;
    sqlx::query("SET synchronous_commit = on")
        .execute(&mut conn)
        .await?;
    let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await?;
    Ok((conn, pid))
}

/// A tokio-postgres client, its backend's pid, and the task driving its
/// connection (awaited after the client is dropped, so that the
/// connection has closed before the database is dropped).
async fn pg_client(
    url: &str,
) -> Result<(tokio_postgres::Client, i32, tokio::task::JoinHandle<()>), Error> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    let driver = tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("tokio-postgres connection: {e}");
        }
    });
    client.batch_execute("SET synchronous_commit = on").await?;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    Ok((client, pid, driver))
}

/// Runs `batches` batches of `size` through one variant, connections
/// opened and warmed (statement prepared) before the clock starts.
async fn run(
    variant: &str,
    url: &str,
    size: usize,
    batches: usize,
    src: &mut Source,
) -> Result<Sample, Error> {
    // Prepared up front so the clocks see the steady state only.
    let warm = 10;
    let measure = |pids: &[i32]| -> Result<(Instant, Duration, Duration), Error> {
        Ok((Instant::now(), process_cpu(), backends_cpu(pids)?))
    };
    // Each arm reads the clocks again before its connections close (a
    // closed connection's backend is gone, and its CPU time with it).
    let (start, end) = match variant {
        "sqlx" => {
            let (mut conn, pid) = sqlx_conn(url).await?;
            for _ in 0..warm {
                sqlx_batch(&mut conn, src.batch(size)).await?;
            }
            let start = measure(&[pid])?;
            for _ in 0..batches {
                sqlx_batch(&mut conn, src.batch(size)).await?;
            }
            (start, measure(&[pid])?)
        }
        "sqlx-2conn" => {
            let (mut a, pa) = sqlx_conn(url).await?;
            let (mut b, pb) = sqlx_conn(url).await?;
            for _ in 0..warm {
                sqlx_batch(&mut a, src.batch(size)).await?;
                sqlx_batch(&mut b, src.batch(size)).await?;
            }
            let start = measure(&[pa, pb])?;
            // Two loops, each with its own connection, sharing the source
            // (single-threaded, so the borrow is taken per batch).
            let src = std::cell::RefCell::new(src);
            let next = || {
                let mut s = src.borrow_mut();
                s.batch(size)
            };
            let left = std::cell::Cell::new(batches);
            let take = || {
                let n = left.get();
                (n > 0).then(|| left.set(n - 1)).is_some()
            };
            let (ra, rb) = tokio::join!(lane(&mut a, &take, &next), lane(&mut b, &take, &next));
            ra?;
            rb?;
            (start, measure(&[pa, pb])?)
        }
        "tokio-pg" | "tokio-pg-pipe2" => {
            let depth = if variant == "tokio-pg" { 1 } else { 2 };
            let (client, pid, driver) = pg_client(url).await?;
            let stmt = client.prepare(statement()).await?;
            for _ in 0..warm {
                pg_batch(&client, &stmt, src.batch(size)).await?;
            }
            let start = measure(&[pid])?;
            let mut in_flight = FuturesUnordered::new();
            let mut sent = 0;
            while sent < batches || !in_flight.is_empty() {
                while sent < batches && in_flight.len() < depth {
                    in_flight.push(pg_batch(&client, &stmt, src.batch(size)));
                    sent += 1;
                }
                if let Some(done) = in_flight.next().await {
                    done?;
                }
            }
            let end = measure(&[pid])?;
            drop(in_flight);
            drop(stmt);
            drop(client);
            driver.await?;
            (start, end)
        }
        other => return Err(format!("unknown variant {other}").into()),
    };
    let ((t0, c0, s0), (t1, c1, s1)) = (start, end);
    Ok(Sample {
        rows: size * batches,
        batches,
        wall: t1 - t0,
        client: c1 - c0,
        server: s1 - s0,
    })
}

/// One connection's loop in `sqlx-2conn`: batches while any are left.
async fn lane(
    conn: &mut PgConnection,
    take: &dyn Fn() -> bool,
    next: &dyn Fn() -> (Vec<String>, Vec<i64>),
) -> Result<(), Error> {
    while take() {
        sqlx_batch(conn, next()).await?;
    }
    Ok(())
}

fn us(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e6 / n as f64
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let mut url = "postgres://postgres@127.0.0.1:5432/postgres".to_string();
    let mut sizes = vec![8usize, 32, 128];
    let mut rows = 100_000usize;
    let mut rounds = 3usize;
    let mut variants: Vec<String> = VARIANTS.iter().map(|v| v.to_string()).collect();
    let mut fillfactor = 100u32;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--batches" => {
                sizes = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--rows" => rows = value()?.parse()?,
            "--rounds" => rounds = value()?.parse()?,
            "--variants" => variants = value()?.split(',').map(str::to_string).collect(),
            // The table's fillfactor: below 100, pages keep room for the
            // new versions of their rows (heap-only updates).
            "--fillfactor" => fillfactor = value()?.parse()?,
            _ if a.starts_with("postgres") => url = a,
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }

    let _ = STATEMENT.set(record_batch()?);
    // A database of our own, dropped at the end.
    let db = format!("fg_pgclients_{}", std::process::id());
    let mut admin = PgConnection::connect(&url).await?;
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&mut admin)
        .await?;
    let base = url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b);
    let dburl = format!("{base}/{db}");
    let outcome = measure_all(&dburl, &sizes, rows, rounds, &variants, fillfactor).await;
    sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    outcome
}

async fn measure_all(
    url: &str,
    sizes: &[usize],
    rows: usize,
    rounds: usize,
    variants: &[String],
    fillfactor: u32,
) -> Result<(), Error> {
    let (mut conn, _) = sqlx_conn(url).await?;
    // The gateway's table (migrations/postgres/0001 and its byte-order
    // index), seeded as the benchmark seeds it.
    sqlx::raw_sql(&format!(
        "CREATE TABLE fences (
             resource_key  TEXT PRIMARY KEY,
             highest_token BIGINT NOT NULL CHECK (highest_token >= 0),
             updated_at    TIMESTAMPTZ NOT NULL DEFAULT now())
             WITH (fillfactor = {fillfactor});
         CREATE INDEX fences_key_bytes ON fences (resource_key COLLATE \"C\");"
    ))
    .execute(&mut conn)
    .await?;
    sqlx::query(
        "INSERT INTO fences (resource_key, highest_token) \
         SELECT 'k' || n, 1 FROM generate_series(0, $1 - 1) AS n",
    )
    .bind(KEYS as i64)
    .execute(&mut conn)
    .await?;
    sqlx::query("VACUUM ANALYZE fences")
        .execute(&mut conn)
        .await?;

    let mut src = Source {
        next_key: 0,
        token: 1,
    };
    println!(
        "variant\tbatch\tround\trows/s\tclient_us/batch\tserver_us/batch\tclient_us/row\tserver_us/row"
    );
    let mut all: Vec<(usize, &str, Sample)> = Vec::new();
    for round in 1..=rounds {
        for &size in sizes {
            let batches = (rows / size).max(1);
            for variant in variants.iter().map(String::as_str) {
                let s = run(variant, url, size, batches, &mut src).await?;
                println!(
                    "{variant}\t{size}\t{round}\t{:.0}\t{:.1}\t{:.1}\t{:.2}\t{:.2}",
                    s.rows as f64 / s.wall.as_secs_f64(),
                    us(s.client, s.batches),
                    us(s.server, s.batches),
                    us(s.client, s.rows),
                    us(s.server, s.rows),
                );
                all.push((size, variant, s));
            }
        }
    }
    println!("\nmedian of {rounds} rounds");
    println!("variant\tbatch\trows/s\tclient_us/row\tserver_us/row");
    for &size in sizes {
        for variant in variants.iter().map(String::as_str) {
            let mine: Vec<&Sample> = all
                .iter()
                .filter(|(b, v, _)| *b == size && *v == variant)
                .map(|(_, _, s)| s)
                .collect();
            let median = |f: &dyn Fn(&Sample) -> f64| {
                let mut v: Vec<f64> = mine.iter().map(|s| f(s)).collect();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            println!(
                "{variant}\t{size}\t{:.0}\t{:.2}\t{:.2}",
                median(&|s| s.rows as f64 / s.wall.as_secs_f64()),
                median(&|s| us(s.client, s.rows)),
                median(&|s| us(s.server, s.rows)),
            );
        }
    }
    // How many of the updates were heap-only (no new index entries): the
    // statistics are flushed by the backends that made them, so wait a
    // moment for the last ones.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (upd, hot): (i64, i64) = sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'fences'",
    )
    .fetch_one(&mut conn)
    .await?;
    println!(
        "\nfillfactor {fillfactor}: {hot} of {upd} updates heap-only ({:.0}%)",
        100.0 * hot as f64 / upd.max(1) as f64
    );
    Ok(())
}
