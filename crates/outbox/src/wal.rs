//! Setting up log tailing, checking it, and recovering from a lost slot.
//!
//! `outbox migrate --wal` ([`migrate_wal`]) creates what the WAL source
//! reads: a publication of the outbox's inserts and a logical replication
//! slot with the pgoutput plugin. The relay runs [`check_wal_setup`] at
//! startup so a server without `wal_level = logical`, a role without
//! REPLICATION or a missing publication is refused with the fix in the
//! message.
//!
//! A slot can go while the table stays: PostgreSQL invalidates a slot that
//! falls more than `max_slot_wal_keep_size` behind (the WAL it needed is
//! gone), and a failover to a standby finds the table (replicated) without
//! the slot (PostgreSQL 15 does not replicate slots). The relay handles
//! both itself (`outbox-relay`'s `source/wal/backfill.rs`): it creates the
//! slot again and delivers the rows the table still holds, in id order,
//! before streaming. The publication carries a mark while that is owed, so
//! a relay that dies halfway finishes it at its next start; when
//! [`migrate_wal`] creates a slot for a publication that already existed,
//! it leaves the mark too. [`recover_wal`] is the manual way, for
//! `--wal-cleanup none` (whose table keeps delivered rows): it recreates
//! the slot and re-inserts the undelivered rows (created since a time) so
//! the new slot decodes them. Emitted events (no row) in the lost WAL
//! cannot be recovered by either; that is why `max_slot_wal_keep_size`
//! defaults to unlimited.

use chrono::{DateTime, Utc};
use tokio_postgres::{Client, GenericClient};

use crate::sql::{SlotState, WalSql};
use crate::{Config, Error};

/// What [`migrate_wal`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalSetup {
    /// The slot's name.
    pub slot: String,
    /// The publication's name.
    pub publication: String,
    /// Whether this call created the publication.
    pub created_publication: bool,
    /// Whether this call created the slot.
    pub created_slot: bool,
}

/// What [`recover_wal`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalRecovery {
    /// The slot's name.
    pub slot: String,
    /// Whether a lost slot was dropped first.
    pub dropped: bool,
    /// Whether the slot was created (not when one made late was there).
    pub created: bool,
    /// Undelivered rows re-inserted for the new slot.
    pub reinserted: i64,
}

/// The slot and publication a fleet (`outbox relay --source wal --schemas
/// PATTERN`) reads the outboxes named `table` of the schemas `schemas`
/// matches in `database` through: `fleet_<pattern>_<table>` for the
/// publication (publications are per database) and
/// `<database>_fleet_<pattern>_<table>` for the slot (slots are per
/// cluster), each character of the pattern that cannot be in a name
/// (`%`) an `_`. A name longer than PostgreSQL's 63 bytes is cut and ends
/// with a hash of the whole, so it stays one per pattern and database.
///
/// ```
/// let (slot, publication) = outbox::wal::fleet_names("app", "tenant_%", "outbox").unwrap();
/// assert_eq!(publication.as_str(), "fleet_tenant___outbox");
/// assert_eq!(slot, "app_fleet_tenant___outbox");
/// ```
pub fn fleet_names(database: &str, schemas: &str, table: &str) -> Result<(String, crate::Ident), Error> {
    fn name(raw: &str) -> String {
        let clean: String = raw
            .chars()
            .map(|c| match c {
                'a'..='z' | '0'..='9' | '_' => c,
                'A'..='Z' => c.to_ascii_lowercase(),
                _ => '_',
            })
            .collect();
        if clean.len() <= 63 && !clean.starts_with(|c: char| c.is_ascii_digit()) {
            return clean;
        }
        // FNV-1a: stable across builds, unlike the std hasher.
        let hash = raw.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let head: String = clean.chars().take(46).collect();
        format!("f_{head}_{hash:016x}")
    }
    let publication = name(&format!("fleet_{schemas}_{table}"));
    let slot = name(&format!("{database}_fleet_{schemas}_{table}"));
    let slot_ident = crate::Ident::new("--schemas", &slot)?;
    Ok((
        slot_ident.as_str().to_owned(),
        crate::Ident::new("--schemas", &publication)?,
    ))
}

