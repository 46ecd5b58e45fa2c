//! A fleet's log tailing (`outbox relay --source wal --schemas PATTERN`):
//! every tenant outbox of one database read through one publication and
//! one slot, so the WAL is decoded once for all of them, not once per
//! tenant. Owns finding the tenants, adding their tables to the
//! publication, and starting the backfills that keeps that from losing a
//! row. The stream, the window, the batches and the writes are the single
//! source's (see the [parent module](super)); each event keeps its
//! outbox's number, and each batch is one outbox's.
//!
//! # Why a tenant joining loses nothing
//!
//! A table's inserts are decoded only once it is in the publication
//! (pgoutput reads the publication as of each change). So when a tenant's
//! table is found, in one transaction its writers are held off (`LOCK
//! TABLE … IN SHARE ROW EXCLUSIVE MODE`, which waits for the inserts under
//! way) and the table is added to the publication: every row either
//! committed before that transaction, and is in the table, or is inserted
//! after it, and is in the stream. A backfill then reads the table up to
//! its highest id, before the stream is read any further (the single
//! source's backfill, whose stream copies of rows it read are dropped).
//!
//! Each time a reader starts (a process starting, taking over from one that
//! died, a reconnect), it backfills every tenant's table the same way: a
//! reader that died halfway through a tenant's backfill leaves no mark
//! saying so, and with `--wal-cleanup delete` a table holds exactly what
//! was not known delivered. Which is why a fleet refuses `--wal-cleanup
//! none`.
//!
//! A tenant whose schema is dropped is let go of: `DROP SCHEMA … CASCADE`
//! took its table out of the publication, its events already read are
//! delivered, and the writes they imply are dropped with the table.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox::sql::WalSql;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::backfill::{Backfill, Server, Why};
use super::{Table, WalSource, fatal};
use crate::config::RelayConfig;
use crate::context::RelayContext;
use crate::error::RelayError;
use crate::metric;
use crate::pg::PgConfig;
use crate::source::{Receipts, SourceError};

/// How a fleet's tenants are found, and when next.
pub(crate) struct Tenants {
    /// The `LIKE` pattern over schema names.
    schemas: String,
    database: String,
    /// Labels name the database too (`database/schema.table`).
    prefixed: bool,
    every: Duration,
    next: Instant,
    /// Tenants not served for their privileges or version: said once.
    refused: BTreeSet<String>,
}

impl Tenants {
    /// The outboxes of the schemas `schemas` matches in `database`, looked
    /// for every `every`.
    pub(crate) fn new(schemas: String, database: String, prefixed: bool, every: Duration) -> Self {
        Self {
            schemas,
            database,
            prefixed,
            every,
            next: Instant::now(),
            refused: BTreeSet::new(),
        }
    }

    /// The database's name: the `database` label of the slot's gauges.
    pub(crate) fn database(&self) -> String {
        self.database.clone()
    }
}

/// Whether a statement failed because its table (or schema) is gone.
pub(super) fn is_gone(error: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    matches!(
        error.code(),
        Some(c) if *c == SqlState::UNDEFINED_TABLE || *c == SqlState::INVALID_SCHEMA_NAME
    )
}

impl WalSource {
    /// A fleet's source for the database of `pg`: checks the server and
    /// the role; the publication and the slot are made, if missing, once
    /// this process reads. `None` if `cancel` fired meanwhile.
    pub(crate) async fn open_fleet(
        config: RelayConfig,
        pg: PgConfig,
        tenants: Tenants,
        ctx: RelayContext,
        receipts: Receipts,
        cancel: &CancellationToken,
    ) -> Result<Option<WalSource>, RelayError> {
        let (slot, publication) =
            outbox::wal::fleet_names(&tenants.database, &tenants.schemas, config.outbox.table.as_str())
                .map_err(RelayError::Schema)?;
        // The slot's and publication's statements; its table's (the fleet's
        // settings name no schema) are never run: each tenant has its own.
        let sql = Arc::new(WalSql::named(&config.outbox, slot, publication).map_err(RelayError::Schema)?);
        let Some(client) = super::connect(&pg, &config, cancel).await? else {
            return Ok(None);
        };
        outbox::wal::check_prerequisites(&client, &sql)
            .await
            .map_err(RelayError::Schema)?;
        info!(
            slot = sql.slot(),
            publication = sql.publication(),
            schemas = %tenants.schemas,
            "log tailing for the fleet: one slot for every tenant outbox of the database"
        );
        ctx.health().postgres("", None);
        Ok(Some(Self::assemble(
            config,
            pg,
            sql,
            Vec::new(),
            Some(tenants),
            client,
            ctx,
            receipts,
        )))
    }

