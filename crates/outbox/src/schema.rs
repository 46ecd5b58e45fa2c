//! Embedded, versioned migrations for the outbox and the inbox.
//!
//! Each table keeps its own ledger, `<table>_migrations` in the same schema,
//! with one row per applied migration and its checksum. [`migrate`] takes a
//! transaction-scoped advisory lock so concurrent runs serialise, refuses a
//! ledger that is newer than this binary or whose checksums changed, and
//! applies what is missing in one transaction: re-running is a no-op.
//! [`check`] is what the relay runs at startup to refuse an unmigrated or too
//! new database before it touches a row.
//!
//! Migrations are numbered files under `migrations/`, never edited once
//! released. Their text names tables through `{placeholders}` filled with
//! quoted [`Ident`](crate::Ident)s.

use sha2::{Digest, Sha256};

use crate::{Config, Error, Ident, InboxConfig, Layout};

/// One numbered migration.
#[derive(Debug, Clone, Copy)]
struct Migration {
    version: i32,
    name: &'static str,
    template: &'static str,
}

const OUTBOX_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "create_outbox",
        template: include_str!("../migrations/outbox/0001_create_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "strict_order",
        template: include_str!("../migrations/outbox/0002_strict_order.sql"),
    },
    Migration {
        version: 3,
        name: "relay_leases",
        template: include_str!("../migrations/outbox/0003_relay_leases.sql"),
    },
    Migration {
        version: 4,
        name: "dead_at",
        template: include_str!("../migrations/outbox/0004_dead_at.sql"),
    },
    Migration {
        version: 5,
        name: "lease_claims",
        template: include_str!("../migrations/outbox/0005_lease_claims.sql"),
    },
    Migration {
        version: 6,
        name: "replays",
        template: include_str!("../migrations/outbox/0006_replays.sql"),
    },
    Migration {
        version: 7,
        name: "attempt_history",
        template: include_str!("../migrations/outbox/0007_attempt_history.sql"),
    },
    Migration {
        version: 8,
        name: "table_contract",
        template: include_str!("../migrations/outbox/0008_table_contract.sql"),
    },
    Migration {
        version: 9,
        name: "notify_names_the_outbox",
        template: include_str!("../migrations/outbox/0009_notify_names_the_outbox.sql"),
    },
    Migration {
        version: 10,
        name: "contract_inline",
        template: include_str!("../migrations/outbox/0010_contract_inline.sql"),
    },
    Migration {
        version: 11,
        name: "operations",
        template: include_str!("../migrations/outbox/0011_operations.sql"),
    },
];

/// The daily-partitioned layout: its own first migration, then the same
/// later ones, which work on either layout.
const OUTBOX_DAILY_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "create_outbox_partitioned",
        template: include_str!("../migrations/outbox/0001_create_outbox_partitioned.sql"),
    },
    OUTBOX_MIGRATIONS[1],
    OUTBOX_MIGRATIONS[2],
    OUTBOX_MIGRATIONS[3],
    OUTBOX_MIGRATIONS[4],
    OUTBOX_MIGRATIONS[5],
    OUTBOX_MIGRATIONS[6],
    OUTBOX_MIGRATIONS[7],
    OUTBOX_MIGRATIONS[8],
    OUTBOX_MIGRATIONS[9],
    OUTBOX_MIGRATIONS[10],
];

const INBOX_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "create_processed_events",
    template: include_str!("../migrations/inbox/0001_create_processed_events.sql"),
}];

/// The outbox schema version this binary writes and expects.
pub const OUTBOX_VERSION: i32 = 11;
/// The inbox schema version this binary writes and expects.
pub const INBOX_VERSION: i32 = 1;

/// What one [`migrate`] or [`migrate_inbox`] call did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// `schema.table` that was migrated.
    pub table: String,
    /// Migrations applied by this call, as `(version, name)`; empty when the
    /// schema was already current.
    pub applied: Vec<(i32, &'static str)>,
    /// The schema version after the call.
    pub version: i32,
}

