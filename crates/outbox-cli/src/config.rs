//! `outbox relay --config outbox.toml`: routes from aggregate types to sinks.
//!
//! Owns the file's shape and its checks; building the sinks is
//! `outbox_relay::sink`'s. Every key of a sink table is a relay flag's name
//! with underscores (`--nats-subject` = `nats_subject`), and a key missing
//! from a table takes the flag's value (or its environment variable, or its
//! default): file over flag over environment over default. Unknown keys, a
//! missing `[default]` and a type routed twice are errors (exit 2), found
//! before the relay starts.
//!
//! ```toml
//! [default]                       # every aggregate type no route names
//! sink = "http://127.0.0.1:8080/events"
//! format = "cloudevents"
//!
//! [routes.orders]                 # aggregate type "orders"
//! sink = "nats://127.0.0.1:4222"
//! nats_subject = "orders.{event_type}"
//!
//! [routes.payments]
//! sink = "amqp://guest:guest@127.0.0.1:5672/%2f"
//! format = "debezium"
//!
//! [ordering]                      # per aggregate type, over --ordering
//! orders = "strict"
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use outbox_relay::SinkOptions;
use outbox_relay::sink::format::{CloudEventsMode, Format, Formatter};
use outbox_relay::sink::router::Router;
use outbox_relay::sink::{self, Sink};
use serde::Deserialize;

use crate::cli::Ordering;
use crate::exit::ConfigError;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RelayFile {
    /// Where every aggregate type no route names goes. Required: the relay
    /// cannot know which types will be written.
    default: Option<SinkTable>,
    /// Aggregate type → its sink.
    #[serde(default)]
    routes: BTreeMap<String, SinkTable>,
    /// Aggregate type → `partition` or `strict` (`--ordering-for`).
    #[serde(default)]
    ordering: BTreeMap<String, String>,
}

/// One sink: its URL and the options that override the flags.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SinkTable {
    sink: String,
    format: Option<String>,
    cloudevents_mode: Option<String>,
    cloudevents_source: Option<String>,
    stream_prefix: Option<String>,
    nats_subject: Option<String>,
    amqp_exchange: Option<String>,
    amqp_routing_key: Option<String>,
    kafka_topic: Option<String>,
    /// librdkafka properties, over the `--kafka-option` ones key by key.
    kafka_options: Option<BTreeMap<String, String>>,
    http_secret: Option<String>,
    http_concurrency: Option<u16>,
    http_timeout: Option<String>,
}

impl RelayFile {
    /// Reads and parses `path`.
    pub(crate) fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("reading --config {}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| ConfigError(format!("--config {}: {e}", path.display())))
    }

    /// The `[ordering]` table, checked.
    pub(crate) fn ordering(&self) -> Result<Vec<(String, Ordering)>, ConfigError> {
        self.ordering
            .iter()
            .map(|(aggregate_type, mode)| match mode.as_str() {
                "partition" => Ok((aggregate_type.clone(), Ordering::Partition)),
                "strict" => Ok((aggregate_type.clone(), Ordering::Strict)),
                other => Err(ConfigError(format!(
                    "--config [ordering] {aggregate_type} = {other:?}: expected \"partition\" or \"strict\""
                ))),
            })
            .collect()
    }

    /// The router the file describes; `flags` are the options of keys a
    /// table leaves out.
    pub(crate) fn router(self, flags: &SinkOptions) -> anyhow::Result<Router> {
        let default = self.default.ok_or_else(|| {
            ConfigError(
                "--config: no [default] table: events of an aggregate type no route names would have \
                 nowhere to go; add [default] with sink = \"…\""
                    .to_owned(),
            )
        })?;
        let mut router = Router::new(default.build("[default]", flags)?);
        for (aggregate_type, table) in self.routes {
            let sink = table.build(&format!("[routes.{aggregate_type}]"), flags)?;
            router = router.route(aggregate_type, sink);
        }
        Ok(router)
    }
}

