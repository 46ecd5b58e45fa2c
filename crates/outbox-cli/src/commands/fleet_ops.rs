//! The many-outbox side of `outbox stats`, `outbox dlq list` and `outbox
//! relays` (`--schemas PATTERN [--databases PATTERN]`, or `--all`): the
//! same reports over every outbox a fleet would serve, one database at a
//! time, each outbox labelled as the fleet labels it (`schema.table`,
//! `database/schema.table` with --databases, a listed outbox's name).
//! Which outboxes those are is `super::selection`'s.
//!
//! Who serves an outbox is PostgreSQL's word, not a fleet's: the session
//! holding its own lock (`outbox::sql::fleet`), a fleet process's control
//! session, named by its `application_name`. An outbox whose schema is not
//! at this binary's version is left out with a warning, as the fleet
//! leaves it unserved, rather than failing the report for every other.

use std::collections::HashMap;

use anyhow::Context;
use chrono::SecondsFormat;
use outbox::sql::fleet::{self, FleetSession, Summary};
use serde::Serialize;
use tokio_postgres::Client;

use super::selection::{Member, Selection};
use crate::cli::{FleetScope, Global};

/// Whether `outbox` can be read by this binary: the role's privileges
/// (exit 2 if missing, as for one outbox) and its schema version. A schema
/// at another version is a warning and `false`: the outbox is left out.
pub(crate) async fn readable(
    client: &Client,
    member: &Member,
    roles: &[outbox::privileges::Role],
    left_out: &mut Vec<LeftOut>,
) -> anyhow::Result<bool> {
    super::require(client, &member.config, roles).await?;
    match outbox::check(client, &member.config).await {
        Ok(()) => Ok(true),
        Err(e @ (outbox::Error::NotMigrated { .. } | outbox::Error::SchemaTooNew { .. })) => {
            eprintln!("warning: {} left out: {e}", member.label);
            left_out.push(LeftOut {
                outbox: member.label.clone(),
                reason: e.to_string(),
            });
            Ok(false)
        }
        Err(e) => Err(e).with_context(|| format!("checking the outbox {}", member.label)),
    }
}

/// An outbox the report could not read.
#[derive(Debug, Serialize)]
pub(crate) struct LeftOut {
    outbox: String,
    reason: String,
}

/// The fleet process serving an outbox.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ServedBy {
    pid: i32,
    application_name: String,
}

impl std::fmt::Display for ServedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.application_name.is_empty() {
            write!(f, "pid {}", self.pid)
        } else {
            write!(f, "{} (pid {})", self.application_name, self.pid)
        }
    }
}

/// Who serves which outbox key in the connected database.
async fn served_by(client: &Client) -> anyhow::Result<HashMap<i32, ServedBy>> {
    let owners = fleet::owners(client)
        .await
        .context("reading which fleet process serves which outbox")?;
    let names: HashMap<i32, String> = fleet::sessions(client)
        .await
        .context("reading the fleet processes")?
        .into_iter()
        .map(|s| (s.pid, s.application_name))
        .collect();
    Ok(owners
        .into_iter()
        .map(|(key, pid)| {
            let application_name = names.get(&pid).cloned().unwrap_or_default();
            (
                key,
                ServedBy {
                    pid,
                    application_name,
                },
            )
        })
        .collect())
}

/// The fleet process serving the one outbox `config`, if one does: the
/// single-outbox `relays` says so, as a fleet holds no partitions.
pub(crate) async fn serving(client: &Client, config: &outbox::Config) -> anyhow::Result<Option<ServedBy>> {
    let key = fleet::outbox_key(client, config)
        .await
        .context("reading the outbox's lock key")?;
    Ok(served_by(client).await?.remove(&key))
}

#[derive(Debug, Serialize)]
struct OutboxStats {
    outbox: String,
    database: Option<String>,
    schema: String,
    table: String,
    #[serde(flatten)]
    summary: Summary,
    /// The control session holding the outbox's own lock; null when no
    /// fleet process serves it.
    served_by: Option<ServedBy>,
}

#[derive(Debug, Default, Serialize)]
struct Totals {
    outboxes: usize,
    backlog: i64,
    due_now: i64,
    waiting: i64,
    dead_letters: i64,
    given_up: i64,
    oldest_unpublished_age_seconds: Option<f64>,
    served: usize,
    unserved: usize,
}

#[derive(Debug, Serialize)]
struct FleetStats {
    /// By backlog, largest first; `--top` of them.
    outboxes: Vec<OutboxStats>,
    /// Over every outbox read, shown or not.
    total: Totals,
    left_out: Vec<LeftOut>,
}