/// A table with its migrations and the values for their placeholders.
struct Target {
    schema: Ident,
    table: Ident,
    migrations: &'static [Migration],
    vars: Vec<(&'static str, String)>,
}

impl Target {
    fn outbox(config: &Config, layout: Layout) -> Result<Self, Error> {
        let t = &config.table;
        let s = config.schema.quoted();
        Ok(Self {
            schema: config.schema.clone(),
            table: t.clone(),
            migrations: match layout {
                Layout::Plain => OUTBOX_MIGRATIONS,
                Layout::Daily => OUTBOX_DAILY_MIGRATIONS,
            },
            vars: vec![
                ("{table}", config.qualified()),
                (
                    "{unpublished_idx}",
                    t.suffixed("--table", "_unpublished_idx")?.quoted(),
                ),
                // Qualifies what DROP INDEX names; CREATE INDEX puts an
                // index in its table's schema.
                ("{schema}", s.clone()),
                ("{dead_idx}", t.suffixed("--table", "_dead_idx")?.quoted()),
                ("{max_attempts}", config.dead_after_attempts.to_string()),
                (
                    "{pending_by_aggregate_idx}",
                    t.suffixed("--table", "_pending_by_aggregate_idx")?.quoted(),
                ),
                (
                    "{by_aggregate_idx}",
                    t.suffixed("--table", "_by_aggregate_idx")?.quoted(),
                ),
                (
                    "{notify_fn}",
                    format!("{s}.{}", t.suffixed("--table", "_notify")?.quoted()),
                ),
                ("{notify_trigger}", t.suffixed("--table", "_notify")?.quoted()),
                ("{relays}", config.companion("_relays")?),
                ("{default_partition}", config.companion("_default")?),
                ("{leases}", config.companion("_leases")?),
                ("{replays}", config.companion("_replays")?),
                ("{removed}", config.companion("_removed")?),
                ("{routes}", config.companion("_routes")?),
                ("{route_state}", config.companion("_route_state")?),
                ("{rollup}", config.companion("_rollup")?),
                ("{audit}", config.companion("_audit")?),
                ("{tick_fn}", config.companion("_relay_tick")?),
                ("{name_fn}", config.companion("_is_name")?),
                ("{headers_fn}", config.companion("_headers_ok")?),
                ("{partitions}", config.partitions.to_string()),
                // A string literal; identifiers cannot contain a quote.
                ("{channel}", config.channel.as_str().to_owned()),
            ],
        })
    }

    fn inbox(config: &InboxConfig) -> Result<Self, Error> {
        let t = &config.table;
        Ok(Self {
            schema: config.schema.clone(),
            table: t.clone(),
            migrations: INBOX_MIGRATIONS,
            vars: vec![
                ("{table}", config.qualified()),
                (
                    "{processed_at_idx}",
                    t.suffixed("--inbox-table", "_processed_at_idx")?.quoted(),
                ),
            ],
        })
    }

