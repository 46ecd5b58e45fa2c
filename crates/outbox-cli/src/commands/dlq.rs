//! `outbox dlq`: list dead letters, show one with its attempt history,
//! requeue them once the cause is fixed, or give up on them so they stop
//! blocking their aggregate. Dead letters never expire on their own.
//! `--outbox NAME` names one outbox of a fleet (`super::selection`); `list
//! --schemas` and `list --all` list every tenant outbox's
//! (`super::fleet_ops`).

use anyhow::Context;
use chrono::{DateTime, Utc};
use outbox::sql::{DeadFilter, EventDetail};

use crate::cli::{DlqArgs, DlqCommand, Global, RequeueArgs};
use crate::exit::ConfigError;

pub(crate) async fn run(g: &Global, args: DlqArgs) -> anyhow::Result<()> {
    let command = args.command;
    let file = args.config.as_deref();
    if let Some(all) = refused_all(&command) {
        return Err(ConfigError(all).into());
    }
    if let DlqCommand::List {
        json,
        limit,
        all: true,
    } = command
    {
        let selection =
            super::selection::all(g, file, args.schemas.as_deref(), args.databases.as_deref()).await?;
        return super::fleet_ops::dead_letters(selection, limit, json).await;
    }
    if let Some(schemas) = &args.schemas {
        let DlqCommand::List { json, limit, .. } = command else {
            // Changing many outboxes at once is not offered yet: one
            // mistyped pattern would requeue or purge every tenant's.
            return Err(ConfigError(format!(
                "`dlq {}` changes one outbox: name it with --outbox NAME or --schema (--schemas is for `dlq list` \
                 only)",
                name(&command)
            ))
            .into());
        };
        let selection = super::selection::pattern(g, schemas, args.databases.as_deref()).await?;
        return super::fleet_ops::dead_letters(selection, limit, json).await;
    }
    if let DlqCommand::Requeue(requeue) = &command
        && requeue.all
        && args.outbox.is_none()
    {
        refuse_fleet_requeue(g, file)?;
    }
    let super::selection::Chosen { pg, config } = super::selection::one(
        g,
        args.outbox.as_deref(),
        file,
        args.schemas.as_deref(),
        args.databases.as_deref(),
    )
    .await?;
    let client = super::connect(&pg).await?;
    super::require(&client, &config, &[super::dlq_role(&command)]).await?;
    outbox::check(&client, &config).await?;
    let sql = outbox::sql::OutboxSql::new(&config);
    match command {
        DlqCommand::List { json, limit, .. } => {
            let dead = sql
                .dead_letters(&client, limit)
                .await
                .context("listing dead letters")?;
            if json {
                println!("{}", serde_json::to_string_pretty(&dead)?);
            } else if dead.is_empty() {
                println!("no dead letters in {}", config.display_name());
            } else {
                println!(
                    "{:>10}  {:<36}  {:<24}  {:<20}  {:>8}  last_error",
                    "id", "event_id", "aggregate", "event_type", "attempts"
                );
                for d in &dead {
                    println!(
                        "{:>10}  {:<36}  {:<24}  {:<20}  {:>8}  {}{}",
                        d.id,
                        d.event_id,
                        format!("{}/{}", d.aggregate_type, d.aggregate_id),
                        d.event_type,
                        d.attempts,
                        if d.given_up_at.is_some() {
                            "[given up] "
                        } else {
                            ""
                        },
                        d.last_error.as_deref().unwrap_or("")
                    );
                }
            }
        }
        DlqCommand::Show { id, json, .. } => {
            let story = sql
                .event_story(&client, Some(id), None)
                .await
                .context("reading the event")?;
            let Some(story) = story else {
                anyhow::bail!(
                    "no event with id {id} in {}: never written, or delivered and removed by `outbox cleanup`",
                    config.display_name()
                );
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&story.event)?);
            } else {
                print!("{}", show(&story.event));
            }
        }
        DlqCommand::Requeue(args) => requeue(&client, &sql, &config, args).await?,
        DlqCommand::GiveUp { id, .. } => {
            let n = sql
                .give_up(&client, &id)
                .await
                .context("giving up on dead letters")?;
            if n == 0 {
                anyhow::bail!(
                    "none of the ids {id:?} is a dead letter in {} that was not given up on already (see `outbox dlq list`)",
                    config.display_name()
                );
            }
            // The aggregates' later events may be claimable now.
            sql.notify(&client, config.channel.as_str())
                .await
                .context("notifying relays")?;
            println!(
                "gave up on {} in {}",
                super::counted(n, "dead letter", "dead letters"),
                config.display_name()
            );
        }
        DlqCommand::Purge {
            older_than, dry_run, ..
        } => {
            let age = humantime::format_duration(older_than);
            if dry_run {
                let n = sql
                    .count_purge_given_up(&client, older_than)
                    .await
                    .context("counting given-up dead letters")?;
                println!(
                    "would delete {} given up on more than {age} ago in {}",
                    super::counted(n.unsigned_abs(), "dead letter", "dead letters"),
                    config.display_name()
                );
                return Ok(());
            }
            let mut deleted = 0;
            loop {
                let n = sql
                    .purge_given_up(&client, older_than)
                    .await
                    .context("deleting given-up dead letters")?;
                deleted += n;
                if n == 0 {
                    break;
                }
            }
            println!(
                "deleted {} given up on more than {age} ago in {}",
                super::counted(deleted, "dead letter", "dead letters"),
                config.display_name()
            );
        }
    }
    Ok(())
}

