//! Whose turn it is to read the slot: one reader, any number of standbys.
//!
//! PostgreSQL lets one session stream a slot at a time, which already keeps
//! two relays from reading it together. What it does not do is notice a
//! reader that froze (SIGSTOP, a VM paused, a partition): its session stays
//! open and the slot stays taken until `wal_sender_timeout`, and when the
//! reader wakes it could deliver what it had read. So the turn is a session
//! advisory lock keyed by the slot, on a connection of its own that runs a
//! heartbeat query every third of the lease timeout.
//!
//! - A standby tries the lock every third of the timeout. When the holder
//!   died, its sessions closed and the lock is free: the standby takes over
//!   at its next try.
//! - When the holder's session has been silent for two thirds of the
//!   timeout (`pg_stat_activity.state_change`), the standby terminates it
//!   and the session streaming the slot, then takes the lock.
//! - The reader vouches for what it reads only until two thirds of the
//!   timeout after its last heartbeat was sent: the standby cannot have
//!   terminated it before then, since the server saw that heartbeat after
//!   it was sent. A reader whose heartbeat fails stops delivering when that
//!   runs out, as a polling relay does when its lease does.
//! - A reader whose lock session is closed (the server went away: a
//!   restart, a failover) holds nothing: the lock went with the session,
//!   and a standby may take it on the server that answers now. Its turn
//!   ends at once, and it queues for the turn again like any standby.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::sql::WalSql;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::context::RelayContext;
use crate::error::error_chain;
use crate::pg::PgConfig;

/// This relay holds the turn. Dropping it ends the heartbeat and closes
/// the lock's session, which hands the turn on.
pub(crate) struct Turn {
    valid_until: watch::Receiver<Instant>,
    /// The lock's session, shared with the heartbeat.
    session: Arc<Client>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}

/// How the turn is timed, from the lease timeout.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) timeout: Duration,
}

impl Timing {
    fn interval(self) -> Duration {
        self.timeout / 3
    }

    fn dead_after(self) -> Duration {
        self.timeout * 2 / 3
    }
}

