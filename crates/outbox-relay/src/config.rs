//! How a relay is configured: [`RelayConfig`] and the ordering modes.
//!
//! Plain data with defaults (each defined once, in `crate::defaults`); the
//! CLI fills it from flags, environment and TOML, the lab and bench fill it
//! directly.

use std::fmt;
use std::time::Duration;

use outbox::Config as OutboxConfig;

use crate::backoff::Backoff;
use crate::defaults;
use crate::error::RelayError;
use crate::failpoint::Failpoint;

/// How the relay runs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The outbox table and NOTIFY channel.
    pub outbox: OutboxConfig,
    /// Rows claimed per transaction (default 100).
    pub batch_size: u32,
    /// Retry schedule and dead-letter limit.
    pub backoff: Backoff,
    /// Fallback poll interval (default 5 s). With `notify` it only covers
    /// what NOTIFY cannot: rows committed with triggers disabled, and retries
    /// another relay scheduled before it died. Without `notify` it is the
    /// delivery latency, so set it lower (the CLI defaults to 1 s then).
    pub poll_interval: Duration,
    /// LISTEN for the insert trigger's notifications (default true).
    pub notify: bool,
    /// How long to keep trying PostgreSQL at startup (default 10 s).
    pub connect_timeout: Duration,
    /// Exit once nothing is due instead of waiting for more (cron jobs,
    /// scripts, `outbox-lab bench`).
    pub drain: bool,
    /// Per-aggregate ordering. `Partition` and `Strict` share the outbox
    /// with other relays through partition leases; `None` claims any row.
    pub ordering: OrderMode,
    /// Aggregate types whose ordering differs from `ordering` (`Partition`
    /// or `Strict` each; `None` has no per-type form, as it takes no leases).
    pub ordering_for: Vec<(String, OrderMode)>,
    /// How soon a dead relay's partitions move to the others (default 10 s).
    pub lease_timeout: Duration,
    /// How this relay shows in `outbox relays` (default `host:pid`).
    pub name: Option<String>,
    /// The largest payload (as JSON text) sent to the sink (default
    /// [`defaults::MAX_EVENT_BYTES`]); a larger one is a dead letter at once,
    /// never sent. Lowered to the sink's own limit where the sink knows it.
    pub max_event_bytes: u64,
    /// The payload bytes one claim may take (default
    /// [`defaults::BATCH_MAX_BYTES`]): rows in id order while they fit, and
    /// always the first, so memory stays bounded by this or one event.
    pub batch_max_bytes: u64,
    /// A test-only pause point.
    pub failpoint: Option<Failpoint>,
    /// Where events come from: the table (default) or the WAL.
    pub source: SourceKind,
    /// Log tailing's settings (`source` = [`SourceKind::Wal`]).
    pub wal: WalSettings,
    /// How the polling source claims a batch: in the transaction it is
    /// delivered in (the default), or by a lease it commits first.
    pub claim: ClaimMode,
    /// With [`ClaimMode::Deadline`]: how long a claim holds its rows (default
    /// 60 s). A relay that dies leaves rows that are claimed again once it
    /// runs out; a delivery still running then is abandoned. Longer than
    /// the slowest batch the sink may take.
    pub claim_timeout: Duration,
    /// What sits between the relay and PostgreSQL (default
    /// [`defaults::POOLER`]: nothing, or a session-mode pool).
    pub pooler: Pooler,
    /// With [`Pooler::Transaction`]: a direct connection (not through the
    /// pooler) used only to LISTEN for the insert trigger's notifications.
    /// Without it the relay polls (`poll_interval`).
    pub listen: Option<crate::pg::PgConfig>,
}

