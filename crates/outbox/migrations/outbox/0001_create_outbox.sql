-- The outbox table: the reference design's columns plus headers.
-- Column names follow Debezium's Outbox Event Router, so a later move to log
-- tailing needs no new table.
CREATE TABLE {table} (
    id              bigserial   PRIMARY KEY,
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
    headers         jsonb       NOT NULL DEFAULT '{}'
);

-- Only unpublished rows: the claim walks a few pages however many published
-- rows the table still holds.
CREATE INDEX {unpublished_idx} ON {table} (id) WHERE published_at IS NULL;

-- One notification per INSERT statement, delivered on commit and coalesced by
-- PostgreSQL, so a 1,000-row batch insert wakes the relay once.
CREATE FUNCTION {notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;

CREATE TRIGGER {notify_trigger} AFTER INSERT ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION {notify_fn}('{channel}');
