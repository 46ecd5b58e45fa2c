//! Why a relay stops, and the one-line error chain its logs print.

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
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}
