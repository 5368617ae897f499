//! The upstream client: HTTPS upstreams verified with SNI and hostname
//! checks, and pooled connections that an upstream closes at awkward
//! moments — a request is retried only when nothing of it was sent, so none
//! ever arrives twice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use tokio::io::AsyncWriteExt;

use crate::support::app::{config_error, config_sections, problem, route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::pki::{Ca, HttpsUpstream};
use crate::support::{fenced_put, read_one_request};

fn https_route(name: &str, addr: std::net::SocketAddr, ca: Option<&std::path::Path>) -> String {
    let mut r = route(
        name,
        &format!("/{name}/{{id}}"),
        &format!("https://{addr}"),
        &format!("{name}:{{id}}"),
    );
    if let Some(ca) = ca {
        r.push_str(&format!("upstream_ca_file = \"{}\"\n", ca.display()));
    }
    r
}

#[tokio::test]
async fn https_upstreams_are_verified_with_sni_and_hostname_checks() {
    let store = TestStore::new(Backend::Sqlite).await;
    let (good, ca, ca_file) = HttpsUpstream::with_new_ca("upstream CA", "upstream").await;
    let misnamed = HttpsUpstream::start(&ca.issue_for("other", vec!["other.example".into()])).await;
    let routes = format!(
        "{}{}{}",
        https_route("trusted", good.addr, Some(&ca_file)),
        https_route("platform", good.addr, None),
        https_route("misnamed", misnamed.addr, Some(&ca_file)),
    );
    let app = TestApp::spawn(&store.url, &routes).await;

    let put = app.put("/trusted/a", Some("1"), "x").await;
    assert_eq!(put.status(), 200);
    assert_eq!(put.text().await.unwrap(), "secure");
    let get = app
        .http
        .get(app.url("/trusted/a?v=1"))
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 200);
    let seen = good.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            format!("PUT /trusted/a host={} proto=http", good.addr),
            format!("GET /trusted/a?v=1 host={} proto=http", good.addr),
        ],
        "origin-form requests with the upstream's Host"
    );

    // Not trusted by the platform's roots: 502 naming the TLS failure.
    let body = problem(app.put("/platform/a", Some("1"), "x").await, 502).await;
    assert_eq!(body["type"], "urn:fencegate:problem:upstream-unreachable");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("TLS handshake") && detail.contains("UnknownIssuer"),
        "{detail}"
    );
    // A certificate for another name, even from the trusted CA: 502.
    let body = problem(app.put("/misnamed/a", Some("1"), "x").await, 502).await;
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains("not valid for name"), "{detail}");
    assert!(misnamed.seen.lock().unwrap().is_empty());
    assert_eq!(good.seen.lock().unwrap().len(), 2, "nothing more arrived");
    // A failed handshake sent nothing: the key is open for the next token.
    assert_eq!(app.put("/trusted/b", Some("1"), "x").await.status(), 200);
    assert_eq!(app.put("/platform/a", Some("2"), "x").await.status(), 502);
}

#[tokio::test]
async fn upstream_tls_settings_are_checked_at_load() {
    let ca = Ca::new("upstream CA");
    let missing = ca.dir.path().join("missing.pem");
    for (upstream, ca_file, why) in [
        (
            "http://127.0.0.1:1",
            Some(missing.clone()),
            "is not https://",
        ),
        ("https://127.0.0.1:1", Some(missing), "upstream_ca_file"),
        ("ftp://127.0.0.1:1", None, "use http:// or https://"),
    ] {
        let mut r = route("r", "/r/{id}", upstream, "r:{id}");
        if let Some(c) = ca_file {
            r.push_str(&format!("upstream_ca_file = \"{}\"\n", c.display()));
        }
        let text =
            format!("[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{r}");
        let err = config_error(&text);
        assert!(
            err.contains("routes[0].upstream") && err.contains(why),
            "{why}: {err}"
        );
    }
}

/// The value of the header `name` in a request [`read_one_request`] read,
/// or an empty one.
fn field(headers: &[(String, String)], name: &str) -> String {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// A listener on a free port whose every connection is served by `serve`,
/// each in a task of its own, with `log` shared between them.
async fn serve_each<L, F, Fut>(log: L, serve: F) -> std::net::SocketAddr
where
    L: Clone + Send + 'static,
    F: Fn(tokio::net::TcpStream, L) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            if let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(serve(tcp, log.clone()));
            }
        }
    });
    addr
}

