//! The claim floor: the id a polling source's claims start their walk of
//! the partial index from, kept in memory per source (lane), and when it
//! may rise.
//!
//! # Why
//!
//! Marking a row published changes the partial index's predicate, so the
//! update is never HOT: the old version's entry stays in
//! `<table>_unpublished_idx` until vacuum removes it, and vacuum cannot
//! while any session holds an older snapshot (a long `REPEATABLE READ`
//! transaction, `pg_dump`, a session idle in a transaction). A claim
//! walking the index from its start then visits every row published since
//! that snapshot was taken, and slows down as they pile up (issue 32:
//! 200,000 events with one snapshot held, the last claims at 15% of the
//! clean rate). From a floor, the walk skips them.
//!
//! # What may lie below the floor
//!
//! The floor only rises to what `FIND_CLAIM_FLOOR` (`outbox::sql`, one
//! statement, one snapshot, sent in a claim's round trip every few claims)
//! found: the smaller of
//!
//! - the *head*, the first row at or above the floor that is waiting and
//!   due. A row a lock claim in flight has marked counts as waiting (its
//!   mark is not committed), so the floor never passes a batch that may
//!   still be rolled back;
//! - the first *gap*, an id with no visible row at all: `nextval` handed it
//!   to a transaction still in progress, which will commit a row there
//!   later (an interleaved uncommitted transaction), or it was rolled back
//!   or deleted.
//!
//! So every id below the floor had, in some snapshot the floor was computed
//! from, a row that was published, a dead letter or not due yet, or no row
//! and never will (a settled gap, below). Such an id becomes claimable again
//! only in these ways, each of which makes the next claim a *sweep*: a claim
//! from 0, after which the floor is computed again from 0.
//!
//! - A retry comes due (this source's own: its failures' times, learned
//!   when each batch commits, and the next retry read at each (re)connect).
//! - A batch is given back or rolled back (`give_back`, `hold`, `recover`, a
//!   reconnect). A deadline claim commits at once and writes its deadline
//!   as `next_attempt_at`, so the floor passes its rows as not due: they
//!   are marked, or given back, or (past the deadline) taken by another
//!   relay's claim.
//! - The partitions held change: rows of a gained partition were another
//!   relay's, retries and deadline claims included.
//! - Dead letters are requeued (`dlq requeue`, the console): deleted and
//!   inserted again under their old ids. Both notify with the payload
//!   [`outbox::sql::NOTIFY_SWEEP`].
//! - The idle source wakes for a retry, the fallback poll or a lease tick
//!   that found due rows.
//! - Every [`SWEEP_EVERY`] in any case: another relay's retries and expired
//!   deadline claims under `--ordering none`, a requeue by an older `outbox`,
//!   anything the list above missed. It bounds how late such a row is.
//!
//! # Gaps
//!
//! A gap may be filled later, by the transaction that allocated the id, so
//! the floor stops at it until it is *settled*: it stayed a gap for
//! [`SETTLE`], then every transaction in progress at a snapshot taken that
//! long after it was first seen has ended (the statement returns its
//! snapshot's in-progress ids; an id is over once a later snapshot no longer
//! lists it). The allocator of an id below the head at first sight called
//! `nextval` before that snapshot (ids are handed out in order, and the
//! head's row had committed); `SETTLE` later it has a transaction id (a
//! plain `INSERT` gets one in the same instant) and is in the second
//! snapshot if still running. So once those have ended, every id below
//! that head still without a row never gets one, and the source remembers
//! that bound (`settled`) for good: the statement no longer reports gaps
//! below it, so one settle covers a whole range of rolled-back or deleted
//! ids. Two cases fall outside (the periodic sweep still delivers their
//! rows, late): an id taken by an explicit `nextval` long before its
//! `INSERT`, and a sequence with `CACHE` above 1, which hands ids out of
//! order across sessions.
//!
//! Why the later snapshot and not the one that first saw the gap: an
//! allocator caught between its `nextval` and its transaction id is in
//! neither that snapshot's in-progress list nor the table, and if it then
//! ran long, its row would commit below the floor, after later rows of the
//! same transaction above it had been delivered. The price: a transaction
//! that got its id within `SETTLE` after the gap was first seen is waited
//! for too.
//!
//! A long transaction that holds a transaction id (idle after a write)
//! therefore holds the floor at any gap first seen while it runs (or up to
//! `SETTLE` before it began), until it ends; if it inserted into the
//! outbox, its own row's id is such a gap, as it must be. It pins nothing
//! seen after it ended. A relay starting while one runs keeps its floor at
//! 0 until it ends (id 0, below every row, is its first gap), claiming as
//! fast as a relay without a floor.
//!
//! # Order
//!
//! Strict per-aggregate order is the strict claim's `NOT EXISTS` probe,
//! which looks at the whole aggregate whatever the floor. Partition order
//! holds because the floor never passes a row that is waiting and due, nor
//! an id that may still commit: a claim from the floor takes what a claim
//! from 0 would, less rows that were not claimable anyway. Several relays
//! share the table through their partitions; the statement looks at the
//! whole table, not this relay's partitions, so a slower relay's rows
//! hold every relay's floor (correct, and one probe cheaper than a
//! filtered walk).

