//! Where events go: the [`Sink`] trait, its per-row outcome and the URL
//! scheme that picks a sink.
//!
//! A sink gets a claimed batch and answers one [`Delivery`] per row, in the
//! batch's order. `Ok` means the broker or receiver acknowledged the event;
//! only those rows are marked published. A sink never panics on a broker
//! failure and never retries on its own: it reports, and the relay schedules
//! the retry, so every retry is visible in the table (`attempts`,
//! `last_error`, `next_attempt_at`).
//!
//! Adding a sink is one file implementing [`Sink`], one feature, and one arm
//! in [`from_url`].

use std::time::Duration;

use futures::future::BoxFuture;
use outbox::OutboxRow;

use self::format::Formatter;

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod format;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "redis")]
pub mod redis;
pub mod router;
pub mod template;

/// The outcome of delivering one row.
pub type Delivery = Result<(), DeliveryError>;

/// Why a row was not delivered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeliveryError {
    /// Worth retrying later: connection errors, timeouts, 408, 429, 5xx.
    #[error("{message}")]
    Retryable {
        /// What went wrong, for `last_error`.
        message: String,
        /// The earliest next attempt the receiver asked for (`Retry-After`).
        retry_after: Option<Duration>,
    },
    /// The receiver refused the event; retrying will not help. The row
    /// becomes a dead letter at once.
    #[error("{message}")]
    Permanent {
        /// What went wrong, for `last_error`.
        message: String,
    },
    /// Not attempted in this call; costs no attempt. The HTTP sink answers
    /// it for the rows of an aggregate behind one that failed in the batch,
    /// since sending them would overtake that event.
    #[error("{message}")]
    NotSent {
        /// Why it was not sent, for `last_error`.
        message: String,
    },
}

impl DeliveryError {
    /// A retryable error with no `Retry-After`.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::Retryable {
            message: message.into(),
            retry_after: None,
        }
    }

    /// A permanent error.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::Permanent {
            message: message.into(),
        }
    }

    /// Whether a later attempt may succeed.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Self::Permanent { .. })
    }
}

/// A destination for events.
pub trait Sink: Send + Sync {
    /// A short name for logs, e.g. `redis`.
    fn name(&self) -> &'static str;

    /// Delivers `batch` and answers one [`Delivery`] per row, in order. Every
    /// network call inside must have a timeout.
    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>>;
}

/// Settings shared by the sinks; each uses the ones that concern it.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    /// Redis stream name prefix; the stream is `<prefix>.<aggregate_type>`.
    pub stream_prefix: String,
    /// Timeout of one HTTP request, Redis round trip, NATS ack or AMQP
    /// confirm (and of making a connection).
    pub timeout: Duration,
    /// How many aggregates an HTTP batch sends to at once.
    pub http_concurrency: usize,
    /// Standard Webhooks secret (`whsec_…`); when set, HTTP requests are signed.
    pub http_secret: Option<String>,
    /// NATS subject, with `{aggregate_type}` / `{event_type}` placeholders.
    pub nats_subject: String,
    /// AMQP exchange, with the same placeholders.
    pub amqp_exchange: String,
    /// AMQP routing key, with the same placeholders.
    pub amqp_routing_key: String,
    /// The envelope: `--format`, `--cloudevents-mode`, `--cloudevents-source`.
    pub formatter: Formatter,
    /// Kafka topic, with the same placeholders.
    pub kafka_topic: String,
    /// librdkafka producer properties (`--kafka-option key=value`): TLS,
    /// SASL, compression, batching. Later pairs win.
    pub kafka_options: Vec<(String, String)>,
}

