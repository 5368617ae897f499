//! JWT fence tokens end to end: lock grants carry signed tokens, and routes
//! with `token = "jwt"` accept only tokens that pass every check.

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

use crate::support::app::{problem, route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::upstream::Upstream;

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/keys/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn pem(name: &str) -> Vec<u8> {
    std::fs::read(fixture(name)).unwrap()
}

struct Setup {
    _store: TestStore,
    up: Upstream,
    app: TestApp,
}

async fn setup() -> Setup {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let mut extra = route("docs", "/docs/{id}", &up.url(), "doc:{id}");
    extra.push_str("token = \"jwt\"\n");
    extra.push_str(&format!(
        "[tokens]\nissuer = \"fencegate-test\"\nsigning_kid = \"k1\"\nleeway_s = 2\n\
         [[tokens.keys]]\nkid = \"k1\"\nalgorithm = \"EdDSA\"\nprivate_key_file = \"{}\"\npublic_key_file = \"{}\"\n\
         [[tokens.keys]]\nkid = \"k2\"\nalgorithm = \"ES256\"\npublic_key_file = \"{}\"\n",
        fixture("ed25519.pem"),
        fixture("ed25519.pub.pem"),
        fixture("p256.pub.pem"),
    ));
    let app = TestApp::spawn(&store.url, &extra).await;
    Setup {
        _store: store,
        up,
        app,
    }
}

impl Setup {
    async fn grant(&self, name: &str) -> Value {
        let r = self
            .app
            .http
            .post(self.app.url(&format!("/_fencegate/locks/{name}")))
            .json(&json!({"ttl_ms": 60000}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        r.json().await.unwrap()
    }

    async fn put(&self, id: &str, token: &str) -> reqwest::Response {
        self.app.put(&format!("/docs/{id}"), Some(token), "x").await
    }
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

fn sign(alg: Algorithm, kid: &str, key: &EncodingKey, claims: &Value) -> String {
    let mut h = Header::new(alg);
    h.kid = Some(kid.to_string());
    jsonwebtoken::encode(&h, claims, key).unwrap()
}

fn k1() -> EncodingKey {
    EncodingKey::from_ed_pem(&pem("ed25519.pem")).unwrap()
}

fn claims(sub: &str, fence: i64) -> Value {
    json!({"sub": sub, "fence": fence, "iat": now(), "exp": now() + 60, "iss": "fencegate-test"})
}

#[tokio::test]
async fn grants_carry_signed_tokens_that_fence_writes() {
    let s = setup().await;
    let g = s.grant("doc:a").await;
    let token = g["token"].as_str().unwrap();
    let parts: Vec<&str> = token.split('.').collect();
    assert_eq!(parts.len(), 3, "a JWT");
    let header: Value = serde_json::from_slice(&B64.decode(parts[0]).unwrap()).unwrap();
    let body: Value = serde_json::from_slice(&B64.decode(parts[1]).unwrap()).unwrap();
    assert_eq!(header["alg"], "EdDSA");
    assert_eq!(header["kid"], "k1");
    assert_eq!(body["sub"], "doc:a");
    assert_eq!(body["fence"], g["fence"]);
    assert_eq!(body["iss"], "fencegate-test");
    assert!(body["exp"].as_i64().unwrap() >= body["iat"].as_i64().unwrap() + 59);
    assert_eq!(s.put("a", token).await.status(), 200);
    // The upstream receives the JWT unchanged.
    assert_eq!(s.up.requests()[0].headers["x-fence-token"], token);

    // A newer grant fences the older token off: 409 by fence number.
    let g2 = s.grant("doc:a2").await;
    let _ = g2;
    let r = s
        .app
        .http
        .post(s.app.url("/_fencegate/locks/doc:a/release"))
        .json(&json!({"lease": g["lease"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let newer = s.grant("doc:a").await;
    assert_eq!(
        s.put("a", newer["token"].as_str().unwrap()).await.status(),
        200
    );
    let body = problem(s.put("a", token).await, 409).await;
    assert_eq!(body["highest_token"], newer["fence"]);
}

#[tokio::test]
async fn a_token_signed_by_the_verify_only_key_is_accepted() {
    let s = setup().await;
    let key = EncodingKey::from_ec_pem(&pem("p256.pem")).unwrap();
    let t = sign(Algorithm::ES256, "k2", &key, &claims("doc:b", 7));
    assert_eq!(s.put("b", &t).await.status(), 200);
}

#[tokio::test]
async fn attacks_are_refused_with_the_failed_check() {
    let s = setup().await;
    let good = sign(Algorithm::EdDSA, "k1", &k1(), &claims("doc:c", 5));
    assert_eq!(s.put("c", &good).await.status(), 200);

    let mut cases: Vec<(&str, String, u16, &str)> = Vec::new();
    // Tampered claims: a higher fence with the old signature.
    let parts: Vec<&str> = good.split('.').collect();
    let forged_body = B64.encode(claims("doc:c", 999_999).to_string());
    cases.push((
        "tampered",
        format!("{}.{}.{}", parts[0], forged_body, parts[2]),
        401,
        "signature",
    ));
    // alg none.
    let none_header = B64.encode(json!({"alg": "none", "typ": "JWT", "kid": "k1"}).to_string());
    cases.push(("alg none", format!("{none_header}.{forged_body}."), 401, ""));
    // HS256 "signed" with the public key of the asymmetric key (key confusion).
    let confused = sign(
        Algorithm::HS256,
        "k1",
        &EncodingKey::from_secret(&pem("ed25519.pub.pem")),
        &claims("doc:c", 999_999),
    );
    cases.push(("HS256 with the public key", confused, 401, "algorithm"));
    // Unknown kid.
    cases.push((
        "unknown kid",
        sign(Algorithm::EdDSA, "k9", &k1(), &claims("doc:c", 999_999)),
        401,
        "kid",
    ));
    // Signed by another key under k1's kid.
    let other = EncodingKey::from_ed_pem(&pem("ed25519-other.pem")).unwrap();
    cases.push((
        "someone else's key",
        sign(Algorithm::EdDSA, "k1", &other, &claims("doc:c", 999_999)),
        401,
        "signature",
    ));
    // Expired beyond the 2 s leeway.
    let mut expired = claims("doc:c", 999_999);
    expired["exp"] = json!(now() - 30);
    cases.push((
        "expired",
        sign(Algorithm::EdDSA, "k1", &k1(), &expired),
        401,
        "expired",
    ));
    // Wrong issuer.
    let mut wrong_iss = claims("doc:c", 999_999);
    wrong_iss["iss"] = json!("someone-else");
    cases.push((
        "wrong issuer",
        sign(Algorithm::EdDSA, "k1", &k1(), &wrong_iss),
        401,
        "issuer",
    ));
    // Not a JWT at all.
    cases.push(("garbage", "12345".to_string(), 401, ""));
    // Valid, but for another resource key: 403.
    cases.push((
        "other resource",
        sign(Algorithm::EdDSA, "k1", &k1(), &claims("doc:other", 999_999)),
        403,
        "doc:other",
    ));

    for (what, token, status, needle) in cases {
        let body = problem(s.put("c", &token).await, status).await;
        let detail = body["detail"].as_str().unwrap().to_lowercase();
        assert!(detail.contains(&needle.to_lowercase()), "{what}: {detail}");
    }
    assert_eq!(
        s.up.applied().len(),
        1,
        "no forged write reached the upstream"
    );
    // The forged fence was never recorded.
    let v: Value = s.app.admin_get("/fences/doc:c").await.json().await.unwrap();
    assert_eq!(v["highest_token"], 5);
    // Missing header is still 428.
    problem(s.app.put("/docs/c", None, "x").await, 428).await;
}

#[test]
fn bad_token_config_is_reported_by_check_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!(
            "[[routes]]\nname = \"d\"\npath = \"/d/{{id}}\"\nupstream = \"http://127.0.0.1:1\"\nkey = \"d:{{id}}\"\ntoken = \"jwt\"\n\
             [tokens]\nsigning_kid = \"nope\"\n[[tokens.keys]]\nkid = \"k1\"\nalgorithm = \"RS256\"\npublic_key_file = \"{}\"\n\
             [[tokens.keys]]\nkid = \"k2\"\nalgorithm = \"EdDSA\"\npublic_key_file = \"missing.pem\"\n",
            fixture("ed25519.pub.pem")
        ),
    )
    .unwrap();
    let (code, _out, err) = crate::support::process::run(&["check-config", path.to_str().unwrap()]);
    assert_eq!(code, 1);
    for needle in [
        "tokens.signing_kid",
        "tokens.keys[0].algorithm",
        "tokens.keys[1].public_key_file",
    ] {
        assert!(err.contains(needle), "missing {needle} in:\n{err}");
    }
}
