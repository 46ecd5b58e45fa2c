//! Where events go: the [`Sink`] trait, its per-row outcome, and the
//! registry of sinks by URL scheme.
//!
//! A sink gets a claimed batch and answers one [`Delivery`] per row, in the
//! batch's order. `Ok` means the broker or receiver acknowledged the event;
//! only those rows are marked published. A sink never panics on a broker
//! failure and never retries on its own: it reports, and the relay schedules
//! the retry, so every retry is visible in the table (`attempts`,
//! `last_error`, `next_attempt_at`).
//!
//! Adding a sink is one file, one cargo feature, one registry line and one
//! line in the conformance suite. The file holds the [`Sink`] and its
//! options, one struct deriving `clap::Args` and `serde`'s traits, whose
//! declaration gives each option its `outbox relay` flag, environment
//! variable and routes-file key; the registry line is its entry in
//! [`SINKS`] (schemes and constructor), beside its options' field in
//! [`PerSinkOptions`], both behind the sink's feature.

use std::time::Duration;

use futures::future::BoxFuture;
use outbox::OutboxRow;

use self::format::Formatter;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(any(feature = "sqs", feature = "sns"))]
pub mod aws;
#[cfg(any(feature = "sqs", feature = "sns"))]
pub mod claim_check;
#[cfg(test)]
pub(crate) mod fake;
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
#[cfg(feature = "sns")]
pub mod sns;
#[cfg(feature = "sqs")]
pub mod sqs;
pub mod template;

/// The name of the route of a sink used without a routes file, and of a
/// routes file's fallback (`[default]`) unless it names it: the `route`
/// label of the metrics.
pub const DEFAULT_ROUTE: &str = "default";

/// The outcome of delivering one row.
pub type Delivery = Result<(), DeliveryError>;

/// Why a row was not delivered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeliveryError {
    /// The event failed and is worth retrying later (an HTTP 408 or 500,
    /// a broker's negative acknowledgement): costs an attempt.
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
    /// The sink as a whole is unavailable (connection refused or reset, DNS,
    /// TLS, a timeout, not connected, no responders, every broker down,
    /// authentication refused; an HTTP receiver answering 502, 503, 504 or
    /// 429): says nothing about this event, so it costs no attempt. The
    /// relay opens the sink's circuit breaker: it claims nothing more for
    /// the sink until [`Sink::probe`] succeeds.
    #[error("{message}")]
    Unavailable {
        /// Why, for `last_error` and the breaker's log line.
        message: String,
        /// How long the receiver asked to be left alone (`Retry-After`):
        /// the earliest next probe and next attempt.
        retry_after: Option<Duration>,
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

    /// The sink is unavailable, see [`DeliveryError::Unavailable`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::Unavailable {
            message: message.into(),
            retry_after: None,
        }
    }

    /// How long the receiver asked to wait before the next attempt
    /// (`Retry-After`), if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Retryable { retry_after, .. } | Self::Unavailable { retry_after, .. } => *retry_after,
            Self::Permanent { .. } | Self::NotSent { .. } => None,
        }
    }

    /// Whether the answer is about the sink rather than the event.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
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

    /// Checks that the sink is reachable without sending an event
    /// (connecting if need be, within the sink's timeout): at startup, and
    /// while its circuit breaker is open. `Err` is
    /// [`DeliveryError::Unavailable`] with the cause.
    ///
    /// The default answers available, so the breaker closes at the next
    /// probe and a delivery decides again.
    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        Box::pin(async { Ok(()) })
    }

    /// Checks the setup for `relay --check`, sending no event: by default
    /// [`probe`](Self::probe). A sink with a part its probe leaves alone
    /// while that part works (the SQS and SNS claim check's bucket) checks
    /// it here too.
    fn check(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        self.probe()
    }

    /// Whether the sink keeps a circuit breaker per route (the router): its
    /// unavailable answers may come from a route's breaker rather than a
    /// failed call, so the relay's own breaker does not count them as
    /// strikes (see `breaker`), and says nothing: the routes' breakers log,
    /// signal and report. Such a sink also times each route's requests
    /// itself (`outbox_sink_request_duration_seconds` per `sink` and
    /// `route`), so the relay does not time the whole call.
    fn has_route_breakers(&self) -> bool {
        false
    }

    /// The retry window of events of `aggregate_type` when it is not the
    /// relay's `--retry-for`: a route's own `retry_for` (the router). None
    /// by default.
    fn retry_for(&self, aggregate_type: &str) -> Option<Duration> {
        let _ = aggregate_type;
        None
    }

    /// The route that delivers events of `aggregate_type` and its sink's
    /// name: the `route` and `sink` labels of their metrics. A sink alone
    /// is one route, [`DEFAULT_ROUTE`]. Asked once per aggregate type (the
    /// relay keeps the handles), never per row.
    fn route_of(&self, aggregate_type: &str) -> (&str, &'static str) {
        let _ = aggregate_type;
        (DEFAULT_ROUTE, self.name())
    }

    /// The sink for the relay's startup lines: its name, or each route's
    /// sink and name (`redis route orders, http route default`).
    fn describe(&self) -> String {
        self.name().to_owned()
    }

    /// Called by the relay that runs this sink when it starts: a sink
    /// with state to report (the router's per-route breakers) reports it
    /// to that relay's health, gauges and signals. Nothing by default.
    fn bind(&self, ctx: &crate::RelayContext) {
        let _ = ctx;
    }

    /// The largest event (payload bytes) the sink accepts, where the sink
    /// can tell (NATS `max_payload`, a Kafka producer's
    /// `message.max.bytes`), once it connected. The relay lowers
    /// `--max-event-bytes` to it, so a larger event fails permanently
    /// without reaching the sink.
    fn max_event_bytes(&self) -> Option<u64> {
        None
    }
}

