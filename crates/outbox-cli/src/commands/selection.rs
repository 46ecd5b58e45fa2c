//! Which outboxes a command works on, by name: `--outbox NAME` (one),
//! `--all` (every outbox of the fleet the relay's configuration describes)
//! and `--schemas PATTERN` (what that pattern finds, alone). Owns turning
//! those into connection settings and tables, and connecting to each
//! database of a selection once; the reports are `fleet_ops`'s and each
//! command's.
//!
//! The fleet is read the way `outbox relay` reads it, so the names agree
//! with what it serves: the `--config` file layered under flags and
//! environment (`crate::config::Layered`), its `[outboxes.NAME]` tables
//! each with its own keys over the file's (`relay::each_listed`), and the
//! outboxes its `schemas` pattern finds in its `databases`. A name is what
//! the fleet calls an outbox in its logs and metrics: a listed outbox's
//! table name, or `schema.table` (`database/schema.table` across
//! databases) for one the pattern found. A found outbox with the
//! `schema.table` of a listed one in the same database is the listed one,
//! as the fleet serves it.

use std::ffi::OsString;
use std::path::Path;

use anyhow::Context;
use clap::CommandFactory;
use clap::parser::ValueSource;
use outbox::sql::fleet;
use outbox_relay::pg::PgConfig;
use tokio_postgres::Client;

use crate::cli::{Cli, Global};
use crate::config::Layered;
use crate::exit::ConfigError;

/// One outbox a command works on: where it is and its table.
pub(crate) struct Chosen {
    pub(crate) pg: PgConfig,
    pub(crate) config: outbox::Config,
}

/// The outboxes a report covers, connected, one database at a time.
pub(crate) struct Selection {
    pub(crate) databases: Vec<Database>,
    /// What selected them, for the reports' text: `matching "tenant_%"`,
    /// `of the fleet`.
    pub(crate) what: String,
    /// The fleet's schema pattern, if it has one: what names its slot
    /// with `--source wal`.
    pub(crate) schemas: Option<String>,
    /// The fleet's top-level table.
    pub(crate) template: outbox::Config,
}

/// One database of a selection: its name where it is not the URL's own
/// (what prefixes found outboxes' labels across databases), and its
/// outboxes.
pub(crate) struct Database {
    pub(crate) name: Option<String>,
    pg: PgConfig,
    pub(crate) client: Client,
    pub(crate) outboxes: Vec<Member>,
}

/// An outbox of a selection.
pub(crate) struct Member {
    /// Its name, as the fleet labels it.
    pub(crate) label: String,
    /// Its key in the fleet's locks (`outbox::sql::fleet`).
    pub(crate) key: i32,
    pub(crate) config: outbox::Config,
}

/// An `[outboxes.NAME]` table's outbox.
struct Listed {
    name: String,
    pg: PgConfig,
    config: outbox::Config,
}

/// The outboxes a fleet would serve, before connecting.
struct Fleet {
    /// The top-level database: the pattern's, and the one outbox's when
    /// there is neither a pattern nor a listed outbox (a plain relay).
    pg: PgConfig,
    /// The top-level table (and schema, for a plain relay).
    template: outbox::Config,
    schemas: Option<String>,
    databases: Option<String>,
    listed: Vec<Listed>,
}

/// The one outbox `--outbox NAME` names in the fleet of `config` (and
/// `--schemas`, `--databases` over its `schemas`, `databases`), or
/// without it the one of `--schema`, `--table` and `DATABASE_URL`.
pub(crate) async fn one(
    g: &Global,
    name: Option<&str>,
    config: Option<&Path>,
    schemas: Option<&str>,
    databases: Option<&str>,
) -> anyhow::Result<Chosen> {
    let Some(name) = name else {
        return Ok(Chosen {
            pg: super::pg_config(g)?,
            config: super::outbox_config(g)?,
        });
    };
    no_schema_beside(g, &format!("--outbox {name:?}"))?;
    Fleet::configured(config, schemas, databases)?.find(name).await
}