/// `--all` means every outbox of the fleet only for `dlq list`: the
/// others read or change one outbox, and changing every tenant's at once
/// is not offered (one mistyped command would requeue or purge them all).
/// `requeue --all` is its own selector, every dead letter of one outbox.
fn refused_all(command: &DlqCommand) -> Option<String> {
    let (DlqCommand::Show { all: true, .. }
    | DlqCommand::GiveUp { all: true, .. }
    | DlqCommand::Purge { all: true, .. }) = command
    else {
        return None;
    };
    Some(format!(
        "`dlq {} --all`: --all (every outbox of the fleet) is for `dlq list` only; `dlq {}` works on one outbox, \
         so that one mistyped command cannot change every tenant's: name it with --outbox NAME",
        name(command),
        name(command)
    ))
}

/// `dlq requeue --all` requeues every dead letter of one outbox. Given a
/// --config that describes a fleet and no --outbox, it could be read as
/// every outbox's: refused, rather than requeueing the --schema outbox
/// (by default `public`) the operator may not have meant.
fn refuse_fleet_requeue(g: &Global, file: Option<&std::path::Path>) -> anyhow::Result<()> {
    let Some(path) = file.filter(|_| g.schema == "public") else {
        return Ok(());
    };
    let read = crate::config::ConfigFile::read(path)?;
    let body = read.body();
    if body.outbox_names().is_empty() && !body.sets("schemas") {
        return Ok(());
    }
    Err(ConfigError(format!(
        "`dlq requeue --all` requeues every dead letter of one outbox, and --config {} describes a fleet: name \
         the outbox with --outbox NAME (`outbox stats --all` lists them), or --schema for one outside it; a \
         requeue across every outbox at once is not offered",
        path.display(),
    ))
    .into())
}

/// The subcommand's name, as typed.
fn name(command: &DlqCommand) -> &'static str {
    match command {
        DlqCommand::List { .. } => "list",
        DlqCommand::Show { .. } => "show",
        DlqCommand::Requeue(_) => "requeue",
        DlqCommand::GiveUp { .. } => "give-up",
        DlqCommand::Purge { .. } => "purge",
    }
}

