//! Every delay that doubles: the retry schedule of a failed row, and the
//! waits between reconnects and probes. No other module doubles a delay.
//!
//! [`Backoff`] is a row's schedule, computed from its attempt count (which
//! PostgreSQL keeps, so it needs no state): the n-th failed delivery waits
//! `base * 2^(n-1)`, capped at `max`, plus up to 10% jitter so relays
//! retrying the same outage do not hit the sink in lockstep. Jitter only
//! ever adds: a row is never retried before its nominal time, which is
//! what the seed's log (200 ms, then 400 ms) shows.
//!
//! A row is retried for a window of time (`retry_for`, a day by default),
//! measured from its first failed attempt rather than from when it was
//! written, so a row that waited behind a backlog or an outage does not die
//! at its first failure. Its first failure after the window ended makes it a
//! dead letter: the claim no longer sees it until an operator requeues it.
//! `max_attempts`, if set, ends it sooner. Answers that spend no attempt (an
//! unavailable sink) neither start the window nor end it.
//!
//! [`Doubling`] is a loop's wait (reconnecting to PostgreSQL, probing a
//! sink that is down): `initial`, doubling to `max`, reset when the loop
//! gets through. Its jitter only ever takes away (up to 20%), so `max` is a
//! promise: a sink back up is probed again within `max`.
//!
//! Why not a crate: `backoff` is unmaintained, and `backon` and
//! `exponential-backoff` are iterators, so a row's delay after its n-th
//! attempt would mean stepping an iterator n times, and their jitter adds
//! to the delay (a probe could then wait past `max`). The rule is one
//! function here (`doubled`).

use std::time::Duration;

use rand::Rng;

use crate::defaults;

/// The first wait before trying to reach PostgreSQL again.
pub(crate) const RECONNECT_FIRST: Duration = Duration::from_millis(100);

/// The longest wait between attempts to reach PostgreSQL again: at
/// startup, after a lost session, for the WAL source's stream. Short,
/// because a failover promotes a standby after an outage of unknown
/// length, and the relay must be back within seconds of the promotion;
/// a server that is down meanwhile sees one attempt every 2 s per session.
pub(crate) const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// `base * 2^(n-1)` capped at `max`, for the `n`-th wait (1-based; 0 and
/// below count as 1).
fn doubled(base: Duration, max: Duration, n: i32) -> Duration {
    let exponent = n.saturating_sub(1).clamp(0, 30).unsigned_abs();
    base.saturating_mul(1 << exponent).min(max)
}

/// Retry delays, the retry window and the attempt limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failure (default [`defaults::BACKOFF_BASE`]).
    pub base: Duration,
    /// Cap on any delay (default [`defaults::BACKOFF_MAX`]).
    pub max: Duration,
    /// Attempts after which a row is a dead letter (default
    /// [`defaults::MAX_ATTEMPTS`]: no limit).
    pub max_attempts: i32,
    /// How long after its first failed attempt a row is retried (default
    /// [`defaults::RETRY_FOR`]); a route may have its own
    /// ([`Sink::retry_for`](crate::Sink::retry_for)).
    pub retry_for: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: defaults::BACKOFF_BASE,
            max: defaults::BACKOFF_MAX,
            max_attempts: defaults::MAX_ATTEMPTS,
            retry_for: defaults::RETRY_FOR,
        }
    }
}

impl Backoff {
    /// The nominal delay after the `attempts`-th failure (1-based), without jitter.
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = outbox_relay::Backoff::default();
    /// assert_eq!(b.nominal(3), Duration::from_millis(800));
    /// ```
    pub fn nominal(&self, attempts: i32) -> Duration {
        doubled(self.base, self.max, attempts)
    }

    /// The delay to wait after the `attempts`-th failure: nominal plus 0–10% jitter.
    pub fn delay(&self, attempts: i32) -> Duration {
        let nominal = self.nominal(attempts);
        nominal.mul_f64(1.0 + rand::rng().random_range(0.0..0.1))
    }

    /// Whether a row that just failed its `attempts`-th attempt,
    /// `failing_for` after its first failed attempt (zero for the first),
    /// is a dead letter: its retry window ended, or it reached
    /// `max_attempts`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = outbox_relay::Backoff { retry_for: Duration::from_secs(60), ..Default::default() };
    /// assert!(!b.is_dead(1, Duration::ZERO));
    /// assert!(!b.is_dead(500, Duration::from_secs(59)));
    /// assert!(b.is_dead(9, Duration::from_secs(60)));
    /// ```
    pub fn is_dead(&self, attempts: i32, failing_for: Duration) -> bool {
        attempts >= self.max_attempts || failing_for >= self.retry_for
    }
}

/// A loop's wait between tries: `initial`, doubling to `max`, each wait
/// jittered down by up to 20%; [`Doubling::reset`] when a try gets through.
///
/// ```
/// use std::time::Duration;
/// use outbox_relay::backoff::Doubling;
/// let mut wait = Doubling::new(Duration::from_millis(100), Duration::from_secs(1));
/// let first = wait.next_delay();
/// assert!(first <= Duration::from_millis(100) && first >= Duration::from_millis(80));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Doubling {
    initial: Duration,
    max: Duration,
    /// Waits handed out since the last reset.
    waits: i32,
}

