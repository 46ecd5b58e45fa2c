//! The relay's statements with typed parameters and rows: the claim in its
//! four shapes, the update of failed rows, the next retry time, the claim
//! floor (its statement and row in `floor.rs`), the lease tick and the
//! goodbye.
//!
//! The batch statements run one of two ways ([`RelayStatements`]), the same
//! methods either way:
//!
//! - prepared once per connection ([`OutboxSql::prepare_relay`]), their
//!   plans pinned for the session ([`setup_batch_session`]): the fastest,
//!   for a direct connection or a session-mode pooler;
//! - unnamed, parsed with each run ([`OutboxSql::unprepared_relay`]), for a
//!   transaction-mode pooler (PgBouncer's `pool_mode = transaction`), which
//!   hands each transaction whichever server connection is free: a named
//!   statement or a session `SET` would outlive its transaction on a server
//!   connection other clients then get. So nothing is left on the session:
//!   each transaction the relay begins pins its plans with `SET LOCAL`, sent
//!   with its `BEGIN` ([`RelayStatements::begin`]), and a statement that is
//!   its own transaction (a deadline claim, its mark) runs inside an explicit
//!   `BEGIN … COMMIT` sent with it, in the same round trip.
//!
//! Every method returns a future that sends its request on first poll, so a
//! caller may poll several together and tokio-postgres pipelines them in
//! that order (marks, `COMMIT`, `BEGIN` and the next claim in one round
//! trip).
//!
//! To add a statement: its text in [`OutboxSql`], a field of type `Stmt` in
//! [`RelayStatements`] made by `OutboxSql::relay_statements`, and a method
//! binding its parameters with [`typed`] (their types come from the Rust
//! values), run through `Stmt`'s methods; wrap it in `alone` if it runs
//! outside the claim's transaction.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Error, GenericClient, Row, RowStream, Statement};
use uuid::Uuid;

use super::OutboxSql;
use super::typed::{Typed, typed};
use crate::{Ident, OutboxRow};

type Param<'p> = &'p (dyn ToSql + Sync);

/// What the claim statements are rendered for
/// ([`OutboxSql::with_claims`]); every [`ClaimParams`] run through them
/// must match.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClaimSpec {
    /// A deadline claim (migration 0005): a deadline written in the claim's
    /// own transaction, instead of a mark the batch's transaction commits.
    pub deadline: bool,
    /// Restricted to some aggregate types: `Some(true)` only the types
    /// [`ClaimParams::types`] lists, `Some(false)` all but those.
    pub types: Option<bool>,
}

/// A deadline claim's own parameters.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineClaim {
    /// The relay claiming, written as `claimed_by`.
    pub owner: Uuid,
    /// How long the claim holds its rows.
    pub timeout_ms: f64,
}

/// What one claim asks for.
#[derive(Debug, Clone, Copy)]
pub struct ClaimParams<'a> {
    /// The types the claim takes or leaves (see [`ClaimSpec::types`]);
    /// ignored by a claim rendered without a type filter.
    pub types: &'a [String],
    /// A deadline claim's owner and timeout; `Some` exactly when the claim
    /// was rendered for leases.
    pub deadline: Option<DeadlineClaim>,
    /// The batch size (dead letters are never claimed: `dead_at` is set).
    pub limit: i64,
    /// The claim floor: the walk of the partial index starts at this id
    /// (0: from the start, a sweep). Rows below it are not claimed, so the
    /// caller keeps it below every row that may be due (see
    /// [`ClaimFloor`](super::ClaimFloor)).
    pub floor: i64,
    /// The batch's payload bytes: rows are claimed in id order while their
    /// payloads fit, and the first one always.
    pub max_bytes: i64,
    /// Which rows this relay may claim.
    pub scope: ClaimScope<'a>,
}

/// Which rows a claim may take.
#[derive(Debug, Clone, Copy)]
pub enum ClaimScope<'a> {
    /// Any due row: a relay alone on the outbox, no order kept.
    All,
    /// Only rows of the partitions this relay holds (see migration 0003).
    Partitions(Partitions<'a>),
}

/// The partitions a relay holds, and how strictly each aggregate type is
/// ordered inside them.
#[derive(Debug, Clone, Copy)]
pub struct Partitions<'a> {
    /// This relay's id, as the lease rows name it.
    pub relay_id: Uuid,
    /// The partitions it holds and is not releasing.
    pub claimable: &'a [i32],
    /// How many partitions the outbox has.
    pub count: i64,
    /// Strict order for some or all aggregate types; `None`: partition
    /// order only, for every type.
    pub strict: Option<Strict<'a>>,
}

