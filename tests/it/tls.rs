//! TLS on the traffic listener: real handshakes with certificates made in
//! the test, client certificates, and SIGHUP reloading the files of a real
//! gateway process.

use std::time::Duration;

use crate::support::app::{config_error, config_sections, docs_route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::fenced_put;
use crate::support::pki::{self, Ca};
use crate::support::process::GatewayProcess;
use crate::support::upstream::Upstream;

#[tokio::test]
async fn https_traffic_and_lock_api_are_served_and_forwarded_as_https() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let ca = Ca::new("test CA");
    let (_, cert, key) = ca.server_files("gateway");
    let extra = format!(
        "{}{}",
        docs_route(&up.url()),
        pki::tls_section(&cert, &key, None)
    );
    let app = TestApp::spawn(&store.url, &extra).await;
    let https = pki::client(&ca, None);
    let base = format!("https://127.0.0.1:{}", app.addr.port());
    let put = fenced_put(&https, format!("{base}/docs/a"), "1", "A")
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let get = https.get(format!("{base}/docs/a")).send().await.unwrap();
    assert_eq!(get.status(), 200);
    let grant = https
        .post(format!("{base}/_fencegate/locks/doc:b"))
        .json(&serde_json::json!({"ttl_ms": 5000}))
        .send()
        .await
        .unwrap();
    assert_eq!(grant.status(), 201);
    let seen = up.requests();
    assert_eq!(seen.len(), 2);
    for r in &seen {
        assert_eq!(r.header("x-forwarded-proto"), Some("https"), "{r:?}");
    }
    // Plain HTTP on the HTTPS listener gets no HTTP answer and reaches
    // nothing.
    let answer = crate::support::raw_request(
        app.addr,
        "PUT /docs/a HTTP/1.1\r\nhost: t\r\nx-fence-token: 2\r\ncontent-length: 0\r\n\r\n",
    )
    .await;
    assert!(!answer.starts_with("HTTP/"), "{answer:?}");
    assert_eq!(up.requests().len(), 2);
}

#[tokio::test]
async fn client_certificates_are_verified_against_the_configured_ca() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let ca = Ca::new("test CA");
    let clients = Ca::new("client CA");
    let other = Ca::new("someone else's CA");
    let (_, cert, key) = ca.server_files("gateway");
    let client_ca = clients.write("clients.pem", &clients.pem());
    let ours = clients.client("billing-worker");
    let theirs = other.client("billing-worker");
    for policy in ["optional", "required"] {
        let extra = format!(
            "{}{}",
            docs_route(&up.url()),
            pki::tls_section(&cert, &key, Some((&client_ca, policy)))
        );
        let app = TestApp::spawn(&store.url, &extra).await;
        let url = format!("https://127.0.0.1:{}/docs/a", app.addr.port());
        let reached = |r: reqwest::Result<reqwest::Response>| {
            r.map(|r| r.headers().get("x-upstream").is_some())
                .unwrap_or(false)
        };
        let with_ours = pki::client(&ca, Some(&ours)).get(&url).send().await;
        assert!(reached(with_ours), "{policy}: our client");
        let with_theirs = pki::client(&ca, Some(&theirs)).get(&url).send().await;
        assert!(
            with_theirs.is_err(),
            "{policy}: a certificate from another CA got through"
        );
        let without = pki::client(&ca, None).get(&url).send().await;
        match policy {
            "optional" => assert!(reached(without), "optional: no certificate"),
            _ => assert!(without.is_err(), "required: no certificate got through"),
        }
        app.stop().await;
    }
}

