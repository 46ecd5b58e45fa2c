//! Every statement the outbox runs, named, rendered once per table.
//!
//! Table names cannot be bind parameters, so each statement is a template
//! whose `{t}` is replaced by the validated, quoted table name when a
//! [`OutboxSql`] or [`InboxSql`] is built (at startup), never per call.
//! Values are always bind parameters. Each statement notes the index it needs.

use crate::{Config, InboxConfig};

#[cfg(feature = "tokio-postgres")]
mod admin;
#[cfg(feature = "tokio-postgres")]
mod audit;
#[cfg(feature = "tokio-postgres")]
pub(crate) mod catalog;
#[cfg(feature = "tokio-postgres")]
mod events;
#[cfg(feature = "tokio-postgres")]
pub mod fleet;
#[cfg(feature = "tokio-postgres")]
mod floor;
#[cfg(feature = "tokio-postgres")]
mod horizon;
#[cfg(feature = "tokio-postgres")]
pub(crate) mod privileges;
#[cfg(feature = "tokio-postgres")]
mod relay;
#[cfg(feature = "tokio-postgres")]
mod replay;
#[cfg(feature = "tokio-postgres")]
mod routes;
#[cfg(feature = "tokio-postgres")]
pub(crate) mod typed;
#[cfg(feature = "tokio-postgres")]
pub(crate) mod wal;

#[cfg(feature = "tokio-postgres")]
pub use admin::{
    Attempt, DeadByError, DeadFilter, DeadLetter, DeadPage, EventDetail, EventStory, PartitionRow, RelayRow,
    Throughput, TypeStats, partition_ranges,
};
#[cfg(feature = "tokio-postgres")]
pub use audit::{AuditRow, AuditSql};
#[cfg(feature = "tokio-postgres")]
pub use events::{
    AggregateEvent, AggregateQuery, ERROR_START, EVENTS_SCAN, EventFilter, EventRow, EventState, EventWalk,
    EventsPage, EventsQuery, EventsSql, Keyset, UnknownState,
};
#[cfg(feature = "tokio-postgres")]
pub use floor::{ClaimFloor, FloorParams};
#[cfg(feature = "tokio-postgres")]
pub use horizon::HorizonHolder;
#[cfg(feature = "tokio-postgres")]
use relay::Shape;
#[cfg(feature = "tokio-postgres")]
pub use relay::{
    ClaimParams, ClaimScope, ClaimSpec, ClaimedRows, DeadlineClaim, DeadlineMarks, Fence, MarkFailedParams,
    Partitions, RelayStatements, Strict, TickParams, TickRow, TickStatement, backend_identity, listen,
    setup_batch_session,
};
#[cfg(feature = "tokio-postgres")]
pub use replay::{
    NewReplay, PageParams, Removed, ReplayFilter, ReplayJob, ReplaySql, ReplayState, SaveReplay,
};
#[cfg(feature = "tokio-postgres")]
pub use routes::{
    BreakerState, HeartbeatParams, PausedRoute, ROLLUP_KEEP_DAYS, RollupDelta, RollupRow, RouteReport,
    RouteSql, RouteState,
};
#[cfg(feature = "tokio-postgres")]
pub use wal::{
    BackfillPage, DeadRows, EmittedDead, PartitionMark, Prerequisites, SlotState, TurnHolder, WalSql,
};

/// The columns the relay reads, in the order [`crate::OutboxRow`] expects.
const ROW_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, \
     first_failed_at";

/// What a claim returns: the row, its payload's bytes (see `CUT`), and
/// how many rows the claim locked. A payload over `LARGE_PAYLOAD` bytes
/// comes back NULL and is read in pieces (`FETCH_PAYLOAD`).
const CLAIMED_COLUMNS: &str = "o.id, o.event_id, o.aggregate_type, o.aggregate_id, o.event_type, \
     CASE WHEN claimed.bytes > {large} THEN NULL ELSE o.payload END AS payload, claimed.bytes, \
     o.headers, o.created_at, o.attempts, o.first_failed_at, claimed.locked_rows{claim_col}";

/// Payloads larger than this many bytes are not returned by the claim but
/// read in pieces of this many bytes. A message is read whole into
/// the client's buffer, which keeps the size of the largest it has read
/// for the connection's lifetime; in pieces, a 30 MB event is held twice
/// at most (as text, then parsed) instead of three times.
pub const LARGE_PAYLOAD: i64 = 1 << 20;

/// `$1` row id, `$2` piece length in bytes. A payload as UTF-8 text, in
/// order, in pieces (see `LARGE_PAYLOAD`). Bytes, not characters: finding
/// a character offset walks the text from its start, which made a 30 MB
/// payload cost seconds. The CTE is materialized so the text is rendered
/// once, not once per piece.
const FETCH_PAYLOAD: &str = "WITH p AS MATERIALIZED (SELECT convert_to(payload::text, 'UTF8') AS text FROM {t} WHERE id = $1) \
     SELECT substring(p.text FROM g FOR $2::int4) FROM p, generate_series(1, octet_length(p.text), $2::int4) AS g ORDER BY g";

/// `$1..$6`: one event. Returns nothing: the event_id is chosen by the writer.
const INSERT_EVENT: &str = "INSERT INTO {t} (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
     VALUES ($1, $2, $3, $4, $5, $6)";

/// Arrays of the same columns: a whole batch in one round trip. `ORDER BY
/// ord` keeps ids in the caller's order, which is the delivery order.
const INSERT_EVENTS: &str = "INSERT INTO {t} (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
     SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload, e.headers \
       FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[]) \
            WITH ORDINALITY AS e(event_id, aggregate_type, aggregate_id, event_type, payload, headers, ord) \
      ORDER BY e.ord";