/// Which aggregate types wait for their aggregate's earlier events.
#[derive(Debug, Clone, Copy)]
pub struct Strict<'a> {
    /// Whether types not listed in `exceptions` are strict.
    pub by_default: bool,
    /// Types whose mode is the opposite of the default.
    pub exceptions: &'a [String],
}

/// The failed rows of a batch, as parallel arrays (one statement for all).
#[derive(Debug, Clone, Copy)]
pub struct MarkFailedParams<'a> {
    /// Row ids.
    pub ids: &'a [i64],
    /// Each row's `last_error`.
    pub errors: &'a [String],
    /// Each row's new attempt count.
    pub attempts: &'a [i32],
    /// Milliseconds until each row's next attempt.
    pub delay_ms: &'a [f64],
    /// Whether each row is now a dead letter (`dead_at` is set).
    pub dead: &'a [bool],
}

/// A deadline claim's outcomes (`MARK_DEADLINE_CLAIM`): the failed rows as
/// [`MarkFailedParams`], the delivered ones, and the claim they were
/// under.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineMarks<'a> {
    /// The failed rows.
    pub failed: MarkFailedParams<'a>,
    /// The delivered rows' ids.
    pub delivered: &'a [i64],
    /// The claim's owner and deadline, as the claim returned them.
    pub fence: Fence,
}

/// Who holds a deadline claim and until when: what the claim wrote, and what
/// its mark must still find on a row to touch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    /// `claimed_by`.
    pub owner: Uuid,
    /// `claimed_until`, exactly as written (microseconds).
    pub until: DateTime<Utc>,
}

/// One relay heartbeat.
#[derive(Debug, Clone, Copy)]
pub struct TickParams<'a> {
    /// This relay's id.
    pub relay_id: Uuid,
    /// Its display name, for `outbox relays`.
    pub name: &'a str,
    /// Seconds of silence after which a relay counts as dead.
    pub dead_after_secs: f64,
    /// Its batch connections' backend pids...
    pub backend_pids: &'a [i32],
    /// ...and their start times (a pid alone may be reused).
    pub backend_starts: &'a [DateTime<Utc>],
}

/// One partition of a tick's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickRow {
    /// A partition this relay holds.
    pub partition: i32,
    /// Whether it is being handed to another relay (claim nothing there).
    pub releasing: bool,
    /// Whether any of its rows is due.
    pub due: bool,
    /// The outbox's partition count.
    pub partitions: i32,
}

/// One batch connection's statements, prepared or unnamed (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct RelayStatements {
    /// The claim in each [`Shape`], indexed by it, bounded by bytes; then
    /// the same four for one row (see [`claim_params`]).
    claims: Vec<Stmt>,
    /// The claim of any row that takes a batch only whole, unprepared
    /// only (see [`RelayStatements::claim_whole_first`]).
    claim_whole: Option<Stmt>,
    mark_failed: Stmt,
    next_retry: Stmt,
    fetch_payload: Stmt,
    /// `FIND_CLAIM_FLOOR` (see [`RelayStatements::find_floor`]).
    pub(super) find_floor: Stmt,
    /// `MARK_DEADLINE_CLAIM`, `RELEASE_DEADLINE_CLAIM` and
    /// `RELEASE_ABANDONED_CLAIMS`, only for deadline claims.
    deadline: Option<(Stmt, Stmt, Stmt)>,
    spec: ClaimSpec,
    /// How a transaction begins: `BEGIN`, or, unprepared, `BEGIN` with the
    /// plans pinned by `SET LOCAL` (see [`pinned_begin`]).
    begin: String,
    /// Unprepared: plans are pinned per transaction, so a statement that is
    /// its own transaction runs in an explicit one (`alone`).
    unnamed: bool,
}

/// One of the relay's statements, as its connection runs it.
#[derive(Debug)]
pub(super) enum Stmt {
    /// A named statement, prepared on the connection once and then only
    /// bound and run: the parse and plan are paid once.
    Prepared(Statement),
    /// Parsed, bound and run as the unnamed statement on every call, its
    /// parameters' types given with them, in one round trip: nothing of it
    /// outlives the call.
    Unnamed(String),
}

impl Stmt {
    /// `text` prepared on `client`, or unnamed without one.
    async fn new(client: Option<&Client>, text: &str) -> Result<Stmt, Error> {
        match client {
            Some(client) => client.prepare(text).await.map(Stmt::Prepared),
            None => Ok(Stmt::Unnamed(text.to_owned())),
        }
    }