/// What sits between the relay and PostgreSQL: the value of `outbox relay
/// --pooler`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Pooler {
    /// A connection of the relay's own for as long as it lasts: direct, or
    /// through a session-mode pool (PgBouncer `pool_mode = session`). The
    /// relay prepares its statements and pins its plans once per session,
    /// and LISTENs on it.
    #[default]
    #[value(help = "Direct, or a session-mode pool (the default)")]
    None,
    /// A transaction-mode pool (PgBouncer `pool_mode = transaction`): each
    /// transaction may run on another server connection, shared with other
    /// clients. The relay leaves nothing on a session: unnamed statements,
    /// plans pinned per transaction (`SET LOCAL`), no LISTEN (poll, or
    /// `--listen-url`), no backend pids recorded for a takeover to
    /// terminate (a lock claim's transaction ends itself after the lease
    /// timeout idle instead). `--source wal` cannot run through one.
    #[value(help = "A transaction-mode pool such as PgBouncer's pool_mode = transaction")]
    Transaction,
}

impl Pooler {
    /// The name used by `--pooler`, logs and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooler::None => "none",
            Pooler::Transaction => "transaction",
        }
    }
}

impl fmt::Display for Pooler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the polling source claims a batch: the value of `outbox relay
/// --claim`, or of a route's `claim` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ClaimMode {
    /// Locks the batch (`FOR UPDATE SKIP LOCKED`) in a transaction that
    /// stays open while it is at the sink and commits its marks: one
    /// round trip per batch, but the open transaction holds back VACUUM
    /// in the whole database for as long as the sink takes.
    #[default]
    #[value(help = "Lock the batch in a transaction open during delivery (the default)")]
    Lock,
    /// Writes a deadline on the batch's rows (`claimed_until`,
    /// `claimed_by`) in a short transaction, delivers with none open, and
    /// marks in a second one that checks the claim is still its own: for
    /// slow sinks.
    ///
    /// Called `lease` until the word came to mean the partition lease
    /// only; `--claim lease` still parses (a hidden alias).
    #[value(
        alias = "lease",
        help = "Claim by a deadline in a short transaction; deliver with none open"
    )]
    Deadline,
}

impl ClaimMode {
    /// The name used by `--claim`, logs and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimMode::Lock => "lock",
            ClaimMode::Deadline => "deadline",
        }
    }
}

