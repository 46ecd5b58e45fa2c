//! Log tailing's statements with typed parameters and rows: the checks and
//! objects `outbox migrate --wal` creates (publication, slot), the slot's
//! state, the table-less `emit`, what the WAL source writes back (dead
//! letters, deletes of delivered rows), whose turn it is to read the slot,
//! the recovery after PostgreSQL invalidated it, and the backfill after a
//! failover (its mark on the publication, reading the table in id order,
//! whether a server is a standby).
//!
//! Replication itself (`START_REPLICATION`) runs on a replication
//! connection in `outbox-relay`, not here.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use tokio_postgres::types::Type;
use tokio_postgres::{Error, GenericClient};
use uuid::Uuid;

use crate::{Config, Ident};

/// `wal_level`, whether the current role may replicate, its name, and the
/// server's version number.
const PREREQUISITES: &str = "SELECT current_setting('wal_level'), r.rolreplication OR r.rolsuper, \
            current_user::text, current_setting('server_version_num')::int4 \
       FROM pg_roles AS r WHERE r.rolname = current_user";

/// `$1` publication name.
const PUBLICATION_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)";

/// Inserts only: the WAL source never needs an UPDATE or DELETE, and the
/// relay's own deletes of delivered rows must not come back to it.
/// `publish_via_partition_root`: a daily-partitioned outbox publishes its
/// rows as the outbox's, not as each day's partition.
const CREATE_PUBLICATION: &str =
    "CREATE PUBLICATION {p} FOR TABLE {t} WITH (publish = 'insert', publish_via_partition_root = true)";

/// A fleet's publication (`outbox relay --source wal --schemas`): made
/// empty, inserts only, each tenant's outbox added as it is found.
const CREATE_FLEET_PUBLICATION: &str =
    "CREATE PUBLICATION {p} WITH (publish = 'insert', publish_via_partition_root = true)";

/// Adds a tenant's outbox to its fleet's publication. Run after
/// `LOCK_WRITERS` in one transaction: no insert into the table is under way
/// when it commits, so each row either committed before (a backfill reads
/// it) or is decoded with the table published.
const ADD_TO_PUBLICATION: &str = "ALTER PUBLICATION {p} ADD TABLE {t}";

/// `$1` publication name. The tables it publishes, as `schema.table`.
const PUBLISHED_TABLES: &str =
    "SELECT schemaname::text || '.' || tablename::text FROM pg_publication_tables WHERE pubname = $1";

/// `$1` slot name. The slot's database, plugin, state (`wal_status`: `lost`
/// once invalidated), the pid reading it, and the WAL bytes it holds back
/// (from `restart_lsn`) and has not confirmed (from `confirmed_flush_lsn`).
const SLOT: &str = "SELECT database::text, plugin::text, coalesce(wal_status, ''), active_pid, \
            coalesce((pg_current_wal_lsn() - restart_lsn)::int8, 0), \
            coalesce((pg_current_wal_lsn() - confirmed_flush_lsn)::int8, 0), \
            coalesce(confirmed_flush_lsn::text, ''), current_database()::text \
       FROM pg_replication_slots WHERE slot_name = $1";

/// `$1` slot name. Waits for the transactions running now to end, so it
/// must run outside a transaction that wrote.
const CREATE_SLOT: &str = "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')";

/// `$1` slot name.
const DROP_SLOT: &str = "SELECT pg_drop_replication_slot($1)";

/// `$1..$6` the event (as `INSERT_EVENT` binds it), `$7` prefix. One event as a transactional logical
/// decoding message: decoded only if the caller's transaction commits, and
/// no row anywhere. `created_at` is the clock at the call, as the insert's
/// default is.
const EMIT: &str = "SELECT pg_logical_emit_message(true, $7::text, json_build_object( \
        'event_id', $1::uuid, 'aggregate_type', $2::text, 'aggregate_id', $3::text, \
        'event_type', $4::text, 'payload', $5::jsonb, 'headers', $6::jsonb, \
        'created_at', clock_timestamp())::text)";

/// The same for arrays of the columns, in the caller's order.
const EMIT_ALL: &str = "SELECT pg_logical_emit_message(true, $7::text, json_build_object( \
        'event_id', e.event_id, 'aggregate_type', e.aggregate_type, 'aggregate_id', e.aggregate_id, \
        'event_type', e.event_type, 'payload', e.payload, 'headers', e.headers, \
        'created_at', clock_timestamp())::text) \
       FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[]) \
            WITH ORDINALITY AS e(event_id, aggregate_type, aggregate_id, event_type, payload, headers, ord) \
      ORDER BY e.ord";

