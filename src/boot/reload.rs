//! Configuration reload on SIGHUP: re-read the config file, check it with
//! the same validator as `fencegate check-config`, and swap what can change
//! under running traffic.
//!
//! [`Live`] is what changes: routes, token keys, auth clients and the
//! access-log switch, swapped in one atomic step ([`arc_swap`]), so a new
//! request sees either the old config or the new one, never a mix. A
//! request takes the current `Live` when it arrives and keeps it to its end:
//! requests in flight finish on the config they started with. The lock
//! API's signing keys and the TLS files are swapped just before (new
//! connections get the new certificate).
//!
//! A config with problems changes nothing: every problem is logged and the
//! reload is counted as an error. So is a change to a setting only a restart
//! can apply (a listener, the store, the lock backend, worker threads, the
//! log format): the log names each one.
//!
//! A reload never changes a fenced route's **key identity**, what its
//! writes are fenced under: its path pattern, key template, `paths` and
//! `key_case` ([`key_identity_changes`]). Were it changed, a write in
//! flight under the old key (token 100) and an older holder's write under
//! the new key, which has no recorded token yet (token 1), would both be
//! admitted, and the upstream could apply 1 after 100. Such a reload is
//! refused as a whole and counted as `refused`; the log names the route
//! and what changed. Changing key identity is an operator's step, with
//! the writers stopped and a restart (docs/operations/reload.md).

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::{Config, PathsMode, Route};
use crate::gateway::live::{Live, Shared};
use crate::metrics::{Metrics, ReloadResult};

/// Applies reloads of one config file to a running gateway.
pub struct Reloader {
    path: PathBuf,
    /// The running config's settings that only a restart can change.
    fixed: Vec<(&'static str, String)>,
    live: Shared,
    /// The lock service, for its signing keys.
    locks: Option<crate::locks::LockService>,
    /// The traffic listener's TLS, for its files.
    tls: Option<Arc<crate::boot::tls::Tls>>,
    metrics: Metrics,
    /// Where a longer route timeout is recorded before it applies: a
    /// restart after a crash waits that long (`FenceStore::begin_run`).
    store: crate::store::FenceStore,
}

/// The settings a reload cannot change, each with its current value.
fn fixed(c: &Config) -> Vec<(&'static str, String)> {
    let s = &c.server;
    vec![
        ("server.listen", s.listen.to_string()),
        ("server.admin_listen", s.admin_listen.to_string()),
        ("server.max_body_bytes", s.max_body_bytes.to_string()),
        (
            "server.header_read_timeout_ms",
            format!("{:?}", s.header_read_timeout),
        ),
        ("server.max_connections", s.max_connections.to_string()),
        (
            "server.shutdown_grace_ms",
            format!("{:?}", s.shutdown_grace),
        ),
        ("server.workers", s.workers.to_string()),
        ("server.tls (on or off)", s.tls.is_some().to_string()),
        (
            "server.http2 (and its h2_* limits)",
            format!("{:?}", s.http2),
        ),
        ("[store]", format!("{:?}", c.store)),
        ("[locks]", format!("{:?}", c.locks)),
        ("[demo]", format!("{:?}", c.demo)),
        ("log.format", format!("{:?}", c.log.format)),
    ]
}

impl Reloader {
    pub fn new(
        config: &Config,
        live: Shared,
        locks: Option<crate::locks::LockService>,
        tls: Option<Arc<crate::boot::tls::Tls>>,
        metrics: Metrics,
        store: crate::store::FenceStore,
    ) -> Self {
        Self {
            path: PathBuf::from(&config.source),
            fixed: fixed(config),
            live,
            locks,
            tls,
            metrics,
            store,
        }
    }

    /// Re-reads the file and applies it; on any problem, changes nothing
    /// and answers every problem.
    pub async fn reload(&self) -> Result<(), NotReloaded> {
        let result = self.try_reload().await;
        self.metrics.config_reload(match &result {
            Ok(()) => ReloadResult::Ok,
            Err(e) => e.result(),
        });
        result
    }