/// Adds `sql`'s table to its fleet's publication, in one transaction that
/// first holds the table's writers off (`LOCK TABLE … IN SHARE ROW
/// EXCLUSIVE MODE`, which waits for the inserts under way): every row then
/// either committed before the table was published, so a backfill of the
/// table finds it, or is decoded from the stream. A failure rolls back.
pub async fn publish_tenant(client: &Client, sql: &WalSql) -> Result<(), tokio_postgres::Error> {
    client.batch_execute("BEGIN").await?;
    let added = async {
        sql.lock_writers(client).await?;
        sql.add_to_publication(client).await?;
        client.batch_execute("COMMIT").await
    }
    .await;
    if added.is_err() {
        // A session that cannot roll back is broken: the caller's next
        // statement finds out.
        let _ = client.batch_execute("ROLLBACK").await;
    }
    added
}

/// `outbox migrate --wal --schemas`: a fleet's publication (made if
/// missing) with every table of `tenants` in it, and its slot (made if
/// missing), in the database `client` is connected to, named by
/// [`fleet_names`]. Idempotent. Rows written before are not decoded: the
/// fleet reads every tenant's table when it starts reading.
pub async fn migrate_fleet_wal(
    client: &Client,
    database: &str,
    schemas: &str,
    tenants: &[Config],
) -> Result<WalSetup, Error> {
    let Some(first) = tenants.first() else {
        return Err(Error::WalNotSetUp {
            what: format!("no outbox in a schema matching {schemas:?} to publish"),
        });
    };
    let (slot_name, publication) = fleet_names(database, schemas, first.table.as_str())?;
    let sql = WalSql::named(first, slot_name.clone(), publication.clone())?;
    prerequisites(client, &sql).await?;
    let created_publication = !sql
        .publication_exists(client)
        .await
        .map_err(Error::pg("looking for the publication"))?;
    if created_publication {
        sql.create_fleet_publication(client)
            .await
            .map_err(Error::pg("creating the fleet's publication"))?;
    }
    let published = sql
        .published_tables(client)
        .await
        .map_err(Error::pg("listing the publication's tables"))?;
    for config in tenants {
        if published.contains(&config.display_name()) {
            continue;
        }
        let tenant = WalSql::named(config, slot_name.clone(), publication.clone())?;
        publish_tenant(client, &tenant)
            .await
            .map_err(Error::pg("adding a tenant's outbox to the fleet's publication"))?;
    }
    let created_slot = match slot(client, &sql).await? {
        Some(s) if s.is_lost() => return Err(Error::SlotInvalidated { slot: s.slot }),
        Some(_) => false,
        None => {
            sql.create_slot(client)
                .await
                .map_err(Error::pg("creating the logical replication slot"))?;
            true
        }
    };
    Ok(WalSetup {
        slot: slot_name,
        publication: publication.as_str().to_owned(),
        created_publication,
        created_slot,
    })
}

/// The slot a fleet with `--source wal` reads the outboxes named like
/// `template`'s table in the schemas `schemas` matches in `database`
/// through (see [`fleet_names`]), as `outbox relays --schemas` reports it;
/// `None` when there is none in this database.
pub async fn fleet_slot_state(
    client: &impl GenericClient,
    database: &str,
    schemas: &str,
    template: &Config,
) -> Result<Option<SlotState>, tokio_postgres::Error> {
    let Ok((slot, publication)) = fleet_names(database, schemas, template.table.as_str()) else {
        return Ok(None);
    };
    let Ok(sql) = WalSql::named(template, slot, publication) else {
        return Ok(None);
    };
    let state = sql.slot_state(client).await?;
    Ok(state.filter(|s| s.database == s.current_database))
}

