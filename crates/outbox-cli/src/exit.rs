//! Exit codes and how errors are printed.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success, including a clean drain after SIGINT/SIGTERM |
//! | 1 | runtime failure: PostgreSQL unreachable until `--connect-timeout`, a statement failed; `relay --drain` made a dead letter, stopped at an unavailable sink, or was refused its lease tick or claim; `relay --check` found a service unreachable; a `dlq` selector matched nothing; a replay's sink refused an event, or its job runs elsewhere |
//! | 2 | usage or configuration: bad flag, URL, TLS file, identifier, duration, schema not migrated or too new; the role lacks a privilege (named, with the `outbox migrate --grant` that fixes it; SQLSTATE 42501 at startup); `relay --check` found such a problem; PostgreSQL refused the login, the database or the certificate; log tailing not possible (`wal_level`, `REPLICATION`, no slot) or its slot invalidated; a transaction-mode pooler in front of a relay not run with `--pooler transaction`, or what that setting cannot do (`--source wal`, `--retention`) |
//!
//! Errors print as `error: …` followed by one `caused by: …` line per source,
//! or with `--log-format json` as one JSON line shaped like the log lines:
//! `{"timestamp":…,"level":"ERROR","fields":{"message":"…","causes":["…"],"exit_code":2},"target":"outbox"}`.
//! clap's own usage errors (exit 2) stay text: they happen before the format
//! is known.

use std::io::Write;
use std::process::ExitCode;
use std::time::SystemTime;

use crate::logging::LogFormat;

/// A configuration mistake found by the CLI itself (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ConfigError(pub(crate) String);

/// Whether anything in the chain is a configuration error: this binary's
/// own, or the library's ([`outbox_relay::exit::is_config`]).
fn is_config(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| cause.is::<ConfigError>()) || outbox_relay::exit::is_config(e.as_ref())
}

/// PostgreSQL refused a statement for a privilege (SQLSTATE 42501) that no
/// startup check named (those print their own fix).
fn denied_unnamed(e: &anyhow::Error) -> bool {
    let named = e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<outbox::Error>(),
            Some(outbox::Error::MissingPrivileges { .. })
        )
    });
    !named
        && e.chain().any(|cause| {
            cause
                .downcast_ref::<outbox::Error>()
                .is_some_and(outbox::Error::is_permission_denied)
        })
}

/// Prints the error chain to stderr in the log format and picks the exit
/// code.
pub(crate) fn report(e: &anyhow::Error, format: LogFormat) -> ExitCode {
    let code = if is_config(e) { 2 } else { 1 };
    let mut stderr = std::io::stderr().lock();
    // Nothing is left to tell if stderr itself is gone.
    let _ = match format {
        LogFormat::Human => outbox_relay::exit::write_human(&mut stderr, e.as_ref()).and_then(|()| {
            if denied_unnamed(e) {
                writeln!(
                    stderr,
                    "fix: grant the role what this command needs: outbox migrate --grant ROLE --as KIND, as \
                     the table's owner (docs/privileges.md)"
                )
            } else {
                Ok(())
            }
        }),
        LogFormat::Json => writeln!(
            stderr,
            "{}",
            outbox_relay::exit::json_line(e.as_ref(), code, "outbox", SystemTime::now())
        ),
    };
    ExitCode::from(code)
}
