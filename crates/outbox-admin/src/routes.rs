//! `GET /routes`: routes → sinks as the relays report them on their
//! heartbeat (`<table>_route_state`): breaker state and since when, the
//! last error, delivered / failed / dead counts, the backlog and oldest
//! waiting event of the aggregate types each route takes, whether it is
//! paused and whether every relay honours that yet; and per minute over
//! the last hour, deliveries and failures from the relays' rollup
//! (`<table>_rollup`), which `outbox cleanup` does not empty. The page
//! refreshes itself.
//!
//! Pause and resume go through a confirmation page, like every change,
//! and are recorded in the audit trail. A pause is a row of
//! `<table>_routes`: relays read it on their heartbeat and answer the
//! route's rows unavailable without calling its sink (no attempt spent).

use std::collections::BTreeMap;

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::html;
use outbox::sql::{PausedRoute, RouteState};
use serde::Serialize;

use crate::actions;
use crate::auth::{self, Access};
use crate::form::Params;
use crate::view::{self, Failure};

/// Rows of relays silent longer than this are not shown: a relay writes
/// its state every heartbeat, a few seconds apart.
const LIVE: std::time::Duration = std::time::Duration::from_secs(60);
/// The charts' span, in minutes.
const MINUTES: i64 = 60;

/// One route as the console shows it: what every live relay reports of
/// it, summed, and the operator's pause.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Route {
    pub(crate) route: String,
    /// Each reporting relay's sink (they agree unless mid-deploy).
    pub(crate) sinks: Vec<String>,
    /// Aggregate types it takes; None: the default route.
    pub(crate) aggregate_types: Option<Vec<String>>,
    /// The worst breaker among the relays: open, half_open, closed.
    pub(crate) breaker: String,
    /// Since when the worst breaker is in that state.
    pub(crate) breaker_since: Option<DateTime<Utc>>,
    /// The operator's pause, if any.
    pub(crate) pause: Option<PausedRoute>,
    /// How many reporting relays say they honour the pause.
    pub(crate) paused_relays: usize,
    /// The relays reporting it.
    pub(crate) relays: Vec<String>,
    pub(crate) delivered: i64,
    pub(crate) failed: i64,
    pub(crate) dead: i64,
    /// The newest last error of any relay, and when.
    pub(crate) last_error: Option<(String, DateTime<Utc>)>,
    /// Waiting events of its aggregate types, and the oldest one's time.
    pub(crate) backlog: i64,
    pub(crate) oldest_waiting: Option<DateTime<Utc>>,
    /// Per minute, oldest first: delivered, failed, dead.
    pub(crate) minutes: Vec<(DateTime<Utc>, i64, i64, i64)>,
}

fn rank(breaker: &str) -> u8 {
    match breaker {
        "open" => 2,
        "half_open" => 1,
        _ => 0,
    }
}

