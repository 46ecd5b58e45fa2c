//! Browsing an outbox's events (the console's `/events` and `/aggregate`):
//! events by state and filters, newest first, and one aggregate's history,
//! oldest first, each with where it stands. Both are paged by keyset on
//! `id`, never by OFFSET, and read only: nothing here locks or changes a
//! row, and none of it is on the relay's path.
//!
//! The invariant: every statement walks an index in id order and stops.
//! The filters map to a fixed set of statements, one per index (an
//! [`EventWalk`]) and direction: the walk's own predicate matches its
//! partial index, so the planner cannot leave it, and every other filter
//! is a `($n IS NULL OR …)` guard applied *above* a walk bounded by `LIMIT`
//! (a limit blocks the guards from being pushed into the walk, where a
//! selective guard would make a sort of the whole table look cheaper). A
//! page therefore reads at most [`EVENTS_SCAN`] index entries, however
//! few rows the filters match; when the bound stops it first, the page
//! says where to go on from (its `next` or `prev`).
//!
//! One aggregate id is walked one row per step (`STEP`, an `ORDER BY id
//! LIMIT 1` descent of `<table>_by_aggregate_idx`): estimated at a few
//! rows, a plain walk of it is planned as a bitmap scan and a sort of the
//! whole aggregate.
//!
//! A state is one expression (`STATE`), the same the relay's columns
//! mean: delivered (`published_at`), given up (`given_up_at`, a dead
//! letter someone gave up on), dead (`dead_at`), retrying (unpublished
//! after a spent attempt: `attempts > 0`), else waiting. An answer that
//! spends no attempt (an unavailable sink, a row held back) leaves a row
//! waiting, with its `last_error` and a later `next_attempt_at`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::{Error, GenericClient, Row};
use uuid::Uuid;

use super::typed::{Typed, typed};
use crate::Config;

/// Index entries one `/events` page reads at most: a filter matching one
/// row in 200 still fills a page of 50, one matching fewer shows what it
/// found and where to go on from.
pub const EVENTS_SCAN: i64 = 10_000;

/// The characters of `last_error` a listed event carries.
pub const ERROR_START: i32 = 200;

/// Where an event stands: one name for each of the row's states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EventState {
    /// Not published, no failed attempt yet (`attempts = 0`): due, or
    /// waiting out an unavailable sink, a deadline claim or its aggregate.
    Waiting,
    /// Not published, after a failed attempt: due again at
    /// `next_attempt_at`.
    Retrying,
    /// Published by a relay.
    Delivered,
    /// A dead letter nobody gave up on: waits for a requeue.
    Dead,
    /// A dead letter someone gave up on, kept for the record.
    GivenUp,
}

impl EventState {
    /// Every state, in the order a row passes through them.
    pub const ALL: [EventState; 5] = [
        EventState::Waiting,
        EventState::Retrying,
        EventState::Delivered,
        EventState::Dead,
        EventState::GivenUp,
    ];

    /// `waiting`, `retrying`, `delivered`, `dead`, `given_up`: the name in
    /// URLs, JSON and the statements.
    pub fn as_str(self) -> &'static str {
        match self {
            EventState::Waiting => "waiting",
            EventState::Retrying => "retrying",
            EventState::Delivered => "delivered",
            EventState::Dead => "dead",
            EventState::GivenUp => "given_up",
        }
    }
}

