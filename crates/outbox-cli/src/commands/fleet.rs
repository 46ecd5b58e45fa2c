//! `outbox relay --schemas PATTERN`: one process serving every tenant
//! outbox the pattern finds (`outbox_relay::fleet`), with the relay's
//! settings for each; `/readyz` reports the fleet's control sessions.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use outbox_relay::fleet::FleetConfig;
use outbox_relay::health::Registry;
use outbox_relay::pg::PgConfig;

use super::relay::{Fleet, Prepared};
use crate::endpoint::Endpoint;
use crate::exit::ConfigError;

/// Runs the fleet until SIGINT/SIGTERM.
pub(crate) async fn run(
    pg: PgConfig,
    prepared: Prepared,
    fleet: Fleet,
    endpoint: Option<Endpoint>,
    otlp_endpoint: Option<&str>,
) -> anyhow::Result<()> {
    let Prepared {
        config,
        sink,
        lane,
        retention,
        probes: _,
        // A fleet publishes no route state (docs/routing.md).
        address: _,
    } = prepared;
    let sink = sink.ok_or_else(|| {
        ConfigError("no sink: give --sink or OUTBOX_SINK, or in --config a top-level sink = \"…\"".to_owned())
    })?;
    if lane.is_some() {
        return Err(ConfigError(
            "a fleet (--schemas) claims every route by lock: remove the routes' `claim` keys".to_owned(),
        )
        .into());
    }
    if retention.is_some() {
        return Err(ConfigError(
            "a fleet (--schemas) runs no retention: run `outbox cleanup --schema SCHEMA` per tenant on a schedule".to_owned(),
        )
        .into());
    }
    let fleet = outbox_relay::fleet::Fleet::new(
        pg,
        Arc::from(sink),
        FleetConfig {
            schemas: fleet.schemas,
            listed: fleet.listed,
            databases: fleet.databases,
            sessions: fleet.sessions,
            prepared_claims: fleet.prepared_claims,
            discover_interval: fleet.discover_interval,
            relay: config,
            split: fleet.split,
        },
    )
    .map_err(|e| ConfigError(e.to_string()))?;
    let cancel = super::shutdown_token()?;
    // From here every way out goes through `flush_traces`.
    let traces = super::start_traces(otlp_endpoint, "outbox-relay")?;
    let fleet = match &traces {
        Some(traces) => fleet.with_tracing(traces.clone()),
        None => fleet,
    };
    let server = endpoint.map(|endpoint| {
        let relays = Arc::new(Registry::default());
        relays.register("fleet", fleet.health());
        endpoint.serve(relays, cancel.clone())
    });
    let result = fleet.run(cancel.clone()).await.context("running the fleet");
    cancel.cancel();
    if let Some(server) = server {
        let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
    }
    super::flush_traces(traces).await;
    result
}
