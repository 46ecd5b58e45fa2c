//! `outbox relay --config outbox.toml`: every relay setting in one file, and
//! routes from aggregate types to sinks.
//!
//! Owns the file's shape, its checks, and how it is layered under the
//! command line and the environment ([`Layered`]); building the sinks is
//! `outbox_relay::sink`'s. Every key is a relay flag's id, its long name
//! with underscores (`--batch-size` = `batch_size`; `--kafka-option` =
//! `kafka_options`), and is checked by the flag's own value parser, so a
//! key takes exactly what its flag takes.
//!
//! Precedence, for the top-level keys: a flag on the command line, then its
//! environment variable, then the file, then the default. The file's values
//! are handed to clap as if they were flags, only for settings neither the
//! command line nor the environment gave (clap's `ValueSource` says which),
//! so clap stays the one parser. Inside a sink table (`[default]`,
//! `[routes.<type>]`) the table's own keys win for that route, and a key it
//! leaves out takes the top-level value. Unknown keys, bad values and a type
//! routed twice are errors naming the key and its line (exit 2), found
//! before the relay starts.
//!
//! ```toml
//! batch_size = 50                 # = --batch-size 50
//! ordering = "strict"
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
//! [ordering_for]                  # per aggregate type, over `ordering`
//! payments = "partition"
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory, FromArgMatches};
use outbox_relay::sink::format::{CloudEventsMode, Format, Formatter};
use outbox_relay::sink::router::Router;
use outbox_relay::sink::{self, Sink};
use outbox_relay::{OrderMode, PerSinkOptions, SinkOptions};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::cli::{Cli, Command, ConfigCommand, Global, RelayArgs};
use crate::exit::ConfigError;

/// The whole file.
#[derive(Debug, Default)]
pub(crate) struct RelayFile {
    /// The top-level keys: a relay flag's id → its value, where it stands.
    settings: BTreeMap<&'static str, Spanned<toml::Value>>,
    /// Where every aggregate type no route names goes, over the top-level
    /// `sink` and sink keys.
    default: Option<SinkTable>,
    /// Aggregate type → its sink.
    routes: BTreeMap<String, SinkTable>,
    /// Aggregate type → `partition` or `strict`: the `[ordering]` table,
    /// over `ordering_for`.
    ordering: BTreeMap<String, Spanned<String>>,
}

/// Flags that are no keys: `config` names the file; logging starts before
/// the file is read.
const NOT_KEYS: [&str; 4] = ["config", "log_format", "help", "version"];

/// The tables of the file, beside the settings.
const TABLES: [&str; 3] = ["default", "routes", "ordering"];

/// Every top-level setting: the ids of `outbox relay`'s flags (the global
/// ones it uses included), in `--help`'s order.
pub(crate) fn setting_keys() -> &'static [&'static str] {
    static KEYS: OnceLock<&'static [&'static str]> = OnceLock::new();
    KEYS.get_or_init(|| {
        let mut cli = Cli::command();
        cli.build();
        let relay = cli.find_subcommand("relay").expect("outbox relay exists");
        let keys: Vec<&'static str> = relay
            .get_arguments()
            .filter(|arg| arg.get_long().is_some())
            .map(|arg| arg.get_id().as_str())
            .filter(|id| !NOT_KEYS.contains(id))
            .map(|id| &*Box::leak(id.to_owned().into_boxed_str()))
            .collect();
        Box::leak(keys.into_boxed_slice())
    })
}

/// Every top-level key: the settings, then the tables.
fn file_keys() -> &'static [&'static str] {
    static KEYS: OnceLock<&'static [&'static str]> = OnceLock::new();
    KEYS.get_or_init(|| {
        let keys: Vec<&'static str> = setting_keys()
            .iter()
            .copied()
            .chain(TABLES.iter().copied().filter(|t| !setting_keys().contains(t)))
            .collect();
        Box::leak(keys.into_boxed_slice())
    })
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
    /// Where each key the table sets stands in the file.
    spans: BTreeMap<&'static str, Range<usize>>,
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
pub(crate) fn table_keys() -> &'static [&'static str] {
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

impl<'de> Deserialize<'de> for RelayFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_struct("RelayFile", file_keys(), FileVisitor)
    }
}

struct FileVisitor;

