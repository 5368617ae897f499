-- Idempotency records, continued (see 0007).
--
-- attempt: a random number a gateway picks when it writes an in-flight
-- record. Completing, marking unknown or forgetting a record matches it, so
-- a gateway that stalled past its record's time never writes its late
-- answer into a newer attempt of the same key (a duplicate that took the
-- record over once it expired).
ALTER TABLE idempotency ADD COLUMN IF NOT EXISTS attempt BIGINT NOT NULL DEFAULT 0;

-- A record never expires while its request may be in flight: records
-- written before this rule with a TTL shorter than their in-flight time
-- are brought in line.
UPDATE idempotency SET expires_at = in_flight_until WHERE expires_at < in_flight_until;

-- Shared mode, a fenced write with an Idempotency-Key: fencegate_enter and
-- the in-flight record in one statement, so in one transaction and one
-- commit. On 'ok' the in-flight record of (p_route, p_method, p_idem_key) is
-- written with p_attempt, or an expired record of the key taken over; the
-- session holds the key's shared advisory lock, as after fencegate_enter.
-- 'duplicate': a live record of the key exists (a concurrent duplicate
-- wrote it first): this write's in-flight marker is taken back, the session
-- holds no lock, and the caller must not forward. A token the call raised
-- stays raised (harmless: a recorded token only makes older ones stale).
-- 'stale' and 'wait' are fencegate_enter's, with no record written.
--
-- The record is written after the marker, and its time counts from then
-- (clock_timestamp(), not the statement's start: fencegate_enter may have
-- waited for the key's lock). Lock order: the record's row (or the primary
-- key entry a concurrent duplicate is inserting) is only ever waited for
-- after the advisory lock is held, and its holder waits for nothing more
-- before it commits, so the two waits cannot form a cycle.
CREATE OR REPLACE FUNCTION fencegate_enter_keyed(
    p_key text, p_token bigint, p_hold_ms bigint,
    p_route text, p_method text, p_idem_key text, p_fingerprint bytea,
    p_attempt bigint, p_in_flight_ms bigint, p_ttl_ms bigint)
RETURNS TABLE (outcome text, highest bigint, wait_ms bigint, entered_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    e record;
    rec_until timestamptz;
BEGIN
    SELECT * INTO e FROM fencegate_enter(p_key, p_token, p_hold_ms);
    IF e.outcome <> 'ok' THEN
        RETURN QUERY SELECT e.outcome, e.highest, e.wait_ms, e.entered_ms;
        RETURN;
    END IF;
    rec_until := clock_timestamp() + p_in_flight_ms * interval '1 millisecond';
    INSERT INTO idempotency AS i
           (route, method, idem_key, fingerprint, state, in_flight_until, expires_at, attempt)
    VALUES (p_route, p_method, p_idem_key, p_fingerprint, 'in_flight', rec_until,
            GREATEST(rec_until, now() + p_ttl_ms * interval '1 millisecond'), p_attempt)
    ON CONFLICT (route, method, idem_key) DO UPDATE
       SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',
           in_flight_until = EXCLUDED.in_flight_until, expires_at = EXCLUDED.expires_at,
           attempt = EXCLUDED.attempt, status = NULL, headers = NULL, body = NULL
     WHERE i.expires_at <= now();
    IF NOT FOUND THEN
        -- Not fencegate_leave: it commits asynchronously, and a token this
        -- call raised must be as durable as any other.
        UPDATE fences SET inflight = GREATEST(inflight - 1, 0)
         WHERE resource_key = p_key AND highest_token = p_token;
        PERFORM pg_advisory_unlock_shared(1179077465, hashtext(p_key));
        RETURN QUERY SELECT 'duplicate'::text, p_token, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    RETURN QUERY SELECT e.outcome, e.highest, e.wait_ms, e.entered_ms;
END
$$;
