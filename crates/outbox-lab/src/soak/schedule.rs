//! The soak's fault schedule, drawn up front from `--seed`: when each
//! relay is killed (and how), and when each rarer fault (a PostgreSQL
//! restart, a sink outage, a split brain...) strikes.
//!
//! The seed reproduces the schedule: the same faults, targets and offsets.
//! It cannot reproduce the operating system's timing (which row a relay
//! had claimed when the SIGKILL landed), which is why a run prints it and
//! a failing one should be rerun with it a few times.

use std::time::Duration;

use serde::Serialize;

/// SplitMix64: small, fast and good enough to spread faults; the schedule
/// needs reproducibility, not cryptography, so no crate.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `[lo, hi)`.
    pub(crate) fn between(&mut self, lo: f64, hi: f64) -> f64 {
        // 53 random bits make an f64 in [0, 1).
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * unit
    }

    pub(crate) fn chance(&mut self, p: f64) -> bool {
        self.between(0.0, 1.0) < p
    }

    /// A generator for another task, so tasks draw independently.
    pub(crate) fn fork(&mut self) -> Self {
        Self(self.next_u64())
    }
}

/// Where an event goes in: the polled table or the log-tailed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Src {
    Poll,
    Wal,
}

impl Src {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Src::Poll => "poll",
            Src::Wal => "wal",
        }
    }
}

/// How PostgreSQL goes down before it is started again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum PgStop {
    /// `pg_ctl stop -m fast` (SIGINT): sessions cut, a checkpoint.
    Fast,
    /// `-m immediate` (SIGQUIT): no checkpoint, crash recovery at start.
    Immediate,
    /// SIGKILL to every server process, like a power cut.
    Crash,
}

/// A rare fault (relay kills have their own list).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub(crate) enum Fault {
    PgRestart {
        stop: PgStop,
    },
    /// `pg_terminate_backend` of the soak's relays' connections (in its
    /// database, by their `application_name`s).
    TerminateBackends,
    /// The sink (redis-server) stopped for this long.
    SinkOutage {
        seconds: f64,
    },
    /// A polling relay SIGSTOPped past its lease, then SIGCONTinued.
    SplitBrain,
    /// `ALTER TABLE … ADD COLUMN` on both outboxes.
    AddColumn,
    /// The WAL source's slot invalidated by `max_slot_wal_keep_size`,
    /// then `outbox migrate --wal --recover`.
    SlotInvalidation,
    /// One transaction of many events.
    BigTransaction {
        src: Src,
        events: u32,
    },
    /// A writer process SIGKILLed with its transaction open.
    WriterKilledBeforeCommit {
        src: Src,
    },
    /// A consumer SIGKILLed and kept down this long.
    ConsumerDead {
        seconds: f64,
    },
}

impl Fault {
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Fault::PgRestart { stop: PgStop::Fast } => "PostgreSQL restart (fast)",
            Fault::PgRestart {
                stop: PgStop::Immediate,
            } => "PostgreSQL restart (immediate)",
            Fault::PgRestart { stop: PgStop::Crash } => "PostgreSQL crash (SIGKILL)",
            Fault::TerminateBackends => "pg_terminate_backend of relay connections",
            Fault::SinkOutage { .. } => "sink outage",
            Fault::SplitBrain => "split brain (SIGSTOP past the lease)",
            Fault::AddColumn => "ALTER TABLE ADD COLUMN",
            Fault::SlotInvalidation => "slot invalidated, then --recover",
            Fault::BigTransaction { .. } => "large transaction",
            Fault::WriterKilledBeforeCommit { .. } => "writer SIGKILLed before COMMIT",
            Fault::ConsumerDead { .. } => "consumer dead",
        }
    }

    /// Runs beside the others instead of in turn (it involves neither the
    /// relays nor the servers).
    pub(crate) fn concurrent(&self) -> bool {
        matches!(
            self,
            Fault::BigTransaction { .. }
                | Fault::WriterKilledBeforeCommit { .. }
                | Fault::ConsumerDead { .. }
        )
    }
}