    async fn try_reload(&self) -> Result<(), NotReloaded> {
        let loaded = crate::boot::load::load(&self.path).map_err(|e| NotReloaded {
            problems: e.to_string().lines().map(str::to_string).collect(),
            key_identity: Vec::new(),
        })?;
        let config = &loaded.config;
        let restart: Vec<String> = fixed(config)
            .into_iter()
            .zip(&self.fixed)
            .filter(|(new, old)| new.1 != old.1)
            .map(|(new, _)| format!("{}: changed, and only a restart applies it", new.0))
            .collect();
        let running = self.live.load();
        let old: Vec<&Route> = running.routes.iter().map(|r| &r.route).collect();
        let key_identity = key_identity_changes(&old, &config.routes);
        if !restart.is_empty() || !key_identity.is_empty() {
            return Err(NotReloaded {
                problems: restart,
                key_identity,
            });
        }
        // Writes may run as long as the longest route timeout from now on:
        // a crash after this must be waited out that long, so the store
        // hears of it first.
        let new_longest = config.routes.iter().map(|r| r.timeout).max();
        if new_longest > old.iter().map(|r| r.timeout).max() {
            let new_longest = new_longest.unwrap_or_default();
            if let Err(e) = self.store.raise_run_bound(new_longest).await {
                return Err(NotReloaded {
                    problems: vec![format!(
                        "the store could not record the longer route timeout: {e}"
                    )],
                    key_identity: Vec::new(),
                });
            }
        }
        if let (Some(tls), Some(new)) = (&self.tls, &loaded.tls) {
            tls.adopt(new);
        }
        if let Some(locks) = &self.locks {
            locks.set_signing_keys(loaded.jwt.clone());
        }
        self.live.store(Arc::new(Live::new(
            config,
            loaded.jwt.clone(),
            &self.metrics,
        )));
        warn_if_open(config);
        Ok(())
    }
}

/// Why a reload applied nothing.
#[derive(Debug)]
pub struct NotReloaded {
    /// The new config's problems, and the settings only a restart applies.
    pub problems: Vec<String>,
    /// The fenced routes whose key identity the new config would change.
    pub key_identity: Vec<KeyIdentityChange>,
}

impl NotReloaded {
    /// How it is counted: `refused` when it would change a route's key
    /// identity (whatever else is wrong with it), else `error`.
    pub fn result(&self) -> ReloadResult {
        if self.key_identity.is_empty() {
            ReloadResult::Error
        } else {
            ReloadResult::Refused
        }
    }
}

/// A fenced route whose resource keys a reload would form differently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyIdentityChange {
    /// The route's name in the new config.
    pub route: String,
    /// What changed, from what to what.
    pub change: String,
}

impl std::fmt::Display for KeyIdentityChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "route '{}': {}", self.route, self.change)
    }
}