/// `--all`: every outbox of the fleet `config` (and `--schemas`,
/// `--databases` over its `schemas`, `databases`) describes.
pub(crate) async fn all(
    g: &Global,
    config: Option<&Path>,
    schemas: Option<&str>,
    databases: Option<&str>,
) -> anyhow::Result<Selection> {
    no_schema_beside(g, "--all")?;
    let fleet = Fleet::configured(config, schemas, databases)?;
    Ok(Selection {
        databases: fleet.connect().await?,
        what: "of the fleet".to_owned(),
        schemas: fleet.schemas.clone(),
        template: fleet.template.clone(),
    })
}

/// `--schemas PATTERN [--databases PATTERN]`: the outboxes named --table
/// the pattern finds, and no listed one.
pub(crate) async fn pattern(g: &Global, schemas: &str, databases: Option<&str>) -> anyhow::Result<Selection> {
    no_schema_beside(g, &format!("--schemas {schemas:?}"))?;
    let fleet = Fleet {
        pg: super::pg_config(g)?,
        template: super::outbox_config(g)?,
        schemas: Some(schemas.to_owned()),
        databases: databases.map(str::to_owned),
        listed: Vec::new(),
    };
    Ok(Selection {
        databases: fleet.connect().await?,
        what: format!("matching {schemas:?}"),
        schemas: fleet.schemas.clone(),
        template: fleet.template.clone(),
    })
}

/// Refuses `--schema` beside `given`, which names outboxes itself. clap
/// refuses the flag beside it, except when `--schema` comes before the
/// subcommand (clap-rs/clap#1204: a parent's global is not validated
/// against the subcommand's conflicts), caught here as a --schema other
/// than the default (an `OUTBOX_SCHEMA` in the environment counts).
pub(crate) fn no_schema_beside(g: &Global, given: &str) -> anyhow::Result<()> {
    if g.schema != "public" {
        return Err(ConfigError(format!(
            "{given} and --schema {:?} both name outboxes: give one of them",
            g.schema
        ))
        .into());
    }
    Ok(())
}

/// The databases `pattern` selects: `pg`'s own (no pattern), or every one
/// of its server matching `pattern`, by name. `outbox migrate --schemas`
/// walks them too.
pub(crate) async fn databases(
    pg: &PgConfig,
    pattern: Option<&str>,
) -> anyhow::Result<Vec<(Option<String>, PgConfig)>> {
    let Some(pattern) = pattern else {
        return Ok(vec![(None, pg.clone())]);
    };
    let client = super::connect(pg).await?;
    let names = fleet::matching_databases(&client, pattern)
        .await
        .context("listing the databases")?;
    Ok(names
        .into_iter()
        .map(|name| {
            let mut pg = pg.clone();
            pg.postgres_mut().dbname(&name);
            (Some(name), pg)
        })
        .collect())
}

impl Fleet {
    /// The fleet `outbox relay --config config` would run, with the
    /// connection flags of this command line, `--schemas` and
    /// `--databases`, and the environment.
    fn configured(
        config: Option<&Path>,
        schemas: Option<&str>,
        databases: Option<&str>,
    ) -> anyhow::Result<Self> {
        let mut argv: Vec<OsString> = vec!["outbox".into(), "relay".into()];
        argv.extend(connection_flags());
        if let Some(path) = config {
            argv.extend(["--config".into(), path.as_os_str().to_owned()]);
        }
        if let Some(schemas) = schemas {
            argv.push(format!("--schemas={schemas}").into());
        }
        if let Some(databases) = databases {
            argv.push(format!("--databases={databases}").into());
        }
        let layered = Layered::parse(argv.iter().cloned())?;
        let mut listed = Vec::new();
        if let Some(file) = &layered.file {
            for (name, _, mine) in super::relay::each_listed(file, &argv)? {
                let (g, ..) = mine.into_relay();
                let pg = super::pg_config(&g).with_context(|| format!("[outboxes.{name}]"))?;
                let config = super::outbox_config(&g).with_context(|| format!("[outboxes.{name}]"))?;
                listed.push(Listed { name, pg, config });
            }
        }
        let (g, relay, _) = layered.into_relay();
        Ok(Self {
            pg: super::pg_config(&g)?,
            template: super::outbox_config(&g)?,
            schemas: relay.schemas,
            databases: relay.databases,
            listed,
        })
    }

