//! The connections of a [`LockClient`](crate::LockClient): TCP, then TLS
//! for https.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tower_service::Service;

use crate::Error;

/// A TLS connector trusting `trust` (PEM), else the platform's roots.
pub(crate) fn tls_connector(trust: Option<&[u8]>) -> Result<TlsConnector, Error> {
    let roots = match trust {
        Some(pem) => Arc::new(
            crate::tls::pem_roots(pem).map_err(|e| Error::Setup(format!("the CA file: {e}")))?,
        ),
        None => crate::tls::platform_roots()
            .map_err(|e| Error::Setup(format!("https: {e}; give a CA (e.g. --cacert)")))?,
    };
    let config = crate::tls::client_config(roots).map_err(Error::Setup)?;
    Ok(TlsConnector::from(Arc::new(config)))
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Connects over TCP, then TLS for `https` URLs.
#[derive(Clone)]
pub(crate) struct Connector {
    pub(crate) tcp: HttpConnector,
    /// Set when the base URL is https.
    pub(crate) tls: Option<TlsConnector>,
}

impl Service<Uri> for Connector {
    type Response = Conn;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Conn, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = (uri.scheme_str() == Some("https")).then(|| self.tls.clone());
        let host = uri
            .host()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let connecting = self.tcp.call(uri);
        Box::pin(async move {
            let tcp = connecting.await?;
            let Some(tls) = tls else {
                return Ok(Conn::Plain(tcp));
            };
            let tls = tls.ok_or("an https URL, but the client was made for http")?;
            let name = ServerName::try_from(host)?;
            let stream = tls.connect(name, tcp.into_inner()).await?;
            Ok(Conn::Tls(Box::new(TokioIo::new(stream))))
        })
    }
}

/// A connection to the gateway, plain or TLS.
pub(crate) enum Conn {
    Plain(TokioIo<TcpStream>),
    /// Boxed: a TLS session is a kilobyte, a plain stream a few words.
    Tls(Box<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>),
}

impl hyper::rt::Read for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

impl Connection for Conn {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}
