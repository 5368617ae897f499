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

/// An upstream that answers each request, then closes the connection after
/// a random moment (0 to 3 ms), while promising keep-alive: pooled
/// connections die just as they are picked. Every request is counted by its
/// `x-test-id`.
async fn closing_upstream() -> (std::net::SocketAddr, Arc<Mutex<HashMap<String, usize>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                continue;
            };
            let log = log.clone();
            tokio::spawn(async move {
                // One request per connection.
                let Some(headers) = read_one_request(&mut tcp).await else {
                    return;
                };
                let id = headers
                    .into_iter()
                    .find(|(name, _)| name == "x-test-id")
                    .map(|(_, v)| v)
                    .unwrap_or_default();
                *log.lock().unwrap().entry(id).or_default() += 1;
                let _ = tcp
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok",
                    )
                    .await;
                let pause = rand::thread_rng().gen_range(0..=3);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            });
        }
    });
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
