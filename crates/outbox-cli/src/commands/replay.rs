//! `outbox replay`: re-deliver published events to a sink, resumably.
//!
//! Owns the command's flow: the target (a sink URL or a route of the
//! routes file), the job row (created, or resumed under its lock), the
//! paced page loop and its retries, progress, and the summary. The SQL is
//! `outbox::sql::ReplaySql`'s; the sinks are the relay's.
//!
//! What it keeps: every matching published row with an id up to the job's
//! bound is acknowledged by the sink at least once, with its original
//! `event_id`, in id order (so in order per aggregate: an aggregate's rows
//! are never split across pages out of order, and a page is sent only
//! after the previous one was acknowledged). The cursor is saved only
//! after the sink acknowledged everything up to it, so a crash or SIGKILL
//! re-sends at most the page in flight. Live delivery is untouched: no row
//! is claimed, locked or marked, and no transaction stays open while the
//! sink has a page.

use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use outbox::sql::{NewReplay, PageParams, ReplayFilter, ReplayJob, ReplaySql, ReplayState, SaveReplay};
use outbox_relay::sink::format::{CloudEventsMode, Format, Formatter};
use outbox_relay::{Sink, SinkOptions};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::cli::{Global, ReplayArgs};
use crate::config::ConfigFile;
use crate::exit::ConfigError;

/// Events per second when `--rate` is not given: about a fiftieth of what
/// one relay delivers to Redis at batch 100 (docs/bench.md), so the sink
/// and PostgreSQL keep nearly all their room for live delivery, and still
/// 3.6 million events an hour.
const DEFAULT_RATE: f64 = 1000.0;
/// The largest page: one sink call, one statement.
const MAX_PAGE: i64 = 500;
/// Ids one page statement walks at most, so a selective filter never makes
/// a long statement: a page with no match just moves the cursor.
const MIN_WINDOW: i64 = 10_000;
/// Retries of a failing sink back off from this...
const BACKOFF_BASE: Duration = Duration::from_millis(200);
/// ...doubling up to this.
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How often progress is logged when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(5);

pub(crate) async fn run(g: &Global, args: ReplayArgs) -> anyhow::Result<()> {
    let config = super::outbox_config(g)?;
    if args.list {
        let client = connected(g, &config).await?;
        return list(&client, &ReplaySql::new(&config)?, args.json).await;
    }
    match args.resume {
        Some(id) => resume(g, &config, id, args).await,
        None => start(g, &config, args).await,
    }
}

/// A new job: target and filter checked before PostgreSQL is touched, then
/// counted, recorded and run (or, with `--dry-run`, only counted).
async fn start(g: &Global, config: &outbox::Config, args: ReplayArgs) -> anyhow::Result<()> {
    let options = sink_options(g, args.sink_options);
    let Some(to) = args.to else {
        unreachable!("clap requires --to without --resume or --list");
    };
    let target = Target::parse(&to);
    let mut filter = ReplayFilter {
        aggregate_type: args.aggregate_type,
        aggregate_id: args.aggregate_id,
        event_type: args.event_type,
        since: args.since,
        until: args.until,
        exclude_types: None,
    };
    let sink = target.sink(args.config.as_deref(), &options, Some(&mut filter))?;
    let client = connected(g, config).await?;
    let sql = ReplaySql::new(config)?;
    if args.dry_run {
        return dry_run(&client, config, &sql, &filter, &target.stored()).await;
    }
    let rate = args.rate.unwrap_or(DEFAULT_RATE);
    let format = format_name(&options.formatter);
    let (upto_id, matched) = sql
        .count_matching(&client, &filter)
        .await
        .context("counting the events to replay")?;
    let removed = sql
        .removed(&client, &filter)
        .await
        .context("reading what cleanup removed")?;
    let job = sql
        .create_job(
            &client,
            &NewReplay {
                target: &target.stored(),
                format: &format,
                filter: &filter,
                rate,
                upto_id,
                matched,
                removed,
            },
        )
        .await
        .context("creating the replay job")?;
    // A fresh job: nobody else can hold its lock.
    sql.lock_job(&client, job.id)
        .await
        .context("locking the replay job")?;
    println!(
        "replay job {}: {matched} events with ids up to {upto_id} to {} ({format}, {})",
        job.id,
        job.target,
        Rate(rate)
    );
    if matched == 0 {
        explain_nothing(&client, config, &sql).await?;
    }
    say_removed(&job);
    Replay::new(&client, &sql, sink, job, rate, g.max_attempts)
        .run()
        .await
}

