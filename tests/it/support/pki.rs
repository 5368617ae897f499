//! Certificates made in the test: a CA, server certificates for 127.0.0.1
//! and client certificates with a chosen common name, as PEM files in a temp
//! dir, plus clients that trust them (reqwest, and a bare rustls handshake
//! that reports the server's certificate).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A test certificate authority.
pub struct Ca {
    cert: Certificate,
    key: KeyPair,
    pub dir: tempfile::TempDir,
}

/// A certificate and its key, as PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca {
            cert,
            key,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    fn issue(&self, cn: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose) -> Issued {
        let mut params = CertificateParams::new(sans).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// A server certificate for 127.0.0.1 and localhost.
    pub fn server(&self, cn: &str) -> Issued {
        self.issue(
            cn,
            vec!["127.0.0.1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A server certificate for exactly these names.
    pub fn issue_for(&self, cn: &str, sans: Vec<String>) -> Issued {
        self.issue(cn, sans, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate whose subject CN is `cn`.
    pub fn client(&self, cn: &str) -> Issued {
        self.issue(cn, Vec::new(), ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// Writes `text` to `name` in this CA's temp dir; returns the path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Writes the CA certificate and a server certificate: (ca, cert, key).
    pub fn server_files(&self, cn: &str) -> (PathBuf, PathBuf, PathBuf) {
        let server = self.server(cn);
        (
            self.write("ca.pem", &self.pem()),
            self.write("server.pem", &server.cert_pem),
            self.write("server.key", &server.key_pem),
        )
    }
}

/// `[server.tls]` naming these files (absolute paths), and optionally a CA
/// for client certificates with a policy.
pub fn tls_section(cert: &Path, key: &Path, clients: Option<(&Path, &str)>) -> String {
    let mut s = format!(
        "[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        cert.display(),
        key.display()
    );
    if let Some((ca, policy)) = clients {
        s.push_str(&format!(
            "client_ca_file = \"{}\"\nclient_auth = \"{policy}\"\n",
            ca.display()
        ));
    }
    s
}

/// An HTTPS client that trusts `ca`, optionally presenting `identity`.
pub fn client(ca: &Ca, identity: Option<&Issued>) -> reqwest::Client {
    // HTTP/1.1 only: these tests are about TLS, and HTTP/2 over TLS has
    // its own (tests/it/http2.rs).
    let mut b = reqwest::Client::builder()
        .http1_only()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).unwrap());
    if let Some(id) = identity {
        let pem = format!("{}{}", id.cert_pem, id.key_pem);
        b = b.identity(reqwest::Identity::from_pem(pem.as_bytes()).unwrap());
    }
    b.build().unwrap()
}

/// A bare TLS handshake with `addr` trusting `ca_pem`: the server's leaf
/// certificate (DER), or why the handshake failed.
pub async fn server_certificate(
    addr: std::net::SocketAddr,
    ca_pem: &str,
) -> Result<Vec<u8>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (_, conn) = tls.get_ref();
    Ok(conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec())
        .unwrap_or_default())
}

/// The DER of a PEM certificate.
pub fn der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .as_ref()
        .to_vec()
}

/// A running HTTPS upstream: every request is answered 200 with a JSON of
/// what it saw; requests are counted, and so are TCP connections, with the
/// SNI each handshake carried.
pub struct HttpsUpstream {
    pub addr: std::net::SocketAddr,
    pub seen: Arc<std::sync::Mutex<Vec<String>>>,
    /// One entry per accepted TLS connection: the server name the client
    /// sent (SNI), `None` when it sent none (as for an IP address).
    pub handshakes: Arc<std::sync::Mutex<Vec<Option<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HttpsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An answer body that never ends (16 KiB pieces, as fast as they are
/// taken); when it is dropped (its connection broke), `log` gets the line
/// `endless answer dropped`.
fn endless(
    log: Arc<std::sync::Mutex<Vec<String>>>,
) -> http_body_util::combinators::BoxBody<bytes::Bytes, std::convert::Infallible> {
    use http_body_util::BodyExt;
    struct Dropped(Arc<std::sync::Mutex<Vec<String>>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.lock().unwrap().push("endless answer dropped".into());
        }
    }
    let piece = bytes::Bytes::from(vec![b'x'; 16 * 1024]);
    let pieces = futures_util::stream::unfold(Dropped(log), move |d| {
        let piece = piece.clone();
        async move { Some((Ok(http_body::Frame::data(piece)), d)) }
    });
    http_body_util::StreamBody::new(pieces).boxed()
}

impl HttpsUpstream {
    /// Serves HTTPS with a certificate for `cn` (and 127.0.0.1, localhost)
    /// from a new CA named `ca_name`; with that CA, and its certificate
    /// written to a file (for a route's `upstream_ca_file`: it lives as long
    /// as the CA).
    pub async fn with_new_ca(ca_name: &str, cn: &str) -> (HttpsUpstream, Ca, PathBuf) {
        let ca = Ca::new(ca_name);
        let ca_file = ca.write("ca.pem", &ca.pem());
        (HttpsUpstream::start(&ca.server(cn)).await, ca, ca_file)
    }

    /// Serves HTTPS on 127.0.0.1:0 with `server` (a certificate and key).
    pub async fn start(server: &Issued) -> HttpsUpstream {
        use http_body_util::BodyExt;
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = vec![CertificateDer::from_pem_slice(server.cert_pem.as_bytes()).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(server.key_pem.as_bytes()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        // HTTP/2 for routes with `upstream_protocol = "h2"`, HTTP/1.1 for
        // the others (the gateway's HTTP/1.1 client offers only that).
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
        let handshakes: Arc<std::sync::Mutex<Vec<Option<String>>>> = Arc::default();
        let log = seen.clone();
        let shakes = handshakes.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, log, shakes) = (acceptor.clone(), log.clone(), shakes.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let sni = tls.get_ref().1.server_name().map(str::to_string);
                    shakes.lock().unwrap().push(sni);
                    let service = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let log = log.clone();
                            async move {
                                // An HTTP/2 request's URI is absolute: the
                                // line tells the two apart.
                                let line = format!(
                                    "{} {} host={} proto={}",
                                    req.method(),
                                    req.uri(),
                                    req.headers()
                                        .get("host")
                                        .and_then(|v| v.to_str().ok())
                                        .unwrap_or(""),
                                    req.headers()
                                        .get("x-forwarded-proto")
                                        .and_then(|v| v.to_str().ok())
                                        .unwrap_or("")
                                );
                                log.lock().unwrap().push(line);
                                // Read to its end before the answer, as an
                                // upstream that applies writes does: an
                                // answer before the request is acknowledged
                                // is an early one, whose connection the
                                // gateway does not keep.
                                let endless_answer = req.uri().query() == Some("endless");
                                let _ = req.into_body().collect().await;
                                let body = if endless_answer {
                                    endless(log.clone())
                                } else {
                                    http_body_util::Full::new(bytes::Bytes::from_static(b"secure"))
                                        .map_err(|never| match never {})
                                        .boxed()
                                };
                                Ok::<_, std::convert::Infallible>(http::Response::new(body))
                            }
                        },
                    );
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
                });
            }
        });
        HttpsUpstream {
            addr,
            seen,
            handshakes,
            task,
        }
    }
}