/// Every route a live relay reports or an operator paused, by name.
pub(crate) async fn load(state: &crate::AppState) -> Result<Vec<Route>, Failure> {
    let fail = |what: &'static str| move |e| Failure(what.to_owned(), e);
    let Some(sql) = &state.routes else {
        return Ok(Vec::new());
    };
    let client = state
        .db
        .client()
        .await
        .map_err(fail("connecting to PostgreSQL"))?;
    let states = sql
        .states(&*client, LIVE)
        .await
        .map_err(fail("reading the routes' state"))?;
    let paused = sql
        .paused(&*client)
        .await
        .map_err(fail("reading paused routes"))?;
    let now = Utc::now();
    let since = now - chrono::Duration::minutes(MINUTES);
    let rollup = sql
        .rollup(&*client, since)
        .await
        .map_err(fail("reading the routes' rollup"))?;
    let stats = state
        .sql
        .stats(&*client)
        .await
        .map_err(fail("reading the backlog"))?;

    let mut by_route: BTreeMap<String, Vec<RouteState>> = BTreeMap::new();
    for s in states {
        by_route.entry(s.route.clone()).or_default().push(s);
    }
    for p in &paused {
        by_route.entry(p.route.clone()).or_default();
    }
    let route_of_type = |t: &str| -> Option<String> {
        let named = by_route.iter().find(|(_, rs)| {
            rs.iter().any(|r| {
                r.aggregate_types
                    .as_ref()
                    .is_some_and(|ts| ts.iter().any(|x| x == t))
            })
        });
        let default = by_route
            .iter()
            .find(|(_, rs)| rs.iter().any(|r| r.aggregate_types.is_none()));
        named.or(default).map(|(name, _)| name.clone())
    };
    let mut backlog: BTreeMap<String, (i64, Option<DateTime<Utc>>)> = BTreeMap::new();
    for s in &stats {
        if let Some(route) = route_of_type(&s.aggregate_type) {
            let entry = backlog.entry(route).or_default();
            entry.0 += s.unpublished;
            entry.1 = match (entry.1, s.oldest_unpublished) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
    }
    let routes = by_route
        .into_iter()
        .map(|(route, reports)| {
            let worst = reports.iter().max_by_key(|r| (rank(&r.breaker), r.breaker_since));
            let mut sinks: Vec<String> = reports.iter().map(|r| r.sink.clone()).collect();
            sinks.dedup();
            let last_error = reports
                .iter()
                .filter_map(|r| Some((r.last_error.clone()?, r.last_error_at?)))
                .max_by_key(|(_, at)| *at);
            // One pass over the route's rows, each into its minute's slot.
            let mut counts = vec![(0, 0, 0); MINUTES as usize];
            for r in rollup.iter().filter(|r| r.route == route) {
                if let Some(ago) = minutes_ago(now, r.minute, MINUTES) {
                    counts[MINUTES as usize - 1 - ago] = (r.delivered, r.failed, r.dead);
                }
            }
            let minutes = counts
                .into_iter()
                .enumerate()
                .map(|(i, (delivered, failed, dead))| {
                    (
                        since + chrono::Duration::minutes(i as i64 + 1),
                        delivered,
                        failed,
                        dead,
                    )
                })
                .collect();
            let (waiting, oldest) = backlog.get(&route).copied().unwrap_or_default();
            Route {
                sinks,
                aggregate_types: reports.first().and_then(|r| r.aggregate_types.clone()),
                breaker: worst.map_or_else(|| "unknown".to_owned(), |r| r.breaker.clone()),
                breaker_since: worst.and_then(|r| r.breaker_since),
                pause: paused.iter().find(|p| p.route == route).cloned(),
                paused_relays: reports.iter().filter(|r| r.paused).count(),
                relays: reports.iter().map(|r| r.relay_name.clone()).collect(),
                delivered: reports.iter().map(|r| r.delivered).sum(),
                failed: reports.iter().map(|r| r.failed).sum(),
                dead: reports.iter().map(|r| r.dead).sum(),
                last_error,
                backlog: waiting,
                oldest_waiting: oldest,
                minutes,
                route,
            }
        })
        .collect();
    Ok(routes)
}

/// How many minutes before `now`'s minute `minute` is (0: this one), if
/// fewer than `span`: the slot of a rollup row in a chart of `span`
/// minutes.
pub(crate) fn minutes_ago(now: DateTime<Utc>, minute: DateTime<Utc>, span: i64) -> Option<usize> {
    let ago = now.timestamp().div_euclid(60) - minute.timestamp().div_euclid(60);
    usize::try_from(ago).ok().filter(|a| (*a as i64) < span)
}

/// The per-minute bars of one series, oldest left, as the overview's chart
/// draws them (it takes the newest first).
fn series(route: &Route, pick: impl Fn(&(DateTime<Utc>, i64, i64, i64)) -> i64) -> Vec<i64> {
    route.minutes.iter().rev().map(pick).collect()
}

/// `GET /routes`.
pub(crate) async fn page(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let paused_refresh = Params::query(raw.as_deref()).get("live") == Some("0");
    let routes = load(&state).await?;
    let now = Utc::now();
    let confirm = |action: &str, route: &str| {
        state.frame.href(&format!(
            "/routes/confirm?{}",
            crate::overview::query(&[("action", action), ("route", route)])
        ))
    };
    let body = html! {
        @if routes.is_empty() {
            p.muted #routes-empty { "No live relay reports a route (relays write their routes' state on every heartbeat)." }
        } @else {
            table #routes {
                thead { tr {
                    th { "route" } th { "sink" } th { "aggregate types" } th { "state" } th { "relays" }
                    th.num { "delivered" } th.num { "failed" } th.num { "dead" } th { "waiting" } th { "last error" } th {}
                } }
                tbody {
                    @for r in &routes {
                        tr.route #(format!("route-{}", r.route)) {
                            td.name { (r.route) }
                            td.mono { @for s in &r.sinks { (s) br; } }
                            td { @match &r.aggregate_types { Some(ts) => (ts.join(", ")), None => span.muted { "every other type" } } }
                            td.state {
                                @if let Some(p) = &r.pause {
                                    span.error.paused { "paused" }
                                    " " (view::relative(p.paused_at, now))
                                    @if let Some(by) = &p.paused_by { " by " (by) }
                                    @if let Some(reason) = &p.reason { br; span.muted { (reason) } }
                                    br;
                                    @if r.relays.is_empty() {
                                        span.error.unserved { "no live relay reports this route: nothing honours the pause (relays without leases, the WAL source and fleets never do)" }
                                    } @else if r.paused_relays == r.relays.len() {
                                        span.muted.honoured { "every relay honours it" }
                                    } @else {
                                        span.muted.pending { (r.paused_relays) " of " (r.relays.len()) " relays honour it so far" }
                                    }
                                } @else if r.breaker == "open" {
                                    span.error.breaker { "breaker open" }
                                    @if let Some(t) = r.breaker_since { " since " (view::when(t, now)) }
                                } @else if r.breaker == "half_open" {
                                    span.breaker { "probing" }
                                    @if let Some(t) = r.breaker_since { " since " (view::when(t, now)) }
                                } @else {
                                    span.ok.breaker { "delivering" }
                                }
                            }
                            td { (r.relays.join(", ")) }
                            td.num.delivered { (r.delivered) }
                            td.num.failed { (r.failed) }
                            td.num.dead { (r.dead) }
                            td {
                                (r.backlog)
                                @if let Some(t) = r.oldest_waiting { ", oldest " (view::relative(t, now)) }
                            }
                            td.error { @if let Some((e, at)) = &r.last_error { (e) br; span.muted { (view::relative(*at, now)) } } }
                            td {
                                @if r.pause.is_some() {
                                    a.button #(format!("resume-{}", r.route)) href=(confirm("resume", &r.route)) { "Resume…" }
                                } @else {
                                    a.button.danger #(format!("pause-{}", r.route)) href=(confirm("pause", &r.route)) { "Pause…" }
                                }
                            }
                        }
                    }
                }
            }
            @for r in &routes {
                section.route-chart {
                    h2 { (r.route) ": the last hour" }
                    p.muted {
                        (r.minutes.iter().map(|m| m.1).sum::<i64>()) " delivered, "
                        (r.minutes.iter().map(|m| m.2).sum::<i64>()) " failed attempts, "
                        (r.minutes.iter().map(|m| m.3).sum::<i64>()) " dead letters (per minute, from the relays' rollup)"
                    }
                    (crate::chart::series(&format!("delivered-{}", r.route), "delivered", &series(r, |m| m.1), 60.0))
                    @if r.minutes.iter().any(|m| m.2 + m.3 > 0) {
                        (crate::chart::series(&format!("failed-{}", r.route), "failed", &series(r, |m| m.2 + m.3), 60.0))
                    }
                }
            }
        }
    };
    Ok(view::live_layout("Routes", &access, &state.frame, "/routes", paused_refresh, body).into_response())
}

