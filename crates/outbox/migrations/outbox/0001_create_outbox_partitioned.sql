-- The outbox as daily RANGE partitions of created_at (`outbox migrate
-- --partition-by day`): retention drops a whole day at once instead of
-- deleting its rows one by one. The same columns as the plain layout; the
-- primary key must include the partition key. Later migrations apply to
-- both layouts unchanged.
CREATE TABLE {table} (
    id              bigserial   NOT NULL,
    event_id        uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at    timestamptz,
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_error      text,
    headers         jsonb       NOT NULL DEFAULT '{}',
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);

-- Catches a row no daily partition covers (maintenance fell behind, or a
-- writer set created_at far from now), so a write never fails for want of
-- a partition. `outbox partitions maintain` reports what it holds.
CREATE TABLE {default_partition} PARTITION OF {table} DEFAULT;

CREATE INDEX {unpublished_idx} ON {table} (id) WHERE published_at IS NULL;

CREATE FUNCTION {notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;

CREATE TRIGGER {notify_trigger} AFTER INSERT ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION {notify_fn}('{channel}');
