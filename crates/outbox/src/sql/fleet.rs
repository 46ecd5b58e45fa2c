//! Statements of a relay fleet (one process serving many outboxes): finding
//! the tenant outboxes of a database and the databases of a server, which
//! of them have rows due, and who serves each, by advisory lock; and what
//! the operator's fleet commands read (each outbox's backlog, the fleet
//! processes' control sessions).
//!
//! # Who serves an outbox
//!
//! A fleet process serves an outbox while its control session holds the
//! outbox's *own* lock (`pg_advisory_lock(OWN, key)`, session level, so a
//! dead process loses it with its connection). Every batch transaction
//! takes the outbox's *batch* lock shared (`pg_try_advisory_xact_lock_shared(BATCH, key)`)
//! and checks, in the same statement, that its control session is still
//! the one it was when the process last said it serves the outbox
//! ([`fence`]). A process that takes an outbox over first takes the batch
//! lock exclusively and lets go of it ([`barrier`]): that passes only once
//! every batch of the previous owner has ended, so the two never deliver
//! one outbox at once and per-aggregate order holds.
//!
//! The control session is recognised by its *tag*: a lock of its own
//! (`TAG`, a random key no live session holds, [`take_tag`]) that it holds
//! exclusively for its whole life. A batch's fence asks the lock table for
//! that one key (a shared try that must fail), not for the own lock among
//! all of them: reading `pg_locks` copies the whole lock table, one own
//! lock per outbox, so that fence grew with the outboxes (a transaction
//! with it took 0.83 ms with 1,000 outboxes served, 0.11 ms with a lock
//! probe, in pgbench). The tag says the control session
//! lives, so its own locks are still held; that the process still means to
//! serve the outbox is its own word: it lets go of an own lock only once no
//! batch of that outbox is between its last look at that word and its
//! fence (`crate`'s caller keeps that promise; see the relay's fleet). So
//! a batch of the old owner begun after the barrier claims nothing: either
//! the control session is gone, and its tag with it, or the process had
//! stopped serving the outbox before letting go of it.
//!
//! Membership (how many fleet processes share the database's outboxes) is
//! a shared lock every control session holds ([`join`], [`members`]), keyed
//! by what the fleet serves (its schema pattern and table), so fleets
//! serving different outboxes of one database do not count each other.
//! Advisory locks live in PostgreSQL's lock table, so none of this needs a
//! table or a migration; they need session-level locks, so a fleet connects
//! directly or through a session-mode pooler, never a transaction-mode one.
//!
//! Names come in validated and quoted (`Ident`); values are bind parameters,
//! each statement unnamed with its parameters' types (`query_typed`).

use tokio_postgres::{Error, GenericClient, Statement};

use super::typed::typed;
use crate::{Config, Ident};

/// The `classid` of an outbox's own lock: `outx` in ASCII.
pub const OWN_LOCK: i32 = 0x6f75_7478;
/// The `classid` of an outbox's batch lock: `outy`.
pub const BATCH_LOCK: i32 = 0x6f75_7479;
/// The `classid` of the membership lock (keyed by the fleet): `outz`.
pub const MEMBER_LOCK: i32 = 0x6f75_747a;
/// The `classid` of a control session's tag: `out{`.
pub const TAG_LOCK: i32 = 0x6f75_747b;

/// One tenant outbox a database holds: its schema and its lock key (a hash
/// of `schema.table`, the same in every process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantOutbox {
    /// The schema holding it.
    pub schema: Ident,
    /// Its key in [`OWN_LOCK`] and [`BATCH_LOCK`].
    pub key: i32,
}

/// Schema names a fleet can serve: what [`Ident`] accepts.
const IDENT_RE: &str = "^[a-z_][a-z0-9_]{0,62}$";