/// `$1` ids, `$2` attempts, `$3` errors, `$4` first failed attempts, `$5`
/// attempt histories (see [`DeadRows`]). Rows the WAL source gave up on
/// become dead letters: no UPDATE is published, so the source never sees
/// this, and `outbox dlq` finds them as it finds the polling relay's.
const DEAD_ROWS: &str = "UPDATE {t} AS o SET dead_at = clock_timestamp(), attempts = d.attempts, last_error = d.error, \
            next_attempt_at = clock_timestamp(), first_failed_at = d.first_failed_at, attempt_log = d.attempt_log \
       FROM unnest($1::int8[], $2::int4[], $3::text[], $4::timestamptz[], $5::jsonb[]) \
            AS d(id, attempts, error, first_failed_at, attempt_log) WHERE o.id = d.id \
     RETURNING o.id";

/// `$1..$11` arrays. Emitted events (no row) the WAL source gave up on are
/// inserted as dead letters. The insert is published; the source skips
/// rows that arrive with `dead_at` set.
const DEAD_EMITTED: &str = "INSERT INTO {t} (event_id, aggregate_type, aggregate_id, event_type, payload, headers, \
            created_at, attempts, last_error, first_failed_at, attempt_log, dead_at) \
     SELECT e.*, clock_timestamp() \
       FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[], \
                   $7::timestamptz[], $8::int4[], $9::text[], $10::timestamptz[], $11::jsonb[]) \
            AS e(event_id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, \
                 last_error, first_failed_at, attempt_log)";

/// `$1` ids. Delivered rows go by primary key (`--wal-cleanup delete`):
/// the table only ever holds what is in flight.
///
/// Returns the ids it found: logical decoding sends a commit as soon as
/// its record is flushed, a moment before the transaction is visible to
/// other sessions, so a row delivered that fast may not be found yet; the
/// source tries those again (as it does the dead letters of `DEAD_ROWS`).
const DELETE_DELIVERED: &str = "DELETE FROM {t} WHERE id = ANY($1::int8[]) RETURNING id";

/// `$1` slot name. Whose turn it is to read the slot: a session advisory
/// lock keyed by the slot's name, held by the reader for its lifetime.
const TURN_TRY: &str = "SELECT pg_try_advisory_lock(hashtextextended('outbox wal ' || $1::text, 0))";

/// `$1` slot name. The turn's holder (pid), how long since its session last
/// changed state (the reader runs a heartbeat query every third of the
/// lease timeout, so a long silence means frozen or cut off), and the pid
/// streaming the slot. NULLs when nobody holds the turn, or the holder's
/// activity is not visible to this role.
const TURN_HOLDER: &str = "WITH k AS (SELECT hashtextextended('outbox wal ' || $1::text, 0) AS key) \
     SELECT l.pid, extract(epoch FROM clock_timestamp() - a.state_change)::float8, \
            (SELECT s.active_pid FROM pg_replication_slots AS s WHERE s.slot_name = $1::text) \
       FROM k, pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid \
      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
        AND l.classid = ((k.key >> 32) & 4294967295)::oid AND l.objid = (k.key & 4294967295)::oid";

/// The reader's heartbeat on the turn's session: any statement updates
/// its `state_change`, which is what the standbys watch.
const HEARTBEAT: &str = "SELECT 1";

/// `$1` prefix. A message the WAL source reads back once it has read
/// everything committed before it: how a drain knows it is done.
/// Transactional, so its commit flushes the WAL: the walsender decodes only
/// flushed WAL, and a non-transactional message waits for the WAL writer
/// (up to `wal_writer_delay`, 200 ms) when nothing else commits, which is
/// what draining emitted events alone looked like.
const DRAIN_MARKER: &str = "SELECT pg_logical_emit_message(true, $1::text, '')::text";

/// `$1` pid. Waits up to 1 s for the backend to exit.
const TERMINATE: &str = "SELECT pg_terminate_backend($1::int4, 1000)";

/// Takes writers out for the recovery's transaction: rows committed while
/// it re-inserts would otherwise overtake the older ones it re-inserts.
const LOCK_WRITERS: &str = "LOCK TABLE {t} IN SHARE ROW EXCLUSIVE MODE";

/// `$1` oldest `created_at` to re-send, or NULL for all. After the slot was
/// recreated: every row not delivered (not dead) is deleted and inserted
/// again, same id and columns, in id order, so the new slot decodes them.
/// Returns how many.
const REINSERT_PENDING: &str = "WITH gone AS ( \
        DELETE FROM {t} WHERE published_at IS NULL AND dead_at IS NULL \
           AND ($1::timestamptz IS NULL OR created_at >= $1::timestamptz) RETURNING *), \
     again AS (INSERT INTO {t} SELECT * FROM gone ORDER BY id RETURNING 1) \
     SELECT count(*) FROM again";

