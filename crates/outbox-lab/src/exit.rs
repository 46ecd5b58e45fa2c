//! Exit codes and how errors are printed.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success: every lab verdict, soak check and demo count holds; the bench lost and repeated nothing |
//! | 1 | runtime failure (a server would not start, PostgreSQL unreachable until `--connect-timeout`, a child process failed), or a check that found a problem: a failed lab verdict, a soak check, the demo's counts |
//! | 2 | usage or configuration: bad flag or URL, an unknown experiment, a sink that is not Redis, the soak on a `DATABASE_URL` without `--i-own-this-server`, no `outbox` binary (`OUTBOX_BIN`); PostgreSQL refused the login or the database |
//!
//! Errors print as `error: …` followed by one `caused by: …` line per
//! source, or with `--log-format json` as one JSON line shaped like the log
//! lines, as the `outbox` binary prints them. clap's own usage errors (exit
//! 2) stay text.

use std::io::Write;
use std::process::ExitCode;

use outbox_relay::pg::{ConnectError, UrlError};
use outbox_relay::{RelayError, SinkError};

use crate::cli::LogFormat;

/// Whether anything in the chain is a configuration error.
fn is_config(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<outbox_lab::ConfigError>()
            || cause.is::<SinkError>()
            || cause.is::<UrlError>()
            || cause
                .downcast_ref::<ConnectError>()
                .is_some_and(ConnectError::is_permanent)
            || cause
                .downcast_ref::<outbox::Error>()
                .is_some_and(outbox::Error::is_config)
            || cause
                .downcast_ref::<RelayError>()
                .is_some_and(RelayError::is_config)
    })
}

/// Prints the error chain to stderr in the log format and picks the exit
/// code.
pub(crate) fn report(e: &anyhow::Error, format: LogFormat) -> ExitCode {
    let code = if is_config(e) { 2 } else { 1 };
    let mut stderr = std::io::stderr().lock();
    // Nothing is left to tell if stderr itself is gone.
    let _ = match format {
        LogFormat::Human => write_human(&mut stderr, e),
        LogFormat::Json => writeln!(stderr, "{}", json(e, code)),
    };
    ExitCode::from(code)
}

fn write_human(out: &mut impl Write, e: &anyhow::Error) -> std::io::Result<()> {
    writeln!(out, "error: {e}")?;
    for cause in e.chain().skip(1) {
        writeln!(out, "caused by: {cause}")?;
    }
    Ok(())
}

/// The error as one line in tracing's JSON shape, keys in its order:
/// `message` the outermost error, `causes` its sources, `exit_code` the
/// process's.
#[derive(serde::Serialize)]
struct JsonError {
    timestamp: String,
    level: &'static str,
    fields: JsonFields,
    target: &'static str,
}

#[derive(serde::Serialize)]
struct JsonFields {
    message: String,
    causes: Vec<String>,
    exit_code: u8,
}

fn json(e: &anyhow::Error, code: u8) -> String {
    let line = JsonError {
        // The format of tracing-subscriber's timestamps.
        timestamp: humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
        level: "ERROR",
        fields: JsonFields {
            message: e.to_string(),
            causes: e.chain().skip(1).map(ToString::to_string).collect(),
            exit_code: code,
        },
        target: "outbox_lab",
    };
    serde_json::to_string(&line).expect("strings and numbers always serialize")
}
