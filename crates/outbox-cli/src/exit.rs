//! Exit codes and how errors are printed.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success, including a clean drain after SIGINT/SIGTERM |
//! | 1 | runtime failure: PostgreSQL unreachable until `--connect-timeout`, a statement failed; `relay --drain` made a dead letter or stopped at an unavailable sink; a `dlq` selector matched nothing |
//! | 2 | usage or configuration: bad flag, URL, TLS file, identifier, duration, schema not migrated or too new; PostgreSQL refused the login, the database or the certificate |
//!
//! Errors print as `error: …` followed by one `caused by: …` line per source.

use std::process::ExitCode;

use outbox_relay::pg::{ConnectError, UrlError};
use outbox_relay::{RelayError, SinkError};

/// A configuration mistake found by the CLI itself (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ConfigError(pub(crate) String);

/// Whether anything in the chain is a configuration error.
fn is_config(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<ConfigError>()
            || cause.is::<outbox_lab::ConfigError>()
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

/// Prints the error chain to stderr and picks the exit code.
pub(crate) fn report(e: &anyhow::Error) -> ExitCode {
    eprintln!("error: {e}");
    for cause in e.chain().skip(1) {
        eprintln!("caused by: {cause}");
    }
    if is_config(e) {
        ExitCode::from(2)
    } else {
        ExitCode::from(1)
    }
}
