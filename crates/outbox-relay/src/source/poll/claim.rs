//! The two ways the polling source claims a batch, behind one seam
//! ([`Claiming`]): by lock ([`ByLock`], `--claim lock`, the default) and by
//! deadline ([`ByDeadline`], `--claim deadline`).
//!
//! Both run in the same two-connection pipeline (see the parent module);
//! what differs is what holds a batch while it is at the sink, and so how
//! its outcomes are made durable and how it is given back:
//!
//! | | by lock | by deadline |
//! |---|---|---|
//! | holds the batch | row locks in a transaction open during delivery | `claimed_until`/`claimed_by` written by a claim that commits at once |
//! | marks | `MARK_FAILED` then `COMMIT` of the claim's transaction | `MARK_DEADLINE_CLAIM`, its own transaction, fenced by the claim |
//! | gives back | `ROLLBACK` | `RELEASE_DEADLINE_CLAIM` |
//! | a claim that found nothing | `COMMIT` of its empty transaction | nothing open |
//! | a relay declared dead | its batch connections are terminated (they hold locks); through a transaction-mode pooler, whose server connections are not its own, the server ends a transaction idle for the lease timeout instead | nothing to terminate: the deadline runs out |
//!
//! It owns no connection and no pipeline state: the parent passes the
//! session and the batch in, and keeps the invariant that at most one
//! transaction is open per connection.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::sql::{
    ClaimFloor, ClaimParams, ClaimedRows, DeadlineClaim, DeadlineMarks, Fence, FloorParams, MarkFailedParams,
};
use tracing::warn;
use uuid::Uuid;

use super::{Session, Settled};
use crate::source::SourceError;

/// What a round trip gives back.
pub(super) struct RoundTrip {
    /// The settled batch, as marked.
    pub(super) settled: Option<Settled>,
    /// The rows claimed, if it claimed.
    pub(super) claimed: Option<ClaimedRows>,
    /// The claim floor, if it was asked for. Its failure is not the
    /// batch's: the floor stays where it was, which is still correct.
    pub(super) floor: Option<Result<ClaimFloor, tokio_postgres::Error>>,
}

/// What one round trip sends, besides the settled batch's marks.
#[derive(Clone, Copy)]
pub(super) struct Ask<'a> {
    /// The claim, if any.
    pub(super) claim: Option<&'a ClaimParams<'a>>,
    /// The floor statement, if due (`FIND_CLAIM_FLOOR`): sent after the
    /// marks are committed and before the claim's transaction begins, so
    /// it runs in a snapshot of its own.
    pub(super) floor: Option<&'a FloorParams>,
}

/// The floor statement if asked for, on `s`, outside any transaction.
async fn find_floor(
    s: &Session,
    floor: Option<&FloorParams>,
) -> Option<Result<ClaimFloor, tokio_postgres::Error>> {
    match floor {
        Some(p) => Some(s.statements.find_floor(&s.client, p).await),
        None => None,
    }
}

/// One way of claiming (see the [module docs](self)).
pub(super) trait Claiming: Send + Sync {
    /// On `s`, in one round trip: makes `settled`'s outcomes durable (if
    /// any), then finds the floor and claims, as `ask` says.
    fn round_trip<'a>(
        &'a self,
        s: &'a Session,
        settled: Option<Settled>,
        ask: Ask<'a>,
    ) -> BoxFuture<'a, Result<RoundTrip, SourceError>>;

    /// Gives a batch back unsent, due again now: `held` is a deadline
    /// claim's ids and fence (None for a lock claim).
    fn release<'a>(
        &'a self,
        s: &'a Session,
        held: Option<(&'a [i64], Fence)>,
    ) -> BoxFuture<'a, Result<(), SourceError>>;

    /// Ends what a claim that found no row began on `s`.
    fn close_empty<'a>(&'a self, s: &'a Session) -> BoxFuture<'a, Result<(), SourceError>>;

    /// Whether a batch keeps row locks on its connection while at the
    /// sink, so the lease tick records the batch connections for another
    /// relay to terminate if it declares this one dead.
    fn holds_locks(&self) -> bool;

    /// What the claim writes on its rows (`ClaimParams::deadline`).
    fn deadline(&self) -> Option<DeadlineClaim>;

    /// The pipeline was reset: the batches it held are forgotten. Claims
    /// that outlive a reset are abandoned (see [`ByDeadline`]).
    fn reset(&mut self) {}

    /// Gives back, on `s`, what earlier resets abandoned, before the next
    /// claim.
    fn give_back_abandoned<'a>(&'a mut self, _s: &'a Session) -> BoxFuture<'a, Result<(), SourceError>> {
        async { Ok(()) }.boxed()
    }
}

