//! When the slot's stream cannot be trusted to hold every undelivered
//! event: the slot made again if it is gone, the rows the table still holds
//! delivered first, in id order, then the stream. Owns the decision
//! ([`Why`]), the publication's mark, reading the table into the window,
//! and which stream rows the backfill already delivered.
//!
//! # When
//!
//! Each time the stream opens, before `START_REPLICATION`:
//!
//! - **the slot is missing** while the publication exists: a failover to a
//!   standby (PostgreSQL 15 does not copy logical slots to standbys), or
//!   someone dropped it;
//! - **the slot was invalidated** (`wal_status = lost`: it fell more than
//!   `max_slot_wal_keep_size` behind). The same situation: the WAL is gone,
//!   the table is not;
//! - **a backfill is owed**: the publication carries the mark, left by a
//!   relay that died before finishing one, or by `outbox migrate --wal`
//!   creating a slot for a publication that existed;
//! - **the server changed** under a running relay (another system
//!   identifier or timeline in `IDENTIFY_SYSTEM`: a failover) and a slot is
//!   there, copied (Patroni's permanent slots) or made by someone: the
//!   slot is kept, and the table is backfilled in case it started late.
//!
//! # Why this delivers everything, once per aggregate in order
//!
//! With `--wal-cleanup delete`, rows are deleted only after their
//! delivery or dead letter, so the table holds exactly what was not yet
//! known delivered (plus rows delivered whose delete had not committed:
//! sent again, as after any crash). The order of the steps:
//!
//! 1. The mark is set on the publication, then the slot is created. From
//!    here, a relay that dies starts over at step 3 (the mark says so).
//! 2. Every row committed after the slot's start is in its stream.
//! 3. The backfill reads, in pages through the primary key, the rows not
//!    delivered and not dead up to the highest id at its start (higher ids
//!    are the stream's), and feeds each page to the window as one
//!    transaction that confirms no position: it goes through the normal
//!    batch path (sink, retries, parked aggregates, dead letters, deletes).
//! 4. Only once the pages are read does the source read the stream, so
//!    the window hands out stream rows after the backfilled ones, and an
//!    aggregate parked behind a failed backfilled row keeps its stream rows
//!    waiting too.
//! 5. A row committed between the slot's start and the page that read it
//!    is in both. The stream's copy is dropped: the backfill keeps the ids
//!    it read until the stream passes the WAL insert position taken after
//!    its last page (a row visible to a page committed before that).
//! 6. The mark is cleared once every backfilled row is delivered or a
//!    dead letter and those writes committed; a position past the
//!    backfill is confirmed only after that.
//!
//! Nothing locks writers out. Why not the exported snapshot of
//! `CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')`, which would leave no
//! overlap: a relay that dies halfway must finish with the slot already
//! there, which needs the overlap handling anyway, so there is one path.
//!
//! With `--wal-cleanup none` the table keeps delivered rows and cannot say
//! which were not: a missing or lost slot, or an owed backfill, stops the
//! relay with the command to run (`outbox migrate --wal --recover
//! --since`), as before; a changed server with a slot is streamed as is.
//!
//! Emitted events (no row) committed after the last confirmed position and
//! before a failover are lost with the old slot: nothing holds them but
//! the WAL of a server that is gone.
//!
//! # A fleet's tables
//!
//! A fleet's stream (one slot per database, see `fleet::wal`) backfills
//! every tenant table each time its reader starts (no mark: a reader that
//! died halfway backfills again at its next start), and a tenant's table
//! when it joins the publication mid-stream, since the rows committed
//! before that are in the table and never in the stream. The tables are
//! read one after the other; the stream waits until every page is read,
//! and its copies of backfilled rows are dropped per table.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use outbox::sql::{BackfillPage, WalSql};
use tokio_postgres::Client;

use super::window::Window;
use crate::source::SourceError;