/// An upstream that answers each request, then closes the connection after
/// a random moment (0 to 3 ms), while promising keep-alive: pooled
/// connections die just as they are picked. Every request is counted by its
/// `x-test-id`.
async fn closing_upstream() -> (std::net::SocketAddr, Arc<Mutex<HashMap<String, usize>>>) {
    let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let addr = serve_each(seen.clone(), |mut tcp, log| async move {
        // One request per connection.
        let Some(headers) = read_one_request(&mut tcp).await else {
            return;
        };
        *log.lock()
            .unwrap()
            .entry(field(&headers, "x-test-id"))
            .or_default() += 1;
        let _ = tcp
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok")
            .await;
        let pause = rand::thread_rng().gen_range(0..=3);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    })
    .await;
    (addr, seen)
}

/// Odd-numbered requests of a client are its fenced writes.
fn id_is_write(id: &str) -> bool {
    id.rsplit('-')
        .next()
        .and_then(|n| n.parse::<u32>().ok())
        .is_some_and(|n| n % 2 == 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_never_sent_twice_when_pooled_connections_die() {
    let store = TestStore::new(Backend::Sqlite).await;
    let (addr, seen) = closing_upstream().await;
    let app = Arc::new(
        TestApp::spawn(
            &store.url,
            &route("docs", "/docs/{id}", &format!("http://{addr}"), "doc:{id}"),
        )
        .await,
    );
    let mut answers = HashMap::new();
    let mut tasks = Vec::new();
    for client in 0..4 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for n in 0..60 {
                let id = format!("c{client}-{n}");
                let req = if n % 2 == 0 {
                    app.http.get(app.url(&format!("/docs/k{client}")))
                } else {
                    fenced_put(&app.http, app.url(&format!("/docs/k{client}")), "1", "x")
                };
                let status = req
                    .header("x-test-id", &id)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16();
                out.push((id, status));
                if n % 7 == 0 {
                    // Let pooled connections sit idle while the upstream
                    // closes them.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            out
        }));
    }
    for t in tasks {
        for (id, status) in t.await.unwrap() {
            answers.insert(id, status);
        }
    }
    let seen = seen.lock().unwrap().clone();
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "sent twice: {twice:?}");
    let writes_ok = answers
        .iter()
        .filter(|(id, s)| id_is_write(id) && **s == 200)
        .count();
    for (id, status) in &answers {
        match status {
            200 => assert_eq!(
                seen.get(id),
                Some(&1),
                "{id} answered 200 but arrived {:?}",
                seen.get(id)
            ),
            // A write whose connection died after bytes of it were written:
            // never sent again, whether or not it arrived.
            502 if id_is_write(id) => {}
            s => panic!("{id}: unexpected {s} (reads are repeated on a dead pooled connection)"),
        }
    }
    assert!(writes_ok > 0, "no write got through: {answers:?}");
}

/// A GET that fails on a kept connection is sent again once, on a new
/// connection: not on the next kept one, which may be as dead, and so on
/// through the whole pool. The upstream here answers the first request on
/// each connection and drops the connection at the second, unanswered, as
/// an upstream that closed its idle connections does; every arrival is
/// counted by its `x-test-id`.
#[tokio::test]
async fn a_failed_get_is_sent_again_once_on_a_new_connection() {
    let store = TestStore::new(Backend::Sqlite).await;
    let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let addr = serve_each(seen.clone(), |mut tcp, log| async move {
        let mut first = true;
        while let Some(headers) = read_one_request(&mut tcp).await {
            *log.lock()
                .unwrap()
                .entry(field(&headers, "x-test-id"))
                .or_default() += 1;
            if !first {
                return;
            }
            first = false;
            // Slow enough that the warm-up's GETs each open a connection.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            if tcp.write_all(answer).await.is_err() {
                return;
            }
        }
    })
    .await;
    // One worker: one pool, which the warm-up fills with four connections.
    let text = config_sections(
        "workers = 1\n",
        &store.url,
        "",
        &route("r", "/r/{id}", &format!("http://{addr}"), "r:{id}"),
    );
    let app = TestApp::from_text(&text).await;
    let get = |id: String| app.http.get(app.url("/r/a")).header("x-test-id", id).send();
    let warm = futures_util::future::join_all((0..4).map(|i| get(format!("warm-{i}")))).await;
    for resp in warm {
        assert_eq!(resp.unwrap().status(), 200);
    }
    // Each kept connection back in the pool.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let resp = get("probe".into()).await.unwrap();
    assert_eq!(resp.status(), 200, "answered on a new connection");
    assert_eq!(resp.text().await.unwrap(), "ok");
    assert_eq!(
        seen.lock().unwrap().get("probe"),
        Some(&2),
        "sent on one kept connection, then once on a new one"
    );
}