/// `FOR UPDATE SKIP LOCKED` in a transaction open while the batch is at the
/// sink; its `COMMIT` makes the marks durable, a crash rolls it back.
pub(super) struct ByLock;

/// The failure marks a settled batch sends, by either claim.
fn failed_params(settled: &Settled) -> MarkFailedParams<'_> {
    let f = &settled.outcomes.failures;
    MarkFailedParams {
        ids: &f.ids,
        errors: &f.errors,
        attempts: &f.attempts,
        delay_ms: &f.delay_ms,
        dead: &f.dead_letter,
    }
}

impl Claiming for ByLock {
    /// The marks and COMMIT of `settled`, the floor statement, then BEGIN
    /// and the claim.
    ///
    /// The transaction is driven by hand rather than through
    /// `tokio_postgres::Transaction` because tokio-postgres pipelines
    /// requests whose futures are polled together, in the order polled. If
    /// a mark fails, PostgreSQL answers the COMMIT with a rollback, so
    /// nothing of the batch is marked and it is redelivered; the caller then
    /// rolls back the claim that followed.
    fn round_trip<'a>(
        &'a self,
        s: &'a Session,
        settled: Option<Settled>,
        ask: Ask<'a>,
    ) -> BoxFuture<'a, Result<RoundTrip, SourceError>> {
        let claim = ask.claim;
        async move {
            let client = &s.client;
            let (failed, committed, floor, begun, claimed) = tokio::join!(
                async {
                    match &settled {
                        Some(d) if !d.outcomes.failures.ids.is_empty() => {
                            s.statements.mark_failed(client, &failed_params(d)).await
                        }
                        _ => Ok(0),
                    }
                },
                async {
                    if settled.is_some() {
                        client.batch_execute("COMMIT").await?;
                    }
                    Ok::<_, tokio_postgres::Error>(())
                },
                find_floor(s, ask.floor),
                async {
                    if claim.is_some() {
                        s.statements.begin(client).await?;
                    }
                    Ok::<_, tokio_postgres::Error>(())
                },
                async {
                    match claim {
                        Some(params) => s.statements.claim(client, params).await.map(Some),
                        None => Ok(None),
                    }
                },
            );
            failed?;
            committed?;
            begun?;
            Ok(RoundTrip {
                settled,
                claimed: claimed?,
                floor,
            })
        }
        .boxed()
    }

    fn release<'a>(
        &'a self,
        s: &'a Session,
        _held: Option<(&'a [i64], Fence)>,
    ) -> BoxFuture<'a, Result<(), SourceError>> {
        async move { Ok(s.client.batch_execute("ROLLBACK").await?) }.boxed()
    }

    fn close_empty<'a>(&'a self, s: &'a Session) -> BoxFuture<'a, Result<(), SourceError>> {
        async move { Ok(s.client.batch_execute("COMMIT").await?) }.boxed()
    }

    fn holds_locks(&self) -> bool {
        true
    }

    fn deadline(&self) -> Option<DeadlineClaim> {
        None
    }
}

/// A deadline written by a claim that commits at once; the marks are one
/// statement that checks the claim is still this relay's (its fence).
///
/// The claim's probe lets a relay pass its own claims (its pipeline orders
/// them), so its own claims must be ones its pipeline still holds. A reset
/// of the pipeline (a lost connection, a failed batch) forgets batches whose
/// claims committed: one claimed ahead and never delivered, or one whose
/// answer was lost with the connection (after a failover it may be on the
/// new primary). Passing those would deliver an aggregate's later events
/// before them. So a reset retires the claimer id: later claims are written
/// under a fresh one, the retired id's rows block their aggregates like
/// another relay's claims, and the next claim first gives them back
/// (`RELEASE_ABANDONED_CLAIMS`); one that commits after that waits out its
/// deadline.
pub(super) struct ByDeadline {
    /// Whose claims these are: the relay's id (in the lease table, when it
    /// takes leases) until the first reset, then a fresh id per reset.
    pub(super) claimer: Uuid,
    /// Whether a claim went out under `claimer` since the last reset.
    pub(super) claimed: std::sync::atomic::AtomicBool,
    /// Retired claimer ids whose rows were not given back yet.
    pub(super) abandoned: Vec<Uuid>,
    /// `--claim-timeout`.
    pub(super) timeout: Duration,
    /// `outbox_claims_lost_total`.
    pub(super) claims_lost: metrics::Counter,
}

