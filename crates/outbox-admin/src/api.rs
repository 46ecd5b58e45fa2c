//! `/api/…`: what the pages show and do, as JSON, for scripts. The same
//! statements, the same dry runs and the same audit trail as the pages and
//! the CLI, with status codes a script can branch on:
//!
//! | status | when |
//! |---|---|
//! | 200 | done, or read |
//! | 401 | no token, or a wrong one |
//! | 403 | read-only console, or a change sent with a browser's cookie instead of a bearer token |
//! | 404 | nothing matched (an unknown event or replay job; a requeue or give-up that changed no row, where `outbox dlq` exits 1) |
//! | 409 | the change conflicts with the state (a route already paused, or not paused; a replay job done, running elsewhere, or not running) |
//! | 422 | a filter or body that does not parse, with what is wrong |
//! | 500 | PostgreSQL failed; the error chain is in `error` |
//!
//! Every error is `{"error": "…"}`. Changes need `Authorization: Bearer`:
//! a browser's session cookie is ambient, and the API takes no CSRF token,
//! so a change the cookie alone proves is refused (the pages' forms carry
//! the CSRF token instead).

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, body::Bytes};
use chrono::Utc;
use serde::Deserialize;
use serde_json::json;

use crate::actions;
use crate::auth::Access;
use crate::dead::Selection;
use crate::form::Params;
use crate::view::{Failure, error_chain};

/// `{"error": message}` with `status`.
pub(crate) fn problem(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

/// An answer other than 200: its status and what went wrong.
#[derive(Debug)]
pub(crate) struct ApiError(StatusCode, String);

impl ApiError {
    fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError(StatusCode::UNPROCESSABLE_ENTITY, message.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        problem(self.0, &self.1)
    }
}

/// A failed statement is a 500 with its error chain, also logged.
impl From<Failure> for ApiError {
    fn from(Failure(what, e): Failure) -> ApiError {
        let chain = error_chain(&e);
        tracing::error!(error = %chain, "admin api: {what}");
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("{what}: {chain}"))
    }
}

type Answer = Result<Response, ApiError>;

fn fail(what: &'static str) -> impl FnOnce(tokio_postgres::Error) -> ApiError {
    move |e| ApiError::from(Failure(what.to_owned(), e))
}

async fn client(state: &crate::AppState) -> Result<std::sync::Arc<tokio_postgres::Client>, ApiError> {
    state.db.client().await.map_err(fail("connecting to PostgreSQL"))
}

/// Who may change rows through the API: a bearer token, nothing else.
fn changer(access: &Access) -> Result<&str, ApiError> {
    match access {
        Access::Bearer { who } => Ok(who),
        Access::ReadOnly => Err(ApiError(
            StatusCode::FORBIDDEN,
            "this console is read-only: start `outbox admin` with --admin-token or --admin-tokens-file"
                .to_owned(),
        )),
        Access::Session { .. } => Err(ApiError(
            StatusCode::FORBIDDEN,
            "changes through the API need Authorization: Bearer <token>, not a browser session".to_owned(),
        )),
    }
}

/// A JSON body, or a 422 saying why not.
fn body<T: for<'de> Deserialize<'de>>(bytes: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::unprocessable(format!("the body is not what this endpoint takes: {e}")))
}

/// Anything under the console that no route serves: JSON under `/api/`,
/// a short page elsewhere.
pub(crate) async fn not_found(uri: axum::http::Uri) -> Response {
    if uri.path().contains("/api/") {
        problem(StatusCode::NOT_FOUND, &format!("no endpoint {}", uri.path()))
    } else {
        (StatusCode::NOT_FOUND, "no such page\n").into_response()
    }
}

/// `GET /api/whoami`: the name the audit trail records for this token,
/// and whether it may change rows.
pub(crate) async fn whoami(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
) -> Response {
    Json(json!({
        "who": access.who(),
        "via": access.via(),
        "may_change": access.may_change(),
        "outbox": state.outbox.display_name(),
    }))
    .into_response()
}

