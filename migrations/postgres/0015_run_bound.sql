-- The longest route timeout of the single-mode instance running on this
-- store, raised before a reload lengthens it: after a crash, the next
-- instance waits for the larger of this and its own longest timeout, so a
-- restart with shorter timeouts still waits out the crashed instance's
-- forwards. 0 for a row written before this column existed.
ALTER TABLE gateway_state ADD COLUMN IF NOT EXISTS longest_timeout_ms BIGINT NOT NULL DEFAULT 0;