impl std::fmt::Display for EventState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state name that is none of [`EventState::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown state {0:?}: one of waiting, retrying, delivered, dead, given_up")]
#[non_exhaustive]
pub struct UnknownState(pub String);

impl std::str::FromStr for EventState {
    type Err = UnknownState;

    /// ```
    /// use outbox::sql::EventState;
    /// assert_eq!("given_up".parse::<EventState>(), Ok(EventState::GivenUp));
    /// assert!("nope".parse::<EventState>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// Which events a list shows. Every filter set narrows; none set means all.
#[derive(Debug, Clone, Copy, Default)]
pub struct EventFilter<'a> {
    /// Only events in this state.
    pub state: Option<EventState>,
    /// Only this aggregate type.
    pub aggregate_type: Option<&'a str>,
    /// Only this event type.
    pub event_type: Option<&'a str>,
    /// Only this aggregate id (of any type unless `aggregate_type` is set).
    pub aggregate_id: Option<&'a str>,
    /// Only events created at or after this instant.
    pub created_from: Option<DateTime<Utc>>,
    /// Only events created before this instant.
    pub created_before: Option<DateTime<Utc>>,
    /// Only events whose last error contains this text (case-sensitive).
    pub error_contains: Option<&'a str>,
}

/// The index a list walks, from its filters: the one whose predicate is
/// the state's, or the aggregate's when an aggregate id is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventWalk {
    /// `<table>_unpublished_idx`: waiting and retrying events.
    Unpublished,
    /// `<table>_dead_idx`: dead letters, given up or not.
    Dead,
    /// The primary key: delivered events, or any.
    Table,
    /// `<table>_by_aggregate_idx (aggregate_id, id)`: one aggregate id.
    Aggregate,
}

impl EventWalk {
    const ALL: [EventWalk; 4] = [
        EventWalk::Unpublished,
        EventWalk::Dead,
        EventWalk::Table,
        EventWalk::Aggregate,
    ];

    /// What restricts the walk to its index: each partial index's own
    /// predicate, so the planner can use no other.
    fn predicate(self) -> &'static str {
        match self {
            EventWalk::Unpublished => "published_at IS NULL AND dead_at IS NULL",
            EventWalk::Dead => "published_at IS NULL AND dead_at IS NOT NULL",
            EventWalk::Table => "true",
            // Walked by `LIST_AGGREGATE_EVENTS` instead.
            EventWalk::Aggregate => "aggregate_id = $4::text",
        }
    }
}

impl EventFilter<'_> {
    /// The index this filter's list walks.
    pub fn walk(&self) -> EventWalk {
        match (self.aggregate_id, self.state) {
            (Some(_), _) => EventWalk::Aggregate,
            (None, Some(EventState::Waiting | EventState::Retrying)) => EventWalk::Unpublished,
            (None, Some(EventState::Dead | EventState::GivenUp)) => EventWalk::Dead,
            (None, Some(EventState::Delivered) | None) => EventWalk::Table,
        }
    }
}

/// Where a page starts: the first page, or past a row of another page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Keyset {
    /// The first page: the newest events of a list, the oldest of an
    /// aggregate.
    #[default]
    Start,
    /// Events with a lower id than this one.
    Before(i64),
    /// Events with a higher id than this one.
    After(i64),
}

/// One page of [`EventsSql::list_events`].
#[derive(Debug, Clone, Copy)]
pub struct EventsQuery<'a> {
    /// Which events.
    pub filter: EventFilter<'a>,
    /// Where the page starts.
    pub keyset: Keyset,
    /// At most this many events.
    pub limit: i64,
    /// At most this many index entries read ([`EVENTS_SCAN`]).
    pub scan: i64,
}

/// One event as a list shows it: no payload, the start of its last error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventRow {
    /// Row id.
    pub id: i64,
    /// The event's id.
    pub event_id: Uuid,
    /// Its aggregate type.
    pub aggregate_type: String,
    /// Its aggregate id.
    pub aggregate_id: String,
    /// Its event type.
    pub event_type: String,
    /// When the writer inserted it.
    pub created_at: DateTime<Utc>,
    /// Where it stands.
    pub state: EventState,
    /// Failed deliveries so far.
    pub attempts: i32,
    /// When it is due (again).
    pub next_attempt_at: DateTime<Utc>,
    /// When a relay delivered it.
    pub published_at: Option<DateTime<Utc>>,
    /// When it became a dead letter.
    pub dead_at: Option<DateTime<Utc>>,
    /// When someone gave up on it.
    pub given_up_at: Option<DateTime<Utc>>,
    /// The first [`ERROR_START`] characters of its last error.
    pub last_error: Option<String>,
}

