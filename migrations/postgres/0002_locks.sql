-- Leases of the lock API, and the last fence issued per lock name.
-- fence survives release and expiry: it is the floor of the next grant.
-- lease/expires_at are NULL when released; used by backend = "store" only
-- (the Redis backends keep their leases in Redis and only fences here).
CREATE TABLE IF NOT EXISTS locks (
    name       TEXT PRIMARY KEY,
    fence      BIGINT NOT NULL DEFAULT 0 CHECK (fence >= 0),
    lease      TEXT,
    expires_at TIMESTAMPTZ
);
