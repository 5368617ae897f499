//! A config with what it names loaded: the traffic listener's certificate
//! and key, the JWT keys, each `https` upstream's trust roots. `config`
//! checks the text and hands over plain data; the files it points to are
//! read here, and their problems are reported in the config's own terms
//! (`file: key: why`), so an operator fixes both kinds in one place.

use std::path::Path;
use std::sync::Arc;

use crate::boot::tls::Tls;
use crate::config::{Config, ConfigError, ConfigProblem};
use crate::fencing::jwt::JwtKeys;

/// A validated config and what it names, loaded.
pub struct Loaded {
    /// Every route's upstream has its TLS loaded.
    pub config: Config,
    /// `[server.tls]`, when the traffic listener speaks HTTPS.
    pub tls: Option<Arc<Tls>>,
    /// `[tokens]`: verifies JWT fence tokens and signs grants.
    pub jwt: Option<Arc<JwtKeys>>,
}

/// The process's environment, as the config reads it: `vars_os`, not
/// `vars`, which panics on a variable that is not UTF-8 (an unrelated
/// variable must not crash the gateway).
pub fn process_env() -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// Loads a config file, overridden by the process's environment, and what
/// it names.
pub fn load(path: &Path) -> Result<Loaded, ConfigError> {
    let env = process_env();
    complete(Config::load_with_env(path, env.iter().cloned())?, &env)
}

/// [`load`] of config text; `file` names it in messages.
pub fn from_toml(
    file: &str,
    text: &str,
    env: Vec<(String, String)>,
) -> Result<Loaded, ConfigError> {
    complete(Config::from_toml(file, text, env.iter().cloned())?, &env)
}

/// Loads what a validated config names; `env` holds the secrets that
/// `[[tokens.keys]] secret_env` names. Every problem is reported at once.
pub fn complete(mut config: Config, env: &[(String, String)]) -> Result<Loaded, ConfigError> {
    let mut problems = Vec::new();
    let mut problem = |key: String, why: String| problems.push(ConfigProblem { key, why });
    let tls = match &config.server.tls {
        None => None,
        Some(files) => match Tls::load(files, config.server.http2.is_some()) {
            Ok(t) => Some(Arc::new(t)),
            Err(why) => {
                problem("server.tls".into(), why);
                None
            }
        },
    };
    let jwt = match &config.tokens {
        None => None,
        Some(settings) => {
            let lookup = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            match JwtKeys::load(settings, &lookup) {
                Ok(k) => Some(Arc::new(k)),
                Err(found) => {
                    found.into_iter().for_each(|(key, why)| problem(key, why));
                    None
                }
            }
        }
    };
    for (i, route) in config.routes.iter_mut().enumerate() {
        if let Err(why) = route.upstream.load_tls() {
            let u = &route.upstream;
            let url = format!("{}://{}{}", u.scheme, u.authority, u.base_path);
            problem(format!("routes[{i}].upstream"), format!("'{url}' {why}"));
        }
    }
    if problems.is_empty() {
        Ok(Loaded { config, tls, jwt })
    } else {
        Err(ConfigError {
            file: config.source.clone(),
            problems,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::fencing::jwt::tests::{env, hs_key, SECRET};
    use crate::fencing::jwt::{JwtKeys, TokensSettings};

    #[test]
    fn the_config_loader_takes_hs256_secrets_from_the_environment_it_is_given() {
        const VAR: &str = "FENCEGATE_TEST_INJECTED_HS256_SECRET";
        assert!(
            std::env::var_os(VAR).is_none(),
            "{VAR} is set in the process"
        );
        let text = format!(
            r#"
            [tokens]
            signing_kid = "h1"
            [[tokens.keys]]
            kid = "h1"
            algorithm = "HS256"
            secret_env = "{VAR}"
            "#
        );
        let tokens = |secret: Option<&str>| {
            let env = secret.map(|s| (VAR.to_owned(), s.to_owned()));
            super::from_toml("t.toml", &text, env.into_iter().collect()).map(|l| l.jwt.unwrap())
        };
        let err = tokens(None).unwrap_err().to_string();
        assert!(
            err.contains(&format!("tokens.keys[0].secret_env: {VAR} is not set")),
            "{err}"
        );

        // Tokens signed with the injected secret verify with a key holding
        // the same secret (HS_SECRET is SECRET), and with no other.
        let verifier = JwtKeys::load(
            &TokensSettings {
                keys: vec![hs_key("h1", "HS_SECRET")],
                ..TokensSettings::default()
            },
            &env,
        )
        .unwrap();
        let now = chrono::Utc::now().timestamp();
        let signer = tokens(Some(SECRET)).unwrap();
        let token = signer.sign("doc:1", 3, now, now + 60).unwrap();
        assert_eq!(verifier.verify(&token, "doc:1").unwrap().fence, 3);
        let other = tokens(Some(&SECRET.replace('0', "1"))).unwrap();
        let token = other.sign("doc:1", 3, now, now + 60).unwrap();
        assert_eq!(
            verifier.verify(&token, "doc:1"),
            Err(crate::fencing::jwt::JwtRejection::Invalid(
                "bad signature".into()
            ))
        );
    }
}
