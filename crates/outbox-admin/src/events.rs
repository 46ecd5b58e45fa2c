//! `GET /events`: every event, newest first, filtered by state, aggregate
//! type, event type, aggregate id, creation time and error text, 50 a
//! page; `GET /aggregate?id=…`: one aggregate's events, oldest first, 200
//! a page, its first pending event marked (under strict ordering it holds
//! the rest back). `GET /api/events` and `GET /api/aggregate` answer the
//! same rows as JSON.
//!
//! Pages are keyed on row ids (`before=`/`after=`), never offsets, so a
//! page costs the same on the thousandth page as on the first and rows
//! written meanwhile shift nothing. Each statement walks one index and
//! stops (`outbox::sql::EventsSql`): a list reads at most
//! [`EVENTS_SCAN`] index entries per request, and says where to go on
//! from when that bound, not the page, stopped it.
//!
//! A filter that does not parse is a 422 naming it, never ignored: a list
//! that silently dropped `state=dead` would show every event as if they
//! were the dead letters.

use axum::Extension;
use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use maud::{Markup, html};
use outbox::sql::{
    AggregateEvent, AggregateQuery, EVENTS_SCAN, EventFilter, EventRow, EventState, EventsPage, EventsQuery,
    Keyset,
};
use serde_json::json;

use crate::auth::Access;
use crate::form::Params;
use crate::overview::query;
use crate::view::{self, Failure, Frame};

/// Events a list page shows.
const PAGE: i64 = 50;
/// Events an aggregate page shows.
const AGGREGATE_PAGE: i64 = 200;

/// The filter fields of `/events`, in the order links carry them.
const FILTER_KEYS: [&str; 7] = [
    "state",
    "aggregate_type",
    "event_type",
    "aggregate_id",
    "created_from",
    "created_before",
    "error",
];

/// A list's filters and keyset, parsed from a query string.
#[derive(Debug, Default)]
struct Filters {
    state: Option<EventState>,
    aggregate_type: Option<String>,
    event_type: Option<String>,
    aggregate_id: Option<String>,
    created_from: Option<DateTime<Utc>>,
    created_before: Option<DateTime<Utc>>,
    error: Option<String>,
    keyset: Keyset,
}

impl Filters {
    /// Every field that does not parse is named in the error, not only
    /// the first.
    fn parse(p: &Params) -> Result<Filters, String> {
        let mut problems = Vec::new();
        let text = |key: &str| p.get(key).map(str::to_owned);
        let state = match p.get("state") {
            None | Some("any") => None,
            Some(v) => v
                .parse::<EventState>()
                .map_err(|e| problems.push(format!("state: {e}")))
                .ok(),
        };
        let mut instant = |key: &str| {
            p.get(key).and_then(|v| {
                parse_instant(v)
                    .map_err(|e| problems.push(format!("{key} {v:?}: {e}")))
                    .ok()
            })
        };
        let (created_from, created_before) = (instant("created_from"), instant("created_before"));
        let keyset = keyset(p).map_err(|e| problems.push(e)).unwrap_or_default();
        if !problems.is_empty() {
            return Err(problems.join("; "));
        }
        Ok(Filters {
            state,
            aggregate_type: text("aggregate_type"),
            event_type: text("event_type"),
            aggregate_id: text("aggregate_id"),
            created_from,
            created_before,
            error: text("error"),
            keyset,
        })
    }

    fn filter(&self) -> EventFilter<'_> {
        EventFilter {
            state: self.state,
            aggregate_type: self.aggregate_type.as_deref(),
            event_type: self.event_type.as_deref(),
            aggregate_id: self.aggregate_id.as_deref(),
            created_from: self.created_from,
            created_before: self.created_before,
            error_contains: self.error.as_deref(),
        }
    }

    /// `state "dead", error containing "422"`, or `every event`.
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = self.state {
            parts.push(format!("state {s}"));
        }
        for (what, v) in [
            ("aggregate type", &self.aggregate_type),
            ("event type", &self.event_type),
            ("aggregate id", &self.aggregate_id),
            ("error containing", &self.error),
        ] {
            if let Some(v) = v {
                parts.push(format!("{what} {v:?}"));
            }
        }
        if let Some(t) = self.created_from {
            parts.push(format!("created at or after {}", view::instant(t)));
        }
        if let Some(t) = self.created_before {
            parts.push(format!("created before {}", view::instant(t)));
        }
        if parts.is_empty() {
            "every event".to_owned()
        } else {
            parts.join(", ")
        }
    }
}

