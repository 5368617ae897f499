//! The upstream has a fenced write's request, or never will (CONTRACT.md,
//! third round, "The upstream has it, or never will"; issue 48 §1). A
//! request counts as handed over only when the upstream's TCP has
//! acknowledged all of it; an upstream connection whose exchange ends any
//! way but normally is reset (`SO_LINGER {1, 0}`, so a crashed process
//! resets too), never closed with data queued and never pooled. Otherwise
//! the kernel goes on delivering the old request after the key reopened.
//!
//! Every case: token 6 with a 300 KB body, then token 7 with a small one on
//! the same key, route `timeout_ms` 2 s, and an upstream whose sockets have
//! a 4 KiB receive buffer ([`RawUpstream::start_with_recv_buffer`]) and
//! that leaves 6's body unread for seconds (`x-test-stall-ms`), so that
//! most of it sits in the gateway's send queue. Checked at the upstream
//! once it settled: token 6 is never applied after 7 (applied `[7]` or
//! `[6, 7]`, never `[7, 6]`, and no "applied 6 after 7"), and the write of
//! a reset connection is recorded aborted, its body incomplete.
//!
//! | case | upstream | gateway | what went wrong before |
//! | --- | --- | --- | --- |
//! | [`stall_body`] | reads the head, then nothing for 4 s | in process, every set-up | 504 at 2 s, 7 applied; the closed socket (FIN-WAIT-1) delivered 6 whole at 4 s |
//! | [`answer_at_once`] | answers 200 right after the head, reads the body 4 s later | in process, every set-up | the answer was not seen as early (the body was "sent" into the socket): 7 admitted at once, 6 applied at 4 s |
//! | [`early_answer_with_a_slow_client_body`] | as above; the client sends the body's rest once the answer is out | in process, every set-up | 7 held to the deadline, but the connection pooled with the body queued: 6 applied after 7 |
//! | [`half_close_after_the_answer`] | answers 200, shuts its side (FIN), reads the body 4 s later | in process, every set-up | held to the deadline, socket closed in LAST-ACK with the body queued: 6 applied after 7 |
//! | [`shared_kill_9_mid_write`] | reads the head, then nothing for 6 s | two processes, shared mode: A killed (-9) mid-write, 7 through B | B admitted 7 when 6's marker ended; the orphaned socket delivered 6 |
//! | [`single_kill_9_then_restart`] | reads the head, then nothing for 7 s | a process, single mode on SQLite: killed mid-write, restarted, 7 through the restart | the restart's wait released 7, then 6 was delivered |
//! | [`shared_sigstop_mid_write`] | reads the head, then nothing for 4.5 s | two processes, shared mode: A stopped mid-write, 7 through B, then A resumed | the upstream read all of 6 from the stopped process's send queue |
//!
//! The upstream, stalled, learns of a reset only when it reads again: until
//! then it counts 6 as in flight, and sees 7 arrive meanwhile ("two tokens
//! in flight"). That overlap is the price of the deadline (as in
//! `exchange_lifetime`'s cases 5 and 8) and is not checked; what is checked
//! is what the upstream *does* with 6. Each case also checks that it meant
//! something: 7 was applied before the upstream's stall of 6 ended, so an
//! old request the kernel delivers late would have been applied after 7.
//!
//! Timing: 7 is sent 1 s after 6's head reached the upstream in process (2.2
//! s for the processes in shared mode, so that 7's own `timeout_ms`, counted
//! from when it starts waiting, outlasts 6's in-flight marker); the stalls
//! end seconds after 7 is applied on a correct gateway. Every wait is
//! bounded: a stuck gateway fails a test, it does not hang it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::support::app::{config_sections, config_text, docs_route, TestApp, SHARED_STORE};
use crate::support::db::{Backend, TestStore};
use crate::support::process::GatewayProcess;
use crate::support::raw_upstream::{
    read_response, Behaviour, RawResponse, RawUpstream, BEHAVIOUR_HEADER, FENCE_HEADER,
    STALL_MS_HEADER,
};
use crate::support::setups::{on_every_setup, Setup};
use crate::support::wait_for;

