//! JWT fence tokens: signing lock grants and verifying presented tokens.
//!
//! A JWT fence token carries the claims `sub` (the resource key it fences),
//! `fence` (the fencing number), `iat`, `exp` and `iss`, and a `kid` header
//! naming one of the keys in `[tokens]`. This module turns the `[tokens]`
//! settings into loaded keys ([`JwtKeys::load`]), signs grants
//! ([`JwtKeys::sign`]) and checks presented tokens ([`JwtKeys::verify`]).
//!
//! # Layout
//!
//! * `keys`: `[tokens]` turned into checked keys, and signing.
//! * `verify`: a presented token checked against them, reason by reason.
//!
//! # Security choices
//!
//! * **The configuration decides the algorithm, never the token.** The
//!   header is decoded only to read `kid`, `alg` (to compare it with the
//!   key's) and whether `crit` is present. The `kid` is looked up only in the
//!   configured key list: it is never used as a path or URL, and the `jku`,
//!   `x5u`, `x5c` and `jwk` headers are ignored. The
//!   [`Validation`](jsonwebtoken::Validation) for a key is built with exactly
//!   that key's one algorithm, and a header `alg` different from the key's is
//!   rejected with its own reason before any cryptography runs. There is no
//!   `none` algorithm (jsonwebtoken has none either), and signature
//!   validation is never disabled. So an HS256 key never verifies an
//!   EdDSA/ES256 token and vice versa: the classic "HMAC signed with the
//!   public key" forgery fails at the `alg` comparison, and again inside
//!   jsonwebtoken, whose validation lists only the key's algorithm and whose
//!   HMAC verifier refuses a non-HMAC key.
//! * **Only three algorithms**: EdDSA (Ed25519), ES256 (P-256) and HS256.
//!   RSA is not offered (large keys, padding pitfalls, nothing gained here).
//! * **Keys are checked when loaded**, not at the first request: every PEM
//!   file is parsed, a private key is test-signed and the signature checked
//!   with the configured public key (so a mismatched pair or a P-384 key
//!   configured as ES256 is a config error), and HS256 secrets must be at
//!   least 32 bytes (the HMAC-SHA256 output size, RFC 7518 §3.2). Every
//!   problem is reported at once, with the config key it belongs to.
//! * **Claims**: `exp` is required and checked with the configured leeway
//!   (whole seconds, at most [`MAX_LEEWAY_SECS`]); `iat` is required (an
//!   integer, not compared with the clock: the lock store's clock issued it,
//!   and the gateway's clock may differ within the leeway); `iss` must be a
//!   single string equal to the configured issuer (jsonwebtoken alone would
//!   also accept an array containing it); `fence` must be an integer ≥ 1;
//!   `sub` must be a string equal to the resource key of the request, and a
//!   token that is valid in every other respect but names another resource
//!   key is [`JwtRejection::WrongSubject`] (403) rather than 401. A token
//!   carrying an `aud` claim is rejected (we never issue one and serve no
//!   audience).
//! * **`nbf`**: `validate_nbf` is on. fencegate never puts `nbf` in a token,
//!   so this changes nothing for its own grants, but a token that does carry
//!   one is honoured (with the leeway) rather than silently ignored, and a
//!   malformed `nbf` is rejected.
//! * **`crit`**: a token with a `crit` header is rejected: RFC 7515 §4.1.11
//!   requires refusing critical extensions one does not understand, and we
//!   understand none.
//! * **Size**: tokens longer than [`MAX_TOKEN_LEN`] bytes are rejected before
//!   anything is decoded, and [`JwtKeys::sign`] refuses to produce one.
//! * **No key material in logs**: [`JwtKeys`]'s `Debug` prints kids,
//!   algorithms and which halves are present, never key bytes or secrets;
//!   load problems name files and variables, never their contents. A `kid`
//!   or `alg` echoed in a rejection is truncated and its control characters
//!   are replaced.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use keys::LoadedKey;

mod keys;
mod verify;

/// Longest token, in bytes, that [`JwtKeys::verify`] will look at (8 KiB).
/// Longer tokens are rejected before they are decoded.
pub const MAX_TOKEN_LEN: usize = 8 * 1024;

/// Shortest HS256 secret accepted, in bytes (the size of an HMAC-SHA256
/// output, as RFC 7518 §3.2 requires).
pub const MIN_HS256_SECRET_LEN: usize = 32;

/// Largest accepted `tokens.leeway_s`, in seconds. Clock skew beyond a few
/// seconds is a fault to fix, not to tolerate, and a huge leeway would make
/// `exp` meaningless.
pub const MAX_LEEWAY_SECS: u64 = 300;

/// The default `tokens.issuer`.
pub const DEFAULT_ISSUER: &str = "fencegate";

/// The default `tokens.leeway_s`.
pub const DEFAULT_LEEWAY: std::time::Duration = std::time::Duration::from_secs(5);

