//! `outbox dlq`: list dead letters, requeue them once the cause is fixed, or
//! give up on them so they stop blocking their aggregate. Dead letters never
//! expire on their own.

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::cli::{DlqCommand, Global, RetryArgs};

#[derive(Debug, Serialize)]
struct DeadLetter {
    id: i64,
    event_id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    attempts: i32,
    last_error: Option<String>,
    created_at: DateTime<Utc>,
    /// Set by `dlq skip`: kept for the record, no longer blocking.
    given_up_at: Option<DateTime<Utc>>,
}

pub(crate) async fn run(g: &Global, command: DlqCommand) -> anyhow::Result<()> {
    let config = super::outbox_config(g)?;
    let client = super::connect(&super::pg_config(g)?).await?;
    outbox::check(&client, &config).await?;
    let sql = outbox::sql::OutboxSql::new(&config);
    match command {
        DlqCommand::List { json, limit } => {
            let rows = client
                .query(&sql.list_dead, &[&g.max_attempts, &limit])
                .await
                .context("listing dead letters")?;
            let dead: Vec<DeadLetter> = rows
                .iter()
                .map(|r| DeadLetter {
                    id: r.get("id"),
                    event_id: r.get("event_id"),
                    aggregate_type: r.get("aggregate_type"),
                    aggregate_id: r.get("aggregate_id"),
                    event_type: r.get("event_type"),
                    attempts: r.get("attempts"),
                    last_error: r.get("last_error"),
                    created_at: r.get("created_at"),
                    given_up_at: r.get("given_up_at"),
                })
                .collect();
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
        DlqCommand::Retry(args) => retry(&client, &sql, &config, g.max_attempts, args).await?,
        DlqCommand::Skip { id } => {
            let n = client
                .execute(&sql.give_up_dead, &[&g.max_attempts, &id])
                .await
                .context("giving up on dead letters")?;
            if n > 0 {
                // The aggregates' later events may be claimable now.
                client
                    .execute(sql.notify, &[&config.channel.as_str()])
                    .await
                    .context("notifying relays")?;
            }
            println!("gave up on {n} dead letters in {}", config.display_name());
        }
    }
    Ok(())
}

async fn retry(
    client: &tokio_postgres::Client,
    sql: &outbox::sql::OutboxSql,
    config: &outbox::Config,
    max_attempts: i32,
    args: RetryArgs,
) -> anyhow::Result<()> {
    // `--all` is the absence of filters; other selectors narrow it.
    let ids: Option<Vec<i64>> = (!args.id.is_empty()).then_some(args.id);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
        [&max_attempts, &ids, &args.aggregate_type, &args.error_contains];
    if args.dry_run {
        let n: i64 = client
            .query_one(&sql.count_dead, &params)
            .await
            .context("counting dead letters")?
            .get(0);
        println!("would requeue {n} dead letters in {}", config.display_name());
        return Ok(());
    }
    let n = client
        .execute(&sql.requeue_dead, &params)
        .await
        .context("requeueing dead letters")?;
    if n > 0 {
        // Requeued rows produce no INSERT, so wake the relays explicitly.
        client
            .execute(sql.notify, &[&config.channel.as_str()])
            .await
            .context("notifying relays")?;
    }
    println!("requeued {n} dead letters in {}", config.display_name());
    Ok(())
}