/// `outbox stats --schemas` and `--all`.
pub(crate) async fn stats(selection: Selection, top: Option<usize>, json: bool) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let mut left_out = Vec::new();
    for db in &selection.databases {
        let served = served_by(&db.client).await?;
        for member in &db.outboxes {
            if !readable(
                &db.client,
                member,
                &[outbox::privileges::Role::Stats],
                &mut left_out,
            )
            .await?
            {
                continue;
            }
            let config = &member.config;
            let summary = fleet::summary(&db.client, config)
                .await
                .with_context(|| format!("reading the backlog of {}", member.label))?;
            rows.push(OutboxStats {
                outbox: member.label.clone(),
                database: db.name.clone(),
                schema: config.schema.as_str().to_owned(),
                table: config.table.as_str().to_owned(),
                summary,
                served_by: served.get(&member.key).cloned(),
            });
        }
    }
    let total = rows.iter().fold(Totals::default(), |mut t, r| {
        let s = &r.summary;
        t.outboxes += 1;
        t.backlog += s.backlog;
        t.due_now += s.due_now;
        t.waiting += s.waiting;
        t.dead_letters += s.dead_letters;
        t.given_up += s.given_up;
        t.oldest_unpublished_age_seconds =
            match (t.oldest_unpublished_age_seconds, s.oldest_unpublished_age_seconds) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
        if r.served_by.is_some() {
            t.served += 1;
        } else {
            t.unserved += 1;
        }
        t
    });
    rows.sort_by(|a, b| {
        b.summary
            .backlog
            .cmp(&a.summary.backlog)
            .then_with(|| a.outbox.cmp(&b.outbox))
    });
    rows.truncate(top.unwrap_or(usize::MAX));
    let report = FleetStats {
        outboxes: rows,
        total,
        left_out,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let width = label_width(report.outboxes.iter().map(|r| r.outbox.as_str()));
    println!(
        "{:<width$}  {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}  served by",
        "outbox", "backlog", "due now", "waiting", "dead", "given up", "oldest"
    );
    for r in &report.outboxes {
        let s = &r.summary;
        let served = r
            .served_by
            .as_ref()
            .map_or_else(|| "-".to_owned(), ToString::to_string);
        println!(
            "{:<width$}  {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}  {served}",
            r.outbox,
            s.backlog,
            s.due_now,
            s.waiting,
            s.dead_letters,
            s.given_up,
            age(s.oldest_unpublished_age_seconds)
        );
    }
    let t = &report.total;
    println!(
        "{:<width$}  {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}  {} served, {} by nobody",
        format!(
            "total ({})",
            super::counted(t.outboxes as u64, "outbox", "outboxes")
        ),
        t.backlog,
        t.due_now,
        t.waiting,
        t.dead_letters,
        t.given_up,
        age(t.oldest_unpublished_age_seconds),
        t.served,
        t.unserved
    );
    Ok(())
}

/// `12.3s`, or `-` with nothing pending.
fn age(seconds: Option<f64>) -> String {
    seconds.map_or_else(|| "-".to_owned(), |s| format!("{s:.1}s"))
}

/// The width of the label column: the longest label, and at least the
/// totals line's.
fn label_width<'a>(labels: impl Iterator<Item = &'a str>) -> usize {
    labels.map(str::len).max().unwrap_or(0).max(20)
}

/// A dead letter with the outbox it is in.
#[derive(Debug, Serialize)]
struct LabelledDead {
    outbox: String,
    #[serde(flatten)]
    dead: outbox::sql::DeadLetter,
}