    /// Connects to each database of the fleet and finds its outboxes.
    async fn connect(&self) -> anyhow::Result<Vec<Database>> {
        let mut found = Vec::new();
        if let Some(pattern) = &self.schemas {
            for (name, pg) in databases(&self.pg, self.databases.as_deref()).await? {
                let client = super::connect(&pg).await?;
                let outboxes = fleet::tenant_outboxes(&client, pattern, &self.template.table)
                    .await
                    .context("listing the tenant outboxes")?
                    .into_iter()
                    .map(|t| {
                        let mut config = self.template.clone();
                        config.schema = t.schema;
                        Member {
                            label: label(name.as_deref(), &config),
                            key: t.key,
                            config,
                        }
                    })
                    .collect();
                found.push(Database {
                    name,
                    pg,
                    client,
                    outboxes,
                });
            }
        } else if self.listed.is_empty() {
            // Neither a pattern nor a listed outbox: the relay serves its
            // one outbox.
            let client = super::connect(&self.pg).await?;
            found.push(Database {
                name: None,
                pg: self.pg.clone(),
                outboxes: vec![member(&client, self.template.display_name(), &self.template).await?],
                client,
            });
        }
        for listed in &self.listed {
            let at = match found.iter().position(|db| same_database(&db.pg, &listed.pg)) {
                Some(at) => at,
                None => {
                    let name = (!same_database(&self.pg, &listed.pg)).then(|| dbname(&listed.pg));
                    found.push(Database {
                        name,
                        pg: listed.pg.clone(),
                        client: super::connect(&listed.pg).await?,
                        outboxes: Vec::new(),
                    });
                    found.len() - 1
                }
            };
            let db = &mut found[at];
            db.outboxes
                .retain(|m| m.config.display_name() != listed.config.display_name());
            let listed = member(&db.client, listed.name.clone(), &listed.config).await?;
            db.outboxes.push(listed);
        }
        for db in &mut found {
            db.outboxes.sort_by(|a, b| a.label.cmp(&b.label));
        }
        Ok(found)
    }

    /// The outbox named `name`: a listed one without connecting (by its
    /// name, or by the label it would have if the pattern had found it),
    /// else the one found under that label; exit 2 naming the closest
    /// otherwise.
    async fn find(&self, name: &str) -> anyhow::Result<Chosen> {
        let listed = self.listed.iter().find(|l| l.name == name).or_else(|| {
            self.listed.iter().find(|l| {
                let database = (!same_database(&self.pg, &l.pg)).then(|| dbname(&l.pg));
                label(database.as_deref(), &l.config) == name
            })
        });
        if let Some(listed) = listed {
            return Ok(Chosen {
                pg: listed.pg.clone(),
                config: listed.config.clone(),
            });
        }
        let databases = self.connect().await?;
        let mut known = Vec::new();
        for db in databases {
            for m in db.outboxes {
                if m.label == name {
                    return Ok(Chosen {
                        pg: db.pg,
                        config: m.config,
                    });
                }
                known.push(m.label);
            }
        }
        let mut error = unknown(name, &known);
        if self.schemas.is_none() && self.listed.is_empty() {
            error.0.push_str(
                " (a fleet's outboxes are --config's [outboxes.NAME] tables and those its `schemas` pattern \
                 finds, or --schemas'; one outbox by its schema is --schema)",
            );
        }
        Err(error.into())
    }
}

/// `outbox` of the connected database as a member labelled `label`.
async fn member(client: &Client, label: String, config: &outbox::Config) -> anyhow::Result<Member> {
    let key = fleet::outbox_key(client, config)
        .await
        .with_context(|| format!("reading the lock key of {label}"))?;
    Ok(Member {
        label,
        key,
        config: config.clone(),
    })
}

