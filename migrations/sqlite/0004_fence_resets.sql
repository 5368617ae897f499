-- Admin resets of a key's highest token (POST /fences/{key}/reset): the
-- audit trail. Times are Unix milliseconds, as elsewhere in this store.
CREATE TABLE IF NOT EXISTS fence_resets (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    resource_key TEXT NOT NULL,
    at           INTEGER NOT NULL,
    by_client    TEXT NOT NULL,
    reason       TEXT NOT NULL,
    from_token   INTEGER,
    to_token     INTEGER NOT NULL CHECK (to_token >= 0)
) STRICT;
CREATE INDEX IF NOT EXISTS fence_resets_by_key ON fence_resets (resource_key, id);