/// A page of events, newest first ([`EventsSql::list_events`]) or an
/// aggregate's, oldest first ([`EventsSql::aggregate_events`]). `next`
/// and `prev` are the keysets of the pages on either side, None where
/// nothing is left: for a list, `next` is the `before` of the older page
/// and `prev` the `after` of the newer; for an aggregate, `next` is the
/// `after` of its later events and `prev` the `before` of its earlier.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventsPage<T> {
    /// The events, in the page's order.
    pub events: Vec<T>,
    /// The keyset of the page after this one.
    pub next: Option<i64>,
    /// The keyset of the page before this one.
    pub prev: Option<i64>,
}

/// One event of an aggregate's history, and whether it holds the rest back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AggregateEvent {
    /// The event.
    #[serde(flatten)]
    pub event: EventRow,
    /// The first event of its aggregate (type and id) that is neither
    /// published nor given up on, wherever it is in the history: under
    /// strict ordering it goes first, and holds every later one back.
    pub first_pending: Option<i64>,
    /// This event is that first one.
    pub blocker: bool,
}

/// One page of [`EventsSql::aggregate_events`].
#[derive(Debug, Clone, Copy)]
pub struct AggregateQuery<'a> {
    /// The aggregate id.
    pub aggregate_id: &'a str,
    /// Only this aggregate type (else every type with this id).
    pub aggregate_type: Option<&'a str>,
    /// Where the page starts.
    pub keyset: Keyset,
    /// At most this many events.
    pub limit: i64,
}

/// The name of where a row stands: `EventState`'s, decided in the order the
/// columns override each other (a published row is delivered whatever else
/// it has kept; a given-up row is still a dead letter).
const STATE: &str = "CASE WHEN published_at IS NOT NULL THEN 'delivered' \
          WHEN given_up_at IS NOT NULL THEN 'given_up' WHEN dead_at IS NOT NULL THEN 'dead' \
          WHEN attempts > 0 THEN 'retrying' ELSE 'waiting' END";

/// The columns of an [`EventRow`], in its order, from a relation with the
/// outbox's columns.
const ROW: &str = "id, event_id, aggregate_type, aggregate_id, event_type, created_at, {state} AS state, attempts, \
     next_attempt_at, published_at, dead_at, given_up_at, left(last_error, {error_start}) AS last_error";

/// The filters of a list but its walk's: `$1` state name, `$2` aggregate
/// type, `$3` event type, `$5`/`$6` created at or after / before, `$7`
/// text of the last error; each NULL when not given.
const FILTERS: &str = "($1::text IS NULL OR {state} = $1::text) \
        AND ($2::text IS NULL OR aggregate_type = $2::text) \
        AND ($3::text IS NULL OR event_type = $3::text) \
        AND ($5::timestamptz IS NULL OR created_at >= $5::timestamptz) \
        AND ($6::timestamptz IS NULL OR created_at < $6::timestamptz) \
        AND ($7::text IS NULL OR strpos(last_error, $7::text) > 0)";

/// `$1..$7` the filters (`$4` the aggregate id of the aggregate walk),
/// `$8` the keyset bound (exclusive), `$9` rows to return, `$10` index
/// entries to read at most. One page of a list: the walk `w` reads its
/// index (`{walk}`, see [`EventWalk`]) in id order from the bound, at most
/// `$10` rows, numbering them; above its LIMIT, which keeps them out of the
/// walk, the filters pick the page's rows (`hit`), and the walk's last
/// row comes back too (`scanned = $10`, hit or not) as where the next
/// page goes on from. Evaluated lazily: a page that fills stops the walk.
const LIST_EVENTS: &str = "SELECT {row}, hit, scanned FROM ( \
        SELECT w.*, coalesce({filters}, false) AS hit FROM ( \
            SELECT {walk_columns}, row_number() OVER (ORDER BY id {dir}) AS scanned \
              FROM {t} WHERE {walk} AND id {cmp} $8::int8 ORDER BY id {dir} LIMIT $10::int8) AS w) AS f \
      WHERE hit OR scanned = $10::int8 ORDER BY id {dir} LIMIT $9::int8";