/// The route's `timeout_ms`.
const TIMEOUT: Duration = Duration::from_millis(2000);
/// Token 6's body: far more than the upstream's receive buffer holds.
const BIG: usize = 300 * 1024;
/// The upstream's `SO_RCVBUF`.
const RCVBUF: u32 = 4096;
/// How long the in-process cases' upstream leaves 6's body unread.
const STALL: Duration = Duration::from_millis(4000);
/// When token 7 is sent in process, after 6's head reached the upstream.
const SEVEN_AFTER: Duration = Duration::from_millis(1000);
/// Upper bound for the upstream to finish everything it was sent.
const SETTLE: Duration = Duration::from_secs(15);
/// Upper bound for any one answer of the gateway.
const ANSWER: Duration = Duration::from_secs(20);
/// How long the gateway is given to write what it will of 6's body before
/// the process cases kill or stop it.
const WRITE_PAUSE: Duration = Duration::from_millis(300);

/// The in-process gateway(s), the upstream, the store.
struct Rig {
    /// One instance in single mode; A and B in shared mode.
    apps: Vec<TestApp>,
    up: RawUpstream,
    _store: TestStore,
}

impl Rig {
    async fn new(setup: Setup) -> Rig {
        let up = RawUpstream::start_with_recv_buffer(RCVBUF).await;
        let store = TestStore::new(setup.backend()).await;
        let routes = routes(&up);
        let apps = setup.spawn(&store.url, &routes).await;
        Rig {
            apps,
            up,
            _store: store,
        }
    }

    /// The instance token 6 goes through.
    fn a(&self) -> &TestApp {
        &self.apps[0]
    }

    /// The instance token 7 goes through (A itself in single mode).
    fn b(&self) -> &TestApp {
        self.apps.last().expect("an instance")
    }
}

/// The test route with `timeout_ms` = [`TIMEOUT`].
fn routes(up: &RawUpstream) -> String {
    format!(
        "{}timeout_ms = {}\n",
        docs_route(&up.url()),
        TIMEOUT.as_millis()
    )
}

/// Token 6's body: letters, so that a prefix of it is recognisable.
fn big_body() -> Vec<u8> {
    (0..BIG).map(|i| b'a' + (i % 26) as u8).collect()
}

/// Token 6's client: a raw connection whose head and body a task writes
/// (the gateway may stop taking the body, and the test must not wait on
/// that) while another task reads the answer.
struct BigWrite {
    writer: JoinHandle<()>,
    answer: JoinHandle<Option<RawResponse>>,
}

impl BigWrite {
    /// Sends token 6 on `path` through the gateway at `addr`, with the
    /// upstream's `behaviour` and a stall of `stall`. With `rest_when`, only
    /// the first third of the body goes at once, the rest when it fires.
    async fn send(
        addr: SocketAddr,
        path: &str,
        behaviour: Behaviour,
        stall: Duration,
        rest_when: Option<oneshot::Receiver<()>>,
    ) -> BigWrite {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut rd, mut wr) = stream.into_split();
        let head = format!(
            "PUT {path} HTTP/1.1\r\nhost: gateway\r\n{FENCE_HEADER}: 6\r\n\
             {BEHAVIOUR_HEADER}: {}\r\n{STALL_MS_HEADER}: {}\r\ncontent-length: {BIG}\r\n\r\n",
            behaviour.as_str(),
            stall.as_millis()
        );
        let body = big_body();
        let writer = tokio::spawn(async move {
            let split = if rest_when.is_some() { BIG / 3 } else { BIG };
            let mut first = head.into_bytes();
            first.extend_from_slice(&body[..split]);
            if wr.write_all(&first).await.is_err() {
                return;
            }
            if let Some(rest_when) = rest_when {
                if rest_when.await.is_ok() {
                    let _ = wr.write_all(&body[split..]).await;
                }
            }
            // Keep the sending side open: the client has not left.
            std::future::pending::<()>().await;
        });
        let answer = tokio::spawn(async move {
            let mut buf = BytesMut::new();
            let read = read_response(&mut rd, &mut buf);
            match tokio::time::timeout(ANSWER, read).await {
                Ok(Ok(resp)) => Some(resp),
                _ => None,
            }
        });
        BigWrite { writer, answer }
    }

    /// The status of the gateway's answer to token 6; `None` if no answer
    /// head came within [`ANSWER`].
    async fn status(&mut self) -> Option<u16> {
        (&mut self.answer)
            .await
            .expect("token 6's reader")
            .map(|r| r.status)
    }
}

impl Drop for BigWrite {
    fn drop(&mut self) {
        self.writer.abort();
        self.answer.abort();
    }
}

