//! Where batches come from, and where what became of each row is recorded.
//!
//! A [`Source`] yields claimed batches and is told the outcome of every row
//! ([`Plan`]: delivered, retry at, permanent, held back). It owns everything
//! on the PostgreSQL side of the cycle: waiting for work, claiming, the
//! transaction a batch lives in, and the commit that makes its marks
//! durable. The relay loop owns the rest (hold-back, delivery, planning) and
//! never sees a connection.
//!
//! The contract that keeps delivery at least once: a batch handed out by
//! [`Source::claim`] stays claimed (nobody else can deliver it, and nothing
//! of it is durable) until the [`Plan`] passed to [`Source::settle`] is
//! committed; any failure before that commit gives the whole batch back.
//!
//! # Receipts
//!
//! Once a settled batch is durable, the source hands it back as a
//! [`Receipt`] through the [`Receipts`] the relay gave it when it opened:
//! its number, rows, outcomes and timings, at the moment it became durable
//! (not at the next claim, which may wait for minutes). The relay turns
//! receipts, and nothing else, into counters, metrics, log lines and
//! signals (`Books` in `relay.rs`), so a source owns PostgreSQL and no
//! bookkeeping, and a batch has one owner from claim to receipt. A batch
//! that never becomes durable (rolled back, read again) has no receipt: it
//! is delivered again, and booked then.
//!
//! # Adding a source
//!
//! A third source is one file (or folder) here implementing [`Source`], and
//! one arm in `Relay::run` opening it for its [`SourceKind`]. It gets the
//! relay's [`RelayContext`](crate::RelayContext) to report its PostgreSQL
//! session's health (`health().postgres`) and send signals; it must keep
//! the contract above, and hand out a receipt for each settled batch once,
//! and only once, it is durable.
//!
//! [`poll`] claims with `FOR UPDATE SKIP LOCKED` (or by deadline) and
//! partition leases, woken by LISTEN/NOTIFY. [`wal`] reads a logical
//! replication slot: its "claim" is the slot itself, and its "commit" the
//! write of its outcomes, which the confirmed position follows.
//!
//! [`SourceKind`]: crate::SourceKind

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use outbox::OutboxRow;
use tokio_util::sync::CancellationToken;

use crate::error::RelayError;
use crate::metric::Tally;
use crate::plan::{Failures, Plan};

#[cfg(test)]
pub(crate) mod fake;
pub(crate) mod poll;
pub(crate) mod tenant;
pub(crate) mod wal;

/// A claimed batch, handed to the relay for delivery.
#[derive(Debug)]
pub(crate) struct Batch {
    /// The rows, in delivery order. Shared: the WAL source keeps them to
    /// retry the ones that fail.
    pub(crate) rows: Arc<[OutboxRow]>,
    /// Rows whose payload or headers cannot be read (index, why): dead
    /// letters unsent.
    pub(crate) unreadable: Vec<(usize, String)>,
    /// The claim filled the batch: more rows are probably due, so the next
    /// batch is claimed while this one is at the sink.
    pub(crate) full: bool,
    /// Claimed while the previous batch was at the sink, before its
    /// outcomes were committed: rows of aggregates that batch blocked must
    /// be held back.
    pub(crate) overlapped: bool,
    /// The claim's round trip (sent, answered), for its span; None for a
    /// source with no claim of its own (the WAL's stream).
    pub(crate) claim: Option<(Instant, Instant)>,
}

/// A settled batch, handed back by its source once its outcomes are
/// durable (see the [module docs](self#receipts)).
#[derive(Debug)]
pub(crate) struct Receipt {
    /// The batch's number in its source, from 1.
    pub(crate) batch: u64,
    /// The outbox it came from, when a source reads several (a fleet's
    /// WAL stream): its `outbox` label. None: the relay's own.
    pub(crate) outbox: Option<String>,
    /// Rows claimed.
    pub(crate) claimed: usize,
    /// Rows marked published (or, for the WAL source, deleted).
    pub(crate) published: usize,
    /// The rows that failed, and what became of them.
    pub(crate) failures: Failures,
    /// Outcomes per aggregate type, for the metrics.
    pub(crate) tallies: Vec<Tally>,
    /// When the batch was handed to the relay.
    pub(crate) claimed_at: Instant,
    /// When its outcomes became durable.
    pub(crate) durable_at: Instant,
    /// Its timings and events, while tracing is on.
    pub(crate) trace: Option<Box<crate::trace::BatchTrace>>,
}

/// Whoever turns receipts into counters, metrics, logs and signals: the
/// relay's `Books`.
pub(crate) trait Book: Send + Sync {
    /// Books one durable batch.
    fn book(&mut self, receipt: Receipt);
}

/// Numbers the batches of one source and hands each receipt to the relay.
pub(crate) struct Receipts {
    last: u64,
    books: Box<dyn Book>,
}

impl Receipts {
    pub(crate) fn new(books: impl Book + 'static) -> Self {
        Self {
            last: 0,
            books: Box::new(books),
        }
    }

    /// The number of the next batch handed out.
    pub(crate) fn next_batch(&mut self) -> u64 {
        self.last += 1;
        self.last
    }

    /// Batch `batch`'s `outcomes` are durable now.
    pub(crate) fn durable(&mut self, batch: u64, claimed: usize, claimed_at: Instant, outcomes: Outcomes) {
        self.durable_of(None, batch, claimed, claimed_at, outcomes);
    }

