//! Config text to its raw structures: TOML parsed, environment overrides
//! applied, unknown keys collected, then handed to `validate`.

use std::collections::BTreeMap;
use std::path::Path;

use super::raw::*;
use super::validate::Validator;
use super::*;

impl Config {
    /// Whether the lock API is open to the network: enabled, with no
    /// `[[auth.clients]]`, on a traffic listener that is not a loopback
    /// address. Worth a warning at start-up and after every reload.
    pub fn lock_api_open_to_network(&self) -> bool {
        self.locks.enabled && !self.auth.enabled() && !self.server.listen.ip().is_loopback()
    }

    /// Loads a config file with overrides from the given variables (the
    /// process's: `boot::load::process_env`).
    pub fn load_with_env(
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            problems: vec![ConfigProblem {
                key: "-".into(),
                why: format!("cannot read the file: {e}"),
            }],
        })?;
        Self::from_toml(&file, &text, env)
    }

    /// Parses and validates config text; `file` is used in messages.
    pub fn from_toml(
        file: &str,
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let fail = |problems| ConfigError {
            file: file.to_string(),
            problems,
        };
        let mut table: toml::Table = toml::from_str(text).map_err(|e| {
            fail(vec![ConfigProblem {
                key: "-".into(),
                why: format!("not valid TOML: {}", e.message()),
            }])
        })?;
        let env: Vec<(String, String)> = env.into_iter().collect();
        let overridden = apply_env_overrides(&mut table, env.iter().cloned()).map_err(fail)?;
        let describe = |key: String| match overridden.get(&key) {
            Some(var) => format!("{key} (from {var})"),
            None => key,
        };

        let mut unknown = Vec::new();
        let raw: Result<RawConfig, _> = serde_path_to_error::deserialize(
            serde_ignored::Deserializer::new(toml::Value::Table(table), &mut |p| {
                unknown.push(p.to_string())
            }),
        );
        let mut problems: Vec<ConfigProblem> = unknown
            .into_iter()
            .map(|k| ConfigProblem {
                key: describe(normalize_path(&k)),
                why: "unknown key".into(),
            })
            .collect();
        let raw = match raw {
            Ok(raw) => raw,
            Err(e) => {
                problems.push(ConfigProblem {
                    key: describe(normalize_path(&e.path().to_string())),
                    why: e.inner().to_string(),
                });
                return Err(fail(problems));
            }
        };
        let mut v = Validator {
            problems,
            deprecations: Vec::new(),
            describe: &describe,
        };
        let mut config = v.config(file, raw);
        if v.problems.is_empty() {
            config.deprecations = v.deprecations;
            Ok(config)
        } else {
            Err(fail(v.problems))
        }
    }
}

/// Turns serde's `routes.0.key` into `routes[0].key`.
pub(super) fn normalize_path(p: &str) -> String {
    let mut out = String::new();
    for seg in p.split('.') {
        if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) {
            out.push('[');
            out.push_str(seg);
            out.push(']');
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(seg);
        }
    }
    out
}

/// Applies `FENCEGATE__A__B=value` as `a.b = value`; a numeric segment
/// indexes an array (`FENCEGATE__ROUTES__0__UPSTREAM`). Values are read as
/// TOML when they parse as a TOML value (`5`, `true`, `["a"]`, `"quoted"`),
/// else taken as a plain string. Returns which dotted keys came from where.
pub(super) fn apply_env_overrides(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<BTreeMap<String, String>, Vec<ConfigProblem>> {
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect();
    vars.sort();
    let mut applied = BTreeMap::new();
    let mut problems = Vec::new();
    for (var, raw) in vars {
        let segments: Vec<String> = var[ENV_PREFIX.len()..]
            .split("__")
            .map(|s| s.to_ascii_lowercase())
            .collect();
        if segments.iter().any(|s| s.is_empty()) {
            problems.push(ConfigProblem {
                key: var.clone(),
                why: "malformed override variable name".into(),
            });
            continue;
        }
        let value = parse_env_value(&raw);
        let dotted = normalize_path(&segments.join("."));
        match set_path(table, &segments, value) {
            Ok(()) => {
                applied.insert(dotted, var);
            }
            Err(why) => problems.push(ConfigProblem {
                key: format!("{dotted} (from {var})"),
                why,
            }),
        }
    }
    if problems.is_empty() {
        Ok(applied)
    } else {
        Err(problems)
    }
}

pub(super) fn parse_env_value(raw: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

pub(super) fn set_path(
    table: &mut toml::Table,
    segments: &[String],
    value: toml::Value,
) -> Result<(), String> {
    let (first, rest) = segments.split_first().ok_or("empty key")?;
    if rest.is_empty() {
        table.insert(first.clone(), value);
        return Ok(());
    }
    let next_is_index = rest[0].bytes().all(|b| b.is_ascii_digit());
    let entry = table.entry(first.clone()).or_insert_with(|| {
        if next_is_index {
            toml::Value::Array(Vec::new())
        } else {
            toml::Value::Table(toml::Table::new())
        }
    });
    set_in_value(entry, rest, value)
}

pub(super) fn set_in_value(
    node: &mut toml::Value,
    segments: &[String],
    value: toml::Value,
) -> Result<(), String> {
    match node {
        toml::Value::Table(t) => set_path(t, segments, value),
        toml::Value::Array(items) => {
            let (idx, rest) = segments.split_first().ok_or("empty key")?;
            let i: usize = idx
                .parse()
                .map_err(|_| format!("'{idx}' is not an index into an array"))?;
            if i > items.len() {
                return Err(format!(
                    "index {i} skips entries: the array has {} entries",
                    items.len()
                ));
            }
            if i == items.len() {
                items.push(toml::Value::Table(toml::Table::new()));
            }
            if rest.is_empty() {
                items[i] = value;
                Ok(())
            } else {
                set_in_value(&mut items[i], rest, value)
            }
        }
        _ => Err("overrides a key that is not a table".into()),
    }
}
