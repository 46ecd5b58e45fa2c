//! The WAL source (`outbox relay --source wal`): the outbox's inserts and
//! emitted events read from the write-ahead log through a logical
//! replication slot, delivered through the same relay loop, sinks and
//! breakers as the polling source.
//!
//! - [`decode`] turns pgoutput's messages into rows.
//! - [`window`] holds what was read and not finished, parks aggregates
//!   behind failures, and decides what position may be confirmed.
//! - [`turn`] lets one relay read and keeps the others as standbys.
//! - [`stream`] opens the replication connection.
//! - [`watch`] reads the slot's state for the gauges and the warning.
//! - [`backfill`] makes the slot again when a failover (or PostgreSQL)
//!   took it, and delivers the rows the table still holds before the
//!   stream.
//! - [`fleet`] reads every tenant outbox of a database through one slot
//!   (`outbox relay --source wal --schemas`): finding them, adding them to
//!   the publication, backfilling each as it joins.
//!
//! Nothing here holds a transaction open: the slot is the claim. A batch
//! is rows handed out of the window; settling it finishes or parks them;
//! the writes it implies (deleting delivered rows, recording dead letters)
//! run while the next batch is at the sink, and only after they committed
//! is the position past their transactions confirmed to PostgreSQL (see
//! [`window`] for why that is at least once).
//!
//! A sink outage pauses the relay loop, so nothing is read and nothing is
//! attempted: the replication client's buffer fills, the server stops
//! sending, and the slot keeps the WAL until the sink is back.

mod backfill;
mod decode;
mod fleet;
mod stream;
mod turn;
mod watch;
mod window;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use metrics::{Counter, Gauge};
use outbox::OutboxRow;
use outbox::sql::WalSql;
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use self::backfill::{Backfill, Server, Why};
use self::decode::{Decoded, Decoder};
pub(crate) use self::fleet::Tenants;
use self::turn::{Timing, Turn};
use self::watch::SlotWatch;
use self::window::{Dead, Pending, Window, Writes};
use super::{Batch, Claim, Outcomes, Receipts, Source, SourceError};
use crate::config::{RelayConfig, WalCleanup};
use crate::context::RelayContext;
use crate::error::{RelayError, error_chain};
use crate::metric;
use crate::pg::{PgConfig, Startup};
use crate::plan::Plan;

/// The longest wait without looking at anything: pending writes are
/// flushed and the turn checked at least this often.
const TICK: Duration = Duration::from_secs(1);

/// How long a delivered row may stay invisible to the relay's delete (or
/// a dead letter's update) before the relay stops waiting for it: the gap
/// between a commit being decoded and its transaction becoming visible is
/// far shorter; past this the row must be gone.
const UNFOUND_GRACE: Duration = Duration::from_secs(5);

/// Batches whose deletes go in one statement while a backlog lasts.
const FLUSH_BATCHES: usize = 10;

/// The first wait after a failure (see `WalSource::retry_in`).
const FIRST_RETRY: Duration = Duration::from_millis(100);

/// One outbox the stream carries; its number is its place in
/// `WalSource::tables`.
struct Table {
    sql: Arc<WalSql>,
    config: outbox::Config,
    /// Its `outbox` label when the source reads several (a fleet); None
    /// for the relay's own.
    label: Option<String>,
    /// False once it is gone (a tenant's schema dropped): nothing more is
    /// written to it.
    live: bool,
}

/// A batch settled, waiting for its writes: its outbox's label, number,
/// rows, when it was handed out, and outcomes.
type Unwritten = (Option<String>, u64, usize, std::time::Instant, Outcomes);

/// The replication session and its decoder.
struct Stream {
    client: ReplicationClient,
    decoder: Decoder,
}

