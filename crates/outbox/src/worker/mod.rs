//! Consumer workers: read events from a broker, run the side effect through
//! the [`Inbox`](crate::Inbox) in one PostgreSQL transaction, and
//! acknowledge to the broker only after that transaction committed.
//!
//! The order is the whole guarantee. A worker that dies after the commit
//! and before the acknowledgement leaves the message unacknowledged; the
//! broker (or another worker) delivers it again, the inbox finds its
//! event_id and the side effect does not run twice. A worker that dies
//! before the commit loses nothing either: the transaction rolls back and
//! the redelivery runs the effect for the first time.

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "redis")]
pub mod redis;

use serde_json::Value;
use uuid::Uuid;

/// One event as a worker hands it to the side effect.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// The idempotency key the inbox records.
    pub event_id: Uuid,
    /// The aggregate the event belongs to.
    pub aggregate_id: String,
    /// What happened, e.g. `OrderPaid`.
    pub event_type: String,
    /// The event's JSON payload.
    pub payload: Value,
    /// The `headers` column (trace context and the like); `{}` when absent.
    pub headers: Value,
    /// Where the broker keeps it (a Redis entry id, a JetStream sequence,
    /// an AMQP delivery tag).
    pub position: String,
}

#[cfg(any(feature = "nats", feature = "amqp"))]
impl Received {
    /// A message from the JSON body the relay's NATS and RabbitMQ sinks
    /// publish in the native format; `None` if it is not an outbox event
    /// (no parsable `event_id`).
    fn from_native_body(
        body: &[u8],
        headers: serde_json::Map<String, Value>,
        position: String,
    ) -> Option<Self> {
        let body: Value = serde_json::from_slice(body).ok()?;
        let text = |k: &str| body[k].as_str().map(str::to_owned);
        Some(Self {
            event_id: text("event_id")?.parse::<Uuid>().ok()?,
            aggregate_id: text("aggregate_id").unwrap_or_default(),
            event_type: text("event_type").unwrap_or_default(),
            payload: body["payload"].clone(),
            headers: Value::Object(headers),
            position,
        })
    }
}

/// What a worker has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Side effects run (first deliveries).
    pub processed: u64,
    /// Redeliveries the inbox recognised; acknowledged without an effect.
    pub duplicates: u64,
    /// Messages taken over from a consumer that left them unacknowledged
    /// (Redis: claimed; NATS: delivered more than once; AMQP: redelivered).
    pub claimed: u64,
    /// Messages that were not outbox events; moved aside, acknowledged.
    pub malformed: u64,
}

impl WorkerStats {
    /// Adds another run's counts (a worker restarted on a new connection).
    pub fn add(&mut self, other: &WorkerStats) {
        self.processed += other.processed;
        self.duplicates += other.duplicates;
        self.claimed += other.claimed;
        self.malformed += other.malformed;
    }
}

/// Why a worker stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The broker failed.
    #[error("{doing}: {message}")]
    Broker {
        /// What the worker was doing.
        doing: &'static str,
        /// The broker's error.
        message: String,
    },
    /// PostgreSQL failed (the message stays unacknowledged).
    #[error(transparent)]
    Outbox(#[from] crate::Error),
}

#[cfg(any(feature = "redis", feature = "nats", feature = "amqp"))]
impl WorkerError {
    fn broker(doing: &'static str, e: impl std::fmt::Display) -> Self {
        Self::Broker {
            doing,
            message: e.to_string(),
        }
    }
}

