-- The table contract's constraints (migration 8) written out instead of
-- calling {name_fn} and {headers_fn}, and not checked on published rows.
--
-- What they check is unchanged; what it costs is not. A CHECK that calls
-- a SQL function parses the function's body again for every statement
-- (to inline it), and {headers_fn}'s subquery runs through the SQL
-- function executor for every row: measured with pgbench, the three
-- constraints made a one-row INSERT 0.12 ms slower and a 1,000-row INSERT
-- 7.7 ms slower (4.0 ms written out). Every UPDATE checks them too, so the
-- relay paid the same again for each row it claimed, although a claim
-- changes none of the checked columns. A claim marks its rows published
-- (the promise its commit keeps), so exempting published rows, as dead
-- letters are, takes the constraints off the relay's path: only a row
-- turned back into an unpublished one (a failed delivery, a requeue) is
-- checked again.
--
-- The functions stay, for queries such as "which rows break the
-- contract"; a test checks that they, the constraints and
-- `outbox::contract` agree. The headers rule is jsonpath here: `strict`,
-- so an array value is not unwrapped into strings; `@?` answers false
-- instead of failing on a value that is not an object, which the first
-- test refuses anyway. NOT VALID as before: rows already there are not
-- checked, and no scan is made. The constraints are replaced in one
-- statement, under the ACCESS EXCLUSIVE lock it takes for a moment.
ALTER TABLE {table}
    DROP CONSTRAINT outbox_aggregate_type_is_a_name,
    DROP CONSTRAINT outbox_event_type_is_a_name,
    DROP CONSTRAINT outbox_headers_are_string_tokens,
    ADD CONSTRAINT outbox_aggregate_type_is_a_name
        CHECK (dead_at IS NOT NULL OR published_at IS NOT NULL
               OR (aggregate_type ~ '^[A-Za-z0-9_-]+([.][A-Za-z0-9_-]+)*$'
                   AND char_length(aggregate_type) <= 100)) NOT VALID,
    ADD CONSTRAINT outbox_event_type_is_a_name
        CHECK (dead_at IS NOT NULL OR published_at IS NOT NULL
               OR (event_type ~ '^[A-Za-z0-9_-]+([.][A-Za-z0-9_-]+)*$'
                   AND char_length(event_type) <= 100)) NOT VALID,
    ADD CONSTRAINT outbox_headers_are_string_tokens
        CHECK (dead_at IS NOT NULL OR published_at IS NOT NULL
               OR (jsonb_typeof(headers) = 'object'
                   AND NOT headers @? 'strict $.* ? (@.type() != "string")'
                   AND NOT headers @? 'strict $.keyvalue() ? (!(@.key like_regex "^[!#$%&''*+.^_`|~0-9A-Za-z-]+$"))')) NOT VALID;
