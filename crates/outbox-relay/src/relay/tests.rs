//! The cycle's rules, driven in process over a fake source and a fake sink
//! (`source::fake`, `sink::fake`): no PostgreSQL, no broker, no process.
//! Each test is named after the rule it proves, and first asserts that the
//! fault it is about happened. Time is paused in all of them: backoff and
//! probes take no wall time, and a relay that hangs fails at once, when the
//! paused clock reaches the wait's timeout.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox::OutboxRow;
use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Books, Relay, RelayConfig, RelayError};
use crate::backoff::Backoff;
use crate::context::Signals;
use crate::plan::tests::row;
use crate::sink::DeliveryError;
use crate::sink::fake::{Call, FakeSink, Gate};
use crate::source::Receipts;
use crate::source::fake::{Event, FakeSource, FakeTable, Journal, Stored};

/// How long a test waits for anything, in paused time where paused.
const PATIENCE: Duration = Duration::from_secs(60);

/// Rows `ids`, each of an aggregate of its own.
fn rows(ids: std::ops::RangeInclusive<i64>) -> Vec<OutboxRow> {
    ids.map(|id| row(id, &format!("a{id}"))).collect()
}

fn config(batch_size: u32, drain: bool) -> RelayConfig {
    RelayConfig {
        batch_size,
        drain,
        ..RelayConfig::default()
    }
}

/// A relay over a fake table and a fake sink, ready to drive.
struct Harness {
    relay: Relay,
    table: FakeTable,
    journal: Journal,
    /// Where the fake sink's parked calls wait.
    gate: Arc<Gate>,
    signals: UnboundedReceiver<String>,
}

impl Harness {
    /// `sink` is built over the harness's journal.
    fn new(config: RelayConfig, rows: Vec<OutboxRow>, sink: impl FnOnce(&Journal) -> FakeSink) -> Self {
        let journal = Journal::default();
        let sink = sink(&journal);
        let gate = sink.gate();
        let (signals, rx) = Signals::channel();
        let relay = Relay::new(tokio_postgres::Config::new(), Arc::new(sink), config).with_signals(signals);
        Self {
            relay,
            table: FakeTable::new(rows),
            journal,
            gate,
            signals: rx,
        }
    }

    /// Drives the relay over the fake source until it returns (a drain, or
    /// `cancel`), checks that no row was marked published unacknowledged;
    /// then the relay's counters and the signals it sent.
    async fn drive(self, cancel: CancellationToken) -> Driven {
        let Self {
            relay,
            table,
            journal,
            mut signals,
            ..
        } = self;
        let receipts = Receipts::new(Books::new(&relay.ctx, Arc::clone(&relay.sink)));
        let source = FakeSource::new(
            table,
            journal.clone(),
            receipts,
            relay.config.batch_size,
            relay.config.drain,
        );
        let counters = relay.counters();
        let result = tokio::time::timeout(PATIENCE, relay.drive(source, cancel))
            .await
            .expect("drive returns");
        // Whatever the test is about, no row was marked unsent.
        assert_marked_only_after_acknowledged(&journal.events());
        let mut sent = Vec::new();
        while let Ok(signal) = signals.try_recv() {
            sent.push(signal);
        }
        Driven {
            result,
            delivered: counters.delivered.load(Ordering::Relaxed),
            failed: counters.failed.load(Ordering::Relaxed),
            dead_lettered: counters.dead_lettered.load(Ordering::Relaxed),
            batches: counters.batches.load(Ordering::Relaxed),
            signals: sent,
        }
    }

    /// Drives the relay (no drain) until `done` holds of the table, then
    /// shuts it down.
    async fn drive_until(self, what: &str, done: impl Fn(&[Stored]) -> bool) -> Driven {
        let table = self.table.clone();
        let cancel = CancellationToken::new();
        let stop = async {
            table.until(what, PATIENCE, done).await;
            cancel.cancel();
        };
        let (driven, ()) = tokio::join!(self.drive(cancel.clone()), stop);
        driven
    }
}

