//! Who may use the lock API and the admin actions: the `[[auth.clients]]`.
//!
//! A client proves who it is with a bearer API key (`Authorization: Bearer
//! KEY`, stored in the config only as its SHA-256) or with a verified TLS
//! client certificate whose subject CN is its `tls_subject`. What it may do
//! is its lock-name globs and its `admin` flag.
//!
//! Choices, and why:
//! * **Keys are compared as hashes, in constant time**, against every
//!   client: the time an answer takes says nothing about how much of a key
//!   was right. Neither keys nor hashes are ever logged or echoed.
//! * **A bearer header that is present wins**: a wrong key is refused (401)
//!   even on a connection with a valid client certificate, since a client
//!   that sends the wrong key is confused or hostile.
//! * **A lease belongs to the client that acquired it.** Its id carries a
//!   tag derived from the client's name ([`Client::lease_tag`]), checked
//!   before the backend is asked: another client presenting the right lease
//!   id still gets 403. The tag is not a secret (the random part of the id
//!   is), and changing it only makes the id unknown to the backend.
//! * **With no clients configured the lock API is open**, for the zero-setup
//!   demo; `serve` warns when such a listener is reachable from elsewhere.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The configured clients.
#[derive(Debug, Clone, Default)]
pub struct Clients {
    clients: Vec<Client>,
}

/// One `[[auth.clients]]` entry.
#[derive(Clone)]
pub struct Client {
    pub name: String,
    /// SHA-256 of the bearer key.
    key_sha256: Option<[u8; 32]>,
    /// The CN of a verified client certificate that identifies this client.
    tls_subject: Option<String>,
    /// Lock names it may use: `*` is any run of characters, `?` one.
    locks: Vec<wildmatch::WildMatch>,
    /// May call admin actions.
    pub admin: bool,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key's hash.
        f.debug_struct("Client")
            .field("name", &self.name)
            .field("tls_subject", &self.tls_subject)
            .field("admin", &self.admin)
            .finish_non_exhaustive()
    }
}

/// Why a request is not allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No credential, or one no client has: 401.
    #[error("{0}")]
    Unauthenticated(&'static str),
    /// A known client asking for something it may not do: 403.
    #[error("{0}")]
    Forbidden(String),
    /// More than one `Authorization` header: 400, whoever they name.
    #[error("more than one Authorization header")]
    Ambiguous,
}

/// How a request identified itself.
#[derive(Debug, Clone, Copy)]
pub struct Credentials<'a> {
    /// The `Authorization` header, if any.
    pub authorization: Option<&'a http::HeaderValue>,
    /// The CN of the connection's verified client certificate, if any.
    pub tls_subject: Option<&'a str>,
}

impl Credentials<'static> {
    /// No credentials at all.
    pub const NONE: Credentials<'static> = Credentials {
        authorization: None,
        tls_subject: None,
    };
}

impl<'a> Credentials<'a> {
    /// A request's credentials: its one `Authorization` header, if any, and
    /// its connection's client certificate CN. More than one
    /// `Authorization` header is refused, whatever they hold: servers and
    /// libraries disagree on which one counts (the first, the last, or
    /// both joined), so an admin key sent with another client's key could
    /// be judged by one here and by the other elsewhere.
    pub fn of(
        headers: &'a http::HeaderMap,
        tls_subject: Option<&'a str>,
    ) -> Result<Self, AuthError> {
        Ok(Self {
            authorization: one_authorization(headers)?,
            tls_subject,
        })
    }
}

/// The request's `Authorization` header, if it has one; more than one is
/// [`AuthError::Ambiguous`].
pub fn one_authorization(
    headers: &http::HeaderMap,
) -> Result<Option<&http::HeaderValue>, AuthError> {
    if two_authorizations(headers) {
        return Err(AuthError::Ambiguous);
    }
    Ok(headers.get(http::header::AUTHORIZATION))
}

/// Whether the request has more than one `Authorization` header. Costs no
/// lookup unless some header of the request is repeated (its map then has
/// more values than names).
pub fn two_authorizations(headers: &http::HeaderMap) -> bool {
    headers.len() != headers.keys_len()
        && headers
            .get_all(http::header::AUTHORIZATION)
            .iter()
            .nth(1)
            .is_some()
}

impl Client {
    /// Builds a client from validated settings; `key_sha256_hex` is 64 hex
    /// digits, `locks` the globs.
    pub fn new(
        name: String,
        key_sha256_hex: Option<&str>,
        tls_subject: Option<String>,
        locks: &[String],
        admin: bool,
    ) -> Result<Self, String> {
        let key_sha256 = match key_sha256_hex {
            None => None,
            Some(h) => {
                let mut out = [0u8; 32];
                hex::decode_to_slice(h.trim(), &mut out)
                    .map_err(|_| "api_key_sha256 must be 64 hex digits (a SHA-256)".to_string())?;
                Some(out)
            }
        };
        if key_sha256.is_none() && tls_subject.is_none() {
            return Err("a client needs api_key_sha256 or tls_subject to authenticate".into());
        }
        Ok(Self {
            name,
            key_sha256,
            tls_subject,
            locks: locks.iter().map(|g| wildmatch::WildMatch::new(g)).collect(),
            admin,
        })
    }