/// See the [module docs](self).
pub(crate) struct WalSource {
    config: RelayConfig,
    pg: PgConfig,
    /// The slot's and publication's statements (and the table's, for a
    /// single outbox).
    sql: Arc<WalSql>,
    /// The outboxes the stream carries: the relay's own, or a fleet's
    /// tenants as they are found.
    tables: Vec<Table>,
    /// A fleet's: how tenants are found.
    tenants: Option<Tenants>,
    ctx: RelayContext,
    receipts: Receipts,
    /// Batches settled whose writes have not been made yet: their receipts
    /// wait for the write (see [`WalSource::flush`]).
    unwritten: Vec<Unwritten>,
    /// `outbox_wal_window_events` (the slot's gauges are the watch's).
    window_gauge: Gauge,
    /// For the writes and the slot's state; `None` after it failed.
    client: Option<Client>,
    turn: Option<Turn>,
    stream: Option<Stream>,
    window: Window,
    /// The batch at the sink, when it was handed out, and its outbox.
    at_sink: Option<(u64, Arc<[OutboxRow]>, std::time::Instant, u32)>,
    /// Held for its task: dropping it stops the watching.
    _watch: SlotWatch,
    /// `drain`: the marker was emitted, and read back.
    drain_marker: (bool, bool),
    /// The last position handed to the replication client to confirm.
    confirmed: u64,
    /// The prefix of the drain marker (see `DRAIN_MARKER`).
    drain_prefix: String,
    /// Since when writes have not found their rows (see `UNFOUND_GRACE`).
    unfound_since: Option<Instant>,
    /// How long the next recovery waits: doubling from 100 ms to 2 s while
    /// failures repeat, back to 100 ms once a batch went through.
    retry_in: crate::backoff::Doubling,
    /// The server the stream last opened on: another one means a failover.
    server: Option<Server>,
    /// The backfill under way, from its start until the stream passed it.
    backfill: Option<Backfill>,
    /// `outbox_wal_backfilled_events_total`.
    backfilled: Counter,
}

/// What a wait ended with.
enum Woke {
    Event(Result<Option<ReplicationEvent>, PgWireError>),
    Tick,
    Lapsed,
    Cancelled,
}

impl WalSource {
    /// Connects and checks the server, the role, the schema and the slot;
    /// `None` if `cancel` fired meanwhile. Reading starts with the first
    /// claim, once this relay holds the turn.
    pub(crate) async fn open(
        config: RelayConfig,
        pg: PgConfig,
        ctx: RelayContext,
        receipts: Receipts,
        cancel: &CancellationToken,
    ) -> Result<Option<WalSource>, RelayError> {
        let sql = Arc::new(WalSql::new(&config.outbox).map_err(RelayError::Schema)?);
        let Some(client) = connect(&pg, &config, cancel).await? else {
            return Ok(None);
        };
        outbox::check(&client, &config.outbox)
            .await
            .map_err(RelayError::Schema)?;
        let slot = outbox::wal::check_wal_setup(&client, &config.outbox)
            .await
            .map_err(RelayError::Schema)?;
        warn_about_mixing(&client, &config).await;
        match &slot {
            Some(slot) if !slot.is_lost() => info!(
                slot = %slot.slot,
                publication = sql.publication(),
                retained_bytes = slot.retained_bytes,
                confirmed_lsn = %slot.confirmed_lsn,
                "log tailing: the slot is ready"
            ),
            _ => {
                let why = if slot.is_some() { Why::Lost } else { Why::Missing };
                if config.wal.cleanup == WalCleanup::None
                    && let Some(error) = why.without_cleanup(sql.slot())
                {
                    return Err(RelayError::Schema(error));
                }
                info!(
                    slot = sql.slot(),
                    publication = sql.publication(),
                    "log tailing: the slot is {}; it is made again once this relay reads",
                    if slot.is_some() { "invalidated" } else { "missing" }
                );
            }
        }
        ctx.health().postgres("", None);
        let table = Table {
            sql: Arc::clone(&sql),
            config: config.outbox.clone(),
            label: None,
            live: true,
        };
        Ok(Some(Self::assemble(
            config,
            pg,
            sql,
            vec![table],
            None,
            client,
            ctx,
            receipts,
        )))
    }

