//! Replay's statements with typed parameters and rows (`outbox replay`):
//! counting what a filter matches, reading published rows a page at a time
//! in id order, the job table `<table>_replays` (create, save the cursor,
//! list, one job's lock), and the trace retention leaves in
//! `<table>_removed` so a replay can say how many matching events were no
//! longer there.
//!
//! Replay never changes an outbox row: every statement here reads the
//! outbox, none claims, locks or marks a row, and each page is its own
//! short statement, so a replay holds no transaction across a delivery
//! (nothing for VACUUM to wait on, nothing a relay would skip). Dead
//! letters and unpublished rows are never read (`published_at IS NOT
//! NULL`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Error, GenericClient, Row};
use uuid::Uuid;

use super::TRACE_REMOVED;
use crate::{Config, OutboxRow};

type Param<'p> = &'p (dyn ToSql + Sync);

/// The rows a replay re-delivers: published (so never a dead letter nor a
/// row waiting for delivery), and each filter given. `$1` aggregate type,
/// `$2` aggregate id, `$3` event type, `$4`/`$5` created at or after /
/// before, `$6` aggregate types left out; each NULL when not given.
const FILTER: &str = "published_at IS NOT NULL \
        AND ($1::text IS NULL OR aggregate_type = $1::text) \
        AND ($2::text IS NULL OR aggregate_id = $2::text) \
        AND ($3::text IS NULL OR event_type = $3::text) \
        AND ($4::timestamptz IS NULL OR created_at >= $4::timestamptz) \
        AND ($5::timestamptz IS NULL OR created_at < $5::timestamptz) \
        AND ($6::text[] IS NULL OR aggregate_type <> ALL($6::text[]))";

/// `$1..$6` the filter. The highest id now (the bound of a new job: later
/// events are the live relay's) and how many rows up to it match. The
/// count reads every row up to the bound (no index covers published rows);
/// one statement, once per job.
const COUNT_MATCHING: &str = "WITH upto AS (SELECT coalesce(max(id), 0) AS id FROM {t}) \
     SELECT upto.id, (SELECT count(*) FROM {t} WHERE id <= upto.id AND {filter}) FROM upto";

/// `$1..$6` the filter, `$7` the cursor (exclusive), `$8` the end of the
/// window (inclusive), `$9` page size. Matching rows in id order through
/// the primary key. The window bounds how far one statement walks when
/// the filter matches few rows, so every page is short however selective
/// the filter is.
const PAGE: &str = "SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts \
       FROM {t} WHERE id > $7::int8 AND id <= $8::int8 AND {filter} ORDER BY id LIMIT $9::int8";

/// Whether the outbox holds any published row, through the primary key
/// (stops at the first one): with log tailing none is ever marked
/// published.
const ANY_PUBLISHED: &str = "SELECT EXISTS (SELECT 1 FROM {t} WHERE published_at IS NOT NULL)";

/// The job's columns, in the order [`ReplayJob`] reads them.
const JOB_COLUMNS: &str = "id, target, format, aggregate_type, aggregate_id, event_type, since, until, exclude_types, \
     rate, upto_id, cursor_id, matched, sent, removed, removed_exact, state, last_error, created_at, updated_at, \
     finished_at";

/// `$1` target, `$2` format, `$3..$8` the filter, `$9` rate, `$10` upto,
/// `$11` matched, `$12` removed, `$13` whether that count is exact. A new
/// job, running.
const CREATE_JOB: &str = "INSERT INTO {replays} (target, format, aggregate_type, aggregate_id, event_type, since, until, \
            exclude_types, rate, upto_id, matched, removed, removed_exact) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) RETURNING {job}";

/// `$1` job id, `$2` cursor, `$3` sent, `$4` state, `$5` last error. One
/// UPDATE per acknowledged page, and one when the job stops, ends or fails.
const SAVE_JOB: &str = "UPDATE {replays} SET cursor_id = $2, sent = $3, state = $4, last_error = $5, \
            updated_at = clock_timestamp(), \
            finished_at = CASE WHEN $4 IN ('done', 'failed') THEN clock_timestamp() END \
      WHERE id = $1";

/// The advisory lock key of one job: held by the process running it, for
/// as long as its session lives, so a resume cannot run a job twice and
/// `--list` can tell a running job from one whose process died.
const JOB_KEY: &str = "hashtextextended('outbox replay ' || {replays_text} || ' ' || $1::int8, 0)";

/// `$1` job id. Takes the job's lock (see `JOB_KEY`); false if another
/// session holds it.
const LOCK_JOB: &str = "SELECT pg_try_advisory_lock({key})";

