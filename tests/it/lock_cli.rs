//! The operators' commands as real processes: `fencegate lock run`
//! (competing runs, a paused wrapper, signals, every exit code, https) and
//! the thin `lock` and `fence` calls, against in-process gateways.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::app::{docs_route, TestApp};
use crate::support::cli::{
    cli, closed_port, process_exists, process_running, CannedServer, Cli, Done,
};
use crate::support::db::{Backend, TestStore};
use crate::support::pki::{self, Ca};
use crate::support::upstream::Upstream;

const LIMIT: Duration = Duration::from_secs(30);

struct Setup {
    store: TestStore,
    up: Upstream,
    app: TestApp,
}

impl Setup {
    async fn new(backend: Backend, extra: &str) -> Setup {
        let store = TestStore::new(backend).await;
        let up = Upstream::start().await;
        let app = TestApp::spawn(&store.url, &format!("{}{extra}", docs_route(&up.url()))).await;
        Setup { store, up, app }
    }

    fn gateway(&self) -> String {
        format!("http://{}", self.app.addr)
    }

    /// `fencegate lock run NAME --gateway G OPTIONS -- bash -c SCRIPT`.
    fn run(&self, name: &str, options: &[&str], script: &str, env: &[(&str, &str)]) -> Cli {
        let gateway = self.gateway();
        let mut args = vec!["lock", "run", name, "--gateway", &gateway];
        args.extend_from_slice(options);
        args.extend_from_slice(&["--", "bash", "-c", script]);
        Cli::start(&args, env)
    }

    async fn status(&self, name: &str) -> Value {
        self.app.lock_status(name).await
    }
}

/// `fencegate lock run NAME --gateway GATEWAY REST` to its end, without
/// extra environment: REST holds the options, `--` and the command.
async fn lock_run(gateway: &str, name: &str, rest: &[&str]) -> Done {
    let mut args = vec!["lock", "run", name, "--gateway", gateway];
    args.extend_from_slice(rest);
    cli(&args, &[]).await
}

/// One holder runs; a second gives up after its wait (75) without running
/// its command; a third, waiting long enough, runs once the first is done
/// and released (no lock-delay after a release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_runs_one_runs_the_other_exits_75() {
    let s = Setup::new(Backend::Sqlite, "").await;
    let mut a = s.run(
        "job:nightly",
        &["--ttl-ms", "3000"],
        "echo \"A fence=$FENCEGATE_FENCE lock=$FENCEGATE_LOCK\"; sleep 1.5",
        &[],
    );
    assert!(a.wait_for_stdout("A fence=1 lock=job:nightly", LIMIT).await);

    let started = Instant::now();
    let mut b = s.run("job:nightly", &["--wait-ms", "300"], "echo B-ran", &[]);
    assert_eq!(b.exit_code(LIMIT).await, 75, "{}", b.stderr());
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(!b.stdout().contains("B-ran"));
    assert!(
        b.stderr().contains("held by another holder"),
        "{}",
        b.stderr()
    );

    let mut c = s.run(
        "job:nightly",
        &["--wait-ms", "20000"],
        "echo \"C fence=$FENCEGATE_FENCE\"",
        &[],
    );
    assert_eq!(a.exit_code(LIMIT).await, 0, "{}", a.stderr());
    assert_eq!(c.exit_code(LIMIT).await, 0, "{}", c.stderr());
    assert!(c.stdout().contains("C fence=2"), "{}", c.stdout());
    assert_eq!(s.status("job:nightly").await["held"], false);
}

/// The child writes through the gateway in a loop with its token.
const WRITER: &str = r#"
echo $$ > "$PIDFILE"
for i in $(seq 1 400); do
  if exec 3<>"/dev/tcp/127.0.0.1/$PORT"; then
    printf 'PUT /docs/p HTTP/1.1\r\nHost: t\r\nX-Fence-Token: %s\r\nContent-Length: 3\r\nConnection: close\r\n\r\nold' "$FENCEGATE_FENCE_TOKEN" >&3
    read -r -t 5 line <&3
    echo "$line" >> "$LOG"
    exec 3<&-
  fi
  sleep 0.05
done
"#;

