//! Route patterns and resource-key templates.
//!
//! Patterns use axum's syntax: literal segments, `{name}` for one segment and
//! `{*name}` for the rest of the path. Routes are tried in file order and the
//! first match wins, which is why this is a plain list and not a radix tree:
//! users reason about "the first route that matches", not about priorities.
//!
//! Captures are percent-decoded before they go into the resource key, and
//! literal segments are compared decoded. If they were not, `/docs/%61` and
//! `/docs/a` would name one document at the upstream but two keys at the
//! gateway, and a stale holder could bypass its fence by spelling the path
//! differently.
//!
//! Decoding is not enough on its own: back ends disagree on what some
//! spellings mean (`/a;x=1` is `/a` to a servlet container, `%2F` is a `/` to
//! some and a character to others, `//` is merged by nginx, `\` is a `/` to
//! IIS). [`ambiguity`] names such a spelling, so that a fenced write using
//! one is refused rather than fenced under a key that may not be the
//! resource the upstream writes. Key parts read from the query or a header
//! are refused on the same grounds when missing, repeated or ambiguous
//! ([`KeyPartError`]).

use std::borrow::Cow;
use std::collections::BTreeSet;

use http::header::{HeaderMap, HeaderName};

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
    /// Literal segments match in any ASCII case (`key_case = "lower"`: the
    /// upstream resolves paths case-insensitively).
    ignore_case: bool,
}

/// A compiled resource-key template such as `doc:{id}`.
#[derive(Debug, Clone)]
pub struct KeyTemplate {
    parts: Vec<KeyPart>,
    /// `key_case = "lower"`: the rendered key is lower-cased.
    lower: bool,
    /// The template as written in the config.
    source: String,
}

#[derive(Debug, Clone)]
enum KeyPart {
    Literal(String),
    Capture(String),
    /// `{query.NAME}`: the decoded value of query parameter NAME.
    Query(String),
    /// `{header.NAME}`: the value of header NAME.
    Header(HeaderName),
}

/// What a key template reads from a request besides the path's captures.
pub struct KeySource<'a> {
    pub captures: &'a Captures,
    /// The raw query string, without `?`.
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
}

/// Why a key part from the query or a header cannot name one resource.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyPartError {
    #[error("the key needs {0}, which the request does not carry (or carries empty)")]
    Missing(String),
    #[error("{0} is sent more than once; back ends disagree on which one counts")]
    Repeated(String),
    #[error("{0} {1}")]
    Ambiguous(String, &'static str),
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
        Ok(Self {
            segments,
            ignore_case: false,
        })
    }

    /// Matches literal segments in any ASCII case.
    pub fn ignoring_case(mut self) -> Self {
        self.ignore_case = true;
        self
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
                    let Some(part) = parts.get(i) else {
                        return Ok(None);
                    };
                    let part = decode_segment(part)?;
                    let same = if self.ignore_case {
                        part.eq_ignore_ascii_case(lit)
                    } else {
                        part == lit.as_str()
                    };
                    if !same {
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
                    let mut tail = &parts[i.min(parts.len())..];
                    if tail.is_empty() || tail.iter().all(|p| p.is_empty()) {
                        return Ok(None);
                    }
                    // `/a/b/` and `/a/b` are one resource to many back ends:
                    // one key (merging them is at worst false contention).
                    if tail.len() > 1 && tail.last().is_some_and(|p| p.is_empty()) {
                        tail = &tail[..tail.len() - 1];
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
                    if let Some(q) = name.strip_prefix("query.") {
                        if !valid_field_name(q) {
                            return Err(format!("'{{{name}}}' names no query parameter (use letters, digits, '_', '-' and '.')"));
                        }
                        parts.push(KeyPart::Query(q.to_string()));
                        rest = &after[end + 1..];
                        continue;
                    }
                    if let Some(h) = name.strip_prefix("header.") {
                        let header = HeaderName::from_bytes(h.as_bytes())
                            .map_err(|_| format!("'{{{name}}}' names no valid header"))?;
                        // A fenced write with such a name is refused (see
                        // `gateway::check_headers`): no write could carry an Idempotency-Key.
                        if h.contains('_') {
                            return Err(format!(
                                "'{{{name}}}' names a header with '_', which fenced writes may not carry (CGI, WSGI and Rack read '_' and '-' as one): use '-'"
                            ));
                        }
                        parts.push(KeyPart::Header(header));
                        rest = &after[end + 1..];
                        continue;
                    }
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
        Ok(Self {
            parts,
            lower: false,
            source: template.to_string(),
        })
    }

    /// The template as written in the config (`doc:{id}`).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the rendered key is lower-cased (`key_case = "lower"`).
    pub fn is_lower_cased(&self) -> bool {
        self.lower
    }

    /// The headers the key is made of (its `{header.NAME}` parts).
    pub fn header_names(&self) -> impl Iterator<Item = &HeaderName> {
        self.parts.iter().filter_map(|p| match p {
            KeyPart::Header(name) => Some(name),
            _ => None,
        })
    }

    /// Lower-cases the rendered key (`key_case = "lower"`).
    pub fn lower_cased(mut self) -> Self {
        self.lower = true;
        self
    }

    /// Renders the resource key of a request.
    pub fn render(&self, src: &KeySource<'_>) -> Result<String, KeyPartError> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                KeyPart::Literal(l) => out.push_str(l),
                KeyPart::Capture(name) => {
                    if let Some((_, v)) = src.captures.iter().find(|(n, _)| n == name) {
                        out.push_str(v);
                    }
                }
                KeyPart::Query(name) => out.push_str(&query_part(src.query, name)?),
                KeyPart::Header(name) => out.push_str(header_part(src.headers, name)?),
            }
        }
        if self.lower {
            out = out.to_lowercase();
        }
        Ok(out)
    }
}

