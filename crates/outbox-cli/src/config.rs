//! `outbox relay --config outbox.toml`: routes from aggregate types to sinks.
//!
//! Owns the file's shape and its checks; building the sinks is
//! `outbox_relay::sink`'s. Every key of a sink table is a relay flag's name
//! with underscores (`--nats-subject` = `nats_subject`; a sink's own keys
//! and flags are one declaration, its options struct in
//! `outbox_relay::sink::PerSinkOptions`), and a key missing
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
use std::fmt;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use outbox_relay::sink::format::{CloudEventsMode, Format, Formatter};
use outbox_relay::sink::router::Router;
use outbox_relay::sink::{self, Sink};
use outbox_relay::{OrderMode, PerSinkOptions, SinkOptions};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

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
///
/// The sinks' own keys are [`PerSinkOptions`]'s, declared once beside each
/// sink. serde's `flatten` cannot be combined with `deny_unknown_fields`, so
/// this table reads its keys itself: an unknown one is refused where it
/// stands, and each sink key's value is checked against its declaration
/// there (so the error points at it) and applied over the flags in
/// [`SinkTable::options`].
#[derive(Debug)]
struct SinkTable {
    sink: String,
    format: Option<String>,
    cloudevents_mode: Option<String>,
    cloudevents_source: Option<String>,
    http_timeout: Option<String>,
    /// The [`PerSinkOptions`] keys the table sets.
    per_sink: serde_json::Map<String, serde_json::Value>,
}

/// The keys of a sink table other than [`PerSinkOptions`]'s.
const SHARED_KEYS: [&str; 5] = [
    "sink",
    "format",
    "cloudevents_mode",
    "cloudevents_source",
    "http_timeout",
];

/// Every key a sink table takes, in the order an unknown-key message lists
/// them: `sink`, the envelope's, each sink's own, `http_timeout`.
fn table_keys() -> &'static [&'static str] {
    static KEYS: OnceLock<&'static [&'static str]> = OnceLock::new();
    KEYS.get_or_init(|| {
        let (last, first) = SHARED_KEYS.split_last().expect("not empty");
        let own = keys_of(&PerSinkOptions::default())
            .into_iter()
            .map(|key| &*Box::leak(key.into_boxed_str()));
        let keys: Vec<&'static str> = first.iter().copied().chain(own).chain([*last]).collect();
        Box::leak(keys.into_boxed_slice())
    })
}

/// The keys `value` serializes with, in order.
fn keys_of(value: &impl Serialize) -> Vec<String> {
    struct Keys(Vec<String>);
    impl<'de> Deserialize<'de> for Keys {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct KeysVisitor;
            impl<'de> Visitor<'de> for KeysVisitor {
                type Value = Keys;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a map")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Keys, A::Error> {
                    let mut keys = Vec::new();
                    while let Some((key, IgnoredAny)) = map.next_entry::<String, IgnoredAny>()? {
                        keys.push(key);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(KeysVisitor)
        }
    }
    // JSON text keeps the order fields serialize in (a `Value` would sort).
    let json = serde_json::to_string(value).expect("options serialize to JSON");
    let Keys(keys) = serde_json::from_str(&json).expect("options serialize to a JSON object");
    keys
}

impl<'de> Deserialize<'de> for SinkTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_struct("SinkTable", table_keys(), TableVisitor)
    }
}

struct TableVisitor;

impl<'de> Visitor<'de> for TableVisitor {
    type Value = SinkTable;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("struct SinkTable")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SinkTable, A::Error> {
        let mut sink = None;
        let mut table = SinkTable {
            sink: String::new(),
            format: None,
            cloudevents_mode: None,
            cloudevents_source: None,
            http_timeout: None,
            per_sink: serde_json::Map::new(),
        };
        while let Some(key) = map.next_key_seed(Key)? {
            match key {
                "sink" => sink = Some(map.next_value()?),
                "format" => table.format = Some(map.next_value()?),
                "cloudevents_mode" => table.cloudevents_mode = Some(map.next_value()?),
                "cloudevents_source" => table.cloudevents_source = Some(map.next_value()?),
                "http_timeout" => table.http_timeout = Some(map.next_value()?),
                own => {
                    let value = map.next_value_seed(Own(own))?;
                    table.per_sink.insert(own.to_owned(), value);
                }
            }
        }
        table.sink = sink.ok_or_else(|| de::Error::missing_field("sink"))?;
        Ok(table)
    }
}

/// A key of a sink table; any other is refused.
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = &'static str;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let key = String::deserialize(d)?;
        let keys = table_keys();
        keys.iter()
            .find(|k| **k == key)
            .copied()
            .ok_or_else(|| de::Error::unknown_field(&key, keys))
    }
}

/// The value of one of [`PerSinkOptions`]'s keys, checked against its
/// declaration.
struct Own(&'static str);

impl<'de> DeserializeSeed<'de> for Own {
    type Value = serde_json::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let value = toml::Value::deserialize(d)?;
        let mut alone = toml::Table::new();
        alone.insert(self.0.to_owned(), value.clone());
        PerSinkOptions::deserialize(alone).map_err(|e| de::Error::custom(e.message()))?;
        serde_json::to_value(value).map_err(de::Error::custom)
    }
}

