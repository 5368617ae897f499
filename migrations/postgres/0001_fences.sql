-- The highest fencing token recorded per resource key.
-- A row only ever moves up: the gateway's one statement per decision is a
-- conditional upsert that changes highest_token only to a greater value.
CREATE TABLE IF NOT EXISTS fences (
    resource_key  TEXT PRIMARY KEY,
    highest_token BIGINT NOT NULL CHECK (highest_token >= 0),
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);