/// The `[tokens]` section as written (the config loader fills this).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokensSettings {
    /// The `iss` claim put in signed tokens and required in presented ones.
    /// Default [`DEFAULT_ISSUER`].
    pub issuer: String,
    /// The `kid` of the key that signs lock grants; `None` makes this
    /// gateway verify-only (grants then carry the plain decimal fence).
    pub signing_kid: Option<String>,
    /// Allowed clock skew when checking `exp` (and `nbf`), in whole seconds
    /// (any fraction is dropped). Default [`DEFAULT_LEEWAY`], at most
    /// [`MAX_LEEWAY_SECS`].
    pub leeway: std::time::Duration,
    /// `[[tokens.keys]]`, in file order (problems name them by index).
    pub keys: Vec<KeySettings>,
}

impl Default for TokensSettings {
    fn default() -> Self {
        TokensSettings {
            issuer: DEFAULT_ISSUER.to_owned(),
            signing_kid: None,
            leeway: DEFAULT_LEEWAY,
            keys: Vec::new(),
        }
    }
}

/// One `[[tokens.keys]]` entry as written.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeySettings {
    /// The key id: tokens name their key with this in the `kid` header.
    pub kid: String,
    /// `"EdDSA"` (Ed25519), `"ES256"` (P-256) or `"HS256"`; case-sensitive.
    pub algorithm: String,
    /// EdDSA/ES256: the PKCS#8 PEM private key (`BEGIN PRIVATE KEY`);
    /// needed only to sign.
    pub private_key_file: Option<std::path::PathBuf>,
    /// EdDSA/ES256: the SubjectPublicKeyInfo PEM public key (`BEGIN PUBLIC
    /// KEY`); required, every key must be able to verify.
    pub public_key_file: Option<std::path::PathBuf>,
    /// HS256 only: the name of the environment variable holding the secret
    /// (its raw bytes, at least [`MIN_HS256_SECRET_LEN`] of them).
    pub secret_env: Option<String>,
}

/// The claims of a fence token.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct FenceClaims {
    /// The resource key the token fences (the lock name).
    pub sub: String,
    /// The fencing token, ≥ 1.
    pub fence: i64,
    /// Issued at, seconds since the Unix epoch.
    pub iat: i64,
    /// Expiry (the lease's), seconds since the Unix epoch.
    pub exp: i64,
    /// The issuer, `tokens.issuer`.
    pub iss: String,
}

/// Why [`JwtKeys::sign`] could not produce a token.
#[derive(Debug, thiserror::Error)]
pub enum JwtError {
    /// `tokens.signing_kid` is not set, so this gateway cannot sign.
    #[error("no signing key is configured (tokens.signing_kid)")]
    NoSigningKey,
    /// The claims asked for are not a valid fence token.
    #[error("invalid claims: {0}")]
    InvalidClaims(&'static str),
    /// The token would be longer than [`MAX_TOKEN_LEN`], so no gateway would
    /// accept it (the resource key is too long).
    #[error("the token would be {len} bytes, more than the {max} accepted")]
    TooLong {
        /// The length the token would have.
        len: usize,
        /// [`MAX_TOKEN_LEN`].
        max: usize,
    },
    /// jsonwebtoken failed to sign (should not happen: private keys are
    /// test-signed when loaded, and HMAC takes any secret).
    #[error("signing failed: {0}")]
    Signing(#[source] jsonwebtoken::errors::Error),
}

/// Why a presented token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtRejection {
    /// → HTTP 401: the string names which check failed, for the problem
    /// detail. One of:
    /// `"token too long"`, `"malformed token"`, `"no alg header"`,
    /// `"no kid header"`, `"unknown kid '<kid>'"`,
    /// `"unsupported critical header"`,
    /// `"algorithm <alg> does not match key '<kid>' (<key alg>)"`,
    /// `"algorithm not allowed for this key"`, `"bad signature"`,
    /// `"expired"`, `"not yet valid"`, `"wrong issuer"`,
    /// `"unexpected audience"`, `"missing claim '<name>'"`,
    /// `"claim '<name>' must be an integer"`,
    /// `"claim '<name>' must be a string"`,
    /// `"claim '<name>' is not a valid time"`,
    /// `"fence must be a positive integer"`, `"key cannot verify"`.
    #[error("{0}")]
    Invalid(String),
    /// → HTTP 403: a valid token, but for another resource key.
    #[error("the token was issued for '{presented}', not '{expected}'")]
    WrongSubject {
        /// The resource key of the request.
        expected: String,
        /// The token's `sub`.
        presented: String,
    },
}

struct Inner {
    issuer: String,
    leeway_secs: u64,
    keys: HashMap<String, LoadedKey>,
    /// The signing kid, present only if that key has a private half.
    signing_kid: Option<String>,
}

/// The loaded `[tokens]` keys: signs grants and verifies presented tokens.
///
/// Cheap to clone (one `Arc`). `Debug` shows kids, algorithms and which key
/// halves are loaded, never key material.
#[derive(Clone)]
pub struct JwtKeys {
    inner: Arc<Inner>,
}

impl fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Keys<'a>(&'a HashMap<String, LoadedKey>);
        impl fmt::Debug for Keys<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let mut kids: Vec<&String> = self.0.keys().collect();
                kids.sort();
                let mut list = f.debug_list();
                for kid in kids {
                    let key = &self.0[kid];
                    list.entry(&format_args!(
                        "{kid} ({}, {})",
                        key.alg.name(),
                        if key.encoding.is_some() {
                            "sign+verify"
                        } else {
                            "verify"
                        }
                    ));
                }
                list.finish()
            }
        }
        f.debug_struct("JwtKeys")
            .field("issuer", &self.inner.issuer)
            .field("leeway_secs", &self.inner.leeway_secs)
            .field("signing_kid", &self.inner.signing_kid)
            .field("keys", &Keys(&self.inner.keys))
            .finish()
    }
}

