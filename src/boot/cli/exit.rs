//! Exit codes of the `lock` and `fence` commands.
//!
//! They are taken from `sysexits.h` where one fits, so that a supervisor or
//! a script can tell "try again later" (75, 69) from "this will not work as
//! asked" (64, 77) and from "the job lost its lock" (76) without reading
//! messages. docs/reference/cli.md lists them with what each means for a
//! supervisor.

use fencegate_client::Error;

/// Refused by the gateway for another reason: 404 (no fence recorded for
/// the key, the lock API turned off, an admin endpoint this gateway does
/// not have), 405, 409 `fence-exhausted` and the like.
pub const REFUSED: u8 = 1;
/// EX_USAGE: the call cannot work as asked: an unusable URL or CA file, or
/// the gateway refused the request as malformed (400: a ttl or wait out of
/// bounds, a name too long).
pub const USAGE: u8 = 64;
/// EX_UNAVAILABLE: the gateway cannot be reached (refused, timed out, TLS
/// failed), or answered that it cannot serve now (503 and other 5xx).
pub const UNREACHABLE: u8 = 69;
/// EX_SOFTWARE: an answer that makes no sense to this client.
pub const SOFTWARE: u8 = 70;
/// EX_OSERR: `lock run` could not set up signal handling.
pub const OS_ERROR: u8 = 71;
/// EX_TEMPFAIL: the lock is held by another holder (after any wait).
pub const HELD: u8 = 75;
/// The lease was lost (`lock run`), or the lease given is not the holder's
/// (`lock renew`, `lock release`: it expired, was released or broken).
pub const LOST: u8 = 76;
/// EX_NOPERM: 401 or 403.
pub const DENIED: u8 = 77;
/// `lock run`: CMD exists but cannot be executed (as a shell says).
pub const CANNOT_EXECUTE: u8 = 126;
/// `lock run`: CMD was not found (as a shell says).
pub const COMMAND_NOT_FOUND: u8 = 127;

/// The exit code for a failed call.
pub fn for_error(e: &Error) -> u8 {
    match e {
        Error::Held { .. } => HELD,
        Error::NotHolder => LOST,
        Error::Denied { .. } => DENIED,
        Error::BadRequest { .. } | Error::InvalidBaseUrl(_) | Error::Setup(_) => USAGE,
        e if e.is_transient() => UNREACHABLE,
        Error::Unexpected { status, .. } if (400..500).contains(status) => REFUSED,
        _ => SOFTWARE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_codes() {
        let unexpected = |status| Error::Unexpected {
            status,
            body: String::new(),
        };
        for (e, code) in [
            (Error::Held { expires_in: None }, HELD),
            (Error::NotHolder, LOST),
            (
                Error::Denied {
                    status: 403,
                    detail: String::new(),
                },
                DENIED,
            ),
            (
                Error::BadRequest {
                    field: None,
                    detail: String::new(),
                },
                USAGE,
            ),
            (Error::Setup(String::new()), USAGE),
            (Error::Http("refused".into()), UNREACHABLE),
            (Error::Unavailable { retry_after: None }, UNREACHABLE),
            (unexpected(502), UNREACHABLE),
            (unexpected(429), UNREACHABLE),
            (unexpected(404), REFUSED),
            (unexpected(409), REFUSED),
            (unexpected(302), SOFTWARE),
            (unexpected(201), SOFTWARE),
        ] {
            assert_eq!(for_error(&e), code, "{e:?}");
        }
    }
}