/// `GET /api/overview`: the overview page's tables.
pub(crate) async fn overview(State(state): State<crate::State>) -> Answer {
    let client = client(&state).await?;
    let sql = &state.sql;
    let stats = sql.stats(&*client).await.map_err(fail("reading the backlog"))?;
    let throughput = sql
        .throughput(&*client, &crate::overview::THROUGHPUT)
        .await
        .map_err(fail("reading the throughput"))?;
    let dead = sql
        .dead_by_error(&*client, 50)
        .await
        .map_err(fail("reading the dead letters"))?;
    let relays = sql.relays(&*client).await.map_err(fail("reading the relays"))?;
    let partitions = sql
        .partition_backlog(&*client)
        .await
        .map_err(fail("reading the partition backlog"))?;
    Ok(Json(json!({
        "outbox": state.outbox.display_name(),
        "backlog": stats,
        "published_per_bucket": { "bucket_seconds": crate::overview::THROUGHPUT.bucket_seconds, "counts": throughput },
        "dead_by_error": dead,
        "relays": relays,
        "partitions": partitions,
    }))
    .into_response())
}

/// `GET /api/dead`: dead letters with the page's filters, `after` (row id)
/// and `limit`; `next` is the `after` of the next page.
pub(crate) async fn dead(State(state): State<crate::State>, RawQuery(raw): RawQuery) -> Answer {
    let p = Params::query(raw.as_deref());
    let selection = Selection::filters(&p, Utc::now()).map_err(ApiError::unprocessable)?;
    let number = |key: &str, default: i64| -> Result<i64, ApiError> {
        p.get(key).map_or(Ok(default), |v| {
            v.parse()
                .map_err(|_| ApiError::unprocessable(format!("{key} {v:?} is not a number")))
        })
    };
    let after_id = number("after", 0)?;
    let limit = number("limit", 50)?.clamp(1, 500);
    let client = client(&state).await?;
    let page = outbox::sql::DeadPage {
        filter: selection.filter(),
        after_id,
        limit,
    };
    let rows = state
        .sql
        .dead_page(&*client, &page)
        .await
        .map_err(fail("listing dead letters"))?;
    let total = state
        .sql
        .count_dead(&*client, &selection.filter())
        .await
        .map_err(fail("counting dead letters"))?;
    let next = rows.last().filter(|_| rows.len() as i64 == limit).map(|r| r.id);
    Ok(Json(json!({ "total": total, "dead_letters": rows, "next": next })).into_response())
}

/// The body of a requeue or give-up.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Change {
    /// `selected` (with `ids`) or `filtered` (with the filters): explicit,
    /// so a body that lost its ids never widens to every dead letter.
    scope: String,
    #[serde(default)]
    ids: Vec<i64>,
    aggregate_type: Option<String>,
    event_type: Option<String>,
    error: Option<String>,
    /// RFC 3339 instants.
    dead_before: Option<String>,
    dead_after: Option<String>,
    /// Count only, change nothing.
    #[serde(default)]
    dry_run: bool,
}

impl Change {
    fn selection(&self, filtered_allowed: bool) -> Result<Selection, String> {
        match self.scope.as_str() {
            "selected" => {
                let ids = self
                    .ids
                    .iter()
                    .map(|id| ("id".to_owned(), id.to_string()))
                    .collect();
                Selection::selected(&Params::from_pairs(ids))
            }
            "filtered" if filtered_allowed => {
                let pairs = [
                    ("aggregate_type", &self.aggregate_type),
                    ("event_type", &self.event_type),
                    ("error", &self.error),
                    ("dead_before", &self.dead_before),
                    ("dead_after", &self.dead_after),
                ]
                .into_iter()
                .filter_map(|(k, v)| v.as_ref().map(|v| (k.to_owned(), v.clone())))
                .collect();
                Selection::filters(&Params::from_pairs(pairs), Utc::now())
            }
            "filtered" => {
                Err("give-up takes scope \"selected\" with ids only, as `outbox dlq give-up` does".to_owned())
            }
            _ => Err("scope must be \"selected\" (with ids) or \"filtered\" (with filter fields)".to_owned()),
        }
    }
}