/// `$1` batch size, `$2` the claim floor, `$3` batch bytes (see `CUT`).
/// Walks the partial index `<table>_unpublished_idx (id) WHERE
/// published_at IS NULL AND dead_at IS NULL` in id order from the floor
/// (`FIND_CLAIM_FLOOR`: the entries below it are, mostly, of rows published
/// since the oldest snapshot still held, which vacuum cannot remove yet),
/// skips rows another relay holds, and marks what it
/// claimed published in the same statement. The mark is only a promise: the relay commits it after the
/// sink acknowledged the rows and turns failed rows back into unpublished ones
/// before that (`MARK_FAILED`), so a crash at any point rolls the mark back
/// with the locks. One statement instead of a locking SELECT plus an UPDATE
/// saves a round trip and a second pass over every row of a good batch.
/// `RETURNING` order is unspecified: the relay sorts by id.
const CLAIM_BATCH: &str = "WITH {deadline_cte}locked AS ( \
        SELECT id, created_at, payload, pg_column_size(payload) AS stored FROM {t} AS c \
         WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= clock_timestamp() \
           AND c.id >= {floor} {type_filter} \
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED), {cut} \
     UPDATE {t} AS o SET {set_claim} FROM claimed{claim_from} \
      WHERE o.id = claimed.id AND o.created_at = claimed.created_at \
     RETURNING {claimed_cols}";

/// The byte bound of every claim (`{budget}`: `--batch-max-bytes`): of the
/// rows `locked` took, in id order, the longest prefix whose payloads fit,
/// and always the first, so an event larger than the bound still goes
/// alone.
///
/// A payload's bytes are its stored size when it is stored uncompressed (in
/// line or in TOAST: no read), and its size as text when compressed, which
/// decompresses it. Only candidates are decompressed: a row whose
/// predecessors' stored sizes already exceed the bound is past the cut
/// whatever its own size (a compressed payload is larger than stored), so
/// a backlog of large compressible events costs one decompression per
/// claimed row, not one per locked row.
///
/// Most claims fit whole: their uncompressed payloads' stored sizes add up
/// to less than the bound. `fits` finds that in one pass (no sort), and
/// then the windows are not run at all (the second branch's filter is a
/// constant, checked before its input is read): measured, the windows on
/// every claim cost about a fifth of the relay's throughput at batch 100.
///
/// `locked_rows` counts what was locked: when it is more than the rows returned,
/// the batch was cut, and the rows past the cut stay locked (not marked)
/// until this transaction ends. The relay then claims nothing else before
/// it commits, or a batch claimed meanwhile would pass them and break
/// partition order.
const CUT: &str = "fits AS ( \
        SELECT coalesce(sum(stored), 0) <= {budget} \
               AND NOT coalesce(bool_or(pg_column_compression(payload) IS NOT NULL), false) AS whole FROM locked), \
     claimed AS ( \
        SELECT id, created_at, 0::int8 AS locked_rows, stored AS bytes FROM locked WHERE (SELECT whole FROM fits) \
        UNION ALL \
        SELECT id, created_at, locked_rows, bytes FROM ( \
            SELECT id, created_at, locked_rows, bytes, \
                   sum(bytes) OVER (ORDER BY id ROWS UNBOUNDED PRECEDING) AS upto FROM ( \
                SELECT id, created_at, count(*) OVER () AS locked_rows, \
                       CASE WHEN sum(stored) OVER (ORDER BY id ROWS UNBOUNDED PRECEDING) - stored > {budget} \
                              OR pg_column_compression(payload) IS NULL THEN stored \
                            ELSE octet_length(payload::text) END AS bytes \
                  FROM locked) AS sized) AS w \
         WHERE NOT (SELECT whole FROM fits) AND (upto <= {budget} OR upto = bytes))";

/// `CUT` for a claim of one row, which is never cut: no bound, no
/// `$budget` parameter. The size still tells a large payload apart.
const ONE_ROW: &str = "claimed AS ( \
        SELECT id, created_at, 0::int8 AS locked_rows, \
               CASE WHEN pg_column_compression(payload) IS NULL THEN stored \
                    ELSE octet_length(payload::text) END AS bytes \
          FROM locked)";

/// `CUT` for a claim that takes its rows only if they fit whole: all of
/// them, when their stored sizes add up to at most the bound and none is
/// compressed (so stored size is the size), or none. Planned in 45% of
/// `CUT`'s time on one table, 75% over a fleet's thousand (measured):
/// planning is most of a one-event batch's cost when every claim is
/// planned (a fleet without prepared claims,
/// [`relay::RelayStatements::claim_whole_first`]):
/// a claim that finds nothing this way (an empty outbox, or a batch that
/// does not fit whole) runs again with `CUT`, in the same transaction.
/// Rows this claim locked are its own transaction's, so that claim does
/// not skip them.
const WHOLE: &str = "claimed AS ( \
        SELECT id, created_at, 0::int8 AS locked_rows, stored AS bytes FROM locked \
         WHERE (SELECT coalesce(sum(stored), 0) <= {budget} \
                       AND coalesce(bool_and(pg_column_compression(payload) IS NULL), true) FROM locked))";

/// The logical partition of a row (`$4` partitions): a stable hash of its
/// aggregate_id, the same expression the tick function uses.
const PARTITION_OF: &str = "((hashtextextended({a}aggregate_id, 0) % $4::int8 + $4::int8) % $4::int8)::int4";

/// What a relay sharing the outbox adds to its claim: `$2` its id, `$3` the
/// partitions it may claim, `$4` the partition count.
///
/// `lease` reads those lease rows `FOR SHARE`, counting the ones that still
/// name this relay. Every change of owner is an UPDATE of a lease row, which
/// now waits for this batch's commit or rollback, so no other relay can take
/// these partitions while the batch is in flight. The count gates the
/// UPDATE as a one-time filter, evaluated (and the locks taken) before any
/// row is read: if a partition moved since the relay's last tick, nothing is
/// claimed and the next tick corrects the relay's view. Rows are filtered by
/// array membership, one hash per row.
const LEASE_CTE: &str = "lease AS (SELECT count(*) AS held FROM ( \
        SELECT 1 FROM {leases} AS l WHERE l.owner = $2 AND l.partition = ANY($3::int4[]) FOR SHARE) AS mine), ";
const LEASE_GATE: &str = "AND (SELECT held FROM lease) = cardinality($3::int4[])";

/// `CLAIM_BATCH` restricted to the partitions this relay holds; `$5` the
/// claim floor, `$6` batch bytes.
const CLAIM_BATCH_LEASED: &str = "WITH {deadline_cte}{lease_cte} locked AS ( \
        SELECT id, created_at, payload, pg_column_size(payload) AS stored FROM {t} AS c \
         WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= clock_timestamp() \
           AND c.id >= {floor} AND {partition_of} = ANY($3::int4[]) {type_filter} {claim_probe} \
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED), {cut} \
     UPDATE {t} AS o SET {set_claim} FROM claimed{claim_from} \
      WHERE o.id = claimed.id AND o.created_at = claimed.created_at {lease_gate} \
     RETURNING {claimed_cols}";

