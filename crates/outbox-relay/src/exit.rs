//! How a binary built on this library (`outbox`, `outbox-lab`) ends on an
//! error: whether the error is a configuration mistake (exit code 2) or a
//! runtime failure (1), and the error printed as text (`error: …`, then one
//! `caused by: …` line per source) or as one JSON line shaped like the log
//! lines. Each binary adds its own configuration error type and its own
//! exit-code table; the error is taken as its source chain, so this crate
//! needs no `anyhow` (an `anyhow::Error` gives it with `as_ref()`).

use std::error::Error;
use std::io::Write;
use std::time::SystemTime;

use tokio_postgres::error::DbError;

use crate::pg::{ConnectError, UrlError};
use crate::{RelayError, SinkError};

/// `root` and its sources, outermost first.
fn chain<'a>(root: &'a (dyn Error + 'static)) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    std::iter::successors(Some(root), |e: &&'a (dyn Error + 'static)| (*e).source())
}

/// Whether anything in the chain is one of this library's (and `outbox`'s)
/// configuration errors: a sink URL, a database URL, a login or
/// certificate PostgreSQL refused, a schema or setting the relay cannot
/// run with.
pub fn is_config(root: &(dyn Error + 'static)) -> bool {
    chain(root).any(|cause| {
        cause.is::<SinkError>()
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

/// The sources of `root`, outermost first, as text. tokio-postgres
/// displays an error the server answered as a bare `db error` whose source
/// is the server's `DbError`: that link is left out, and the `DbError`
/// is given in the server's words with its SQLSTATE.
fn causes(root: &(dyn Error + 'static)) -> Vec<String> {
    chain(root)
        .skip(1)
        .filter(|cause| {
            !(cause.to_string() == "db error" && cause.source().is_some_and(|s| s.is::<DbError>()))
        })
        .map(|cause| match cause.downcast_ref::<DbError>() {
            Some(db) => crate::error::db_message(db),
            None => cause.to_string(),
        })
        .collect()
}

/// `error: …`, then `caused by: …` per source.
pub fn write_human(out: &mut impl Write, root: &(dyn Error + 'static)) -> std::io::Result<()> {
    writeln!(out, "error: {root}")?;
    for cause in causes(root) {
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

/// [`JsonError`] for `root`, logged by `target` (the binary) at `now`.
pub fn json_line(root: &(dyn Error + 'static), code: u8, target: &'static str, now: SystemTime) -> String {
    let line = JsonError {
        // The format of tracing-subscriber's timestamps.
        timestamp: humantime::format_rfc3339_micros(now).to_string(),
        level: "ERROR",
        fields: JsonFields {
            message: root.to_string(),
            causes: causes(root),
            exit_code: code,
        },
        target,
    };
    serde_json::to_string(&line).expect("strings and numbers always serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message with a source, as `anyhow`'s context makes.
    #[derive(Debug, thiserror::Error)]
    #[error("opening the sink")]
    struct Opening(#[source] SinkError);

    #[test]
    fn json_keeps_the_chain_and_the_code() {
        let e = Opening(SinkError::InvalidUrl {
            url: "nope".into(),
            reason: "no scheme".into(),
        });
        let line = json_line(&e, 2, "outbox", SystemTime::UNIX_EPOCH);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with(r#"{"timestamp":"1970-01-01T00:00:00.000000Z","level":"ERROR","fields":{"message":"opening the sink""#), "{line}");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["timestamp"], "1970-01-01T00:00:00.000000Z");
        assert_eq!(v["level"], "ERROR");
        assert_eq!(v["fields"]["message"], "opening the sink");
        assert_eq!(
            v["fields"]["causes"],
            serde_json::json!(["invalid sink URL \"nope\": no scheme"])
        );
        assert_eq!(v["fields"]["exit_code"], 2);
        assert_eq!(v["target"], "outbox");
        assert!(
            is_config(&e),
            "a sink's configuration error anywhere in the chain"
        );
    }
}