    async fn query_raw(&self, client: &Client, params: Vec<Typed<'_>>) -> Result<RowStream, Error> {
        match self {
            Stmt::Prepared(s) => client.query_raw(s, params.into_iter().map(|(p, _)| p)).await,
            Stmt::Unnamed(text) => client.query_typed_raw(text, params).await,
        }
    }

    async fn execute(&self, client: &Client, params: &[Typed<'_>]) -> Result<u64, Error> {
        match self {
            Stmt::Prepared(s) => client.execute_raw(s, params.iter().map(|(p, _)| *p)).await,
            Stmt::Unnamed(text) => client.execute_typed(text, params).await,
        }
    }

    pub(super) async fn query_one(&self, client: &Client, params: &[Typed<'_>]) -> Result<Row, Error> {
        match self {
            Stmt::Prepared(s) => {
                let params: Vec<Param<'_>> = params.iter().map(|(p, _)| *p).collect();
                client.query_one(s, &params).await
            }
            Stmt::Unnamed(text) => client.query_typed_one(text, params).await,
        }
    }
}

impl OutboxSql {
    /// Prepares the batch statements on `client`, for a session of its own
    /// (direct, or through a session-mode pooler), set up by
    /// [`setup_batch_session`].
    pub async fn prepare_relay(&self, client: &Client) -> Result<RelayStatements, Error> {
        self.relay_statements(Some(client), "BEGIN".to_owned()).await
    }

    /// The batch statements unprepared, for a connection through a
    /// transaction-mode pooler (see the [module docs](self)); the session is
    /// not set up. A lock claim's transaction left idle for
    /// `idle_timeout` ends the session (`idle_in_transaction_session_timeout`),
    /// which releases its locks: behind a pooler nobody may terminate the
    /// backends of a relay declared dead, so the server must end its
    /// transactions itself. Make it the lease timeout: longer than a batch
    /// may stay at the sink.
    pub async fn unprepared_relay(&self, idle_timeout: Duration) -> Result<RelayStatements, Error> {
        self.relay_statements(None, pinned_begin(idle_timeout)).await
    }

    /// The statements prepared on `client`, or unnamed without one.
    async fn relay_statements(
        &self,
        client: Option<&Client>,
        begin: String,
    ) -> Result<RelayStatements, Error> {
        let stmt = |text| Stmt::new(client, text);
        let texts: Vec<&str> = [false, true]
            .into_iter()
            .flat_map(|one| Shape::ALL.map(|s| self.claim_text(s, one)))
            .collect();
        let claims = futures::future::try_join_all(texts.into_iter().map(stmt));
        let deadline = async {
            if !self.claim_spec.deadline {
                return Ok(None);
            }
            let (mark, release, abandoned) = tokio::try_join!(
                stmt(&self.mark_deadline_claim),
                stmt(&self.release_deadline_claim),
                stmt(&self.release_abandoned_claims)
            )?;
            Ok(Some((mark, release, abandoned)))
        };
        let (claims, mark_failed, next_retry, fetch_payload, find_floor, deadline) = tokio::try_join!(
            claims,
            stmt(&self.mark_failed),
            stmt(&self.next_retry),
            stmt(&self.fetch_payload),
            stmt(&self.find_claim_floor),
            deadline,
        )?;
        Ok(RelayStatements {
            claims,
            // Prepared, every claim is planned once: nothing to save.
            claim_whole: client.is_none().then(|| Stmt::Unnamed(self.claim_whole.clone())),
            mark_failed,
            next_retry,
            fetch_payload,
            find_floor,
            deadline,
            spec: self.claim_spec,
            begin,
            unnamed: client.is_none(),
        })
    }

    /// The claim statement of `shape`, of one row or bounded by bytes.
    fn claim_text(&self, shape: Shape, one: bool) -> &str {
        &self.claims[shape as usize][usize::from(one)]
    }

    /// The plan of the claim `p` would run, as `EXPLAIN (FORMAT JSON)`
    /// gives it. With `analyze`, the claim runs (`ANALYZE, BUFFERS`): call
    /// it in a transaction that is rolled back.
    pub async fn explain_claim(
        &self,
        client: &impl GenericClient,
        p: &ClaimParams<'_>,
        analyze: bool,
    ) -> Result<serde_json::Value, Error> {
        let (which, params) = claim_params(p, &self.claim_spec);
        let shapes = Shape::ALL.len();
        let text = self.claim_text(Shape::ALL[which % shapes], which >= shapes);
        let options = if analyze {
            "ANALYZE, BUFFERS, FORMAT JSON"
        } else {
            "FORMAT JSON"
        };
        let explain = format!("EXPLAIN ({options}) {text}");
        let params: Vec<Param<'_>> = params.iter().map(|(p, _)| *p).collect();
        client.query_one(&explain, &params).await?.try_get(0)
    }

    /// The lease connection's tick, prepared: an unprepared query would cost
    /// a second round trip, and a second transaction, per tick.
    pub async fn prepare_tick(&self, client: &Client) -> Result<TickStatement, Error> {
        Stmt::new(Some(client), &self.relay_tick).await.map(TickStatement)
    }

    /// The lease tick unnamed, for a connection through a transaction-mode
    /// pooler: parsed, bound and run in one round trip and one transaction,
    /// as the prepared one is.
    pub fn unprepared_tick(&self) -> TickStatement {
        TickStatement(Stmt::Unnamed(self.relay_tick.clone()))
    }

    /// A relay leaving: its partitions go to the others at their next
    /// tick. Returns how many it held. Typed, so it is one round trip and
    /// one transaction (`execute` would prepare first, a second of each).
    pub async fn relay_leave(&self, client: &Client, relay_id: Uuid) -> Result<u64, Error> {
        client
            .execute_typed(&self.relay_leave, &[(&relay_id, Type::UUID)])
            .await
    }
}

/// The lease tick, prepared on the lease connection or unnamed.
#[derive(Debug)]
pub struct TickStatement(Stmt);

impl TickStatement {
    /// One relay tick (heartbeat and rebalance; see migration 0003): the
    /// partitions it holds, whether each is being released, whether any of
    /// them has a row due, and the partition count.
    pub async fn run(&self, client: &Client, p: &TickParams<'_>) -> Result<Vec<TickRow>, Error> {
        let params = vec![
            typed(&p.relay_id),
            typed(&p.name),
            typed(&p.dead_after_secs),
            typed(&p.backend_pids),
            typed(&p.backend_starts),
        ];
        let rows: Vec<Row> = self.0.query_raw(client, params).await?.try_collect().await?;
        rows.iter()
            .map(|r| {
                Ok(TickRow {
                    partition: r.try_get(0)?,
                    releasing: r.try_get(1)?,
                    due: r.try_get(2)?,
                    partitions: r.try_get(3)?,
                })
            })
            .collect()
    }
}

/// The claim's four shapes, one statement each.
#[derive(Debug, Clone, Copy)]
pub(super) enum Shape {
    All,
    Partitions,
    /// Partition order, a batch much smaller than the partitions held.
    FewPartitions,
    Strict,
}

impl Shape {
    /// Every shape, in the order of [`RelayStatements`]' claims.
    pub(super) const ALL: [Shape; 4] = [Shape::All, Shape::Partitions, Shape::FewPartitions, Shape::Strict];

    /// How many parameters the shape's own filters take (`$1` the batch
    /// size, then the partitions' and strict order's).
    pub(super) fn fixed_params(self) -> usize {
        match self {
            Shape::All => 1,
            Shape::Partitions | Shape::FewPartitions => 4,
            Shape::Strict => 6,
        }
    }
}

/// Which claim `p` needs (its index in [`RelayStatements`]) and its
/// parameters, in `$n` order (the order `claim_template` numbers them):
/// the shape's own, the floor, the type filter's, the lease's, and the byte
/// bound last.
/// A claim of one row has no bound (one row is never cut) and skips its
/// cost, about 60 µs per claim, a fifth of the relay's time at batch size 1.
fn claim_params<'a>(p: &'a ClaimParams<'a>, spec: &'a ClaimSpec) -> (usize, Vec<Typed<'a>>) {
    debug_assert_eq!(
        spec.deadline,
        p.deadline.is_some(),
        "a claim's parameters must match its statement"
    );
    let mut params: Vec<Typed<'a>> = vec![typed(&p.limit)];
    let shape = match &p.scope {
        ClaimScope::All => Shape::All,
        ClaimScope::Partitions(l) => {
            params.extend([typed(&l.relay_id), typed(&l.claimable), typed(&l.count)]);
            match &l.strict {
                // The peek reads twice the batch, so it locks at most that
                // many lease rows. Measured against locking them all (64):
                // +20% at batch 1, -5% at batch 10 (the extra read costs
                // what the saved locks gain), hence only batches of at most
                // an eighth of the partitions held.
                None if p.limit.saturating_mul(8) <= l.claimable.len() as i64 => Shape::FewPartitions,
                None => Shape::Partitions,
                Some(s) => {
                    params.extend([typed(&s.exceptions), typed(&s.by_default)]);
                    Shape::Strict
                }
            }
        }
    };
    params.push(typed(&p.floor));
    if let Some(types_in) = &spec.types {
        params.extend([typed(&p.types), typed(types_in)]);
    }
    if let Some(lease) = &p.deadline {
        params.extend([typed(&lease.owner), typed(&lease.timeout_ms)]);
    }
    if p.limit == 1 {
        return (shape as usize + Shape::ALL.len(), params);
    }
    params.push(typed(&p.max_bytes));
    (shape as usize, params)
}

/// What a claim returned.
#[derive(Debug, Default)]
pub struct ClaimedRows {
    /// The rows, in id order.
    pub rows: Vec<OutboxRow>,
    /// Rows whose payload or headers the relay cannot read (PostgreSQL
    /// accepted a number serde_json cannot hold, say; that column is then
    /// `null`) or that break the table contract ([`crate::contract`]):
    /// their index in `rows`, and why (naming the column). The relay
    /// dead-letters them unsent.
    pub unreadable: Vec<(usize, String)>,
    /// The byte bound cut the batch short: more rows were locked than
    /// returned, and stay locked until the transaction ends, so nothing
    /// else may be claimed before it does (see the claim's `CUT`). A lease
    /// claim's transaction has ended: nothing stays locked.
    pub cut: bool,
    /// A deadline claim's owner and deadline: what its mark must match.
    pub fence: Option<Fence>,
}

impl RelayStatements {
    /// Begins the batch's transaction: `BEGIN`, or unprepared, `BEGIN` with
    /// the plans pinned for this transaction (one simple query, one round
    /// trip, pipelined with what follows).
    pub async fn begin(&self, client: &Client) -> Result<(), Error> {
        client.batch_execute(&self.begin).await
    }