/// The outbox columns a walk carries, unqualified.
const WALK_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type, created_at, attempts, \
     next_attempt_at, published_at, dead_at, given_up_at, last_error";

/// `LIST_EVENTS` for [`EventWalk::Aggregate`]: the same parameters and
/// rows, the walk of `<table>_by_aggregate_idx (aggregate_id, id)` taken
/// one row per step (`STEP`). A plain walk of one aggregate id is
/// estimated at a few rows, and for a few rows PostgreSQL finds a bitmap
/// scan and a sort cheaper than the index's order (it chose them on 20,000
/// rows): the whole aggregate read and sorted, however long its history.
/// Rows come out in step order, which is id order: no ORDER BY, which
/// PostgreSQL could only satisfy by sorting the CTE.
const LIST_AGGREGATE_EVENTS: &str = "WITH RECURSIVE w AS ( \
        (SELECT {walk_columns}, 1::int8 AS scanned FROM {t} \
          WHERE aggregate_id = $4::text AND id {cmp} $8::int8 ORDER BY id {dir} LIMIT 1) \
        UNION ALL \
        SELECT n.*, w.scanned + 1 FROM w CROSS JOIN LATERAL ({step}) AS n WHERE w.scanned < $10::int8) \
     SELECT {row}, hit, scanned FROM (SELECT w.*, coalesce({filters}, false) AS hit FROM w) AS f \
      WHERE hit OR scanned = $10::int8 LIMIT $9::int8";

/// One step of an aggregate's walk: the next row of aggregate `{id}`
/// after the row `w`, of type `{type}` if not NULL. `ORDER BY … LIMIT 1`
/// is a descent of the index, whatever the estimates (PostgreSQL's own
/// plan for `min()`). On the daily-partitioned layout a step descends
/// every partition's index.
const STEP: &str = "SELECT {walk_columns} FROM {t} AS o \
      WHERE o.aggregate_id = {id} AND ({type}::text IS NULL OR o.aggregate_type = {type}::text) AND o.id {cmp} w.id \
      ORDER BY o.id {dir} LIMIT 1";

/// `$1` aggregate id, `$2` aggregate type or NULL, `$3` the keyset bound
/// (exclusive), `$4` rows. One aggregate's events in id order, walked as
/// in `LIST_AGGREGATE_EVENTS`, each with the first event of its aggregate
/// that is neither published nor given up on: one probe of
/// `<table>_pending_by_aggregate_idx` per row (the strict claim's own
/// question).
const AGGREGATE_EVENTS: &str = "WITH RECURSIVE w AS ( \
        (SELECT {walk_columns} FROM {t} \
          WHERE aggregate_id = $1::text AND ($2::text IS NULL OR aggregate_type = $2::text) AND id {cmp} $3::int8 \
          ORDER BY id {dir} LIMIT 1) \
        UNION ALL \
        SELECT n.* FROM w CROSS JOIN LATERAL ({step}) AS n) \
     SELECT {row}, (SELECT min(e.id) FROM {t} AS e \
             WHERE e.aggregate_type = o.aggregate_type AND e.aggregate_id = o.aggregate_id \
               AND e.published_at IS NULL AND e.given_up_at IS NULL) AS first_pending \
       FROM w AS o LIMIT $4::int8";

/// A walk's direction: towards lower ids, or higher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Down,
    Up,
}

