-- The insert trigger's notification names its outbox (issue 33).
--
-- A relay fleet LISTENs once per database for every tenant outbox in it,
-- all on one channel: the payload, `schema.table`, tells it which outbox
-- to wake instead of scanning them all. PostgreSQL still coalesces the
-- notifications of one transaction (same channel, same payload), so a
-- 1,000-row insert wakes its outbox once. A single relay ignores the
-- payload. Replacing the function takes no lock on the table.
CREATE OR REPLACE FUNCTION {notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;