/// The one decoded value of query parameter `name`. A raw `;` in the query
/// is refused (old frameworks split parameters on it), and so is a raw `+`
/// in the value (a space to form decoders, a plus to others): either could
/// make the upstream read another value than the key holds.
fn query_part(query: Option<&str>, name: &str) -> Result<String, KeyPartError> {
    let what = || format!("query parameter '{name}'");
    let query = query.unwrap_or_default();
    if query.contains(';') {
        return Err(KeyPartError::Ambiguous(
            "the query string".into(),
            "has a ';', which some back ends read as a parameter separator",
        ));
    }
    let mut found: Option<&str> = None;
    for pair in query.split('&') {
        let (raw_name, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
        let decoded = strict_decode(raw_name).ok_or_else(|| {
            KeyPartError::Ambiguous("a query parameter name".into(), MALFORMED_ESCAPE)
        })?;
        if decoded != name {
            continue;
        }
        if found.replace(raw_value).is_some() {
            return Err(KeyPartError::Repeated(what()));
        }
    }
    let raw = found.ok_or_else(|| KeyPartError::Missing(what()))?;
    if raw.contains('+') {
        return Err(KeyPartError::Ambiguous(
            what(),
            "has a raw '+', a space to some back ends and a plus to others; send %20 or %2B",
        ));
    }
    let value =
        strict_decode(raw).ok_or_else(|| KeyPartError::Ambiguous(what(), MALFORMED_ESCAPE))?;
    if value.is_empty() {
        return Err(KeyPartError::Missing(what()));
    }
    Ok(value.into_owned())
}

const MALFORMED_ESCAPE: &str =
    "has a '%' not followed by two hex digits, or does not decode to UTF-8";

/// The one value of header `name`. A comma makes it a list, whose members
/// back ends pick differently.
fn header_part<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<&'a str, KeyPartError> {
    let what = || format!("header '{name}'");
    let mut values = headers.get_all(name).iter();
    let value = values.next().ok_or_else(|| KeyPartError::Missing(what()))?;
    if values.next().is_some() {
        return Err(KeyPartError::Repeated(what()));
    }
    let value = value
        .to_str()
        .map_err(|_| KeyPartError::Ambiguous(what(), "is not visible ASCII"))?;
    if value.contains(',') {
        return Err(KeyPartError::Ambiguous(what(), "is a list (it has a ',')"));
    }
    if value.is_empty() {
        return Err(KeyPartError::Missing(what()));
    }
    Ok(value)
}

