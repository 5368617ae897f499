//! The `Idempotency-Key` flow of a fenced write: the body fingerprinted and
//! memory asked first, then the key's record claimed together with the
//! fence decision, a duplicate told what the record says, and a first
//! use's answer stored before it is returned. The keys, fingerprints and
//! caches themselves are `idempotency`'s; the records' statements are the
//! store's.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;

use super::accounting::Ended;
use super::detach::ClientPresence;
use super::error::{ClientError, GatewayError, UpstreamError};
use super::fence::{Admission, RecordCheck};
use super::fenced::FencedWrite;
use super::forward::forward;
use super::live::GatedRoute;
use super::proxy::Downstream;
use super::state::GatewayState;
use crate::idempotency::{self, Cached};
use crate::metrics::IdempotencyOutcome;
use crate::store::{Begin, Found, RecordId, StoreError, StoredAnswer};

impl FencedWrite {
    /// Phase: idempotency key, from memory. Reads the body (writes with an Idempotency-Key
    /// are buffered: the fingerprint covers it), then asks the cache of
    /// completed records: a replay or a 422 ends here (`Err`), without the
    /// store; otherwise the write goes on as a first use, as far as memory
    /// knows (the record's insert will tell the truth).
    pub(super) async fn ask_memory(
        &mut self,
        state: &GatewayState,
        key: String,
    ) -> Result<FirstUse, Ended> {
        let settings = self.route.idempotency.ok_or(Err(GatewayError::Internal(
            "an idempotency key on a route without idempotency",
        )))?;
        let body = std::mem::take(self.req.body_mut());
        let limit = state.max_body_bytes as usize;
        let bytes =
            match http_body_util::BodyExt::collect(http_body_util::Limited::new(body, limit)).await
            {
                Ok(c) => c.to_bytes(),
                Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                    return Err(Err(ClientError::BodyTooLarge {
                        limit: state.max_body_bytes,
                    }
                    .into()))
                }
                Err(_) => {
                    return Err(Err(ClientError::BadRequest(
                        "the client broke off the request body",
                    )
                    .into()))
                }
            };
        let pq = self
            .req
            .uri()
            .path_and_query()
            .map_or("/", |pq| pq.as_str());
        let fingerprint =
            idempotency::fingerprint(self.req.method(), pq, self.req.headers(), &bytes);
        *self.req.body_mut() = Body::from(bytes);
        match state
            .replays
            .get(self.record_id(&key), &fingerprint, Instant::now())
        {
            Cached::Replay(resp) => Err(Ok(resp)),
            Cached::Reused => Err(Err(ClientError::IdempotencyReused.into())),
            Cached::Miss => Ok(FirstUse {
                settings,
                key,
                fingerprint,
            }),
        }
    }

    /// A first use of an `Idempotency-Key`: check the fence and write the
    /// key's record, forward, and store the answer before returning it.
    /// Answers whether the write was forwarded, and the result.
    pub(super) async fn decide_with_record_and_forward(
        mut self: Box<Self>,
        state: &GatewayState,
        peer: Downstream,
        first: FirstUse,
        client: &dyn ClientPresence,
    ) -> (bool, Ended) {
        // Owned handles, so that the record's id does not borrow `self`,
        // whose request the forward consumes (an `Arc` and, for the usual
        // methods, no allocation).
        let route = self.route.clone();
        let route_name = route.name.as_str();
        let method = self.req.method().clone();
        let id = || RecordId {
            route: route_name,
            method: method.as_str(),
            key: &first.key,
        };
        // While this instance holds fenced writes back after a crash (the
        // quarantine), a first use waits before its record is written; a
        // replay must not wait with it, so then the store is asked first.
        if state.fence.holding_back() {
            match Box::pin(recorded(state, id(), &first.fingerprint)).await {
                // A record of a request never sent is taken back below.
                Ok(RecordSays::Nothing | RecordSays::Unsent(_)) => {}
                Ok(RecordSays::Ended(ended)) => return (false, ended),
                Err(e) => return (false, Err(e)),
            }
        }
        let decided = Instant::now();
        let store_timeout = state.fence.store.timeout();
        let claimed = self.claim(state, &first, id, store_timeout).await;
        let Claimed {
            admission,
            record_until,
            expires,
            attempt,
        } = match claimed {
            Ok(c) => c,
            Err(ended) => return (false, ended),
        };
        state.metrics.decision_time.observe(decided.elapsed());
        let record = Some((record_until, store_timeout));
        if let Err(e) = self.may_start(&admission, client, record) {
            // Nothing was sent: the key's record goes.
            state.forgets.later(id(), attempt, expires);
            return (false, Err(e));
        }
        // Phase: forward, then store the answer before returning it.
        let result = forward(state, &self.route, self.req, peer, Some(admission)).await;
        let end = FirstEnd {
            id: id(),
            attempt,
            fingerprint: first.fingerprint,
            expires,
        };
        (
            true,
            Box::pin(idempotency_answer(
                state,
                &self.route,
                end,
                &first.settings,
                result,
            ))
            .await,
        )
    }

    /// Claims the key's record together with the fence decision: the
    /// admission and the record once the fence admits the write, or how
    /// the request ends (a duplicate told what the record says, a refusal).
    async fn claim<'a>(
        &mut self,
        state: &GatewayState,
        first: &'a FirstUse,
        id: impl Fn() -> RecordId<'a>,
        store_timeout: Duration,
    ) -> Result<Claimed, Ended> {
        // A claim that finds a live record whose read then finds none: the
        // record went in between (its own first use was refused before
        // anything was sent and forgot it, or it expired). Nothing holds
        // the key's record any more, so this request is its first use and
        // claims it again; only a record that vanishes a second time is
        // answered 503, for the client to retry.
        let mut claims = 1;
        // Whether a record of a request never sent was taken back (once).
        let mut took_back = false;
        loop {
            let arrival = match self.arrival(state) {
                Ok(a) => a,
                Err(e) => {
                    let record = (id(), first.fingerprint);
                    return Err(Box::pin(unless_recorded(state, record, e)).await);
                }
            };
            let attempt: i64 = rand::random();
            // The record: written once the fence admits the write, in one
            // transaction with it where the store allows it (see
            // `Fence::check_with_record`). Its insert is also the lookup: a live
            // record of the key (a duplicate, or a replay memory did not
            // know) is found only then, and read.
            let begin = Begin {
                id: id(),
                fingerprint: &first.fingerprint,
                attempt,
                in_flight: idempotency::in_flight(self.route.timeout, store_timeout),
                ttl: first.settings.ttl,
            };
            // Before the record's statement starts: with the record's
            // lifetime, a local lower bound of its expiry.
            let begun = Instant::now();
            let lives = Duration::from_millis(begin.in_flight.max(begin.ttl).as_millis() as u64);
            let check = Box::pin(state.fence.check_with_record(self.write(), arrival, &begin));
            match check.await {
                Ok(RecordCheck::Admitted {
                    admission,
                    record_until,
                }) => {
                    return Ok(Claimed {
                        admission,
                        record_until,
                        expires: idempotency::cached_until(begun, lives),
                        attempt,
                    })
                }
                Ok(RecordCheck::Duplicate) => {
                    let again = Again {
                        claims: &mut claims,
                        took_back: &mut took_back,
                    };
                    if let Some(ended) = duplicate(state, begin.id, &first.fingerprint, again).await
                    {
                        return Err(ended);
                    }
                }
                Ok(RecordCheck::Refused(e)) => {
                    let record = (begin.id, first.fingerprint);
                    return Err(Box::pin(unless_recorded(state, record, e)).await);
                }
                Err(e) => {
                    // Nothing was forwarded; the record may have been
                    // written all the same (see `check_with_record`).
                    state.forgets.later(begin.id, attempt, begun + lives);
                    return Err(Err(e));
                }
            }
        }
    }

    pub(super) fn record_id<'a>(&'a self, key: &'a str) -> RecordId<'a> {
        RecordId {
            route: &self.route.name,
            method: self.req.method().as_str(),
            key,
        }
    }
}