use std::time::{Duration, Instant};

use metrics::Gauge;
use outbox::sql::{ClaimFloor, FloorParams};

/// How long a gap must stay one before the transactions in progress are
/// taken as the ones that may fill it. A plain `INSERT` calls `nextval`
/// for its default and gets its transaction id in the same instant; this
/// is far longer than that window, so by then the allocator of any id seen
/// missing is in the snapshot's in-progress list if it is still running.
pub const SETTLE: Duration = Duration::from_secs(1);

/// The safety sweep: at least this often a claim starts from 0. It is what
/// bounds the delay of a row that became claimable below the floor in a
/// way this source was not told about; one walk over the dead index
/// entries per interval costs a busy relay under a held snapshot well
/// under 1% (a walk of 200,000 entries takes about 10 ms).
pub(super) const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// The floor is computed again in one claim round trip out of this many:
/// the claims between start up to this many batches below where they
/// could, which costs little, and the statement's cost is shared by them.
/// Measured (docs/bench.md, "Claim floor"): every claim, every 4th and
/// every 16th were alike within the noise, clean (batch 1, 10 and 100)
/// and with a snapshot held; 4 keeps the walk short and the statement rare.
const EVERY_CLAIMS: u32 = 4;

/// While a gap holds the floor, it is looked at again at most this often
/// (nothing moves until its transactions end or it fills), however many
/// claims are made meanwhile: a relay started on a full table walks from 0
/// until its first gap (id 0) settles, so a quick look counts.
const RECHECK: Duration = Duration::from_millis(100);

/// Retry times remembered for sweeps; later ones wait for the periodic
/// sweep.
const RETRIES_KEPT: usize = 256;

/// See the [module docs](self).
pub(super) struct Floor {
    /// Where claims start.
    at: i64,
    /// Bumped by each sweep: an answer to a statement sent before it is
    /// stale.
    generation: u64,
    /// Every id below this with no row is known never to get one.
    settled: i64,
    /// The gap holding the floor, while it settles.
    watch: Option<Watch>,
    /// The next claim sweeps.
    sweep_next: bool,
    /// When the periodic sweep is due.
    next_sweep: Instant,
    /// Retry times not yet swept for, ascending.
    retries: Vec<Instant>,
    /// Claims since the floor was last asked for.
    claims: u32,
    /// When it was last asked for.
    asked_at: Option<Instant>,
    /// `outbox_claim_floor`, for the relay's own lane.
    gauge: Option<Gauge>,
}

/// A gap first seen at `seen`, below `upto` (the head then).
struct Watch {
    upto: i64,
    seen: Instant,
    /// The transactions in progress at the first snapshot at least
    /// [`SETTLE`] after `seen`.
    waiting: Option<Vec<i64>>,
}

/// A floor statement sent with a round trip, and what its answer applies
/// to.
#[derive(Debug, Clone, Copy)]
pub(super) struct Asked {
    pub(super) params: FloorParams,
    generation: u64,
}

impl Floor {
    /// A floor at 0; the first claim sweeps (and asks for the floor).
    pub(super) fn new(gauge: Option<Gauge>, now: Instant) -> Self {
        Self {
            at: 0,
            generation: 0,
            settled: 0,
            watch: None,
            sweep_next: true,
            next_sweep: now,
            retries: Vec::new(),
            claims: 0,
            asked_at: None,
            gauge,
        }
    }

