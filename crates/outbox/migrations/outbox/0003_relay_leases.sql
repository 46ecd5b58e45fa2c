-- Several relays on one outbox. Rows are split into a fixed number of
-- logical partitions by a stable hash of aggregate_id, so every event of an
-- aggregate is in one partition. A relay delivers only rows of partitions
-- it holds a lease on, so one relay at a time delivers an aggregate.
--
-- Liveness is a heartbeat row per relay; a relay silent for longer than the
-- lease timeout is dead and its partitions go to the others. Safety is a row
-- lock: each batch transaction takes FOR SHARE on the lease rows it claims
-- under (checking it still owns them), and every change of owner is an
-- UPDATE of those rows, so ownership cannot move while a batch of the
-- partition is in flight, however slow or frozen its relay.
CREATE TABLE {relays} (
    relay_id     uuid        PRIMARY KEY,
    name         text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    heartbeat_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The relay's batch connections, as (pid, backend_start) so a recycled
    -- pid is never mistaken for one of them.
    backend_pids   int4[]        NOT NULL DEFAULT '{}',
    backend_starts timestamptz[] NOT NULL DEFAULT '{}'
);

-- No foreign key to the relays table: a dead relay's row is deleted at once,
-- while its leases are taken over only when no batch of its holds them.
CREATE TABLE {leases} (
    partition   int4        PRIMARY KEY,
    owner       uuid,
    acquired_at timestamptz
);

INSERT INTO {leases} (partition) SELECT generate_series(0, {partitions} - 1);

-- One tick of a relay, in one transaction: heartbeat, forget relays that
-- stopped beating, then move towards an even share. Relays rank by start
-- time, so they all compute the same shares: the first N mod R get one more.
-- Excess partitions go highest first; one a batch of ours still holds is
-- reported as releasing (the relay stops claiming it) and goes next tick.
-- Partitions are taken lowest first from nobody or from dead relays,
-- skipping any a dead relay's batch still holds. A relay declared dead may
-- only be frozen or cut off, its batch transaction still holding locks, so
-- its batch connections are terminated: its partitions move now rather than
-- when it wakes, and its commit fails instead of marking rows it no longer
-- owns. Without the privilege to do that (another role), they move when its
-- transactions end.
CREATE FUNCTION {tick_fn}(me uuid, my_name text, dead_after interval, max_attempts int4,
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
                          AND o.attempts < max_attempts
                          AND ((hashtextextended(o.aggregate_id, 0) % n + n) % n)::int4
                              IN (SELECT l4.partition FROM {leases} AS l4 WHERE l4.owner = me)),
               n
          FROM {leases} AS l WHERE l.owner = me ORDER BY l.partition;
END
$$;