/// What a drive left behind.
#[derive(Debug)]
struct Driven {
    result: Result<(), RelayError>,
    delivered: u64,
    failed: u64,
    dead_lettered: u64,
    batches: u64,
    signals: Vec<String>,
}

impl Driven {
    /// The `OUTBOX_BATCH=committed` signals sent.
    fn committed_signals(&self) -> usize {
        self.signals
            .iter()
            .filter(|s| *s == "OUTBOX_BATCH=committed")
            .count()
    }
}

/// Every row a commit marked published was acknowledged by the sink
/// before.
fn assert_marked_only_after_acknowledged(events: &[Event]) {
    let mut acknowledged = Vec::new();
    for event in events {
        match event {
            Event::Answered(answers) => {
                acknowledged.extend(answers.iter().filter(|(_, a)| a.is_ok()).map(|(id, _)| *id));
            }
            Event::Committed { batch, published } => {
                for id in published {
                    assert!(
                        acknowledged.contains(id),
                        "batch {batch} marked row {id} published before the sink acknowledged it: {events:#?}"
                    );
                }
            }
            _ => {}
        }
    }
}

/// The position of the first event `matches` accepts.
fn position(events: &[Event], matches: impl Fn(&Event) -> bool) -> usize {
    events
        .iter()
        .position(matches)
        .unwrap_or_else(|| panic!("no such event in {events:#?}"))
}

// At least once.

#[tokio::test(start_paused = true)]
async fn rows_are_marked_published_only_after_the_sink_acknowledged_them() {
    let h = Harness::new(config(10, true), rows(1..=3), |j| {
        FakeSink::new(j).then(Call::ok().parked())
    });
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let gate = Arc::clone(&h.gate);
    let at_sink = async {
        gate.reached().await;
        // The fault under test: the batch is at the sink, unanswered.
        assert_eq!(journal.sent(), [vec![1, 2, 3]]);
        assert_eq!(
            table.published(),
            Vec::<i64>::new(),
            "marked before the sink answered"
        );
        assert!(table.rows().iter().all(|s| s.locked), "claimed while at the sink");
        gate.release();
    };
    let (driven, ()) = tokio::join!(h.drive(CancellationToken::new()), at_sink);
    driven.result.as_ref().expect("drained");
    assert_eq!(table.published(), [1, 2, 3]);
    let events = journal.events();
    assert_marked_only_after_acknowledged(&events);
    let answered = position(&events, |e| matches!(e, Event::Answered(_)));
    let settled = position(&events, |e| matches!(e, Event::Settled(1)));
    let committed = position(&events, |e| matches!(e, Event::Committed { batch: 1, .. }));
    assert!(answered < settled && settled < committed, "{events:#?}");
    assert_eq!((driven.delivered, driven.batches), (3, 1));
}

#[tokio::test(start_paused = true)]
async fn a_failed_commit_redelivers_the_whole_batch_and_books_only_the_durable_commit() {
    // Two full batches: the commit of the first fails while the second is
    // at the sink, so both are given back, delivered again and committed.
    let h = Harness::new(config(2, true), rows(1..=4), FakeSink::new);
    h.table.fail_commits(1);
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained");

    let events = journal.events();
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, Event::CommitFailed(_)))
            .count(),
        1,
        "the fault: one commit failed"
    );
    assert_eq!(
        journal.sent(),
        [vec![1, 2], vec![3, 4], vec![1, 2], vec![3, 4]],
        "each row sent twice: at least once, never marked unsent"
    );
    assert_eq!(table.published(), [1, 2, 3, 4], "each published, once");
    assert_marked_only_after_acknowledged(&events);
    let committed: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Committed { batch, .. } => Some(*batch),
            _ => None,
        })
        .collect();
    assert_eq!(committed.len(), 2, "{events:#?}");
    assert!(!committed.contains(&1), "batch 1's commit failed: {events:#?}");
    assert_eq!(
        (driven.delivered, driven.failed, driven.batches),
        (4, 0, 2),
        "receipts only for the durable commits"
    );
    assert_eq!(driven.committed_signals(), 1);
}