    /// Runs `statement`, which is its own transaction. Unprepared, in an
    /// explicit one that pins its plans: `BEGIN; SET LOCAL …`, the
    /// statement, `COMMIT`, pipelined (one round trip still). Only outside a
    /// transaction: inside one, this `COMMIT` would end it.
    pub(super) async fn alone<T>(
        &self,
        client: &Client,
        statement: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        if !self.unnamed {
            return statement.await;
        }
        // A failed statement makes the COMMIT a rollback, not an error: the
        // statement's own error is the one returned.
        let (begun, done, committed) = tokio::join!(
            client.batch_execute(&self.begin),
            statement,
            client.batch_execute("COMMIT")
        );
        begun?;
        let done = done?;
        committed?;
        Ok(done)
    }

    /// Claims a batch and marks it published: a lock claim in the open
    /// transaction (a promise the commit keeps), a deadline claim as its own
    /// transaction. Rows come back in id order.
    pub async fn claim(&self, client: &Client, p: &ClaimParams<'_>) -> Result<ClaimedRows, Error> {
        let (which, params) = claim_params(p, &self.spec);
        let statement = &self.claims[which];
        let read = async {
            // Decoded as they arrive, each raw row dropped once decoded: a
            // batch of large payloads is held about once, not twice.
            let stream = statement.query_raw(client, params).await?;
            read_claim(stream, p).await
        };
        let (rows, large, unreadable, locked, fence) = if self.spec.deadline {
            self.alone(client, read).await?
        } else {
            read.await?
        };
        self.finish_claim(client, rows, large, unreadable, locked, fence)
            .await
    }

