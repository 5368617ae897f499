//! HTTP/2 on the traffic listener: the `h2` crate's framing, HPACK, flow
//! control and stream states, beside the HTTP/1.1 of our own.
//!
//! Each stream becomes one request for the same [`Service`] an HTTP/1.1
//! connection calls, so a stream has exactly an HTTP/1.1 request's
//! semantics: the gateway cannot tell them apart except by
//! [`http::Version`]. What is HTTP/2's own stays here: the connection's
//! life (handshake, idle end, GOAWAY at a drain), the guards against
//! abuse that the protocol invites, and the mapping of a stream's events
//! onto a request's (a client's `RST_STREAM` drops the request's future:
//! "the client left").
//!
//! # Layout
//!
//! * [`server`]: one connection's accept loop and its streams.
//! * [`body`]: a stream's request body as an [`http_body::Body`], and the
//!   answer's body sent under the peer's flow control.
//! * [`tunnel`]: a stream as a byte stream both ways, for an extended
//!   CONNECT's tunnel (RFC 8441).
//! * [`client`]: HTTP/2 to upstreams: a connection per upstream and
//!   worker, and what a stream tells a fenced write's exchange.
//!
//! Imports `http1` (the service contract, the drain, `Host` validation;
//! the upstream, its errors and the exchange's witness); nothing else of
//! the crate.
//!
//! [`Service`]: crate::http1::server::Service

pub mod body;
pub mod client;
pub mod server;
pub mod tunnel;

pub use client::Http2Client;
pub use server::{serve, Settings};

use http::{header, HeaderMap};

/// Takes out the fields HTTP/2 forbids in a message (RFC 9113 §8.2.2):
/// they belong to one HTTP/1.1 connection, and an answer relayed from one
/// may carry them.
pub fn connection_specific(headers: &mut HeaderMap) {
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::TE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}
