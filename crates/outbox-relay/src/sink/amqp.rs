//! RabbitMQ (AMQP 0-9-1) sink: one persistent message per event, published
//! to exchange `outbox` (`--amqp-exchange`) with routing key
//! `<aggregate_type>.<event_type>` (`--amqp-routing-key`), on a channel in
//! publisher-confirm mode.
//!
//! Each message carries the body and headers `--format` gives it
//! ([`super::format`]; native: the JSON body the other brokers get), `message_id =
//! event_id` (the consumer's dedup key: the broker does not deduplicate),
//! `content_type: application/json`, `delivery_mode: 2`, `type =
//! event_type`, `timestamp = created_at`, and the row's `headers` as an AMQP
//! field table. A batch is published whole, then every confirm is awaited
//! under the `--http-timeout`; a row is delivered only when the broker
//! acked it and did not return it.
//!
//! The exchange is declared, durable and of type topic, the first time a
//! connection uses it: a relay pointed at an empty broker works, and
//! declaring an existing durable topic exchange changes nothing. One that
//! exists with another type or durability is refused by the broker
//! (`PRECONDITION_FAILED`); that fails the batch with the broker's words. The
//! default exchange (`""`) and the predeclared `amq.*` ones are not declared.
//!
//! Messages are published `mandatory`, so one that no queue is bound for
//! comes back (`basic.return`) instead of vanishing. Such a row fails with
//! `unroutable: no queue bound to exchange "outbox" for routing key
//! "orders.OrderPlaced"` and is retryable, not permanent: the missing
//! binding is configuration that a consumer typically adds at its own
//! deploy, and a retried row goes out once it exists, while a row made a
//! dead letter would need `outbox dlq requeue`. After `--max-attempts` it
//! becomes a dead letter anyway. A nack is retryable too. No connection
//! (refused, or authentication refused), a lost connection or channel, or
//! a confirm that never comes make the sink unavailable: no attempt is
//! spent, and the relay's breaker probes by connecting. A name or header longer than AMQP's 255-byte
//! short string is permanent, and so is a message over the broker's
//! `max_message_size` (the broker closes the channel naming its size; the
//! other messages that close cut off are retried).
//!
//! Ordering is as for NATS: one channel keeps publish order, so an
//! aggregate's events reach a queue in id order; a failed row does not hold
//! back its successors, which were already sent, so each row reports its
//! real outcome.
//!
//! The connection is made lazily, every step under the timeout, and dropped
//! after any connection-level failure or missing confirm, so a broker that
//! is down or restarts only turns into retries.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use outbox::OutboxRow;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::format::{Formatter, Message, Protocol};
use super::template::Template;
use super::{Delivery, DeliveryError, Sink, SinkError, SinkOptions};

/// `delivery_mode` of a message the broker writes to disk.
const PERSISTENT: u8 = 2;

/// `--amqp-exchange`'s default.
const DEFAULT_EXCHANGE: &str = "outbox";
/// `--amqp-routing-key`'s default.
const DEFAULT_ROUTING_KEY: &str = "{aggregate_type}.{event_type}";

/// The RabbitMQ sink's options. Each field is a flag of `outbox relay`, the
/// environment variable beside it, and the routes file's key of the same
/// name (the flag with underscores).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct AmqpOptions {
    /// AMQP exchange, declared durable topic if missing; same placeholders.
    #[arg(
        id = "amqp_exchange",
        value_name = "AMQP_EXCHANGE",
        long = "amqp-exchange",
        env = "OUTBOX_AMQP_EXCHANGE",
        default_value = DEFAULT_EXCHANGE
    )]
    #[serde(rename = "amqp_exchange")]
    pub exchange: String,
    /// AMQP routing key; same placeholders.
    #[arg(
        id = "amqp_routing_key",
        value_name = "AMQP_ROUTING_KEY",
        long = "amqp-routing-key",
        env = "OUTBOX_AMQP_ROUTING_KEY",
        default_value = DEFAULT_ROUTING_KEY
    )]
    #[serde(rename = "amqp_routing_key")]
    pub routing_key: String,
}