/// A verified client certificate whose CN is a client's `tls_subject`
/// authenticates as that client on the lock API, with its globs and its
/// leases; an unknown CN is 401 like no credential; a bearer key, when sent,
/// is what authenticates (a wrong one is refused whatever the certificate).
#[tokio::test]
async fn a_client_certificate_authenticates_as_the_client_of_its_cn() {
    use sha2::Digest;
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let ca = Ca::new("test CA");
    let clients = Ca::new("client CA");
    let (_, cert, key) = ca.server_files("gateway");
    let client_ca = clients.write("clients.pem", &clients.pem());
    let auth = format!(
        "[[auth.clients]]\nname = \"billing\"\ntls_subject = \"billing-worker\"\nlocks = [\"billing:*\"]\n\
         [[auth.clients]]\nname = \"ops\"\napi_key_sha256 = \"{}\"\nlocks = [\"*\"]\n",
        hex::encode(sha2::Sha256::digest(b"key-ops"))
    );
    let extra = format!(
        "{}{}{auth}",
        docs_route(&up.url()),
        pki::tls_section(&cert, &key, Some((&client_ca, "optional")))
    );
    let app = TestApp::spawn(&store.url, &extra).await;
    let base = format!("https://127.0.0.1:{}/_fencegate/locks", app.addr.port());
    let billing = pki::client(&ca, Some(&clients.client("billing-worker")));
    let stranger = pki::client(&ca, Some(&clients.client("someone-else")));
    let anonymous = pki::client(&ca, None);
    let ttl = serde_json::json!({"ttl_ms": 5000});

    let grant = billing
        .post(format!("{base}/billing:run"))
        .json(&ttl)
        .send()
        .await
        .unwrap();
    assert_eq!(grant.status(), 201);
    let grant: serde_json::Value = grant.json().await.unwrap();
    let outside = billing
        .post(format!("{base}/doc:1"))
        .json(&ttl)
        .send()
        .await
        .unwrap();
    assert_eq!(outside.status(), 403, "outside the client's globs");
    for (who, client) in [("an unknown CN", &stranger), ("no certificate", &anonymous)] {
        let resp = client
            .post(format!("{base}/billing:other"))
            .json(&ttl)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401, "{who}");
        assert!(resp.headers().contains_key("www-authenticate"), "{who}");
    }
    // A bearer key decides when it is sent: a wrong one is refused even
    // with billing's certificate, ops's key is ops (whose lease billing's
    // is not).
    let wrong_key = billing
        .post(format!("{base}/billing:other"))
        .bearer_auth("not-a-key")
        .json(&ttl)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong_key.status(), 401);
    let as_ops = billing
        .post(format!("{base}/billing:run/release"))
        .bearer_auth("key-ops")
        .json(&serde_json::json!({"lease": grant["lease"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(as_ops.status(), 403, "billing's lease is not ops's");
    let released = billing
        .post(format!("{base}/billing:run/release"))
        .json(&serde_json::json!({"lease": grant["lease"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(released.status(), 204);
    assert!(up.requests().is_empty(), "lock calls reach no upstream");
}

#[tokio::test]
async fn unusable_tls_files_are_config_problems() {
    let ca = Ca::new("test CA");
    let (_, cert, key) = ca.server_files("gateway");
    let other_key = ca.write("other.key", &ca.server("x").key_pem);
    let garbage = ca.write("garbage.pem", "not a certificate");
    for (cert, key, why) in [
        (
            ca.dir.path().join("missing.pem"),
            key.clone(),
            "missing.pem",
        ),
        (garbage.clone(), key.clone(), "no certificate"),
        (cert.clone(), garbage.clone(), "no usable private key"),
        (cert.clone(), other_key.clone(), "do not make a usable pair"),
    ] {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}",
            pki::tls_section(&cert, &key, None)
        );
        let err = config_error(&text);
        assert!(
            err.contains("server.tls") && err.contains(why),
            "{why}: {err}"
        );
    }
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}client_auth = \"required\"\n",
        pki::tls_section(&cert, &key, None)
    );
    let err = config_error(&text);
    assert!(err.contains("server.tls.client_auth"), "{err}");
}

/// SIGHUP re-reads the certificate and key for new connections; files that
/// fail to load keep the current ones and are logged.
#[tokio::test]
async fn sighup_reloads_the_certificate_and_keeps_it_when_the_new_one_is_bad() {
    let store = TestStore::new(Backend::Sqlite).await;
    let ca = Ca::new("test CA");
    let (_, cert, key) = ca.server_files("first");
    let config = config_sections(
        "",
        &store.url,
        "",
        &(docs_route("http://127.0.0.1:9") + &pki::tls_section(&cert, &key, None)),
    );
    let mut gw = GatewayProcess::start(&config);
    let first = std::fs::read_to_string(&cert).unwrap();
    let seen = pki::server_certificate(gw.addr, &ca.pem()).await.unwrap();
    assert_eq!(seen, pki::der(&first));

    let second = ca.server("second");
    std::fs::write(&cert, &second.cert_pem).unwrap();
    std::fs::write(&key, &second.key_pem).unwrap();
    gw.signal(libc::SIGHUP);
    let mut now = Vec::new();
    for _ in 0..100 {
        now = pki::server_certificate(gw.addr, &ca.pem()).await.unwrap();
        if now == pki::der(&second.cert_pem) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        now,
        pki::der(&second.cert_pem),
        "the new certificate is served"
    );

    // A half-written certificate: the old one stays, and the log says why.
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nnot base64").unwrap();
    gw.signal(libc::SIGHUP);
    for _ in 0..100 {
        if gw.log().contains("config not reloaded") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gw.log().contains("config not reloaded"), "{}", gw.log());
    let still = pki::server_certificate(gw.addr, &ca.pem()).await.unwrap();
    assert_eq!(still, pki::der(&second.cert_pem));
    assert!(gw.is_running(), "a bad file never stops the gateway");
}