/// The sink flags' options, as the relay builds them.
fn sink_options(g: &Global, flags: Box<crate::cli::SinkArgs>) -> SinkOptions {
    flags.options(|| format!("/outbox/{}.{}", g.schema, g.table))
}

/// A connection to a migrated outbox.
async fn connected(g: &Global, config: &outbox::Config) -> anyhow::Result<Client> {
    let client = super::connect(&super::pg_config(g)?).await?;
    outbox::check(&client, config).await?;
    Ok(client)
}

/// Continues job `id` from its cursor, with its filter, target and format.
async fn resume(g: &Global, config: &outbox::Config, id: i64, args: ReplayArgs) -> anyhow::Result<()> {
    let mut options = sink_options(g, args.sink_options);
    let client = &connected(g, config).await?;
    let sql = &ReplaySql::new(config)?;
    let job = sql
        .job(client, id)
        .await
        .context("reading the replay job")?
        .ok_or_else(|| ConfigError(format!("no replay job {id} (see `outbox replay --list`)")))?;
    if job.state == ReplayState::Done {
        println!(
            "replay job {id} is done already: {} of {} events sent",
            job.sent, job.matched
        );
        return Ok(());
    }
    let target = match args.to {
        Some(to) => {
            let given = Target::parse(&to);
            if given.stored() != job.target {
                return Err(ConfigError(format!(
                    "--to {} is not replay job {id}'s target {} (leave --to out, or give the job's own URL)",
                    given.stored(),
                    job.target
                ))
                .into());
            }
            given
        }
        None if job.target.contains("***") => {
            return Err(ConfigError(format!(
                "replay job {id}'s target {} held a password, which is never stored: give the URL again with \
                 --to (`outbox replay --resume {id} --to <URL>`)",
                job.target
            ))
            .into());
        }
        None => Target::parse(&job.target),
    };
    // The job's envelope, whatever the flags say: consumers see one format.
    let (format, mode) = parse_format(&job.format)?;
    let (_, _, source) = options.formatter.parts();
    options.formatter = Formatter::new(format, mode, source.to_owned());
    let sink = target.sink(args.config.as_deref(), &options, None)?;
    if !sql.lock_job(client, id).await.context("locking the replay job")? {
        anyhow::bail!(
            "replay job {id} is running in another process (see `outbox replay --list`); stop that one first"
        );
    }
    let rate = args.rate.unwrap_or(job.rate);
    println!(
        "replay job {id}: resuming after id {} ({} of {} sent) up to {} to {} ({}, {})",
        job.cursor_id,
        job.sent,
        job.matched,
        job.upto_id,
        job.target,
        job.format,
        Rate(rate)
    );
    Replay::new(client, sql, sink, job, rate, g.max_attempts)
        .run()
        .await
}

/// `--dry-run`: what a replay would send, and what cleanup removed.
async fn dry_run(
    client: &Client,
    config: &outbox::Config,
    sql: &ReplaySql,
    filter: &ReplayFilter,
    target: &str,
) -> anyhow::Result<()> {
    let (upto_id, matched) = sql
        .count_matching(client, filter)
        .await
        .context("counting the events to replay")?;
    let removed = sql
        .removed(client, filter)
        .await
        .context("reading what cleanup removed")?;
    println!("dry run: would replay {matched} events with ids up to {upto_id} to {target}; nothing sent");
    if removed.count > 0 {
        println!("{}", removed_line(removed));
    }
    if matched == 0 {
        explain_nothing(client, config, sql).await?;
    }
    Ok(())
}

