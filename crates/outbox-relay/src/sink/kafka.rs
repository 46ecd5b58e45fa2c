//! Kafka sink: one record per event on topic `outbox.event.<aggregate_type>`
//! (`--kafka-topic`), keyed by `aggregate_id`, written by librdkafka's
//! idempotent producer with `acks=all`.
//!
//! Each record carries the body and headers `--format` gives it
//! ([`super::format`]; native: the JSON body the other brokers get, every key
//! of the row's `headers` as a record header; CloudEvents binary mode: `ce_`
//! headers, the Kafka binding's), a `content-type` header when the format
//! names one, and the header `id: <event_id>` in every format (a row header
//! named `id` is dropped so it cannot replace it): the key
//! Debezium's outbox router uses, by which consumers (the inbox) drop
//! re-sends. The idempotent producer only removes the duplicates of its own
//! internal retries; a relay that crashed between "acked" and "marked", or
//! a record whose report timed out although the broker kept it, is sent
//! again and must be dropped by the consumer.
//!
//! Ordering: the key picks the partition (librdkafka's default partitioner
//! hashes it), so the events of an aggregate share one partition, and the
//! idempotent producer keeps their order in it even across its internal
//! retries (up to 5 requests in flight). As with NATS, a failed row is
//! retried later by the relay while its successors of the same batch went
//! out, so consumers needing strict order check `outbox_id` per aggregate.
//!
//! A batch is handed whole to librdkafka's queue, then every delivery report
//! is awaited. librdkafka fails a record it could not write within
//! `message.timeout.ms`, set to `--http-timeout`; a report that still has
//! not arrived a second later is counted as failed too, so a batch takes at
//! most the timeout plus that second. A row is delivered only when its own
//! report said the broker acknowledged it with `acks=all`.
//!
//! Errors: a record over the broker's size limit, an invalid topic name or a
//! refused authorization is permanent; no acknowledgement within the
//! timeout, every broker down, a transport failure or refused
//! authentication make the sink unavailable (no attempt spent, the relay's
//! breaker probes with a metadata request); anything else (an unknown topic
//! that an operator may still create, leader changes) is retryable. The sink never creates topics: partitions, replication and
//! retention are the operator's choice (a broker with
//! `auto.create.topics.enable` creates them on first use).
//!
//! `--kafka-option key=value` passes any other librdkafka producer property
//! (TLS and SASL: `security.protocol`, `sasl.mechanisms`, …; compression,
//! `linger.ms`). The properties the delivery guarantee rests on are refused
//! ([`RESERVED`]); librdkafka checks the rest at startup, so an unknown name
//! or a bad value is a configuration error, not a failure per batch.
//!
//! The producer is made on the first batch, not at startup, and made anew
//! after librdkafka reports a fatal error (which leaves it unusable, e.g. an
//! idempotence sequence that the broker lost) or after a batch failed whole.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::OutboxRow;
use rdkafka::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use tokio::time::Instant;

use super::format::{Formatter, Protocol};
use super::template::Template;
use super::{Delivery, DeliveryError, Sink, SinkError, SinkOptions};

/// How long after librdkafka's own `message.timeout.ms` a missing delivery
/// report counts as a failure: librdkafka checks timeouts once a second or
/// so, and the report then has to reach us.
const REPORT_GRACE: Duration = Duration::from_secs(1);
/// The longest topic name Kafka accepts.
const MAX_TOPIC_LEN: usize = 249;
/// Producer properties `--kafka-option` may not set, and why: the URL and
/// `--http-timeout` own the first ones, the rest would weaken "a row is
/// delivered only when every in-sync replica has it" or change the
/// producer's protocol (transactions).
pub const RESERVED: &[(&str, &str)] = &[
    ("bootstrap.servers", "the brokers come from the kafka:// URL"),
    ("metadata.broker.list", "the brokers come from the kafka:// URL"),
    ("message.timeout.ms", "set by --http-timeout"),
    ("delivery.timeout.ms", "set by --http-timeout"),
    ("enable.idempotence", "the relay needs the idempotent producer"),
    ("acks", "the relay needs acks=all"),
    ("request.required.acks", "the relay needs acks=all"),
    ("transactional.id", "the relay does not use Kafka transactions"),
];

