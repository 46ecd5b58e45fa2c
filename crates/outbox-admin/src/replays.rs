//! `/replays`: the replay jobs (`<table>_replays`), newest first, with
//! their progress (acknowledged of matched, cursor of bound), state,
//! whether a process runs them now (it holds the job's advisory lock) and
//! why one stopped; live while one runs. And the forms that act on them,
//! each a confirmation first: start a job (`POST /replays/check` shows
//! its dry run, `POST /replays/start` starts it), resume a stopped or
//! failed one (`GET`, then `POST /replays/resume`) and cancel one this
//! console runs (`POST /replays/cancel`). `jobs` runs them.

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use outbox::sql::{ReplayJob, ReplayState};

use crate::auth::{self, Access};
use crate::form::Params;
use crate::jobs::{JobError, NewJob};
use crate::view::{self, Failure};

/// `GET /replays`.
pub(crate) async fn page(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let paused = Params::query(raw.as_deref()).get("live") == Some("0");
    let jobs = match &state.replays {
        None => Vec::new(),
        Some(sql) => {
            let client = state
                .db
                .client()
                .await
                .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
            sql.jobs(&*client)
                .await
                .map_err(|e| Failure("listing replay jobs".into(), e))?
        }
    };
    let label = state.outbox.display_name();
    let now = chrono::Utc::now();
    let can_run = access.may_change() && state.runner.enabled();
    let body = html! {
        p.muted {
            "Jobs of " code { "outbox replay" } " and of this console. A job re-delivers published events in id order, "
            "at least once, with their original event ids; its cursor is saved after each acknowledged page, so a "
            "stopped, failed or orphaned job resumes where it was."
        }
        @if jobs.is_empty() {
            p.muted #replays-empty { "No replay job yet." }
        } @else {
            table #replays {
                thead { tr {
                    th.num { "id" } th { "target" } th { "filter" } th { "state" } th { "progress" }
                    th.num { "rate/s" } th { "created" } th { "last error" } th {}
                } }
                tbody {
                    @for j in &jobs {
                        (row(&state, &access, j, state.runner.runs(&label, j.id), can_run, now))
                    }
                }
            }
        }
        @if can_run {
            (start_form(&state, &access))
        } @else if !access.may_change() {
            p.muted { "This console is read-only: start " code { "outbox admin" } " with --admin-token to start, cancel and resume replays." }
        }
    };
    let running = jobs.iter().any(|j| j.state == ReplayState::Running && j.live);
    let page = if running || paused {
        view::live_layout("Replays", &access, &state.frame, "/replays", paused, body)
    } else {
        view::layout("Replays", &access, &state.frame, body)
    };
    Ok(page.into_response())
}

fn row(
    state: &crate::AppState,
    access: &Access,
    j: &ReplayJob,
    here: bool,
    can_run: bool,
    now: chrono::DateTime<chrono::Utc>,
) -> Markup {
    #[allow(clippy::cast_precision_loss)]
    let pct = if j.matched > 0 {
        (j.sent as f64 * 100.0 / j.matched as f64).min(100.0)
    } else {
        100.0
    };
    let resumable = j.state != ReplayState::Done && !(j.state == ReplayState::Running && j.live);
    html! {
        tr #(format!("replay-{}", j.id)) {
            td.num { (j.id) }
            td.mono { (j.target) " (" (j.format) ")" }
            td.mono { (describe(&j.filter)) }
            td.state {
                @match j.state {
                    ReplayState::Running if here => span.ok { "running here" },
                    ReplayState::Running if j.live => span.ok { "running" },
                    ReplayState::Running => span.error { "running, no process (died: resume it)" },
                    ReplayState::Done => span.ok { "done" },
                    ReplayState::Stopped => "stopped",
                    ReplayState::Failed => span.error { "failed" },
                }
            }
            td.progress {
                progress max="100" value=(format!("{pct:.0}")) {}
                " " (j.sent) " of " (j.matched) " sent, cursor " (j.cursor_id) " of " (j.upto_id)
                @if j.removed.count > 0 { ", " (j.removed.count) " removed by retention" }
            }
            td.num { @if j.rate.is_finite() { (j.rate) } @else { "unlimited" } }
            td { (view::when(j.created_at, now)) }
            td.error { (j.last_error.as_deref().unwrap_or("")) }
            td {
                @if here && access.may_change() {
                    form.inline method="post" action=(state.frame.href("/replays/cancel")) {
                        input type="hidden" name="csrf" value=(access.csrf());
                        input type="hidden" name="id" value=(j.id);
                        button.danger #(format!("cancel-{}", j.id)) type="submit" { "Cancel" }
                    }
                } @else if resumable && can_run {
                    a #(format!("resume-{}", j.id)) href=(state.frame.href(&format!("/replays/resume?id={}", j.id))) { "Resume…" }
                }
            }
        }
    }
}

