//! Starting and running the gateway: building the runtime objects from a
//! validated config (TLS, keys, pools, stores), the workers' service, the
//! SIGHUP reload, the command line, and log output. The only layer that
//! sees every other.
//!
//! # Layout
//!
//! * [`app`]: `Application::build` and `run`: start-up and shutdown.
//! * [`traffic`]: a worker's service: proxied requests in place, the
//!   reserved prefix (lock API) on the store's runtime.
//! * [`reload`]: SIGHUP: the config re-read, and what it swaps.
//! * [`tls`]: the traffic listener's certificate, key and client CA, from
//!   their files.
//! * [`cli`]: the `fencegate` command line, the operators' `lock` and
//!   `fence` commands included.
//! * [`logging`]: log output as text or JSON lines.

pub mod app;
pub mod cli;
pub mod load;
pub mod logging;
pub mod reload;
pub mod tls;
pub mod traffic;