impl<'de> Visitor<'de> for FileVisitor {
    type Value = RelayFile;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("struct RelayFile")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RelayFile, A::Error> {
        let mut file = RelayFile::default();
        while let Some(key) = map.next_key_seed(Key(file_keys()))? {
            match key {
                "default" => file.default = Some(map.next_value()?),
                "routes" => file.routes = map.next_value()?,
                // `ordering = "strict"` is `--ordering`; an `[ordering]`
                // table, per aggregate type, came first and stays valid.
                "ordering" => {
                    let value: Spanned<Ordering> = map.next_value()?;
                    let span = value.span();
                    match value.into_inner() {
                        Ordering::Mode(mode) => {
                            file.settings
                                .insert("ordering", Spanned::new(span, toml::Value::String(mode)));
                        }
                        Ordering::PerType(types) => file.ordering = types,
                    }
                }
                setting => {
                    file.settings.insert(setting, map.next_value()?);
                }
            }
        }
        Ok(file)
    }
}

/// The value of the `ordering` key: a mode, or the `[ordering]` table.
enum Ordering {
    Mode(String),
    PerType(BTreeMap<String, Spanned<String>>),
}

impl<'de> Deserialize<'de> for Ordering {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct OrderingVisitor;
        impl<'de> Visitor<'de> for OrderingVisitor {
            type Value = Ordering;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mode (\"partition\", \"strict\", \"none\") or a table of aggregate types")
            }
            fn visit_str<E: de::Error>(self, mode: &str) -> Result<Ordering, E> {
                Ok(Ordering::Mode(mode.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Ordering, A::Error> {
                let mut types = BTreeMap::new();
                while let Some((aggregate_type, mode)) = map.next_entry()? {
                    types.insert(aggregate_type, mode);
                }
                Ok(Ordering::PerType(types))
            }
        }
        d.deserialize_any(OrderingVisitor)
    }
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
            spans: BTreeMap::new(),
        };
        while let Some(key) = map.next_key_seed(Key(table_keys()))? {
            let mut string = |map: &mut A| -> Result<Option<String>, A::Error> {
                let value: Spanned<String> = map.next_value()?;
                table.spans.insert(key, value.span());
                Ok(Some(value.into_inner()))
            };
            match key {
                "sink" => sink = string(&mut map)?,
                "format" => table.format = string(&mut map)?,
                "cloudevents_mode" => table.cloudevents_mode = string(&mut map)?,
                "cloudevents_source" => table.cloudevents_source = string(&mut map)?,
                "http_timeout" => table.http_timeout = string(&mut map)?,
                own => {
                    let value = map.next_value_seed(Own(own))?;
                    table.spans.insert(own, value.span());
                    table.per_sink.insert(own.to_owned(), value.into_inner());
                }
            }
        }
        table.sink = sink.ok_or_else(|| de::Error::missing_field("sink"))?;
        Ok(table)
    }
}

/// A key of a table that takes these keys; any other is refused.
struct Key(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for Key {
    type Value = &'static str;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let key = String::deserialize(d)?;
        self.0
            .iter()
            .find(|k| **k == key)
            .copied()
            .ok_or_else(|| de::Error::unknown_field(&key, self.0))
    }
}

/// The value of one of [`PerSinkOptions`]'s keys, checked against its
/// declaration.
struct Own(&'static str);

impl<'de> DeserializeSeed<'de> for Own {
    type Value = Spanned<serde_json::Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let value = Spanned::<toml::Value>::deserialize(d)?;
        let span = value.span();
        let mut alone = toml::Table::new();
        alone.insert(self.0.to_owned(), value.get_ref().clone());
        PerSinkOptions::deserialize(alone).map_err(|e| de::Error::custom(e.message()))?;
        let json = serde_json::to_value(value.into_inner()).map_err(de::Error::custom)?;
        Ok(Spanned::new(span, json))
    }
}

/// A file read from disk: what it says, and where, for messages.
#[derive(Debug)]
pub(crate) struct ConfigFile {
    path: PathBuf,
    text: String,
    body: RelayFile,
}

impl ConfigFile {
    /// Reads and parses `path`: an unknown key or a value of the wrong type
    /// is an error naming the file and line.
    pub(crate) fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("reading --config {}: {e}", path.display())))?;
        let body = toml::from_str(&text).map_err(|e: toml::de::Error| match e.span() {
            Some(span) => ConfigError(format!(
                "--config {}:{}: {}",
                path.display(),
                line_of(&text, &span),
                e.message().trim_end()
            )),
            None => ConfigError(format!("--config {}: {}", path.display(), e.message().trim_end())),
        })?;
        Ok(Self {
            path: path.to_owned(),
            text,
            body,
        })
    }

    /// `path:line` of a span in the file.
    pub(crate) fn at(&self, span: &Range<usize>) -> String {
        format!("{}:{}", self.path.display(), line_of(&self.text, span))
    }

    /// The file's sink tables and `[ordering]`.
    pub(crate) fn body(&self) -> &RelayFile {
        &self.body
    }

    pub(crate) fn into_body(self) -> RelayFile {
        self.body
    }
}

