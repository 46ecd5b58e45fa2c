//! `outbox relay`: deliver until SIGINT/SIGTERM, then drain the batch in flight.

use std::sync::Arc;

use anyhow::Context;
use outbox_relay::{Backoff, Failpoint, Relay, RelayConfig, SinkOptions};

use crate::cli::{Global, RelayArgs};
use crate::exit::ConfigError;

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
    let options = SinkOptions {
        stream_prefix: args.stream_prefix,
        timeout: args.http_timeout,
        http_concurrency: usize::from(args.http_concurrency),
    };
    let sink = outbox_relay::sink::from_url(&args.sink, &options)?;
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
        poll_interval: args.poll_interval,
        notify: !args.no_notify,
        connect_timeout: g.connect_timeout,
        failpoint,
    };
    let cancel = super::shutdown_token()?;
    Relay::new(pg, Arc::from(sink), config)
        .run(cancel)
        .await
        .context("running the relay")
}
