-- Idempotency-Key records: one per route, method and key. A record is
-- written before its request is forwarded (state 'in_flight', with the
-- instant by which the forward and the storing of its answer must be over),
-- and completed with the upstream's answer ('done') or marked 'unknown'
-- when the request may have reached the upstream but no answer was stored.
-- An 'in_flight' record past in_flight_until is unknown too: its gateway
-- crashed or stalled. Records past expires_at are forgotten and purged.
CREATE TABLE IF NOT EXISTS idempotency (
    route           TEXT NOT NULL,
    method          TEXT NOT NULL,
    idem_key        TEXT NOT NULL,
    fingerprint     BYTEA NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('in_flight', 'done', 'unknown')),
    in_flight_until TIMESTAMPTZ NOT NULL,
    expires_at      TIMESTAMPTZ NOT NULL,
    status          INTEGER,
    headers         BYTEA,
    body            BYTEA,
    PRIMARY KEY (route, method, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency (expires_at);