    fn display_name(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    fn ledger(&self) -> Result<String, Error> {
        Ok(format!(
            "{}.{}",
            self.schema.quoted(),
            self.table.suffixed("--table", "_migrations")?.quoted()
        ))
    }

    fn render(&self, m: &Migration) -> String {
        self.vars
            .iter()
            .fold(m.template.to_owned(), |sql, (k, v)| sql.replace(k, v))
    }

    fn latest(&self) -> i32 {
        self.migrations.last().map_or(0, |m| m.version)
    }
}

fn checksum(m: &Migration) -> String {
    Sha256::digest(m.template.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(feature = "tokio-postgres")]
mod pg {
    use tokio_postgres::{Client, GenericClient};

    use crate::sql::catalog;

    use super::*;

    /// Creates or upgrades the outbox table, its partial index and NOTIFY trigger.
    ///
    /// ```no_run
    /// # async fn run(client: &mut tokio_postgres::Client) -> Result<(), outbox::Error> {
    /// let report = outbox::migrate(client, &outbox::Config::default()).await?;
    /// println!("{} is at version {}", report.table, report.version);
    /// # Ok(()) }
    /// ```
    ///
    /// An existing table keeps its layout; asking for daily partitions of a
    /// plain table is [`Error::LayoutMismatch`].
    pub async fn migrate(client: &mut Client, config: &Config) -> Result<MigrationReport, Error> {
        let layout = match (existing_layout(client, config).await?, config.layout) {
            (Some(Layout::Plain), Layout::Daily) => {
                return Err(Error::LayoutMismatch {
                    table: config.display_name(),
                });
            }
            (Some(found), _) => found,
            (None, wanted) => wanted,
        };
        run(client, &Target::outbox(config, layout)?).await
    }

    /// The layout of the outbox table if it exists.
    pub async fn existing_layout(
        client: &impl GenericClient,
        config: &Config,
    ) -> Result<Option<Layout>, Error> {
        let kind = catalog::relkind(client, &config.qualified())
            .await
            .map_err(Error::pg("looking up the outbox table"))?;
        Ok(kind.map(|k| {
            if k as u8 == b'p' {
                Layout::Daily
            } else {
                Layout::Plain
            }
        }))
    }

    /// Creates or upgrades the consumer's processed-events table.
    pub async fn migrate_inbox(client: &mut Client, config: &InboxConfig) -> Result<MigrationReport, Error> {
        run(client, &Target::inbox(config)?).await
    }

    /// Fails with [`Error::NotMigrated`] or [`Error::SchemaTooNew`] unless the
    /// outbox table is at exactly this binary's version.
    pub async fn check(client: &impl GenericClient, config: &Config) -> Result<(), Error> {
        check_target(client, &Target::outbox(config, config.layout)?).await
    }

    /// Like [`check`], for the inbox table.
    pub async fn check_inbox(client: &impl GenericClient, config: &InboxConfig) -> Result<(), Error> {
        check_target(client, &Target::inbox(config)?).await
    }

    async fn current_version(client: &impl GenericClient, target: &Target) -> Result<i32, Error> {
        let ledger = target.ledger()?;
        let exists = catalog::exists(client, &ledger)
            .await
            .map_err(Error::pg("looking up the migrations table"))?;
        if !exists {
            return Ok(0);
        }
        catalog::ledger_version(client, &ledger)
            .await
            .map_err(Error::pg("reading the schema version"))
    }

    async fn check_target(client: &impl GenericClient, target: &Target) -> Result<(), Error> {
        let found = current_version(client, target).await?;
        let known = target.latest();
        if found > known {
            return Err(Error::SchemaTooNew {
                table: target.display_name(),
                found,
                known,
            });
        }
        if found < known {
            return Err(Error::NotMigrated {
                table: target.display_name(),
                found,
                needed: known,
            });
        }
        Ok(())
    }

    async fn run(client: &mut Client, target: &Target) -> Result<MigrationReport, Error> {
        let ledger = target.ledger()?;
        let tx = client
            .transaction()
            .await
            .map_err(Error::pg("starting the migration transaction"))?;
        // Serialises concurrent `outbox migrate` runs against the same table.
        catalog::lock_migrations(&tx, &ledger)
            .await
            .map_err(Error::pg("taking the migration lock"))?;
        catalog::create_ledger(&tx, &target.schema.quoted(), &ledger)
            .await
            .map_err(Error::pg("creating the migrations table"))?;

        let applied = catalog::applied(&tx, &ledger)
            .await
            .map_err(Error::pg("reading applied migrations"))?;
        let mut version = 0;
        for (v, sum) in applied {
            let Some(m) = target.migrations.iter().find(|m| m.version == v) else {
                return Err(Error::SchemaTooNew {
                    table: target.display_name(),
                    found: v,
                    known: target.latest(),
                });
            };
            if checksum(m) != sum {
                return Err(Error::MigrationChanged {
                    table: target.display_name(),
                    version: v,
                    name: m.name.to_owned(),
                });
            }
            version = version.max(v);
        }

        let mut report = MigrationReport {
            table: target.display_name(),
            applied: Vec::new(),
            version,
        };
        for m in target.migrations.iter().filter(|m| m.version > version) {
            tx.batch_execute(&target.render(m))
                .await
                .map_err(Error::pg("applying a migration"))?;
            catalog::record(&tx, &ledger, m.version, m.name, &checksum(m))
                .await
                .map_err(Error::pg("recording a migration"))?;
            report.applied.push((m.version, m.name));
            report.version = m.version;
        }
        tx.commit().await.map_err(Error::pg("committing the migration"))?;
        Ok(report)
    }
}

#[cfg(feature = "tokio-postgres")]
pub use pg::{check, check_inbox, existing_layout, migrate, migrate_inbox};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_placeholder() {
        for layout in [Layout::Plain, Layout::Daily] {
            let target = Target::outbox(&Config::new("app", "events").unwrap(), layout).unwrap();
            for m in target.migrations {
                let sql = target.render(m);
                for (placeholder, _) in &target.vars {
                    assert!(!sql.contains(placeholder), "{placeholder} in {sql}");
                }
                // The outbox or a companion of it (`events_replays`).
                assert!(sql.contains("\"app\".\"events"), "{sql}");
                if m.version == 1 {
                    assert!(sql.contains("('outbox_new')"));
                }
            }
            assert_eq!(target.latest(), OUTBOX_VERSION);
        }
        let inbox = Target::inbox(&InboxConfig::default()).unwrap();
        assert_eq!(inbox.latest(), INBOX_VERSION);
    }

    #[test]
    fn derived_names_are_validated() {
        let long = "a".repeat(60);
        let config = Config::new("public", &long).unwrap();
        assert!(Target::outbox(&config, Layout::Plain).is_err());
    }
}