impl fmt::Display for ClaimMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the relay reads events: the value of `outbox relay --source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SourceKind {
    /// Claims unpublished rows from the table (`FOR UPDATE SKIP LOCKED`).
    #[default]
    #[value(help = "Claim unpublished rows from the table (the default)")]
    Poll,
    /// Reads the outbox's inserts and emitted events from the write-ahead
    /// log through a logical replication slot (`outbox migrate --wal`).
    #[value(help = "Tail the write-ahead log (logical replication, pgoutput)")]
    Wal,
}

impl fmt::Display for SourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SourceKind::Poll => "poll",
            SourceKind::Wal => "wal",
        })
    }
}

/// What the WAL source does with a delivered row (`--wal-cleanup`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WalCleanup {
    /// Deletes it by primary key, in batches, before its position is
    /// confirmed: the table holds only what is in flight.
    #[default]
    #[value(help = "Delete delivered rows by primary key (the default)")]
    Delete,
    /// Leaves it for daily partition drops: no write at all per event.
    #[value(help = "Leave delivered rows (daily partitions drop them)")]
    None,
}

/// Log tailing's settings.
#[derive(Debug, Clone, Copy)]
pub struct WalSettings {
    /// Events read whose position the server was not sent (default
    /// 5,000): the most a crash re-sends, besides a larger transaction's
    /// own events.
    pub window: usize,
    /// Delete delivered rows, or leave them.
    pub cleanup: WalCleanup,
    /// Warn when the slot holds back more WAL than this (default 1 GiB).
    pub retained_warn: u64,
}

impl Default for WalSettings {
    fn default() -> Self {
        Self {
            window: defaults::WAL_WINDOW as usize,
            cleanup: WalCleanup::Delete,
            retained_warn: defaults::WAL_RETAINED_WARN,
        }
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            outbox: OutboxConfig::default(),
            batch_size: defaults::BATCH_SIZE,
            backoff: Backoff::default(),
            poll_interval: defaults::POLL_INTERVAL,
            notify: true,
            connect_timeout: defaults::CONNECT_TIMEOUT,
            drain: false,
            ordering: OrderMode::Partition,
            ordering_for: Vec::new(),
            lease_timeout: defaults::LEASE_TIMEOUT,
            name: None,
            max_event_bytes: defaults::MAX_EVENT_BYTES,
            batch_max_bytes: defaults::BATCH_MAX_BYTES,
            failpoint: None,
            source: SourceKind::Poll,
            wal: WalSettings::default(),
            claim: ClaimMode::Lock,
            claim_timeout: defaults::CLAIM_TIMEOUT,
            pooler: defaults::POOLER,
            listen: None,
        }
    }
}

/// How strictly the relay keeps each aggregate's events in order: the value
/// of `outbox relay --ordering` (the short help of each value is what
/// `--help` lists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OrderMode {
    /// No order promised: every relay claims any row (plain `SKIP LOCKED`),
    /// so two relays can deliver one aggregate's events at once, in either
    /// order. The fastest with several relays.
    #[value(help = "Any relay, any order: no leases, plain SKIP LOCKED")]
    None,
    /// One relay at a time delivers a partition of aggregates (leases), in
    /// id order while nothing fails. Events behind a failed event of the
    /// same aggregate in the same or the next batch are held back with it;
    /// events claimed after its batch committed may overtake its retry.
    #[default]
    #[value(help = "One relay per partition of aggregates; id order while nothing fails")]
    Partition,
    /// An event is never delivered while an earlier event of its aggregate
    /// is pending: due later, waiting for a retry, a dead letter nobody gave
    /// up on (`outbox dlq give-up`), or in flight. At most one event per
    /// aggregate per batch.
    #[value(help = "An aggregate waits for its earliest undelivered event")]
    Strict,
}

impl OrderMode {
    /// The name used by `--ordering`, logs and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            OrderMode::None => "none",
            OrderMode::Partition => "partition",
            OrderMode::Strict => "strict",
        }
    }
}

impl fmt::Display for OrderMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl RelayConfig {
    /// Refuses per-type orderings that cannot be honoured.
    pub(crate) fn check_ordering(&self) -> Result<(), RelayError> {
        for (aggregate_type, mode) in &self.ordering_for {
            let reason = if *mode == OrderMode::None {
                "`none` applies to a whole relay (it takes no leases), not to one aggregate type"
            } else if self.ordering == OrderMode::None {
                "per-type ordering needs a relay with leases: use `partition` or `strict` as the default"
            } else {
                continue;
            };
            return Err(RelayError::Ordering {
                aggregate_type: aggregate_type.clone(),
                reason,
            });
        }
        Ok(())
    }

    /// Refuses what cannot run through the pooler in front: log tailing
    /// needs the replication protocol and a session advisory lock, which a
    /// transaction-mode pooler cannot carry.
    pub(crate) fn check_pooler(&self) -> Result<(), RelayError> {
        if self.pooler == Pooler::Transaction && self.source == SourceKind::Wal {
            return Err(RelayError::Pooler(
                "log tailing (--source wal) cannot run through a transaction-mode pooler: it needs the \
                 replication protocol and a session advisory lock; give the WAL relay a DATABASE_URL that \
                 connects directly to PostgreSQL, without --pooler transaction",
            ));
        }
        Ok(())
    }

    /// Whether the relay LISTENs: with `notify`, on its own session, or
    /// through a transaction-mode pooler only on `listen` (a LISTEN there
    /// would be left on a server connection the relay does not keep).
    pub(crate) fn listens(&self) -> bool {
        self.notify && (self.pooler == Pooler::None || self.listen.is_some())
    }

    /// `ordering_for` as `type=mode,…`, for logs.
    pub(crate) fn ordering_for_display(&self) -> String {
        self.ordering_for
            .iter()
            .map(|(t, m)| format!("{t}={m}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}
