//! The bench's replication slot and publication (`outbox migrate --wal` for
//! the scratch outbox), for the runs of `--source wal`.
//!
//! A slot decodes everything committed after its position, so each run of
//! the WAL source gets a fresh slot, made after the table was emptied: it
//! reads that run's events and nothing of an earlier one. Polling runs have
//! no slot, so no earlier run's rows come back later and no WAL is held
//! for them. The slot is dropped at the end, also when a phase failed: a
//! forgotten slot keeps WAL on the server forever.
//!
//! The publication is named like the slot (`<schema>_<table>`): should the
//! database already have one of that name, the bench refuses to run rather
//! than read the wrong table, and it never drops a publication it did not
//! create.

use anyhow::{Context, bail};
use outbox::sql::WalSql;

use crate::ConfigError;
use crate::scratch::{Scratch, wait_until};

impl Scratch {
    /// Drops the bench's slot (once no relay streams it) and creates it
    /// again at the current position, with the publication if missing.
    pub(crate) async fn fresh_slot(&mut self) -> anyhow::Result<()> {
        self.drop_slot().await?;
        let setup = outbox::wal::migrate_wal(&self.db, &self.config).await?;
        if setup.created_publication {
            self.created_publication = true;
        } else if !self.created_publication {
            self.check_publication(&setup.publication).await?;
        }
        Ok(())
    }

    /// Drops the bench's slot, if there is one, once no relay streams it.
    pub(crate) async fn drop_slot(&self) -> anyhow::Result<()> {
        let sql = WalSql::new(&self.config)?;
        wait_until("the relay to let go of the replication slot", async || {
            Ok(sql
                .slot_state(&self.db)
                .await?
                .is_none_or(|s| s.active_pid.is_none()))
        })
        .await?;
        if sql.slot_state(&self.db).await?.is_some() {
            sql.drop_slot(&self.db)
                .await
                .with_context(|| format!("dropping the replication slot {}", sql.slot()))?;
        }
        Ok(())
    }

    /// Drops the slot, and the publication if this run created it.
    pub(crate) async fn drop_wal(&mut self) -> anyhow::Result<()> {
        self.drop_slot().await?;
        if self.created_publication {
            let publication = self.config.wal_publication()?;
            self.db
                .batch_execute(&format!("DROP PUBLICATION IF EXISTS {}", publication.quoted()))
                .await
                .context("dropping the bench's publication")?;
            self.created_publication = false;
        }
        Ok(())
    }

    /// WAL bytes the slot holds back, if there is a slot.
    pub(crate) async fn retained_wal(&self) -> anyhow::Result<Option<i64>> {
        let sql = WalSql::new(&self.config)?;
        Ok(sql.slot_state(&self.db).await?.map(|s| s.retained_bytes))
    }

    /// Refuses a publication of that name that does not publish the
    /// scratch outbox (another outbox's, in another schema).
    async fn check_publication(&self, publication: &str) -> anyhow::Result<()> {
        let ours = self
            .db
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_publication_tables \
                  WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
                &[
                    &publication,
                    &self.config.schema.as_str(),
                    &self.config.table.as_str(),
                ],
            )
            .await
            .context("looking up the publication's tables")?
            .get::<_, bool>(0);
        if !ours {
            bail!(ConfigError(format!(
                "the publication {publication} exists in this database for another table (publication \
                 names are per database, not per schema): the bench needs that name for {}; run it on \
                 another database or without DATABASE_URL",
                self.config.display_name()
            )));
        }
        Ok(())
    }
}
