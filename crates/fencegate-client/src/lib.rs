//! A Rust client of fencegate's lock API (`/_fencegate/locks/{name}`), and a
//! [`LeaseKeeper`] for leader election.
//!
//! A crate of its own so that a service that takes locks does not build the
//! gateway: its dependencies are an HTTP/1.1 client (hyper), rustls with
//! `ring`, tokio and serde; no database driver, no Redis client, no server.
//!
//! [`LockClient`] speaks the four calls of the lock API: [`acquire`],
//! [`renew`], [`release`] and [`status`]. A [`Grant`] carries the fencing
//! token to send as `X-Fence-Token` on writes through the gateway; its
//! `lease` is the secret that proves ownership and is never printed.
//!
//! It speaks `http` and `https` (rustls; the CAs of [`ClientOptions`], else
//! the platform's trust roots), and sends a bearer key when given one
//! ([`ClientOptions::api_key`]), for gateways with `[[auth.clients]]`.
//!
//! [`LeaseKeeper`] renews a grant in the background and says, from the
//! client's own monotonic clock, when the lease can no longer be trusted:
//! as soon as a renewal is refused, or once the last successful renewal is
//! older than the ttl (minus a margin for clock drift). Work done as the
//! holder should stop when [`LeaseKeeper::lost`] resolves; the fencing token
//! makes the gateway refuse any write that slips through anyway.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use fencegate_client::{Error, LockClient};
//!
//! # async fn demo() -> Result<(), Error> {
//! let locks = LockClient::new("http://127.0.0.1:8080")?;
//!
//! // One-off: take the lock, write with its token, let go.
//! let grant = locks
//!     .acquire("job:nightly", Duration::from_secs(30), Duration::from_secs(5))
//!     .await?;
//! println!("fence {}; send X-Fence-Token: {}", grant.fence, grant.token);
//! locks.release("job:nightly", &grant.lease).await?;
//!
//! // Leader election: keep the lease alive while working.
//! let keeper = locks
//!     .acquire_keeper("job:nightly", Duration::from_secs(10), Duration::from_secs(30))
//!     .await?;
//! tokio::select! {
//!     _ = keeper.lost() => eprintln!("leadership lost; stop and retry"),
//!     _ = async {
//!         // Leader work; send keeper.token() as X-Fence-Token on each write.
//!     } => {}
//! }
//! keeper.release().await.ok();
//! # Ok(()) }
//! ```
//!
//! [`acquire`]: LockClient::acquire
//! [`renew`]: LockClient::renew
//! [`release`]: LockClient::release
//! [`status`]: LockClient::status

//!
//! # Layout
//!
//! * [`LockClient`], [`ClientOptions`]: the calls, over http or https.
//! * [`LeaseKeeper`]: renewals in the background, and loss by the client's
//!   own clock.
//! * [`Grant`], [`Status`]: the API's answers; the gateway serializes these
//!   same types.
//! * [`Error`], [`Answer`]: refusals and failures; [`problem`]: the problem
//!   types and members they are read from.
//! * [`tls`]: trust roots and the rustls client config (the gateway's
//!   upstream client shares them).

mod answer;
mod client;
mod connect;
mod error;
mod keeper;
pub mod problem;
pub mod tls;
mod wire;

pub use answer::Answer;
pub use client::{lock_path, segment, ClientOptions, LockClient, DEFAULT_TIMEOUT};
pub use error::Error;
pub use keeper::LeaseKeeper;
pub use wire::{Grant, Status};

/// The README's examples, compiled as doctests so that they keep up with the
/// API. Only under `cfg(doctest)`: a build does not read the README.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