/// `CLAIM_BATCH_LEASED` for a batch much smaller than the partitions held
/// (at most an eighth of them: batch 1 to 8 over 64 partitions): the same rows, with a lock on the lease rows
/// of the partitions the batch can touch instead of on all of them. Each
/// tuple lock costs a WAL record (about 60 bytes; 64 of them were 88% of a
/// batch-1 claim's WAL) and, while the relay's two batches overlap, a
/// MultiXact.
///
/// `peek` reads, without locking, the partitions of the first `2 × $1` due
/// rows: at most `$1` of them are locked by this relay's other batch in
/// flight, so the first `$1` unlocked rows are among them, and the claim
/// returns what `CLAIM_BATCH_LEASED` would. `lease` locks those lease rows
/// that still name this relay, `FOR SHARE`, in an InitPlan the claim's
/// filter evaluates before its first row lock: as before, every row is
/// locked after its partition's lease, so no owner change can pass a batch
/// in flight. A partition that moved is left out, not the whole batch.
const CLAIM_BATCH_FEW_LEASED: &str = "WITH {deadline_cte}peek AS ( \
        SELECT DISTINCT {partition_of_d} AS partition FROM ( \
            SELECT aggregate_id FROM {t} \
             WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= clock_timestamp() \
               AND id >= {floor} AND {partition_of} = ANY($3::int4[]) {type_filter_peek} \
             ORDER BY id LIMIT 2 * $1::int8) AS d), \
     lease AS (SELECT coalesce(array_agg(mine.partition), '{}') AS held FROM ( \
        SELECT l.partition FROM {leases} AS l \
         WHERE l.owner = $2 AND l.partition IN (SELECT partition FROM peek) FOR SHARE) AS mine), \
     locked AS ( \
        SELECT id, created_at, payload, pg_column_size(payload) AS stored FROM {t} AS c \
         WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= clock_timestamp() \
           AND c.id >= {floor} AND {partition_of} = ANY((SELECT held FROM lease)::int4[]) {type_filter} {claim_probe} \
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED), {cut} \
     UPDATE {t} AS o SET {set_claim} FROM claimed{claim_from} \
      WHERE o.id = claimed.id AND o.created_at = claimed.created_at \
     RETURNING {claimed_cols}";

/// `CLAIM_BATCH_LEASED` for strict per-aggregate order: a row is claimed
/// only if no earlier event of its aggregate is still pending: not due yet,
/// waiting for a retry, a dead letter nobody gave up on, or locked by a
/// batch in flight (whose mark is not committed). So at most one event per
/// aggregate per batch, and an aggregate stops at its first undelivered
/// event. The `NOT EXISTS` is one probe of
/// `<table>_pending_by_aggregate_idx`. Per-aggregate-type modes: `$5` the
/// aggregate types whose mode is not the default, `$6` whether the default
/// is strict; `$7` the claim floor, `$8` batch bytes. A row is held to
/// strict order when exactly one of "its type is listed" and "the default
/// is strict" holds; the others skip the `NOT EXISTS` probe.
const CLAIM_BATCH_STRICT_LEASED: &str = "WITH {deadline_cte}{lease_cte} locked AS ( \
        SELECT c.id, c.created_at, c.payload, pg_column_size(c.payload) AS stored FROM {t} AS c \
         WHERE c.published_at IS NULL AND c.dead_at IS NULL AND c.next_attempt_at <= clock_timestamp() \
           AND c.id >= {floor} AND {partition_of_c} = ANY($3::int4[]) {type_filter} \
           AND ((c.aggregate_type = ANY($5::text[])) = $6::bool OR NOT EXISTS (SELECT 1 FROM {t} AS e \
                 WHERE e.aggregate_type = c.aggregate_type AND e.aggregate_id = c.aggregate_id \
                   AND e.id < c.id AND e.published_at IS NULL AND e.given_up_at IS NULL)) \
         ORDER BY c.id LIMIT $1 FOR UPDATE OF c SKIP LOCKED), {cut} \
     UPDATE {t} AS o SET {set_claim} FROM claimed{claim_from} \
      WHERE o.id = claimed.id AND o.created_at = claimed.created_at {lease_gate} \
     RETURNING {claimed_cols}";

/// What a deadline claim (`--claim deadline`, migration 0005) puts in the claim
/// templates in place of the lock claim's mark. `{p_owner}` is the relay's
/// id, `{p_timeout}` the claim timeout in milliseconds. The claim writes one
/// deadline, read once (`deadline`), on every row it takes, as
/// `claimed_until` and as `next_attempt_at`: the claim's walk of the partial
/// index then skips a held row like any row not yet due and finds it due
/// again once the claim expired, with no index or scan of its own. The
/// deadline comes back with the rows: with `claimed_by` it is the fence the
/// mark checks (`MARK_DEADLINE_CLAIM`).
const DEADLINE_CTE: &str =
    "deadline AS (SELECT clock_timestamp() + {p_timeout}::float8 * interval '1 millisecond' AS at), ";
const SET_LEASE: &str =
    "claimed_by = {p_owner}::uuid, claimed_until = deadline.at, next_attempt_at = deadline.at";

/// A deadline claim under partition order: a row waits while an earlier event
/// of its aggregate is held by another claimer's unexpired claim (this
/// claimer's own claims are its pipeline's, ordered as the lock claim's are;
/// a relay whose pipeline was reset claims under a new id, see
/// `RELEASE_ABANDONED_CLAIMS`). The lock claim needs no
/// such test, as ownership of a partition cannot move while a batch of it
/// is in flight (its lease rows are locked `FOR SHARE` until the commit);
/// a deadline claim commits before delivery, so a partition can move to
/// another relay while its batch is at the sink, and this is what keeps
/// that relay from overtaking it. One probe of
/// `<table>_pending_by_aggregate_idx`. (Strict order's own probe already
/// counts a claimed row as pending.)
const CLAIM_PROBE: &str = "AND NOT EXISTS (SELECT 1 FROM {t} AS e \
        WHERE e.aggregate_type = c.aggregate_type AND e.aggregate_id = c.aggregate_id AND e.id < c.id \
          AND e.published_at IS NULL AND e.given_up_at IS NULL AND e.claimed_until > clock_timestamp() \
          AND e.claimed_by <> {p_owner}::uuid)";