impl SinkTable {
    fn build(self, name: &str, flags: &SinkOptions) -> anyhow::Result<Box<dyn Sink>> {
        let bad = |key: &str, e: &dyn std::fmt::Display| ConfigError(format!("--config {name} {key}: {e}"));
        let (format, mode, source) = flags.formatter.parts();
        let format = match self.format {
            Some(f) => f.parse::<Format>().map_err(|e| bad("format", &e))?,
            None => format,
        };
        let mode = match self.cloudevents_mode {
            Some(m) => m
                .parse::<CloudEventsMode>()
                .map_err(|e| bad("cloudevents_mode", &e))?,
            None => mode,
        };
        let timeout = match self.http_timeout {
            Some(t) => humantime::parse_duration(&t).map_err(|e| bad("http_timeout", &e))?,
            None => flags.timeout,
        };
        if timeout == Duration::ZERO {
            return Err(bad("http_timeout", &"must be greater than zero").into());
        }
        let options = SinkOptions {
            stream_prefix: self.stream_prefix.unwrap_or_else(|| flags.stream_prefix.clone()),
            timeout,
            http_concurrency: self.http_concurrency.map_or(flags.http_concurrency, usize::from),
            http_secret: self.http_secret.or_else(|| flags.http_secret.clone()),
            nats_subject: self.nats_subject.unwrap_or_else(|| flags.nats_subject.clone()),
            amqp_exchange: self.amqp_exchange.unwrap_or_else(|| flags.amqp_exchange.clone()),
            amqp_routing_key: self
                .amqp_routing_key
                .unwrap_or_else(|| flags.amqp_routing_key.clone()),
            kafka_topic: self.kafka_topic.unwrap_or_else(|| flags.kafka_topic.clone()),
            // librdkafka keeps the last value of a key: the table's win.
            kafka_options: flags
                .kafka_options
                .iter()
                .cloned()
                .chain(self.kafka_options.into_iter().flatten())
                .collect(),
            formatter: Formatter::new(
                format,
                mode,
                self.cloudevents_source.unwrap_or_else(|| source.to_owned()),
            ),
        };
        // SinkError is a configuration error (exit 2) already; the context
        // says which table it came from.
        let sink = sink::from_url(&self.sink, &options)
            .map_err(|e| anyhow::Error::new(e).context(format!("--config {name}")))?;
        Ok(sink)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RelayFile, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn refuses_unknown_keys() {
        let e = parse("[default]\nsink = \"redis://x\"\nsubjekt = \"a\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("subjekt"), "{e}");
        let e = parse("[defaults]\nsink = \"redis://x\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("defaults"), "{e}");
    }

    #[test]
    fn names_the_table_at_fault() {
        let flags = SinkOptions::default();
        let file = parse(
            "[default]\nsink = \"redis://x\"\n[routes.orders]\nsink = \"nats://x:4222\"\nnats_subject = \"a.{nope}\"\n",
        )
        .unwrap();
        let e = format!("{:#}", file.router(&flags).err().unwrap());
        assert!(e.contains("[routes.orders]") && e.contains("{nope}"), "{e}");
        let file = parse("[routes.orders]\nsink = \"redis://x\"\n").unwrap();
        let e = file.router(&flags).err().unwrap().to_string();
        assert!(e.contains("[default]"), "{e}");
        let file = parse("[default]\nsink = \"redis://x\"\n[ordering]\norders = \"none\"\n").unwrap();
        let e = file.ordering().unwrap_err().to_string();
        assert!(e.contains("orders") && e.contains("none"), "{e}");
        let file = parse("[default]\nsink = \"redis://x\"\n[ordering]\norders = \"strict\"\n").unwrap();
        assert_eq!(
            file.ordering().unwrap(),
            [("orders".to_owned(), Ordering::Strict)]
        );
        let file = parse(
            "[default]\nsink = \"redis://x\"\n[routes.orders]\nsink = \"kafka://k:9092\"\nkafka_topic = \"a b\"\n",
        )
        .unwrap();
        let e = format!("{:#}", file.router(&flags).err().unwrap());
        assert!(
            e.contains("[routes.orders]") && e.contains("--kafka-topic"),
            "{e}"
        );
        let file = parse(
            "[default]\nsink = \"kafka://k:9092\"\nkafka_options = { \"linger.ms\" = \"5\", acks = \"1\" }\n",
        )
        .unwrap();
        let e = format!("{:#}", file.router(&flags).err().unwrap());
        assert!(
            e.contains("[default]") && e.contains("--kafka-option") && e.contains("acks"),
            "{e}"
        );
        let file = parse("[default]\nsink = \"redis://x\"\nformat = \"avro\"\n").unwrap();
        let e = file.router(&flags).err().unwrap().to_string();
        assert!(e.contains("format") && e.contains("avro"), "{e}");
    }
}