/// Sends token 7 to `url` (a gateway's URL of the key's path) and answers its
/// status; panics if no answer comes within [`ANSWER`].
async fn send_seven(url: String) -> u16 {
    let resp = reqwest::Client::new()
        .put(url)
        .header(FENCE_HEADER, "7")
        .body("seven")
        .timeout(ANSWER)
        .send()
        .await
        .expect("the gateway answers token 7");
    let status = resp.status().as_u16();
    let _ = resp.bytes().await;
    status
}

/// Waits until 6's head reached the upstream; answers when it did.
async fn six_arrived(up: &RawUpstream, path: &str) -> Instant {
    wait_for("token 6's head at the upstream", || {
        up.arrived(path, 6) == 1
    })
    .await;
    up.write(path, 6).started
}

/// Once the upstream has settled: 6 was never applied after 7, and a 6 not
/// applied was cut off (a reset), not left to arrive; the case meant
/// something (7 was applied before the stall of 6 ended). `t0`: when 6 was
/// sent. Answers the timeline for later messages.
async fn six_never_after_seven(
    up: &RawUpstream,
    path: &str,
    t0: Instant,
    stall: Duration,
) -> String {
    up.settle(SETTLE).await;
    let timeline = up.timeline(path, t0);
    let applied_late: Vec<String> = up
        .violations()
        .into_iter()
        .filter(|v| v.starts_with("applied "))
        .collect();
    let applied = up.applied_tokens(path);
    assert!(
        applied_late.is_empty() && applied != [7, 6],
        "the upstream applied token 6 after token 7 ({}; applied in this order: {applied:?}): \
         the gateway let the key reopen while the old request could still reach the upstream \
         (it closed or pooled the connection with the body queued, or left it to a dead or \
         stopped process, instead of resetting it)\n{timeline}",
        applied_late.join("; ")
    );
    let (w6, w7) = (up.write(path, 6), up.write(path, 7));
    let seven_applied = w7
        .applied_at
        .unwrap_or_else(|| panic!("token 7 was not applied\n{timeline}"));
    assert!(
        seven_applied < w6.started + stall,
        "the test did not mean anything: token 7 was applied only after the upstream's \
         stall of token 6 ended\n{timeline}"
    );
    assert_eq!(
        applied,
        vec![7],
        "token 6 came complete while the upstream stalled past its deadline\n{timeline}"
    );
    assert!(
        w6.aborted && !w6.body_complete && w6.body_bytes < BIG,
        "token 6's connection must have been reset, its body cut short: {} of {BIG} bytes \
         arrived, complete: {}\n{timeline}",
        w6.body_bytes,
        w6.body_complete
    );
    timeline
}

on_every_setup!(stall_body);
on_every_setup!(answer_at_once);
on_every_setup!(early_answer_with_a_slow_client_body);
on_every_setup!(half_close_after_the_answer);

/// The upstream reads 6's head, then nothing for 4 s. The gateway answers
/// 6 at its deadline (504, or 502) and lets 7 through; the connection must
/// be reset then, not closed with 290 KB still to deliver.
async fn stall_body(setup: Setup) {
    let rig = Rig::new(setup).await;
    let path = "/docs/handover-stall";
    let t0 = Instant::now();
    let mut six = BigWrite::send(rig.a().addr, path, Behaviour::StallBody, STALL, None).await;
    let head_at = six_arrived(&rig.up, path).await;
    tokio::time::sleep_until((head_at + SEVEN_AFTER).into()).await;
    let seven = tokio::spawn(send_seven(rig.b().url(path)));
    let status = six.status().await;
    assert!(
        matches!(status, Some(502 | 504)),
        "token 6, whose body the upstream never took within timeout_ms, must be answered \
         504 (or 502); it got {status:?}"
    );
    assert_eq!(seven.await.unwrap(), 200, "token 7 is forwarded");
    six_never_after_seven(&rig.up, path, t0, STALL).await;
}

/// The upstream answers 200 at once, before reading any of 6's body, then
/// reads it 4 s later. The answer comes while most of the body sits in the
/// gateway's send queue: an early answer, so the key stays closed to the
/// deadline and the connection is reset, rather than 7 admitted at once
/// and 6's queued body delivered after it.
async fn answer_at_once(setup: Setup) {
    let rig = Rig::new(setup).await;
    let path = "/docs/handover-answer";
    let t0 = Instant::now();
    let mut six = BigWrite::send(rig.a().addr, path, Behaviour::AnswerThenStall, STALL, None).await;
    let head_at = six_arrived(&rig.up, path).await;
    tokio::time::sleep_until((head_at + SEVEN_AFTER).into()).await;
    let seven = tokio::spawn(send_seven(rig.b().url(path)));
    assert_eq!(seven.await.unwrap(), 200, "token 7 is forwarded");
    let status = six.status().await;
    // 200 is the upstream's own (early) answer, relayed.
    assert!(
        matches!(status, Some(200 | 502 | 504)),
        "token 6 got {status:?}"
    );
    six_never_after_seven(&rig.up, path, t0, STALL).await;
}