/// `$1` job id, or NULL for every job. Jobs, newest first, each with
/// whether a session holds its lock (`JOB_KEY`, a bigint key: its halves
/// are `classid` and `objid` in `pg_locks`).
const LIST_JOBS: &str = "SELECT {job_j}, EXISTS (SELECT 1 FROM pg_locks AS l \
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
              AND l.classid = ((k.key >> 32) & 4294967295)::oid AND l.objid = (k.key & 4294967295)::oid) \
       FROM {replays} AS j CROSS JOIN LATERAL (SELECT {key_j} AS key) AS k \
      WHERE $1::int8 IS NULL OR j.id = $1::int8 ORDER BY j.id DESC";

/// `$1..$6` the filter (`$2`, the aggregate id, only decides exactness:
/// the trace has no aggregate ids). Matching
/// published rows retention removed, from the buckets of their aggregate
/// type, event type and hour, and whether that count is exact: a bucket
/// only partly inside `since`/`until` is counted whole.
const REMOVED: &str = "SELECT coalesce(sum(removed), 0)::int8, \
            $2::text IS NULL AND coalesce(bool_and(($4::timestamptz IS NULL OR hour >= $4::timestamptz) \
                AND ($5::timestamptz IS NULL OR hour + interval '1 hour' <= $5::timestamptz)), true) \
       FROM {removed} \
      WHERE ($1::text IS NULL OR aggregate_type = $1::text) \
        AND ($3::text IS NULL OR event_type = $3::text) \
        AND ($4::timestamptz IS NULL OR hour + interval '1 hour' > $4::timestamptz) \
        AND ($5::timestamptz IS NULL OR hour < $5::timestamptz) \
        AND ($6::text[] IS NULL OR aggregate_type <> ALL($6::text[]))";

/// A daily partition about to be dropped (`{partition}`, qualified):
/// its published rows into the trace, in the drop's transaction.
const TRACE_DROPPED: &str = "WITH gone AS (SELECT id, aggregate_type, event_type, created_at FROM {partition} \
        WHERE published_at IS NOT NULL) {trace}";

/// Which published rows a replay re-delivers. Every filter set narrows;
/// none set means every published row.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReplayFilter {
    /// Only this aggregate type.
    pub aggregate_type: Option<String>,
    /// Only this aggregate.
    pub aggregate_id: Option<String>,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only events created at or after this instant.
    pub since: Option<DateTime<Utc>>,
    /// Only events created before this instant.
    pub until: Option<DateTime<Utc>>,
    /// Not these aggregate types.
    pub exclude_types: Option<Vec<String>>,
}

impl ReplayFilter {
    fn params(&self) -> [Param<'_>; 6] {
        [
            &self.aggregate_type,
            &self.aggregate_id,
            &self.event_type,
            &self.since,
            &self.until,
            &self.exclude_types,
        ]
    }
}

/// One page of a replay.
#[derive(Debug, Clone, Copy)]
pub struct PageParams<'a> {
    /// Which rows.
    pub filter: &'a ReplayFilter,
    /// Rows with an id above this.
    pub after_id: i64,
    /// Rows with an id at most this (the end of the window walked).
    pub through_id: i64,
    /// At most this many rows.
    pub limit: i64,
}

/// A new replay job.
#[derive(Debug, Clone, Copy)]
pub struct NewReplay<'a> {
    /// Where it sends: a sink URL with its password and every query value
    /// masked (`outbox_relay::redact::url`), or `route:<name>`.
    pub target: &'a str,
    /// The envelope (`native`, `cloudevents`, `debezium`).
    pub format: &'a str,
    /// Which rows.
    pub filter: &'a ReplayFilter,
    /// Events per second.
    pub rate: f64,
    /// The highest id it replays.
    pub upto_id: i64,
    /// Rows matching when it was created.
    pub matched: i64,
    /// Matching rows retention had removed.
    pub removed: Removed,
}

/// How a job stands, saved after each acknowledged page.
#[derive(Debug, Clone, Copy)]
pub struct SaveReplay<'a> {
    /// The job.
    pub id: i64,
    /// Every matching row up to this id was acknowledged.
    pub cursor_id: i64,
    /// Events the sink acknowledged, over every run of the job.
    pub sent: i64,
    /// Its state.
    pub state: ReplayState,
    /// Why it stopped or failed.
    pub last_error: Option<&'a str>,
}

/// Where a replay job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplayState {
    /// A process is sending, or was when it died (see [`ReplayJob::live`]).
    Running,
    /// Stopped by SIGINT/SIGTERM; resumable.
    Stopped,
    /// Every matching row up to its bound was acknowledged.
    Done,
    /// The sink refused an event, or it could not go on; resumable once the
    /// cause is fixed.
    Failed,
}

impl ReplayState {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Done => "done",
            Self::Failed => "failed",
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "stopped" => Self::Stopped,
            "done" => Self::Done,
            "failed" => Self::Failed,
            // The table's CHECK allows nothing else.
            _ => Self::Running,
        }
    }
}

