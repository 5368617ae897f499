//! The ready-made monitoring and deployment in `deploy/` stay true to the
//! code: every metric an alert rule or a Grafana panel queries is one the
//! gateway exports (read from a real `/metrics`), every label value they
//! match on is one it uses, and the Kubernetes example's config is a valid
//! shared-mode config whose probe paths answer 200 on a real gateway run
//! from it. (`promtool check rules` and `promtool test rules` check the
//! rules' syntax and behaviour; `.ci/run` runs them.)

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{json, Value};

use crate::support::app::{docs_route, route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::upstream::Upstream;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every metric name a scrape of `text` (OpenMetrics) can be queried by:
/// the samples' names, and for each declared family the names its type
/// exports (a family with no series yet still declares itself).
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(decl) = line.strip_prefix("# TYPE ") {
            let mut parts = decl.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// The `fencegate_` metric names in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("fencegate_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// The values a PromQL expression matches label `label` against
/// (`label="v"`, `label!="v"`, and each alternative of `label=~"a|b"`).
fn label_values(expr: &str, label: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find(label) {
        let before = rest[..i].chars().last();
        let tail = &rest[i + label.len()..];
        rest = tail;
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let op_end = tail.find('"').unwrap_or(0);
        let op = tail[..op_end].trim();
        if !["=", "!=", "=~", "!~"].contains(&op) {
            continue;
        }
        let value = &tail[op_end + 1..];
        let value = &value[..value.find('"').unwrap_or(value.len())];
        out.extend(value.split('|').map(str::to_string));
    }
    out
}

/// The label values the gateway uses, per label.
fn known_values(label: &str) -> Vec<String> {
    use fencegate::metrics::{Outcome, ReloadResult, UpstreamFailure};
    match label {
        "outcome" => Outcome::ALL
            .iter()
            .map(|o| o.as_str().to_string())
            .collect(),
        "kind" => UpstreamFailure::ALL
            .iter()
            .map(|k| k.as_str().to_string())
            .collect(),
        "result" => ReloadResult::ALL
            .iter()
            .map(|r| r.as_str().to_string())
            .collect(),
        "op" => vec!["record".into(), "get".into(), "ping".into()],
        _ => unreachable!("no list for {label}"),
    }
}

/// Checks the metric names and label values of `exprs` against a real
/// scrape; answers how many expressions were checked.
fn check_exprs(exprs: &[(String, String)], exported: &BTreeSet<String>) -> usize {
    for (what, expr) in exprs {
        let names = metric_names(expr);
        for name in &names {
            assert!(
                exported.contains(name),
                "{what}: {name} is not exported by /metrics\n{expr}"
            );
        }
        for label in ["outcome", "kind", "result", "op"] {
            let known = known_values(label);
            for v in label_values(expr, label) {
                // Grafana's variables ($instance) are not values.
                if !v.starts_with('$') {
                    assert!(
                        known.contains(&v),
                        "{what}: {label}=\"{v}\" is never exported"
                    );
                }
            }
        }
        for v in label_values(expr, "event") {
            assert!(
                fencegate::metrics::LockEvent::ALL
                    .iter()
                    .any(|e| e.as_str() == v),
                "{what}: lock event \"{v}\" is never counted"
            );
        }
    }
    exprs.len()
}

/// The `/metrics` text of a gateway that has done a bit of everything, so
/// that most labelled series exist; families without one still declare
/// themselves.
pub(crate) async fn busy_gateway_metrics() -> String {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let dead = route("dead", "/dead/{id}", "http://127.0.0.1:1", "dead:{id}");
    let app = TestApp::spawn(&store.url, &format!("{}{dead}", docs_route(&up.url()))).await;
    assert_eq!(app.put("/docs/a", Some("2"), "x").await.status(), 200);
    assert_eq!(app.put("/docs/a", Some("1"), "x").await.status(), 409);
    let get = app.http.get(app.url("/docs/a")).send().await.expect("GET");
    assert_eq!(get.status(), 200);
    assert_eq!(app.put("/dead/a", Some("1"), "x").await.status(), 502);
    let renew = app
        .http
        .post(app.url("/_fencegate/locks/doc:a/renew"))
        .json(&json!({"lease": "not-a-lease", "ttl_ms": 1000}))
        .send()
        .await
        .expect("renew");
    assert_eq!(renew.status(), 409);
    app.metrics().await
}

/// The metric names a scrape of a busy gateway can be queried by.
async fn scrape() -> BTreeSet<String> {
    exported_names(&busy_gateway_metrics().await)
}

#[tokio::test]
async fn alert_rules_and_the_grafana_dashboard_query_real_metrics() {
    let exported = scrape().await;

    // Prometheus rules.
    let rules: Value = serde_norway::from_str(&read("deploy/prometheus/fencegate-alerts.yml"))
        .expect("the alert rules are YAML");
    let mut exprs = Vec::new();
    let mut alerts = BTreeSet::new();
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let name = rule["alert"].as_str().expect("an alert name").to_string();
            let expr = rule["expr"].as_str().expect("an expr").to_string();
            assert!(
                rule["labels"]["severity"].is_string(),
                "{name} has a severity"
            );
            for a in ["summary", "description"] {
                assert!(rule["annotations"][a].is_string(), "{name} has a {a}");
            }
            // The only metric not of ours: Prometheus' own scrape health.
            let foreign = expr.contains("up{") && !expr.contains("fencegate_");
            assert!(
                foreign || !metric_names(&expr).is_empty(),
                "{name} queries no fencegate metric"
            );
            exprs.push((name.clone(), expr));
            alerts.insert(name);
        }
    }
    for wanted in [
        "FencegateStoreUnavailable",
        "FencegateStaleTokenSpike",
        "FencegateKeyBusy",
        "FencegateUpstreamErrors",
        "FencegateLockRenewalsRefused",
    ] {
        assert!(alerts.contains(wanted), "no {wanted} alert");
    }
    // Every alert has a promtool unit test.
    let tests = read("deploy/prometheus/fencegate-alerts.test.yml");
    for a in &alerts {
        assert!(
            tests.contains(&format!("alertname: {a}\n")),
            "{a} has no test in fencegate-alerts.test.yml"
        );
    }
    assert_eq!(check_exprs(&exprs, &exported), alerts.len());

    // Grafana: every query of every panel and variable.
    let dash: Value = serde_json::from_str(&read("deploy/grafana/fencegate-dashboard.json"))
        .expect("the dashboard is JSON");
    fn queries(v: &Value, at: &str, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                let here = m
                    .get("title")
                    .or(m.get("name"))
                    .and_then(Value::as_str)
                    .map_or(at.to_string(), str::to_string);
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "query" | "definition", Value::String(q)) => {
                            out.push((format!("panel '{here}'"), q.clone()))
                        }
                        _ => queries(v, &here, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| queries(v, at, out)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    queries(&dash, "dashboard", &mut found);
    let found: Vec<_> = found
        .into_iter()
        .filter(|(_, q)| q.contains("fencegate_"))
        .collect();
    assert!(found.len() >= 15, "the dashboard's queries: {found:?}");
    check_exprs(&found, &exported);
    // Every family the gateway exports is on the dashboard somewhere.
    let charted: BTreeSet<String> = found.iter().flat_map(|(_, q)| metric_names(q)).collect();
    for family in exported.iter().filter(|n| n.starts_with("fencegate_")) {
        let base = family
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        assert!(
            charted.iter().any(|c| c.starts_with(base)),
            "{family} is on no panel"
        );
    }
}

/// The Kubernetes example: its objects fit together, and its config runs a
/// real shared-mode gateway whose probe paths answer 200.
#[tokio::test]
async fn the_kubernetes_example_runs_shared_mode_with_real_probes() {
    let text = read("deploy/kubernetes/fencegate.yaml");
    let docs: Vec<Value> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("a YAML document"))
        .collect();
    let of = |kind: &str| -> Vec<&Value> { docs.iter().filter(|d| d["kind"] == kind).collect() };
    let [config_map] = of("ConfigMap")[..] else {
        panic!("one ConfigMap")
    };
    let [deployment] = of("Deployment")[..] else {
        panic!("one Deployment")
    };
    let [pdb] = of("PodDisruptionBudget")[..] else {
        panic!("one PodDisruptionBudget")
    };
    let services = of("Service");
    assert_eq!(services.len(), 2, "traffic and admin Services");

    // The config: valid, shared mode on Postgres.
    let toml = config_map["data"]["fencegate.toml"]
        .as_str()
        .expect("fencegate.toml in the ConfigMap");
    let config = fencegate::config::Config::from_toml("fencegate.toml", toml, Vec::new())
        .unwrap_or_else(|e| panic!("the ConfigMap's config is invalid:\n{e}"));
    assert_eq!(config.store.mode, fencegate::config::StoreMode::Shared);
    assert!(matches!(
        config.store.backend,
        fencegate::config::StoreBackend::Postgres
    ));

    // The pod: ports are the config's, probes on the admin port, the
    // config mounted where the args read it, the store URL from a secret.
    let spec = &deployment["spec"];
    assert!(
        spec["replicas"].as_u64().unwrap_or(0) >= 2,
        "several instances"
    );
    let pod = &spec["template"]["spec"];
    let labels = &spec["template"]["metadata"]["labels"];
    assert_eq!(&spec["selector"]["matchLabels"], labels);
    let [container] = &pod["containers"].as_array().expect("containers")[..] else {
        panic!("one container")
    };
    let port = |name: &str| -> u64 {
        container["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("no container port named {name}"))
    };
    assert_eq!(port("traffic"), u64::from(config.server.listen.port()));
    assert_eq!(port("admin"), u64::from(config.server.admin_listen.port()));
    let mut probed = Vec::new();
    for (probe, path) in [
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
        ("startupProbe", "/healthz"),
    ] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(get["port"], "admin", "{probe} on the admin listener");
        probed.push(path);
    }
    let args: Vec<&str> = container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let config_path = args
        .windows(2)
        .find(|w| w[0] == "--config")
        .map(|w| w[1])
        .expect("--config PATH");
    let mount = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| config_path.starts_with(m["mountPath"].as_str().unwrap_or("?")))
        .expect("the config's directory is mounted");
    assert!(
        mount["subPath"].is_null(),
        "a subPath mount never sees updates"
    );
    let env = container["env"].as_array().expect("env");
    let url = env
        .iter()
        .find(|e| e["name"] == "FENCEGATE__STORE__URL")
        .expect("the store URL from the environment");
    assert!(
        url["valueFrom"]["secretKeyRef"].is_object(),
        "from a secret"
    );
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
    assert!(
        grace > config.server.shutdown_grace.as_secs(),
        "the kubelet waits longer than the gateway drains"
    );

    // Services and the disruption budget select the pods, by port name.
    for svc in &services {
        for (k, v) in svc["spec"]["selector"].as_object().expect("a selector") {
            assert_eq!(
                &labels[k], v,
                "Service {} selects the pods",
                svc["metadata"]["name"]
            );
        }
        for p in svc["spec"]["ports"].as_array().expect("ports") {
            port(p["targetPort"].as_str().expect("a named target port"));
        }
    }
    assert_eq!(&pdb["spec"]["selector"]["matchLabels"], labels);

    // The same config, run for real in shared mode on Postgres (listeners
    // on port 0, the store URL as the secret would give it).
    let store = TestStore::new(Backend::Postgres).await;
    let env = [
        ("FENCEGATE__STORE__URL", store.url.as_str()),
        ("FENCEGATE__SERVER__LISTEN", "127.0.0.1:0"),
        ("FENCEGATE__SERVER__ADMIN_LISTEN", "127.0.0.1:0"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    let config = fencegate::config::Config::from_toml("fencegate.toml", toml, env)
        .unwrap_or_else(|e| panic!("with the secret's URL:\n{e}"));
    let app = TestApp::from_config(config)
        .await
        .expect("the example's config starts a gateway");
    for path in probed {
        let resp = app.admin_get(path).await;
        assert_eq!(resp.status(), 200, "the probe of {path}");
    }
    app.stop().await;
}
