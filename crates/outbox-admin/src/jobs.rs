//! Replay jobs run by the console: starting one after its dry run,
//! resuming a stopped or failed one, cancelling one it runs, under the
//! rules of `outbox replay` (the target checked and stored masked, a
//! resumed job keeps its filter, format and target, one process per job
//! through its advisory lock), each recorded in the audit trail.
//!
//! A job runs in this process as a task of its own, on a connection of its
//! own that holds the job's lock, through the engine of
//! [`outbox_relay::replay`]; its progress is the job row the engine saves
//! after each acknowledged page, which is what every page reads. Stopping
//! the console stops its jobs at a page boundary, resumable; a console
//! that dies leaves them "running, no process", resumable too.
//!
//! The sink of a job is built by [`ReplayTargets`], which the binary
//! implements with `outbox replay --to`'s own code (sink URLs and the
//! routes file's `route:NAME` tables), so a job started here is the job
//! the CLI would have started with the same words.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::sql::{NewReplay, Removed, ReplayFilter, ReplayJob, ReplaySql, ReplayState, SaveReplay};
use outbox_relay::replay::{End, Replay, Settings};
use outbox_relay::{Backoff, Sink};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::AppState;
use crate::actions::{self, Changed, Kind};
use crate::form::Params;
use crate::view::{Failure, error_chain};

/// How the console builds a replay's sink: `outbox replay --to`'s rules.
pub trait ReplayTargets: Send + Sync {
    /// The sink (no connection made) for `target`, a sink URL or
    /// `route:NAME` of the routes file, sending `format` (`native`,
    /// `cloudevents`, `cloudevents:binary`, `debezium`). For a new job,
    /// `filter` is narrowed to the route's events. `Err` says why not, in
    /// words for the operator.
    fn sink(
        &self,
        target: &str,
        format: &str,
        filter: Option<&mut ReplayFilter>,
    ) -> Result<Box<dyn Sink>, String>;

    /// `target` as a job row keeps it: no password, no query value.
    fn stored(&self, target: &str) -> String;

    /// The format of a new job when the form names none.
    fn default_format(&self) -> String;
}

/// What the console needs to run replay jobs.
pub struct Replays {
    /// Builds each job's sink.
    pub targets: Arc<dyn ReplayTargets>,
    /// Retry delays and `--max-attempts`, as `outbox replay` takes them.
    pub backoff: Backoff,
}

impl std::fmt::Debug for Replays {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replays")
            .field("backoff", &self.backoff)
            .finish_non_exhaustive()
    }
}

/// Why a job could not be started, resumed or cancelled.
#[derive(Debug)]
pub(crate) enum JobError {
    /// No such job.
    NotFound(String),
    /// The job's state forbids it: done already, running elsewhere, not
    /// running.
    Conflict(String),
    /// The request does not parse, or names a target that cannot be built.
    Unprocessable(String),
    /// PostgreSQL failed.
    Failed(Failure),
}

impl From<Failure> for JobError {
    fn from(f: Failure) -> JobError {
        JobError::Failed(f)
    }
}

fn fail(what: &'static str) -> impl FnOnce(tokio_postgres::Error) -> JobError {
    move |e| JobError::Failed(Failure(what.to_owned(), e))
}

/// A new job as the form or the API asks for it.
#[derive(Debug, Clone)]
pub(crate) struct NewJob {
    /// A sink URL or `route:NAME`, as `--to` takes it (secrets included:
    /// never stored, never shown back but in the confirmation's form).
    pub(crate) to: String,
    pub(crate) format: Option<String>,
    pub(crate) filter: ReplayFilter,
    pub(crate) rate: f64,
}

/// The form's (and the API's) field names for a new job.
pub(crate) const FIELDS: [&str; 8] = [
    "to",
    "format",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "since",
    "until",
    "rate",
];

impl NewJob {
    pub(crate) fn parse(p: &Params) -> Result<NewJob, String> {
        let to = p
            .get("to")
            .ok_or("a target is required: a sink URL (as `relay --sink` takes it) or route:NAME")?;
        let text = |k: &str| p.get(k).map(str::to_owned);
        let time = |k: &str| {
            p.get(k)
                .map(|v| instant(v).map_err(|e| format!("{k}: {e}")))
                .transpose()
        };
        let filter = ReplayFilter {
            aggregate_type: text("aggregate_type"),
            aggregate_id: text("aggregate_id"),
            event_type: text("event_type"),
            since: time("since")?,
            until: time("until")?,
            exclude_types: None,
        };
        if let (Some(s), Some(u)) = (filter.since, filter.until)
            && s >= u
        {
            return Err("since must be before until".to_owned());
        }
        let rate = match p.get("rate") {
            None => outbox_relay::replay::DEFAULT_RATE,
            Some(r) => outbox_relay::replay::parse_rate(r).map_err(|e| format!("rate: {e}"))?,
        };
        Ok(NewJob {
            to: to.to_owned(),
            format: text("format"),
            filter,
            rate,
        })
    }