    /// The floor the claim about to be sent starts from: 0 if a sweep is
    /// due.
    pub(super) fn for_claim(&mut self, now: Instant) -> i64 {
        let retry_due = self.retries.first().is_some_and(|r| *r <= now);
        if self.sweep_next || now >= self.next_sweep || retry_due {
            self.sweep(now);
        }
        self.claims += 1;
        self.at
    }

    /// Whether this round trip should carry the floor statement, and from
    /// where. Call after [`Floor::for_claim`].
    pub(super) fn ask(&mut self, now: Instant) -> Option<Asked> {
        let due = if self.watch.is_some() {
            self.asked_at.is_none_or(|a| now >= a + RECHECK)
        } else {
            self.claims >= EVERY_CLAIMS
        };
        if !due {
            return None;
        }
        self.claims = 0;
        self.asked_at = Some(now);
        Some(Asked {
            params: FloorParams {
                from: self.at,
                settled: self.settled,
            },
            generation: self.generation,
        })
    }

    /// What the statement sent as `asked` found, at `now`.
    pub(super) fn found(&mut self, asked: Asked, found: ClaimFloor, now: Instant) {
        if asked.generation != self.generation || asked.params.from != self.at {
            return;
        }
        let mut candidate = found.head;
        match found.gap {
            None => {
                // Every id in [from, head) has a row: none can be a gap later.
                self.settled = self.settled.max(found.head);
                self.watch = None;
            }
            Some(gap) => {
                candidate = gap;
                self.watch_gap(gap, &found, now);
            }
        }
        if candidate > self.at {
            self.at = candidate;
            if let Some(g) = &self.gauge {
                // An id: exact in an f64 up to 2^53.
                #[allow(clippy::cast_precision_loss)]
                g.set(candidate as f64);
            }
        }
    }

    /// `gap` holds the floor: settles it, or starts watching it.
    fn watch_gap(&mut self, gap: i64, found: &ClaimFloor, now: Instant) {
        let Some(w) = self.watch.as_mut().filter(|w| gap < w.upto) else {
            self.watch = Some(Watch {
                upto: found.head,
                seen: now,
                waiting: None,
            });
            return;
        };
        match &w.waiting {
            None => {
                if now >= w.seen + SETTLE {
                    w.waiting = Some(found.in_progress.clone());
                }
            }
            Some(waiting) => {
                let mut running = found.in_progress.clone();
                running.sort_unstable();
                if waiting.iter().all(|x| running.binary_search(x).is_err()) {
                    self.settled = self.settled.max(w.upto);
                    self.watch = None;
                    // Look past it at the next round trip.
                    self.claims = EVERY_CLAIMS;
                }
            }
        }
    }

    /// The next claim sweeps: a batch was given back, the connections were
    /// replaced, the partitions changed, dead letters were requeued.
    pub(super) fn sweep_next(&mut self) {
        self.sweep_next = true;
    }

    /// A row this source failed comes due at `at`: the first claim from
    /// then on sweeps.
    pub(super) fn retry_at(&mut self, at: Instant) {
        let i = self.retries.partition_point(|r| *r <= at);
        if self.retries.get(i.wrapping_sub(1)) == Some(&at) {
            return;
        }
        self.retries.insert(i, at);
        self.retries.truncate(RETRIES_KEPT);
    }

    /// The earliest retry not yet swept for, for the idle wait.
    pub(super) fn next_retry(&self) -> Option<Instant> {
        self.retries.first().copied()
    }

    /// Where claims start now.
    #[cfg(test)]
    fn at(&self) -> i64 {
        self.at
    }

