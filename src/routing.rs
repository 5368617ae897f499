//! Route patterns and resource-key templates.
//!
//! Patterns use axum's syntax: literal segments, `{name}` for one segment and
//! `{*name}` for the rest of the path. Routes are tried in file order and the
//! first match wins, which is why this is a plain list and not a radix tree:
//! users reason about "the first route that matches", not about priorities.
//!
//! Captures are percent-decoded before they go into the resource key. If they
//! were not, `/docs/%61` and `/docs/a` would name one document at the upstream
//! but two keys at the gateway, and a stale holder could bypass its fence by
//! spelling the path differently.

use std::borrow::Cow;
use std::collections::BTreeSet;

/// One piece of a compiled path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `{name}`: exactly one non-empty segment.
    Param(String),
    /// `{*name}`: one or more remaining segments, joined with `/`.
    Rest(String),
}

/// A compiled path pattern such as `/docs/{id}`.
#[derive(Debug, Clone)]
pub struct PathPattern {
    segments: Vec<Segment>,
}

/// A compiled resource-key template such as `doc:{id}`.
#[derive(Debug, Clone)]
pub struct KeyTemplate {
    parts: Vec<KeyPart>,
}

#[derive(Debug, Clone)]
enum KeyPart {
    Literal(String),
    Capture(String),
}

/// Why a request path could not be matched safely.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathError {
    /// A capture decodes to bytes that are not UTF-8.
    NotUtf8,
    /// A `.` or `..` segment: upstreams resolve these differently, so the
    /// key the gateway computes could name another resource than the one the
    /// upstream writes.
    DotSegment,
}

/// Captured values of a matched path, in pattern order.
pub type Captures = Vec<(String, String)>;

impl PathPattern {
    /// Compiles a pattern; the error says what is wrong with it.
    pub fn parse(pattern: &str) -> Result<Self, String> {
        let Some(rest) = pattern.strip_prefix('/') else {
            return Err("must start with '/'".into());
        };
        let mut segments = Vec::new();
        let mut names = BTreeSet::new();
        let raw: Vec<&str> = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split('/').collect()
        };
        for (i, seg) in raw.iter().enumerate() {
            let last = i + 1 == raw.len();
            if let Some(inner) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                let (name, is_rest) = match inner.strip_prefix('*') {
                    Some(n) => (n, true),
                    None => (inner, false),
                };
                if !valid_name(name) {
                    return Err(format!(
                        "'{{{inner}}}' is not a valid capture (use letters, digits and '_')"
                    ));
                }
                if !names.insert(name.to_string()) {
                    return Err(format!("capture '{name}' appears twice"));
                }
                if is_rest {
                    if !last {
                        return Err(format!("'{{*{name}}}' must be the last segment"));
                    }
                    segments.push(Segment::Rest(name.to_string()));
                } else {
                    segments.push(Segment::Param(name.to_string()));
                }
            } else if seg.contains('{') || seg.contains('}') {
                return Err(format!(
                    "segment '{seg}' mixes text and a capture; a capture must be a whole segment"
                ));
            } else if seg.is_empty() && !last {
                return Err("contains an empty segment ('//')".into());
            } else {
                segments.push(Segment::Literal(seg.to_string()));
            }
        }
        Ok(Self { segments })
    }

    /// Names of the captures this pattern defines.
    pub fn capture_names(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Param(n) | Segment::Rest(n) => Some(n.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// Matches a request path (without query). `Ok(None)` means no match.
    pub fn matches(&self, path: &str) -> Result<Option<Captures>, PathError> {
        let Some(rest) = path.strip_prefix('/') else {
            return Ok(None);
        };
        let parts: Vec<&str> = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split('/').collect()
        };
        let mut captures = Vec::new();
        let mut i = 0;
        for seg in &self.segments {
            match seg {
                Segment::Literal(lit) => {
                    if parts.get(i).copied() != Some(lit.as_str()) {
                        return Ok(None);
                    }
                    i += 1;
                }
                Segment::Param(name) => match parts.get(i) {
                    Some(p) if !p.is_empty() => {
                        captures.push((name.clone(), decode_segment(p)?.into_owned()));
                        i += 1;
                    }
                    _ => return Ok(None),
                },
                Segment::Rest(name) => {
                    let tail = &parts[i.min(parts.len())..];
                    if tail.is_empty() || tail.iter().all(|p| p.is_empty()) {
                        return Ok(None);
                    }
                    let mut joined = String::new();
                    for (n, p) in tail.iter().enumerate() {
                        if n > 0 {
                            joined.push('/');
                        }
                        joined.push_str(&decode_segment(p)?);
                    }
                    captures.push((name.clone(), joined));
                    i = parts.len();
                }
            }
        }
        if i != parts.len() {
            return Ok(None);
        }
        Ok(Some(captures))
    }
}

