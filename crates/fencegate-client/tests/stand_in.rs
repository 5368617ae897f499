//! The client against a stand-in gateway: a TCP listener that records each
//! request and answers the next canned answer. What the real gateway does
//! with the calls is tested in the gateway's own suite (`tests/it/client.rs`);
//! here it is what goes on the wire and how answers are read.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate_client::{ClientOptions, Error, LockClient};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// A request as the stand-in read it: the head's lines, and the body.
struct Seen {
    head: Vec<String>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.head[1..].iter().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then_some(v.trim())
        })
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Answers `answers` in order, one per request, on any connection; `None`
/// answers nothing and keeps the connection open.
async fn stand_in(answers: Vec<Option<(u16, Value)>>) -> (String, mpsc::UnboundedReceiver<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (seen_tx, seen_rx) = mpsc::unbounded_channel();
    let answers: Answers = Arc::new(Mutex::new(answers.into_iter()));
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(serve(conn, seen_tx.clone(), answers.clone()));
        }
    });
    (url, seen_rx)
}

/// The answers still to give, shared by the connections.
type Answers = Arc<Mutex<std::vec::IntoIter<Option<(u16, Value)>>>>;

async fn serve(mut conn: TcpStream, seen: mpsc::UnboundedSender<Seen>, answers: Answers) {
    let mut buf = Vec::new();
    loop {
        let Some(end) = read_until_head_end(&mut conn, &mut buf).await else {
            return;
        };
        let head: Vec<String> = String::from_utf8_lossy(&buf[..end])
            .split("\r\n")
            .map(str::to_string)
            .collect();
        buf.drain(..end + 4);
        let length = head
            .iter()
            .find_map(|l| {
                let (n, v) = l.split_once(':')?;
                n.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().unwrap())
            })
            .unwrap_or(0);
        while buf.len() < length {
            if read_more(&mut conn, &mut buf).await == 0 {
                return;
            }
        }
        let body = buf.drain(..length).collect();
        let _ = seen.send(Seen { head, body });
        let next = answers.lock().unwrap().next().flatten();
        let Some((status, body)) = next else {
            // Never answer; hold the connection until the client leaves.
            let _ = conn.read(&mut [0u8; 1]).await;
            return;
        };
        let body = body.to_string();
        let out = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if conn.write_all(out.as_bytes()).await.is_err() {
            return;
        }
    }
}

async fn read_until_head_end(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(end);
        }
        if read_more(conn, buf).await == 0 {
            return None;
        }
    }
}

async fn read_more(conn: &mut TcpStream, buf: &mut Vec<u8>) -> usize {
    let mut chunk = [0u8; 4096];
    let n = conn.read(&mut chunk).await.unwrap_or(0);
    buf.extend_from_slice(&chunk[..n]);
    n
}

fn grant(fence: i64, ttl_ms: u64) -> Value {
    json!({
        "name": "doc:a", "lease": "0123456789abcdef0123456789abcdef",
        "fence": fence, "token": fence.to_string(), "ttl_ms": ttl_ms,
        "expires_at": "2030-01-01T00:00:00Z"
    })
}

#[tokio::test]
async fn an_acquire_sends_one_segment_json_and_the_key() {
    let (url, mut seen) = stand_in(vec![Some((201, grant(7, 5000)))]).await;
    let locks = LockClient::with_options(&url, &ClientOptions::new().api_key("s3cret")).unwrap();
    let g = locks
        .acquire("doc:a", Duration::from_secs(5), Duration::from_millis(250))
        .await
        .unwrap();
    assert_eq!((g.fence, g.token.as_str(), g.ttl_ms), (7, "7", 5000));

    let req = seen.recv().await.unwrap();
    assert_eq!(req.head[0], "POST /_fencegate/locks/doc%3Aa HTTP/1.1");
    assert_eq!(req.header("authorization"), Some("Bearer s3cret"));
    assert_eq!(req.header("content-type"), Some("application/json"));
    assert_eq!(req.json(), json!({"ttl_ms": 5000, "wait_ms": 250}));
}

#[tokio::test]
async fn a_status_is_a_get_without_a_body() {
    let (url, mut seen) = stand_in(vec![Some((
        200,
        json!({"name": "jobs/x", "held": false, "fence": 3, "expires_in_ms": null}),
    ))])
    .await;
    let st = LockClient::new(&format!("{url}/prefix/"))
        .unwrap()
        .status("jobs/x")
        .await
        .unwrap();
    assert!(!st.held);
    assert_eq!(st.fence, 3);
    let req = seen.recv().await.unwrap();
    assert_eq!(
        req.head[0],
        "GET /prefix/_fencegate/locks/jobs%2Fx HTTP/1.1"
    );
    assert_eq!(req.header("authorization"), None);
    assert!(req.body.is_empty());
}

#[tokio::test]
async fn a_refused_renewal_loses_the_lease_at_once() {
    let (url, mut seen) = stand_in(vec![
        Some((201, grant(4, 900))),
        Some((
            409,
            json!({"type": "urn:fencegate:problem:not-holder", "detail": "gone"}),
        )),
    ])
    .await;
    let locks = LockClient::new(&url).unwrap();
    let keeper = locks
        .acquire_keeper("doc:a", Duration::from_millis(900), Duration::ZERO)
        .await
        .unwrap();
    assert!(keeper.is_held());
    assert_eq!(keeper.fence(), 4);
    // The renewal goes out at a third of the ttl and is refused: lost then,
    // not at the deadline (whose reason would be another).
    tokio::time::timeout(Duration::from_millis(800), keeper.lost())
        .await
        .expect("the refusal ends the lease");
    assert!(!keeper.is_held());
    assert!(keeper.loss_reason().unwrap().starts_with("renewal refused"));

    let _acquire = seen.recv().await.unwrap();
    let renew = seen.recv().await.unwrap();
    assert_eq!(
        renew.head[0],
        "POST /_fencegate/locks/doc%3Aa/renew HTTP/1.1"
    );
    assert_eq!(
        renew.json(),
        json!({"lease": "0123456789abcdef0123456789abcdef", "ttl_ms": 900})
    );
}

#[tokio::test]
async fn no_answer_within_the_timeout_is_transient() {
    let (url, _seen) = stand_in(vec![None]).await;
    let locks = LockClient::new(&url)
        .unwrap()
        .with_timeout(Duration::from_millis(100));
    let e = locks.status("doc:a").await.unwrap_err();
    assert!(
        matches!(&e, Error::Http(why) if why.contains("no answer within 100 ms")),
        "{e}"
    );
    assert!(e.is_transient());
}

#[tokio::test]
async fn a_held_lock_says_how_long_it_stays_held() {
    let (url, _seen) = stand_in(vec![Some((
        409,
        json!({"type": "urn:fencegate:problem:lock-held", "expires_in_ms": 900}),
    ))])
    .await;
    let e = LockClient::new(&url)
        .unwrap()
        .acquire("doc:a", Duration::from_secs(1), Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Held { expires_in: Some(d) } if d == Duration::from_millis(900)));
    assert_eq!(
        e.to_string(),
        "the lock is held by another holder (expires in 900 ms)"
    );
}