    /// The text of the lock claim `p` needs, for a caller that prepares it
    /// on a session of its own choosing ([`RelayStatements::claim_prepared`]);
    /// None for statements prepared here already or made for deadline
    /// claims.
    pub fn claim_text(&self, p: &ClaimParams<'_>) -> Option<&str> {
        if self.spec.deadline {
            return None;
        }
        match &self.claims[claim_params(p, &self.spec).0] {
            Stmt::Unnamed(text) => Some(text),
            Stmt::Prepared(_) => None,
        }
    }

    /// Claims as [`RelayStatements::claim`] does, through `statement`: the
    /// text [`RelayStatements::claim_text`] gave for `p`, prepared on
    /// `client`.
    pub async fn claim_prepared(
        &self,
        client: &Client,
        statement: &Statement,
        p: &ClaimParams<'_>,
    ) -> Result<ClaimedRows, Error> {
        self.claim_through(client, &Stmt::Prepared(statement.clone()), p)
            .await
    }

    /// Claims as [`RelayStatements::claim`] does, trying first a claim that
    /// takes the batch only if it fits whole (`WHOLE`), which PostgreSQL
    /// plans faster. For unprepared statements, where
    /// every claim is planned, and for claims whose rows are usually there
    /// (a fleet claims an outbox once woken): a claim that finds nothing
    /// runs twice. Prepared, a claim of partitions, a deadline claim or a
    /// claim of one row is a plain [`RelayStatements::claim`].
    pub async fn claim_whole_first(
        &self,
        client: &Client,
        p: &ClaimParams<'_>,
    ) -> Result<ClaimedRows, Error> {
        let whole = match (&self.claim_whole, &p.scope) {
            (Some(whole), ClaimScope::All) if p.limit > 1 && !self.spec.deadline => whole,
            _ => return self.claim(client, p).await,
        };
        let claimed = self.claim_through(client, whole, p).await?;
        if claimed.rows.is_empty() {
            // Nothing due, or not all of it fits: the byte bound decides.
            return self.claim(client, p).await;
        }
        Ok(claimed)
    }

