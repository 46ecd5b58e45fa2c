//! Turning a batch's sink outcomes into what the commit records: how many
//! rows were delivered, and for every other row its new attempt count, error
//! and retry delay, or that it is now a dead letter.
//!
//! A failed attempt makes a row a dead letter when the receiver refused it
//! (permanent), or when its retry window (`--retry-for`, or its route's
//! `retry_for`) ended: the window runs from the row's first failed attempt
//! (`first_failed_at`), so a row that waited behind a backlog is not cut
//! short, and only attempts spent count (an unavailable sink, an outage of
//! any length, is neither). `--max-attempts`, if set, ends it sooner.
//!
//! Per-aggregate order is the rule the delays keep: within a batch, a failed
//! row of an aggregate is never due before an earlier failed row of the same
//! aggregate, and rows held back behind a failure inherit its delay, so they
//! come due together, in id order. The aggregates blocked this way are handed
//! to the next batch, which was claimed while this one was at the sink and so
//! may hold later events of them. Only later ones: a block starts at the
//! aggregate's first failed or held-back row, and an earlier row of the
//! aggregate in the next batch (one held back before and due again) goes
//! ahead. Without that, two rows of one aggregate held back in alternate
//! batches would hold each other back for ever.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::OutboxRow;

use crate::backoff::Backoff;
use crate::metric::{self, Tally};
use crate::sink::{Delivery, DeliveryError, Sink};

/// Aggregates (type, id) with a failed or held-back row.
pub(crate) type Blocked = HashMap<(String, String), Block>;

/// Where an aggregate's block starts, and the delay its rows inherit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    /// The outbox id of the aggregate's first failed or held-back row.
    pub(crate) from_id: i64,
    /// The delay the last of them was given.
    pub(crate) delay: Duration,
}

/// Whether `blocked` holds `row` back: a later row of a blocked aggregate.
fn holds(blocked: &Blocked, row: &OutboxRow) -> Option<Block> {
    if blocked.is_empty() {
        return None;
    }
    blocked.get(&key(row)).copied().filter(|b| row.id > b.from_id)
}

/// The failed rows of a batch as the arrays `MARK_FAILED` binds.
#[derive(Debug, Default)]
pub(crate) struct Failures {
    /// Each failed row's index in the batch (the WAL source's rows have no
    /// id in common: emitted events have none).
    pub(crate) positions: Vec<usize>,
    pub(crate) ids: Vec<i64>,
    pub(crate) errors: Vec<String>,
    pub(crate) attempts: Vec<i32>,
    pub(crate) delay_ms: Vec<f64>,
    /// Whether each row is now a dead letter.
    pub(crate) dead_letter: Vec<bool>,
    /// Where each row's retry window starts: its first failed attempt, this
    /// one's time if it was the first (None: no attempt spent yet). The
    /// polling source's mark computes the same with the database's clock;
    /// the WAL source keeps it in memory.
    pub(crate) first_failed: Vec<Option<DateTime<Utc>>>,
    /// The shortest retry delay among rows that are not dead letters.
    pub(crate) soonest: Option<Duration>,
    /// Rows that failed (held-back rows not included).
    pub(crate) failed: u64,
    /// Rows that became dead letters.
    pub(crate) dead: u64,
    /// Rows whose sink was unavailable (no attempt spent).
    pub(crate) unavailable: u64,
    /// The first error, for the batch's log line.
    pub(crate) first_error: Option<String>,
}

impl Failures {
    /// A row comes due again after `delay`: the relay wakes for the soonest.
    fn due_in(&mut self, delay: Duration) {
        self.soonest = Some(self.soonest.map_or(delay, |s| s.min(delay)));
    }

    fn push(&mut self, at: (usize, &OutboxRow), error: String, attempts: i32, delay: Duration, dead: bool) {
        let (i, row) = at;
        self.positions.push(i);
        self.ids.push(row.id);
        self.errors.push(error);
        self.delay_ms.push(delay.as_secs_f64() * 1000.0);
        self.dead_letter.push(dead);
        let spent = attempts > row.attempts;
        self.first_failed
            .push(row.first_failed_at.or_else(|| spent.then(Utc::now)));
        self.attempts.push(attempts);
    }
}