/// A claim restricted to some aggregate types (a relay whose routes differ
/// in `claim` runs a claim per mode): `{p_types}` the types, `{p_types_in}`
/// whether they are the ones to take (true) or to leave (false).
const TYPE_FILTER: &str = "AND ({a}aggregate_type = ANY({p_types}::text[])) = {p_types_in}::bool";

/// `$1..$5` the failed rows as in `MARK_FAILED`, `$6` the delivered rows'
/// ids, `$7` the relay's id, `$8` the claim's deadline. A deadline claim's
/// outcomes in one statement, its own short transaction: delivered rows
/// published, failed ones with their retry time or dead, and the claim
/// cleared. Only rows still under this claim match: a claim that expired
/// and was taken by another relay (which wrote its own deadline) is not
/// marked by this one, whose delivery then counts as a duplicate. Returns
/// rows published and rows failed.
const MARK_DEADLINE_CLAIM: &str = "WITH now AS (SELECT clock_timestamp() AS at), \
     failed AS (UPDATE {t} AS o SET {failed_set}, claimed_by = NULL, claimed_until = NULL \
       FROM now, {failed_rows} \
      WHERE o.id = f.id AND o.claimed_by = $7::uuid AND o.claimed_until = $8::timestamptz RETURNING 1), \
     delivered AS (UPDATE {t} AS o SET published_at = now.at, claimed_by = NULL, claimed_until = NULL FROM now \
      WHERE o.id = ANY($6::int8[]) AND o.claimed_by = $7::uuid AND o.claimed_until = $8::timestamptz RETURNING 1) \
     SELECT (SELECT count(*) FROM delivered), (SELECT count(*) FROM failed)";

/// `$1` ids, `$2` the relay's id, `$3` the claim's deadline. Gives a lease
/// claim back unsent (shutdown, a claim found lapsed before delivery): due
/// again now, attempts unchanged. Only rows still under this claim.
const RELEASE_DEADLINE_CLAIM: &str = "UPDATE {t} SET claimed_by = NULL, claimed_until = NULL, next_attempt_at = clock_timestamp() \
      WHERE id = ANY($1::int8[]) AND claimed_by = $2::uuid AND claimed_until = $3::timestamptz";

/// `$1` the claimer ids a relay abandoned. Gives back every row still held
/// under them, due again now, attempts unchanged: the claims a reset of the
/// relay's pipeline dropped (a batch claimed ahead and never delivered, a
/// claim whose answer was lost with its connection), which would otherwise
/// hold their aggregates until their deadlines pass. One walk of the
/// unpublished index; run once after a reset, not per batch.
const RELEASE_ABANDONED_CLAIMS: &str = "UPDATE {t} SET claimed_by = NULL, claimed_until = NULL, next_attempt_at = clock_timestamp() \
      WHERE published_at IS NULL AND dead_at IS NULL AND claimed_by = ANY($1::uuid[])";

/// `$1` relay id, `$2` its name, `$3` seconds after which a silent relay
/// is dead, `$4`/`$5` its batch connections' pids and start times. One
/// relay tick (heartbeat and rebalance; see migrations 0003 and 0004): the
/// partitions it holds, whether each is being released, whether any of them
/// has a row due, and the partition count. The function's `max_attempts`
/// argument is unused since dead letters are recorded in the row (0004).
const RELAY_TICK: &str = "SELECT partition, releasing, due, partitions \
       FROM {tick_fn}($1, $2, make_interval(secs => $3), 0, $4::int4[], $5::timestamptz[])";

/// `$1` relay id. A relay leaving: its partitions go to the others at
/// their next tick, without waiting for the heartbeat to expire.
const RELAY_LEAVE: &str = "WITH gone AS (DELETE FROM {relays} WHERE relay_id = $1) \
     UPDATE {leases} SET owner = NULL, acquired_at = NULL WHERE owner = $1";

/// The live relays, oldest first, each with its partitions.
const RELAYS: &str = "SELECT r.relay_id, r.name, r.started_at, \
            extract(epoch FROM clock_timestamp() - r.heartbeat_at)::float8 AS silent_for, \
            coalesce(array_agg(l.partition ORDER BY l.partition) FILTER (WHERE l.partition IS NOT NULL), '{}') AS partitions \
       FROM {relays} AS r LEFT JOIN {leases} AS l ON l.owner = r.relay_id \
      GROUP BY r.relay_id ORDER BY r.started_at, r.relay_id";

/// Every partition with its owner (NULL: none) and its pending rows (not
/// published, not dead), through the claim's partial index.
const PARTITION_BACKLOG: &str = "WITH n AS (SELECT count(*)::int8 AS n FROM {leases}), \
     pending AS ( \
        SELECT ((hashtextextended(o.aggregate_id, 0) % n.n + n.n) % n.n)::int4 AS partition, count(*) AS rows \
          FROM {t} AS o, n WHERE o.published_at IS NULL AND o.dead_at IS NULL GROUP BY 1) \
     SELECT l.partition, l.owner, coalesce(p.rows, 0) AS rows \
       FROM {leases} AS l LEFT JOIN pending AS p ON p.partition = l.partition ORDER BY l.partition";

/// `$1` ids. Gives up on dead letters: they stay for inspection but no
/// longer hold their aggregate back in strict mode.
const GIVE_UP_DEAD: &str = "UPDATE {t} SET given_up_at = clock_timestamp() \
      WHERE id = ANY($1::int8[]) AND published_at IS NULL AND dead_at IS NOT NULL AND given_up_at IS NULL";

/// Seconds until the next row waiting for a retry comes due (NULL if none;
/// negative if one is due now), so an idle relay sleeps until then instead
/// of polling. Reads every row of the claim's partial index, so the relay
/// runs it only after (re)connecting, not per poll.
const NEXT_RETRY: &str = "SELECT extract(epoch FROM min(next_attempt_at) - clock_timestamp())::float8 FROM {t} \
      WHERE published_at IS NULL AND dead_at IS NULL";

/// Parallel arrays: id, last_error, new attempts, delay in milliseconds until
/// the next attempt, whether the row is now a dead letter. One statement for
/// every failed row of a batch, in the claim's transaction: it takes back the
/// claim's mark (`published_at`). The clock is read once (the CTE) so rows
/// given equal delays come due at the same instant and keep their id order.
const MARK_FAILED: &str = "WITH now AS (SELECT clock_timestamp() AS at) \
     UPDATE {t} AS o SET {failed_set}, published_at = NULL FROM now, {failed_rows} WHERE o.id = f.id";