impl Default for SinkOptions {
    fn default() -> Self {
        Self {
            stream_prefix: "outbox.event".to_owned(),
            timeout: Duration::from_secs(10),
            http_concurrency: 16,
            http_secret: None,
            nats_subject: "outbox.event.{aggregate_type}".to_owned(),
            amqp_exchange: "outbox".to_owned(),
            amqp_routing_key: "{aggregate_type}.{event_type}".to_owned(),
            formatter: Formatter::default(),
            kafka_topic: "outbox.event.{aggregate_type}".to_owned(),
            kafka_options: Vec::new(),
        }
    }
}

/// A sink URL that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// Not a URL at all.
    #[error("invalid sink URL {url:?}: {reason}")]
    InvalidUrl {
        /// The refused value.
        url: String,
        /// Why.
        reason: String,
    },
    /// A sink option that cannot be used.
    #[error("invalid {option}: {reason}")]
    InvalidOption {
        /// The flag, e.g. `--http-secret`.
        option: &'static str,
        /// Why.
        reason: String,
    },
    /// A scheme no compiled-in sink handles.
    #[error("unknown sink scheme {scheme:?} in {url:?} (known: {known})")]
    UnknownScheme {
        /// The scheme.
        scheme: String,
        /// The whole value.
        url: String,
        /// The schemes this build knows.
        known: String,
    },
    /// A subject, exchange or routing key template that cannot be rendered.
    #[error("invalid {flag} {template:?}: {reason}")]
    InvalidTemplate {
        /// The flag it came from, e.g. `--nats-subject`.
        flag: &'static str,
        /// The refused value.
        template: String,
        /// Why.
        reason: String,
    },
}

/// The schemes this build handles, for messages: a sink whose feature is
/// off must not be offered as a fix.
pub const KNOWN_SCHEMES: &[&str] = &[
    #[cfg(feature = "redis")]
    "redis",
    #[cfg(feature = "redis")]
    "rediss",
    #[cfg(feature = "http")]
    "http",
    #[cfg(feature = "http")]
    "https",
    #[cfg(feature = "nats")]
    "nats",
    #[cfg(feature = "amqp")]
    "amqp",
    #[cfg(feature = "amqp")]
    "amqps",
    #[cfg(feature = "kafka")]
    "kafka",
];

/// Builds the sink a URL names. Builds no connection: an unreachable sink is
/// a delivery failure later, never a startup crash.
// Without any sink feature nothing reads `options`.
#[cfg_attr(
    not(any(
        feature = "redis",
        feature = "http",
        feature = "nats",
        feature = "amqp",
        feature = "kafka"
    )),
    allow(unused_variables)
)]
pub fn from_url(url: &str, options: &SinkOptions) -> Result<Box<dyn Sink>, SinkError> {
    // Before URL parsing: `kafka://a:9092,b:9092` lists several brokers,
    // which a URL parser reads as one host with a bad port.
    #[cfg(feature = "kafka")]
    if url.starts_with("kafka://") {
        return Ok(Box::new(kafka::KafkaSink::new(url, options)?));
    }
    let parsed = url::Url::parse(url).map_err(|e| SinkError::InvalidUrl {
        url: url.to_owned(),
        reason: e.to_string(),
    })?;
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(SinkError::InvalidUrl {
            url: url.to_owned(),
            reason: "no host".to_owned(),
        });
    }
    match parsed.scheme() {
        #[cfg(feature = "redis")]
        "redis" | "rediss" => Ok(Box::new(redis::RedisSink::new(url, options)?)),
        #[cfg(feature = "http")]
        "http" | "https" => Ok(Box::new(http::HttpSink::new(parsed, options)?)),
        #[cfg(feature = "nats")]
        "nats" => Ok(Box::new(nats::NatsSink::new(url, options)?)),
        #[cfg(feature = "amqp")]
        "amqp" | "amqps" => Ok(Box::new(amqp::AmqpSink::new(url, options)?)),
        scheme => Err(SinkError::UnknownScheme {
            scheme: scheme.to_owned(),
            url: url.to_owned(),
            known: KNOWN_SCHEMES.join(", "),
        }),
    }
}
