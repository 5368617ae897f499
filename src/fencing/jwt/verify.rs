//! Verifying presented tokens and signing grants.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::Header;
use serde_json::Value;

use super::keys::LoadedKey;
use super::{FenceClaims, JwtError, JwtKeys, JwtRejection, MAX_TOKEN_LEN};

/// Longest client-supplied string (a `kid` or `alg`), in characters, echoed
/// back in a rejection reason.
const MAX_SHOWN_KID: usize = 64;

fn invalid(reason: impl Into<String>) -> JwtRejection {
    JwtRejection::Invalid(reason.into())
}

impl JwtKeys {
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
    /// Checks, in order: length; shape; header (`alg` and `kid` present,
    /// `kid` configured, `crit` absent, `alg` equal to the key's); then, in
    /// jsonwebtoken with only the key's algorithm allowed: signature,
    /// presence of `exp`, `iss`, `sub`, expiry with leeway, `nbf` if
    /// present, issuer, no `aud`; then `exp`, `iat`, `fence`, `iss` and `sub`
    /// types and values. Every failure is [`JwtRejection::Invalid`], except a
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
/// own [`Validation`](jsonwebtoken::Validation) (its one algorithm). Returns
/// the claims as JSON.
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

/// A client-supplied string made safe to echo: at most [`MAX_SHOWN_KID`]
/// characters, control characters replaced (the reason is logged and sent
/// back in the problem detail).
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
/// whitespace, no stray bits in the last character. `URL_SAFE_NO_PAD`
/// decodes with `DecodePaddingMode::RequireNone` and, like every
/// `GeneralPurposeConfig` unless told otherwise, refuses trailing bits. It is
/// also the engine jsonwebtoken decodes with, so a header read here is one
/// jsonwebtoken reads the same way.
fn b64url_decode(text: &str) -> Option<Vec<u8>> {
    URL_SAFE_NO_PAD.decode(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fencing::jwt::tests::*;
    use crate::fencing::jwt::TokensSettings;
    use jsonwebtoken::{Algorithm, EncodingKey};
    use serde_json::json;
    use std::time::Duration;

    fn now() -> i64 {
        chrono::Utc::now().timestamp()
    }

    fn b64url(bytes: &[u8]) -> String {
        URL_SAFE_NO_PAD.encode(bytes)
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

    /// A token of `header` with good claims, EdDSA-signed with `key`: the
    /// header tests vary the header alone.
    fn ed_forged(header: Value, key: &EncodingKey) -> String {
        forge(header, good_claims(), Some((key, Algorithm::EdDSA)))
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

    /// `token` is refused because its header's `alg` is not that of the
    /// key its `kid` names: no algorithm confusion gets to a signature check.
    fn assert_mismatch(keys: &JwtKeys, token: &str, alg: &str, kid: &str, key_alg: &str) {
        assert_eq!(
            rejected(keys, token),
            format!("algorithm {alg} does not match key '{kid}' ({key_alg})")
        );
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
            assert_mismatch(&keys, &token, "none", "k1", "EdDSA");
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
            assert_mismatch(&keys, &token, "HS256", kid, alg);
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
        let token = ed_forged(
            json!({"alg": "EdDSA", "kid": "h1"}),
            &ed_signing_key("ed25519.pem"),
        );
        assert_mismatch(&keys, &token, "EdDSA", "h1", "HS256");
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
        assert_mismatch(&keys, &token, "HS256", "k1", "EdDSA");
        // ES256 token presented as EdDSA and the reverse.
        let es = EncodingKey::from_ec_pem(&read_fixture("p256.pem")).unwrap();
        let token = forge(
            json!({"alg": "ES256", "kid": "k1"}),
            good_claims(),
            Some((&es, Algorithm::ES256)),
        );
        assert_mismatch(&keys, &token, "ES256", "k1", "EdDSA");
    }

    #[test]
    fn unknown_or_missing_kid_is_refused() {
        let keys = keys();
        let ed = ed_signing_key("ed25519.pem");
        let token = ed_forged(json!({"alg": "EdDSA", "kid": "k9"}), &ed);
        assert_eq!(rejected(&keys, &token), "unknown kid 'k9'");
        let token = ed_forged(json!({"alg": "EdDSA"}), &ed);
        assert_eq!(rejected(&keys, &token), "no kid header");
        // A path or URL as kid is just an unknown kid (and echoed safely).
        let long = format!("../../etc/passwd\n{}", "x".repeat(200));
        let token = ed_forged(json!({"alg": "EdDSA", "kid": long}), &ed);
        let why = rejected(&keys, &token);
        assert!(
            why.starts_with("unknown kid '../../etc/passwd\u{fffd}x"),
            "{why}"
        );
        assert!(why.len() < 100 && !why.contains('\n'), "{why}");
        let token = ed_forged(json!({"kid": "k1"}), &ed);
        assert_eq!(rejected(&keys, &token), "no alg header");
    }

    #[test]
    fn key_url_headers_are_ignored() {
        let keys = keys();
        let other = ed_signing_key("ed25519-other.pem");
        let other_pub = String::from_utf8(read_fixture("ed25519-other.pub.pem")).unwrap();
        let token = ed_forged(
            json!({
                "alg": "EdDSA", "kid": "k1",
                "jku": "https://attacker.example/jwks.json",
                "x5u": "https://attacker.example/cert.pem",
                "x5c": [other_pub],
            }),
            &other,
        );
        assert_eq!(rejected(&keys, &token), "bad signature");
    }

    #[test]
    fn crit_header_is_refused() {
        let keys = keys();
        let token = ed_forged(
            json!({"alg": "EdDSA", "kid": "k1", "crit": ["exp"], "exp": 1}),
            &ed_signing_key("ed25519.pem"),
        );
        assert_eq!(rejected(&keys, &token), "unsupported critical header");
    }

    #[test]
    fn signed_by_another_key_is_a_bad_signature() {
        let keys = keys();
        let token = ed_forged(
            json!({"alg": "EdDSA", "kid": "k1", "typ": "JWT"}),
            &ed_signing_key("ed25519-other.pem"),
        );
        assert_eq!(rejected(&keys, &token), "bad signature");
        // The fixtures hold one P-256 pair (and a P-384 key cannot sign
        // ES256), so an ES256 signature is spoiled by flipping a byte.
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
    fn base64url_decoding_is_strict() {
        assert_eq!(b64url_decode("").unwrap(), b"");
        assert_eq!(b64url_decode("YQ").unwrap(), b"a");
        assert_eq!(b64url_decode("YWI").unwrap(), b"ab");
        assert_eq!(b64url_decode("YWJj").unwrap(), b"abc");
        assert_eq!(b64url_decode("-_8").unwrap(), [0xfb, 0xff]);
        for bad in [
            "Y", "YQ==", "YWI=", "YR", "YWJ", "-_9", "YW+j", "YW/j", "YW j",
        ] {
            assert_eq!(b64url_decode(bad), None, "{bad}");
        }
        for len in 0..40u8 {
            let bytes: Vec<u8> = (0..len).map(|i| i.wrapping_mul(37) ^ 0xa5).collect();
            assert_eq!(b64url_decode(&b64url(&bytes)).unwrap(), bytes);
        }
    }

    /// `value` as base64url whose last character has spare low bits (the
    /// length is not a multiple of 4), made so by growing a field `x`.
    fn with_spare_bits(mut value: Value) -> String {
        loop {
            let text = b64url(value.to_string().as_bytes());
            if !text.len().is_multiple_of(4) {
                return text;
            }
            value["x"] = json!(format!("{}x", value["x"].as_str().unwrap_or_default()));
        }
    }

    /// `text` (from [`with_spare_bits`]) with its last character's lowest
    /// spare bit set: the same bytes to a lax decoder, refused by a strict one.
    fn with_trailing_bits(text: &str) -> String {
        let alphabet = base64::alphabet::URL_SAFE.as_str();
        let (head, last) = text.split_at(text.len() - 1);
        let value = alphabet.find(last).unwrap() | 1;
        format!("{head}{}", &alphabet[value..=value])
    }

    /// `header.payload`, signed by the real k1 key.
    fn k1_signed(header: &str, payload: &str) -> String {
        let message = format!("{header}.{payload}");
        let sig = jsonwebtoken::crypto::sign(
            message.as_bytes(),
            &ed_signing_key("ed25519.pem"),
            Algorithm::EdDSA,
        )
        .unwrap();
        format!("{message}.{sig}")
    }

    #[test]
    fn padded_or_non_canonical_segments_are_malformed() {
        let keys = keys();
        let header = with_spare_bits(json!({"alg": "EdDSA", "kid": "k1"}));
        let claims = with_spare_bits(good_claims());
        let token = k1_signed(&header, &claims);
        assert_eq!(keys.verify(&token, "doc:1").unwrap().fence, 7);
        let padded = |text: &str| format!("{text}{}", "=".repeat(4 - text.len() % 4));
        for (header, claims) in [
            (padded(&header), claims.clone()),
            (header.clone(), padded(&claims)),
            (with_trailing_bits(&header), claims.clone()),
            (header.clone(), with_trailing_bits(&claims)),
        ] {
            // Signed as presented, so only the encoding is wrong.
            let token = k1_signed(&header, &claims);
            assert_eq!(rejected(&keys, &token), "malformed token", "{token}");
        }
    }
}
