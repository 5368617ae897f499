-- Admin resets of a key's highest token (POST /fences/{key}/reset): the
-- audit trail, and how shared-mode instances learn of a reset (they poll
-- for rows above the last id they saw and forget the key from memory).
CREATE TABLE IF NOT EXISTS fence_resets (
    id           BIGSERIAL PRIMARY KEY,
    resource_key TEXT NOT NULL,
    at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    by_client    TEXT NOT NULL,
    reason       TEXT NOT NULL,
    -- NULL when the key had no record.
    from_token   BIGINT,
    to_token     BIGINT NOT NULL CHECK (to_token >= 0)
);
CREATE INDEX IF NOT EXISTS fence_resets_by_key ON fence_resets (resource_key, id);

-- Listings page through keys in byte order (COLLATE "C"), whatever the
-- database's collation, so a prefix is one contiguous range. Raising a
-- key's token does not change the key, so these indexes cost nothing on the
-- decision path beyond a new key's insert.
CREATE INDEX IF NOT EXISTS fences_key_bytes ON fences (resource_key COLLATE "C");
CREATE INDEX IF NOT EXISTS locks_name_bytes ON locks (name COLLATE "C");
