-- Shared mode's batches: the common items in a few set-based statements
-- instead of one or two statements each.
--
-- 0010's fencegate_admit_batch ran a statement per leave and two per
-- admission (fencegate_enter_one locks the row, decides, then writes it),
-- each with its own executor start-up, in a loop over the batch in key
-- order. Most items of a batch are alone on their key and take the common
-- way: a leave of the key's highest token while the key is open, or an
-- admission that finds the key open and either joins the writers of its
-- highest token or raises it over none in flight. Those now take one
-- statement for all the batch's leaves and one for all its admissions.
--
-- Locks. First, one statement takes every key of the batch in key order
-- (COLLATE "C", as the loop always took them): an existing row is locked
-- (ON CONFLICT DO UPDATE locks the row even where its WHERE is false), a
-- missing one is inserted with token 0, which decides every admission as
-- no row would (an admission is 'ok', and the row ends as the loop's
-- insert would leave it). After that statement the batch holds every row
-- it touches, so nothing else it does waits: the only waits are in that
-- one pass in key order, and no two batches, on any instance, wait for
-- each other in a cycle. (Locking the existing rows first and inserting
-- the missing ones later would not do: a row inserted in between, and
-- locked by a third batch, is waited for out of order.) A key that had no
-- row and only leaves in the batch gets no row: its leaves had no writer
-- to count down, and its placeholder is deleted before the batch commits,
-- so no other session ever sees it.
--
-- Meaning. A key with one item in the batch cannot be reordered against
-- another item of its own key, so the set-based statements decide exactly
-- what the loop would: their WHERE clauses are the branches of
-- fencegate_leave_one and fencegate_enter_one (0010) that they replace,
-- and an item that does not match (a stale token, a closed key, a raise
-- over writers in flight, a leave of a draining token) goes through the
-- loop as before. Keys with more than one item go through the loop,
-- leaves first, then the lower token. Outcomes, the answer rows and every
-- column's meaning are 0010's.
CREATE OR REPLACE FUNCTION fencegate_admit_batch(
    p_leave_keys text[], p_leave_tokens bigint[],
    p_keys text[], p_tokens bigint[], p_hold_ms bigint[])
RETURNS TABLE (ord bigint, outcome text, highest bigint, wait_ms bigint, entered_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    i record;
    e record;
    -- Keys that had no row, inserted by the first statement.
    fresh text[];
    -- Keys with exactly one item (a leave or an admission) in the batch.
    alone text[];
    -- Leaves written by the set-based statement, by key (alone: unique).
    left_keys text[];
    -- Admissions decided by the set-based statement, by position.
    set_ords bigint[];
    set_tokens bigint[];
    set_entered bigint;
BEGIN
    IF cardinality(p_keys) = 0 THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    WITH taken AS (
        INSERT INTO fences AS r (resource_key, highest_token, updated_at)
        SELECT d.k, 0, now()
          FROM (SELECT DISTINCT u.k FROM unnest(p_leave_keys || p_keys) AS u(k)) d
         ORDER BY d.k COLLATE "C"
        ON CONFLICT (resource_key) DO UPDATE SET updated_at = r.updated_at WHERE false
        RETURNING r.resource_key)
    SELECT coalesce(array_agg(taken.resource_key), '{}') INTO fresh FROM taken;
    SELECT coalesce(array_agg(a.k), '{}') INTO alone
      FROM (SELECT u.k FROM unnest(p_leave_keys || p_keys) AS u(k)
             GROUP BY u.k HAVING count(*) = 1) a;

    -- fencegate_leave_one's first branch: a writer of the highest token of
    -- an open key.
    WITH l AS (
        SELECT u.k, u.t FROM unnest(p_leave_keys, p_leave_tokens) AS u(k, t)
         WHERE u.k = ANY (alone) AND NOT u.k = ANY (fresh)),
    w AS (
        UPDATE fences r SET inflight = GREATEST(r.inflight - 1, 0)
          FROM l
         WHERE r.resource_key = l.k AND r.highest_token = l.t
           AND (r.open_at IS NULL OR r.open_at <= clock_timestamp())
        RETURNING r.resource_key)
    SELECT coalesce(array_agg(w.resource_key), '{}') INTO left_keys FROM w;

    -- fencegate_enter_one's two 'ok' branches on an open key: the highest
    -- token joins its writers; a higher one raises it over no writer in
    -- flight (none entered, or all their markers ended). Measured before
    -- any marker is written: a lower bound of when each was.
    set_entered := FLOOR(EXTRACT(EPOCH FROM (clock_timestamp() - statement_timestamp())) * 1000);
    WITH a AS (
        SELECT u.k, u.t, u.h, u.o
          FROM unnest(p_keys, p_tokens, p_hold_ms) WITH ORDINALITY AS u(k, t, h, o)
         WHERE u.k = ANY (alone)),
    w AS (
        UPDATE fences r
           SET highest_token = a.t,
               updated_at = CASE WHEN a.t > r.highest_token THEN now() ELSE r.updated_at END,
               inflight = CASE WHEN a.t = r.highest_token THEN r.inflight + 1 ELSE 1 END,
               writer_until = CASE WHEN a.t = r.highest_token
                                   THEN GREATEST(r.writer_until,
                                                 clock_timestamp() + a.h * interval '1 millisecond')
                                   ELSE clock_timestamp() + a.h * interval '1 millisecond' END,
               open_at = CASE WHEN a.t = r.highest_token THEN r.open_at END,
               draining_token = CASE WHEN a.t = r.highest_token THEN r.draining_token END,
               draining = CASE WHEN a.t = r.highest_token THEN r.draining ELSE 0 END
          FROM a
         WHERE r.resource_key = a.k
           AND (r.open_at IS NULL OR r.open_at <= clock_timestamp())
           AND (a.t = r.highest_token
                OR (a.t > r.highest_token
                    AND NOT coalesce(r.inflight > 0 AND r.writer_until > clock_timestamp(), false)))
        RETURNING a.o, a.t)
    SELECT coalesce(array_agg(w.o), '{}'), coalesce(array_agg(w.t), '{}')
      INTO set_ords, set_tokens FROM w;
    RETURN QUERY SELECT s.o, 'ok'::text, s.t, 0::bigint, set_entered
                   FROM unnest(set_ords, set_tokens) AS s(o, t);

    -- Everything else, one item at a time, as 0010 did (on rows held
    -- already: fencegate_enter_one finds its row, and waits for nothing).
    FOR i IN SELECT a.k, a.t, a.h, a.o FROM (
                 SELECT l.k, l.t, NULL::bigint AS h, 0::bigint AS o
                   FROM unnest(p_leave_keys, p_leave_tokens) AS l(k, t)
                  WHERE NOT l.k = ANY (left_keys) AND NOT l.k = ANY (fresh)
                 UNION ALL
                 SELECT u.k, u.t, u.h, u.o
                   FROM unnest(p_keys, p_tokens, p_hold_ms) WITH ORDINALITY AS u(k, t, h, o)
                  WHERE NOT u.o = ANY (set_ords)
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
    IF cardinality(fresh) > 0 THEN
        DELETE FROM fences r
         WHERE r.resource_key = ANY (fresh) AND NOT r.resource_key = ANY (p_keys);
    END IF;
END
$$;
