//! JWT fence tokens: signing lock grants and verifying presented tokens.
//!
//! A JWT fence token carries the claims `sub` (the resource key it fences),
//! `fence` (the fencing number), `iat`, `exp` and `iss`, and a `kid` header
//! naming one of the keys in `[tokens]`. This module turns the `[tokens]`
//! settings into loaded keys ([`JwtKeys::load`]), signs grants
//! ([`JwtKeys::sign`]) and checks presented tokens ([`JwtKeys::verify`]).
//!
//! # Security choices
//!
//! * **The configuration decides the algorithm, never the token.** The
//!   header is decoded only to read `kid` (and to compare `alg`). The `kid` is
//!   looked up only in the configured key list: it is never used as a path or
//!   URL, and the `jku`, `x5u`, `x5c` and `jwk` headers are ignored. The
//!   [`Validation`] for a key is built with exactly that key's one algorithm,
//!   and a header `alg` different from the key's is rejected with its own
//!   reason before any cryptography runs. There is no `none` algorithm
//!   (jsonwebtoken has none either), and signature validation is never
//!   disabled. So an HS256 key never verifies an EdDSA/ES256 token and vice
//!   versa: the classic "HMAC signed with the public key" forgery fails at
//!   the `alg` comparison, and again inside jsonwebtoken, whose validation
//!   lists only the key's algorithm and whose HMAC verifier refuses a
//!   non-HMAC key.
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
//!   echoed in a rejection is truncated and stripped of control characters.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde_json::Value;

/// Longest token, in bytes, that [`JwtKeys::verify`] will look at (8 KiB).
/// Longer tokens are rejected before they are decoded.
pub const MAX_TOKEN_LEN: usize = 8 * 1024;

/// Shortest HS256 secret accepted, in bytes (the size of an HMAC-SHA256
/// output, as RFC 7518 §3.2 requires).
pub const MIN_HS256_SECRET_LEN: usize = 32;

/// Largest accepted `tokens.leeway`, in seconds. Clock skew beyond a few
/// seconds is a fault to fix, not to tolerate, and a huge leeway would make
/// `exp` meaningless.
pub const MAX_LEEWAY_SECS: u64 = 300;

/// The default `tokens.issuer`.
pub const DEFAULT_ISSUER: &str = "fencegate";

/// The default `tokens.leeway`.
pub const DEFAULT_LEEWAY: std::time::Duration = std::time::Duration::from_secs(5);

/// Longest `kid` (in characters) echoed back in a rejection reason.
const MAX_SHOWN_KID: usize = 64;

/// The message test-signed when a key pair is loaded.
const PROBE_MESSAGE: &[u8] = b"fencegate key check";

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
    /// jsonwebtoken failed to sign (should not happen: keys are test-signed
    /// when loaded).
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

fn invalid(reason: impl Into<String>) -> JwtRejection {
    JwtRejection::Invalid(reason.into())
}

/// The algorithms a key may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyAlg {
    EdDsa,
    Es256,
    Hs256,
}

impl KeyAlg {
    fn parse(name: &str) -> Option<KeyAlg> {
        match name {
            "EdDSA" => Some(KeyAlg::EdDsa),
            "ES256" => Some(KeyAlg::Es256),
            "HS256" => Some(KeyAlg::Hs256),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            KeyAlg::EdDsa => "EdDSA",
            KeyAlg::Es256 => "ES256",
            KeyAlg::Hs256 => "HS256",
        }
    }

    fn jwt(self) -> Algorithm {
        match self {
            KeyAlg::EdDsa => Algorithm::EdDSA,
            KeyAlg::Es256 => Algorithm::ES256,
            KeyAlg::Hs256 => Algorithm::HS256,
        }
    }
}

