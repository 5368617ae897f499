//! Leader election through the gateway's lock API.
//!
//! ```text
//! cargo run -p fencegate-client --example leader_election -- http://127.0.0.1:8080 job:nightly
//! ```
//!
//! Run it in two terminals: one becomes leader and works; the other waits.
//! Stop the leader with Ctrl-C (it releases the lock, and the other takes
//! over at once) or freeze it with Ctrl-Z (its lease expires, the other
//! takes over, and when it resumes it notices the loss and stops working).

use std::time::Duration;

use fencegate_client::{Error, LeaseKeeper, LockClient};

/// How long a lease lasts without renewal: how long the others wait when
/// the leader dies without releasing.
const TTL: Duration = Duration::from_secs(10);
/// How long one acquire lets the gateway wait for the lock before asking
/// again (must be within the gateway's `locks.max_wait_ms`).
const WAIT: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(base), Some(name)) = (args.next(), args.next()) else {
        eprintln!("usage: leader_election <gateway base URL> <lock name>");
        eprintln!("   eg: leader_election http://127.0.0.1:8080 job:nightly");
        std::process::exit(2);
    };
    let locks = match LockClient::new(&base) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };

    let mut backoff = Duration::from_millis(500);
    loop {
        println!("waiting for {name:?}...");
        let keeper = tokio::select! {
            r = locks.acquire_keeper(&name, TTL, WAIT) => r,
            _ = tokio::signal::ctrl_c() => return,
        };
        let keeper = match keeper {
            Ok(k) => k,
            // Still held by someone else after waiting: wait again.
            Err(Error::Held { .. }) => continue,
            Err(e) if e.is_transient() => {
                eprintln!("cannot reach the lock service ({e}); retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
            Err(e) => {
                eprintln!("giving up: {e}");
                std::process::exit(1);
            }
        };
        backoff = Duration::from_millis(500);
        println!("leader of {name:?} with fence {}", keeper.fence());

        tokio::select! {
            // Stop working the moment the lease is lost; dropping the work
            // future cancels it at its next await.
            _ = keeper.lost() => {
                eprintln!(
                    "lost leadership ({}); stopping work",
                    keeper.loss_reason().unwrap_or_default()
                );
            }
            _ = lead(&keeper) => {}
            _ = tokio::signal::ctrl_c() => {
                match keeper.release().await {
                    Ok(()) => println!("released {name:?}"),
                    Err(e) => eprintln!("release failed ({e}); the lease will expire"),
                }
                return;
            }
        }
        // Lost: dropping the keeper (end of this iteration) stops renewing.
    }
}

/// The leader's work: here, one "write" per second, forever.
async fn lead(keeper: &LeaseKeeper) {
    for step in 1u64.. {
        // Check before each write; the gateway's fence check catches the
        // writes that race with a loss anyway.
        if !keeper.is_held() {
            return;
        }
        // Read the token for every write: with JWT tokens it changes on
        // renewal. This is where the write goes through the gateway, e.g.
        //
        //   PUT http://127.0.0.1:8080/docs/report
        //   X-Fence-Token: <keeper.token()>
        //
        // A 409 answer there means a newer holder has written: stop.
        println!(
            "step {step}: writing with fence {} (X-Fence-Token: {})",
            keeper.fence(),
            keeper.token()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
