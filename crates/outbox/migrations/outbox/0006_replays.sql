-- Replay (`outbox replay`): re-delivering published events to a sink, with
-- their original event_ids, without touching live delivery.
--
-- One row per replay job. The filter and the target are stored so that
-- `outbox replay --resume ID` continues the same job; `upto_id` is the
-- highest id when the job was created, so a replay is bounded and later
-- events are left to the live relay. `cursor_id`: every matching row with
-- an id up to it was acknowledged by the sink (or the job began past it).
-- A sink URL's password is never stored: `target` is redacted, and a
-- resume asks for the URL again.
CREATE TABLE {replays} (
    id              bigserial   PRIMARY KEY,
    target          text        NOT NULL,
    format          text        NOT NULL,
    aggregate_type  text,
    aggregate_id    text,
    event_type      text,
    since           timestamptz,
    until           timestamptz,
    -- Aggregate types left out (`route:default`: the types no route names).
    exclude_types   text[],
    rate            float8      NOT NULL,
    upto_id         int8        NOT NULL,
    cursor_id       int8        NOT NULL DEFAULT 0,
    matched         int8        NOT NULL DEFAULT 0,
    sent            int8        NOT NULL DEFAULT 0,
    removed         int8        NOT NULL DEFAULT 0,
    removed_exact   bool        NOT NULL DEFAULT true,
    state           text        NOT NULL DEFAULT 'running'
                    CHECK (state IN ('running', 'stopped', 'done', 'failed')),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at     timestamptz
);

-- What retention removed (`outbox cleanup`, `relay --retention`,
-- `partitions maintain`): published rows per aggregate type, event type
-- and hour of created_at, with the ids they spanned. Replay reads it to
-- say how many matching events were no longer there. One row per bucket,
-- added to by each cleanup batch and each dropped day, so it stays small
-- (types × event types × hours kept).
CREATE TABLE {removed} (
    aggregate_type  text        NOT NULL,
    event_type      text        NOT NULL,
    hour            timestamptz NOT NULL,
    removed         int8        NOT NULL,
    min_id          int8        NOT NULL,
    max_id          int8        NOT NULL,
    last_removed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (aggregate_type, event_type, hour)
);