    /// A lock claim in the open transaction through `statement`, which
    /// takes `p`'s parameters as the claim [`claim_params`] picks does.
    async fn claim_through(
        &self,
        client: &Client,
        statement: &Stmt,
        p: &ClaimParams<'_>,
    ) -> Result<ClaimedRows, Error> {
        let (_, params) = claim_params(p, &self.spec);
        let stream = statement.query_raw(client, params).await?;
        let (rows, large, unreadable, locked, fence) = read_claim(stream, p).await?;
        self.finish_claim(client, rows, large, unreadable, locked, fence)
            .await
    }

    /// Reads the payloads the claim left out, and says whether it was cut.
    async fn finish_claim(
        &self,
        client: &Client,
        mut rows: Vec<OutboxRow>,
        large: Vec<(i64, i32)>,
        unreadable: Vec<(i64, String)>,
        locked: i64,
        fence: Option<Fence>,
    ) -> Result<ClaimedRows, Error> {
        // `RETURNING` order is unspecified.
        rows.sort_unstable_by_key(|r| r.id);
        let at = |rows: &[OutboxRow], id: i64| rows.binary_search_by_key(&id, |r| r.id).ok();
        let mut unreadable = unreadable;
        for (id, bytes) in large {
            let Some(i) = at(&rows, id) else { continue };
            let fetched = self.fetch_payload(client, id, bytes);
            // A deadline claim has committed: its payloads are read outside
            // a transaction.
            let fetched = if self.spec.deadline {
                self.alone(client, fetched).await?
            } else {
                fetched.await?
            };
            match fetched {
                Ok(payload) => rows[i].payload = payload,
                Err(e) => unreadable.push((id, format!("payload: {e}"))),
            }
        }
        let mut unreadable: Vec<(usize, String)> = unreadable
            .into_iter()
            .filter_map(|(id, why)| at(&rows, id).map(|i| (i, why)))
            .collect();
        unreadable.sort_unstable_by_key(|(i, _)| *i);
        let cut = usize::try_from(locked).is_ok_and(|l| l > rows.len());
        Ok(ClaimedRows {
            rows,
            unreadable,
            cut,
            fence,
        })
    }

    /// A payload the claim left out for its size (`LARGE_PAYLOAD`), read in
    /// pieces in the claim's transaction. `bytes` sizes the text buffer.
    async fn fetch_payload(
        &self,
        client: &Client,
        id: i64,
        bytes: i32,
    ) -> Result<Result<serde_json::Value, serde_json::Error>, Error> {
        let piece = i32::try_from(super::LARGE_PAYLOAD).unwrap_or(i32::MAX);
        let stream = self
            .fetch_payload
            .query_raw(client, vec![typed(&id), typed(&piece)])
            .await?;
        futures::pin_mut!(stream);
        let mut text = Vec::with_capacity(usize::try_from(bytes).unwrap_or(0));
        while let Some(row) = stream.try_next().await? {
            text.extend_from_slice(row.try_get(0)?);
        }
        Ok(serde_json::from_slice(&text))
    }

    /// Turns failed rows of the claim back into unpublished ones with their
    /// retry time. Returns rows updated.
    pub async fn mark_failed(&self, client: &Client, p: &MarkFailedParams<'_>) -> Result<u64, Error> {
        let params = [
            typed(&p.ids),
            typed(&p.errors),
            typed(&p.attempts),
            typed(&p.delay_ms),
            typed(&p.dead),
        ];
        self.mark_failed.execute(client, &params).await
    }