/// One loaded key.
struct LoadedKey {
    alg: KeyAlg,
    /// Always present: every configured key can verify.
    decoding: DecodingKey,
    /// Present for HS256 and for asymmetric keys with a private key file.
    encoding: Option<EncodingKey>,
    /// Built once: exactly this key's algorithm, issuer, leeway.
    validation: Validation,
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
    /// Loads every key; on failure returns every problem as (config key,
    /// why), e.g.
    /// `("tokens.keys[1].public_key_file", "cannot read keys/x.pem: No such file or directory")`,
    /// `("tokens.signing_kid", "names no key in tokens.keys")`,
    /// `("tokens.keys[0].algorithm", "'RS256' is not supported; use EdDSA, ES256 or HS256")`,
    /// `("tokens.keys[2].secret_env", "FENCEGATE_HS256_SECRET is not set")`.
    /// Also reported: an empty issuer, a leeway above [`MAX_LEEWAY_SECS`]
    /// (as `tokens.leeway_s`), no keys at all, empty or duplicate kids, PEM
    /// files on an HS256 key, `secret_env` on an EdDSA/ES256 key, an
    /// EdDSA/ES256 key without `public_key_file`, PEM files that are not a
    /// key of the right type (with a hint for SEC1 `EC PRIVATE KEY` files),
    /// a private key that does not match its public key, a secret shorter
    /// than [`MIN_HS256_SECRET_LEN`] bytes, and a signing key without a
    /// private half. Relative paths are used as given (relative to the
    /// working directory); the config loader resolves them if it wants to.
    ///
    /// `env` looks up environment variables (tests pass a closure; the
    /// program passes `|name| std::env::var(name).ok()`).
    ///
    /// # Errors
    ///
    /// Every problem found, in config order, as (config key, why). Nothing
    /// in them is key material.
    pub fn load(
        settings: &TokensSettings,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<JwtKeys, Vec<(String, String)>> {
        let mut problems: Vec<(String, String)> = Vec::new();
        let mut problem = |key: String, why: String| problems.push((key, why));

        if settings.issuer.is_empty() {
            problem("tokens.issuer".into(), "must not be empty".into());
        }
        let leeway_secs = settings.leeway.as_secs();
        if leeway_secs > MAX_LEEWAY_SECS {
            problem(
                "tokens.leeway_s".into(),
                format!("{leeway_secs} s is too long; at most {MAX_LEEWAY_SECS} s is allowed"),
            );
        }
        if settings.keys.is_empty() {
            problem(
                "tokens.keys".into(),
                "no keys are configured; add a [[tokens.keys]] entry".into(),
            );
        }

        let mut keys: HashMap<String, LoadedKey> = HashMap::new();
        // kid → index of its first entry, over every entry as written.
        let mut first_index: HashMap<&str, usize> = HashMap::new();
        // kids whose entries had problems (so signing_kid is not blamed too).
        let mut broken: HashSet<&str> = HashSet::new();

        for (i, key) in settings.keys.iter().enumerate() {
            let prefix = format!("tokens.keys[{i}]");
            let mut key_problems: Vec<(String, String)> = Vec::new();
            if key.kid.is_empty() {
                key_problems.push((format!("{prefix}.kid"), "must not be empty".into()));
            } else if let Some(first) = first_index.get(key.kid.as_str()) {
                key_problems.push((
                    format!("{prefix}.kid"),
                    format!(
                        "'{}' is already the kid of tokens.keys[{first}]; kids must be unique",
                        key.kid
                    ),
                ));
            } else {
                first_index.insert(&key.kid, i);
            }

            let loaded = match load_key(key, &prefix, leeway_secs, &settings.issuer, env) {
                Ok(loaded) => Some(loaded),
                Err(mut more) => {
                    key_problems.append(&mut more);
                    None
                }
            };
            if key_problems.is_empty() {
                if let Some(loaded) = loaded {
                    keys.insert(key.kid.clone(), loaded);
                }
            } else {
                broken.insert(&key.kid);
                for (k, why) in key_problems {
                    problem(k, why);
                }
            }
        }

        let mut signing_kid = None;
        if let Some(kid) = &settings.signing_kid {
            if !first_index.contains_key(kid.as_str()) {
                problem(
                    "tokens.signing_kid".into(),
                    "names no key in tokens.keys".into(),
                );
            } else if broken.contains(kid.as_str()) {
                // Its own problems are reported above.
            } else if let Some(key) = keys.get(kid) {
                if key.encoding.is_some() {
                    signing_kid = Some(kid.clone());
                } else {
                    problem(
                        "tokens.signing_kid".into(),
                        format!(
                            "key '{kid}' has no private_key_file; the signing key needs its private key"
                        ),
                    );
                }
            }
        }

        if !problems.is_empty() {
            return Err(problems);
        }
        Ok(JwtKeys {
            inner: Arc::new(Inner {
                issuer: settings.issuer.clone(),
                leeway_secs,
                keys,
                signing_kid,
            }),
        })
    }

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

    /// Signs claims {sub, fence, iat, exp, iss} with the signing key, header
    /// `alg` from that key and `kid` = `signing_kid`.
    ///
    /// Refuses (with [`JwtError::InvalidClaims`]) an empty `sub`, a `fence`
    /// below 1, a negative `iat` or an `exp` before `iat`, and (with
    /// [`JwtError::TooLong`]) a token no gateway would accept.
    ///
    /// # Errors
    ///
    /// [`JwtError::NoSigningKey`] when this gateway cannot sign (check
    /// [`JwtKeys::can_sign`] first), the two above, and
    /// [`JwtError::Signing`] should the crypto backend fail.
    pub fn sign(&self, sub: &str, fence: i64, iat: i64, exp: i64) -> Result<String, JwtError> {
        let kid = self
            .inner
            .signing_kid
            .as_ref()
            .ok_or(JwtError::NoSigningKey)?;
        let key = &self.inner.keys[kid];
        let encoding = key.encoding.as_ref().ok_or(JwtError::NoSigningKey)?;
        if sub.is_empty() {
            return Err(JwtError::InvalidClaims("sub must not be empty"));
        }
        if fence < 1 {
            return Err(JwtError::InvalidClaims("fence must be a positive integer"));
        }
        if iat < 0 {
            return Err(JwtError::InvalidClaims("iat must not be negative"));
        }
        if exp < iat {
            return Err(JwtError::InvalidClaims("exp must not be before iat"));
        }
        let mut header = Header::new(key.alg.jwt());
        header.kid = Some(kid.clone());
        let claims = FenceClaims {
            sub: sub.to_owned(),
            fence,
            iat,
            exp,
            iss: self.inner.issuer.clone(),
        };
        let token = jsonwebtoken::encode(&header, &claims, encoding).map_err(JwtError::Signing)?;
        if token.len() > MAX_TOKEN_LEN {
            return Err(JwtError::TooLong {
                len: token.len(),
                max: MAX_TOKEN_LEN,
            });
        }
        Ok(token)
    }

    /// Verifies a token presented for resource key `resource_key`.
    ///
    /// Checks, in order: length; shape; header (`crit` absent, `alg` and
    /// `kid` present, `kid` configured, `alg` equal to the key's); then, in
    /// jsonwebtoken with only the key's algorithm allowed: signature,
    /// presence of `exp`, `iss`, `sub`, expiry with leeway, `nbf` if
    /// present, issuer, no `aud`; then `iat`, `fence`, `iss` and `sub` types
    /// and values. Every failure is [`JwtRejection::Invalid`], except a
    /// token valid in every respect whose `sub` is not `resource_key`:
    /// [`JwtRejection::WrongSubject`].
    ///
    /// # Errors
    ///
    /// [`JwtRejection::Invalid`] (401) with the failed check's reason, or
    /// [`JwtRejection::WrongSubject`] (403).
    pub fn verify(&self, token: &str, resource_key: &str) -> Result<FenceClaims, JwtRejection> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(invalid("token too long"));
        }
        let header = read_header(token)?;
        let Some(header_alg) = header.alg else {
            return Err(invalid("no alg header"));
        };
        let Some(kid) = header.kid else {
            return Err(invalid("no kid header"));
        };
        let Some(key) = self.inner.keys.get(&kid) else {
            return Err(invalid(format!("unknown kid '{}'", shown(&kid))));
        };
        if header.crit {
            return Err(invalid("unsupported critical header"));
        }
        if header_alg != key.alg.name() {
            return Err(invalid(format!(
                "algorithm {} does not match key '{}' ({})",
                shown(&header_alg),
                shown(&kid),
                key.alg.name()
            )));
        }
        let claims = check_signed(token, key)?;
        self.check_claims(claims, resource_key)
    }

    /// The claim checks jsonwebtoken does not do.
    fn check_claims(&self, claims: Value, resource_key: &str) -> Result<FenceClaims, JwtRejection> {
        let Value::Object(map) = claims else {
            return Err(invalid("malformed token"));
        };
        let integer = |name: &str| -> Result<i64, JwtRejection> {
            match map.get(name) {
                None | Some(Value::Null) => Err(invalid(format!("missing claim '{name}'"))),
                Some(v) => v
                    .as_i64()
                    .ok_or_else(|| invalid(format!("claim '{name}' must be an integer"))),
            }
        };
        let string = |name: &str| -> Result<&str, JwtRejection> {
            match map.get(name) {
                None | Some(Value::Null) => Err(invalid(format!("missing claim '{name}'"))),
                Some(v) => v
                    .as_str()
                    .ok_or_else(|| invalid(format!("claim '{name}' must be a string"))),
            }
        };
        let exp = integer("exp")?;
        let iat = integer("iat")?;
        let fence = match map.get("fence") {
            None | Some(Value::Null) => return Err(invalid("missing claim 'fence'")),
            Some(v) => match v.as_i64() {
                Some(f) if f >= 1 => f,
                _ => return Err(invalid("fence must be a positive integer")),
            },
        };
        // jsonwebtoken accepts an `iss` array containing the issuer; we
        // accept exactly the one string.
        let iss = match map.get("iss") {
            Some(Value::String(iss)) if *iss == self.inner.issuer => iss.clone(),
            None | Some(Value::Null) => return Err(invalid("missing claim 'iss'")),
            Some(_) => return Err(invalid("wrong issuer")),
        };
        let sub = string("sub")?;
        if sub != resource_key {
            return Err(JwtRejection::WrongSubject {
                expected: resource_key.to_owned(),
                presented: sub.to_owned(),
            });
        }
        Ok(FenceClaims {
            sub: sub.to_owned(),
            fence,
            iat,
            exp,
            iss,
        })
    }
}