/// HTTPS upstreams keep their connections alive like `http://` ones: one
/// TLS handshake for a run of requests, reads and fenced writes alike.
#[tokio::test]
async fn https_connections_are_kept_alive() {
    let store = TestStore::new(Backend::Sqlite).await;
    let (up, _ca, ca_file) = HttpsUpstream::with_new_ca("upstream CA", "upstream").await;
    // One worker: every request of the test's one client connection is
    // served by the same upstream pool.
    let text = config_sections(
        "workers = 1\n",
        &store.url,
        "",
        &https_route("kept", up.addr, Some(&ca_file)),
    );
    let app = TestApp::from_text(&text).await;
    for i in 0..6 {
        let resp = if i % 2 == 0 {
            app.put("/kept/a", Some("1"), "x").await
        } else {
            app.http.get(app.url("/kept/a")).send().await.unwrap()
        };
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.text().await.unwrap(), "secure");
        // The connection goes back to the pool once the exchange is over in
        // both directions: give it that moment.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(up.seen.lock().unwrap().len(), 6);
    assert_eq!(
        up.handshakes.lock().unwrap().len(),
        1,
        "six requests over one TLS connection"
    );
}

/// An upstream named by host name gets that name as SNI (and is verified
/// against it); one named by IP address gets none, as TLS has no SNI for
/// addresses.
#[tokio::test]
async fn sni_names_the_upstream_host() {
    let store = TestStore::new(Backend::Sqlite).await;
    let ca = Ca::new("upstream CA");
    let ca_file = ca.write("ca.pem", &ca.pem());
    let by_name = HttpsUpstream::start(&ca.issue_for("localhost", vec!["localhost".into()])).await;
    let by_ip = HttpsUpstream::start(&ca.server("upstream")).await;
    let mut named = route(
        "named",
        "/named/{id}",
        &format!("https://localhost:{}", by_name.addr.port()),
        "named:{id}",
    );
    named.push_str(&format!("upstream_ca_file = \"{}\"\n", ca_file.display()));
    let routes = format!("{named}{}", https_route("ip", by_ip.addr, Some(&ca_file)));
    let app = TestApp::spawn(&store.url, &routes).await;
    assert_eq!(app.put("/named/a", Some("1"), "x").await.status(), 200);
    assert_eq!(app.put("/ip/a", Some("1"), "x").await.status(), 200);
    assert_eq!(
        *by_name.handshakes.lock().unwrap(),
        vec![Some("localhost".to_string())]
    );
    assert_eq!(
        by_name.seen.lock().unwrap().clone(),
        vec![format!(
            "PUT /named/a host=localhost:{} proto=http",
            by_name.addr.port()
        )]
    );
    assert_eq!(*by_ip.handshakes.lock().unwrap(), vec![None]);
}

/// An upstream that answers each request on a connection with the answer
/// its path names (see [`scripted_answer`]), written in one piece, and keeps
/// the connection for the next request unless the answer ends it. Counts
/// connections, and the paths each one carried.
async fn scripted_upstream() -> (std::net::SocketAddr, Arc<Mutex<Vec<Vec<String>>>>) {
    let conns: Arc<Mutex<Vec<Vec<String>>>> = Arc::default();
    let addr = serve_each(conns.clone(), |mut tcp, log| async move {
        let n = {
            let mut log = log.lock().unwrap();
            log.push(Vec::new());
            log.len() - 1
        };
        while let Some(headers) = read_one_request(&mut tcp).await {
            let path = field(&headers, "x-test-path");
            log.lock().unwrap()[n].push(path.clone());
            let (answer, close) = scripted_answer(&path);
            if tcp.write_all(&answer).await.is_err() || close {
                return;
            }
        }
    })
    .await;
    (addr, conns)
}

