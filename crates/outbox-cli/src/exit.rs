//! Exit codes and how errors are printed.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success, including a clean drain after SIGINT/SIGTERM |
//! | 1 | runtime failure: PostgreSQL unreachable until `--connect-timeout`, a statement failed; `relay --drain` made a dead letter or stopped at an unavailable sink; a `dlq` selector matched nothing; a replay's sink refused an event, or its job runs elsewhere |
//! | 2 | usage or configuration: bad flag, URL, TLS file, identifier, duration, schema not migrated or too new; PostgreSQL refused the login, the database or the certificate; log tailing not possible (`wal_level`, `REPLICATION`, no slot) or its slot invalidated; a transaction-mode pooler in front of a relay not run with `--pooler transaction`, or what that setting cannot do (`--source wal`, `--retention`) |
//!
//! Errors print as `error: …` followed by one `caused by: …` line per source,
//! or with `--log-format json` as one JSON line shaped like the log lines:
//! `{"timestamp":…,"level":"ERROR","fields":{"message":"…","causes":["…"],"exit_code":2},"target":"outbox"}`.
//! clap's own usage errors (exit 2) stay text: they happen before the format
//! is known.

use std::io::Write;
use std::process::ExitCode;
use std::time::SystemTime;

use outbox_relay::pg::{ConnectError, UrlError};
use outbox_relay::{RelayError, SinkError};

use crate::logging::LogFormat;

/// A configuration mistake found by the CLI itself (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ConfigError(pub(crate) String);

/// Whether anything in the chain is a configuration error.
fn is_config(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<ConfigError>()
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
        LogFormat::Json => writeln!(stderr, "{}", json(e, code, SystemTime::now())),
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

/// The error as one line in tracing's JSON shape, keys in its order, so a
/// log pipeline parses it like every line before it: `message` is the
/// outermost error, `causes` its sources outermost first, `exit_code` the
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

fn json(e: &anyhow::Error, code: u8, now: SystemTime) -> String {
    let line = JsonError {
        // The format of tracing-subscriber's timestamps.
        timestamp: humantime::format_rfc3339_micros(now).to_string(),
        level: "ERROR",
        fields: JsonFields {
            message: e.to_string(),
            causes: e.chain().skip(1).map(ToString::to_string).collect(),
            exit_code: code,
        },
        target: "outbox",
    };
    serde_json::to_string(&line).expect("strings and numbers always serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_keeps_the_chain_and_the_code() {
        let e = anyhow::Error::new(ConfigError("unknown scheme \"nope\"".into())).context("opening the sink");
        let line = json(&e, 2, SystemTime::UNIX_EPOCH);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with(r#"{"timestamp":"1970-01-01T00:00:00.000000Z","level":"ERROR","fields":{"message":"opening the sink""#), "{line}");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["timestamp"], "1970-01-01T00:00:00.000000Z");
        assert_eq!(v["level"], "ERROR");
        assert_eq!(v["fields"]["message"], "opening the sink");
        assert_eq!(
            v["fields"]["causes"],
            serde_json::json!(["unknown scheme \"nope\""])
        );
        assert_eq!(v["fields"]["exit_code"], 2);
    }
}