/// Whether this server is a standby: the WAL source streams from the
/// host of a multi-host URL that is not.
const IN_RECOVERY: &str = "SELECT pg_is_in_recovery()";

/// What the publication's comment says while a backfill is owed: set
/// before a slot is created for an outbox that may hold rows the slot will
/// never decode, cleared once the relay delivered them. On the publication
/// because it is the one object of log tailing that outlives its slot (a
/// failover to a standby keeps the catalog, not the slot).
const BACKFILL_MARK: &str = "outbox wal backfill owed";

/// `$1` publication name, `$2` the mark. Whether the publication carries
/// the mark; no row without the publication.
const BACKFILL_OWED: &str = "SELECT coalesce(obj_description(oid, 'pg_publication') = $2, false) \
       FROM pg_publication WHERE pubname = $1";

/// Sets the mark (COMMENT takes no parameters; the text is a constant).
const BACKFILL_MARK_SET: &str = "COMMENT ON PUBLICATION {p} IS 'outbox wal backfill owed'";

/// Clears it.
const BACKFILL_MARK_CLEAR: &str = "COMMENT ON PUBLICATION {p} IS NULL";

/// The highest id now: a backfill reads up to it; rows inserted later
/// (higher ids) are the stream's. Through the primary key.
const BACKFILL_BOUND: &str = "SELECT coalesce(max(id), 0)::int8 FROM {t}";

/// `$1` after id, `$2` up to id, `$3` rows, `$4` bytes. The next page of a
/// backfill: rows not delivered (not published, not dead letters) in id
/// order through the primary key, with each payload's size as text, cut
/// once the payloads before a row reach `$4` bytes (the first row always
/// comes).
const BACKFILL_PAGE: &str = "SELECT {cols}, bytes FROM ( \
        SELECT {cols}, octet_length(payload::text)::int8 AS bytes, \
               sum(octet_length(payload::text)) OVER (ORDER BY id)::int8 AS running \
          FROM {t} WHERE id > $1 AND id <= $2 AND published_at IS NULL AND dead_at IS NULL \
         ORDER BY id LIMIT $3) AS page \
      WHERE running - bytes < $4 ORDER BY id";

/// The WAL insert position: a transaction visible to a statement that ran
/// before this committed at or before it (its commit record was inserted
/// before it became visible), so the stream holds nothing a backfill read
/// past the first commit that ends after it.
const INSERT_POSITION: &str = "SELECT pg_current_wal_insert_lsn()::text";

/// `$1` a partition (qualified). Its comment, where a partition drop keeps
/// its log-tailing mark (see `outbox::partitions`).
const PARTITION_COMMENT: &str = "SELECT obj_description(to_regclass($1), 'pg_class')";

/// `$1` a partition (qualified). Its highest id and the current WAL
/// position, read together for a mark.
const MARK_NOW: &str = "SELECT (SELECT max(id) FROM {partition}), pg_current_wal_lsn()::text";

/// `$1` slot, `$2` position. Whether the slot is healthy and has confirmed
/// at least that position.
const CONFIRMED_PAST: &str = "SELECT coalesce(bool_or(wal_status <> 'lost' AND confirmed_flush_lsn >= $2::text::pg_lsn), false) \
       FROM pg_replication_slots WHERE slot_name = $1";

/// The prefix of a partition's comment that holds its mark.
const MARK_PREFIX: &str = "outbox wal mark ";

/// A past day's partition as log tailing last saw it: its highest id, and
/// a WAL position every transaction that wrote into it committed before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionMark {
    /// `pg_current_wal_lsn()` when the mark was taken.
    pub lsn: String,
    /// The partition's highest id then (`None`: it was empty).
    pub max_id: Option<i64>,
}

impl PartitionMark {
    fn parse(comment: &str) -> Option<PartitionMark> {
        let mut parts = comment.strip_prefix(MARK_PREFIX)?.split(' ');
        let lsn = parts.next().filter(|l| is_lsn(l))?.to_owned();
        let max_id = match parts.next()? {
            "-" => None,
            id => Some(id.parse().ok()?),
        };
        Some(PartitionMark { lsn, max_id })
    }

    fn render(&self) -> String {
        let id = self.max_id.map_or_else(|| "-".to_owned(), |i| i.to_string());
        format!("{MARK_PREFIX}{} {id}", self.lsn)
    }
}