/// `$1` a `LIKE` pattern, `$2` the table, `$3` its ledger, `$4` the
/// identifier rule, `$5` one schema or NULL. Schemas matching the pattern
/// (only `$5`, if given) that hold the table and its migration ledger (an
/// outbox `outbox migrate` made).
const TENANT_SCHEMAS: &str = "SELECT n.nspname::text, hashtext(n.nspname || '.' || $2) & 2147483647 \
       FROM pg_namespace AS n \
      WHERE n.nspname LIKE $1 AND n.nspname ~ $4 AND ($5::text IS NULL OR n.nspname = $5) \
        AND EXISTS (SELECT 1 FROM pg_class AS t WHERE t.relnamespace = n.oid AND t.relname = $2 AND t.relkind IN ('r', 'p')) \
        AND EXISTS (SELECT 1 FROM pg_class AS l WHERE l.relnamespace = n.oid AND l.relname = $3 AND l.relkind = 'r') \
      ORDER BY 1";

/// The tenant outboxes named `table` in the schemas matching the `LIKE`
/// pattern `pattern`, by schema name. Schemas whose names [`Ident`] would
/// refuse are left out.
pub async fn tenant_outboxes(
    client: &impl GenericClient,
    pattern: &str,
    table: &Ident,
) -> Result<Vec<TenantOutbox>, Error> {
    tenants(client, pattern, table, None).await
}

/// [`TENANT_SCHEMAS`], of every matching schema or of `only`.
async fn tenants(
    client: &impl GenericClient,
    pattern: &str,
    table: &Ident,
    only: Option<&Ident>,
) -> Result<Vec<TenantOutbox>, Error> {
    let ledger = format!("{}_migrations", table.as_str());
    let rows = client
        .query_typed(
            TENANT_SCHEMAS,
            &[
                typed(&pattern),
                typed(&table.as_str()),
                typed(&ledger.as_str()),
                typed(&IDENT_RE),
                typed(&only.map(Ident::as_str)),
            ],
        )
        .await?;
    rows.iter()
        .map(|row| {
            let schema: String = row.try_get(0)?;
            Ok(TenantOutbox {
                // The statement keeps only names Ident accepts.
                schema: Ident::new("--schemas", &schema).expect("filtered by IDENT_RE"),
                key: row.try_get(1)?,
            })
        })
        .collect()
}

/// The lock key of the outbox `config` ([`TenantOutbox::key`]), for one
/// listed by name rather than found by a pattern: the same hash.
pub async fn outbox_key(client: &impl GenericClient, config: &Config) -> Result<i32, Error> {
    client
        .query_typed_one(
            "SELECT hashtext($1 || '.' || $2) & 2147483647",
            &[typed(&config.schema.as_str()), typed(&config.table.as_str())],
        )
        .await?
        .try_get(0)
}

/// `$1` a `LIKE` pattern, `$2` the identifier rule: the schemas matching it,
/// but PostgreSQL's own.
const MATCHING_SCHEMAS: &str = "SELECT nspname::text FROM pg_namespace \
      WHERE nspname LIKE $1 AND nspname ~ $2 AND nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema' \
      ORDER BY 1";

/// The schemas whose names match the `LIKE` pattern `pattern` (with or
/// without an outbox), PostgreSQL's own left out: what `outbox migrate
/// --schemas` migrates.
pub async fn matching_schemas(client: &impl GenericClient, pattern: &str) -> Result<Vec<Ident>, Error> {
    let rows = client
        .query_typed(MATCHING_SCHEMAS, &[typed(&pattern), typed(&IDENT_RE)])
        .await?;
    rows.iter()
        .map(|row| {
            let schema: String = row.try_get(0)?;
            Ok(Ident::new("--schemas", &schema).expect("filtered by IDENT_RE"))
        })
        .collect()
}

/// `$1` a `LIKE` pattern: the databases matching it that take connections.
const MATCHING_DATABASES: &str = "SELECT datname::text FROM pg_database \
      WHERE datname LIKE $1 AND datallowconn AND NOT datistemplate ORDER BY 1";