/// What every failed row's mark sets (`now.at`: the clock, read once), from
/// the rows `FAILED_ROWS` binds: `MARK_FAILED`'s and `MARK_DEADLINE_CLAIM`'s.
/// A row whose attempt was spent (`f.attempts` above the row's: not an
/// unavailable sink, not held back) starts its retry window if it had
/// none, and its history gains the attempt (`ATTEMPT_LOG`).
const FAILED_SET: &str = "attempts = f.attempts, last_error = f.error, \
     next_attempt_at = now.at + f.delay_ms * interval '1 millisecond', dead_at = CASE WHEN f.dead THEN now.at END, \
     first_failed_at = CASE WHEN f.attempts > o.attempts THEN coalesce(o.first_failed_at, now.at) \
                            ELSE o.first_failed_at END, \
     attempt_log = CASE WHEN f.attempts > o.attempts THEN {attempt_log} ELSE o.attempt_log END";

/// The row's history (`attempt_log`, migration 0007) with this attempt
/// appended, keeping the last [`ATTEMPT_LOG_LEN`]: the oldest entry goes
/// once it is full, so each mark costs one small jsonb, whatever the
/// row's attempts. The error is cut at [`ATTEMPT_LOG_ERROR`] characters;
/// `last_error` keeps all of the last one.
const ATTEMPT_LOG: &str = "(CASE WHEN jsonb_array_length(o.attempt_log) >= {log_len} THEN o.attempt_log - 0 \
          ELSE coalesce(o.attempt_log, '[]'::jsonb) END) \
     || jsonb_build_array(jsonb_build_object('at', now.at, 'attempt', f.attempts, \
          'outcome', CASE WHEN f.dead THEN 'dead' ELSE 'retry' END, 'error', left(f.error, {error_len})))";

/// How many attempts a row's history keeps.
pub const ATTEMPT_LOG_LEN: usize = 10;

/// The characters of each attempt's error a row's history keeps.
pub const ATTEMPT_LOG_ERROR: usize = 256;

/// `$1..$5`, the failed rows as parallel arrays, as the relation `f`.
const FAILED_ROWS: &str = "unnest($1::int8[], $2::text[], $3::int4[], $4::float8[], $5::bool[]) \
     AS f(id, error, attempts, delay_ms, dead)";

/// Unpublished rows per aggregate type: waiting for delivery, dead letters,
/// given up, aggregates a dead letter blocks in strict mode, oldest waiting.
/// Scans the unpublished rows only.
const STATS: &str = "SELECT aggregate_type, \
            count(*) FILTER (WHERE dead_at IS NULL) AS unpublished, \
            count(*) FILTER (WHERE dead_at IS NOT NULL AND given_up_at IS NULL) AS dead_letters, \
            count(*) FILTER (WHERE given_up_at IS NOT NULL) AS given_up, \
            count(DISTINCT aggregate_id) FILTER (WHERE dead_at IS NOT NULL AND given_up_at IS NULL) AS blocked_aggregates, \
            min(created_at) FILTER (WHERE dead_at IS NULL) AS oldest_unpublished \
       FROM {t} WHERE published_at IS NULL GROUP BY aggregate_type ORDER BY aggregate_type";

/// `$1` limit. Dead letters oldest first, with their payloads, headers and
/// attempt history, through `<table>_dead_idx`.
const LIST_DEAD: &str = "SELECT id, event_id, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, \
            dead_at, given_up_at, payload, headers, first_failed_at, attempt_log \
       FROM {t} WHERE published_at IS NULL AND dead_at IS NOT NULL ORDER BY id LIMIT $1";

/// The dead-letter filter shared by requeue, its dry run and the admin
/// console's list: `$1` ids or NULL, `$2` aggregate type or NULL, `$3` text
/// the last error contains, or NULL, `$4` event type or NULL, `$5`/`$6`
/// dead at or before / at or after, or NULL.
const DEAD_FILTER: &str = "published_at IS NULL AND dead_at IS NOT NULL \
        AND ($1::int8[] IS NULL OR id = ANY($1::int8[])) \
        AND ($2::text IS NULL OR aggregate_type = $2::text) \
        AND ($3::text IS NULL OR strpos(last_error, $3::text) > 0) \
        AND ($4::text IS NULL OR event_type = $4::text) \
        AND ($5::timestamptz IS NULL OR dead_at <= $5::timestamptz) \
        AND ($6::timestamptz IS NULL OR dead_at >= $6::timestamptz)";

/// Every column an operator looks at, in the order `admin::EventDetail`
/// reads them.
const DETAIL_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, attempts, \
     last_error, created_at, next_attempt_at, published_at, dead_at, given_up_at, first_failed_at, attempt_log";

/// `$1..$6` the dead-letter filter, `$7` the last id of the previous page
/// (0 for the first), `$8` page size. A page of dead letters with their
/// payloads, oldest first, through `<table>_dead_idx`.
const LIST_DEAD_PAGE: &str =
    "SELECT {detail} FROM {t} WHERE {dead} AND id > $7::int8 ORDER BY id LIMIT $8::int8";

/// `$1` age in seconds. Deletes given-up dead letters given up on longer
/// ago than that: an operator decided they will never be sent, and kept
/// them only to look at. In short batches, as retention deletes, so no
/// lock is held long; returns how many went.
const PURGE_GIVEN_UP: &str = "WITH gone AS (DELETE FROM {t} WHERE id IN ( \
        SELECT id FROM {t} WHERE given_up_at < clock_timestamp() - make_interval(secs => $1::float8) \
          AND published_at IS NULL LIMIT 1000) RETURNING 1) \
      SELECT count(*) FROM gone";

/// `$1` age in seconds. What [`PURGE_GIVEN_UP`] would delete (its dry run).
const COUNT_PURGE_GIVEN_UP: &str = "SELECT count(*) FROM {t} \
      WHERE given_up_at < clock_timestamp() - make_interval(secs => $1::float8) AND published_at IS NULL";

/// `$1` ids. What [`GIVE_UP_DEAD`] would touch (its dry run).
const COUNT_GIVE_UP: &str = "SELECT count(*) FROM {t} \
      WHERE id = ANY($1::int8[]) AND published_at IS NULL AND dead_at IS NOT NULL AND given_up_at IS NULL";

