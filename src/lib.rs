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
//! Layers, from the ground up; a module imports only from layers below it
//! (or beside it, where said), never from one above, and no two import
//! each other:
//!
//! * [`http1`]: our HTTP/1.1, both sides: the listeners' server and the
//!   upstream client, sharing one codec, and the tunnels an upgrade opens.
//!   Imports nothing of the crate.
//! * [`http2`]: HTTP/2 on the traffic listener, through the `h2` crate:
//!   each stream one call of the service an HTTP/1.1 connection calls,
//!   the guards against HTTP/2's own abuses, and extended CONNECT's
//!   tunnels. Imports `http1` (the service contract, the drain, the
//!   tunnel's splice).
//! * [`listener`]: the accept loop, the connection limit, the worker
//!   threads, the TLS handshake, and which HTTP a connection speaks.
//!   Imports `http1` and `http2`.
//! * [`fencing`]: the vocabulary: the token grammar, JWT fence tokens,
//!   path patterns and resource-key templates, the per-key gate. Imports
//!   nothing of the crate.
//! * [`metrics`]: every metric, with typed labels. Imports nothing.
//! * [`auth`]: the API clients: bearer keys, client certificates,
//!   lock-name globs, the admin flag. Imports nothing.
//! * [`demo`]: a toy document store to try the gateway against.
//! * [`config`]: TOML and environment overrides, validated into plain
//!   data. Imports `fencing` (patterns, templates, key settings), `http1`
//!   (an upstream's URL parts), `http2` (its settings) and `auth`.
//! * [`store`]: the fence store (SQLite or Postgres), group commit, shared
//!   mode's admissions, and what keeps decisions right through a Postgres
//!   failover. Imports `config`.
//! * [`idempotency`]: `Idempotency-Key`: keys, fingerprints, the replay
//!   cache and the forgetting of records. Imports `store`, `config`,
//!   `fencing`.
//! * [`gateway`]: one proxied request's phases, from route match to the
//!   answer: the fence decision, the exchange with the upstream and when
//!   its key may open, header hygiene, errors and their one mapping to
//!   problem documents, refusals, the live config. Imports everything
//!   above.
//! * [`locks`]: the lock API: leases whose grants carry fences, on the
//!   store, Redis or Redlock. Imports `store`, `fencing`, `metrics`,
//!   `config`; its HTTP face imports `gateway` (problems, the live config).
//! * [`admin`]: the admin listener: health, readiness, metrics, fences,
//!   the dashboard, the OpenAPI document.
//! * [`boot`]: start-up and shutdown, the workers' service, SIGHUP
//!   reload, loading what the config names (TLS, keys), the command line,
//!   logging. The only layer that sees every other.
//!
//! The lock API's Rust client is a crate of its own, [`fencegate_client`]
//! (`crates/fencegate-client`), so that services taking locks do not build
//! the gateway. Imports go one way, from here to it: the command line
//! calls gateways with it, [`locks`] answers with its wire types (grants,
//! statuses, problem kinds), and TLS clients take its setup.

pub mod admin;
pub mod auth;
pub mod boot;
pub mod config;
pub mod demo;
pub mod fencing;
pub mod gateway;
pub mod http1;
pub mod http2;
pub mod idempotency;
pub mod listener;
pub mod locks;
pub mod metrics;
pub mod store;
