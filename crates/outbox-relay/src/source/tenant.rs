//! The source of one outbox of a fleet (see `crate::fleet`): a batch is
//! claimed by lock on a session borrowed from the database's pool, held
//! through delivery, and committed with its marks; then the session goes
//! back to the pool for whichever outbox asked next.
//!
//! Unlike the polling source there is one batch in flight per outbox and
//! no claim ahead: what bounds the fleet is sessions per database, not per
//! outbox, and an outbox's next batch queues behind the other outboxes'.
//! Every claim runs after the fence (`outbox::sql::fleet::fence`) in its
//! transaction, so only the fleet process serving the outbox claims from
//! it, and a process that takes it over waits until this batch ended.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::sql::{ClaimParams, ClaimScope, MarkFailedParams, RelayStatements};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Batch, Claim, Outcomes, Receipts, Source, SourceError};
use crate::config::RelayConfig;
use crate::context::RelayContext;
use crate::error::error_chain;
use crate::fleet::{Database, Lent, Tenant};
use crate::plan::Plan;

/// A batch at the sink: its number, rows and when it was claimed.
struct AtSink {
    batch: u64,
    rows: usize,
    started: Instant,
}

/// A batch delivered and planned, committed by the next claim.
struct Settled {
    batch: u64,
    claimed: usize,
    outcomes: Outcomes,
    started: Instant,
}

/// See the [module docs](self).
pub(crate) struct TenantSource {
    config: RelayConfig,
    ctx: RelayContext,
    tenant: Arc<Tenant>,
    database: Arc<Database>,
    statements: RelayStatements,
    receipts: Receipts,
    /// The session of the batch in flight, from claim to commit.
    session: Option<Lent>,
    at_sink: Option<AtSink>,
    settled: Option<Settled>,
    /// The last claim was not full: wait for a wake-up before the next.
    idle: bool,
    /// The last batch failed; set back by the next commit.
    failing: bool,
}

impl TenantSource {
    pub(crate) fn new(
        config: RelayConfig,
        ctx: RelayContext,
        tenant: Arc<Tenant>,
        database: Arc<Database>,
        statements: RelayStatements,
        receipts: Receipts,
    ) -> Self {
        Self {
            config,
            ctx,
            tenant,
            database,
            statements,
            receipts,
            session: None,
            at_sink: None,
            settled: None,
            idle: false,
            failing: false,
        }
    }

    /// Commits the settled batch (its failure marks, then `COMMIT`) and
    /// gives its session back.
    async fn commit_settled(&mut self) -> Result<(), SourceError> {
        let Some(settled) = self.settled.take() else {
            return Ok(());
        };
        let session = self.session.take().ok_or(SourceError::ConnectionLost)?;
        let client = session.client();
        let f = &settled.outcomes.failures;
        if !f.ids.is_empty() {
            let params = MarkFailedParams {
                ids: &f.ids,
                errors: &f.errors,
                attempts: &f.attempts,
                delay_ms: &f.delay_ms,
                dead: &f.dead_letter,
            };
            if let Err(error) = self.statements.mark_failed(client, &params).await {
                self.session = Some(session);
                return Err(error.into());
            }
        }
        if let Err(error) = client.batch_execute("COMMIT").await {
            self.session = Some(session);
            return Err(error.into());
        }
        session.restore();
        if std::mem::take(&mut self.failing) {
            info!("a batch committed again");
            self.ctx.health().postgres("", None);
        }
        if let Some(soonest) = settled.outcomes.failures.soonest {
            // Retries wake the outbox when due, not at the next poll.
            let tenant = Arc::clone(&self.tenant);
            tokio::spawn(async move {
                tokio::time::sleep(soonest).await;
                tenant.wake();
            });
        }
        self.receipts
            .durable(settled.batch, settled.claimed, settled.started, settled.outcomes);
        Ok(())
    }

    /// Ends the transaction of the batch in flight unmarked and gives the
    /// session back.
    async fn roll_back(&mut self) -> Result<(), SourceError> {
        if let Some(session) = self.session.take() {
            session.client().batch_execute("ROLLBACK").await?;
            session.restore();
        }
        Ok(())
    }