/// Dead letters nobody gave up on, per aggregate type and last error, most
/// first (`$1` at most this many groups). Through `<table>_dead_idx`.
const DEAD_BY_ERROR: &str = "SELECT aggregate_type, coalesce(last_error, ''), count(*) FROM {t} \
      WHERE published_at IS NULL AND dead_at IS NOT NULL AND given_up_at IS NULL \
      GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT $1";

/// `$1` bucket width in seconds, `$2` buckets. Rows published per bucket,
/// bucket 0 the most recent, over the last `$1 * $2` seconds. No index
/// covers `published_at`: this reads the whole table (the console's
/// overview only, never the relay). Rows a relay claimed but has not
/// committed are invisible here, as everywhere.
const THROUGHPUT: &str = "SELECT floor(extract(epoch FROM clock_timestamp() - published_at) / $1::float8)::int4 AS bucket, \
            count(*) FROM {t} \
      WHERE published_at > clock_timestamp() - make_interval(secs => $1::float8 * $2::int4) \
      GROUP BY 1 ORDER BY 1";

/// `$1` row id or NULL, `$2` event_id or NULL. One event with what decides
/// where it is: the clock, the earliest earlier event of its aggregate still
/// pending (unpublished, not given up: what holds it back under strict
/// order, through `<table>_pending_by_aggregate_idx`), its partition, that
/// partition's owner and the owner's heartbeat age (NULL: no live relay).
/// By row id through the primary key; by event_id a scan (no index: the
/// writer never looks rows up by it).
const EVENT_STORY: &str = "WITH n AS (SELECT count(*)::int8 AS n FROM {leases}), \
     ev AS (SELECT {detail} FROM {t} \
             WHERE ($1::int8 IS NOT NULL AND id = $1::int8) OR ($2::uuid IS NOT NULL AND event_id = $2::uuid) \
             ORDER BY id LIMIT 1) \
     SELECT ev.*, clock_timestamp(), \
            (SELECT e.id FROM {t} AS e WHERE e.aggregate_type = ev.aggregate_type AND e.aggregate_id = ev.aggregate_id \
                AND e.id < ev.id AND e.published_at IS NULL AND e.given_up_at IS NULL ORDER BY e.id LIMIT 1), \
            p.partition, n.n::int4, r.relay_id, r.name, \
            extract(epoch FROM clock_timestamp() - r.heartbeat_at)::float8 \
       FROM ev CROSS JOIN n \
       CROSS JOIN LATERAL (SELECT CASE WHEN n.n > 0 \
            THEN ((hashtextextended(ev.aggregate_id, 0) % n.n + n.n) % n.n)::int4 END AS partition) AS p \
       LEFT JOIN {leases} AS l ON l.partition = p.partition \
       LEFT JOIN {relays} AS r ON r.relay_id = l.owner";

/// Puts matching dead letters (given up on or not) back in line;
/// `last_error` and the attempt history stay for the record, the attempts
/// and the retry window (`first_failed_at`) start again. Deleted and inserted again (same id
/// and columns) rather than updated: the WAL source reads only inserts, so
/// a requeued row must be one to reach it again; the polling relay sees a
/// due row either way.
const REQUEUE_DEAD: &str = "WITH gone AS (DELETE FROM {t} WHERE {dead} RETURNING *), \
     again AS (INSERT INTO {t} (id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, \
            created_at, last_error, attempt_log) \
     SELECT g.id, g.event_id, g.aggregate_type, g.aggregate_id, g.event_type, g.payload, g.headers, \
            g.created_at, g.last_error, g.attempt_log FROM gone AS g ORDER BY g.id RETURNING 1) \
     SELECT count(*) FROM again";

/// What [`REQUEUE_DEAD`] would touch.
const COUNT_DEAD: &str = "SELECT count(*) FROM {t} WHERE {dead}";

/// This connection's backend pid and start time.
const BACKEND_IDENTITY: &str = "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()";

/// `$1` channel. Wakes relays after a requeue or a give-up, with the
/// payload [`NOTIFY_SWEEP`].
pub(crate) const NOTIFY: &str = "SELECT pg_notify($1, 'sweep')";

/// The payload of the notification `outbox dlq requeue`, `dlq give-up` and
/// the console send: rows may have become claimable below a polling
/// relay's claim floor (a requeued dead letter is inserted again under its
/// old id), so the relay's next claim starts from 0. The insert trigger's
/// notifications have an empty payload.
pub const NOTIFY_SWEEP: &str = "sweep";

/// `$1` interval in seconds. The retention cutoff, read once per cleanup so
/// every batch uses the same one.
pub(crate) const CUTOFF: &str = "SELECT clock_timestamp() - make_interval(secs => $1)";

/// `$1` the qualified table name. One session advisory lock per table for
/// scheduled retention, so of several relays one runs it.
pub(crate) const RETENTION_LOCK: &str = "SELECT pg_try_advisory_lock(hashtext('outbox retention ' || $1))";

/// `$1` last id deleted (0 to start), `$2` cutoff, `$3` batch size. One
/// short transaction of published rows older than the cutoff, walked by
/// primary key so each batch starts where the last ended instead of
/// rescanning. `published_at < $2` never matches an unpublished row or a
/// dead letter (their `published_at` is NULL). What it deleted goes into
/// the trace replay reads (`TRACE_REMOVED`), in the same statement.
/// Returns rows deleted and the last id.
const DELETE_PUBLISHED: &str = "WITH batch AS ( \
        SELECT id FROM {t} WHERE id > $1 AND published_at < $2 ORDER BY id LIMIT $3), \
     gone AS (DELETE FROM {t} AS o USING batch WHERE o.id = batch.id \
        RETURNING o.id, o.aggregate_type, o.event_type, o.created_at), \
     traced AS ({trace}) \
     SELECT count(*), coalesce(max(id), $1) FROM gone";