/// What a route's resource keys are made of, setting by setting, as
/// written in the config: the path pattern, the key template, `paths` and
/// `key_case`. Compared as written: a respelling that means the same
/// (another capture name) is a change too; telling meanings apart is not
/// worth a fork of a key's history.
fn key_identity(r: &Route) -> [(&'static str, String); 4] {
    let paths = match r.paths {
        PathsMode::Strict => "strict",
        PathsMode::AsIs => "as-is",
    };
    let case = if r.key.is_lower_cased() {
        "lower"
    } else {
        "preserve"
    };
    [
        ("path pattern", r.path.clone()),
        ("key template", r.key.source().to_string()),
        ("paths", paths.to_string()),
        ("key_case", case.to_string()),
    ]
}

/// Every change of a fenced route's key identity from the running routes
/// `old` to `new`, which a reload refuses. (Every route is fenced: the
/// config needs at least one fenced method per route.)
///
/// Routes are matched by name. A route only in `old` (removed) or only in
/// `new` (added) changes no key identity by itself, with one exception: a
/// route only in `new` that has the path pattern or the key template of a
/// route only in `old` cannot be told from that route renamed, so it is
/// held to the same rule. A pure rename (all four settings equal) passes;
/// one that also changes a setting is refused.
pub fn key_identity_changes(old: &[&Route], new: &[Route]) -> Vec<KeyIdentityChange> {
    let named = |name: &str| old.iter().find(|r| r.name == name);
    let kept = |name: &str| new.iter().any(|r| r.name == name);
    let mut changes = Vec::new();
    for r in new {
        let (before, renamed) = match named(&r.name) {
            Some(before) => (*before, None),
            None => {
                let (path, key) = (r.path.as_str(), r.key.source());
                let Some(before) = old
                    .iter()
                    .find(|o| !kept(&o.name) && (o.path == path || o.key.source() == key))
                else {
                    continue;
                };
                (*before, Some(before.name.as_str()))
            }
        };
        let (was, is) = (key_identity(before), key_identity(r));
        for ((what, from), (_, to)) in was.iter().zip(&is) {
            if from == to {
                continue;
            }
            let change = match renamed {
                None => format!("{what} changed from '{from}' to '{to}'"),
                Some(old_name) => format!(
                    "{what} changed from '{from}' to '{to}' (it replaces route '{old_name}', whose path pattern or key template it has: a rename cannot be told from a new route taking over the old one's resources)"
                ),
            };
            changes.push(KeyIdentityChange {
                route: r.name.clone(),
                change,
            });
        }
    }
    changes
}

/// Warns when `config` leaves the lock API open to the network (see
/// [`Config::lock_api_open_to_network`]): at start-up, and after a reload
/// that removed the last client.
pub fn warn_if_open(config: &Config) {
    if config.lock_api_open_to_network() {
        tracing::warn!(
            listen = %config.server.listen,
            "the lock API is open to anyone who can reach this listener: no [[auth.clients]] are configured"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The routes of a config made of `routes` (`[[routes]]` entries).
    fn routes(routes: &str) -> Vec<Route> {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:8080\"\nadmin_listen = \"127.0.0.1:9090\"\n\
             [store]\nurl = \"sqlite://x.db\"\n{routes}"
        );
        Config::from_toml("t.toml", &text, Vec::new())
            .unwrap()
            .routes
    }

    /// A `[[routes]]` entry: `extra` are more of its lines.
    fn route(name: &str, path: &str, key: &str, extra: &str) -> String {
        format!(
            "[[routes]]\nname = \"{name}\"\npath = \"{path}\"\n\
             upstream = \"http://127.0.0.1:9000\"\nkey = \"{key}\"\n{extra}"
        )
    }

    fn changes(old: &str, new: &str) -> Vec<String> {
        let old = routes(old);
        let old: Vec<&Route> = old.iter().collect();
        key_identity_changes(&old, &routes(new))
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// Each of the four settings of a kept route's key identity is a
    /// change, named with its route; anything else (a timeout, the
    /// upstream, the methods, the token kind, another route added or one
    /// removed) is not, and neither is a pure rename. A renamed route that
    /// also changes a setting cannot be told from a new route taking over
    /// the old one's resources: a change too.
    #[test]
    fn only_a_fenced_routes_key_identity_counts_as_a_change() {
        let docs = route("docs", "/docs/{id}", "doc:{id}", "");
        let other = route("other", "/other/{id}", "other:{id}", "");
        for (new, what) in [
            (
                route("docs", "/docs/{id}", "document:{id}", ""),
                "key template changed from 'doc:{id}' to 'document:{id}'",
            ),
            (
                route("docs", "/v2/docs/{id}", "doc:{id}", ""),
                "path pattern changed from '/docs/{id}' to '/v2/docs/{id}'",
            ),
            (
                route("docs", "/docs/{id}", "doc:{id}", "paths = \"as-is\"\n"),
                "paths changed from 'strict' to 'as-is'",
            ),
            (
                route("docs", "/docs/{id}", "doc:{id}", "key_case = \"lower\"\n"),
                "key_case changed from 'preserve' to 'lower'",
            ),
            (
                route("docs", "/docs/{doc}", "doc:{doc}", ""),
                "path pattern changed from '/docs/{id}' to '/docs/{doc}'",
            ),
        ] {
            let found = changes(&format!("{docs}{other}"), &format!("{new}{other}"));
            assert_eq!(
                found.len(),
                if what.contains("{doc}") { 2 } else { 1 },
                "{found:?}"
            );
            assert_eq!(found[0], format!("route 'docs': {what}"));
        }
        for harmless in [
            route("docs", "/docs/{id}", "doc:{id}", "timeout_ms = 100\n"),
            route(
                "docs",
                "/docs/{id}",
                "doc:{id}",
                "methods = [\"PUT\"]\nidempotency = \"optional\"\n",
            ),
            route("docs", "/docs/{id}", "doc:{id}", "")
                + &route("new", "/new/{id}", "new:{id}", ""),
            route("renamed", "/docs/{id}", "doc:{id}", ""),
        ] {
            assert_eq!(
                changes(&format!("{docs}{other}"), &format!("{harmless}{other}")),
                Vec::<String>::new()
            );
        }
        assert_eq!(
            changes(&format!("{docs}{other}"), &docs),
            Vec::<String>::new(),
            "a removed route"
        );
        for renamed in [
            route("documents", "/docs/{id}", "document:{id}", ""),
            route("documents", "/documents/{id}", "doc:{id}", ""),
        ] {
            let found = changes(&format!("{docs}{other}"), &format!("{renamed}{other}"));
            assert_eq!(found.len(), 1, "{found:?}");
            assert!(found[0].starts_with("route 'documents': "), "{found:?}");
            assert!(found[0].contains("it replaces route 'docs'"), "{found:?}");
        }
        // A new route beside the kept one, with its key template: no
        // rename, since the route it would replace is still there.
        let beside = format!("{docs}{}", route("more", "/more/{id}", "doc:{id}", ""));
        assert_eq!(changes(&docs, &beside), Vec::<String>::new());
    }
}
