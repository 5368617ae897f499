-- Whether the single-mode instance of this store stopped cleanly. A start
-- that finds running = true follows a crash: writes of the crashed instance
-- may still be in flight to the upstream, so fenced writes wait out the
-- longest route timeout before being forwarded.
CREATE TABLE IF NOT EXISTS gateway_state (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    running    BOOLEAN NOT NULL,
    changed_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
