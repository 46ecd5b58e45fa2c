//! What the WAL source holds between the replication stream and the slot's
//! confirmed position: the events read and not yet finished, in commit
//! order, and the position that is safe to confirm.
//!
//! # Why the confirmed position never passes an unacknowledged event
//!
//! Every event belongs to the transaction it was committed in. A
//! transaction is finished when each of its events is: acknowledged by the
//! sink, or a dead letter recorded in the table. The confirmable position
//! is the commit end of the last transaction such that it and every one
//! before it are finished. Finishing also queues what the table must learn
//! (the delivered row's delete, the dead letter), and the source reports a
//! position to PostgreSQL only after those writes committed
//! ([`Window::take_writes`] hands both out together). So after a crash the
//! slot restarts at or before the first unfinished transaction: whatever
//! was unacknowledged is read again (at least once), and at most this
//! window is sent twice.
//!
//! # Order per aggregate
//!
//! A failed event parks its aggregate: later events of that aggregate wait
//! behind it, in order, until it is delivered or a dead letter, while other
//! aggregates go on. The wait is in memory and bounded by the window: once
//! `limit` events are unfinished, the source stops reading the stream, and
//! PostgreSQL keeps the WAL meanwhile.
//!
//! # Several outboxes
//!
//! A fleet's stream carries the events of every tenant outbox of a
//! database. Each event keeps its outbox's number: aggregates are told
//! apart per outbox, a batch holds the events of one outbox (its sink, its
//! metrics), and the writes a position waits for are each outbox's own.
//! The position is the stream's, so it passes a transaction only once
//! every outbox's events of it are finished and written.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::OutboxRow;
use outbox::sql::{ATTEMPT_LOG_ERROR, ATTEMPT_LOG_LEN};
use serde_json::Value;
use tokio::time::Instant;

use crate::plan::Failures;

/// An aggregate: (outbox, type, id).
type Key = (u32, String, String);

/// An event's aggregate.
fn key(outbox: u32, row: &OutboxRow) -> Key {
    (outbox, row.aggregate_type.clone(), row.aggregate_id.clone())
}

/// An event read from the stream.
#[derive(Debug)]
pub(crate) struct Event {
    /// Its transaction's number (position in `Window::txns`, offset).
    txn: u64,
    /// Its outbox (0 for a single outbox).
    outbox: u32,
    pub(crate) row: OutboxRow,
    /// The row's id in the table; `None` for an emitted event.
    pub(crate) table_id: Option<i64>,
    /// Why its payload or headers cannot be read: a dead letter, unsent.
    pub(crate) unreadable: Option<String>,
    /// Its payload's size as text, for `--batch-max-bytes`.
    pub(crate) bytes: u64,
    /// Its failed attempts so far, as the table's `attempt_log` keeps them:
    /// written with its dead letter.
    history: Vec<Value>,
}

/// The bookkeeping of an event at the sink (its row went with the batch).
#[derive(Debug)]
struct Out {
    txn: u64,
    outbox: u32,
    table_id: Option<i64>,
    bytes: u64,
    history: Vec<Value>,
}

/// A transaction's unfinished events.
#[derive(Debug)]
struct Txn {
    /// Its commit's end position; `None` until the commit was read.
    end: Option<u64>,
    unfinished: usize,
    /// Its events read so far.
    events: usize,
}

/// An aggregate whose events wait behind a failure.
#[derive(Debug)]
struct Parked {
    /// When its first event is due again.
    due: Instant,
    /// Its waiting events, in order.
    queue: VecDeque<Event>,
    /// Whether some of its events are at the sink now.
    out: bool,
}

/// A dead letter to record: the row's id, or the whole emitted event,
/// with its attempt history (a JSON array).
#[derive(Debug)]
pub(crate) enum Dead {
    /// A row of the table.
    Row {
        id: i64,
        attempts: i32,
        error: String,
        first_failed_at: Option<DateTime<Utc>>,
        history: Value,
    },
    /// An emitted event, which becomes a row.
    Emitted {
        row: OutboxRow,
        error: String,
        history: Value,
    },
}

/// What the tables must learn before a position may be confirmed: each
/// outbox's writes, by its number.
pub(crate) type Pending = std::collections::BTreeMap<u32, Writes>;