impl KeyTemplate {
    /// Compiles a key template against the captures a pattern defines.
    pub fn parse(template: &str, pattern: &PathPattern) -> Result<Self, String> {
        if template.is_empty() {
            return Err("must not be empty".into());
        }
        let known: BTreeSet<&str> = pattern.capture_names().collect();
        let mut parts = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            match rest.find(['{', '}']) {
                None => {
                    parts.push(KeyPart::Literal(rest.to_string()));
                    break;
                }
                Some(pos) if rest.as_bytes()[pos] == b'}' => {
                    return Err("has a '}' without a matching '{'".into());
                }
                Some(pos) => {
                    if pos > 0 {
                        parts.push(KeyPart::Literal(rest[..pos].to_string()));
                    }
                    let after = &rest[pos + 1..];
                    let end = after
                        .find('}')
                        .ok_or_else(|| "has a '{' without a matching '}'".to_string())?;
                    let name = after[..end].trim_start_matches('*');
                    if !known.contains(name) {
                        let list: Vec<_> = known.iter().map(|n| format!("{{{n}}}")).collect();
                        return Err(format!(
                            "uses capture '{{{name}}}', which the route's path does not define (it defines: {})",
                            if list.is_empty() { "none".to_string() } else { list.join(", ") }
                        ));
                    }
                    parts.push(KeyPart::Capture(name.to_string()));
                    rest = &after[end + 1..];
                }
            }
        }
        Ok(Self { parts })
    }

    /// Renders the resource key from a match's captures.
    pub fn render(&self, captures: &Captures) -> String {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                KeyPart::Literal(l) => out.push_str(l),
                KeyPart::Capture(name) => {
                    if let Some((_, v)) = captures.iter().find(|(n, _)| n == name) {
                        out.push_str(v);
                    }
                }
            }
        }
        out
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
}

fn decode_segment(raw: &str) -> Result<Cow<'_, str>, PathError> {
    let decoded = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| PathError::NotUtf8)?;
    if decoded == "." || decoded == ".." {
        return Err(PathError::DotSegment);
    }
    Ok(decoded)
}

/// True when a raw request path has a `.` or `..` segment, encoded or not.
pub fn has_dot_segment(path: &str) -> bool {
    path.split('/').any(|seg| {
        let d = percent_encoding::percent_decode_str(seg).decode_utf8_lossy();
        d == "." || d == ".."
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, path: &str) -> Option<Captures> {
        PathPattern::parse(p).unwrap().matches(path).unwrap()
    }

    #[test]
    fn params_and_rest() {
        assert_eq!(
            m("/docs/{id}", "/docs/7"),
            Some(vec![("id".into(), "7".into())])
        );
        assert_eq!(m("/docs/{id}", "/docs/"), None);
        assert_eq!(m("/docs/{id}", "/docs/7/x"), None);
        assert_eq!(m("/docs/{id}", "/docs"), None);
        assert_eq!(
            m("/f/{*rest}", "/f/a/b/c"),
            Some(vec![("rest".into(), "a/b/c".into())])
        );
        assert_eq!(m("/f/{*rest}", "/f/"), None);
        assert_eq!(m("/", "/"), Some(vec![]));
        assert_eq!(m("/a", "/a/"), None);
    }

    #[test]
    fn captures_are_decoded() {
        assert_eq!(
            m("/docs/{id}", "/docs/%61%2Fb"),
            Some(vec![("id".into(), "a/b".into())])
        );
        let p = PathPattern::parse("/docs/{id}").unwrap();
        assert_eq!(p.matches("/docs/%2e%2E"), Err(PathError::DotSegment));
        assert_eq!(p.matches("/docs/%ff"), Err(PathError::NotUtf8));
    }

    #[test]
    fn bad_patterns() {
        for bad in [
            "docs",
            "/a/{*r}/b",
            "/a/x{id}",
            "/a/{id}/{id}",
            "/a/{}",
            "/a//b",
        ] {
            assert!(PathPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn templates() {
        let p = PathPattern::parse("/t/{tenant}/docs/{id}").unwrap();
        let k = KeyTemplate::parse("doc:{tenant}:{id}", &p).unwrap();
        let caps = p.matches("/t/acme/docs/9").unwrap().unwrap();
        assert_eq!(k.render(&caps), "doc:acme:9");
        assert!(KeyTemplate::parse("doc:{nope}", &p)
            .unwrap_err()
            .contains("{nope}"));
        assert!(KeyTemplate::parse("doc:{id", &p).is_err());
        assert!(KeyTemplate::parse("", &p).is_err());
    }
}