    /// Before a fleet's stream starts: the publication (made if missing),
    /// every tenant found and in it, the slot (made if missing, made again
    /// if invalidated), and a backfill of every tenant's table begun.
    pub(super) async fn prepare_fleet(&mut self, server: Server) -> Result<(), SourceError> {
        let sql = Arc::clone(&self.sql);
        let client = self.client().await?;
        if !sql.publication_exists(client).await? {
            sql.create_fleet_publication(client).await?;
            info!(
                publication = sql.publication(),
                "log tailing for the fleet: publication created"
            );
        }
        self.find_tenants().await?;
        let live: Vec<u32> = self.live().map(|(n, _)| n).collect();
        self.publish(&live).await?;
        let client = self.client().await?;
        match sql.slot_state(client).await? {
            Some(s) if s.database != s.current_database => {
                return Err(fatal(outbox::Error::WalNotSetUp {
                    what: format!(
                        "the replication slot {} decodes database {}, not {}",
                        s.slot, s.database, s.current_database
                    ),
                }));
            }
            Some(s) if s.is_lost() => {
                error!(
                    slot = sql.slot(),
                    "PostgreSQL invalidated the replication slot (it fell more than max_slot_wal_keep_size behind): \
                     creating it again; every tenant's table is read before the stream"
                );
                sql.drop_slot(client).await?;
                sql.create_slot(client).await?;
                metrics::counter!(
                    metric::WAL_SLOT_RECREATED,
                    &[self.ctx.label(), ("reason", Why::Lost.label().to_owned())]
                )
                .increment(1);
            }
            Some(_) => {}
            None => {
                sql.create_slot(client).await?;
                info!(slot = sql.slot(), "log tailing for the fleet: slot created");
            }
        }
        let tables: Vec<(u32, Arc<WalSql>)> = self.live().map(|(n, t)| (n, Arc::clone(&t.sql))).collect();
        let client = self.client().await?;
        let backfill = Backfill::of_tables(Why::Tenants, tables, client).await;
        self.backfill = Some(backfill.map_err(|e| self.gone_or(e))?);
        self.server = Some(server);
        if let Some(t) = &mut self.tenants {
            t.next = Instant::now() + t.every;
        }
        Ok(())
    }

    /// While streaming, every discover interval: tenants found since are
    /// added to the publication, their tables backfilled before the stream
    /// is read further; dropped ones are let go of.
    pub(super) async fn join_tenants(&mut self) -> Result<(), SourceError> {
        let Some(t) = &mut self.tenants else {
            return Ok(());
        };
        if self.stream.is_none() || Instant::now() < t.next {
            return Ok(());
        }
        t.next = Instant::now() + t.every;
        let new = self.find_tenants().await?;
        if new.is_empty() {
            return Ok(());
        }
        self.publish(&new).await?;
        // Before the stream is read again: their relations are this
        // source's from the first message naming them.
        for &n in &new {
            let table = &self.tables[n as usize];
            if let (true, Some(stream)) = (table.live, &mut self.stream) {
                let c = &table.config;
                stream
                    .decoder
                    .add(n, c.schema.as_str(), c.table.as_str(), table.sql.prefix());
            }
        }
        let joined: Vec<(u32, Arc<WalSql>)> = new
            .iter()
            .filter_map(|&n| {
                let t = &self.tables[n as usize];
                t.live.then(|| (n, Arc::clone(&t.sql)))
            })
            .collect();
        info!(
            outboxes = joined.len(),
            "tenants joined the publication: their rows committed before are read from their tables first"
        );
        self.client().await?;
        let client = self.client.as_ref().expect("connected");
        let started = match &mut self.backfill {
            Some(b) => {
                let mut result = Ok(());
                for (n, sql) in joined {
                    result = result.and(b.add(n, sql, client).await);
                }
                result
            }
            None => Backfill::of_tables(Why::Tenants, joined, client)
                .await
                .map(|b| self.backfill = Some(b)),
        };
        started.map_err(|e| self.gone_or(e))
    }

