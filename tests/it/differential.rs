//! Differential tests of the gateway's HTTP/1.1 framing against hyper's
//! HTTP/1, on generated and mutated byte streams.
//!
//! A hand-written parser needs a referee: request smuggling is two
//! readers disagreeing about where a message ends. Each case is a byte
//! stream made of generated messages (pipelined requests; chunked bodies
//! with extensions and trailers; `Content-Length` and `Transfer-Encoding`
//! in combination; odd whitespace, obs-fold, bare CR and LF), then mutated
//! byte by byte. Both readers get the same bytes, and must agree:
//!
//! - **requests** (the server's framing, [`frame_requests`], which is the
//!   connection's own `parse_head` and body gathering) against hyper's
//!   server (`hyper::server::conn::http1` over an in-memory pipe): the same
//!   requests, in order, with the same method, target and body bytes, and
//!   the same ending (every byte used, or a refusal or an incomplete
//!   message);
//! - **answers** (the upstream client's `upstream::wire::parse_head` and
//!   its `Decoder`) against hyper's client (`hyper::client::conn::http1`):
//!   answers with informational ones before them, conflicting framing, and
//!   bytes after their end: the same status and body bytes, or both
//!   refused.
//!
//! Where the gateway is stricter on purpose, the disagreement is allowed
//! only in one shape: the gateway refuses where hyper reads on, for a
//! reason listed in [`STRICTER_REQUESTS`] or [`STRICTER_ANSWERS`] with the
//! RFC's word for it, and everything before that agrees. Anything else
//! fails, shrunk to a small case.
//!
//! CI runs a fixed seed and [`CASES`] cases a side; `fuzz/run.sh` runs
//! more (`PROPTEST_CASES`, `PROPTEST_RNG_SEED`) and prints how many cases
//! agreed and how many were allowed, by reason.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fencegate::http1::client::answer::{parse_head, WireError};
use fencegate::http1::codec::{ChunkError, Decoded, Decoder};
use fencegate::http1::server::request::{frame_requests, HeadError, StreamEnd};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Cases a side in CI: a few seconds in a debug build.
const CASES: u32 = 5000;
/// The CI's seed.
const SEED: u64 = 49;

/// Requests the gateway refuses and hyper reads, on purpose.
const STRICTER_REQUESTS: &[(HeadError, &str)] = &[
    (
        HeadError::BareLf,
        "RFC 9112 §2.2: a recipient MAY take a bare LF for a line end (hyper and httparse do); \
         a front end that does not sees one field where the gateway would see two",
    ),
    (
        HeadError::Host,
        "RFC 9112 §3.2: a server MUST answer 400 to a request without Host (HTTP/1.1), with \
         more than one, or with an invalid one; hyper does not look at Host",
    ),
    (
        HeadError::UnsupportedCoding,
        "RFC 9112 §6.1: a coding the server does not implement is 501; hyper decodes \
         `gzip, chunked` or `chunked, chunked` as chunked and passes the coded bytes on",
    ),
    (
        HeadError::Coding,
        "RFC 9110 §5.6.1 lets a recipient ignore empty list elements, and RFC 9112 §6.1 has \
         no codings in HTTP/1.0; with an empty element in Transfer-Encoding some readers take \
         it for the last coding (hyper refuses `chunked,` and reads `, chunked` as chunked), \
         so the gateway takes neither",
    ),
    (
        HeadError::Chunked(ChunkError::Extension),
        "RFC 9112 §7.1.1: chunk-ext is tokens and quoted strings, never a control \
         character; hyper skips any byte but LF",
    ),
    (
        HeadError::Chunked(ChunkError::LineEnd),
        "RFC 9112 §7.1: every line of the chunked framing ends in CRLF; hyper takes a bare \
         LF inside the trailer section (a trailer line to it, the section's end to others)",
    ),
    (
        HeadError::Chunked(ChunkError::Trailer),
        "RFC 9112 §7.1.2 and §5: trailer fields are field lines; hyper skips trailer lines \
         up to their CRLF and hands them to httparse, which takes a bare LF for a line end",
    ),
];

