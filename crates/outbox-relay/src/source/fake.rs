//! A source over an in-memory table, for testing the relay's cycle without
//! PostgreSQL or a process (river's driver tests, at the unit level).
//!
//! [`FakeSource`] keeps the [contract](super#receipts) the real sources
//! keep, the way the polling source does: a batch handed out stays claimed
//! (locked, nothing of it durable) until its [`Plan`] is settled and then
//! committed, which happens at the next claim, overlap, hold or finish; a
//! commit applies the plan's outcomes to the table and only then hands a
//! [`Receipt`](super::Receipt) to its [`Receipts`]; a batch given back, or
//! everything in flight at [`Source::recover`], returns to the table unsent.
//!
//! What it does not model: connections, partition leases and deadline
//! claims (only their lapsing, on request), the byte bound of a claim,
//! wake-ups (an idle claim sleeps until the
//! soonest retry comes due, or shutdown).
//!
//! Every call it sees, and every call of the fake sink that shares its
//! [`Journal`], is recorded in order, so a test asserts on the order of
//! delivery and commit; [`FakeTable::fail_commits`] and
//! [`FakeTable::refuse_delivery`] inject the faults a test needs.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::OutboxRow;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Batch, Claim, Outcomes, Receipts, Source, SourceError};
use crate::plan::Plan;
use crate::sink::Delivery;

/// One call seen by the fake source or the fake sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    /// The source claimed these rows ahead, while a batch was at the sink.
    ClaimedAhead(Vec<i64>),
    /// The source handed out batch `batch`.
    HandedOut {
        batch: u64,
        ids: Vec<i64>,
        overlapped: bool,
    },
    /// The sink was called with these rows.
    Sent(Vec<i64>),
    /// The sink answered: each row's id and answer.
    Answered(Vec<(i64, Delivery)>),
    /// The sink answered a probe: whether it is available.
    Probed(bool),
    /// The relay settled batch `batch`.
    Settled(u64),
    /// Batch `batch` was committed: these rows are marked published.
    Committed { batch: u64, published: Vec<i64> },
    /// The commit of batch `batch` failed: nothing of it is durable.
    CommitFailed(u64),
    /// A batch (handed out, or claimed ahead with no number) went back to
    /// the table unsent.
    GivenBack { batch: Option<u64>, ids: Vec<i64> },
    /// The relay paused (the sink is unavailable).
    Held,
    /// The relay recovered from a failed operation.
    Recovered,
    /// The relay finished.
    Finished,
}

/// The calls seen, in order, each with the (possibly paused) time it was
/// seen at. Shared by the fake source and the fake sink.
#[derive(Debug, Clone, Default)]
pub(crate) struct Journal(Arc<Mutex<Vec<(Instant, Event)>>>);

impl Journal {
    pub(crate) fn push(&self, event: Event) {
        lock(&self.0).push((Instant::now(), event));
    }

    /// The events so far.
    pub(crate) fn events(&self) -> Vec<Event> {
        lock(&self.0).iter().map(|(_, e)| e.clone()).collect()
    }

    /// The events so far, with when they were seen.
    pub(crate) fn timed(&self) -> Vec<(Instant, Event)> {
        lock(&self.0).clone()
    }

    /// Each call of the sink: the rows it was given.
    pub(crate) fn sent(&self) -> Vec<Vec<i64>> {
        self.events()
            .into_iter()
            .filter_map(|e| match e {
                Event::Sent(ids) => Some(ids),
                _ => None,
            })
            .collect()
    }
}

/// A poisoned lock only means another test thread panicked: the data is
/// still what it was, and that test already failed.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One row of the fake table: the event and the columns the relay writes.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub(crate) row: OutboxRow,
    /// `published_at IS NOT NULL`.
    pub(crate) published: bool,
    /// `dead_at IS NOT NULL`.
    pub(crate) dead: bool,
    pub(crate) last_error: Option<String>,
    /// `next_attempt_at`.
    pub(crate) next_attempt: Instant,
    /// The delay the last failure was given.
    pub(crate) delay: Option<Duration>,
    /// Claimed by a batch in flight (locked).
    pub(crate) locked: bool,
}

#[derive(Debug)]
struct State {
    rows: Vec<Stored>,
    /// Commits still to fail.
    fail_commits: u32,
    /// Batches still to refuse delivery of ([`Source::may_deliver`]).
    refuse_delivery: u32,
    /// Batches still to stop vouching for during delivery
    /// ([`Source::lapse`]).
    lapse: u32,
}

/// The table behind a [`FakeSource`], shared with the test.
#[derive(Debug, Clone)]
pub(crate) struct FakeTable {
    state: Arc<Mutex<State>>,
    /// The number of commits so far, for tests that wait on progress.
    commits: Arc<watch::Sender<u64>>,
}

impl FakeTable {
    /// A table holding `rows`, all unpublished and due now.
    pub(crate) fn new(rows: impl IntoIterator<Item = OutboxRow>) -> Self {
        let now = Instant::now();
        let rows = rows
            .into_iter()
            .map(|row| Stored {
                row,
                published: false,
                dead: false,
                last_error: None,
                next_attempt: now,
                delay: None,
                locked: false,
            })
            .collect();
        Self {
            state: Arc::new(Mutex::new(State {
                rows,
                fail_commits: 0,
                refuse_delivery: 0,
                lapse: 0,
            })),
            commits: Arc::new(watch::channel(0).0),
        }
    }