/// `X/Y` in hex, as PostgreSQL prints an LSN: safe inside a literal.
fn is_lsn(s: &str) -> bool {
    s.split_once('/').is_some_and(|(a, b)| {
        [a, b]
            .iter()
            .all(|p| !p.is_empty() && p.len() <= 8 && p.bytes().all(|c| c.is_ascii_hexdigit()))
    })
}

/// Log tailing's statements for one outbox table, rendered.
#[derive(Debug, Clone)]
pub struct WalSql {
    slot: String,
    publication: Ident,
    prefix: String,
    create_publication: String,
    dead_rows: String,
    dead_emitted: String,
    delete_delivered: String,
    lock_writers: String,
    reinsert_pending: String,
    backfill_mark_set: String,
    backfill_mark_clear: String,
    backfill_bound: String,
    backfill_page: String,
    add_to_publication: String,
}

/// Which rows [`WalSql::backfill_page`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackfillPage {
    /// Rows with a higher id than this.
    pub after: i64,
    /// Up to this id.
    pub upto: i64,
    /// At most this many.
    pub rows: i64,
    /// Stopping once the payloads before a row reach this many bytes.
    pub bytes: i64,
}

/// What the server allows: checked before anything is created or read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prerequisites {
    /// `wal_level`.
    pub wal_level: String,
    /// Whether the role has REPLICATION (or is a superuser).
    pub may_replicate: bool,
    /// The role's name.
    pub role: String,
    /// `server_version_num`, e.g. 150004.
    pub server_version: i32,
}

impl Prerequisites {
    /// The first thing that stops log tailing, as the error naming its fix.
    pub fn check(&self) -> Result<(), crate::Error> {
        if self.wal_level != "logical" {
            return Err(crate::Error::WalLevel {
                found: self.wal_level.clone(),
            });
        }
        if !self.may_replicate {
            return Err(crate::Error::NoReplication {
                role: self.role.clone(),
            });
        }
        Ok(())
    }
}

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotState {
    /// The slot's name.
    pub slot: String,
    /// The database it decodes.
    pub database: String,
    /// Its output plugin.
    pub plugin: String,
    /// `reserved`, `extended`, `unreserved`, or `lost` once invalidated.
    pub wal_status: String,
    /// The backend streaming it, if one is.
    pub active_pid: Option<i32>,
    /// WAL bytes it keeps PostgreSQL from removing (from `restart_lsn`).
    pub retained_bytes: i64,
    /// WAL bytes written since its confirmed position.
    pub lag_bytes: i64,
    /// Its confirmed position, as PostgreSQL prints LSNs.
    pub confirmed_lsn: String,
    /// The database this was asked from.
    pub current_database: String,
}

impl SlotState {
    /// Whether PostgreSQL invalidated it.
    pub fn is_lost(&self) -> bool {
        self.wal_status == "lost"
    }
}

/// One line for people (`outbox stats`, `outbox relays`, the console):
/// `slot public_outbox, read by pid 4242, wal_status reserved: retains
/// 1.5 MiB of WAL, 0 B not confirmed, confirmed up to 0/1A2B3C8`.
impl std::fmt::Display for SlotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "slot {}, ", self.slot)?;
        match self.active_pid {
            Some(pid) => write!(f, "read by pid {pid}")?,
            None => f.write_str("read by nobody")?,
        }
        write!(
            f,
            ", wal_status {}: retains {} of WAL, {} not confirmed, confirmed up to {}",
            if self.wal_status.is_empty() {
                "-"
            } else {
                &self.wal_status
            },
            Bytes(self.retained_bytes),
            Bytes(self.lag_bytes),
            if self.confirmed_lsn.is_empty() {
                "-"
            } else {
                &self.confirmed_lsn
            },
        )
    }
}

/// A byte count in binary units, one decimal past KiB.
struct Bytes(i64);

impl std::fmt::Display for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0.unsigned_abs() < 1024 {
            return write!(f, "{} B", self.0);
        }
        // Display only: the f64 is exact well past any WAL size.
        #[allow(clippy::cast_precision_loss)]
        let mut value = self.0 as f64 / 1024.0;
        let mut unit = 0;
        while value.abs() >= 1024.0 && unit < UNITS.len() - 1 {
            value /= 1024.0;
            unit += 1;
        }
        write!(f, "{value:.1} {}", UNITS[unit])
    }
}

/// Who holds the turn to read the slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TurnHolder {
    /// The session holding the turn.
    pub pid: i32,
    /// Seconds since that session last changed state; `None` when its
    /// activity is not visible to this role.
    pub silent_secs: Option<f64>,
    /// The backend streaming the slot, if any.
    pub streaming_pid: Option<i32>,
}