/// What log tailing needs of the server and the role: `wal_level =
/// logical`, and REPLICATION (or a superuser). Refused with the fix.
pub async fn check_prerequisites(client: &Client, sql: &WalSql) -> Result<(), Error> {
    prerequisites(client, sql).await
}

async fn prerequisites(client: &Client, sql: &WalSql) -> Result<(), Error> {
    sql.prerequisites(client)
        .await
        .map_err(Error::pg(
            "checking wal_level and the role's REPLICATION attribute",
        ))?
        .check()
}

/// The slot, refusing one of another database or plugin.
async fn slot(client: &Client, sql: &WalSql) -> Result<Option<SlotState>, Error> {
    let state = sql
        .slot_state(client)
        .await
        .map_err(Error::pg("reading the replication slot"))?;
    if let Some(s) = &state {
        if s.database != s.current_database {
            return Err(Error::WalNotSetUp {
                what: format!(
                    "the replication slot {} decodes database {}, not {} (slot names are per cluster; use another --schema or --table)",
                    s.slot, s.database, s.current_database
                ),
            });
        }
        if s.plugin != "pgoutput" {
            return Err(Error::WalNotSetUp {
                what: format!(
                    "the replication slot {} uses the {} plugin, not pgoutput: drop it",
                    s.slot, s.plugin
                ),
            });
        }
    }
    Ok(state)
}

/// The slot of `config`'s outbox as `outbox stats`, `outbox relays` and the
/// console report it: `None` when log tailing is not set up (no slot of
/// that name in this database, or a table whose name cannot be a slot's).
pub async fn slot_state(
    client: &impl GenericClient,
    config: &Config,
) -> Result<Option<SlotState>, tokio_postgres::Error> {
    let Ok(sql) = WalSql::new(config) else {
        return Ok(None);
    };
    let state = sql.slot_state(client).await?;
    // Slot names are per cluster: one of another database is not ours.
    Ok(state.filter(|s| s.database == s.current_database))
}

/// Creates the publication and the slot for `config`'s outbox, if missing.
/// Idempotent. The slot starts at the current position: rows committed
/// before it are not decoded. A new setup has none; a slot made for a
/// publication that existed (after a failover, or a drop) leaves the
/// publication marked, and the relay delivers the table's rows first.
pub async fn migrate_wal(client: &Client, config: &Config) -> Result<WalSetup, Error> {
    let sql = WalSql::new(config)?;
    prerequisites(client, &sql).await?;
    let created_publication = !sql
        .publication_exists(client)
        .await
        .map_err(Error::pg("looking for the publication"))?;
    if created_publication {
        sql.create_publication(client)
            .await
            .map_err(Error::pg("creating the publication of the outbox's inserts"))?;
    }
    let created_slot = match slot(client, &sql).await? {
        Some(s) if s.is_lost() => return Err(Error::SlotInvalidated { slot: s.slot }),
        Some(_) => false,
        None => {
            if !created_publication {
                // The slot went and the table stayed (a failover, a lost
                // slot dropped by hand): rows committed before the new slot
                // would never be decoded. The relay delivers them first.
                sql.mark_backfill(client).await.map_err(Error::pg(
                    "marking the publication: the relay owes a backfill of the table's rows",
                ))?;
            }
            sql.create_slot(client)
                .await
                .map_err(Error::pg("creating the logical replication slot"))?;
            true
        }
    };
    Ok(WalSetup {
        slot: sql.slot().to_owned(),
        publication: sql.publication().to_owned(),
        created_publication,
        created_slot,
    })
}

/// What the relay checks before reading: the server, the role and the
/// publication. Returns the slot as it is: missing or invalidated is for
/// the relay to handle (see the [module docs](self)); one of another
/// database or plugin is refused.
pub async fn check_wal_setup(client: &Client, config: &Config) -> Result<Option<SlotState>, Error> {
    let sql = WalSql::new(config)?;
    prerequisites(client, &sql).await?;
    if !sql
        .publication_exists(client)
        .await
        .map_err(Error::pg("looking for the publication"))?
    {
        return Err(Error::WalNotSetUp {
            what: format!("the publication {} does not exist", sql.publication()),
        });
    }
    slot(client, &sql).await
}