/// The 1-based line a span starts on.
fn line_of(text: &str, span: &Range<usize>) -> usize {
    let start = span.start.min(text.len());
    text.as_bytes()[..start].iter().filter(|b| **b == b'\n').count() + 1
}

/// Where an effective setting came from, highest precedence first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    /// The command line.
    Flag,
    /// This environment variable.
    Env(String),
    /// The file, at `path:line`.
    File(String),
    /// Nobody set it.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag => f.write_str("flag"),
            Source::Env(var) => write!(f, "env {var}"),
            Source::File(at) => write!(f, "file {at}"),
            Source::Default => f.write_str("default"),
        }
    }
}

/// The command line with the file layered under flags and environment.
#[derive(Debug)]
pub(crate) struct Layered {
    /// What the command runs with.
    pub(crate) cli: Cli,
    /// The file, if `--config` named one.
    pub(crate) file: Option<ConfigFile>,
    /// The command's matches after layering: each setting's value as text.
    matches: ArgMatches,
    /// Each setting's source, and `config`'s.
    sources: BTreeMap<&'static str, Source>,
    /// The repeatable settings.
    lists: BTreeSet<&'static str>,
}

impl Layered {
    /// Parses `argv` (the process's, for `relay` and `config show`) and
    /// layers the `--config` file under it.
    ///
    /// clap's derive keeps no `ArgMatches`, and only they say whether a value
    /// came from the command line, the environment or a default: the same
    /// arguments parse the same way twice.
    pub(crate) fn parse(argv: impl IntoIterator<Item = OsString>) -> anyhow::Result<Self> {
        let argv: Vec<OsString> = argv.into_iter().collect();
        let mut command = Cli::command();
        command.build();
        let first = command
            .clone()
            .try_get_matches_from(&argv)
            .map_err(|e| ConfigError(e.to_string()))?;
        let (this, matches) = leaf(&command, &first);
        let file = match matches.get_one::<PathBuf>("config") {
            Some(path) => Some(ConfigFile::read(path)?),
            None => None,
        };
        let mut sources = BTreeMap::new();
        let mut lists = BTreeSet::new();
        let mut extra: Vec<OsString> = Vec::new();
        for &key in setting_keys() {
            let arg = this
                .get_arguments()
                .find(|arg| arg.get_id() == key)
                .expect("`relay` and `config show` take the same flags");
            if matches!(arg.get_action(), ArgAction::Append) {
                lists.insert(key);
            }
            let source = match matches.value_source(key) {
                Some(ValueSource::CommandLine) => Source::Flag,
                Some(ValueSource::EnvVariable) => Source::Env(
                    arg.get_env()
                        .map(|var| var.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                ),
                _ => match file.as_ref().and_then(|f| Some((f, f.body.settings.get(key)?))) {
                    Some((file, value)) => {
                        let at = file.at(&value.span());
                        let args = file_args(arg, value.get_ref()).map_err(|e| {
                            ConfigError(format!("--config {at}: {key} = {}: {e}", shown(value.get_ref())))
                        })?;
                        extra.extend(args.into_iter().map(OsString::from));
                        Source::File(at)
                    }
                    None => Source::Default,
                },
            };
            sources.insert(key, source);
        }
        match matches.value_source("config") {
            Some(ValueSource::CommandLine) => sources.insert("config", Source::Flag),
            Some(ValueSource::EnvVariable) => {
                sources.insert("config", Source::Env("OUTBOX_CONFIG".to_owned()))
            }
            _ => None,
        };
        let layered = command
            .clone()
            .try_get_matches_from(argv.into_iter().chain(extra))
            .map_err(|e| ConfigError(e.to_string()))?;
        let cli = Cli::from_arg_matches(&layered).map_err(|e| ConfigError(e.to_string()))?;
        if let Some(Source::File(at)) = sources.get("database_url") {
            tracing::warn!(
                "database_url is set in {at}: a password there is a secret in a file; \
                 DATABASE_URL in the environment keeps it out"
            );
        }
        let (_, matches) = leaf(&command, &layered);
        Ok(Self {
            cli,
            file,
            matches: matches.clone(),
            sources,
            lists,
        })
    }

    /// Where `key` (one of [`setting_keys`]) came from.
    pub(crate) fn source(&self, key: &str) -> Source {
        self.sources.get(key).cloned().unwrap_or(Source::Default)
    }

    /// The settings `outbox relay` runs with (`config show`'s too).
    pub(crate) fn into_relay(self) -> (Global, RelayArgs, Option<ConfigFile>) {
        let args = match self.cli.command {
            Command::Relay(args) => args,
            Command::Config(ConfigCommand::Show(show)) => show.relay,
            _ => unreachable!("layered only for `relay` and `config show`"),
        };
        (self.cli.global, args, self.file)
    }

    /// Whether `key` is a repeatable flag (its value a list).
    pub(crate) fn is_list(&self, key: &str) -> bool {
        self.lists.contains(key)
    }

    /// `key`'s values as its flag would take them; empty when unset.
    pub(crate) fn raw(&self, key: &str) -> Vec<String> {
        self.matches
            .get_raw(key)
            .map(|values| values.map(|v| v.to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }
}

/// The subcommand that runs, and its matches.
fn leaf<'a>(
    mut command: &'a clap::Command,
    mut matches: &'a ArgMatches,
) -> (&'a clap::Command, &'a ArgMatches) {
    while let Some((name, sub)) = matches.subcommand() {
        command = command
            .find_subcommand(name)
            .expect("a matched subcommand exists");
        matches = sub;
    }
    (command, matches)
}

/// The file's `value` for `arg` as command-line arguments, each checked by
/// the flag's own value parser.
fn file_args(arg: &clap::Arg, value: &toml::Value) -> Result<Vec<String>, String> {
    let long = arg.get_long().expect("every setting has a long flag");
    let values = match (arg.get_action(), value) {
        (ArgAction::SetTrue, toml::Value::Boolean(on)) => {
            return Ok(if *on { vec![format!("--{long}")] } else { vec![] });
        }
        (ArgAction::SetTrue, _) => return Err("expected true or false".to_owned()),
        // Repeatable flags: a table of KEY = VALUE, or an array.
        (ArgAction::Append, toml::Value::Table(table)) => table
            .iter()
            .map(|(k, v)| scalar(v).map(|v| format!("{k}={v}")))
            .collect::<Result<Vec<_>, _>>()?,
        (ArgAction::Append, toml::Value::Array(values)) => {
            values.iter().map(scalar).collect::<Result<Vec<_>, _>>()?
        }
        (_, value) => vec![scalar(value)?],
    };
    // The flag alone, with no default, environment or neighbours, judges
    // each value: its message is the flag's.
    let alone = arg
        .clone()
        .env(None)
        .default_value(None)
        .required(false)
        .global(false);
    let check = clap::Command::new("outbox")
        .no_binary_name(true)
        .color(clap::ColorChoice::Never)
        .arg(alone);
    let mut args = Vec::new();
    for value in values {
        let flag = format!("--{long}={value}");
        check
            .clone()
            .try_get_matches_from([&flag])
            .map_err(|e| match arg.get_action() {
                // Say which of the values it is.
                ArgAction::Append => format!("{value:?}: {}", clap_reason(&e)),
                _ => clap_reason(&e),
            })?;
        args.push(flag);
    }
    Ok(args)
}

/// A single TOML value as the text a flag takes.
fn scalar(value: &toml::Value) -> Result<String, String> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        toml::Value::Datetime(d) => Ok(d.to_string()),
        toml::Value::Array(_) | toml::Value::Table(_) => {
            Err(format!("expected a single value, found {}", value.type_str()))
        }
    }
}

