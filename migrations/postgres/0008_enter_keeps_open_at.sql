-- A token raised over writers that never left (a crashed or abandoned
-- write's marker) opens only when their writes can no longer arrive
-- (open_at). Until 0008, a still higher token arriving before that instant
-- overwrote open_at and was admitted at once, while those writes might
-- still reach the upstream. Now it takes over the waiting: a newer token
-- never opens before the current one would have. The rest is as in 0005.

-- Admits a fenced write of p_token on p_key. On 'ok' the calling session
-- holds the key's shared advisory lock and must call fencegate_leave when
-- the write has finished at the upstream. 'stale' carries the highest token.
-- 'wait' carries how long (ms) until writers that never left can no longer
-- arrive; the token is recorded by then, so older ones are already refused.
-- After 'stale' or 'wait' the session holds no lock. 'ok' also carries
-- entered_ms: how long after the statement's start the in-flight marker was
-- written (read before writing it, so a lower bound): the caller adds it to
-- the moment it sent the statement to get a local lower bound of the
-- marker's end, whatever the wait inside the statement was.
CREATE OR REPLACE FUNCTION fencegate_enter(p_key text, p_token bigint, p_hold_ms bigint)
RETURNS TABLE (outcome text, highest bigint, wait_ms bigint, entered_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    ns CONSTANT int := 1179077465;
    h int := hashtext(p_key);
    hold interval := p_hold_ms * interval '1 millisecond';
    cur_token bigint;
    cur_inflight int;
    cur_until timestamptz;
    cur_open timestamptz;
    entered bigint;
BEGIN
    -- Fast path: the token is the key's current, open one. The row lock of
    -- the UPDATE waits for a concurrent token change to commit, and its WHERE
    -- is re-checked against the changed row; the shared lock then keeps the
    -- token current until this write leaves.
    PERFORM pg_advisory_lock_shared(ns, h);
    entered := FLOOR(EXTRACT(EPOCH FROM (clock_timestamp() - statement_timestamp())) * 1000);
    UPDATE fences
       SET inflight = inflight + 1,
           writer_until = GREATEST(writer_until, clock_timestamp() + hold)
     WHERE resource_key = p_key AND highest_token = p_token
       AND (open_at IS NULL OR open_at <= clock_timestamp());
    IF FOUND THEN
        RETURN QUERY SELECT 'ok'::text, p_token, 0::bigint, entered;
        RETURN;
    END IF;
    SELECT f.highest_token, f.open_at INTO cur_token, cur_open
      FROM fences f WHERE f.resource_key = p_key;
    IF FOUND AND p_token <= cur_token THEN
        PERFORM pg_advisory_unlock_shared(ns, h);
        IF p_token < cur_token THEN
            RETURN QUERY SELECT 'stale'::text, cur_token, 0::bigint, 0::bigint;
        ELSE
            RETURN QUERY SELECT 'wait'::text, cur_token,
                GREATEST(1, CEIL(EXTRACT(EPOCH FROM (cur_open - clock_timestamp())) * 1000))::bigint, 0::bigint;
        END IF;
        RETURN;
    END IF;

    -- A higher token (or a new key): change the token under the exclusive
    -- lock, which is granted once every write holding the shared lock, on
    -- every instance, has left.
    PERFORM pg_advisory_unlock_shared(ns, h);
    PERFORM pg_advisory_lock(ns, h);
    -- FOR UPDATE: wait for the last leaving writer's decrement to commit.
    SELECT f.highest_token, f.inflight, f.writer_until, f.open_at
      INTO cur_token, cur_inflight, cur_until, cur_open
      FROM fences f WHERE f.resource_key = p_key FOR UPDATE;
    IF FOUND AND p_token < cur_token THEN
        PERFORM pg_advisory_unlock(ns, h);
        RETURN QUERY SELECT 'stale'::text, cur_token, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    IF FOUND AND p_token > cur_token AND cur_inflight > 0 AND cur_until > clock_timestamp() THEN
        -- Writers of the old token hold no lock, yet never left: they
        -- crashed or lost Postgres mid-forward, and their writes may still
        -- reach the upstream until cur_until. Record the new token now, so
        -- older ones are refused, but open it only then.
        cur_open := GREATEST(cur_until, cur_open);
        UPDATE fences
           SET highest_token = p_token, updated_at = now(), inflight = 0,
               writer_until = NULL, open_at = cur_open
         WHERE resource_key = p_key;
        PERFORM pg_advisory_unlock(ns, h);
        RETURN QUERY SELECT 'wait'::text, p_token,
            GREATEST(1, CEIL(EXTRACT(EPOCH FROM (cur_open - clock_timestamp())) * 1000))::bigint, 0::bigint;
        RETURN;
    END IF;
    IF FOUND AND p_token > cur_token AND cur_open > clock_timestamp() THEN
        -- The current token was itself raised over writers that never left
        -- and is not open yet: their writes may still arrive until then, so
        -- a newer token waits as long (taking over the opening time).
        UPDATE fences
           SET highest_token = p_token, updated_at = now(), inflight = 0,
               writer_until = NULL
         WHERE resource_key = p_key;
        PERFORM pg_advisory_unlock(ns, h);
        RETURN QUERY SELECT 'wait'::text, p_token,
            GREATEST(1, CEIL(EXTRACT(EPOCH FROM (cur_open - clock_timestamp())) * 1000))::bigint, 0::bigint;
        RETURN;
    END IF;
    IF FOUND AND p_token = cur_token AND cur_open > clock_timestamp() THEN
        PERFORM pg_advisory_unlock(ns, h);
        RETURN QUERY SELECT 'wait'::text, cur_token,
            GREATEST(1, CEIL(EXTRACT(EPOCH FROM (cur_open - clock_timestamp())) * 1000))::bigint, 0::bigint;
        RETURN;
    END IF;
    entered := FLOOR(EXTRACT(EPOCH FROM (clock_timestamp() - statement_timestamp())) * 1000);
    INSERT INTO fences AS f (resource_key, highest_token, updated_at, inflight, writer_until)
    VALUES (p_key, p_token, now(), 1, clock_timestamp() + hold)
    ON CONFLICT (resource_key) DO UPDATE
        SET inflight = CASE WHEN f.highest_token = EXCLUDED.highest_token THEN f.inflight + 1 ELSE 1 END,
            writer_until = CASE WHEN f.highest_token = EXCLUDED.highest_token
                                THEN GREATEST(f.writer_until, EXCLUDED.writer_until)
                                ELSE EXCLUDED.writer_until END,
            updated_at = CASE WHEN f.highest_token = EXCLUDED.highest_token THEN f.updated_at ELSE now() END,
            open_at = NULL,
            highest_token = EXCLUDED.highest_token;
    -- Downgrade: keep a shared lock for the forward and let equal tokens in.
    PERFORM pg_advisory_lock_shared(ns, h);
    PERFORM pg_advisory_unlock(ns, h);
    RETURN QUERY SELECT 'ok'::text, p_token, 0::bigint, entered;
END
$$;