/// `POST /api/dead/requeue`: `{"scope": "selected", "ids": [17]}` or
/// `{"scope": "filtered", "aggregate_type": "orders", …}`, `"dry_run":
/// true` to count only. 404 when no dead letter matched.
pub(crate) async fn requeue(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    bytes: Bytes,
) -> Answer {
    change(&state, &access, &bytes, Kind::Requeue).await
}

/// `POST /api/dead/give-up`: `{"scope": "selected", "ids": [17]}`, as
/// requeue.
pub(crate) async fn give_up(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    bytes: Bytes,
) -> Answer {
    change(&state, &access, &bytes, Kind::GiveUp).await
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Requeue,
    GiveUp,
}

async fn change(state: &crate::AppState, access: &Access, bytes: &Bytes, kind: Kind) -> Answer {
    let who = changer(access)?;
    let change: Change = body(bytes)?;
    let selection = change
        .selection(kind == Kind::Requeue)
        .map_err(ApiError::unprocessable)?;
    let verb = match kind {
        Kind::Requeue => "requeued",
        Kind::GiveUp => "given_up",
    };
    if change.dry_run {
        let client = client(state).await?;
        let n = match kind {
            Kind::Requeue => state.sql.count_dead(&*client, &selection.filter()).await,
            Kind::GiveUp => state.sql.count_give_up(&*client, &selection.ids).await,
        }
        .map_err(fail("counting dead letters"))?;
        return Ok(
            Json(json!({ "dry_run": true, verb: n, "selection": selection.detail() })).into_response(),
        );
    }
    let done = match kind {
        Kind::Requeue => actions::requeue(state, who, &selection).await?,
        Kind::GiveUp => actions::give_up(state, who, &selection).await?,
    };
    let status = if done.rows == 0 {
        StatusCode::NOT_FOUND
    } else {
        StatusCode::OK
    };
    let mut answer = json!({ verb: done.rows, "audit_id": done.audit_id, "selection": selection.detail() });
    if done.rows == 0 {
        answer["error"] = json!("no dead letter matched the selection");
    }
    Ok((status, Json(answer)).into_response())
}

/// The body of a purge.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Purge {
    /// Whole days (`30`) or a humantime age (`"12h"`).
    older_than: serde_json::Value,
    #[serde(default)]
    dry_run: bool,
}