/// The wrapper is paused (SIGSTOP) past its lease while its child keeps
/// writing. A new holder takes the lock and writes; every later write of
/// the child is refused by the gateway and never reaches the upstream. On
/// SIGCONT the wrapper finds its deadline passed, stops the child, exits 76.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_wrapper_loses_the_lock_and_its_child_is_stopped() {
    let s = Setup::new(Backend::Sqlite, "").await;
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let log = dir.path().join("log");
    let port = s.app.addr.port().to_string();
    let mut a = s.run(
        "doc:p",
        &["--ttl-ms", "1200", "--kill-grace-ms", "2000"],
        WRITER,
        &[
            ("PORT", &port),
            ("PIDFILE", pidfile.to_str().unwrap()),
            ("LOG", log.to_str().unwrap()),
        ],
    );
    let deadline = Instant::now() + LIMIT;
    while s.up.applied_on("/docs/p").is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        s.up.applied_on("/docs/p")[0].token,
        Some(1),
        "{}",
        a.stderr()
    );
    let child: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    a.signal(libc::SIGSTOP);
    // A new holder, once the paused one's lease has expired.
    let grant = s
        .app
        .http
        .post(s.app.url("/_fencegate/locks/doc:p"))
        .json(&serde_json::json!({"ttl_ms": 10000, "wait_ms": 10000}))
        .send()
        .await
        .unwrap();
    assert_eq!(grant.status(), 201);
    let grant: Value = grant.json().await.unwrap();
    assert_eq!(grant["fence"], 2);
    let put = s.app.put("/docs/p", Some("2"), "new").await;
    assert_eq!(put.status(), 200);
    // The child keeps trying meanwhile.
    let refused_before = std::fs::read_to_string(&log)
        .unwrap()
        .matches(" 409 ")
        .count();
    let deadline = Instant::now() + LIMIT;
    while std::fs::read_to_string(&log)
        .unwrap()
        .matches(" 409 ")
        .count()
        < refused_before + 3
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        process_exists(child),
        "the child runs while the wrapper is stopped"
    );

    a.signal(libc::SIGCONT);
    assert_eq!(a.exit_code(LIMIT).await, 76, "{}", a.stderr());
    assert!(a.stderr().contains("lost the lock doc:p"), "{}", a.stderr());
    assert!(!process_exists(child), "the child outlived the wrapper");

    let applied = s.up.applied_on("/docs/p");
    let first_new = applied
        .iter()
        .position(|w| w.token == Some(2))
        .expect("the new holder's write was applied");
    let late: Vec<_> = applied[first_new..]
        .iter()
        .filter(|w| w.token != Some(2))
        .collect();
    assert!(late.is_empty(), "old writes reached the upstream: {late:?}");
    assert!(s.up.violations().is_empty(), "{:?}", s.up.violations());
    let tried = std::fs::read_to_string(&log).unwrap();
    assert!(tried.matches(" 409 ").count() >= 3, "{tried}");
}

/// SIGTERM and SIGINT to the wrapper reach the command, which may trap them;
/// the exit code is the command's, and the lock is released after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_are_passed_on_and_the_exit_code_is_the_commands() {
    let s = Setup::new(Backend::Sqlite, "").await;
    let mut trapped = s.run(
        "sig:a",
        &[],
        "trap 'echo trapped; exit 42' TERM; echo ready; for i in $(seq 1 600); do sleep 0.05; done",
        &[],
    );
    assert!(trapped.wait_for_stdout("ready", LIMIT).await);
    trapped.signal(libc::SIGTERM);
    assert_eq!(trapped.exit_code(LIMIT).await, 42, "{}", trapped.stderr());
    assert!(trapped.stdout().contains("trapped"));
    assert_eq!(s.status("sig:a").await["held"], false);

    // Not trapped: the command dies of SIGINT, reported as a shell does.
    let mut plain = s.run("sig:b", &[], "echo ready; exec sleep 30", &[]);
    assert!(plain.wait_for_stdout("ready", LIMIT).await);
    plain.signal(libc::SIGINT);
    assert_eq!(plain.exit_code(LIMIT).await, 130, "{}", plain.stderr());
    assert_eq!(s.status("sig:b").await["held"], false);
}