impl JwtKeys {
    /// Whether this gateway signs grants: `tokens.signing_kid` names a key
    /// with a private key (or an HS256 secret).
    #[must_use]
    pub fn can_sign(&self) -> bool {
        self.inner.signing_kid.is_some()
    }

    /// The configured issuer (`iss` of signed tokens, required in presented
    /// ones).
    #[must_use]
    pub fn issuer(&self) -> &str {
        &self.inner.issuer
    }

    /// The kid that signs grants, if any.
    #[must_use]
    pub fn signing_kid(&self) -> Option<&str> {
        self.inner.signing_kid.as_deref()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::PathBuf;

    // The key fixtures below are shared with the tests in keys.rs and
    // verify.rs.

    pub(crate) const SECRET: &str = "0123456789abcdef0123456789abcdef-test-only";

    pub(super) fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/")).join(name)
    }

    pub(super) fn read_fixture(name: &str) -> Vec<u8> {
        std::fs::read(fixture(name)).unwrap()
    }

    pub(crate) fn env(name: &str) -> Option<String> {
        match name {
            "HS_SECRET" => Some(SECRET.to_owned()),
            "SHORT_SECRET" => Some("too short".to_owned()),
            _ => None,
        }
    }

    pub(super) fn ed_key(kid: &str, private: Option<&str>, public: &str) -> KeySettings {
        KeySettings {
            kid: kid.to_owned(),
            algorithm: "EdDSA".to_owned(),
            private_key_file: private.map(fixture),
            public_key_file: Some(fixture(public)),
            secret_env: None,
        }
    }

    pub(super) fn es_key(kid: &str, private: Option<&str>, public: &str) -> KeySettings {
        KeySettings {
            algorithm: "ES256".to_owned(),
            ..ed_key(kid, private, public)
        }
    }

    pub(crate) fn hs_key(kid: &str, var: &str) -> KeySettings {
        KeySettings {
            kid: kid.to_owned(),
            algorithm: "HS256".to_owned(),
            secret_env: Some(var.to_owned()),
            ..KeySettings::default()
        }
    }

    /// k1: EdDSA, e1: ES256, h1: HS256, all able to sign.
    pub(super) fn all_keys() -> Vec<KeySettings> {
        vec![
            ed_key("k1", Some("ed25519.pem"), "ed25519.pub.pem"),
            es_key("e1", Some("p256.pem"), "p256.pub.pem"),
            hs_key("h1", "HS_SECRET"),
        ]
    }

    pub(super) fn keys_signing_with(kid: &str) -> JwtKeys {
        let settings = TokensSettings {
            signing_kid: Some(kid.to_owned()),
            keys: all_keys(),
            ..TokensSettings::default()
        };
        JwtKeys::load(&settings, &env).unwrap()
    }

    pub(super) fn keys() -> JwtKeys {
        keys_signing_with("k1")
    }

    #[test]
    fn debug_shows_no_key_material() {
        let keys = keys();
        let text = format!("{keys:?}");
        assert!(text.contains("k1 (EdDSA, sign+verify)"), "{text}");
        assert!(text.contains("h1 (HS256, sign+verify)"), "{text}");
        assert!(!text.contains(SECRET), "{text}");
        assert!(!text.contains("0123456789abcdef"), "{text}");
        for file in ["ed25519.pem", "p256.pem", "ed25519.pub.pem"] {
            let pem = String::from_utf8(read_fixture(file)).unwrap();
            let body = pem.lines().nth(1).unwrap();
            assert!(!text.contains(&body[..20]), "{text}");
        }
        assert!(
            !text.contains('[') || !text.contains("SecretOrDer"),
            "{text}"
        );
    }
}
