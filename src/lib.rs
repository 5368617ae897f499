//! fencegate: an HTTP reverse proxy that enforces fencing tokens for backends
//! that cannot check them.
//!
//! A lease-based lock can always be outlived by its holder (a GC pause, a VM
//! freeze, a network stall). Fencing tokens fix that: every grant carries a
//! number that only grows, and the resource refuses writes carrying a number
//! lower than the highest it has seen. fencegate does that refusal on the
//! resource's behalf: it requires `X-Fence-Token` on writes, records the
//! highest token per resource key durably, refuses stale writes with 409 and
//! guarantees that, for one key, a stale write never reaches the upstream
//! after a newer one.
//!
//! # Layout
//!
//! A request's path through the code, top to bottom:
//!
//! * [`server`]: the accept loop (header-read timeout, connection limit,
//!   graceful shutdown) shared by the traffic and admin listeners, and the
//!   traffic listener's worker threads (one runtime and socket per CPU).
//! * [`traffic`]: a worker's service: proxied requests in place, the
//!   reserved prefix (lock API) on the store's runtime.
//! * [`gateway`]: the phases of one request: match route → check framing →
//!   read token → check fence → forward → respond.
//! * [`routing`]: path patterns and resource-key templates.
//! * [`token`]: the strict `X-Fence-Token` grammar.
//! * [`fence`]: the decision — a durable record in the [`store`], then the
//!   per-key [`gate`] that orders in-flight writes.
//! * [`exchange`]: one fenced write's exchange with the upstream, and when
//!   its key may open for another token.
//! * [`proxy`]: header hygiene, the pooled upstream client, body wrappers.
//! * [`error`]: errors by origin (client, store, upstream) and their one
//!   mapping to `application/problem+json`.
//!
//! Around it: [`config`] (typed, validated TOML with env overrides),
//! [`admin`] (health, readiness, metrics, fence inspection), [`metrics`],
//! [`app`] (`Application::build` and `run`), [`demo`] (a toy backend) and
//! [`cli`].

pub mod admin;
pub mod app;
pub mod cli;
pub mod client;
pub mod config;
pub mod demo;
pub mod error;
pub mod exchange;
pub mod fence;
pub mod gate;
pub mod gateway;
pub mod jwt;
pub mod locks;
pub mod metrics;
pub mod proxy;
pub mod routing;
pub mod server;
pub mod store;
pub mod token;
pub mod traffic;
