//! The fencing guarantees as both recording upstreams check them, write by
//! write: never two tokens in flight on a path at once, and never a token
//! applied after a higher one on the same path.

use std::collections::HashMap;

/// What a recording upstream saw break.
#[derive(Default)]
pub struct Breaches {
    /// Highest token applied per path.
    highest: HashMap<String, i64>,
    /// Every breach so far, in words; empty means the guarantees held.
    pub seen: Vec<String>,
}

impl Breaches {
    /// A write of `token` arrives on `path` while writes of the tokens
    /// `in_flight` are in flight there: each other token is a breach,
    /// reported once.
    pub fn arrive(
        &mut self,
        path: &str,
        token: Option<i64>,
        in_flight: impl IntoIterator<Item = Option<i64>>,
    ) {
        let mut reported = Vec::new();
        for other in in_flight {
            if other != token && !reported.contains(&other) {
                reported.push(other);
                self.seen.push(format!(
                    "two tokens in flight on {path}: {} and {}",
                    fmt_token(other),
                    fmt_token(token)
                ));
            }
        }
    }

    /// A write of `token` is applied on `path`: a token below the highest
    /// applied there is a breach.
    pub fn apply(&mut self, path: &str, token: Option<i64>) {
        if let Some(t) = token {
            match self.highest.get(path).copied() {
                Some(h) if t < h => self.seen.push(format!("applied {t} after {h} on {path}")),
                Some(h) if t == h => {}
                _ => {
                    self.highest.insert(path.to_string(), t);
                }
            }
        }
    }
}

/// A write's token as the upstreams write it: the number, or `none`.
pub fn fmt_token(t: Option<i64>) -> String {
    t.map_or_else(|| "none".to_string(), |t| t.to_string())
}