/// What a batch's commit records.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub(crate) published: usize,
    pub(crate) failures: Failures,
    /// Aggregates the next batch must hold back.
    pub(crate) blocked: Blocked,
    /// Delivered, failed and dead rows per aggregate type, for the metrics.
    pub(crate) tallies: Vec<Tally>,
    /// The batch's timings and events for its spans, while tracing is on.
    pub(crate) trace: Option<Box<crate::trace::BatchTrace>>,
}

/// What the relay decides before the sink sees a batch: which rows it
/// keeps back, and why. Built by [`screen`]; the common case (nothing kept
/// back) copies nothing.
#[derive(Debug, Default)]
pub(crate) struct Screen {
    /// Indices into the batch of the rows kept back, ascending, with their
    /// outcome.
    stopped: Vec<(usize, Outcome)>,
}

/// Screens a batch: later rows of aggregates `blocked` holds back, and rows
/// whose payload could not be read (`unreadable`, by index) or is over
/// `max_event_bytes`, never reach the sink.
pub(crate) fn screen(
    rows: &[OutboxRow],
    unreadable: &[(usize, String)],
    blocked: &Blocked,
    max_event_bytes: u64,
) -> Screen {
    let stopped = rows
        .iter()
        .enumerate()
        .filter_map(|(i, row)| {
            if holds(blocked, row).is_some() {
                return Some((i, Outcome::HeldBack));
            }
            if let Some((_, why)) = unreadable.iter().find(|(u, _)| *u == i) {
                return Some((i, Outcome::Unreadable(why.clone())));
            }
            let bytes = outbox::payload_bytes(&row.payload);
            (bytes > max_event_bytes).then_some((
                i,
                Outcome::TooLarge {
                    bytes,
                    limit: max_event_bytes,
                },
            ))
        })
        .collect();
    Screen { stopped }
}

impl Screen {
    /// The rows that may go to the sink, when some are kept back (None: all
    /// of them).
    pub(crate) fn sendable(&self, rows: &[OutboxRow]) -> Option<Vec<OutboxRow>> {
        if self.stopped.is_empty() {
            return None;
        }
        let mut stopped = self.stopped.iter().map(|(i, _)| *i).peekable();
        Some(
            rows.iter()
                .enumerate()
                .filter(|(i, _)| stopped.next_if_eq(i).is_none())
                .map(|(_, row)| row.clone())
                .collect(),
        )
    }

    /// Merges the sink's answers for the sendable rows back into batch
    /// order, beside the outcomes of the rows kept back.
    pub(crate) fn merge(self, batch_len: usize, sent: Vec<Delivery>) -> Vec<Outcome> {
        let mut sent = sent.into_iter();
        let mut stopped = self.stopped.into_iter().peekable();
        (0..batch_len)
            .map(|i| match stopped.next_if(|(at, _)| *at == i) {
                Some((_, outcome)) => outcome,
                None => Outcome::Sent(sent.next().unwrap_or_else(|| {
                    Err(DeliveryError::retryable(
                        "the sink answered for fewer rows than it was given",
                    ))
                })),
            })
            .collect()
    }
}

/// What became of one row of a batch: the sink's answer, or kept back by
/// the relay before it reached the sink. Those are the relay's decisions,
/// which is why they are not among the sink's [`DeliveryError`]s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The sink answered for the row.
    Sent(Delivery),
    /// A later event of an aggregate the previous batch blocked: not sent.
    HeldBack,
    /// The payload is over `--max-event-bytes`: not sent, and it never
    /// will be, so it is a dead letter at once.
    TooLarge {
        /// The payload's size as JSON text.
        bytes: u64,
        /// The limit it is over.
        limit: u64,
    },
    /// PostgreSQL holds a payload or headers the relay cannot read (why,
    /// naming the column): not sent,
    /// and it never will be, so it is a dead letter at once.
    Unreadable(String),
}

/// When a row whose sink was unavailable comes due again: the breaker's
/// longest probe interval, or later if the sink said so (`Retry-After`).
const UNAVAILABLE_RETRY: Duration = crate::breaker::MAX_PROBE;

/// The message recorded in `last_error` for a row the relay held back.
const HELD_BACK: &str = "held back: an earlier event of this aggregate failed in the previous batch";

