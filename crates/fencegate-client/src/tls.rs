//! Trust roots and the rustls client config for https to a gateway.
//!
//! The gateway's own upstream client uses these too, so that both speak TLS
//! out of the process the same way: the `ring` provider, its safe protocol
//! versions, HTTP/1.1 only.

use std::sync::{Arc, LazyLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};

/// Trust roots from the certificates in `pem`: every one a usable CA, at
/// least one. The error says which rule failed.
pub fn pem_roots(pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| format!("not PEM certificates: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("not a usable CA: {e}"))?;
    }
    if roots.is_empty() {
        return Err("holds no certificate".into());
    }
    Ok(roots)
}

/// The platform's trust roots, read once (the first caller pays for it).
static PLATFORM_ROOTS: LazyLock<Result<Arc<RootCertStore>, String>> = LazyLock::new(|| {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
        return Err(format!(
            "no trust roots found on this system ({})",
            why.join("; ")
        ));
    }
    Ok(Arc::new(roots))
});

/// The platform's trust roots (`SSL_CERT_FILE` and `SSL_CERT_DIR` are
/// honoured), or why there are none.
pub fn platform_roots() -> Result<Arc<RootCertStore>, String> {
    PLATFORM_ROOTS.clone()
}

/// A client config trusting `roots`: the `ring` provider, its safe protocol
/// versions, HTTP/1.1 only (as the gateway and its upstreams speak it).
pub fn client_config(roots: Arc<RootCertStore>) -> Result<ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pem_without_a_certificate_is_refused() {
        assert_eq!(pem_roots(b"").unwrap_err(), "holds no certificate");
        let key_only = b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        assert_eq!(pem_roots(key_only).unwrap_err(), "holds no certificate");
    }

    #[test]
    fn a_client_config_offers_http1_only() {
        let config = client_config(Arc::new(RootCertStore::empty())).unwrap();
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
