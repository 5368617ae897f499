-- The longest route timeout of the running instance (see the Postgres
-- migration 0015).
ALTER TABLE gateway_state ADD COLUMN longest_timeout_ms INTEGER NOT NULL DEFAULT 0;