/// The answer for a path, and whether the connection ends after it.
fn scripted_answer(path: &str) -> (Vec<u8>, bool) {
    let answer: &[u8] = match path {
        "plain" => b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nplain",
        // A second answer hidden after the first: it must never reach
        // anyone as the answer to another request.
        "smuggle" => {
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok\
            HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nsmuggled"
        }
        "both" => {
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n\
            0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nsmuggled"
        }
        "lengths" => {
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 10\r\n\r\nokokokokok"
        }
        "negative" => b"HTTP/1.1 200 OK\r\ncontent-length: -2\r\n\r\nok",
        "chunked" => {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
            3;ext=1\r\nchu\r\n4\r\nnked\r\n0\r\nx-trailer: t\r\n\r\n"
        }
        "bad-chunk" => {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n"
        }
        // Issue 49's D1-D3 in answers: framings a lenient decoder read as
        // a whole body (`ok`, `hello`) and a strict one as something else.
        "lf-in-extension" => {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2;\nab\r\nok\r\n0\r\n\r\n"
        }
        "empty-size-line" => {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n\r\n\r\n"
        }
        "lf-trailer" => {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\n\
            HTTP/1.1 200 OK\r\n\r\n"
        }
        "bad-trailer" => {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\
            HTTP/1.1 200 OK\r\n\r\n"
        }
        "interim" => {
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n\
            HTTP/1.1 201 Created\r\ncontent-length: 7\r\n\r\ninterim"
        }
        "upgrade" => {
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n"
        }
        "to-close" => b"HTTP/1.1 200 OK\r\n\r\nread until the close",
        "cut-short" => b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        "garbage" => b"HTTP/1.1 twohundred\r\n\r\n",
        "many-fields" => {
            let fields: String = (0..101).map(|i| format!("x-{i}: 1\r\n")).collect();
            let answer = format!("HTTP/1.1 200 OK\r\n{fields}content-length: 0\r\n\r\n");
            return (answer.into_bytes(), false);
        }
        _ => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
    };
    let close = matches!(path, "to-close" | "cut-short" | "garbage" | "upgrade");
    (answer.to_vec(), close)
}

/// Answers whose framing is broken, ambiguous or hostile never reach a
/// client as something else: a head that cannot be trusted is a 502 problem,
/// a body that breaks off breaks off for the client too, and bytes an
/// upstream sends past its answer (a second, smuggled answer) are never
/// taken for the answer to the next request: that connection is not used
/// again. Well-framed answers of every kind pass whole, and their
/// connections are kept.
#[tokio::test]
async fn hostile_answers_are_refused_and_never_answer_another_request() {
    let store = TestStore::new(Backend::Sqlite).await;
    let (addr, conns) = scripted_upstream().await;
    // One worker: every request shares one pool of upstream connections.
    let text = config_sections(
        "workers = 1\n",
        &store.url,
        "",
        &route("s", "/s/{id}", &format!("http://{addr}"), "s:{id}"),
    );
    let app = TestApp::from_text(&text).await;
    let get = |path: &'static str| {
        app.http
            .get(app.url("/s/a"))
            .header("x-test-path", path)
            .send()
    };

    // Well framed: passed on whole, the connection kept for the next.
    for (path, status, body) in [
        ("plain", 200, "plain"),
        ("chunked", 200, "chunked"),
        ("interim", 201, "interim"),
        ("plain", 200, "plain"),
    ] {
        let resp = get(path).await.unwrap();
        assert_eq!(resp.status(), status, "{path}");
        assert_eq!(resp.text().await.unwrap(), body, "{path}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        conns.lock().unwrap().clone(),
        vec![vec!["plain", "chunked", "interim", "plain"]],
        "one connection for well-framed answers"
    );

    // A smuggled second answer: the client gets the first, and the next
    // request its own answer, on a new connection.
    let resp = get("smuggle").await.unwrap();
    assert_eq!(resp.text().await.unwrap(), "ok");
    tokio::time::sleep(Duration::from_millis(20)).await;
    for _ in 0..3 {
        let resp = get("plain").await.unwrap();
        assert_eq!(
            resp.text().await.unwrap(),
            "plain",
            "never the smuggled answer"
        );
    }

    // Heads that cannot be trusted: 502, and nothing of them passed on.
    for path in [
        "both",
        "lengths",
        "negative",
        "upgrade",
        "garbage",
        "many-fields",
    ] {
        let resp = get(path).await.unwrap();
        let body = problem(resp, 502).await;
        assert!(!body.to_string().contains("smuggled"), "{path}: {body}");
        let resp = get("plain").await.unwrap();
        assert_eq!(resp.text().await.unwrap(), "plain", "after {path}");
    }

    // Bodies: read to the close passes whole; one that breaks off, or whose
    // chunks are malformed, breaks off for the client.
    let resp = get("to-close").await.unwrap();
    assert_eq!(resp.text().await.unwrap(), "read until the close");
    for path in [
        "cut-short",
        "bad-chunk",
        "lf-in-extension",
        "empty-size-line",
        "lf-trailer",
        "bad-trailer",
    ] {
        // The head was sound and is passed on, but the server may not have
        // flushed it when the body broke: then the whole answer breaks off.
        if let Ok(resp) = get(path).await {
            assert_eq!(resp.status(), 200, "{path}: the head was sound");
            assert!(resp.bytes().await.is_err(), "{path}: the body breaks off");
        }
        let resp = get("plain").await.unwrap();
        assert_eq!(resp.text().await.unwrap(), "plain", "after {path}");
    }

    // Every connection that carried a broken or hostile answer carried
    // nothing after it.
    let conns = conns.lock().unwrap().clone();
    for paths in &conns {
        if let Some(i) = paths
            .iter()
            .position(|p| p != "plain" && p != "chunked" && p != "interim")
        {
            assert_eq!(
                i,
                paths.len() - 1,
                "a connection was used after {}: {paths:?}",
                paths[i]
            );
        }
    }
}