/// `POST /api/dead/purge`: `{"older_than": "30d"}` deletes the dead
/// letters given up on longer ago than that, as `outbox dlq purge`; 200
/// with `deleted` even when it is 0, as the CLI exits 0.
pub(crate) async fn purge(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    bytes: Bytes,
) -> Answer {
    let who = changer(&access)?;
    let purge: Purge = body(&bytes)?;
    let written = match &purge.older_than {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let (age, before) = crate::dead::purge_age(Some(&written)).map_err(ApiError::unprocessable)?;
    if purge.dry_run {
        let client = client(&state).await?;
        let n = state
            .sql
            .count_purge_given_up(&*client, age)
            .await
            .map_err(fail("counting given-up dead letters"))?;
        return Ok(Json(json!({ "dry_run": true, "deleted": n })).into_response());
    }
    let done = actions::purge(&state, who, before).await?;
    Ok(Json(
        json!({ "deleted": done.rows, "audit_id": done.audit_id, "given_up_before": before.to_rfc3339() }),
    )
    .into_response())
}

/// `GET /api/event?id=…`: one event's story (event id or row id), with the
/// reasons the story page gives; 404 when no row has it.
pub(crate) async fn event(State(state): State<crate::State>, RawQuery(raw): RawQuery) -> Answer {
    let p = Params::query(raw.as_deref());
    let id = p
        .get("id")
        .ok_or_else(|| ApiError::unprocessable("id is required: an event id (UUID) or a row id"))?;
    let (row_id, event_id) = crate::story::parse_id(id).map_err(ApiError::unprocessable)?;
    let client = client(&state).await?;
    let story = state
        .sql
        .event_story(&*client, row_id, event_id)
        .await
        .map_err(fail("reading the event"))?;
    let Some(story) = story else {
        return Ok(problem(
            StatusCode::NOT_FOUND,
            "no event with this id: never written, or delivered and removed by `outbox cleanup`",
        ));
    };
    let reasons = crate::story::reasons(&story);
    Ok(Json(json!({ "story": story, "reasons": reasons })).into_response())
}

/// `GET /api/replays`: every replay job, newest first, with its progress.
pub(crate) async fn replays(State(state): State<crate::State>) -> Answer {
    let Some(sql) = &state.replays else {
        return Ok(Json(json!({ "replays": [] })).into_response());
    };
    let client = client(&state).await?;
    let jobs = sql.jobs(&*client).await.map_err(fail("listing replay jobs"))?;
    Ok(Json(json!({ "replays": jobs })).into_response())
}

/// `GET /api/audit?before=ID&limit=N`: the audit trail, newest first.
pub(crate) async fn audit(State(state): State<crate::State>, RawQuery(raw): RawQuery) -> Answer {
    let p = Params::query(raw.as_deref());
    let before = p
        .get("before")
        .map(str::parse::<i64>)
        .transpose()
        .map_err(|_| ApiError::unprocessable("before must be an audit row id"))?
        .unwrap_or(i64::MAX);
    let limit = p
        .get("limit")
        .map(str::parse::<i64>)
        .transpose()
        .map_err(|_| ApiError::unprocessable("limit must be a number"))?
        .unwrap_or(100)
        .clamp(1, 1000);
    let client = client(&state).await?;
    let rows = state
        .audit
        .recent(&*client, before, limit)
        .await
        .map_err(fail("reading the audit trail"))?;
    let next = rows.last().filter(|_| rows.len() as i64 == limit).map(|r| r.id);
    Ok(Json(json!({ "audit": rows, "next": next })).into_response())
}

/// `GET /api/routes`: each route with its sinks, breaker, pause, counts,
/// backlog and per-minute deliveries over the last hour.
pub(crate) async fn routes(State(state): State<crate::State>) -> Answer {
    let routes = crate::routes::load(&state).await?;
    Ok(Json(json!({ "routes": routes })).into_response())
}

/// The body of a pause or resume.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteChange {
    route: String,
    reason: Option<String>,
}

/// `POST /api/routes/pause`: `{"route": "orders", "reason": "…"}`; 409
/// when it is paused already.
pub(crate) async fn pause(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    bytes: Bytes,
) -> Answer {
    route_change(&state, &access, &bytes, true).await
}

/// `POST /api/routes/resume`: `{"route": "orders"}`; 409 when it is not
/// paused.
pub(crate) async fn resume(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    bytes: Bytes,
) -> Answer {
    route_change(&state, &access, &bytes, false).await
}

async fn route_change(state: &crate::AppState, access: &Access, bytes: &Bytes, pause: bool) -> Answer {
    let who = changer(access)?;
    let change: RouteChange = body(bytes)?;
    crate::routes::route_name(Some(change.route.as_str()).filter(|r| !r.trim().is_empty()))
        .map_err(ApiError::unprocessable)?;
    let Some(sql) = &state.routes else {
        return Ok(problem(StatusCode::NOT_FOUND, "this outbox has no routes table"));
    };
    let done = if pause {
        actions::pause(state, sql, who, &change.route, change.reason.as_deref()).await?
    } else {
        actions::resume(state, sql, who, &change.route).await?
    };
    if done.rows == 0 {
        let message = if pause {
            format!("route {} is paused already", change.route)
        } else {
            format!("route {} is not paused", change.route)
        };
        return Ok(problem(StatusCode::CONFLICT, &message));
    }
    Ok(Json(json!({ "route": change.route, "paused": pause, "audit_id": done.audit_id })).into_response())
}

