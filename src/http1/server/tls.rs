//! HTTPS on a listener: the config new connections are accepted with, and
//! what a finished handshake tells of the client. Where the config comes
//! from (files, a reload) is the caller's business: this side only swaps
//! it in whole, so connections already open keep the one they were
//! accepted with.

use std::sync::{Arc, RwLock};

use rustls::pki_types::CertificateDer;
use rustls::ServerConfig;

/// The TLS config new connections of a listener get.
pub struct ServerTls {
    current: RwLock<Arc<ServerConfig>>,
}

/// What a TLS connection tells the requests on it.
#[derive(Debug, Clone, Default)]
pub struct TlsPeer {
    /// The common name of the client certificate, when one was presented and
    /// verified against the config's client CA.
    pub client_cn: Option<String>,
}

impl ServerTls {
    pub fn new(config: Arc<ServerConfig>) -> Self {
        Self {
            current: RwLock::new(config),
        }
    }

    /// The config for new connections from now on.
    pub fn replace(&self, config: Arc<ServerConfig>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = config;
    }

    /// The config new connections get now.
    pub fn current(&self) -> Arc<ServerConfig> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The acceptor for a new connection.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current())
    }
}

/// Reads a finished handshake's client identity.
pub fn peer_of(conn: &rustls::ServerConnection) -> TlsPeer {
    let client_cn = conn
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(|cert| common_name(cert));
    TlsPeer { client_cn }
}

/// The subject's first common name, if it is valid UTF-8.
fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let cn = parsed.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_string)
}