/// What published rows retention removed (`gone`: their id, aggregate
/// type, event type, created at) add to `<table>_removed`: one upsert per
/// aggregate type, event type and UTC hour of created_at, so `outbox
/// replay` can say how many matching events were no longer there.
/// Buckets are upserted in key order, so two cleanups running at once (a
/// relay's `--retention` and `outbox cleanup`) lock them in the same order
/// and wait for each other rather than deadlock.
pub(crate) const TRACE_REMOVED: &str = "INSERT INTO {removed} AS r (aggregate_type, event_type, hour, removed, min_id, max_id) \
        SELECT aggregate_type, event_type, date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', \
               count(*), min(id), max(id) FROM gone GROUP BY 1, 2, 3 ORDER BY 1, 2, 3 \
     ON CONFLICT (aggregate_type, event_type, hour) DO UPDATE \
        SET removed = r.removed + EXCLUDED.removed, min_id = least(r.min_id, EXCLUDED.min_id), \
            max_id = greatest(r.max_id, EXCLUDED.max_id), last_removed_at = clock_timestamp()";

/// `$1` cutoff, `$2` batch size. Oldest processed events first, through the
/// `processed_at` index. Returns rows deleted.
const DELETE_PROCESSED: &str = "WITH batch AS ( \
        SELECT event_id FROM {t} WHERE processed_at < $1 ORDER BY processed_at LIMIT $2), \
     gone AS (DELETE FROM {t} AS i USING batch WHERE i.event_id = batch.event_id RETURNING 1) \
     SELECT count(*) FROM gone";

/// `$1` event_id. The inbox's whole trick: a conflict means "seen before".
const INBOX_RECORD: &str = "INSERT INTO {t} (event_id) VALUES ($1) ON CONFLICT (event_id) DO NOTHING";

/// A claim template with what `spec` asks for in place: the lock claim's
/// mark or a deadline claim's deadline, the type filter, and each parameter's
/// number. A shape has fixed parameters (`relay::Shape::FIXED`); the claim
/// floor, the type filter's two, the lease's two and the byte bound
/// follow, in that order, each but the floor only where used
/// (`relay::claim_params` binds them the same way).
#[cfg(feature = "tokio-postgres")]
fn claim_template(template: &str, shape: Shape, spec: ClaimSpec) -> String {
    let mut next = shape.fixed_params();
    let mut param = || {
        next += 1;
        format!("${next}")
    };
    let floor = format!("{}::int8", param());
    let (types, types_in) = match spec.types {
        Some(_) => (param(), param()),
        None => (String::new(), String::new()),
    };
    let (owner, timeout) = if spec.deadline {
        (param(), param())
    } else {
        (String::new(), String::new())
    };
    let budget = param();
    let type_filter = |prefix: &str| {
        if spec.types.is_none() {
            return String::new();
        }
        TYPE_FILTER
            .replace("{a}", prefix)
            .replace("{p_types}", &types)
            .replace("{p_types_in}", &types_in)
    };
    let ordered = matches!(shape, Shape::Partitions | Shape::FewPartitions);
    let (deadline, set, from, col, probe) = if spec.deadline {
        (
            DEADLINE_CTE.replace("{p_timeout}", &timeout),
            SET_LEASE.replace("{p_owner}", &owner),
            ", deadline",
            ", o.claimed_until",
            if ordered {
                CLAIM_PROBE.replace("{p_owner}", &owner)
            } else {
                String::new()
            },
        )
    } else {
        (
            String::new(),
            "published_at = clock_timestamp()".to_owned(),
            "",
            "",
            String::new(),
        )
    };
    template
        .replace("{cut}", CUT)
        .replace("{budget}", &format!("{budget}::int8"))
        .replace("{deadline_cte}", &deadline)
        .replace("{set_claim}", &set)
        .replace("{claim_from}", from)
        .replace("{claimed_cols}", &CLAIMED_COLUMNS.replace("{claim_col}", col))
        .replace("{claim_probe}", &probe)
        .replace("{floor}", &floor)
        .replace("{type_filter_peek}", &type_filter(""))
        .replace("{type_filter}", &type_filter("c."))
}

/// The outbox statements for one table, rendered; callers run them through
/// the typed methods of the submodules, never as text.
#[derive(Debug, Clone)]
pub struct OutboxSql {
    pub(crate) insert_event: String,
    pub(crate) insert_events: String,
    /// What the claims are rendered for.
    #[cfg(feature = "tokio-postgres")]
    pub(crate) claim_spec: ClaimSpec,
    /// The claim in each shape (`relay::Shape`), bounded by bytes and for
    /// one row (`ONE_ROW`).
    #[cfg(feature = "tokio-postgres")]
    pub(crate) claims: [[String; 2]; 4],
    /// The claim of any row that takes a batch only whole (`WHOLE`).
    #[cfg(feature = "tokio-postgres")]
    pub(crate) claim_whole: String,
    /// See `floor::FIND_CLAIM_FLOOR`.
    #[cfg(feature = "tokio-postgres")]
    pub(crate) find_claim_floor: String,
    /// See `horizon::DEAD_TUPLES`.
    #[cfg(feature = "tokio-postgres")]
    pub(crate) dead_tuples: String,
    pub(crate) mark_deadline_claim: String,
    pub(crate) release_deadline_claim: String,
    pub(crate) release_abandoned_claims: String,
    pub(crate) relay_tick: String,
    pub(crate) relay_leave: String,
    pub(crate) relays: String,
    pub(crate) partition_backlog: String,
    pub(crate) give_up_dead: String,
    pub(crate) next_retry: String,
    pub(crate) fetch_payload: String,
    pub(crate) mark_failed: String,
    pub(crate) stats: String,
    pub(crate) list_dead: String,
    pub(crate) requeue_dead: String,
    pub(crate) count_dead: String,
    pub(crate) list_dead_page: String,
    pub(crate) count_give_up: String,
    pub(crate) purge_given_up: String,
    pub(crate) count_purge_given_up: String,
    pub(crate) dead_by_error: String,
    pub(crate) throughput: String,
    pub(crate) event_story: String,
    pub(crate) notify: &'static str,
    pub(crate) delete_published: String,
}

impl OutboxSql {
    /// Renders every statement for `config`'s table, with the lock claim.
    pub fn new(config: &Config) -> Self {
        Self::render(
            config,
            #[cfg(feature = "tokio-postgres")]
            ClaimSpec::default(),
        )
    }

    /// Renders every statement for `config`'s table, the claims as `spec`
    /// says.
    #[cfg(feature = "tokio-postgres")]
    pub fn with_claims(config: &Config, spec: ClaimSpec) -> Self {
        Self::render(config, spec)
    }