/// A job's filter in the form's words: only what is set.
fn describe(f: &outbox::sql::ReplayFilter) -> String {
    let mut parts: Vec<String> = [
        ("aggregate type", &f.aggregate_type),
        ("aggregate id", &f.aggregate_id),
        ("event type", &f.event_type),
    ]
    .into_iter()
    .filter_map(|(name, v)| Some(format!("{name} {}", v.as_ref()?)))
    .collect();
    if let Some(t) = f.since {
        parts.push(format!("since {}", view::instant(t)));
    }
    if let Some(t) = f.until {
        parts.push(format!("until {}", view::instant(t)));
    }
    if let Some(types) = &f.exclude_types {
        parts.push(format!("not {}", types.join(", ")));
    }
    if parts.is_empty() {
        "every published event".to_owned()
    } else {
        parts.join("; ")
    }
}

fn start_form(state: &crate::AppState, access: &Access) -> Markup {
    html! {
        h2 { "Start a replay" }
        form #replay-form.filters method="post" action=(state.frame.href("/replays/check")) {
            input type="hidden" name="csrf" value=(access.csrf());
            label { "to " input name="to" required placeholder="https://… or route:NAME" size="40"; }
            label { "format "
                select name="format" {
                    option value="" { "default" }
                    option value="native" { "native" }
                    option value="cloudevents" { "cloudevents" }
                    option value="cloudevents:binary" { "cloudevents:binary" }
                    option value="debezium" { "debezium" }
                }
            }
            label { "aggregate type " input name="aggregate_type"; }
            label { "aggregate id " input name="aggregate_id"; }
            label { "event type " input name="event_type"; }
            label { "since " input name="since" placeholder="2026-12-05T00:00:00Z or 24h"; }
            label { "until " input name="until"; }
            label { "rate " input name="rate" placeholder="1000/s, or unlimited"; }
            button #replay-check type="submit" { "Count what it would send" }
        }
        p.muted {
            "The target is what " code { "outbox replay --to" } " takes: a sink URL, or " code { "route:NAME" }
            " of the routes file the console was given with --config. A password or query value in a URL is used, "
            "never stored: resuming such a job asks for the URL again."
        }
    }
}

/// A page saying what happened, linking back to the jobs.
fn outcome(state: &crate::AppState, access: &Access, status: StatusCode, message: &str) -> Response {
    let body = html! {
        p.message #result { (message) }
        p { a #back-to-replays href=(state.frame.href("/replays")) { "Replays" } " · " a href=(state.frame.href("/audit")) { "Audit trail" } }
    };
    (status, view::layout("Replays", access, &state.frame, body)).into_response()
}

/// What a posted form's handler ends with: its page, or a job error as a
/// page (404, 409 or 422 with its words); a failed statement is the
/// console's error page.
fn answer(
    state: &crate::AppState,
    access: &Access,
    done: Result<Response, JobError>,
) -> Result<Response, Failure> {
    let (status, message) = match done {
        Ok(page) => return Ok(page),
        Err(JobError::NotFound(m)) => (StatusCode::NOT_FOUND, m),
        Err(JobError::Conflict(m)) => (StatusCode::CONFLICT, m),
        Err(JobError::Unprocessable(m)) => (StatusCode::UNPROCESSABLE_ENTITY, m),
        Err(JobError::Failed(f)) => return Err(f),
    };
    Ok(outcome(state, access, status, &message))
}

/// `POST /replays/check`: the dry run of a new job, and the form that
/// starts it (the same fields, hidden).
pub(crate) async fn check(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let p = Params::parse(&body);
    if let Some(refused) = auth::refusal(&state.auth, &state.frame, &access, &p) {
        return Ok(refused);
    }
    let done = async {
        let job = NewJob::parse(&p).map_err(JobError::Unprocessable)?;
        let checked = state.runner.check(&state, &job).await?;
        Ok(confirmation(&state, &access, &p, &job, &checked))
    }
    .await;
    answer(&state, &access, done)
}

/// The dry run's page, with the form that starts the job.
fn confirmation(
    state: &crate::AppState,
    access: &Access,
    p: &Params,
    job: &NewJob,
    checked: &crate::jobs::Checked,
) -> Response {
    let rate = if job.rate.is_finite() {
        format!("{}/s", job.rate)
    } else {
        "unlimited rate".to_owned()
    };
    let body = html! {
        p.message #dry-run {
            "Would replay " strong { (checked.matched) } " events with ids up to " (checked.upto_id) " to "
            code { (checked.target) } " (" (checked.format) ", " (rate) "), matching "
            code { (describe(&checked.filter)) } "."
        }
        @if checked.removed.count > 0 {
            p.error #removed {
                @if checked.removed.exact { (checked.removed.count) } @else { "Up to " (checked.removed.count) }
                " matching events were removed by cleanup before this replay and cannot be sent."
            }
        }
        form #replay-start method="post" action=(state.frame.href("/replays/start")) {
            input type="hidden" name="csrf" value=(access.csrf());
            @for (k, v) in job.fields(p) { input type="hidden" name=(k) value=(v); }
            div.actions {
                button.danger #confirm type="submit" { "Yes, start the replay" }
                a href=(state.frame.href("/replays")) { "Cancel" }
            }
        }
        p.muted { "Starting counts again: events published meanwhile are included." }
    };
    view::layout("Start a replay?", access, &state.frame, body).into_response()
}