    /// The fields again, for the confirmation's hidden inputs.
    pub(crate) fn fields(&self, p: &Params) -> Vec<(&'static str, String)> {
        FIELDS
            .iter()
            .filter_map(|k| p.get(k).map(|v| (*k, v.to_owned())))
            .collect()
    }
}

/// `outbox replay --since`'s words: a time, or a duration ago (`24h`).
fn instant(v: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if let Ok(t) = crate::events::parse_instant(v) {
        return Ok(t);
    }
    let ago = humantime::parse_duration(v).map_err(|_| {
        "neither a time (2026-12-05T00:00:00Z, or a UTC date and time) nor a duration ago (24h)".to_owned()
    })?;
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|ago| chrono::Utc::now().checked_sub_signed(ago))
        .ok_or_else(|| "too far back".to_owned())
}

/// What a new job would send: its dry run.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Checked {
    /// The target as the job would keep it.
    pub(crate) target: String,
    pub(crate) format: String,
    pub(crate) filter: ReplayFilter,
    pub(crate) upto_id: i64,
    pub(crate) matched: i64,
    pub(crate) removed: Removed,
}

/// A job this console runs.
struct Running {
    cancel: CancellationToken,
    /// True once the job's task has saved its end.
    ended: watch::Receiver<bool>,
}

/// The jobs this console runs, by outbox and job id.
pub(crate) struct Runner {
    replays: Option<Replays>,
    running: Mutex<HashMap<(String, i64), Running>>,
    tasks: TaskTracker,
    /// The console's end: every job stops at its next page boundary.
    stop: CancellationToken,
}

impl Runner {
    pub(crate) fn new(replays: Option<Replays>) -> Runner {
        Runner {
            replays,
            running: Mutex::new(HashMap::new()),
            tasks: TaskTracker::new(),
            stop: CancellationToken::new(),
        }
    }

    /// Whether this console can start and resume jobs.
    pub(crate) fn enabled(&self) -> bool {
        self.replays.is_some()
    }