/// `--list`: every job, newest first.
async fn list(client: &Client, sql: &ReplaySql, json: bool) -> anyhow::Result<()> {
    let jobs = sql.jobs(client).await.context("listing replay jobs")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&jobs)?);
        return Ok(());
    }
    if jobs.is_empty() {
        println!("no replay jobs");
        return Ok(());
    }
    println!(
        "{:>6}  {:<18}  {:>15}  {:>12}  {:>8}  {:<20}  {:<32}  filter",
        "id", "state", "sent/matched", "cursor", "removed", "created", "target"
    );
    for j in &jobs {
        let state = match (j.state, j.live) {
            (ReplayState::Running, false) => "running (no process)".to_owned(),
            (s, _) => s.as_str().to_owned(),
        };
        println!(
            "{:>6}  {:<18}  {:>15}  {:>12}  {:>8}  {:<20}  {:<32}  {}{}",
            j.id,
            state,
            format!("{}/{}", j.sent, j.matched),
            format!("{}/{}", j.cursor_id, j.upto_id),
            j.removed.count,
            j.created_at.format("%Y-%m-%d %H:%M:%S"),
            j.target,
            describe(&j.filter),
            j.last_error
                .as_deref()
                .map(|e| format!("  [{e}]"))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// The filter in the flags' words.
fn describe(f: &ReplayFilter) -> String {
    let mut parts = Vec::new();
    for (flag, value) in [
        ("--aggregate-type", &f.aggregate_type),
        ("--aggregate-id", &f.aggregate_id),
        ("--event-type", &f.event_type),
    ] {
        if let Some(v) = value {
            parts.push(format!("{flag} {v}"));
        }
    }
    if let Some(t) = f.since {
        parts.push(format!("--since {}", t.to_rfc3339()));
    }
    if let Some(t) = f.until {
        parts.push(format!("--until {}", t.to_rfc3339()));
    }
    if let Some(types) = &f.exclude_types {
        parts.push(format!("not {}", types.join(",")));
    }
    if parts.is_empty() {
        "every published event".to_owned()
    } else {
        parts.join(" ")
    }
}

/// Why nothing matched, when the reason is cheap to see: log tailing
/// deletes delivered rows or never marks them published.
async fn explain_nothing(client: &Client, config: &outbox::Config, sql: &ReplaySql) -> anyhow::Result<()> {
    let slot = outbox::sql::WalSql::new(config)?
        .slot_state(client)
        .await
        .context("looking up the replication slot")?;
    if let Some(slot) = slot
        && !sql
            .any_published(client)
            .await
            .context("looking for published rows")?
    {
        eprintln!(
            "warning: {} has no published row to replay: it is read by log tailing (slot {}), which deletes \
             delivered rows (--wal-cleanup delete) or leaves them unmarked (none)",
            config.display_name(),
            slot.slot
        );
    }
    Ok(())
}

fn say_removed(job: &ReplayJob) {
    if job.removed.count > 0 {
        println!("{}", removed_line(job.removed));
    }
}

fn removed_line(removed: outbox::sql::Removed) -> String {
    if removed.exact {
        format!(
            "{} matching events were removed by cleanup before this replay and cannot be sent",
            removed.count
        )
    } else {
        format!(
            "up to {} matching events were removed by cleanup before this replay and cannot be sent (not \
             exact: cleanup records counts per aggregate type, event type and hour, not per aggregate id or \
             to the second)",
            removed.count
        )
    }
}

/// Where a replay sends.
enum Target {
    /// A sink URL, as `relay --sink` takes it.
    Url(String),
    /// A sink table of the routes file: an aggregate type, or `default`.
    Route(String),
}

impl Target {
    fn parse(to: &str) -> Self {
        match to.strip_prefix("route:") {
            Some(name) => Self::Route(name.to_owned()),
            None => Self::Url(to.to_owned()),
        }
    }

    /// As the job row keeps it: never a password.
    fn stored(&self) -> String {
        match self {
            Self::Url(url) => super::config::redact_url(url),
            Self::Route(name) => format!("route:{name}"),
        }
    }

    /// The sink, built (no connection made). For a new job, `filter` is
    /// narrowed to the route's events.
    fn sink(
        &self,
        config_path: Option<&Path>,
        options: &SinkOptions,
        filter: Option<&mut ReplayFilter>,
    ) -> anyhow::Result<Box<dyn Sink>> {
        let name = match self {
            Self::Url(url) => return outbox_relay::sink::from_url(url, options).context("--to"),
            Self::Route(name) => name,
        };
        let path = config_path.ok_or_else(|| {
            ConfigError(format!(
                "--to route:{name} names a sink table of a routes file: give it with --config"
            ))
        })?;
        let file = ConfigFile::read(path)?.into_body();
        let tables = file.tables();
        let routed: Vec<String> = tables
            .iter()
            .filter_map(|(header, _)| header.strip_prefix("[routes.")?.strip_suffix(']'))
            .map(str::to_owned)
            .collect();
        let header = if name == "default" {
            "[default]".to_owned()
        } else {
            format!("[routes.{name}]")
        };
        let Some((_, entries)) = tables.iter().find(|(h, _)| *h == header) else {
            return Err(ConfigError(format!(
                "--to route:{name}: {} has no {header} table (its tables: {})",
                path.display(),
                tables
                    .iter()
                    .map(|(h, _)| h.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .into());
        };
        let url = entries
            .iter()
            .find(|(key, ..)| *key == "sink")
            .and_then(|(_, values, _)| values.first().cloned());
        if let Some(filter) = filter {
            if name == "default" {
                filter.exclude_types = Some(routed);
            } else {
                match &filter.aggregate_type {
                    Some(t) if t != name => {
                        return Err(ConfigError(format!(
                            "--to route:{name} carries aggregate type {name} only, not --aggregate-type {t}"
                        ))
                        .into());
                    }
                    _ => filter.aggregate_type = Some(name.clone()),
                }
            }
        }
        // The router sends each row to its type's table; with the filter
        // above every row is of this route. Without a [default] table the
        // route's own sink stands in as the default the router needs.
        let router = file
            .router(url.as_deref(), options)
            .with_context(|| format!("--to route:{name}"))?;
        Ok(Box::new(router))
    }
}

/// `native`, `cloudevents`, `cloudevents:binary`, `debezium`: the envelope
/// as the job row keeps it.
fn format_name(formatter: &Formatter) -> String {
    match formatter.parts() {
        (Format::CloudEvents, CloudEventsMode::Binary, _) => "cloudevents:binary".to_owned(),
        (format, ..) => format.to_string(),
    }
}

fn parse_format(name: &str) -> anyhow::Result<(Format, CloudEventsMode)> {
    let (format, mode) = match name.split_once(':') {
        Some((f, "binary")) => (f, CloudEventsMode::Binary),
        _ => (name, CloudEventsMode::Structured),
    };
    let format = format
        .parse::<Format>()
        .map_err(|e| ConfigError(format!("the job's format {name:?}: {e}")))?;
    Ok((format, mode))
}

/// A rate for people.
struct Rate(f64);

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_infinite() {
            f.write_str("unlimited rate")
        } else {
            write!(f, "{}/s", self.0)
        }
    }
}

/// One run of a job: the page loop.
struct Replay<'a> {
    client: &'a Client,
    sql: &'a ReplaySql,
    sink: Box<dyn Sink>,
    job: ReplayJob,
    pace: Pace,
    page: i64,
    window: i64,
    max_attempts: i32,
    progress: Progress,
    /// Events acknowledged in this run.
    sent_now: i64,
    started: Instant,
    /// Test-only (`OUTBOX_FAILPOINT=replay-pause-after-id=N`): park once
    /// the sink acknowledged a page reaching id N, before its cursor is
    /// saved, so a test can kill the process with a page sent and unsaved.
    pause_after_id: Option<i64>,
}

/// How a run ended, short of an error.
enum End {
    Done,
    Stopped,
}

impl<'a> Replay<'a> {
    fn new(
        client: &'a Client,
        sql: &'a ReplaySql,
        sink: Box<dyn Sink>,
        job: ReplayJob,
        rate: f64,
        max_attempts: i32,
    ) -> Self {
        let page = if rate.is_finite() {
            // About ten pages a second: smooth pacing, few round trips.
            // Rates are positive and finite here; the cast saturates.
            #[allow(clippy::cast_possible_truncation)]
            let p = (rate / 10.0).ceil() as i64;
            p.clamp(1, MAX_PAGE)
        } else {
            MAX_PAGE
        };
        let progress = Progress::new(&job);
        Self {
            client,
            sql,
            sink,
            pace: Pace::new(rate),
            page,
            window: (page * 20).max(MIN_WINDOW),
            max_attempts,
            progress,
            sent_now: 0,
            started: Instant::now(),
            pause_after_id: std::env::var("OUTBOX_FAILPOINT")
                .ok()
                .and_then(|v| v.strip_prefix("replay-pause-after-id=")?.parse().ok()),
            job,
        }
    }

    async fn run(mut self) -> anyhow::Result<()> {
        let cancel = super::shutdown_token()?;
        let end = self.pages(&cancel).await;
        self.progress.finish();
        let end = match end {
            Ok(end) => end,
            Err(e) => {
                // The job stays resumable from its cursor; record why it
                // failed if PostgreSQL still answers.
                let why = format!("{e:#}");
                let _ = self.save(ReplayState::Failed, Some(&why)).await;
                return Err(e.context(format!(
                    "replay job {} failed after id {}; fix the cause, then `outbox replay --resume {}`",
                    self.job.id, self.job.cursor_id, self.job.id
                )));
            }
        };
        let secs = self.started.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let per_sec = if secs > 0.0 {
            self.sent_now as f64 / secs
        } else {
            0.0
        };
        match end {
            End::Done => {
                self.save(ReplayState::Done, None).await?;
                println!(
                    "replay job {} done: matched {}, sent {} ({} in this run), removed by cleanup {}{}, {secs:.2} s, \
                     {per_sec:.0} events/s",
                    self.job.id,
                    self.job.matched,
                    self.job.sent,
                    self.sent_now,
                    if self.job.removed.exact { "" } else { "at most " },
                    self.job.removed.count,
                );
                self.removed_meanwhile().await?;
            }
            End::Stopped => {
                self.save(ReplayState::Stopped, None).await?;
                println!(
                    "replay job {} stopped after id {} (sent {} of {}; {} in this run, {secs:.2} s, {per_sec:.0} \
                     events/s); resume with `outbox replay --resume {}`",
                    self.job.id,
                    self.job.cursor_id,
                    self.job.sent,
                    self.job.matched,
                    self.sent_now,
                    self.job.id
                );
            }
        }
        Ok(())
    }

    /// Pages until the bound, a signal or a failure.
    async fn pages(&mut self, cancel: &CancellationToken) -> anyhow::Result<End> {
        // The failing event and how often it failed (not counting
        // unavailable answers, which say nothing about it).
        let mut strikes: (i64, i32) = (0, 0);
        let mut outage = 0_u32;
        loop {
            if cancel.is_cancelled() {
                return Ok(End::Stopped);
            }
            let cursor = self.job.cursor_id;
            if cursor >= self.job.upto_id {
                return Ok(End::Done);
            }
            let through = cursor.saturating_add(self.window).min(self.job.upto_id);
            let rows = self
                .sql
                .page(
                    self.client,
                    &PageParams {
                        filter: &self.job.filter,
                        after_id: cursor,
                        through_id: through,
                        limit: self.page,
                    },
                )
                .await
                .context("reading a page of events")?;
            let full = i64::try_from(rows.len()).unwrap_or(i64::MAX) >= self.page;
            let Some(last) = rows.last() else {
                self.job.cursor_id = through;
                self.save(ReplayState::Running, None).await?;
                continue;
            };
            // A full page may end before the window: the next starts after it.
            let next = if full { last.id } else { through };
            if !self.pace.admit(rows.len(), cancel).await {
                return Ok(End::Stopped);
            }
            // Not raced with the signal: the page is finished (every sink
            // call has a timeout) and its acknowledgements saved.
            let answers = self.sink.deliver(&rows).await;
            let failed = answers.iter().position(Result::is_err);
            let acked = failed.unwrap_or(rows.len());
            if let Some(at) = self.pause_after_id
                && acked > 0
                && rows[acked - 1].id >= at
            {
                tracing::warn!("failpoint replay-pause-after-id reached; parked before saving the cursor");
                outbox::notify::send("OUTBOX_FAILPOINT=replay-pause-after-id reached");
                std::future::pending::<()>().await;
            }
            if acked > 0 {
                self.job.cursor_id = if failed.is_none() {
                    next
                } else {
                    rows[acked - 1].id
                };
                let n = i64::try_from(acked).unwrap_or(i64::MAX);
                self.job.sent += n;
                self.sent_now += n;
                self.save(ReplayState::Running, None).await?;
                self.progress.sent(self.job.sent, self.job.cursor_id);
                outage = 0;
            }
            let Some(i) = failed else { continue };
            let row = &rows[i];
            let Err(error) = &answers[i] else {
                unreachable!("position found an error")
            };
            let what = format!(
                "event id {} (event_id {}, {}/{})",
                row.id, row.event_id, row.aggregate_type, row.aggregate_id
            );
            if !error.is_retryable() {
                anyhow::bail!("the sink refused {what}: {error}");
            }
            let delay = if error.is_unavailable() {
                outage += 1;
                tracing::warn!(sink = self.sink.name(), error = %error, "sink unavailable; retrying");
                backoff(outage)
            } else {
                strikes = if strikes.0 == row.id {
                    (row.id, strikes.1 + 1)
                } else {
                    (row.id, 1)
                };
                if strikes.1 >= self.max_attempts {
                    anyhow::bail!(
                        "the sink failed {what} {} times (--max-attempts): {error}",
                        strikes.1
                    );
                }
                tracing::warn!(event = %what, attempt = strikes.1, error = %error, "delivery failed; retrying");
                backoff(u32::try_from(strikes.1).unwrap_or(u32::MAX))
            };
            // Cancel-safe: a sleep.
            tokio::select! {
                () = cancel.cancelled() => return Ok(End::Stopped),
                () = tokio::time::sleep(delay) => {}
            }
            self.pace.reset();
        }
    }

    /// Saves the cursor, the count and the state: one UPDATE.
    async fn save(&self, state: ReplayState, last_error: Option<&str>) -> anyhow::Result<()> {
        self.sql
            .save_job(
                self.client,
                &SaveReplay {
                    id: self.job.id,
                    cursor_id: self.job.cursor_id,
                    sent: self.job.sent,
                    state,
                    last_error,
                },
            )
            .await
            .context("saving the replay job's cursor")?;
        Ok(())
    }

    /// Warns if cleanup removed matching events while the job ran: those
    /// past the cursor then were never sent.
    async fn removed_meanwhile(&self) -> anyhow::Result<()> {
        let now = self
            .sql
            .removed(self.client, &self.job.filter)
            .await
            .context("reading what cleanup removed")?;
        let more = now.count - self.job.removed.count;
        if more > 0 {
            eprintln!(
                "warning: cleanup removed {more} more matching events while replay job {} ran; those it had not \
                 sent yet were not sent",
                self.job.id
            );
        }
        Ok(())
    }
}

/// The delay before retry `n` (1-based): 200 ms doubling to 30 s.
fn backoff(n: u32) -> Duration {
    BACKOFF_BASE
        .saturating_mul(2_u32.saturating_pow(n.saturating_sub(1)))
        .min(BACKOFF_MAX)
}

/// The pacer: events go out no faster than the rate, page by page.
struct Pace {
    rate: f64,
    since: Instant,
    /// Events admitted since `since`.
    admitted: f64,
}

impl Pace {
    fn new(rate: f64) -> Self {
        Self {
            rate,
            since: Instant::now(),
            admitted: 0.0,
        }
    }

    /// Waits until `n` more events may go; false if cancelled meanwhile.
    /// A page goes at the time its first event is due, so the average over
    /// the run is the rate.
    async fn admit(&mut self, n: usize, cancel: &CancellationToken) -> bool {
        if self.rate.is_infinite() {
            return true;
        }
        let due = self.since + Duration::from_secs_f64(self.admitted / self.rate);
        let now = Instant::now();
        // Behind by more than a second (a slow sink): start again rather
        // than burst to catch up.
        if now > due + Duration::from_secs(1) {
            self.reset();
        }
        #[allow(clippy::cast_precision_loss)]
        {
            self.admitted += n as f64;
        }
        // Cancel-safe: a sleep.
        tokio::select! {
            () = cancel.cancelled() => false,
            () = tokio::time::sleep_until(due.max(now).into()) => true,
        }
    }

    fn reset(&mut self) {
        self.since = Instant::now();
        self.admitted = 0.0;
    }
}

/// A bar with an ETA on a terminal, a log line every few seconds otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    matched: i64,
    last_log: Instant,
}

impl Progress {
    fn new(job: &ReplayJob) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(
                Some(u64::try_from(job.matched).unwrap_or(0)),
                ProgressDrawTarget::stderr(),
            );
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:40} {pos}/{len} events, {per_sec}, ETA {eta} (after id {msg})",
            ) {
                bar.set_style(style);
            }
            bar.set_position(u64::try_from(job.sent).unwrap_or(0));
            bar.reset_eta();
            bar
        });
        Self {
            bar,
            matched: job.matched,
            last_log: Instant::now(),
        }
    }

    fn sent(&mut self, sent: i64, cursor: i64) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(u64::try_from(sent).unwrap_or(0));
                bar.set_message(cursor.to_string());
            }
            None if self.last_log.elapsed() >= LOG_EVERY => {
                self.last_log = Instant::now();
                tracing::info!(sent, matched = self.matched, cursor, "replay progress");
            }
            None => {}
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_cap() {
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(3), Duration::from_millis(800));
        assert_eq!(backoff(40), BACKOFF_MAX);
    }

    #[test]
    fn formats_round_trip() {
        for (format, mode) in [
            (Format::Native, CloudEventsMode::Structured),
            (Format::CloudEvents, CloudEventsMode::Structured),
            (Format::CloudEvents, CloudEventsMode::Binary),
            (Format::Debezium, CloudEventsMode::Structured),
        ] {
            let name = format_name(&Formatter::new(format, mode, "s"));
            assert_eq!(parse_format(&name).unwrap(), (format, mode), "{name}");
        }
    }

    #[test]
    fn passwords_are_not_stored() {
        assert_eq!(
            Target::parse("amqp://user:pw@rabbit:5672/%2f").stored(),
            "amqp://user:***@rabbit:5672/%2f"
        );
        assert_eq!(Target::parse("route:orders").stored(), "route:orders");
    }
}