/// A replay job refused: 404, 409 or 422 with its words.
impl From<crate::jobs::JobError> for ApiError {
    fn from(e: crate::jobs::JobError) -> ApiError {
        use crate::jobs::JobError;
        match e {
            JobError::NotFound(m) => ApiError(StatusCode::NOT_FOUND, m),
            JobError::Conflict(m) => ApiError(StatusCode::CONFLICT, m),
            JobError::Unprocessable(m) => ApiError::unprocessable(m),
            JobError::Failed(f) => f.into(),
        }
    }
}

/// The body of `POST /api/replays`: `outbox replay`'s flags.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartReplay {
    to: String,
    format: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    since: Option<String>,
    until: Option<String>,
    /// `500`, `"500/s"` or `"unlimited"`.
    rate: Option<serde_json::Value>,
    #[serde(default)]
    dry_run: bool,
}

/// A JSON number or string as the form's text.
fn text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `POST /api/replays`: starts a replay job (200 with the job), or with
/// `dry_run` counts what it would send.
pub(crate) async fn start_replay(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    bytes: Bytes,
) -> Answer {
    let who = changer(&access)?;
    let b: StartReplay = body(&bytes)?;
    let pairs = [
        ("to", Some(b.to)),
        ("format", b.format),
        ("aggregate_type", b.aggregate_type),
        ("aggregate_id", b.aggregate_id),
        ("event_type", b.event_type),
        ("since", b.since),
        ("until", b.until),
        ("rate", b.rate.as_ref().map(text)),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v)))
    .collect();
    let job = crate::jobs::NewJob::parse(&Params::from_pairs(pairs)).map_err(ApiError::unprocessable)?;
    if b.dry_run {
        let checked = state.runner.check(&state, &job).await?;
        return Ok(Json(json!({ "dry_run": true, "would": checked })).into_response());
    }
    let (job, done) = state.runner.start(&state, who, &job).await?;
    Ok(Json(json!({ "job": job, "audit_id": done.audit_id })).into_response())
}

/// The body of `POST /api/replays/resume`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeReplay {
    id: i64,
    /// The target's URL again, when the job's was masked.
    to: Option<String>,
    rate: Option<serde_json::Value>,
}

/// `POST /api/replays/resume`: resumes a stopped or failed job here.
pub(crate) async fn resume_replay(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    bytes: Bytes,
) -> Answer {
    let who = changer(&access)?;
    let b: ResumeReplay = body(&bytes)?;
    let rate = b
        .rate
        .as_ref()
        .map(|r| outbox_relay::replay::parse_rate(&text(r)))
        .transpose()
        .map_err(|e| ApiError::unprocessable(format!("rate: {e}")))?;
    let (job, done) = state
        .runner
        .resume(&state, who, b.id, b.to.as_deref(), rate)
        .await?;
    Ok(Json(json!({ "job": job, "audit_id": done.audit_id })).into_response())
}

/// The body of `POST /api/replays/cancel`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelReplay {
    id: i64,
}

/// `POST /api/replays/cancel`: stops a job this console runs; answers the
/// job as saved when it stopped.
pub(crate) async fn cancel_replay(
    State(state): State<crate::State>,
    Extension(access): Extension<Access>,
    bytes: Bytes,
) -> Answer {
    let who = changer(&access)?;
    let b: CancelReplay = body(&bytes)?;
    let (job, done) = state.runner.cancel(&state, who, b.id).await?;
    Ok(Json(json!({ "job": job, "audit_id": done.audit_id })).into_response())
}