/// `before=`/`after=`: a row id, one of them at most.
fn keyset(p: &Params) -> Result<Keyset, String> {
    let id = |key: &str| {
        p.get(key)
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| format!("{key} {v:?} is not a row id (a number)"))
            })
            .transpose()
    };
    match (id("before")?, id("after")?) {
        (None, None) => Ok(Keyset::Start),
        (Some(b), None) => Ok(Keyset::Before(b)),
        (None, Some(a)) => Ok(Keyset::After(a)),
        (Some(_), Some(_)) => Err("give before or after, not both".to_owned()),
    }
}

/// RFC 3339 (`2024-05-01T12:00:00Z`), or a date and time without an
/// offset (`2024-05-01T12:00`, what a browser's datetime field sends) or
/// a date, both read as UTC.
pub(crate) fn parse_instant(v: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(v) {
        return Ok(t.with_timezone(&Utc));
    }
    for format in [
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%dT%H:%M",
        "%Y-%m-%d %H:%M:%S",
        "%Y-%m-%d %H:%M",
    ] {
        if let Ok(t) = NaiveDateTime::parse_from_str(v, format) {
            return Ok(t.and_utc());
        }
    }
    NaiveDate::parse_from_str(v, "%Y-%m-%d")
        .ok()
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .map(|t| t.and_utc())
        .ok_or_else(|| "not a time: give RFC 3339 (2024-05-01T12:00:00Z), or a UTC date and time".to_owned())
}

/// The filters as typed, for links and the form.
fn typed_filters(p: &Params) -> Vec<(&'static str, String)> {
    FILTER_KEYS
        .iter()
        .filter_map(|k| p.get(k).map(|v| (*k, v.to_owned())))
        .collect()
}

/// `path?pairs` under the outbox's prefix.
fn link(frame: &Frame, path: &str, pairs: &[(&str, String)]) -> String {
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    frame.href(&format!("{path}?{}", query(&pairs)))
}

