//! The command line with the file layered under flags and environment:
//! where each setting came from, and clap kept the one parser.
//!
//! Owns [`Layered`] and [`Origin`]: the file's top-level values are handed
//! to clap as extra flags, each checked alone by its own flag's value
//! parser, only for settings clap's `ValueSource` says neither the command
//! line nor the environment gave. It does not read the file (`file.rs`)
//! nor build sinks (`router.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory, FromArgMatches};

use super::file::{ConfigFile, setting_keys};
use crate::cli::{Cli, Command, ConfigCommand, Global, RelayArgs};
use crate::exit::ConfigError;

/// Where an effective setting came from, highest precedence first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The command line.
    Flag,
    /// This environment variable.
    Env(String),
    /// The file, at `path:line`.
    File(String),
    /// Nobody set it.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag => f.write_str("flag"),
            Origin::Env(var) => write!(f, "env {var}"),
            Origin::File(at) => write!(f, "file {at}"),
            Origin::Default => f.write_str("default"),
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
    sources: BTreeMap<&'static str, Origin>,
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
        Self::parse_for(argv, None)
    }

    /// [`Layered::parse`] for the outbox `outbox` of the file's
    /// `[outboxes.NAME]` tables: the keys its table sets win over flags,
    /// environment and the file's top-level keys (it is the most specific
    /// place a setting can be given); the others layer as usual.
    pub(crate) fn parse_for(
        argv: impl IntoIterator<Item = OsString>,
        outbox: Option<&str>,
    ) -> anyhow::Result<Self> {
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
            let own =
                outbox.and_then(|name| Some((file.as_ref()?, file.as_ref()?.body().own_setting(name, key)?)));
            if let Some((file, value)) = own {
                let at = file.at(&value.span());
                let args = file_args(arg, value.get_ref()).map_err(|e| {
                    ConfigError(format!("--config {at}: {key} = {}: {e}", shown(value.get_ref())))
                })?;
                extra.extend(args.into_iter().map(OsString::from));
                sources.insert(key, Origin::File(at));
                continue;
            }
            let source = match matches.value_source(key) {
                Some(ValueSource::CommandLine) => Origin::Flag,
                Some(ValueSource::EnvVariable) => Origin::Env(
                    arg.get_env()
                        .map(|var| var.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                ),
                _ => match file.as_ref().and_then(|f| Some((f, f.body().settings.get(key)?))) {
                    Some((file, value)) => {
                        let at = file.at(&value.span());
                        let args = file_args(arg, value.get_ref()).map_err(|e| {
                            ConfigError(format!("--config {at}: {key} = {}: {e}", shown(value.get_ref())))
                        })?;
                        extra.extend(args.into_iter().map(OsString::from));
                        Origin::File(at)
                    }
                    None => Origin::Default,
                },
            };
            sources.insert(key, source);
        }
        match matches.value_source("config") {
            Some(ValueSource::CommandLine) => sources.insert("config", Origin::Flag),
            Some(ValueSource::EnvVariable) => {
                sources.insert("config", Origin::Env("OUTBOX_CONFIG".to_owned()))
            }
            _ => None,
        };
        // An outbox's own keys come last and override the command line's
        // (a repeated flag: the last wins).
        let layered = if outbox.is_some() {
            overriding(command.clone())
        } else {
            command.clone()
        };
        let layered = layered
            .try_get_matches_from(argv.into_iter().chain(extra))
            .map_err(|e| ConfigError(e.to_string()))?;
        let cli = Cli::from_arg_matches(&layered).map_err(|e| ConfigError(e.to_string()))?;
        if let Some(Origin::File(at)) = sources.get("database_url") {
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
    pub(crate) fn source(&self, key: &str) -> Origin {
        self.sources.get(key).cloned().unwrap_or(Origin::Default)
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

/// `command` with every argument of it and of its subcommands taking its
/// last occurrence instead of refusing a repeat.
fn overriding(command: clap::Command) -> clap::Command {
    let names: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_owned())
        .collect();
    names
        .iter()
        .fold(command.args_override_self(true), |command, name| {
            command.mut_subcommand(name, overriding)
        })
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
