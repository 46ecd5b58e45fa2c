//! Why a relay stops, and the one-line error chain its logs print.

use tokio_postgres::error::{DbError, SqlState};

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
    /// What cannot run through the pooler in front (`--pooler`).
    #[error("{0}")]
    Pooler(&'static str),
    /// A transaction-mode pooler sits in front of a relay run without
    /// `--pooler transaction`: a prepared statement did not survive its
    /// transaction, or two of its sessions share one server connection.
    #[error(
        "a transaction-mode pooler (such as PgBouncer with pool_mode = transaction) sits between the relay \
         and PostgreSQL: {sign}; run the relay with --pooler transaction (OUTBOX_POOLER=transaction), or \
         connect it directly or through a session-mode pool"
    )]
    TransactionPooler {
        /// What gave it away.
        sign: String,
    },
    /// A fleet asked for what it cannot serve (see `Fleet::new`).
    #[error("{0}")]
    Fleet(String),
    /// `--drain` cannot finish: PostgreSQL refuses the lease tick or the
    /// claim for a reason no retry fixes (a missing privilege, a missing
    /// function): the drain fails now rather than wait for an operator.
    #[error("the drain cannot finish: {reason}")]
    Drain {
        /// What was refused, and the server's words.
        reason: String,
    },
}

impl RelayError {
    /// True when the cause is configuration or schema (CLI exit code 2).
    pub fn is_config(&self) -> bool {
        match self {
            RelayError::Schema(e) => e.is_config(),
            RelayError::Ordering { .. }
            | RelayError::Pooler(_)
            | RelayError::TransactionPooler { .. }
            | RelayError::Fleet(_) => true,
            RelayError::Connect(e) => e.is_permanent(),
            RelayError::Drain { .. } => false,
        }
    }
}

/// Whether `e` says a transaction-mode pooler runs each transaction on
/// whichever server connection is free: a statement prepared in one
/// transaction is missing in the next (26000, `invalid_sql_statement_name`),
/// or one of the same name is already there, another client's (42P05,
/// `duplicate_prepared_statement`). A relay connected directly, or through a
/// session-mode pool, never sees either: it names its statements once per
/// session and never twice.
pub(crate) fn transaction_pooler(e: &tokio_postgres::Error) -> Option<RelayError> {
    let code = e.code()?;
    if *code != SqlState::INVALID_SQL_STATEMENT_NAME && *code != SqlState::DUPLICATE_PSTATEMENT {
        return None;
    }
    Some(RelayError::TransactionPooler { sign: error_chain(e) })
}

/// Whether PostgreSQL refused `e` (or a source of it) for a reason only an
/// operator fixes: class 42 (a missing privilege, 42501; a missing table
/// or function, 42P01, 42883) or a missing schema (3F000). A retry meets
/// the same refusal; a lost connection, a deadlock or a timeout are not
/// among these.
pub(crate) fn needs_operator(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|e| {
        e.downcast_ref::<DbError>().is_some_and(|db| {
            db.code().code().starts_with("42") || *db.code() == SqlState::INVALID_SCHEMA_NAME
        })
    })
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
pub(crate) fn db_message(db: &DbError) -> String {
    format!(
        "{}: {} (SQLSTATE {})",
        db.severity(),
        db.message(),
        db.code().code()
    )
}