/// A first use of an idempotency key, as far as memory knows: its body
/// read and fingerprinted, no completed record of its key cached.
pub(super) struct FirstUse {
    pub(super) settings: crate::config::IdempotencySettings,
    pub(super) key: String,
    pub(super) fingerprint: [u8; 32],
}

/// Whether a claim may be made again, and what was tried already.
struct Again<'a> {
    /// Claims made for this request.
    claims: &'a mut u32,
    /// Whether a record of a request never sent was taken back (once).
    took_back: &'a mut bool,
}

/// A claim found a live record of the key: how the request ends, as the
/// record says; `None` to claim the key again. When it is the record of a
/// request this instance never sent (whose client was told 503) and is
/// forgetting, it is forgotten now and the key claimed again, once: the
/// client's retry is the key's first use, not "in progress" until the
/// background forget lands. A store that cannot forget it now is 503
/// again.
async fn duplicate(
    state: &GatewayState,
    id: RecordId<'_>,
    fingerprint: &[u8; 32],
    again: Again<'_>,
) -> Option<Ended> {
    match Box::pin(recorded(state, id, fingerprint)).await {
        Ok(RecordSays::Ended(ended)) => Some(ended),
        Ok(RecordSays::Unsent(unsent)) if !*again.took_back => {
            *again.took_back = true;
            let taken = state.forgets.take_back(id, unsent).await;
            taken.err().map(|e| Err(e.into()))
        }
        Ok(RecordSays::Unsent(_)) => {
            let e = "the key's record of a request never sent outlived its forget";
            Some(Err(StoreError::Other(e.into()).into()))
        }
        Ok(RecordSays::Nothing) if *again.claims < MAX_CLAIMS => {
            *again.claims += 1;
            None
        }
        Ok(RecordSays::Nothing) => {
            let e = "the key's idempotency record vanished twice while it was read";
            Some(Err(StoreError::Other(e.into()).into()))
        }
        Err(e) => Some(Err(e)),
    }
}

