-- Shared mode without per-key advisory locks: the fence row alone orders
-- writes across instances, so admissions and leaves of many writes share
-- one statement and one commit (group commit, as in single mode), and no
-- connection is held while a write is in flight.
--
-- A row's admission state:
--   highest_token, inflight, writer_until: writers of the highest token
--     that entered and have not left, and when the last of their markers
--     ends (a writer that never leaves, because its instance crashed or lost
--     Postgres, counts until then).
--   open_at: when set and in the future, the highest token is not admitted
--     yet: writers of draining_token, the token it was raised over, may still
--     be in flight. Those writers count down `draining` as they leave, and
--     the last one opens the key at once (open_at := NULL); writers that
--     never leave are waited out until open_at, the end of their markers.
--   draining_token, draining: see open_at. Only a leave of draining_token
--     counts down, so a writer that outlived its own marker (superseded
--     already) can never open a key that another token's writers hold.
--
-- Before 0010 a session advisory lock per key did the waiting inside
-- Postgres, on a connection held for the whole forward. Now a write that
-- must wait is told 'wait' and asks again (the gateway polls with a short
-- backoff). A higher token that finds writers in flight is recorded at
-- once, so older tokens are refused from then on, and opens when they have
-- left. Rows written by the old protocol need nothing: their open_at (a
-- token raised over writers that never left) is honoured as it is.
ALTER TABLE fences ADD COLUMN IF NOT EXISTS draining_token BIGINT;
ALTER TABLE fences ADD COLUMN IF NOT EXISTS draining INTEGER NOT NULL DEFAULT 0;

