-- Idempotency-Key records; see the Postgres migration of the same name.
-- Times are Unix milliseconds.
CREATE TABLE IF NOT EXISTS idempotency (
    route           TEXT NOT NULL,
    method          TEXT NOT NULL,
    idem_key        TEXT NOT NULL,
    fingerprint     BLOB NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('in_flight', 'done', 'unknown')),
    in_flight_until INTEGER NOT NULL,
    expires_at      INTEGER NOT NULL,
    status          INTEGER,
    headers         BLOB,
    body            BLOB,
    PRIMARY KEY (route, method, idem_key)
) STRICT;
CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency (expires_at);
