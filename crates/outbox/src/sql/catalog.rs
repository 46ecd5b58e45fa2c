//! Statements about the schema itself: the migration ledger, catalog
//! lookups, and the DDL of daily partitions. Names come in already
//! validated and quoted (`Ident`, `Config::qualified`); values are bind
//! parameters, except the partition bounds, which DDL cannot bind and which
//! are dates this crate formats.
//!
//! Each runs unnamed with its parameters' types (`query_typed`): one round
//! trip, where an untyped query is prepared first in one of its own, and
//! through a transaction-mode pooler those two may run on different server
//! connections (the second finds no statement, or another client's of the
//! same name).

use chrono::NaiveDate;
use tokio_postgres::{Error, GenericClient};

use super::typed::typed;

/// `pg_class.relkind` of `qualified`, if it exists (`p`: partitioned).
pub(crate) async fn relkind(client: &impl GenericClient, qualified: &str) -> Result<Option<i8>, Error> {
    client
        .query_typed_one(
            "SELECT (SELECT relkind FROM pg_class WHERE oid = to_regclass($1))",
            &[typed(&qualified)],
        )
        .await?
        .try_get(0)
}

/// Whether the table (or other relation) `qualified` exists.
pub(crate) async fn exists(client: &impl GenericClient, qualified: &str) -> Result<bool, Error> {
    client
        .query_typed_one("SELECT to_regclass($1) IS NOT NULL", &[typed(&qualified)])
        .await?
        .try_get(0)
}

/// The highest version the ledger `ledger` records (0: none).
pub(crate) async fn ledger_version(client: &impl GenericClient, ledger: &str) -> Result<i32, Error> {
    client
        .query_typed_one(&format!("SELECT coalesce(max(version), 0) FROM {ledger}"), &[])
        .await?
        .try_get(0)
}

/// Serialises concurrent migrations of one table, until the transaction ends.
pub(crate) async fn lock_migrations(tx: &impl GenericClient, ledger: &str) -> Result<(), Error> {
    tx.execute_typed("SELECT pg_advisory_xact_lock(hashtext($1))", &[typed(&ledger)])
        .await
        .map(drop)
}

/// The schema and the ledger, if missing.
pub(crate) async fn create_ledger(tx: &impl GenericClient, schema: &str, ledger: &str) -> Result<(), Error> {
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {ledger} (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             checksum   text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );"
    ))
    .await
}

/// Applied migrations as (version, checksum), oldest first.
pub(crate) async fn applied(tx: &impl GenericClient, ledger: &str) -> Result<Vec<(i32, String)>, Error> {
    tx.query_typed(
        &format!("SELECT version, checksum FROM {ledger} ORDER BY version"),
        &[],
    )
    .await?
    .iter()
    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
    .collect()
}

/// Records one applied migration.
pub(crate) async fn record(
    tx: &impl GenericClient,
    ledger: &str,
    version: i32,
    name: &str,
    checksum: &str,
) -> Result<(), Error> {
    tx.execute_typed(
        &format!("INSERT INTO {ledger} (version, name, checksum) VALUES ($1, $2, $3)"),
        &[typed(&version), typed(&name), typed(&checksum)],
    )
    .await
    .map(drop)
}

/// The server's date in UTC, `ago_secs` seconds back.
pub(crate) async fn utc_date(client: &impl GenericClient, ago_secs: f64) -> Result<NaiveDate, Error> {
    client
        .query_typed_one(
            "SELECT ((now() - make_interval(secs => $1)) AT TIME ZONE 'UTC')::date",
            &[typed(&ago_secs)],
        )
        .await?
        .try_get(0)
}

/// Creates `partition` of `table` for the UTC day `day`.
pub(crate) async fn create_daily_partition(
    client: &impl GenericClient,
    table: &str,
    partition: &str,
    day: NaiveDate,
    next: NaiveDate,
) -> Result<(), Error> {
    client
        .batch_execute(&format!(
            "CREATE TABLE {partition} PARTITION OF {table} \
             FOR VALUES FROM ('{day} 00:00:00+00') TO ('{next} 00:00:00+00')"
        ))
        .await
}

/// Rows in `table`, and how many of them are unpublished.
pub(crate) async fn counts(client: &impl GenericClient, table: &str) -> Result<(i64, i64), Error> {
    let row = client
        .query_typed_one(
            &format!("SELECT count(*) FILTER (WHERE published_at IS NULL), count(*) FROM {table}"),
            &[],
        )
        .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

/// Dead letters in `table` (given up on or not).
pub(crate) async fn dead_count(client: &impl GenericClient, table: &str) -> Result<i64, Error> {
    client
        .query_typed_one(
            &format!("SELECT count(*) FROM {table} WHERE dead_at IS NOT NULL"),
            &[],
        )
        .await?
        .try_get(0)
}

/// The names of `qualified`'s partitions, in name order.
pub(crate) async fn partitions_of(
    client: &impl GenericClient,
    qualified: &str,
) -> Result<Vec<String>, Error> {
    client
        .query_typed(
            "SELECT c.relname::text FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid \
              WHERE i.inhparent = to_regclass($1) ORDER BY 1",
            &[typed(&qualified)],
        )
        .await?
        .iter()
        .map(|r| r.try_get(0))
        .collect()
}

/// In a transaction: `table` locked for a partition drop, giving up after
/// `lock_timeout` (a PostgreSQL interval, e.g. `300ms`).
pub(crate) async fn lock_for_drop(
    tx: &impl GenericClient,
    table: &str,
    lock_timeout: &str,
) -> Result<(), Error> {
    tx.batch_execute(&format!("SET LOCAL lock_timeout = '{lock_timeout}'"))
        .await?;
    tx.batch_execute(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        .await
}

/// Detaches and drops `partition` of `table`.
pub(crate) async fn drop_partition(
    tx: &impl GenericClient,
    table: &str,
    partition: &str,
) -> Result<(), Error> {
    tx.batch_execute(&format!(
        "ALTER TABLE {table} DETACH PARTITION {partition}; DROP TABLE {partition};"
    ))
    .await
}
