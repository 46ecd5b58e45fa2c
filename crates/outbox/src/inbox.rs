//! The idempotent consumer: at-least-once delivery made exactly-once in effect.
//!
//! The consumer records the sender's `event_id` in `processed_events` in the
//! same transaction as its side effect. A duplicate finds the row already
//! there, skips the effect and is answered as a success (an error would only
//! make the sender retry, forever). Record and effect commit or roll back
//! together, so "recorded but not done" cannot happen.
//!
//! For a side effect outside the database (an e-mail, a payment API) the
//! transaction cannot cover it: record, commit, call, and delete the record if
//! the call fails, so the next delivery tries again.

use uuid::Uuid;

use crate::sql::InboxSql;
use crate::{Error, InboxConfig, Statements};

/// Whether an event was seen before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// First time: run the side effect in this transaction.
    New,
    /// Already processed: skip the side effect, answer success.
    Duplicate,
}

/// What [`Inbox::process`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed<T> {
    /// The side effect ran and returned this.
    New(T),
    /// The event was a duplicate; nothing ran.
    Duplicate,
}

/// A handle on one processed-events table.
#[derive(Debug, Clone)]
pub struct Inbox {
    config: InboxConfig,
    sql: InboxSql,
    statements: Statements,
}

impl Default for Inbox {
    fn default() -> Self {
        Self::new(InboxConfig::default())
    }
}

impl Inbox {
    /// An inbox on `config`'s table.
    pub fn new(config: InboxConfig) -> Self {
        let sql = InboxSql::new(&config);
        Self {
            config,
            sql,
            statements: Statements::default(),
        }
    }

    /// The same inbox sending its sqlx statement as `statements` says (see
    /// [`Statements`]; the tokio-postgres flavour runs inside the caller's
    /// transaction either way).
    #[must_use]
    pub fn with_statements(mut self, statements: Statements) -> Self {
        self.statements = statements;
        self
    }

    /// The table this inbox records into.
    pub fn config(&self) -> &InboxConfig {
        &self.config
    }
}

#[cfg(feature = "tokio-postgres")]
mod pg {
    use tokio_postgres::GenericClient;

    use super::*;

    impl Inbox {
        /// Records `event_id` in `client`'s transaction and says whether it is new.
        pub async fn record<C: GenericClient>(&self, client: &C, event_id: Uuid) -> Result<Record, Error> {
            let inserted = client
                .execute(&self.sql.record, &[&event_id])
                .await
                .map_err(Error::pg("recording an event in the inbox"))?;
            Ok(if inserted == 1 {
                Record::New
            } else {
                Record::Duplicate
            })
        }

        /// Runs `effect` once per `event_id`, in `client`'s transaction; the
        /// caller commits. A duplicate is `Ok(Processed::Duplicate)`. The
        /// effect's error type must absorb [`Error`] (anyhow, `Box<dyn Error>`
        /// or your own enum with a `From` impl).
        ///
        /// ```no_run
        /// # async fn run(client: &mut tokio_postgres::Client, event_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
        /// use outbox::{Inbox, Processed};
        ///
        /// let inbox = Inbox::default();
        /// let tx = client.transaction().await?;
        /// let outcome = inbox
        ///     .process(&tx, event_id, async |tx| -> Result<u64, Box<dyn std::error::Error>> {
        ///         Ok(tx.execute("INSERT INTO shipments (order_id) VALUES (42)", &[]).await?)
        ///     })
        ///     .await?;
        /// tx.commit().await?;
        /// if outcome == Processed::Duplicate {
        ///     // answer success all the same
        /// }
        /// # Ok(()) }
        /// ```
        pub async fn process<C, T, E, F>(
            &self,
            client: &C,
            event_id: Uuid,
            effect: F,
        ) -> Result<Processed<T>, E>
        where
            C: GenericClient,
            F: AsyncFnOnce(&C) -> Result<T, E>,
            E: From<Error>,
        {
            match self.record(client, event_id).await? {
                Record::Duplicate => Ok(Processed::Duplicate),
                Record::New => Ok(Processed::New(effect(client).await?)),
            }
        }
    }
}

#[cfg(feature = "sqlx")]
mod sqlx_driver {
    use sqlx::PgConnection;

    use super::*;

    impl Inbox {
        /// [`Inbox::record`] through sqlx.
        pub async fn record_sqlx(&self, conn: &mut PgConnection, event_id: Uuid) -> Result<Record, Error> {
            let done = sqlx::query(&self.sql.record)
                .persistent(self.statements == Statements::Prepared)
                .bind(event_id)
                .execute(conn)
                .await
                .map_err(Error::sqlx("recording an event in the inbox"))?;
            Ok(if done.rows_affected() == 1 {
                Record::New
            } else {
                Record::Duplicate
            })
        }

        /// [`Inbox::process`] through sqlx: `effect` gets the same connection.
        pub async fn process_sqlx<T, E, F>(
            &self,
            conn: &mut PgConnection,
            event_id: Uuid,
            effect: F,
        ) -> Result<Processed<T>, E>
        where
            F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
            E: From<Error>,
        {
            match self.record_sqlx(conn, event_id).await? {
                Record::Duplicate => Ok(Processed::Duplicate),
                Record::New => Ok(Processed::New(effect(conn).await?)),
            }
        }
    }
}
