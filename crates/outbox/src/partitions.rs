//! Daily partitions of a partitioned outbox (`Layout::Daily`): creating the
//! coming days ahead of time and dropping past days once every row in them
//! is published.
//!
//! Partitions are named `<table>_pYYYYMMDD` and cover one UTC day of
//! `created_at`. A day is dropped only if it holds no unpublished row (a
//! pending event, a retry or a dead letter), checked and dropped in one
//! transaction that holds `ACCESS EXCLUSIVE` on the outbox: no writer can
//! insert into that day, and no relay can turn a row of it back into an
//! unpublished one, between the check and the drop. The lock is taken with a
//! short `lock_timeout` and retried, so maintenance waiting behind a long
//! batch never queues the application's writers behind it for long.
//!
//! With log tailing and `--wal-cleanup none`, delivered rows are never
//! marked published. Such a day goes once the slot has confirmed past a
//! *mark*: the WAL position and the day's highest id, taken under that
//! same lock, when every transaction that wrote into the day had ended (a
//! comment on the partition keeps it). A row inserted after the mark (an
//! explicit `created_at` in the past) has a higher id and moves the mark.
//! Days holding dead letters are kept, as always.
//!
//! A dropped day's published rows are counted into `<table>_removed` (per
//! aggregate type, event type and hour) in the drop's transaction, so
//! `outbox replay` can say how many matching events were gone.

use std::time::Duration;

use chrono::{Days, NaiveDate};
use tokio_postgres::Client;

use crate::sql::catalog;
use crate::{Config, Error, Ident};

/// How long one attempt waits for the outbox lock before giving up (and
/// letting queued writers through).
const LOCK_TIMEOUT: &str = "300ms";
/// Attempts at the lock per partition before it is reported as busy.
const LOCK_ATTEMPTS: u32 = 10;

/// What [`maintain`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Maintenance {
    /// Partitions created, by name.
    pub created: Vec<String>,
    /// Partitions dropped, by name, with the rows they held.
    pub dropped: Vec<(String, i64)>,
    /// Past partitions kept because they hold unpublished rows (pending,
    /// retrying or dead letters), with that count.
    pub kept: Vec<(String, i64)>,
    /// Past partitions not dropped because the outbox stayed locked by others.
    pub busy: Vec<String>,
    /// Past partitions of a log-tailing outbox kept until the slot has
    /// confirmed past their mark (their rows may not be delivered yet).
    pub awaiting_slot: Vec<String>,
    /// Rows in the default partition: a day that had no partition yet when
    /// they were written. They are delivered as usual; the partition for
    /// their day cannot be created while they are there.
    pub in_default: i64,
}

/// Creates the partitions of today and the next `premake` days (UTC, by the
/// server's clock), and with `keep` drops days that ended more than `keep`
/// ago and hold no unpublished row. Run outside a transaction.
pub async fn maintain(
    client: &mut Client,
    config: &Config,
    keep: Option<Duration>,
    premake: u32,
) -> Result<Maintenance, Error> {
    let mut done = Maintenance::default();
    let table = config.qualified();
    let today = catalog::utc_date(client, 0.0)
        .await
        .map_err(Error::pg("reading the server's date"))?;
    for offset in 0..=u64::from(premake) {
        let day = today + Days::new(offset);
        let name = partition_name(config, day)?;
        let exists = catalog::exists(client, &qualified(config, &name))
            .await
            .map_err(Error::pg("looking up a partition"))?;
        if exists {
            continue;
        }
        let next = day + Days::new(1);
        catalog::create_daily_partition(client, &table, &qualified(config, &name), day, next)
            .await
            .map_err(Error::pg("creating a daily partition"))?;
        done.created.push(name.to_string());
    }
    if let Some(keep) = keep {
        let cutoff = catalog::utc_date(client, keep.as_secs_f64())
            .await
            .map_err(Error::pg("computing the retention cutoff"))?;
        for (name, day) in daily_partitions(client, config).await? {
            // The day ends at the next midnight; it goes once that is
            // `keep` in the past.
            if day + Days::new(1) > cutoff {
                continue;
            }
            drop_if_published(client, config, &name, &mut done).await?;
        }
    }
    let default = qualified(config, &config.table.suffixed("--table", "_default")?);
    done.in_default = catalog::counts(client, &default)
        .await
        .map_err(Error::pg("counting rows in the default partition"))?
        .1;
    Ok(done)
}