/// Answers the gateway refuses and hyper's client reads, on purpose.
const STRICTER_ANSWERS: &[(WireError, &str)] = &[
    (
        WireError::Upgrade,
        "RFC 9110 §15.2.2: a 101 only answers a request that asked to upgrade, and the \
         gateway never asks; hyper's client hands any 101 to its caller",
    ),
    (
        WireError::BothFramings,
        "RFC 9112 §6.3: Transfer-Encoding with Content-Length ought to be handled as an \
         error (a sign of smuggling or splitting); hyper lets Transfer-Encoding win",
    ),
    (
        WireError::CodingGap,
        "RFC 9110 §5.6.1: an empty list element is ignored by some readers and taken for the \
         last coding by others (hyper reads `chunked,` to the close)",
    ),
    (
        WireError::Chunk(ChunkError::Extension),
        "RFC 9112 §7.1.1: no control character in a chunk extension",
    ),
    (
        WireError::Chunk(ChunkError::LineEnd),
        "RFC 9112 §7.1: CRLF everywhere in the chunked framing, trailers included",
    ),
    (
        WireError::Chunk(ChunkError::Trailer),
        "RFC 9112 §7.1.2 and §5: trailer fields are field lines",
    ),
];

// ---------------------------------------------------------------------
// What is generated.

/// Request methods, the plain one first (proptest shrinks toward it).
const METHODS: &[&str] = &["PUT", "GET", "POST", "HEAD", "DELETE", "OPTIONS", "PATCH"];
const TARGETS: &[&str] = &["/a", "/", "/a?b=c", "*", "http://h/a", "/a%20b"];
const VERSIONS: &[&str] = &["HTTP/1.1", "HTTP/1.0"];
const HOSTS: &[&str] = &[
    "Host: a\r\n",
    "",
    "Host: a\r\nHost: a\r\n",
    "Host: a b\r\n",
    "Host: u@a\r\n",
    "Host: [::1]:8080\r\n",
    "Host: a.example:80\r\n",
    "Host:\r\n",
];
const CONNECTIONS: &[&str] = &[
    "",
    "Connection: close\r\n",
    "Connection: keep-alive\r\n",
    "Connection: keep-alive, close\r\n",
];
/// Other fields, odd ones among them (obs-fold, whitespace, controls).
const FIELDS: &[&[u8]] = &[
    b"",
    b"X-A: b\r\n",
    b"X-A:\tb \t\r\n",
    b"X_A: b\r\n",
    b"X-E:\r\n",
    b"X-O: \x80ab\r\n",
    b"Expect: 100-continue\r\n",
    b"X-A: b\r\n c\r\n",
    b"X-A : b\r\n",
    b" X-A: b\r\n",
    b"X-A: a\rb\r\n",
    b"X-A: a\x01\r\n",
    b"X-A: b\n",
];
/// `Content-Length` values for a body of `{n}` bytes.
const LENGTHS: &[&str] = &[
    "{n}",
    "0{n}",
    "{n}, {n}",
    "{n}\r\nContent-Length: {n}",
    "{n}\r\nContent-Length: {m}",
    "+{n}",
    "{n} ",
    " {n}",
    "",
    "-{n}",
    "{n}x",
    "{n}, {m}",
];
const CODINGS: &[&str] = &[
    "chunked",
    "Chunked",
    "gzip, chunked",
    "chunked, gzip",
    "chunked, chunked",
    "identity",
    "",
    " chunked ",
    "chunked\r\nTransfer-Encoding: chunked",
    "gzip\r\nTransfer-Encoding: chunked",
    "chunked;q=1",
    ", chunked",
];
/// A chunk-size line for a chunk of `{x}` (hex) bytes, with its extension.
const SIZES: &[&str] = &[
    "{x}", "{X}", "00{x}", "{x} ", "{x}\t", " {x}", "{x}x", "", "+{x}", "{x}0",
];
const EXTENSIONS: &[&[u8]] = &[
    b"",
    b";a=b",
    b";a",
    b" ; a = \"q;\\\"\"",
    b";a=\"\x80\"",
    b";\x01",
    b";a\nb",
    b";a\rb",
    b";\x7f",
    b";a\tb",
];
const LINE_ENDS: &[&[u8]] = &[b"\r\n", b"\n", b"\r", b"\r\r\n"];
const DATA_ENDS: &[&[u8]] = &[b"\r\n", b"\n", b"\r", b"", b"x\r\n", b"\r\n\r\n"];
const LAST_CHUNKS: &[&[u8]] = &[
    b"0\r\n",
    b"000\r\n",
    b"0;e=1\r\n",
    b"0\n",
    b"\r\n",
    b"0 \r\n",
    b"0;\x01\r\n",
];
const TRAILERS: &[&[u8]] = &[
    b"X-T: v\r\n",
    b"X-T:v\r\n",
    b"X T: v\r\n",
    b"X-T : v\r\n",
    b" folded\r\n",
    b"X-T: a\x01\r\n",
    b"nocolon\r\n",
    b"\tx: y\r\n",
    b"X-T: v\n",
    b"GET /s HTTP/1.1\r\n",
    b"X-T: a\rb\r\n",
];
const SECTION_ENDS: &[&[u8]] = &[b"\r\n", b"\n", b"", b"\r"];
/// Bytes of bodies: enough of a head's to hide one.
const DATA: &[u8] = b"aZ0 \r\n:;G/";
/// What a mutation inserts.
const INSERTS: &[&[u8]] = &[
    b" ", b"\t", b"\r", b"\n", b"\r\n", b"\r\n ", b"\x00", b";", b"0", b"a", b":", b",",
];

