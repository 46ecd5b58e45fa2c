//! `outbox partitions maintain`: create the coming days, drop the past days
//! whose every row is published, and say what was kept and why.

use anyhow::Context;

use crate::cli::{Global, PartitionsCommand};
use crate::exit::ConfigError;

pub(crate) async fn run(g: &Global, command: PartitionsCommand) -> anyhow::Result<()> {
    let PartitionsCommand::Maintain { keep, premake } = command;
    let config = super::outbox_config(g)?;
    let mut client = super::connect(&super::pg_config(g)?).await?;
    super::require(&client, &config, &[outbox::privileges::Role::Partitions]).await?;
    outbox::check(&client, &config).await?;
    if outbox::existing_layout(&client, &config).await? != Some(outbox::Layout::Daily) {
        return Err(ConfigError(format!(
            "{} is not partitioned (it was migrated without --partition-by day); use `outbox cleanup` for retention",
            config.display_name()
        ))
        .into());
    }
    let done = outbox::partitions::maintain(&mut client, &config, keep, premake)
        .await
        .with_context(|| format!("maintaining the partitions of {}", config.display_name()))?;
    report(&config, &done);
    Ok(())
}

/// Prints what maintenance did; warnings go to stderr.
pub(crate) fn report(config: &outbox::Config, done: &outbox::partitions::Maintenance) {
    let table = config.display_name();
    for name in &done.created {
        println!("{table}: created partition {name}");
    }
    for (name, rows) in &done.dropped {
        println!("{table}: dropped partition {name} ({rows} published rows)");
    }
    for (name, unpublished) in &done.kept {
        eprintln!(
            "warning: {table}: kept partition {name}: {unpublished} unpublished rows (pending, retrying or dead letters); \
             deliver, requeue or delete them and it goes at the next run"
        );
    }
    for name in &done.awaiting_slot {
        println!(
            "{table}: kept partition {name}: log tailing has not confirmed past it yet; it goes at a later run"
        );
    }
    for name in &done.busy {
        eprintln!(
            "warning: {table}: kept partition {name}: the outbox stayed locked by other sessions; it goes at the next run"
        );
    }
    if done.in_default > 0 {
        eprintln!(
            "warning: {table}: {} rows are in the default partition (written for a day that had no partition); \
             they are delivered as usual, but run maintenance with enough --premake to keep it empty",
            done.in_default
        );
    }
    if done.created.is_empty()
        && done.dropped.is_empty()
        && done.kept.is_empty()
        && done.busy.is_empty()
        && done.awaiting_slot.is_empty()
    {
        println!("{table}: partitions up to date");
    }
}
