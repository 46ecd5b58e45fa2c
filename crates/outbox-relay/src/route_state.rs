//! What a relay tells the console about its routes, and the pauses it
//! honours: the `route_state`, `rollup` and `routes` tables of migration
//! 0011, written and read on the relay's heartbeat.
//!
//! [`RouteBoard`] (in the relay's context) holds one [`RouteStatus`] per
//! route: its counters since the relay started (added from receipts in
//! `Books`, atomics only), its breaker's state and since when (from
//! `Breaker::report`, at changes of state), its last error, and whether a
//! pause of it is honoured (an atomic the router, or the loop of a relay
//! with one sink, reads before delivering).
//!
//! # The heartbeat
//!
//! [`Publisher::publish`] runs on the lease task's connection, pipelined
//! right behind each lease tick (`lease.rs`): no connection of its own, no
//! round trip of its own, and its interval is the tick's, a third of
//! `--lease-timeout` or `--poll-interval` if shorter (3.3 s by default).
//! The lease task is the relay's one periodic task with a connection of
//! its own in every polling relay that takes leases; the backlog gauges'
//! connection exists only with `--http`, and the batch sessions belong to
//! the batch loop, which must not wait on a console. Each heartbeat is
//! one statement (`outbox::sql::RouteSql::heartbeat`): one upsert row per
//! route, one rollup row per route that delivered or failed since the last
//! heartbeat, the deletes of old minutes and silent relays' rows, and the
//! read of the paused routes. Its cost is bounded by the number of routes,
//! never by the traffic.
//!
//! A relay without leases (`--ordering none`), a fleet's outboxes and the
//! WAL source publish nothing and honour no pause (docs/routing.md says
//! why): they have no such task, and a connection per relay (or per
//! tenant) only for this is not worth it.
//!
//! Publishing never stops delivery: a failed heartbeat (a missing grant, a
//! server away) is logged once when its error changes and retried at the
//! next tick; the counters keep counting, and the rollup's deltas are
//! those since the last heartbeat written, so nothing is lost nor counted
//! twice across failures (but for a heartbeat whose answer was lost after
//! its commit). The `paused` column says what the relay honoured before
//! this heartbeat, so a route shows `paused` only once no new batch of it
//! can be sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outbox::sql::{BreakerState, HeartbeatParams, PausedRoute, RollupDelta, RouteReport, RouteSql};
use tokio::sync::Notify;
use tokio_postgres::Client;
use tracing::{info, warn};
use uuid::Uuid;

use crate::breaker::CircuitState;
use crate::context::RelayContext;
use crate::error::error_chain;

/// Rows of relays silent this long are deleted by the next heartbeat of
/// any relay (readers ignore them much sooner: they ask for rows written
/// within a window of their own).
pub(crate) const SILENT_AFTER: Duration = Duration::from_secs(3600);

/// A route's `sink` column: the sink's kind, and its address without
/// secrets when known (`http http://hooks.internal/orders`).
pub(crate) fn sink_text(kind: &str, address: Option<&str>) -> String {
    match address {
        Some(address) => format!("{kind} {address}"),
        None => kind.to_owned(),
    }
}

/// The routes of one relay.
#[derive(Debug, Default)]
pub(crate) struct RouteBoard {
    routes: Mutex<Vec<Arc<RouteStatus>>>,
}

impl RouteBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<RouteStatus>>> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds the route `name` (once: a second call returns the first).
    /// `aggregate_types` None: the default route.
    pub(crate) fn register(
        &self,
        name: &str,
        sink: String,
        aggregate_types: Option<Vec<String>>,
    ) -> Arc<RouteStatus> {
        let mut routes = self.lock();
        if let Some(route) = routes.iter().find(|r| r.name == name) {
            return Arc::clone(route);
        }
        let route = Arc::new(RouteStatus {
            name: name.to_owned(),
            sink,
            aggregate_types,
            delivered: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            dead: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            resumed: Notify::new(),
            detail: Mutex::default(),
        });
        routes.push(Arc::clone(&route));
        route
    }

    /// The route `name`, if registered.
    pub(crate) fn get(&self, name: &str) -> Option<Arc<RouteStatus>> {
        self.lock().iter().find(|r| r.name == name).cloned()
    }

    fn all(&self) -> Vec<Arc<RouteStatus>> {
        self.lock().clone()
    }
}

/// One route's state, shared by its breaker, the relay's books and the
/// heartbeat.
#[derive(Debug)]
pub(crate) struct RouteStatus {
    name: String,
    /// Its sink's kind and address, without secrets.
    sink: String,
    aggregate_types: Option<Vec<String>>,
    delivered: AtomicU64,
    failed: AtomicU64,
    dead: AtomicU64,
    /// Set by the heartbeat; read before each delivery.
    paused: AtomicBool,
    /// Wakes a relay loop waiting for its route to be resumed.
    resumed: Notify,
    /// A std mutex: written at a breaker's change of state or a failed
    /// batch, read by the heartbeat; never held across an await.
    detail: Mutex<Detail>,
}

