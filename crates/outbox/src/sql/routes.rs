//! Routes as operators see them (migration 0011): what each relay reports
//! about its routes (`<table>_route_state`), deliveries per route and
//! minute (`<table>_rollup`), and the pauses operators ask for
//! (`<table>_routes`).
//!
//! The relay's side is [`RouteSql::heartbeat`]: one statement per
//! heartbeat, whatever the number of routes, that upserts the relay's
//! rows (arrays, `unnest`), adds its deltas to the current minute of the
//! rollup, deletes what is old (minutes past [`ROLLUP_KEEP_DAYS`], rows of
//! relays silent longer than the relay says) and reads back the paused
//! routes. Every statement is unnamed and typed (`query_typed`): one round
//! trip, nothing prepared on the session, so it runs through a
//! transaction-mode pooler as it runs direct.
//!
//! The console's side reads the same tables ([`RouteSql::states`],
//! [`RouteSql::rollup`], [`RouteSql::paused`]) and pauses and resumes
//! ([`RouteSql::pause`], [`RouteSql::resume`]) on any client, so it can
//! run them in the transaction of its audit row. A pause is a row, never a
//! lock: relays read it with their next heartbeat.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::{Error, GenericClient, Row};
use uuid::Uuid;

use super::typed::typed;
use crate::Config;

/// How long the rollup keeps a minute: the console's longest chart.
pub const ROLLUP_KEEP_DAYS: i32 = 7;

/// `$1` relay id, `$2` relay name, `$3` when it started, `$4` seconds of
/// silence after which any relay's rows are deleted; per route (one
/// element each, in one order): `$5` name, `$6` sink, `$7` whether it is
/// the default route (aggregate types NULL), `$8` breaker, `$9` since,
/// `$10` paused, `$11..$13` delivered, failed, dead since the relay
/// started, `$14` last error, `$15` its time, `$16..$18` delivered,
/// failed, dead since the last heartbeat written; `$19`/`$20` (route's
/// position from 1, aggregate type) pairs.
///
/// One statement: the upsert, the rollup's addition (only routes with a
/// delta) and both deletes are data-modifying CTEs, which PostgreSQL runs
/// once each whether or not the final SELECT reads them. Rows are written
/// in route order, so two relays adding to the same minutes lock its rows
/// in one order and never deadlock. The rollup's delete walks its primary
/// key from `minute`'s start, which needs a stable bound (`now()`: with
/// `clock_timestamp()`, volatile, it is a sequential scan of 7 days of
/// minutes, 14 ms at 20 routes); `route_state` is small (relays × routes).
const HEARTBEAT: &str = "WITH input AS ( \
         SELECT * FROM unnest($5::text[], $6::text[], $7::bool[], $8::text[], $9::timestamptz[], $10::bool[], \
                $11::int8[], $12::int8[], $13::int8[], $14::text[], $15::timestamptz[], \
                $16::int8[], $17::int8[], $18::int8[]) WITH ORDINALITY \
             AS r(route, sink, is_default, breaker, breaker_since, paused, delivered, failed, dead, \
                  last_error, last_error_at, d_delivered, d_failed, d_dead, i)), \
     types AS ( \
         SELECT i, array_agg(aggregate_type ORDER BY aggregate_type) AS aggregate_types \
           FROM unnest($19::int8[], $20::text[]) AS t(i, aggregate_type) GROUP BY i), \
     state AS ( \
         INSERT INTO {route_state} AS s (relay_id, relay_name, route, sink, aggregate_types, breaker, \
                breaker_since, paused, delivered, failed, dead, last_error, last_error_at, started_at, updated_at) \
         SELECT $1::uuid, $2::text, r.route, r.sink, \
                CASE WHEN r.is_default THEN NULL ELSE coalesce(t.aggregate_types, '{}') END, \
                r.breaker, r.breaker_since, r.paused, r.delivered, r.failed, r.dead, r.last_error, \
                r.last_error_at, $3::timestamptz, clock_timestamp() \
           FROM input AS r LEFT JOIN types AS t USING (i) ORDER BY r.route \
         ON CONFLICT (relay_id, route) DO UPDATE SET relay_name = excluded.relay_name, sink = excluded.sink, \
                aggregate_types = excluded.aggregate_types, breaker = excluded.breaker, \
                breaker_since = excluded.breaker_since, paused = excluded.paused, \
                delivered = excluded.delivered, failed = excluded.failed, dead = excluded.dead, \
                last_error = excluded.last_error, last_error_at = excluded.last_error_at, \
                updated_at = excluded.updated_at), \
     added AS ( \
         INSERT INTO {rollup} AS u (minute, route, delivered, failed, dead) \
         SELECT date_trunc('minute', clock_timestamp()), route, d_delivered, d_failed, d_dead \
           FROM input WHERE d_delivered <> 0 OR d_failed <> 0 OR d_dead <> 0 ORDER BY route \
         ON CONFLICT (minute, route) DO UPDATE SET delivered = u.delivered + excluded.delivered, \
                failed = u.failed + excluded.failed, dead = u.dead + excluded.dead), \
     old_minutes AS ( \
         DELETE FROM {rollup} WHERE minute < date_trunc('minute', now()) - {keep}), \
     silent AS ( \
         DELETE FROM {route_state} WHERE relay_id <> $1::uuid \
            AND updated_at < now() - make_interval(secs => $4::float8)) \
     SELECT route, paused_at, paused_by, reason FROM {routes} WHERE paused_at IS NOT NULL ORDER BY route";

