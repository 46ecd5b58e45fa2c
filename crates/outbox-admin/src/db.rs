//! The console's one PostgreSQL connection, shared by every request
//! (tokio-postgres pipelines concurrent queries on it) and reopened on the
//! next request after it drops, so a PostgreSQL restart costs one failed
//! page, not the console; and a connection of its own for each change.

use std::sync::{Arc, Mutex};

use outbox_relay::pg::PgConfig;
use tokio_postgres::Client;

pub(crate) struct Db {
    config: PgConfig,
    /// A std mutex: held only to clone or swap the `Arc`, never across an
    /// await.
    client: Mutex<Option<Arc<Client>>>,
}

impl Db {
    pub(crate) fn new(config: PgConfig) -> Db {
        Db {
            config,
            client: Mutex::new(None),
        }
    }

    /// The open connection, or a new one (one attempt, bounded by
    /// `--connect-timeout`). Two requests racing past a dropped connection
    /// may both connect; the later one wins and the other is closed when
    /// its request ends.
    pub(crate) async fn client(&self) -> Result<Arc<Client>, tokio_postgres::Error> {
        if let Some(client) = self.lock().as_ref().filter(|c| !c.is_closed()) {
            return Ok(Arc::clone(client));
        }
        let client = Arc::new(outbox_relay::pg::connect_once(&self.config).await?);
        *self.lock() = Some(Arc::clone(&client));
        Ok(client)
    }

    /// A connection of its own, for a change and its audit row in one
    /// transaction: the shared one pipelines every request's statements, so
    /// a transaction on it would take in other requests' statements.
    /// Changes are rare; the connection is closed when it is dropped.
    pub(crate) async fn own(&self) -> Result<Client, tokio_postgres::Error> {
        outbox_relay::pg::connect_once(&self.config).await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<Client>>> {
        // A panic while holding the lock cannot leave the Option torn.
        self.client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