    /// Records a deadline claim's outcomes, checking the claim is still its
    /// own (`MARK_DEADLINE_CLAIM`), in its own short transaction. Returns rows
    /// published and rows failed: fewer than asked means the claim expired
    /// and another relay took those rows.
    ///
    /// # Panics
    /// If the statements were not made for deadline claims.
    pub async fn mark_deadline_claim(
        &self,
        client: &Client,
        p: &DeadlineMarks<'_>,
    ) -> Result<(u64, u64), Error> {
        let (mark, _, _) = self.deadline.as_ref().expect("made for deadline claims");
        let f = &p.failed;
        let params = [
            typed(&f.ids),
            typed(&f.errors),
            typed(&f.attempts),
            typed(&f.delay_ms),
            typed(&f.dead),
            typed(&p.delivered),
            typed(&p.fence.owner),
            typed(&p.fence.until),
        ];
        let row = self.alone(client, mark.query_one(client, &params)).await?;
        let count = |i| row.try_get::<_, i64>(i).map(|n| u64::try_from(n).unwrap_or(0));
        Ok((count(0)?, count(1)?))
    }

    /// Gives a deadline claim's rows back unsent, due now (`RELEASE_DEADLINE_CLAIM`).
    /// Returns rows released.
    ///
    /// # Panics
    /// If the statements were not made for deadline claims.
    pub async fn release_deadline_claim(
        &self,
        client: &Client,
        ids: &[i64],
        fence: Fence,
    ) -> Result<u64, Error> {
        let (_, release, _) = self.deadline.as_ref().expect("made for deadline claims");
        let params = [typed(&ids), typed(&fence.owner), typed(&fence.until)];
        self.alone(client, release.execute(client, &params)).await
    }

    /// Gives back every row still claimed under the claimer ids `abandoned`
    /// (`RELEASE_ABANDONED_CLAIMS`). Returns rows released.
    ///
    /// # Panics
    /// If the statements were not made for deadline claims.
    pub async fn release_abandoned_claims(&self, client: &Client, abandoned: &[Uuid]) -> Result<u64, Error> {
        let (_, _, release) = self.deadline.as_ref().expect("made for deadline claims");
        self.alone(client, release.execute(client, &[typed(&abandoned)]))
            .await
    }

    /// Seconds until the next row waiting for a retry comes due: `None` if
    /// none waits, negative if one is due now. Outside a transaction.
    pub async fn next_retry(&self, client: &Client) -> Result<Option<f64>, Error> {
        self.alone(client, self.next_retry.query_one(client, &[]))
            .await?
            .try_get(0)
    }
}

/// What a claim's stream held: its rows (payloads over `LARGE_PAYLOAD`
/// left out), those left out with their size, the unreadable ones, how many
/// rows it locked, and a deadline claim's fence.
type ReadClaim = (
    Vec<OutboxRow>,
    Vec<(i64, i32)>,
    Vec<(i64, String)>,
    i64,
    Option<Fence>,
);

/// Decodes a claim's rows as they arrive.
async fn read_claim(stream: RowStream, p: &ClaimParams<'_>) -> Result<ReadClaim, Error> {
    futures::pin_mut!(stream);
    let (mut rows, mut large, mut unreadable, mut locked) = (Vec::new(), Vec::new(), Vec::new(), 0_i64);
    let mut fence = None;
    while let Some(row) = stream.try_next().await? {
        locked = row.try_get("locked_rows")?;
        if let Some(lease) = &p.deadline
            && fence.is_none()
        {
            // One deadline for the whole claim (`DEADLINE_CTE`).
            fence = Some(Fence {
                owner: lease.owner,
                until: row.try_get("claimed_until")?,
            });
        }
        let mut decoded = decode(&row, serde_json::Value::Null, serde_json::Value::Null)?;
        // One row's payload or headers that cannot be read must not
        // fail the claim: the same row would fail every claim after it.
        let why = |e: Error| std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string);
        match row.try_get::<_, Option<serde_json::Value>>("payload") {
            Ok(Some(payload)) => decoded.payload = payload,
            Ok(None) => large.push((decoded.id, row.try_get::<_, i32>("bytes")?)),
            Err(e) => unreadable.push((decoded.id, format!("payload: {}", why(e)))),
        }
        match row.try_get("headers") {
            Ok(headers) => {
                decoded.headers = headers;
                // A row the table's constraints would refuse now (written
                // before migration 8, or with them dropped): a dead letter
                // naming the column, never sent half.
                if let Err(v) = crate::contract::check_row(&decoded) {
                    unreadable.push((decoded.id, v.to_string()));
                }
            }
            Err(e) => unreadable.push((decoded.id, format!("headers: {}", why(e)))),
        }
        rows.push(decoded);
    }
    Ok((rows, large, unreadable, locked, fence))
}

