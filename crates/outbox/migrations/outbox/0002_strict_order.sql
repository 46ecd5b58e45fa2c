-- Strict per-aggregate ordering (`outbox relay --ordering strict`) asks, for
-- each candidate row, whether an earlier event of its aggregate is still
-- pending. This index answers that in one probe. A dead letter an operator
-- gave up on (`outbox dlq skip`) keeps its row for inspection but leaves
-- the index, so it no longer holds its aggregate back.
ALTER TABLE {table} ADD COLUMN given_up_at timestamptz;

CREATE INDEX {pending_by_aggregate_idx} ON {table} (aggregate_type, aggregate_id, id)
    WHERE published_at IS NULL AND given_up_at IS NULL;
