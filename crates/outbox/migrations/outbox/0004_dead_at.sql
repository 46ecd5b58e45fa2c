-- Dead letters are recorded in the row. Before this migration a row was a
-- dead letter when `attempts` reached the `--max-attempts` of whichever
-- command looked at it, so `dlq list --max-attempts 3` and a relay with the
-- default 5 disagreed, and the relay silently retried rows an operator had
-- seen as dead. Now the relay sets `dead_at` when a row reaches its attempt
-- limit or fails permanently; every command reads `dead_at`, the claim
-- skips it, and `dlq requeue` clears it. Changing `--max-attempts` changes
-- only future decisions.
ALTER TABLE {table} ADD COLUMN dead_at timestamptz;

-- Rows that were dead letters by the old rule (`migrate --max-attempts`,
-- default 5) become dead letters by the new one.
UPDATE {table} SET dead_at = clock_timestamp()
 WHERE published_at IS NULL AND attempts >= {max_attempts};

-- The claim's index leaves dead letters out, as the claim does.
DROP INDEX {schema}.{unpublished_idx};
CREATE INDEX {unpublished_idx} ON {table} (id) WHERE published_at IS NULL AND dead_at IS NULL;

-- `dlq list` and `stats` find the dead letters without reading the backlog.
CREATE INDEX {dead_idx} ON {table} (id) WHERE published_at IS NULL AND dead_at IS NOT NULL;

-- The tick's `due` reads `dead_at` too. `max_attempts` stays in the
-- signature, unused, so a relay of the previous version keeps ticking while
-- the migration is rolled out.
CREATE OR REPLACE FUNCTION {tick_fn}(me uuid, my_name text, dead_after interval, max_attempts int4,
                          pids int4[], starts timestamptz[])
RETURNS TABLE (partition int4, releasing bool, due bool, partitions int4)
LANGUAGE plpgsql AS $$
DECLARE
    live uuid[];
    n int4;
    rank int4;
    target int4;
    excess int4[];
    dead_pids int4[];
    dead_pid int4;
BEGIN
    INSERT INTO {relays} AS r (relay_id, name, backend_pids, backend_starts)
        VALUES (me, my_name, pids, starts)
        ON CONFLICT (relay_id) DO UPDATE
           SET heartbeat_at = clock_timestamp(), name = EXCLUDED.name,
               backend_pids = EXCLUDED.backend_pids, backend_starts = EXCLUDED.backend_starts;
    WITH dead AS (
        DELETE FROM {relays} AS r WHERE r.heartbeat_at < clock_timestamp() - dead_after
        RETURNING r.backend_pids, r.backend_starts)
    SELECT coalesce(array_agg(a.pid), '{}') INTO dead_pids
      FROM dead, unnest(dead.backend_pids, dead.backend_starts) AS b(pid, started)
      JOIN pg_stat_activity AS a ON a.pid = b.pid AND a.backend_start = b.started;
    FOREACH dead_pid IN ARRAY dead_pids LOOP
        BEGIN
            -- Waits up to 1 s for the backend to exit and release its locks.
            PERFORM pg_terminate_backend(dead_pid, 1000);
        EXCEPTION WHEN insufficient_privilege THEN
            NULL;
        END;
    END LOOP;
    SELECT array_agg(r.relay_id ORDER BY r.started_at, r.relay_id) INTO live FROM {relays} AS r;
    SELECT count(*) INTO n FROM {leases};
    rank := array_position(live, me) - 1;
    target := n / cardinality(live) + CASE WHEN rank < n % cardinality(live) THEN 1 ELSE 0 END;
    SELECT coalesce(array_agg(x.partition), '{}') INTO excess FROM (
        SELECT l.partition FROM {leases} AS l WHERE l.owner = me
         ORDER BY l.partition DESC OFFSET target) AS x;
    IF cardinality(excess) > 0 THEN
        UPDATE {leases} AS l SET owner = NULL, acquired_at = NULL
         WHERE l.partition IN (
               SELECT l2.partition FROM {leases} AS l2
                WHERE l2.owner = me AND l2.partition = ANY (excess)
                  FOR UPDATE SKIP LOCKED);
    ELSE
        -- The owner test runs in this statement's snapshot, which sees a
        -- relay that registered after `live` was read.
        UPDATE {leases} AS l SET owner = me, acquired_at = clock_timestamp()
         WHERE l.partition IN (
               SELECT l2.partition FROM {leases} AS l2
                WHERE l2.owner IS NULL
                   OR NOT EXISTS (SELECT 1 FROM {relays} AS r WHERE r.relay_id = l2.owner)
                ORDER BY l2.partition
                LIMIT greatest(target - (SELECT count(*) FROM {leases} AS l3 WHERE l3.owner = me), 0)
                  FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN QUERY
        SELECT l.partition, l.partition = ANY (excess),
               EXISTS (SELECT 1 FROM {table} AS o
                        WHERE o.published_at IS NULL AND o.next_attempt_at <= clock_timestamp()
                          AND o.dead_at IS NULL
                          AND ((hashtextextended(o.aggregate_id, 0) % n + n) % n)::int4
                              IN (SELECT l4.partition FROM {leases} AS l4 WHERE l4.owner = me)),
               n
          FROM {leases} AS l WHERE l.owner = me ORDER BY l.partition;
END
$$;
