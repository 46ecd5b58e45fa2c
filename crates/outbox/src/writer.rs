//! The writer: puts events into the outbox inside the caller's transaction.
//!
//! It never begins, commits or rolls back, and never talks to a sink: the
//! event becomes visible to the relay exactly when the caller's business
//! change commits, and vanishes with it on rollback. That is the whole answer
//! to the dual-write problem.

use serde_json::Value;
use uuid::Uuid;

use crate::sql::OutboxSql;
use crate::{Config, Error, Event};

/// A handle on one outbox table, holding its rendered statements.
///
/// Build it once (it renders SQL) and share it; it is cheap to clone.
#[derive(Debug, Clone)]
pub struct Outbox {
    config: Config,
    sql: OutboxSql,
    statements: Statements,
}

/// How the sqlx flavour of the writer and the inbox sends its statements.
/// The tokio-postgres flavour always sends them unnamed with their types,
/// in one round trip, which works everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Statements {
    /// Prepared, and cached per connection by sqlx (its default): after
    /// the first call, one round trip per statement.
    #[default]
    Prepared,
    /// Unnamed, parsed with each call (sqlx's `persistent(false)`): for a
    /// connection through a transaction-mode pooler (PgBouncer's
    /// `pool_mode = transaction`), which runs each transaction on
    /// whichever server connection is free, where a statement prepared in
    /// an earlier transaction is missing (or another client's stands under
    /// its name). sqlx then takes two round trips per statement. The
    /// application's own sqlx queries need `.persistent(false)` there too.
    Unnamed,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new(Config::default())
    }
}

/// Columns of a batch as arrays, the shape `INSERT_EVENTS` binds.
pub(crate) struct Columns {
    pub(crate) ids: Vec<Uuid>,
    pub(crate) types: Vec<String>,
    pub(crate) aggregates: Vec<String>,
    pub(crate) event_types: Vec<String>,
    pub(crate) payloads: Vec<Value>,
    pub(crate) headers: Vec<Value>,
}

impl Columns {
    pub(crate) fn of(events: &[Event]) -> Result<Self, Error> {
        let mut c = Columns {
            ids: Vec::with_capacity(events.len()),
            types: Vec::with_capacity(events.len()),
            aggregates: Vec::with_capacity(events.len()),
            event_types: Vec::with_capacity(events.len()),
            payloads: Vec::with_capacity(events.len()),
            headers: Vec::with_capacity(events.len()),
        };
        for e in events {
            e.validate()?;
            c.ids.push(e.event_id);
            c.types.push(e.aggregate_type.clone());
            c.aggregates.push(e.aggregate_id.clone());
            c.event_types.push(e.event_type.clone());
            c.payloads.push(e.payload.clone());
            c.headers.push(Value::Object(e.headers.clone()));
        }
        Ok(c)
    }
}

/// A statement's typed parameter.
#[cfg(feature = "tokio-postgres")]
pub(crate) type Typed<'a> = (
    &'a (dyn tokio_postgres::types::ToSql + Sync),
    tokio_postgres::types::Type,
);

/// One event as `INSERT_EVENT` and `EMIT` bind it (`$1..$6`), `headers`
/// being its headers as one JSON value.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn event_params<'a>(e: &'a Event, headers: &'a Value) -> [Typed<'a>; 6] {
    use tokio_postgres::types::Type;
    [
        (&e.event_id, Type::UUID),
        (&e.aggregate_type, Type::TEXT),
        (&e.aggregate_id, Type::TEXT),
        (&e.event_type, Type::TEXT),
        (&e.payload, Type::JSONB),
        (headers, Type::JSONB),
    ]
}

#[cfg(feature = "tokio-postgres")]
impl Columns {
    /// The arrays as `INSERT_EVENTS` and `EMIT_ALL` bind them (`$1..$6`).
    pub(crate) fn params(&self) -> [Typed<'_>; 6] {
        use tokio_postgres::types::Type;
        [
            (&self.ids, Type::UUID_ARRAY),
            (&self.types, Type::TEXT_ARRAY),
            (&self.aggregates, Type::TEXT_ARRAY),
            (&self.event_types, Type::TEXT_ARRAY),
            (&self.payloads, Type::JSONB_ARRAY),
            (&self.headers, Type::JSONB_ARRAY),
        ]
    }
}

