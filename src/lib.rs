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
//! A fenced write's path through the code, top to bottom, then what
//! surrounds it. One line per module:
//!
//! * [`server`]: the HTTP/1.1 server of both listeners, our own: the
//!   accept loop (connection limit), a connection's phases (header-read
//!   timeout, strict request framing, bodies read on demand), the graceful
//!   drain, and the traffic listener's worker threads.
//! * [`tls`]: HTTPS on the traffic listener: certificates, SIGHUP reload,
//!   client identities.
//! * [`traffic`]: a worker's service: proxied requests in place, the
//!   reserved prefix (lock API) on the store's runtime.
//! * [`gateway`]: one proxied request's phases, from route match to the
//!   answer, and its accounting.
//! * [`idempotency`]: `Idempotency-Key` on fenced writes: keys,
//!   fingerprints, the records' life, and the memory cache of completed
//!   records' answers.
//! * [`routing`]: path patterns and resource-key templates.
//! * [`token`]: the strict `X-Fence-Token` grammar.
//! * [`jwt`]: JWT fence tokens: loading keys, verifying tokens, signing grants.
//! * [`fence`]: the decision: the durable record in the store, then the gate.
//! * [`gate`]: the per-key gate that orders in-flight writes, and the memory
//!   cache of durable tokens.
//! * [`store`]: the fence store (SQLite or Postgres), group commit, shared
//!   mode's cross-instance admissions, and what keeps decisions right through
//!   a Postgres failover (read-only servers refused, the single-writer
//!   lock's lease, readiness and the durability check).
//! * [`exchange`]: one fenced write's exchange with the upstream, and when
//!   its key may open for another token.
//! * [`proxy`]: header hygiene and the body wrappers of a forward.
//! * [`upstream`]: the upstream client, an HTTP/1.1 of its own: per-worker
//!   connections over TCP or TLS, exchanges run in the asking future,
//!   strict framing, retried only when nothing was sent.
//! * [`error`]: errors by origin and their one mapping to problem documents.
//! * [`locks`]: the lock API: leases whose grants carry fences, on the
//!   store, Redis or Redlock.
//! * [`auth`]: the API clients: bearer keys, client certificates, lock-name
//!   globs, the admin flag.
//! * [`admin`]: the admin listener: health, readiness, metrics, fences.
//! * [`dashboard`]: the admin listener's live page and the reads it polls.
//! * [`refusals`]: the bounded ring of recent refusals the dashboard shows.
//! * [`openapi`]: the OpenAPI document of the lock and admin APIs.
//! * [`metrics`]: every metric, with typed labels.
//! * [`logging`]: log output as text or JSON lines.
//! * [`config`]: typed, validated TOML with environment overrides.
//! * [`app`]: `Application::build` and `run`: start-up and shutdown.
//! * [`reload`]: SIGHUP: the config re-read, and what it swaps.
//! * [`cli`]: the `fencegate` command line, the operators' `lock` and
//!   `fence` commands included.
//! * [`demo`]: a toy document store to try the gateway against.
//!
//! The lock API's Rust client is a crate of its own, [`fencegate_client`]
//! (`crates/fencegate-client`), so that services taking locks do not build
//! the gateway. Imports go one way, from here to it: [`cli`] calls gateways
//! with it, [`locks`] answers with its wire types (grants, statuses, problem
//! kinds), and [`tls`] takes its HTTPS client setup from it.

pub mod admin;
pub mod auth;
pub mod boot;
pub mod config;
pub mod demo;
pub mod fencing;
pub mod gateway;
pub mod http1;
pub mod idempotency;
pub mod locks;
pub mod metrics;
pub mod store;