    /// Whether this client may use the lock `name`.
    pub fn may_lock(&self, name: &str) -> bool {
        self.locks.iter().any(|g| g.matches(name))
    }

    /// The tag its lease ids carry: 8 hex digits of SHA-256 of its name.
    pub fn lease_tag(&self) -> String {
        lease_tag(&self.name)
    }
}

/// See [`Client::lease_tag`].
fn lease_tag(name: &str) -> String {
    hex::encode(&Sha256::digest(name.as_bytes())[..4])
}

/// The tag part of a lease id made by [`Clients::lease_id`], if any.
pub fn tag_of(lease: &str) -> Option<&str> {
    lease.split_once('.').map(|(tag, _)| tag)
}

impl Clients {
    pub fn new(clients: Vec<Client>) -> Self {
        Self { clients }
    }

    /// Whether any client is configured (else the lock API is open).
    pub fn enabled(&self) -> bool {
        !self.clients.is_empty()
    }

    /// Whether any client may call admin actions.
    pub fn any_admin(&self) -> bool {
        self.clients.iter().any(|c| c.admin)
    }

    /// The client a request comes from. `Ok(None)` when no clients are
    /// configured (open).
    pub fn authenticate(&self, creds: Credentials<'_>) -> Result<Option<&Client>, AuthError> {
        if self.clients.is_empty() {
            return Ok(None);
        }
        if let Some(header) = creds.authorization {
            let key = bearer(header).ok_or(AuthError::Unauthenticated(
                "the Authorization header is not 'Bearer KEY'",
            ))?;
            let hash: [u8; 32] = Sha256::digest(key).into();
            // Every client is compared, in constant time, whatever matched.
            let mut found = None;
            for c in &self.clients {
                if let Some(h) = &c.key_sha256 {
                    if bool::from(h.ct_eq(&hash)) && found.is_none() {
                        found = Some(c);
                    }
                }
            }
            return found
                .map(Some)
                .ok_or(AuthError::Unauthenticated("the bearer key is not known"));
        }
        if let Some(cn) = creds.tls_subject {
            if let Some(c) = self
                .clients
                .iter()
                .find(|c| c.tls_subject.as_deref() == Some(cn))
            {
                return Ok(Some(c));
            }
        }
        Err(AuthError::Unauthenticated(
            "a bearer key or a known client certificate is needed",
        ))
    }

    /// Whether `client` (authenticated; `None` when the API is open) may
    /// use the lock `name`.
    pub fn may_lock(client: Option<&Client>, name: &str) -> Result<(), AuthError> {
        match client {
            Some(c) if !c.may_lock(name) => Err(AuthError::Forbidden(format!(
                "client '{}' may not use the lock '{name}'",
                c.name
            ))),
            _ => Ok(()),
        }
    }

    /// Checks that `lease` was acquired by `client` (or that the API is
    /// open): another client's lease is 403, even with the right id.
    pub fn owns_lease(client: Option<&Client>, lease: &str) -> Result<(), AuthError> {
        match client {
            None => Ok(()),
            Some(c) if tag_of(lease) == Some(c.lease_tag().as_str()) => Ok(()),
            Some(c) => Err(AuthError::Forbidden(format!(
                "this lease was not acquired by client '{}'",
                c.name
            ))),
        }
    }

    /// A new lease id for `client`: its tag, a dot, then `random` (the
    /// secret part). Untagged when the API is open.
    pub fn lease_id(client: Option<&Client>, random: String) -> String {
        match client {
            Some(c) => format!("{}.{random}", c.lease_tag()),
            None => random,
        }
    }

    /// The admin client a request comes from: 401 without a known key, 403
    /// for a client without `admin`, and 403 when no admin client exists.
    pub fn admin(&self, creds: Credentials<'_>) -> Result<&Client, AuthError> {
        if !self.any_admin() {
            return Err(AuthError::Forbidden(
                "no [[auth.clients]] entry has admin = true, so admin actions are disabled".into(),
            ));
        }
        // Only bearer keys: the admin listener has no TLS.
        let creds = Credentials {
            tls_subject: None,
            ..creds
        };
        match self.authenticate(creds)? {
            Some(c) if c.admin => Ok(c),
            Some(c) => Err(AuthError::Forbidden(format!(
                "client '{}' may not call admin actions",
                c.name
            ))),
            None => unreachable!("clients exist, so authenticate names one or fails"),
        }
    }
}