/// A dead letter of an event that has no row (emitted), as its columns.
#[derive(Debug, Clone, Copy)]
pub struct EmittedDead<'a> {
    /// The events' ids.
    pub event_ids: &'a [Uuid],
    /// Their aggregate types.
    pub aggregate_types: &'a [String],
    /// Their aggregate ids.
    pub aggregate_ids: &'a [String],
    /// Their event types.
    pub event_types: &'a [String],
    /// Their payloads.
    pub payloads: &'a [Value],
    /// Their headers.
    pub headers: &'a [Value],
    /// When each was emitted.
    pub created_at: &'a [DateTime<Utc>],
    /// Attempts spent on each.
    pub attempts: &'a [i32],
    /// Each one's last error.
    pub errors: &'a [String],
    /// Each one's first failed attempt.
    pub first_failed_at: &'a [Option<DateTime<Utc>>],
    /// Each one's attempt history (a JSON array, as `attempt_log`).
    pub attempt_logs: &'a [Value],
}

/// Dead letters of rows, as parallel columns.
#[derive(Debug, Clone, Default)]
pub struct DeadRows {
    /// The rows' ids.
    pub ids: Vec<i64>,
    /// Attempts spent on each.
    pub attempts: Vec<i32>,
    /// Each one's last error.
    pub errors: Vec<String>,
    /// Each one's first failed attempt.
    pub first_failed_at: Vec<Option<DateTime<Utc>>>,
    /// Each one's attempt history (a JSON array, as `attempt_log`).
    pub attempt_logs: Vec<Value>,
}

impl WalSql {
    /// Renders the statements for `config`'s table.
    pub fn new(config: &Config) -> Result<Self, crate::Error> {
        Self::named(config, config.wal_slot()?, config.wal_publication()?)
    }

    /// Renders the statements for `config`'s table, read through the slot
    /// and publication named here: a tenant's outbox of a fleet, whose
    /// database has one of each for every tenant (see
    /// [`crate::wal::fleet_names`]).
    pub fn named(config: &Config, slot: String, publication: Ident) -> Result<Self, crate::Error> {
        let t = config.qualified();
        let render = |template: &str| template.replace("{t}", &t).replace("{p}", &publication.quoted());
        Ok(Self {
            slot,
            prefix: config.wal_prefix(),
            create_publication: render(CREATE_PUBLICATION),
            dead_rows: render(DEAD_ROWS),
            dead_emitted: render(DEAD_EMITTED),
            delete_delivered: render(DELETE_DELIVERED),
            lock_writers: render(LOCK_WRITERS),
            reinsert_pending: render(REINSERT_PENDING),
            backfill_mark_set: render(BACKFILL_MARK_SET),
            backfill_mark_clear: render(BACKFILL_MARK_CLEAR),
            backfill_bound: render(BACKFILL_BOUND),
            backfill_page: render(BACKFILL_PAGE).replace("{cols}", super::ROW_COLUMNS),
            add_to_publication: render(ADD_TO_PUBLICATION),
            publication,
        })
    }

    /// The slot's name.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// The publication's name.
    pub fn publication(&self) -> &str {
        self.publication.as_str()
    }

    /// The logical decoding message prefix of emitted events.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// What the server allows.
    pub async fn prerequisites(&self, client: &impl GenericClient) -> Result<Prerequisites, Error> {
        let row = client.query_one(PREREQUISITES, &[]).await?;
        Ok(Prerequisites {
            wal_level: row.try_get(0)?,
            may_replicate: row.try_get(1)?,
            role: row.try_get(2)?,
            server_version: row.try_get(3)?,
        })
    }

    /// Whether the publication exists in this database.
    pub async fn publication_exists(&self, client: &impl GenericClient) -> Result<bool, Error> {
        client
            .query_one(PUBLICATION_EXISTS, &[&self.publication.as_str()])
            .await?
            .try_get(0)
    }

    /// Creates the publication (inserts only).
    pub async fn create_publication(&self, client: &impl GenericClient) -> Result<(), Error> {
        client.batch_execute(&self.create_publication).await
    }

    /// Creates a fleet's publication, publishing no table yet.
    pub async fn create_fleet_publication(&self, client: &impl GenericClient) -> Result<(), Error> {
        client
            .batch_execute(&CREATE_FLEET_PUBLICATION.replace("{p}", &self.publication.quoted()))
            .await
    }

    /// Adds this table to the publication (after [`WalSql::lock_writers`],
    /// in its transaction).
    pub async fn add_to_publication(&self, tx: &impl GenericClient) -> Result<(), Error> {
        tx.batch_execute(&self.add_to_publication).await
    }