/// What one table must learn before a position may be confirmed.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    /// Delivered rows to delete (`--wal-cleanup delete`).
    pub(crate) delete: Vec<i64>,
    /// Dead letters to record.
    pub(crate) dead: Vec<Dead>,
}

impl Writes {
    pub(crate) fn is_empty(&self) -> bool {
        self.delete.is_empty() && self.dead.is_empty()
    }
}

/// A batch being put together.
struct Building {
    /// The outbox of its rows: one per batch.
    outbox: Option<u32>,
    rows: Vec<OutboxRow>,
    unreadable: Vec<(usize, String)>,
    bytes: u64,
    max_rows: usize,
    max_bytes: u64,
}

impl Building {
    /// Whether an event of `bytes` joins: always the first.
    fn fits(&self, bytes: u64) -> bool {
        self.rows.is_empty()
            || (self.rows.len() < self.max_rows && self.bytes.saturating_add(bytes) <= self.max_bytes)
    }

    fn take(&mut self, e: Event, out: &mut Vec<Out>) {
        self.bytes += e.bytes;
        self.outbox = Some(e.outbox);
        if let Some(why) = e.unreadable {
            self.unreadable.push((self.rows.len(), why));
        }
        out.push(Out {
            txn: e.txn,
            outbox: e.outbox,
            table_id: e.table_id,
            bytes: e.bytes,
            history: e.history,
        });
        self.rows.push(e.row);
    }
}

/// Appends a failed attempt to an event's history as the polling relay's
/// mark does (`ATTEMPT_LOG` in `outbox::sql`): the last
/// [`ATTEMPT_LOG_LEN`], the error cut at [`ATTEMPT_LOG_ERROR`] characters.
fn record(history: &mut Vec<Value>, attempt: i32, dead: bool, error: &str) {
    if history.len() >= ATTEMPT_LOG_LEN {
        history.remove(0);
    }
    let error: String = error.chars().take(ATTEMPT_LOG_ERROR).collect();
    history.push(serde_json::json!({
        "at": Utc::now(),
        "attempt": attempt,
        "outcome": if dead { "dead" } else { "retry" },
        "error": error,
    }));
}

/// The events between the stream and the confirmed position.
#[derive(Debug)]
pub(crate) struct Window {
    limit: usize,
    /// The payload bytes of unfinished events the window may hold: they
    /// are what is in memory (finished ones are dropped).
    max_bytes: u64,
    unfinished_bytes: u64,
    delete_delivered: bool,
    txns: VecDeque<Txn>,
    /// The number of `txns[0]`.
    first_txn: u64,
    /// Between a begin and its commit.
    in_txn: bool,
    /// Events not handed out yet, in commit order.
    fresh: VecDeque<Event>,
    parked: HashMap<Key, Parked>,
    /// The batch at the sink, in its order.
    out: Vec<Out>,
    unfinished: usize,
    /// The end of the last finished transaction not yet handed out by
    /// [`Window::take_writes`].
    confirmable: Option<u64>,
    /// Finished transactions whose end the server has not been sent yet,
    /// with their events: a crash now would re-send them, so they count
    /// against the window until [`Window::sent`] says the server has it.
    confirming: VecDeque<(u64, usize)>,
    unconfirmed: usize,
    /// Events read whose position the server has not been sent: what a
    /// crash now would make it send again.
    held: usize,
    writes: Pending,
}

impl Window {
    /// A window of at most `limit` events read and not confirmed, and
    /// `max_bytes` of unfinished payload (always one event).
    pub(crate) fn new(limit: usize, max_bytes: u64, delete_delivered: bool) -> Self {
        Self {
            limit: limit.max(1),
            max_bytes,
            unfinished_bytes: 0,
            delete_delivered,
            txns: VecDeque::new(),
            first_txn: 0,
            in_txn: false,
            fresh: VecDeque::new(),
            parked: HashMap::new(),
            out: Vec::new(),
            unfinished: 0,
            confirmable: None,
            confirming: VecDeque::new(),
            unconfirmed: 0,
            held: 0,
            writes: Pending::new(),
        }
    }

