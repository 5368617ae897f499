-- Shared mode: several gateway instances on one Postgres.
--
-- Per-key serialization across instances uses session advisory locks in the
-- two-int4 form, namespace 1179077465 ('FGKY'), id hashtext(resource_key):
-- shared while forwarding writes with the key's current token, exclusive to
-- change the token. A hash collision between two keys only makes them wait
-- for each other (false contention), never lets two tokens of one key run
-- together.
--
-- The in-flight marker (inflight, writer_until) lives in the fence row and is
-- written by the same statement that admits a write, so it costs no extra
-- round trip. A writer that leaves normally decrements inflight when it
-- releases its lock. A writer that crashed (or lost its connection) cannot;
-- the next writer with a higher token then waits until writer_until, after
-- which the crashed write can no longer arrive at the upstream (its route
-- timeout is over).

ALTER TABLE fences ADD COLUMN IF NOT EXISTS inflight INTEGER NOT NULL DEFAULT 0;
ALTER TABLE fences ADD COLUMN IF NOT EXISTS writer_until TIMESTAMPTZ;
-- Set when a token was raised over writers that never left: no write with
-- the new token may be forwarded before it.
ALTER TABLE fences ADD COLUMN IF NOT EXISTS open_at TIMESTAMPTZ;

-- Admits a fenced write of p_token on p_key. On 'ok' the calling session
-- holds the key's shared advisory lock and must call fencegate_leave when
-- the write has finished at the upstream. 'stale' carries the highest token.
-- 'wait' carries how long (ms) until writers that never left can no longer
-- arrive; the token is recorded by then, so older ones are already refused.
-- After 'stale' or 'wait' the session holds no lock.
CREATE OR REPLACE FUNCTION fencegate_enter(p_key text, p_token bigint, p_hold_ms bigint)
RETURNS TABLE (outcome text, highest bigint, wait_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    ns CONSTANT int := 1179077465;
    h int := hashtext(p_key);
    hold interval := p_hold_ms * interval '1 millisecond';
    cur_token bigint;
    cur_inflight int;
    cur_until timestamptz;
    cur_open timestamptz;
BEGIN
    -- Fast path: the token is the key's current, open one. The row lock of
    -- the UPDATE waits for a concurrent token change to commit, and its WHERE
    -- is re-checked against the changed row; the shared lock then keeps the
    -- token current until this write leaves.
    PERFORM pg_advisory_lock_shared(ns, h);
    UPDATE fences
       SET inflight = inflight + 1,
           writer_until = GREATEST(writer_until, clock_timestamp() + hold)
     WHERE resource_key = p_key AND highest_token = p_token
       AND (open_at IS NULL OR open_at <= clock_timestamp());
    IF FOUND THEN
        RETURN QUERY SELECT 'ok'::text, p_token, 0::bigint;
        RETURN;
    END IF;
    SELECT f.highest_token, f.open_at INTO cur_token, cur_open
      FROM fences f WHERE f.resource_key = p_key;
    IF FOUND AND p_token <= cur_token THEN
        PERFORM pg_advisory_unlock_shared(ns, h);
        IF p_token < cur_token THEN
            RETURN QUERY SELECT 'stale'::text, cur_token, 0::bigint;
        ELSE
            RETURN QUERY SELECT 'wait'::text, cur_token,
                GREATEST(1, CEIL(EXTRACT(EPOCH FROM (cur_open - clock_timestamp())) * 1000))::bigint;
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
        RETURN QUERY SELECT 'stale'::text, cur_token, 0::bigint;
        RETURN;
    END IF;
    IF FOUND AND p_token > cur_token AND cur_inflight > 0 AND cur_until > clock_timestamp() THEN
        -- Writers of the old token hold no lock, yet never left: they
        -- crashed or lost Postgres mid-forward, and their writes may still
        -- reach the upstream until cur_until. Record the new token now, so
        -- older ones are refused, but open it only then.
        UPDATE fences
           SET highest_token = p_token, updated_at = now(), inflight = 0,
               writer_until = NULL, open_at = cur_until
         WHERE resource_key = p_key;
        PERFORM pg_advisory_unlock(ns, h);
        RETURN QUERY SELECT 'wait'::text, p_token,
            GREATEST(1, CEIL(EXTRACT(EPOCH FROM (cur_until - clock_timestamp())) * 1000))::bigint;
        RETURN;
    END IF;
    IF FOUND AND p_token = cur_token AND cur_open > clock_timestamp() THEN
        PERFORM pg_advisory_unlock(ns, h);
        RETURN QUERY SELECT 'wait'::text, cur_token,
            GREATEST(1, CEIL(EXTRACT(EPOCH FROM (cur_open - clock_timestamp())) * 1000))::bigint;
        RETURN;
    END IF;
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
    RETURN QUERY SELECT 'ok'::text, p_token, 0::bigint;
END
$$;

-- A write admitted by fencegate_enter has finished at the upstream. The
-- decrement need not be durable: if it is lost, the next token change only
-- waits until writer_until, which is the safe direction.
CREATE OR REPLACE FUNCTION fencegate_leave(p_key text, p_token bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE fences SET inflight = GREATEST(inflight - 1, 0)
     WHERE resource_key = p_key AND highest_token = p_token;
    PERFORM pg_advisory_unlock_shared(1179077465, hashtext(p_key));
END
$$;