impl Doubling {
    /// Starts at `initial`.
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            waits: 0,
        }
    }

    /// The next wait, without jitter, and without taking it.
    pub fn nominal(&self) -> Duration {
        doubled(self.initial, self.max, self.waits.saturating_add(1))
    }

    /// The next wait: nominal less 0–20% jitter. The one after doubles.
    pub fn next_delay(&mut self) -> Duration {
        let nominal = self.nominal();
        self.waits = self.waits.saturating_add(1);
        nominal.mul_f64(rand::rng().random_range(0.8..=1.0))
    }

    /// A try got through: the next wait is `initial` again.
    pub fn reset(&mut self) {
        self.waits = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_base_and_caps() {
        let b = Backoff {
            base: Duration::from_millis(200),
            max: Duration::from_secs(1),
            max_attempts: 5,
            retry_for: Duration::from_secs(60),
        };
        let ms: Vec<u128> = (1..=5).map(|n| b.nominal(n).as_millis()).collect();
        assert_eq!(ms, [200, 400, 800, 1000, 1000]);
        assert_eq!(b.nominal(i32::MAX), Duration::from_secs(1));
        assert_eq!(b.nominal(0), Duration::from_millis(200), "never below base");
        assert_eq!(b.nominal(i32::MIN), Duration::from_millis(200));
    }

    /// What the defaults make of a day (docs/relay.md quotes it): the
    /// attempts a row gets before its window ends, nominal (no jitter) and
    /// with the most jitter (10% on every delay).
    #[test]
    fn the_default_window_is_about_290_attempts() {
        let b = Backoff::default();
        assert_eq!(b.max_attempts, i32::MAX, "no count limit by default");
        let attempts = |stretch: f64| {
            // The first attempt fails at 0; each later one after its delay.
            let (mut n, mut at) = (1, Duration::ZERO);
            while !b.is_dead(n, at) {
                at += b.nominal(n).mul_f64(stretch);
                n += 1;
            }
            n
        };
        assert_eq!((attempts(1.0), attempts(1.1)), (299, 273));
        // 11 doublings from 200 ms reach the 5 min cap within 7 minutes.
        let doubling: Duration = (1..=11).map(|n| b.nominal(n)).sum();
        assert_eq!(b.nominal(12), Duration::from_secs(300));
        assert!(doubling < Duration::from_secs(7 * 60), "{doubling:?}");
    }

    #[test]
    fn the_window_counts_from_the_first_failure_and_max_attempts_ends_it_sooner() {
        let b = Backoff {
            retry_for: Duration::from_secs(10),
            ..Backoff::default()
        };
        assert!(!b.is_dead(1, Duration::ZERO), "a first failure never ends it");
        assert!(!b.is_dead(1000, Duration::from_secs(9)));
        assert!(b.is_dead(2, Duration::from_secs(10)));
        let b = Backoff { max_attempts: 3, ..b };
        assert!(!b.is_dead(2, Duration::ZERO));
        assert!(b.is_dead(3, Duration::ZERO));
    }

    #[test]
    fn jitter_only_adds_up_to_ten_percent() {
        let b = Backoff::default();
        for _ in 0..1000 {
            let d = b.delay(2);
            assert!(
                d >= Duration::from_millis(400) && d < Duration::from_millis(440),
                "{d:?}"
            );
        }
    }

    #[test]
    fn doubling_caps_resets_and_only_jitters_down() {
        let ms = Duration::from_millis;
        let mut wait = Doubling::new(ms(100), ms(1000));
        let mut nominal = Vec::new();
        for _ in 0..6 {
            let expected = wait.nominal();
            nominal.push(expected.as_millis());
            let got = wait.next_delay();
            assert!(
                got <= expected && got >= expected.mul_f64(0.8),
                "{got:?} for {expected:?}"
            );
        }
        assert_eq!(nominal, [100, 200, 400, 800, 1000, 1000]);
        wait.reset();
        assert_eq!(wait.nominal(), ms(100));
        // A wait that never stops doubling stays at the cap.
        for _ in 0..100 {
            wait.next_delay();
        }
        assert_eq!(wait.nominal(), ms(1000));
    }

    /// A reconnect loop sleeping on its waits: five failures take between
    /// 80% and 100% of 100 + 200 + 400 + 800 + 1000 ms, never longer.
    #[tokio::test(start_paused = true)]
    async fn a_loop_sleeping_on_its_waits_is_bounded_by_the_nominal_sum() {
        let mut wait = Doubling::new(Duration::from_millis(100), Duration::from_secs(1));
        let started = tokio::time::Instant::now();
        for _ in 0..5 {
            tokio::time::sleep(wait.next_delay()).await;
        }
        let elapsed = started.elapsed();
        assert!(
            elapsed <= Duration::from_millis(2500) && elapsed >= Duration::from_millis(2000),
            "{elapsed:?}"
        );
    }
}