/// The databases of the server whose names match the `LIKE` pattern
/// `pattern` and that take connections.
pub async fn matching_databases(client: &impl GenericClient, pattern: &str) -> Result<Vec<String>, Error> {
    let rows = client.query_typed(MATCHING_DATABASES, &[typed(&pattern)]).await?;
    rows.iter().map(|row| row.try_get(0)).collect()
}

/// A fleet's key in [`MEMBER_LOCK`]: what it serves, hashed by the server
/// (the same in every process).
const FLEET_KEY: &str = "hashtext($2 || '|' || $3) & 2147483647";

/// Joins the fleet serving the outboxes named `table` in the schemas
/// matching `pattern` in this database: its membership lock, shared, for
/// the session's life.
pub async fn join(client: &impl GenericClient, pattern: &str, table: &Ident) -> Result<(), Error> {
    client
        .execute_typed(
            &format!("SELECT pg_advisory_lock_shared($1, {FLEET_KEY})"),
            &[typed(&MEMBER_LOCK), typed(&pattern), typed(&table.as_str())],
        )
        .await
        .map(drop)
}

/// The advisory locks of class `$1` granted in this database: key and
/// holder's pid. `pg_locks` shows a two-key lock's keys as `classid` and
/// `objid` (an `oid`, so compared as `int8`), with `objsubid` 2.
const HELD: &str = "SELECT objid::int8, pid FROM pg_locks \
      WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid::int8 = $1::int8 \
        AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// How many processes of the fleet of `pattern` and `table` (see [`join`])
/// serve this database.
pub async fn members(client: &impl GenericClient, pattern: &str, table: &Ident) -> Result<usize, Error> {
    let row = client
        .query_typed_one(
            &format!("SELECT count(*) FROM ({HELD}) AS held WHERE objid = {FLEET_KEY}"),
            &[
                typed(&i64::from(MEMBER_LOCK)),
                typed(&pattern),
                typed(&table.as_str()),
            ],
        )
        .await?;
    Ok(usize::try_from(row.try_get::<_, i64>(0)?).unwrap_or(0))
}

/// Which outbox keys are served, and by which backend pid (the control
/// session of a fleet process).
pub async fn owners(client: &impl GenericClient) -> Result<Vec<(i32, i32)>, Error> {
    let rows = client.query_typed(HELD, &[typed(&i64::from(OWN_LOCK))]).await?;
    rows.iter()
        .map(|row| {
            let key: i64 = row.try_get(0)?;
            // Keys are non-negative int4s (TENANT_SCHEMAS masks the hash).
            Ok((i32::try_from(key).unwrap_or(i32::MAX), row.try_get(1)?))
        })
        .collect()
}

/// `$1` a lock class, `$2` keys: tries each key's lock, session level.
const TRY_LOCKS: &str = "SELECT k FROM unnest($2::int4[]) AS k WHERE pg_try_advisory_lock($1, k)";

/// Takes the own locks of `keys` that nobody holds; returns those taken.
pub async fn try_own(client: &impl GenericClient, keys: &[i32]) -> Result<Vec<i32>, Error> {
    let rows = client
        .query_typed(TRY_LOCKS, &[typed(&OWN_LOCK), typed(&keys)])
        .await?;
    rows.iter().map(|row| row.try_get(0)).collect()
}

/// `$1` the own lock class, `$2` keys: tries each key's lock shared,
/// session level.
const TRY_SHARED: &str = "SELECT k FROM unnest($2::int4[]) AS k WHERE pg_try_advisory_lock_shared($1, k)";

/// Takes the own locks of `keys` shared, for outboxes served split (every
/// fleet process serving them at once, by partition leases): granted
/// unless a process serving one whole holds it. Returns those taken.
pub async fn try_share(client: &impl GenericClient, keys: &[i32]) -> Result<Vec<i32>, Error> {
    let rows = client
        .query_typed(TRY_SHARED, &[typed(&OWN_LOCK), typed(&keys)])
        .await?;
    rows.iter().map(|row| row.try_get(0)).collect()
}

