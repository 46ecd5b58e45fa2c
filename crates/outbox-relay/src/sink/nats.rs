//! NATS JetStream sink: one message per event on `outbox.event.<aggregate_type>`
//! (`--nats-subject`), acknowledged by the stream that captures the subject.
//!
//! Each message carries the body and headers `--format` gives it
//! ([`super::format`]; native: the JSON body the other brokers get), the header
//! `Nats-Msg-Id: <event_id>` and every key of the row's `headers` as a
//! message header. `Nats-Msg-Id` is the dedup key: a re-send inside the
//! stream's duplicate window (2 minutes by default) is acknowledged with
//! `duplicate: true` and not stored again, so a relay that crashed between
//! "acked" and "marked" does not double the stream's contents.
//!
//! A batch is published whole before any ack is awaited: all publishes go
//! out on one connection, then every ack future is awaited, each under the
//! `--http-timeout`. A row is delivered only when its own ack arrived.
//!
//! Ordering: one connection keeps publish order, and a stream stores in
//! arrival order, so the events of an aggregate land in id order. If one of
//! them fails (no ack in time, say) the later ones of that aggregate were
//! already sent concurrently, so they are not [`NotSent`]: each row
//! reports its real outcome, and the relay retries the failed one later.
//! That one failure can therefore land after its successors; consumers that
//! need strict order must check `outbox_id` per aggregate, as with any
//! at-least-once sink.
//!
//! Errors: no connection, no ack in time or a lost connection make the sink
//! unavailable (no attempt spent; the relay's breaker probes with a
//! round trip to the server). So does "no stream captures this subject"
//! (no responders): the stream is configuration, but an operator may create
//! it later (`nats stream add OUTBOX --subjects 'outbox.event.>'`), and the
//! rows then go out without a requeue. A full stream or any other JetStream
//! error is retryable. The sink never creates streams:
//! retention, replicas and limits are the operator's choice. An invalid
//! subject or header name, or a message over the server's `max_payload`, is
//! permanent.
//!
//! The connection is made lazily, under the timeout. async-nats reconnects
//! on its own, but a client found disconnected is dropped and made anew on
//! the next batch, so a NATS that is down turns into "connection refused"
//! in `last_error` rather than ack timeouts.
//!
//! [`NotSent`]: super::DeliveryError::NotSent

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::{self, message::PublishMessage};
use async_nats::{Client, ConnectOptions, HeaderMap, HeaderName, HeaderValue, ServerAddr};
use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::OutboxRow;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::format::{Formatter, Protocol};
use super::template::Template;
use super::{Delivery, DeliveryError, Sink, SinkError, SinkOptions};

/// Acks in flight one connection allows; above the largest batch
/// (`--batch-size` ≤ 10,000) so a batch never trips async-nats' limit.
const MAX_ACKS_IN_FLIGHT: usize = 20_000;
/// Reconnect attempts async-nats makes on its own. We drop a disconnected
/// client anyway; the bound stops a dropped one from retrying forever.
const MAX_RECONNECTS: usize = 10;

/// `--nats-subject`'s default.
const DEFAULT_SUBJECT: &str = "outbox.event.{aggregate_type}";

/// The NATS sink's options. Each field is a flag of `outbox relay`, the
/// environment variable beside it, and the routes file's key of the same
/// name (the flag with underscores).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct NatsOptions {
    /// NATS subject; {aggregate_type} and {event_type} are replaced per event.
    #[arg(
        id = "nats_subject",
        value_name = "NATS_SUBJECT",
        long = "nats-subject",
        env = "OUTBOX_NATS_SUBJECT",
        default_value = DEFAULT_SUBJECT
    )]
    #[serde(rename = "nats_subject")]
    pub subject: String,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            subject: DEFAULT_SUBJECT.to_owned(),
        }
    }
}

/// Delivers to NATS JetStream.
pub struct NatsSink {
    url: String,
    subject: Template,
    timeout: Duration,
    formatter: Formatter,
    connection: Mutex<Option<Connection>>,
    /// The server's `max_payload`, once connected (0 before).
    max_payload: AtomicU64,
}

