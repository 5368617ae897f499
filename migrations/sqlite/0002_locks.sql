-- Leases of the lock API, and the last fence issued per lock name.
-- expires_at is Unix time in milliseconds on SQLite's clock.
CREATE TABLE IF NOT EXISTS locks (
    name       TEXT PRIMARY KEY NOT NULL,
    fence      INTEGER NOT NULL DEFAULT 0 CHECK (fence >= 0),
    lease      TEXT,
    expires_at INTEGER
) STRICT;
