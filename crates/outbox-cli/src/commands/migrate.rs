//! `outbox migrate`: create or upgrade the outbox table, or the inbox with
//! `--inbox`; or, with `--grant ROLE --as KIND`, grant a role what it
//! needs (`outbox::privileges`), `--dry-run` printing the statements only.

use anyhow::Context;

use crate::cli::{Global, MigrateArgs, PartitionBy};

/// Days after today a partitioned outbox gets partitions for at migrate time.
const PREMAKE: u32 = 3;

/// `--wal`: the publication and slot, or `--recover` a lost slot.
async fn wal(
    client: &mut tokio_postgres::Client,
    config: &outbox::Config,
    args: &MigrateArgs,
) -> anyhow::Result<()> {
    if args.recover {
        let done = outbox::wal::recover_wal(client, config, args.since)
            .await
            .with_context(|| format!("recovering log tailing for {}", config.display_name()))?;
        if done.dropped {
            println!("dropped the invalidated replication slot {}", done.slot);
        }
        println!(
            "{} the replication slot {}; re-inserted {} undelivered row(s) for it to deliver",
            if done.created { "created" } else { "kept" },
            done.slot,
            done.reinserted
        );
        return Ok(());
    }
    let done = outbox::wal::migrate_wal(client, config)
        .await
        .with_context(|| format!("setting up log tailing for {}", config.display_name()))?;
    let said = |created: bool| if created { "created" } else { "exists" };
    println!(
        "publication {}: {}; replication slot {}: {}",
        done.publication,
        said(done.created_publication),
        done.slot,
        said(done.created_slot)
    );
    Ok(())
}

/// `--grant ROLE --as KINDS`: the tables must exist (their schema version
/// checked) for what GRANT names; then every statement in one
/// transaction, or printed with `--dry-run`.
async fn grant(g: &Global, args: &MigrateArgs, role: &str) -> anyhow::Result<()> {
    use outbox::privileges::Role;
    let grantee = outbox::Ident::new("--grant", role)?;
    let outbox = super::outbox_config(g)?;
    let inbox = args.inbox_table.config()?;
    let mut client = super::connect(&super::pg_config(g)?).await?;
    // `migrate` may be granted before the outbox exists: its owner is
    // then whoever creates it.
    if args.grant_as.iter().any(|r| !r.on_inbox() && *r != Role::Migrate) {
        outbox::check(&client, &outbox).await?;
    }
    if args.grant_as.iter().any(|r| r.on_inbox()) {
        outbox::check_inbox(&client, &inbox).await?;
    }
    let tables = outbox::privileges::Tables::new(outbox, inbox);
    let statements = outbox::privileges::grants(&client, &tables, &args.grant_as, &grantee).await?;
    if args.dry_run {
        println!("-- outbox migrate --grant {grantee} --dry-run: nothing was changed");
        for statement in &statements {
            println!("{statement};");
        }
        return Ok(());
    }
    outbox::privileges::apply(&mut client, &statements)
        .await
        .with_context(|| format!("granting {grantee} what it needs"))?;
    for statement in &statements {
        println!("{statement};");
    }
    let kinds: Vec<&str> = args.grant_as.iter().map(|r| r.name()).collect();
    println!("granted {grantee} what {} need(s)", kinds.join(", "));
    Ok(())
}

/// `--schemas PATTERN [--databases PATTERN]`: the outbox in every matching
/// schema of every matching database, one transaction each, one line per
/// outbox that changed and a count at the end.
async fn tenants(g: &Global, args: &MigrateArgs, schemas: &str) -> anyhow::Result<()> {
    let databases = super::selection::databases(&super::pg_config(g)?, args.databases.as_deref()).await?;
    let template = super::outbox_config(g)?
        .with_partitions(args.partitions)?
        .with_dead_after_attempts(g.max_attempts);
    let (mut changed, mut current) = (0_u64, 0_u64);
    for (database, pg) in databases {
        let prefix = database.as_ref().map(|d| format!("{d}/")).unwrap_or_default();
        let mut client = super::connect(&pg).await?;
        let found = outbox::sql::fleet::matching_schemas(&client, schemas)
            .await
            .context("listing the schemas")?;
        let mut migrated = Vec::new();
        for schema in found {
            let mut config = template.clone();
            config.schema = schema;
            if args.partition_by == Some(PartitionBy::Day) {
                config.layout = outbox::Layout::Daily;
            }
            let report = outbox::migrate(&mut client, &config)
                .await
                .with_context(|| format!("migrating the outbox {prefix}{}", config.display_name()))?;
            migrated.push(config.clone());
            if report.applied.is_empty() {
                current += 1;
            } else {
                changed += 1;
                println!("{prefix}{} is at schema version {}", report.table, report.version);
            }
        }
        if args.wal {
            let name = match &database {
                Some(name) => name.clone(),
                None => pg.postgres().get_dbname().unwrap_or("postgres").to_owned(),
            };
            let setup = outbox::wal::migrate_fleet_wal(&client, &name, schemas, &migrated)
                .await
                .with_context(|| format!("setting up log tailing for the fleet in {name}"))?;
            println!(
                "{prefix}log tailing for the fleet: publication {}{}, slot {}{}",
                setup.publication,
                if setup.created_publication {
                    " (created)"
                } else {
                    ""
                },
                setup.slot,
                if setup.created_slot { " (created)" } else { "" },
            );
        }
    }
    println!(
        "{} migrated, {} already up to date (schema version {})",
        super::counted(changed, "outbox", "outboxes"),
        current,
        outbox::OUTBOX_VERSION
    );
    Ok(())
}

pub(crate) async fn run(g: &Global, args: MigrateArgs) -> anyhow::Result<()> {
    if let Some(role) = args.grant.clone() {
        return grant(g, &args, &role).await;
    }
    if let Some(schemas) = args.schemas.clone() {
        return tenants(g, &args, &schemas).await;
    }
    let pg = super::pg_config(g)?;
    let report = if args.inbox {
        let config = args.inbox_table.config()?;
        let mut client = super::connect(&pg).await?;
        outbox::migrate_inbox(&mut client, &config)
            .await
            .with_context(|| format!("migrating the inbox {}", config.display_name()))?
    } else {
        let mut config = super::outbox_config(g)?
            .with_partitions(args.partitions)?
            .with_dead_after_attempts(g.max_attempts);
        if args.partition_by == Some(PartitionBy::Day) {
            config.layout = outbox::Layout::Daily;
        }
        let mut client = super::connect(&pg).await?;
        let report = outbox::migrate(&mut client, &config)
            .await
            .with_context(|| format!("migrating the outbox {}", config.display_name()))?;
        if outbox::existing_layout(&client, &config).await? == Some(outbox::Layout::Daily) {
            // Writes land in real partitions from the start.
            let done = outbox::partitions::maintain(&mut client, &config, None, PREMAKE)
                .await
                .with_context(|| format!("creating the partitions of {}", config.display_name()))?;
            super::partitions::report(&config, &done);
        }
        if args.wal {
            wal(&mut client, &config, &args).await?;
        }
        report
    };
    if report.applied.is_empty() {
        println!(
            "{} is up to date (schema version {})",
            report.table, report.version
        );
    } else {
        for (version, name) in &report.applied {
            println!("{}: applied {version:04}_{name}", report.table);
        }
        println!("{} is at schema version {}", report.table, report.version);
    }
    Ok(())
}
