//! The configuration file's shape and how it is read: its keys, their
//! deserialisation, and the lines they stand on.
//!
//! Owns [`RelayFile`] and its sink tables ([`SinkTable`]), the lists of
//! keys each takes (derived from the relay's flags and from
//! [`PerSinkOptions`], never spelled twice), and [`ConfigFile`], the text
//! read from disk kept beside it so every message can name `path:line`.
//! It does not layer the settings under flags and environment
//! (`layered.rs`) nor build sinks from the tables (`router.rs`).
//!
//! Invariant: a file that reads has only known keys, and each sink key's
//! value was accepted by its declaration where it stands.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use clap::CommandFactory;
use outbox_relay::sink::DEFAULT_ROUTE;
use outbox_relay::{OrderMode, PerSinkOptions};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::cli::Cli;
use crate::exit::ConfigError;

/// The whole file.
#[derive(Debug, Default)]
pub(crate) struct RelayFile {
    /// The top-level keys: a relay flag's id → its value, where it stands.
    pub(super) settings: BTreeMap<&'static str, Spanned<toml::Value>>,
    /// Where every aggregate type no route names goes, over the top-level
    /// `sink` and sink keys.
    pub(super) default: Option<SinkTable>,
    /// Aggregate type → its sink.
    pub(super) routes: BTreeMap<String, SinkTable>,
    /// Aggregate type → `partition` or `strict`: the `[ordering]` table,
    /// over `ordering_for`.
    ordering: BTreeMap<String, Spanned<String>>,
    /// `[outboxes.NAME]`: an outbox a fleet serves by name, and the
    /// settings it takes over the top-level ones (any top-level key:
    /// `schema`, `table`, `database_url`, `sink`, `batch_size`, …).
    pub(super) outboxes: BTreeMap<String, Spanned<Settings>>,
}

/// The settings of an `[outboxes.NAME]` table: top-level keys only.
#[derive(Debug, Default, Clone)]
pub(crate) struct Settings(pub(super) BTreeMap<&'static str, Spanned<toml::Value>>);

impl<'de> Deserialize<'de> for Settings {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct SettingsVisitor;

        impl<'de> Visitor<'de> for SettingsVisitor {
            type Value = Settings;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a table of relay settings")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Settings, A::Error> {
                let mut settings = BTreeMap::new();
                while let Some(key) = map.next_key_seed(Key(setting_keys()))? {
                    settings.insert(key, map.next_value()?);
                }
                Ok(Settings(settings))
            }
        }
        d.deserialize_map(SettingsVisitor)
    }
}

/// Flags that are no keys: `config` names the file; logging starts before
/// the file is read; `check` is what to do, not how to run.
const NOT_KEYS: [&str; 5] = ["config", "log_format", "help", "version", "check"];

/// The tables of the file, beside the settings.
const TABLES: [&str; 4] = ["default", "routes", "ordering", "outboxes"];

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
pub(super) struct SinkTable {
    pub(super) sink: String,
    /// The route's name in metrics, logs and readiness checks, over the
    /// table's aggregate type (`default` for `[default]`).
    pub(super) name: Option<String>,
    pub(super) format: Option<String>,
    pub(super) cloudevents_mode: Option<String>,
    pub(super) cloudevents_source: Option<String>,
    pub(super) http_timeout: Option<String>,
    /// How the route's batches are claimed (`lock` or `deadline`; `lease` is its old name), over
    /// `--claim`.
    pub(super) claim: Option<String>,
    /// How long the route's events are retried, over `--retry-for`.
    pub(super) retry_for: Option<String>,
    /// The [`PerSinkOptions`] keys the table sets.
    pub(super) per_sink: serde_json::Map<String, serde_json::Value>,
    /// Where each key the table sets stands in the file.
    spans: BTreeMap<&'static str, Range<usize>>,
}

/// The keys of a sink table other than [`PerSinkOptions`]'s and `name`.
const SHARED_KEYS: [&str; 7] = [
    "sink",
    "format",
    "cloudevents_mode",
    "cloudevents_source",
    "claim",
    "retry_for",
    "http_timeout",
];

/// Every sink key a table takes, each also a relay setting, in the order
/// `config show` lists them: `sink`, the envelope's, each sink's own,
/// `http_timeout`.
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