/// `--kafka-topic`'s default.
const DEFAULT_TOPIC: &str = "outbox.event.{aggregate_type}";

/// The Kafka sink's options. Each field is a flag of `outbox relay`, the
/// environment variable beside it, and the routes file's key of the same
/// name (the flag with underscores; `--kafka-option` is `kafka_options`, a
/// table whose keys go over the flags' key by key).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct KafkaOptions {
    /// Kafka topic; same placeholders. Records are keyed by aggregate id.
    #[arg(
        id = "kafka_topic",
        value_name = "KAFKA_TOPIC",
        long = "kafka-topic",
        env = "OUTBOX_KAFKA_TOPIC",
        default_value = DEFAULT_TOPIC
    )]
    #[serde(rename = "kafka_topic")]
    pub topic: String,
    /// A librdkafka producer property, KEY=VALUE, repeatable (TLS, SASL,
    /// compression, linger.ms); the environment variable takes a
    /// comma-separated list. Properties the delivery guarantee rests on
    /// (acks, enable.idempotence, …) are refused.
    #[arg(
        id = "kafka_options",
        long = "kafka-option",
        env = "OUTBOX_KAFKA_OPTIONS",
        value_name = "KEY=VALUE",
        value_delimiter = ',',
        value_parser = key_value
    )]
    #[serde(rename = "kafka_options", with = "properties")]
    pub options: Vec<(String, String)>,
}

impl Default for KafkaOptions {
    fn default() -> Self {
        Self {
            topic: DEFAULT_TOPIC.to_owned(),
            options: Vec::new(),
        }
    }
}

/// `KEY=VALUE` of `--kafka-option`.
fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(key, _)| !key.trim().is_empty())
        .map(|(key, value)| (key.trim().to_owned(), value.to_owned()))
        .ok_or_else(|| format!("expected KEY=VALUE (a librdkafka property), got {s:?}"))
}

/// `kafka_options` in a routes file: a table of properties. Later pairs win,
/// as with librdkafka.
mod properties {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(pairs: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(pairs.iter().map(|(k, v)| (k, v)))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, String)>, D::Error> {
        Ok(BTreeMap::<String, String>::deserialize(d)?.into_iter().collect())
    }
}

/// Delivers to Kafka.
pub struct KafkaSink {
    brokers: String,
    topic: Template,
    timeout: Duration,
    /// `--kafka-option` pairs, set after the relay's own properties.
    options: Vec<(String, String)>,
    formatter: Formatter,
    /// The producer, made lazily; replaced after a fatal error. A std mutex:
    /// it is held only to clone or swap the handle, never across an await.
    producer: Mutex<Option<KafkaProducer>>,
}

type KafkaProducer = FutureProducer<LogContext>;

impl KafkaSink {
    /// A sink for `url` (`kafka://host:port[,host:port…]`).
    pub fn new(url: &str, options: &SinkOptions) -> Result<Self, SinkError> {
        let brokers = bootstrap_servers(url).map_err(|reason| SinkError::InvalidUrl {
            url: url.to_owned(),
            reason,
        })?;
        let own = &options.per_sink.kafka;
        let topic = Template::parse(&own.topic, "--kafka-topic")?;
        // A topic without placeholders can be checked now rather than per row.
        if topic.is_constant()
            && let Some(reason) = topic_problem(&own.topic)
        {
            return Err(SinkError::InvalidTemplate {
                flag: "--kafka-topic",
                template: own.topic.clone(),
                reason,
            });
        }
        if let Some((key, why)) = own
            .options
            .iter()
            .find_map(|(key, _)| RESERVED.iter().find(|(reserved, _)| reserved == key))
        {
            return Err(SinkError::InvalidOption {
                option: "--kafka-option",
                reason: format!("{key} cannot be set: {why}"),
            });
        }
        let sink = Self {
            brokers,
            topic,
            timeout: options.timeout,
            options: own.options.clone(),
            formatter: options.formatter.clone(),
            producer: Mutex::new(None),
        };
        // Refuse a setting librdkafka rejects now, as a configuration error;
        // this checks each property and makes no client, so no connection.
        sink.config()
            .create_native_config()
            .map_err(|e| SinkError::InvalidOption {
                option: "--kafka-option",
                reason: format!("librdkafka refused the producer configuration: {e}"),
            })?;
        Ok(sink)
    }

