//! The relay's PostgreSQL session and what wakes it: LISTEN/NOTIFY plus a
//! jittered fallback poll.
//!
//! The session is one connection that both claims batches and listens. A task
//! drives the connection and turns each notification into a permit in a
//! one-slot channel, so a burst of commits coalesces into one wake-up. The
//! channel closes when the connection dies, which the relay sees as
//! [`Wake::ConnectionLost`] and answers by reconnecting.
//!
//! The fallback poll is not optional: a notification sent while the relay is
//! reconnecting is lost (PostgreSQL only queues them for listening sessions),
//! and rows waiting for a retry produce no notification at all.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use rand::Rng;
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client};
use tokio_util::sync::CancellationToken;

/// Why [`Wakeups::wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// A NOTIFY arrived on the channel.
    Notified,
    /// The poll timer (or a retry deadline) expired.
    Timer,
    /// Shutdown was requested.
    Cancelled,
    /// The connection is gone.
    ConnectionLost,
}

/// Notifications from one connection.
pub(crate) struct Wakeups {
    rx: mpsc::Receiver<()>,
    /// A notification asked for a sweep ([`outbox::sql::NOTIFY_SWEEP`]);
    /// kept apart from `rx`, which [`Wakeups::drain`] empties.
    sweep: Arc<AtomicBool>,
}

/// Connects and starts the task that drives the connection; the caller sets
/// the session up (`outbox::sql::setup_batch_session`, `outbox::sql::listen`).
pub(crate) async fn connect(pg: &crate::pg::PgConfig) -> Result<(Client, Wakeups), tokio_postgres::Error> {
    let (client, mut connection) = crate::pg::open(pg).await?;
    let (tx, rx) = mpsc::channel(1);
    let sweep = Arc::new(AtomicBool::new(false));
    let asked = Arc::clone(&sweep);
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(n)) => {
                    if n.payload() == outbox::sql::NOTIFY_SWEEP {
                        asked.store(true, Ordering::Relaxed);
                    }
                    // A full slot already means "wake up"; more would add nothing.
                    let _ = tx.try_send(());
                }
                Ok(AsyncMessage::Notice(notice)) => {
                    tracing::debug!(%notice, "postgres notice");
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(error = %crate::error::error_chain(&error), "postgres connection closed");
                    break;
                }
            }
        }
    });
    Ok((client, Wakeups { rx, sweep }))
}

impl Wakeups {
    /// Forgets pending notifications: the claim that follows sees every row
    /// committed before it. Returns false if the connection is gone.
    pub(crate) fn drain(&mut self) -> bool {
        loop {
            match self.rx.try_recv() {
                Ok(()) => continue,
                Err(mpsc::error::TryRecvError::Empty) => return true,
                Err(mpsc::error::TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Whether a notification asked for a sweep since the last call.
    pub(crate) fn take_sweep(&self) -> bool {
        self.sweep.swap(false, Ordering::Relaxed)
    }

    /// Waits for a notification, `timeout`, or cancellation, whichever is first.
    pub(crate) async fn wait(&mut self, timeout: Duration, cancel: &CancellationToken) -> Wake {
        // All three branches are cancel-safe: a dropped recv loses no message.
        tokio::select! {
            _ = cancel.cancelled() => Wake::Cancelled,
            message = self.rx.recv() => match message {
                Some(()) => Wake::Notified,
                None => Wake::ConnectionLost,
            },
            _ = tokio::time::sleep(timeout) => Wake::Timer,
        }
    }
}

/// The fallback poll interval minus up to 10%, so several relays started
/// together drift apart instead of polling in lockstep.
pub(crate) fn jittered(interval: Duration) -> Duration {
    interval.mul_f64(1.0 - rand::rng().random_range(0.0..0.1))
}