    /// The next `n` commits fail (nothing of them becomes durable).
    pub(crate) fn fail_commits(&self, n: u32) {
        lock(&self.state).fail_commits = n;
    }

    /// The next `n` batches handed out may not be delivered.
    pub(crate) fn refuse_delivery(&self, n: u32) {
        lock(&self.state).refuse_delivery = n;
    }

    /// The next `n` batches delivered lapse at once: the source stops
    /// vouching for them (a lease or deadline ran out) during delivery.
    pub(crate) fn lapse(&self, n: u32) {
        lock(&self.state).lapse = n;
    }

    /// The rows as they are now, in id order.
    pub(crate) fn rows(&self) -> Vec<Stored> {
        lock(&self.state).rows.clone()
    }

    /// Row `id` as it is now.
    pub(crate) fn row(&self, id: i64) -> Stored {
        self.rows()
            .into_iter()
            .find(|s| s.row.id == id)
            .unwrap_or_else(|| panic!("no row {id} in the fake table"))
    }

    /// The ids of the published rows.
    pub(crate) fn published(&self) -> Vec<i64> {
        self.rows()
            .iter()
            .filter(|s| s.published)
            .map(|s| s.row.id)
            .collect()
    }

    /// Waits until `done` holds of the rows, checking after each commit;
    /// panics with `what` after `within` (of paused time, where paused).
    pub(crate) async fn until(&self, what: &str, within: Duration, done: impl Fn(&[Stored]) -> bool) {
        let mut commits = self.commits.subscribe();
        let wait = async {
            while !done(&lock(&self.state).rows) {
                commits.changed().await.expect("the table outlives the wait");
            }
        };
        tokio::time::timeout(within, wait)
            .await
            .unwrap_or_else(|_| panic!("timed out waiting until {what}: {:#?}", self.rows()));
    }

    /// Locks up to `limit` due rows in id order; their rows and unlocked
    /// clones, or None if nothing is due.
    fn claim(&self, limit: usize) -> Option<(Vec<i64>, Vec<OutboxRow>)> {
        let now = Instant::now();
        let mut state = lock(&self.state);
        let due = state
            .rows
            .iter_mut()
            .filter(|s| !s.published && !s.dead && !s.locked && s.next_attempt <= now)
            .take(limit);
        let mut ids = Vec::new();
        let mut rows = Vec::new();
        for s in due {
            s.locked = true;
            ids.push(s.row.id);
            rows.push(s.row.clone());
        }
        (!ids.is_empty()).then_some((ids, rows))
    }

    /// Rolls back the claim on `ids`: unlocked, unchanged.
    fn release(&self, ids: &[i64]) {
        for s in lock(&self.state).rows.iter_mut() {
            if ids.contains(&s.row.id) {
                s.locked = false;
            }
        }
    }

    fn release_all(&self) {
        for s in lock(&self.state).rows.iter_mut() {
            s.locked = false;
        }
    }

    /// When the soonest row waiting for a retry comes due.
    fn soonest(&self) -> Option<Instant> {
        lock(&self.state)
            .rows
            .iter()
            .filter(|s| !s.published && !s.dead)
            .map(|s| s.next_attempt)
            .min()
    }

    /// Applies a settled batch's outcomes, the way `MARK_FAILED` and the
    /// publish mark do, and unlocks its rows: the ids marked published, or
    /// None (the rows only unlocked, as by a rollback) when an injected
    /// failure says the commit fails.
    fn commit(&self, ids: &[i64], outcomes: &Outcomes) -> Option<Vec<i64>> {
        let now = Instant::now();
        let mut state = lock(&self.state);
        let failed = state.fail_commits > 0;
        if failed {
            state.fail_commits -= 1;
        }
        let f = &outcomes.failures;
        let mut published = Vec::new();
        for s in state.rows.iter_mut().filter(|s| ids.contains(&s.row.id)) {
            s.locked = false;
            if failed {
                continue;
            }
            match f.ids.iter().position(|id| *id == s.row.id) {
                Some(k) => {
                    let delay = Duration::from_secs_f64(f.delay_ms[k] / 1000.0);
                    s.row.attempts = f.attempts[k];
                    s.last_error = Some(f.errors[k].clone());
                    s.dead = f.dead_letter[k];
                    s.next_attempt = now + delay;
                    s.delay = Some(delay);
                }
                None => {
                    s.published = true;
                    published.push(s.row.id);
                }
            }
        }
        drop(state);
        if !failed {
            self.commits.send_modify(|n| *n += 1);
        }
        (!failed).then_some(published)
    }
}

/// A batch in flight: its number once handed out, and its rows' ids.
#[derive(Debug)]
struct InFlight {
    batch: u64,
    ids: Vec<i64>,
    /// When it was handed out.
    claimed_at: std::time::Instant,
}