    /// The topic a row is written to.
    pub fn topic(&self, row: &OutboxRow) -> String {
        self.topic.render(row)
    }

    /// The bootstrap servers, as librdkafka's `bootstrap.servers`.
    pub fn bootstrap_servers(&self) -> &str {
        &self.brokers
    }

    fn config(&self) -> ClientConfig {
        // librdkafka takes milliseconds and wants at least 1 for the message
        // timeout, 1,000 for the connection setup timeout.
        let ms = |d: Duration, min: u128| d.as_millis().clamp(min, i32::MAX as u128).to_string();
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("client.id", "outbox-relay")
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", ms(self.timeout, 1))
            .set("socket.connection.setup.timeout.ms", ms(self.timeout, 1_000))
            // Back within a second of a broker's return, not librdkafka's 10 s.
            .set("reconnect.backoff.ms", "100")
            .set("reconnect.backoff.max.ms", "1000")
            .set_log_level(RDKafkaLogLevel::Warning);
        for (key, value) in &self.options {
            config.set(key, value);
        }
        config
    }

    fn producer(&self) -> Result<KafkaProducer, DeliveryError> {
        let mut slot = self.producer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = slot.as_ref() {
            return Ok(p.clone());
        }
        let producer: KafkaProducer = self
            .config()
            .create_with_context(LogContext)
            .map_err(|e| DeliveryError::unavailable(format!("kafka: creating the producer: {e}")))?;
        *slot = Some(producer.clone());
        Ok(producer)
    }

    /// Hands one row to librdkafka's queue; the future reports the broker's
    /// answer.
    fn enqueue(
        &self,
        producer: &KafkaProducer,
        row: &OutboxRow,
    ) -> Result<(String, DeliveryFuture), DeliveryError> {
        let topic = self.topic(row);
        if let Some(reason) = topic_problem(&topic) {
            return Err(DeliveryError::permanent(format!(
                "invalid kafka topic {topic:?}: {reason}"
            )));
        }
        let event_id = row.event_id.to_string();
        let formatted = self.formatter.message(row, Protocol::Kafka);
        let mut headers = OwnedHeaders::new();
        if let Some(content_type) = formatted.content_type {
            headers = headers.insert(Header {
                key: "content-type",
                value: Some(content_type),
            });
        }
        for (name, value) in &formatted.headers {
            if name != "id" {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_str()),
                });
            }
        }
        // Last, so a row header of the same name cannot replace the dedup key.
        let headers = headers.insert(Header {
            key: "id",
            value: Some(&event_id),
        });
        let body = formatted.body;
        let record = FutureRecord::to(&topic)
            .key(&row.aggregate_id)
            .payload(&body)
            .headers(headers);
        match producer.send_result(record) {
            Ok(report) => Ok((topic, report)),
            Err((e, _)) => Err(classify(&e, &topic, self.timeout)),
        }
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        let producer = match self.producer() {
            Ok(p) => p,
            Err(e) => return batch.iter().map(|_| Err(e.clone())).collect(),
        };

        // Queue everything first: `send_result` only hands the record to
        // librdkafka, which batches, sends and retries on its own threads.
        let pending: Vec<_> = batch.iter().map(|row| self.enqueue(&producer, row)).collect();

        let deadline = Instant::now() + self.timeout + REPORT_GRACE;
        let timeout = self.timeout;
        let reports = pending.into_iter().map(|queued| async move {
            let (topic, report) = queued?;
            match tokio::time::timeout_at(deadline, report).await {
                Ok(Ok(Ok(_delivered))) => Ok(()),
                Ok(Ok(Err((e, _message)))) => Err(classify(&e, &topic, timeout)),
                Ok(Err(_canceled)) => Err(DeliveryError::unavailable(
                    "kafka: the producer went away before reporting",
                )),
                Err(_) => Err(DeliveryError::unavailable(format!(
                    "kafka: no delivery report for topic {topic:?} within {:?}",
                    timeout + REPORT_GRACE
                ))),
            }
        });
        let outcomes = futures::future::join_all(reports).await;

        if let Some((code, reason)) = producer.client().fatal_error() {
            tracing::warn!(%code, %reason, "kafka producer failed fatally; making a new one");
            *self.producer.lock().unwrap_or_else(PoisonError::into_inner) = None;
        } else if !outcomes.is_empty() && outcomes.iter().all(Result::is_err) {
            // A broker that lost its idempotence state (tansu after a restart)
            // refuses the old producer id with an unknown error forever; a new
            // producer gets a new id. Costs nothing while the brokers are down.
            *self.producer.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
        outcomes
    }
}