    /// The claims are the relay's, which needs tokio-postgres: a build
    /// without it (the sqlx writer alone) renders the rest.
    fn render(config: &Config, #[cfg(feature = "tokio-postgres")] spec: ClaimSpec) -> Self {
        let t = config.qualified();
        // Companion names are validated by the migration that creates them;
        // a table name too long for them fails the schema check first.
        let companion = |suffix: &str| format!("{}.\"{}{suffix}\"", config.schema.quoted(), config.table);
        let (leases, relays, tick_fn, removed) = (
            companion("_leases"),
            companion("_relays"),
            companion("_relay_tick"),
            companion("_removed"),
        );
        let render = |template: &str| {
            template
                .replace("{lease_cte}", LEASE_CTE)
                .replace("{lease_gate}", LEASE_GATE)
                .replace("{partition_of_c}", &PARTITION_OF.replace("{a}", "c."))
                .replace("{partition_of_d}", &PARTITION_OF.replace("{a}", "d."))
                .replace("{partition_of}", &PARTITION_OF.replace("{a}", ""))
                .replace("{leases}", &leases)
                .replace("{relays}", &relays)
                .replace("{tick_fn}", &tick_fn)
                .replace("{trace}", TRACE_REMOVED)
                .replace("{removed}", &removed)
                .replace("{dead}", DEAD_FILTER)
                .replace("{failed_set}", FAILED_SET)
                .replace("{attempt_log}", ATTEMPT_LOG)
                .replace("{log_len}", &ATTEMPT_LOG_LEN.to_string())
                .replace("{error_len}", &ATTEMPT_LOG_ERROR.to_string())
                .replace("{failed_rows}", FAILED_ROWS)
                .replace("{detail}", DETAIL_COLUMNS)
                .replace("{cols}", ROW_COLUMNS)
                .replace("{large}", &LARGE_PAYLOAD.to_string())
                .replace("{t}", &t)
        };
        #[cfg(feature = "tokio-postgres")]
        let claims = |shape: Shape| {
            let template = match shape {
                Shape::All => CLAIM_BATCH,
                Shape::Partitions => CLAIM_BATCH_LEASED,
                Shape::FewPartitions => CLAIM_BATCH_FEW_LEASED,
                Shape::Strict => CLAIM_BATCH_STRICT_LEASED,
            };
            [false, true].map(|one| {
                let template = if one {
                    template.replace("{cut}", ONE_ROW)
                } else {
                    template.to_owned()
                };
                render(&claim_template(&template, shape, spec))
            })
        };
        Self {
            insert_event: render(INSERT_EVENT),
            insert_events: render(INSERT_EVENTS),
            #[cfg(feature = "tokio-postgres")]
            claims: Shape::ALL.map(claims),
            #[cfg(feature = "tokio-postgres")]
            claim_whole: render(&claim_template(
                &CLAIM_BATCH.replace("{cut}", WHOLE),
                Shape::All,
                spec,
            )),
            #[cfg(feature = "tokio-postgres")]
            claim_spec: spec,
            #[cfg(feature = "tokio-postgres")]
            find_claim_floor: render(floor::FIND_CLAIM_FLOOR),
            #[cfg(feature = "tokio-postgres")]
            dead_tuples: render(horizon::DEAD_TUPLES),
            mark_deadline_claim: render(MARK_DEADLINE_CLAIM),
            release_deadline_claim: render(RELEASE_DEADLINE_CLAIM),
            release_abandoned_claims: render(RELEASE_ABANDONED_CLAIMS),
            relay_tick: render(RELAY_TICK),
            relay_leave: render(RELAY_LEAVE),
            relays: render(RELAYS),
            partition_backlog: render(PARTITION_BACKLOG),
            give_up_dead: render(GIVE_UP_DEAD),
            next_retry: render(NEXT_RETRY),
            fetch_payload: render(FETCH_PAYLOAD),
            mark_failed: render(MARK_FAILED),
            stats: render(STATS),
            list_dead: render(LIST_DEAD),
            requeue_dead: render(REQUEUE_DEAD),
            count_dead: render(COUNT_DEAD),
            list_dead_page: render(LIST_DEAD_PAGE),
            count_give_up: render(COUNT_GIVE_UP),
            purge_given_up: render(PURGE_GIVEN_UP),
            count_purge_given_up: render(COUNT_PURGE_GIVEN_UP),
            dead_by_error: render(DEAD_BY_ERROR),
            throughput: render(THROUGHPUT),
            event_story: render(EVENT_STORY),
            notify: NOTIFY,
            delete_published: render(DELETE_PUBLISHED),
        }
    }
}

/// The inbox statements for one processed-events table.
#[derive(Debug, Clone)]
pub struct InboxSql {
    /// See `INBOX_RECORD`.
    pub(crate) record: String,
    /// See `DELETE_PROCESSED`.
    pub(crate) delete_processed: String,
}

impl InboxSql {
    /// Renders the statements for `config`'s table.
    pub fn new(config: &InboxConfig) -> Self {
        let t = config.qualified();
        Self {
            record: INBOX_RECORD.replace("{t}", &t),
            delete_processed: DELETE_PROCESSED.replace("{t}", &t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_quoted_names_and_no_placeholders() {
        let sql = OutboxSql::new(&Config::new("app", "events").unwrap());
        let spec = ClaimSpec {
            deadline: true,
            types: Some(true),
        };
        let leased = OutboxSql::with_claims(&Config::new("app", "events").unwrap(), spec);
        for s in sql.claims.iter().chain(&leased.claims).flatten().chain([
            &sql.requeue_dead,
            &sql.count_dead,
            &sql.insert_events,
            &sql.list_dead_page,
            &sql.count_give_up,
            &sql.purge_given_up,
            &sql.count_purge_given_up,
            &sql.dead_by_error,
            &sql.throughput,
            &sql.event_story,
            &sql.find_claim_floor,
            &sql.dead_tuples,
            &sql.mark_failed,
            &sql.mark_deadline_claim,
            &sql.list_dead,
        ]) {
            assert!(s.contains("\"app\".\"events\""), "{s}");
            // `'{}'` is an empty array literal, not a placeholder.
            assert!(!s.replace("'{}'", "").contains('{'), "{s}");
        }
        assert!(sql.claims[1][1].contains("\"app\".\"events_leases\""));
        assert!(NOTIFY.contains(&format!("'{NOTIFY_SWEEP}'")));
        assert!(sql.relay_tick.contains("\"app\".\"events_relay_tick\"("));
    }
}