/// What a key's record says to a request ([`recorded`]).
pub(super) enum RecordSays {
    /// No live record.
    Nothing,
    /// The record of a request this instance never sent, which it is
    /// forgetting (the record's attempt): an answer to no one.
    Unsent(i64),
    /// A completed record's answer, or a refusal.
    Ended(Ended),
}

/// What the store's record `id` says to a request of `fingerprint`: a
/// completed record's answer (remembered in memory from now on), or a
/// refusal; nothing when there is no live record, or when it is the
/// record of a request this instance never sent and is forgetting.
pub(super) async fn recorded(
    state: &GatewayState,
    id: RecordId<'_>,
    fingerprint: &[u8; 32],
) -> Result<RecordSays, GatewayError> {
    // Before the read's statement starts: with the time to expiry it
    // reports, a local lower bound of the record's expiry.
    let anchor = Instant::now();
    let read = state.fence.store.idem_read(id, fingerprint).await?;
    if let Some(attempt) = read.attempt.filter(|a| state.forgets.forgetting(id, *a)) {
        return Ok(RecordSays::Unsent(attempt));
    }
    Ok(match read.found {
        Found::Absent => RecordSays::Nothing,
        Found::Done(stored) => {
            let until = idempotency::cached_until(anchor, read.expires_in);
            state
                .replays
                .insert(id, *fingerprint, &stored, until, Instant::now());
            RecordSays::Ended(Ok(replay(stored)))
        }
        Found::Reused => RecordSays::Ended(Err(ClientError::IdempotencyReused.into())),
        Found::InFlight { for_ms } => RecordSays::Ended(Err(ClientError::IdempotencyInProgress {
            retry_after: Duration::from_millis(for_ms),
        }
        .into())),
        Found::Unknown => RecordSays::Ended(Err(ClientError::IdempotencyOutcomeUnknown.into())),
    })
}

