-- Whether the instance stopped cleanly (see the Postgres migration).
CREATE TABLE IF NOT EXISTS gateway_state (
    id         INTEGER PRIMARY KEY NOT NULL CHECK (id = 1),
    running    INTEGER NOT NULL,
    changed_at INTEGER NOT NULL
) STRICT;