/// The key of `Authorization: Bearer KEY` (scheme in any case, RFC 7235).
fn bearer(header: &http::HeaderValue) -> Option<&[u8]> {
    let v = header.as_bytes();
    let (scheme, rest) = v.split_at(v.iter().position(|b| *b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let key = rest.trim_ascii();
    (!key.is_empty()).then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(key: &str) -> String {
        hex::encode(Sha256::digest(key.as_bytes()))
    }

    fn clients() -> Clients {
        Clients::new(vec![
            Client::new(
                "billing".into(),
                Some(&sha("k-billing")),
                None,
                &["billing:*".into(), "doc:4?".into()],
                false,
            )
            .unwrap(),
            Client::new(
                "ops".into(),
                Some(&sha("k-ops")),
                Some("ops-host".into()),
                &["*".into()],
                true,
            )
            .unwrap(),
        ])
    }

    fn creds<'a>(auth: Option<&'a http::HeaderValue>, cn: Option<&'a str>) -> Credentials<'a> {
        Credentials {
            authorization: auth,
            tls_subject: cn,
        }
    }

    #[test]
    fn bearer_keys_and_certificates_identify_clients() {
        let c = clients();
        let good = http::HeaderValue::from_static("Bearer k-billing");
        let lower = http::HeaderValue::from_static("bearer   k-ops ");
        let wrong = http::HeaderValue::from_static("Bearer nope");
        let basic = http::HeaderValue::from_static("Basic azpi");
        assert_eq!(
            c.authenticate(creds(Some(&good), None))
                .unwrap()
                .unwrap()
                .name,
            "billing"
        );
        assert_eq!(
            c.authenticate(creds(Some(&lower), None))
                .unwrap()
                .unwrap()
                .name,
            "ops"
        );
        assert_eq!(
            c.authenticate(creds(None, Some("ops-host")))
                .unwrap()
                .unwrap()
                .name,
            "ops"
        );
        for bad in [
            creds(Some(&wrong), None),
            creds(Some(&wrong), Some("ops-host")),
            creds(Some(&basic), None),
            creds(None, Some("stranger")),
            creds(None, None),
        ] {
            assert!(
                matches!(c.authenticate(bad), Err(AuthError::Unauthenticated(_))),
                "{bad:?}"
            );
        }
        assert!(Clients::default()
            .authenticate(Credentials::NONE)
            .unwrap()
            .is_none());
    }

    #[test]
    fn lock_globs_leases_and_admin() {
        let c = clients();
        let billing = http::HeaderValue::from_static("Bearer k-billing");
        let ops = http::HeaderValue::from_static("Bearer k-ops");
        let b = creds(Some(&billing), None);
        let billing_client = c.authenticate(b).unwrap();
        assert!(Clients::may_lock(billing_client, "billing:invoice-7").is_ok());
        assert!(Clients::may_lock(billing_client, "doc:42").is_ok());
        for no in ["doc:420", "ops:x"] {
            assert!(matches!(
                Clients::may_lock(billing_client, no),
                Err(AuthError::Forbidden(_))
            ));
        }
        assert!(Clients::may_lock(None, "anything").is_ok());
        let lease = Clients::lease_id(billing_client, "abc".into());
        assert!(Clients::owns_lease(billing_client, &lease).is_ok());
        let ops_client = c.authenticate(creds(Some(&ops), None)).unwrap();
        assert!(matches!(
            Clients::owns_lease(ops_client, &lease),
            Err(AuthError::Forbidden(_))
        ));
        assert!(matches!(
            Clients::owns_lease(ops_client, "untagged"),
            Err(AuthError::Forbidden(_))
        ));
        assert!(Clients::owns_lease(None, &lease).is_ok());
        assert_eq!(c.admin(creds(Some(&ops), None)).unwrap().name, "ops");
        assert!(matches!(c.admin(b), Err(AuthError::Forbidden(_))));
        assert!(matches!(
            c.admin(creds(None, Some("ops-host"))),
            Err(AuthError::Unauthenticated(_))
        ));
        assert!(matches!(
            Clients::default().admin(Credentials::NONE),
            Err(AuthError::Forbidden(_))
        ));
    }

    #[test]
    fn debug_never_shows_the_key_hash() {
        let shown = format!("{:?}", clients());
        assert!(!shown.contains(&sha("k-billing")), "{shown}");
        assert!(shown.contains("billing"));
    }

    #[test]
    fn settings_are_checked() {
        assert!(Client::new("x".into(), Some("abc"), None, &[], false).is_err());
        assert!(Client::new("x".into(), None, None, &[], false).is_err());
    }
}