    fn sweep(&mut self, now: Instant) {
        self.at = 0;
        self.generation += 1;
        self.sweep_next = false;
        self.next_sweep = now + SWEEP_EVERY;
        let due = self.retries.partition_point(|r| *r <= now);
        self.retries.drain(..due);
        // The floor is computed again from 0 in this very round trip.
        self.claims = EVERY_CLAIMS;
        self.asked_at = None;
        if let Some(g) = &self.gauge {
            g.set(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(head: i64, gap: Option<i64>, in_progress: &[i64]) -> ClaimFloor {
        ClaimFloor {
            head,
            gap,
            in_progress: in_progress.to_vec(),
        }
    }

    /// The first claim sweeps and asks from 0; then the floor follows the
    /// head and is asked for every `EVERY_CLAIMS` claims.
    #[test]
    fn the_floor_follows_the_head() {
        let t0 = Instant::now();
        let mut f = Floor::new(None, t0);
        assert_eq!(f.for_claim(t0), 0);
        let asked = f.ask(t0).expect("a sweep asks at once");
        assert_eq!(asked.params, FloorParams { from: 0, settled: 0 });
        f.found(asked, found(100, None, &[]), t0);
        assert_eq!(f.at(), 100);
        for _ in 1..EVERY_CLAIMS {
            assert_eq!(f.for_claim(t0), 100);
            assert!(f.ask(t0).is_none());
        }
        assert_eq!(f.for_claim(t0), 100);
        let asked = f.ask(t0).expect("every few claims");
        assert_eq!(
            asked.params,
            FloorParams {
                from: 100,
                settled: 100
            }
        );
    }

    /// A gap holds the floor until it stayed one for `SETTLE` and the
    /// transactions in progress then have ended; then ids below the head
    /// at first sight are settled.
    #[test]
    fn a_gap_is_passed_once_settled() {
        let t0 = Instant::now();
        let mut f = Floor::new(None, t0);
        f.for_claim(t0);
        let asked = f.ask(t0).unwrap();
        f.found(asked, found(50, Some(10), &[7]), t0);
        assert_eq!(f.at(), 10, "the floor stops at the gap");
        // Later looks: still a gap, not yet settled.
        let t1 = t0 + SETTLE / 2;
        f.for_claim(t1);
        let asked = f.ask(t1).unwrap();
        f.found(asked, found(80, Some(10), &[]), t1);
        assert_eq!(f.at(), 10);
        // SETTLE after first sight: who runs now must end first.
        let t2 = t0 + SETTLE;
        f.for_claim(t2);
        let asked = f.ask(t2).unwrap();
        f.found(asked, found(90, Some(10), &[8, 9]), t2);
        assert_eq!(f.at(), 10);
        let t3 = t2 + RECHECK;
        f.for_claim(t3);
        let asked = f.ask(t3).unwrap();
        f.found(asked, found(95, Some(10), &[9, 12]), t3);
        assert_eq!(f.at(), 10, "transaction 9 still runs");
        let t4 = t3 + RECHECK;
        f.for_claim(t4);
        let asked = f.ask(t4).unwrap();
        f.found(asked, found(99, Some(10), &[12]), t4);
        // Settled below 50 (the head at first sight); asked again at once.
        f.for_claim(t4);
        let asked = f.ask(t4).expect("looks past the settled gap at once");
        assert_eq!(
            asked.params,
            FloorParams {
                from: 10,
                settled: 50
            }
        );
        f.found(asked, found(99, None, &[]), t4);
        assert_eq!(f.at(), 99);
    }

    /// A retry time, a given-back batch and the periodic timer each make
    /// the next claim a sweep from 0, answered from 0.
    #[test]
    fn sweeps_start_from_zero() {
        let t0 = Instant::now();
        let mut f = Floor::new(None, t0);
        f.for_claim(t0);
        let asked = f.ask(t0).unwrap();
        f.found(asked, found(100, None, &[]), t0);
        f.retry_at(t0 + Duration::from_millis(10));
        assert_eq!(f.next_retry(), Some(t0 + Duration::from_millis(10)));
        assert_eq!(f.for_claim(t0), 100, "not due yet");
        let t1 = t0 + Duration::from_millis(10);
        assert_eq!(f.for_claim(t1), 0, "the retry came due");
        assert_eq!(f.next_retry(), None);
        // An answer to a statement sent before the sweep is stale.
        f.found(asked, found(200, None, &[]), t1);
        assert_eq!(f.at(), 0);
        let asked = f.ask(t1).unwrap();
        assert_eq!(asked.params.from, 0);
        f.found(asked, found(100, None, &[]), t1);
        assert_eq!(f.at(), 100);
        f.sweep_next();
        assert_eq!(f.for_claim(t1), 0);
        let asked = f.ask(t1).unwrap();
        f.found(asked, found(100, None, &[]), t1);
        assert_eq!(f.for_claim(t1 + SWEEP_EVERY), 0, "the periodic sweep");
    }
}