/// A write with an Idempotency-Key refused before its record (its id and fingerprint) was
/// written: the refusal stands only if the key has no live record, or only
/// the record of a request this instance never sent. A record of an
/// earlier request answers instead — a replay's token is stale once a
/// newer one was recorded, and a replay is served all the same (the write
/// did happen); a duplicate in flight is 409 in progress. When the store
/// cannot be read, its error: the gateway cannot tell which it is.
pub(super) async fn unless_recorded(
    state: &GatewayState,
    (id, fingerprint): (RecordId<'_>, [u8; 32]),
    refusal: GatewayError,
) -> Ended {
    match recorded(state, id, &fingerprint).await {
        Ok(RecordSays::Nothing | RecordSays::Unsent(_)) => Err(refusal),
        Ok(RecordSays::Ended(ended)) => ended,
        Err(e) => Err(e),
    }
}

/// A stored answer, replayed.
pub(super) fn replay(stored: StoredAnswer) -> Response {
    let (status, headers) = idempotency::replay_head(&stored);
    let mut resp = Response::new(Body::from(stored.body));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

/// A forwarded first use's record, for its end.
pub(super) struct FirstEnd<'a> {
    pub(super) id: RecordId<'a>,
    pub(super) attempt: i64,
    pub(super) fingerprint: [u8; 32],
    /// A local lower bound of the record's expiry.
    pub(super) expires: Instant,
}

/// The end of a first use: the upstream's answer stored durably before it
/// is returned, and remembered for replays once it is; or, when it cannot
/// be stored, the record told what is known.
pub(super) async fn idempotency_answer(
    state: &GatewayState,
    route: &GatedRoute,
    end: FirstEnd<'_>,
    settings: &crate::config::IdempotencySettings,
    result: Result<Response, GatewayError>,
) -> Result<Response, GatewayError> {
    let FirstEnd {
        id,
        attempt,
        fingerprint,
        expires,
    } = end;
    let store = &state.fence.store;
    let resp = match result {
        Ok(resp) => resp,
        // Nothing of it was sent (the connection failed): the key may be
        // used again (once forgotten, which is tried in the background when
        // the store fails now).
        Err(e @ GatewayError::Upstream(UpstreamError::Unreachable { sent: false, .. })) => {
            state.forgets.now_or_later(id, attempt, expires).await;
            return Err(e);
        }
        Err(e) => {
            route.metrics.idempotency(IdempotencyOutcome::NotStored);
            if let Err(err) = store.idem_unknown(id, attempt).await {
                tracing::warn!(error = %err, "cannot mark an idempotency record unknown; it becomes so when its time runs out");
            }
            return Err(e);
        }
    };
    let (parts, body) = resp.into_parts();
    match idempotency::buffer(body, settings.max_response_bytes).await {
        Ok(idempotency::Buffered::Whole(bytes)) => {
            let stored = StoredAnswer {
                status: parts.status.as_u16(),
                headers: parts
                    .headers
                    .iter()
                    .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
                    .collect(),
                body: bytes.clone(),
            };
            match store.idem_complete(id, attempt, &stored).await {
                // Durable in the record, which nothing changes until it
                // expires: replays may come from memory until then.
                Ok(true) => state
                    .replays
                    .insert(id, fingerprint, &stored, expires, Instant::now()),
                // The record is no longer this attempt's (this gateway
                // stalled past its time and a duplicate took the expired
                // record over): nothing stored, nothing remembered.
                Ok(false) => {
                    route.metrics.idempotency(IdempotencyOutcome::NotStored);
                    tracing::warn!(
                        "an idempotency answer came after its record's time; not stored"
                    );
                }
                Err(err) => {
                    // The answer is the truth: give it; duplicates will hear
                    // "outcome unknown" once the record's time runs out.
                    route.metrics.idempotency(IdempotencyOutcome::NotStored);
                    tracing::warn!(error = %err, "cannot store an idempotency answer");
                }
            }
            Ok(Response::from_parts(parts, Body::from(bytes)))
        }
        Ok(idempotency::Buffered::TooLarge(body)) => {
            route.metrics.idempotency(IdempotencyOutcome::NotStored);
            if let Err(err) = store.idem_unknown(id, attempt).await {
                tracing::warn!(error = %err, "cannot mark an idempotency record unknown; it becomes so when its time runs out");
            }
            Ok(Response::from_parts(parts, body))
        }
        Err(()) => {
            route.metrics.idempotency(IdempotencyOutcome::NotStored);
            if let Err(err) = store.idem_unknown(id, attempt).await {
                tracing::warn!(error = %err, "cannot mark an idempotency record unknown; it becomes so when its time runs out");
            }
            Err(UpstreamError::Unreachable {
                route: route.name.clone(),
                detail: "the upstream's answer broke off".into(),
                sent: true,
            }
            .into())
        }
    }
}

/// How often a first use claims its key's record when the live record its
/// claim found has gone by the time it is read (see
/// `decide_with_record_and_forward`). The claim after taking back a record of a
/// request never sent does not count.
pub(super) const MAX_CLAIMS: u32 = 2;

/// A claimed record of a first use: its admission, and what the end of the
/// write needs of the record.
struct Claimed {
    admission: Admission,
    /// When the record stops being in flight.
    record_until: Instant,
    /// A local lower bound of the record's expiry.
    expires: Instant,
    /// The record's attempt: what the write's later changes to it match.
    attempt: i64,
}
