//! The console's one PostgreSQL connection, shared by every request
//! (tokio-postgres pipelines concurrent queries on it) and reopened on the
//! next request after it drops, so a PostgreSQL restart costs one failed
//! page, not the console.

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

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<Client>>> {
        // A panic while holding the lock cannot leave the Option torn.
        self.client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