/// Computes each row's outcome, and logs the rows that became dead
/// letters. `carried` are the aggregates the previous batch blocked;
/// `sink` names the failures and may give a route its own retry window
/// ([`Sink::retry_for`]).
pub(crate) fn plan(
    backoff: Backoff,
    sink: &dyn Sink,
    rows: &[OutboxRow],
    outcomes: Vec<Outcome>,
    carried: &Blocked,
) -> Plan {
    let plan = decide(backoff, sink, rows, outcomes, carried);
    let f = &plan.failures;
    for (k, _) in f.dead_letter.iter().enumerate().filter(|(_, dead)| **dead) {
        let row = &rows[f.positions[k]];
        tracing::warn!(
            id = row.id,
            event_id = %row.event_id,
            attempts = f.attempts[k],
            error = %f.errors[k],
            "dead letter"
        );
    }
    plan
}

/// What [`plan`] decides, without its log: replay plans a failed row the
/// same way, but marks nothing, so makes no dead letter to log.
pub(crate) fn decide(
    backoff: Backoff,
    sink: &dyn Sink,
    rows: &[OutboxRow],
    outcomes: Vec<Outcome>,
    carried: &Blocked,
) -> Plan {
    let now = Utc::now();
    // How long a row has been failing, this attempt included: zero at its
    // first failed attempt.
    let failing_for = |row: &OutboxRow| {
        row.first_failed_at
            .map_or(Duration::ZERO, |first| (now - first).to_std().unwrap_or_default())
    };
    // A `Retry-After` is honoured up to the cap on any delay.
    let asked = |retry_after: Option<Duration>| retry_after.unwrap_or_default().min(backoff.max);
    let mut plan = Plan::default();
    let failures = &mut plan.failures;
    // The delay given to the last failed row of each aggregate, which rows
    // held back behind it inherit so they come due together, in order.
    let mut blocked: HashMap<(&str, &str), Block> = HashMap::new();
    for (i, (row, outcome)) in rows.iter().zip(outcomes).enumerate() {
        let k = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
        // Rows come in id order, so a block started in this batch is
        // always behind an earlier row.
        let behind = blocked
            .get(&k)
            .copied()
            .or_else(|| holds(carried, row))
            .map(|b| b.delay);
        // A permanent failure is a dead letter whatever its attempts.
        let (message, attempts, delay, permanent) = match outcome {
            Outcome::Sent(Ok(())) => {
                plan.published += 1;
                metric::tally(&mut plan.tallies, &row.aggregate_type).delivered += 1;
                continue;
            }
            Outcome::Sent(Err(DeliveryError::Retryable { message, retry_after })) => {
                let attempts = row.attempts.saturating_add(1);
                // Never due before an earlier failed row of the same
                // aggregate, whatever the jitter drew.
                let delay = backoff
                    .delay(attempts)
                    .max(asked(retry_after))
                    .max(behind.unwrap_or_default());
                (message, attempts, delay, false)
            }
            Outcome::Sent(Err(DeliveryError::Permanent { message })) => (
                format!("permanent: {message}"),
                row.attempts.saturating_add(1),
                Duration::ZERO,
                true,
            ),
            Outcome::TooLarge { bytes, limit } => {
                // The route's sink, not the router.
                let name = sink.route_of(&row.aggregate_type).1;
                let message = format!(
                    "permanent: {name}: event too large: its payload is {bytes} bytes, over the limit of {limit} \
                     (--max-event-bytes, or the sink's max payload); it was not sent"
                );
                (message, row.attempts.saturating_add(1), Duration::ZERO, true)
            }
            Outcome::Unreadable(why) => {
                let message = format!("permanent: the event cannot be read: {why}; it was not sent");
                (message, row.attempts.saturating_add(1), Duration::ZERO, true)
            }
            // The sink, not the event, failed: no attempt is spent. The row
            // comes due again after one probe interval, so a route that is
            // down is not claimed in a loop while the others deliver (a
            // sink that is down as a whole stops the claim altogether, see
            // `breaker`).
            Outcome::Sent(Err(DeliveryError::Unavailable { message, retry_after })) => {
                let delay = UNAVAILABLE_RETRY
                    .max(asked(retry_after))
                    .max(behind.unwrap_or_default());
                failures.unavailable += 1;
                failures.due_in(delay);
                failures.push(
                    (i, row),
                    format!("sink unavailable: {message}"),
                    row.attempts,
                    delay,
                    false,
                );
                block(&mut blocked, k, row.id, delay);
                continue;
            }
            // Neither says anything about the event: no attempt is spent.
            Outcome::HeldBack | Outcome::Sent(Err(DeliveryError::NotSent { .. })) => {
                let message = match outcome {
                    Outcome::Sent(Err(DeliveryError::NotSent { message })) => message,
                    _ => HELD_BACK.to_owned(),
                };
                let delay = behind.unwrap_or_default();
                failures.push((i, row), message, row.attempts, delay, false);
                block(&mut blocked, k, row.id, delay);
                continue;
            }
        };
        block(&mut blocked, k, row.id, delay);
        failures.failed += 1;
        let window = Backoff {
            retry_for: sink.retry_for(&row.aggregate_type).unwrap_or(backoff.retry_for),
            ..backoff
        };
        let dead = permanent || window.is_dead(attempts, failing_for(row));
        let tally = metric::tally(&mut plan.tallies, &row.aggregate_type);
        tally.failed += 1;
        tally.error.get_or_insert_with(|| message.clone());
        if dead {
            tally.dead += 1;
            failures.dead += 1;
        } else {
            failures.due_in(delay);
        }
        failures.first_error.get_or_insert_with(|| message.clone());
        failures.push((i, row), message, attempts, delay, dead);
    }
    plan.blocked = blocked
        .into_iter()
        .map(|((t, id), d)| ((t.to_owned(), id.to_owned()), d))
        .collect();
    plan
}

