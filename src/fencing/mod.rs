//! The vocabulary of fencing, with no store and no I/O: the token grammar,
//! JWT fence tokens, routes' path patterns and resource-key templates, and
//! the per-key gate that orders in-flight writes.
//!
//! # Layout
//!
//! * [`token`]: the strict `X-Fence-Token` grammar.
//! * [`jwt`]: JWT fence tokens: loading keys, verifying tokens, signing
//!   grants.
//! * [`routing`]: path patterns and resource-key templates.
//! * [`gate`]: the per-key gate that orders in-flight writes, and the
//!   memory cache of durable tokens.
//!
//! Imports: nothing of the rest of the crate.

pub mod gate;
pub mod jwt;
pub mod routing;
pub mod token;