/// `$1` the own lock class, `$2` keys: lets go of each (held) shared lock.
const UNLOCK_SHARED: &str = "SELECT pg_advisory_unlock_shared($1, k) FROM unnest($2::int4[]) AS k";

/// Stops serving `keys` split: lets go of their shared own locks.
pub async fn unshare(client: &impl GenericClient, keys: &[i32]) -> Result<(), Error> {
    client
        .execute_typed(UNLOCK_SHARED, &[typed(&OWN_LOCK), typed(&keys)])
        .await
        .map(drop)
}

/// `{i}` a position, `{r}` an outbox's relays table: the position if no
/// relay of that outbox beat within `$1` milliseconds.
const NO_LIVE_RELAY: &str = "SELECT {i}::int4 WHERE NOT EXISTS (SELECT 1 FROM {r} \
      WHERE heartbeat_at > clock_timestamp() - make_interval(secs => $1::float8 / 1000))";

/// Of `outboxes`, the positions of those no relay with partition leases
/// serves: none of their relays (a fleet's split relays, or a relay run
/// for that outbox alone) beat within `within`. A fleet process taking
/// one over whole waits for that as for the batch barrier, so a relay
/// partitioning it and a process serving it whole never deliver it at
/// once. One statement for all (empty: nothing run).
pub async fn without_live_relays(
    client: &impl GenericClient,
    outboxes: &[Config],
    within: std::time::Duration,
) -> Result<Vec<usize>, Error> {
    if outboxes.is_empty() {
        return Ok(Vec::new());
    }
    let parts = outboxes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            // The table is an Ident ([a-z0-9_]): its quoted companion needs
            // no escaping.
            let relays = format!("{}.\"{}_relays\"", c.schema.quoted(), c.table.as_str());
            NO_LIVE_RELAY
                .replace("{i}", &i.to_string())
                .replace("{r}", &relays)
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    #[allow(clippy::cast_precision_loss)]
    let ms = within.as_millis() as f64;
    client
        .query_typed(&parts, &[typed(&ms)])
        .await?
        .iter()
        .map(|row| Ok(usize::try_from(row.try_get::<_, i32>(0)?).unwrap_or(usize::MAX)))
        .collect()
}

/// `$1` a lock class, `$2` keys: lets go of each (held) session lock.
const UNLOCK: &str = "SELECT pg_advisory_unlock($1, k) FROM unnest($2::int4[]) AS k";

/// Stops serving `keys`: lets go of their own locks.
pub async fn disown(client: &impl GenericClient, keys: &[i32]) -> Result<(), Error> {
    client
        .execute_typed(UNLOCK, &[typed(&OWN_LOCK), typed(&keys)])
        .await
        .map(drop)
}

/// Of `keys` (outboxes just taken over), those no batch of a previous owner
/// is still in: their batch lock could be taken exclusively. It is let go
/// of at once; a key that did not pass is tried again later.
pub async fn barrier(client: &impl GenericClient, keys: &[i32]) -> Result<Vec<i32>, Error> {
    let passed: Vec<i32> = client
        .query_typed(TRY_LOCKS, &[typed(&BATCH_LOCK), typed(&keys)])
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    if !passed.is_empty() {
        client
            .execute_typed(UNLOCK, &[typed(&BATCH_LOCK), typed(&passed)])
            .await?;
    }
    Ok(passed)
}

/// `$1` the tag lock class. A key (positive) no live session holds, taken
/// for this session (a row), or none if another session holds the one drawn.
const TAKE_TAG: &str = "SELECT k FROM (SELECT 1 + (random() * 2147483645)::int4 AS k) AS drawn \
      WHERE pg_try_advisory_lock($1, k)";