    /// The tables the publication publishes, as `schema.table`.
    pub async fn published_tables(&self, client: &impl GenericClient) -> Result<Vec<String>, Error> {
        let rows = client
            .query(PUBLISHED_TABLES, &[&self.publication.as_str()])
            .await?;
        rows.iter().map(|r| r.try_get(0)).collect()
    }

    /// The slot, if it exists. Typed, so one round trip that leaves nothing
    /// on the session (`outbox stats` runs it, also through a
    /// transaction-mode pooler).
    pub async fn slot_state(&self, client: &impl GenericClient) -> Result<Option<SlotState>, Error> {
        let Some(row) = client.query_typed_opt(SLOT, &[(&self.slot, Type::NAME)]).await? else {
            return Ok(None);
        };
        Ok(Some(SlotState {
            slot: self.slot.clone(),
            database: row.try_get(0)?,
            plugin: row.try_get(1)?,
            wal_status: row.try_get(2)?,
            active_pid: row.try_get(3)?,
            retained_bytes: row.try_get(4)?,
            lag_bytes: row.try_get(5)?,
            confirmed_lsn: row.try_get(6)?,
            current_database: row.try_get(7)?,
        }))
    }

    /// Creates the slot; returns its start position. Waits for the
    /// transactions running now to end.
    pub async fn create_slot(&self, client: &impl GenericClient) -> Result<String, Error> {
        client.query_one(CREATE_SLOT, &[&self.slot]).await?.try_get(0)
    }

    /// Drops the slot (nobody may be streaming it).
    pub async fn drop_slot(&self, client: &impl GenericClient) -> Result<(), Error> {
        client.execute(DROP_SLOT, &[&self.slot]).await.map(drop)
    }

    /// Records dead letters of rows; returns the ids it found (see
    /// `DELETE_DELIVERED` for why one may not be found yet).
    pub async fn dead_rows(&self, client: &impl GenericClient, d: &DeadRows) -> Result<Vec<i64>, Error> {
        let rows = client
            .query_typed(
                &self.dead_rows,
                &[
                    (&d.ids, Type::INT8_ARRAY),
                    (&d.attempts, Type::INT4_ARRAY),
                    (&d.errors, Type::TEXT_ARRAY),
                    (&d.first_failed_at, Type::TIMESTAMPTZ_ARRAY),
                    (&d.attempt_logs, Type::JSONB_ARRAY),
                ],
            )
            .await?;
        rows.iter().map(|r| r.try_get(0)).collect()
    }

    /// Records dead letters of emitted events as rows.
    pub async fn dead_emitted(&self, client: &impl GenericClient, d: &EmittedDead<'_>) -> Result<u64, Error> {
        client
            .execute_typed(
                &self.dead_emitted,
                &[
                    (&d.event_ids, Type::UUID_ARRAY),
                    (&d.aggregate_types, Type::TEXT_ARRAY),
                    (&d.aggregate_ids, Type::TEXT_ARRAY),
                    (&d.event_types, Type::TEXT_ARRAY),
                    (&d.payloads, Type::JSONB_ARRAY),
                    (&d.headers, Type::JSONB_ARRAY),
                    (&d.created_at, Type::TIMESTAMPTZ_ARRAY),
                    (&d.attempts, Type::INT4_ARRAY),
                    (&d.errors, Type::TEXT_ARRAY),
                    (&d.first_failed_at, Type::TIMESTAMPTZ_ARRAY),
                    (&d.attempt_logs, Type::JSONB_ARRAY),
                ],
            )
            .await
    }

    /// Deletes delivered rows by id; returns the ids it found.
    pub async fn delete_delivered(
        &self,
        client: &impl GenericClient,
        ids: &[i64],
    ) -> Result<Vec<i64>, Error> {
        let rows = client
            .query_typed(&self.delete_delivered, &[(&ids, Type::INT8_ARRAY)])
            .await?;
        rows.iter().map(|r| r.try_get(0)).collect()
    }

    /// The mark a partition drop left on `partition` (qualified), if any.
    pub async fn partition_mark(
        &self,
        client: &impl GenericClient,
        partition: &str,
    ) -> Result<Option<PartitionMark>, Error> {
        let comment: Option<String> = client
            .query_one(PARTITION_COMMENT, &[&partition])
            .await?
            .try_get(0)?;
        Ok(comment.as_deref().and_then(PartitionMark::parse))
    }

    /// `partition`'s highest id and the current position, now.
    pub async fn mark_now(
        &self,
        client: &impl GenericClient,
        partition: &str,
    ) -> Result<PartitionMark, Error> {
        let row = client
            .query_one(&MARK_NOW.replace("{partition}", partition), &[])
            .await?;
        Ok(PartitionMark {
            max_id: row.try_get(0)?,
            lsn: row.try_get(1)?,
        })
    }