/// The fewest relay kills at the failpoint a run plans (if it kills that
/// often at all); the others are drawn, 30% of the kills.
const MIN_AFTER_ACK: usize = 2;

/// How a relay is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum KillKind {
    /// SIGKILL wherever it is.
    Anywhere,
    /// Restarted with the `pause-after-deliver` failpoint and SIGKILLed
    /// once parked there: between the sink's ack and the mark.
    AfterAck,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct PlannedKill {
    pub(crate) at: Duration,
    /// An index into the run's relays (taken modulo their number).
    pub(crate) relay: u64,
    pub(crate) kind: KillKind,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Planned {
    pub(crate) at: Duration,
    pub(crate) fault: Fault,
}

/// How much of each fault one run injects.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    pub(crate) duration: Duration,
    pub(crate) pg_restarts: u32,
    pub(crate) terminations: u32,
    pub(crate) outages: u32,
    /// Seconds an outage lasts, drawn in this range.
    pub(crate) outage_seconds: (f64, f64),
    pub(crate) split_brains: u32,
    pub(crate) add_columns: u32,
    pub(crate) slot_invalidation: bool,
    pub(crate) big_transactions: u32,
    pub(crate) big_events: u32,
    pub(crate) doomed_writers: u32,
    pub(crate) consumer_dead_seconds: f64,
    /// Seconds between relay kills, drawn in this range.
    pub(crate) kill_every: (f64, f64),
}

/// The part of the run faults are injected in: after a warm-up, and ending
/// early enough that the last ones have settled before the writers stop.
const FAULTS_FROM: f64 = 0.06;
const FAULTS_UNTIL: f64 = 0.82;

