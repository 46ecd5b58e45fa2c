//! `outbox replay`: re-deliver published events to a sink, resumably.
//!
//! Owns the command's flow: starting a job (target and filter checked,
//! then counted and recorded) or resuming one under its lock, `--dry-run`,
//! `--list`, progress (`progress.rs`) and the summary. The target is
//! `target.rs`'s. The engine (the paced page loop, its retries through the
//! relay's breaker and backoff, the cursor, and what replay guarantees) is
//! `outbox_relay::replay`'s; the SQL is `outbox::sql::ReplaySql`'s.

use std::time::Instant;

use anyhow::Context;
use outbox::sql::{NewReplay, ReplayFilter, ReplayJob, ReplaySql, ReplayState};
use outbox_relay::replay::{DEFAULT_RATE, End, Replay, Settings};
use outbox_relay::sink::format::Formatter;
use outbox_relay::{Backoff, Sink};
use tokio_postgres::Client;

use super::selection::{Chosen, Selection};
use crate::cli::{Global, ReplayArgs};
use crate::exit::ConfigError;

mod progress;
pub(crate) mod target;

use progress::Progress;
use target::{Target, format_name, parse_format};

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

pub(crate) async fn run(g: &Global, args: ReplayArgs) -> anyhow::Result<()> {
    if args.named.all {
        if !args.list {
            // A replay job is one outbox's: its cursor, filter and target.
            return Err(ConfigError(
                "replay --all: a replay re-delivers one outbox's events (one job, one cursor); starting one in \
                 every outbox at once is not offered, as one mistyped command would re-send every tenant's \
                 events: name the outbox with --outbox NAME (--all is for `replay --list --all`)"
                    .to_owned(),
            )
            .into());
        }
        let selection = super::selection::all(g, args.config.as_deref(), None, None).await?;
        return list_all(selection, args.json).await;
    }
    let chosen = super::selection::one(
        g,
        args.named.outbox.as_deref(),
        args.config.as_deref(),
        None,
        None,
    )
    .await?;
    if args.list {
        let client = connected(&chosen).await?;
        return list(&client, &ReplaySql::new(&chosen.config)?, args.json).await;
    }
    match args.resume {
        Some(id) => resume(g, &chosen, id, args).await,
        None => start(g, &chosen, args).await,
    }
}

/// A new job: target and filter checked before PostgreSQL is touched, then
/// counted, recorded and run (or, with `--dry-run`, only counted).
async fn start(g: &Global, chosen: &Chosen, args: ReplayArgs) -> anyhow::Result<()> {
    let config = &chosen.config;
    let options = super::sink_options(config, *args.sink_options);
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
    let client = connected(chosen).await?;
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
    run_job(g, &client, &sql, sink, job, rate).await
}

/// A connection to a migrated outbox.
async fn connected(chosen: &Chosen) -> anyhow::Result<Client> {
    let client = super::connect(&chosen.pg).await?;
    outbox::check(&client, &chosen.config).await?;
    Ok(client)
}

