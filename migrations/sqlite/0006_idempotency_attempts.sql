-- Idempotency records, continued; see the Postgres migration of the same
-- name: the attempt a record's gateway matches when it completes, marks
-- unknown or forgets it, and no record expiring while it may be in flight.
ALTER TABLE idempotency ADD COLUMN attempt INTEGER NOT NULL DEFAULT 0;
UPDATE idempotency SET expires_at = in_flight_until WHERE expires_at < in_flight_until;