/// The rare faults at their offsets, in order, and the relay kills.
pub(crate) fn draw(budget: &Budget, sources: &[Src], rng: &mut Rng) -> (Vec<Planned>, Vec<PlannedKill>) {
    let mut faults = Vec::new();
    let stops = [PgStop::Fast, PgStop::Immediate, PgStop::Crash];
    for i in 0..budget.pg_restarts {
        faults.push(Fault::PgRestart {
            stop: stops[i as usize % stops.len()],
        });
    }
    for _ in 0..budget.terminations {
        faults.push(Fault::TerminateBackends);
    }
    for _ in 0..budget.outages {
        let (lo, hi) = budget.outage_seconds;
        faults.push(Fault::SinkOutage {
            seconds: rng.between(lo, hi).round(),
        });
    }
    if sources.contains(&Src::Poll) {
        for _ in 0..budget.split_brains {
            faults.push(Fault::SplitBrain);
        }
    }
    for _ in 0..budget.add_columns {
        faults.push(Fault::AddColumn);
    }
    if budget.slot_invalidation && sources.contains(&Src::Wal) {
        faults.push(Fault::SlotInvalidation);
    }
    for i in 0..budget.big_transactions {
        faults.push(Fault::BigTransaction {
            src: sources[i as usize % sources.len()],
            events: budget.big_events,
        });
    }
    for i in 0..budget.doomed_writers {
        faults.push(Fault::WriterKilledBeforeCommit {
            src: sources[i as usize % sources.len()],
        });
    }
    faults.push(Fault::ConsumerDead {
        seconds: budget.consumer_dead_seconds,
    });

    // Fisher-Yates, then one fault per equal slot of the window, at a
    // random point of its first half: spread out, never bunched.
    for i in (1..faults.len()).rev() {
        faults.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let d = budget.duration.as_secs_f64();
    let (from, until) = (d * FAULTS_FROM, d * FAULTS_UNTIL);
    let slot = (until - from) / faults.len() as f64;
    let planned = faults
        .into_iter()
        .enumerate()
        .map(|(i, fault)| Planned {
            at: Duration::from_secs_f64(from + slot * i as f64 + rng.between(0.0, slot / 2.0)),
            fault,
        })
        .collect();

    let mut kills = Vec::new();
    let (lo, hi) = budget.kill_every;
    let mut at = d * FAULTS_FROM / 2.0;
    while at < until {
        kills.push(PlannedKill {
            at: Duration::from_secs_f64(at),
            relay: rng.next_u64(),
            kind: if rng.chance(0.3) {
                KillKind::AfterAck
            } else {
                KillKind::Anywhere
            },
        });
        at += rng.between(lo, hi);
    }
    // Whatever the draw, a few kills at the failpoint: one that meets a
    // server down is made a plain kill, and a run must still test one.
    let drawn = kills.iter().filter(|k| k.kind == KillKind::AfterAck).count();
    let mut missing = MIN_AFTER_ACK.saturating_sub(drawn);
    for kill in kills.iter_mut().rev() {
        if missing == 0 {
            break;
        }
        if kill.kind == KillKind::Anywhere {
            kill.kind = KillKind::AfterAck;
            missing -= 1;
        }
    }
    (planned, kills)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Budget {
        Budget {
            duration: Duration::from_secs(600),
            pg_restarts: 3,
            terminations: 2,
            outages: 3,
            outage_seconds: (10.0, 60.0),
            split_brains: 2,
            add_columns: 1,
            slot_invalidation: true,
            big_transactions: 2,
            big_events: 10_000,
            doomed_writers: 2,
            consumer_dead_seconds: 60.0,
            kill_every: (1.5, 3.0),
        }
    }

    #[test]
    fn a_seed_draws_the_same_schedule() {
        let draw_with = |seed| draw(&budget(), &[Src::Poll, Src::Wal], &mut Rng::new(seed));
        let (a, ka) = draw_with(7);
        let (b, kb) = draw_with(7);
        let (c, _) = draw_with(8);
        let times = |p: &[Planned]| p.iter().map(|p| p.at).collect::<Vec<_>>();
        assert_eq!(times(&a), times(&b));
        assert_eq!(ka.len(), kb.len());
        assert_ne!(times(&a), times(&c));
    }

    #[test]
    fn the_budget_is_spent_inside_the_window() {
        let (faults, kills) = draw(&budget(), &[Src::Poll, Src::Wal], &mut Rng::new(1));
        assert_eq!(faults.len(), 3 + 2 + 3 + 2 + 1 + 1 + 2 + 2 + 1);
        let outages: Vec<f64> = faults
            .iter()
            .filter_map(|p| match p.fault {
                Fault::SinkOutage { seconds } => Some(seconds),
                _ => None,
            })
            .collect();
        assert!(outages.iter().all(|s| (10.0..=60.0).contains(s)), "{outages:?}");
        assert!(faults.windows(2).all(|w| w[0].at < w[1].at));
        assert!(faults.iter().all(|p| p.at.as_secs_f64() < 600.0 * FAULTS_UNTIL));
        // 460 s of kills every 1.5–3 s.
        assert!((150..=320).contains(&kills.len()), "{}", kills.len());
    }

    #[test]
    fn every_run_plans_kills_at_the_failpoint() {
        let short = Budget {
            duration: Duration::from_secs(20),
            ..budget()
        };
        for seed in 0..50 {
            let (_, kills) = draw(&short, &[Src::Poll, Src::Wal], &mut Rng::new(seed));
            let after_ack = kills.iter().filter(|k| k.kind == KillKind::AfterAck).count();
            assert!(kills.len() >= 4, "seed {seed}: {} kills", kills.len());
            assert!(
                after_ack >= MIN_AFTER_ACK,
                "seed {seed}: {after_ack} of {}",
                kills.len()
            );
        }
    }

    #[test]
    fn a_poll_only_run_has_no_slot_to_invalidate() {
        let (faults, _) = draw(&budget(), &[Src::Poll], &mut Rng::new(1));
        assert!(!faults.iter().any(|p| p.fault == Fault::SlotInvalidation));
        let (faults, _) = draw(&budget(), &[Src::Wal], &mut Rng::new(1));
        assert!(!faults.iter().any(|p| p.fault == Fault::SplitBrain));
    }
}