#[derive(Clone)]
struct Connection {
    client: Client,
    jetstream: jetstream::Context,
}

impl NatsSink {
    /// A sink for `url` (`nats://[user:pass@]host:port`).
    pub fn new(url: &str, options: &SinkOptions) -> Result<Self, SinkError> {
        ServerAddr::from_str(url).map_err(|e| SinkError::InvalidUrl {
            url: url.to_owned(),
            reason: e.to_string(),
        })?;
        let own = &options.per_sink.nats;
        let subject = Template::parse(&own.subject, "--nats-subject")?;
        // A subject without placeholders can be checked now rather than per row.
        if subject.is_constant()
            && let Some(reason) = subject_problem(&own.subject)
        {
            return Err(SinkError::InvalidTemplate {
                flag: "--nats-subject",
                template: own.subject.clone(),
                reason,
            });
        }
        Ok(Self {
            url: url.to_owned(),
            subject,
            timeout: options.timeout,
            formatter: options.formatter.clone(),
            connection: Mutex::new(None),
            max_payload: AtomicU64::new(0),
        })
    }

    /// The subject a row is published on.
    pub fn subject(&self, row: &OutboxRow) -> String {
        self.subject.render(row)
    }

    async fn connection(&self) -> Result<Connection, String> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            if c.client.connection_state() != State::Disconnected {
                return Ok(c.clone());
            }
            *slot = None;
        }
        let connect = ConnectOptions::new()
            .name("outbox-relay")
            .connection_timeout(self.timeout)
            .max_reconnects(MAX_RECONNECTS)
            .connect(self.url.as_str());
        let client = match tokio::time::timeout(self.timeout, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(format!("connecting to nats: {e}")),
            Err(_) => return Err(format!("connecting to nats: no answer within {:?}", self.timeout)),
        };
        let jetstream = jetstream::context::ContextBuilder::new()
            .timeout(self.timeout)
            .max_ack_inflight(MAX_ACKS_IN_FLIGHT)
            .build(client.clone());
        let max_payload = u64::try_from(client.server_info().max_payload).unwrap_or(u64::MAX);
        self.max_payload.store(max_payload, Ordering::Relaxed);
        let c = Connection { client, jetstream };
        *slot = Some(c.clone());
        Ok(c)
    }

    fn message(&self, row: &OutboxRow) -> Result<(String, PublishMessage), DeliveryError> {
        let subject = self.subject(row);
        if let Some(reason) = subject_problem(&subject) {
            return Err(DeliveryError::permanent(format!(
                "invalid nats subject {subject:?}: {reason}"
            )));
        }
        let formatted = self.formatter.message(row, Protocol::Nats);
        let mut headers = HeaderMap::new();
        if let Some(content_type) = formatted.content_type {
            headers.insert("content-type", content_type);
        }
        for (name, value) in &formatted.headers {
            let bad = |what: &str| {
                DeliveryError::permanent(format!("header {name:?} cannot be a nats header: {what}"))
            };
            let name_ok = HeaderName::from_str(name).map_err(|e| bad(&e.to_string()))?;
            let value_ok = HeaderValue::from_str(value).map_err(|e| bad(&e.to_string()))?;
            headers.insert(name_ok, value_ok);
        }
        // Set last, so a row header of the same name cannot replace the dedup key.
        let message = PublishMessage::build()
            .payload(formatted.body.into())
            .headers(headers)
            .message_id(row.event_id.to_string());
        Ok((subject, message))
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        let conn = match self.connection().await {
            Ok(c) => c,
            Err(message) => {
                return batch
                    .iter()
                    .map(|_| Err(DeliveryError::unavailable(message.clone())))
                    .collect();
            }
        };

        // Publish everything first; each publish only queues the message on
        // the connection, so this is fast unless the connection is stuck,
        // which the deadline bounds for the whole batch.
        let deadline = Instant::now() + self.timeout;
        let mut pending: Vec<Result<(String, PublishAckFuture), DeliveryError>> =
            Vec::with_capacity(batch.len());
        for row in batch {
            let sent = match self.message(row) {
                Err(e) => Err(e),
                Ok((subject, message)) => {
                    let publish = conn.jetstream.send_publish(subject.clone(), message);
                    match tokio::time::timeout_at(deadline, publish).await {
                        Ok(Ok(ack)) => Ok((subject, ack)),
                        Ok(Err(e)) => Err(classify(e.kind(), &subject, &e.to_string(), self.timeout)),
                        Err(_) => Err(DeliveryError::unavailable(format!(
                            "nats: not sent, the connection took no message within {:?}",
                            self.timeout
                        ))),
                    }
                }
            };
            pending.push(sent);
        }

        let ack_deadline = Instant::now() + self.timeout;
        let acks = pending.into_iter().map(|sent| async move {
            let (subject, ack) = sent?;
            match tokio::time::timeout_at(ack_deadline, ack.into_future()).await {
                // A duplicate ack means the stream already holds this event.
                Ok(Ok(_ack)) => Ok(()),
                Ok(Err(e)) => Err(classify(e.kind(), &subject, &e.to_string(), self.timeout)),
                Err(_) => Err(classify(PublishErrorKind::TimedOut, &subject, "", self.timeout)),
            }
        });
        let outcomes = futures::future::join_all(acks).await;

        if outcomes.iter().any(Result::is_err) && conn.client.connection_state() == State::Disconnected {
            *self.connection.lock().await = None;
        }
        outcomes
    }
}

