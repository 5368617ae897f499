//! The documentation stays true to the code: every key the config loader
//! accepts is in the configuration reference, every metric the gateway
//! exports is in the metrics reference (with its type and labels), and
//! every relative link in README.md and docs/ leads to a file, and a
//! heading, that exist.
//!
//! The truth comes from the code, never from a list kept here: the config
//! keys from the loader's own structs (`config::accepted_keys`), checked
//! key by key against the loader's unknown-key report; the metrics from a
//! real gateway's `/metrics`, which declares every family it registered,
//! those with no series yet included.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use fencegate::config::Config;

use crate::deploy::busy_gateway_metrics;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A Markdown file's text outside fenced code blocks, line by line with
/// line numbers (from 1): code examples are not documentation of keys,
/// and their `[x](y)` is no link.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// The code spans of a line, in order.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

/// The cells of a table row (`| a | b |`), trimmed; an escaped `\|` does
/// not split a cell.
fn cells(line: &str) -> Option<Vec<String>> {
    let row = line.trim().strip_prefix('|')?.strip_suffix('|')?;
    let mut out = vec![String::new()];
    let mut chars = row.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => out.last_mut().unwrap().push('|'),
            '|' => out.push(String::new()),
            c => out.last_mut().unwrap().push(c),
        }
    }
    Some(out.iter().map(|c| c.trim().to_string()).collect())
}

/// The cell's text if it is one code span and nothing else.
fn only_code(cell: &str) -> Option<&str> {
    cell.strip_prefix('`')?
        .strip_suffix('`')
        .filter(|c| !c.contains('`'))
}

// ---------------------------------------------------------------------------
// Config keys

const CONFIG_MD: &str = "docs/reference/config.md";

/// The keys the configuration reference documents, in the loader's
/// notation, each with its line: a table row whose first cell is a key,
/// under a heading that names its section (`[store]` gives `store.KEY`,
/// `[[routes]]` gives `routes[].KEY`). A heading without a section ends
/// the one before.
fn documented_keys() -> BTreeMap<String, usize> {
    let text = read(&repo().join(CONFIG_MD));
    let mut section: Option<String> = None;
    let mut keys = BTreeMap::new();
    for (n, line) in prose(&text) {
        if line.starts_with('#') {
            section = code_spans(line).into_iter().find_map(|span| {
                let array = span.strip_prefix("[[").and_then(|s| s.strip_suffix("]]"));
                let table = span.strip_prefix('[').and_then(|s| s.strip_suffix(']'));
                match (array, table) {
                    (Some(name), _) => Some(format!("{name}[]")),
                    (None, Some(name)) => Some(name.to_string()),
                    _ => None,
                }
            });
            continue;
        }
        let (Some(section), Some(row)) = (&section, cells(line)) else {
            continue;
        };
        if let Some(key) = row.first().and_then(|c| only_code(c)) {
            if key
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            {
                keys.insert(format!("{section}.{key}"), n);
            }
        }
    }
    keys
}

/// Whether the loader takes `key` (in `accepted_keys`' notation) as a key
/// of its own: set alone, through its environment override, it may be
/// refused for its value, but is not reported as an unknown key.
fn loader_accepts(key: &str) -> bool {
    let var = key
        .split('.')
        .map(|seg| match seg.strip_suffix("[]") {
            Some(array) => format!("{}__0", array.to_ascii_uppercase()),
            None => seg.to_ascii_uppercase(),
        })
        .collect::<Vec<_>>()
        .join("__");
    let env = [(format!("FENCEGATE__{var}"), "1".to_string())];
    match Config::from_toml("probe.toml", "", env) {
        Ok(_) => true,
        Err(e) => !e.problems.iter().any(|p| p.why == "unknown key"),
    }
}