#[derive(Debug, Clone)]
struct Chunk {
    data: Vec<u8>,
    size: usize,
    ext: usize,
    line_end: usize,
    data_end: usize,
}

#[derive(Debug, Clone)]
enum Body {
    None,
    Length {
        value: usize,
        data: Vec<u8>,
        /// Bytes more (or fewer) than declared.
        off: i8,
    },
    Chunked {
        coding: usize,
        chunks: Vec<Chunk>,
        last: usize,
        trailers: Vec<usize>,
        end: usize,
        /// A `Content-Length` too.
        length: bool,
    },
}

/// One message's head fields and body, for a request or an answer.
#[derive(Debug, Clone)]
struct Message {
    fields: Vec<usize>,
    connection: usize,
    body: Body,
}

#[derive(Debug, Clone)]
struct Req {
    method: usize,
    target: usize,
    version: usize,
    host: usize,
    message: Message,
}

#[derive(Debug, Clone)]
enum Mutation {
    /// The nth CRLF becomes a bare LF, or a bare CR.
    Crlf {
        nth: usize,
        lf: bool,
    },
    Insert {
        at: usize,
        what: usize,
    },
    Delete {
        at: usize,
        len: usize,
    },
    Truncate {
        at: usize,
    },
}

/// Weighted toward the plain variant (index 0), so that most cases are
/// valid enough to reach the interesting parts.
fn pick(len: usize) -> impl Strategy<Value = usize> {
    prop_oneof![3 => Just(0), 2 => 0..len]
}

fn data() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(select(DATA), 1..12)
}

fn chunk() -> impl Strategy<Value = Chunk> {
    (
        data(),
        pick(SIZES.len()),
        pick(EXTENSIONS.len()),
        pick(LINE_ENDS.len()),
        pick(DATA_ENDS.len()),
    )
        .prop_map(|(data, size, ext, line_end, data_end)| Chunk {
            data,
            size,
            ext,
            line_end,
            data_end,
        })
}

fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        1 => Just(Body::None),
        2 => (pick(LENGTHS.len()), data(), prop_oneof![4 => Just(0i8), 1 => -1i8..=1])
            .prop_map(|(value, data, off)| Body::Length { value, data, off }),
        4 => (
            pick(CODINGS.len()),
            proptest::collection::vec(chunk(), 0..4),
            pick(LAST_CHUNKS.len()),
            prop_oneof![3 => Just(vec![]), 1 => proptest::collection::vec(0..TRAILERS.len(), 1..3)],
            pick(SECTION_ENDS.len()),
            prop_oneof![6 => Just(false), 1 => Just(true)],
        )
            .prop_map(|(coding, chunks, last, trailers, end, length)| Body::Chunked {
                coding,
                chunks,
                last,
                trailers,
                end,
                length,
            }),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    (
        proptest::collection::vec(0..FIELDS.len(), 0..3),
        pick(CONNECTIONS.len()),
        body(),
    )
        .prop_map(|(fields, connection, body)| Message {
            fields,
            connection,
            body,
        })
}

fn request() -> impl Strategy<Value = Req> {
    (
        0..METHODS.len(),
        pick(TARGETS.len()),
        prop_oneof![4 => Just(0), 1 => Just(1)],
        // Mostly valid: a refused Host ends a stream before what follows.
        prop_oneof![8 => Just(0), 1 => 0..HOSTS.len()],
        message(),
    )
        .prop_map(|(method, target, version, host, message)| Req {
            method,
            target,
            version,
            host,
            message,
        })
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0..12usize, any::<bool>()).prop_map(|(nth, lf)| Mutation::Crlf { nth, lf }),
        (any::<usize>(), 0..INSERTS.len()).prop_map(|(at, what)| Mutation::Insert { at, what }),
        (any::<usize>(), 1..3usize).prop_map(|(at, len)| Mutation::Delete { at, len }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
    ]
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    prop_oneof![
        1 => Just(vec![]),
        1 => proptest::collection::vec(mutation(), 1..3),
    ]
}

impl Message {
    /// The head's fields after the start line, the empty line, and the body.
    fn write(&self, out: &mut Vec<u8>) {
        for &f in &self.fields {
            out.extend_from_slice(FIELDS[f]);
        }
        out.extend_from_slice(CONNECTIONS[self.connection].as_bytes());
        match &self.body {
            Body::None => out.extend_from_slice(b"\r\n"),
            Body::Length { value, data, off } => {
                let n = data.len();
                let value = LENGTHS[*value]
                    .replace("{n}", &n.to_string())
                    .replace("{m}", &(n + 1).to_string());
                out.extend_from_slice(format!("Content-Length: {value}\r\n\r\n").as_bytes());
                let sent = (n as isize + isize::from(*off)).max(0) as usize;
                out.extend(data.iter().copied().cycle().take(sent));
            }
            Body::Chunked {
                coding,
                chunks,
                last,
                trailers,
                end,
                length,
            } => {
                out.extend_from_slice(
                    format!("Transfer-Encoding: {}\r\n", CODINGS[*coding]).as_bytes(),
                );
                if *length {
                    out.extend_from_slice(b"Content-Length: 3\r\n");
                }
                out.extend_from_slice(b"\r\n");
                for c in chunks {
                    let n = c.data.len();
                    let size = SIZES[c.size]
                        .replace("{x}", &format!("{n:x}"))
                        .replace("{X}", &format!("{n:X}"));
                    out.extend_from_slice(size.as_bytes());
                    out.extend_from_slice(EXTENSIONS[c.ext]);
                    out.extend_from_slice(LINE_ENDS[c.line_end]);
                    out.extend_from_slice(&c.data);
                    out.extend_from_slice(DATA_ENDS[c.data_end]);
                }
                out.extend_from_slice(LAST_CHUNKS[*last]);
                for &t in trailers {
                    out.extend_from_slice(TRAILERS[t]);
                }
                out.extend_from_slice(SECTION_ENDS[*end]);
            }
        }
    }
}

