//! Self-tests of the recording upstream: they prove that its detectors can
//! fail, which the gateway's ordering tests rely on.

use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;

use crate::support::fenced_put;
use crate::support::upstream::{pattern_bytes, Upstream};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Wait until `cond` holds, or panic after 10 s.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn write(c: &reqwest::Client, up: &Upstream, path: &str, token: i64, body: &str) {
    let resp = fenced_put(c, format!("{}{path}", up.url()), token, body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn write_is_applied_and_recorded_with_its_token() {
    let up = Upstream::start().await;
    let c = client();
    let resp = c
        .post(format!("{}/docs/1?v=2", up.url()))
        .header("x-fence-token", "5")
        .header("x-dup", "a")
        .header("x-dup", "b")
        .body("hello")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-upstream"], "recorder");
    let json: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(json, serde_json::json!({"applied": 1, "token": 5}));

    let applied = up.applied();
    assert_eq!(applied.len(), 1);
    assert_eq!(applied[0].seq, 1);
    assert_eq!(applied[0].method, "POST");
    assert_eq!(applied[0].path, "/docs/1");
    assert_eq!(applied[0].token, Some(5));
    assert_eq!(&applied[0].body[..], b"hello");
    assert_eq!(up.applied_on("/docs/1").len(), 1);
    assert!(up.applied_on("/docs/2").is_empty());

    let reqs = up.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].method, "POST");
    assert_eq!(reqs[0].path_and_query, "/docs/1?v=2");
    assert_eq!(reqs[0].path(), "/docs/1");
    assert_eq!(reqs[0].header("x-fence-token"), Some("5"));
    assert_eq!(reqs[0].header_all("x-dup"), vec!["a", "b"]);
    assert_eq!(reqs[0].body_len, 5);

    // A write without a (numeric) token is applied with token None.
    let resp = c
        .delete(format!("{}/docs/1", up.url()))
        .header("x-fence-token", "abc")
        .send()
        .await
        .unwrap();
    let json: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(json, serde_json::json!({"applied": 2, "token": null}));
    assert_eq!(up.applied()[1].token, None);

    assert!(up.violations().is_empty(), "{:?}", up.violations());
    assert_eq!(up.in_flight(), 0);
    assert!(up.aborted().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_writes_with_different_tokens_are_a_violation() {
    let up = Upstream::start().await;
    let c = client();
    let send = |path: &'static str, token: i64| {
        let c = c.clone();
        let url = format!("{}{path}", up.url());
        async move {
            c.post(url)
                .header("x-fence-token", token.to_string())
                .header("x-test-delay-ms", "500")
                .body("x")
                .send()
                .await
                .unwrap()
                .status()
        }
    };

    // Overlaps that are allowed: the same token twice on one path (one
    // holder writing many times), different tokens on different paths.
    let (a, b, c, d, ()) = tokio::join!(
        send("/same", 3),
        send("/same", 3),
        send("/x", 1),
        send("/y", 2),
        eventually("four writes in flight", || up.in_flight() == 4)
    );
    assert!([a, b, c, d].iter().all(|s| s.as_u16() == 200));
    assert!(up.violations().is_empty(), "{:?}", up.violations());

    // Different tokens on one path at once: a violation.
    let (a, b, ()) = tokio::join!(
        send("/p", 5),
        send("/p", 7),
        eventually("both writes in flight", || up.in_flight() == 2)
    );
    assert_eq!((a.as_u16(), b.as_u16()), (200, 200));
    // Which write arrives (and is applied) first is up to the scheduler, so
    // "applied 5 after 7 on /p" may follow as well.
    let v = up.violations();
    assert!(
        v[0] == "two tokens in flight on /p: 5 and 7"
            || v[0] == "two tokens in flight on /p: 7 and 5",
        "{v:?}"
    );
    assert!(
        v.len() == 1 || (v.len() == 2 && v[1] == "applied 5 after 7 on /p"),
        "{v:?}"
    );
    assert_eq!(up.in_flight(), 0);
}

#[tokio::test]
async fn lower_token_after_higher_is_a_violation() {
    let up = Upstream::start().await;
    let c = client();
    write(&c, &up, "/p", 7, "seven").await;
    write(&c, &up, "/p", 7, "seven again").await; // equal: fine
    write(&c, &up, "/q", 1, "other path").await; // other path: fine
    assert!(up.violations().is_empty(), "{:?}", up.violations());

    write(&c, &up, "/p", 5, "five").await;
    assert_eq!(up.violations(), vec!["applied 5 after 7 on /p".to_string()]);
    // The stale write is still recorded, in order.
    let tokens: Vec<_> = up.applied_on("/p").iter().map(|a| a.token).collect();
    assert_eq!(tokens, vec![Some(7), Some(7), Some(5)]);
    let seqs: Vec<_> = up.applied().iter().map(|a| a.seq).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4]);
}

