-- The admin console as an operations console (issue 36): what the relays
-- tell about their routes, what operators ask of them, what happened over
-- time, and who changed what.
--
-- {routes}: what an operator asks of a route, by route name (its
-- aggregate type unless the relay names it; `default` for the default
-- route). A paused route is not delivered: relays read this table on their
-- heartbeat and answer its rows unavailable without calling its sink (no
-- attempt spent, as an open breaker does), until it is resumed (its row
-- deleted or `paused_at` set NULL). Small: one row per route ever paused.
CREATE TABLE {routes} (
    route      text        PRIMARY KEY,
    paused_at  timestamptz,
    paused_by  text,
    reason     text
);

-- {route_state}: each live relay's view of each of its routes, written on
-- its heartbeat (one upsert per relay and route; a relay's rows are
-- deleted when it stops, and rows of relays silent for long are ignored by
-- readers and deleted by the next heartbeat of any relay). Counters are
-- since the relay started.
CREATE TABLE {route_state} (
    relay_id         uuid        NOT NULL,
    relay_name       text        NOT NULL,
    route            text        NOT NULL,
    -- The sink's kind and redacted address (no password).
    sink             text        NOT NULL,
    -- Aggregate types routed here; NULL: the default route (every type no
    -- other route names).
    aggregate_types  text[],
    breaker          text        NOT NULL CHECK (breaker IN ('closed', 'open', 'half_open')),
    breaker_since    timestamptz,
    paused           bool        NOT NULL DEFAULT false,
    delivered        int8        NOT NULL DEFAULT 0,
    failed           int8        NOT NULL DEFAULT 0,
    dead             int8        NOT NULL DEFAULT 0,
    last_error       text,
    last_error_at    timestamptz,
    started_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (relay_id, route)
);

-- {rollup}: deliveries per route and minute, added to by each relay's
-- heartbeat from its own counters. Not rows of the outbox, so `outbox
-- cleanup` does not empty the console's charts. Relays delete minutes
-- older than 7 days: at most routes × 10,080 rows.
CREATE TABLE {rollup} (
    minute     timestamptz NOT NULL,
    route      text        NOT NULL,
    delivered  int8        NOT NULL DEFAULT 0,
    failed     int8        NOT NULL DEFAULT 0,
    dead       int8        NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, route)
);

-- {audit}: every change made from the console or its API: who (the
-- name of the token that made it), what, to which
-- rows (the selection, as JSON), how many it changed, and when.
CREATE TABLE {audit} (
    id        bigserial   PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    who       text        NOT NULL,
    action    text        NOT NULL,
    detail    jsonb       NOT NULL DEFAULT '{}',
    affected  int8        NOT NULL
);

-- {by_aggregate_idx}: one aggregate's events in id order, whatever their
-- state (the console's `/aggregate`, and `/events` filtered by aggregate
-- id). {pending_by_aggregate_idx} holds only pending rows and leads with
-- the aggregate type, which these pages may not know. Every insert pays
-- one more index entry for it: measured with one-event transactions, see
-- docs/admin.md#events. On the daily-partitioned layout it is created on
-- every partition, and on those made later. IF NOT EXISTS: on a large
-- table, build it beforehand with CREATE INDEX CONCURRENTLY under this
-- name (plain layout), and this migration takes no lock for it.
CREATE INDEX IF NOT EXISTS {by_aggregate_idx} ON {table} (aggregate_id, id);
