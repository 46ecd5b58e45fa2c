//! `GET /dead`: dead letters, a page at a time, filtered by aggregate type,
//! event type, error text and age, each with its payload, headers,
//! attempts, last error and timestamps. Its actions are `outbox dlq
//! requeue` and `outbox dlq give-up`, through the same typed statements:
//! `GET /dead/confirm` shows the dry-run count ("N dead letters will be
//! requeued"), and only its form posts the change (`POST /dead/requeue`,
//! `POST /dead/give-up`), with the session's CSRF token. A requeue or a
//! give-up then notifies the relays, like the CLI.
//!
//! The confirmation carries the selection with absolute instants (an age
//! filter becomes `dead_before`/`dead_after`), so the change touches what
//! was counted, give or take rows that died or were requeued in between:
//! the result page says how many it changed.

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use outbox::sql::{DeadFilter, DeadPage};

use crate::actions;
use crate::auth::{self, Access};
use crate::form::Params;
use crate::overview::query;
use crate::view::{self, Failure};

const PAGE: i64 = 50;
const MAX_PAGE: i64 = 500;

/// Which dead letters an action or a page is about.
#[derive(Debug, Default)]
pub(crate) struct Selection {
    pub(crate) ids: Vec<i64>,
    aggregate_type: Option<String>,
    event_type: Option<String>,
    error: Option<String>,
    dead_before: Option<DateTime<Utc>>,
    dead_after: Option<DateTime<Utc>>,
}

impl Selection {
    /// The filters of a form: `older_than`/`newer_than` are ages
    /// (humantime, `5m`), `dead_before`/`dead_after` instants (RFC 3339).
    pub(crate) fn filters(p: &Params, now: DateTime<Utc>) -> Result<Selection, String> {
        let age = |key: &str| -> Result<Option<DateTime<Utc>>, String> {
            p.get(key)
                .map(|v| {
                    let d = humantime::parse_duration(v)
                        .map_err(|e| format!("{key} {v:?}: {e} (e.g. 90s, 5m, 2h)"))?;
                    chrono::Duration::from_std(d)
                        .ok()
                        .and_then(|d| now.checked_sub_signed(d))
                        .ok_or_else(|| format!("{key} {v:?} is too long"))
                })
                .transpose()
        };
        let instant = |key: &str| -> Result<Option<DateTime<Utc>>, String> {
            p.get(key)
                .map(|v| {
                    DateTime::parse_from_rfc3339(v)
                        .map(|t| t.with_timezone(&Utc))
                        .map_err(|e| format!("{key} {v:?}: {e}"))
                })
                .transpose()
        };
        // A confirmation posts instants; an instant wins over an age.
        Ok(Selection {
            ids: Vec::new(),
            aggregate_type: p.get("aggregate_type").map(str::to_owned),
            event_type: p.get("event_type").map(str::to_owned),
            error: p.get("error").map(str::to_owned),
            dead_before: instant("dead_before")?.or(age("older_than")?),
            dead_after: instant("dead_after")?.or(age("newer_than")?),
        })
    }

    /// The checked rows of a form.
    pub(crate) fn selected(p: &Params) -> Result<Selection, String> {
        let ids = p
            .all("id")
            .map(|v| v.parse::<i64>().map_err(|_| format!("id {v:?} is not a row id")))
            .collect::<Result<Vec<_>, _>>()?;
        if ids.is_empty() {
            return Err("Select at least one dead letter (the checkboxes of the list).".to_owned());
        }
        Ok(Selection {
            ids,
            ..Selection::default()
        })
    }

    /// For the audit trail: the ids, or the filters with instants.
    pub(crate) fn detail(&self) -> serde_json::Value {
        if !self.ids.is_empty() {
            return serde_json::json!({ "ids": self.ids });
        }
        serde_json::json!({
            "aggregate_type": self.aggregate_type,
            "event_type": self.event_type,
            "error": self.error,
            "dead_before": self.dead_before.map(|t| t.to_rfc3339()),
            "dead_after": self.dead_after.map(|t| t.to_rfc3339()),
        })
    }