/// Starts or extends the block of aggregate `k` at row `id`.
fn block<'a>(
    blocked: &mut HashMap<(&'a str, &'a str), Block>,
    k: (&'a str, &'a str),
    id: i64,
    delay: Duration,
) {
    blocked
        .entry(k)
        .and_modify(|b| b.delay = delay)
        .or_insert(Block { from_id: id, delay });
}

fn key(row: &OutboxRow) -> (String, String) {
    (row.aggregate_type.clone(), row.aggregate_id.clone())
}

#[cfg(test)]
pub(crate) mod tests {
    use chrono::Utc;
    use serde_json::json;
    use uuid::Uuid;

    use super::*;

    /// A row of aggregate `orders`/`aggregate` (the WAL window's tests
    /// share it).
    pub(crate) fn row(id: i64, aggregate: &str) -> OutboxRow {
        OutboxRow {
            id,
            event_id: Uuid::new_v4(),
            aggregate_type: "orders".to_owned(),
            aggregate_id: aggregate.to_owned(),
            event_type: "E".to_owned(),
            payload: json!({}),
            headers: json!({}),
            created_at: Utc::now(),
            attempts: 0,
            first_failed_at: None,
        }
    }

    const NO_LIMIT: u64 = u64::MAX;

    /// A sink that is only a name, "redis", and routes' retry windows.
    #[derive(Default)]
    struct Named {
        windows: Vec<(&'static str, Duration)>,
    }

    impl Sink for Named {
        fn name(&self) -> &'static str {
            "redis"
        }
        fn deliver<'a>(&'a self, _: &'a [OutboxRow]) -> futures::future::BoxFuture<'a, Vec<Delivery>> {
            unreachable!("plans only")
        }
        fn retry_for(&self, aggregate_type: &str) -> Option<Duration> {
            self.windows
                .iter()
                .find(|(t, _)| *t == aggregate_type)
                .map(|(_, w)| *w)
        }
    }

    fn failed() -> Outcome {
        Outcome::Sent(Err(DeliveryError::retryable("down")))
    }

    #[test]
    fn a_failure_holds_back_the_later_rows_of_its_aggregate_in_the_next_batch() {
        let first = [row(1, "a"), row(2, "b")];
        let plan = plan(
            Backoff::default(),
            &Named::default(),
            &first,
            vec![failed(), Outcome::Sent(Ok(()))],
            &Blocked::new(),
        );
        assert_eq!(plan.published, 1);
        let next = [row(3, "a"), row(4, "b")];
        let screened = screen(&next, &[], &plan.blocked, NO_LIMIT);
        let sendable = screened.sendable(&next).expect("a is held back");
        assert_eq!(sendable.iter().map(|r| r.id).collect::<Vec<_>>(), [4]);
        let answers = screened.merge(next.len(), vec![Ok(())]);
        assert_eq!(answers[0], Outcome::HeldBack);
        assert_eq!(answers[1], Outcome::Sent(Ok(())));
    }

