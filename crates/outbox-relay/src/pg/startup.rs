//! What happens when a connection attempt fails: [`ConnectError`], whether
//! retrying may help (by SQLSTATE, or what rustls refused), and
//! [`Startup`], the retry loop's rules shared by [`connect`](super::connect)
//! and the relay's sessions. Not the attempt itself (`open` in the parent
//! module). The invariant: a failure retrying cannot fix ends startup at
//! once, and nothing retries past the connect timeout.

use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;
use tracing::warn;

use super::PgConfig;
use crate::backoff::{Doubling, RECONNECT_FIRST, RECONNECT_MAX};
use crate::error::error_chain;

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// A failure retrying cannot fix: the server refused the login or the
    /// database, or the TLS handshake failed (a certificate refused).
    #[error("connecting to postgres at {target}: {why} (not retried)")]
    Refused {
        /// Where (`host:port/dbname`).
        target: String,
        /// The failure in a few words (`authentication failed`).
        why: &'static str,
        /// The error, with the server's message.
        #[source]
        source: tokio_postgres::Error,
    },
    /// PostgreSQL was still unreachable when the connect timeout ran out.
    #[error("connecting to postgres at {target} (gave up after {timeout:?}, {attempts} attempts)")]
    GaveUp {
        /// Where (`host:port/dbname`).
        target: String,
        /// The connect timeout.
        timeout: Duration,
        /// How many attempts failed.
        attempts: u32,
        /// The last attempt's error.
        #[source]
        source: tokio_postgres::Error,
    },
}

impl ConnectError {
    /// True when retrying could not help: configuration, not availability
    /// (the CLI's exit code 2).
    pub fn is_permanent(&self) -> bool {
        matches!(self, ConnectError::Refused { .. })
    }

    /// The last error from tokio-postgres.
    pub fn postgres(&self) -> &tokio_postgres::Error {
        match self {
            ConnectError::Refused { source, .. } | ConnectError::GaveUp { source, .. } => source,
        }
    }
}

/// Whether retrying a failed connection attempt may help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// Not up yet, restarting, out of connection slots, a network error.
    Transient,
    /// Why it never will, in a few words.
    Permanent(&'static str),
}

/// Classifies a failed attempt. The server's own errors by SQLSTATE: it is
/// starting, stopping or full (57P03, 57P01, 57P02, 53300, other class 53
/// and 08) is transient, anything else it says is permanent (28000 and
/// 28P01 authentication, 3D000 no such database, 42501 no CONNECT
/// privilege). A certificate rustls refused, or a TLS alert from the
/// server, is permanent; other I/O errors (refused, reset, timed out) and
/// a closed connection are transient; what is left (no TLS on a server
/// asked for it, a bad option) is permanent.
fn classify(error: &tokio_postgres::Error) -> Failure {
    if let Some(db) = error.as_db_error() {
        return classify_code(db.code());
    }
    let mut io = false;
    let mut cause = std::error::Error::source(error);
    while let Some(e) = cause {
        if let Some(e) = e.downcast_ref::<std::io::Error>() {
            io = true;
            if let Some(tls) = e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                return classify_tls(tls);
            }
        }
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return classify_tls(tls);
        }
        cause = e.source();
    }
    if io || error.is_closed() {
        Failure::Transient
    } else {
        Failure::Permanent("refused by the client's TLS or connection settings")
    }
}

fn classify_tls(error: &rustls::Error) -> Failure {
    match error {
        rustls::Error::InvalidCertificate(_) => Failure::Permanent("the server's certificate was refused"),
        rustls::Error::AlertReceived(_) => Failure::Permanent("the server refused the TLS handshake"),
        _ => Failure::Permanent("the TLS handshake failed"),
    }
}

fn classify_code(code: &SqlState) -> Failure {
    let class = &code.code()[..2];
    if *code == SqlState::CANNOT_CONNECT_NOW
        || *code == SqlState::ADMIN_SHUTDOWN
        || *code == SqlState::CRASH_SHUTDOWN
        || class == "53"
        || class == "08"
    {
        Failure::Transient
    } else if class == "28" {
        Failure::Permanent("authentication failed")
    } else if *code == SqlState::INVALID_CATALOG_NAME {
        Failure::Permanent("the database does not exist")
    } else if *code == SqlState::INSUFFICIENT_PRIVILEGE {
        Failure::Permanent("permission denied")
    } else {
        Failure::Permanent("refused by the server")
    }
}

/// Startup's retry rules, shared by [`connect`](super::connect) and the
/// relay's sessions: 100 ms doubling to 2 s, jittered, until the connect
/// timeout; a permanent failure ends it at once.
#[derive(Debug)]
pub(crate) struct Startup {
    target: String,
    timeout: Duration,
    deadline: Instant,
    delay: Doubling,
    attempts: u32,
}

impl Startup {
    pub(crate) fn new(config: &PgConfig, timeout: Duration) -> Startup {
        Startup {
            target: config.target(),
            timeout,
            deadline: Instant::now() + timeout,
            delay: Doubling::new(RECONNECT_FIRST, RECONNECT_MAX),
            attempts: 0,
        }
    }

    /// Books a failed attempt: how long to wait before the next, or the
    /// error to give up with. Logs each transient failure with the
    /// server's message.
    pub(crate) fn failed(&mut self, error: tokio_postgres::Error) -> Result<Duration, ConnectError> {
        self.attempts += 1;
        if let Failure::Permanent(why) = classify(&error) {
            return Err(ConnectError::Refused {
                target: self.target.clone(),
                why,
                source: error,
            });
        }
        let delay = self.delay.next_delay();
        if Instant::now() + delay >= self.deadline {
            return Err(ConnectError::GaveUp {
                target: self.target.clone(),
                timeout: self.timeout,
                attempts: self.attempts,
                source: error,
            });
        }
        warn!(
            target_db = %self.target,
            attempt = self.attempts,
            // Whole milliseconds: readable in a line, a number in JSON (a
            // u128 would be a string there).
            retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            error = %error_chain(&error),
            "postgres not reachable yet; retrying"
        );
        outbox::notify::send("OUTBOX_CONNECT=retrying");
        Ok(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_are_classified_by_sqlstate() {
        for (code, transient) in [
            (SqlState::CANNOT_CONNECT_NOW, true),
            (SqlState::TOO_MANY_CONNECTIONS, true),
            (SqlState::ADMIN_SHUTDOWN, true),
            (SqlState::CONNECTION_FAILURE, true),
            (SqlState::INVALID_PASSWORD, false),
            (SqlState::INVALID_AUTHORIZATION_SPECIFICATION, false),
            (SqlState::INVALID_CATALOG_NAME, false),
            (SqlState::INSUFFICIENT_PRIVILEGE, false),
        ] {
            assert_eq!(
                classify_code(&code) == Failure::Transient,
                transient,
                "{}",
                code.code()
            );
        }
    }
}
