//! Exit codes and how errors are printed.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success, including a clean drain after SIGINT/SIGTERM |
//! | 1 | runtime failure: PostgreSQL unreachable until `--connect-timeout`, a statement failed; `relay --drain` made a dead letter, stopped at an unavailable sink, or was refused its lease tick or claim; `relay --check` found a service unreachable; a `dlq` selector matched nothing; a replay's sink refused an event, or its job runs elsewhere |
//! | 2 | usage or configuration: bad flag, URL, TLS file, identifier, duration, schema not migrated or too new; the role lacks a privilege (named, with the `outbox migrate --grant` that fixes it; SQLSTATE 42501 at startup); `relay --check` found such a problem; PostgreSQL refused the login, the database or the certificate; log tailing not possible (`wal_level`, `REPLICATION`, no slot) or its slot invalidated; a transaction-mode pooler in front of a relay not run with `--pooler transaction`, or what that setting cannot do (`--source wal`, `--retention`); an `--outbox` name the fleet does not have, or `--all` on a command that changes rows |
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

/// Ends the process on a usage error from clap. A bad value that came
/// from an environment variable is named as that variable: clap names the
/// flag, which is nowhere in a unit file or manifest that set
/// `OUTBOX_BATCH_SIZE=abc`.
pub(crate) fn usage(e: clap::Error, command: &clap::Command) -> ! {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if matches!(e.kind(), ErrorKind::InvalidValue | ErrorKind::ValueValidation) {
        let text = |kind| match e.get(kind) {
            Some(ContextValue::String(s)) => Some(s.clone()),
            _ => None,
        };
        if let (Some(flag), Some(value)) = (text(ContextKind::InvalidArg), text(ContextKind::InvalidValue)) {
            // "--batch-size <N>" → "batch-size".
            let long = flag
                .trim_start_matches('-')
                .split([' ', '='])
                .next()
                .unwrap_or_default();
            if let Some(var) = from_environment(command, long, &value) {
                let why = std::error::Error::source(&e)
                    .map(|s| format!(": {s}"))
                    .unwrap_or_default();
                eprintln!("error: invalid value '{value}' in the environment variable {var} (--{long}){why}");
                std::process::exit(2);
            }
        }
    }
    e.exit()
}

/// The variable of the flag `--long` (in any subcommand) if it holds
/// `value` and the command line does not give the flag.
fn from_environment(command: &clap::Command, long: &str, value: &str) -> Option<String> {
    let on_command_line =
        std::env::args().any(|a| a == format!("--{long}") || a.starts_with(&format!("--{long}=")));
    if on_command_line {
        return None;
    }
    let mut stack = vec![command];
    while let Some(c) = stack.pop() {
        for arg in c.get_arguments().filter(|a| a.get_long() == Some(long)) {
            let var = arg.get_env()?;
            if std::env::var_os(var).is_some_and(|v| v == value) {
                return Some(var.to_string_lossy().into_owned());
            }
        }
        stack.extend(c.get_subcommands());
    }
    None
}