    pub(crate) fn filter(&self) -> DeadFilter<'_> {
        DeadFilter {
            ids: (!self.ids.is_empty()).then_some(self.ids.as_slice()),
            aggregate_type: self.aggregate_type.as_deref(),
            error_contains: self.error.as_deref(),
            event_type: self.event_type.as_deref(),
            dead_before: self.dead_before,
            dead_after: self.dead_after,
        }
    }

    /// The selection as hidden fields, instants absolute.
    fn hidden(&self) -> Markup {
        html! {
            @for id in &self.ids { input type="hidden" name="id" value=(id); }
            @if let Some(v) = &self.aggregate_type { input type="hidden" name="aggregate_type" value=(v); }
            @if let Some(v) = &self.event_type { input type="hidden" name="event_type" value=(v); }
            @if let Some(v) = &self.error { input type="hidden" name="error" value=(v); }
            @if let Some(v) = self.dead_before { input type="hidden" name="dead_before" value=(v.to_rfc3339()); }
            @if let Some(v) = self.dead_after { input type="hidden" name="dead_after" value=(v.to_rfc3339()); }
        }
    }

    /// For people and the log: `ids [1, 2]`, `aggregate type "orders",
    /// error containing "422"`, or `every dead letter`.
    pub(crate) fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.ids.is_empty() {
            parts.push(format!("ids {:?}", self.ids));
        }
        if let Some(v) = &self.aggregate_type {
            parts.push(format!("aggregate type {v:?}"));
        }
        if let Some(v) = &self.event_type {
            parts.push(format!("event type {v:?}"));
        }
        if let Some(v) = &self.error {
            parts.push(format!("error containing {v:?}"));
        }
        if let Some(v) = self.dead_before {
            parts.push(format!("dead at or before {}", view::instant(v)));
        }
        if let Some(v) = self.dead_after {
            parts.push(format!("dead at or after {}", view::instant(v)));
        }
        if parts.is_empty() {
            "every dead letter".to_owned()
        } else {
            parts.join(", ")
        }
    }
}

/// The actions of the list's form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    RequeueSelected,
    RequeueFiltered,
    GiveUpSelected,
}

impl Action {
    fn parse(v: Option<&str>) -> Option<Action> {
        match v? {
            "requeue-selected" => Some(Action::RequeueSelected),
            "requeue-filtered" => Some(Action::RequeueFiltered),
            "give-up-selected" => Some(Action::GiveUpSelected),
            _ => None,
        }
    }
}

fn bad_request(state: &crate::AppState, access: &Access, message: &str) -> Response {
    view::message_page(
        StatusCode::BAD_REQUEST,
        "Bad request",
        access,
        &state.frame,
        message,
    )
}