/// `POST /replays/start`.
pub(crate) async fn start(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let p = Params::parse(&body);
    if let Some(refused) = auth::refusal(&state.auth, &state.frame, &access, &p) {
        return Ok(refused);
    }
    let done = async {
        let job = NewJob::parse(&p).map_err(JobError::Unprocessable)?;
        let (job, _) = state.runner.start(&state, access.who(), &job).await?;
        let said = format!(
            "Started replay job {}: {} events with ids up to {} to {}.",
            job.id, job.matched, job.upto_id, job.target
        );
        Ok(outcome(&state, &access, StatusCode::OK, &said))
    }
    .await;
    answer(&state, &access, done)
}

/// The job id of a form or query.
fn job_id(p: &Params) -> Result<i64, JobError> {
    p.get("id")
        .ok_or_else(|| JobError::Unprocessable("id is required".to_owned()))?
        .parse::<i64>()
        .map_err(|_| JobError::Unprocessable("id is not a job id".to_owned()))
}

/// `GET /replays/resume?id=`: what resuming the job does, and its form
/// (the URL again when the job's target was masked).
pub(crate) async fn resume_confirm(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let p = Params::query(raw.as_deref());
    let found = async {
        let id = job_id(&p)?;
        let missing = || JobError::NotFound(format!("no replay job {id}"));
        let sql = state.replays.as_ref().ok_or_else(missing)?;
        let client = state
            .db
            .client()
            .await
            .map_err(|e| Failure("connecting to PostgreSQL".into(), e))?;
        sql.job(&*client, id)
            .await
            .map_err(|e| Failure("reading the replay job".into(), e))?
            .ok_or_else(missing)
    }
    .await;
    let job = match found {
        Ok(job) => job,
        Err(e) => return answer(&state, &access, Err(e)),
    };
    let needs_url = job.target.contains(outbox_relay::redact::HIDDEN);
    let body = html! {
        p.message #dry-run {
            "Resuming job " (job.id) " sends the events after id " (job.cursor_id) " up to " (job.upto_id)
            " (" (job.matched - job.sent) " of " (job.matched) " still to send) to " code { (job.target) } " (" (job.format) "), with its filter."
        }
        @if job.state == ReplayState::Done {
            p.error { "This job is done already." }
        } @else if !access.may_change() || !state.runner.enabled() {
            p.error { "This console cannot resume jobs: it is read-only, or was started without a way to build sinks." }
        } @else {
            form #replay-resume method="post" action=(state.frame.href("/replays/resume")) {
                input type="hidden" name="csrf" value=(access.csrf());
                input type="hidden" name="id" value=(job.id);
                @if needs_url {
                    label { "the target's URL again (its password or query values were not stored) "
                        input name="to" required size="40"; }
                }
                label { "rate " input name="rate" placeholder=(format!("{} (the job's)", if job.rate.is_finite() { job.rate.to_string() } else { "unlimited".to_owned() })); }
                div.actions {
                    button.danger #confirm type="submit" { "Yes, resume job " (job.id) }
                    a href=(state.frame.href("/replays")) { "Cancel" }
                }
            }
        }
    };
    Ok(view::layout("Resume a replay?", &access, &state.frame, body).into_response())
}

/// `POST /replays/resume`.
pub(crate) async fn resume(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let p = Params::parse(&body);
    if let Some(refused) = auth::refusal(&state.auth, &state.frame, &access, &p) {
        return Ok(refused);
    }
    let done = async {
        let id = job_id(&p)?;
        let rate = p
            .get("rate")
            .map(outbox_relay::replay::parse_rate)
            .transpose()
            .map_err(|e| JobError::Unprocessable(format!("rate: {e}")))?;
        let (job, _) = state
            .runner
            .resume(&state, access.who(), id, p.get("to"), rate)
            .await?;
        let said = format!(
            "Resumed replay job {}: after id {}, {} of {} sent so far.",
            job.id, job.cursor_id, job.sent, job.matched
        );
        Ok(outcome(&state, &access, StatusCode::OK, &said))
    }
    .await;
    answer(&state, &access, done)
}

/// `POST /replays/cancel`: stops a job this console runs, at its next page.
pub(crate) async fn cancel(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let p = Params::parse(&body);
    if let Some(refused) = auth::refusal(&state.auth, &state.frame, &access, &p) {
        return Ok(refused);
    }
    let done = async {
        let (job, _) = state.runner.cancel(&state, access.who(), job_id(&p)?).await?;
        let said = format!(
            "Cancelled replay job {}: {} after id {}, {} of {} sent; resume it from this page.",
            job.id,
            job.state.as_str(),
            job.cursor_id,
            job.sent,
            job.matched
        );
        Ok(outcome(&state, &access, StatusCode::OK, &said))
    }
    .await;
    answer(&state, &access, done)
}
