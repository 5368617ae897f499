//! Turning the `[tokens]` settings into loaded keys.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Validation};

use super::{Inner, JwtKeys, KeySettings, TokensSettings, MAX_LEEWAY_SECS, MIN_HS256_SECRET_LEN};

/// The message test-signed when a key pair is loaded.
const PROBE_MESSAGE: &[u8] = b"fencegate key check";

/// The algorithms a key may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeyAlg {
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

    pub(super) fn name(self) -> &'static str {
        match self {
            KeyAlg::EdDsa => "EdDSA",
            KeyAlg::Es256 => "ES256",
            KeyAlg::Hs256 => "HS256",
        }
    }

    pub(super) fn jwt(self) -> Algorithm {
        match self {
            KeyAlg::EdDsa => Algorithm::EdDSA,
            KeyAlg::Es256 => Algorithm::ES256,
            KeyAlg::Hs256 => Algorithm::HS256,
        }
    }

    fn parse_ignoring_case(name: &str) -> Option<KeyAlg> {
        [KeyAlg::EdDsa, KeyAlg::Es256, KeyAlg::Hs256]
            .into_iter()
            .find(|alg| alg.name().eq_ignore_ascii_case(name))
    }
}

/// One loaded key.
pub(super) struct LoadedKey {
    pub(super) alg: KeyAlg,
    /// Always present: every configured key can verify.
    pub(super) decoding: DecodingKey,
    /// Present for HS256 and for asymmetric keys with a private key file.
    pub(super) encoding: Option<EncodingKey>,
    /// Built once: exactly this key's algorithm, issuer, leeway.
    pub(super) validation: Validation,
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
    /// private half. Relative paths are used as given, i.e. relative to the
    /// working directory (the config loader has already resolved them
    /// against the config file's directory).
    ///
    /// `env` looks up the variables named by `secret_env`. It is a parameter,
    /// not `std::env::var`, so the secrets come from the environment the
    /// config loader was given (the process's, or a test's list).
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

        let signing_kid = match signing_kid(settings, &first_index, &broken, &keys) {
            Ok(kid) => kid,
            Err(why) => {
                problem("tokens.signing_kid".into(), why);
                None
            }
        };

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
}

/// `signing_kid`, when it names a loaded key with a private key; its
/// problem otherwise (none when its entry's own problems are reported).
fn signing_kid(
    settings: &TokensSettings,
    first_index: &HashMap<&str, usize>,
    broken: &HashSet<&str>,
    keys: &HashMap<String, LoadedKey>,
) -> Result<Option<String>, String> {
    let Some(kid) = &settings.signing_kid else {
        return Ok(None);
    };
    if !first_index.contains_key(kid.as_str()) {
        return Err("names no key in tokens.keys".into());
    }
    match keys.get(kid) {
        // Its own problems are reported with its entry.
        _ if broken.contains(kid.as_str()) => Ok(None),
        Some(key) if key.encoding.is_some() => Ok(Some(kid.clone())),
        Some(_) => Err(format!(
            "key '{kid}' has no private_key_file; the signing key needs its private key"
        )),
        None => Ok(None),
    }
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

    let pair = match alg {
        KeyAlg::Hs256 => hs256_pair(key, prefix, env, &mut problems),
        KeyAlg::EdDsa | KeyAlg::Es256 => pem_pair(alg, key, prefix, &mut problems),
    };
    let (decoding, encoding) = match pair {
        Some(pair) if problems.is_empty() => pair,
        _ => return Err(problems),
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

/// What verifies and signs with an HS256 key: its secret, from the
/// environment variable `secret_env` names.
fn hs256_pair(
    key: &KeySettings,
    prefix: &str,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<(String, String)>,
) -> Option<(DecodingKey, Option<EncodingKey>)> {
    for (field, path) in [
        ("private_key_file", &key.private_key_file),
        ("public_key_file", &key.public_key_file),
    ] {
        if path.is_some() {
            problems.push((
                format!("{prefix}.{field}"),
                "HS256 keys take their secret from secret_env, not from a PEM file".to_owned(),
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
                problems.push((format!("{prefix}.secret_env"), format!("{var} is not set")));
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
    secret.map(|secret| {
        (
            DecodingKey::from_secret(secret.as_bytes()),
            Some(EncodingKey::from_secret(secret.as_bytes())),
        )
    })
}

/// What verifies and signs with an EdDSA or ES256 key: its PEM files, the
/// private one optional, and checked to be the public one's other half.
fn pem_pair(
    alg: KeyAlg,
    key: &KeySettings,
    prefix: &str,
    problems: &mut Vec<(String, String)>,
) -> Option<(DecodingKey, Option<EncodingKey>)> {
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
    decoding.map(|decoding| (decoding, encoding))
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

/// The PEM file at `path`, its key parsed for `alg` by `ed` or `ec`, and
/// what the file should hold, in words ("an Ed25519 public key").
fn pem_key<K>(
    alg: KeyAlg,
    path: &Path,
    half: &str,
    ed: impl FnOnce(&[u8]) -> jsonwebtoken::errors::Result<K>,
    ec: impl FnOnce(&[u8]) -> jsonwebtoken::errors::Result<K>,
) -> Result<(Vec<u8>, Option<K>, String), String> {
    let pem = read_pem(path)?;
    let (key, what) = match alg {
        KeyAlg::EdDsa => (ed(&pem), "an Ed25519"),
        KeyAlg::Es256 => (ec(&pem), "a P-256"),
        KeyAlg::Hs256 => {
            return Err(format!(
                "{}: HS256 keys are secrets, not PEM files",
                path.display()
            ))
        }
    };
    Ok((pem, key.ok(), format!("{what} {half} key")))
}

fn load_public(alg: KeyAlg, path: &Path) -> Result<DecodingKey, String> {
    let (_, key, what) = pem_key(
        alg,
        path,
        "public",
        DecodingKey::from_ed_pem,
        DecodingKey::from_ec_pem,
    )?;
    let not_it = || {
        format!(
            "{} is not {what} in PEM form ('BEGIN PUBLIC KEY'; make it with `openssl pkey -in PRIVATE.pem -pubout`)",
            path.display()
        )
    };
    let key = key.ok_or_else(not_it)?;
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
    let (pem, key, what) = pem_key(
        alg,
        path,
        "private",
        EncodingKey::from_ed_pem,
        EncodingKey::from_ec_pem,
    )?;
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
    let key = key.ok_or_else(not_it)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fencing::jwt::tests::*;
    use std::time::Duration;

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
}