impl Req {
    fn write(&self, out: &mut Vec<u8>) {
        let line = format!(
            "{} {} {}\r\n{}",
            METHODS[self.method], TARGETS[self.target], VERSIONS[self.version], HOSTS[self.host]
        );
        out.extend_from_slice(line.as_bytes());
        self.message.write(out);
    }
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        if bytes.is_empty() {
            break;
        }
        match *m {
            Mutation::Crlf { nth, lf } => {
                let at = bytes.windows(2).enumerate().filter(|(_, w)| *w == b"\r\n");
                if let Some((i, _)) = at.clone().nth(nth % at.count().max(1)) {
                    bytes.remove(if lf { i } else { i + 1 });
                }
            }
            Mutation::Insert { at, what } => {
                let at = at % (bytes.len() + 1);
                bytes.splice(at..at, INSERTS[what].iter().copied());
            }
            Mutation::Delete { at, len } => {
                let at = at % bytes.len();
                bytes.drain(at..(at + len).min(bytes.len()));
            }
            Mutation::Truncate { at } => bytes.truncate(at % bytes.len()),
        }
    }
    bytes
}

/// A case's bytes, shown as escaped text (proptest shows the smallest
/// failing case by its `Debug`).
#[derive(Clone)]
struct Shown(Vec<u8>);

impl std::fmt::Debug for Shown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "b\"{}\"", self.0.escape_ascii())
    }
}

fn stream() -> impl Strategy<Value = Shown> {
    (proptest::collection::vec(request(), 1..4), mutations()).prop_map(|(reqs, mutations)| {
        let mut out = Vec::new();
        for r in &reqs {
            r.write(&mut out);
        }
        Shown(mutate(out, &mutations))
    })
}

// ---------------------------------------------------------------------
// The two readers of requests.

/// A request as read: method, target, body.
type Read = (String, String, Vec<u8>);

/// What a reader made of a stream: its requests, and whether it refused
/// one (`Err`, with the gateway's reason). Running out of bytes inside a
/// message is no refusal: the server closes quietly at the client's close
/// then, as hyper does once what is left is only empty lines.
#[derive(Debug, PartialEq, Eq)]
struct Reading {
    requests: Vec<Read>,
    end: Result<(), Option<HeadError>>,
}

fn gateway_reads(stream: &[u8]) -> Reading {
    let (framed, end) = frame_requests(stream);
    let requests = framed
        .into_iter()
        .map(|f| {
            (
                f.request.method.to_string(),
                f.request.uri.to_string(),
                f.body.to_vec(),
            )
        })
        .collect();
    let end = match end {
        StreamEnd::Done | StreamEnd::Incomplete => Ok(()),
        StreamEnd::Refused(e) => Err(Some(e)),
    };
    Reading { requests, end }
}

/// hyper's server on the stream: every request whose body it read whole,
/// and whether the connection ended without an error.
async fn hyper_reads(stream: Vec<u8>) -> Reading {
    let (mut client, server) = tokio::io::duplex(1 << 20);
    // The requests read whole, and whether a body was refused (hyper
    // reports that to the body's reader, not as the connection's error).
    let seen: Arc<Mutex<(Vec<Read>, bool)>> = Arc::default();
    let log = seen.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let log = log.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await;
            let mut log = log.lock().unwrap();
            match body {
                Ok(body) => log.0.push((
                    parts.method.to_string(),
                    parts.uri.to_string(),
                    body.to_bytes().to_vec(),
                )),
                Err(e) => log.1 |= !ran_out(&e),
            }
            Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
        }
    });
    let conn = tokio::spawn(async move {
        hyper::server::conn::http1::Builder::new()
            .half_close(true)
            .serve_connection(TokioIo::new(server), service)
            .await
    });
    let _ = client.write_all(&stream).await;
    let _ = client.shutdown().await;
    let mut answers = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut answers));
    assert!(read.await.is_ok(), "hyper never ended the connection");
    let refused = match conn.await.expect("hyper's connection task") {
        Ok(()) => false,
        Err(e) => !ran_out(&e),
    };
    let (requests, body_refused) = std::mem::take(&mut *seen.lock().unwrap());
    Reading {
        requests,
        end: if refused || body_refused {
            Err(None)
        } else {
            Ok(())
        },
    }
}