impl Default for AmqpOptions {
    fn default() -> Self {
        Self {
            exchange: DEFAULT_EXCHANGE.to_owned(),
            routing_key: DEFAULT_ROUTING_KEY.to_owned(),
        }
    }
}

/// Delivers to a RabbitMQ exchange.
pub struct AmqpSink {
    url: String,
    exchange: Template,
    routing_key: Template,
    timeout: Duration,
    formatter: Formatter,
    // Held for a whole batch: confirms are counted per channel, so two
    // batches must not interleave on one.
    link: Mutex<Option<Link>>,
}

struct Link {
    // Kept so the connection lives as long as its channel.
    connection: Connection,
    channel: Channel,
    declared: HashSet<String>,
}

/// A row ready to publish: where, its properties, its body.
type Prepared = (Route, BasicProperties, Vec<u8>);

/// Where one row goes.
struct Route {
    exchange: ShortString,
    routing_key: ShortString,
}

impl AmqpSink {
    /// A sink for `url` (`amqp://user:pass@host:port/vhost`, or `amqps://`).
    pub fn new(url: &str, options: &SinkOptions) -> Result<Self, SinkError> {
        url.parse::<lapin::uri::AMQPUri>()
            .map_err(|reason| SinkError::InvalidUrl {
                url: url.to_owned(),
                reason,
            })?;
        Ok(Self {
            url: url.to_owned(),
            exchange: Template::parse(&options.per_sink.amqp.exchange, "--amqp-exchange")?,
            routing_key: Template::parse(&options.per_sink.amqp.routing_key, "--amqp-routing-key")?,
            timeout: options.timeout,
            formatter: options.formatter.clone(),
            link: Mutex::new(None),
        })
    }

    /// The exchange and routing key a row is published with.
    pub fn route(&self, row: &OutboxRow) -> (String, String) {
        (self.exchange.render(row), self.routing_key.render(row))
    }