/// Takes a tag for this (control) session: see the [module docs](self).
/// Held until the session ends.
pub async fn take_tag(client: &impl GenericClient) -> Result<i32, Error> {
    loop {
        if let Some(row) = client.query_typed_opt(TAKE_TAG, &[typed(&TAG_LOCK)]).await? {
            return row.try_get(0);
        }
    }
}

/// `$1` the batch lock class, `$2` the key, `$3` the tag lock class, `$4`
/// the control session's tag. In the batch's transaction, before its
/// claim: the batch lock shared (held until the transaction ends), and the
/// tag still held by someone else: by the control session, as nobody else
/// takes a tag a live session holds. A shared try that succeeds holds the
/// tag until this transaction ends, which only keeps a new control session
/// from drawing it meanwhile.
const FENCE: &str = "SELECT pg_try_advisory_xact_lock_shared($1, $2) \
      AND NOT pg_try_advisory_xact_lock_shared($3, $4)";

/// Whether this transaction may claim from the outbox `key`: see the
/// [module docs](self). Run inside the batch's transaction; `tag` is the
/// control session's ([`take_tag`]) as it was when the batch last saw its
/// process serve the outbox.
pub async fn fence(client: &impl GenericClient, key: i32, tag: i32) -> Result<bool, Error> {
    client
        .query_typed_one(
            FENCE,
            &[typed(&BATCH_LOCK), typed(&key), typed(&TAG_LOCK), typed(&tag)],
        )
        .await?
        .try_get(0)
}

/// `{t}` the outbox. One outbox's backlog for `outbox stats --schemas`:
/// `STATS`'s counts summed over aggregate types (pending rows, dead
/// letters, given up, the oldest pending row), the pending rows split into
/// due now and waiting (for a retry's backoff, or a deadline claim's
/// deadline), and the oldest pending row's age by the server's clock, one
/// instant for the whole statement so due and waiting add up to the
/// backlog. Scans the unpublished rows only (`<table>_unpublished_idx`).
const SUMMARY: &str = "WITH now AS (SELECT clock_timestamp() AS at) \
     SELECT count(*) FILTER (WHERE dead_at IS NULL), \
            count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at <= (SELECT at FROM now)), \
            count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at > (SELECT at FROM now)), \
            count(*) FILTER (WHERE dead_at IS NOT NULL AND given_up_at IS NULL), \
            count(*) FILTER (WHERE given_up_at IS NOT NULL), \
            min(created_at) FILTER (WHERE dead_at IS NULL), \
            extract(epoch FROM (SELECT at FROM now) - min(created_at) FILTER (WHERE dead_at IS NULL))::float8 \
       FROM {t} WHERE published_at IS NULL";

/// One outbox's backlog, as [`summary`] reads it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Rows waiting for delivery: not published, not dead letters.
    pub backlog: i64,
    /// Of the backlog, rows due now.
    pub due_now: i64,
    /// Of the backlog, rows waiting for a later attempt (a retry's backoff).
    pub waiting: i64,
    /// Dead letters nobody gave up on.
    pub dead_letters: i64,
    /// Dead letters given up on (`dlq give-up`).
    pub given_up: i64,
    /// When the oldest row of the backlog was written.
    pub oldest_unpublished: Option<chrono::DateTime<chrono::Utc>>,
    /// Its age in seconds, by the server's clock.
    pub oldest_unpublished_age_seconds: Option<f64>,
}

/// The backlog of the outbox `outbox`: see [`Summary`]. One statement,
/// rendered for the outbox when called (an operator's command, run once
/// per outbox).
pub async fn summary(client: &impl GenericClient, outbox: &Config) -> Result<Summary, Error> {
    let statement = SUMMARY.replace("{t}", &outbox.qualified());
    let row = client.query_typed_one(&statement, &[]).await?;
    Ok(Summary {
        backlog: row.try_get(0)?,
        due_now: row.try_get(1)?,
        waiting: row.try_get(2)?,
        dead_letters: row.try_get(3)?,
        given_up: row.try_get(4)?,
        oldest_unpublished: row.try_get(5)?,
        oldest_unpublished_age_seconds: row.try_get(6)?,
    })
}