/// A route name from a form or body: what relays report (an aggregate
/// type, or a name the relay gave it), never empty or huge.
pub(crate) fn route_name(v: Option<&str>) -> Result<&str, String> {
    match v {
        Some(r) if r.len() <= 200 => Ok(r),
        Some(_) => Err("route is longer than 200 characters".to_owned()),
        None => Err("route is required".to_owned()),
    }
}

/// `GET /routes/confirm?action=pause|resume&route=…`: what the change
/// would do, and its form.
pub(crate) async fn confirm(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let bad = |message: &str| {
        view::message_page(
            StatusCode::BAD_REQUEST,
            "Bad request",
            &access,
            &state.frame,
            message,
        )
    };
    let route = match route_name(p.get("route")) {
        Ok(r) => r.to_owned(),
        Err(message) => return Ok(bad(&message)),
    };
    let pause = match p.get("action") {
        Some("pause") => true,
        Some("resume") => false,
        _ => return Ok(bad("action must be pause or resume")),
    };
    let routes = load(&state).await?;
    let found = routes.iter().find(|r| r.route == route);
    let body = html! {
        @match found {
            None => p.error #dry-run { "No live relay reports a route " (route) "; a pause is kept and honoured when relays serving it start." },
            Some(r) if pause => p.message #dry-run {
                "Pausing " strong { (route) } " stops its delivery to " (r.sinks.join(", ")) " within one heartbeat of each of its "
                (r.relays.len()) " relays; " (r.backlog) " waiting events (and every new one) stay in the outbox until it is resumed, spending no attempt."
            },
            Some(r) => p.message #dry-run {
                "Resuming " strong { (route) } " lets its " (r.relays.len()) " relays deliver its " (r.backlog) " waiting events again from their next heartbeat."
            },
        }
        @if !access.may_change() {
            p.error { "This console is read-only: start `outbox admin` with --admin-token to do this." }
        } @else {
            form #route-form method="post" action=(state.frame.href(if pause { "/routes/pause" } else { "/routes/resume" })) {
                input type="hidden" name="csrf" value=(access.csrf());
                input type="hidden" name="route" value=(route);
                @if pause { label { "reason (for the audit trail and the routes page)" input name="reason"; } }
                div.actions {
                    button.danger[pause] #confirm type="submit" { @if pause { "Yes, pause " } @else { "Yes, resume " } (route) }
                    a href=(state.frame.href("/routes")) { "Cancel" }
                }
            }
        }
    };
    let title = if pause {
        "Pause a route?"
    } else {
        "Resume a route?"
    };
    Ok(view::layout(title, &access, &state.frame, body).into_response())
}