    /// The source, once its checks passed; watching the slot from now on
    /// (its gauges labelled with `database` too, for a fleet's).
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        config: RelayConfig,
        pg: PgConfig,
        sql: Arc<WalSql>,
        tables: Vec<Table>,
        tenants: Option<Tenants>,
        client: Client,
        ctx: RelayContext,
        receipts: Receipts,
    ) -> WalSource {
        let mut watch_pg = pg.clone();
        watch_pg
            .postgres_mut()
            .application_name("outbox-relay slot watch");
        let database = tenants.as_ref().map(Tenants::database);
        let watch = SlotWatch::start(
            watch_pg,
            Arc::clone(&sql),
            config.wal.retained_warn,
            &ctx,
            database,
        );
        WalSource {
            window: window(&config),
            config,
            pg,
            tables,
            tenants,
            window_gauge: metrics::gauge!(metric::WAL_WINDOW, &[ctx.label()]),
            backfilled: metrics::counter!(metric::WAL_BACKFILLED, &[ctx.label()]),
            ctx,
            receipts,
            unwritten: Vec::new(),
            client: Some(client),
            turn: None,
            stream: None,
            at_sink: None,
            _watch: watch,
            drain_marker: (false, false),
            confirmed: 0,
            drain_prefix: format!("outbox-drain:{}", sql.slot()),
            retry_in: crate::backoff::Doubling::new(FIRST_RETRY, crate::backoff::RECONNECT_MAX),
            unfound_since: None,
            server: None,
            backfill: None,
            sql,
        }
    }

    /// The stream's decoder: every outbox carried, by its number.
    fn decoder(&self) -> Decoder {
        let mut decoder = Decoder::default();
        for (n, t) in self.tables.iter().enumerate().filter(|(_, t)| t.live) {
            let n = u32::try_from(n).expect("fewer than 2^32 outboxes");
            decoder.add(
                n,
                t.config.schema.as_str(),
                t.config.table.as_str(),
                t.sql.prefix(),
            );
        }
        decoder
    }

    /// The slot's name.
    pub(crate) fn slot(&self) -> &str {
        self.sql.slot()
    }

    /// Forgets everything read: the stream closes, and whatever was not
    /// confirmed is read again by whoever reads next.
    fn reset(&mut self) {
        self.stream = None;
        self.at_sink = None;
        // A backfill not finished is owed still (the publication's mark):
        // the next reader starts it over.
        self.backfill = None;
        // Read again, so delivered (and booked) again.
        self.unwritten.clear();
        self.window = window(&self.config);
        self.show_window();
    }

    fn show_window(&self) {
        // Events, a count: exact in an f64.
        #[allow(clippy::cast_precision_loss)]
        self.window_gauge.set(self.window.unfinished() as f64);
    }

    fn turn_valid(&self) -> bool {
        self.turn.as_ref().is_some_and(Turn::is_valid)
    }

    /// Holds the turn and streams the slot; false if cancelled first.
    async fn ensure_reading(&mut self, cancel: &CancellationToken) -> Result<bool, SourceError> {
        if self.turn.is_some() && !self.turn_valid() {
            warn!(
                slot = self.slot(),
                "this relay's turn ran out; it stops reading and waits as a standby"
            );
            self.turn = None;
            self.reset();
        }
        if self.turn.is_none() {
            let timing = Timing {
                timeout: self.config.lease_timeout,
            };
            let mut pg = self.pg.clone();
            pg.postgres_mut().application_name("outbox-relay turn");
            match Turn::take(&pg, Arc::clone(&self.sql), timing, &self.ctx, cancel).await {
                Some(turn) => self.turn = Some(turn),
                None => return Ok(false),
            }
        }
        if self.stream.is_none() {
            let host = stream::primary(&self.pg, &self.sql).await?;
            let config = stream::config(&host, self.sql.slot(), self.sql.publication());
            let mut said_busy = false;
            let client = loop {
                let (mut client, server) = stream::connect(config.clone())
                    .await
                    .map_err(SourceError::Replication)?;
                self.prepare(server).await?;
                match stream::start(&mut client).await {
                    Ok(()) => break client,
                    Err(e) if stream::is_slot_busy(&e) => {
                        if !said_busy {
                            info!(error = %e, "the previous reader still holds the slot; waiting for it to let go");
                            said_busy = true;
                        }
                    }
                    Err(e) => return Err(SourceError::Replication(e)),
                }
                tokio::select! {
                    () = cancel.cancelled() => return Ok(false),
                    () = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
                if !self.turn_valid() {
                    return Ok(true);
                }
            };
            info!(slot = self.slot(), host = %host.target(), "streaming the slot");
            self.ctx.health().postgres("", None);
            self.stream = Some(Stream {
                client,
                decoder: self.decoder(),
            });
        }
        Ok(true)
    }

    /// Before the stream starts on `server`: whether the stream alone
    /// holds every undelivered event, and if not, the slot made again (if
    /// it is gone) and a backfill begun (see [`backfill`]).
    async fn prepare(&mut self, server: Server) -> Result<(), SourceError> {
        if self.tenants.is_some() {
            return self.prepare_fleet(server).await;
        }
        let sql = Arc::clone(&self.sql);
        let slot = sql.slot().to_owned();
        // Remembered once acted on: a failure before the mark is set must
        // not make the next try forget that the server changed.
        let moved_from = self.server.clone().filter(|before| *before != server);
        let client = self.client().await?;
        let state = sql.slot_state(client).await?;
        let owed = sql.backfill_owed(client).await?;
        let why = match &state {
            None => Why::Missing,
            Some(s) if s.is_lost() => Why::Lost,
            Some(_) if owed => Why::Owed,
            Some(_) => match moved_from {
                Some(from) => Why::Moved {
                    from,
                    to: server.clone(),
                },
                None => {
                    self.server = Some(server);
                    return Ok(());
                }
            },
        };
        if self.config.wal.cleanup == WalCleanup::None {
            if let Some(error) = why.without_cleanup(&slot) {
                return Err(fatal(error));
            }
            warn!(
                %slot,
                ?why,
                "another server answers (a failover) and it has the slot: streaming it as it is \
                 (--wal-cleanup none keeps delivered rows, so the table cannot be backfilled)"
            );
            self.server = Some(server);
            return Ok(());
        }
        match &why {
            Why::Missing => warn!(
                %slot,
                "the replication slot is missing (a failover to a standby, or it was dropped): \
                 creating it again, then delivering the table's undelivered rows before streaming"
            ),
            Why::Lost => error!(
                %slot,
                "PostgreSQL invalidated the replication slot (it fell more than max_slot_wal_keep_size behind): \
                 creating it again, then delivering the table's undelivered rows before streaming; \
                 emitted events in the lost WAL cannot be recovered"
            ),
            Why::Owed => warn!(
                %slot,
                "a backfill of the table is owed (a relay died before finishing one, or the slot was made again): \
                 delivering the table's undelivered rows before streaming"
            ),
            Why::Moved { from, to } => warn!(
                %slot,
                from = %from,
                to = %to,
                "the server changed under the relay (timeline {} → {}): a failover; it has the slot: \
                 delivering the table's undelivered rows before streaming it",
                from.timeline,
                to.timeline
            ),
            // A fleet's, which `prepare_fleet` handles.
            Why::Tenants => {}
        }
        let client = self.client().await?;
        if why.recreates() {
            if !sql.publication_exists(client).await? {
                return Err(fatal(outbox::Error::WalNotSetUp {
                    what: format!("the publication {} does not exist", sql.publication()),
                }));
            }
            if why == Why::Lost {
                sql.drop_slot(client).await?;
            }
        }
        // The mark before the slot: a relay dying in between finds the
        // slot missing, or the mark, and starts over.
        if !owed {
            mark(&sql, client).await?;
        }
        if why.recreates() {
            sql.create_slot(client).await?;
            metrics::counter!(
                metric::WAL_SLOT_RECREATED,
                &[self.ctx.label(), ("reason", why.label().to_owned())]
            )
            .increment(1);
        }
        let client = self.client().await?;
        self.backfill = Some(Backfill::start(why, &sql, client).await?);
        self.server = Some(server);
        Ok(())
    }

    /// Reads the backfill's pages into the window while it has room.
    async fn read_backfill(&mut self) -> Result<(), SourceError> {
        while self.window.has_room() && self.backfill.as_ref().is_some_and(Backfill::reading) {
            let sql = Arc::clone(&self.sql);
            let (rows, bytes) = (self.config.batch_size, self.config.batch_max_bytes);
            self.client().await?;
            let (Some(backfill), Some(client)) = (&mut self.backfill, &self.client) else {
                return Ok(());
            };
            let before = backfill.rows;
            backfill
                .read_page(&sql, client, &mut self.window, rows, bytes)
                .await?;
            self.backfilled.increment(backfill.rows - before);
            if !backfill.reading() {
                info!(
                    rows = backfill.rows,
                    "backfill: every undelivered row of the table is read; the stream follows"
                );
            }
            self.show_window();
        }
        Ok(())
    }

    /// Moves what the replication client has buffered into the window,
    /// without waiting, while it has room.
    fn pull(&mut self) -> Result<(), SourceError> {
        self.note_sent();
        if self.backfilling() {
            return Ok(());
        }
        while self.window.has_room() {
            let Some(stream) = &mut self.stream else {
                return Ok(());
            };
            let Some(event) = stream.client.recv().now_or_never() else {
                return Ok(());
            };
            self.handle(event)?;
        }
        Ok(())
    }

    /// One event of the replication stream.
    fn handle(&mut self, event: Result<Option<ReplicationEvent>, PgWireError>) -> Result<(), SourceError> {
        let Some(stream) = &mut self.stream else {
            return Ok(());
        };
        let event = event
            .map_err(SourceError::Replication)?
            .ok_or(SourceError::ConnectionLost)?;
        match event {
            ReplicationEvent::Begin { .. } => self.window.begin(),
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.window.commit(end_lsn.as_u64());
                if let Some(backfill) = &mut self.backfill {
                    backfill.passed(end_lsn.as_u64());
                    if backfill.is_over() {
                        info!(skipped = backfill.skipped, "backfill: the stream is past it");
                        self.backfill = None;
                    }
                }
            }
            ReplicationEvent::XLogData { data, .. } => {
                let decoded = stream
                    .decoder
                    .data(&data)
                    .map_err(|e| SourceError::Decode(e.to_string()))?;
                // Committed after the slot's start and read by the
                // backfill, which delivered it: not twice.
                let backfilled = match (&decoded, &mut self.backfill) {
                    (
                        Some(Decoded {
                            outbox,
                            table_id: Some(id),
                            ..
                        }),
                        Some(b),
                    ) => b.delivered(*outbox, *id),
                    _ => false,
                };
                if !backfilled {
                    self.push(decoded);
                }
            }
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => {
                if prefix == self.drain_prefix {
                    self.drain_marker.1 = true;
                    return Ok(());
                }
                let decoded = stream.decoder.message(&prefix, &content, lsn.as_u64());
                if transactional {
                    self.push(decoded);
                } else if decoded.is_some() {
                    // Emitted outside a transaction: its own transaction,
                    // confirmable at its own position.
                    self.window.begin();
                    self.push(decoded);
                    self.window.commit(lsn.as_u64());
                }
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                // Everything read is finished and written: the server's
                // position is safe to confirm, which keeps the slot moving
                // while other tables write and the outbox is idle.
                if self.window.is_idle() && self.at_sink.is_none() {
                    stream.client.update_applied_lsn(wal_end);
                    self.confirmed = self.confirmed.max(wal_end.as_u64());
                }
            }
            ReplicationEvent::StoppedAt { .. } => {}
        }
        self.show_window();
        Ok(())
    }

    /// Lets the window know what the server has been sent as confirmed.
    fn note_sent(&mut self) {
        if let Some(stream) = &self.stream {
            let sent = stream.client.metrics().last_applied_lsn().as_u64();
            self.window.sent(sent);
        }
    }

    /// Whether a backfill still has pages to read: the stream waits.
    fn backfilling(&self) -> bool {
        self.backfill.as_ref().is_some_and(Backfill::reading)
    }

    fn push(&mut self, decoded: Option<Decoded>) {
        if let Some(d) = decoded {
            self.window
                .push_to(d.outbox, d.row, d.table_id, d.unreadable, d.bytes);
        }
    }

    /// Commits the writes the finished events imply, then confirms the
    /// position past them. Discarded if this relay lost its turn: the next
    /// reader reads those events again.
    ///
    /// The batches settled before it get their receipts once their writes
    /// committed: a settled batch's deletes and dead letters are what make
    /// it durable (the confirmed position only follows them).
    async fn flush(&mut self) -> Result<(), SourceError> {
        // Asked before the writes are taken: they then include the last
        // backfilled rows'.
        let owes_nothing = self
            .backfill
            .as_ref()
            .is_some_and(|b| b.owes_nothing(&self.window));
        let (writes, confirmable) = self.window.take_writes();
        // Taken now: a failed write drops them (the batches are read and
        // delivered again after the reset that follows).
        let settled = std::mem::take(&mut self.unwritten);
        if !self.turn_valid() {
            return Ok(());
        }
        if writes.values().any(|w| !w.is_empty()) {
            let unfound = self.write_each(writes).await?;
            if !unfound.is_empty() {
                let since = *self.unfound_since.get_or_insert_with(Instant::now);
                if since.elapsed() < UNFOUND_GRACE {
                    // Not visible yet: hold the position until they are.
                    self.window.restore(unfound, confirmable);
                    self.unwritten = settled;
                    return Ok(());
                }
                warn!(
                    deletes = ?unfound.values().flat_map(|w| &w.delete).collect::<Vec<_>>(),
                    dead_letters = unfound.values().map(|w| w.dead.len()).sum::<usize>(),
                    "rows the relay delivered or gave up on were not found for {} s (deleted by someone else?); going on without them",
                    UNFOUND_GRACE.as_secs()
                );
            }
            self.unfound_since = None;
        }
        if owes_nothing {
            let sql = Arc::clone(&self.sql);
            sql.clear_backfill(self.client().await?).await?;
            if let Some(b) = &mut self.backfill {
                b.cleared();
                warn!(
                    slot = sql.slot(),
                    why = ?b.why,
                    rows = b.rows,
                    elapsed_ms = u64::try_from(b.started.elapsed().as_millis()).unwrap_or(u64::MAX),
                    "backfill done: the table's undelivered rows are delivered; streaming the slot"
                );
                if b.is_over() {
                    self.backfill = None;
                }
            }
        }
        for (outbox, batch, claimed, started, outcomes) in settled {
            self.receipts
                .durable_of(outbox, batch, claimed, started, outcomes);
        }
        // A backfill's page read behind the stream's transactions confirms
        // position 0: nothing to send.
        let confirmable = confirmable.filter(|lsn| *lsn > self.confirmed);
        if let (Some(lsn), Some(stream)) = (confirmable, &self.stream) {
            stream.client.update_applied_lsn(Lsn::from_u64(lsn));
            self.confirmed = self.confirmed.max(lsn);
        }
        Ok(())
    }

    /// Each outbox's writes, on its own table; returns those that did not
    /// find their rows. The writes of a table gone meanwhile (a tenant's
    /// schema dropped) are dropped with it.
    async fn write_each(&mut self, writes: Pending) -> Result<Pending, SourceError> {
        let mut unfound = Pending::new();
        for (outbox, w) in writes {
            let Some(table) = self
                .tables
                .get(outbox as usize)
                .filter(|t| t.live && !w.is_empty())
            else {
                continue;
            };
            let sql = Arc::clone(&table.sql);
            match write(&sql, self.client().await?, w).await {
                Ok(left) if left.is_empty() => {}
                Ok(left) => {
                    unfound.insert(outbox, left);
                }
                Err(e) if self.tenants.is_some() && fleet::is_gone(&e) => {
                    debug!(outbox = %sql.publication(), error = %error_chain(&e), "a tenant's table is gone; its writes with it");
                    if let Some(t) = self.tables.get_mut(outbox as usize) {
                        t.live = false;
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(unfound)
    }

    /// The connection for writes, reopened if it failed.
    async fn client(&mut self) -> Result<&Client, SourceError> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            self.client = Some(crate::pg::connect_once(&self.pg).await?);
        }
        Ok(self.client.as_ref().expect("connected"))
    }

    /// Whether a drain is done: everything committed before the drain
    /// looked was read and finished. Emits the marker the first time.
    async fn drained(&mut self) -> Result<bool, SourceError> {
        if !self.drain_marker.0 {
            let (sql, prefix) = (Arc::clone(&self.sql), self.drain_prefix.clone());
            sql.drain_marker(self.client().await?, &prefix).await?;
            self.drain_marker.0 = true;
            return Ok(false);
        }
        Ok(self.drain_marker.1
            && self.window.is_idle()
            && self.at_sink.is_none()
            && self.backfill.as_ref().is_none_or(|b| !b.owes()))
    }

    /// Waits for the stream, the next retry, a tick, the turn running out
    /// or cancellation.
    async fn wait(&mut self, cancel: &CancellationToken) -> Woke {
        self.note_sent();
        // Room comes back once the status update carrying the position
        // went out (every `STATUS_INTERVAL`): look again soon.
        let tick = Instant::now()
            + if self.window.awaits_confirmation() {
                stream::STATUS_INTERVAL / 2
            } else {
                TICK
            };
        let until = self.window.next_due().map_or(tick, |due| due.min(tick));
        let lapse = match &self.turn {
            Some(t) => t.lapse(),
            None => futures::future::pending().boxed(),
        };
        // The stream waits while a backfill has pages to read.
        let room = self.window.has_room() && !self.backfilling();
        let Some(stream) = &mut self.stream else {
            return Woke::Tick;
        };
        tokio::select! {
            () = cancel.cancelled() => Woke::Cancelled,
            event = stream.client.recv(), if room => Woke::Event(event),
            () = tokio::time::sleep_until(until) => Woke::Tick,
            () = lapse => Woke::Lapsed,
        }
    }
}

/// The session for writes and the slot's state, retried as a relay's
/// first connection is (see `Startup`); `None` if `cancel` fired first.
async fn connect(
    pg: &PgConfig,
    config: &RelayConfig,
    cancel: &CancellationToken,
) -> Result<Option<Client>, RelayError> {
    let mut startup = Startup::new(pg, config.connect_timeout);
    loop {
        match crate::pg::connect_once(pg).await {
            Ok(c) => return Ok(Some(c)),
            Err(e) => {
                let delay = startup.failed(e).map_err(RelayError::Connect)?;
                tokio::select! {
                    () = cancel.cancelled() => return Ok(None),
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// Says what does not apply or cannot work beside log tailing: the
/// ordering flags (commit order and parking replace them), and polling
/// relays running on the same outbox (each source delivers every event).
async fn warn_about_mixing(client: &Client, config: &RelayConfig) {
    if config.ordering != crate::config::OrderMode::default() || !config.ordering_for.is_empty() {
        warn!(
            "--ordering and --ordering-for do not apply to --source wal: events go in commit order, an aggregate waits behind its failed event"
        );
    }
    let sql = outbox::sql::OutboxSql::new(&config.outbox);
    let live = config.lease_timeout.as_secs_f64();
    match sql.relays(client).await {
        Ok(relays) => {
            let polling = relays.iter().filter(|r| r.silent_for_seconds < live).count();
            if polling > 0 {
                warn!(
                    polling,
                    "polling relays are running on this outbox: with a WAL relay as well, every event is delivered twice; stop one kind"
                );
            }
        }
        Err(error) => debug!(error = %error_chain(&error), "could not list the polling relays"),
    }
}

/// What the relay stops with.
fn fatal(error: outbox::Error) -> SourceError {
    SourceError::Fatal(RelayError::Schema(error))
}

/// Sets the publication's mark. A role that does not own the publication
/// cannot: the relay stops, saying so (`outbox migrate --wal` run by the
/// owner marks it and makes the slot; this relay then backfills).
async fn mark(sql: &WalSql, client: &Client) -> Result<(), SourceError> {
    match sql.mark_backfill(client).await {
        Ok(()) => Ok(()),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            Err(fatal(outbox::Error::WalNotSetUp {
                what: format!(
                    "the relay's role may not mark the publication {} (only its owner may comment on it), \
                     which making the slot again without losing rows needs: {}",
                    sql.publication(),
                    error_chain(&e)
                ),
            }))
        }
        Err(e) => Err(e.into()),
    }
}

/// An empty window for `config`: unfinished payloads bounded at two
/// batches' worth (one at the sink, one ready), as a polling relay holds.
fn window(config: &RelayConfig) -> Window {
    let bytes = config.batch_max_bytes.saturating_mul(2);
    Window::new(config.wal.window, bytes, config.wal.cleanup == WalCleanup::Delete)
}

/// The writes of finished events: deletes, then dead letters. Returns
/// those that did not find their row (see `DELETE_DELIVERED`).
async fn write(sql: &WalSql, client: &Client, writes: Writes) -> Result<Writes, tokio_postgres::Error> {
    let mut unfound = Writes::default();
    if !writes.delete.is_empty() {
        let found: HashSet<i64> = sql
            .delete_delivered(client, &writes.delete)
            .await?
            .into_iter()
            .collect();
        unfound.delete = writes
            .delete
            .into_iter()
            .filter(|id| !found.contains(id))
            .collect();
    }
    let mut rows = outbox::sql::DeadRows::default();
    let mut emitted = Vec::new();
    for dead in writes.dead {
        match dead {
            Dead::Row {
                id,
                attempts,
                error,
                first_failed_at,
                history,
            } => {
                rows.ids.push(id);
                rows.attempts.push(attempts);
                rows.errors.push(error);
                rows.first_failed_at.push(first_failed_at);
                rows.attempt_logs.push(history);
            }
            Dead::Emitted { row, error, history } => emitted.push((row, error, history)),
        }
    }
    if !rows.ids.is_empty() {
        let found: HashSet<i64> = sql.dead_rows(client, &rows).await?.into_iter().collect();
        let outbox::sql::DeadRows {
            ids,
            attempts,
            errors,
            first_failed_at,
            attempt_logs,
        } = rows;
        let each = ids
            .into_iter()
            .zip(attempts)
            .zip(errors)
            .zip(first_failed_at)
            .zip(attempt_logs);
        for ((((id, attempts), error), first_failed_at), history) in each {
            if !found.contains(&id) {
                unfound.dead.push(Dead::Row {
                    id,
                    attempts,
                    error,
                    first_failed_at,
                    history,
                });
            }
        }
    }
    if !emitted.is_empty() {
        let event_ids: Vec<_> = emitted.iter().map(|(r, ..)| r.event_id).collect();
        let types: Vec<_> = emitted.iter().map(|(r, ..)| r.aggregate_type.clone()).collect();
        let aggregates: Vec<_> = emitted.iter().map(|(r, ..)| r.aggregate_id.clone()).collect();
        let event_types: Vec<_> = emitted.iter().map(|(r, ..)| r.event_type.clone()).collect();
        let payloads: Vec<_> = emitted.iter().map(|(r, ..)| r.payload.clone()).collect();
        let headers: Vec<_> = emitted.iter().map(|(r, ..)| r.headers.clone()).collect();
        let created_at: Vec<_> = emitted.iter().map(|(r, ..)| r.created_at).collect();
        let attempts: Vec<_> = emitted.iter().map(|(r, ..)| r.attempts).collect();
        let errors: Vec<_> = emitted.iter().map(|(_, e, _)| e.clone()).collect();
        let first_failed_at: Vec<_> = emitted.iter().map(|(r, ..)| r.first_failed_at).collect();
        let attempt_logs: Vec<_> = emitted.iter().map(|(.., h)| h.clone()).collect();
        sql.dead_emitted(
            client,
            &outbox::sql::EmittedDead {
                event_ids: &event_ids,
                aggregate_types: &types,
                aggregate_ids: &aggregates,
                event_types: &event_types,
                payloads: &payloads,
                headers: &headers,
                created_at: &created_at,
                attempts: &attempts,
                errors: &errors,
                first_failed_at: &first_failed_at,
                attempt_logs: &attempt_logs,
            },
        )
        .await?;
    }
    Ok(unfound)
}

impl Source for WalSource {
    async fn claim(&mut self, cancel: &CancellationToken) -> Result<Claim, SourceError> {
        loop {
            if cancel.is_cancelled() {
                return Ok(Claim::Cancelled);
            }
            if !self.ensure_reading(cancel).await? {
                return Ok(Claim::Cancelled);
            }
            if !self.turn_valid() {
                continue;
            }
            self.join_tenants().await?;
            self.read_backfill().await?;
            self.pull()?;
            let now = Instant::now();
            if self.window.has_ready(now) {
                let batch_size = self.config.batch_size as usize;
                let (rows, unreadable) = self
                    .window
                    .next_batch(now, batch_size, self.config.batch_max_bytes);
                if !rows.is_empty() {
                    let outbox = self.window.out_outbox().unwrap_or(0);
                    let mut rows = rows;
                    if let Some(label) = self.tables.get(outbox as usize).and_then(|t| t.label.as_deref()) {
                        for row in &mut rows {
                            super::name_the_outbox(row, label);
                        }
                    }
                    let rows: Arc<[OutboxRow]> = rows.into();
                    let batch = self.receipts.next_batch();
                    self.at_sink = Some((batch, Arc::clone(&rows), std::time::Instant::now(), outbox));
                    let full = self.window.has_ready(now);
                    return Ok(Claim::Batch(Batch {
                        rows,
                        unreadable,
                        full,
                        overlapped: false,
                        claim: None,
                    }));
                }
            }
            self.flush().await?;
            if self.config.drain && self.drained().await? {
                return Ok(Claim::Drained);
            }
            match self.wait(cancel).await {
                Woke::Cancelled => return Ok(Claim::Cancelled),
                Woke::Event(event) => self.handle(event)?,
                Woke::Tick | Woke::Lapsed => {}
            }
        }
    }

    fn may_deliver(&self) -> bool {
        self.turn_valid()
    }

    async fn give_back(&mut self) -> Result<(), SourceError> {
        // Only when the turn ran out: whoever reads next reads it again.
        self.reset();
        Ok(())
    }

    fn lapse(&self) -> BoxFuture<'static, ()> {
        match &self.turn {
            Some(t) => t.lapse(),
            None => futures::future::pending().boxed(),
        }
    }

    async fn overlap(&mut self, _full: bool) -> Result<(), SourceError> {
        // The writes of earlier batches, while this one is at the sink: a
        // delete per batch costs more than the sink's round trip, so they
        // go in fewer, larger statements (and at once when reading waits
        // for the position they hold back). An idle source flushes before
        // it waits.
        let rows = (self.config.batch_size as usize).saturating_mul(FLUSH_BATCHES);
        if self.window.should_flush(rows) {
            self.flush().await?;
        }
        Ok(())
    }

    fn settle(&mut self, plan: Plan) {
        let Some((batch, rows, started, outbox)) = self.at_sink.take() else {
            return;
        };
        self.window.settle(&rows, &plan.failures, Instant::now());
        self.retry_in.reset();
        self.show_window();
        debug!(
            rows = rows.len(),
            delivered = plan.published,
            failed = plan.failures.ids.len(),
            "batch settled"
        );
        let label = self.tables.get(outbox as usize).and_then(|t| t.label.clone());
        self.unwritten
            .push((label, batch, rows.len(), started, Outcomes::from_plan(plan)));
    }

    async fn hold(&mut self) -> Result<(), SourceError> {
        self.flush().await
    }

    async fn recover(&mut self, error: SourceError, cancel: &CancellationToken) -> bool {
        let error = error_chain(&error);
        let delay = self.retry_in.next_delay();
        warn!(
            %error,
            retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            "log tailing: reading again from the slot's confirmed position"
        );
        self.ctx
            .health()
            .postgres("", Some(format!("reconnecting: {error}")));
        self.reset();
        tokio::select! {
            () = cancel.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        }
    }

    async fn finish(&mut self) {
        if let Err(error) = self.flush().await {
            warn!(error = %error_chain(&error), "the last writes failed; their events will be read again");
            return;
        }
        let Some(mut stream) = self.stream.take() else {
            return;
        };
        // The confirmed position goes out with the next status update;
        // wait for it (briefly) so a restart re-sends as little as possible.
        let sent = stream.client.metrics();
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline && sent.last_applied_lsn().as_u64() < self.confirmed {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stream.client.shutdown().await;
    }
}
