//! `outbox consume`: a consumer worker (Redis Streams consumer group, NATS
//! JetStream durable pull consumer or RabbitMQ queue) whose side effect is one SQL statement,
//! applied once per event through the inbox and acknowledged only after it
//! committed (`outbox::worker`). With `--otlp-endpoint` each inbox
//! transaction is a span whose parent is the event's `traceparent`
//! ([`Traced`]).

use std::sync::Arc;
use std::time::SystemTime;

use anyhow::Context;
use outbox::Inbox;
use outbox::worker::amqp::AmqpWorker;
use outbox::worker::nats::NatsWorker;
use outbox::worker::redis::RedisWorker;
use outbox::worker::{InboxOutcome, Observe, Received, WorkerStats};
use outbox_relay::trace::{InboxSpan, Tracing};
use tokio_postgres::types::Type;
use tracing::{info, warn};

use crate::cli::{ConsumeArgs, Global};
use crate::exit::ConfigError;

pub(crate) async fn run(g: &Global, args: ConsumeArgs) -> anyhow::Result<()> {
    let from = match args.from.split_once("://").map(|(scheme, _)| scheme) {
        Some("redis" | "rediss") => From::Redis,
        Some("nats") => From::Nats,
        Some("amqp" | "amqps") => From::Amqp,
        _ => {
            return Err(ConfigError(format!(
                "--from must be a redis://, nats:// or amqp:// URL, not {:?}",
                args.from
            ))
            .into());
        }
    };
    // Checked before connecting, so a missing flag is exit 2 at once.
    let required = |value: &Option<String>, flag: &str| {
        value
            .clone()
            .ok_or_else(|| ConfigError(format!("{flag} is required with --from {}", args.from)))
    };
    let (stream, group, queue) = match from {
        From::Amqp => (String::new(), String::new(), required(&args.queue, "--queue")?),
        From::Redis | From::Nats => (
            required(&args.stream, "--stream")?,
            required(&args.group, "--group")?,
            String::new(),
        ),
    };
    let inbox = Inbox::new(args.inbox_table.config()?);
    let pg = super::pg_config(g)?;
    let consumer = args
        .consumer
        .clone()
        .unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()));
    let cancel = super::shutdown_token()?;
    let traces = super::start_traces(args.otlp_endpoint.as_deref(), "outbox-consume")?;
    let observer = traces.clone().map(|tracing| {
        let (destination, group) = match from {
            From::Amqp => (queue.clone(), None),
            From::Redis | From::Nats => (stream.clone(), Some(group.clone())),
        };
        Arc::new(Traced {
            tracing,
            system: from.system(),
            destination,
            group,
        }) as Arc<dyn Observe>
    });
    let pause_after_commit = std::env::var("OUTBOX_FAILPOINT").is_ok_and(|v| v == "pause-after-commit");
    let mut total = WorkerStats::default();
    let mut ready = false;
    // One PostgreSQL connection at a time; when it is lost (a restart, a
    // failover, pg_terminate_backend) the worker stops with the message
    // it was on unacknowledged, and a new connection takes over: the
    // broker delivers that message again and the inbox decides.
    // Every way out of the loop goes through `flush_traces`.
    let consumed: anyhow::Result<()> = async {
        loop {
            let mut db = super::connect(&pg).await?;
            super::require_inbox(&db, inbox.config(), &[outbox::privileges::Role::Consume]).await?;
            outbox::check_inbox(&db, inbox.config()).await?;
            // Typed, so `$4->>'field'` needs no casts; unused parameters are fine.
            const APPLY_TYPES: [Type; 5] = [Type::UUID, Type::TEXT, Type::TEXT, Type::JSONB, Type::JSONB];
            // Checked once (and closed again at once, in one transaction, so
            // nothing is left on a session a transaction-mode pooler shares);
            // each event then sends it unnamed, with its types: one round trip
            // in the inbox's transaction, valid whichever server connection
            // that transaction runs on.
            db.batch_execute("BEGIN").await?;
            let checked = db.prepare_typed(&args.apply, &APPLY_TYPES).await.map(drop);
            db.batch_execute("COMMIT").await?;
            checked.map_err(|e| {
                ConfigError(format!(
                    "--apply does not prepare: {}",
                    e.as_db_error()
                        .map_or_else(|| e.to_string(), |d| d.message().to_owned())
                ))
            })?;
            let apply = args.apply.as_str();
            let effect = async |tx: &tokio_postgres::Transaction<'_>, m: &Received| {
                let [uuid, text, text2, jsonb, jsonb2] = APPLY_TYPES;
                tx.execute_typed(
                    apply,
                    &[
                        (&m.event_id, uuid),
                        (&m.aggregate_id, text),
                        (&m.event_type, text2),
                        (&m.payload, jsonb),
                        (&m.headers, jsonb2),
                    ],
                )
                .await
                .map(drop)
            };
            // Once, not per connection.
            let first = !std::mem::replace(&mut ready, true);
            let ran = match from {
                From::Nats => {
                    let mut worker = NatsWorker::new(&args.from, &stream, &group, inbox.clone());
                    worker.ack_wait = args.claim_idle;
                    worker.pause_after_commit = pause_after_commit;
                    worker.observer = observer.clone();
                    if first {
                        info!(%stream, durable = %group, "consumer ready");
                        outbox::notify::send("READY=1\nSTATUS=consumer ready");
                    }
                    worker.run(&mut db, cancel.clone(), effect).await
                }
                From::Amqp => {
                    let mut worker = AmqpWorker::new(&args.from, &queue, inbox.clone());
                    worker.prefetch = args.prefetch;
                    worker.pause_after_commit = pause_after_commit;
                    worker.observer = observer.clone();
                    if first {
                        info!(%queue, prefetch = args.prefetch, "consumer ready");
                        outbox::notify::send("READY=1\nSTATUS=consumer ready");
                    }
                    worker.run(&mut db, cancel.clone(), effect).await
                }
                From::Redis => {
                    let mut worker = RedisWorker::new(&args.from, &stream, &group, &consumer, inbox.clone())
                        .map_err(|e| ConfigError(e.to_string()))?;
                    worker.claim_idle = args.claim_idle;
                    worker.pause_after_commit = pause_after_commit;
                    worker.observer = observer.clone();
                    if first {
                        info!(%stream, %group, %consumer, "consumer ready");
                        outbox::notify::send("READY=1\nSTATUS=consumer ready");
                    }
                    worker.run(&mut db, cancel.clone(), effect).await
                }
            };
            match ran {
                Ok(stats) => {
                    total.add(&stats);
                    break;
                }
                Err(e) if !cancel.is_cancelled() && !usable(&db).await => {
                    warn!(error = %e, "PostgreSQL connection lost; reconnecting");
                }
                Err(e) => return Err(e).context("consuming"),
            }
        }
        Ok(())
    }
    .await;
    super::flush_traces(traces).await;
    consumed?;
    info!(
        processed = total.processed,
        duplicates = total.duplicates,
        claimed = total.claimed,
        malformed = total.malformed,
        "consumer stopped"
    );
    Ok(())
}