/// What [`read_header`] extracts from a token's header.
struct HeaderFields {
    alg: Option<String>,
    kid: Option<String>,
    crit: bool,
}

/// Reads `alg`, `kid` and whether `crit` is present, from a token of the
/// shape `header.payload.signature`. Nothing else in the header is looked at
/// (in particular not `jku`, `x5u`, `x5c` or `jwk`).
///
/// jsonwebtoken's own `decode_header` would refuse `"alg": "none"` as a JSON
/// error; reading the header here gives every case its own reason.
fn read_header(token: &str) -> Result<HeaderFields, JwtRejection> {
    let malformed = || invalid("malformed token");
    let mut parts = token.split('.');
    let (Some(header), Some(payload), Some(_signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(malformed());
    };
    if header.is_empty() || payload.is_empty() {
        return Err(malformed());
    }
    let base64url = |c: u8| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'.';
    if !token.bytes().all(base64url) {
        return Err(malformed());
    }
    let bytes = b64url_decode(header).ok_or_else(malformed)?;
    let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(&bytes) else {
        return Err(malformed());
    };
    let text = |name: &str| -> Result<Option<String>, JwtRejection> {
        match fields.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(malformed()),
        }
    };
    Ok(HeaderFields {
        alg: text("alg")?,
        kid: text("kid")?,
        crit: fields.contains_key("crit"),
    })
}

/// Signature and registered-claim checks, by jsonwebtoken, with the key's
/// own [`Validation`] (its one algorithm). Returns the claims as JSON.
fn check_signed(token: &str, key: &LoadedKey) -> Result<Value, JwtRejection> {
    match jsonwebtoken::decode::<Value>(token, &key.decoding, &key.validation) {
        Ok(data) => Ok(data.claims),
        Err(e) => Err(invalid(match e.kind() {
            ErrorKind::InvalidSignature => "bad signature".to_owned(),
            ErrorKind::ExpiredSignature => "expired".to_owned(),
            ErrorKind::ImmatureSignature => "not yet valid".to_owned(),
            ErrorKind::InvalidIssuer => "wrong issuer".to_owned(),
            ErrorKind::InvalidAudience => "unexpected audience".to_owned(),
            // jsonwebtoken also says "missing" when the claim is there with
            // the wrong type; the signature has been checked by then, so the
            // payload can be looked at to say which.
            ErrorKind::MissingRequiredClaim(c) => match claim_present(token, c) {
                false => format!("missing claim '{}'", shown(c)),
                true if c == "exp" || c == "nbf" => {
                    format!("claim '{}' is not a valid time", shown(c))
                }
                true => format!("claim '{}' must be a string", shown(c)),
            },
            ErrorKind::InvalidClaimFormat(c) => format!("claim '{}' is not a valid time", shown(c)),
            ErrorKind::InvalidAlgorithm | ErrorKind::MissingAlgorithm => {
                "algorithm not allowed for this key".to_owned()
            }
            ErrorKind::InvalidToken
            | ErrorKind::Base64(_)
            | ErrorKind::Json(_)
            | ErrorKind::Utf8(_) => "malformed token".to_owned(),
            // Key errors cannot happen with keys checked at load; anything
            // else is refused all the same.
            _ => "key cannot verify".to_owned(),
        })),
    }
}

/// Whether the token's payload has claim `name` with a non-null value. Used
/// only to word a rejection, after jsonwebtoken has checked the signature.
fn claim_present(token: &str, name: &str) -> bool {
    token
        .split('.')
        .nth(1)
        .and_then(b64url_decode)
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .is_some_and(|claims| claims.get(name).is_some_and(|v| !v.is_null()))
}

/// Loads one key entry, or returns its problems.
fn load_key(
    key: &KeySettings,
    prefix: &str,
    leeway_secs: u64,
    issuer: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<LoadedKey, Vec<(String, String)>> {
    let mut problems = Vec::new();
    let Some(alg) = KeyAlg::parse(&key.algorithm) else {
        let hint = match KeyAlg::parse_ignoring_case(&key.algorithm) {
            Some(alg) => format!(" (names are case-sensitive: did you mean {}?)", alg.name()),
            None => String::new(),
        };
        problems.push((
            format!("{prefix}.algorithm"),
            format!(
                "'{}' is not supported; use EdDSA, ES256 or HS256{hint}",
                key.algorithm
            ),
        ));
        return Err(problems);
    };

    let (decoding, encoding) = match alg {
        KeyAlg::Hs256 => {
            for (field, path) in [
                ("private_key_file", &key.private_key_file),
                ("public_key_file", &key.public_key_file),
            ] {
                if path.is_some() {
                    problems.push((
                        format!("{prefix}.{field}"),
                        "HS256 keys take their secret from secret_env, not from a PEM file"
                            .to_owned(),
                    ));
                }
            }
            let secret = match key.secret_env.as_deref() {
                None | Some("") => {
                    problems.push((
                        format!("{prefix}.secret_env"),
                        "HS256 keys need secret_env, the environment variable holding the secret"
                            .to_owned(),
                    ));
                    None
                }
                Some(var) => match env(var) {
                    None => {
                        problems
                            .push((format!("{prefix}.secret_env"), format!("{var} is not set")));
                        None
                    }
                    Some(value) if value.len() < MIN_HS256_SECRET_LEN => {
                        problems.push((
                            format!("{prefix}.secret_env"),
                            format!(
                                "{var} holds {} bytes; HS256 needs a secret of at least {MIN_HS256_SECRET_LEN} bytes",
                                value.len()
                            ),
                        ));
                        None
                    }
                    Some(value) => Some(value),
                },
            };
            match secret {
                Some(secret) if problems.is_empty() => (
                    DecodingKey::from_secret(secret.as_bytes()),
                    Some(EncodingKey::from_secret(secret.as_bytes())),
                ),
                _ => return Err(problems),
            }
        }
        KeyAlg::EdDsa | KeyAlg::Es256 => {
            if key.secret_env.is_some() {
                problems.push((
                    format!("{prefix}.secret_env"),
                    format!(
                        "only HS256 keys use secret_env; {} keys use private_key_file and public_key_file",
                        alg.name()
                    ),
                ));
            }
            let decoding = match &key.public_key_file {
                None => {
                    problems.push((
                        format!("{prefix}.public_key_file"),
                        format!(
                            "{} keys need a public key file (PEM) to verify tokens",
                            alg.name()
                        ),
                    ));
                    None
                }
                Some(path) => match load_public(alg, path) {
                    Ok(k) => Some(k),
                    Err(why) => {
                        problems.push((format!("{prefix}.public_key_file"), why));
                        None
                    }
                },
            };
            let encoding = match &key.private_key_file {
                None => None,
                Some(path) => match load_private(alg, path) {
                    Ok(k) => Some(k),
                    Err(why) => {
                        problems.push((format!("{prefix}.private_key_file"), why));
                        None
                    }
                },
            };
            if let (Some(dec), Some(enc)) = (&decoding, &encoding) {
                if !pair_matches(alg, enc, dec) {
                    problems.push((
                        format!("{prefix}.private_key_file"),
                        "does not match public_key_file: it is not the private half of that public key"
                            .to_owned(),
                    ));
                }
            }
            match decoding {
                Some(decoding) if problems.is_empty() => (decoding, encoding),
                _ => return Err(problems),
            }
        }
    };

    let mut validation = Validation::new(alg.jwt());
    validation.leeway = leeway_secs;
    validation.reject_tokens_expiring_in_less_than = 0;
    validation.validate_exp = true;
    validation.validate_nbf = true;
    validation.validate_aud = true; // no audience configured: any `aud` is refused
    validation.set_required_spec_claims(&["exp", "iss", "sub"]);
    validation.set_issuer(&[issuer]);
    Ok(LoadedKey {
        alg,
        decoding,
        encoding,
        validation,
    })
}

impl KeyAlg {
    fn parse_ignoring_case(name: &str) -> Option<KeyAlg> {
        [KeyAlg::EdDsa, KeyAlg::Es256, KeyAlg::Hs256]
            .into_iter()
            .find(|alg| alg.name().eq_ignore_ascii_case(name))
    }
}

/// Reads a file for a key, with the error in the problem's words.
fn read_pem(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {}", path.display(), io_reason(&e)))
}

/// An io::Error's message without the " (os error N)" suffix.
fn io_reason(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error ") {
        Some(at) => text[..at].to_owned(),
        None => text,
    }
}

