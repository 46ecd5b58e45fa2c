//! `outbox migrate`: create or upgrade the outbox table, or the inbox with `--inbox`.

use anyhow::Context;

use crate::cli::{Global, MigrateArgs};

pub(crate) async fn run(g: &Global, args: MigrateArgs) -> anyhow::Result<()> {
    let pg = super::pg_config(g)?;
    let report = if args.inbox {
        let config = args.inbox_table.config()?;
        let mut client = super::connect(&pg).await?;
        outbox::migrate_inbox(&mut client, &config)
            .await
            .with_context(|| format!("migrating the inbox {}", config.display_name()))?
    } else {
        let config = super::outbox_config(g)?.with_partitions(args.partitions)?;
        let mut client = super::connect(&pg).await?;
        outbox::migrate(&mut client, &config)
            .await
            .with_context(|| format!("migrating the outbox {}", config.display_name()))?
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
