//! The batch sessions of one database of a fleet, shared by its outboxes.
//!
//! At most `size` connections, opened when first needed and kept while
//! healthy. An outbox borrows one for a batch, from claim to commit, and
//! gives it back: the next borrower is whoever asked first (tokio's
//! semaphore is fair), so an outbox with a backlog queues behind the others
//! after each batch instead of keeping a session. That queue is the fleet's
//! round robin.
//!
//! Sessions run the relay's statements unprepared (each outbox has its own
//! table, and prepared statements per outbox per session would grow with
//! the tenants), with plans pinned per transaction.

use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::pg::PgConfig;

/// See the [module docs](self).
pub(crate) struct Pool {
    pg: PgConfig,
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<Client>>,
}

/// A session lent to one batch. Dropped without [`Lent::restore`], its
/// connection is closed: what it had open is rolled back.
pub(crate) struct Lent {
    client: Option<Client>,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    /// A pool of at most `size` sessions to `pg`.
    pub(crate) fn new(pg: PgConfig, size: usize) -> Arc<Self> {
        Arc::new(Self {
            pg,
            permits: Arc::new(Semaphore::new(size.max(1))),
            idle: Mutex::default(),
        })
    }

    /// A session, once one is free (first come, first served), connecting
    /// if none is open. None if `cancel` fired first.
    pub(crate) async fn lend(
        self: &Arc<Self>,
        cancel: &CancellationToken,
    ) -> Result<Option<Lent>, tokio_postgres::Error> {
        let permit = tokio::select! {
            permit = Arc::clone(&self.permits).acquire_owned() => permit.expect("never closed"),
            () = cancel.cancelled() => return Ok(None),
        };
        let idle = self.idle.lock().expect("not poisoned").pop();
        let client = match idle {
            Some(client) if !client.is_closed() => client,
            _ => crate::pg::connect_once(&self.pg).await?,
        };
        Ok(Some(Lent {
            client: Some(client),
            pool: Arc::clone(self),
            _permit: permit,
        }))
    }

    /// Closes the idle sessions (a fleet letting go of a database).
    pub(crate) fn close(&self) {
        self.idle.lock().expect("not poisoned").clear();
    }
}

impl Lent {
    /// The session.
    pub(crate) fn client(&self) -> &Client {
        self.client.as_ref().expect("present until restored")
    }

    /// Gives the session back for the next batch, unless its connection
    /// is gone. Only outside a transaction.
    pub(crate) fn restore(mut self) {
        if let Some(client) = self.client.take()
            && !client.is_closed()
        {
            self.pool.idle.lock().expect("not poisoned").push(client);
        }
    }
}