#[derive(Debug)]
struct Detail {
    breaker: BreakerState,
    since: Option<DateTime<Utc>>,
    last_error: Option<(String, DateTime<Utc>)>,
}

impl Default for Detail {
    fn default() -> Self {
        Self {
            breaker: BreakerState::Closed,
            since: None,
            last_error: None,
        }
    }
}

impl RouteStatus {
    fn detail(&self) -> std::sync::MutexGuard<'_, Detail> {
        self.detail.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Its name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A durable batch's outcomes for this route; `error` the last of its
    /// failures, if any.
    pub(crate) fn booked(&self, delivered: u64, failed: u64, dead: u64, error: Option<&str>) {
        self.delivered.fetch_add(delivered, Ordering::Relaxed);
        self.failed.fetch_add(failed, Ordering::Relaxed);
        self.dead.fetch_add(dead, Ordering::Relaxed);
        if let Some(error) = error {
            self.detail().last_error = Some((error.to_owned(), Utc::now()));
        }
    }

    /// Its breaker changed state: `down` is since when and why its sink has
    /// been unavailable (while open or half-open). Since when is the
    /// outage's start while it lasts, the closing's time after.
    pub(crate) fn breaker(&self, state: CircuitState, down: Option<(Instant, &str)>) {
        let now = Utc::now();
        let mut d = self.detail();
        let was = d.breaker;
        d.breaker = match state {
            CircuitState::Closed => BreakerState::Closed,
            CircuitState::Open => BreakerState::Open,
            CircuitState::HalfOpen => BreakerState::HalfOpen,
        };
        match down {
            Some((since, cause)) => {
                let since = chrono::Duration::from_std(since.elapsed()).map_or(now, |ago| now - ago);
                d.since = Some(since);
                if d.last_error.as_ref().is_none_or(|(e, _)| e != cause) {
                    d.last_error = Some((cause.to_owned(), now));
                }
            }
            None if was != BreakerState::Closed => d.since = Some(now),
            None => {}
        }
    }

    /// Whether a pause of this route is honoured: its rows are answered
    /// unavailable, unsent. One atomic load, on the delivery path.
    pub(crate) fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    /// Resolves once the route is not paused (at once if it is not).
    pub(crate) async fn resumed(&self) {
        loop {
            let notified = self.resumed.notified();
            tokio::pin!(notified);
            // Registered before the check, so a resume in between wakes it.
            notified.as_mut().enable();
            if !self.is_paused() {
                return;
            }
            notified.await;
        }
    }

    /// Applies what the heartbeat read: `pause` the route's row in
    /// `routes` if paused. Logged once per change.
    fn honour(&self, pause: Option<&PausedRoute>) {
        let paused = pause.is_some();
        if self.paused.swap(paused, Ordering::Relaxed) == paused {
            return;
        }
        match pause {
            Some(p) => info!(
                route = %self.name,
                paused_by = p.paused_by.as_deref(),
                reason = p.reason.as_deref(),
                "route paused: its events wait, unsent and with no attempt spent, until it is resumed"
            ),
            None => {
                info!(route = %self.name, "route resumed: its events are delivered again");
                self.resumed.notify_waiters();
            }
        }
    }

    /// Its report for the heartbeat, with what it delivered since `written`.
    fn report(&self, written: &RollupDelta) -> (RouteReport, RollupDelta) {
        let count = |c: &AtomicU64| i64::try_from(c.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
        let now = RollupDelta {
            delivered: count(&self.delivered),
            failed: count(&self.failed),
            dead: count(&self.dead),
        };
        let d = self.detail();
        let report = RouteReport {
            route: self.name.clone(),
            sink: self.sink.clone(),
            aggregate_types: self.aggregate_types.clone(),
            breaker: d.breaker,
            breaker_since: d.since,
            paused: self.is_paused(),
            delivered: now.delivered,
            failed: now.failed,
            dead: now.dead,
            last_error: d.last_error.clone(),
            delta: RollupDelta {
                delivered: now.delivered - written.delivered,
                failed: now.failed - written.failed,
                dead: now.dead - written.dead,
            },
        };
        (report, now)
    }
}

/// Writes a relay's routes on its heartbeat and applies the pauses it
/// reads back (see the [module docs](self)).
pub(crate) struct Publisher {
    sql: RouteSql,
    ctx: RelayContext,
    relay_id: Uuid,
    started_at: DateTime<Utc>,
    /// Per route, its counts as of the last heartbeat written: the next
    /// one adds what came since to the rollup.
    written: HashMap<String, RollupDelta>,
    /// What the last failure said: logged once per change.
    failing: Option<String>,
}

impl Publisher {
    /// The publisher of the relay `ctx` (id `relay_id`) over `outbox`'s
    /// tables; None, with a warning, if their names cannot be made.
    pub(crate) fn new(outbox: &outbox::Config, ctx: &RelayContext, relay_id: Uuid) -> Option<Self> {
        match RouteSql::new(outbox) {
            Ok(sql) => Some(Self {
                sql,
                ctx: ctx.clone(),
                relay_id,
                started_at: Utc::now(),
                written: HashMap::new(),
                failing: None,
            }),
            Err(error) => {
                warn!(error = %error_chain(&error), "route state is not published");
                None
            }
        }
    }