    async fn connect(&self) -> Result<Link, String> {
        let properties = ConnectionProperties::default().with_connection_name("outbox-relay".into());
        let steps = async {
            let connection = Connection::connect(&self.url, properties)
                .await
                .map_err(|e| format!("connecting to amqp: {e}"))?;
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| format!("amqp: opening a channel: {e}"))?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(|e| format!("amqp: enabling publisher confirms: {e}"))?;
            Ok(Link {
                connection,
                channel,
                declared: HashSet::new(),
            })
        };
        tokio::time::timeout(self.timeout, steps)
            .await
            .unwrap_or_else(|_| Err(format!("connecting to amqp: no answer within {:?}", self.timeout)))
    }

    fn route_of(&self, row: &OutboxRow) -> Result<Route, DeliveryError> {
        let (exchange, routing_key) = self.route(row);
        let short = |what: &str, s: String| {
            ShortString::try_new(s).map_err(|e| DeliveryError::permanent(format!("amqp {what}: {e}")))
        };
        Ok(Route {
            exchange: short("exchange", exchange)?,
            routing_key: short("routing key", routing_key)?,
        })
    }

    fn properties(row: &OutboxRow, message: &Message) -> Result<BasicProperties, DeliveryError> {
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            let name = ShortString::try_new(name).map_err(|e| {
                DeliveryError::permanent(format!("header name cannot be an amqp field name: {e}"))
            })?;
            let value = LongString::from(value.as_bytes().to_vec());
            headers.insert(name, AMQPValue::LongString(value));
        }
        let timestamp = u64::try_from(row.created_at.timestamp()).unwrap_or(0);
        let mut properties = BasicProperties::default();
        if let Some(content_type) = message.content_type {
            properties = properties.with_content_type(content_type.into());
        }
        Ok(properties
            .with_message_id(row.event_id.to_string().into())
            .with_delivery_mode(PERSISTENT)
            .with_type(
                ShortString::try_new(row.event_type.as_str())
                    .map_err(|e| DeliveryError::permanent(format!("amqp type (event_type): {e}")))?,
            )
            .with_timestamp(timestamp)
            .with_headers(headers))
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        let mut slot = self.link.lock().await;
        if slot
            .as_ref()
            .is_some_and(|l| !l.connection.status().connected() || !l.channel.status().connected())
        {
            *slot = None;
        }
        if slot.is_none() {
            match self.connect().await {
                Ok(link) => *slot = Some(link),
                Err(message) => return all_failed(batch, DeliveryError::unavailable(message)),
            }
        }
        // Just filled when empty.
        let Some(link) = slot.as_mut() else {
            return all_failed(batch, DeliveryError::unavailable("amqp: no connection"));
        };
        let (outcomes, healthy) = self.publish(link, batch).await;
        if !healthy {
            *slot = None;
        }
        outcomes
    }

    /// Publishes `batch` on `link`; the flag is false when the link must be
    /// dropped (a connection error or a confirm that never came).
    async fn publish(&self, link: &mut Link, batch: &[OutboxRow]) -> (Vec<Delivery>, bool) {
        let deadline = Instant::now() + self.timeout;
        let mut healthy = true;

        let routes: Vec<Result<Prepared, DeliveryError>> = batch
            .iter()
            .map(|row| {
                let message = self.formatter.message(row, Protocol::Amqp);
                let properties = Self::properties(row, &message)?;
                Ok((self.route_of(row)?, properties, message.body))
            })
            .collect();

        for exchange in routes.iter().flatten().map(|(r, _, _)| r.exchange.as_str()) {
            if link.declared.contains(exchange) || exchange.is_empty() || exchange.starts_with("amq.") {
                continue;
            }
            let declare = link.channel.exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            );
            let failed = match tokio::time::timeout_at(deadline, declare).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!(
                    "amqp: declaring exchange {exchange:?} (durable, topic): {e}"
                )),
                Err(_) => Some(format!(
                    "amqp: declaring exchange {exchange:?}: no answer within {:?}",
                    self.timeout
                )),
            };
            if let Some(message) = failed {
                // The broker closes the channel on a refused declare.
                return (all_failed(batch, DeliveryError::retryable(message)), false);
            }
            link.declared.insert(exchange.to_owned());
        }

        let mut confirms = Vec::with_capacity(batch.len());
        for route in routes {
            let sent = match route {
                Err(e) => Err(e),
                Ok((route, properties, body)) if healthy => {
                    let publish = link.channel.basic_publish(
                        route.exchange.clone(),
                        route.routing_key.clone(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &body,
                        properties,
                    );
                    let size = body.len();
                    match tokio::time::timeout_at(deadline, publish).await {
                        Ok(Ok(confirm)) => Ok((route, size, confirm)),
                        Ok(Err(e)) => {
                            healthy = false;
                            Err(DeliveryError::unavailable(format!("amqp: publishing: {e}")))
                        }
                        Err(_) => {
                            healthy = false;
                            Err(DeliveryError::unavailable(format!(
                                "amqp: not sent, the connection took no message within {:?}",
                                self.timeout
                            )))
                        }
                    }
                }
                Ok(_) => Err(DeliveryError::unavailable(
                    "amqp: not sent: the connection failed earlier in the batch",
                )),
            };
            confirms.push(sent);
        }

        let confirm_deadline = Instant::now() + self.timeout;
        let waits = confirms.into_iter().map(|sent| async move {
            let (route, size, confirm) = sent?;
            match tokio::time::timeout_at(confirm_deadline, confirm).await {
                Ok(Ok(confirmation)) => Ok((route, confirmation)),
                Ok(Err(e)) => Err(confirm_failed(&e, size)),
                Err(_) => Err(DeliveryError::unavailable(format!(
                    "amqp: no publisher confirm within {:?}",
                    self.timeout
                ))),
            }
        });
        let confirmed = futures::future::join_all(waits).await;

        // lapin hands a returned message to whichever confirm completes next,
        // which under a multiple-ack is any of them (a HashMap's order). The
        // message_id we set is the event_id, so returns are matched by that.
        let mut returned: HashMap<String, (u16, String)> = HashMap::new();
        let mut outcomes = Vec::with_capacity(batch.len());
        for c in confirmed {
            outcomes.push(match c {
                Err(e) => {
                    healthy = false;
                    Err(e)
                }
                Ok((route, Confirmation::Ack(ret))) => {
                    collect_return(&mut returned, ret);
                    Ok(route)
                }
                Ok((route, Confirmation::Nack(ret))) => {
                    collect_return(&mut returned, ret);
                    Err(DeliveryError::retryable(format!(
                        "amqp: the broker nacked the message (exchange {:?}, routing key {:?})",
                        route.exchange.as_str(),
                        route.routing_key.as_str()
                    )))
                }
                Ok((_, Confirmation::NotRequested)) => Err(DeliveryError::retryable(
                    "amqp: the channel is not in confirm mode",
                )),
            });
        }
        let outcomes = batch
            .iter()
            .zip(outcomes)
            .map(|(row, outcome)| {
                let route = outcome?;
                match returned.get(&row.event_id.to_string()) {
                    None => Ok(()),
                    Some((code, text)) => Err(DeliveryError::retryable(format!(
                        "unroutable: no queue bound to exchange {:?} for routing key {:?} ({code} {text})",
                        route.exchange.as_str(),
                        route.routing_key.as_str()
                    ))),
                }
            })
            .collect();
        (outcomes, healthy)
    }
}