/// Why the stream alone will not do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Why {
    /// No slot (a failover to a standby, or dropped).
    Missing,
    /// PostgreSQL invalidated it.
    Lost,
    /// The publication carries the mark.
    Owed,
    /// Another server answers: `(system, timeline)` before and now.
    Moved { from: Server, to: Server },
    /// A fleet's tables: a reader starting, or a tenant's table joining
    /// the publication.
    Tenants,
}

impl Why {
    /// The metric label of a slot this relay creates again.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Why::Missing => "missing",
            Why::Lost => "lost",
            Why::Owed => "owed",
            Why::Moved { .. } => "moved",
            Why::Tenants => "tenants",
        }
    }

    /// Whether the slot must be created (again).
    pub(crate) fn recreates(&self) -> bool {
        matches!(self, Why::Missing | Why::Lost)
    }

    /// What `--wal-cleanup none` stops with instead, if it does: its table
    /// cannot tell undelivered rows from delivered ones.
    pub(crate) fn without_cleanup(&self, slot: &str) -> Option<outbox::Error> {
        match self {
            Why::Lost => Some(outbox::Error::SlotInvalidated {
                slot: slot.to_owned(),
            }),
            Why::Missing => Some(outbox::Error::SlotMissing {
                slot: slot.to_owned(),
            }),
            Why::Owed => Some(outbox::Error::BackfillOwed {
                slot: slot.to_owned(),
            }),
            Why::Moved { .. } | Why::Tenants => None,
        }
    }
}

/// Which server answers: its system identifier and timeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Server {
    pub(crate) system: String,
    pub(crate) timeline: u32,
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "system {} timeline {}", self.system, self.timeline)
    }
}

/// One table of a backfill: its outbox's number, statements, and the next
/// page's bounds.
#[derive(Debug)]
struct Part {
    outbox: u32,
    sql: Arc<WalSql>,
    after: i64,
    upto: i64,
}

impl Part {
    /// The rows of `sql`'s table up to its highest id now.
    async fn start(outbox: u32, sql: Arc<WalSql>, client: &Client) -> Result<Part, tokio_postgres::Error> {
        let upto = sql.backfill_bound(client).await?;
        Ok(Part {
            outbox,
            sql,
            after: 0,
            upto,
        })
    }
}

/// A backfill under way: from its start until the stream passed it.
#[derive(Debug)]
pub(crate) struct Backfill {
    pub(crate) why: Why,
    /// The tables left to read, the one being read first.
    parts: VecDeque<Part>,
    /// Every page was read.
    read: bool,
    /// The rows read that the stream may carry too: (outbox, id).
    ids: HashSet<(u32, i64)>,
    /// The window's number of the last page's transaction.
    last_txn: Option<u64>,
    /// Once read: the stream holds nothing read past this position.
    until: Option<u64>,
    /// The publication still carries the mark.
    marked: bool,
    pub(crate) rows: u64,
    pub(crate) skipped: u64,
    pub(crate) started: Instant,
}

impl Backfill {
    /// A backfill of the rows up to the highest id now (a single outbox,
    /// number 0), under the publication's mark.
    pub(crate) async fn start(
        why: Why,
        sql: &Arc<WalSql>,
        client: &Client,
    ) -> Result<Backfill, tokio_postgres::Error> {
        let backfill = Self::of_tables(why, vec![(0, Arc::clone(sql))], client).await?;
        Ok(Backfill {
            marked: true,
            ..backfill
        })
    }

    /// A backfill of a fleet's `tables` (outbox number, statements), each
    /// up to its highest id now; no mark.
    pub(crate) async fn of_tables(
        why: Why,
        tables: Vec<(u32, Arc<WalSql>)>,
        client: &Client,
    ) -> Result<Backfill, tokio_postgres::Error> {
        let mut parts = VecDeque::new();
        for (outbox, sql) in tables {
            parts.push_back(Part::start(outbox, sql, client).await?);
        }
        Ok(Backfill {
            why,
            parts,
            read: false,
            ids: HashSet::new(),
            last_txn: None,
            until: None,
            marked: false,
            rows: 0,
            skipped: 0,
            started: Instant::now(),
        })
    }

