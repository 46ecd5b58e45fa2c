//! `outbox relay --http ADDR`: the relay's HTTP endpoint, serving
//! Prometheus metrics (`/metrics`), liveness (`/healthz`) and readiness
//! (`/readyz`).
//!
//! The relay library records through the `metrics` facade and reports
//! readiness to `outbox_relay::health`; this module installs the exporter,
//! binds the port and serves both. Its own facts are the process's: the
//! usual `process_*` metrics (CPU, memory, file descriptors, threads, start
//! time; `metrics-process`, read at each scrape so they cost nothing
//! between scrapes) and `outbox_build_info` with the version and the git
//! commit (`build.rs`).
//!
//! Why `metrics` + `metrics-exporter-prometheus` rather than
//! `prometheus-client`: the facade keeps the library free of any exporter
//! (a library user can install another recorder, or none, and every handle
//! is then a no-op), handles are cheap clones looked up once, and the
//! exporter renders the text format without a listener of its own (its
//! default features, hyper and a push gateway, are off), so axum serves it
//! beside the probes on one port.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use outbox_relay::health::Registry;
use outbox_relay::metric;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::exit::ConfigError;

/// How often histogram samples are folded into their buckets between
/// scrapes, so memory stays flat however rarely Prometheus scrapes.
const UPKEEP: Duration = Duration::from_secs(5);

/// Buckets of the `_seconds` histograms: 1 ms to 5 min.
const SECONDS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Buckets of `outbox_batch_size`, up to the largest `--batch-size`.
const ROWS: [f64; 12] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 10000.0,
];

/// The exporter installed and the port bound, not yet serving.
pub(crate) struct Endpoint {
    listener: TcpListener,
    handle: PrometheusHandle,
    process: metrics_process::Collector,
}

impl Endpoint {
    /// Installs the Prometheus recorder (before the relay and its sinks are
    /// built, so their handles record) and binds `addr`: a port in use or
    /// an address not of this host is a configuration error (exit 2).
    pub(crate) async fn bind(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr).await.map_err(|e| {
            ConfigError(format!(
                "--http (OUTBOX_HTTP, key `http`) {addr}: cannot listen there: {e}"
            ))
        })?;
        let mut builder = PrometheusBuilder::new();
        for name in metric::HISTOGRAMS {
            let buckets: &[f64] = if name == metric::BATCH_SIZE {
                &ROWS
            } else {
                &SECONDS
            };
            builder = builder.set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)?;
        }
        let handle = builder.install_recorder()?;
        metric::describe();
        metrics::gauge!(
            metric::BUILD_INFO,
            "version" => env!("CARGO_PKG_VERSION"),
            "commit" => env!("OUTBOX_COMMIT"),
        )
        .set(1.0);
        let process = metrics_process::Collector::default();
        process.describe();
        Ok(Self {
            listener,
            handle,
            process,
        })
    }

    /// The bound address (the port, when `addr` asked for port 0).
    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `cancel` fires; `/readyz` asks `relays`.
    pub(crate) fn serve(self, relays: Arc<Registry>, cancel: CancellationToken) -> JoinHandle<()> {
        let Self {
            listener,
            handle,
            process,
        } = self;
        let upkeep = handle.clone();
        let stop = cancel.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(UPKEEP) => upkeep.run_upkeep(),
                }
            }
        });
        let app = Router::new()
            .route("/metrics", get(move || render(handle.clone(), process.clone())))
            .route("/healthz", get(healthz))
            .route("/readyz", get(move || readyz(Arc::clone(&relays))));
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(cancel.cancelled_owned())
                .await;
            if let Err(error) = served {
                tracing::warn!(%error, "the HTTP endpoint failed");
            }
        })
    }
}

/// The process's metrics read now, then everything rendered.
async fn render(handle: PrometheusHandle, process: metrics_process::Collector) -> impl IntoResponse {
    // A handful of small reads of /proc/self: no need for a blocking thread.
    process.collect();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        handle.render(),
    )
}

/// Alive as long as this answers at all.
async fn healthz() -> impl IntoResponse {
    json(StatusCode::OK, &serde_json::json!({"alive": true}))
}

/// 200 when every check of every relay passes, else 503; the body names
/// each check and what is not ready.
async fn readyz(relays: Arc<Registry>) -> impl IntoResponse {
    let readiness = relays.readiness();
    let status = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json(status, &readiness)
}

fn json(status: StatusCode, body: &impl serde::Serialize) -> axum::response::Response {
    // Serializing maps of strings cannot fail.
    let body = serde_json::to_string(body).unwrap_or_default();
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}