fn load_public(alg: KeyAlg, path: &Path) -> Result<DecodingKey, String> {
    let pem = read_pem(path)?;
    let (key, what) = match alg {
        KeyAlg::EdDsa => (DecodingKey::from_ed_pem(&pem), "an Ed25519 public key"),
        KeyAlg::Es256 => (DecodingKey::from_ec_pem(&pem), "a P-256 public key"),
        KeyAlg::Hs256 => unreachable!("HS256 keys have no PEM files"),
    };
    let not_it = || {
        format!(
            "{} is not {what} in PEM form ('BEGIN PUBLIC KEY'; make it with `openssl pkey -in PRIVATE.pem -pubout`)",
            path.display()
        )
    };
    let key = key.map_err(|_| not_it())?;
    // jsonwebtoken checks the key only when it first verifies (and its Ed25519
    // verifier slices the first 32 bytes without a length check): check now.
    if alg == KeyAlg::EdDsa && key.as_bytes().len() != 32 {
        return Err(not_it());
    }
    // A verification of a dummy signature fails on the key itself (Err)
    // or on the signature (Ok(false)); only the latter means a usable key.
    match jsonwebtoken::crypto::verify("AAAA", PROBE_MESSAGE, &key, alg.jwt()) {
        Ok(_) => Ok(key),
        Err(_) => Err(not_it()),
    }
}

fn load_private(alg: KeyAlg, path: &Path) -> Result<EncodingKey, String> {
    let pem = read_pem(path)?;
    let (key, what) = match alg {
        KeyAlg::EdDsa => (EncodingKey::from_ed_pem(&pem), "an Ed25519 private key"),
        KeyAlg::Es256 => (EncodingKey::from_ec_pem(&pem), "a P-256 private key"),
        KeyAlg::Hs256 => unreachable!("HS256 keys have no PEM files"),
    };
    let not_it = || {
        let sec1 = String::from_utf8_lossy(&pem).contains("-----BEGIN EC PRIVATE KEY-----");
        if sec1 {
            format!(
                "{} is a SEC1 'EC PRIVATE KEY'; convert it to PKCS#8 with `openssl pkcs8 -topk8 -nocrypt -in {} -out NEW.pem`",
                path.display(),
                path.display()
            )
        } else {
            format!(
                "{} is not {what} in PKCS#8 PEM form ('BEGIN PRIVATE KEY', unencrypted)",
                path.display()
            )
        }
    };
    let key = key.map_err(|_| not_it())?;
    // Parsing the PEM does not parse the key (nor check its curve): sign once.
    match jsonwebtoken::crypto::sign(PROBE_MESSAGE, &key, alg.jwt()) {
        Ok(_) => Ok(key),
        Err(_) => Err(not_it()),
    }
}

/// Whether `enc` is the private half of `dec`: sign a message and verify it.
fn pair_matches(alg: KeyAlg, enc: &EncodingKey, dec: &DecodingKey) -> bool {
    jsonwebtoken::crypto::sign(PROBE_MESSAGE, enc, alg.jwt())
        .and_then(|sig| jsonwebtoken::crypto::verify(&sig, PROBE_MESSAGE, dec, alg.jwt()))
        .unwrap_or(false)
}

/// A client-supplied string made safe to echo: at most [`MAX_SHOWN_KID`]
/// characters, control characters replaced.
fn shown(s: &str) -> String {
    let mut out: String = s
        .chars()
        .take(MAX_SHOWN_KID)
        .map(|c| if c.is_control() { '\u{fffd}' } else { c })
        .collect();
    if s.chars().count() > MAX_SHOWN_KID {
        out.push('…');
    }
    out
}