/// `{"error": message}` with `status`.
fn problem(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

/// A failed statement as a 500 JSON answer, logged.
fn json_failure(f: Failure) -> Response {
    let Failure(what, e) = f;
    let chain = view::error_chain(&e);
    tracing::error!(error = %chain, "admin api: {what}");
    problem(StatusCode::INTERNAL_SERVER_ERROR, &format!("{what}: {chain}"))
}

async fn list_page(state: &crate::AppState, filters: &Filters) -> Result<EventsPage<EventRow>, Failure> {
    let client = state
        .db
        .client()
        .await
        .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
    let q = EventsQuery {
        filter: filters.filter(),
        keyset: filters.keyset,
        limit: PAGE,
        scan: EVENTS_SCAN,
    };
    state
        .events
        .list_events(&*client, &q)
        .await
        .map_err(|e| Failure("listing events".into(), e))
}

/// `GET /events`.
pub(crate) async fn list(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let frame = &state.frame;
    let typed = typed_filters(&p);
    let filters = match Filters::parse(&p) {
        Ok(f) => f,
        Err(message) => {
            let body = html! {
                p.error #problem { "Bad filter: " (message) }
                (form(frame, &typed))
            };
            return Ok((
                StatusCode::UNPROCESSABLE_ENTITY,
                view::layout("Events", &access, frame, body),
            )
                .into_response());
        }
    };
    let page = list_page(&state, &filters).await?;
    let now = Utc::now();
    let bound = |key: &str, id: i64| {
        let mut pairs = typed.clone();
        pairs.push((if key == "before" { "before" } else { "after" }, id.to_string()));
        link(frame, "/events", &pairs)
    };
    // The scan bound, not the page, stopped the walk.
    let short = page.events.len() < usize::try_from(PAGE).unwrap_or(usize::MAX) && page.next.is_some();
    let body = html! {
        (form(frame, &typed))
        p #events-count {
            (page.events.len()) " events shown (" (filters.describe()) ")"
            @match filters.keyset {
                Keyset::Start => {},
                Keyset::Before(id) => { ", older than row " (id) },
                Keyset::After(id) => { ", newer than row " (id) },
            }
            "."
        }
        @if short {
            p.muted #scan-bound {
                "Searched " (EVENTS_SCAN) " events without filling the page: older events may match."
            }
        }
        @if page.events.is_empty() {
            p.muted #no-events { "No events here." }
        } @else {
            table #events {
                thead { tr {
                    th { "id" } th { "event type" } th { "aggregate" } th { "created" } th { "state" } th { "last error" }
                } }
                tbody {
                    @for e in &page.events {
                        tr.event #(format!("event-{}", e.id)) {
                            td.id { a href=(frame.href(&format!("/event?id={}", e.id))) { (e.id) } }
                            td.type { (e.event_type) }
                            td.aggregate {
                                (e.aggregate_type) " / "
                                a.aggregate-link href=(aggregate_href(frame, &e.aggregate_id, Some(&e.aggregate_type))) { (e.aggregate_id) }
                            }
                            td { (view::when(e.created_at, now)) }
                            td.state { (state_cell(e, now)) }
                            td.error { (e.last_error.as_deref().unwrap_or("")) }
                        }
                    }
                }
            }
        }
        p.pager {
            @if let Some(id) = page.prev { a #newer href=(bound("after", id)) { "← newer" } " " }
            @if let Some(id) = page.next { a #older href=(bound("before", id)) { "older →" } }
        }
    };
    Ok(view::layout("Events", &access, frame, body).into_response())
}

/// `GET /api/events`: the rows of `/events` as JSON.
pub(crate) async fn api_list(State(state): State<crate::State>, RawQuery(raw): RawQuery) -> Response {
    let p = Params::query(raw.as_deref());
    let filters = match Filters::parse(&p) {
        Ok(f) => f,
        Err(message) => return problem(StatusCode::UNPROCESSABLE_ENTITY, &message),
    };
    match list_page(&state, &filters).await {
        Ok(page) => Json(page).into_response(),
        Err(f) => json_failure(f),
    }
}

/// The filter form, with the values as typed.
fn form(frame: &Frame, typed: &[(&str, String)]) -> Markup {
    let value = |key: &str| {
        typed
            .iter()
            .find(|(k, _)| *k == key)
            .map_or("", |(_, v)| v.as_str())
            .to_owned()
    };
    let chosen = value("state");
    html! {
        form.filters #events-filters method="get" action=(frame.href("/events")) {
            label { "state "
                select name="state" {
                    option value="" { "any" }
                    @for s in EventState::ALL {
                        option value=(s.as_str()) selected[chosen == s.as_str()] { (s.as_str()) }
                    }
                }
            }
            label { "aggregate type" input name="aggregate_type" value=(value("aggregate_type")); }
            label { "event type" input name="event_type" value=(value("event_type")); }
            label { "aggregate id" input name="aggregate_id" value=(value("aggregate_id")); }
            label { "created from" input name="created_from" placeholder="2024-05-01T12:00:00Z" value=(value("created_from")); }
            label { "created before" input name="created_before" placeholder="2024-05-01T13:00:00Z" value=(value("created_before")); }
            label { "error contains" input name="error" value=(value("error")); }
            button type="submit" { "Filter" }
            a href=(frame.href("/events")) { "Clear" }
        }
    }
}

