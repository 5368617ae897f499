//! TLS on the traffic listener: loading the certificate, key and client CA,
//! reloading them on SIGHUP, and the handshake that turns an accepted TCP
//! connection into an HTTPS one with, optionally, a verified client identity.
//!
//! The crypto provider is rustls' `ring` (a pure build: no cmake, no C
//! toolchain beyond what `ring` itself needs). ALPN offers `h2` then
//! `http/1.1` when `[server] http2` is on, and only `http/1.1` when it is
//! off (a restart setting, so a reload never changes what is offered).
//!
//! Reloading swaps the whole `ServerConfig` for new connections; connections
//! already open keep the config they were accepted with. Files that fail to
//! load leave the current config in place, so a half-written certificate
//! never takes the listener down.
//!

use std::path::Path;
use std::sync::{Arc, RwLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use crate::http1::server::tls::ServerTls;

use crate::config::{ClientAuth, TlsConfig};

/// The traffic listener's TLS: the files it comes from, and the config
/// the listener gives new connections.
pub struct Tls {
    files: RwLock<TlsConfig>,
    /// ALPN offers `h2` (`[server] http2`).
    http2: bool,
    serving: Arc<ServerTls>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files()).finish()
    }
}

impl Tls {
    /// Loads the files; an error names the file and what is wrong with it.
    pub fn load(files: &TlsConfig, http2: bool) -> Result<Self, String> {
        let config = build(files, http2)?;
        Ok(Self {
            files: RwLock::new(files.clone()),
            http2,
            serving: Arc::new(ServerTls::new(config)),
        })
    }

    /// The files it was loaded from.
    pub fn files(&self) -> TlsConfig {
        self.files.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What the listener accepts connections with.
    pub fn serving(&self) -> Arc<ServerTls> {
        self.serving.clone()
    }

    /// Re-reads the files for new connections; on failure the current ones
    /// stay and the error says why.
    pub fn reload(&self) -> Result<(), String> {
        self.serving.replace(build(&self.files(), self.http2)?);
        Ok(())
    }

    /// Takes over another (freshly loaded) config's files and certificate,
    /// for new connections: a config reload.
    pub fn adopt(&self, other: &Tls) {
        *self.files.write().unwrap_or_else(|e| e.into_inner()) = other.files();
        self.serving.replace(other.serving.current());
    }
}

fn build(files: &TlsConfig, http2: bool) -> Result<Arc<ServerConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = read_certs(&files.cert_file)?;
    let key = PrivateKeyDer::from_pem_file(&files.key_file)
        .map_err(|e| format!("{}: no usable private key: {e}", files.key_file.display()))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?;
    let builder = match &files.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in read_certs(ca)? {
                roots
                    .add(cert)
                    .map_err(|e| format!("{}: not a usable CA certificate: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = match files.client_auth {
                ClientAuth::Optional => verifier.allow_unauthenticated(),
                ClientAuth::Required => verifier,
            };
            let verifier = verifier
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        format!(
            "{} and {}: the certificate and key do not make a usable pair: {e}",
            files.cert_file.display(),
            files.key_file.display()
        )
    })?;
    config.alpn_protocols = if http2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    Ok(Arc::new(config))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM certificate chain: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: holds no certificate", path.display()));
    }
    Ok(certs)
}