    #[test]
    fn rows_held_back_in_alternate_batches_do_not_hold_each_other_back_for_ever() {
        // Row 5 was held back and is due again while row 6, held back in the
        // batch before, still blocks the aggregate: 5 is earlier, so it goes.
        let held = plan(
            Backoff::default(),
            &Named::default(),
            &[row(6, "a")],
            vec![Outcome::HeldBack],
            &Blocked::new(),
        );
        assert_eq!(held.blocked[&("orders".to_owned(), "a".to_owned())].from_id, 6);
        let again = [row(5, "a")];
        let screened = screen(&again, &[], &held.blocked, NO_LIMIT);
        assert!(screened.sendable(&again).is_none(), "row 5 is sent");
        assert_eq!(
            screened.merge(again.len(), vec![Ok(())]),
            vec![Outcome::Sent(Ok(()))]
        );
    }

    #[test]
    fn held_back_rows_inherit_the_delay_of_the_failure_before_them() {
        let rows = [row(1, "a"), row(2, "a")];
        let plan = plan(
            Backoff::default(),
            &Named::default(),
            &rows,
            vec![failed(), Outcome::HeldBack],
            &Blocked::new(),
        );
        assert_eq!(plan.failures.ids, [1, 2]);
        assert_eq!(plan.failures.attempts, [1, 0], "held back spends no attempt");
        assert_eq!(plan.failures.delay_ms[0], plan.failures.delay_ms[1]);
        assert_eq!(plan.failures.failed, 1);
    }

    #[test]
    fn a_payload_over_the_limit_never_reaches_the_sink_and_is_dead_at_once() {
        let mut big = row(2, "b");
        big.payload = json!({"blob": "x".repeat(100)});
        let bytes = outbox::payload_bytes(&big.payload);
        assert_eq!(bytes, big.payload.to_string().len() as u64);
        let rows = [row(1, "a"), big, row(3, "c")];
        let screened = screen(&rows, &[], &Blocked::new(), bytes - 1);
        let sendable = screened.sendable(&rows).expect("the big one is kept back");
        assert_eq!(sendable.iter().map(|r| r.id).collect::<Vec<_>>(), [1, 3]);
        let outcomes = screened.merge(rows.len(), vec![Ok(()), Ok(())]);
        assert_eq!(
            outcomes[1],
            Outcome::TooLarge {
                bytes,
                limit: bytes - 1
            }
        );
        let plan = plan(
            Backoff::default(),
            &Named::default(),
            &rows,
            outcomes,
            &Blocked::new(),
        );
        assert_eq!(plan.published, 2);
        assert_eq!(plan.failures.ids, [2]);
        assert_eq!(plan.failures.dead, 1);
        assert_eq!(plan.failures.attempts, [1], "one attempt, and dead");
        assert_eq!(plan.failures.dead_letter, [true]);
        assert_eq!(
            plan.tallies,
            [Tally {
                aggregate_type: "orders".to_owned(),
                delivered: 2,
                failed: 1,
                dead: 1,
                error: Some(plan.failures.errors[0].clone()),
            }],
            "the metrics' tally: one per aggregate type"
        );
        assert!(
            plan.failures.errors[0].starts_with("permanent: redis: event too large"),
            "{}",
            plan.failures.errors[0]
        );
        assert!(
            screen(&rows, &[], &Blocked::new(), bytes)
                .sendable(&rows)
                .is_none(),
            "at the limit: sent"
        );
    }

    #[test]
    fn an_unavailable_sink_spends_no_attempt_and_the_row_comes_due_after_a_probe_interval() {
        let rows = [row(1, "a"), row(2, "a")];
        let plan = plan(
            Backoff::default(),
            &Named::default(),
            &rows,
            vec![
                Outcome::Sent(Err(DeliveryError::unavailable("connection refused"))),
                Outcome::HeldBack,
            ],
            &Blocked::new(),
        );
        assert_eq!(plan.failures.attempts, [0, 0]);
        assert_eq!(plan.failures.unavailable, 1);
        assert_eq!(plan.failures.failed, 0);
        assert_eq!(plan.failures.delay_ms, [1000.0, 1000.0]);
        assert_eq!(plan.failures.soonest, Some(UNAVAILABLE_RETRY));
        assert_eq!(plan.failures.errors[0], "sink unavailable: connection refused");
    }