impl Direction {
    fn render(self, template: &str) -> String {
        let (cmp, dir) = match self {
            Direction::Down => ("<", "DESC"),
            Direction::Up => (">", "ASC"),
        };
        template.replace("{cmp}", cmp).replace("{dir}", dir)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The statements of this module for one outbox table, rendered.
#[derive(Debug, Clone)]
pub struct EventsSql {
    /// `LIST_EVENTS` per [`EventWalk`], then per [`Direction`].
    list: [[String; 2]; 4],
    /// `AGGREGATE_EVENTS` per [`Direction`].
    aggregate: [String; 2],
}

impl EventsSql {
    /// Renders the statements for `config`'s table.
    pub fn new(config: &Config) -> EventsSql {
        let t = config.qualified();
        let render = |template: &str| {
            template
                .replace("{row}", ROW)
                .replace("{walk_columns}", WALK_COLUMNS)
                .replace("{filters}", FILTERS)
                .replace("{state}", STATE)
                .replace("{error_start}", &ERROR_START.to_string())
                .replace("{t}", &t)
        };
        let both = |template: &str| [Direction::Down, Direction::Up].map(|d| render(&d.render(template)));
        let step = |id: &str, ty: &str| STEP.replace("{id}", id).replace("{type}", ty);
        EventsSql {
            list: EventWalk::ALL.map(|walk| match walk {
                EventWalk::Aggregate => {
                    both(&LIST_AGGREGATE_EVENTS.replace("{step}", &step("$4::text", "NULL")))
                }
                _ => both(&LIST_EVENTS.replace("{walk}", walk.predicate())),
            }),
            aggregate: both(&AGGREGATE_EVENTS.replace("{step}", &step("$1::text", "$2"))),
        }
    }

    #[cfg(test)]
    fn all(&self) -> impl Iterator<Item = &String> {
        self.list.iter().flatten().chain(&self.aggregate)
    }
}

/// A list's statement parameters, in the order `LIST_EVENTS` numbers them.
struct ListParams<'a> {
    state: Option<&'static str>,
    filter: EventFilter<'a>,
    bound: i64,
    rows: i64,
    scan: i64,
}

impl ListParams<'_> {
    fn typed(&self) -> [Typed<'_>; 10] {
        [
            typed(&self.state),
            typed(&self.filter.aggregate_type),
            typed(&self.filter.event_type),
            typed(&self.filter.aggregate_id),
            typed(&self.filter.created_from),
            typed(&self.filter.created_before),
            typed(&self.filter.error_contains),
            typed(&self.bound),
            typed(&self.rows),
            typed(&self.scan),
        ]
    }
}

/// Where a page walks from: its direction and exclusive bound.
fn start(keyset: Keyset, first: Direction) -> (Direction, i64) {
    match (keyset, first) {
        (Keyset::Start, Direction::Down) => (Direction::Down, i64::MAX),
        (Keyset::Start, Direction::Up) => (Direction::Up, 0),
        (Keyset::Before(id), _) => (Direction::Down, id),
        (Keyset::After(id), _) => (Direction::Up, id),
    }
}

impl EventsQuery<'_> {
    fn statement<'s>(&self, sql: &'s EventsSql) -> (&'s str, ListParams<'_>, Direction) {
        let (direction, bound) = start(self.keyset, Direction::Down);
        let walk = self.filter.walk();
        let text = &sql.list[walk as usize][direction.index()];
        let params = ListParams {
            state: self.filter.state.map(EventState::as_str),
            filter: self.filter,
            bound,
            // One more than the page: whether another page follows.
            rows: self.limit.max(1) + 1,
            scan: self.scan.max(1),
        };
        (text, params, direction)
    }
}

