//! Integration tests: real gateways (in-process and as processes), real
//! upstreams on port 0, real SQLite files and Postgres databases.

#![recursion_limit = "256"]

mod answer_table;
mod chaos;
mod client;
mod config_errors;
mod dashboard;
mod deploy;
mod differential;
mod docs;
mod durability;
mod exchange_lifetime;
mod failover_pg;
mod failover_redis;
mod group_commit;
mod handover;
mod headers;
mod http2;
mod http_server;
mod idempotency;
mod jwt_tokens;
mod key_integrity;
mod lock_cli;
mod lock_delay;
mod locks_api;
mod locks_redis;
mod openapi;
mod operating;
mod ordering;
mod pg_outage;
mod raw_upstream_selftest;
mod resets;
mod restarts;
mod server_limits;
mod shared_mode;
mod support;
mod tls;
mod trust;
mod unknown_outcomes;
mod upgrades;
mod upstream_client;
mod upstream_selftest;