/// `{i}` a position, `{t}` the outbox, `{l}` its migration ledger: one
/// outbox's part of a [`summaries_statement`], [`SUMMARY`]'s counts with
/// the ledger's version, at the statement's one instant.
const SUMMARY_PART: &str = "SELECT {i}::int4, (SELECT coalesce(max(version), 0) FROM {l})::int4, \
            count(*) FILTER (WHERE dead_at IS NULL), \
            count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at <= (SELECT at FROM now)), \
            count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at > (SELECT at FROM now)), \
            count(*) FILTER (WHERE dead_at IS NOT NULL AND given_up_at IS NULL), \
            count(*) FILTER (WHERE given_up_at IS NOT NULL), \
            min(created_at) FILTER (WHERE dead_at IS NULL), \
            extract(epoch FROM (SELECT at FROM now) - min(created_at) FILTER (WHERE dead_at IS NULL))::float8 \
       FROM {t} WHERE published_at IS NULL";

/// One outbox's backlog as [`summaries`] reads it, with its schema version.
#[derive(Debug, Clone, PartialEq)]
pub struct VersionedSummary {
    /// The outbox's schema version (its ledger's highest): a list compares
    /// it with [`crate::OUTBOX_VERSION`] rather than running
    /// [`crate::check`] once per outbox.
    pub version: i32,
    /// Its backlog.
    pub summary: Summary,
}

/// The statement [`summaries`] runs for `outboxes`: [`SUMMARY`] of each,
/// `UNION ALL`, one instant for all. One round trip for many outboxes, as
/// the fleet's scan does for its wake-ups and gauges; each part scans its outbox's
/// unpublished rows only (`<table>_unpublished_idx`).
pub fn summaries_statement(outboxes: &[Config]) -> String {
    let parts = outboxes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            // The table is an Ident ([a-z0-9_]), so the ledger's quoted
            // name needs no escaping.
            let ledger = format!("{}.\"{}_migrations\"", c.schema.quoted(), c.table.as_str());
            SUMMARY_PART
                .replace("{i}", &i.to_string())
                .replace("{l}", &ledger)
                .replace("{t}", &c.qualified())
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    format!("WITH now AS (SELECT clock_timestamp() AS at) {parts} ORDER BY 1")
}

/// The backlog and schema version of each of `outboxes`, in their order, in
/// one statement ([`summaries_statement`]): what the admin console's list
/// of a fleet reads. One outbox the statement cannot read (a schema too old
/// for a column) fails the statement; the caller reads those one at a time.
pub async fn summaries(
    client: &impl GenericClient,
    outboxes: &[Config],
) -> Result<Vec<VersionedSummary>, Error> {
    if outboxes.is_empty() {
        return Ok(Vec::new());
    }
    let rows = client.query_typed(&summaries_statement(outboxes), &[]).await?;
    rows.iter().map(versioned).collect()
}

/// [`summaries_statement`] of `outboxes` prepared on `client`, for a
/// fleet's scan, which runs the same one every poll: planning it is most
/// of its cost (with 1,000 outboxes, 460 ms planned, 65 ms prepared).
/// Not for an empty list.
pub async fn prepare_summaries(client: &impl GenericClient, outboxes: &[Config]) -> Result<Statement, Error> {
    client.prepare(&summaries_statement(outboxes)).await
}

/// Runs a statement [`prepare_summaries`] made: what [`summaries`] reads.
pub async fn prepared_summaries(
    client: &impl GenericClient,
    statement: &Statement,
) -> Result<Vec<VersionedSummary>, Error> {
    client
        .query(statement, &[])
        .await?
        .iter()
        .map(versioned)
        .collect()
}