impl EventsSql {
    /// One page of events, newest first (see [`EventsQuery`]). Reads at
    /// most `query.scan` entries of one index.
    pub async fn list_events(
        &self,
        client: &impl GenericClient,
        query: &EventsQuery<'_>,
    ) -> Result<EventsPage<EventRow>, Error> {
        let (text, params, direction) = query.statement(self);
        let rows = client.query_typed(text, &params.typed()).await?;
        let limit = usize::try_from(params.rows - 1).unwrap_or(usize::MAX);
        let mut hits = Vec::with_capacity(rows.len().min(limit + 1));
        let mut last: Option<(i64, i64)> = None;
        for r in &rows {
            if r.try_get::<_, bool>(13)? {
                hits.push(event_row(r)?);
            }
            last = Some((r.try_get(0)?, r.try_get(14)?));
        }
        // Past the page, in its direction: a row beyond a full page, else
        // the walk's last row if the scan bound stopped it, else nothing.
        let beyond = if hits.len() > limit {
            hits.truncate(limit);
            hits.last().map(|e| e.id)
        } else {
            last.filter(|(_, scanned)| *scanned == params.scan)
                .map(|(id, _)| id)
        };
        Ok(match direction {
            Direction::Down => EventsPage {
                // Rows newer than the bound, from the page that led here.
                prev: (query.keyset != Keyset::Start)
                    .then(|| hits.first().map_or(params.bound.saturating_sub(1), |e| e.id)),
                next: beyond,
                events: hits,
            },
            Direction::Up => {
                hits.reverse();
                EventsPage {
                    next: Some(hits.last().map_or(params.bound.saturating_add(1), |e| e.id)),
                    prev: beyond,
                    events: hits,
                }
            }
        })
    }