/// The daily partitions of the outbox, oldest first, by their names.
async fn daily_partitions(client: &Client, config: &Config) -> Result<Vec<(Ident, NaiveDate)>, Error> {
    let prefix = format!("{}_p", config.table);
    let names = catalog::partitions_of(client, &config.qualified())
        .await
        .map_err(Error::pg("listing partitions"))?;
    let mut out = Vec::new();
    for name in names {
        let Some(day) = name
            .strip_prefix(&prefix)
            .and_then(|d| NaiveDate::parse_from_str(d, "%Y%m%d").ok())
        else {
            continue;
        };
        out.push((Ident::new("--table", &name)?, day));
    }
    Ok(out)
}

/// Checks and drops one past day under the outbox lock, or records why not.
async fn drop_if_published(
    client: &mut Client,
    config: &Config,
    name: &Ident,
    done: &mut Maintenance,
) -> Result<(), Error> {
    let table = config.qualified();
    let partition = qualified(config, name);
    for attempt in 1..=LOCK_ATTEMPTS {
        let tx = client
            .transaction()
            .await
            .map_err(Error::pg("starting a partition drop"))?;
        match catalog::lock_for_drop(&tx, &table, LOCK_TIMEOUT).await {
            Ok(()) => {}
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                drop(tx);
                tokio::time::sleep(Duration::from_millis(100) * attempt).await;
                continue;
            }
            Err(e) => return Err(Error::pg("locking the outbox")(e)),
        }
        let (unpublished, rows) = catalog::counts(&tx, &partition)
            .await
            .map_err(Error::pg("counting a partition's unpublished rows"))?;
        if unpublished > 0 {
            match delivered_from_wal(&tx, config, &partition).await? {
                Wal::Delivered => {}
                Wal::Awaiting => {
                    tx.commit()
                        .await
                        .map_err(Error::pg("committing a partition's mark"))?;
                    done.awaiting_slot.push(name.to_string());
                    return Ok(());
                }
                Wal::NoSlot | Wal::Dead => {
                    done.kept.push((name.to_string(), unpublished));
                    return Ok(());
                }
            }
        }
        // Replay says how many matching events a drop took (see
        // `sql::ReplaySql`): recorded in the drop's transaction.
        crate::sql::ReplaySql::new(config)?
            .trace_dropped(&tx, &partition)
            .await
            .map_err(Error::pg("recording what a partition drop removes"))?;
        catalog::drop_partition(&tx, &table, &partition)
            .await
            .map_err(Error::pg("dropping a partition"))?;
        tx.commit()
            .await
            .map_err(Error::pg("committing a partition drop"))?;
        done.dropped.push((name.to_string(), rows));
        return Ok(());
    }
    done.busy.push(name.to_string());
    Ok(())
}

/// What log tailing says of a past day with unpublished rows.
enum Wal {
    /// No usable slot: unpublished means undelivered.
    NoSlot,
    /// It holds dead letters: kept for `outbox dlq`.
    Dead,
    /// Not yet confirmed past its mark (which may have just been taken).
    Awaiting,
    /// The slot confirmed past its mark: every row was delivered.
    Delivered,
}

/// Under the drop's lock: whether the slot delivered every row of
/// `partition` (see the module docs).
async fn delivered_from_wal(
    tx: &impl tokio_postgres::GenericClient,
    config: &Config,
    partition: &str,
) -> Result<Wal, Error> {
    let sql = crate::sql::WalSql::new(config)?;
    let slot = sql
        .slot_state(tx)
        .await
        .map_err(Error::pg("reading the replication slot"))?;
    if slot.is_none_or(|s| s.is_lost() || s.database != s.current_database) {
        return Ok(Wal::NoSlot);
    }
    if catalog::dead_count(tx, partition)
        .await
        .map_err(Error::pg("counting a partition's dead letters"))?
        > 0
    {
        return Ok(Wal::Dead);
    }
    let now = sql
        .mark_now(tx, partition)
        .await
        .map_err(Error::pg("reading a partition's mark"))?;
    let mark = sql
        .partition_mark(tx, partition)
        .await
        .map_err(Error::pg("reading a partition's mark"))?;
    match mark {
        Some(mark) if mark.max_id == now.max_id => {
            let confirmed = sql
                .confirmed_past(tx, &mark.lsn)
                .await
                .map_err(Error::pg("comparing the slot's position with a partition's mark"))?;
            Ok(if confirmed { Wal::Delivered } else { Wal::Awaiting })
        }
        // No mark yet, or rows came in after it: mark it now.
        _ => {
            sql.set_partition_mark(tx, partition, &now)
                .await
                .map_err(Error::pg("marking a partition"))?;
            Ok(Wal::Awaiting)
        }
    }
}

fn partition_name(config: &Config, day: NaiveDate) -> Result<Ident, Error> {
    config
        .table
        .suffixed("--table", &format!("_p{}", day.format("%Y%m%d")))
}

fn qualified(config: &Config, name: &Ident) -> String {
    format!("{}.{}", config.schema.quoted(), name.quoted())
}
