//! The `pooled` phase: the polling relay through PgBouncer, beside the same
//! relay on the same database directly, in one run (issue 32).
//!
//! Throughput: N pre-written events drained (`outbox relay --drain`) per
//! batch size (`--batch-sizes`, default 1 and 100) and claim mode (lock,
//! deadline), by [`Route`]:
//! - direct: the default (`--pooler none`: statements prepared and plans
//!   pinned once per session);
//! - direct, unnamed: `--pooler transaction` on the direct connection, so
//!   what unnamed statements and plans pinned per transaction cost, with no
//!   pooler in between;
//! - PgBouncer session: `pool_mode = session`, the relay's defaults;
//! - PgBouncer transaction: `pool_mode = transaction`, `--pooler
//!   transaction`.
//!
//! Latency (commit to consumer, as the latency phase measures it) through
//! the transaction pool, where the relay cannot LISTEN: polling (its
//! default there, `--poll-interval` 1 s), and with `--listen-url` on a
//! direct connection; direct NOTIFY beside them.
//!
//! PgBouncer (the testkit's: Debian's `/usr/sbin/pgbouncer`, its defaults
//! but for trust auth and the pool mode) runs in front of the bench's own
//! throwaway PostgreSQL, so the phase needs no `DATABASE_URL`.

use serde::Serialize;

use super::latency::{self, Clock, LatencyRun};
use super::throughput::Strategy;
use crate::report::Spread;
use crate::scratch::Scratch;

/// How the relay reaches the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Route {
    Direct,
    DirectUnnamed,
    Session,
    Transaction,
}

impl Route {
    pub(crate) const ALL: [Route; 4] = [
        Route::Direct,
        Route::DirectUnnamed,
        Route::Session,
        Route::Transaction,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::DirectUnnamed => "direct, --pooler transaction",
            Route::Session => "PgBouncer session",
            Route::Transaction => "PgBouncer transaction",
        }
    }

    /// The relay's pooler flags on this route.
    fn args(self) -> &'static [&'static str] {
        match self {
            Route::Direct | Route::Session => &[],
            Route::DirectUnnamed | Route::Transaction => &["--pooler", "transaction"],
        }
    }
}

/// How the relay is woken in the latency runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Waking {
    /// Direct, LISTEN/NOTIFY: the default.
    DirectNotify,
    /// Through the transaction pool, no LISTEN: the poll (1 s).
    TransactionPoll,
    /// Through the transaction pool, LISTEN on `--listen-url` (direct).
    TransactionListenUrl,
}

impl Waking {
    pub(crate) const ALL: [Waking; 3] = [
        Waking::DirectNotify,
        Waking::TransactionPoll,
        Waking::TransactionListenUrl,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Waking::DirectNotify => "direct, NOTIFY",
            Waking::TransactionPoll => "PgBouncer transaction, poll",
            Waking::TransactionListenUrl => "PgBouncer transaction, --listen-url",
        }
    }
}

/// What one pooled drain measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PooledRun {
    pub(crate) seconds: f64,
    /// Distinct event_ids that reached Redis.
    pub(crate) delivered: u64,
    /// Stream entries beyond the distinct ones.
    pub(crate) duplicates: u64,
    /// Rows marked published.
    pub(crate) marked: u64,
}

/// The two PgBouncers, in front of the bench's PostgreSQL, and the URLs of
/// the bench's database: directly and through each.
pub(super) struct Pools {
    direct: String,
    session: String,
    transaction: String,
    _bouncers: [outbox_testkit::PgBouncer; 2],
}

impl Pools {
    /// Starts both pools in front of `pg`, whose database `database` the
    /// bench uses at `direct`.
    pub(super) async fn start(pg: &outbox_testkit::Postgres, direct: &str) -> anyhow::Result<Pools> {
        use outbox_testkit::{PgBouncer, PoolMode};
        let session = PgBouncer::start(pg, PoolMode::Session).await?;
        let transaction = PgBouncer::start(pg, PoolMode::Transaction).await?;
        let database = direct.rsplit('/').next().unwrap_or("postgres");
        Ok(Pools {
            direct: direct.to_owned(),
            session: session.url(database),
            transaction: transaction.url(database),
            _bouncers: [session, transaction],
        })
    }

