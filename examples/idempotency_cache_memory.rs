//! What one completed Idempotency-Key record costs in the gateway's memory
//! (`idempotency::ReplayCache`), measured rather than estimated:
//!
//!     cargo run --release --example idempotency_cache_memory [N] [BODY_BYTES]
//!
//! Caches N records (default 50,000) of a small JSON answer's shape (a
//! 36-character key, four headers, a body of BODY_BYTES, default 60) under
//! the gateway's allocator (mimalloc), and prints per record: the
//! heap bytes requested (a counting allocator around mimalloc: what the
//! entries hold, without the allocator's own rounding), the growth of the
//! process's resident memory (`VmRSS`: what the machine pays), and the
//! bytes the cache charges against its bound (which must not be below
//! what the entries hold, or the bound would not bound). One shape per
//! run: memory freed by a first measurement would be reused by a second
//! without growing the resident set.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::idempotency::ReplayCache;
use fencegate::store::{RecordId, StoredAnswer};

/// mimalloc, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static INNER: mimalloc::MiMalloc = mimalloc::MiMalloc;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { INNER.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { INNER.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { INNER.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn rss_kib() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn headers() -> Vec<(String, Vec<u8>)> {
    vec![
        ("content-type".into(), b"application/json".to_vec()),
        ("content-length".into(), b"60".to_vec()),
        ("date".into(), b"Mon, 01 Dec 2025 09:00:00 GMT".to_vec()),
        ("x-request-id".into(), b"5b0e9c1a-7f3a-4d2e-9c1b".to_vec()),
    ]
}

fn measure(label: &str, n: usize, body_len: usize) {
    let body = Bytes::from(vec![b'x'; body_len]);
    // The answers exist before the cache, as they do in the gateway (the
    // first client's answer, or the row just read): what is measured is
    // what caching adds.
    let answers: Vec<StoredAnswer> = (0..n)
        .map(|_| StoredAnswer {
            status: 201,
            headers: headers(),
            body: body.clone(),
        })
        .collect();
    let keys: Vec<String> = (0..n)
        .map(|i| format!("9f4c2a7e-1b3d-4e5f-8a9b-{i:012}"))
        .collect();
    let cache = ReplayCache::new(n, usize::MAX, usize::MAX);
    let now = Instant::now();
    let until = now + Duration::from_secs(3600);
    let (heap0, rss0) = (LIVE.load(Ordering::Relaxed), rss_kib());
    for (key, answer) in keys.iter().zip(&answers) {
        let id = RecordId {
            route: "payments",
            method: "POST",
            key,
        };
        cache.insert(id, [7; 32], answer, until, now);
    }
    let (heap1, rss1) = (LIVE.load(Ordering::Relaxed), rss_kib());
    assert_eq!(cache.len(), n);
    // The body is shared with the answer it came from (a reference count,
    // not a copy); the charge counts it all the same.
    let heap = (heap1 - heap0) as f64 / n as f64;
    let rss = (rss1 - rss0) as f64 * 1024.0 / n as f64;
    let charged = cache.bytes() as f64 / n as f64;
    println!(
        "{label:<28} {n:>8} {heap:>12.0} {rss:>12.0} {charged:>12.0} {:>12.0}",
        heap + body_len as f64
    );
    drop(cache);
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().ok());
    let n = args.next().flatten().unwrap_or(50_000);
    let body = args.next().flatten().unwrap_or(60);
    println!(
        "{:<28} {:>8} {:>12} {:>12} {:>12} {:>12}",
        "answer", "records", "heap B/rec", "RSS B/rec", "charged", "heap+body"
    );
    measure(&format!("{body}-byte body"), n, body);
    println!(
        "default bounds: {} entries, {} MiB",
        fencegate::idempotency::CACHE_MAX_ENTRIES,
        fencegate::idempotency::CACHE_MAX_BYTES / (1024 * 1024)
    );
}