    /// One heartbeat on `client`. Never fails: see the [module docs](self).
    pub(crate) async fn publish(&mut self, client: &Client) {
        let routes = self.ctx.routes().all();
        if routes.is_empty() {
            return;
        }
        let mut reports = Vec::with_capacity(routes.len());
        let mut counts = Vec::with_capacity(routes.len());
        for route in &routes {
            let written = self.written.get(&route.name).copied().unwrap_or_default();
            let (report, now) = route.report(&written);
            reports.push(report);
            counts.push(now);
        }
        let params = HeartbeatParams {
            relay_id: self.relay_id,
            relay_name: self.ctx.name(),
            started_at: self.started_at,
            silent_after: SILENT_AFTER,
            routes: &reports,
        };
        match self.sql.heartbeat(client, &params).await {
            Ok(paused) => {
                if self.failing.take().is_some() {
                    info!("route state written again");
                }
                for (route, now) in routes.iter().zip(counts) {
                    self.written.insert(route.name.clone(), now);
                    route.honour(paused.iter().find(|p| p.route == route.name));
                }
            }
            Err(error) => {
                let error = error_chain(&error);
                if self.failing.as_ref() != Some(&error) {
                    warn!(
                        %error,
                        "writing route state failed: the console shows this relay's routes as silent and \
                         pauses are not read until it succeeds; delivery goes on"
                    );
                    self.failing = Some(error);
                }
            }
        }
    }

    /// The relay stops: its rows go (the console shows live relays).
    pub(crate) async fn leave(&self, client: &Client) {
        if self.ctx.routes().all().is_empty() {
            return;
        }
        if let Err(error) = self.sql.leave(client, self.relay_id).await {
            warn!(error = %error_chain(&error), "deleting this relay's route state failed; it ages out");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rollup_gets_what_came_since_the_last_heartbeat_written() {
        let board = RouteBoard::default();
        let route = board.register("orders", "http".to_owned(), Some(vec!["orders".to_owned()]));
        assert!(Arc::ptr_eq(
            &route,
            &board.register("orders", String::new(), None)
        ));
        route.booked(5, 1, 0, Some("HTTP 500"));
        let (report, now) = route.report(&RollupDelta::default());
        assert_eq!(
            (report.delivered, report.delta.delivered, report.delta.failed),
            (5, 5, 1)
        );
        assert_eq!(report.last_error.map(|(e, _)| e).as_deref(), Some("HTTP 500"));
        // Written: the next delta starts there.
        route.booked(2, 0, 0, None);
        let (report, _) = route.report(&now);
        assert_eq!(
            (report.delivered, report.delta.delivered, report.delta.failed),
            (7, 2, 0)
        );
    }

    #[test]
    fn a_breaker_reports_since_when_and_why() {
        let route = RouteBoard::default().register("default", "redis".to_owned(), None);
        let down = Instant::now();
        route.breaker(CircuitState::Open, Some((down, "connection refused")));
        let (report, _) = route.report(&RollupDelta::default());
        assert_eq!(report.breaker, BreakerState::Open);
        let since = report.breaker_since.expect("since when");
        assert!((Utc::now() - since).num_seconds() < 5);
        assert_eq!(
            report.last_error.map(|(e, _)| e).as_deref(),
            Some("connection refused")
        );
        route.breaker(CircuitState::Closed, None);
        let (report, _) = route.report(&RollupDelta::default());
        assert_eq!(report.breaker, BreakerState::Closed);
        assert!(
            report.breaker_since.is_some_and(|s| s >= since),
            "closed since then"
        );
    }

    #[tokio::test]
    async fn a_loop_waiting_for_its_route_wakes_when_it_is_resumed() {
        let route = RouteBoard::default().register("default", "redis".to_owned(), None);
        let pause = PausedRoute {
            route: "default".to_owned(),
            paused_at: Utc::now(),
            paused_by: Some("ops".to_owned()),
            reason: None,
        };
        route.honour(Some(&pause));
        assert!(route.is_paused());
        let waiting = {
            let route = Arc::clone(&route);
            tokio::spawn(async move { route.resumed().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        route.honour(None);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken by the resume")
            .unwrap();
    }
}
