-- The consumer's record of handled events. A row is inserted in the same
-- transaction as the side effect, so "recorded" and "done" cannot diverge.
CREATE TABLE {table} (
    event_id     uuid        PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Retention deletes by age.
CREATE INDEX {processed_at_idx} ON {table} (processed_at);
