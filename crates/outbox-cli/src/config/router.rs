//! From the file's sink tables to the relay's [`Router`]: each table's
//! keys over the flags' [`SinkOptions`], then its sink.
//!
//! Owns merging a table over the flags (a key the table leaves out takes
//! the flag's value; a table of properties goes over the flags' key by
//! key) and naming the table at fault in every error. Parsing the URL and
//! building the sink is `outbox_relay::sink`'s; reading the tables is
//! `file.rs`'s.

use std::time::Duration;

use outbox_relay::sink::format::{CloudEventsMode, Format, Formatter};
use outbox_relay::sink::router::Router;
use outbox_relay::sink::{self, DEFAULT_ROUTE, Sink};
use outbox_relay::{ClaimMode, PerSinkOptions, SinkOptions, redact};
use serde::Deserialize;

use super::file::{RelayFile, SinkTable};
use crate::exit::ConfigError;

/// Routes whose `claim` differs from the default route's: their own
/// router, their claim mode, and the aggregate types they take.
pub(crate) struct OtherLane {
    pub(crate) router: Router,
    pub(crate) claim: ClaimMode,
    pub(crate) types: Vec<String>,
}

impl RelayFile {
    /// The routers the file describes, split by claim mode: the default
    /// route with every route claimed as it is (`claim`, the effective
    /// `--claim`, unless its table sets its own), and the routes claimed
    /// the other way, if any. With `split` false (the WAL source, which
    /// has no claim) everything goes in the first.
    pub(crate) fn lanes(
        mut self,
        sink: Option<&str>,
        flags: &SinkOptions,
        claim: ClaimMode,
        split: bool,
    ) -> anyhow::Result<(Router, ClaimMode, Option<OtherLane>)> {
        let mode = |name: &str, table: &SinkTable| -> Result<ClaimMode, ConfigError> {
            match table.claim.as_deref() {
                None => Ok(claim),
                // `--claim`'s own parser, so the key takes what the flag does.
                Some(value) => <ClaimMode as clap::ValueEnum>::from_str(value, false).map_err(|_| {
                    ConfigError(format!(
                        "--config {name} claim = {value:?}: expected \"lock\" or \"deadline\""
                    ))
                }),
            }
        };
        let own = match &self.default {
            Some(table) => mode("[default]", table)?,
            None => claim,
        };
        let mut other: Vec<(String, SinkTable)> = Vec::new();
        for (aggregate_type, table) in std::mem::take(&mut self.routes) {
            let route_mode = mode(&format!("[routes.{aggregate_type}]"), &table)?;
            if split && route_mode != own {
                other.push((aggregate_type, table));
            } else {
                self.routes.insert(aggregate_type, table);
            }
        }
        let first = self.router(sink, flags)?;
        let types: Vec<String> = other.iter().map(|(t, _)| t.clone()).collect();
        let mut tables = other.into_iter();
        let Some((first_type, first_table)) = tables.next() else {
            return Ok((first, own, None));
        };
        // The lane claims only its own types, so its first route's sink can
        // stand as the router's default.
        let name = |t: &str| format!("[routes.{t}]");
        let first_window = first_table.window(&name(&first_type))?;
        let first_name = first_table.route_name(&first_type);
        let mut router = Router::named(first_name.clone(), first_table.build(&name(&first_type), flags)?)
            .with_address(first_name, redact::url(&first_table.sink))
            .with_default_types(vec![first_type.clone()]);
        if let Some(window) = first_window {
            router = router.with_retry_for(None, window);
        }
        for (aggregate_type, table) in tables {
            router = table.route(router, aggregate_type, flags)?;
        }
        let other_mode = match own {
            ClaimMode::Lock => ClaimMode::Deadline,
            ClaimMode::Deadline => ClaimMode::Lock,
        };
        Ok((
            first,
            own,
            Some(OtherLane {
                router,
                claim: other_mode,
                types,
            }),
        ))
    }

    /// The router the file describes. `sink` (the effective `--sink`) is
    /// the default route when there is no `[default]`; `flags` are the
    /// options of keys a table leaves out.
    pub(crate) fn router(self, sink: Option<&str>, flags: &SinkOptions) -> anyhow::Result<Router> {
        let default_window = match &self.default {
            Some(table) => table.window("[default]")?,
            None => None,
        };
        let default = match (self.default, sink) {
            (Some(table), _) => {
                let name = table.route_name(DEFAULT_ROUTE);
                (name, table.build("[default]", flags)?, redact::url(&table.sink))
            }
            (None, Some(url)) => (
                DEFAULT_ROUTE.to_owned(),
                sink::from_url(url, flags)?,
                redact::url(url),
            ),
            (None, None) => {
                return Err(ConfigError(
                    "--config: no [default] table and no sink: events of an aggregate type no route \
                     names would have nowhere to go; add [default] with sink = \"…\", or a top-level \
                     sink = \"…\""
                        .to_owned(),
                )
                .into());
            }
        };
        let mut router = Router::named(default.0.clone(), default.1).with_address(default.0, default.2);
        if let Some(window) = default_window {
            router = router.with_retry_for(None, window);
        }
        for (aggregate_type, table) in self.routes {
            router = table.route(router, aggregate_type, flags)?;
        }
        Ok(router)
    }
}

/// A sink built alone for `relay --check`: where it is configured
/// (`--sink`, `[default]`, `[routes.<type>]`), its URL, the sink.
pub(crate) type NamedSink = (String, String, Box<dyn Sink>);