/// 0 and the command's own code, 127 for a command that is not there, 64
/// for a ttl the gateway refuses, 69 with nothing listening, 77 on 401 and
/// 403 (with the bearer key sent), 76 when a renewal is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_exit_code() {
    let s = Setup::new(Backend::Postgres, "").await;
    let gateway = s.gateway();
    let done = lock_run(&gateway, "x:ok", &["--", "true"]).await;
    assert_eq!(done.code, 0, "{done:?}");
    let done = cli(
        &["lock", "run", "x:3", "--", "bash", "-c", "exit 3"],
        &[("FENCEGATE_URL", &gateway)],
    )
    .await;
    assert_eq!(done.code, 3, "{done:?}");
    assert_eq!(s.status("x:3").await["held"], false, "released after");
    let done = lock_run(&gateway, "x:missing", &["--", "/nonexistent/command"]).await;
    assert_eq!(done.code, 127, "{done:?}");
    assert_eq!(s.status("x:missing").await["held"], false);
    let done = lock_run(&gateway, "x:ttl", &["--ttl-ms", "5", "--", "true"]).await;
    assert_eq!(done.code, 64, "{done:?}");
    assert!(done.stderr.contains("ttl_ms"), "{done:?}");

    let nowhere = format!("http://127.0.0.1:{}", closed_port());
    let done = lock_run(&nowhere, "x", &["--", "true"]).await;
    assert_eq!(done.code, 69, "{done:?}");

    let canned = CannedServer::start(|auth| if auth.is_some() { 403 } else { 401 }).await;
    let done = lock_run(&canned.url(), "x", &["--", "true"]).await;
    assert_eq!(done.code, 77, "{done:?}");
    assert!(done.stderr.contains("not authenticated"), "{done:?}");
    let done = cli(
        &["lock", "run", "x", "--gateway", &canned.url(), "--", "true"],
        &[("FENCEGATE_API_KEY", "k-123")],
    )
    .await;
    assert_eq!(done.code, 77, "{done:?}");
    assert!(done.stderr.contains("forbidden"), "{done:?}");
    assert_eq!(
        *canned.seen.lock().unwrap(),
        vec![None, Some("Bearer k-123".to_string())]
    );

    // A refused renewal: the lease is taken from under the wrapper.
    let mut run = s.run(
        "x:stolen",
        &["--ttl-ms", "1500", "--kill-grace-ms", "500"],
        "echo ready; trap '' TERM; for i in $(seq 1 600); do sleep 0.05; done",
        &[],
    );
    assert!(run.wait_for_stdout("ready", LIMIT).await);
    let mut db = <sqlx::PgConnection as sqlx::Connection>::connect(&s.store.url)
        .await
        .unwrap();
    sqlx::query("UPDATE locks SET lease = 'stolen' WHERE name = 'x:stolen'")
        .execute(&mut db)
        .await
        .unwrap();
    let started = Instant::now();
    assert_eq!(run.exit_code(LIMIT).await, 76, "{}", run.stderr());
    assert!(run.stderr().contains("renewal refused"), "{}", run.stderr());
    // It ignored SIGTERM: SIGKILL came after the grace.
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// CMD leads a process group of its own, and the wrapper signals the whole
/// group: a background job CMD started (a grandchild, which would go on
/// writing with the token if only CMD's own pid were signalled) is stopped
/// on loss and gets the signals passed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_process_group_is_stopped_and_signalled() {
    let s = Setup::new(Backend::Sqlite, "").await;
    let dir = tempfile::tempdir().unwrap();
    const SCRIPT: &str = r#"sleep 300 & echo $! > "$PIDFILE"; echo ready; wait"#;
    let grandchild = |file: &std::path::Path| -> i32 {
        std::fs::read_to_string(file)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let gone = |pid: i32| async move {
        let deadline = Instant::now() + Duration::from_secs(5);
        while process_running(pid) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        !process_running(pid)
    };

    // Loss: the wrapper is paused past its lease.
    let lost_pid = dir.path().join("lost");
    let mut lost = s.run(
        "grp:lost",
        &["--ttl-ms", "1200", "--kill-grace-ms", "500"],
        SCRIPT,
        &[("PIDFILE", lost_pid.to_str().unwrap())],
    );
    assert!(lost.wait_for_stdout("ready", LIMIT).await);
    let pid = grandchild(&lost_pid);
    assert!(process_running(pid));
    lost.signal(libc::SIGSTOP);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    lost.signal(libc::SIGCONT);
    assert_eq!(lost.exit_code(LIMIT).await, 76, "{}", lost.stderr());
    assert!(
        gone(pid).await,
        "the background job outlived the lost lease"
    );

    // A signal to the wrapper reaches the whole group.
    let term_pid = dir.path().join("term");
    let mut term = s.run(
        "grp:term",
        &[],
        SCRIPT,
        &[("PIDFILE", term_pid.to_str().unwrap())],
    );
    assert!(term.wait_for_stdout("ready", LIMIT).await);
    let pid = grandchild(&term_pid);
    term.signal(libc::SIGTERM);
    assert_eq!(term.exit_code(LIMIT).await, 143, "{}", term.stderr());
    assert!(gone(pid).await, "SIGTERM did not reach the background job");
    assert_eq!(s.status("grp:term").await["held"], false);
}