    /// One page of an aggregate's events, oldest first, each with where it
    /// stands and whether it is its aggregate's first pending event.
    pub async fn aggregate_events(
        &self,
        client: &impl GenericClient,
        query: &AggregateQuery<'_>,
    ) -> Result<EventsPage<AggregateEvent>, Error> {
        let (direction, bound) = start(query.keyset, Direction::Up);
        let limit = query.limit.max(1);
        let rows = client
            .query_typed(
                &self.aggregate[direction.index()],
                &[
                    typed(&query.aggregate_id),
                    typed(&query.aggregate_type),
                    typed(&bound),
                    typed(&(limit + 1)),
                ],
            )
            .await?;
        let mut events = rows
            .iter()
            .map(|r| {
                let event = event_row(r)?;
                let first_pending: Option<i64> = r.try_get(13)?;
                Ok(AggregateEvent {
                    blocker: first_pending == Some(event.id),
                    first_pending,
                    event,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let more = events.len() > usize::try_from(limit).unwrap_or(usize::MAX);
        events.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        let edge = |e: Option<&AggregateEvent>| e.map(|e| e.event.id);
        Ok(match direction {
            Direction::Up => EventsPage {
                next: more.then(|| edge(events.last())).flatten(),
                prev: (query.keyset != Keyset::Start)
                    .then(|| edge(events.first()).unwrap_or(bound.saturating_add(1))),
                events,
            },
            Direction::Down => {
                events.reverse();
                EventsPage {
                    prev: more.then(|| edge(events.first())).flatten(),
                    next: Some(edge(events.last()).unwrap_or(bound.saturating_sub(1))),
                    events,
                }
            }
        })
    }

    /// The plan of the statement [`list_events`](Self::list_events) runs for
    /// `query`, as `EXPLAIN (FORMAT JSON)` gives it: with `generic`, the
    /// plan PostgreSQL would keep for the statement prepared (the
    /// parameters unknown to the planner, as after its fifth run), else the
    /// plan for these values. Changes and resets the session's
    /// `plan_cache_mode`: run it on a connection of its own.
    pub async fn explain_events(
        &self,
        client: &impl GenericClient,
        query: &EventsQuery<'_>,
        generic: bool,
    ) -> Result<serde_json::Value, Error> {
        let (text, params, _) = query.statement(self);
        explain(client, text, &params.typed(), generic).await
    }

    /// The plan of [`aggregate_events`](Self::aggregate_events)'s statement,
    /// as [`explain_events`](Self::explain_events) gives it.
    pub async fn explain_aggregate_events(
        &self,
        client: &impl GenericClient,
        query: &AggregateQuery<'_>,
        generic: bool,
    ) -> Result<serde_json::Value, Error> {
        let (direction, bound) = start(query.keyset, Direction::Up);
        let rows = query.limit.max(1) + 1;
        let params = [
            typed(&query.aggregate_id),
            typed(&query.aggregate_type),
            typed(&bound),
            typed(&rows),
        ];
        explain(client, &self.aggregate[direction.index()], &params, generic).await
    }
}

/// `EXPLAIN (FORMAT JSON)` of `text` with `params`. PostgreSQL 15 has no
/// `EXPLAIN (GENERIC_PLAN)`: a generic plan is the plan of a prepared
/// statement under `plan_cache_mode = force_generic_plan`.
async fn explain(
    client: &impl GenericClient,
    text: &str,
    params: &[Typed<'_>],
    generic: bool,
) -> Result<serde_json::Value, Error> {
    if !generic {
        let explain = format!("EXPLAIN (FORMAT JSON) {text}");
        return client.query_typed_one(&explain, params).await?.try_get(0);
    }
    let types: Vec<&str> = params.iter().map(|(_, t)| t.name()).collect();
    // EXECUTE's arguments cannot be bind parameters: PostgreSQL quotes
    // each value as a literal of its type, for this session to read back.
    let quote = (1..=types.len())
        .zip(&types)
        .map(|(i, t)| format!("quote_nullable(${i}::{t})"))
        .collect::<Vec<_>>()
        .join(", ");
    let literals: Vec<String> = client
        .query_typed_one(&format!("SELECT ARRAY[{quote}]"), params)
        .await?
        .try_get(0)?;
    let args: Vec<String> = literals
        .iter()
        .zip(&types)
        .map(|(literal, t)| format!("{literal}::{t}"))
        .collect();
    client
        .batch_execute(&format!(
            "SET plan_cache_mode = force_generic_plan; PREPARE outbox_explain_events ({}) AS {text}",
            types.join(", ")
        ))
        .await?;
    let plan = client
        .query_typed_one(
            &format!(
                "EXPLAIN (FORMAT JSON) EXECUTE outbox_explain_events ({})",
                args.join(", ")
            ),
            &[],
        )
        .await
        .and_then(|r| r.try_get(0));
    client
        .batch_execute("DEALLOCATE outbox_explain_events; RESET plan_cache_mode")
        .await?;
    plan
}

fn event_row(r: &Row) -> Result<EventRow, Error> {
    let state: &str = r.try_get(6)?;
    Ok(EventRow {
        id: r.try_get(0)?,
        event_id: r.try_get(1)?,
        aggregate_type: r.try_get(2)?,
        aggregate_id: r.try_get(3)?,
        event_type: r.try_get(4)?,
        created_at: r.try_get(5)?,
        // `STATE` yields only the names of `EventState::ALL`.
        state: state.parse().expect("STATE names an EventState"),
        attempts: r.try_get(7)?,
        next_attempt_at: r.try_get(8)?,
        published_at: r.try_get(9)?,
        dead_at: r.try_get(10)?,
        given_up_at: r.try_get(11)?,
        last_error: r.try_get(12)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_filter_walks_one_index_and_states_round_trip() {
        let sql = EventsSql::new(&Config::new("app", "events").unwrap());
        for s in sql.all() {
            assert!(s.contains("\"app\".\"events\""), "{s}");
            assert!(!s.contains('{'), "{s}");
        }
        let walk = |state, aggregate_id| {
            EventFilter {
                state,
                aggregate_id,
                ..EventFilter::default()
            }
            .walk()
        };
        assert_eq!(walk(Some(EventState::Retrying), None), EventWalk::Unpublished);
        assert_eq!(walk(Some(EventState::GivenUp), None), EventWalk::Dead);
        assert_eq!(walk(None, None), EventWalk::Table);
        assert_eq!(walk(Some(EventState::Dead), Some("o-1")), EventWalk::Aggregate);
        for state in EventState::ALL {
            assert_eq!(state.as_str().parse(), Ok(state));
            assert!(STATE.contains(&format!("'{state}'")), "{state}");
        }
        assert_eq!("Dead".parse::<EventState>(), Err(UnknownState("Dead".into())));
    }
}