/// A TOML value as the file spells it (a table or array by its type).
fn shown(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => format!("{s:?}"),
        toml::Value::Array(_) | toml::Value::Table(_) => format!("<{}>", value.type_str()),
        other => scalar(other).unwrap_or_default(),
    }
}

/// What clap said about a value: the value parser's reason, or the values
/// it takes.
fn clap_reason(e: &clap::Error) -> String {
    use std::error::Error as _;
    let text = e.to_string();
    match (e.source(), text.split_once("[possible values: ")) {
        (Some(source), _) => source.to_string(),
        (None, Some((_, values))) => {
            format!("expected one of {}", values.split(']').next().unwrap_or_default())
        }
        (None, None) => text
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("error: ")
            .to_owned(),
    }
}

/// A key a sink table sets: its values as text, where it stands.
pub(crate) type TableEntry = (&'static str, Vec<String>, Range<usize>);

impl RelayFile {
    /// Whether the file has sink tables (the relay then runs a router).
    pub(crate) fn routes(&self) -> bool {
        self.default.is_some() || !self.routes.is_empty()
    }

    /// The `[ordering]` table, checked.
    pub(crate) fn ordering(&self) -> Result<Vec<(String, OrderMode)>, ConfigError> {
        self.ordering
            .iter()
            .map(|(aggregate_type, mode)| match mode.get_ref().as_str() {
                "partition" => Ok((aggregate_type.clone(), OrderMode::Partition)),
                "strict" => Ok((aggregate_type.clone(), OrderMode::Strict)),
                other => Err(ConfigError(format!(
                    "--config [ordering] {aggregate_type} = {other:?}: expected \"partition\" or \"strict\""
                ))),
            })
            .collect()
    }

    /// The router the file describes. `sink` (the effective `--sink`) is
    /// the default route when there is no `[default]`; `flags` are the
    /// options of keys a table leaves out.
    pub(crate) fn router(self, sink: Option<&str>, flags: &SinkOptions) -> anyhow::Result<Router> {
        let default = match (self.default, sink) {
            (Some(table), _) => table.build("[default]", flags)?,
            (None, Some(url)) => sink::from_url(url, flags)?,
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
        let mut router = Router::new(default);
        for (aggregate_type, table) in self.routes {
            let sink = table.build(&format!("[routes.{aggregate_type}]"), flags)?;
            router = router.route(aggregate_type, sink);
        }
        Ok(router)
    }

    /// Each sink table by its header (`[default]`, `[routes.orders]`): the
    /// keys it sets, their values as text and where they stand.
    pub(crate) fn tables(&self) -> Vec<(String, Vec<TableEntry>)> {
        let named = self
            .default
            .iter()
            .map(|t| ("[default]".to_owned(), t))
            .chain(self.routes.iter().map(|(ty, t)| (format!("[routes.{ty}]"), t)));
        named.map(|(name, table)| (name, table.entries())).collect()
    }

    /// The `[ordering]` table: type, mode, where it stands.
    pub(crate) fn ordering_entries(&self) -> impl Iterator<Item = (&str, &str, Range<usize>)> {
        self.ordering
            .iter()
            .map(|(ty, mode)| (ty.as_str(), mode.get_ref().as_str(), mode.span()))
    }
}

impl SinkTable {
    /// The keys this table sets, in [`table_keys`] order, values as text
    /// (a table of properties as `KEY=VALUE` each).
    fn entries(&self) -> Vec<TableEntry> {
        let shared = [
            ("sink", Some(&self.sink)),
            ("format", self.format.as_ref()),
            ("cloudevents_mode", self.cloudevents_mode.as_ref()),
            ("cloudevents_source", self.cloudevents_source.as_ref()),
            ("http_timeout", self.http_timeout.as_ref()),
        ];
        table_keys()
            .iter()
            .filter_map(|&key| {
                let span = self.spans.get(key)?.clone();
                let text = match shared.iter().find(|(k, _)| *k == key) {
                    Some((_, value)) => vec![(*value)?.clone()],
                    None => match self.per_sink.get(key)? {
                        serde_json::Value::String(s) => vec![s.clone()],
                        serde_json::Value::Object(properties) => properties
                            .iter()
                            .map(|(k, v)| match v.as_str() {
                                Some(v) => format!("{k}={v}"),
                                None => format!("{k}={v}"),
                            })
                            .collect(),
                        other => vec![other.to_string()],
                    },
                };
                Some((key, text, span))
            })
            .collect()
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
    fn top_level_keys_are_settings_and_ordering_is_either() {
        let file = parse(
            "batch_size = 50\nordering = \"strict\"\nsink = \"redis://x\"\n\n[routes.orders]\nsink = \"redis://y\"\n",
        )
        .unwrap();
        assert_eq!(
            file.settings.keys().copied().collect::<Vec<_>>(),
            ["batch_size", "ordering", "sink"]
        );
        assert!(file.ordering.is_empty());
        let text = "sink = \"redis://x\"\n[ordering]\norders = \"strict\"\n";
        let file = parse(text).unwrap();
        assert!(!file.settings.contains_key("ordering"));
        assert_eq!(line_of(text, &file.ordering["orders"].span()), 3);
        // Every relay flag is a key, but not --config or --log-format.
        let keys = setting_keys();
        for key in [
            "batch_size",
            "database_url",
            "schema",
            "max_attempts",
            "kafka_options",
            "http_secret",
        ] {
            assert!(keys.contains(&key), "{key} in {keys:?}");
        }
        assert!(!keys.contains(&"config") && !keys.contains(&"log_format"));
        let e = parse("batch_size = 5\nbatchsize = 5\n").unwrap_err();
        assert!(
            e.message()
                .starts_with("unknown field `batchsize`, expected one of `sink`, `batch_size`"),
            "{e}"
        );
        assert_eq!(line_of("batch_size = 5\nbatchsize = 5\n", &e.span().unwrap()), 2);
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
    }
}
