//! A NATS JetStream worker: a durable pull consumer whose messages run
//! through the inbox and are acknowledged only after the inbox transaction
//! committed.
//!
//! A message not acknowledged within `ack_wait` (its worker died, or its
//! effect failed and it was negatively acknowledged) is redelivered to a
//! worker of the same durable consumer; the inbox makes the redelivery of a
//! message whose effect already committed a no-op. A message that is not an
//! outbox event (no parsable `event_id`) is terminated (`AckKind::Term`) so
//! it is not redelivered for ever, and logged.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures::StreamExt;
use tokio_postgres::{Client, Transaction};
use tokio_util::sync::CancellationToken;

use super::{Applied, Received, WorkerError, WorkerStats};
use crate::Inbox;

/// A worker of one durable pull consumer on a JetStream stream.
#[derive(Debug, Clone)]
pub struct NatsWorker {
    url: String,
    stream: String,
    durable: String,
    inbox: Inbox,
    /// How long a delivered message may stay unacknowledged before it is
    /// delivered again (JetStream's `ack_wait`, set when the consumer is
    /// created).
    pub ack_wait: Duration,
    /// Test hook: park forever after a commit, before the ack.
    #[doc(hidden)]
    pub pause_after_commit: bool,
    /// Told of each inbox transaction, e.g. to trace it (`outbox consume`
    /// makes a span of each). None by default.
    pub observer: Option<std::sync::Arc<dyn super::Observe>>,
}

impl NatsWorker {
    /// A worker of durable consumer `durable` on JetStream stream `stream`.
    pub fn new(url: &str, stream: impl Into<String>, durable: impl Into<String>, inbox: Inbox) -> Self {
        Self {
            url: url.to_owned(),
            stream: stream.into(),
            durable: durable.into(),
            inbox,
            ack_wait: Duration::from_secs(30),
            pause_after_commit: false,
            observer: None,
        }
    }

    /// Runs until `cancel` fires, as [`RedisWorker::run`](super::redis::RedisWorker::run)
    /// does: `effect` runs once per event_id inside the inbox transaction;
    /// an `Err` rolls it back and the message is redelivered after a delay.
    pub async fn run<E>(
        &self,
        db: &mut Client,
        cancel: CancellationToken,
        mut effect: impl AsyncFnMut(&Transaction<'_>, &Received) -> Result<(), E>,
    ) -> Result<WorkerStats, WorkerError>
    where
        E: std::fmt::Display,
    {
        let client = async_nats::connect(&self.url)
            .await
            .map_err(|e| WorkerError::broker("connecting to NATS", e))?;
        let js = jetstream::new(client);
        let stream = js
            .get_stream(&self.stream)
            .await
            .map_err(|e| WorkerError::broker("finding the JetStream stream", e))?;
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                &self.durable,
                pull::Config {
                    durable_name: Some(self.durable.clone()),
                    ack_wait: self.ack_wait,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| WorkerError::broker("creating the durable consumer", e))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| WorkerError::broker("pulling messages", e))?;
        let mut stats = WorkerStats::default();
        loop {
            let next = tokio::select! {
                _ = cancel.cancelled() => break,
                next = messages.next() => next,
            };
            let Some(next) = next else { break };
            let msg = next.map_err(|e| WorkerError::broker("receiving a message", e))?;
            if msg.info().is_ok_and(|i| i.delivered > 1) {
                stats.claimed += 1;
            }
            let Some(message) = message(&msg) else {
                tracing::warn!(subject = %msg.subject, "not an outbox event; terminated");
                msg.ack_with(AckKind::Term)
                    .await
                    .map_err(|e| WorkerError::broker("terminating a malformed message", e))?;
                crate::notify::send("OUTBOX_MESSAGE=rejected");
                stats.malformed += 1;
                continue;
            };
            match super::apply(
                db,
                &self.inbox,
                &message,
                &mut effect,
                &mut stats,
                self.pause_after_commit,
                self.observer.as_deref(),
            )
            .await?
            {
                // A double ack waits for the server to record it, so a
                // crash right after cannot bring the message back.
                Applied::Committed => msg
                    .double_ack()
                    .await
                    .map_err(|e| WorkerError::broker("acknowledging", e))?,
                Applied::EffectFailed => msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await
                    .map_err(|e| WorkerError::broker("negatively acknowledging", e))?,
            }
        }
        Ok(stats)
    }
}

/// A message as the relay's NATS sink publishes it.
pub fn message(msg: &jetstream::Message) -> Option<Received> {
    let headers = msg
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .filter(|(name, _)| !name.to_string().starts_with("Nats-"))
        .filter_map(|(name, values)| {
            let value = values.first()?.as_str().to_owned();
            Some((name.to_string(), serde_json::Value::String(value)))
        })
        .collect();
    let position = msg
        .info()
        .map(|i| i.stream_sequence.to_string())
        .unwrap_or_default();
    Received::from_native_body(&msg.payload, headers, position)
}
