//! `outbox cleanup`: retention of published rows or inbox records, batch by
//! batch, with a spinner on a terminal and a one-line summary.

use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::{CleanupArgs, Global};

pub(crate) async fn run(g: &Global, args: CleanupArgs) -> anyhow::Result<()> {
    let client = super::connect(&super::pg_config(g)?).await?;
    // Hidden when stderr is not a terminal.
    let progress = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})").context("progress template")?,
    );
    progress.enable_steady_tick(Duration::from_millis(120));
    let started = Instant::now();
    let show = |n: u64| progress.set_message(format!("{n} rows deleted"));
    let (table, done) = if args.inbox {
        let config = args.inbox_table.config()?;
        super::require_inbox(&client, &config, &[outbox::privileges::Role::CleanupInbox]).await?;
        outbox::check_inbox(&client, &config).await?;
        let done =
            outbox::retention::delete_processed(&client, &config, args.older_than, args.batch_size, show)
                .await
                .with_context(|| format!("cleaning {}", config.display_name()))?;
        (config.display_name(), done)
    } else {
        let config = super::outbox_config(g)?;
        super::require(&client, &config, &[outbox::privileges::Role::Cleanup]).await?;
        outbox::check(&client, &config).await?;
        let done =
            outbox::retention::delete_published(&client, &config, args.older_than, args.batch_size, show)
                .await
                .with_context(|| format!("cleaning {}", config.display_name()))?;
        (config.display_name(), done)
    };
    progress.finish_and_clear();
    println!(
        "{table}: deleted {} rows older than {} in {} batches, {:.2} s",
        done.deleted,
        humantime::format_duration(args.older_than),
        done.batches,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