/// As [`answer_at_once`], with the client sending the last two thirds of
/// 6's body only once the upstream has answered, so that the gateway sees
/// the answer while the body is still coming. The key stays closed to the
/// deadline; the connection, its send queue still holding the body, must
/// be reset, not pooled.
async fn early_answer_with_a_slow_client_body(setup: Setup) {
    let rig = Rig::new(setup).await;
    let path = "/docs/handover-slow-client";
    let t0 = Instant::now();
    let (rest, rest_when) = oneshot::channel();
    let mut six = BigWrite::send(
        rig.a().addr,
        path,
        Behaviour::AnswerThenStall,
        STALL,
        Some(rest_when),
    )
    .await;
    let head_at = six_arrived(&rig.up, path).await;
    tokio::time::sleep_until((head_at + Duration::from_millis(300)).into()).await;
    let _ = rest.send(());
    tokio::time::sleep_until((head_at + SEVEN_AFTER).into()).await;
    let seven = tokio::spawn(send_seven(rig.b().url(path)));
    assert_eq!(seven.await.unwrap(), 200, "token 7 is forwarded");
    let status = six.status().await;
    assert!(
        matches!(status, Some(200 | 502 | 504)),
        "token 6 got {status:?}"
    );
    six_never_after_seven(&rig.up, path, t0, STALL).await;
}

/// The upstream sends a complete 200 with `connection: close` right after
/// 6's head and shuts its sending side, then reads the body 4 s later. The
/// gateway, done reading, must reset the connection, not close it (a close
/// leaves it in LAST-ACK with the body queued, delivered later).
async fn half_close_after_the_answer(setup: Setup) {
    let rig = Rig::new(setup).await;
    let path = "/docs/handover-half-close";
    let t0 = Instant::now();
    let mut six = BigWrite::send(
        rig.a().addr,
        path,
        Behaviour::HalfCloseAfterHead,
        STALL,
        None,
    )
    .await;
    let head_at = six_arrived(&rig.up, path).await;
    tokio::time::sleep_until((head_at + SEVEN_AFTER).into()).await;
    let seven = tokio::spawn(send_seven(rig.b().url(path)));
    assert_eq!(seven.await.unwrap(), 200, "token 7 is forwarded");
    let status = six.status().await;
    assert!(
        matches!(status, Some(200 | 502 | 504)),
        "token 6 got {status:?}"
    );
    six_never_after_seven(&rig.up, path, t0, STALL).await;
}

// ---------------------------------------------------------------------------
// Gateway processes: a crash or a pause mid-write.

/// Two processes' config: shared mode on the store at `store_url`.
fn shared_config(store_url: &str, up: &RawUpstream) -> String {
    config_sections("", store_url, SHARED_STORE, &routes(up))
}

/// Starts the processes for `config`, off the runtime's threads.
async fn start_processes(config: &str, n: usize) -> Vec<GatewayProcess> {
    let config = config.to_string();
    tokio::task::spawn_blocking(move || (0..n).map(|_| GatewayProcess::start(&config)).collect())
        .await
        .expect("start the gateway processes")
}

/// When token 7 is sent to another shared-mode instance, after 6's head
/// reached the upstream: after 6's forward deadline, a little before its
/// in-flight marker (`timeout_ms` + 1 s from its admission) ends, so that
/// 7's own `timeout_ms`, counted from when it starts waiting, outlasts it.
const SHARED_SEVEN_AFTER: Duration = Duration::from_millis(2200);