    /// Whether the stream may be read: fewer than `limit` events read whose
    /// position the server was not sent, finished or not. Or a transaction
    /// larger than that is being read and nothing else is held: it can only
    /// be confirmed once read whole, so it is (a crash re-sends it whole).
    pub(crate) fn has_room(&self) -> bool {
        let memory = self.unfinished_bytes < self.max_bytes;
        memory && (self.held < self.limit || (self.in_txn && self.txns.len() == 1 && self.unconfirmed == 0))
    }

    /// Whether room is only waiting for the server to be sent a position.
    pub(crate) fn awaits_confirmation(&self) -> bool {
        !self.has_room() && self.unconfirmed > 0
    }

    /// The replication client sent the server `lsn` as confirmed.
    pub(crate) fn sent(&mut self, lsn: u64) {
        while let Some(&(end, events)) = self.confirming.front() {
            if end > lsn {
                break;
            }
            self.unconfirmed -= events;
            self.held -= events;
            self.confirming.pop_front();
        }
    }

    /// Events read and not finished.
    pub(crate) fn unfinished(&self) -> usize {
        self.unfinished
    }

    /// Nothing read is unfinished, nothing is to be written, and no
    /// transaction is half read: the server's position may be confirmed.
    pub(crate) fn is_idle(&self) -> bool {
        self.unfinished == 0
            && !self.in_txn
            && self.txns.is_empty()
            && self.writes.values().all(Writes::is_empty)
    }

    /// A transaction starts.
    pub(crate) fn begin(&mut self) {
        self.in_txn = true;
        self.txns.push_back(Txn {
            end: None,
            unfinished: 0,
            events: 0,
        });
    }

    /// An event of outbox 0 (see [`Window::push_to`]).
    #[cfg(test)]
    pub(crate) fn push(
        &mut self,
        row: OutboxRow,
        table_id: Option<i64>,
        unreadable: Option<String>,
        bytes: u64,
    ) {
        self.push_to(0, row, table_id, unreadable, bytes);
    }

    /// An event of outbox `outbox` in the current transaction. Outside one
    /// (which pgoutput never does) it gets a transaction of its own at the
    /// next commit.
    pub(crate) fn push_to(
        &mut self,
        outbox: u32,
        row: OutboxRow,
        table_id: Option<i64>,
        unreadable: Option<String>,
        bytes: u64,
    ) {
        if !self.in_txn {
            self.begin();
        }
        let txn = self.first_txn + self.txns.len() as u64 - 1;
        let current = self.txns.back_mut().expect("begun");
        current.unfinished += 1;
        current.events += 1;
        self.unfinished += 1;
        self.unfinished_bytes += bytes;
        self.held += 1;
        self.fresh.push_back(Event {
            txn,
            outbox,
            row,
            table_id,
            unreadable,
            bytes,
            history: Vec::new(),
        });
    }

    /// The number of the newest transaction begun, if any was.
    pub(crate) fn last_txn(&self) -> Option<u64> {
        (self.first_txn + self.txns.len() as u64).checked_sub(1)
    }

    /// Whether transaction `txn` and every one before it are finished (their
    /// writes are then queued or taken).
    pub(crate) fn finished_through(&self, txn: u64) -> bool {
        self.first_txn > txn
    }

    /// The current transaction's commit, ending at `end`.
    pub(crate) fn commit(&mut self, end: u64) {
        if let Some(t) = self.txns.back_mut().filter(|_| self.in_txn) {
            t.end = Some(end);
        }
        self.in_txn = false;
        self.advance();
    }