/// `$1` relay id. A relay stopping deletes its rows: the console shows
/// live relays only.
const LEAVE: &str = "DELETE FROM {route_state} WHERE relay_id = $1";

/// The columns [`RouteState`] reads, in order.
const STATE_COLUMNS: &str = "relay_id, relay_name, route, sink, aggregate_types, breaker, breaker_since, paused, \
     delivered, failed, dead, last_error, last_error_at, started_at, updated_at";

/// `$1` seconds. Rows of relays that wrote within that window, per route
/// newest first.
const STATES: &str = "SELECT {columns} FROM {route_state} \
     WHERE updated_at >= clock_timestamp() - make_interval(secs => $1::float8) \
     ORDER BY route, updated_at DESC, relay_name";

/// `$1` the first minute. Through the primary key, from that minute on.
const ROLLUP: &str = "SELECT minute, route, delivered, failed, dead FROM {rollup} \
     WHERE minute >= $1 ORDER BY minute, route";

/// The paused routes, by name.
const PAUSED: &str = "SELECT route, paused_at, paused_by, reason FROM {routes} \
     WHERE paused_at IS NOT NULL ORDER BY route";

/// `$1` route, `$2` who, `$3` why. Pauses a route not paused yet: a row
/// back only if it was not (the `WHERE` of `DO UPDATE` leaves a paused
/// route's row, and who paused it, as they are).
const PAUSE: &str = "INSERT INTO {routes} AS r (route, paused_at, paused_by, reason) \
     VALUES ($1, clock_timestamp(), $2, $3) \
     ON CONFLICT (route) DO UPDATE SET paused_at = excluded.paused_at, paused_by = excluded.paused_by, \
            reason = excluded.reason WHERE r.paused_at IS NULL \
     RETURNING route";

/// `$1` route. Resumes a paused route; the row stays (one per route ever
/// paused), with nothing set.
const RESUME: &str = "UPDATE {routes} SET paused_at = NULL, paused_by = NULL, reason = NULL \
     WHERE route = $1 AND paused_at IS NOT NULL";

/// The route statements of one outbox, rendered once.
#[derive(Debug, Clone)]
pub struct RouteSql {
    heartbeat: String,
    leave: String,
    states: String,
    rollup: String,
    paused: String,
    pause: String,
    resume: String,
}

/// A route's circuit breaker, as `route_state.breaker` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Its sink is called.
    Closed,
    /// Its sink is unavailable: its rows are answered unavailable, no
    /// attempt spent, while a probe waits.
    Open,
    /// A probe answered; the next delivery decides.
    HalfOpen,
}

impl BreakerState {
    /// The column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// One route as a relay reports it on its heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteReport {
    /// Its name.
    pub route: String,
    /// Its sink's kind and address, without secrets.
    pub sink: String,
    /// The aggregate types it takes; None: the default route (every type
    /// no other route names).
    pub aggregate_types: Option<Vec<String>>,
    /// Its breaker's state...
    pub breaker: BreakerState,
    /// ...and since when (None: closed since the relay started).
    pub breaker_since: Option<DateTime<Utc>>,
    /// Whether the relay honours a pause of it.
    pub paused: bool,
    /// Rows delivered since the relay started.
    pub delivered: i64,
    /// Failed attempts since the relay started.
    pub failed: i64,
    /// Dead letters made since the relay started.
    pub dead: i64,
    /// The last error, and when.
    pub last_error: Option<(String, DateTime<Utc>)>,
    /// What to add to the rollup's current minute: the counts since the
    /// last heartbeat written.
    pub delta: RollupDelta,
}

/// Counts to add to a route's minute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RollupDelta {
    /// Rows delivered.
    pub delivered: i64,
    /// Failed attempts.
    pub failed: i64,
    /// Dead letters.
    pub dead: i64,
}