/// Where an event stands, with the time that goes with it.
fn state_cell(e: &EventRow, now: DateTime<Utc>) -> Markup {
    html! {
        @match e.state {
            EventState::Delivered => {
                span.ok { "delivered" }
                @if let Some(t) = e.published_at { " " (view::when(t, now)) }
            },
            EventState::GivenUp => {
                span.error { "given up" }
                @if let Some(t) = e.given_up_at { " " (view::when(t, now)) }
                " after " (e.attempts) " attempts"
            },
            EventState::Dead => {
                span.error { "dead letter" }
                @if let Some(t) = e.dead_at { " since " (view::when(t, now)) }
                " after " (e.attempts) " attempts"
            },
            EventState::Retrying => {
                "retrying: " (e.attempts) " failed attempts, next " (view::when(e.next_attempt_at, now))
            },
            _ => {
                "waiting"
                @if e.next_attempt_at > now { ", due " (view::when(e.next_attempt_at, now)) }
            },
        }
    }
}

fn aggregate_href(frame: &Frame, aggregate_id: &str, aggregate_type: Option<&str>) -> String {
    let mut pairs = vec![("id", aggregate_id.to_owned())];
    pairs.extend(aggregate_type.map(|t| ("type", t.to_owned())));
    link(frame, "/aggregate", &pairs)
}

/// An aggregate page's query: its id (required), type and keyset.
struct AggregateArgs {
    id: String,
    aggregate_type: Option<String>,
    keyset: Keyset,
}

impl AggregateArgs {
    fn parse(p: &Params) -> Result<AggregateArgs, String> {
        let keyset = keyset(p);
        let Some(id) = p.get("id") else {
            return Err("give the aggregate id: /aggregate?id=…".to_owned());
        };
        Ok(AggregateArgs {
            id: id.to_owned(),
            aggregate_type: p.get("type").map(str::to_owned),
            keyset: keyset?,
        })
    }

    fn query(&self) -> AggregateQuery<'_> {
        AggregateQuery {
            aggregate_id: &self.id,
            aggregate_type: self.aggregate_type.as_deref(),
            keyset: self.keyset,
            limit: AGGREGATE_PAGE,
        }
    }

    fn describe(&self) -> String {
        match &self.aggregate_type {
            Some(t) => format!("{t} / {}", self.id),
            None => self.id.clone(),
        }
    }
}

/// One page of an aggregate, None if it has no events at all.
async fn aggregate_page(
    state: &crate::AppState,
    args: &AggregateArgs,
) -> Result<Option<EventsPage<AggregateEvent>>, Failure> {
    let client = state
        .db
        .client()
        .await
        .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
    let page = state
        .events
        .aggregate_events(&*client, &args.query())
        .await
        .map_err(|e| Failure("reading the aggregate's events".into(), e))?;
    Ok((!page.events.is_empty() || args.keyset != Keyset::Start).then_some(page))
}

