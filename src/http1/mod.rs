//! Our HTTP/1.1, both sides: the server that takes requests on the
//! listeners, and the client that forwards them to the upstreams. It
//! imports nothing from the rest of the crate: what it knows of fencing is
//! what a caller tells it (a deadline, a [`client::Witness`] to report to,
//! an answer to give to a refused head).
//!
//! # Layout
//!
//! * [`codec`]: what both sides share: head limits, the fields that frame
//!   a body, the chunked codec, the hop-by-hop fields.
//! * [`server`]: the accept loop, a connection's phases, request heads and
//!   bodies, the drain, the traffic listener's workers, TLS handshakes.
//! * [`client`]: per-worker pools of upstream connections, one exchange on
//!   a connection, its deadline, and what the connection's TCP can tell.
//!
//! Imports: `server` and `client` each import `codec`, never each other.

pub mod client;
pub mod codec;
pub mod server;