impl RelayFile {
    /// Reads and parses `path`.
    pub(crate) fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("reading --config {}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| ConfigError(format!("--config {}: {e}", path.display())))
    }

    /// The `[ordering]` table, checked.
    pub(crate) fn ordering(&self) -> Result<Vec<(String, OrderMode)>, ConfigError> {
        self.ordering
            .iter()
            .map(|(aggregate_type, mode)| match mode.as_str() {
                "partition" => Ok((aggregate_type.clone(), OrderMode::Partition)),
                "strict" => Ok((aggregate_type.clone(), OrderMode::Strict)),
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
    /// The options this table's sink is built with: its keys over `flags`.
    fn options(&self, name: &str, flags: &SinkOptions) -> Result<SinkOptions, ConfigError> {
        let bad = |key: &str, e: &dyn std::fmt::Display| ConfigError(format!("--config {name} {key}: {e}"));
        let (format, mode, source) = flags.formatter.parts();
        let format = match &self.format {
            Some(f) => f.parse::<Format>().map_err(|e| bad("format", &e))?,
            None => format,
        };
        let mode = match &self.cloudevents_mode {
            Some(m) => m
                .parse::<CloudEventsMode>()
                .map_err(|e| bad("cloudevents_mode", &e))?,
            None => mode,
        };
        let timeout = match &self.http_timeout {
            Some(t) => humantime::parse_duration(t).map_err(|e| bad("http_timeout", &e))?,
            None => flags.timeout,
        };
        if timeout == Duration::ZERO {
            return Err(bad("http_timeout", &"must be greater than zero"));
        }
        // The table's keys over the flags' values; a table value (the
        // librdkafka properties) goes over the flags' key by key, and
        // librdkafka keeps the last value of a key: the table's win.
        let mut per_sink = serde_json::to_value(&flags.per_sink).map_err(|e| bad("options", &e))?;
        if let serde_json::Value::Object(merged) = &mut per_sink {
            for (key, value) in &self.per_sink {
                match (merged.get_mut(key), value) {
                    (Some(serde_json::Value::Object(under)), serde_json::Value::Object(over)) => {
                        under.extend(over.clone());
                    }
                    _ => {
                        merged.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        // Each value was checked against its declaration when the file was read.
        let per_sink = PerSinkOptions::deserialize(per_sink).map_err(|e| bad("options", &e))?;
        Ok(SinkOptions {
            timeout,
            formatter: Formatter::new(
                format,
                mode,
                self.cloudevents_source
                    .clone()
                    .unwrap_or_else(|| source.to_owned()),
            ),
            per_sink,
        })
    }

    fn build(self, name: &str, flags: &SinkOptions) -> anyhow::Result<Box<dyn Sink>> {
        let options = self.options(name, flags)?;
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

    /// Every sink option: its flag, environment variable and routes-file
    /// line, each giving the same value.
    fn every_option() -> Vec<(&'static str, &'static str, &'static str, &'static str)> {
        let mut all = vec![
            (
                "--stream-prefix",
                "OUTBOX_STREAM_PREFIX",
                "p",
                "stream_prefix = \"p\"",
            ),
            (
                "--nats-subject",
                "OUTBOX_NATS_SUBJECT",
                "s.{event_type}",
                "nats_subject = \"s.{event_type}\"",
            ),
            (
                "--amqp-exchange",
                "OUTBOX_AMQP_EXCHANGE",
                "x",
                "amqp_exchange = \"x\"",
            ),
            (
                "--amqp-routing-key",
                "OUTBOX_AMQP_ROUTING_KEY",
                "k",
                "amqp_routing_key = \"k\"",
            ),
            (
                "--http-secret",
                "OUTBOX_HTTP_SECRET",
                "whsec_c2VjcmV0",
                "http_secret = \"whsec_c2VjcmV0\"",
            ),
            (
                "--http-concurrency",
                "OUTBOX_HTTP_CONCURRENCY",
                "3",
                "http_concurrency = 3",
            ),
        ];
        if cfg!(feature = "kafka") {
            all.extend([
                ("--kafka-topic", "OUTBOX_KAFKA_TOPIC", "t", "kafka_topic = \"t\""),
                (
                    "--kafka-option",
                    "OUTBOX_KAFKA_OPTIONS",
                    "linger.ms=5",
                    "kafka_options = { \"linger.ms\" = \"5\" }",
                ),
            ]);
        }
        all
    }

    /// The sinks' own options `outbox relay --sink redis://x <flags>` gets.
    fn from_flags(flags: &[&str]) -> PerSinkOptions {
        let args = ["outbox", "relay", "--sink", "redis://x"].iter().chain(flags);
        match <crate::cli::Cli as clap::Parser>::try_parse_from(args)
            .unwrap()
            .command
        {
            crate::cli::Command::Relay(relay) => relay.sink_options.per_sink,
            _ => unreachable!(),
        }
    }

    /// The sinks' own options of a `[default]` table, over `flags`.
    fn from_file(lines: &str, flags: &SinkOptions) -> Result<SinkOptions, ConfigError> {
        let file = parse(&format!("[default]\nsink = \"redis://x\"\n{lines}")).unwrap();
        file.default.unwrap().options("[default]", flags)
    }

    /// Where the child process started by `one_declaration_is_flag_environment_and_key`
    /// prints what it parsed.
    const CHILD_SAYS: &str = "parsed from the environment: ";

    #[test]
    fn one_declaration_is_flag_environment_and_key() {
        let options = every_option();
        let flags: Vec<&str> = options
            .iter()
            .flat_map(|(flag, _, value, _)| [*flag, *value])
            .collect();
        let from_flags = from_flags(&flags);
        assert_ne!(from_flags, PerSinkOptions::default());

        let lines: String = options.iter().map(|(.., line)| format!("{line}\n")).collect();
        let from_file = from_file(&lines, &SinkOptions::default()).unwrap().per_sink;
        assert_eq!(from_file, from_flags);

        // The environment is read in a child process: this one's cannot be
        // changed safely while other tests run.
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "config::tests::child_parses_the_environment",
                "--exact",
                "--nocapture",
            ])
            .env("OUTBOX_TEST_CHILD", "1")
            .envs(options.iter().map(|(_, env, value, _)| (env, value)))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json = stdout
            .lines()
            .find_map(|l| l.strip_prefix(CHILD_SAYS))
            .unwrap_or_else(|| panic!("the child did not run: {stdout}"));
        let from_env: PerSinkOptions = serde_json::from_str(json).unwrap();
        assert_eq!(from_env, from_flags);
    }

    #[test]
    fn child_parses_the_environment() {
        if std::env::var_os("OUTBOX_TEST_CHILD").is_none() {
            return;
        }
        println!("{CHILD_SAYS}{}", serde_json::to_string(&from_flags(&[])).unwrap());
    }

    #[test]
    fn a_key_left_out_takes_the_flag() {
        let mut flags = SinkOptions {
            per_sink: from_flags(&["--nats-subject", "from.flag", "--stream-prefix", "flag"]),
            ..SinkOptions::default()
        };
        if cfg!(feature = "kafka") {
            flags.per_sink = from_flags(&[
                "--nats-subject",
                "from.flag",
                "--stream-prefix",
                "flag",
                "--kafka-option",
                "linger.ms=1",
                "--kafka-option",
                "acks=all",
            ]);
        }
        let file =
            "stream_prefix = \"file\"\nkafka_options = { \"linger.ms\" = \"2\", \"batch.size\" = \"9\" }\n";
        let file = if cfg!(feature = "kafka") {
            file
        } else {
            "stream_prefix = \"file\"\n"
        };
        let options = from_file(file, &flags).unwrap().per_sink;
        assert_eq!(options.redis.stream_prefix, "file");
        assert_eq!(options.nats.subject, "from.flag");
        #[cfg(feature = "kafka")]
        assert_eq!(
            options.kafka.options,
            [("acks", "all"), ("batch.size", "9"), ("linger.ms", "2")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
    }

    #[test]
    fn refuses_unknown_keys() {
        let e = parse("[default]\nsink = \"redis://x\"\nsubjekt = \"a\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("subjekt"), "{e}");
        // The same message as a derived `deny_unknown_fields` table's, at the key.
        let known = if cfg!(feature = "kafka") {
            "`sink`, `format`, `cloudevents_mode`, `cloudevents_source`, `stream_prefix`, `nats_subject`, \
             `amqp_exchange`, `amqp_routing_key`, `kafka_topic`, `kafka_options`, `http_secret`, \
             `http_concurrency`, `http_timeout`"
        } else {
            "`sink`, `format`, `cloudevents_mode`, `cloudevents_source`, `stream_prefix`, `nats_subject`, \
             `amqp_exchange`, `amqp_routing_key`, `http_secret`, `http_concurrency`, `http_timeout`"
        };
        assert_eq!(
            e,
            format!(
                "TOML parse error at line 3, column 1\n  |\n3 | subjekt = \"a\"\n  | ^^^^^^^\n\
                 unknown field `subjekt`, expected one of {known}\n"
            )
        );
        // A value of the wrong type is pointed at.
        let e = parse("[default]\nsink = \"redis://x\"\nhttp_concurrency = \"a\"\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "TOML parse error at line 3, column 20\n  |\n3 | http_concurrency = \"a\"\n  |                    ^^^\n\
             invalid type: string \"a\", expected u16\n"
        );
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
            [("orders".to_owned(), OrderMode::Strict)]
        );
        // Without the kafka feature these keys, like the scheme, are unknown.
        if cfg!(feature = "kafka") {
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
        }
        let file = parse("[default]\nsink = \"redis://x\"\nformat = \"avro\"\n").unwrap();
        let e = file.router(&flags).err().unwrap().to_string();
        assert!(e.contains("format") && e.contains("avro"), "{e}");
    }
}
