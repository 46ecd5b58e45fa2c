//! What the lab's and the bench's latency and idle measurements share: how
//! the relay learns about new rows ([`Wakeup`], as relay flags), the wall
//! clock latencies are measured on, and latency = first arrival minus when
//! the event was written.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// How the relay learns about new rows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Wakeup {
    /// LISTEN/NOTIFY with the relay's default fallback poll.
    Notify,
    /// LISTEN/NOTIFY with a fallback poll every `fallback_ms`.
    NotifyOrPoll { fallback_ms: u64 },
    /// `--no-notify --poll-interval <ms>`.
    Poll { interval_ms: u64 },
    /// `--source wal`: the relay reads the WAL stream (a replication slot)
    /// instead of the table.
    Wal,
}

impl Wakeup {
    pub(crate) fn label(self) -> String {
        match self {
            Wakeup::Notify => "NOTIFY".to_owned(),
            Wakeup::NotifyOrPoll { fallback_ms } => {
                format!("NOTIFY (+{} fallback poll)", seconds_or_ms(fallback_ms))
            }
            Wakeup::Poll { interval_ms } => format!("poll {interval_ms} ms"),
            Wakeup::Wal => "WAL (--source wal)".to_owned(),
        }
    }

    /// The `outbox relay` flags of this mode.
    pub(crate) fn relay_args(self) -> Vec<String> {
        let interval = |ms: u64| vec!["--poll-interval".to_owned(), format!("{ms}ms")];
        match self {
            Wakeup::Notify => Vec::new(),
            Wakeup::NotifyOrPoll { fallback_ms } => interval(fallback_ms),
            Wakeup::Poll { interval_ms } => [vec!["--no-notify".to_owned()], interval(interval_ms)].concat(),
            Wakeup::Wal => vec!["--source".to_owned(), "wal".to_owned()],
        }
    }
}

/// `1 s` for whole seconds, else `250 ms`.
fn seconds_or_ms(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

/// Now, in seconds since the Unix epoch: the clock `created_at` is on.
pub(crate) fn epoch_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Latencies in ms, sorted, of the events that arrived (`(key, epoch
/// seconds)`, duplicates after the first arrival ignored) and have a row in
/// `created` (`created_at` in epoch seconds by the same key); and how many
/// distinct events arrived.
pub(crate) fn latencies_ms<K: Eq + Hash>(
    arrivals: impl IntoIterator<Item = (K, f64)>,
    created: &HashMap<K, f64>,
) -> (Vec<f64>, usize) {
    let mut first: HashMap<K, f64> = HashMap::new();
    for (key, at) in arrivals {
        first.entry(key).or_insert(at);
    }
    let mut latencies: Vec<f64> = first
        .iter()
        .filter_map(|(key, at)| created.get(key).map(|c| (at - c) * 1000.0))
        .collect();
    latencies.sort_by(f64::total_cmp);
    (latencies, first.len())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::{Wakeup, latencies_ms};

    #[test]
    fn first_arrival_minus_created() {
        let created = HashMap::from([(1, 10.0), (2, 10.5)]);
        let arrivals = [(2, 10.75), (1, 10.25), (2, 11.0), (3, 12.0)];
        let (latencies, distinct) = latencies_ms(arrivals, &created);
        assert_eq!(latencies, [250.0, 250.0]);
        assert_eq!(distinct, 3);
    }

    #[test]
    fn labels_and_flags() {
        assert_eq!(Wakeup::Notify.label(), "NOTIFY");
        assert!(Wakeup::Notify.relay_args().is_empty());
        let fallback = Wakeup::NotifyOrPoll { fallback_ms: 1000 };
        assert_eq!(fallback.label(), "NOTIFY (+1 s fallback poll)");
        assert_eq!(fallback.relay_args(), ["--poll-interval", "1000ms"]);
        let poll = Wakeup::Poll { interval_ms: 200 };
        assert_eq!(poll.label(), "poll 200 ms");
        assert_eq!(poll.relay_args(), ["--no-notify", "--poll-interval", "200ms"]);
        assert_eq!(Wakeup::Wal.relay_args(), ["--source", "wal"]);
    }
}