    /// Leaves `mark` on `partition` (its comment).
    pub async fn set_partition_mark(
        &self,
        client: &impl GenericClient,
        partition: &str,
        mark: &PartitionMark,
    ) -> Result<(), Error> {
        // COMMENT takes no parameters; the text is an LSN and a number.
        debug_assert!(is_lsn(&mark.lsn));
        client
            .batch_execute(&format!("COMMENT ON TABLE {partition} IS '{}'", mark.render()))
            .await
    }

    /// Whether the slot is healthy and confirmed `lsn`.
    pub async fn confirmed_past(&self, client: &impl GenericClient, lsn: &str) -> Result<bool, Error> {
        client
            .query_one(CONFIRMED_PAST, &[&self.slot, &lsn])
            .await?
            .try_get(0)
    }

    /// Tries to take the turn to read the slot, for this session's lifetime.
    pub async fn try_turn(&self, client: &impl GenericClient) -> Result<bool, Error> {
        client.query_one(TURN_TRY, &[&self.slot]).await?.try_get(0)
    }

    /// Who holds the turn, if anybody.
    pub async fn turn_holder(&self, client: &impl GenericClient) -> Result<Option<TurnHolder>, Error> {
        let Some(row) = client.query_opt(TURN_HOLDER, &[&self.slot]).await? else {
            return Ok(None);
        };
        Ok(Some(TurnHolder {
            pid: row.try_get(0)?,
            silent_secs: row.try_get(1)?,
            streaming_pid: row.try_get(2)?,
        }))
    }

    /// Writes the drain marker with `prefix`.
    pub async fn drain_marker(&self, client: &impl GenericClient, prefix: &str) -> Result<(), Error> {
        client.query_one(DRAIN_MARKER, &[&prefix]).await.map(drop)
    }

    /// One heartbeat of the turn's holder.
    pub async fn heartbeat(&self, client: &impl GenericClient) -> Result<(), Error> {
        client.batch_execute(HEARTBEAT).await
    }

    /// Terminates a backend; false if it was gone or not ours to signal.
    pub async fn terminate(&self, client: &impl GenericClient, pid: i32) -> Result<bool, Error> {
        client.query_one(TERMINATE, &[&pid]).await?.try_get(0)
    }

    /// In the recovery's transaction: blocks writers until it commits.
    pub async fn lock_writers(&self, tx: &impl GenericClient) -> Result<(), Error> {
        tx.batch_execute(&self.lock_writers).await
    }

    /// Deletes and re-inserts every undelivered row (created at or after
    /// `since`, if given) so a new slot decodes them; returns how many.
    pub async fn reinsert_pending(
        &self,
        tx: &impl GenericClient,
        since: Option<DateTime<Utc>>,
    ) -> Result<i64, Error> {
        tx.query_one(&self.reinsert_pending, &[&since]).await?.try_get(0)
    }
}

impl WalSql {
    /// Whether the server is a standby (in recovery).
    pub async fn in_recovery(&self, client: &impl GenericClient) -> Result<bool, Error> {
        client.query_one(IN_RECOVERY, &[]).await?.try_get(0)
    }

    /// Whether a backfill is owed (the publication carries the mark);
    /// false without the publication.
    pub async fn backfill_owed(&self, client: &impl GenericClient) -> Result<bool, Error> {
        let row = client
            .query_opt(BACKFILL_OWED, &[&self.publication.as_str(), &BACKFILL_MARK])
            .await?;
        row.map_or(Ok(false), |r| r.try_get(0))
    }

    /// Marks a backfill owed; needs the publication's owner (or a
    /// superuser).
    pub async fn mark_backfill(&self, client: &impl GenericClient) -> Result<(), Error> {
        client.batch_execute(&self.backfill_mark_set).await
    }

    /// The backfill owed is done.
    pub async fn clear_backfill(&self, client: &impl GenericClient) -> Result<(), Error> {
        client.batch_execute(&self.backfill_mark_clear).await
    }

    /// The highest id now (0 when empty).
    pub async fn backfill_bound(&self, client: &impl GenericClient) -> Result<i64, Error> {
        client.query_one(&self.backfill_bound, &[]).await?.try_get(0)
    }