/// What a sink is built with: the options every sink shares, and each
/// sink's own.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    /// Timeout of one HTTP request, Redis round trip, NATS ack, AMQP
    /// confirm or Kafka delivery report (and of making a connection).
    pub timeout: Duration,
    /// The envelope: `--format`, `--cloudevents-mode`, `--cloudevents-source`.
    pub formatter: Formatter,
    /// Each compiled-in sink's own options.
    pub per_sink: PerSinkOptions,
}

impl Default for SinkOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            formatter: Formatter::default(),
            per_sink: PerSinkOptions::default(),
        }
    }
}

/// Each compiled-in sink's own options, one field per sink, flattened: `outbox
/// relay` takes their flags (and environment variables), and a routes-file
/// table takes their keys. Field order is the order of `--help` and of the
/// keys an unknown-key message lists.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PerSinkOptions {
    /// `--stream-prefix`.
    #[cfg(feature = "redis")]
    #[command(flatten)]
    #[serde(flatten)]
    pub redis: redis::RedisOptions,
    /// `--nats-subject`.
    #[cfg(feature = "nats")]
    #[command(flatten)]
    #[serde(flatten)]
    pub nats: nats::NatsOptions,
    /// `--amqp-exchange`, `--amqp-routing-key`.
    #[cfg(feature = "amqp")]
    #[command(flatten)]
    #[serde(flatten)]
    pub amqp: amqp::AmqpOptions,
    /// `--kafka-topic`, `--kafka-option`.
    #[cfg(feature = "kafka")]
    #[command(flatten)]
    #[serde(flatten)]
    pub kafka: kafka::KafkaOptions,
    /// `--http-secret`, `--http-concurrency`.
    #[cfg(feature = "http")]
    #[command(flatten)]
    #[serde(flatten)]
    pub http: http::HttpOptions,
}

