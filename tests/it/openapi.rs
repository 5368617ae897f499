//! The OpenAPI document (`docs/openapi.json`): valid OpenAPI 3.1, served
//! as kept in the repository, and true: real answers of every documented
//! operation match the schema the document gives for their status, media
//! type and headers, and so do the gateway's own refusals of fenced writes.
//!
//! The OpenAPI 3.1 meta-schema is vendored in
//! `tests/fixtures/openapi/oas-3.1-schema-2022-10-07.json` (published by the
//! OpenAPI Initiative under the Apache License 2.0), so validation needs no
//! network.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::app::{content_type, docs_route, route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::fenced_put;
use crate::support::upstream::Upstream;
use crate::trust::auth_section;

fn document() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/openapi.json");
    let text = std::fs::read_to_string(&path).expect("docs/openapi.json");
    serde_json::from_str(&text).expect("docs/openapi.json is JSON")
}

/// Compiles `schema` with the document's components beside it, so that its
/// `#/components/...` references resolve.
fn validator(doc: &Value, schema: &Value) -> jsonschema::Validator {
    let mut root = schema.clone();
    if let Value::Object(m) = &mut root {
        m.insert("components".into(), doc["components"].clone());
    }
    jsonschema::draft202012::new(&root).unwrap_or_else(|e| panic!("schema {schema} compiles: {e}"))
}

fn conforms(doc: &Value, schema: &Value, instance: &Value, what: &str) {
    let v = validator(doc, schema);
    let errors: Vec<String> = v
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{what} does not match its schema:\n{}\n{instance:#}",
        errors.join("\n")
    );
}

#[test]
fn the_document_is_valid_openapi_3_1() {
    let doc = document();
    let meta_path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/openapi/oas-3.1-schema-2022-10-07.json");
    let meta: Value = serde_json::from_str(
        &std::fs::read_to_string(meta_path).expect("the vendored meta-schema"),
    )
    .expect("the meta-schema is JSON");
    let v = jsonschema::draft202012::new(&meta).expect("the meta-schema compiles");
    let errors: Vec<String> = v
        .iter_errors(&doc)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "not OpenAPI 3.1:\n{}", errors.join("\n"));
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(
        doc["info"]["version"],
        env!("CARGO_PKG_VERSION"),
        "info.version is the crate's"
    );
    // Every schema is a valid JSON Schema 2020-12 whose references resolve.
    let schemas = doc["components"]["schemas"].as_object().expect("schemas");
    for name in schemas.keys() {
        validator(
            &doc,
            &json!({"$ref": format!("#/components/schemas/{name}")}),
        );
    }
    // Every $ref anywhere points at something.
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    out.push(r.clone());
                }
                m.values().for_each(|v| refs(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    for r in all {
        let pointer = r.strip_prefix('#').expect("local references only");
        assert!(doc.pointer(pointer).is_some(), "dangling $ref {r}");
    }
}

#[tokio::test]
async fn the_served_document_is_the_file() {
    let store = TestStore::new(Backend::Sqlite).await;
    let app = TestApp::spawn(&store.url, "").await;
    let resp = app.admin_get("/openapi.json").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"],
        "application/json",
        "served as JSON"
    );
    let served = resp.text().await.expect("a body");
    let file =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/openapi.json"))
            .expect("docs/openapi.json");
    assert!(
        served == file,
        "GET /openapi.json differs from docs/openapi.json"
    );
}

/// Calls documented operations and checks each answer against the
/// document; remembers which operations were seen.
struct Api<'a> {
    doc: Value,
    app: &'a TestApp,
    seen: BTreeSet<(String, String)>,
}

