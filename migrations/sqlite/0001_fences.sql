-- The highest fencing token recorded per resource key.
-- updated_at is Unix time in milliseconds, taken from SQLite's clock.
CREATE TABLE IF NOT EXISTS fences (
    resource_key  TEXT PRIMARY KEY NOT NULL,
    highest_token INTEGER NOT NULL CHECK (highest_token >= 0),
    updated_at    INTEGER NOT NULL
) STRICT;