/// Whether `db` still answers. The driver marks a connection closed only
/// once its task has seen the end, so right after a `FATAL` (a restart,
/// `pg_terminate_backend`) it can still look open: ask it.
async fn usable(db: &tokio_postgres::Client) -> bool {
    !db.is_closed() && db.simple_query("SELECT 1").await.is_ok()
}

/// The broker `--from` names.
#[derive(Debug, Clone, Copy)]
enum From {
    Redis,
    Nats,
    Amqp,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "consumer".to_owned())
}

impl From {
    /// Its `messaging.system`.
    fn system(self) -> &'static str {
        match self {
            From::Redis => "redis",
            From::Nats => "nats",
            From::Amqp => "rabbitmq",
        }
    }
}

/// Makes a span of each inbox transaction ([`Tracing::inbox`]).
#[derive(Debug)]
struct Traced {
    tracing: Tracing,
    system: &'static str,
    destination: String,
    group: Option<String>,
}

impl Observe for Traced {
    fn inbox(&self, message: &Received, outcome: InboxOutcome, started: SystemTime, ended: SystemTime) {
        self.tracing.inbox(&InboxSpan {
            system: self.system,
            destination: &self.destination,
            group: self.group.as_deref(),
            event_id: message.event_id,
            event_type: &message.event_type,
            headers: &message.headers,
            outcome: match outcome {
                InboxOutcome::Processed => "processed",
                InboxOutcome::Duplicate => "duplicate",
                _ => "failed",
            },
            started,
            ended,
        });
    }
}
