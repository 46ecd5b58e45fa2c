//! The batch sessions of one database of a fleet, shared by its outboxes,
//! and the claims prepared on them.
//!
//! At most `size` connections, opened when first needed and kept while
//! healthy. An outbox borrows a session for a batch, from claim to commit,
//! and gives it back: the next borrower is whoever asked first (tokio's
//! semaphore is fair), so an outbox with a backlog queues behind the others
//! after each batch instead of keeping a session. That queue is the fleet's
//! round robin.
//!
//! Each outbox always borrows the same session (its key decides), so its
//! claim can be prepared there once: planning a claim costs PostgreSQL more
//! than running it (about 0.3 ms against 0.1 ms for a one-event batch over
//! a thousand tenants), and a fleet claims once per event at low rates.
//! A session keeps at most `prepared` claims, the least recently used
//! closed first; each allocates about 200 kB of the backend's memory
//! contexts (some 35 kB of it resident). PostgreSQL chooses
//! between a plan per run and its generic plan as for a single relay's
//! prepared statements (after five runs, by cost). Not forced generic: a
//! generic plan made while the table was analysed empty joins the whole
//! table to every claim (measured: a 100,000-event burst drained in 37 s
//! against 2.8 s). With `prepared` 0 every claim is parsed and planned on
//! each run. Everything else runs
//! unprepared (each outbox has its own table), with plans pinned per
//! transaction.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;

use crate::pg::PgConfig;

/// See the [module docs](self).
pub(crate) struct Pool {
    pg: PgConfig,
    slots: Vec<Slot>,
    /// Claims kept prepared per session.
    prepared: usize,
}

/// One session of the pool: one borrower at a time.
struct Slot {
    permit: Arc<Semaphore>,
    idle: Mutex<Option<Session>>,
}

/// A batch session and the claims prepared on it.
struct Session {
    client: Client,
    /// By text (which names the outbox's table: two outboxes' keys may
    /// collide, their texts never do): the statement and when it was last
    /// used.
    claims: HashMap<Box<str>, (Statement, u64)>,
    uses: u64,
}

/// A session lent to one batch. Dropped without [`Lent::restore`], its
/// connection is closed: what it had open is rolled back.
pub(crate) struct Lent {
    session: Option<Session>,
    pool: Arc<Pool>,
    slot: usize,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    /// A pool of at most `size` sessions to `pg`, each keeping up to
    /// `prepared` claims prepared.
    pub(crate) fn new(pg: PgConfig, size: usize, prepared: usize) -> Arc<Self> {
        let slots = (0..size.max(1))
            .map(|_| Slot {
                permit: Arc::new(Semaphore::new(1)),
                idle: Mutex::default(),
            })
            .collect();
        Arc::new(Self { pg, slots, prepared })
    }

    /// The session of the outbox `key`, once it is free (first come, first
    /// served), connecting if it is not open. None if `cancel` fired first.
    pub(crate) async fn lend(
        self: &Arc<Self>,
        key: i32,
        cancel: &CancellationToken,
    ) -> Result<Option<Lent>, tokio_postgres::Error> {
        let slot = usize::try_from(key.unsigned_abs()).unwrap_or(0) % self.slots.len();
        let permit = tokio::select! {
            permit = Arc::clone(&self.slots[slot].permit).acquire_owned() => permit.expect("never closed"),
            () = cancel.cancelled() => return Ok(None),
        };
        let idle = self.slots[slot].idle.lock().expect("not poisoned").take();
        let session = match idle {
            Some(session) if !session.client.is_closed() => session,
            _ => {
                let client = crate::pg::connect_once(&self.pg).await?;
                Session {
                    client,
                    claims: HashMap::new(),
                    uses: 0,
                }
            }
        };
        Ok(Some(Lent {
            session: Some(session),
            pool: Arc::clone(self),
            slot,
            _permit: permit,
        }))
    }

    /// Closes the idle sessions (a fleet letting go of a database).
    pub(crate) fn close(&self) {
        for slot in &self.slots {
            slot.idle.lock().expect("not poisoned").take();
        }
    }
}

impl Lent {
    fn session(&self) -> &Session {
        self.session.as_ref().expect("present until restored")
    }

    /// The session.
    pub(crate) fn client(&self) -> &Client {
        &self.session().client
    }

    /// The claim `text` prepared on this session, preparing it on first
    /// use; None when the pool keeps no prepared claims.
    pub(crate) async fn prepared_claim(
        &mut self,
        text: &str,
    ) -> Result<Option<Statement>, tokio_postgres::Error> {
        let cap = self.pool.prepared;
        let session = self.session.as_mut().expect("present until restored");
        if cap == 0 {
            return Ok(None);
        }
        session.uses += 1;
        let now = session.uses;
        if let Some((statement, used)) = session.claims.get_mut(text) {
            *used = now;
            return Ok(Some(statement.clone()));
        }
        if session.claims.len() >= cap
            && let Some(oldest) = session
                .claims
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(text, _)| text.clone())
        {
            // Dropping the statement closes it on the server.
            session.claims.remove(&oldest);
        }
        let statement = session.client.prepare(text).await?;
        session.claims.insert(text.into(), (statement.clone(), now));
        Ok(Some(statement))
    }

    /// Forgets the prepared claim `text` (after it failed: the next claim
    /// prepares it again, against the table as it is then).
    pub(crate) fn forget(&mut self, text: &str) {
        if let Some(session) = self.session.as_mut() {
            session.claims.remove(text);
        }
    }

    /// Gives the session back for the next batch, unless its connection
    /// is gone. Only outside a transaction.
    pub(crate) fn restore(mut self) {
        if let Some(session) = self.session.take()
            && !session.client.is_closed()
        {
            *self.pool.slots[self.slot].idle.lock().expect("not poisoned") = Some(session);
        }
    }
}