#[test]
fn the_config_reference_documents_every_key_the_loader_accepts() {
    let listed = fencegate::config::accepted_keys().expect("the config structs can be listed");
    // The listing is read from the loader's structs; the loader itself
    // must agree with it key by key, and must refuse a key it lacks, or
    // probing would prove nothing.
    for key in &listed {
        assert!(
            loader_accepts(key),
            "{key} is listed, but the loader reports it as unknown"
        );
    }
    assert!(
        !loader_accepts("store.no_such_key"),
        "probing tells no key apart"
    );

    let documented = documented_keys();
    let mut wrong = Vec::new();
    for key in listed.iter().filter(|k| !documented.contains_key(*k)) {
        wrong.push(format!(
            "{key} is accepted, but {CONFIG_MD} has no row for it under its section's heading"
        ));
    }
    for (key, line) in &documented {
        if !loader_accepts(key) {
            wrong.push(format!(
                "{CONFIG_MD}:{line}: {key} is reported as an unknown key"
            ));
        } else if !listed.contains(key) {
            wrong.push(format!(
                "{CONFIG_MD}:{line}: {key} is accepted, but config::accepted_keys misses it"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---------------------------------------------------------------------------
// Metrics

const METRICS_MD: &str = "docs/reference/metrics.md";

/// One metric as exported or as documented.
#[derive(Debug, Default)]
struct Metric {
    /// `counter`, `gauge` or `histogram`.
    kind: String,
    labels: BTreeSet<String>,
}

/// Every metric family a scrape declares, under the name a query uses
/// (counters with their `_total`), with the label names its series carry
/// (a histogram's `le` aside).
fn exported(text: &str) -> BTreeMap<String, Metric> {
    let mut families = BTreeMap::new();
    for decl in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let mut parts = decl.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        families.insert(name.to_string(), kind.to_string());
    }
    let mut metrics = BTreeMap::new();
    for (family, kind) in &families {
        let name = match kind.as_str() {
            "counter" => format!("{family}_total"),
            _ => family.clone(),
        };
        let mut labels = BTreeSet::new();
        for sample in text.lines().filter(|l| !l.starts_with('#')) {
            let end = sample.find(['{', ' ']).unwrap_or(sample.len());
            let of_family = sample[..end]
                .strip_prefix(family.as_str())
                .is_some_and(|s| {
                    ["", "_total", "_bucket", "_sum", "_count", "_created"].contains(&s)
                });
            let set = sample[end..]
                .strip_prefix('{')
                .and_then(|s| s.split_once('}'));
            if let (true, Some((set, _))) = (of_family, set) {
                let names = set
                    .split(',')
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, _)| k);
                labels.extend(names.filter(|k| *k != "le").map(str::to_string));
            }
        }
        let kind = kind.clone();
        metrics.insert(name, Metric { kind, labels });
    }
    metrics
}

/// The metrics reference's table: the metric, its type, and the label
/// names its labels cell lists, with the row's line.
fn documented_metrics() -> BTreeMap<String, (Metric, usize)> {
    let text = read(&repo().join(METRICS_MD));
    let mut out = BTreeMap::new();
    for (n, line) in prose(&text) {
        let Some(row) = cells(line) else { continue };
        let Some(name) = row.first().and_then(|c| only_code(c)) else {
            continue;
        };
        if name.starts_with("fencegate_") && row.len() >= 3 {
            let labels = code_spans(&row[2])
                .into_iter()
                .map(str::to_string)
                .collect();
            let kind = row[1].clone();
            out.insert(name.to_string(), (Metric { kind, labels }, n));
        }
    }
    out
}

#[tokio::test]
async fn the_metrics_reference_documents_every_metric_the_gateway_exports() {
    let exported = exported(&busy_gateway_metrics().await);
    assert!(
        exported.len() > 5,
        "a scrape declares the metrics: {exported:?}"
    );

    let documented = documented_metrics();
    let mut wrong = Vec::new();
    for (name, metric) in &exported {
        let Some((doc, line)) = documented.get(name) else {
            wrong.push(format!(
                "{name} ({}) is exported, but {METRICS_MD} has no row for it",
                metric.kind
            ));
            continue;
        };
        if doc.kind != metric.kind {
            wrong.push(format!(
                "{METRICS_MD}:{line}: {name} is a {}, documented as '{}'",
                metric.kind, doc.kind
            ));
        }
        for label in metric.labels.difference(&doc.labels) {
            wrong.push(format!(
                "{METRICS_MD}:{line}: {name}'s label {label} is not documented"
            ));
        }
    }
    for (name, (_, line)) in &documented {
        if !exported.contains_key(name) {
            wrong.push(format!(
                "{METRICS_MD}:{line}: {name} is not exported by /metrics"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---------------------------------------------------------------------------
// Links

/// README.md and every Markdown file under docs/.
fn doc_files() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md")];
    let mut dirs = vec![repo().join("docs")];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The anchors GitHub gives a Markdown file's headings: the heading's text
/// without its markup, lower-cased, spaces as `-`, punctuation dropped but
/// `-` and `_`; a repeated one gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeMap::<String, usize>::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        if !line.starts_with('#') {
            continue;
        }
        let Some(title) = line.trim_start_matches('#').strip_prefix(' ') else {
            continue;
        };
        let text = link_texts(title);
        let slug: String = text
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

/// `[text](target)` as its text alone.
fn link_texts(s: &str) -> String {
    let mut out = s.to_string();
    while let Some((open, mid, close)) = next_link(&out) {
        let text = out[open + 1..mid].to_string();
        out.replace_range(open..=close, &text);
    }
    out
}

/// The next inline link `[text](target)` in `s`: the positions of its
/// `[`, of the `]` before `(`, and of its closing `)`.
fn next_link(s: &str) -> Option<(usize, usize, usize)> {
    let mid = s.find("](")?;
    let open = s[..mid].rfind('[')?;
    let close = mid + s[mid..].find(')')?;
    Some((open, mid, close))
}

/// The relative link targets in a Markdown file's prose (code spans and
/// code blocks left out), each with its line.
fn relative_links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_code = false;
    for (n, line) in prose(text) {
        // Code spans may wrap: the backticks' parity carries over lines.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i > 0 {
                in_code = !in_code;
            }
            if !in_code {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some((_, mid, close)) = next_link(rest) {
            let target = rest[mid + 2..close].split_whitespace().next().unwrap_or("");
            let target = target.trim_start_matches('<').trim_end_matches('>');
            if !target.contains("://") && !target.starts_with("mailto:") {
                out.push((n, target.to_string()));
            }
            rest = &rest[close + 1..];
        }
    }
    out
}

#[test]
fn relative_links_in_the_docs_resolve() {
    let files = doc_files();
    let mut broken = Vec::new();
    let mut indexed = BTreeSet::new();
    let index = repo().join("docs/README.md");
    for file in &files {
        let text = read(file);
        let shown = file
            .strip_prefix(repo())
            .unwrap_or(file)
            .display()
            .to_string();
        for (line, link) in relative_links(&text) {
            let (path, anchor) = match link.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.as_str(), None),
            };
            let target = match path {
                "" => file.clone(),
                p => file.parent().expect("a directory").join(p),
            };
            let Ok(target) = target.canonicalize() else {
                broken.push(format!("{shown}:{line}: {link}: no such file"));
                continue;
            };
            if *file == index {
                indexed.insert(target.clone());
            }
            let Some(anchor) = anchor else { continue };
            if target.extension().is_none_or(|e| e != "md") {
                broken.push(format!(
                    "{shown}:{line}: {link}: an anchor into a file that is not Markdown"
                ));
            } else if !anchors(&read(&target)).contains(anchor) {
                broken.push(format!(
                    "{shown}:{line}: {link}: no heading has the anchor #{anchor}"
                ));
            }
        }
    }
    for file in files
        .iter()
        .filter(|f| f.starts_with(repo().join("docs")) && **f != index)
    {
        let page = file.canonicalize().expect("a page that exists");
        if !indexed.contains(&page) {
            let shown = file.strip_prefix(repo().join("docs")).unwrap_or(file);
            broken.push(format!("docs/README.md does not list {}", shown.display()));
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