/// Every key a sink table takes, in the order an unknown-key message lists
/// them: [`table_keys`] with the route's `name` after `sink` (a key of the
/// table alone, no relay setting).
fn read_keys() -> &'static [&'static str] {
    static KEYS: OnceLock<&'static [&'static str]> = OnceLock::new();
    KEYS.get_or_init(|| {
        let (sink, rest) = table_keys().split_first().expect("not empty");
        let keys: Vec<&'static str> = [*sink, "name"].into_iter().chain(rest.iter().copied()).collect();
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
                "outboxes" => file.outboxes = map.next_value()?,
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
        d.deserialize_struct("SinkTable", read_keys(), TableVisitor)
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
            name: None,
            format: None,
            cloudevents_mode: None,
            cloudevents_source: None,
            http_timeout: None,
            claim: None,
            retry_for: None,
            per_sink: serde_json::Map::new(),
            spans: BTreeMap::new(),
        };
        while let Some(key) = map.next_key_seed(Key(read_keys()))? {
            let mut string = |map: &mut A| -> Result<Option<String>, A::Error> {
                let value: Spanned<String> = map.next_value()?;
                table.spans.insert(key, value.span());
                Ok(Some(value.into_inner()))
            };
            match key {
                "sink" => sink = string(&mut map)?,
                "name" => table.name = string(&mut map)?,
                "format" => table.format = string(&mut map)?,
                "cloudevents_mode" => table.cloudevents_mode = string(&mut map)?,
                "cloudevents_source" => table.cloudevents_source = string(&mut map)?,
                "http_timeout" => table.http_timeout = string(&mut map)?,
                "claim" => table.claim = string(&mut map)?,
                "retry_for" => table.retry_for = string(&mut map)?,
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
        let body = toml::from_str(&text).map_err(|e: toml::de::Error| {
            let message = suggest(e.message().trim_end());
            match e.span() {
                Some(span) => ConfigError(format!(
                    "--config {}:{}: {message}",
                    path.display(),
                    line_of(&text, &span)
                )),
                None => ConfigError(format!("--config {}: {message}", path.display())),
            }
        })?;
        let file = Self {
            path: path.to_owned(),
            text,
            body,
        };
        file.check_route_names()?;
        file.check_sinks()?;
        Ok(file)
    }

    /// Each table's sink is one this build has, and sets only its own
    /// keys (and the shared ones): `stream_prefix` in a table whose sink
    /// is `http://…` would otherwise be ignored without a word. Checked
    /// here, where the line of each key is known.
    fn check_sinks(&self) -> Result<(), ConfigError> {
        let defaults = PerSinkOptions::default();
        let owners: Vec<(&[&str], Vec<String>)> = vec![
            (&["redis", "rediss"], keys_of(&defaults.redis)),
            (&["http", "https"], keys_of(&defaults.http)),
            (&["nats"], keys_of(&defaults.nats)),
            (&["amqp", "amqps"], keys_of(&defaults.amqp)),
            #[cfg(feature = "kafka")]
            (&["kafka"], keys_of(&defaults.kafka)),
        ];
        let tables = self
            .body
            .default
            .iter()
            .map(|t| ("[default]".to_owned(), t))
            .chain(
                self.body
                    .routes
                    .iter()
                    .map(|(ty, t)| (format!("[routes.{ty}]"), t)),
            );
        for (header, table) in tables {
            let at = |key: &str| match table.spans.get(key) {
                Some(span) => self.at(span),
                None => self.path.display().to_string(),
            };
            let Some((scheme, _)) = table.sink.split_once("://") else {
                continue; // not a URL: the sink's own parser says why, below
            };
            if !outbox_relay::sink::schemes().any(|known| known == scheme) {
                let known: Vec<&str> = outbox_relay::sink::schemes().collect();
                return Err(ConfigError(format!(
                    "--config {}: {header} sink: unknown sink scheme {scheme:?} (known: {})",
                    at("sink"),
                    known.join(", ")
                )));
            }
            for key in table.per_sink.keys() {
                let Some((schemes, _)) = owners.iter().find(|(_, keys)| keys.contains(key)) else {
                    continue;
                };
                if !schemes.contains(&scheme) {
                    return Err(ConfigError(format!(
                        "--config {}: {header} {key}: a key of the {} sink, but this table's sink is {scheme}://…; \
                         remove it, or move it to a table whose sink is {}://…",
                        at(key),
                        schemes[0],
                        schemes[0]
                    )));
                }
            }
        }
        Ok(())
    }

    /// Every route has a name of its own: they tell routes apart in
    /// metrics, logs and readiness checks.
    fn check_route_names(&self) -> Result<(), ConfigError> {
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        // The fallback route exists whether or not `[default]` is written.
        let default = self.body.default.as_ref();
        let tables = std::iter::once(("[default]".to_owned(), default, DEFAULT_ROUTE.to_owned())).chain(
            self.body
                .routes
                .iter()
                .map(|(ty, t)| (format!("[routes.{ty}]"), Some(t), ty.clone())),
        );
        for (header, table, fallback) in tables {
            let name = table.and_then(|t| t.name.clone()).unwrap_or(fallback);
            let at = || match table.and_then(|t| t.spans.get("name")) {
                Some(span) => self.at(span),
                None => self.path.display().to_string(),
            };
            if name.is_empty() {
                return Err(ConfigError(format!(
                    "--config {}: {header} name = \"\": a route's name cannot be empty",
                    at()
                )));
            }
            if let Some(other) = seen.insert(name.clone(), header.clone()) {
                return Err(ConfigError(format!(
                    "--config {}: {header} and {other} are both routes named {name:?}; give one of them \
                     name = \"…\" (routes are told apart by name in metrics and logs)",
                    at()
                )));
            }
        }
        Ok(())
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

/// serde's message for an unknown key lists every key the table takes (40
/// and more at the top level); the key meant is nearly always one edit or
/// two away, so name that one instead, and the page that lists them all.
fn suggest(message: &str) -> String {
    let Some(rest) = message.strip_prefix("unknown field `") else {
        return message.to_owned();
    };
    let Some((key, known)) = rest.split_once("`, expected one of ") else {
        return message.to_owned();
    };
    let closest = known
        .split(", ")
        .map(|k| k.trim_matches('`'))
        // `subjekt` meant `nats_subject`: a key's words after its sink's
        // name count as well as the whole key.
        .map(|k| {
            let tail = k.split_once('_').map_or(k, |(_, t)| t);
            let distance = strsim::damerau_levenshtein(key, k).min(strsim::damerau_levenshtein(key, tail));
            (distance, k)
        })
        .min();
    match closest {
        Some((distance, k)) if distance <= 2.max(key.len() / 4) => {
            format!("unknown key `{key}`: did you mean `{k}`? (every key: docs/configuration.md)")
        }
        _ => format!("unknown key `{key}` (every key: docs/configuration.md)"),
    }
}

/// The 1-based line a span starts on.
fn line_of(text: &str, span: &Range<usize>) -> usize {
    let start = span.start.min(text.len());
    text.as_bytes()[..start].iter().filter(|b| **b == b'\n').count() + 1
}

/// A key a sink table sets: its values as text, where it stands.
pub(crate) type TableEntry = (&'static str, Vec<String>, Range<usize>);

impl RelayFile {
    /// The names of the `[outboxes.NAME]` tables.
    pub(crate) fn outbox_names(&self) -> Vec<String> {
        self.outboxes.keys().cloned().collect()
    }

    /// The keys `[outboxes.NAME]` sets: each value as the file spells it
    /// (URLs with their secrets masked), and where it stands.
    pub(crate) fn outbox_entries(&self, name: &str) -> Vec<(&'static str, String, Range<usize>)> {
        self.outboxes
            .get(name)
            .map(|table| {
                table
                    .get_ref()
                    .0
                    .iter()
                    .map(|(key, value)| {
                        let shown = match value.get_ref() {
                            toml::Value::String(s) if *key == "sink" || *key == "database_url" => {
                                outbox_relay::redact::url(s)
                            }
                            toml::Value::String(s) => s.clone(),
                            toml::Value::Integer(n) => n.to_string(),
                            toml::Value::Float(x) => x.to_string(),
                            toml::Value::Boolean(b) => b.to_string(),
                            other => serde_json::to_string(other).unwrap_or_default(),
                        };
                        (*key, shown, value.span())
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `key`'s value in `[outboxes.NAME]`, if that table sets it.
    pub(crate) fn own_setting(&self, name: &str, key: &str) -> Option<&Spanned<toml::Value>> {
        self.outboxes
            .get(name)
            .and_then(|table| table.get_ref().0.get(key))
    }

    /// Whether the file sets the top-level `key`.
    pub(crate) fn sets(&self, key: &str) -> bool {
        self.settings.contains_key(key)
    }

    /// Where `[outboxes.NAME]` stands, for messages.
    pub(crate) fn outbox_span(&self, name: &str) -> Option<std::ops::Range<usize>> {
        self.outboxes.get(name).map(Spanned::span)
    }

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
            ("claim", self.claim.as_ref()),
            ("retry_for", self.retry_for.as_ref()),
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
        // The same message as a derived `deny_unknown_fields` table's, at the key.
        let known = if cfg!(feature = "kafka") {
            "`sink`, `name`, `format`, `cloudevents_mode`, `cloudevents_source`, `claim`, `retry_for`, `stream_prefix`, \
             `nats_subject`, `amqp_exchange`, `amqp_routing_key`, `kafka_topic`, `kafka_options`, `http_secret`, \
             `http_concurrency`, `http_timeout`"
        } else {
            "`sink`, `name`, `format`, `cloudevents_mode`, `cloudevents_source`, `claim`, `retry_for`, `stream_prefix`, \
             `nats_subject`, `amqp_exchange`, `amqp_routing_key`, `http_secret`, `http_concurrency`, `http_timeout`"
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
    fn an_unknown_key_is_answered_with_the_closest_one() {
        let known = "`sink`, `batch_size`, `poll_interval`";
        assert_eq!(
            suggest(&format!("unknown field `batchsize`, expected one of {known}")),
            "unknown key `batchsize`: did you mean `batch_size`? (every key: docs/configuration.md)"
        );
        assert_eq!(
            suggest("unknown field `subjekt`, expected one of `sink`, `nats_subject`"),
            "unknown key `subjekt`: did you mean `nats_subject`? (every key: docs/configuration.md)"
        );
        assert_eq!(
            suggest(&format!("unknown field `colour`, expected one of {known}")),
            "unknown key `colour` (every key: docs/configuration.md)"
        );
        assert_eq!(
            suggest("invalid type: string \"a\", expected u16"),
            "invalid type: string \"a\", expected u16"
        );
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

    /// A route is named after its table (`default` for the fallback)
    /// unless it says otherwise, and no two routes share a name.
    #[test]
    fn each_route_has_a_name_of_its_own() {
        let read = |text: &str| {
            let path = std::env::temp_dir().join(format!("outbox-{}.toml", uuid::Uuid::new_v4().simple()));
            std::fs::write(&path, text).unwrap();
            let read = ConfigFile::read(&path);
            let _ = std::fs::remove_file(&path);
            read.map_err(|e| e.to_string())
        };
        let file = read(
            "[default]\nsink = \"redis://x\"\nname = \"fallback\"\n[routes.orders]\nsink = \"redis://y\"\n",
        )
        .unwrap();
        let body = file.body();
        assert_eq!(body.default.as_ref().unwrap().name.as_deref(), Some("fallback"));
        assert_eq!(body.routes["orders"].name, None, "named after its type");
        assert!(read("sink = \"redis://x\"\n[routes.default]\nsink = \"redis://y\"\nname = \"d\"\n").is_ok());
        // The fallback exists without a [default] table, named `default`.
        let e = read("sink = \"redis://x\"\n[routes.default]\nsink = \"redis://y\"\n").unwrap_err();
        assert!(
            e.contains(
                "[routes.default] and [default] are both routes named \"default\"; give one of them name = "
            ),
            "{e}"
        );
        let e = read(
            "sink = \"redis://x\"\n[routes.a]\nsink = \"redis://y\"\nname = \"n\"\n\n[routes.b]\nsink = \"redis://z\"\nname = \"n\"\n",
        )
        .unwrap_err();
        assert!(
            e.contains(".toml:8: [routes.b] and [routes.a] are both routes named \"n\""),
            "{e}"
        );
        let e = read("[default]\nsink = \"redis://x\"\nname = \"\"\n").unwrap_err();
        assert!(
            e.contains(".toml:3: [default] name = \"\": a route's name cannot be empty"),
            "{e}"
        );
    }
}
