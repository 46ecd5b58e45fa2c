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
use std::time::SystemTime;

use crate::cli::LogFormat;

/// Whether anything in the chain is a configuration error: this binary's
/// own, or the library's ([`outbox_relay::exit::is_config`]).
fn is_config(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| cause.is::<outbox_lab::ConfigError>()) || outbox_relay::exit::is_config(e.as_ref())
}

/// Prints the error chain to stderr in the log format and picks the exit
/// code.
pub(crate) fn report(e: &anyhow::Error, format: LogFormat) -> ExitCode {
    let code = if is_config(e) { 2 } else { 1 };
    let mut stderr = std::io::stderr().lock();
    // Nothing is left to tell if stderr itself is gone.
    let _ = match format {
        LogFormat::Human => outbox_relay::exit::write_human(&mut stderr, e.as_ref()),
        LogFormat::Json => writeln!(
            stderr,
            "{}",
            outbox_relay::exit::json_line(e.as_ref(), code, "outbox_lab", SystemTime::now())
        ),
    };
    ExitCode::from(code)
}