    /// A row failing `failing_for` already, with `attempts` spent.
    fn failing(id: i64, aggregate_type: &str, attempts: i32, failing_for: Duration) -> OutboxRow {
        OutboxRow {
            aggregate_type: aggregate_type.to_owned(),
            attempts,
            first_failed_at: (attempts > 0).then(|| Utc::now() - failing_for),
            ..row(id, "a")
        }
    }

    #[test]
    fn a_row_dies_at_its_first_failure_after_its_window_from_its_first_failed_attempt() {
        let hour = Duration::from_secs(3600);
        let backoff = Backoff {
            retry_for: hour,
            ..Backoff::default()
        };
        // A row written long ago failing for the first time: its window
        // starts now, however old it is.
        let mut old = row(1, "a");
        old.created_at = Utc::now() - chrono::Duration::days(3);
        let rows = [
            old,
            failing(2, "orders", 40, hour - Duration::from_secs(60)),
            failing(3, "orders", 41, hour + Duration::from_secs(1)),
        ];
        let plan = plan(
            backoff,
            &Named::default(),
            &rows,
            vec![failed(), failed(), failed()],
            &Blocked::new(),
        );
        let f = &plan.failures;
        assert_eq!(f.dead_letter, [false, false, true]);
        assert_eq!(f.attempts, [1, 41, 42]);
        assert_eq!(f.dead, 1);
        assert!(f.first_failed[0].is_some(), "its first failure starts the window");
        assert_eq!(f.first_failed[1], rows[1].first_failed_at, "kept");
        assert_eq!(f.first_failed[2], rows[2].first_failed_at);
        // The same rows answered unavailable: no attempt, no window, no death.
        let plan = decide(
            backoff,
            &Named::default(),
            &rows,
            vec![
                Outcome::Sent(Err(DeliveryError::unavailable("HTTP 503"))),
                Outcome::Sent(Err(DeliveryError::unavailable("HTTP 503"))),
                Outcome::Sent(Err(DeliveryError::unavailable("HTTP 503"))),
            ],
            &Blocked::new(),
        );
        assert_eq!(plan.failures.dead_letter, [false; 3]);
        assert_eq!(plan.failures.attempts, [0, 40, 41]);
        assert_eq!(plan.failures.first_failed[0], None, "no attempt spent: no window");
    }

    #[test]
    fn max_attempts_set_ends_the_window_sooner_and_a_route_may_have_its_own_window() {
        let minute = Duration::from_secs(60);
        let rows = [
            failing(1, "orders", 2, Duration::from_secs(1)),
            failing(2, "payments", 1, 2 * minute),
            failing(3, "invoices", 1, 2 * minute),
        ];
        let answers = || vec![failed(), failed(), failed()];
        let backoff = Backoff {
            max_attempts: 3,
            ..Backoff::default()
        };
        let routes = Named {
            windows: vec![("payments", minute)],
        };
        let plan = decide(backoff, &routes, &rows, answers(), &Blocked::new());
        assert_eq!(
            plan.failures.dead_letter,
            [true, true, false],
            "orders: its third attempt; payments: its route's minute is over; invoices: the day is not"
        );
    }

    #[test]
    fn retry_after_delays_a_failed_row_and_an_unavailable_one_up_to_the_cap() {
        let rows = [row(1, "a"), row(2, "b"), row(3, "c")];
        let after = |secs| Some(Duration::from_secs(secs));
        let plan = decide(
            Backoff::default(),
            &Named::default(),
            &rows,
            vec![
                Outcome::Sent(Err(DeliveryError::Retryable {
                    message: "HTTP 500".into(),
                    retry_after: after(30),
                })),
                Outcome::Sent(Err(DeliveryError::Unavailable {
                    message: "HTTP 429".into(),
                    retry_after: after(2),
                })),
                Outcome::Sent(Err(DeliveryError::Unavailable {
                    message: "HTTP 503".into(),
                    retry_after: after(86_400),
                })),
            ],
            &Blocked::new(),
        );
        assert_eq!(plan.failures.delay_ms, [30_000.0, 2_000.0, 300_000.0]);
        assert_eq!(plan.failures.attempts, [1, 0, 0]);
    }
}