/// Whoever wants to know of each inbox transaction a worker runs (a
/// tracer: `outbox consume` makes a span of each, whose parent is the
/// event's `traceparent`). Called after the commit or rollback, before the
/// acknowledgement, on the worker's task: keep it short.
///
/// ```
/// use std::time::SystemTime;
/// use outbox::worker::{InboxOutcome, Observe, Received};
///
/// #[derive(Debug)]
/// struct Log;
///
/// impl Observe for Log {
///     fn inbox(&self, m: &Received, outcome: InboxOutcome, started: SystemTime, ended: SystemTime) {
///         let took = ended.duration_since(started).unwrap_or_default();
///         println!("{} {outcome:?} in {took:?}", m.event_id);
///     }
/// }
/// ```
pub trait Observe: Send + Sync + std::fmt::Debug {
    /// `message` went through the inbox from `started` to `ended`.
    fn inbox(
        &self,
        message: &Received,
        outcome: InboxOutcome,
        started: std::time::SystemTime,
        ended: std::time::SystemTime,
    );
}

/// How one inbox transaction ended (see [`Observe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InboxOutcome {
    /// The side effect ran and committed.
    Processed,
    /// The event_id was recorded already: committed without the effect.
    Duplicate,
    /// The side effect failed and was rolled back.
    Failed,
}

/// How running one message through the inbox ended.
#[cfg(any(feature = "redis", feature = "nats", feature = "amqp"))]
enum Applied {
    /// Committed (first time or duplicate): acknowledge it.
    Committed,
    /// The effect failed (logged) and was rolled back: leave it for a
    /// redelivery.
    EffectFailed,
}

/// The inbox's error or the effect's, kept apart so only the second is
/// retried quietly.
#[cfg(any(feature = "redis", feature = "nats", feature = "amqp"))]
enum Failed {
    Outbox(crate::Error),
    Effect(String),
}

#[cfg(any(feature = "redis", feature = "nats", feature = "amqp"))]
impl From<crate::Error> for Failed {
    fn from(e: crate::Error) -> Self {
        Failed::Outbox(e)
    }
}

/// The part every worker shares: `effect` once per event_id inside the
/// inbox transaction, then commit, counting new and duplicate messages.
/// With `pause_after_commit` (a test hook) it parks for ever right after the
/// commit, before the caller could acknowledge.
#[cfg(any(feature = "redis", feature = "nats", feature = "amqp"))]
async fn apply<E: std::fmt::Display>(
    db: &mut tokio_postgres::Client,
    inbox: &crate::Inbox,
    message: &Received,
    effect: &mut impl AsyncFnMut(&tokio_postgres::Transaction<'_>, &Received) -> Result<(), E>,
    stats: &mut WorkerStats,
    pause_after_commit: bool,
    observer: Option<&dyn Observe>,
) -> Result<Applied, WorkerError> {
    let started = std::time::SystemTime::now();
    let observe = |outcome| {
        if let Some(observer) = observer {
            observer.inbox(message, outcome, started, std::time::SystemTime::now());
        }
    };
    let tx = db
        .transaction()
        .await
        .map_err(crate::Error::pg("starting the inbox transaction"))?;
    let outcome = inbox
        .process(&tx, message.event_id, async |tx| -> Result<(), Failed> {
            effect(tx, message)
                .await
                .map_err(|e| Failed::Effect(e.to_string()))
        })
        .await;
    match outcome {
        Ok(done) => {
            tx.commit()
                .await
                .map_err(crate::Error::pg("committing the inbox transaction"))?;
            match done {
                crate::Processed::New(()) => {
                    stats.processed += 1;
                    observe(InboxOutcome::Processed);
                }
                crate::Processed::Duplicate => {
                    stats.duplicates += 1;
                    observe(InboxOutcome::Duplicate);
                }
            }
            if pause_after_commit {
                tracing::warn!(event_id = %message.event_id, "failpoint: committed, parked before the acknowledgement");
                crate::notify::send("OUTBOX_FAILPOINT=pause-after-commit reached");
                std::future::pending::<()>().await;
            }
            Ok(Applied::Committed)
        }
        Err(Failed::Outbox(e)) => Err(e.into()),
        // Dropping the transaction rolls it back.
        Err(Failed::Effect(error)) => {
            drop(tx);
            observe(InboxOutcome::Failed);
            tracing::warn!(event_id = %message.event_id, %error, "side effect failed; will retry");
            Ok(Applied::EffectFailed)
        }
    }
}