/// Continues job `id` from its cursor, with its filter, target and format.
async fn resume(g: &Global, chosen: &Chosen, id: i64, args: ReplayArgs) -> anyhow::Result<()> {
    let config = &chosen.config;
    let mut options = super::sink_options(config, *args.sink_options);
    let client = &connected(chosen).await?;
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
    // The job keeps its target masked (no password, no query value), so
    // the operator gives the URL again and it must mask to the same text.
    // A job stored before query values were masked holds them in clear:
    // compared masked too, and usable as it is.
    let shown = Target::shown(&job.target);
    let target = match args.to {
        Some(to) => {
            let given = Target::parse(&to);
            if given.stored() != shown {
                return Err(ConfigError(format!(
                    "--to {} is not replay job {id}'s target {shown} (leave --to out, or give the job's own URL)",
                    given.stored(),
                ))
                .into());
            }
            given
        }
        None if job.target.contains(outbox_relay::redact::HIDDEN) => {
            return Err(ConfigError(format!(
                "replay job {id}'s target {shown} held a password or query values, which are never stored: give \
                 the URL again with --to (`outbox replay --resume {id} --to <URL>`)"
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
        "replay job {id}: resuming after id {} ({} of {} sent) up to {} to {shown} ({}, {})",
        job.cursor_id,
        job.sent,
        job.matched,
        job.upto_id,
        job.format,
        Rate(rate)
    );
    run_job(g, client, sql, sink, job, rate).await
}

/// Runs a created or resumed (and locked) job with the engine, showing
/// progress, and says how it ended.
async fn run_job(
    g: &Global,
    client: &Client,
    sql: &ReplaySql,
    sink: Box<dyn Sink>,
    job: ReplayJob,
    rate: f64,
) -> anyhow::Result<()> {
    let cancel = crate::commands::shutdown_token()?;
    let settings = Settings {
        rate,
        backoff: Backoff {
            max_attempts: g.max_attempts,
            ..Backoff::default()
        },
        pause_after_id: std::env::var("OUTBOX_FAILPOINT")
            .ok()
            .and_then(|v| v.strip_prefix("replay-pause-after-id=")?.parse().ok()),
    };
    let mut progress = Progress::new(&job);
    let started = Instant::now();
    let mut replay = Replay::new(client, sql, sink, job, settings);
    let end = replay
        .run(&cancel, &mut |job| progress.sent(job.sent, job.cursor_id))
        .await;
    progress.finish();
    let job = replay.job();
    let end = end.map_err(|e| {
        anyhow::Error::new(e).context(format!(
            "replay job {} failed after id {}; fix the cause, then `outbox replay --resume {}`",
            job.id, job.cursor_id, job.id
        ))
    })?;
    let secs = started.elapsed().as_secs_f64();
    #[allow(clippy::cast_precision_loss)]
    let per_sec = if secs > 0.0 {
        replay.sent_now() as f64 / secs
    } else {
        0.0
    };
    match end {
        End::Done => {
            println!(
                "replay job {} done: matched {}, sent {} ({} in this run), removed by cleanup {}{}, {secs:.2} s, \
                 {per_sec:.0} events/s",
                job.id,
                job.matched,
                job.sent,
                replay.sent_now(),
                if job.removed.exact { "" } else { "at most " },
                job.removed.count,
            );
            let more = replay.removed_meanwhile().await?;
            if more > 0 {
                eprintln!(
                    "warning: cleanup removed {more} more matching events while replay job {} ran; those it had \
                     not sent yet were not sent",
                    job.id
                );
            }
        }
        End::Stopped => {
            println!(
                "replay job {} stopped after id {} (sent {} of {}; {} in this run, {secs:.2} s, {per_sec:.0} \
                 events/s); resume with `outbox replay --resume {}`",
                job.id,
                job.cursor_id,
                job.sent,
                job.matched,
                replay.sent_now(),
                job.id
            );
        }
    }
    Ok(())
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
    let jobs = jobs(client, sql).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&jobs)?);
        return Ok(());
    }
    print_jobs(jobs.into_iter().map(|job| (None, job)).collect());
    Ok(())
}

/// A job with the outbox it replays, for `--list --all`.
#[derive(serde::Serialize)]
struct LabelledJob {
    outbox: String,
    #[serde(flatten)]
    job: ReplayJob,
}

/// `--list --all`: every outbox's jobs, by outbox, newest first in each.
async fn list_all(selection: Selection, json: bool) -> anyhow::Result<()> {
    let mut listed = Vec::new();
    let mut left_out = Vec::new();
    for db in &selection.databases {
        for member in &db.outboxes {
            if !super::fleet_ops::readable(&db.client, member, &[], &mut left_out).await? {
                continue;
            }
            let sql = ReplaySql::new(&member.config)?;
            let jobs = jobs(&db.client, &sql)
                .await
                .with_context(|| format!("in {}", member.label))?;
            listed.extend(jobs.into_iter().map(|job| LabelledJob {
                outbox: member.label.clone(),
                job,
            }));
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&listed)?);
        return Ok(());
    }
    print_jobs(listed.into_iter().map(|l| (Some(l.outbox), l.job)).collect());
    Ok(())
}

/// The jobs of one outbox, newest first, targets as shown.
async fn jobs(client: &Client, sql: &ReplaySql) -> anyhow::Result<Vec<ReplayJob>> {
    let mut jobs = sql.jobs(client).await.context("listing replay jobs")?;
    for job in &mut jobs {
        job.target = Target::shown(&job.target);
    }
    Ok(jobs)
}

/// The jobs as a table, with an outbox column when they are labelled.
fn print_jobs(jobs: Vec<(Option<String>, ReplayJob)>) {
    if jobs.is_empty() {
        println!("no replay jobs");
        return;
    }
    let width = jobs
        .iter()
        .filter_map(|(outbox, _)| Some(outbox.as_ref()?.len()))
        .max()
        .map(|w| w.max("outbox".len()));
    let column = |label: &str| width.map_or_else(String::new, |width| format!("{label:<width$}  "));
    println!(
        "{}{:>6}  {:<18}  {:>15}  {:>12}  {:>8}  {:<20}  {:<32}  filter",
        column("outbox"),
        "id",
        "state",
        "sent/matched",
        "cursor",
        "removed",
        "created",
        "target"
    );
    for (label, j) in &jobs {
        let state = match (j.state, j.live) {
            (ReplayState::Running, false) => "running (no process)".to_owned(),
            (s, _) => s.as_str().to_owned(),
        };
        println!(
            "{}{:>6}  {:<18}  {:>15}  {:>12}  {:>8}  {:<20}  {:<32}  {}{}",
            column(label.as_deref().unwrap_or_default()),
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