/// A sink URL that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// Not a URL at all. Its message shows the URL masked
    /// ([`crate::redact::url`]): it reaches logs and the terminal.
    #[error("invalid sink URL {:?}: {reason}", crate::redact::url(.url))]
    InvalidUrl {
        /// The refused value, as given.
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
    #[error("unknown sink scheme {scheme:?} in {:?} (known: {known})", crate::redact::url(.url))]
    UnknownScheme {
        /// The scheme.
        scheme: String,
        /// The whole value, as given (masked in the message).
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

/// Builds a sink from its URL and options; makes no connection.
pub type Build = fn(&str, &SinkOptions) -> Result<Box<dyn Sink>, SinkError>;

/// A compiled-in sink: the URL schemes it handles and how it is built.
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    /// The URL schemes, e.g. `redis` and `rediss`.
    pub schemes: &'static [&'static str],
    /// Whether the URL is handed over as it is, before any URL parsing:
    /// `kafka://a:9092,b:9092` lists several brokers, which a URL parser
    /// reads as one host with a bad port.
    pub unparsed: bool,
    /// The constructor.
    pub build: Build,
}

impl Registration {
    /// A sink whose URL must parse as a URL with a host.
    pub const fn new(schemes: &'static [&'static str], build: Build) -> Self {
        Self {
            schemes,
            unparsed: false,
            build,
        }
    }

    /// A sink that parses its URL itself.
    pub const fn unparsed(schemes: &'static [&'static str], build: Build) -> Self {
        Self {
            schemes,
            unparsed: true,
            build,
        }
    }
}

/// The compiled-in sinks, one line each, behind its feature: a sink whose
/// feature is off is neither built nor offered as a fix in messages.
#[rustfmt::skip]
pub const SINKS: &[Registration] = &[
    #[cfg(feature = "redis")]
    Registration::new(&["redis", "rediss"], |url, o| Ok(Box::new(redis::RedisSink::new(url, o)?))),
    #[cfg(feature = "http")]
    Registration::new(&["http", "https"], |url, o| Ok(Box::new(http::HttpSink::new(parse(url)?, o)?))),
    #[cfg(feature = "nats")]
    Registration::new(&["nats"], |url, o| Ok(Box::new(nats::NatsSink::new(url, o)?))),
    #[cfg(feature = "amqp")]
    Registration::new(&["amqp", "amqps"], |url, o| Ok(Box::new(amqp::AmqpSink::new(url, o)?))),
    #[cfg(feature = "kafka")]
    Registration::unparsed(&["kafka"], |url, o| Ok(Box::new(kafka::KafkaSink::new(url, o)?))),
    #[cfg(feature = "sqs")]
    Registration::unparsed(&["sqs"], |url, o| Ok(Box::new(sqs::SqsSink::new(url, o)?))),
    #[cfg(feature = "sns")]
    Registration::unparsed(&["sns"], |url, o| Ok(Box::new(sns::SnsSink::new(url, o)?))),
];

/// The schemes this build handles, in [`SINKS`] order.
pub fn schemes() -> impl Iterator<Item = &'static str> {
    SINKS.iter().flat_map(|sink| sink.schemes.iter().copied())
}

/// Builds the sink a URL names. Builds no connection: an unreachable sink is
/// a delivery failure later, never a startup crash.
pub fn from_url(url: &str, options: &SinkOptions) -> Result<Box<dyn Sink>, SinkError> {
    let handles = |scheme: &str, unparsed: bool| {
        SINKS
            .iter()
            .find(|sink| sink.unparsed == unparsed && sink.schemes.contains(&scheme))
    };
    if let Some((scheme, _)) = url.split_once("://")
        && let Some(sink) = handles(scheme, true)
    {
        return (sink.build)(url, options);
    }
    let parsed = parse(url)?;
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(SinkError::InvalidUrl {
            url: url.to_owned(),
            reason: "no host".to_owned(),
        });
    }
    match handles(parsed.scheme(), false) {
        Some(sink) => (sink.build)(url, options),
        None => Err(SinkError::UnknownScheme {
            scheme: parsed.scheme().to_owned(),
            url: url.to_owned(),
            known: schemes().collect::<Vec<_>>().join(", "),
        }),
    }
}

fn parse(url: &str) -> Result<url::Url, SinkError> {
    url::Url::parse(url).map_err(|e| SinkError::InvalidUrl {
        url: url.to_owned(),
        reason: e.to_string(),
    })
}