/// A relay's heartbeat: itself and its routes.
#[derive(Debug, Clone, Copy)]
pub struct HeartbeatParams<'a> {
    /// Its id (the lease rows' relay id).
    pub relay_id: Uuid,
    /// Its name, as `outbox relays` shows it.
    pub relay_name: &'a str,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// Rows of relays silent this long are deleted.
    pub silent_after: Duration,
    /// Its routes.
    pub routes: &'a [RouteReport],
}

/// A relay's view of one of its routes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteState {
    /// The relay.
    pub relay_id: Uuid,
    /// Its name.
    pub relay_name: String,
    /// The route.
    pub route: String,
    /// Its sink's kind and address, without secrets.
    pub sink: String,
    /// The aggregate types it takes; None: the default route.
    pub aggregate_types: Option<Vec<String>>,
    /// `closed`, `open` or `half_open`.
    pub breaker: String,
    /// Since when (None: closed since the relay started).
    pub breaker_since: Option<DateTime<Utc>>,
    /// Whether this relay honours a pause of the route.
    pub paused: bool,
    /// Delivered since the relay started.
    pub delivered: i64,
    /// Failed attempts since the relay started.
    pub failed: i64,
    /// Dead letters since the relay started.
    pub dead: i64,
    /// The last error...
    pub last_error: Option<String>,
    /// ...and when.
    pub last_error_at: Option<DateTime<Utc>>,
    /// When the relay started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub updated_at: DateTime<Utc>,
}

/// One route's deliveries in one minute, summed over relays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RollupRow {
    /// The minute's start.
    pub minute: DateTime<Utc>,
    /// The route.
    pub route: String,
    /// Rows delivered.
    pub delivered: i64,
    /// Failed attempts.
    pub failed: i64,
    /// Dead letters made.
    pub dead: i64,
}

/// A route an operator paused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PausedRoute {
    /// The route's name (every relay's route of that name is paused).
    pub route: String,
    /// When.
    pub paused_at: DateTime<Utc>,
    /// Who.
    pub paused_by: Option<String>,
    /// Why, if said.
    pub reason: Option<String>,
}

impl RouteSql {
    /// The statements for `config`'s route tables. Fails on a table name
    /// too long for its companions' names.
    pub fn new(config: &Config) -> Result<Self, crate::Error> {
        let routes = config.companion("_routes")?;
        let route_state = config.companion("_route_state")?;
        let rollup = config.companion("_rollup")?;
        let render = |s: &str| {
            s.replace("{columns}", STATE_COLUMNS)
                .replace("{keep}", &format!("interval '{ROLLUP_KEEP_DAYS} days'"))
                .replace("{route_state}", &route_state)
                .replace("{rollup}", &rollup)
                .replace("{routes}", &routes)
        };
        Ok(Self {
            heartbeat: render(HEARTBEAT),
            leave: render(LEAVE),
            states: render(STATES),
            rollup: render(ROLLUP),
            paused: render(PAUSED),
            pause: render(PAUSE),
            resume: render(RESUME),
        })
    }

    /// A relay's heartbeat (see `HEARTBEAT`): its routes' rows written,
    /// their deltas added to the current minute, old minutes and silent
    /// relays' rows deleted. Returns the paused routes.
    pub async fn heartbeat(
        &self,
        client: &impl GenericClient,
        p: &HeartbeatParams<'_>,
    ) -> Result<Vec<PausedRoute>, Error> {
        let r = p.routes;
        let names: Vec<&str> = r.iter().map(|r| r.route.as_str()).collect();
        let sinks: Vec<&str> = r.iter().map(|r| r.sink.as_str()).collect();
        let default: Vec<bool> = r.iter().map(|r| r.aggregate_types.is_none()).collect();
        let breaker: Vec<&str> = r.iter().map(|r| r.breaker.as_str()).collect();
        let since: Vec<Option<DateTime<Utc>>> = r.iter().map(|r| r.breaker_since).collect();
        let paused: Vec<bool> = r.iter().map(|r| r.paused).collect();
        let delivered: Vec<i64> = r.iter().map(|r| r.delivered).collect();
        let failed: Vec<i64> = r.iter().map(|r| r.failed).collect();
        let dead: Vec<i64> = r.iter().map(|r| r.dead).collect();
        let error: Vec<Option<&str>> = r
            .iter()
            .map(|r| r.last_error.as_ref().map(|(e, _)| e.as_str()))
            .collect();
        let error_at: Vec<Option<DateTime<Utc>>> = r
            .iter()
            .map(|r| r.last_error.as_ref().map(|(_, at)| *at))
            .collect();
        let d_delivered: Vec<i64> = r.iter().map(|r| r.delta.delivered).collect();
        let d_failed: Vec<i64> = r.iter().map(|r| r.delta.failed).collect();
        let d_dead: Vec<i64> = r.iter().map(|r| r.delta.dead).collect();
        // The types as (route position, type) pairs: a text[][] cannot be
        // ragged, so one array per route does not bind.
        let (type_route, types): (Vec<i64>, Vec<&str>) = (1_i64..)
            .zip(r)
            .flat_map(|(i, r)| r.aggregate_types.iter().flatten().map(move |t| (i, t.as_str())))
            .unzip();
        let silent_after = p.silent_after.as_secs_f64();
        let rows = client
            .query_typed(
                &self.heartbeat,
                &[
                    typed(&p.relay_id),
                    typed(&p.relay_name),
                    typed(&p.started_at),
                    typed(&silent_after),
                    typed(&names),
                    typed(&sinks),
                    typed(&default),
                    typed(&breaker),
                    typed(&since),
                    typed(&paused),
                    typed(&delivered),
                    typed(&failed),
                    typed(&dead),
                    typed(&error),
                    typed(&error_at),
                    typed(&d_delivered),
                    typed(&d_failed),
                    typed(&d_dead),
                    typed(&type_route),
                    typed(&types),
                ],
            )
            .await?;
        rows.iter().map(paused_row).collect()
    }