    fn url(&self, route: Route) -> &str {
        match route {
            Route::Direct | Route::DirectUnnamed => &self.direct,
            Route::Session => &self.session,
            Route::Transaction => &self.transaction,
        }
    }
}

/// Writes `n` events and drains them with a relay on `route`, claiming as
/// `claim`, `batch` rows per batch.
pub(super) async fn drain(
    scratch: &mut Scratch,
    pools: &Pools,
    route: Route,
    claim: &str,
    n: usize,
    batch: u32,
) -> anyhow::Result<PooledRun> {
    scratch.prepare(Strategy::Relay).await?;
    scratch.write(Strategy::Relay, n).await?;
    let batch = batch.to_string();
    let mut args = vec!["--batch-size", batch.as_str(), "--drain", "--claim", claim];
    args.extend(route.args());
    let relay = scratch.spawn_bench_relay_on(pools.url(route), &args).await?;
    let (seconds, _) = scratch.relay_drained(relay).await?;
    let (entries, delivered) = scratch.stream_counts().await?;
    Ok(PooledRun {
        seconds,
        delivered,
        duplicates: entries - delivered,
        marked: scratch.published().await? as u64,
    })
}

/// Commit-to-consumer latency with the relay woken as `waking`.
pub(super) async fn latency(
    scratch: &mut Scratch,
    pools: &Pools,
    waking: Waking,
    rate: u32,
    seconds: f64,
) -> anyhow::Result<LatencyRun> {
    scratch.prepare(Strategy::Relay).await?;
    let pooled = ["--pooler", "transaction"];
    let listen = ["--pooler", "transaction", "--listen-url", pools.direct.as_str()];
    let (url, args): (&str, &[&str]) = match waking {
        Waking::DirectNotify => (&pools.direct, &[]),
        Waking::TransactionPoll => (&pools.transaction, &pooled),
        Waking::TransactionListenUrl => (&pools.transaction, &listen),
    };
    latency::measure_on(scratch, url, args, rate, seconds, Clock::CreatedAt).await
}

/// One route and claim mode at one batch size.
#[derive(Debug, Serialize)]
pub(super) struct PooledRow {
    pub(super) route: Route,
    pub(super) claim: &'static str,
    pub(super) batch_size: u32,
    pub(super) events_per_second: Spread,
    pub(super) runs: Vec<PooledRun>,
    #[serde(skip)]
    pub(super) events: usize,
}

impl PooledRow {
    pub(super) fn new(
        route: Route,
        claim: &'static str,
        batch_size: u32,
        events: usize,
        runs: Vec<PooledRun>,
    ) -> Self {
        Self {
            route,
            claim,
            batch_size,
            events_per_second: Spread::of(runs.iter().map(|r| events as f64 / r.seconds)),
            runs,
            events,
        }
    }
}

/// Latency woken one way.
#[derive(Debug, Serialize)]
pub(super) struct PooledLatencyRow {
    pub(super) waking: Waking,
    pub(super) rate: u32,
    pub(super) p50_ms: Spread,
    pub(super) p99_ms: Spread,
    pub(super) max_ms: Spread,
    pub(super) runs: Vec<LatencyRun>,
}

impl PooledLatencyRow {
    pub(super) fn new(waking: Waking, rate: u32, runs: Vec<LatencyRun>) -> Self {
        Self {
            waking,
            rate,
            p50_ms: Spread::of(runs.iter().map(|r| r.p50_ms)),
            p99_ms: Spread::of(runs.iter().map(|r| r.p99_ms)),
            max_ms: Spread::of(runs.iter().map(|r| r.max_ms)),
            runs,
        }
    }
}