    /// Claims one batch, or None when the fence or the claim found nothing.
    /// `tag` is the control session's, read under the look that saw the
    /// outbox served.
    async fn claim_once(&mut self, lent: Lent, tag: i32) -> Result<Option<Batch>, SourceError> {
        // The session is the batch's from BEGIN on: a failure below is
        // rolled back by `recover`.
        self.session = Some(lent);
        let key = self.tenant.key;
        let params = ClaimParams {
            types: &[],
            deadline: None,
            limit: i64::from(self.config.batch_size),
            floor: 0,
            max_bytes: i64::try_from(self.config.batch_max_bytes).unwrap_or(i64::MAX),
            scope: ClaimScope::All,
        };
        let session = self.session.as_mut().expect("just set");
        let prepared = match self.statements.claim_text(&params) {
            Some(text) => session.prepared_claim(text).await?,
            None => None,
        };
        let client = session.client();
        // Pipelined: one round trip.
        let (begun, fenced) = tokio::join!(
            self.statements.begin(client),
            outbox::sql::fleet::fence(client, key, tag)
        );
        begun?;
        if !fenced? {
            // Taken over, or let go of since the wake-up: the hub knows.
            self.roll_back().await?;
            return Ok(None);
        }
        // The claim's round trip, for its span: only while tracing is on.
        let sent = self.ctx.tracing().is_some().then(Instant::now);
        let claimed = match &prepared {
            Some(statement) => self.statements.claim_prepared(client, statement, &params).await,
            None => self.statements.claim_whole_first(client, &params).await,
        };
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(error) => {
                if let (Some(session), Some(text)) =
                    (self.session.as_mut(), self.statements.claim_text(&params))
                {
                    // Prepared again next time, against the table as it is.
                    session.forget(text);
                }
                return Err(error.into());
            }
        };
        if claimed.rows.is_empty() {
            let session = self.session.take().expect("just set");
            session.client().batch_execute("COMMIT").await?;
            session.restore();
            return Ok(None);
        }
        let answered = Instant::now();
        let full = claimed.rows.len() == self.config.batch_size as usize || claimed.cut;
        let mut rows = claimed.rows;
        for row in &mut rows {
            super::name_the_outbox(row, self.ctx.outbox());
        }
        self.idle = !full;
        self.at_sink = Some(AtSink {
            batch: self.receipts.next_batch(),
            rows: rows.len(),
            started: Instant::now(),
        });
        Ok(Some(Batch {
            rows: rows.into(),
            unreadable: claimed.unreadable,
            full,
            overlapped: false,
            claim: sent.map(|sent| (sent, answered)),
        }))
    }
}

impl Source for TenantSource {
    async fn claim(&mut self, cancel: &CancellationToken) -> Result<Claim, SourceError> {
        self.commit_settled().await?;
        loop {
            if self.idle {
                // A notification naming this outbox, the database's due
                // scan, a retry coming due, or being served again.
                tokio::select! {
                    () = self.tenant.woken() => {}
                    () = cancel.cancelled() => return Ok(Claim::Cancelled),
                }
            }
            self.idle = true;
            if !self.tenant.served() {
                continue;
            }
            let Some(lent) = self.database.pool().lend(self.tenant.key, cancel).await? else {
                return Ok(Claim::Cancelled);
            };
            let tenant = Arc::clone(&self.tenant);
            // Held until the fence ran (see `Tenant::look`).
            let (Some(_look), Some(tag)) = (tenant.look().await, self.database.tag()) else {
                lent.restore();
                continue;
            };
            if let Some(batch) = self.claim_once(lent, tag).await? {
                return Ok(Claim::Batch(batch));
            }
        }
    }

    fn may_deliver(&self) -> bool {
        // The batch's transaction holds the outbox's batch lock: no other
        // process claims from it until the transaction ends.
        true
    }

    async fn give_back(&mut self) -> Result<(), SourceError> {
        self.at_sink = None;
        self.roll_back().await
    }

    fn lapse(&self) -> BoxFuture<'static, ()> {
        std::future::pending().boxed()
    }

    async fn overlap(&mut self, _full: bool) -> Result<(), SourceError> {
        Ok(())
    }

    fn settle(&mut self, plan: Plan) {
        let Some(at_sink) = self.at_sink.take() else {
            return;
        };
        self.settled = Some(Settled {
            batch: at_sink.batch,
            claimed: at_sink.rows,
            outcomes: Outcomes::from_plan(plan),
            started: at_sink.started,
        });
    }

    async fn hold(&mut self) -> Result<(), SourceError> {
        self.commit_settled().await?;
        self.idle = false;
        Ok(())
    }

    async fn recover(&mut self, error: SourceError, cancel: &CancellationToken) -> bool {
        self.at_sink = None;
        self.settled = None;
        let chain = error_chain(&error);
        if let Some(session) = self.session.take() {
            // Rolled back and given back; a broken session is dropped.
            if session.client().batch_execute("ROLLBACK").await.is_ok() {
                session.restore();
            }
        }
        self.failing = true;
        self.ctx
            .health()
            .postgres("", Some(format!("batch failed: {chain}")));
        warn!(error = %chain, "batch failed; retrying");
        self.idle = false;
        let pause = self.config.poll_interval.min(Duration::from_secs(1));
        tokio::select! {
            () = tokio::time::sleep(pause) => true,
            () = cancel.cancelled() => false,
        }
    }

    async fn finish(&mut self) {
        if let Err(error) = self.commit_settled().await {
            warn!(error = %error_chain(&error), "committing the last batch failed; it will be redelivered");
        }
        let _ = self.roll_back().await;
    }
}
