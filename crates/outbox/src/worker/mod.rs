//! Consumer workers: read events from a broker, run the side effect through
//! the [`Inbox`](crate::Inbox) in one PostgreSQL transaction, and
//! acknowledge to the broker only after that transaction committed.
//!
//! The order is the whole guarantee. A worker that dies after the commit
//! and before the acknowledgement leaves the message unacknowledged; the
//! broker (or another worker) delivers it again, the inbox finds its
//! event_id and the side effect does not run twice. A worker that dies
//! before the commit loses nothing either: the transaction rolls back and
//! the redelivery runs the effect for the first time.

#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "redis")]
pub mod redis;

use serde_json::Value;
use uuid::Uuid;

/// One event as a worker hands it to the side effect.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The idempotency key the inbox records.
    pub event_id: Uuid,
    /// The aggregate the event belongs to.
    pub aggregate_id: String,
    /// What happened, e.g. `OrderPaid`.
    pub event_type: String,
    /// The event's JSON payload.
    pub payload: Value,
    /// The `headers` column (trace context and the like); `{}` when absent.
    pub headers: Value,
    /// Where the broker keeps it (a Redis entry id, a JetStream sequence).
    pub position: String,
}

/// What a worker has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Side effects run (first deliveries).
    pub processed: u64,
    /// Redeliveries the inbox recognised; acknowledged without an effect.
    pub duplicates: u64,
    /// Messages taken over from a consumer that left them unacknowledged
    /// (Redis: claimed; NATS: delivered more than once).
    pub claimed: u64,
    /// Messages that were not outbox events; moved aside, acknowledged.
    pub malformed: u64,
}

/// Why a worker stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The broker failed.
    #[error("{doing}: {message}")]
    Broker {
        /// What the worker was doing.
        doing: &'static str,
        /// The broker's error.
        message: String,
    },
    /// PostgreSQL failed (the message stays unacknowledged).
    #[error(transparent)]
    Outbox(#[from] crate::Error),
}