/// A batch claimed ahead, not handed out yet.
#[derive(Debug)]
struct Ahead {
    ids: Vec<i64>,
    rows: Vec<OutboxRow>,
}

/// See the [module docs](self).
pub(crate) struct FakeSource {
    table: FakeTable,
    journal: Journal,
    receipts: Receipts,
    batch_size: usize,
    drain: bool,
    ahead: Option<Ahead>,
    at_sink: Option<InFlight>,
    settled: Option<(InFlight, Outcomes)>,
}

impl FakeSource {
    pub(crate) fn new(
        table: FakeTable,
        journal: Journal,
        receipts: Receipts,
        batch_size: u32,
        drain: bool,
    ) -> Self {
        Self {
            table,
            journal,
            receipts,
            batch_size: batch_size as usize,
            drain,
            ahead: None,
            at_sink: None,
            settled: None,
        }
    }

    fn hand_out(&mut self, ids: Vec<i64>, rows: Vec<OutboxRow>, overlapped: bool) -> Claim {
        let batch = self.receipts.next_batch();
        self.journal.push(Event::HandedOut {
            batch,
            ids: ids.clone(),
            overlapped,
        });
        let full = rows.len() == self.batch_size;
        self.at_sink = Some(InFlight {
            batch,
            ids,
            claimed_at: std::time::Instant::now(),
        });
        Claim::Batch(Batch {
            rows: rows.into(),
            unreadable: Vec::new(),
            full,
            overlapped,
            claim: None,
        })
    }

    /// Commits the settled batch, if any, and hands out its receipt.
    fn commit_settled(&mut self) -> Result<(), SourceError> {
        let Some((batch, outcomes)) = self.settled.take() else {
            return Ok(());
        };
        let Some(published) = self.table.commit(&batch.ids, &outcomes) else {
            self.journal.push(Event::CommitFailed(batch.batch));
            return Err(SourceError::ConnectionLost);
        };
        self.journal.push(Event::Committed {
            batch: batch.batch,
            published,
        });
        self.receipts
            .durable(batch.batch, batch.ids.len(), batch.claimed_at, outcomes);
        Ok(())
    }

    fn release_ahead(&mut self) {
        if let Some(ahead) = self.ahead.take() {
            self.table.release(&ahead.ids);
            self.journal.push(Event::GivenBack {
                batch: None,
                ids: ahead.ids,
            });
        }
    }
}

impl Source for FakeSource {
    async fn claim(&mut self, cancel: &CancellationToken) -> Result<Claim, SourceError> {
        if let Some(ahead) = self.ahead.take() {
            return Ok(self.hand_out(ahead.ids, ahead.rows, true));
        }
        self.commit_settled()?;
        if let Some((ids, rows)) = self.table.claim(self.batch_size) {
            return Ok(self.hand_out(ids, rows, false));
        }
        if self.drain {
            return Ok(Claim::Drained);
        }
        let due = async {
            match self.table.soonest() {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = due => Ok(Claim::Empty),
            () = cancel.cancelled() => Ok(Claim::Cancelled),
        }
    }

    fn may_deliver(&self) -> bool {
        let mut state = lock(&self.table.state);
        if state.refuse_delivery > 0 {
            state.refuse_delivery -= 1;
            return false;
        }
        true
    }

    async fn give_back(&mut self) -> Result<(), SourceError> {
        if let Some(b) = self.at_sink.take() {
            self.table.release(&b.ids);
            self.journal.push(Event::GivenBack {
                batch: Some(b.batch),
                ids: b.ids,
            });
        }
        Ok(())
    }

    fn lapse(&self) -> BoxFuture<'static, ()> {
        let mut state = lock(&self.table.state);
        if state.lapse > 0 {
            state.lapse -= 1;
            return std::future::ready(()).boxed();
        }
        std::future::pending().boxed()
    }

    async fn overlap(&mut self, full: bool) -> Result<(), SourceError> {
        if self.at_sink.is_none() {
            return Ok(());
        }
        self.commit_settled()?;
        if full && let Some((ids, rows)) = self.table.claim(self.batch_size) {
            self.journal.push(Event::ClaimedAhead(ids.clone()));
            self.ahead = Some(Ahead { ids, rows });
        }
        Ok(())
    }

    fn settle(&mut self, plan: Plan) {
        if let Some(b) = self.at_sink.take() {
            self.journal.push(Event::Settled(b.batch));
            self.settled = Some((b, Outcomes::from_plan(plan)));
        }
    }

    async fn hold(&mut self) -> Result<(), SourceError> {
        self.release_ahead();
        self.commit_settled()?;
        self.journal.push(Event::Held);
        Ok(())
    }

    async fn recover(&mut self, _error: SourceError, cancel: &CancellationToken) -> bool {
        self.ahead = None;
        self.at_sink = None;
        self.settled = None;
        self.table.release_all();
        self.journal.push(Event::Recovered);
        !cancel.is_cancelled()
    }

    async fn finish(&mut self) {
        self.release_ahead();
        // As the polling source: a failed last commit is redelivered later.
        let _ = self.commit_settled();
        self.journal.push(Event::Finished);
    }
}