/// Percent-decodes `raw`, or `None` if an escape is malformed or the result
/// is not UTF-8.
fn strict_decode(raw: &str) -> Option<Cow<'_, str>> {
    let b = raw.as_bytes();
    let mut i = 0;
    while let Some(p) = b[i..].iter().position(|&c| c == b'%') {
        let at = i + p;
        if !(b.get(at + 1).is_some_and(u8::is_ascii_hexdigit)
            && b.get(at + 2).is_some_and(u8::is_ascii_hexdigit))
        {
            return None;
        }
        i = at + 3;
    }
    percent_encoding::percent_decode_str(raw).decode_utf8().ok()
}

/// Why a raw request path (without the query) may name more than one
/// resource to the back ends behind the gateway, or `None`. Used on fenced
/// writes of `paths = "strict"` routes.
pub fn ambiguity(raw: &str) -> Option<&'static str> {
    let b = raw.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        match c {
            b';' => {
                return Some("has a ';': servlet containers strip ';' parameters from a segment")
            }
            b'\\' => return Some("has a '\\', which some back ends read as '/'"),
            b'/' if b.get(i + 1) == Some(&b'/') => {
                return Some("has an empty segment ('//'), which some back ends merge")
            }
            b'%' => {
                let hex = |j: usize| b.get(j).and_then(|h| (*h as char).to_digit(16));
                let (Some(hi), Some(lo)) = (hex(i + 1), hex(i + 2)) else {
                    return Some("has a '%' not followed by two hex digits");
                };
                match (hi * 16 + lo) as u8 {
                    b'/' | b'\\' => {
                        return Some(
                            "has an encoded '/' or '\\' (%2F, %5C), which some back ends decode",
                        )
                    }
                    0x00..=0x1f | 0x7f => return Some("has an encoded control character"),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    None
}

/// A query parameter name a template may use.
fn valid_field_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
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
    // A segment decodes to a dot only from a `.` or a `%2e`: a path with
    // neither, as most are, needs no segment decoded (checked on every
    // proxied request).
    if !path.bytes().any(|b| b == b'.' || b == b'%') {
        return false;
    }
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

    /// What a pattern with one parameter, `name`, captures on a match.
    fn one(name: &str, value: &str) -> Option<Captures> {
        Some(vec![(name.into(), value.into())])
    }

    fn render(
        k: &KeyTemplate,
        captures: &Captures,
        query: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Result<String, KeyPartError> {
        let mut h = HeaderMap::new();
        for (n, v) in headers {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        k.render(&KeySource {
            captures,
            query,
            headers: &h,
        })
    }

    #[test]
    fn literals_match_decoded_and_optionally_in_any_case() {
        assert_eq!(m("/docs/{id}", "/%64ocs/7"), one("id", "7"));
        assert_eq!(m("/docs/{id}", "/DOCS/7"), None);
        let p = PathPattern::parse("/docs/{id}").unwrap().ignoring_case();
        assert!(p.matches("/DoCs/7").unwrap().is_some());
    }

    #[test]
    fn ambiguous_spellings_are_named() {
        for bad in [
            "/docs/report;x=1",
            "/docs/a%2Fb",
            "/docs/a%2fb",
            "/docs/a%5Cb",
            "/docs/a%5cb",
            "/docs/a\\b",
            "/docs//a",
            "/docs/a%00",
            "/docs/a%1f",
            "/docs/a%7F",
            "/docs/a%",
            "/docs/a%4",
            "/docs/a%zz",
        ] {
            assert!(ambiguity(bad).is_some(), "{bad} passed");
        }
        for good in [
            "/docs/a",
            "/docs/%61",
            "/docs/a%20b",
            "/docs/%E2%9C%93",
            "/",
            "/docs/a/",
        ] {
            assert_eq!(ambiguity(good), None, "{good}");
        }
    }

    #[test]
    fn query_and_header_parts() {
        let p = PathPattern::parse("/docs/{id}").unwrap();
        let k = KeyTemplate::parse("doc:{query.tenant}:{id}:{header.x-region}", &p).unwrap();
        let caps = p.matches("/docs/9").unwrap().unwrap();
        let region = [("x-region", "eu")];
        assert_eq!(
            render(&k, &caps, Some("a=1&tenant=ac%6De"), &region),
            Ok("doc:acme:9:eu".into())
        );
        // Names are compared decoded, so a re-encoded name is a repeat.
        assert!(matches!(
            render(&k, &caps, Some("tenant=a&ten%61nt=b"), &region),
            Err(KeyPartError::Repeated(_))
        ));
        for (query, headers) in [
            (Some("tenant=a;tenant=b"), &region[..]),
            (Some("tenant=a+b"), &region[..]),
            (Some("tenant=a%zz"), &region[..]),
            (Some("tenant=a"), &[("x-region", "eu, us")][..]),
        ] {
            assert!(
                matches!(
                    render(&k, &caps, query, headers),
                    Err(KeyPartError::Ambiguous(..))
                ),
                "{query:?} {headers:?}"
            );
        }
        for (query, headers) in [
            (None, &region[..]),
            (Some("tenant="), &region[..]),
            (Some("tenant=a"), &[][..]),
        ] {
            assert!(
                matches!(
                    render(&k, &caps, query, headers),
                    Err(KeyPartError::Missing(_))
                ),
                "{query:?} {headers:?}"
            );
        }
        assert!(matches!(
            render(
                &k,
                &caps,
                Some("tenant=a"),
                &[("x-region", "eu"), ("x-region", "us")]
            ),
            Err(KeyPartError::Repeated(_))
        ));
        let lower = KeyTemplate::parse("Doc:{id}", &p).unwrap().lower_cased();
        let caps = p.matches("/docs/AbC").unwrap().unwrap();
        assert_eq!(render(&lower, &caps, None, &[]), Ok("doc:abc".into()));
        assert!(KeyTemplate::parse("{query.}", &p).is_err());
        assert!(KeyTemplate::parse("{header.a b}", &p).is_err());
        // A fenced write carrying such a name is refused, so no key could
        // ever be made of one.
        let e = KeyTemplate::parse("{header.x_tenant}", &p).unwrap_err();
        assert!(e.contains("'_'"), "{e}");
    }

    #[test]
    fn params_and_rest() {
        assert_eq!(m("/docs/{id}", "/docs/7"), one("id", "7"));
        assert_eq!(m("/docs/{id}", "/docs/"), None);
        assert_eq!(m("/docs/{id}", "/docs/7/x"), None);
        assert_eq!(m("/docs/{id}", "/docs"), None);
        assert_eq!(m("/f/{*rest}", "/f/a/b/c"), one("rest", "a/b/c"));
        assert_eq!(m("/f/{*rest}", "/f/"), None);
        assert_eq!(m("/", "/"), Some(vec![]));
        assert_eq!(m("/a", "/a/"), None);
    }

    #[test]
    fn captures_are_decoded() {
        assert_eq!(m("/docs/{id}", "/docs/%61%2Fb"), one("id", "a/b"));
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
        assert_eq!(render(&k, &caps, None, &[]), Ok("doc:acme:9".into()));
        assert!(KeyTemplate::parse("doc:{nope}", &p)
            .unwrap_err()
            .contains("{nope}"));
        assert!(KeyTemplate::parse("doc:{id", &p).is_err());
        assert!(KeyTemplate::parse("", &p).is_err());
    }

    /// What a back end makes of a raw path: percent-decoded, and for the
    /// chosen back end's quirks: servlet containers strip `;` parameters
    /// from each segment (and, with Spring's helper, decode `%2F`), IIS
    /// reads `\\` as `/`, nginx merges slashes; all resolve dot segments.
    fn normalized(raw: &str, servlet: bool, merge_slashes: bool, drop_trailing: bool) -> String {
        let mut segs: Vec<String> = Vec::new();
        let stripped: Vec<String> = raw
            .split('/')
            .map(|seg| {
                let seg = if servlet {
                    seg.split(';').next().unwrap_or("")
                } else {
                    seg
                };
                percent_encoding::percent_decode_str(seg)
                    .decode_utf8_lossy()
                    .replace('\\', "/")
            })
            .collect();
        let joined = stripped.join("/");
        let all: Vec<&str> = joined.split('/').skip(1).collect();
        for (i, seg) in all.iter().enumerate() {
            let last = i + 1 == all.len();
            match *seg {
                "." => {}
                ".." => {
                    segs.pop();
                }
                "" if last && drop_trailing => {}
                "" if !last && merge_slashes => {}
                s => segs.push(s.to_string()),
            }
        }
        format!("/{}", segs.join("/"))
    }

    /// A decoded path as a request would spell it.
    fn encoded(path: &str) -> String {
        const RESERVED: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS
            .add(b' ')
            .add(b'%')
            .add(b';')
            .add(b'\\')
            .add(b'?')
            .add(b'#')
            .add(b'+');
        percent_encoding::utf8_percent_encode(path, RESERVED).to_string()
    }

    /// The key a strict `/docs/{*rest}` route gives a raw path, or `None`
    /// when it refuses it or does not match it.
    fn strict_key(path: &str) -> Option<String> {
        let pattern = PathPattern::parse("/docs/{*rest}").unwrap();
        let template = KeyTemplate::parse("doc:{rest}", &pattern).unwrap();
        if ambiguity(path).is_some() {
            return None;
        }
        let captures = pattern.matches(path).ok()??;
        render(&template, &captures, None, &[]).ok()
    }

    fn spelling() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let piece = prop::sample::select(vec![
            "a", "b", "Z", "%61", "%41", "é", "%C3%A9", "%20", "+", "-", "_", "~", "/", "//", ";",
            ";x=1", "%3B", "%2F", "%2f", "%5C", "%5c", "\\", ".", "..", "%2e", "%2E%2E", "%", "%4",
            "%zz", "%00", "%1F", "%7f",
        ]);
        prop::collection::vec(piece, 1..8).prop_map(|p| format!("/docs/{}", p.concat()))
    }

    proptest::proptest! {
        /// Any path a strict route accepts names, at every kind of back end,
        /// the very resource its key names; every other spelling is refused.
        /// Whatever a back end makes of an accepted path, spelled plainly,
        /// gets the same key: two spellings of one resource never get two
        /// keys.
        #[test]
        fn accepted_paths_name_one_resource(path in spelling()) {
            let Some(key) = strict_key(&path) else {
                return Ok(());
            };
            for (servlet, merge, trailing) in [
                (true, false, false),
                (false, true, false),
                (false, false, true),
                (false, false, false),
            ] {
                let upstream = normalized(&path, servlet, merge, trailing);
                let plain = strict_key(&encoded(&upstream));
                proptest::prop_assert_eq!(
                    Some(&key), plain.as_ref(),
                    "{} is {} at a back end (servlet {}, merging slashes {}, dropping a trailing one {})",
                    path, upstream, servlet, merge, trailing
                );
            }
        }
    }

    /// Dot segments, plain or percent-encoded in either case, anywhere in
    /// the path; dots inside a segment and encoded characters other than
    /// dots are not.
    #[test]
    fn dot_segments_plain_and_encoded() {
        for path in [
            "/.",
            "/..",
            "/a/./b",
            "/a/../b",
            "/a/.",
            "/%2e",
            "/%2E%2e/x",
            "/a/.%2e",
            "/a/%2e%2E/",
            "./a",
        ] {
            assert!(has_dot_segment(path), "{path}");
        }
        for path in [
            "/",
            "/docs/k1234",
            "/a.b/c",
            "/a/...",
            "/a/.b",
            "/a/%2f",
            "/a/%2e%2e%2e",
            "/%41",
            "",
        ] {
            assert!(!has_dot_segment(path), "{path}");
        }
    }
}
