//! The problem documents (RFC 9457, `application/problem+json`) of the lock
//! API that a client acts on: their `type`s and the members they add.
//!
//! The gateway names its lock problems with these constants, so a client
//! matching on them matches what the gateway sends.

/// What every problem `type` of fencegate starts with; the kind follows.
pub const TYPE_PREFIX: &str = "urn:fencegate:problem:";

/// 409: another holder has the lock.
pub const LOCK_HELD: &str = "lock-held";
/// 409: the lease expired, was released, or never held the lock.
pub const NOT_HOLDER: &str = "not-holder";
/// 400: a field of the request is refused; [`FIELD`] names it.
pub const BAD_LOCK_REQUEST: &str = "bad-lock-request";

/// Member of [`LOCK_HELD`]: the time left on the holder's lease, in
/// milliseconds, when the backend said.
pub const EXPIRES_IN_MS: &str = "expires_in_ms";
/// Member of [`BAD_LOCK_REQUEST`]: the refused field (`ttl_ms`, `wait_ms`,
/// `lease`, `name`, `body`).
pub const FIELD: &str = "field";