/// `outbox dlq list --schemas` and `--all`: by outbox label, then oldest
/// first, at most `limit` over all outboxes.
pub(crate) async fn dead_letters(selection: Selection, limit: i64, json: bool) -> anyhow::Result<()> {
    let mut listed: Vec<LabelledDead> = Vec::new();
    let mut left_out = Vec::new();
    let mut outboxes = 0_u64;
    'databases: for db in &selection.databases {
        for member in &db.outboxes {
            let remaining = limit - listed.len() as i64;
            if remaining <= 0 {
                break 'databases;
            }
            if !readable(
                &db.client,
                member,
                &[outbox::privileges::Role::Stats],
                &mut left_out,
            )
            .await?
            {
                continue;
            }
            outboxes += 1;
            let dead = outbox::sql::OutboxSql::new(&member.config)
                .dead_letters(&db.client, remaining)
                .await
                .with_context(|| format!("listing the dead letters of {}", member.label))?;
            listed.extend(dead.into_iter().map(|dead| LabelledDead {
                outbox: member.label.clone(),
                dead,
            }));
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&listed)?);
        return Ok(());
    }
    if listed.is_empty() {
        println!(
            "no dead letters in {} {}",
            super::counted(outboxes, "outbox", "outboxes"),
            selection.what
        );
        return Ok(());
    }
    let width = label_width(listed.iter().map(|d| d.outbox.as_str()));
    println!(
        "{:<width$}  {:>10}  {:<36}  {:<24}  {:<20}  {:>8}  last_error",
        "outbox", "id", "event_id", "aggregate", "event_type", "attempts"
    );
    for LabelledDead { outbox, dead: d } in &listed {
        println!(
            "{outbox:<width$}  {:>10}  {:<36}  {:<24}  {:<20}  {:>8}  {}{}",
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
    if listed.len() as i64 >= limit {
        println!("(--limit {limit} reached: there may be more)");
    }
    Ok(())
}

/// A fleet process in one database.
#[derive(Debug, Serialize)]
struct Process {
    #[serde(flatten)]
    session: FleetSession,
    /// Matching outboxes it serves.
    serves: usize,
}

/// One database's fleet processes.
#[derive(Debug, Serialize)]
struct DatabaseRelays {
    database: String,
    /// Matching outboxes (named --table, migrated).
    outboxes: usize,
    processes: Vec<Process>,
    /// Matching outboxes no fleet process serves.
    unserved: usize,
    /// The slot a fleet with `--source wal` reads them through, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    slot: Option<outbox::sql::SlotState>,
}

/// `outbox relays --schemas` and `--all`: reads locks and
/// `pg_stat_activity` only, so it needs no privilege on the outboxes.
pub(crate) async fn relays(selection: Selection, json: bool) -> anyhow::Result<()> {
    let mut report = Vec::new();
    for db in &selection.databases {
        let database = match &db.name {
            Some(name) => name.clone(),
            None => fleet::current_database(&db.client)
                .await
                .context("reading the database's name")?,
        };
        let owners: HashMap<i32, i32> = fleet::owners(&db.client)
            .await
            .context("reading which fleet process serves which outbox")?
            .into_iter()
            .collect();
        let sessions = fleet::sessions(&db.client)
            .await
            .context("reading the fleet processes")?;
        // Only the matching outboxes count: a process may serve others
        // (another pattern or --table) in the same database.
        let owner_of = |t: &Member| owners.get(&t.key).copied();
        let processes = sessions
            .into_iter()
            .map(|session| Process {
                serves: db
                    .outboxes
                    .iter()
                    .filter(|&t| owner_of(t) == Some(session.pid))
                    .count(),
                session,
            })
            .collect();
        let slot = match &selection.schemas {
            Some(schemas) => {
                outbox::wal::fleet_slot_state(&db.client, &database, schemas, &selection.template)
                    .await
                    .context("reading the fleet's replication slot")?
            }
            None => None,
        };
        report.push(DatabaseRelays {
            slot,
            database,
            outboxes: db.outboxes.len(),
            processes,
            unserved: db.outboxes.iter().filter(|&t| owner_of(t).is_none()).count(),
        });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    for (i, d) in report.iter().enumerate() {
        if i > 0 {
            println!();
        }
        println!(
            "database {}: {} {}, {}",
            d.database,
            super::counted(d.outboxes as u64, "outbox", "outboxes"),
            selection.what,
            super::counted(d.processes.len() as u64, "fleet process", "fleet processes")
        );
        println!(
            "  {:>8}  {:<24}  {:<16}  {:<20}  {:>7}",
            "pid", "application_name", "client", "backend_start", "serves"
        );
        for p in &d.processes {
            let s = &p.session;
            println!(
                "  {:>8}  {:<24}  {:<16}  {:<20}  {:>7}",
                s.pid,
                s.application_name,
                s.client_addr.as_deref().unwrap_or("-"),
                s.backend_start.map_or_else(
                    || "-".to_owned(),
                    |t| t.to_rfc3339_opts(SecondsFormat::Secs, true)
                ),
                p.serves
            );
        }
        println!(
            "  {:>8}  {:<24}  {:<16}  {:<20}  {:>7}",
            "", "(nobody)", "", "", d.unserved
        );
        if let Some(slot) = &d.slot {
            println!("  log tailing (--source wal): {slot}");
        }
    }
    Ok(())
}

/// The outboxes `--schemas` or `--all` select, connected; None for one
/// outbox ([`one`]: `--outbox`, whose fleet `--schemas` may give).
pub(crate) async fn many(g: &Global, scope: &FleetScope) -> anyhow::Result<Option<Selection>> {
    let config = scope.config.as_deref();
    let databases = scope.databases.as_deref();
    Ok(match (&scope.schemas, scope.named.all, &scope.named.outbox) {
        (schemas, true, _) => Some(super::selection::all(g, config, schemas.as_deref(), databases).await?),
        (Some(schemas), false, None) => Some(super::selection::pattern(g, schemas, databases).await?),
        _ => None,
    })
}

/// The one outbox of `--outbox NAME`, or of --schema and --table.
pub(crate) async fn one(g: &Global, scope: &FleetScope) -> anyhow::Result<super::selection::Chosen> {
    super::selection::one(
        g,
        scope.named.outbox.as_deref(),
        scope.config.as_deref(),
        scope.schemas.as_deref(),
        scope.databases.as_deref(),
    )
    .await
}