    /// A relay stopping: deletes its rows. Returns how many.
    pub async fn leave(&self, client: &impl GenericClient, relay_id: Uuid) -> Result<u64, Error> {
        client.execute_typed(&self.leave, &[typed(&relay_id)]).await
    }

    /// The rows of relays that wrote within `live_within`, by route, each
    /// route's newest first.
    pub async fn states(
        &self,
        client: &impl GenericClient,
        live_within: Duration,
    ) -> Result<Vec<RouteState>, Error> {
        let secs = live_within.as_secs_f64();
        let rows = client.query_typed(&self.states, &[typed(&secs)]).await?;
        rows.iter()
            .map(|r| {
                Ok(RouteState {
                    relay_id: r.try_get(0)?,
                    relay_name: r.try_get(1)?,
                    route: r.try_get(2)?,
                    sink: r.try_get(3)?,
                    aggregate_types: r.try_get(4)?,
                    breaker: r.try_get(5)?,
                    breaker_since: r.try_get(6)?,
                    paused: r.try_get(7)?,
                    delivered: r.try_get(8)?,
                    failed: r.try_get(9)?,
                    dead: r.try_get(10)?,
                    last_error: r.try_get(11)?,
                    last_error_at: r.try_get(12)?,
                    started_at: r.try_get(13)?,
                    updated_at: r.try_get(14)?,
                })
            })
            .collect()
    }

    /// Each route's minutes from `since` on, oldest first.
    pub async fn rollup(
        &self,
        client: &impl GenericClient,
        since: DateTime<Utc>,
    ) -> Result<Vec<RollupRow>, Error> {
        let rows = client.query_typed(&self.rollup, &[typed(&since)]).await?;
        rows.iter()
            .map(|r| {
                Ok(RollupRow {
                    minute: r.try_get(0)?,
                    route: r.try_get(1)?,
                    delivered: r.try_get(2)?,
                    failed: r.try_get(3)?,
                    dead: r.try_get(4)?,
                })
            })
            .collect()
    }

    /// The paused routes, by name.
    pub async fn paused(&self, client: &impl GenericClient) -> Result<Vec<PausedRoute>, Error> {
        let rows = client.query_typed(&self.paused, &[]).await?;
        rows.iter().map(paused_row).collect()
    }

    /// Pauses `route` for every relay of this outbox, from their next
    /// heartbeat on. False if it was paused already (who paused it and why
    /// are left as they were).
    pub async fn pause(
        &self,
        client: &impl GenericClient,
        route: &str,
        who: &str,
        reason: Option<&str>,
    ) -> Result<bool, Error> {
        let rows = client
            .query_typed(&self.pause, &[typed(&route), typed(&who), typed(&reason)])
            .await?;
        Ok(!rows.is_empty())
    }

    /// Resumes `route`: relays deliver it again from their next heartbeat
    /// on. False if it was not paused.
    pub async fn resume(&self, client: &impl GenericClient, route: &str) -> Result<bool, Error> {
        Ok(client.execute_typed(&self.resume, &[typed(&route)]).await? > 0)
    }
}

fn paused_row(r: &Row) -> Result<PausedRoute, Error> {
    Ok(PausedRoute {
        route: r.try_get(0)?,
        paused_at: r.try_get(1)?,
        paused_by: r.try_get(2)?,
        reason: r.try_get(3)?,
    })
}