/// Every relay statement is an index-driven point operation: a walk of the
/// partial index in id order stopped by `LIMIT`, and primary-key lookups.
/// Statistics can say otherwise: an outbox that was empty at its last
/// ANALYZE and has since filled up looks tiny, and the planner then sorts
/// every unpublished row for each claim, which makes a backlog drain in
/// quadratic time (measured: 149 events/s instead of thousands at batch 1).
/// So the relay's batch sessions rule out the plans that read whole tables.
/// Not the lease session: the tick function's statements (a semi-join of
/// the lease table, an EXISTS over the outbox) are planned well without it,
/// and badly with it (measured: 600 ms instead of 2 ms per tick).
///
/// A disabled plan type still counts, at a cost of 10^10, when nothing else
/// can do its job (the claim's byte bound sorts its few locked rows), and
/// such a cost crosses `jit_above_cost`: the claim was then compiled by
/// LLVM on every run, about a second each. JIT never pays off for
/// statements this short, so it is off too.
const PIN_INDEX_PLANS: [(&str, &str); 6] = [
    ("jit", "off"),
    ("enable_seqscan", "off"),
    ("enable_bitmapscan", "off"),
    ("enable_sort", "off"),
    ("enable_hashjoin", "off"),
    ("enable_mergejoin", "off"),
];

/// `PIN_INDEX_PLANS` as `SET` (`scope` ``) or `SET LOCAL` (`scope` `LOCAL `).
fn pin_index_plans(scope: &str) -> String {
    PIN_INDEX_PLANS
        .iter()
        .map(|(name, value)| format!("SET {scope}{name} = {value}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// An unprepared connection's `BEGIN`: the plans pinned for the
/// transaction only, and a transaction left idle for `idle_timeout` ending
/// its session (see [`OutboxSql::unprepared_relay`]).
fn pinned_begin(idle_timeout: Duration) -> String {
    let ms = idle_timeout.as_millis().max(1);
    format!(
        "BEGIN; {}; SET LOCAL idle_in_transaction_session_timeout = {ms}",
        pin_index_plans("LOCAL ")
    )
}

/// Sets a batch session up: plans pinned to index paths and, when given,
/// `LISTEN` on the insert trigger's channel, in one round trip. Only for a
/// session of the relay's own: through a transaction-mode pooler these
/// settings would stay on a server connection other clients then use.
pub async fn setup_batch_session(client: &Client, listen: Option<&Ident>) -> Result<(), Error> {
    let mut setup = pin_index_plans("");
    if let Some(channel) = listen {
        setup.push_str(&format!("; LISTEN {}", channel.quoted()));
    }
    client.batch_execute(&setup).await
}

/// `LISTEN` on the insert trigger's channel, alone: a connection that only
/// wakes the relay (one whose batches go through a transaction-mode pooler).
pub async fn listen(client: &Client, channel: &Ident) -> Result<(), Error> {
    client
        .batch_execute(&format!("LISTEN {}", channel.quoted()))
        .await
}

/// This connection's backend pid and start time: what the lease tick
/// reports so a takeover can tell a frozen relay's sessions from live ones.
pub async fn backend_identity(client: &Client) -> Result<(i32, DateTime<Utc>), Error> {
    // Unnamed: a relay checks with it whether a transaction-mode pooler sits
    // in front, before it leaves a named statement on a server connection.
    let me = client.query_typed_one(super::BACKEND_IDENTITY, &[]).await?;
    Ok((me.try_get(0)?, me.try_get(1)?))
}

/// A row with the columns of `ROW_COLUMNS`, in any order: the claims'
/// `RETURNING`, or a caller's own `SELECT` of them.
impl TryFrom<&Row> for OutboxRow {
    type Error = Error;

    fn try_from(row: &Row) -> Result<Self, Self::Error> {
        decode(row, row.try_get("payload")?, row.try_get("headers")?)
    }
}

/// `row` with `payload` and `headers`, read from it or set apart.
fn decode(row: &Row, payload: serde_json::Value, headers: serde_json::Value) -> Result<OutboxRow, Error> {
    Ok(OutboxRow {
        id: row.try_get("id")?,
        event_id: row.try_get("event_id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        event_type: row.try_get("event_type")?,
        payload,
        headers,
        created_at: row.try_get("created_at")?,
        attempts: row.try_get("attempts")?,
        first_failed_at: row.try_get("first_failed_at")?,
    })
}
