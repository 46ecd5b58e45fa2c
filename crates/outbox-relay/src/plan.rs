//! Turning a batch's sink outcomes into what the commit records: how many
//! rows were delivered, and for every other row its new attempt count, error
//! and retry delay.
//!
//! Per-aggregate order is the rule the delays keep: within a batch, a failed
//! row of an aggregate is never due before an earlier failed row of the same
//! aggregate, and rows held back behind a failure inherit its delay, so they
//! come due together, in id order. The aggregates blocked this way are handed
//! to the next batch, which was claimed while this one was at the sink and so
//! may hold later events of them.

use std::collections::HashMap;
use std::time::Duration;

use outbox::OutboxRow;

use crate::backoff::Backoff;
use crate::sink::{Delivery, DeliveryError};

/// Aggregates (type, id) with a failed or held-back row, and the delay that
/// row was given.
pub(crate) type Blocked = HashMap<(String, String), Duration>;

/// The failed rows of a batch as the arrays `MARK_FAILED` binds.
#[derive(Debug, Default)]
pub(crate) struct Failures {
    pub(crate) ids: Vec<i64>,
    pub(crate) errors: Vec<String>,
    pub(crate) attempts: Vec<i32>,
    pub(crate) delay_ms: Vec<f64>,
    /// The shortest retry delay among rows that are not dead letters.
    pub(crate) soonest: Option<Duration>,
    /// Rows that failed (held-back rows not included).
    pub(crate) failed: u64,
    /// Rows that became dead letters.
    pub(crate) dead: u64,
    /// The first error, for the batch's log line.
    pub(crate) first_error: Option<String>,
}

impl Failures {
    fn push(&mut self, id: i64, error: String, attempts: i32, delay: Duration) {
        self.ids.push(id);
        self.errors.push(error);
        self.attempts.push(attempts);
        self.delay_ms.push(delay.as_secs_f64() * 1000.0);
    }
}

/// What a batch's commit records.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub(crate) published: usize,
    pub(crate) failures: Failures,
    /// Aggregates the next batch must hold back.
    pub(crate) blocked: Blocked,
}

/// The rows of `rows` that may go to the sink, when some are held back by
/// `blocked` (None: all of them; the common case copies nothing).
pub(crate) fn sendable(rows: &[OutboxRow], blocked: &Blocked) -> Option<Vec<OutboxRow>> {
    if blocked.is_empty() || !rows.iter().any(|r| blocked.contains_key(&key(r))) {
        return None;
    }
    Some(
        rows.iter()
            .filter(|r| !blocked.contains_key(&key(r)))
            .cloned()
            .collect(),
    )
}

/// Merges the sink's answers for the sendable rows back into batch order,
/// answering `HeldBack` for the rest.
pub(crate) fn merge(rows: &[OutboxRow], blocked: &Blocked, sent: Vec<Delivery>) -> Vec<Delivery> {
    if blocked.is_empty() {
        return sent;
    }
    let mut sent = sent.into_iter();
    rows.iter()
        .map(|r| {
            if blocked.contains_key(&key(r)) {
                Err(DeliveryError::HeldBack {
                    message: "held back: an earlier event of this aggregate failed in the previous batch"
                        .to_owned(),
                })
            } else {
                sent.next().unwrap_or_else(|| {
                    Err(DeliveryError::retryable(
                        "the sink answered for fewer rows than it was given",
                    ))
                })
            }
        })
        .collect()
}

/// Computes each row's outcome. `carried` are the aggregates the previous
/// batch blocked.
pub(crate) fn plan(
    backoff: Backoff,
    rows: &[OutboxRow],
    deliveries: Vec<Delivery>,
    carried: &Blocked,
) -> Plan {
    let mut plan = Plan::default();
    let failures = &mut plan.failures;
    // The delay given to the last failed row of each aggregate, which rows
    // held back behind it inherit so they come due together, in order.
    let mut blocked: HashMap<(&str, &str), Duration> = HashMap::new();
    let carried_delay = |row: &OutboxRow| {
        if carried.is_empty() {
            None
        } else {
            carried.get(&key(row)).copied()
        }
    };
    for (row, delivery) in rows.iter().zip(deliveries) {
        let k = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
        let behind = blocked.get(&k).copied().or_else(|| carried_delay(row));
        let (message, attempts, delay) = match delivery {
            Ok(()) => {
                plan.published += 1;
                continue;
            }
            Err(DeliveryError::Retryable { message, retry_after }) => {
                let attempts = row.attempts.saturating_add(1);
                // Never due before an earlier failed row of the same
                // aggregate, whatever the jitter drew.
                let delay = backoff
                    .delay(attempts)
                    .max(retry_after.unwrap_or_default())
                    .max(behind.unwrap_or_default());
                (message, attempts, delay)
            }
            Err(DeliveryError::Permanent { message }) => {
                let attempts = row.attempts.saturating_add(1).max(backoff.max_attempts);
                (format!("permanent: {message}"), attempts, Duration::ZERO)
            }
            Err(DeliveryError::HeldBack { message }) => {
                let delay = behind.unwrap_or_default();
                failures.push(row.id, message, row.attempts, delay);
                blocked.insert(k, delay);
                continue;
            }
        };
        blocked.insert(k, delay);
        failures.failed += 1;
        if backoff.is_dead(attempts) {
            failures.dead += 1;
            tracing::warn!(id = row.id, event_id = %row.event_id, attempts, error = %message, "dead letter");
        } else {
            failures.soonest = Some(failures.soonest.map_or(delay, |s| s.min(delay)));
        }
        failures.first_error.get_or_insert_with(|| message.clone());
        failures.push(row.id, message, attempts, delay);
    }
    plan.blocked = blocked
        .into_iter()
        .map(|((t, id), d)| ((t.to_owned(), id.to_owned()), d))
        .collect();
    plan
}

fn key(row: &OutboxRow) -> (String, String) {
    (row.aggregate_type.clone(), row.aggregate_id.clone())
}