/// A fenced write to an HTTPS upstream whose answer never ends, to a client
/// that reads the head and then stops reading but stays connected: nothing
/// polls the exchange any more, so only the upstream connection's own
/// deadline can end it, through TLS as over plain TCP. At `timeout_ms` the
/// gateway resets the connection (the upstream's answer is dropped, though
/// the client is still there) and lets the key go: token 2 is forwarded
/// then, not never.
#[tokio::test]
async fn a_stalled_https_exchange_is_cut_at_its_deadline() {
    use tokio::io::AsyncReadExt;
    let store = TestStore::new(Backend::Sqlite).await;
    let (up, _ca, ca_file) = HttpsUpstream::with_new_ca("upstream CA", "upstream").await;
    let mut route = https_route("tls", up.addr, Some(&ca_file));
    route.push_str("timeout_ms = 600\n");
    let app = TestApp::spawn(&store.url, &route).await;

    let sent1 = std::time::Instant::now();
    let mut client = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    client
        .write_all(
            b"PUT /tls/a?endless HTTP/1.1\r\nhost: gw\r\nx-fence-token: 1\r\n\
              content-length: 1\r\n\r\nx",
        )
        .await
        .unwrap();
    let mut head = [0u8; 12];
    client.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200", "token 1's answer begins");
    // From here on the client reads nothing, and stays connected.

    let two = tokio::time::timeout(Duration::from_secs(10), app.put("/tls/a", Some("2"), "y"))
        .await
        .expect("token 2 is answered once token 1's exchange is cut");
    assert_eq!(two.status(), 200);
    assert_eq!(two.text().await.unwrap(), "secure");
    let waited = sent1.elapsed();
    assert!(
        waited >= Duration::from_millis(600),
        "token 2 went after {waited:?}, before token 1's deadline"
    );
    // The upstream learns of the reset when its next write fails.
    let dropped = "endless answer dropped".to_string();
    for _ in 0..50 {
        if up.seen.lock().unwrap().contains(&dropped) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = up.seen.lock().unwrap().clone();
    let one = format!("PUT /tls/a?endless host={} proto=http", up.addr);
    let two = format!("PUT /tls/a host={} proto=http", up.addr);
    assert_eq!(seen.first(), Some(&one), "{seen:?}");
    assert!(
        seen.contains(&dropped),
        "token 1's answer was cut at the upstream while its client stayed: {seen:?}"
    );
    assert!(seen.contains(&two), "{seen:?}");
    drop(client);
}