// Retries and dead letters.

#[tokio::test(start_paused = true)]
async fn a_retryable_failure_schedules_a_retry_with_one_more_attempt_after_the_backoff() {
    let h = Harness::new(config(10, true), rows(1..=1), |j| {
        FakeSink::new(j).then(Call::retryable())
    });
    let table = h.table.clone();
    let before = Instant::now();
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained: the retry is not due yet");
    let r = table.row(1);
    assert!(!r.published && !r.dead && !r.locked, "{r:?}");
    assert_eq!(r.row.attempts, 1);
    assert_eq!(r.last_error.as_deref(), Some("fake: try again"));
    // The default backoff's first delay, 200 ms, plus up to 10% jitter.
    let delay = r.delay.expect("a retry delay");
    assert!(
        delay >= Duration::from_millis(200) && delay < Duration::from_millis(220),
        "{delay:?}"
    );
    assert_eq!(
        r.next_attempt - before,
        delay,
        "due after its delay (paused time)"
    );
    assert_eq!(
        (
            driven.delivered,
            driven.failed,
            driven.dead_lettered,
            driven.batches
        ),
        (0, 1, 0, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_row_failing_max_attempts_times_is_a_dead_letter() {
    let config = RelayConfig {
        backoff: Backoff {
            max_attempts: 3,
            ..Backoff::default()
        },
        ..config(10, false)
    };
    let h = Harness::new(config, rows(1..=1), |j| {
        FakeSink::new(j)
            .then(Call::retryable())
            .then(Call::retryable())
            .then(Call::retryable())
    });
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h.drive_until("row 1 is a dead letter", |rows| rows[0].dead).await;
    driven.result.as_ref().expect("cancelled");
    let r = table.row(1);
    assert_eq!(
        journal.sent(),
        [vec![1], vec![1], vec![1]],
        "three attempts, no fourth"
    );
    assert_eq!(r.row.attempts, 3);
    assert!(r.dead && !r.published, "{r:?}");
    // Each retry waited out its backoff: 200 ms, then 400 ms (nominal).
    let sends: Vec<Instant> = journal
        .timed()
        .into_iter()
        .filter_map(|(at, e)| matches!(e, Event::Sent(_)).then_some(at))
        .collect();
    assert!(sends[1] - sends[0] >= Duration::from_millis(200), "{sends:?}");
    assert!(sends[2] - sends[1] >= Duration::from_millis(400), "{sends:?}");
    assert_eq!(
        (
            driven.delivered,
            driven.failed,
            driven.dead_lettered,
            driven.batches
        ),
        (0, 3, 1, 3)
    );
}

#[tokio::test(start_paused = true)]
async fn a_permanent_failure_is_a_dead_letter_at_once() {
    let h = Harness::new(config(10, true), rows(1..=2), |j| {
        FakeSink::new(j).then(Call::permanent())
    });
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained");
    assert_eq!(journal.sent(), [vec![1, 2]], "sent once");
    for id in [1, 2] {
        let r = table.row(id);
        assert!(r.dead && !r.published, "{r:?}");
        assert_eq!(r.row.attempts, 1, "one attempt, below max_attempts, and dead");
        assert_eq!(r.last_error.as_deref(), Some("permanent: fake: refused"));
    }
    assert_eq!(
        (
            driven.delivered,
            driven.failed,
            driven.dead_lettered,
            driven.batches
        ),
        (0, 2, 2, 1)
    );
}

// Order per aggregate.

#[tokio::test(start_paused = true)]
async fn a_later_event_the_sink_did_not_send_behind_a_failure_spends_no_attempt() {
    // Rows 1 and 2 of aggregate x, 3 of y: the sink fails 1, and does not
    // send 2 behind it (as the HTTP sink answers).
    let batch = vec![row(1, "x"), row(2, "x"), row(3, "y")];
    let h = Harness::new(config(10, true), batch, |j| {
        FakeSink::new(j).then(Call::each(|row| match row.id {
            1 => Err(DeliveryError::retryable("fake: try again")),
            2 => Err(DeliveryError::NotSent {
                message: "behind a failure".to_owned(),
            }),
            _ => Ok(()),
        }))
    });
    let table = h.table.clone();
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained");
    let (first, later) = (table.row(1), table.row(2));
    assert_eq!(first.row.attempts, 1, "the fault: row 1 failed");
    assert_eq!(later.row.attempts, 0, "not sent: no attempt");
    assert!(!later.published && !later.dead, "{later:?}");
    assert_eq!(later.delay, first.delay, "comes due with the failure before it");
    assert_eq!(table.published(), [3]);
    assert_eq!((driven.delivered, driven.failed, driven.batches), (1, 1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_later_event_claimed_during_its_aggregates_failure_is_held_back_unsent() {
    // One row a batch: row 2 is claimed ahead while row 1, of the same
    // aggregate, is at the sink and fails.
    let h = Harness::new(config(1, true), vec![row(1, "x"), row(2, "x")], |j| {
        FakeSink::new(j).then(Call::retryable())
    });
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained");
    let events = journal.events();
    assert!(
        events.contains(&Event::HandedOut {
            batch: 2,
            ids: vec![2],
            overlapped: true
        }),
        "the fault: row 2 was claimed while row 1 was at the sink: {events:#?}"
    );
    assert_eq!(table.row(1).row.attempts, 1, "the fault: row 1 failed");
    assert_eq!(journal.sent(), [vec![1]], "row 2 never reached the sink");
    let held = table.row(2);
    assert_eq!(held.row.attempts, 0, "held back: no attempt");
    assert!(!held.published && !held.dead, "{held:?}");
    assert!(
        held.last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("held back")),
        "{held:?}"
    );
    assert!(
        held.next_attempt >= table.row(1).next_attempt,
        "never due before row 1"
    );
    assert_eq!((driven.delivered, driven.failed, driven.batches), (0, 1, 2));
}

#[tokio::test(start_paused = true)]
async fn an_event_over_max_event_bytes_is_a_dead_letter_unsent() {
    let mut big = row(2, "b");
    big.payload = json!({"blob": "x".repeat(100)});
    let config = RelayConfig {
        max_event_bytes: 64,
        ..config(10, true)
    };
    let h = Harness::new(config, vec![row(1, "a"), big], FakeSink::new);
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained");
    assert_eq!(journal.sent(), [vec![1]], "row 2 never reached the sink");
    let r = table.row(2);
    assert!(r.dead && !r.published, "{r:?}");
    assert_eq!(r.row.attempts, 1);
    assert!(
        r.last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("permanent: fake: event too large")),
        "{r:?}"
    );
    assert_eq!(table.published(), [1]);
    assert_eq!(
        (
            driven.delivered,
            driven.failed,
            driven.dead_lettered,
            driven.batches
        ),
        (1, 1, 1, 1)
    );
}

// The breaker.

#[tokio::test(start_paused = true)]
async fn an_unavailable_sink_opens_the_breaker_and_nothing_is_claimed_until_a_probe_succeeds() {
    let h = Harness::new(config(10, false), rows(1..=2), |j| {
        FakeSink::new(j)
            .then(Call::unavailable())
            // The startup probe, then two refused while open, then back.
            .probes([true, false, false, true])
    });
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h
        .drive_until("both rows are published", |rows| rows.iter().all(|s| s.published))
        .await;
    driven.result.as_ref().expect("cancelled");
    let events = journal.events();
    assert_eq!(
        journal.sent(),
        [vec![1, 2], vec![1, 2]],
        "the fault, then the redelivery"
    );
    let refused = position(
        &events,
        |e| matches!(e, Event::Answered(a) if a.iter().all(|(_, d)| d.as_ref().is_err_and(DeliveryError::is_unavailable))),
    );
    let held = position(&events, |e| *e == Event::Held);
    let probed: Vec<usize> = (0..events.len())
        .filter(|i| matches!(events[*i], Event::Probed(_)))
        .collect();
    assert_eq!(probed.len(), 4, "startup, two refused, one answered: {events:#?}");
    let back = probed[3];
    assert!(
        refused < held && held < probed[1],
        "paused before probing: {events:#?}"
    );
    assert!(
        !events[refused..back]
            .iter()
            .any(|e| matches!(e, Event::HandedOut { .. } | Event::ClaimedAhead(_))),
        "claimed while the breaker was open: {events:#?}"
    );
    let resumed = position(&events, |e| matches!(e, Event::HandedOut { batch: 2, .. }));
    assert!(resumed > back, "{events:#?}");
    for id in [1, 2] {
        assert_eq!(table.row(id).row.attempts, 0, "unavailable spends no attempt");
    }
    assert_eq!(
        (
            driven.delivered,
            driven.failed,
            driven.dead_lettered,
            driven.batches
        ),
        (2, 0, 0, 2)
    );
}

#[tokio::test(start_paused = true)]
async fn a_sink_down_at_startup_is_probed_before_anything_is_claimed() {
    let h = Harness::new(config(10, false), rows(1..=1), |j| {
        FakeSink::new(j).probes([false, false, true])
    });
    let journal = h.journal.clone();
    let driven = h
        .drive_until("row 1 is published", |rows| rows[0].published)
        .await;
    driven.result.as_ref().expect("cancelled");
    let events = journal.events();
    assert_eq!(
        events[0..4],
        [
            Event::Probed(false),
            Event::Probed(false),
            Event::Probed(true),
            Event::HandedOut {
                batch: 1,
                ids: vec![1],
                overlapped: false
            },
        ],
        "claimed only once a probe answered"
    );
    assert_eq!((driven.delivered, driven.batches), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_sink_answering_probes_but_failing_every_batch_spends_an_attempt_after_three_strikes() {
    // Unavailable once (opens the breaker), then three times half-open:
    // the third strike counts as an attempt.
    let h = Harness::new(config(10, false), rows(1..=1), |j| {
        (0..4).fold(FakeSink::new(j), |sink, _| sink.then(Call::unavailable()))
    });
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h
        .drive_until("row 1 spent an attempt", |rows| rows[0].row.attempts == 1)
        .await;
    driven.result.as_ref().expect("cancelled");
    assert_eq!(
        journal.sent().len(),
        4,
        "the fault: four batches, all unavailable"
    );
    let r = table.row(1);
    assert_eq!(r.row.attempts, 1, "{r:?}");
    assert!(
        r.last_error
            .as_deref()
            .is_some_and(|e| e.contains("failed 3 batches in a row")),
        "{r:?}"
    );
    assert_eq!((driven.delivered, driven.failed, driven.batches), (0, 1, 4));
}

#[tokio::test(start_paused = true)]
async fn a_drain_stops_at_a_sink_outage_and_says_why_spending_no_attempt() {
    let h = Harness::new(config(1, true), rows(1..=2), |j| {
        FakeSink::new(j).then(Call::unavailable())
    });
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let counters = h.relay.counters();
    let driven = h.drive(CancellationToken::new()).await;
    driven
        .result
        .as_ref()
        .expect("a drain that stops early is not an error");
    assert_eq!(journal.sent(), [vec![1]], "the fault, and nothing after it");
    assert_eq!(
        counters.sink_unavailable.get().map(String::as_str),
        Some("fake: fake: connection refused")
    );
    let events = journal.events();
    assert!(
        events.contains(&Event::GivenBack {
            batch: None,
            ids: vec![2]
        }),
        "the batch claimed ahead is given back: {events:#?}"
    );
    for id in [1, 2] {
        let r = table.row(id);
        assert!(!r.published && !r.locked && r.row.attempts == 0, "{r:?}");
    }
    assert_eq!((driven.delivered, driven.failed, driven.batches), (0, 0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_claim_lapsing_during_delivery_abandons_the_batch_as_retryable_failures() {
    // The sink never answers; the source stops vouching for the batch.
    let h = Harness::new(config(10, true), rows(1..=2), |j| {
        FakeSink::new(j).then(Call::ok().parked())
    });
    h.table.lapse(1);
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained");
    let events = journal.events();
    assert_eq!(journal.sent(), [vec![1, 2]], "the batch reached the sink");
    assert!(
        !events.iter().any(|e| matches!(e, Event::Answered(_))),
        "the fault: the sink never answered: {events:#?}"
    );
    for id in [1, 2] {
        let r = table.row(id);
        assert!(!r.published && !r.dead && !r.locked, "{r:?}");
        assert_eq!(r.row.attempts, 1, "{r:?}");
        assert!(
            r.last_error
                .as_deref()
                .is_some_and(|e| e.starts_with("abandoned")),
            "{r:?}"
        );
    }
    assert_eq!((driven.delivered, driven.failed, driven.batches), (0, 2, 1));
}

// Receipts and books.

#[tokio::test(start_paused = true)]
async fn receipts_are_booked_once_per_durable_batch_and_a_batch_given_back_books_nothing() {
    // Two rows a batch: the first batch is refused (given back unsent);
    // then 1, 2 go; 3 fails, 4 is refused for good; 5 goes.
    let h = Harness::new(config(2, true), rows(1..=5), |j| {
        FakeSink::new(j)
            .then(Call::ok())
            .then(Call::each(|row| match row.id {
                3 => Err(DeliveryError::retryable("fake: try again")),
                _ => Err(DeliveryError::permanent("fake: refused")),
            }))
    });
    h.table.refuse_delivery(1);
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained");
    let events = journal.events();
    assert_eq!(
        events[0..3],
        [
            Event::Probed(true),
            Event::HandedOut {
                batch: 1,
                ids: vec![1, 2],
                overlapped: false
            },
            Event::GivenBack {
                batch: Some(1),
                ids: vec![1, 2]
            },
        ],
        "the fault: batch 1 given back unsent"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, Event::Committed { batch: 1, .. })),
        "{events:#?}"
    );
    assert_eq!(journal.sent(), [vec![1, 2], vec![3, 4], vec![5]]);
    assert_eq!(table.published(), [1, 2, 5]);
    assert_eq!(
        (
            driven.delivered,
            driven.failed,
            driven.dead_lettered,
            driven.batches
        ),
        (3, 2, 1, 3)
    );
    assert_eq!(driven.committed_signals(), 1, "{:?}", driven.signals);
}

// Stopping.

#[tokio::test(start_paused = true)]
async fn a_drain_returns_when_the_source_is_drained_with_the_counters_right() {
    let h = Harness::new(config(2, true), rows(1..=5), FakeSink::new);
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let driven = h.drive(CancellationToken::new()).await;
    driven.result.as_ref().expect("drained");
    assert_eq!(table.published(), [1, 2, 3, 4, 5]);
    assert_eq!(journal.sent(), [vec![1, 2], vec![3, 4], vec![5]]);
    assert_eq!(journal.events().last(), Some(&Event::Finished));
    assert_eq!(
        (
            driven.delivered,
            driven.failed,
            driven.dead_lettered,
            driven.batches
        ),
        (5, 0, 0, 3)
    );
    assert_eq!(driven.committed_signals(), 1);
}

#[tokio::test(start_paused = true)]
async fn shutdown_while_a_batch_is_at_the_sink_commits_it_before_drive_returns() {
    // A full batch: the next one is claimed ahead while it is at the sink.
    let h = Harness::new(config(2, false), rows(1..=3), |j| {
        FakeSink::new(j).then(Call::ok().parked())
    });
    let (table, journal) = (h.table.clone(), h.journal.clone());
    let gate = Arc::clone(&h.gate);
    let cancel = CancellationToken::new();
    let shutdown = async {
        gate.reached().await;
        cancel.cancel();
        gate.release();
    };
    let (driven, ()) = tokio::join!(h.drive(cancel.clone()), shutdown);
    driven.result.as_ref().expect("cancelled");
    let events = journal.events();
    assert!(
        events.contains(&Event::ClaimedAhead(vec![3])),
        "the fault: a batch claimed ahead when shutdown came: {events:#?}"
    );
    assert_eq!(journal.sent(), [vec![1, 2]], "nothing sent after shutdown");
    assert_eq!(table.published(), [1, 2], "the batch at the sink is committed");
    let r = table.row(3);
    assert!(
        !r.published && !r.locked && r.row.attempts == 0,
        "given back: {r:?}"
    );
    let committed = position(&events, |e| matches!(e, Event::Committed { batch: 1, .. }));
    let finished = position(&events, |e| *e == Event::Finished);
    assert!(committed < finished, "{events:#?}");
    assert_eq!((driven.delivered, driven.batches), (2, 1));
}

/// A batch's warning says what became of each row: delivered, retried (at
/// the earliest retry, `from` when the rows' times differ), dead-lettered;
/// never "retried" for a dead letter, and nothing for rows that only wait
/// for an unavailable sink.
#[test]
fn the_line_of_a_batch_names_its_dead_letters_apart_from_its_retries() {
    use crate::plan::{Blocked, Outcome, decide};

    let now = chrono::DateTime::parse_from_rfc3339("2025-06-01T12:00:00Z")
        .unwrap()
        .to_utc();
    let line = |rows: &[OutboxRow], outcomes: Vec<Outcome>| {
        let sink = crate::sink::fake::FakeSink::new(&Journal::default());
        let plan = decide(Backoff::default(), &sink, rows, outcomes, &Blocked::new());
        let retry_ms = plan
            .failures
            .delay_ms
            .iter()
            .zip(&plan.failures.dead_letter)
            .find(|(_, dead)| !**dead)
            .map(|(ms, _)| *ms);
        (super::failed_line(plan.published, &plan.failures, now), retry_ms)
    };
    let sent = |d: Result<(), DeliveryError>| Outcome::Sent(d);
    let (said, retry_ms) = line(
        &rows(1..=4),
        vec![
            sent(Ok(())),
            sent(Err(DeliveryError::retryable("down"))),
            sent(Err(DeliveryError::permanent("refused"))),
            sent(Ok(())),
        ],
    );
    #[allow(clippy::cast_possible_truncation)]
    let at = now + chrono::Duration::milliseconds(retry_ms.unwrap().round() as i64);
    assert_eq!(
        said.as_deref(),
        Some(
            format!(
                "2 delivered, 1 will be retried at {}, 1 dead-lettered",
                at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
            )
            .as_str()
        )
    );
    // Only dead letters: nothing is retried.
    let (said, _) = line(&rows(1..=1), vec![sent(Err(DeliveryError::permanent("refused")))]);
    assert_eq!(said.as_deref(), Some("0 delivered, 1 dead-lettered"));
    // Two retries at different times: from the earliest.
    let mut later = rows(1..=2);
    later[1].attempts = 2;
    let (said, _) = line(
        &later,
        vec![
            sent(Err(DeliveryError::retryable("down"))),
            sent(Err(DeliveryError::retryable("down"))),
        ],
    );
    let said = said.unwrap();
    assert!(
        said.starts_with("0 delivered, 2 will be retried from 2025-06-01T12:00:"),
        "{said}"
    );
    // The sink unavailable: no attempt spent, the breaker speaks.
    let (said, _) = line(
        &rows(1..=2),
        vec![sent(Err(DeliveryError::unavailable("refused"))), sent(Ok(()))],
    );
    assert_eq!(said, None);
}