/// One row of [`summaries_statement`].
fn versioned(row: &tokio_postgres::Row) -> Result<VersionedSummary, Error> {
    Ok(VersionedSummary {
        version: row.try_get(1)?,
        summary: Summary {
            backlog: row.try_get(2)?,
            due_now: row.try_get(3)?,
            waiting: row.try_get(4)?,
            dead_letters: row.try_get(5)?,
            given_up: row.try_get(6)?,
            oldest_unpublished: row.try_get(7)?,
            oldest_unpublished_age_seconds: row.try_get(8)?,
        },
    })
}

/// The tenant outbox named `table` in `schema`, if `schema` matches the
/// `LIKE` pattern `pattern` and holds one: whether [`tenant_outboxes`]
/// would list it, without listing the others.
pub async fn tenant_outbox(
    client: &impl GenericClient,
    pattern: &str,
    schema: &Ident,
    table: &Ident,
) -> Result<Option<TenantOutbox>, Error> {
    Ok(tenants(client, pattern, table, Some(schema)).await?.pop())
}

/// A fleet process as PostgreSQL sees it: its control session in one
/// database.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FleetSession {
    /// The control session's backend pid (what [`owners`] reports).
    pub pid: i32,
    /// Its `application_name` (`outbox-fleet` unless the URL set one);
    /// empty if none.
    pub application_name: String,
    /// Where it connects from; None over a Unix socket, or when the role
    /// may not see other roles' sessions (`pg_read_all_stats`).
    pub client_addr: Option<String>,
    /// When its connection started; None when the role may not see it.
    pub backend_start: Option<chrono::DateTime<chrono::Utc>>,
}

/// `$1` the lock classes. The sessions of this database holding the
/// membership or an own lock (the control sessions of fleet processes),
/// with what `pg_stat_activity` says of them, oldest first. Other roles'
/// `client_addr` and `backend_start` read as NULL without
/// `pg_read_all_stats`; `application_name` is visible to all.
const FLEET_SESSIONS: &str = "SELECT l.pid, coalesce(a.application_name, ''), host(a.client_addr), a.backend_start \
       FROM (SELECT DISTINCT pid FROM pg_locks \
              WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid::int8 = ANY($1::int8[]) \
                AND database = (SELECT oid FROM pg_database WHERE datname = current_database())) AS l \
       LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid \
      ORDER BY a.backend_start NULLS LAST, l.pid";

/// The fleet processes of this database: their control sessions.
pub async fn sessions(client: &impl GenericClient) -> Result<Vec<FleetSession>, Error> {
    let classes: &[i64] = &[i64::from(MEMBER_LOCK), i64::from(OWN_LOCK)];
    let rows = client.query_typed(FLEET_SESSIONS, &[typed(&classes)]).await?;
    rows.iter()
        .map(|row| {
            Ok(FleetSession {
                pid: row.try_get(0)?,
                application_name: row.try_get(1)?,
                client_addr: row.try_get(2)?,
                backend_start: row.try_get(3)?,
            })
        })
        .collect()
}

/// The connected database's name: what labels an outbox across databases.
pub async fn current_database(client: &impl GenericClient) -> Result<String, Error> {
    client
        .query_typed_one("SELECT current_database()::text", &[])
        .await?
        .try_get(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summaries_statement_reads_each_outbox_and_its_ledger_in_order() {
        let a = Config::new("t1", "outbox").unwrap();
        let b = Config::new("t2", "outbox").unwrap();
        let sql = summaries_statement(&[a, b]);
        assert!(
            sql.starts_with("WITH now AS (SELECT clock_timestamp() AS at) SELECT 0::int4, "),
            "{sql}"
        );
        assert!(sql.contains("FROM \"t1\".\"outbox_migrations\")"), "{sql}");
        assert!(sql.contains(" UNION ALL SELECT 1::int4, "), "{sql}");
        assert!(
            sql.contains("FROM \"t2\".\"outbox\" WHERE published_at IS NULL"),
            "{sql}"
        );
        assert!(sql.ends_with(" ORDER BY 1"), "{sql}");
    }
}