    /// Reads one more table (a tenant's joining the publication), up to its
    /// highest id now: the stream waits again until it is read, and drops
    /// its copies until past the new last page.
    pub(crate) async fn add(
        &mut self,
        outbox: u32,
        sql: Arc<WalSql>,
        client: &Client,
    ) -> Result<(), tokio_postgres::Error> {
        self.parts.push_back(Part::start(outbox, sql, client).await?);
        self.read = false;
        self.until = None;
        Ok(())
    }

    /// Whether pages are left to read: the stream waits until none are.
    pub(crate) fn reading(&self) -> bool {
        !self.read
    }

    /// Reads the next page into `window` as one transaction confirming
    /// no position; at the end, takes the position the stream must pass
    /// before its copies stop.
    pub(crate) async fn read_page(
        &mut self,
        sql: &WalSql,
        client: &Client,
        window: &mut Window,
        rows: u32,
        bytes: u64,
    ) -> Result<(), SourceError> {
        let found = match self.parts.front() {
            Some(part) => {
                let page = BackfillPage {
                    after: part.after,
                    upto: part.upto,
                    rows: i64::from(rows.max(1)),
                    bytes: i64::try_from(bytes).unwrap_or(i64::MAX),
                };
                match part.sql.backfill_page(client, &page).await {
                    Ok(found) => found,
                    // A tenant dropped meanwhile: nothing of it is owed.
                    Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
                        Vec::new()
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            None => Vec::new(),
        };
        let Some((last, _)) = found.last() else {
            if self.parts.pop_front().is_some() && !self.parts.is_empty() {
                return Ok(());
            }
            let position = sql.insert_position(client).await?;
            let until = pgwire_replication::Lsn::parse(&position)
                .map_err(|e| SourceError::Decode(format!("the WAL insert position {position:?}: {e}")))?;
            self.until = Some(until.as_u64());
            self.read = true;
            return Ok(());
        };
        let part = self.parts.front_mut().expect("a page was read from it");
        part.after = last.id;
        let outbox = part.outbox;
        window.begin();
        for (row, size) in found {
            self.ids.insert((outbox, row.id));
            self.rows += 1;
            let id = row.id;
            // As the stream's decoder does: a row that breaks the table
            // contract is a dead letter naming the column.
            let unreadable = outbox::contract::check_row(&row).err().map(|v| v.to_string());
            window.push_to(
                outbox,
                row,
                Some(id),
                unreadable,
                u64::try_from(size).unwrap_or(0),
            );
        }
        // Position 0: confirming it moves nothing, and the window's order
        // keeps every later position behind this transaction.
        window.commit(0);
        self.last_txn = window.last_txn();
        Ok(())
    }

    /// Whether the stream's row `id` was backfilled: then it is dropped
    /// (once: a requeued dead letter comes back with its id).
    pub(crate) fn delivered(&mut self, outbox: u32, id: i64) -> bool {
        let hit = self.ids.remove(&(outbox, id));
        if hit {
            self.skipped += 1;
        }
        hit
    }

    /// The stream read a commit ending at `end`: past the last page's
    /// position, it carries nothing the backfill read.
    pub(crate) fn passed(&mut self, end: u64) {
        if self.until.is_some_and(|until| end >= until) {
            self.ids = HashSet::new();
            self.until = None;
        }
    }

    /// Whether the mark may go: every page read, every backfilled row
    /// finished. Ask before the window's writes are taken, and clear once
    /// they committed.
    pub(crate) fn owes_nothing(&self, window: &Window) -> bool {
        self.marked && self.read && self.last_txn.is_none_or(|t| window.finished_through(t))
    }

    /// Whether the publication still carries the mark.
    pub(crate) fn owes(&self) -> bool {
        self.marked
    }

    /// The mark was cleared.
    pub(crate) fn cleared(&mut self) {
        self.marked = false;
    }

    /// Whether there is nothing left to do: the mark cleared and the
    /// stream past the last page.
    pub(crate) fn is_over(&self) -> bool {
        !self.marked && self.read && self.until.is_none()
    }
}