/// Whether hyper's error is the bytes' end inside a message, rather than
/// a refusal of them.
fn ran_out(e: &hyper::Error) -> bool {
    if e.is_incomplete_message() {
        return true;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Whether the readings agree, or differ only where the gateway is
/// stricter on purpose (its reason, then); an error saying how otherwise.
fn judge_requests(gateway: &Reading, hyper: &Reading) -> Result<Option<&'static str>, String> {
    if gateway == hyper
        || (gateway.requests == hyper.requests && gateway.end.is_err() && hyper.end.is_err())
    {
        return Ok(None);
    }
    if let Err(Some(refusal)) = gateway.end {
        let agreed = hyper.requests.starts_with(&gateway.requests);
        let listed = STRICTER_REQUESTS.iter().find(|(e, _)| *e == refusal);
        if let (true, Some((_, why))) = (agreed, listed) {
            return Ok(Some(why));
        }
    }
    Err(format!(
        "the gateway read {gateway:?}\nhyper read {hyper:?}"
    ))
}

/// Tallies of a run, printed at its end (see `fuzz/run.sh`).
#[derive(Default)]
struct Tally {
    cases: usize,
    agreed: usize,
    stricter: BTreeMap<&'static str, usize>,
}

impl Tally {
    fn note(&mut self, allowed: Option<&'static str>) {
        self.cases += 1;
        match allowed {
            None => self.agreed += 1,
            Some(why) => *self.stricter.entry(why).or_default() += 1,
        }
    }

    fn print(&self, side: &str) {
        eprintln!(
            "differential {side}: {} cases, {} agreed, {} where the gateway is stricter on purpose",
            self.cases,
            self.agreed,
            self.cases - self.agreed
        );
        for (why, n) in &self.stricter {
            eprintln!("  {n:>6}  {why}");
        }
    }
}

fn config() -> Config {
    let env = |name: &str| std::env::var(name).ok();
    Config {
        cases: env("PROPTEST_CASES")
            .and_then(|v| v.parse().ok())
            .unwrap_or(CASES),
        rng_seed: RngSeed::Fixed(
            env("PROPTEST_RNG_SEED")
                .and_then(|v| v.parse().ok())
                .unwrap_or(SEED),
        ),
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// Runs `judge` on `strategy`'s cases; fails on the first disagreement it
/// reports (shrunk), and prints the tally either way.
fn differ<S: Strategy>(
    side: &str,
    strategy: S,
    judge: impl Fn(&S::Value) -> Result<Option<&'static str>, String>,
) {
    let tally = Mutex::new(Tally::default());
    let mut runner = TestRunner::new(config());
    let run = runner.run(&strategy, |case| {
        let allowed = judge(&case).map_err(TestCaseError::fail)?;
        tally.lock().unwrap().note(allowed);
        Ok(())
    });
    tally.lock().unwrap().print(side);
    if let Err(e) = run {
        panic!("{e}");
    }
}

#[test]
fn requests_are_framed_as_hyper_frames_them() {
    let rt = runtime();
    differ("requests", stream(), |Shown(bytes)| {
        let gateway = gateway_reads(bytes);
        let hyper = rt.block_on(hyper_reads(bytes.clone()));
        judge_requests(&gateway, &hyper)
    });
}

// ---------------------------------------------------------------------
// Answers.

const STATUSES: &[&str] = &[
    "200 OK",
    "201 Created",
    "204 No Content",
    "304 Not Modified",
    "404 Not Found",
    "101 Switching Protocols",
];
const INTERIM: &[&str] = &[
    "",
    "HTTP/1.1 100 Continue\r\n\r\n",
    "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
    "HTTP/1.1 100 Continue\r\nContent-Length: 5\r\n\r\n",
];
const AFTER: &[&[u8]] = &[
    b"",
    b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nsmuggled",
    b"xyz",
    b"\r\n",
];
const ASKED: &[&str] = &["GET", "HEAD", "PUT"];

#[derive(Debug, Clone)]
struct Answer {
    asked: usize,
    interim: usize,
    version: usize,
    status: usize,
    message: Message,
    after: usize,
}

fn answer() -> impl Strategy<Value = Answer> {
    (
        pick(ASKED.len()),
        pick(INTERIM.len()),
        prop_oneof![4 => Just(0), 1 => Just(1)],
        pick(STATUSES.len()),
        message(),
        pick(AFTER.len()),
    )
        .prop_map(|(asked, interim, version, status, message, after)| Answer {
            asked,
            interim,
            version,
            status,
            message,
            after,
        })
}

fn answer_case() -> impl Strategy<Value = (&'static str, Shown)> {
    (answer(), mutations()).prop_map(|(a, mutations)| {
        let mut out = INTERIM[a.interim].as_bytes().to_vec();
        let line = format!("{} {}\r\n", VERSIONS[a.version], STATUSES[a.status]);
        out.extend_from_slice(line.as_bytes());
        a.message.write(&mut out);
        out.extend_from_slice(AFTER[a.after]);
        (ASKED[a.asked], Shown(mutate(out, &mutations)))
    })
}

/// What a client made of an answer: its status and body, or a refusal
/// (the gateway's reason when it gave one).
type Answered = Result<(u16, Vec<u8>), Option<WireError>>;

/// The upstream client's reading, by its own steps: the head, then the
/// body by its decoder, the bytes' end being the connection's close.
fn gateway_answer(bytes: &[u8], asked: &Method) -> Answered {
    let mut buf = BytesMut::from(bytes);
    let head = parse_head(&mut buf, asked).map_err(Some)?.ok_or(None)?;
    let mut decoder = head.body;
    let mut body = Vec::new();
    loop {
        match decoder.decode(&mut buf).map_err(|e| Some(e.into()))? {
            Decoded::Data(d) => body.extend_from_slice(&d),
            Decoded::End => break,
            Decoded::More if decoder == Decoder::ToClose => break,
            Decoded::More => return Err(None),
        }
    }
    Ok((head.status.as_u16(), body))
}

/// hyper's client asking `asked` of an upstream that answers `bytes` and
/// closes.
async fn hyper_answer(bytes: Vec<u8>, asked: Method) -> Answered {
    let (client, mut server) = tokio::io::duplex(1 << 20);
    let upstream = tokio::spawn(async move {
        let mut request = [0u8; 4096];
        let _ = server.read(&mut request).await;
        let _ = server.write_all(&bytes).await;
        let _ = server.shutdown().await;
        // Held open for reading until the client is done.
        let _ = server.read_to_end(&mut Vec::new()).await;
    });
    let exchange = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client))
            .await
            .map_err(|_| None)?;
        tokio::spawn(conn);
        let req = Request::builder()
            .method(asked)
            .uri("/")
            .header("host", "upstream")
            .body(Empty::<Bytes>::new())
            .expect("a request");
        let resp = sender.send_request(req).await.map_err(|_| None)?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.map_err(|_| None)?;
        Ok((status, body.to_bytes().to_vec()))
    };
    let answered = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .expect("hyper's client never finished");
    upstream.abort();
    answered
}

fn judge_answers(gateway: &Answered, hyper: &Answered) -> Result<Option<&'static str>, String> {
    match (gateway, hyper) {
        (Ok(g), Ok(h)) if g == h => Ok(None),
        (Err(_), Err(_)) => Ok(None),
        (Err(Some(refusal)), Ok(_)) => STRICTER_ANSWERS
            .iter()
            .find(|(e, _)| e == refusal)
            .map(|(_, why)| Some(*why))
            .ok_or_else(|| format!("the gateway refused ({refusal}), hyper read {hyper:?}")),
        _ => Err(format!(
            "the gateway read {gateway:?}\nhyper read {hyper:?}"
        )),
    }
}

#[test]
fn answers_are_framed_as_hyper_frames_them() {
    let rt = runtime();
    differ("answers", answer_case(), |(asked, Shown(bytes))| {
        let asked: Method = asked.parse().expect("a method");
        let gateway = gateway_answer(bytes, &asked);
        let hyper = rt.block_on(hyper_answer(bytes.clone(), asked));
        judge_answers(&gateway, &hyper)
    });
}
