//! `fencegate_client` against a real in-process gateway on SQLite.

use std::time::{Duration, Instant};

use fencegate_client::{Error, LeaseKeeper, LockClient};

use crate::support::app::{docs_route, route, TestApp};
use crate::support::db::{Backend, TestStore};
use crate::support::upstream::Upstream;

const MS: Duration = Duration::from_millis(1);

struct Setup {
    _store: TestStore,
    _up: Upstream,
    app: TestApp,
    locks: LockClient,
}

async fn setup() -> Setup {
    setup_with(docs_route).await
}

async fn setup_with(extra: impl FnOnce(&str) -> String) -> Setup {
    let store = TestStore::new(Backend::Sqlite).await;
    let up = Upstream::start().await;
    let app = TestApp::spawn(&store.url, &extra(&up.url())).await;
    let locks = LockClient::new(&format!("http://{}", app.addr)).unwrap();
    Setup {
        _store: store,
        _up: up,
        app,
        locks,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_renew_release_status() {
    let s = setup().await;
    let never = s.locks.status("doc:a").await.unwrap();
    assert!(!never.held);
    assert_eq!(never.name, "doc:a");

    let g = s
        .locks
        .acquire("doc:a", 5000 * MS, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(g.name, "doc:a");
    assert_eq!(g.fence, 1);
    assert_eq!(g.token, "1");
    assert_eq!(g.ttl_ms, 5000);
    assert_eq!(g.lease.len(), 32);
    let shown = format!("{g:?}");
    assert!(!shown.contains(&g.lease), "Debug shows the lease: {shown}");

    let st = s.locks.status("doc:a").await.unwrap();
    assert!(st.held);
    assert_eq!(st.fence, 1);
    assert!(st.expires_in_ms.unwrap() <= 5000);

    let r = s.locks.renew("doc:a", &g.lease, 8000 * MS).await.unwrap();
    assert_eq!(r.fence, 1);
    assert_eq!(r.ttl_ms, 8000);
    assert_eq!(r.lease, g.lease);

    // Somebody else's lease is not the holder.
    let other = "0".repeat(32);
    assert!(matches!(
        s.locks.renew("doc:a", &other, 1000 * MS).await,
        Err(Error::NotHolder)
    ));
    assert!(matches!(
        s.locks.release("doc:a", &other).await,
        Err(Error::NotHolder)
    ));

    s.locks.release("doc:a", &g.lease).await.unwrap();
    assert!(!s.locks.status("doc:a").await.unwrap().held);
    assert!(matches!(
        s.locks.release("doc:a", &g.lease).await,
        Err(Error::NotHolder)
    ));

    let g2 = s
        .locks
        .acquire("doc:a", 5000 * MS, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(g2.fence, 2);
    assert_ne!(g2.lease, g.lease);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_after_waiting() {
    let s = setup().await;
    let a = s
        .locks
        .acquire("doc:h", 10_000 * MS, Duration::ZERO)
        .await
        .unwrap();

    match s.locks.acquire("doc:h", 5000 * MS, Duration::ZERO).await {
        Err(Error::Held {
            expires_in: Some(d),
        }) => assert!(d <= 10_000 * MS, "{d:?}"),
        other => panic!("expected Held, got {other:?}"),
    }

    let started = Instant::now();
    match s.locks.acquire("doc:h", 5000 * MS, 300 * MS).await {
        Err(e @ Error::Held { .. }) => assert!(!e.is_transient()),
        other => panic!("expected Held, got {other:?}"),
    }
    assert!(
        started.elapsed() >= 250 * MS,
        "the gateway answered before the wait ran out"
    );

    // A waiter gets the lock once the holder releases.
    let waiter = {
        let locks = s.locks.clone();
        tokio::spawn(async move { locks.acquire("doc:h", 5000 * MS, 10_000 * MS).await })
    };
    tokio::time::sleep(100 * MS).await;
    s.locks.release("doc:h", &a.lease).await.unwrap();
    let b = waiter.await.unwrap().unwrap();
    assert_eq!(b.fence, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_holder_after_expiry() {
    let s = setup().await;
    let g = s
        .locks
        .acquire("doc:e", 200 * MS, Duration::ZERO)
        .await
        .unwrap();
    tokio::time::sleep(450 * MS).await;
    assert!(!s.locks.status("doc:e").await.unwrap().held);
    assert!(matches!(
        s.locks.renew("doc:e", &g.lease, 5000 * MS).await,
        Err(Error::NotHolder)
    ));
    assert!(matches!(
        s.locks.release("doc:e", &g.lease).await,
        Err(Error::NotHolder)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_name_the_field() {
    let s = setup().await;
    for ttl in [50 * MS, 600_001 * MS] {
        match s.locks.acquire("doc:b", ttl, Duration::ZERO).await {
            Err(Error::BadRequest {
                field: Some(f),
                detail,
            }) => {
                assert_eq!(f, "ttl_ms");
                assert!(detail.contains("ttl_ms"), "{detail}");
            }
            other => panic!("ttl {ttl:?}: expected BadRequest, got {other:?}"),
        }
    }
    match s
        .locks
        .acquire("doc:b", 1000 * MS, Duration::from_secs(99_999))
        .await
    {
        Err(Error::BadRequest { field: Some(f), .. }) => assert_eq!(f, "wait_ms"),
        other => panic!("expected BadRequest on wait_ms, got {other:?}"),
    }
    match s.locks.renew("doc:b", "", 1000 * MS).await {
        Err(Error::BadRequest { field: Some(f), .. }) => assert_eq!(f, "lease"),
        other => panic!("expected BadRequest on lease, got {other:?}"),
    }
    match s.locks.status("").await {
        Err(Error::BadRequest { field: Some(f), .. }) => assert_eq!(f, "name"),
        other => panic!("expected BadRequest on name, got {other:?}"),
    }
    assert!(matches!(
        LockClient::new("ftp://example.com"),
        Err(Error::InvalidBaseUrl(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_with_slashes_and_colons_round_trip() {
    let s = setup().await;
    let names = [
        "jobs/nightly:2024-01-01",
        "a/b/c",
        "q",
        "q/renew",
        "q/release",
        "..",
        "x y?z#w%41",
        "tenant:ü/ключ",
    ];
    let mut grants = Vec::new();
    for name in names {
        let g = s
            .locks
            .acquire(name, 5000 * MS, Duration::ZERO)
            .await
            .unwrap_or_else(|e| panic!("acquire {name:?}: {e}"));
        assert_eq!(g.name, name);
        // Distinct locks: each starts at fence 1 ("q/renew" is not a renewal
        // of "q").
        assert_eq!(g.fence, 1, "{name:?}");
        grants.push(g);
    }
    for g in &grants {
        let st = s.locks.status(&g.name).await.unwrap();
        assert_eq!(st.name, g.name);
        assert!(st.held, "{:?}", g.name);
        let r = s.locks.renew(&g.name, &g.lease, 5000 * MS).await.unwrap();
        assert_eq!((r.name.as_str(), r.fence), (g.name.as_str(), 1));
        s.locks.release(&g.name, &g.lease).await.unwrap();
        assert!(!s.locks.status(&g.name).await.unwrap().held);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeper_keeps_a_short_lease_alive() {
    let s = setup().await;
    // Long enough that a loaded CI machine renews in time (three renewals
    // per ttl), short enough that the run renews several times.
    let ttl = 1500 * MS;
    let keeper = s
        .locks
        .acquire_keeper("doc:k", ttl, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(keeper.name(), "doc:k");
    let fence = keeper.fence();
    assert_eq!(keeper.token(), fence.to_string());
    let first_deadline = keeper.valid_until();

    let end = Instant::now() + 4000 * MS;
    while Instant::now() < end {
        assert!(keeper.is_held(), "lost: {:?}", keeper.loss_reason());
        let st = s.locks.status("doc:k").await.unwrap();
        // Never "held" by the keeper once the gateway says it is not.
        assert!(
            st.held || !keeper.is_held(),
            "the keeper outlived its lease"
        );
        assert!(st.held, "the lease ran out while kept");
        assert_eq!(st.fence, fence, "the fence moved while kept");
        tokio::time::sleep(50 * MS).await;
    }
    assert!(keeper.is_held());
    assert!(keeper.valid_until() > first_deadline, "never renewed");
    assert_eq!(keeper.fence(), fence);

    keeper.release().await.unwrap();
    assert!(!s.locks.status("doc:k").await.unwrap().held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeper_reports_loss_when_the_gateway_goes_away() {
    let s = setup().await;
    // Generous enough that a loaded machine renews in time before the stop.
    let ttl = 1000 * MS;
    let keeper = s
        .locks
        .acquire_keeper("doc:gone", ttl, Duration::ZERO)
        .await
        .unwrap();
    // Wait for a renewal, so the deadline comes from the renewing task.
    let first = keeper.valid_until();
    let until = Instant::now() + 5 * ttl;
    while keeper.valid_until() == first && Instant::now() < until {
        tokio::time::sleep(10 * MS).await;
    }
    assert!(keeper.is_held());
    assert!(keeper.valid_until() > first, "never renewed");

    let Setup {
        app,
        _store,
        _up,
        locks: _,
    } = s;
    app.stop().await;
    let stopped = Instant::now();

    // No renewal can succeed from here, so the deadline is at most one ttl
    // after the last successful renewal was sent (before the stop).
    tokio::time::timeout(ttl + Duration::from_secs(3), keeper.lost())
        .await
        .expect("lost() did not resolve");
    assert!(!keeper.is_held());
    assert!(
        keeper.valid_until() <= stopped + ttl,
        "deadline extended past the stop"
    );
    // Lost by the deadline, not before: no renewal was refused.
    assert!(Instant::now() >= keeper.valid_until());
    let why = keeper.loss_reason().expect("a reason");
    assert!(why.contains("deadline"), "{why}");
    // Once lost, the keeper stays lost.
    tokio::time::sleep(ttl).await;
    assert!(!keeper.is_held());
    assert!(*keeper.subscribe().borrow());
    // Nothing to release it with.
    assert!(keeper.release().await.unwrap_err().is_transient());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeper_reports_loss_when_the_lease_is_taken() {
    let s = setup().await;
    let ttl = Duration::from_secs(3);
    let sent = Instant::now();
    let grant = s
        .locks
        .acquire("doc:taken", ttl, Duration::ZERO)
        .await
        .unwrap();
    let lease = grant.lease.clone();
    let keeper = LeaseKeeper::start(s.locks.clone(), grant, ttl, sent);
    assert!(keeper.is_held());
    assert!(keeper.valid_until() <= sent + ttl);

    // Someone with the lease id releases it and another holder takes over:
    // the next renewal is refused, well before the deadline.
    s.locks.release("doc:taken", &lease).await.unwrap();
    let other = s
        .locks
        .acquire("doc:taken", ttl, Duration::ZERO)
        .await
        .unwrap();
    assert!(other.fence > keeper.fence());

    tokio::time::timeout(ttl + Duration::from_secs(3), keeper.lost())
        .await
        .expect("lost() did not resolve");
    assert!(!keeper.is_held());
    let why = keeper.loss_reason().unwrap();
    assert!(why.contains("refused"), "{why}");
    assert!(matches!(keeper.release().await, Err(Error::NotHolder)));
    // The new holder is untouched.
    let st = s.locks.status("doc:taken").await.unwrap();
    assert!(st.held);
    assert_eq!(st.fence, other.fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_keeper_lets_the_lease_expire() {
    let s = setup().await;
    let ttl = 300 * MS;
    let keeper = s
        .locks
        .acquire_keeper("doc:drop", ttl, Duration::ZERO)
        .await
        .unwrap();
    let lost = keeper.lost();
    drop(keeper);
    tokio::time::timeout(Duration::from_secs(3), lost)
        .await
        .expect("lost() of a dropped keeper did not resolve");
    // Not released: still held until the ttl runs out.
    let g = s
        .locks
        .acquire("doc:drop", ttl, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(g.fence, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeper_follows_jwt_tokens_across_renewals() {
    fn fixture(name: &str) -> String {
        format!("{}/tests/fixtures/keys/{name}", env!("CARGO_MANIFEST_DIR"))
    }
    let s = setup_with(|up| {
        let mut extra = route("docs", "/docs/{id}", up, "doc:{id}");
        extra.push_str("token = \"jwt\"\n");
        extra.push_str(&format!(
            "[tokens]\nissuer = \"fencegate-test\"\nsigning_kid = \"k1\"\n\
             [[tokens.keys]]\nkid = \"k1\"\nalgorithm = \"EdDSA\"\nprivate_key_file = \"{}\"\npublic_key_file = \"{}\"\n",
            fixture("ed25519.pem"),
            fixture("ed25519.pub.pem"),
        ));
        extra
    })
    .await;
    let ttl = 1500 * MS;
    let keeper = s
        .locks
        .acquire_keeper("doc:jwt", ttl, Duration::ZERO)
        .await
        .unwrap();
    let first = keeper.token();
    assert_eq!(first.split('.').count(), 3, "not a JWT: {first}");
    assert_eq!(
        s.app.put("/docs/jwt", Some(&first), "one").await.status(),
        200
    );

    // iat and exp have one-second resolution: within a few seconds of
    // renewals the token changes, the fence does not.
    let until = Instant::now() + Duration::from_secs(5);
    while keeper.token() == first && Instant::now() < until {
        tokio::time::sleep(50 * MS).await;
    }
    let later = keeper.token();
    assert_ne!(later, first, "the token never changed across renewals");
    assert!(keeper.is_held());
    assert_eq!(
        s.app.put("/docs/jwt", Some(&later), "two").await.status(),
        200
    );
    assert_eq!(
        s.locks.status("doc:jwt").await.unwrap().fence,
        keeper.fence()
    );
    keeper.release().await.unwrap();
}