-- One admission of a fenced write of p_token on p_key, holding the row's
-- lock until the caller's transaction commits. 'ok': the write is counted
-- in flight and must be left with fencegate_leave_one (or its marker runs
-- out); entered_ms is how long after the statement's start the marker was
-- written (a lower bound, for the caller's local bound of the marker's
-- end). 'stale' carries the highest token. 'wait' carries how long (ms)
-- until the key opens at the latest, if nobody leaves before.
CREATE OR REPLACE FUNCTION fencegate_enter_one(
    p_key text, p_token bigint, p_hold_ms bigint,
    OUT outcome text, OUT highest bigint, OUT wait_ms bigint, OUT entered_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    hold interval := p_hold_ms * interval '1 millisecond';
    f record;
    now_ts timestamptz;
    is_open boolean;
BEGIN
    wait_ms := 0;
    entered_ms := 0;
    LOOP
        SELECT r.highest_token, r.inflight, r.writer_until, r.open_at
          INTO f FROM fences r WHERE r.resource_key = p_key FOR UPDATE;
        EXIT WHEN FOUND;
        entered_ms := FLOOR(EXTRACT(EPOCH FROM (clock_timestamp() - statement_timestamp())) * 1000);
        INSERT INTO fences (resource_key, highest_token, updated_at, inflight, writer_until)
        VALUES (p_key, p_token, now(), 1, clock_timestamp() + hold)
        ON CONFLICT (resource_key) DO NOTHING;
        IF FOUND THEN
            outcome := 'ok';
            highest := p_token;
            RETURN;
        END IF;
        -- A concurrent first write of the key committed its row: lock it.
    END LOOP;
    now_ts := clock_timestamp();
    is_open := f.open_at IS NULL OR f.open_at <= now_ts;
    IF p_token < f.highest_token THEN
        outcome := 'stale';
        highest := f.highest_token;
        RETURN;
    END IF;
    IF NOT is_open THEN
        -- Writers of the token it was raised over may still be in flight.
        -- A still higher token takes over the waiting: it never opens
        -- before the current one would have.
        IF p_token > f.highest_token THEN
            UPDATE fences SET highest_token = p_token, updated_at = now()
             WHERE resource_key = p_key;
        END IF;
        outcome := 'wait';
        highest := p_token;
        wait_ms := GREATEST(1, CEIL(EXTRACT(EPOCH FROM (f.open_at - now_ts)) * 1000))::bigint;
        RETURN;
    END IF;
    IF p_token = f.highest_token THEN
        entered_ms := FLOOR(EXTRACT(EPOCH FROM (clock_timestamp() - statement_timestamp())) * 1000);
        UPDATE fences
           SET inflight = inflight + 1,
               writer_until = GREATEST(writer_until, clock_timestamp() + hold)
         WHERE resource_key = p_key;
        outcome := 'ok';
        highest := p_token;
        RETURN;
    END IF;
    -- A higher token.
    IF f.inflight > 0 AND f.writer_until > now_ts THEN
        -- Writers of the old token are in flight (or never left): record
        -- the new token now, so older ones are refused, and open it when
        -- the last of them leaves, or their markers end.
        UPDATE fences
           SET highest_token = p_token, updated_at = now(), inflight = 0,
               writer_until = NULL, open_at = f.writer_until,
               draining_token = f.highest_token, draining = f.inflight
         WHERE resource_key = p_key;
        outcome := 'wait';
        highest := p_token;
        wait_ms := GREATEST(1, CEIL(EXTRACT(EPOCH FROM (f.writer_until - now_ts)) * 1000))::bigint;
        RETURN;
    END IF;
    entered_ms := FLOOR(EXTRACT(EPOCH FROM (clock_timestamp() - statement_timestamp())) * 1000);
    UPDATE fences
       SET highest_token = p_token, updated_at = now(), inflight = 1,
           writer_until = clock_timestamp() + hold, open_at = NULL,
           draining_token = NULL, draining = 0
     WHERE resource_key = p_key;
    outcome := 'ok';
    highest := p_token;
END
$$;

-- A fenced write of p_token on p_key has finished at the upstream.
CREATE OR REPLACE FUNCTION fencegate_leave_one(p_key text, p_token bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fences SET inflight = GREATEST(inflight - 1, 0)
     WHERE resource_key = p_key AND highest_token = p_token
       AND (open_at IS NULL OR open_at <= clock_timestamp());
    IF FOUND THEN
        RETURN;
    END IF;
    UPDATE fences
       SET draining = draining - 1,
           open_at = CASE WHEN draining <= 1 THEN NULL ELSE open_at END,
           draining_token = CASE WHEN draining <= 1 THEN NULL ELSE draining_token END
     WHERE resource_key = p_key AND draining_token = p_token
       AND open_at > clock_timestamp();
END
$$;

-- Leaves and admissions of a batch of writes, in one statement and one
-- commit. Rows are locked in key order (within a key, leaves first, so an
-- admission sees the leaves that came with it, then the lower of two
-- tokens): concurrent batches, on any instance, never wait for each other
-- in a cycle. Answers are for the admissions, with their positions.
--
-- A leave commits with its batch. Were it alone, it could commit
-- asynchronously, as fencegate_leave always has: a lost leave only keeps
-- a key closed until its marker ends, and a write that depends on it
-- commits synchronously, flushing the WAL up to and past it.
CREATE OR REPLACE FUNCTION fencegate_admit_batch(
    p_leave_keys text[], p_leave_tokens bigint[],
    p_keys text[], p_tokens bigint[], p_hold_ms bigint[])
RETURNS TABLE (ord bigint, outcome text, highest bigint, wait_ms bigint, entered_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    i record;
    e record;
BEGIN
    IF cardinality(p_keys) = 0 THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    FOR i IN SELECT a.k, a.t, a.h, a.o FROM (
                 SELECT l.k, l.t, NULL::bigint AS h, 0::bigint AS o
                   FROM unnest(p_leave_keys, p_leave_tokens) AS l(k, t)
                 UNION ALL
                 SELECT u.k, u.t, u.h, u.o
                   FROM unnest(p_keys, p_tokens, p_hold_ms) WITH ORDINALITY AS u(k, t, h, o)
             ) a
             ORDER BY a.k COLLATE "C", a.o > 0, a.t LOOP
        IF i.o = 0 THEN
            PERFORM fencegate_leave_one(i.k, i.t);
            CONTINUE;
        END IF;
        e := fencegate_enter_one(i.k, i.t, i.h);
        ord := i.o;
        outcome := e.outcome;
        highest := e.highest;
        wait_ms := e.wait_ms;
        entered_ms := e.entered_ms;
        RETURN NEXT;
    END LOOP;
END
$$;

-- The one-write forms, as earlier gateways call them: during a rolling
-- upgrade they speak the same protocol. No advisory lock is taken or
-- released any more; 'wait' asks again within 10 ms, because an earlier
-- gateway sleeps for wait_ms before it asks again and a leave may open
-- the key long before the markers end.
CREATE OR REPLACE FUNCTION fencegate_enter(p_key text, p_token bigint, p_hold_ms bigint)
RETURNS TABLE (outcome text, highest bigint, wait_ms bigint, entered_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    e record;
BEGIN
    e := fencegate_enter_one(p_key, p_token, p_hold_ms);
    RETURN QUERY SELECT e.outcome, e.highest, LEAST(e.wait_ms, 10), e.entered_ms;
END
$$;

CREATE OR REPLACE FUNCTION fencegate_leave(p_key text, p_token bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM fencegate_leave_one(p_key, p_token);
END
$$;

-- As in 0009, on fencegate_enter_one: the admission and the in-flight
-- record in one transaction. 'duplicate' takes this write's count back in
-- the same transaction (synchronously: a token this call raised must be as
-- durable as any other). Lock order: the fence row, then the record's row.
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
    e := fencegate_enter_one(p_key, p_token, p_hold_ms);
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
        UPDATE fences SET inflight = GREATEST(inflight - 1, 0)
         WHERE resource_key = p_key AND highest_token = p_token;
        RETURN QUERY SELECT 'duplicate'::text, p_token, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    RETURN QUERY SELECT e.outcome, e.highest, e.wait_ms, e.entered_ms;
END
$$;