/// `host:port[,host:port…]` from `kafka://host:port[,host:port…]`. Parsed by
/// hand: a URL parser takes `a:9092,b:9092` for a host with a bad port.
fn bootstrap_servers(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("kafka://")
        .ok_or_else(|| "not a kafka:// URL".to_owned())?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() {
        return Err("no host".to_owned());
    }
    if rest.contains(['/', '?', '#', '@']) {
        return Err("expected kafka://host:port[,host:port…], without path, query or user".to_owned());
    }
    for server in rest.split(',') {
        let (host, port) = server
            .rsplit_once(':')
            .ok_or_else(|| format!("{server:?} has no port (e.g. 127.0.0.1:9092)"))?;
        if host.is_empty() {
            return Err(format!("{server:?} has no host"));
        }
        port.parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("{port:?} is not a port"))?;
    }
    Ok(rest.to_owned())
}

/// Why Kafka would refuse `topic` as a topic name, if it would: 1 to 249 of
/// `[a-zA-Z0-9._-]`, and neither `.` nor `..`.
fn topic_problem(topic: &str) -> Option<String> {
    if topic.is_empty() {
        return Some("empty".to_owned());
    }
    if topic.len() > MAX_TOPIC_LEN {
        return Some(format!("longer than {MAX_TOPIC_LEN} characters"));
    }
    if topic == "." || topic == ".." {
        return Some("'.' and '..' are not topic names".to_owned());
    }
    if let Some(c) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Some(format!(
            "{c:?} is not allowed (only a-z, A-Z, 0-9, '.', '_', '-')"
        ));
    }
    None
}

fn classify(error: &KafkaError, topic: &str, timeout: Duration) -> DeliveryError {
    use RDKafkaErrorCode as C;
    match error.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::MessageBatchTooLarge
            | C::InvalidTopic
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::UnsupportedForMessageFormat
            | C::PolicyViolation,
        ) => DeliveryError::permanent(format!("kafka: writing to topic {topic:?}: {error}")),
        Some(C::MessageTimedOut) => DeliveryError::unavailable(format!(
            "kafka: no acknowledgement for topic {topic:?} within {timeout:?} (brokers down or unreachable?)"
        )),
        // `Unknown` is the broker's UNKNOWN_SERVER_ERROR: a failure of the
        // broker, not of the record (tansu answers it while shutting down).
        Some(
            C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::SaslAuthenticationFailed
            | C::Authentication
            | C::Unknown,
        ) => DeliveryError::unavailable(format!("kafka: writing to topic {topic:?}: {error}")),
        Some(C::UnknownTopic | C::UnknownTopicOrPartition) => DeliveryError::retryable(format!(
            "kafka: topic {topic:?} does not exist; create it, e.g. \
             `kafka-topics.sh --create --topic {topic}`"
        )),
        _ => DeliveryError::retryable(format!("kafka: writing to topic {topic:?}: {error}")),
    }
}