    /// The next page of a backfill: rows in id order with their payloads'
    /// sizes as text.
    pub async fn backfill_page(
        &self,
        client: &impl GenericClient,
        page: &BackfillPage,
    ) -> Result<Vec<(crate::OutboxRow, i64)>, Error> {
        let rows = client
            .query_typed(
                &self.backfill_page,
                &[
                    (&page.after, Type::INT8),
                    (&page.upto, Type::INT8),
                    (&page.rows, Type::INT8),
                    (&page.bytes, Type::INT8),
                ],
            )
            .await?;
        rows.iter()
            .map(|r| Ok((crate::OutboxRow::try_from(r)?, r.try_get("bytes")?)))
            .collect()
    }

    /// The WAL insert position, as PostgreSQL prints it.
    pub async fn insert_position(&self, client: &impl GenericClient) -> Result<String, Error> {
        client.query_one(INSERT_POSITION, &[]).await?.try_get(0)
    }
}

/// Emits one event with `prefix` in the caller's transaction.
pub(crate) async fn emit(client: &impl GenericClient, prefix: &str, e: &crate::Event) -> Result<(), Error> {
    let headers = Value::Object(e.headers.clone());
    let mut params = crate::writer::event_params(e, &headers).to_vec();
    params.push((&prefix, Type::TEXT));
    client.execute_typed(EMIT, &params).await.map(drop)
}

/// Emits events in order with `prefix` in the caller's transaction, in one
/// round trip.
pub(crate) async fn emit_all(
    client: &impl GenericClient,
    prefix: &str,
    c: &crate::writer::Columns,
) -> Result<(), Error> {
    let mut params = c.params().to_vec();
    params.push((&prefix, Type::TEXT));
    client.execute_typed(EMIT_ALL, &params).await.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_mark_reads_back_and_refuses_anything_else() {
        let mark = PartitionMark {
            lsn: "0/1A2B3C8".to_owned(),
            max_id: Some(42),
        };
        assert_eq!(PartitionMark::parse(&mark.render()), Some(mark));
        let empty = PartitionMark {
            lsn: "1/0".to_owned(),
            max_id: None,
        };
        assert_eq!(PartitionMark::parse(&empty.render()), Some(empty));
        for bad in [
            "",
            "outbox wal mark 0/1'; DROP 42",
            "outbox wal mark x/1 1",
            "a comment",
        ] {
            assert_eq!(PartitionMark::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn names_follow_the_table_and_statements_are_rendered() {
        let config = Config::new("app", "events").unwrap();
        let sql = WalSql::new(&config).unwrap();
        assert_eq!(sql.slot(), "app_events");
        assert_eq!(sql.publication(), "app_events");
        assert_eq!(sql.prefix(), "outbox:app.events");
        for s in [
            &sql.create_publication,
            &sql.dead_rows,
            &sql.reinsert_pending,
            &sql.backfill_bound,
            &sql.backfill_page,
        ] {
            assert!(s.contains("\"app\".\"events\""), "{s}");
            assert!(!s.contains("{t}") && !s.contains("{p}"), "{s}");
        }
        assert!(!sql.backfill_page.contains("{cols}"));
        for s in [&sql.backfill_mark_set, &sql.backfill_mark_clear] {
            assert!(s.starts_with("COMMENT ON PUBLICATION \"app_events\" IS"), "{s}");
        }
        assert!(
            sql.backfill_mark_set.contains(BACKFILL_MARK),
            "what is set is what is read"
        );
        assert!(sql.create_publication.contains("PUBLICATION \"app_events\""));
        let long = Config::new(
            "a_rather_long_schema_name_here",
            "and_a_rather_long_table_name_too_yes",
        )
        .unwrap();
        assert!(
            WalSql::new(&long).is_err(),
            "a slot name over 63 bytes is refused"
        );
    }

    #[test]
    fn a_slot_reads_as_one_line() {
        let mut state = SlotState {
            slot: "public_outbox".to_owned(),
            database: "app".to_owned(),
            plugin: "pgoutput".to_owned(),
            wal_status: "reserved".to_owned(),
            active_pid: Some(4242),
            retained_bytes: 1_572_864,
            lag_bytes: 0,
            confirmed_lsn: "0/1A2B3C8".to_owned(),
            current_database: "app".to_owned(),
        };
        assert_eq!(
            state.to_string(),
            "slot public_outbox, read by pid 4242, wal_status reserved: retains 1.5 MiB of WAL, \
             0 B not confirmed, confirmed up to 0/1A2B3C8"
        );
        state.active_pid = None;
        state.retained_bytes = 3 << 30;
        state.lag_bytes = 1023;
        assert!(state.to_string().contains("read by nobody"), "{state}");
        assert!(
            state
                .to_string()
                .contains("retains 3.0 GiB of WAL, 1023 B not confirmed"),
            "{state}"
        );
    }
}