/// Why `subject` cannot be published to, if it cannot: NATS subjects are
/// dot-separated non-empty tokens without whitespace, and publishing to a
/// wildcard is refused.
fn subject_problem(subject: &str) -> Option<String> {
    if subject.is_empty() {
        return Some("empty".to_owned());
    }
    if subject.chars().any(char::is_whitespace) {
        return Some("contains whitespace".to_owned());
    }
    if subject.split('.').any(str::is_empty) {
        return Some("has an empty token (leading, trailing or double '.')".to_owned());
    }
    if subject.split('.').any(|t| t == "*" || t == ">") {
        return Some("has a wildcard token ('*' or '>')".to_owned());
    }
    None
}

fn classify(kind: PublishErrorKind, subject: &str, detail: &str, timeout: Duration) -> DeliveryError {
    match kind {
        PublishErrorKind::StreamNotFound => DeliveryError::unavailable(format!(
            "nats: no JetStream stream captures subject {subject:?} (no responders); \
             create one, e.g. `nats stream add OUTBOX --subjects 'outbox.event.>'`"
        )),
        // The client buffers while disconnected, so a server that is down
        // shows as an ack that never comes.
        PublishErrorKind::TimedOut => {
            DeliveryError::unavailable(format!("nats: no ack for subject {subject:?} within {timeout:?}"))
        }
        PublishErrorKind::BrokenPipe => {
            DeliveryError::unavailable("nats: connection lost before the ack".to_owned())
        }
        PublishErrorKind::MaxPayloadExceeded => DeliveryError::permanent(format!("nats: {detail}")),
        _ => DeliveryError::retryable(format!("nats publish to {subject:?}: {detail}")),
    }
}

impl Sink for NatsSink {
    fn name(&self) -> &'static str {
        "nats"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }

    fn max_event_bytes(&self) -> Option<u64> {
        Some(self.max_payload.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            let conn = self.connection().await.map_err(DeliveryError::unavailable)?;
            match tokio::time::timeout(self.timeout, conn.client.flush()).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(DeliveryError::unavailable(format!("nats: {e}"))),
                Err(_) => Err(DeliveryError::unavailable(format!(
                    "nats: no answer within {:?}",
                    self.timeout
                ))),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_subjects() {
        assert_eq!(subject_problem("outbox.event.orders"), None);
        for bad in ["", "a b", "a..b", ".a", "a.", "a.*", "a.>"] {
            assert!(subject_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn refuses_bad_urls_and_constant_subjects() {
        let options = SinkOptions::default();
        assert!(NatsSink::new("nats://127.0.0.1:4222", &options).is_ok());
        let mut options = SinkOptions::default();
        options.per_sink.nats.subject = "outbox.>".into();
        let e = NatsSink::new("nats://127.0.0.1:4222", &options)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--nats-subject") && e.contains("wildcard"), "{e}");
    }
}
