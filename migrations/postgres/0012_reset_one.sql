-- An admin's reset of one key, in one call: p_to becomes the key's highest
-- token; from_token is the one before (NULL for a key without a row). The
-- caller has locked fence_resets (resets commit in id order) and records
-- the reset in the same transaction.
--
-- Writers in flight are not forgotten. A shared-mode write is counted in
-- its key's row until its leave, and the leave names the write's token. A
-- reset that only rewrote highest_token would leave those counts matching
-- no token: their leaves would never count, the key would stay closed
-- until their markers ended, and a write of p_to (the key's token now) could
-- be admitted beside them. So a reset does to them what admitting a higher
-- token over them does (fencegate_enter_one, migration 0010): the live
-- writers of an open key become the writers it drains, and it opens when
-- the last of them leaves or their markers end. A drain already running is
-- kept, its writers still counting down; counts whose markers have ended
-- are dropped, as fencegate_enter_one ignores them. Single-mode rows never
-- count writers in flight, and are only re-tokened.
CREATE OR REPLACE FUNCTION fencegate_reset_one(p_key text, p_to bigint, OUT from_token bigint)
LANGUAGE plpgsql AS $$
DECLARE
    f record;
    now_ts timestamptz;
BEGIN
    LOOP
        SELECT r.highest_token, r.inflight, r.writer_until, r.open_at
          INTO f FROM fences r WHERE r.resource_key = p_key FOR UPDATE;
        EXIT WHEN FOUND;
        INSERT INTO fences (resource_key, highest_token, updated_at)
        VALUES (p_key, p_to, now())
        ON CONFLICT (resource_key) DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
        -- A concurrent first write of the key committed its row: lock it.
    END LOOP;
    from_token := f.highest_token;
    now_ts := clock_timestamp();
    IF f.inflight > 0 AND f.writer_until > now_ts
       AND (f.open_at IS NULL OR f.open_at <= now_ts) THEN
        UPDATE fences
           SET highest_token = p_to, updated_at = now(), inflight = 0,
               writer_until = NULL, open_at = f.writer_until,
               draining_token = f.highest_token, draining = f.inflight
         WHERE resource_key = p_key;
    ELSE
        UPDATE fences
           SET highest_token = p_to, updated_at = now(), inflight = 0,
               writer_until = NULL
         WHERE resource_key = p_key;
    END IF;
END
$$;
