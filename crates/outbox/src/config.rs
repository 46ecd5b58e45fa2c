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
}

impl Default for Config {
    fn default() -> Self {
        Self {
            schema: Ident::new("--schema", "public").expect("valid literal"),
            table: Ident::new("--table", "outbox").expect("valid literal"),
            channel: Ident::new("--channel", "outbox_new").expect("valid literal"),
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

    /// `"schema"."table"`, for SQL text.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.table.quoted())
    }

    /// `schema.table`, for messages.
    pub fn display_name(&self) -> String {
        format!("{}.{}", self.schema, self.table)
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
