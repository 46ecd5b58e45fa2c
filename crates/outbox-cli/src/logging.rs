//! Logging setup: human-readable lines by default, JSON with `--log-format json`.
//! `RUST_LOG` overrides the default filter.
//!
//! Both go to stderr. Human lines are coloured only for a person at a
//! terminal: never into a pipe, file or journal, and never with `NO_COLOR`
//! set (<https://no-color.org>). JSON is tracing's shape, one object a line:
//! `{"timestamp":…,"level":"INFO","fields":{"message":"relay ready",…},"target":…}`,
//! every field its display form (`"ordering":"partition"`, a bare UUID),
//! never Rust's debug syntax. The error that ends the process is printed in
//! the same format (see [`crate::exit`]).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// One readable line per event.
    Human,
    /// One JSON object per line, for log shippers.
    Json,
}

pub(crate) fn init(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Overrides tracing-subscriber's own NO_COLOR check, so it is
        // repeated in `colour`.
        .with_ansi(format == LogFormat::Human && colour());
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Whether stderr is a terminal and `NO_COLOR` is unset or empty.
fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