/// `GET /dead`.
pub(crate) async fn list(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let now = Utc::now();
    let selection = match Selection::filters(&p, now) {
        Ok(s) => s,
        Err(message) => return Ok(bad_request(&state, &access, &message)),
    };
    let after_id = p.get("after").and_then(|v| v.parse().ok()).unwrap_or(0_i64);
    let limit = p
        .get("limit")
        .and_then(|v| v.parse().ok())
        .unwrap_or(PAGE)
        .clamp(1, MAX_PAGE);
    let client = state
        .db
        .client()
        .await
        .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
    let page = DeadPage {
        filter: selection.filter(),
        after_id,
        limit,
    };
    let rows = state
        .sql
        .dead_page(&*client, &page)
        .await
        .map_err(|e| Failure("listing dead letters".into(), e))?;
    let total = state
        .sql
        .count_dead(&*client, &selection.filter())
        .await
        .map_err(|e| Failure("counting dead letters".into(), e))?;
    // The filters as typed, for the form and the next page's link.
    let typed = |key: &str| p.get(key).unwrap_or("").to_owned();
    let next = rows.last().filter(|_| rows.len() as i64 == limit).map(|last| {
        let keys = [
            "aggregate_type",
            "event_type",
            "error",
            "older_than",
            "newer_than",
        ];
        let mut pairs: Vec<(&str, String)> = keys
            .iter()
            .map(|k| (*k, typed(k)))
            .filter(|(_, v)| !v.is_empty())
            .collect();
        pairs.push(("after", last.id.to_string()));
        pairs.push(("limit", limit.to_string()));
        let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        state.frame.href(&format!("/dead?{}", query(&pairs)))
    });
    let body = html! {
        form.filters method="get" action=(state.frame.href("/dead")) {
            label { "aggregate type" input name="aggregate_type" value=(typed("aggregate_type")); }
            label { "event type" input name="event_type" value=(typed("event_type")); }
            label { "error contains" input name="error" value=(typed("error")); }
            label { "dead for at least" input name="older_than" placeholder="5m" value=(typed("older_than")); }
            label { "dead for at most" input name="newer_than" placeholder="1h" value=(typed("newer_than")); }
            button type="submit" { "Filter" }
            a href=(state.frame.href("/dead")) { "Clear" }
        }
        p #dead-count { (view::dead_letters(total)) " match (" (selection.describe()) ")" @if after_id > 0 { ", after id " (after_id) } "." }
        @if rows.is_empty() {
            p.muted { "No dead letters here." }
        } @else {
            form #dead-form method="get" action=(state.frame.href("/dead/confirm")) {
                (selection.hidden())
                div.actions {
                    button type="submit" name="action" value="requeue-selected" { "Requeue selected…" }
                    button.secondary type="submit" name="action" value="requeue-filtered" { "Requeue all " (total) " filtered…" }
                    button.danger type="submit" name="action" value="give-up-selected" { "Give up on selected…" }
                    @if !access.may_change() { span.muted { "(read-only: the next page shows the count only)" } }
                }
                table #dead-letters {
                    thead { tr {
                        th {} th { "id" } th { "aggregate" } th { "event type" } th.num { "attempts" }
                        th { "created" } th { "dead since" } th { "last error" }
                    } }
                    tbody {
                        @for d in &rows {
                            tr.dead #(format!("dead-{}", d.id)) {
                                td { input type="checkbox" name="id" value=(d.id) aria-label=(format!("select {}", d.id)); }
                                td { a href=(state.frame.href(&format!("/event?id={}", d.id))) { (d.id) } }
                                td { (d.aggregate_type) " / " (d.aggregate_id) }
                                td { (d.event_type) }
                                td.num { (d.attempts) }
                                td { (view::when(d.created_at, now)) }
                                td {
                                    @if let Some(t) = d.dead_at { (view::when(t, now)) }
                                    @if let Some(t) = d.given_up_at { br; span.muted { "given up " (view::relative(t, now)) } }
                                }
                                td.error { (d.last_error.as_deref().unwrap_or("")) }
                            }
                            tr.payload {
                                td {}
                                td colspan="7" {
                                    details {
                                        summary { "event " span.mono { (d.event_id) } ": payload and headers" }
                                        p.muted { "payload" }
                                        pre.payload { (view::json(&d.payload)) }
                                        p.muted { "headers" }
                                        pre.headers { (view::json(&d.headers)) }
                                        p.muted { "next attempt was due " (view::when(d.next_attempt_at, now)) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            @if let Some(next) = next { p { a #next-page href=(next) { "Next page →" } } }
        }
        h2 { "Purge given-up dead letters" }
        form.filters #purge method="get" action=(state.frame.href("/dead/purge")) {
            label { "given up on more than" input name="older_than" placeholder="30d" value="30d"; }
            button.secondary type="submit" { "Count…" }
            span.muted { "the next page counts them; nothing is deleted before you confirm" }
        }
    };
    Ok(view::layout("Dead letters", &access, &state.frame, body).into_response())
}

/// `GET /dead/confirm`: the dry run. Counts what the action would change
/// and offers the form that does it.
pub(crate) async fn confirm(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let Some(action) = Action::parse(p.get("action")) else {
        return Ok(bad_request(
            &state,
            &access,
            "Unknown action: choose requeue or give up on the dead-letter list.",
        ));
    };
    let selection = match action {
        Action::RequeueFiltered => Selection::filters(&p, Utc::now()),
        Action::RequeueSelected | Action::GiveUpSelected => Selection::selected(&p),
    };
    let selection = match selection {
        Ok(s) => s,
        Err(message) => return Ok(bad_request(&state, &access, &message)),
    };
    let client = state
        .db
        .client()
        .await
        .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
    let (count, (verb, done), target) = match action {
        Action::RequeueSelected | Action::RequeueFiltered => (
            state.sql.count_dead(&*client, &selection.filter()).await,
            ("requeue", "requeued"),
            state.frame.href("/dead/requeue"),
        ),
        Action::GiveUpSelected => (
            state.sql.count_give_up(&*client, &selection.ids).await,
            ("give up on", "given up on"),
            state.frame.href("/dead/give-up"),
        ),
    };
    let count = count.map_err(|e| Failure("counting dead letters".into(), e))?;
    let body = html! {
        p.message #dry-run { (view::dead_letters(count)) " will be " (done) "." }
        p.muted { "Selection: " (selection.describe()) "." }
        @if action == Action::GiveUpSelected {
            p.muted { "Given-up dead letters stay for inspection but no longer hold their aggregate back under --ordering strict." }
        } @else {
            p.muted { "Requeued rows get attempts = 0 and are due now; their last error stays for the record. The relays are notified." }
        }
        @if !access.may_change() {
            p.error { "This console is read-only: start `outbox admin` with --admin-token to do this." }
        } @else if count > 0 {
            form #confirm-form method="post" action=(target) {
                input type="hidden" name="csrf" value=(access.csrf());
                input type="hidden" name="scope" value=(if action == Action::RequeueFiltered { "filtered" } else { "selected" });
                (selection.hidden())
                div.actions {
                    button #confirm type="submit" { "Yes, " (verb) " " (view::dead_letters(count)) }
                    a href=(state.frame.href("/dead")) { "Cancel" }
                }
            }
        }
        p { a href=(state.frame.href("/dead")) { "Back to the dead letters" } }
    };
    let title = if action == Action::GiveUpSelected {
        "Give up?"
    } else {
        "Requeue?"
    };
    Ok(view::layout(title, &access, &state.frame, body).into_response())
}

/// `POST /dead/requeue`.
pub(crate) async fn requeue(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let p = Params::parse(&body);
    if let Some(refused) = auth::refusal(&state.auth, &state.frame, &access, &p) {
        return Ok(refused);
    }
    // An explicit scope, so a body that lost its ids never widens to
    // every dead letter.
    let selection = match p.get("scope") {
        Some("selected") => Selection::selected(&p),
        Some("filtered") => Selection::filters(&p, Utc::now()),
        _ => {
            Err("scope must be \"selected\" (with id fields) or \"filtered\" (with filter fields)".to_owned())
        }
    };
    let selection = match selection {
        Ok(s) => s,
        Err(message) => return Ok(bad_request(&state, &access, &message)),
    };
    let n = actions::requeue(&state, access.who(), &selection).await?.rows;
    Ok(done(
        &state,
        &access,
        n,
        &format!("Requeued {} ({}).", view::dead_letters(n), selection.describe()),
    ))
}

/// `POST /dead/give-up`.
pub(crate) async fn give_up(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let p = Params::parse(&body);
    if let Some(refused) = auth::refusal(&state.auth, &state.frame, &access, &p) {
        return Ok(refused);
    }
    let selection = match Selection::selected(&p) {
        Ok(s) => s,
        Err(message) => return Ok(bad_request(&state, &access, &message)),
    };
    // The aggregates' later events may be claimable now: the change
    // notifies the relays.
    let n = actions::give_up(&state, access.who(), &selection).await?.rows;
    Ok(done(
        &state,
        &access,
        n,
        &format!("Gave up on {} ({}).", view::dead_letters(n), selection.describe()),
    ))
}

/// The result of a change of `n` rows: 404 when nothing matched any more,
/// as the CLI exits 1 then, so a script posting the form can tell.
fn done(state: &crate::AppState, access: &Access, n: u64, message: &str) -> Response {
    let status = if n == 0 {
        StatusCode::NOT_FOUND
    } else {
        StatusCode::OK
    };
    let body = html! {
        p.message #result { (message) }
        p {
            a href=(state.frame.href("/")) { "Overview" } " · "
            a href=(state.frame.href("/dead")) { "Dead letters" } " · "
            a href=(state.frame.href("/audit")) { "Audit trail" }
        }
    };
    (status, view::layout("Done", access, &state.frame, body)).into_response()
}

/// The purge form's age: whole days (`30`), or a humantime age (`12h`),
/// and the instant that far back.
pub(crate) fn purge_age(v: Option<&str>) -> Result<(std::time::Duration, DateTime<Utc>), String> {
    let v = v.ok_or("older_than is required: how long ago the rows were given up on (e.g. 30d)")?;
    let parsed = match v.parse::<u64>() {
        Ok(days) => Ok(std::time::Duration::from_secs(days.saturating_mul(86_400))),
        Err(_) => humantime::parse_duration(v),
    };
    let age = parsed.map_err(|e| format!("older_than {v:?}: {e} (e.g. 30d, 12h)"))?;
    let before = chrono::Duration::from_std(age)
        .ok()
        .and_then(|d| Utc::now().checked_sub_signed(d))
        .ok_or_else(|| format!("older_than {v:?} is too long"))?;
    Ok((age, before))
}

/// `GET /dead/purge?older_than=30d`: the dry run of a purge of given-up
/// dead letters, and the form that does it with the cutoff fixed.
pub(crate) async fn purge_confirm(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let (age, before) = match purge_age(p.get("older_than")) {
        Ok(cutoff) => cutoff,
        Err(message) => return Ok(bad_request(&state, &access, &message)),
    };
    let client = state
        .db
        .client()
        .await
        .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
    let count = state
        .sql
        .count_purge_given_up(&*client, age)
        .await
        .map_err(|e| Failure("counting given-up dead letters".into(), e))?;
    let body = html! {
        p.message #dry-run { (view::dead_letters(count)) " given up on before " (view::instant(before)) " will be deleted." }
        p.muted { "Deleted rows are gone: their payloads cannot be requeued or inspected any more. The audit trail records who purged how many." }
        @if !access.may_change() {
            p.error { "This console is read-only: start `outbox admin` with --admin-token to do this." }
        } @else if count > 0 {
            form #purge-form method="post" action=(state.frame.href("/dead/purge")) {
                input type="hidden" name="csrf" value=(access.csrf());
                input type="hidden" name="before" value=(before.to_rfc3339());
                div.actions {
                    button.danger #confirm type="submit" { "Yes, delete " (view::dead_letters(count)) }
                    a href=(state.frame.href("/dead")) { "Cancel" }
                }
            }
        }
        p { a href=(state.frame.href("/dead")) { "Back to the dead letters" } }
    };
    Ok(view::layout("Purge given-up dead letters?", &access, &state.frame, body).into_response())
}

/// `POST /dead/purge`: deletes what the dry run counted (`before`, an
/// instant), plus rows given up on in between that are older than it.
pub(crate) async fn purge(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let p = Params::parse(&body);
    if let Some(refused) = auth::refusal(&state.auth, &state.frame, &access, &p) {
        return Ok(refused);
    }
    let before = match p.get("before").map(DateTime::parse_from_rfc3339) {
        Some(Ok(t)) => t.with_timezone(&Utc),
        _ => {
            return Ok(bad_request(
                &state,
                &access,
                "before must be an RFC 3339 instant: open the purge's dry run from the dead-letter list",
            ));
        }
    };
    let n = actions::purge(&state, access.who(), before).await?.rows;
    Ok(done(
        &state,
        &access,
        n,
        &format!(
            "Deleted {} given up on before {}.",
            view::dead_letters(n),
            view::instant(before)
        ),
    ))
}
