//! A RabbitMQ (AMQP 0-9-1) worker: consumes a queue with manual
//! acknowledgements, runs each event through the inbox and acknowledges it
//! only after the inbox transaction committed.
//!
//! `basic.qos` bounds the unacknowledged messages the broker hands this
//! worker (`prefetch`). If the worker dies, the broker requeues every message
//! it had not acknowledged (flagged `redelivered`) for another consumer of
//! the queue; the inbox makes the redelivery of a message whose effect
//! already committed a no-op. A failed effect is rolled back and the message
//! negatively acknowledged with requeue, after a short delay so a failing
//! effect does not spin. A message that is not an outbox event (no parsable
//! `event_id`) is rejected without requeue (the queue's dead-letter exchange
//! gets it, if it has one) so it cannot come back for ever.
//!
//! Messages are read as the relay's RabbitMQ sink publishes them in the
//! native format: a JSON body with `event_id`, `aggregate_id`, `event_type`
//! and `payload`; the header table becomes [`Received::headers`].

use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use tokio_postgres::{Client, Transaction};
use tokio_util::sync::CancellationToken;

use super::{Applied, Received, WorkerError, WorkerStats};
use crate::Inbox;

/// How long a failed effect waits before its message is requeued.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// A worker consuming one RabbitMQ queue.
#[derive(Debug, Clone)]
pub struct AmqpWorker {
    url: String,
    queue: String,
    inbox: Inbox,
    /// Unacknowledged messages the broker may hand this worker at once
    /// (`basic.qos` prefetch count).
    pub prefetch: u16,
    /// Test hook: park forever after a commit, before the ack.
    #[doc(hidden)]
    pub pause_after_commit: bool,
    /// Told of each inbox transaction, e.g. to trace it (`outbox consume`
    /// makes a span of each). None by default.
    pub observer: Option<std::sync::Arc<dyn super::Observe>>,
}

impl AmqpWorker {
    /// A worker of queue `queue` on the broker at `url`
    /// (`amqp://user:pass@host:port/vhost`). The queue must exist, bound to
    /// the relay's exchange: the worker declares nothing.
    pub fn new(url: &str, queue: impl Into<String>, inbox: Inbox) -> Self {
        Self {
            url: url.to_owned(),
            queue: queue.into(),
            inbox,
            prefetch: 10,
            pause_after_commit: false,
            observer: None,
        }
    }

    /// Runs until `cancel` fires, as [`RedisWorker::run`](super::redis::RedisWorker::run)
    /// does: `effect` runs once per event_id inside the inbox transaction;
    /// an `Err` rolls it back and the message is requeued.
    pub async fn run<E>(
        &self,
        db: &mut Client,
        cancel: CancellationToken,
        mut effect: impl AsyncFnMut(&Transaction<'_>, &Received) -> Result<(), E>,
    ) -> Result<WorkerStats, WorkerError>
    where
        E: std::fmt::Display,
    {
        let connection = Connection::connect(
            &self.url,
            ConnectionProperties::default().with_connection_name("outbox-consumer".into()),
        )
        .await
        .map_err(|e| WorkerError::broker("connecting to RabbitMQ", e))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| WorkerError::broker("opening a channel", e))?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| WorkerError::broker("setting the prefetch (basic.qos)", e))?;
        let mut consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                "".into(),
                // no_ack false: acknowledgements are manual.
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| WorkerError::broker("consuming the queue", e))?;
        let mut stats = WorkerStats::default();
        loop {
            // Cancel-safe: a delivery not yet taken from the consumer stays
            // unacknowledged and the broker requeues it when we disconnect.
            let next = tokio::select! {
                _ = cancel.cancelled() => break,
                next = consumer.next() => next,
            };
            let Some(next) = next else { break };
            let delivery = next.map_err(|e| WorkerError::broker("receiving a message", e))?;
            if delivery.redelivered {
                stats.claimed += 1;
            }
            let Some(message) = message(&delivery) else {
                tracing::warn!(routing_key = %delivery.routing_key, "not an outbox event; rejected");
                delivery
                    .reject(BasicRejectOptions { requeue: false })
                    .await
                    .map_err(|e| WorkerError::broker("rejecting a malformed message", e))?;
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
                Applied::Committed => {
                    delivery
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(|e| WorkerError::broker("acknowledging", e))?;
                }
                Applied::EffectFailed => {
                    tokio::time::sleep(RETRY_DELAY).await;
                    delivery
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..BasicNackOptions::default()
                        })
                        .await
                        .map_err(|e| WorkerError::broker("negatively acknowledging", e))?;
                }
            }
        }
        // A clean close, so the acknowledgements sent are settled before
        // the socket goes; an error here loses nothing (unacked = requeued).
        let _ = connection.close(200, "consumer stopped".into()).await;
        Ok(stats)
    }
}

/// A message as the relay's RabbitMQ sink publishes it (native format).
pub fn message(delivery: &Delivery) -> Option<Received> {
    let headers = delivery
        .properties
        .headers()
        .as_ref()
        .map(|t| {
            t.inner()
                .iter()
                .filter_map(|(name, value)| match value {
                    AMQPValue::LongString(s) => Some((
                        name.to_string(),
                        serde_json::Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned()),
                    )),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Received::from_native_body(&delivery.data, headers, delivery.delivery_tag.to_string())
}