/// A confirm that failed because the channel closed. The broker closes it
/// with 406 PRECONDITION_FAILED "message size N is larger than configured
/// max size M" for a message over its `max_message_size`: that message
/// will never be taken, so it is a permanent failure; every other message
/// the close cut off is retryable.
fn confirm_failed(e: &lapin::Error, size: usize) -> DeliveryError {
    let text = e.to_string();
    let refused = text
        .split("message size ")
        .nth(1)
        .filter(|rest| rest.contains("larger than configured max size"))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse::<usize>().ok());
    if refused == Some(size) {
        return DeliveryError::permanent(format!(
            "amqp: a message of {size} bytes is too large for the broker (its max_message_size): {text}"
        ));
    }
    let message = format!("amqp: waiting for the publisher confirm: {text}");
    if connection_lost(e) {
        DeliveryError::unavailable(message)
    } else {
        DeliveryError::retryable(message)
    }
}

/// Whether `e` is about the connection (the broker closed it, shutting down
/// or refusing us; IO failed; heartbeats stopped) rather than one channel
/// or message: the sink is unavailable.
fn connection_lost(e: &lapin::Error) -> bool {
    use lapin::ErrorKind as K;
    use lapin::protocol::AMQPErrorKind;
    match e.kind() {
        K::ProtocolError(amqp) => matches!(amqp.kind(), AMQPErrorKind::Hard(_)),
        K::IOError(_) | K::InvalidConnectionState(_) | K::MissingHeartbeatError => true,
        _ => false,
    }
}

fn collect_return(
    returned: &mut HashMap<String, (u16, String)>,
    message: Option<lapin::message::BasicReturnMessage>,
) {
    if let Some(m) = message
        && let Some(id) = m.delivery.properties.message_id()
    {
        returned.insert(id.to_string(), (m.reply_code, m.reply_text.to_string()));
    }
}

fn all_failed(batch: &[OutboxRow], error: DeliveryError) -> Vec<Delivery> {
    batch.iter().map(|_| Err(error.clone())).collect()
}

impl Sink for AmqpSink {
    fn name(&self) -> &'static str {
        "amqp"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            let mut slot = self.link.lock().await;
            if slot
                .as_ref()
                .is_some_and(|l| l.connection.status().connected() && l.channel.status().connected())
            {
                return Ok(());
            }
            *slot = Some(self.connect().await.map_err(DeliveryError::unavailable)?);
            Ok(())
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_urls_and_templates() {
        let options = SinkOptions::default();
        assert!(AmqpSink::new("amqp://guest:guest@127.0.0.1:5672/%2f", &options).is_ok());
        assert!(AmqpSink::new("amqp://guest:guest@127.0.0.1:notaport", &options).is_err());
        let mut options = SinkOptions::default();
        options.per_sink.amqp.routing_key = "{aggregate}".into();
        let e = AmqpSink::new("amqp://127.0.0.1", &options)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--amqp-routing-key"), "{e}");
    }
}