impl RelayFile {
    /// Each sink the file describes, built alone, with its table's name and
    /// URL: what `relay --check` probes one by one (a router answers for
    /// all its routes at once). `sink` (the effective `--sink`) stands for
    /// the default route when there is no `[default]`.
    pub(crate) fn sinks(&self, sink: Option<&str>, flags: &SinkOptions) -> anyhow::Result<Vec<NamedSink>> {
        let mut sinks = Vec::new();
        match (&self.default, sink) {
            (Some(table), _) => {
                sinks.push((
                    "[default]".to_owned(),
                    table.sink.clone(),
                    table.build("[default]", flags)?,
                ));
            }
            (None, Some(url)) => {
                sinks.push(("--sink".to_owned(), url.to_owned(), sink::from_url(url, flags)?))
            }
            (None, None) => {}
        }
        for (aggregate_type, table) in &self.routes {
            let name = format!("[routes.{aggregate_type}]");
            sinks.push((name.clone(), table.sink.clone(), table.build(&name, flags)?));
        }
        Ok(sinks)
    }
}

impl SinkTable {
    /// The route's name: its `name`, else `fallback` (its aggregate type,
    /// or `default`); `ConfigFile::read` checked they differ.
    fn route_name(&self, fallback: &str) -> String {
        self.name.clone().unwrap_or_else(|| fallback.to_owned())
    }

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

    /// The route's own retry window (`retry_for`), checked as
    /// `--retry-for` is.
    fn window(&self, name: &str) -> Result<Option<Duration>, ConfigError> {
        let Some(text) = &self.retry_for else {
            return Ok(None);
        };
        let bad =
            |e: &dyn std::fmt::Display| ConfigError(format!("--config {name} retry_for = {text:?}: {e}"));
        let window = humantime::parse_duration(text).map_err(|e| bad(&e))?;
        if window == Duration::ZERO {
            return Err(bad(&"must be greater than zero"));
        }
        Ok(Some(window))
    }

    /// `router` with this table's route for `aggregate_type`.
    fn route(self, router: Router, aggregate_type: String, flags: &SinkOptions) -> anyhow::Result<Router> {
        let name = format!("[routes.{aggregate_type}]");
        let window = self.window(&name)?;
        let route = self.route_name(&aggregate_type);
        let sink = self.build(&name, flags)?;
        let address = redact::url(&self.sink);
        let router = router
            .route_named(aggregate_type.clone(), route.clone(), sink)
            .with_address(route, address);
        Ok(match window {
            Some(window) => router.with_retry_for(Some(&aggregate_type), window),
            None => router,
        })
    }

    fn build(&self, name: &str, flags: &SinkOptions) -> anyhow::Result<Box<dyn Sink>> {
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
    use outbox_relay::OrderMode;

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
                "config::router::tests::child_parses_the_environment",
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
    fn names_the_table_at_fault() {
        let flags = SinkOptions::default();
        let file = parse(
            "[default]\nsink = \"redis://x\"\n[routes.orders]\nsink = \"nats://x:4222\"\nnats_subject = \"a.{nope}\"\n",
        )
        .unwrap();
        let e = format!("{:#}", file.router(None, &flags).err().unwrap());
        assert!(e.contains("[routes.orders]") && e.contains("{nope}"), "{e}");
        let file = parse("[routes.orders]\nsink = \"redis://x\"\n").unwrap();
        let e = file.router(None, &flags).err().unwrap().to_string();
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
            let e = format!("{:#}", file.router(None, &flags).err().unwrap());
            assert!(
                e.contains("[routes.orders]") && e.contains("--kafka-topic"),
                "{e}"
            );
            let file = parse(
                "[default]\nsink = \"kafka://k:9092\"\nkafka_options = { \"linger.ms\" = \"5\", acks = \"1\" }\n",
            )
            .unwrap();
            let e = format!("{:#}", file.router(None, &flags).err().unwrap());
            assert!(
                e.contains("[default]") && e.contains("--kafka-option") && e.contains("acks"),
                "{e}"
            );
        }
        // Routes without [default]: the top-level (or --sink) sink is the default.
        let file = parse("sink = \"redis://x\"\n[routes.orders]\nsink = \"redis://y\"\n").unwrap();
        assert!(file.routes());
        file.router(Some("redis://x"), &flags).unwrap();
        let file = parse("[default]\nsink = \"redis://x\"\nformat = \"avro\"\n").unwrap();
        let e = file.router(None, &flags).err().unwrap().to_string();
        assert!(e.contains("format") && e.contains("avro"), "{e}");
        let file = parse(
            "[default]\nsink = \"redis://x\"\n[routes.orders]\nsink = \"redis://y\"\nretry_for = \"soon\"\n",
        )
        .unwrap();
        let e = file.router(None, &flags).err().unwrap().to_string();
        assert!(e.contains("[routes.orders] retry_for = \"soon\""), "{e}");
    }

    #[test]
    fn a_route_s_retry_for_is_its_own_window() {
        use outbox_relay::Sink as _;
        let file = parse(
            "[default]\nsink = \"redis://x\"\nretry_for = \"2h\"\n\
             [routes.orders]\nsink = \"redis://y\"\nretry_for = \"10m\"\n\
             [routes.payments]\nsink = \"redis://z\"\n",
        )
        .unwrap();
        let router = file.router(None, &SinkOptions::default()).unwrap();
        let minutes = |m: u64| Some(Duration::from_secs(m * 60));
        assert_eq!(router.retry_for("orders"), minutes(10));
        assert_eq!(router.retry_for("payments"), None, "the relay's --retry-for");
        assert_eq!(router.retry_for("invoices"), minutes(120), "[default]'s");
    }
}