    /// The live outboxes, by number.
    fn live(&self) -> impl Iterator<Item = (u32, &Table)> {
        self.tables
            .iter()
            .enumerate()
            .filter(|(_, t)| t.live)
            .map(|(n, t)| (u32::try_from(n).expect("fewer than 2^32 outboxes"), t))
    }

    /// Finds the tenant outboxes: those dropped are let go of, those not
    /// known yet (and servable) are added. Returns the added ones' numbers.
    async fn find_tenants(&mut self) -> Result<Vec<u32>, SourceError> {
        let Some(tenants) = &self.tenants else {
            return Ok(Vec::new());
        };
        let (pattern, database, prefixed) = (
            tenants.schemas.clone(),
            tenants.database.clone(),
            tenants.prefixed,
        );
        let table = self.config.outbox.table.clone();
        self.client().await?;
        let client = self.client.as_ref().expect("connected");
        let found = outbox::sql::fleet::tenant_outboxes(client, &pattern, &table).await?;
        let schemas: HashSet<&str> = found.iter().map(|t| t.schema.as_str()).collect();
        for t in self.tables.iter_mut().filter(|t| t.live) {
            if !schemas.contains(t.config.schema.as_str()) {
                t.live = false;
                info!(
                    outbox = t.label.as_deref().unwrap_or_default(),
                    "outbox gone; let go"
                );
            }
        }
        let publication = outbox::Ident::new("--schemas", self.sql.publication()).map_err(fatal)?;
        let mut added = Vec::new();
        for tenant in found {
            if self
                .tables
                .iter()
                .any(|t| t.live && t.config.schema == tenant.schema)
            {
                continue;
            }
            let mut config = self.config.outbox.clone();
            config.schema = tenant.schema;
            let label = crate::fleet::label(prefixed.then_some(database.as_str()), &config);
            let refused = &mut self.tenants.as_mut().expect("a fleet's").refused;
            if let Err(why) = crate::fleet::servable(client, &config, false).await {
                if refused.insert(label.clone()) {
                    warn!(outbox = %label, error = %why.error, "outbox not served: {}", why.reason);
                }
                continue;
            }
            refused.remove(&label);
            let sql =
                WalSql::named(&config, self.sql.slot().to_owned(), publication.clone()).map_err(fatal)?;
            added.push(u32::try_from(self.tables.len()).expect("fewer than 2^32 outboxes"));
            self.tables.push(Table {
                sql: Arc::new(sql),
                config,
                label: Some(label),
                live: true,
            });
        }
        Ok(added)
    }

    /// Adds the tables of `outboxes` the publication lacks, each in a
    /// transaction that holds its writers off (see the module docs). A
    /// table gone meanwhile is let go of.
    async fn publish(&mut self, outboxes: &[u32]) -> Result<(), SourceError> {
        let sql = Arc::clone(&self.sql);
        let published: HashSet<String> = sql
            .published_tables(self.client().await?)
            .await?
            .into_iter()
            .collect();
        for &n in outboxes {
            let table = &self.tables[n as usize];
            if published.contains(&table.config.display_name()) {
                continue;
            }
            let tsql = Arc::clone(&table.sql);
            match outbox::wal::publish_tenant(self.client().await?, &tsql).await {
                Ok(()) => {}
                Err(e) if is_gone(&e) => self.tables[n as usize].live = false,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// `error`, unless a tenant's table went meanwhile: then the next
    /// discovery lets it go, and the stream starts over without it.
    fn gone_or(&self, error: tokio_postgres::Error) -> SourceError {
        if is_gone(&error) {
            info!("a tenant's table went while it was being read; reading again without it");
        }
        error.into()
    }
}
