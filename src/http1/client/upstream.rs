//! An upstream as the client reaches it: scheme, authority, the `Host` it
//! is sent, where to connect, and how its certificate is verified.

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a route forwards to.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// `http` or `https`; other schemes are refused at load time.
    pub scheme: http::uri::Scheme,
    /// Host and port, from config only, never from the client's `Host`.
    pub authority: http::uri::Authority,
    /// A path prefix prepended to the request path ("" for none).
    pub base_path: String,
    /// `authority` as the `Host` header sent upstream, built once.
    pub host: http::HeaderValue,
    /// `host:port` to connect to (the scheme's port when none is given).
    pub connect_to: String,
    /// Which pooled connections can serve this upstream: same scheme,
    /// authority and trust.
    pub pool_key: std::sync::Arc<str>,
    /// `https`: the CA file its certificate is verified against, instead
    /// of the platform's roots.
    pub ca_file: Option<PathBuf>,
    /// `https`: how the upstream's certificate is verified; set by
    /// [`Upstream::load_tls`].
    pub tls: Option<UpstreamTls>,
}

impl Upstream {
    /// Loads what verifies an `https` upstream's certificate (its CA file,
    /// or the platform's roots); nothing for `http`.
    pub fn load_tls(&mut self) -> Result<(), String> {
        if self.scheme == http::uri::Scheme::HTTPS {
            let tls = UpstreamTls::new(self.authority.host(), self.ca_file.as_deref())?;
            self.tls = Some(tls);
        }
        Ok(())
    }

    /// An upstream from its URL, and the CA file that verifies it when
    /// it is `https`; the error says what is wrong with the URL. Nothing is
    /// read: an `https` upstream needs [`Upstream::load_tls`] before use.
    pub fn parse(raw: &str, ca_file: Option<&Path>) -> Result<Upstream, String> {
        let uri: http::Uri = raw
            .parse()
            .map_err(|_| "is not a URL like http://127.0.0.1:9000".to_string())?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or("has no scheme: write it like http://127.0.0.1:9000")?;
        let https = scheme == http::uri::Scheme::HTTPS;
        if scheme != http::uri::Scheme::HTTP && !https {
            return Err(format!("uses scheme '{scheme}'; use http:// or https://"));
        }
        if ca_file.is_some() && !https {
            return Err("has upstream_ca_file but is not https://".into());
        }
        let authority = uri.authority().cloned().ok_or("has no host")?;
        if authority.as_str().contains('@') {
            return Err("must not carry credentials".into());
        }
        if authority.host().is_empty() {
            return Err("has no host".into());
        }
        if uri.query().is_some() {
            return Err("must not have a query string".into());
        }
        let base_path = uri.path().trim_end_matches('/').to_string();
        let host = http::HeaderValue::from_str(authority.as_str())
            .map_err(|_| "has a host that cannot be sent as a Host header".to_string())?;
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let host_name = authority.host();
        let connect_to = format!("{host_name}:{port}");
        let pool_key = format!(
            "{scheme}://{connect_to}{}",
            ca_file
                .map(|p| format!(" ca={}", p.display()))
                .unwrap_or_default()
        );
        Ok(Upstream {
            scheme,
            authority,
            base_path,
            host,
            connect_to,
            pool_key: pool_key.into(),
            ca_file: ca_file.map(Path::to_path_buf),
            tls: None,
        })
    }

    /// A copy for one traffic worker: its own pool key and `Host` value,
    /// which every request clones (see `gateway::live::WorkerLive`).
    pub fn worker_copy(&self) -> Upstream {
        Upstream {
            pool_key: std::sync::Arc::from(&*self.pool_key),
            // A new buffer: a clone would share the count of this one's.
            host: http::HeaderValue::from_bytes(self.host.as_bytes())
                .unwrap_or_else(|_| self.host.clone()),
            ..self.clone()
        }
    }

    /// Where to connect.
    pub fn address(&self) -> &str {
        &self.connect_to
    }
}

/// TLS to an `https://` upstream, built when the config is loaded.
#[derive(Clone)]
pub struct UpstreamTls {
    /// Trust roots (the platform's, or `upstream_ca_file`), ALPN http/1.1.
    pub config: Arc<rustls::ClientConfig>,
    /// Sent as SNI and checked against the certificate.
    pub server_name: rustls::pki_types::ServerName<'static>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl UpstreamTls {
    /// TLS for the upstream host `host`, trusting `ca_file` (PEM) or, without
    /// one, the platform's roots. The error says what is wrong.
    pub fn new(host: &str, ca_file: Option<&std::path::Path>) -> Result<Self, String> {
        let roots = match ca_file {
            None => fencegate_client::tls::platform_roots()
                .map_err(|e| format!("{e}; set upstream_ca_file"))?,
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|e| format!("upstream_ca_file {}: {e}", path.display()))?;
                let roots = fencegate_client::tls::pem_roots(&pem)
                    .map_err(|e| format!("upstream_ca_file {}: {e}", path.display()))?;
                Arc::new(roots)
            }
        };
        // An IP literal in brackets (`[::1]`) is named without them.
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let server_name = rustls::pki_types::ServerName::try_from(name.to_string())
            .map_err(|_| format!("'{host}' is not a name a certificate can be checked against"))?;
        let config = fencegate_client::tls::client_config(roots)?;
        Ok(Self {
            config: Arc::new(config),
            server_name,
        })
    }
}