/// `POST /routes/pause`.
pub(crate) async fn pause(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    change(&state, &access, &Params::parse(&body), true).await
}

/// `POST /routes/resume`.
pub(crate) async fn resume(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    change(&state, &access, &Params::parse(&body), false).await
}

async fn change(
    state: &crate::AppState,
    access: &Access,
    p: &Params,
    pause: bool,
) -> Result<Response, Failure> {
    if let Some(refused) = auth::refusal(&state.auth, &state.frame, access, p) {
        return Ok(refused);
    }
    let page = |status: StatusCode, message: &str| {
        let body = html! {
            p.message #result { (message) }
            p { a href=(state.frame.href("/routes")) { "Routes" } " · " a href=(state.frame.href("/audit")) { "Audit trail" } }
        };
        (status, view::layout("Routes", access, &state.frame, body)).into_response()
    };
    let route = match route_name(p.get("route")) {
        Ok(r) => r,
        Err(message) => return Ok(page(StatusCode::BAD_REQUEST, &message)),
    };
    let Some(sql) = &state.routes else {
        return Ok(page(StatusCode::NOT_FOUND, "This outbox has no routes table."));
    };
    let done = if pause {
        actions::pause(state, sql, access.who(), route, p.get("reason")).await?
    } else {
        actions::resume(state, sql, access.who(), route).await?
    };
    Ok(match (pause, done.rows) {
        (true, 0) => page(
            StatusCode::CONFLICT,
            &format!("Route {route} was paused already."),
        ),
        (false, 0) => page(StatusCode::CONFLICT, &format!("Route {route} was not paused.")),
        (true, _) => page(
            StatusCode::OK,
            &format!("Paused route {route}: its relays stop delivering it within one heartbeat."),
        ),
        (false, _) => page(
            StatusCode::OK,
            &format!("Resumed route {route}: its relays deliver it again from their next heartbeat."),
        ),
    })
}
