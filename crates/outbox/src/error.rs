//! The library's one error type.
//!
//! Callers branch on [`Error::is_config`] (a setting or the schema is wrong;
//! retrying will not help) rather than on message text. Messages are lowercase
//! and say what was being done, with the driver error kept as the source.

/// Everything the writer, inbox and migrations can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A schema, table or channel name is not a plain SQL identifier.
    #[error(
        "invalid {what} value {name:?}: expected a lowercase SQL identifier ([a-z_][a-z0-9_]*, at most 63 bytes)"
    )]
    InvalidIdentifier {
        /// The flag or setting the name came from.
        what: &'static str,
        /// The refused name.
        name: String,
    },
    /// A partition count out of range.
    #[error("invalid --partitions {value}: expected 1 to {max}")]
    InvalidPartitions {
        /// The refused count.
        value: u32,
        /// The largest accepted.
        max: u32,
    },
    /// `--partition-by day` asked of an outbox that exists unpartitioned.
    #[error(
        "{table} exists as a plain table; it cannot be turned into daily partitions in place (create a new outbox with --partition-by day and move the unpublished rows)"
    )]
    LayoutMismatch {
        /// The qualified table name.
        table: String,
    },
    /// An event is missing a required field or is too large.
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    /// An event breaks the table contract (`docs/schema.md`): the table's
    /// CHECK constraints would refuse it, and the relay could not deliver
    /// it as written. Found before any SQL.
    #[error("invalid event: {0}")]
    Contract(#[from] Violation),
    /// The outbox or inbox table has not been created yet.
    #[error(
        "{table} is not migrated (found schema version {found}, this binary needs {needed}); run `outbox migrate`"
    )]
    NotMigrated {
        /// The qualified table name.
        table: String,
        /// The version found in the database (0 = none).
        found: i32,
        /// The version this binary needs.
        needed: i32,
    },
    /// The database was migrated by a newer release than this one.
    #[error("{table} has schema version {found}, newer than this binary knows ({known}); upgrade outbox")]
    SchemaTooNew {
        /// The qualified table name.
        table: String,
        /// The version found in the database.
        found: i32,
        /// The newest version this binary knows.
        known: i32,
    },
    /// A migration that was already applied has different contents now.
    #[error("migration {version} ({name}) of {table} was changed after it was applied (checksum mismatch)")]
    MigrationChanged {
        /// The qualified table name.
        table: String,
        /// The migration's number.
        version: i32,
        /// The migration's name.
        name: String,
    },
    /// Log tailing needs `wal_level = logical`.
    #[error(
        "wal_level is {found}: log tailing (--source wal) needs wal_level = logical; run ALTER SYSTEM SET wal_level = logical as a superuser, then restart PostgreSQL (a reload is not enough)"
    )]
    WalLevel {
        /// The server's `wal_level`.
        found: String,
    },
    /// The role may not open replication connections.
    #[error(
        "role {role} lacks the REPLICATION attribute log tailing (--source wal) needs; run ALTER ROLE {role} REPLICATION as a superuser"
    )]
    NoReplication {
        /// The role connected as.
        role: String,
    },
    /// `outbox migrate --wal` has not run, or ran for another database.
    #[error("{what}; run `outbox migrate --wal` for this outbox")]
    WalNotSetUp {
        /// What is missing.
        what: String,
    },
    /// PostgreSQL invalidated the slot (`max_slot_wal_keep_size`): the WAL it
    /// needed is gone.
    #[error(
        "the replication slot {slot} was invalidated by PostgreSQL: it fell more than max_slot_wal_keep_size behind and the WAL it needed was removed; run `outbox migrate --wal --recover` to recreate it and re-send the undelivered rows still in the table"
    )]
    SlotInvalidated {
        /// The slot's name.
        slot: String,
    },
    /// The slot is gone (a failover to a standby, or dropped) and the
    /// relay keeps delivered rows (`--wal-cleanup none`), so it cannot
    /// tell which rows of the table a new slot must send.
    #[error(
        "the replication slot {slot} is missing (a failover to a standby, or it was dropped), and with --wal-cleanup none the table keeps delivered rows, so the relay cannot tell which to send again: run `outbox migrate --wal --recover --since <time>` with a time before the relay stopped confirming"
    )]
    SlotMissing {
        /// The slot's name.
        slot: String,
    },
    /// The publication says the table's rows are owed to a slot that
    /// started late, and the relay keeps delivered rows
    /// (`--wal-cleanup none`), so it cannot tell which.
    #[error(
        "the slot {slot} started after rows it must send (its publication is marked: a backfill is owed), and with --wal-cleanup none the table keeps delivered rows, so the relay cannot tell which: run `outbox migrate --wal --recover --since <time>` with a time before the relay stopped confirming"
    )]
    BackfillOwed {
        /// The slot's name.
        slot: String,
    },
    /// The connected role lacks privileges a command needs
    /// ([`crate::privileges::check`]).
    #[error("role {role} lacks {missing}\nfix: {fix}")]
    MissingPrivileges {
        /// The role connected as.
        role: String,
        /// What it lacks, grouped by object.
        missing: String,
        /// The command that grants it.
        fix: String,
    },
    /// `outbox migrate --grant` found no object to grant on.
    #[error("{what} does not exist; run `outbox migrate` (as the owner) before granting on it")]
    NothingToGrantOn {
        /// The object, as people read it.
        what: String,
    },
    /// A statement failed in tokio-postgres.
    #[cfg(feature = "tokio-postgres")]
    #[error("{doing}")]
    Postgres {
        /// What was being done.
        doing: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A statement failed in sqlx.
    #[cfg(feature = "sqlx")]
    #[error("{doing}")]
    Sqlx {
        /// What was being done.
        doing: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

/// What breaks the table contract ([`crate::contract`]), naming the column:
/// the writer's error and the relay's dead-letter reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// An `aggregate_type` or `event_type` that is empty.
    #[error("{column} is empty")]
    Empty {
        /// The column.
        column: &'static str,
    },
    /// An `aggregate_type` or `event_type` over
    /// [`MAX_NAME_CHARS`](crate::contract::MAX_NAME_CHARS).
    #[error(
        "{column} is {chars} characters, over the limit of {} (names built from it must fit Kafka's 249)",
        crate::contract::MAX_NAME_CHARS
    )]
    NameTooLong {
        /// The column.
        column: &'static str,
        /// Its length in characters.
        chars: usize,
    },
    /// An `aggregate_type` or `event_type` that cannot name a stream,
    /// subject, routing key or topic.
    #[error(
        "{column} {value:?} is not a name: expected letters, digits, '_' and '-', in segments joined by single dots (what Redis, NATS, AMQP and Kafka names all accept)"
    )]
    NotAName {
        /// The column.
        column: &'static str,
        /// The refused value.
        value: String,
    },
    /// `headers` that are not a JSON object (an array, a string, null…).
    #[error("headers: expected a JSON object of strings, got {got}")]
    HeadersNotAnObject {
        /// What it is instead, e.g. `an array`.
        got: &'static str,
    },
    /// A header name that is not an HTTP token.
    #[error("headers: name {name:?} is not an HTTP token (letters, digits and !#$%&'*+-.^_`|~)")]
    HeaderName {
        /// The refused name.
        name: String,
    },
    /// A header whose value is not a string.
    #[error("headers: {name:?} is {got}, expected a string")]
    HeaderValue {
        /// The header's name.
        name: String,
        /// What its value is, e.g. `a number`.
        got: &'static str,
    },
}