/// The exit codes `each_exit_code` leaves out: 126 for a command that is
/// not executable, and 128 + N for a signal received while still waiting
/// for the lock (nothing was run; the lock held elsewhere is untouched).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_cannot_run_and_a_signal_while_waiting() {
    let s = Setup::new(Backend::Sqlite, "").await;
    let gateway = s.gateway();
    let dir = tempfile::tempdir().unwrap();
    let not_executable = dir.path().join("job.sh");
    std::fs::write(&not_executable, "#!/bin/sh\necho ran\n").unwrap();
    let done = lock_run(
        &gateway,
        "code:126",
        &["--", not_executable.to_str().unwrap()],
    )
    .await;
    assert_eq!(done.code, 126, "{done:?}");
    assert_eq!(s.status("code:126").await["held"], false);

    let grant = s
        .app
        .http
        .post(s.app.url("/_fencegate/locks/code:held"))
        .json(&serde_json::json!({"ttl_ms": 30000}))
        .send()
        .await
        .unwrap();
    assert_eq!(grant.status(), 201);
    for (sig, code) in [
        (libc::SIGHUP, 129),
        (libc::SIGINT, 130),
        (libc::SIGTERM, 143),
    ] {
        let mut waiting = s.run("code:held", &["--wait-ms", "20000"], "echo ran", &[]);
        // Let it start waiting: its first acquire is refused at once.
        tokio::time::sleep(Duration::from_millis(300)).await;
        waiting.signal(sig);
        assert_eq!(waiting.exit_code(LIMIT).await, code, "{}", waiting.stderr());
        assert!(!waiting.stdout().contains("ran"));
    }
    assert_eq!(s.status("code:held").await["held"], true);
}

/// `lock acquire|renew|release|status` print the gateway's JSON (problems
/// too) with their exit codes; status shows a running lock-delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_calls_print_json() {
    let s = Setup::new(Backend::Sqlite, "[locks]\nlock_delay_ms = 5000\n").await;
    let g = s.gateway();
    let env = [("FENCEGATE_URL", g.as_str())];
    let done = cli(&["lock", "acquire", "c:a", "--ttl-ms", "10000"], &env).await;
    assert_eq!(done.code, 0, "{done:?}");
    let grant = done.json();
    assert_eq!(grant["fence"], 1);
    let lease = grant["lease"].as_str().unwrap().to_string();

    let done = cli(&["lock", "acquire", "c:a"], &env).await;
    assert_eq!(done.code, 75, "{done:?}");
    assert_eq!(done.json()["type"], "urn:fencegate:problem:lock-held");

    let done = cli(&["lock", "status", "c:a"], &env).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert_eq!(done.json()["held"], true);

    let done = cli(&["lock", "renew", "c:a", "--lease", &lease], &env).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert_eq!(done.json()["fence"], 1);
    let with_env = [("FENCEGATE_URL", g.as_str()), ("FENCEGATE_LEASE", &lease)];
    let done = cli(&["lock", "renew", "c:a", "--ttl-ms", "20000"], &with_env).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert_eq!(done.json()["ttl_ms"], 20000);
    let done = cli(&["lock", "renew", "c:a", "--lease", "nope"], &env).await;
    assert_eq!(done.code, 76, "{done:?}");
    assert_eq!(done.json()["type"], "urn:fencegate:problem:not-holder");

    let done = cli(&["lock", "release", "c:a"], &with_env).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert_eq!(done.stdout, "", "204 has no body");
    let done = cli(&["lock", "release", "c:a"], &with_env).await;
    assert_eq!(done.code, 76, "{done:?}");

    let done = cli(&["lock", "acquire", "c:a", "--ttl-ms", "100"], &env).await;
    assert_eq!(done.code, 0, "{done:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let done = cli(&["lock", "status", "c:a"], &env).await;
    assert_eq!(done.code, 0, "{done:?}");
    let st = done.json();
    assert_eq!(st["held"], false, "{st}");
    assert!(st["delayed_until"].is_string(), "{st}");
    let done = cli(&["lock", "acquire", "c:a", "--wait-ms", "100"], &env).await;
    assert_eq!(done.code, 75, "refused during the lock-delay: {done:?}");

    let done = cli(&["lock", "acquire", "c:b", "--ttl-ms", "1"], &env).await;
    assert_eq!(done.code, 64, "{done:?}");
    assert_eq!(done.json()["field"], "ttl_ms");
    let nowhere = format!("http://127.0.0.1:{}", closed_port());
    let done = cli(&["lock", "status", "c:a", "--gateway", &nowhere], &[]).await;
    assert_eq!(done.code, 69, "{done:?}");
    assert_eq!(done.stdout, "");
}

