//! `outbox relay`: deliver until SIGINT/SIGTERM (or, with `--drain`, until
//! nothing is due), then finish the batch in flight.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use outbox_relay::{Backoff, Counters, Failpoint, Relay, RelayConfig};

use crate::cli::{Global, RelayArgs};
use crate::config::RelayFile;
use crate::exit::ConfigError;

/// With no NOTIFY the poll interval is the delivery latency, so the default
/// is shorter than the fallback poll's.
const POLL_WITHOUT_NOTIFY: Duration = Duration::from_secs(1);

pub(crate) async fn run(g: &Global, args: RelayArgs) -> anyhow::Result<()> {
    let outbox = super::outbox_config(g)?;
    let pg = super::pg_config(g)?;
    if args.backoff_max < args.backoff_base {
        return Err(ConfigError(format!(
            "--backoff-max ({:?}) is shorter than --backoff-base ({:?})",
            args.backoff_max, args.backoff_base
        ))
        .into());
    }
    let options = (*args.sink_options).options(|| format!("/outbox/{}.{}", g.schema, g.table));
    let mut ordering_for = args.ordering_for;
    let sink: Box<dyn outbox_relay::Sink> = match (&args.config, &args.sink) {
        (Some(path), _) => {
            let file = RelayFile::read(path)?;
            // The file's [ordering] table wins over --ordering-for.
            for (aggregate_type, mode) in file.ordering()? {
                ordering_for.retain(|(t, _)| *t != aggregate_type);
                ordering_for.push((aggregate_type, mode));
            }
            Box::new(file.router(&options)?)
        }
        (None, Some(url)) => outbox_relay::sink::from_url(url, &options)?,
        // clap requires one of them.
        (None, None) => return Err(ConfigError("give --sink or --config".to_owned()).into()),
    };
    let failpoint = match std::env::var("OUTBOX_FAILPOINT") {
        Ok(v) if !v.is_empty() => Some(v.parse::<Failpoint>().map_err(ConfigError)?),
        _ => None,
    };
    let config = RelayConfig {
        outbox,
        batch_size: args.batch_size,
        backoff: Backoff {
            base: args.backoff_base,
            max: args.backoff_max,
            max_attempts: g.max_attempts,
        },
        poll_interval: args.poll_interval.unwrap_or(if args.no_notify {
            POLL_WITHOUT_NOTIFY
        } else {
            RelayConfig::default().poll_interval
        }),
        notify: !args.no_notify,
        connect_timeout: g.connect_timeout,
        drain: args.drain,
        ordering: args.ordering,
        ordering_for,
        lease_timeout: args.lease_timeout,
        name: args.relay_name,
        max_event_bytes: args.max_event_bytes,
        failpoint,
    };
    let cancel = super::shutdown_token()?;
    let retention = args.retention.map(|keep| {
        let schedule = outbox_relay::Retention {
            keep,
            interval: args.retention_interval,
        };
        tokio::spawn(schedule.run(pg.clone(), config.outbox.clone(), cancel.clone()))
    });
    let drain = config.drain;
    let relay = Relay::new(pg, Arc::from(sink), config);
    let counters = relay.counters();
    let result = relay.run(cancel.clone()).await.context("running the relay");
    cancel.cancel();
    if let Some(task) = retention {
        let _ = task.await;
    }
    result?;
    if drain {
        drain_verdict(&counters)?;
    }
    Ok(())
}

/// A drain that left due rows behind or made dead letters fails (exit 1),
/// so a cron job notices.
fn drain_verdict(counters: &Counters) -> anyhow::Result<()> {
    if let Some(cause) = counters.sink_unavailable.get() {
        anyhow::bail!("the drain stopped with due events undelivered: the sink is unavailable ({cause})");
    }
    let dead = counters.dead_lettered.load(Ordering::Relaxed);
    if dead > 0 {
        anyhow::bail!("the drain made {dead} dead letter(s): see `outbox dlq list`");
    }
    Ok(())
}