    /// When the next parked aggregate is due, if one waits.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.parked
            .values()
            .filter(|p| !p.out && !p.queue.is_empty())
            .map(|p| p.due)
            .min()
    }

    /// Whether a batch could be handed out at `now`.
    pub(crate) fn has_ready(&self, now: Instant) -> bool {
        !self.fresh.is_empty() || self.next_due().is_some_and(|due| due <= now)
    }

    /// The next batch: the due parked aggregates' events first, then fresh
    /// ones in commit order, at most `max_rows` and, after the first,
    /// `max_bytes` of payload, all of one outbox (the first event's; the
    /// others' stay, in order, for the next batches). Fresh events of a
    /// parked aggregate join its queue instead. The rows go to the sink;
    /// [`Window::settle`] must follow before the next batch.
    pub(crate) fn next_batch(
        &mut self,
        now: Instant,
        max_rows: usize,
        max_bytes: u64,
    ) -> (Vec<OutboxRow>, Vec<(usize, String)>) {
        debug_assert!(self.out.is_empty(), "a batch is at the sink");
        let mut b = Building {
            outbox: None,
            rows: Vec::new(),
            unreadable: Vec::new(),
            bytes: 0,
            max_rows,
            max_bytes,
        };
        // Due aggregates, the one waiting longest first.
        let mut keys: Vec<(Instant, Key)> = self
            .parked
            .iter()
            .filter(|(_, p)| !p.out && p.due <= now && !p.queue.is_empty())
            .map(|(k, p)| (p.due, k.clone()))
            .collect();
        keys.sort();
        'keys: for (_, key) in keys {
            if b.outbox.is_some_and(|o| o != key.0) {
                continue;
            }
            let parked = self.parked.get_mut(&key).expect("listed");
            while let Some(e) = parked.queue.front() {
                if !b.fits(e.bytes) {
                    break 'keys;
                }
                let e = parked.queue.pop_front().expect("front");
                parked.out = true;
                b.take(e, &mut self.out);
            }
        }
        // Events of other outboxes are stepped over, not taken.
        let mut i = 0;
        while let Some(e) = self.fresh.get(i) {
            if let Some(parked) = self.parked.get_mut(&key(e.outbox, &e.row)) {
                let e = self.fresh.remove(i).expect("present");
                parked.queue.push_back(e);
                continue;
            }
            if b.outbox.is_some_and(|o| o != e.outbox) {
                i += 1;
                continue;
            }
            if !b.fits(e.bytes) {
                break;
            }
            let e = self.fresh.remove(i).expect("present");
            b.take(e, &mut self.out);
        }
        (b.rows, b.unreadable)
    }

    /// The outbox of the batch at the sink.
    pub(crate) fn out_outbox(&self) -> Option<u32> {
        self.out.first().map(|o| o.outbox)
    }

    /// What became of the batch at the sink (`rows`, as handed out):
    /// delivered rows and dead letters are finished, every other row parks
    /// its aggregate until its retry time.
    pub(crate) fn settle(&mut self, rows: &[OutboxRow], failures: &Failures, now: Instant) {
        let out = std::mem::take(&mut self.out);
        debug_assert_eq!(out.len(), rows.len());
        let mut failed = failures.positions.iter().enumerate().peekable();
        // Per aggregate, this batch's events that wait again, in order, and
        // the delay of the first.
        let mut waiting: HashMap<Key, (Duration, Vec<Event>)> = HashMap::new();
        for (i, (mut o, row)) in out.into_iter().zip(rows).enumerate() {
            let Some((k, _)) = failed.next_if(|(_, at)| **at == i) else {
                self.finish(&o, o.table_id.filter(|_| self.delete_delivered).map(Ok));
                continue;
            };
            let error = failures.errors[k].clone();
            let (attempts, dead) = (failures.attempts[k], failures.dead_letter[k]);
            if attempts > row.attempts {
                record(&mut o.history, attempts, dead, &error);
            }
            if dead {
                let history = Value::Array(std::mem::take(&mut o.history));
                let dead = match o.table_id {
                    Some(id) => Dead::Row {
                        id,
                        attempts,
                        error,
                        first_failed_at: failures.first_failed[k],
                        history,
                    },
                    None => Dead::Emitted {
                        row: OutboxRow {
                            attempts,
                            first_failed_at: failures.first_failed[k],
                            ..row.clone()
                        },
                        error,
                        history,
                    },
                };
                self.finish(&o, Some(Err(dead)));
                continue;
            }
            let delay = Duration::from_secs_f64(failures.delay_ms[k].max(0.0) / 1000.0);
            let entry = waiting
                .entry(key(o.outbox, row))
                .or_insert_with(|| (delay, Vec::new()));
            entry.1.push(Event {
                txn: o.txn,
                outbox: o.outbox,
                row: OutboxRow {
                    attempts,
                    first_failed_at: failures.first_failed[k],
                    ..row.clone()
                },
                table_id: o.table_id,
                unreadable: None,
                bytes: o.bytes,
                history: o.history,
            });
        }
        for (key, (delay, events)) in waiting {
            let parked = self.parked.entry(key).or_insert_with(|| Parked {
                due: now,
                queue: VecDeque::new(),
                out: false,
            });
            parked.due = now + delay;
            parked.out = false;
            for e in events.into_iter().rev() {
                parked.queue.push_front(e);
            }
        }
        // Aggregates whose events at the sink were all delivered: the ones
        // behind them are due now, or nothing waits any more.
        self.parked.retain(|_, p| {
            if p.out {
                p.out = false;
                p.due = now;
            }
            !p.queue.is_empty()
        });
    }

    /// Whether to flush while a batch is at the sink: nothing is to be
    /// written (confirming a position costs no round trip), dead letters
    /// are waiting, `rows` deletes piled up, or reading waits for a
    /// position to be confirmed.
    pub(crate) fn should_flush(&self, rows: usize) -> bool {
        let deletes: usize = self.writes.values().map(|w| w.delete.len()).sum();
        deletes == 0
            || self.writes.values().any(|w| !w.dead.is_empty())
            || deletes >= rows
            || !self.has_room()
    }

    /// The table's pending writes and the position that is confirmable once
    /// they committed.
    pub(crate) fn take_writes(&mut self) -> (Pending, Option<u64>) {
        (std::mem::take(&mut self.writes), self.confirmable.take())
    }

    /// Puts back writes that did not find their rows yet, with the
    /// position they were to confirm: it is confirmed once they do.
    pub(crate) fn restore(&mut self, writes: Pending, confirmable: Option<u64>) {
        let later = std::mem::replace(&mut self.writes, writes);
        for (outbox, later) in later {
            let w = self.writes.entry(outbox).or_default();
            w.delete.extend(later.delete);
            w.dead.extend(later.dead);
        }
        self.confirmable = self.confirmable.max(confirmable);
    }

    /// One event finished: delivered (with the row to delete, if any) or a
    /// dead letter.
    fn finish(&mut self, o: &Out, write: Option<Result<i64, Dead>>) {
        match write {
            Some(Ok(id)) => self.writes.entry(o.outbox).or_default().delete.push(id),
            Some(Err(dead)) => self.writes.entry(o.outbox).or_default().dead.push(dead),
            None => {}
        }
        let i = usize::try_from(o.txn - self.first_txn).expect("a transaction in the window");
        self.txns[i].unfinished -= 1;
        self.unfinished -= 1;
        self.unfinished_bytes -= o.bytes;
        self.advance();
    }

    /// Moves the confirmable position past every finished transaction at
    /// the front.
    fn advance(&mut self) {
        while let Some(t) = self.txns.front() {
            match t.end {
                Some(end) if t.unfinished == 0 => {
                    // A backfill's page (position 0) read after stream
                    // transactions confirms nothing of its own.
                    self.confirmable = Some(self.confirmable.map_or(end, |c| c.max(end)));
                    if t.events > 0 {
                        self.unconfirmed += t.events;
                        self.confirming.push_back((end, t.events));
                    }
                    self.txns.pop_front();
                    self.first_txn += 1;
                }
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Failures;
    use crate::plan::tests::row;

    /// Rows at `positions` failed with `delay`; the rest were delivered.
    fn failed(positions: &[usize], delay_ms: f64, dead: bool) -> Failures {
        let mut f = Failures::default();
        for &p in positions {
            f.positions.push(p);
            f.ids.push(0);
            f.errors.push("down".to_owned());
            f.attempts.push(1);
            f.first_failed.push(Some(chrono::Utc::now()));
            f.delay_ms.push(delay_ms);
            f.dead_letter.push(dead);
        }
        f
    }

    fn ids(rows: &[OutboxRow]) -> Vec<i64> {
        rows.iter().map(|r| r.id).collect()
    }

    /// Outbox 0's writes and the confirmable position.
    fn take(w: &mut Window) -> (Writes, Option<u64>) {
        let (mut writes, confirmable) = w.take_writes();
        (writes.remove(&0).unwrap_or_default(), confirmable)
    }

    #[test]
    fn a_batch_is_one_outboxs_and_the_position_waits_for_every_outbox() {
        let mut w = Window::new(100, u64::MAX, true);
        let now = Instant::now();
        w.begin();
        w.push_to(1, row(1, "a"), Some(1), None, 1);
        w.push_to(2, row(1, "a"), Some(1), None, 1);
        w.push_to(1, row(2, "a"), Some(2), None, 1);
        w.commit(10);
        let (rows, _) = w.next_batch(now, 10, u64::MAX);
        assert_eq!(
            (ids(&rows), w.out_outbox()),
            (vec![1, 2], Some(1)),
            "outbox 1's, in order"
        );
        // Outbox 1's aggregate "a" fails; outbox 2's "a" is another aggregate.
        w.settle(&rows, &failed(&[0, 1], 50.0, false), now);
        let (rows, _) = w.next_batch(now, 10, u64::MAX);
        assert_eq!((ids(&rows), w.out_outbox()), (vec![1], Some(2)));
        w.settle(&rows, &Failures::default(), now);
        let (writes, confirmable) = w.take_writes();
        assert_eq!(writes[&2].delete, [1]);
        assert!(!writes.contains_key(&1));
        assert_eq!(confirmable, None, "outbox 1's events of the transaction wait");
        let later = now + Duration::from_millis(50);
        let (rows, _) = w.next_batch(later, 10, u64::MAX);
        assert_eq!((ids(&rows), w.out_outbox()), (vec![1, 2], Some(1)));
        w.settle(&rows, &Failures::default(), later);
        let (writes, confirmable) = w.take_writes();
        assert_eq!((writes[&1].delete.clone(), confirmable), (vec![1, 2], Some(10)));
    }

    #[test]
    fn a_transaction_is_confirmable_once_every_event_of_it_and_before_it_is_finished() {
        let mut w = Window::new(100, u64::MAX, true);
        let now = Instant::now();
        w.begin();
        w.push(row(1, "a"), Some(1), None, 2);
        w.commit(100);
        w.begin();
        w.push(row(2, "b"), Some(2), None, 2);
        w.push(row(3, "c"), Some(3), None, 2);
        // The second transaction's commit is not read yet.
        let (rows, _) = w.next_batch(now, 10, u64::MAX);
        assert_eq!(ids(&rows), [1, 2, 3]);
        w.settle(&rows, &failed(&[0], 10.0, false), now);
        let (writes, confirmable) = take(&mut w);
        assert_eq!(writes.delete, [2, 3]);
        assert_eq!(confirmable, None, "the first transaction failed");
        w.commit(200);
        assert_eq!(w.take_writes().1, None);
        let later = now + Duration::from_millis(10);
        let (rows, _) = w.next_batch(later, 10, u64::MAX);
        assert_eq!(ids(&rows), [1]);
        assert_eq!(rows[0].attempts, 1, "its attempt is kept");
        w.settle(&rows, &Failures::default(), later);
        let (writes, confirmable) = take(&mut w);
        assert_eq!((writes.delete, confirmable), (vec![1], Some(200)));
        assert!(w.is_idle());
    }

    #[test]
    fn a_failure_parks_its_aggregate_and_the_others_go_on() {
        let mut w = Window::new(100, u64::MAX, false);
        let now = Instant::now();
        w.begin();
        for (id, a) in [(1, "a"), (2, "a"), (3, "b")] {
            w.push(row(id, a), Some(id), None, 1);
        }
        w.commit(10);
        let (rows, _) = w.next_batch(now, 10, u64::MAX);
        // 1 failed, 2 was held back behind it (no attempt), 3 delivered.
        let mut f = failed(&[0, 1], 50.0, false);
        f.attempts[1] = 0;
        w.settle(&rows, &f, now);
        w.begin();
        w.push(row(4, "a"), Some(4), None, 1);
        w.push(row(5, "b"), Some(5), None, 1);
        w.commit(20);
        let (rows, _) = w.next_batch(now, 10, u64::MAX);
        assert_eq!(ids(&rows), [5], "a waits behind its failure; b goes on");
        w.settle(&rows, &Failures::default(), now);
        assert_eq!(w.next_due(), Some(now + Duration::from_millis(50)));
        let later = now + Duration::from_millis(50);
        let (rows, _) = w.next_batch(later, 10, u64::MAX);
        assert_eq!(ids(&rows), [1, 2, 4], "in order, together");
        w.settle(&rows, &Failures::default(), later);
        assert_eq!(w.take_writes().1, Some(20));
        assert!(w.is_idle());
    }

    #[test]
    fn a_dead_letter_finishes_its_event_and_lets_its_aggregate_go_on() {
        let mut w = Window::new(100, u64::MAX, true);
        let now = Instant::now();
        w.begin();
        w.push(row(0, "a"), None, None, 1);
        w.push(row(7, "a"), Some(7), None, 1);
        w.commit(10);
        let (rows, _) = w.next_batch(now, 1, u64::MAX);
        assert_eq!(rows.len(), 1, "max_rows");
        w.settle(&rows, &failed(&[0], 0.0, true), now);
        let (rows, _) = w.next_batch(now, 10, u64::MAX);
        assert_eq!(ids(&rows), [7]);
        w.settle(&rows, &Failures::default(), now);
        let (writes, confirmable) = take(&mut w);
        assert!(matches!(&writes.dead[..], [Dead::Emitted { .. }]));
        assert_eq!((writes.delete, confirmable), (vec![7], Some(10)));
    }

    #[test]
    fn the_window_bounds_what_is_read_and_bytes_bound_a_batch() {
        let mut w = Window::new(2, u64::MAX, true);
        let now = Instant::now();
        w.begin();
        w.push(row(1, "a"), Some(1), None, 10);
        w.push(row(2, "b"), Some(2), None, 10);
        assert!(w.has_room(), "a transaction larger than the window is read whole");
        w.commit(5);
        assert!(!w.has_room());
        let (rows, _) = w.next_batch(now, 10, 15);
        assert_eq!(ids(&rows), [1], "the second would pass 15 bytes");
        w.settle(&rows, &Failures::default(), now);
        assert!(!w.has_room(), "delivered, but its transaction is not");
        let (rows, _) = w.next_batch(now, 10, 5);
        assert_eq!(ids(&rows), [2], "always the first");
        w.settle(&rows, &Failures::default(), now);
        assert_eq!(w.take_writes().1, Some(5));
        assert!(!w.has_room(), "finished, not yet sent to the server");
        assert!(w.awaits_confirmation());
        w.sent(4);
        assert!(!w.has_room());
        w.sent(5);
        assert!(w.has_room());
    }

    #[test]
    fn small_transactions_fill_the_window_until_the_server_is_sent_their_end() {
        let mut w = Window::new(2, u64::MAX, true);
        let now = Instant::now();
        for (id, end) in [(1, 10), (2, 20)] {
            w.begin();
            w.push(row(id, "a"), Some(id), None, 1);
            w.commit(end);
        }
        assert!(!w.has_room(), "two read, none confirmed");
        let (rows, _) = w.next_batch(now, 10, u64::MAX);
        w.settle(&rows, &Failures::default(), now);
        assert_eq!(w.take_writes().1, Some(20));
        assert!(!w.has_room(), "finished is not enough");
        w.sent(10);
        assert!(w.has_room());
    }

    #[test]
    fn a_transaction_is_finished_through_once_popped_and_numbers_run_on() {
        let mut w = Window::new(100, u64::MAX, true);
        let now = Instant::now();
        assert_eq!(w.last_txn(), None);
        w.begin();
        w.push(row(1, "a"), Some(1), None, 1);
        w.commit(0);
        let first = w.last_txn().unwrap();
        w.begin();
        w.push(row(2, "b"), Some(2), None, 1);
        w.commit(30);
        assert!(!w.finished_through(first));
        let (rows, _) = w.next_batch(now, 1, u64::MAX);
        w.settle(&rows, &Failures::default(), now);
        assert!(w.finished_through(first), "the first is done");
        assert!(!w.finished_through(first + 1));
        let (writes, confirmable) = take(&mut w);
        assert_eq!(
            (writes.delete, confirmable),
            (vec![1], Some(0)),
            "confirming position 0 moves nothing"
        );
    }

    #[test]
    fn unfinished_payload_bytes_bound_what_is_read_but_one_event_always_fits() {
        let mut w = Window::new(100, 25, true);
        let now = Instant::now();
        w.begin();
        w.push(row(1, "a"), Some(1), None, 30);
        assert!(!w.has_room(), "30 bytes unfinished, over 25");
        let (rows, _) = w.next_batch(now, 10, u64::MAX);
        w.settle(&rows, &Failures::default(), now);
        assert!(w.has_room(), "delivered: its bytes are no longer held");
    }
}