/// `fence get` prints the record (1 and the problem when none); `fence
/// reset` checks its arguments, sends the body and the bearer key, and maps
/// problems to exit codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_calls_print_json() {
    let s = Setup::new(Backend::Sqlite, "").await;
    assert_eq!(s.app.put("/docs/f", Some("7"), "x").await.status(), 200);
    let admin = format!("http://{}", s.app.admin);
    let env = [("FENCEGATE_ADMIN_URL", admin.as_str())];
    let done = cli(&["fence", "get", "doc:f"], &env).await;
    assert_eq!(done.code, 0, "{done:?}");
    let rec = done.json();
    assert_eq!(rec["resource_key"], "doc:f");
    assert_eq!(rec["highest_token"], 7);
    let done = cli(&["fence", "get", "doc:none", "--admin", &admin], &[]).await;
    assert_eq!(done.code, 1, "{done:?}");
    assert_eq!(done.json()["type"], "urn:fencegate:problem:no-fence");

    // Arguments are checked before anything is sent.
    for args in [
        &["fence", "reset", "doc:f", "--reason", "r"][..],
        &["fence", "reset", "doc:f", "--highest-token", "3"][..],
        &[
            "fence",
            "reset",
            "doc:f",
            "--highest-token",
            "-1",
            "--reason",
            "r",
        ][..],
        &[
            "fence",
            "reset",
            "doc:f",
            "--highest-token",
            "x",
            "--reason",
            "r",
        ][..],
    ] {
        let done = cli(args, &env).await;
        assert_eq!(done.code, 2, "{args:?}: {done:?}");
        assert_eq!(done.stdout, "");
    }

    // The admin listener's answer, whichever it is, gets its exit code.
    let done = cli(
        &[
            "fence",
            "reset",
            "doc:f",
            "--highest-token",
            "3",
            "--reason",
            "r",
        ],
        &env,
    )
    .await;
    let answer = done.json();
    let expected = match answer["status"].as_u64() {
        Some(401 | 403) => 77,
        Some(404 | 405) => 1,
        None if answer["highest_token"] == 3 => 0,
        other => panic!("unexpected answer {other:?}: {done:?}"),
    };
    assert_eq!(done.code, expected, "{done:?}");

    for (status, code) in [(401, 77), (403, 77), (404, 1)] {
        let canned = match status {
            401 => CannedServer::start(|_| 401).await,
            403 => CannedServer::start(|_| 403).await,
            _ => CannedServer::start(|_| 404).await,
        };
        let done = cli(
            &[
                "fence",
                "reset",
                "doc:f",
                "--admin",
                &canned.url(),
                "--highest-token",
                "3",
                "--reason",
                "poisoned by a forged token",
            ],
            &[("FENCEGATE_API_KEY", "admin-key")],
        )
        .await;
        assert_eq!(done.code, code, "{status}: {done:?}");
        assert_eq!(done.json()["status"], status);
        assert!(
            done.stderr.contains(&format!("canned {status}")),
            "{done:?}"
        );
        assert_eq!(
            *canned.seen.lock().unwrap(),
            vec![Some("Bearer admin-key".to_string())]
        );
    }
}