/// Matching published rows retention removed (see `<table>_removed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Removed {
    /// How many.
    pub count: i64,
    /// Whether `count` is exact; otherwise it is an upper bound (an
    /// `aggregate_id` filter, or `since`/`until` inside an hour).
    pub exact: bool,
}

/// A replay job as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayJob {
    /// Its id (`--resume ID`).
    pub id: i64,
    /// Its target: a sink URL, password and query values masked, or
    /// `route:<name>`.
    pub target: String,
    /// Its envelope.
    pub format: String,
    /// Which rows.
    pub filter: ReplayFilter,
    /// Events per second.
    pub rate: f64,
    /// The highest id it replays.
    pub upto_id: i64,
    /// Every matching row up to this id was acknowledged.
    pub cursor_id: i64,
    /// Rows matching when it was created.
    pub matched: i64,
    /// Events acknowledged, over every run.
    pub sent: i64,
    /// Matching rows retention had removed when it was created.
    pub removed: Removed,
    /// Its state.
    pub state: ReplayState,
    /// Why it stopped or failed.
    pub last_error: Option<String>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When its row last changed.
    pub updated_at: DateTime<Utc>,
    /// When it was done or failed.
    pub finished_at: Option<DateTime<Utc>>,
    /// Whether a session holds its lock: a process is running it now
    /// (`--list` only; false when just created).
    pub live: bool,
}

impl ReplayJob {
    fn from_row(r: &Row) -> Result<Self, Error> {
        Ok(Self {
            id: r.try_get(0)?,
            target: r.try_get(1)?,
            format: r.try_get(2)?,
            filter: ReplayFilter {
                aggregate_type: r.try_get(3)?,
                aggregate_id: r.try_get(4)?,
                event_type: r.try_get(5)?,
                since: r.try_get(6)?,
                until: r.try_get(7)?,
                exclude_types: r.try_get(8)?,
            },
            rate: r.try_get(9)?,
            upto_id: r.try_get(10)?,
            cursor_id: r.try_get(11)?,
            matched: r.try_get(12)?,
            sent: r.try_get(13)?,
            removed: Removed {
                count: r.try_get(14)?,
                exact: r.try_get(15)?,
            },
            state: ReplayState::parse(r.try_get(16)?),
            last_error: r.try_get(17)?,
            created_at: r.try_get(18)?,
            updated_at: r.try_get(19)?,
            finished_at: r.try_get(20)?,
            live: r.len() > 21 && r.try_get(21)?,
        })
    }
}

/// Replay's statements for one outbox table, rendered.
#[derive(Debug, Clone)]
pub struct ReplaySql {
    count_matching: String,
    page: String,
    any_published: String,
    create_job: String,
    save_job: String,
    lock_job: String,
    list_jobs: String,
    removed: String,
    trace_dropped: String,
}