/// `GET /aggregate`.
pub(crate) async fn aggregate(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let frame = &state.frame;
    let args = match AggregateArgs::parse(&p) {
        Ok(a) => a,
        Err(message) => {
            return Ok(view::message_page(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Aggregate",
                &access,
                frame,
                &message,
            ));
        }
    };
    let Some(page) = aggregate_page(&state, &args).await? else {
        return Ok(view::message_page(
            StatusCode::NOT_FOUND,
            "Aggregate",
            &access,
            frame,
            &format!(
                "No events of aggregate {} in {}: never written, or delivered and removed by `outbox cleanup`.",
                args.describe(),
                state.outbox.display_name()
            ),
        ));
    };
    let now = Utc::now();
    let bound = |key: &'static str, id: i64| {
        let mut pairs = vec![("id", args.id.clone())];
        pairs.extend(args.aggregate_type.clone().map(|t| ("type", t)));
        pairs.push((key, id.to_string()));
        link(frame, "/aggregate", &pairs)
    };
    // Each aggregate type's first pending event, wherever it is.
    let mut blockers: Vec<(&str, i64)> = Vec::new();
    for e in &page.events {
        if let Some(first) = e.first_pending
            && !blockers.iter().any(|(t, _)| *t == e.event.aggregate_type)
        {
            blockers.push((&e.event.aggregate_type, first));
        }
    }
    let title = format!("Aggregate {}", args.describe());
    let body = html! {
        div #blocker {
            @if blockers.is_empty() {
                p { "Nothing of this aggregate waits: every event on this page is delivered or given up on." }
            }
            @for (t, first) in &blockers {
                p.verdict {
                    "Event " a href=(frame.href(&format!("/event?id={first}"))) { (first) } " (" (t) ") is the first not delivered and not given up on: "
                    "relays with --ordering strict (or --ordering-for " (t) "=strict) deliver the later ones only after it."
                }
            }
        }
        table #aggregate-events {
            thead { tr {
                th { "id" } th { "event type" } th { "aggregate type" } th { "created" } th { "state" } th { "last error" }
            } }
            tbody {
                @for a in &page.events {
                    @let e = &a.event;
                    @let held = a.first_pending.is_some_and(|f| f < e.id)
                        && !matches!(e.state, EventState::Delivered | EventState::GivenUp);
                    tr.event.blocker[a.blocker] .held[held] #(format!("event-{}", e.id)) {
                        td.id { a href=(frame.href(&format!("/event?id={}", e.id))) { (e.id) } }
                        td.type { (e.event_type) }
                        td { (e.aggregate_type) }
                        td { (view::when(e.created_at, now)) }
                        td.state {
                            (state_cell(e, now))
                            @if a.blocker { br; strong.error.mark { "first pending: holds the rest back" } }
                            @if held { br; span.muted.mark { "held back behind " (a.first_pending.unwrap_or_default()) } }
                        }
                        td.error { (e.last_error.as_deref().unwrap_or("")) }
                    }
                }
            }
        }
        p.pager {
            @if let Some(id) = page.prev { a #earlier href=(bound("before", id)) { "← earlier" } " " }
            @if let Some(id) = page.next { a #later href=(bound("after", id)) { "later →" } }
        }
        p { a href=(link(frame, "/events", &[("aggregate_id", args.id.clone())])) { "These events in the list" } }
    };
    Ok(view::layout(&title, &access, frame, body).into_response())
}

/// `GET /api/aggregate`: the rows of `/aggregate` as JSON.
pub(crate) async fn api_aggregate(State(state): State<crate::State>, RawQuery(raw): RawQuery) -> Response {
    let p = Params::query(raw.as_deref());
    let args = match AggregateArgs::parse(&p) {
        Ok(a) => a,
        Err(message) => return problem(StatusCode::UNPROCESSABLE_ENTITY, &message),
    };
    match aggregate_page(&state, &args).await {
        Ok(Some(page)) => Json(page).into_response(),
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            &format!("no events of aggregate {}", args.describe()),
        ),
        Err(f) => json_failure(f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_parse_or_name_every_problem() {
        let p = Params::parse(b"state=dead&aggregate_type=orders&created_from=2024-05-01&after=7");
        let f = Filters::parse(&p).unwrap();
        assert_eq!(f.state, Some(EventState::Dead));
        assert_eq!(f.keyset, Keyset::After(7));
        assert_eq!(f.created_from, Some("2024-05-01T00:00:00Z".parse().unwrap()));
        let p = Params::parse(b"state=nope&created_before=yesterday&before=x");
        let e = Filters::parse(&p).unwrap_err();
        assert!(e.contains("unknown state \"nope\""), "{e}");
        assert!(e.contains("created_before \"yesterday\""), "{e}");
        assert!(e.contains("before \"x\" is not a row id"), "{e}");
        assert_eq!(
            parse_instant("2024-05-01T12:30").unwrap(),
            "2024-05-01T12:30:00Z".parse::<DateTime<Utc>>().unwrap()
        );
        assert!(
            Filters::parse(&Params::parse(b"state=any"))
                .unwrap()
                .state
                .is_none()
        );
    }
}