/// Against a gateway with `[[auth.clients]]` the key in
/// `$FENCEGATE_API_KEY` is what counts: none or one outside its lock globs
/// is 77, the right one runs; `fence reset` with an admin's key resets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_sent_to_a_gateway_with_clients() {
    let s = Setup::new(Backend::Sqlite, &crate::trust::auth_section()).await;
    let g = s.gateway();
    let run = |name: &'static str, key: Option<&'static str>| {
        let g = g.clone();
        async move {
            let env: Vec<(&str, &str)> =
                key.map(|k| ("FENCEGATE_API_KEY", k)).into_iter().collect();
            cli(&["lock", "run", name, "--gateway", &g, "--", "true"], &env).await
        }
    };
    let done = run("billing:x", None).await;
    assert_eq!(done.code, 77, "{done:?}");
    assert!(done.stderr.contains("not authenticated"), "{done:?}");
    let done = run("other:x", Some("key-billing")).await;
    assert_eq!(done.code, 77, "{done:?}");
    assert!(done.stderr.contains("forbidden"), "{done:?}");
    let done = run("billing:x", Some("key-billing")).await;
    assert_eq!(done.code, 0, "{done:?}");

    assert_eq!(s.app.put("/docs/r", Some("9"), "x").await.status(), 200);
    let admin = format!("http://{}", s.app.admin);
    let reset = |key: &'static str| {
        let admin = admin.clone();
        async move {
            let args = [
                "fence",
                "reset",
                "doc:r",
                "--admin",
                &admin,
                "--highest-token",
                "2",
                "--reason",
                "test",
            ];
            cli(&args, &[("FENCEGATE_API_KEY", key)]).await
        }
    };
    let done = reset("key-billing").await;
    assert_eq!(done.code, 77, "{done:?}");
    let done = reset("key-ops").await;
    assert_eq!(done.code, 0, "{done:?}");
    assert_eq!(done.json()["highest_token"], 2);
    let done = cli(&["fence", "get", "doc:r", "--admin", &admin], &[]).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert_eq!(done.json()["last_reset"]["reason"], "test", "{done:?}");
}

/// Over https the CA given with `--cacert` (or `$FENCEGATE_CACERT`) is
/// trusted, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_a_ca_of_its_own() {
    let store = TestStore::new(Backend::Sqlite).await;
    let ca = Ca::new("test CA");
    let other = Ca::new("another CA");
    let (ca_file, cert, key) = ca.server_files("gateway");
    let other_file = other.write("other.pem", &other.pem());
    let app = TestApp::spawn(&store.url, &pki::tls_section(&cert, &key, None)).await;
    let gateway = format!("https://127.0.0.1:{}", app.addr.port());
    let ca_path = ca_file.to_str().unwrap();

    let done = lock_run(
        &gateway,
        "tls:a",
        &[
            "--cacert",
            ca_path,
            "--",
            "bash",
            "-c",
            "echo fence=$FENCEGATE_FENCE",
        ],
    )
    .await;
    assert_eq!(done.code, 0, "{done:?}");
    assert!(done.stdout.contains("fence=1"), "{done:?}");
    let done = cli(
        &["lock", "status", "tls:a"],
        &[("FENCEGATE_URL", &gateway), ("FENCEGATE_CACERT", ca_path)],
    )
    .await;
    assert_eq!(done.code, 0, "{done:?}");
    assert_eq!(done.json()["fence"], 1);

    // `lock status` trusting the CA file `ca`.
    let status_trusting = |ca: std::path::PathBuf| {
        let gateway = gateway.clone();
        async move {
            let ca = ca.to_str().unwrap().to_string();
            let args = [
                "lock",
                "status",
                "tls:a",
                "--gateway",
                &gateway,
                "--cacert",
                &ca,
            ];
            cli(&args, &[]).await
        }
    };
    // Another CA (given, or as the system's bundle): the handshake fails.
    let done = status_trusting(other_file.clone()).await;
    assert_eq!(done.code, 69, "{done:?}");
    let done = cli(
        &["lock", "status", "tls:a", "--gateway", &gateway],
        &[("SSL_CERT_FILE", other_file.to_str().unwrap())],
    )
    .await;
    assert_eq!(done.code, 69, "{done:?}");
    assert!(
        done.stderr.to_lowercase().contains("certificate"),
        "{done:?}"
    );
    // A CA file that is not one.
    let done = status_trusting(ca.write("junk.pem", "not a certificate")).await;
    assert_eq!(done.code, 64, "{done:?}");
}