impl ReplaySql {
    /// Renders the statements for `config`'s table.
    pub fn new(config: &Config) -> Result<Self, crate::Error> {
        let t = config.qualified();
        let replays = config.companion("_replays")?;
        let removed = config.companion("_removed")?;
        // The lock key names the table as text, so two outboxes' job 1
        // differ; a quote cannot occur in validated names.
        let key = JOB_KEY.replace("{replays_text}", &format!("'{replays}'"));
        let render = |template: &str| {
            template
                .replace("{filter}", FILTER)
                .replace(
                    "{job_j}",
                    &JOB_COLUMNS
                        .split(", ")
                        .map(|c| format!("j.{c}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                )
                .replace("{job}", JOB_COLUMNS)
                .replace("{key_j}", &key.replace("$1::int8", "j.id"))
                .replace("{key}", &key)
                .replace("{trace}", TRACE_REMOVED)
                .replace("{replays}", &replays)
                .replace("{removed}", &removed)
                .replace("{t}", &t)
        };
        Ok(Self {
            count_matching: render(COUNT_MATCHING),
            page: render(PAGE),
            any_published: render(ANY_PUBLISHED),
            create_job: render(CREATE_JOB),
            save_job: render(SAVE_JOB),
            lock_job: render(LOCK_JOB),
            list_jobs: render(LIST_JOBS),
            removed: render(REMOVED),
            trace_dropped: render(TRACE_DROPPED),
        })
    }

    /// The highest id now, and how many rows up to it `filter` matches.
    pub async fn count_matching(
        &self,
        client: &impl GenericClient,
        filter: &ReplayFilter,
    ) -> Result<(i64, i64), Error> {
        let row = client.query_one(&self.count_matching, &filter.params()).await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }

    /// Matching published rows retention removed (since migration 0006:
    /// earlier removals left no trace).
    pub async fn removed(
        &self,
        client: &impl GenericClient,
        filter: &ReplayFilter,
    ) -> Result<Removed, Error> {
        let row = client.query_one(&self.removed, &filter.params()).await?;
        Ok(Removed {
            count: row.try_get(0)?,
            exact: row.try_get(1)?,
        })
    }

    /// One page of matching rows, in id order.
    pub async fn page(
        &self,
        client: &impl GenericClient,
        p: &PageParams<'_>,
    ) -> Result<Vec<OutboxRow>, Error> {
        let f = p.filter.params();
        let rows = client
            .query(
                &self.page,
                &[
                    f[0],
                    f[1],
                    f[2],
                    f[3],
                    f[4],
                    f[5],
                    &p.after_id,
                    &p.through_id,
                    &p.limit,
                ],
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok(OutboxRow {
                    id: r.try_get(0)?,
                    event_id: r.try_get::<_, Uuid>(1)?,
                    aggregate_type: r.try_get(2)?,
                    aggregate_id: r.try_get(3)?,
                    event_type: r.try_get(4)?,
                    payload: r.try_get(5)?,
                    headers: r.try_get(6)?,
                    created_at: r.try_get(7)?,
                    attempts: r.try_get(8)?,
                    first_failed_at: None,
                })
            })
            .collect()
    }

    /// Whether the outbox holds any published row.
    pub async fn any_published(&self, client: &impl GenericClient) -> Result<bool, Error> {
        client.query_one(&self.any_published, &[]).await?.try_get(0)
    }

    /// Creates a job, running.
    pub async fn create_job(
        &self,
        client: &impl GenericClient,
        job: &NewReplay<'_>,
    ) -> Result<ReplayJob, Error> {
        let f = job.filter;
        let row = client
            .query_one(
                &self.create_job,
                &[
                    &job.target,
                    &job.format,
                    &f.aggregate_type,
                    &f.aggregate_id,
                    &f.event_type,
                    &f.since,
                    &f.until,
                    &f.exclude_types,
                    &job.rate,
                    &job.upto_id,
                    &job.matched,
                    &job.removed.count,
                    &job.removed.exact,
                ],
            )
            .await?;
        ReplayJob::from_row(&row)
    }

    /// Saves a job's cursor, count and state; false if there is no such job.
    pub async fn save_job(&self, client: &impl GenericClient, s: &SaveReplay<'_>) -> Result<bool, Error> {
        let n = client
            .execute(
                &self.save_job,
                &[&s.id, &s.cursor_id, &s.sent, &s.state.as_str(), &s.last_error],
            )
            .await?;
        Ok(n == 1)
    }

    /// Takes job `id`'s lock for this session (until it ends); false if
    /// another session holds it.
    pub async fn lock_job(&self, client: &impl GenericClient, id: i64) -> Result<bool, Error> {
        client.query_one(&self.lock_job, &[&id]).await?.try_get(0)
    }

    /// Every job, newest first.
    pub async fn jobs(&self, client: &impl GenericClient) -> Result<Vec<ReplayJob>, Error> {
        let rows = client.query(&self.list_jobs, &[&None::<i64>]).await?;
        rows.iter().map(ReplayJob::from_row).collect()
    }

    /// Job `id`, if it exists.
    pub async fn job(&self, client: &impl GenericClient, id: i64) -> Result<Option<ReplayJob>, Error> {
        let rows = client.query(&self.list_jobs, &[&Some(id)]).await?;
        rows.first().map(ReplayJob::from_row).transpose()
    }

    /// In a partition drop's transaction: `partition`'s (qualified)
    /// published rows go into the trace of what retention removed.
    pub async fn trace_dropped(&self, client: &impl GenericClient, partition: &str) -> Result<u64, Error> {
        client
            .execute(&self.trace_dropped.replace("{partition}", partition), &[])
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_quoted_names_and_no_placeholders() {
        let sql = ReplaySql::new(&Config::new("app", "events").unwrap()).unwrap();
        for s in [
            &sql.count_matching,
            &sql.page,
            &sql.any_published,
            &sql.create_job,
            &sql.save_job,
            &sql.lock_job,
            &sql.list_jobs,
            &sql.removed,
        ] {
            assert!(!s.contains('{'), "{s}");
        }
        assert!(sql.page.contains("\"app\".\"events\""));
        assert!(sql.create_job.contains("\"app\".\"events_replays\""));
        assert!(
            sql.list_jobs
                .contains("hashtextextended('outbox replay ' || '\"app\".\"events_replays\"' || ' ' || j.id")
        );
        assert!(sql.lock_job.contains("|| $1::int8, 0)"));
        assert!(sql.trace_dropped.contains("\"app\".\"events_removed\""));
        assert_eq!(sql.trace_dropped.matches('{').count(), 1, "{}", sql.trace_dropped);
    }
}