impl ByDeadline {
    /// A deadline claim's marks, in one statement that is its own
    /// transaction (`MARK_DEADLINE_CLAIM`). Rows it finds taken by another
    /// relay (this claim expired) are left to that relay and counted.
    async fn mark(&self, s: &Session, settled: Option<Settled>) -> Result<Option<Settled>, SourceError> {
        let Some(mut d) = settled else {
            return Ok(None);
        };
        let Some(held) = &d.held else {
            return Ok(Some(d));
        };
        let f = &d.outcomes.failures;
        let delivered: Vec<i64> = if f.ids.is_empty() {
            held.ids.clone()
        } else {
            let failed: std::collections::HashSet<i64> = f.ids.iter().copied().collect();
            held.ids
                .iter()
                .copied()
                .filter(|id| !failed.contains(id))
                .collect()
        };
        let marks = DeadlineMarks {
            failed: failed_params(&d),
            delivered: &delivered,
            fence: held.fence,
        };
        let (published, failed) = s.statements.mark_deadline_claim(&s.client, &marks).await?;
        let lost = (held.ids.len() as u64).saturating_sub(published + failed);
        if lost > 0 {
            self.claims_lost.increment(lost);
            warn!(
                lost,
                claimed = held.ids.len(),
                timeout_ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
                "the claim expired before its mark and another relay took these rows: they were delivered twice (raise --claim-timeout above the slowest batch)"
            );
        }
        d.outcomes.published = usize::try_from(published).unwrap_or(usize::MAX);
        Ok(Some(d))
    }
}

impl Claiming for ByDeadline {
    /// The marks of `settled`, the floor statement and the next claim,
    /// each its own statement and transaction, pipelined.
    fn round_trip<'a>(
        &'a self,
        s: &'a Session,
        settled: Option<Settled>,
        ask: Ask<'a>,
    ) -> BoxFuture<'a, Result<RoundTrip, SourceError>> {
        async move {
            let (marked, floor, claimed) =
                tokio::join!(self.mark(s, settled), find_floor(s, ask.floor), async {
                    match ask.claim {
                        Some(params) => {
                            self.claimed.store(true, std::sync::atomic::Ordering::Relaxed);
                            s.statements.claim(&s.client, params).await.map(Some)
                        }
                        None => Ok(None),
                    }
                });
            Ok(RoundTrip {
                settled: marked?,
                claimed: claimed?,
                floor,
            })
        }
        .boxed()
    }

    fn release<'a>(
        &'a self,
        s: &'a Session,
        held: Option<(&'a [i64], Fence)>,
    ) -> BoxFuture<'a, Result<(), SourceError>> {
        async move {
            if let Some((ids, fence)) = held {
                s.statements.release_deadline_claim(&s.client, ids, fence).await?;
            }
            Ok(())
        }
        .boxed()
    }

    fn close_empty<'a>(&'a self, _s: &'a Session) -> BoxFuture<'a, Result<(), SourceError>> {
        async { Ok(()) }.boxed()
    }

    fn holds_locks(&self) -> bool {
        false
    }

    fn deadline(&self) -> Option<DeadlineClaim> {
        Some(DeadlineClaim {
            owner: self.claimer,
            timeout_ms: self.timeout.as_secs_f64() * 1000.0,
        })
    }

    fn reset(&mut self) {
        if self.claimed.swap(false, std::sync::atomic::Ordering::Relaxed) {
            self.abandoned.push(self.claimer);
            self.claimer = Uuid::new_v4();
        }
    }

    fn give_back_abandoned<'a>(&'a mut self, s: &'a Session) -> BoxFuture<'a, Result<(), SourceError>> {
        async move {
            if self.abandoned.is_empty() {
                return Ok(());
            }
            let released = s
                .statements
                .release_abandoned_claims(&s.client, &self.abandoned)
                .await?;
            if released > 0 {
                warn!(
                    rows = released,
                    "gave back the rows of claims forgotten when the batch pipeline was reset; they will be delivered again"
                );
            }
            self.abandoned.clear();
            Ok(())
        }
        .boxed()
    }
}