/// Like [`check_wal_setup`], and a usable slot too. Returns its state.
pub async fn check_wal(client: &Client, config: &Config) -> Result<SlotState, Error> {
    let sql = WalSql::new(config)?;
    match check_wal_setup(client, config).await? {
        None => Err(Error::WalNotSetUp {
            what: format!("the replication slot {} does not exist", sql.slot()),
        }),
        Some(s) if s.is_lost() => Err(Error::SlotInvalidated { slot: s.slot }),
        Some(s) => Ok(s),
    }
}

/// After PostgreSQL invalidated the slot, by hand (`outbox migrate --wal
/// --recover`; the relay does better on its own unless `--wal-cleanup
/// none`, see the [module docs](self)): drops it, creates it again, and
/// in one transaction that holds writers off re-inserts every undelivered
/// row (created at or after `since`, if given) so the new slot decodes
/// them. Rows committed between the new slot and that transaction are
/// decoded twice (a duplicate, never a loss), the first time ahead of
/// their aggregate's older undelivered rows, which the transaction
/// re-inserts after them: where order matters, keep writers off the
/// outbox while this runs. (Holding them off from here would deadlock:
/// creating the slot waits for every transaction under way, and a writer's
/// would be waiting for the lock.) Refuses a healthy slot, unless the
/// publication's mark says it was made late (then it is kept, and the
/// mark cleared), and one a relay is still streaming.
pub async fn recover_wal(
    client: &mut Client,
    config: &Config,
    since: Option<DateTime<Utc>>,
) -> Result<WalRecovery, Error> {
    let sql = WalSql::new(config)?;
    prerequisites(client, &sql).await?;
    let owed = sql
        .backfill_owed(&*client)
        .await
        .map_err(Error::pg("reading the publication's mark"))?;
    let mut create = true;
    let dropped = match slot(client, &sql).await? {
        Some(s) if s.is_lost() => {
            if let Some(pid) = s.active_pid {
                return Err(Error::WalNotSetUp {
                    what: format!(
                        "the replication slot {} is still streamed by pid {pid}: stop the relay first",
                        s.slot
                    ),
                });
            }
            sql.drop_slot(&*client)
                .await
                .map_err(Error::pg("dropping the invalidated slot"))?;
            true
        }
        // Made late (the publication's mark): the rows before it are owed.
        Some(_) if owed => {
            create = false;
            false
        }
        Some(s) => {
            return Err(Error::WalNotSetUp {
                what: format!(
                    "the replication slot {} is healthy (wal_status {}), there is nothing to recover",
                    s.slot, s.wal_status
                ),
            });
        }
        None => false,
    };
    if !sql
        .publication_exists(&*client)
        .await
        .map_err(Error::pg("looking for the publication"))?
    {
        sql.create_publication(&*client)
            .await
            .map_err(Error::pg("creating the publication of the outbox's inserts"))?;
    }
    if create {
        sql.create_slot(&*client)
            .await
            .map_err(Error::pg("creating the logical replication slot"))?;
    }
    let tx = client
        .transaction()
        .await
        .map_err(Error::pg("starting the recovery transaction"))?;
    sql.lock_writers(&tx)
        .await
        .map_err(Error::pg("locking writers out of the outbox"))?;
    let reinserted = sql
        .reinsert_pending(&tx, since)
        .await
        .map_err(Error::pg("re-inserting the undelivered rows"))?;
    tx.commit().await.map_err(Error::pg("committing the recovery"))?;
    // The slot decodes the re-inserted rows: no backfill is owed.
    if owed {
        sql.clear_backfill(&*client)
            .await
            .map_err(Error::pg("clearing the publication's backfill mark"))?;
    }
    Ok(WalRecovery {
        slot: sql.slot().to_owned(),
        dropped,
        created: create,
        reinserted,
    })
}