impl Error {
    /// True when the error comes from configuration or schema state, which a
    /// retry cannot fix (the CLI exits 2 for these).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            Error::InvalidIdentifier { .. }
                | Error::InvalidPartitions { .. }
                | Error::LayoutMismatch { .. }
                | Error::NotMigrated { .. }
                | Error::SchemaTooNew { .. }
                | Error::MigrationChanged { .. }
                | Error::WalLevel { .. }
                | Error::NoReplication { .. }
                | Error::WalNotSetUp { .. }
                | Error::SlotInvalidated { .. }
                | Error::SlotMissing { .. }
                | Error::BackfillOwed { .. }
                | Error::MissingPrivileges { .. }
                | Error::NothingToGrantOn { .. }
        ) || self.is_permission_denied()
    }

    /// Whether PostgreSQL refused a statement for want of a privilege
    /// (SQLSTATE 42501): a grant is missing, which no retry fixes.
    pub fn is_permission_denied(&self) -> bool {
        #[cfg(feature = "tokio-postgres")]
        if let Error::Postgres { source, .. } = self {
            return source.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE);
        }
        false
    }

    #[cfg(feature = "tokio-postgres")]
    pub(crate) fn pg(doing: &'static str) -> impl FnOnce(tokio_postgres::Error) -> Error {
        move |source| Error::Postgres { doing, source }
    }

    #[cfg(feature = "sqlx")]
    pub(crate) fn sqlx(doing: &'static str) -> impl FnOnce(sqlx::Error) -> Error {
        move |source| Error::Sqlx { doing, source }
    }
}
