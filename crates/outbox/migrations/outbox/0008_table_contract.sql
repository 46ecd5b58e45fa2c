-- The table contract (docs/schema.md, "The table contract"): a row the
-- relay cannot deliver as written is refused at INSERT instead of being
-- delivered half (headers given as an array were dropped), refused by one
-- sink and not another (a header name with a space), or sent to a name no
-- one subscribes to (aggregate_type '' went to the stream `outbox.event.`).
-- The same rules are `outbox::contract` in Rust, which the writer checks
-- before any SQL and the relay applies to what it reads (a test feeds the
-- same values to both).
--
-- aggregate_type and event_type name streams, subjects, routing keys and
-- topics (`outbox.event.{aggregate_type}`, `{aggregate_type}.{event_type}`):
-- segments of ASCII letters, digits, '_' and '-' joined by single dots, at
-- most 100 characters. Kafka accepts only [a-zA-Z0-9._-] (249 at most);
-- NATS splits subjects at dots and refuses empty tokens, spaces, '*' and
-- '>'; AMQP routing keys are dot-separated words of at most 255 bytes;
-- Redis accepts anything. `[.]`, not `\.`: the same with
-- standard_conforming_strings off.
CREATE FUNCTION {name_fn}(value text) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
    SELECT value ~ '^[A-Za-z0-9_-]+([.][A-Za-z0-9_-]+)*$' AND char_length(value) <= 100
$fn$;

-- headers travel as HTTP, NATS, AMQP and Kafka headers: a JSON object
-- whose values are strings and whose names are HTTP tokens (RFC 9110
-- tchar). A CHECK cannot hold a subquery, so the rule is a function.
CREATE FUNCTION {headers_fn}(headers jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
    SELECT jsonb_typeof(headers) = 'object'
       AND NOT EXISTS (SELECT FROM jsonb_each(headers) AS h(name, value)
                        WHERE jsonb_typeof(h.value) <> 'string'
                           OR h.name !~ '^[!#$%&''*+.^_`|~0-9A-Za-z-]+$')
$fn$;

-- No INSERT may slip in between the dead letters below and the
-- constraints (the constraints take this lock anyway).
LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;

-- Unpublished rows that break the contract become dead letters naming the
-- column, as the relay would make them: every UPDATE checks a NOT VALID
-- constraint too, so the relay's claim of such a row (an UPDATE) would
-- fail its whole batch, every time. Fix one (UPDATE its column) and
-- `outbox dlq requeue` it, or `dlq give-up` it.
UPDATE {table}
   SET dead_at = clock_timestamp(),
       last_error = 'permanent: the event breaks the table contract (migration 8): ' ||
           CASE
               WHEN NOT coalesce({name_fn}(aggregate_type), false)
                   THEN 'aggregate_type ' || to_json(aggregate_type)::text || ' is not a name'
               WHEN NOT coalesce({name_fn}(event_type), false)
                   THEN 'event_type ' || to_json(event_type)::text || ' is not a name'
               ELSE 'headers: expected a JSON object of strings whose names are HTTP tokens'
           END || '; it was not sent'
 WHERE published_at IS NULL AND dead_at IS NULL
   AND NOT (coalesce({name_fn}(aggregate_type), false) AND coalesce({name_fn}(event_type), false)
            AND coalesce({headers_fn}(headers), false));

-- NOT VALID: new and updated rows are checked, rows already in the table
-- are not. Validating would fail the upgrade on any old row that breaks
-- the contract, published ones included (delivered already, kept for
-- history and replay), and scan the whole table. Once those are gone
-- (retention) or fixed, `ALTER TABLE … VALIDATE CONSTRAINT …` makes each
-- constraint cover every row. A dead letter is exempt, so `outbox dlq
-- give-up` works on one that breaks the contract, while `dlq requeue`
-- (which clears dead_at) refuses it until it is fixed. On the
-- daily-partitioned layout the constraints reach every partition, and
-- the ones made later.
ALTER TABLE {table}
    ADD CONSTRAINT outbox_aggregate_type_is_a_name
        CHECK (dead_at IS NOT NULL OR {name_fn}(aggregate_type)) NOT VALID,
    ADD CONSTRAINT outbox_event_type_is_a_name
        CHECK (dead_at IS NOT NULL OR {name_fn}(event_type)) NOT VALID,
    ADD CONSTRAINT outbox_headers_are_string_tokens
        CHECK (dead_at IS NOT NULL OR {headers_fn}(headers)) NOT VALID;

-- Replay jobs stored before every query value of a sink URL was masked
-- (`?token=…` in clear; a password never was stored): masked now, as
-- `outbox replay` stores them from this version on. Resuming such a job
-- asks for the URL again (`--resume ID --to URL`).
UPDATE {replays}
   SET target = regexp_replace(target, E'([?&][^=&#]*=)[^&#]+', E'\\1***', 'g')
 WHERE target LIKE '%://%?%';
