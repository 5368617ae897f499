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
//! * [`tunnel`]: an agreed upgrade's two byte streams spliced together,
//!   with its idle bound and its end at a stop; both sides (and HTTP/2's
//!   extended CONNECT) meet there.
//! * [`prefixed`]: an I/O whose first bytes were already read (a preface,
//!   or what a client sent right behind its upgrade request).
//!
//! Imports: `server` and `client` each import `codec`, never each other;
//! both import `tunnel` and `prefixed`, which import nothing of them but
//! the drain.

pub mod client;
pub mod codec;
pub mod prefixed;
pub mod server;
pub mod tunnel;
