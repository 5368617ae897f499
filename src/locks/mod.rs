//! The lock API: leases whose grants carry fencing tokens.

pub mod backend;
pub mod notify;
pub mod store;