impl Outbox {
    /// A writer for `config`'s table.
    pub fn new(config: Config) -> Self {
        let sql = OutboxSql::new(&config);
        Self {
            config,
            sql,
            statements: Statements::default(),
        }
    }

    /// The same writer sending its sqlx statements as `statements` says
    /// (for a transaction-mode pooler, [`Statements::Unnamed`]).
    ///
    /// ```
    /// use outbox::{Outbox, Statements};
    ///
    /// let writer = Outbox::default().with_statements(Statements::Unnamed);
    /// # let _ = writer;
    /// ```
    #[must_use]
    pub fn with_statements(mut self, statements: Statements) -> Self {
        self.statements = statements;
        self
    }

    /// The table this writer inserts into.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The rendered statements, for the relay and operator commands.
    pub fn sql(&self) -> &OutboxSql {
        &self.sql
    }
}

#[cfg(feature = "tokio-postgres")]
mod pg {
    use serde_json::Value;
    use tokio_postgres::GenericClient;
    use uuid::Uuid;

    use super::{Columns, Outbox};
    use crate::{Error, Event};

    impl Outbox {
        /// Inserts one event in `client`'s transaction and returns its `event_id`.
        ///
        /// ```no_run
        /// # async fn run(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
        /// use outbox::{Event, Outbox};
        /// use serde_json::json;
        ///
        /// let outbox = Outbox::default();
        /// let tx = client.transaction().await?;
        /// tx.execute("INSERT INTO orders (id, total) VALUES ($1, $2)", &[&42_i64, &990_i64]).await?;
        /// outbox
        ///     .enqueue(&tx, &Event::new("orders", "42", "OrderCreated", json!({"order_id": 42})))
        ///     .await?;
        /// tx.commit().await?; // the order and its event become visible together
        /// # Ok(()) }
        /// ```
        pub async fn enqueue<C: GenericClient>(&self, client: &C, event: &Event) -> Result<Uuid, Error> {
            event.validate()?;
            let headers = Value::Object(event.headers.clone());
            // Typed parameters let the statement be parsed, bound and run in
            // one round trip; an untyped one costs a second for the prepare.
            client
                .execute_typed(&self.sql.insert_event, &super::event_params(event, &headers))
                .await
                .map_err(Error::pg("inserting an event into the outbox"))?;
            Ok(event.event_id)
        }

        /// Inserts many events in one round trip, in order, and returns their
        /// `event_id`s.
        pub async fn enqueue_all<C: GenericClient>(
            &self,
            client: &C,
            events: &[Event],
        ) -> Result<Vec<Uuid>, Error> {
            if events.is_empty() {
                return Ok(Vec::new());
            }
            let c = Columns::of(events)?;
            client
                .execute_typed(&self.sql.insert_events, &c.params())
                .await
                .map_err(Error::pg("inserting events into the outbox"))?;
            Ok(c.ids)
        }
    }

    impl Outbox {
        /// Emits one event in `client`'s transaction without writing a row:
        /// a transactional logical decoding message
        /// (`pg_logical_emit_message(true, 'outbox:<schema>.<table>', …)`)
        /// that only the WAL source (`outbox relay --source wal`) delivers,
        /// and only if the transaction commits. No row, index, cleanup or
        /// dead tuple; a dead letter of it becomes a row. Returns its
        /// `event_id`.
        ///
        /// ```no_run
        /// # async fn run(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
        /// use outbox::{Event, Outbox};
        /// use serde_json::json;
        ///
        /// let tx = client.transaction().await?;
        /// tx.execute("UPDATE accounts SET balance = balance - 10 WHERE id = 7", &[]).await?;
        /// Outbox::default()
        ///     .emit(&tx, &Event::new("accounts", "7", "Debited", json!({"amount": 10})))
        ///     .await?;
        /// tx.commit().await?;
        /// # Ok(()) }
        /// ```
        pub async fn emit<C: GenericClient>(&self, client: &C, event: &Event) -> Result<Uuid, Error> {
            event.validate()?;
            crate::sql::wal::emit(client, &self.config.wal_prefix(), event)
                .await
                .map_err(Error::pg("emitting an event to the write-ahead log"))?;
            Ok(event.event_id)
        }