/// The error for a name the fleet does not have: the closest name when
/// one is near (a typo, or a schema without its table), else the names.
fn unknown(name: &str, known: &[String]) -> ConfigError {
    let closest = known
        .iter()
        .map(|k| {
            let distance = if k.strip_prefix(name).is_some_and(|rest| rest.starts_with('.')) {
                0
            } else {
                strsim::damerau_levenshtein(name, k)
            };
            (distance, k)
        })
        .min();
    if let Some((distance, k)) = closest
        && distance <= 2.max(name.len() / 4)
    {
        return ConfigError(format!(
            "--outbox {name:?}: the fleet has no outbox of that name; did you mean {k:?}? (`--all` lists them)"
        ));
    }
    if known.is_empty() {
        return ConfigError(format!(
            "--outbox {name:?}: the fleet of this configuration has no outbox: give --config a file with \
             [outboxes.NAME] tables or a `schemas` pattern, or --schemas"
        ));
    }
    const SHOWN: usize = 20;
    let mut names = known
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if known.len() > SHOWN {
        names.push_str(&format!(" and {} more", known.len() - SHOWN));
    }
    ConfigError(format!(
        "--outbox {name:?}: the fleet has no outbox of that name; its outboxes: {names}"
    ))
}

/// The connection flags (`--database-url`, `--table`, `--channel`,
/// `--connect-timeout`) given on this process's command line, as the
/// relay's parse takes them: given there, they win over the file as they
/// do for the relay; from the environment, that parse reads them itself.
fn connection_flags() -> Vec<OsString> {
    // The same arguments parse the same way twice: main parsed them.
    let Ok(matches) = Cli::command().try_get_matches_from(std::env::args_os()) else {
        return Vec::new();
    };
    let mut levels = vec![&matches];
    while let Some((_, sub)) = levels.last().and_then(|m| m.subcommand()) {
        levels.push(sub);
    }
    let mut flags = Vec::new();
    for id in ["database_url", "table", "channel", "connect_timeout"] {
        // A global's value lands at the level it was given at.
        let given = levels
            .iter()
            .find(|m| m.value_source(id) == Some(ValueSource::CommandLine));
        if let Some(values) = given.and_then(|m| m.get_raw(id)) {
            for value in values {
                let mut flag = OsString::from(format!("--{}=", id.replace('_', "-")));
                flag.push(value);
                flags.push(flag);
            }
        }
    }
    flags
}

/// `schema.table`, or `database/schema.table` across databases: the
/// fleet's label (`outbox_relay::fleet`).
fn label(database: Option<&str>, outbox: &outbox::Config) -> String {
    match database {
        Some(name) => format!("{name}/{}", outbox.display_name()),
        None => outbox.display_name(),
    }
}

fn dbname(pg: &PgConfig) -> String {
    pg.postgres().get_dbname().unwrap_or("postgres").to_owned()
}

/// Whether `a` and `b` connect to one database (hosts, ports, database).
fn same_database(a: &PgConfig, b: &PgConfig) -> bool {
    let (a, b) = (a.postgres(), b.postgres());
    a.get_hosts() == b.get_hosts() && a.get_ports() == b.get_ports() && a.get_dbname() == b.get_dbname()
}

#[cfg(test)]
mod tests {
    use super::unknown;

    #[test]
    fn an_unknown_name_suggests_the_closest_or_lists_them() {
        let known = [
            "acme".to_owned(),
            "tenant_0.outbox".to_owned(),
            "tenant_1.outbox".to_owned(),
        ];
        let e = unknown("acne", &known).to_string();
        assert!(e.contains("did you mean \"acme\"?"), "{e}");
        let e = unknown("tenant_1", &known).to_string();
        assert!(e.contains("did you mean \"tenant_1.outbox\"?"), "{e}");
        let e = unknown("zebra", &known).to_string();
        assert!(
            e.ends_with("its outboxes: acme, tenant_0.outbox, tenant_1.outbox"),
            "{e}"
        );
        let e = unknown("zebra", &[]).to_string();
        assert!(e.contains("has no outbox"), "{e}");
    }
}