/// `dlq show` as text: the columns, one per line, the attempt history,
/// oldest first, then the payload and headers.
fn show(e: &EventDetail) -> String {
    use std::fmt::Write as _;
    let when = |at: Option<DateTime<Utc>>| at.map_or_else(|| "-".to_owned(), |t| t.to_rfc3339());
    let state = match (e.published_at, e.given_up_at, e.dead_at) {
        (Some(_), ..) => "published",
        (None, Some(_), _) => "dead letter, given up",
        (None, None, Some(_)) => "dead letter",
        (None, None, None) => "unpublished",
    };
    let mut out = String::new();
    let mut line = |key: &str, value: &str| {
        let _ = writeln!(out, "{key:<16} {value}");
    };
    line("id", &e.id.to_string());
    line("event_id", &e.event_id.to_string());
    line("aggregate", &format!("{}/{}", e.aggregate_type, e.aggregate_id));
    line("event_type", &e.event_type);
    line("state", state);
    line("attempts", &e.attempts.to_string());
    line("created_at", &when(Some(e.created_at)));
    line("first_failed_at", &when(e.first_failed_at));
    line("next_attempt_at", &when(Some(e.next_attempt_at)));
    line("dead_at", &when(e.dead_at));
    line("given_up_at", &when(e.given_up_at));
    line("published_at", &when(e.published_at));
    line("last_error", e.last_error.as_deref().unwrap_or("-"));
    let _ = writeln!(
        out,
        "\nattempt history (last {}, oldest first):",
        outbox::sql::ATTEMPT_LOG_LEN
    );
    if e.attempt_log.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for a in &e.attempt_log {
        let attempt = a.attempt.map_or_else(|| "-".to_owned(), |n| n.to_string());
        let _ = writeln!(
            out,
            "  {}  #{attempt:<4} {:<6} {}",
            a.at.to_rfc3339(),
            a.outcome,
            a.error.as_deref().unwrap_or("")
        );
    }
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    let _ = write!(
        out,
        "\npayload:\n{}\n\nheaders:\n{}\n",
        pretty(&e.payload),
        pretty(&e.headers)
    );
    out
}

async fn requeue(
    client: &tokio_postgres::Client,
    sql: &outbox::sql::OutboxSql,
    config: &outbox::Config,
    args: RequeueArgs,
) -> anyhow::Result<()> {
    // `--all` is the absence of filters; other selectors narrow it.
    let filter = DeadFilter {
        ids: (!args.id.is_empty()).then_some(&args.id),
        aggregate_type: args.aggregate_type.as_deref(),
        error_contains: args.error_contains.as_deref(),
        ..DeadFilter::default()
    };
    if args.dry_run {
        let n = sql
            .count_dead(client, &filter)
            .await
            .context("counting dead letters")?;
        no_match(n == 0, &args, config)?;
        println!(
            "would requeue {} in {}",
            super::counted(n.unsigned_abs(), "dead letter", "dead letters"),
            config.display_name()
        );
        return Ok(());
    }
    let n = sql
        .requeue_dead(client, &filter)
        .await
        .context("requeueing dead letters")?;
    no_match(n == 0, &args, config)?;
    if n > 0 {
        // Requeued rows produce no INSERT, so wake the relays explicitly.
        sql.notify(client, config.channel.as_str())
            .await
            .context("notifying relays")?;
    }
    println!(
        "requeued {} in {}",
        super::counted(n, "dead letter", "dead letters"),
        config.display_name()
    );
    Ok(())
}

/// A selector (`--id`, `--aggregate-type`, `--error-contains`) that matched
/// no dead letter is an error (exit 1), so a script notices a typo; `--all`
/// with nothing dead is not.
fn no_match(none: bool, args: &RequeueArgs, config: &outbox::Config) -> anyhow::Result<()> {
    let mut selectors = Vec::new();
    if !args.id.is_empty() {
        selectors.push(format!("--id {:?}", args.id));
    }
    if let Some(t) = &args.aggregate_type {
        selectors.push(format!("--aggregate-type {t:?}"));
    }
    if let Some(e) = &args.error_contains {
        selectors.push(format!("--error-contains {e:?}"));
    }
    if none && !selectors.is_empty() {
        anyhow::bail!(
            "no dead letter in {} matches {} (see `outbox dlq list`)",
            config.display_name(),
            selectors.join(" ")
        );
    }
    Ok(())
}