#[tokio::test]
async fn aborted_body_is_recorded_and_not_applied() {
    let up = Upstream::start().await;
    let mut sock = tokio::net::TcpStream::connect(up.addr()).await.unwrap();
    let head = format!(
        "POST /a HTTP/1.1\r\nhost: {}\r\nx-fence-token: 3\r\ncontent-length: 100\r\n\r\n",
        up.addr()
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(b"0123456789").await.unwrap();
    sock.flush().await.unwrap();
    eventually("the write to arrive", || up.in_flight() == 1).await;
    drop(sock);

    eventually("the abort to be recorded", || up.aborted().len() == 1).await;
    let aborted = up.aborted();
    assert_eq!(aborted[0].method, "POST");
    assert_eq!(aborted[0].path_and_query, "/a");
    assert_eq!(aborted[0].header("x-fence-token"), Some("3"));
    assert_eq!(aborted[0].body_len, 10);
    eventually("the write to leave flight", || up.in_flight() == 0).await;
    assert!(up.applied().is_empty());
    assert!(up.violations().is_empty());
    assert_eq!(up.requests().len(), 1);

    // The server still works afterwards.
    let resp = client()
        .get(format!("{}/a", up.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
}

#[tokio::test]
async fn get_returns_the_last_applied_body() {
    let up = Upstream::start().await;
    let c = client();
    let url = format!("{}/doc", up.url());
    let resp = c.get(&url).send().await.unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers()["x-upstream"], "recorder");

    write(&c, &up, "/doc", 1, "first").await;
    write(&c, &up, "/doc", 2, "second").await;
    write(&c, &up, "/other", 3, "unrelated").await;
    let resp = c.get(&url).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "second");

    let resp = c.head(&url).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let resp = c
        .request(reqwest::Method::OPTIONS, &url)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    // Reads are recorded but never applied.
    assert_eq!(up.applied().len(), 3);
    let methods: Vec<_> = up.requests().into_iter().map(|r| r.method).collect();
    assert_eq!(
        methods,
        vec!["GET", "PUT", "PUT", "PUT", "GET", "HEAD", "OPTIONS"]
    );
}

#[tokio::test]
async fn test_headers_steer_status_delay_and_streaming() {
    let up = Upstream::start().await;
    let c = client();

    // x-test-status: the write is still applied.
    let resp = c
        .post(format!("{}/s", up.url()))
        .header("x-fence-token", "1")
        .header("x-test-status", "503")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(up.applied_on("/s").len(), 1);

    // x-test-delay-ms on a read.
    let start = Instant::now();
    let resp = c
        .get(format!("{}/s", up.url()))
        .header("x-test-delay-ms", "150")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(start.elapsed() >= Duration::from_millis(150));

    // x-test-response-bytes: streamed bodies on reads and writes.
    let n = 300 * 1024 + 7;
    let resp = c
        .get(format!("{}/big", up.url()))
        .header("x-test-response-bytes", n.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.bytes().await.unwrap().to_vec(), pattern_bytes(n));
    let resp = c
        .put(format!("{}/big", up.url()))
        .header("x-fence-token", "9")
        .header("x-test-response-bytes", "70000")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.bytes().await.unwrap().to_vec(), pattern_bytes(70000));
    assert_eq!(up.applied_on("/big").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients_with_random_delays() {
    let up = Upstream::with_write_delays(1, 20).await;
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..50 {
        let c = c.clone();
        let url = format!("{}/k/{}", up.url(), i % 5);
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                // One token per path: overlapping writes are allowed.
                let resp = c
                    .post(&url)
                    .header("x-fence-token", "42")
                    .body(vec![b'z'; 1000])
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(up.applied().len(), 200);
    assert_eq!(up.requests().len(), 200);
    assert!(up.violations().is_empty(), "{:?}", up.violations());
    assert_eq!(up.in_flight(), 0);
    let seqs: Vec<u64> = up.applied().iter().map(|a| a.seq).collect();
    assert_eq!(seqs, (1..=200).collect::<Vec<u64>>());
}