/// Sends librdkafka's own log lines and errors to `tracing` (rdkafka's
/// default context uses the `log` crate, which nothing here records).
#[derive(Debug, Clone, Copy)]
struct LogContext;

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(facility, "librdkafka: {message}");
            }
            RDKafkaLogLevel::Warning => tracing::warn!(facility, "librdkafka: {message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(facility, "librdkafka: {message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(facility, "librdkafka: {message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        // "All brokers down" and the like: the delivery reports carry the
        // consequence to `last_error`, so this is context, not an alarm.
        tracing::warn!(%error, "librdkafka: {reason}");
    }
}

impl Sink for KafkaSink {
    fn name(&self) -> &'static str {
        "kafka"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            let producer = self.producer()?;
            let timeout = self.timeout;
            // A metadata request answers only when a broker does; librdkafka
            // blocks the calling thread for it.
            let metadata = tokio::task::spawn_blocking(move || {
                producer.client().fetch_metadata(None, timeout).map(|_| ())
            });
            match metadata.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(DeliveryError::unavailable(format!("kafka: {e}"))),
                Err(e) => Err(DeliveryError::unavailable(format!(
                    "kafka: the metadata request failed: {e}"
                ))),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::template::tests::row;

    #[test]
    fn parses_bootstrap_servers() {
        assert_eq!(
            bootstrap_servers("kafka://127.0.0.1:9092").unwrap(),
            "127.0.0.1:9092"
        );
        assert_eq!(
            bootstrap_servers("kafka://a:9092,b:9093/").unwrap(),
            "a:9092,b:9093"
        );
        for bad in [
            "kafka://",
            "kafka://a",
            "kafka://a:notaport",
            "kafka://a:0",
            "kafka://:9092",
            "kafka://a:9092,",
            "kafka://a:9092/topic",
            "kafka://u:p@a:9092",
            "http://a:9092",
        ] {
            assert!(bootstrap_servers(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn checks_topics() {
        assert_eq!(topic_problem("outbox.event.orders"), None);
        assert_eq!(topic_problem("a-b_c.D9"), None);
        let long = "a".repeat(250);
        for bad in ["", ".", "..", "a b", "a/b", "a.*", long.as_str()] {
            assert!(topic_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn refuses_bad_urls_and_constant_topics() {
        let options = SinkOptions::default();
        let sink = KafkaSink::new("kafka://127.0.0.1:9092", &options).unwrap();
        assert_eq!(sink.topic(&row()), "outbox.event.orders");
        assert_eq!(sink.bootstrap_servers(), "127.0.0.1:9092");
        let mut options = SinkOptions::default();
        options.per_sink.kafka.topic = "outbox events".into();
        let e = KafkaSink::new("kafka://127.0.0.1:9092", &options)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--kafka-topic") && e.contains("not allowed"), "{e}");
    }

    #[test]
    fn passes_options_to_librdkafka_and_refuses_reserved_ones() {
        let with = |pairs: &[(&str, &str)]| {
            let mut options = SinkOptions::default();
            options.per_sink.kafka.options = pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            options
        };
        let url = "kafka://127.0.0.1:9092";
        let sink = KafkaSink::new(url, &with(&[("compression.type", "lz4"), ("linger.ms", "20")])).unwrap();
        assert_eq!(sink.config().get("compression.type"), Some("lz4"));
        assert_eq!(sink.config().get("acks"), Some("all"));
        for (key, value, needle) in [
            ("acks", "1", "acks=all"),
            ("enable.idempotence", "false", "idempotent"),
            ("bootstrap.servers", "x:1", "kafka:// URL"),
            ("no.such.property", "1", "No such configuration property"),
            ("compression.type", "rot13", "rot13"),
        ] {
            let e = KafkaSink::new(url, &with(&[(key, value)]))
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.contains("--kafka-option") && e.contains(needle),
                "{key}={value}: {e}"
            );
        }
    }

    #[test]
    fn classifies_errors() {
        let t = Duration::from_secs(1);
        let production = |code| KafkaError::MessageProduction(code);
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::InvalidTopic,
        ] {
            assert!(!classify(&production(code), "t", t).is_retryable(), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::Unknown,
        ] {
            assert!(classify(&production(code), "t", t).is_unavailable(), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::QueueFull,
            RDKafkaErrorCode::NotEnoughReplicas,
            RDKafkaErrorCode::UnknownTopicOrPartition,
        ] {
            let error = classify(&production(code), "t", t);
            assert!(error.is_retryable() && !error.is_unavailable(), "{code:?}");
        }
        let e = classify(&production(RDKafkaErrorCode::MessageTimedOut), "t", t).to_string();
        assert!(e.contains("kafka") && e.contains("no acknowledgement"), "{e}");
    }
}
