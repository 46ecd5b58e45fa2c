//! `outbox consume`: a consumer worker (Redis Streams consumer group or NATS
//! JetStream durable pull consumer) whose side effect is one SQL statement,
//! applied once per event through the inbox and acknowledged only after it
//! committed (`outbox::worker`).

use anyhow::Context;
use outbox::Inbox;
use outbox::worker::Message;
use outbox::worker::nats::NatsWorker;
use outbox::worker::redis::RedisWorker;
use tokio_postgres::types::Type;
use tracing::info;

use crate::cli::{ConsumeArgs, Global};
use crate::exit::ConfigError;

pub(crate) async fn run(g: &Global, args: ConsumeArgs) -> anyhow::Result<()> {
    let nats = args.from.starts_with("nats://");
    if !nats && !args.from.starts_with("redis://") && !args.from.starts_with("rediss://") {
        return Err(ConfigError(format!(
            "--from must be a redis:// or nats:// URL, not {:?}",
            args.from
        ))
        .into());
    }
    let inbox = Inbox::new(args.inbox_table.config()?);
    let mut db = super::connect(&super::pg_config(g)?).await?;
    outbox::check_inbox(&db, inbox.config()).await?;
    // Typed, so `$4->>'field'` needs no casts; unused parameters are fine.
    let apply = db
        .prepare_typed(
            &args.apply,
            &[Type::UUID, Type::TEXT, Type::TEXT, Type::JSONB, Type::JSONB],
        )
        .await
        .map_err(|e| {
            ConfigError(format!(
                "--apply does not prepare: {}",
                e.as_db_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_owned())
            ))
        })?;
    let consumer = args
        .consumer
        .unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()));
    let pause_after_commit = std::env::var("OUTBOX_FAILPOINT").is_ok_and(|v| v == "pause-after-commit");
    let cancel = super::shutdown_token()?;
    let effect = async |tx: &tokio_postgres::Transaction<'_>, m: &Message| {
        tx.execute(
            &apply,
            &[
                &m.event_id,
                &m.aggregate_id,
                &m.event_type,
                &m.payload,
                &m.headers,
            ],
        )
        .await
        .map(drop)
    };
    let stats = if nats {
        let mut worker = NatsWorker::new(&args.from, &args.stream, &args.group, inbox);
        worker.ack_wait = args.claim_idle;
        worker.pause_after_commit = pause_after_commit;
        info!(stream = %args.stream, durable = %args.group, "consumer ready");
        worker.run(&mut db, cancel, effect).await
    } else {
        let mut worker = RedisWorker::new(&args.from, &args.stream, &args.group, &consumer, inbox)
            .map_err(|e| ConfigError(e.to_string()))?;
        worker.claim_idle = args.claim_idle;
        worker.pause_after_commit = pause_after_commit;
        info!(stream = %args.stream, group = %args.group, %consumer, "consumer ready");
        worker.run(&mut db, cancel, effect).await
    }
    .context("consuming")?;
    info!(
        processed = stats.processed,
        duplicates = stats.duplicates,
        claimed = stats.claimed,
        malformed = stats.malformed,
        "consumer stopped"
    );
    Ok(())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "consumer".to_owned())
}