    /// Batch `batch` of the outbox labelled `outbox` (None: the relay's
    /// own) is durable now.
    pub(crate) fn durable_of(
        &mut self,
        outbox: Option<String>,
        batch: u64,
        claimed: usize,
        claimed_at: Instant,
        outcomes: Outcomes,
    ) {
        self.books.book(Receipt {
            batch,
            outbox,
            claimed,
            published: outcomes.published,
            failures: outcomes.failures,
            tallies: outcomes.tallies,
            claimed_at,
            durable_at: Instant::now(),
            trace: outcomes.trace,
        });
    }
}

/// What a receipt needs of a [`Plan`]: its outcomes, without the
/// aggregates it blocks (the relay keeps those).
#[derive(Debug, Default)]
pub(crate) struct Outcomes {
    pub(crate) published: usize,
    pub(crate) failures: Failures,
    pub(crate) tallies: Vec<Tally>,
    pub(crate) trace: Option<Box<crate::trace::BatchTrace>>,
}

impl Outcomes {
    pub(crate) fn from_plan(plan: Plan) -> Self {
        Self {
            published: plan.published,
            failures: plan.failures,
            tallies: plan.tallies,
            trace: plan.trace,
        }
    }

    /// The round trip that makes these outcomes durable is sent now: where
    /// the batch's `outbox.mark` span starts (when it is traced).
    pub(crate) fn marking(&mut self) {
        if let Some(trace) = &mut self.trace {
            trace.marking = Instant::now();
        }
    }
}

/// What [`Source::claim`] found.
#[derive(Debug)]
pub(crate) enum Claim {
    /// A batch to deliver.
    Batch(Batch),
    /// Nothing due now; the next claim waits for a wake-up first.
    Empty,
    /// Nothing due and the relay runs with `drain`: stop.
    Drained,
    /// Shutdown was requested while waiting.
    Cancelled,
}

/// Why a source operation failed. Either way the batches in flight are
/// given back: rolled back, and claimed again later.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SourceError {
    /// A statement failed.
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    /// The connection went away while waiting.
    #[error("the postgres connection was lost")]
    ConnectionLost,
    /// The replication stream failed.
    #[error("the replication stream failed")]
    Replication(#[source] pgwire_replication::PgWireError),
    /// None of the URL's hosts is a primary (a failover under way): the
    /// replication connection has nowhere to go yet. What each said.
    #[error("none of the hosts takes writes yet: {0}")]
    NoPrimary(String),
    /// pgoutput sent what the relay cannot decode.
    #[error("{0}")]
    Decode(String),
    /// What reconnecting cannot fix (with `--wal-cleanup none`, a slot
    /// invalidated or dropped): the relay stops with it.
    #[error(transparent)]
    Fatal(RelayError),
}

/// The PostgreSQL side of the relay's cycle.
pub(crate) trait Source: Send {
    /// The next batch: the one claimed during the last delivery if there is
    /// one; otherwise, once the last settled batch is committed and (after
    /// a claim that found little) a wake-up came, a fresh claim.
    fn claim(
        &mut self,
        cancel: &CancellationToken,
    ) -> impl Future<Output = Result<Claim, SourceError>> + Send;

    /// Whether the batch just handed out may still be delivered: false when
    /// the source can no longer vouch that nobody else owns its rows.
    fn may_deliver(&self) -> bool;

    /// Gives the batch just handed out back, unsent.
    fn give_back(&mut self) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Resolves if, during delivery, the source stops vouching for the batch
    /// at the sink (a lease ran out). Owned, so it runs beside
    /// [`Source::overlap`].
    fn lapse(&self) -> BoxFuture<'static, ()>;

    /// Runs while the batch is at the sink: commits the previous batch's
    /// outcomes and, when the batch is `full`, claims the next one.
    fn overlap(&mut self, full: bool) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// What became of each row of the batch at the sink. Durable once
    /// committed: with the next claim, or before the next wait.
    fn settle(&mut self, plan: Plan);

    /// Before a pause (the sink is unavailable): commits the settled batch
    /// and gives back one claimed ahead, so no transaction stays open while
    /// nothing is delivered; the next [`Source::claim`] claims at once.
    fn hold(&mut self) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// After a failed operation: gives back everything in flight and gets
    /// ready to claim again. False if shutdown was requested meanwhile.
    fn recover(
        &mut self,
        error: SourceError,
        cancel: &CancellationToken,
    ) -> impl Future<Output = bool> + Send;

    /// At shutdown: commits the settled batch, gives back a claimed one.
    fn finish(&mut self) -> impl Future<Output = ()> + Send;
}

/// Consumers of a sink many outboxes share must tell their events apart:
/// every event a fleet delivers carries the header [`OUTBOX_HEADER`] naming
/// its outbox (its `outbox` label), in every format and sink that carries
/// the row's headers. It replaces a header of that name the writer set, so
/// a consumer can trust it.
pub(crate) fn name_the_outbox(row: &mut OutboxRow, label: &str) {
    let value = serde_json::Value::String(label.to_owned());
    match row.headers.as_object_mut() {
        Some(headers) => {
            headers.insert(OUTBOX_HEADER.to_owned(), value);
        }
        // The table's contract makes headers an object; anything else was
        // never one a consumer could read.
        None => row.headers = serde_json::json!({ OUTBOX_HEADER: value }),
    }
}

/// See [`name_the_outbox`].
pub(crate) const OUTBOX_HEADER: &str = "outbox";
