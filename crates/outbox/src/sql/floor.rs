//! The claim floor's statement with its typed parameters ([`FloorParams`])
//! and row ([`ClaimFloor`]): in one snapshot, how far above a given id the
//! next claim's walk of the partial index may start.
//!
//! Why a floor: marking a row published is an update that changes the
//! partial index's predicate, so it is never HOT, and the old version's
//! entry stays in `<table>_unpublished_idx` until vacuum removes it. While
//! any session holds a snapshot older than the mark (a long `REPEATABLE
//! READ` transaction, a backup, an idle transaction), vacuum cannot, and
//! the claim, which walks the index from its start in id order, visits
//! every row published since: its cost grows with them (measured on a
//! 200,000-event run: the last claims 15% as fast as on a clean table).
//! Starting the walk at a floor skips them.
//!
//! This module only says what the statement finds. When the relay runs it,
//! which gap it may pass and when it claims from 0 again is the relay's
//! (`outbox-relay`, `source/poll/floor.rs`, where the correctness argument
//! is).

use tokio_postgres::{Client, Error};

use super::relay::RelayStatements;
use super::typed::typed;

/// `$1` the current floor, `$2` the settled bound: an id below it with no
/// row is known never to get one. In the statement's one snapshot:
///
/// - `head`: the first row at or above `$1` that is waiting and due
///   (`published_at IS NULL AND dead_at IS NULL AND next_attempt_at <=
///   clock_timestamp()`), through the partial index from `$1`, as the claim
///   walks it; with none, one past the last row at or above `$1` (through
///   the primary key, backwards), so an empty outbox's floor moves past the
///   dead entries too; with no row at all, `$1`. A row a lock claim in
///   flight has marked is still waiting here (its mark is not committed),
///   so the head never passes a batch that may be rolled back.
/// - `gap`: the first id in `[max($1, $2), head)` with no visible row at
///   all, or NULL: an id `nextval` handed to a transaction still in
///   progress (its row commits there later), or one rolled back or
///   deleted. Found by one walk of the primary key in id order that stops
///   at the first missing id (`lag`), so it costs the rows between the
///   last floor and the head, or less; a count of the range would cost as
///   much when nothing is missing and more when something is.
/// - `xip`: with a gap, the transactions in progress in the statement's
///   snapshot (`pg_current_snapshot()`, whose `xip` lists top-level
///   transaction ids only), so the relay can tell when those that could
///   fill it have ended without a query of its own; NULL without one.
///
/// Read-only; run it outside the batch's transaction (in autocommit), or it
/// would see that transaction's own claim as published.
pub(super) const FIND_CLAIM_FLOOR: &str = "WITH head AS MATERIALIZED ( \
        SELECT coalesce( \
            (SELECT id FROM {t} WHERE published_at IS NULL AND dead_at IS NULL \
                AND next_attempt_at <= clock_timestamp() AND id >= $1::int8 ORDER BY id LIMIT 1), \
            (SELECT max(id) + 1 FROM {t} WHERE id >= $1::int8), \
            $1::int8) AS id), \
     span AS MATERIALIZED (SELECT greatest($1::int8, $2::int8) AS lo, head.id AS hi FROM head) \
     SELECT span.hi, gap.id, \
            CASE WHEN gap.id IS NOT NULL THEN \
                ARRAY(SELECT x::text::int8 FROM pg_snapshot_xip(pg_current_snapshot()) AS x) END \
       FROM span LEFT JOIN LATERAL ( \
            SELECT w.prev + 1 AS id FROM ( \
                SELECT g.id, lag(g.id, 1, span.lo - 1) OVER (ORDER BY g.id) AS prev \
                  FROM {t} AS g WHERE g.id >= span.lo AND g.id <= span.hi) AS w \
             WHERE w.id > w.prev + 1 ORDER BY w.id LIMIT 1) AS gap ON true";

/// What [`RelayStatements::find_floor`] starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FloorParams {
    /// The floor the relay holds now: nothing below it is looked at.
    pub from: i64,
    /// Ids below this with no row are known never to get one: not gaps.
    pub settled: i64,
}

/// What [`RelayStatements::find_floor`] found, in one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimFloor {
    /// The first waiting, due row at or above the floor (see
    /// `FIND_CLAIM_FLOOR` for the cases without one).
    pub head: i64,
    /// The first id at or above the floor and the settled bound, below
    /// `head`, with no visible row.
    pub gap: Option<i64>,
    /// With a gap, the transaction ids in progress in the same snapshot;
    /// empty without one.
    pub in_progress: Vec<i64>,
}

impl RelayStatements {
    /// Where the next claim may start (see [`ClaimFloor`]). Returns a
    /// future that sends on first poll, so it pipelines with the claim's
    /// round trip.
    pub async fn find_floor(&self, client: &Client, p: &FloorParams) -> Result<ClaimFloor, Error> {
        // Outside the claim's transaction (its own snapshot), so alone: in
        // an explicit one that pins its plans behind a transaction pooler.
        let params = [typed(&p.from), typed(&p.settled)];
        let row = self
            .alone(client, self.find_floor.query_one(client, &params))
            .await?;
        Ok(ClaimFloor {
            head: row.try_get(0)?,
            gap: row.try_get(1)?,
            in_progress: row.try_get::<_, Option<Vec<i64>>>(2)?.unwrap_or_default(),
        })
    }
}