    /// Whether this console runs job `id` of `outbox` now.
    pub(crate) fn runs(&self, outbox: &str, id: i64) -> bool {
        self.lock().contains_key(&(outbox.to_owned(), id))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, i64), Running>> {
        // No panic while holding it leaves the map torn.
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn replays(&self) -> Result<&Replays, JobError> {
        self.replays.as_ref().ok_or_else(|| {
            JobError::Conflict(
                "this console runs no replays (its host gave it no way to build sinks)".to_owned(),
            )
        })
    }

    /// The dry run of `job`: its target and filter checked, its events
    /// counted; nothing created, nothing sent.
    pub(crate) async fn check(&self, state: &AppState, job: &NewJob) -> Result<Checked, JobError> {
        let (_, checked) = self.prepare(state, job, &*state_client(state).await?).await?;
        Ok(checked)
    }

    /// The sink and the dry run of `job`, counted through `client`.
    async fn prepare(
        &self,
        state: &AppState,
        job: &NewJob,
        client: &impl tokio_postgres::GenericClient,
    ) -> Result<(Box<dyn Sink>, Checked), JobError> {
        let replays = self.replays()?;
        let sql = replay_sql(state)?;
        let mut filter = job.filter.clone();
        let format = job
            .format
            .clone()
            .unwrap_or_else(|| replays.targets.default_format());
        let sink = replays
            .targets
            .sink(&job.to, &format, Some(&mut filter))
            .map_err(JobError::Unprocessable)?;
        let (upto_id, matched) = sql
            .count_matching(client, &filter)
            .await
            .map_err(fail("counting the events to replay"))?;
        let removed = sql
            .removed(client, &filter)
            .await
            .map_err(fail("reading what cleanup removed"))?;
        let checked = Checked {
            target: replays.targets.stored(&job.to),
            format,
            filter,
            upto_id,
            matched,
            removed,
        };
        Ok((sink, checked))
    }

    /// Creates `job` (counted again: what is published now), records it
    /// and runs it.
    pub(crate) async fn start(
        self: &Arc<Self>,
        state: &AppState,
        who: &str,
        job: &NewJob,
    ) -> Result<(ReplayJob, Changed), JobError> {
        let sql = replay_sql(state)?;
        let mut client = actions::begin(state).await?;
        let tx = actions::transaction(&mut client).await?;
        let (sink, c) = self.prepare(state, job, &tx).await?;
        let created = sql
            .create_job(
                &tx,
                &NewReplay {
                    target: &c.target,
                    format: &c.format,
                    filter: &c.filter,
                    rate: job.rate,
                    upto_id: c.upto_id,
                    matched: c.matched,
                    removed: c.removed,
                },
            )
            .await
            .map_err(fail("creating the replay job"))?;
        // A session lock, kept past the commit; nobody knows the id yet.
        sql.lock_job(&tx, created.id)
            .await
            .map_err(fail("locking the replay job"))?;
        let detail = json!({
            "job": created.id,
            "target": c.target,
            "format": c.format,
            "filter": c.filter,
            "rate": rate_json(job.rate),
            "upto_id": c.upto_id,
        });
        let kind = Kind {
            action: "replay-start",
            wake: false,
            said: |n| format!("started a replay job of {n} events"),
        };
        let changed = actions::finish(state, tx, who, kind, detail, count(c.matched)).await?;
        self.spawn(state, client, sink, created.clone(), job.rate)?;
        Ok((created, changed))
    }

    /// Resumes job `id` from its cursor with its filter, format and
    /// target; `to` gives the target's URL again when the job's was
    /// masked, and must mask to the same text.
    pub(crate) async fn resume(
        self: &Arc<Self>,
        state: &AppState,
        who: &str,
        id: i64,
        to: Option<&str>,
        rate: Option<f64>,
    ) -> Result<(ReplayJob, Changed), JobError> {
        let replays = self.replays()?;
        let sql = replay_sql(state)?;
        let label = state.outbox.display_name();
        let job = find(&sql, &*state_client(state).await?, id).await?;
        if job.state == ReplayState::Done {
            return Err(JobError::Conflict(format!(
                "replay job {id} is done already: {} of {} events sent",
                job.sent, job.matched
            )));
        }
        if self.runs(&label, id) {
            return Err(JobError::Conflict(format!(
                "replay job {id} is running in this console already"
            )));
        }
        let shown = replays.targets.stored(&job.target);
        let target = match to {
            Some(to) if replays.targets.stored(to) != shown => {
                return Err(JobError::Unprocessable(format!(
                    "{} is not replay job {id}'s target {shown} (leave the target out, or give the job's own URL)",
                    replays.targets.stored(to)
                )));
            }
            Some(to) => to.to_owned(),
            None if job.target.contains(outbox_relay::redact::HIDDEN) => {
                return Err(JobError::Unprocessable(format!(
                    "replay job {id}'s target {shown} held a password or query values, which are never stored: \
                     give its URL again"
                )));
            }
            None => job.target.clone(),
        };
        let sink = replays
            .targets
            .sink(&target, &job.format, None)
            .map_err(JobError::Unprocessable)?;
        let mut client = actions::begin(state).await?;
        if !sql
            .lock_job(&client, id)
            .await
            .map_err(fail("locking the replay job"))?
        {
            return Err(JobError::Conflict(format!(
                "replay job {id} is running in another process (an `outbox replay`, or another console); stop \
                 that one first"
            )));
        }
        let rate = rate.unwrap_or(job.rate);
        let tx = actions::transaction(&mut client).await?;
        // Running from now, its last failure cleared: the page shows the
        // resumed job at once, not at its first acknowledged page.
        sql.save_job(
            &tx,
            &SaveReplay {
                id,
                cursor_id: job.cursor_id,
                sent: job.sent,
                state: ReplayState::Running,
                last_error: None,
            },
        )
        .await
        .map_err(fail("saving the replay job's state"))?;
        let detail = json!({
            "job": id,
            "target": shown,
            "after_id": job.cursor_id,
            "rate": rate_json(rate),
        });
        let kind = Kind {
            action: "replay-resume",
            wake: false,
            said: |n| format!("resumed a replay job with {n} events to go"),
        };
        let to_go = count(job.matched - job.sent);
        let changed = actions::finish(state, tx, who, kind, detail, to_go).await?;
        let job = ReplayJob {
            state: ReplayState::Running,
            last_error: None,
            live: true,
            ..job
        };
        self.spawn(state, client, sink, job.clone(), rate)?;
        Ok((job, changed))
    }

    /// Stops job `id`, which this console runs, at its next page boundary
    /// (every sink call has a timeout), and answers it as saved then.
    pub(crate) async fn cancel(
        &self,
        state: &AppState,
        who: &str,
        id: i64,
    ) -> Result<(ReplayJob, Changed), JobError> {
        let sql = replay_sql(state)?;
        let label = state.outbox.display_name();
        let running = self
            .lock()
            .get(&(label, id))
            .map(|r| (r.cancel.clone(), r.ended.clone()));
        let Some((cancel, mut ended)) = running else {
            let job = find(&sql, &*state_client(state).await?, id).await?;
            return Err(JobError::Conflict(match (job.state, job.live) {
                (ReplayState::Running, true) => format!(
                    "replay job {id} runs in another process (an `outbox replay`, or another console): stop it \
                     there (SIGTERM to `outbox replay`)"
                ),
                (state, _) => format!("replay job {id} is not running ({})", state.as_str()),
            }));
        };
        let mut client = actions::begin(state).await?;
        let tx = actions::transaction(&mut client).await?;
        let kind = Kind {
            action: "replay-cancel",
            wake: false,
            said: |_| "cancelled a replay job".to_owned(),
        };
        let changed = actions::finish(state, tx, who, kind, json!({ "job": id }), 1).await?;
        cancel.cancel();
        // Bounded: a page in flight ends within its sink's timeout.
        let _ = tokio::time::timeout(Duration::from_secs(60), ended.wait_for(|e| *e)).await;
        let job = find(&sql, &*state_client(state).await?, id).await?;
        Ok((job, changed))
    }

    /// Runs `job` (created or resumed, locked by `client`'s session) in a
    /// task of its own.
    fn spawn(
        self: &Arc<Self>,
        state: &AppState,
        client: tokio_postgres::Client,
        sink: Box<dyn Sink>,
        job: ReplayJob,
        rate: f64,
    ) -> Result<(), JobError> {
        let replays = self.replays()?;
        let sql = replay_sql(state)?;
        let outbox = state.outbox.display_name();
        let key = (outbox.clone(), job.id);
        let cancel = self.stop.child_token();
        let (done, ended) = watch::channel(false);
        self.lock().insert(
            key.clone(),
            Running {
                cancel: cancel.clone(),
                ended,
            },
        );
        let settings = Settings {
            rate,
            backoff: replays.backoff,
            pause_after_id: None,
        };
        let runner = Arc::clone(self);
        self.tasks.spawn(async move {
            let id = job.id;
            let mut replay = Replay::new(&client, &sql, sink, job, settings);
            let end = replay.run(&cancel, &mut |_| {}).await;
            let (sent, total, cursor) = (replay.sent_now(), replay.job().sent, replay.job().cursor_id);
            match end {
                Ok(End::Done) => tracing::info!(job = id, %outbox, sent, total, "admin: replay job done"),
                Ok(End::Stopped) => {
                    tracing::info!(job = id, %outbox, sent, total, cursor, "admin: replay job stopped; resumable");
                }
                Err(e) => tracing::warn!(
                    job = id,
                    %outbox,
                    sent,
                    cursor,
                    error = %error_chain(&e),
                    "admin: replay job failed; fix the cause, then resume it from the replays page"
                ),
            }
            drop(replay);
            runner.lock().remove(&key);
            let _ = done.send(true);
        });
        Ok(())
    }

    /// Stops every job at its next page boundary and waits until each has
    /// saved where it stopped.
    pub(crate) async fn shutdown(&self) {
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

async fn state_client(state: &AppState) -> Result<Arc<tokio_postgres::Client>, JobError> {
    state.db.client().await.map_err(fail("connecting to PostgreSQL"))
}

fn replay_sql(state: &AppState) -> Result<ReplaySql, JobError> {
    state
        .replays
        .clone()
        .ok_or_else(|| JobError::NotFound("this outbox has no replay jobs table".to_owned()))
}

async fn find(sql: &ReplaySql, client: &tokio_postgres::Client, id: i64) -> Result<ReplayJob, JobError> {
    sql.job(client, id)
        .await
        .map_err(fail("reading the replay job"))?
        .ok_or_else(|| JobError::NotFound(format!("no replay job {id}")))
}

/// A rate in the audit trail, `unlimited` spelled out (JSON has no infinity).
fn rate_json(rate: f64) -> serde_json::Value {
    if rate.is_finite() {
        json!(rate)
    } else {
        json!("unlimited")
    }
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}
