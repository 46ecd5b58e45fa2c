//! # outbox-relay
//!
//! The relay of the transactional outbox: it claims unpublished rows with
//! `FOR UPDATE SKIP LOCKED`, hands them to a [`Sink`], and marks what the sink
//! acknowledged, all in one transaction per batch (see [`relay`] for why that
//! is at-least-once and never "marked but not sent").
//!
//! | module | owns |
//! |---|---|
//! | [`relay`] | the cycle: wait, claim, deliver, mark, commit; receipts into counters, metrics, logs, signals |
//! | `context` | [`RelayContext`]: what one relay owns and reports (name, outbox, health, counters, [`Signals`]) |
//! | `source` | where batches come from: the `Source` trait; `source::poll`, the polling claim with leases and its two-connection overlap; `source::wal`, log tailing through a replication slot |
//! | `plan` | what became of each row: delivered, retry at, permanent, held back |
//! | `config`, `counters`, `error` | [`RelayConfig`], [`Counters`], [`RelayError`] |
//! | `wake` | the session, LISTEN/NOTIFY and the fallback poll |
//! | `lease` | sharing the outbox between relays: heartbeat, rebalancing, partitions held |
//! | [`backoff`] | every delay that doubles: retry delays and the dead-letter limit, reconnect and probe waits |
//! | [`defaults`] | every setting's default, defined once (the CLI's flags default to them) |
//! | [`replay`] | re-delivering published events, resumably: the engine behind `outbox replay` |
//! | [`sink`] | the [`Sink`] trait, one file per sink, chosen by URL |
//! | [`failpoint`] | test-only pause points (`OUTBOX_FAILPOINT`) |
//! | [`pg`] | from `DATABASE_URL` to a connection, for every crate: TLS as libpq does it, startup retries |
//! | [`redact`] | secrets out of URLs before they are printed, logged or stored: passwords and every query value |
//! | `route_state` | what the relay tells the console about its routes (state, counts, rollup) on its heartbeat, and the route pauses it honours |
//! | `retention` | [`Retention`]: cleanup or partition maintenance on a schedule, one relay at a time |
//! | [`metric`] | what the relay records for Prometheus through the `metrics` facade: names, descriptions, handles |
//! | [`health`] | one relay's readiness (PostgreSQL, leases, each sink's breaker), and the process's [`health::Registry`] that `/readyz` reports |
//! | `backlog` | [`Backlog`]: the backlog and dead-letter gauges, from one query on a schedule |
//! | [`trace`] | OpenTelemetry traces over OTLP/HTTP: the exporter ([`trace::Tracing`]), a batch's spans from its receipt, an inbox transaction's span |
//!
//! Each sink is a feature, all but `kafka` on by default (it builds
//! librdkafka, a C library; the `outbox` binary turns it on):
//!
//! | feature | URL schemes | sink |
//! |---|---|---|
//! | `redis` | `redis://`, `rediss://` | Redis Streams (`XADD`) |
//! | `http` | `http://`, `https://` | one `POST` per event |
//! | `nats` | `nats://` | NATS JetStream, dedup by `Nats-Msg-Id` |
//! | `amqp` | `amqp://`, `amqps://` | RabbitMQ with publisher confirms |
//! | `kafka` | `kafka://` | Kafka, idempotent producer, `acks=all`, key = aggregate id |

mod backlog;
pub mod backoff;
mod breaker;
mod config;
mod context;
mod counters;
pub mod defaults;
mod error;
pub mod exit;
pub mod failpoint;
pub mod fleet;
pub mod health;
mod lease;
pub mod metric;
pub mod pg;
mod plan;
pub mod redact;
pub mod relay;
pub mod replay;
mod retention;
mod route_state;
pub mod sink;
mod source;
pub mod trace;
mod wake;

pub use backlog::{Backlog, HORIZON_WARN};
pub use backoff::Backoff;
pub use config::{ClaimMode, Pooler, SourceKind, WalCleanup, WalSettings};
pub use context::{RelayContext, Signals};
pub use failpoint::Failpoint;
pub use relay::{Counters, OrderMode, Relay, RelayConfig, RelayError};
pub use retention::Retention;
pub use sink::{Delivery, DeliveryError, PerSinkOptions, Sink, SinkError, SinkOptions};
pub use source::poll::CLAIM_FLOOR_SETTLE;
