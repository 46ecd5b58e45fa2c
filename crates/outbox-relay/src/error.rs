//! Why a relay stops, and the one-line error chain its logs print.

use tokio_postgres::error::DbError;

use crate::pg::ConnectError;

/// Why the relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// PostgreSQL could not be reached within the connect timeout at
    /// startup, or refused in a way retrying cannot fix
    /// ([`ConnectError::is_permanent`]: a configuration error).
    #[error(transparent)]
    Connect(ConnectError),
    /// The outbox table is missing, outdated or too new.
    #[error("checking the outbox schema")]
    Schema(#[source] outbox::Error),
    /// Per-type ordering that cannot be honoured.
    #[error("invalid ordering for aggregate type {aggregate_type:?}: {reason}")]
    Ordering {
        /// The aggregate type.
        aggregate_type: String,
        /// Why.
        reason: &'static str,
    },
}

impl RelayError {
    /// True when the cause is configuration or schema (CLI exit code 2).
    pub fn is_config(&self) -> bool {
        match self {
            RelayError::Schema(e) => e.is_config(),
            RelayError::Ordering { .. } => true,
            RelayError::Connect(e) => e.is_permanent(),
        }
    }
}

/// The error and its sources on one line, for logs and `last_error`.
///
/// A `tokio_postgres::Error` the server answered displays only `db error`,
/// also behind `#[error(transparent)]`; the server's words replace it
/// ([`db_message`]) and end the line.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut message = String::new();
    let mut link = Some(e);
    while let Some(e) = link {
        if !message.is_empty() {
            message.push_str(": ");
        }
        let text = e.to_string();
        if let Some(db) = e.source().and_then(|s| s.downcast_ref::<DbError>()) {
            if text != "db error" {
                message.push_str(&text);
                message.push_str(": ");
            }
            message.push_str(&db_message(db));
            break;
        }
        message.push_str(&text);
        link = e.source();
    }
    message
}

/// What the server said: `FATAL: terminating connection due to
/// administrator command (SQLSTATE 57P01)`.
fn db_message(db: &DbError) -> String {
    format!(
        "{}: {} (SQLSTATE {})",
        db.severity(),
        db.message(),
        db.code().code()
    )
}