/// Strict unpadded base64url (RFC 4648 §5), as JWS uses: no padding, no
/// whitespace, no stray bits in the last character.
fn b64url_decode(text: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        match c {
            b'A'..=b'Z' => Some(u32::from(c - b'A')),
            b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
            b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
            b'-' => Some(62),
            b'_' => Some(63),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    if bytes.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc: u32 = 0;
        for &c in chunk {
            acc = (acc << 6) | value(c)?;
        }
        match chunk.len() {
            4 => out.extend_from_slice(&[(acc >> 16) as u8, (acc >> 8) as u8, acc as u8]),
            3 => {
                if acc & 0b11 != 0 {
                    return None;
                }
                out.extend_from_slice(&[(acc >> 10) as u8, (acc >> 2) as u8]);
            }
            2 => {
                if acc & 0b1111 != 0 {
                    return None;
                }
                out.push((acc >> 4) as u8);
            }
            _ => return None,
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::PathBuf;
    use std::time::Duration;

    const SECRET: &str = "0123456789abcdef0123456789abcdef-test-only";

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/")).join(name)
    }

    fn read_fixture(name: &str) -> Vec<u8> {
        std::fs::read(fixture(name)).unwrap()
    }

    fn env(name: &str) -> Option<String> {
        match name {
            "HS_SECRET" => Some(SECRET.to_owned()),
            "SHORT_SECRET" => Some("too short".to_owned()),
            _ => None,
        }
    }

    fn ed_key(kid: &str, private: Option<&str>, public: &str) -> KeySettings {
        KeySettings {
            kid: kid.to_owned(),
            algorithm: "EdDSA".to_owned(),
            private_key_file: private.map(fixture),
            public_key_file: Some(fixture(public)),
            secret_env: None,
        }
    }

    fn es_key(kid: &str, private: Option<&str>, public: &str) -> KeySettings {
        KeySettings {
            algorithm: "ES256".to_owned(),
            ..ed_key(kid, private, public)
        }
    }

    fn hs_key(kid: &str, var: &str) -> KeySettings {
        KeySettings {
            kid: kid.to_owned(),
            algorithm: "HS256".to_owned(),
            secret_env: Some(var.to_owned()),
            ..KeySettings::default()
        }
    }

    /// k1: EdDSA, e1: ES256, h1: HS256, all able to sign.
    fn all_keys() -> Vec<KeySettings> {
        vec![
            ed_key("k1", Some("ed25519.pem"), "ed25519.pub.pem"),
            es_key("e1", Some("p256.pem"), "p256.pub.pem"),
            hs_key("h1", "HS_SECRET"),
        ]
    }

    fn keys_signing_with(kid: &str) -> JwtKeys {
        let settings = TokensSettings {
            signing_kid: Some(kid.to_owned()),
            keys: all_keys(),
            ..TokensSettings::default()
        };
        JwtKeys::load(&settings, &env).unwrap()
    }

    fn keys() -> JwtKeys {
        keys_signing_with("k1")
    }

    fn now() -> i64 {
        chrono::Utc::now().timestamp()
    }

    fn b64url(bytes: &[u8]) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let b = [
                chunk[0],
                *chunk.get(1).unwrap_or(&0),
                *chunk.get(2).unwrap_or(&0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..=chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }

    /// A token with exactly this header and these claims, signed as `alg`
    /// with `key` (or unsigned, with an empty signature, if `key` is None).
    fn forge(header: Value, claims: Value, key: Option<(&EncodingKey, Algorithm)>) -> String {
        let message = format!(
            "{}.{}",
            b64url(header.to_string().as_bytes()),
            b64url(claims.to_string().as_bytes())
        );
        let signature = match key {
            Some((key, alg)) => jsonwebtoken::crypto::sign(message.as_bytes(), key, alg).unwrap(),
            None => String::new(),
        };
        format!("{message}.{signature}")
    }

    fn ed_signing_key(file: &str) -> EncodingKey {
        EncodingKey::from_ed_pem(&read_fixture(file)).unwrap()
    }

    fn good_claims() -> Value {
        json!({"sub": "doc:1", "fence": 7, "iat": now(), "exp": now() + 60, "iss": "fencegate"})
    }

    /// Signed by the real k1 key, with these claims.
    fn k1_token(claims: Value) -> String {
        forge(
            json!({"alg": "EdDSA", "kid": "k1", "typ": "JWT"}),
            claims,
            Some((&ed_signing_key("ed25519.pem"), Algorithm::EdDSA)),
        )
    }

    fn rejected(keys: &JwtKeys, token: &str) -> String {
        match keys.verify(token, "doc:1") {
            Err(JwtRejection::Invalid(why)) => why,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn round_trip_eddsa_es256_hs256() {
        for (kid, alg) in [("k1", "EdDSA"), ("e1", "ES256"), ("h1", "HS256")] {
            let keys = keys_signing_with(kid);
            assert!(keys.can_sign());
            assert_eq!(keys.signing_kid(), Some(kid));
            let (iat, exp) = (now(), now() + 30);
            let token = keys.sign("doc:1", 42, iat, exp).unwrap();
            let header = read_header(&token).unwrap();
            assert_eq!(header.alg.as_deref(), Some(alg));
            assert_eq!(header.kid.as_deref(), Some(kid));
            let claims = keys.verify(&token, "doc:1").unwrap();
            assert_eq!(
                claims,
                FenceClaims {
                    sub: "doc:1".into(),
                    fence: 42,
                    iat,
                    exp,
                    iss: "fencegate".into()
                }
            );
            // Any configured key verifies, whichever signs.
            assert_eq!(keys_signing_with("k1").verify(&token, "doc:1"), Ok(claims));
        }
    }

    #[test]
    fn tampered_claims_are_refused() {
        let keys = keys();
        for kid in ["k1", "e1", "h1"] {
            let token = keys_signing_with(kid)
                .sign("doc:1", 5, now(), now() + 60)
                .unwrap();
            let parts: Vec<&str> = token.split('.').collect();
            let mut claims: Value =
                serde_json::from_slice(&b64url_decode(parts[1]).unwrap()).unwrap();
            claims["fence"] = json!(6);
            let forged = format!(
                "{}.{}.{}",
                parts[0],
                b64url(claims.to_string().as_bytes()),
                parts[2]
            );
            assert_eq!(rejected(&keys, &forged), "bad signature", "{kid}");
        }
    }

    #[test]
    fn alg_none_is_refused() {
        let keys = keys();
        for kid in ["k1", "e1", "h1"] {
            let token = forge(
                json!({"alg": "none", "kid": kid, "typ": "JWT"}),
                good_claims(),
                None,
            );
            let why = rejected(&keys, &token);
            assert!(
                why.starts_with("algorithm none does not match key"),
                "{why}"
            );
        }
        // Other spellings and no kid at all.
        for alg in ["None", "NONE", "nOnE"] {
            let token = forge(json!({"alg": alg, "kid": "k1"}), good_claims(), None);
            assert!(rejected(&keys, &token).starts_with("algorithm "));
        }
        let token = forge(json!({"alg": "none"}), good_claims(), None);
        assert_eq!(rejected(&keys, &token), "no kid header");
        // A valid signature with the header's alg swapped to none.
        let real = keys.sign("doc:1", 5, now(), now() + 60).unwrap();
        let parts: Vec<&str> = real.split('.').collect();
        let header = b64url(json!({"alg": "none", "kid": "k1"}).to_string().as_bytes());
        for sig in ["", parts[2]] {
            let token = format!("{header}.{}.{sig}", parts[1]);
            assert_eq!(
                rejected(&keys, &token),
                "algorithm none does not match key 'k1' (EdDSA)"
            );
        }
    }

    #[test]
    fn hs256_signed_with_the_public_key_is_refused() {
        let keys = keys();
        for (kid, alg, public) in [
            ("k1", "EdDSA", "ed25519.pub.pem"),
            ("e1", "ES256", "p256.pub.pem"),
        ] {
            let pem = read_fixture(public);
            let hmac = EncodingKey::from_secret(&pem);
            let token = forge(
                json!({"alg": "HS256", "kid": kid, "typ": "JWT"}),
                good_claims(),
                Some((&hmac, Algorithm::HS256)),
            );
            assert_eq!(
                rejected(&keys, &token),
                format!("algorithm HS256 does not match key '{kid}' ({alg})")
            );
            // Defence in depth: even past our header check, jsonwebtoken with
            // the key's Validation refuses it.
            let key = &keys.inner.keys[kid];
            assert_eq!(
                check_signed(&token, key),
                Err(invalid("algorithm not allowed for this key"))
            );
            // Also with the DER bytes jsonwebtoken keeps for the key.
            let hmac = EncodingKey::from_secret(key.decoding.as_bytes());
            let token = forge(
                json!({"alg": "HS256", "kid": kid}),
                good_claims(),
                Some((&hmac, Algorithm::HS256)),
            );
            assert!(rejected(&keys, &token).starts_with("algorithm HS256 does not match"));
        }
    }

    #[test]
    fn an_hs256_key_never_verifies_asymmetric_tokens_and_vice_versa() {
        let keys = keys();
        // EdDSA-signed token claiming the HS256 key's kid.
        let token = forge(
            json!({"alg": "EdDSA", "kid": "h1"}),
            good_claims(),
            Some((&ed_signing_key("ed25519.pem"), Algorithm::EdDSA)),
        );
        assert_eq!(
            rejected(&keys, &token),
            "algorithm EdDSA does not match key 'h1' (HS256)"
        );
        assert_eq!(
            check_signed(&token, &keys.inner.keys["h1"]),
            Err(invalid("algorithm not allowed for this key"))
        );
        // HS256-signed (with the real secret) claiming the EdDSA key's kid.
        let token = forge(
            json!({"alg": "HS256", "kid": "k1"}),
            good_claims(),
            Some((
                &EncodingKey::from_secret(SECRET.as_bytes()),
                Algorithm::HS256,
            )),
        );
        assert_eq!(
            rejected(&keys, &token),
            "algorithm HS256 does not match key 'k1' (EdDSA)"
        );
        // ES256 token presented as EdDSA and the reverse.
        let es = EncodingKey::from_ec_pem(&read_fixture("p256.pem")).unwrap();
        let token = forge(
            json!({"alg": "ES256", "kid": "k1"}),
            good_claims(),
            Some((&es, Algorithm::ES256)),
        );
        assert_eq!(
            rejected(&keys, &token),
            "algorithm ES256 does not match key 'k1' (EdDSA)"
        );
    }

    #[test]
    fn unknown_or_missing_kid_is_refused() {
        let keys = keys();
        let ed = ed_signing_key("ed25519.pem");
        let token = forge(
            json!({"alg": "EdDSA", "kid": "k9"}),
            good_claims(),
            Some((&ed, Algorithm::EdDSA)),
        );
        assert_eq!(rejected(&keys, &token), "unknown kid 'k9'");
        let token = forge(
            json!({"alg": "EdDSA"}),
            good_claims(),
            Some((&ed, Algorithm::EdDSA)),
        );
        assert_eq!(rejected(&keys, &token), "no kid header");
        // A path or URL as kid is just an unknown kid (and echoed safely).
        let long = format!("../../etc/passwd\n{}", "x".repeat(200));
        let token = forge(
            json!({"alg": "EdDSA", "kid": long}),
            good_claims(),
            Some((&ed, Algorithm::EdDSA)),
        );
        let why = rejected(&keys, &token);
        assert!(
            why.starts_with("unknown kid '../../etc/passwd\u{fffd}x"),
            "{why}"
        );
        assert!(why.len() < 100 && !why.contains('\n'), "{why}");
        let token = forge(
            json!({"kid": "k1"}),
            good_claims(),
            Some((&ed, Algorithm::EdDSA)),
        );
        assert_eq!(rejected(&keys, &token), "no alg header");
    }

    #[test]
    fn key_url_headers_are_ignored() {
        let keys = keys();
        let other = ed_signing_key("ed25519-other.pem");
        let other_pub = String::from_utf8(read_fixture("ed25519-other.pub.pem")).unwrap();
        let token = forge(
            json!({
                "alg": "EdDSA", "kid": "k1",
                "jku": "https://attacker.example/jwks.json",
                "x5u": "https://attacker.example/cert.pem",
                "x5c": [other_pub],
            }),
            good_claims(),
            Some((&other, Algorithm::EdDSA)),
        );
        assert_eq!(rejected(&keys, &token), "bad signature");
    }

    #[test]
    fn crit_header_is_refused() {
        let keys = keys();
        let token = forge(
            json!({"alg": "EdDSA", "kid": "k1", "crit": ["exp"], "exp": 1}),
            good_claims(),
            Some((&ed_signing_key("ed25519.pem"), Algorithm::EdDSA)),
        );
        assert_eq!(rejected(&keys, &token), "unsupported critical header");
    }

    #[test]
    fn signed_by_another_key_is_a_bad_signature() {
        let keys = keys();
        let token = forge(
            json!({"alg": "EdDSA", "kid": "k1", "typ": "JWT"}),
            good_claims(),
            Some((&ed_signing_key("ed25519-other.pem"), Algorithm::EdDSA)),
        );
        assert_eq!(rejected(&keys, &token), "bad signature");
        // Same for ES256 signed with another P-256 key? We have one pair;
        // a P-384-signed ES256 token cannot be made, so flip a signature byte.
        let token = keys_signing_with("e1")
            .sign("doc:1", 1, now(), now() + 60)
            .unwrap();
        let (msg, sig) = token.rsplit_once('.').unwrap();
        let mut sig = b64url_decode(sig).unwrap();
        sig[10] ^= 1;
        assert_eq!(
            rejected(&keys, &format!("{msg}.{}", b64url(&sig))),
            "bad signature"
        );
    }

    #[test]
    fn another_resource_key_is_wrong_subject() {
        let keys = keys();
        let token = keys.sign("doc:1", 3, now(), now() + 60).unwrap();
        assert_eq!(
            keys.verify(&token, "doc:2"),
            Err(JwtRejection::WrongSubject {
                expected: "doc:2".into(),
                presented: "doc:1".into()
            })
        );
        // But an invalid token for another key is Invalid, not WrongSubject.
        let expired = keys.sign("doc:1", 3, now() - 600, now() - 300).unwrap();
        assert_eq!(keys.verify(&expired, "doc:2"), Err(invalid("expired")));
    }

    #[test]
    fn expiry_uses_the_configured_leeway() {
        let keys = keys(); // leeway 5 s
        let token = keys.sign("doc:1", 3, now() - 120, now() - 60).unwrap();
        assert_eq!(rejected(&keys, &token), "expired");
        let token = keys.sign("doc:1", 3, now() - 120, now() - 2).unwrap();
        assert_eq!(keys.verify(&token, "doc:1").unwrap().fence, 3);

        let strict = JwtKeys::load(
            &TokensSettings {
                leeway: Duration::ZERO,
                keys: all_keys(),
                ..TokensSettings::default()
            },
            &env,
        )
        .unwrap();
        assert_eq!(rejected(&strict, &token), "expired");
        assert!(!strict.can_sign());
    }

    #[test]
    fn wrong_issuer_is_refused() {
        let keys = keys();
        let mut claims = good_claims();
        claims["iss"] = json!("someone-else");
        assert_eq!(rejected(&keys, &k1_token(claims.clone())), "wrong issuer");
        // jsonwebtoken would accept an array containing our issuer; we do not.
        claims["iss"] = json!(["fencegate", "someone-else"]);
        assert_eq!(rejected(&keys, &k1_token(claims.clone())), "wrong issuer");
        claims["iss"] = json!(["fencegate"]);
        assert_eq!(rejected(&keys, &k1_token(claims)), "wrong issuer");

        let other_issuer = JwtKeys::load(
            &TokensSettings {
                issuer: "gw-2".into(),
                keys: all_keys(),
                ..TokensSettings::default()
            },
            &env,
        )
        .unwrap();
        let token = keys.sign("doc:1", 3, now(), now() + 60).unwrap();
        assert_eq!(rejected(&other_issuer, &token), "wrong issuer");
    }

    #[test]
    fn missing_claims_are_named() {
        let keys = keys();
        for claim in ["fence", "iat", "exp", "iss", "sub"] {
            let mut claims = good_claims();
            claims.as_object_mut().unwrap().remove(claim);
            assert_eq!(
                rejected(&keys, &k1_token(claims)),
                format!("missing claim '{claim}'")
            );
        }
    }

    #[test]
    fn fence_must_be_a_positive_integer() {
        let keys = keys();
        for bad in [
            json!(0),
            json!(-1),
            json!(i64::MIN),
            json!(1.5),
            json!(2.0),
            json!("7"),
            json!(u64::MAX),
            json!(true),
            json!([1]),
        ] {
            let mut claims = good_claims();
            claims["fence"] = bad.clone();
            assert_eq!(
                rejected(&keys, &k1_token(claims)),
                "fence must be a positive integer",
                "{bad}"
            );
        }
        let mut claims = good_claims();
        claims["fence"] = json!(i64::MAX);
        assert_eq!(
            keys.verify(&k1_token(claims), "doc:1").unwrap().fence,
            i64::MAX
        );
    }

    #[test]
    fn claim_types_are_checked() {
        let keys = keys();
        let cases = [
            ("iat", json!("now"), "claim 'iat' must be an integer"),
            ("iat", json!(1.5), "claim 'iat' must be an integer"),
            ("exp", json!("later"), "claim 'exp' is not a valid time"),
            ("exp", json!(-5), "claim 'exp' is not a valid time"),
            (
                "exp",
                json!(now() as f64 + 60.0),
                "claim 'exp' must be an integer",
            ),
            ("sub", json!(1), "claim 'sub' must be a string"),
            ("sub", json!(null), "missing claim 'sub'"),
            ("iss", json!(7), "claim 'iss' must be a string"),
            ("exp", json!(null), "missing claim 'exp'"),
            ("nbf", json!(now() + 3600), "not yet valid"),
            ("nbf", json!("soon"), "claim 'nbf' is not a valid time"),
            ("aud", json!("fencegate"), "unexpected audience"),
        ];
        for (claim, value, why) in cases {
            let mut claims = good_claims();
            claims[claim] = value;
            assert_eq!(rejected(&keys, &k1_token(claims)), why, "{claim}");
        }
        let mut claims = good_claims();
        claims["nbf"] = json!(now() - 10);
        assert!(keys.verify(&k1_token(claims), "doc:1").is_ok());
        assert_eq!(rejected(&keys, &k1_token(json!([1, 2]))), "malformed token");
    }

    #[test]
    fn garbage_is_malformed() {
        let keys = keys();
        let real = keys.sign("doc:1", 1, now(), now() + 60).unwrap();
        let parts: Vec<&str> = real.split('.').collect();
        let cases = [
            String::new(),
            "garbage".into(),
            "a.b".into(),
            "a.b.c".into(),
            "...".into(),
            "..".into(),
            "a.b.c.d".into(),
            "\u{0}\u{1}.\u{2}.x".into(),
            "Bearer x.y.z".into(),
            "ééé.ééé.ééé".into(),
            format!("{real}.{}", parts[2]),
            format!("{}=.{}.{}", parts[0], parts[1], parts[2]),
            format!(".{}.{}", parts[1], parts[2]),
            format!("{}..{}", parts[0], parts[2]),
            format!("{}.{}!.{}", parts[0], parts[1], parts[2]),
            format!("{}.{}.{}", b64url(b"not json"), parts[1], parts[2]),
            format!("{}.{}.{}", b64url(b"[1]"), parts[1], parts[2]),
            format!(
                "{}.{}.{}",
                b64url(br#"{"alg":7,"kid":"k1"}"#),
                parts[1],
                parts[2]
            ),
            format!("{}.{}.!!", parts[0], parts[1]),
        ];
        for token in cases {
            assert_eq!(rejected(&keys, &token), "malformed token", "{token:?}");
        }
        // Anything that changes the signed text is a bad signature first.
        for token in [
            format!("{}.{}.", parts[0], parts[1]),
            format!("{}.{}.{}", parts[0], b64url(b"not json"), parts[2]),
        ] {
            assert_eq!(rejected(&keys, &token), "bad signature", "{token:?}");
        }
        // A signed payload that is not JSON.
        let message = format!("{}.{}", parts[0], b64url(b"not json"));
        let sig = jsonwebtoken::crypto::sign(
            message.as_bytes(),
            &ed_signing_key("ed25519.pem"),
            Algorithm::EdDSA,
        )
        .unwrap();
        assert_eq!(
            rejected(&keys, &format!("{message}.{sig}")),
            "malformed token"
        );
    }

    #[test]
    fn oversized_tokens_are_refused_before_parsing() {
        let keys = keys();
        assert_eq!(
            rejected(&keys, &"a".repeat(MAX_TOKEN_LEN + 1)),
            "token too long"
        );
        // A validly signed token that is too long.
        let mut claims = good_claims();
        claims["pad"] = json!("p".repeat(MAX_TOKEN_LEN));
        assert_eq!(rejected(&keys, &k1_token(claims)), "token too long");
        // sign() will not produce one either.
        let long_key = "k".repeat(MAX_TOKEN_LEN);
        assert!(matches!(
            keys.sign(&long_key, 1, now(), now() + 60),
            Err(JwtError::TooLong { .. })
        ));
        // Just under the limit is fine.
        let mut sub = "d".repeat(5000);
        let token = loop {
            let token = keys.sign(&sub, 1, now(), now() + 60).unwrap();
            if token.len() > MAX_TOKEN_LEN - 4 {
                break token;
            }
            sub.push('d');
        };
        assert!(token.len() <= MAX_TOKEN_LEN);
        assert!(keys.verify(&token, &sub).is_ok());
    }

    #[test]
    fn sign_checks_its_arguments() {
        let keys = keys();
        assert!(matches!(
            keys.sign("doc:1", 0, now(), now() + 1),
            Err(JwtError::InvalidClaims(_))
        ));
        assert!(matches!(
            keys.sign("", 1, now(), now() + 1),
            Err(JwtError::InvalidClaims(_))
        ));
        assert!(matches!(
            keys.sign("doc:1", 1, now(), now() - 1),
            Err(JwtError::InvalidClaims(_))
        ));
        let verify_only = JwtKeys::load(
            &TokensSettings {
                keys: vec![ed_key("k1", None, "ed25519.pub.pem")],
                ..TokensSettings::default()
            },
            &env,
        )
        .unwrap();
        assert!(!verify_only.can_sign());
        assert!(matches!(
            verify_only.sign("doc:1", 1, now(), now() + 1),
            Err(JwtError::NoSigningKey)
        ));
        // A verify-only gateway still verifies another instance's tokens.
        let token = keys.sign("doc:1", 9, now(), now() + 60).unwrap();
        assert_eq!(verify_only.verify(&token, "doc:1").unwrap().fence, 9);
        assert_eq!(verify_only.issuer(), "fencegate");
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

    fn problems(settings: &TokensSettings) -> Vec<(String, String)> {
        JwtKeys::load(settings, &env).unwrap_err()
    }

    fn has(problems: &[(String, String)], key: &str, why: &str) -> bool {
        problems.iter().any(|(k, w)| k == key && w.contains(why))
    }

    #[test]
    fn load_reports_every_problem_at_once() {
        let missing = fixture("missing.pem");
        let settings = TokensSettings {
            issuer: String::new(),
            signing_kid: Some("nope".into()),
            leeway: Duration::from_secs(3600),
            keys: vec![
                KeySettings {
                    kid: "r1".into(),
                    algorithm: "RS256".into(),
                    ..KeySettings::default()
                },
                KeySettings {
                    public_key_file: Some(missing.clone()),
                    ..ed_key("k1", Some("ed25519.pem"), "x")
                },
                hs_key("h1", "FENCEGATE_HS256_SECRET"),
                KeySettings {
                    private_key_file: Some(fixture("ed25519.pem")),
                    ..hs_key("h2", "SHORT_SECRET")
                },
                es_key("h1", Some("p256.pem"), "p256.pub.pem"),
                KeySettings {
                    public_key_file: None,
                    ..ed_key("k5", Some("ed25519.pem"), "x")
                },
                KeySettings {
                    kid: String::new(),
                    algorithm: "eddsa".into(),
                    ..KeySettings::default()
                },
                KeySettings {
                    secret_env: Some("HS_SECRET".into()),
                    ..es_key("e7", None, "p256.pub.pem")
                },
                hs_key("h8", ""),
            ],
        };
        let p = problems(&settings);
        let expected = [
            ("tokens.issuer", "must not be empty"),
            ("tokens.leeway_s", "3600 s is too long"),
            (
                "tokens.keys[0].algorithm",
                "'RS256' is not supported; use EdDSA, ES256 or HS256",
            ),
            (
                "tokens.keys[1].public_key_file",
                &format!(
                    "cannot read {}: No such file or directory",
                    missing.display()
                ),
            ),
            (
                "tokens.keys[2].secret_env",
                "FENCEGATE_HS256_SECRET is not set",
            ),
            (
                "tokens.keys[3].private_key_file",
                "HS256 keys take their secret",
            ),
            ("tokens.keys[3].secret_env", "SHORT_SECRET holds 9 bytes"),
            (
                "tokens.keys[4].kid",
                "'h1' is already the kid of tokens.keys[2]",
            ),
            (
                "tokens.keys[5].public_key_file",
                "EdDSA keys need a public key file",
            ),
            ("tokens.keys[6].kid", "must not be empty"),
            ("tokens.keys[6].algorithm", "did you mean EdDSA?"),
            (
                "tokens.keys[7].secret_env",
                "only HS256 keys use secret_env",
            ),
            ("tokens.keys[8].secret_env", "HS256 keys need secret_env"),
            ("tokens.signing_kid", "names no key in tokens.keys"),
        ];
        for (key, why) in expected {
            assert!(has(&p, key, why), "{key}: {why} not in {p:#?}");
        }
        assert_eq!(p.len(), expected.len(), "{p:#?}");
        // No message carries the secret.
        assert!(!format!("{p:?}").contains("too short"));
        // Exact wording of the io error (no "(os error 2)").
        assert!(p
            .iter()
            .any(|(_, w)| w.ends_with("No such file or directory")));
    }

    #[test]
    fn load_checks_pem_contents() {
        let p = problems(&TokensSettings {
            keys: vec![
                // ES256 from a SEC1 file: hint to convert.
                es_key("e1", Some("p256-sec1.pem"), "p256.pub.pem"),
                // P-384 is not ES256.
                es_key("e2", Some("p384.pem"), "p384.pub.pem"),
                // Ed25519 public key configured as ES256, and the reverse.
                es_key("e3", None, "ed25519.pub.pem"),
                ed_key("k4", None, "p256.pub.pem"),
                // Private key where the public one belongs.
                ed_key("k5", None, "ed25519.pem"),
                // A pair that does not match.
                ed_key("k6", Some("ed25519.pem"), "ed25519-other.pub.pem"),
                // Not a PEM at all.
                ed_key("k7", Some("README.md"), "README.md"),
            ],
            ..TokensSettings::default()
        });
        let expected = [
            (
                "tokens.keys[0].private_key_file",
                "is a SEC1 'EC PRIVATE KEY'; convert it",
            ),
            (
                "tokens.keys[1].private_key_file",
                "is not a P-256 private key",
            ),
            (
                "tokens.keys[1].public_key_file",
                "is not a P-256 public key",
            ),
            (
                "tokens.keys[2].public_key_file",
                "is not a P-256 public key",
            ),
            (
                "tokens.keys[3].public_key_file",
                "is not an Ed25519 public key",
            ),
            (
                "tokens.keys[4].public_key_file",
                "is not an Ed25519 public key",
            ),
            (
                "tokens.keys[5].private_key_file",
                "does not match public_key_file",
            ),
            (
                "tokens.keys[6].private_key_file",
                "is not an Ed25519 private key",
            ),
            (
                "tokens.keys[6].public_key_file",
                "is not an Ed25519 public key",
            ),
        ];
        for (key, why) in expected {
            assert!(has(&p, key, why), "{key}: {why} not in {p:#?}");
        }
        assert_eq!(p.len(), expected.len(), "{p:#?}");
    }

    #[test]
    fn load_checks_the_signing_key() {
        let p = problems(&TokensSettings {
            signing_kid: Some("k1".into()),
            keys: vec![ed_key("k1", None, "ed25519.pub.pem")],
            ..TokensSettings::default()
        });
        assert_eq!(
            p,
            vec![(
                "tokens.signing_kid".to_owned(),
                "key 'k1' has no private_key_file; the signing key needs its private key"
                    .to_owned()
            )]
        );
        // A broken signing key is reported once, under its own entry.
        let p = problems(&TokensSettings {
            signing_kid: Some("k1".into()),
            keys: vec![ed_key("k1", Some("p256.pem"), "ed25519.pub.pem")],
            ..TokensSettings::default()
        });
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].0, "tokens.keys[0].private_key_file");
        // No keys at all.
        let p = problems(&TokensSettings::default());
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].0, "tokens.keys");
    }

    #[test]
    fn base64url_decoding_is_strict() {
        assert_eq!(b64url_decode("").unwrap(), b"");
        assert_eq!(b64url_decode("YQ").unwrap(), b"a");
        assert_eq!(b64url_decode("YWI").unwrap(), b"ab");
        assert_eq!(b64url_decode("YWJj").unwrap(), b"abc");
        assert_eq!(b64url_decode("-_8").unwrap(), [0xfb, 0xff]);
        for bad in ["Y", "YQ==", "YR", "YWJ", "YW+j", "YW/j", "YW j"] {
            assert_eq!(b64url_decode(bad), None, "{bad}");
        }
        for len in 0..40u8 {
            let bytes: Vec<u8> = (0..len).map(|i| i.wrapping_mul(37) ^ 0xa5).collect();
            assert_eq!(b64url_decode(&b64url(&bytes)).unwrap(), bytes);
        }
    }
}