        /// Emits many events in order in one round trip (see
        /// [`Outbox::emit`]); returns their `event_id`s.
        pub async fn emit_all<C: GenericClient>(
            &self,
            client: &C,
            events: &[Event],
        ) -> Result<Vec<Uuid>, Error> {
            if events.is_empty() {
                return Ok(Vec::new());
            }
            let c = Columns::of(events)?;
            crate::sql::wal::emit_all(client, &self.config.wal_prefix(), &c)
                .await
                .map_err(Error::pg("emitting events to the write-ahead log"))?;
            Ok(c.ids)
        }
    }

    /// [`Outbox::enqueue`] on the default table `public.outbox`.
    pub async fn enqueue<C: GenericClient>(client: &C, event: &Event) -> Result<Uuid, Error> {
        Outbox::default().enqueue(client, event).await
    }

    /// [`Outbox::enqueue_all`] on the default table `public.outbox`.
    pub async fn enqueue_all<C: GenericClient>(client: &C, events: &[Event]) -> Result<Vec<Uuid>, Error> {
        Outbox::default().enqueue_all(client, events).await
    }
}

#[cfg(feature = "tokio-postgres")]
pub use pg::{enqueue, enqueue_all};

/// The writer for sqlx, on any `&mut PgConnection` (a transaction derefs to one).
#[cfg(feature = "sqlx")]
pub mod sqlx {
    use serde_json::Value;
    use sqlx::PgConnection;
    use uuid::Uuid;

    use super::{Columns, Outbox, Statements};
    use crate::{Error, Event};

    impl Outbox {
        /// Inserts one event through sqlx and returns its `event_id`.
        ///
        /// ```no_run
        /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
        /// use outbox::{Event, Outbox};
        /// use serde_json::json;
        ///
        /// let mut tx = pool.begin().await?;
        /// sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(42_i64).execute(&mut *tx).await?;
        /// Outbox::default()
        ///     .enqueue_sqlx(&mut tx, &Event::new("orders", "42", "OrderCreated", json!({"order_id": 42})))
        ///     .await?;
        /// tx.commit().await?;
        /// # Ok(()) }
        /// ```
        pub async fn enqueue_sqlx(&self, conn: &mut PgConnection, event: &Event) -> Result<Uuid, Error> {
            event.validate()?;
            sqlx::query(&self.sql.insert_event)
                .persistent(self.statements == Statements::Prepared)
                .bind(event.event_id)
                .bind(&event.aggregate_type)
                .bind(&event.aggregate_id)
                .bind(&event.event_type)
                .bind(&event.payload)
                .bind(Value::Object(event.headers.clone()))
                .execute(conn)
                .await
                .map_err(Error::sqlx("inserting an event into the outbox"))?;
            Ok(event.event_id)
        }

        /// Inserts many events through sqlx in one round trip.
        pub async fn enqueue_all_sqlx(
            &self,
            conn: &mut PgConnection,
            events: &[Event],
        ) -> Result<Vec<Uuid>, Error> {
            if events.is_empty() {
                return Ok(Vec::new());
            }
            let c = Columns::of(events)?;
            sqlx::query(&self.sql.insert_events)
                .persistent(self.statements == Statements::Prepared)
                .bind(&c.ids)
                .bind(&c.types)
                .bind(&c.aggregates)
                .bind(&c.event_types)
                .bind(&c.payloads)
                .bind(&c.headers)
                .execute(conn)
                .await
                .map_err(Error::sqlx("inserting events into the outbox"))?;
            Ok(c.ids)
        }
    }

    /// [`Outbox::enqueue_sqlx`] on the default table `public.outbox`.
    pub async fn enqueue(conn: &mut PgConnection, event: &Event) -> Result<Uuid, Error> {
        Outbox::default().enqueue_sqlx(conn, event).await
    }

    /// [`Outbox::enqueue_all_sqlx`] on the default table `public.outbox`.
    pub async fn enqueue_all(conn: &mut PgConnection, events: &[Event]) -> Result<Vec<Uuid>, Error> {
        Outbox::default().enqueue_all_sqlx(conn, events).await
    }
}