impl Api<'_> {
    /// The operation `(method, template)` (`template` the document's path),
    /// sent to `path`.
    async fn call(
        &mut self,
        op: (&str, &str),
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> (u16, Value) {
        self.call_with_keys(op, path, key.as_slice(), body).await
    }

    /// [`Api::call`] with an `Authorization` header for each of `keys`.
    async fn call_with_keys(
        &mut self,
        (method, template): (&str, &str),
        path: &str,
        keys: &[&str],
        body: Option<&Value>,
    ) -> (u16, Value) {
        let url = if template.starts_with("/_fencegate/") {
            self.app.url(path)
        } else {
            self.app.admin_url(path)
        };
        let mut req = self
            .app
            .http
            .request(method.parse().expect("a method"), url);
        for k in keys {
            req = req.bearer_auth(k);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.expect("gateway answered");
        let status = resp.status().as_u16();
        let what = format!("{method} {path} → {status}");
        let op = self.doc["paths"][template][method.to_lowercase()].clone();
        assert!(op.is_object(), "{method} {template} is not documented");
        self.seen
            .insert((template.to_string(), method.to_lowercase()));
        let mut answer = op["responses"][status.to_string()].clone();
        assert!(answer.is_object(), "{what}: status not documented");
        if let Some(r) = answer["$ref"].as_str() {
            answer = self
                .doc
                .pointer(&r[1..])
                .expect("a documented response")
                .clone();
        }
        for header in answer["headers"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|h| h.0)
        {
            assert!(
                resp.headers().contains_key(header.as_str()),
                "{what}: no {header} header"
            );
        }
        let content_type = content_type(&resp);
        let text = resp.text().await.expect("a body");
        let Some(content) = answer["content"].as_object() else {
            assert!(
                text.is_empty(),
                "{what}: a body where none is documented: {text}"
            );
            return (status, Value::Null);
        };
        let (media, spec) = content.iter().next().expect("one media type");
        assert!(
            content_type.starts_with(media.as_str()),
            "{what}: content-type {content_type}, documented {media}"
        );
        if !media.ends_with("json") {
            return (status, Value::String(text));
        }
        let body: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text}"));
        conforms(&self.doc, &spec["schema"], &body, &what);
        (status, body)
    }

    /// A refusal of a proxied fenced write, against a named schema.
    async fn fenced(&self, path: &str, token: Option<&str>, schema: &str) {
        let resp = self.app.put(path, token, "x").await;
        self.proxied(resp, &format!("PUT {path}"), schema).await;
    }

    /// A refusal of a proxied request (`what`), against a named schema.
    async fn proxied(&self, resp: reqwest::Response, what: &str, schema: &str) {
        let status = resp.status().as_u16();
        assert_eq!(
            resp.headers()["content-type"],
            "application/problem+json",
            "{what}"
        );
        let body: Value = resp.json().await.expect("a problem document");
        let what = format!("{what} → {status}");
        conforms(
            &self.doc,
            &json!({"$ref": format!("#/components/schemas/{schema}")}),
            &body,
            &what,
        );
    }
}

