//! Writer cost: how fast an application can enqueue, one connection,
//! committing each transaction.
//!
//! - `enqueue`, one event per transaction: the commit-bound common case;
//! - `enqueue_all`, 100 events per transaction: one `unnest` round trip;
//! - baseline: 100 `enqueue` calls in one transaction, a round trip each,
//!   which is what `enqueue_all` replaces.

use std::time::Instant;

use outbox::Event;
use serde::Serialize;

use super::event;
use crate::scratch::Scratch;

/// Events per transaction in the batched shapes.
const PER_TX: usize = 100;

/// How the writer enqueues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Shape {
    Single,
    EnqueueAll,
    EnqueueLoop,
}

impl Shape {
    pub(super) const ALL: [Shape; 3] = [Shape::Single, Shape::EnqueueAll, Shape::EnqueueLoop];

    pub(super) fn label(self) -> &'static str {
        match self {
            Shape::Single => "enqueue, 1 event/tx",
            Shape::EnqueueAll => "enqueue_all, 100 events/tx",
            Shape::EnqueueLoop => "enqueue ×100 in 1 tx (baseline)",
        }
    }

    pub(super) fn events_per_tx(self) -> usize {
        match self {
            Shape::Single => 1,
            Shape::EnqueueAll | Shape::EnqueueLoop => PER_TX,
        }
    }
}

/// What one writer run measured.
#[derive(Debug, Clone, Serialize)]
pub(super) struct WriterRun {
    pub(super) transactions: usize,
    pub(super) events: usize,
    pub(super) seconds: f64,
    /// Rows in the table afterwards: must equal `events`.
    pub(super) rows: u64,
}

/// Commits `transactions` transactions of `shape`.
pub(super) async fn measure(
    scratch: &mut Scratch,
    shape: Shape,
    transactions: usize,
) -> anyhow::Result<WriterRun> {
    scratch.clear().await?;
    let per_tx = shape.events_per_tx();
    let events: Vec<Event> = (0..transactions * per_tx).map(event).collect();
    let started = Instant::now();
    for chunk in events.chunks(per_tx) {
        let tx = scratch.db.transaction().await?;
        match shape {
            Shape::Single | Shape::EnqueueLoop => {
                for e in chunk {
                    scratch.outbox.enqueue(&tx, e).await?;
                }
            }
            Shape::EnqueueAll => {
                scratch.outbox.enqueue_all(&tx, chunk).await?;
            }
        }
        tx.commit().await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let rows = scratch.rows().await? as u64;
    Ok(WriterRun {
        transactions,
        events: events.len(),
        seconds,
        rows,
    })
}