impl Turn {
    /// Waits, as a standby, until this relay holds the turn. `None` if
    /// `cancel` fired first. A connection that fails is `ctx`'s PostgreSQL
    /// problem (`/readyz`) until one works.
    pub(crate) async fn take(
        pg: &PgConfig,
        sql: Arc<WalSql>,
        timing: Timing,
        ctx: &RelayContext,
        cancel: &CancellationToken,
    ) -> Option<Turn> {
        let mut said_standby = false;
        let mut client: Option<Client> = None;
        // A server that does not answer (restarting, or no primary yet
        // during a failover) is tried again sooner than the lock.
        let mut reconnect =
            crate::backoff::Doubling::new(crate::backoff::RECONNECT_FIRST, crate::backoff::RECONNECT_MAX);
        loop {
            if cancel.is_cancelled() {
                return None;
            }
            if client.as_ref().is_none_or(Client::is_closed) {
                client = match crate::pg::connect_once(pg).await {
                    Ok(c) => {
                        reconnect.reset();
                        Some(c)
                    }
                    Err(error) => {
                        let delay = reconnect.next_delay();
                        let problem = format!("reconnecting: {}", error_chain(&error));
                        ctx.health().postgres("", Some(problem));
                        warn!(
                            error = %error_chain(&error),
                            retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                            "the turn's connection failed; retrying"
                        );
                        tokio::select! {
                            () = cancel.cancelled() => return None,
                            () = tokio::time::sleep(delay) => {}
                        }
                        continue;
                    }
                };
            }
            if let Some(c) = &client {
                let sent = Instant::now();
                match Self::try_once(c, &sql, timing, &mut said_standby).await {
                    Ok(true) => {
                        let c = client.take().expect("connected");
                        info!(slot = sql.slot(), "reading the slot (this relay holds the turn)");
                        return Some(Self::hold(c, sql, timing, sent + timing.dead_after()));
                    }
                    Ok(false) => {}
                    Err(error) => {
                        warn!(error = %error_chain(&error), "checking whose turn it is failed; retrying");
                        client = None;
                    }
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return None,
                () = tokio::time::sleep(timing.interval()) => {}
            }
        }
    }

    /// One try: the lock, or else whether its holder went silent.
    async fn try_once(
        client: &Client,
        sql: &WalSql,
        timing: Timing,
        said_standby: &mut bool,
    ) -> Result<bool, tokio_postgres::Error> {
        if sql.try_turn(client).await? {
            return Ok(true);
        }
        let Some(holder) = sql.turn_holder(client).await? else {
            // Released between the two statements: the next try takes it.
            return Ok(false);
        };
        match holder.silent_secs {
            Some(silent) if silent > timing.dead_after().as_secs_f64() => {
                warn!(
                    slot = sql.slot(),
                    pid = holder.pid,
                    silent_seconds = silent,
                    "the reader went silent for longer than the lease timeout allows; taking over"
                );
                for pid in std::iter::once(holder.pid).chain(holder.streaming_pid) {
                    if !sql.terminate(client, pid).await? {
                        warn!(
                            pid,
                            "could not terminate the silent reader's session (another role?)"
                        );
                    }
                }
                // Its sessions are gone: take the lock now.
                sql.try_turn(client).await
            }
            None if !*said_standby => {
                warn!(
                    pid = holder.pid,
                    "standby: the reader's activity is not visible to this role (pg_read_all_stats), so a frozen reader cannot be detected"
                );
                *said_standby = true;
                Ok(false)
            }
            _ => {
                if !*said_standby {
                    info!(
                        slot = sql.slot(),
                        reader_pid = holder.pid,
                        "standby: another relay reads the slot"
                    );
                    *said_standby = true;
                }
                Ok(false)
            }
        }
    }

    /// Holds the turn on `client`, heartbeating until dropped.
    fn hold(client: Client, sql: Arc<WalSql>, timing: Timing, valid_until: Instant) -> Turn {
        let (tx, rx) = watch::channel(valid_until);
        let stop = CancellationToken::new();
        let session = Arc::new(client);
        let task = tokio::spawn(heartbeat(Arc::clone(&session), sql, timing, tx, stop.clone()));
        Turn {
            valid_until: rx,
            session,
            stop,
            task,
        }
    }

    /// Whether the standbys cannot yet have taken over: the lock's session
    /// is open and its heartbeat recent enough.
    pub(crate) fn is_valid(&self) -> bool {
        !self.session.is_closed() && *self.valid_until.borrow() > Instant::now()
    }

    /// Resolves once the turn ran out (heartbeats failed for too long).
    pub(crate) fn lapse(&self) -> BoxFuture<'static, ()> {
        let mut rx = self.valid_until.clone();
        async move {
            loop {
                let until = *rx.borrow_and_update();
                tokio::select! {
                    () = tokio::time::sleep_until(until) => {
                        if *rx.borrow() <= Instant::now() {
                            return;
                        }
                    }
                    changed = rx.changed() => {
                        if changed.is_err() {
                            // The heartbeat ended: what was granted still
                            // runs out at its time.
                            let until = *rx.borrow();
                            tokio::time::sleep_until(until).await;
                            return;
                        }
                    }
                }
            }
        }
        .boxed()
    }
}

/// The reader's heartbeat: one query per interval on the lock's session.
async fn heartbeat(
    client: Arc<Client>,
    sql: Arc<WalSql>,
    timing: Timing,
    valid_until: watch::Sender<Instant>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(timing.interval()) => {}
        }
        let sent = Instant::now();
        let beat = tokio::time::timeout(timing.interval(), sql.heartbeat(&*client)).await;
        match beat {
            Ok(Ok(())) => {
                debug!(slot = sql.slot(), "turn heartbeat");
                valid_until.send_replace(sent + timing.dead_after());
            }
            Ok(Err(error)) => {
                warn!(error = %error_chain(&error), "the turn's heartbeat failed; this relay stops reading when its turn runs out");
                return;
            }
            Err(_) => {
                warn!("the turn's heartbeat timed out; this relay stops reading when its turn runs out");
                return;
            }
        }
    }
}