#[tokio::test]
async fn real_answers_match_the_documented_schemas() {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let issued = route("issued", "/issued/{id}", &up.url(), "iss:{id}") + "token = \"issued\"\n";
    let extra = format!("{}{}{}", auth_section(), docs_route(&up.url()), issued);
    let app = TestApp::spawn(&store.url, &extra).await;
    let mut api = Api {
        doc: document(),
        app: &app,
        seen: BTreeSet::new(),
    };
    let (billing, ops) = (Some("key-billing"), Some("key-ops"));
    let acquire = ("POST", "/_fencegate/locks/{name}");
    let status = ("GET", "/_fencegate/locks/{name}");
    let renew = ("POST", "/_fencegate/locks/{name}/renew");
    let release = ("POST", "/_fencegate/locks/{name}/release");
    let a = "/_fencegate/locks/billing:a";
    let (a_renew, a_release) = (format!("{a}/renew"), format!("{a}/release"));
    let ttl = json!({"ttl_ms": 10000});

    // The lock API, every answer a client can provoke.
    let (s, _) = api.call(acquire, a, None, Some(&ttl)).await;
    assert_eq!(s, 401);
    let (s, _) = api
        .call(acquire, "/_fencegate/locks/doc:zz", billing, Some(&ttl))
        .await;
    assert_eq!(s, 403);
    let (s, p) = api
        .call(acquire, a, billing, Some(&json!({"ttl": 1})))
        .await;
    assert_eq!((s, p["field"].as_str()), (400, Some("body")));
    let (s, grant) = api.call(acquire, a, billing, Some(&ttl)).await;
    assert_eq!(s, 201);
    let (s, p) = api.call(acquire, a, ops, Some(&ttl)).await;
    assert_eq!(
        (s, p["type"].as_str()),
        (409, Some("urn:fencegate:problem:lock-held"))
    );
    let (s, st) = api.call(status, a, billing, None).await;
    assert_eq!((s, &st["held"]), (200, &json!(true)));
    let lease = json!({"lease": grant["lease"], "ttl_ms": 10000});
    let (s, _) = api.call(renew, &a_renew, billing, Some(&lease)).await;
    assert_eq!(s, 200);
    let just_lease = json!({"lease": grant["lease"]});
    let (s, _) = api
        .call(release, &a_release, billing, Some(&just_lease))
        .await;
    assert_eq!(s, 204);
    let (s, _) = api
        .call(release, &a_release, billing, Some(&just_lease))
        .await;
    assert_eq!(s, 409);
    let (s, _) = api.call(renew, &a_renew, billing, Some(&lease)).await;
    assert_eq!(s, 409);

    // Fenced writes' refusals use the document's problem schemas.
    assert_eq!(app.put("/docs/report", Some("5"), "x").await.status(), 200);
    api.fenced("/docs/report", Some("4"), "StaleTokenProblem")
        .await;
    api.fenced("/docs/report", None, "MissingTokenProblem")
        .await;
    api.fenced("/issued/1", Some("5"), "UnissuedTokenProblem")
        .await;
    api.fenced("/docs/a;b", Some("5"), "Problem").await;
    let twice = app
        .http
        .get(app.url("/docs/report"))
        .bearer_auth("one")
        .bearer_auth("two");
    let resp = twice.send().await.expect("an answer");
    api.proxied(resp, "GET with two keys", "AmbiguousCredentialsProblem")
        .await;
    let stripping = app
        .http
        .get(app.url("/docs/report"))
        .header("x-fence-token", "5")
        .header("connection", "x-fence-token");
    let resp = stripping.send().await.expect("an answer");
    api.proxied(
        resp,
        "GET naming its token in Connection",
        "ProtectedHeaderProblem",
    )
    .await;
    let underscored =
        fenced_put(&app.http, app.url("/docs/report"), "5", "x").header("x_fence_token", "1");
    let resp = underscored.send().await.expect("an answer");
    api.proxied(resp, "PUT with X_Fence_Token", "AmbiguousHeaderProblem")
        .await;
    // A coding the server refuses, on the lock API's path as anywhere.
    let mut raw = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    raw.write_all(
        b"POST /_fencegate/locks/a HTTP/1.1\r\nHost: x\r\n\
          Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut text = String::new();
    raw.read_to_string(&mut text).await.unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an answer");
    assert!(head.starts_with("HTTP/1.1 501 "), "{head}");
    let body: Value = serde_json::from_str(body).expect("a problem document");
    conforms(
        &api.doc,
        &json!({"$ref": "#/components/schemas/UnsupportedCodingProblem"}),
        &body,
        "POST with gzip, chunked → 501",
    );
    // Two keys on a lock API call: a bad lock request, named as such.
    let (s, p) = api
        .call_with_keys(acquire, a, &["key-billing", "key-ops"], Some(&ttl))
        .await;
    assert_eq!(
        (s, p["type"].as_str()),
        (400, Some("urn:fencegate:problem:ambiguous-credentials"))
    );

    // The admin listener.
    for (template, path) in [
        ("/", "/"),
        ("/healthz", "/healthz"),
        ("/readyz", "/readyz"),
        ("/metrics", "/metrics"),
        ("/openapi.json", "/openapi.json"),
        ("/instance", "/instance"),
        ("/routes", "/routes"),
        ("/fences", "/fences?prefix=doc:&limit=10"),
        ("/locks", "/locks?limit=10"),
    ] {
        let (s, _) = api.call(("GET", template), path, None, None).await;
        assert_eq!(s, 200, "GET {path}");
    }
    let (s, page) = api
        .call(("GET", "/refusals"), "/refusals", None, None)
        .await;
    assert_eq!(s, 200);
    let outcomes: Vec<&str> = page["refusals"]
        .as_array()
        .expect("refusals")
        .iter()
        .filter_map(|r| r["outcome"].as_str())
        .collect();
    assert_eq!(
        outcomes,
        ["ambiguous_path", "unissued", "stale"],
        "newest first"
    );
    for (template, path) in [
        ("/refusals", "/refusals?limit=0"),
        ("/fences", "/fences?limit=0"),
        ("/locks", "/locks?limit=x"),
    ] {
        let (s, _) = api.call(("GET", template), path, None, None).await;
        assert_eq!(s, 400, "GET {path}");
    }
    let fence = ("GET", "/fences/{key}");
    let (s, rec) = api.call(fence, "/fences/doc:report", None, None).await;
    assert_eq!((s, &rec["highest_token"]), (200, &json!(5)));
    let (s, _) = api.call(fence, "/fences/nothing-here", None, None).await;
    assert_eq!(s, 404);
    let (reset, report) = (("POST", "/fences/{key}/reset"), "/fences/doc:report/reset");
    let why = json!({"highest_token": 3, "reason": "checking the document"});
    let (s, _) = api.call(reset, report, None, Some(&why)).await;
    assert_eq!(s, 401);
    let (s, _) = api.call(reset, report, billing, Some(&why)).await;
    assert_eq!(s, 403);
    let negative = json!({"highest_token": -1, "reason": "x"});
    let (s, _) = api.call(reset, report, ops, Some(&negative)).await;
    assert_eq!(s, 400);
    let (s, rec) = api.call(reset, report, ops, Some(&why)).await;
    assert_eq!((s, &rec["last_reset"]["to"]), (200, &json!(3)));
    let (s, rec) = api.call(fence, "/fences/doc:report", None, None).await;
    assert_eq!((s, &rec["last_reset"]["by"]), (200, &json!("ops")));

    let (brk, b) = (("POST", "/locks/{name}/break"), "/locks/billing:b/break");
    let (s, _) = api
        .call(acquire, "/_fencegate/locks/billing:b", billing, Some(&ttl))
        .await;
    assert_eq!(s, 201);
    let (s, _) = api.call(brk, b, None, None).await;
    assert_eq!(s, 401);
    let (s, _) = api.call(brk, b, billing, None).await;
    assert_eq!(s, 403);
    let (s, _) = api
        .call_with_keys(brk, b, &["key-ops", "key-billing"], None)
        .await;
    assert_eq!(s, 400);
    let (s, _) = api.call(brk, b, ops, None).await;
    assert_eq!(s, 204);
    let (s, _) = api.call(brk, b, ops, None).await;
    assert_eq!(s, 404);
    let (s, listing) = api
        .call(("GET", "/locks"), "/locks?prefix=billing:", None, None)
        .await;
    assert_eq!(
        (s, listing["locks"].as_array().map(Vec::len)),
        (200, Some(2))
    );

    // Every documented operation was called and answered as documented.
    let documented: BTreeSet<(String, String)> = api.doc["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .flat_map(|(p, item)| {
            item.as_object()
                .into_iter()
                .flatten()
                .filter(|(m, _)| ["get", "post", "put", "patch", "delete"].contains(&m.as_str()))
                .map(move |(m, _)| (p.clone(), m.clone()))
        })
        .collect();
    let missed: Vec<_> = documented.difference(&api.seen).collect();
    assert!(missed.is_empty(), "documented but not checked: {missed:?}");
}