/// Shared mode: instance A is killed (-9) while 6's body waits in its send
/// queue; B admits 7 when 6's in-flight marker ends. The kernel, which
/// closes a dead process's sockets, must reset 6's connection (`SO_LINGER
/// {1, 0}`), not close it and go on delivering the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_kill_9_mid_write() {
    let stall = Duration::from_millis(6000);
    let up = RawUpstream::start_with_recv_buffer(RCVBUF).await;
    let store = TestStore::new(Backend::Postgres).await;
    let mut procs = start_processes(&shared_config(&store.url, &up), 2).await;
    let path = "/docs/handover-kill-shared";
    let t0 = Instant::now();
    let six = BigWrite::send(procs[0].addr, path, Behaviour::StallBody, stall, None).await;
    let head_at = six_arrived(&up, path).await;
    tokio::time::sleep(WRITE_PAUSE).await;
    procs[0].kill9();
    tokio::time::sleep_until((head_at + SHARED_SEVEN_AFTER).into()).await;
    assert_eq!(
        send_seven(procs[1].url(path)).await,
        200,
        "token 7 goes through B once 6's marker has ended"
    );
    six_never_after_seven(&up, path, t0, stall).await;
    drop(six);
}

/// Single mode: the process is killed (-9) while 6's body waits in its
/// send queue, and restarted at once on the same store; the restart holds
/// fenced writes back for a while, then lets 7 through. The dead process's
/// connection must have been reset, not left to deliver 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_kill_9_then_restart() {
    let stall = Duration::from_millis(7000);
    let up = RawUpstream::start_with_recv_buffer(RCVBUF).await;
    let store = TestStore::new(Backend::Sqlite).await;
    let config = config_text(&store.url, &routes(&up));
    let mut first = start_processes(&config, 1).await.remove(0);
    let path = "/docs/handover-kill-single";
    let t0 = Instant::now();
    let six = BigWrite::send(first.addr, path, Behaviour::StallBody, stall, None).await;
    six_arrived(&up, path).await;
    tokio::time::sleep(WRITE_PAUSE).await;
    first.kill9();
    let restart = start_processes(&config, 1).await.remove(0);
    assert!(
        restart.log().contains("did not stop cleanly"),
        "the restart must know the first process crashed:\n{}",
        restart.log()
    );
    assert_eq!(
        send_seven(restart.url(path)).await,
        200,
        "token 7 goes through the restart after its wait"
    );
    six_never_after_seven(&up, path, t0, stall).await;
    drop(six);
}

/// Whether the process `pid` is stopped (state `T` in `/proc/PID/stat`).
fn stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|r| r.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// Shared mode: instance A is stopped (SIGSTOP: a VM freeze, a long pause)
/// while 6's body waits in its send queue; B admits 7 when 6's marker
/// ends. A stopped process's kernel still sends what is queued: the
/// upstream, reading again after its stall, must find only a little of the
/// middle of 6's body there, never its end. Then A resumes (SIGCONT), past
/// 6's deadline: it must reset the connection and send nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_sigstop_mid_write() {
    let stall = Duration::from_millis(4500);
    let up = RawUpstream::start_with_recv_buffer(RCVBUF).await;
    let store = TestStore::new(Backend::Postgres).await;
    let procs = start_processes(&shared_config(&store.url, &up), 2).await;
    let (a, b) = (&procs[0], &procs[1]);
    let path = "/docs/handover-stopped";
    let t0 = Instant::now();
    let six = BigWrite::send(a.addr, path, Behaviour::StallBody, stall, None).await;
    let head_at = six_arrived(&up, path).await;
    tokio::time::sleep(WRITE_PAUSE).await;
    a.signal(libc::SIGSTOP);
    // kill(2) returns before the process has stopped.
    wait_for("instance A to stop", || stopped(a.pid())).await;
    tokio::time::sleep_until((head_at + SHARED_SEVEN_AFTER).into()).await;
    let seven = send_seven(b.url(path)).await;
    // The upstream reads 6 again after its stall: it takes whatever A's
    // kernel still had queued.
    tokio::time::sleep_until((head_at + stall + Duration::from_millis(1000)).into()).await;
    let before = up.write(path, 6);
    a.signal(libc::SIGCONT);
    assert_eq!(
        seven, 200,
        "token 7 goes through B once 6's marker has ended"
    );
    // Give the resumed instance time to do whatever it would.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let timeline = six_never_after_seven(&up, path, t0, stall).await;
    let after = up.write(path, 6);
    assert_eq!(
        after.body_bytes,
        before.body_bytes,
        "instance A sent {} more bytes of token 6's body after it resumed past its \
         deadline\n{timeline}",
        after.body_bytes.saturating_sub(before.body_bytes)
    );
    eprintln!(
        "a stopped instance's send queue delivered {} of token 6's {BIG} bytes",
        before.body_bytes
    );
    drop(six);
}
