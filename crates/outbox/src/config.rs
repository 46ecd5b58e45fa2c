//! Where the outbox and the inbox live: schema, table and NOTIFY channel.
//!
//! Every name is an [`Ident`], validated when the config is built, so the rest
//! of the crate can render it into SQL without further checks.

use crate::{Error, Ident};

/// Names of the outbox table and its NOTIFY channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Schema holding the outbox table (default `public`).
    pub schema: Ident,
    /// The outbox table (default `outbox`).
    pub table: Ident,
    /// Channel the insert trigger notifies (default `outbox_new`).
    pub channel: Ident,
    /// Logical partitions relays share the outbox by (default 64). Only
    /// [`migrate`](crate::migrate) reads it, when it creates the lease
    /// table; from then on that table decides.
    pub partitions: u32,
    /// How [`migrate`](crate::migrate) creates the table (default plain).
    /// An existing table keeps its layout.
    pub layout: Layout,
    /// The attempt limit rows were judged by before dead letters were
    /// recorded in the row (default 5). Only [`migrate`](crate::migrate)
    /// reads it, once: the migration that adds `dead_at` marks the
    /// unpublished rows with this many attempts as dead letters.
    pub dead_after_attempts: i32,
}

/// How the outbox table is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// One table; retention deletes published rows in batches.
    #[default]
    Plain,
    /// Daily `RANGE (created_at)` partitions plus a default partition;
    /// retention drops whole days (`outbox partitions maintain`).
    Daily,
}

/// Partitions [`Config::partitions`] defaults to: enough for dozens of relays
/// to share evenly, few enough that a relay's lease check stays cheap.
pub const DEFAULT_PARTITIONS: u32 = 64;

/// The relay's default attempt limit (`--max-attempts`), and what
/// [`Config::dead_after_attempts`] defaults to.
pub const DEFAULT_MAX_ATTEMPTS: i32 = 5;

/// The most partitions [`Config::with_partitions`] accepts.
pub const MAX_PARTITIONS: u32 = 4096;

impl Default for Config {
    fn default() -> Self {
        Self {
            schema: Ident::new("--schema", "public").expect("valid literal"),
            table: Ident::new("--table", "outbox").expect("valid literal"),
            channel: Ident::new("--channel", "outbox_new").expect("valid literal"),
            partitions: DEFAULT_PARTITIONS,
            layout: Layout::Plain,
            dead_after_attempts: DEFAULT_MAX_ATTEMPTS,
        }
    }
}

impl Config {
    /// A config for `schema.table` with the default channel.
    ///
    /// ```
    /// let config = outbox::Config::new("app", "outbox").unwrap();
    /// assert_eq!(config.qualified(), "\"app\".\"outbox\"");
    /// assert!(outbox::Config::new("app", "outbox; drop table x").is_err());
    /// ```
    pub fn new(schema: &str, table: &str) -> Result<Self, Error> {
        Ok(Self {
            schema: Ident::new("--schema", schema)?,
            table: Ident::new("--table", table)?,
            ..Self::default()
        })
    }

    /// Uses another NOTIFY channel.
    pub fn with_channel(mut self, channel: &str) -> Result<Self, Error> {
        self.channel = Ident::new("--channel", channel)?;
        Ok(self)
    }

    /// Uses `n` logical partitions (1 to [`MAX_PARTITIONS`]) when the lease
    /// table is created.
    pub fn with_partitions(mut self, n: u32) -> Result<Self, Error> {
        if !(1..=MAX_PARTITIONS).contains(&n) {
            return Err(Error::InvalidPartitions {
                value: n,
                max: MAX_PARTITIONS,
            });
        }
        self.partitions = n;
        Ok(self)
    }

    /// Marks unpublished rows with `n` attempts or more as dead letters
    /// when the migration recording dead letters in the row runs (see
    /// [`Config::dead_after_attempts`]).
    pub fn with_dead_after_attempts(mut self, n: i32) -> Self {
        self.dead_after_attempts = n;
        self
    }

    /// `"schema"."table"`, for SQL text.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.table.quoted())
    }

    /// `schema.table`, for messages.
    pub fn display_name(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// The logical replication slot log tailing reads (`relay --source
    /// wal`): `<schema>_<table>`. Slots are named per cluster, not per
    /// database, so the schema is part of the name.
    pub fn wal_slot(&self) -> Result<String, Error> {
        let name = format!("{}_{}", self.schema, self.table);
        // A slot name is a plain identifier; only its length can be wrong.
        Ident::new("--table", &name).map(|_| name)
    }

    /// The publication of the outbox's inserts: `<schema>_<table>`, like
    /// the slot. Publications are named per database, not per schema, so
    /// two outboxes of one name in two schemas need the schema in it.
    pub fn wal_publication(&self) -> Result<Ident, Error> {
        Ident::new("--table", &format!("{}_{}", self.schema, self.table))
    }

    /// The prefix `pg_logical_emit_message` is called with for this outbox
    /// (`Outbox::emit`): `outbox:<schema>.<table>`.
    pub fn wal_prefix(&self) -> String {
        format!("outbox:{}.{}", self.schema, self.table)
    }

    /// `"schema"."<table><suffix>"`: a companion object of the outbox.
    pub fn companion(&self, suffix: &str) -> Result<String, Error> {
        Ok(format!(
            "{}.{}",
            self.schema.quoted(),
            self.table.suffixed("--table", suffix)?.quoted()
        ))
    }
}

/// Names of the consumer's processed-events table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxConfig {
    /// Schema holding the table (default `public`).
    pub schema: Ident,
    /// The processed-events table (default `processed_events`).
    pub table: Ident,
}

impl Default for InboxConfig {
    fn default() -> Self {
        Self {
            schema: Ident::new("--inbox-schema", "public").expect("valid literal"),
            table: Ident::new("--inbox-table", "processed_events").expect("valid literal"),
        }
    }
}

impl InboxConfig {
    /// A config for `schema.table`.
    pub fn new(schema: &str, table: &str) -> Result<Self, Error> {
        Ok(Self {
            schema: Ident::new("--inbox-schema", schema)?,
            table: Ident::new("--inbox-table", table)?,
        })
    }

    /// `"schema"."table"`, for SQL text.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.table.quoted())
    }

    /// `schema.table`, for messages.
    pub fn display_name(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }
}
