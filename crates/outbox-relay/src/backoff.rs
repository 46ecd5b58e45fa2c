//! The retry schedule and the dead-letter limit.
//!
//! A row's n-th failed delivery waits `base * 2^(n-1)`, capped at `max`, plus
//! up to 10% jitter so relays retrying the same outage do not hit the sink in
//! lockstep. Jitter only ever adds: a row is never retried before its nominal
//! time, which is what the seed's log (200 ms, then 400 ms) shows. A row whose
//! attempts reach `max_attempts` is a dead letter: the claim no longer sees it
//! until an operator requeues it.

use std::time::Duration;

use rand::Rng;

/// Retry delays and the attempt limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failure (default 200 ms).
    pub base: Duration,
    /// Cap on any delay (default 5 min).
    pub max: Duration,
    /// Attempts after which a row is a dead letter (default 5).
    pub max_attempts: i32,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(200),
            max: Duration::from_secs(300),
            max_attempts: 5,
        }
    }
}

impl Backoff {
    /// The nominal delay after the `attempts`-th failure (1-based), without jitter.
    pub fn nominal(&self, attempts: i32) -> Duration {
        let exponent = attempts.saturating_sub(1).clamp(0, 30) as u32;
        self.base.saturating_mul(1 << exponent).min(self.max)
    }

    /// The delay to wait after the `attempts`-th failure: nominal plus 0–10% jitter.
    pub fn delay(&self, attempts: i32) -> Duration {
        let nominal = self.nominal(attempts);
        nominal.mul_f64(1.0 + rand::rng().random_range(0.0..0.1))
    }

    /// Whether a row with this many attempts is a dead letter.
    pub fn is_dead(&self, attempts: i32) -> bool {
        attempts >= self.max_attempts
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
        };
        let ms: Vec<u128> = (1..=5).map(|n| b.nominal(n).as_millis()).collect();
        assert_eq!(ms, [200, 400, 800, 1000, 1000]);
        assert_eq!(b.nominal(i32::MAX), Duration::from_secs(1));
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
}
