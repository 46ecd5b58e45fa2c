//! Integration tests of the `outbox` library, relay and CLI against real
//! PostgreSQL, Redis and HTTP receivers started by the testkit. One binary
//! for the whole crate to save link time.

#![allow(unreachable_pub, missing_docs)]

mod admin;
mod admin_api;
mod admin_events;
mod admin_fleet;
mod admin_ops;
mod amqp;
mod cli;
mod config;
mod conformance;
mod consume;
mod crash;
mod deadline_claim;
mod deploy;
mod failover;
mod fleet;
mod fleet_names;
mod fleet_ops;
mod fleet_split;
mod fleet_wal;
mod formats;
mod held_snapshot;
mod idle;
#[cfg(feature = "kafka")]
mod kafka;
mod logs;
mod memory;
mod metrics;
mod nats;
mod ordering;
mod outage;
mod partitions;
mod pgbouncer;
mod privileges;
mod relay;
mod replay;
mod replay_engine;
mod retention;
mod retry;
mod retry_window;
mod route_state;
mod routed_metrics;
mod routing;
mod scale;
mod secrets;
#[cfg(all(feature = "sqs", feature = "sns"))]
mod sqs;
#[cfg(all(feature = "sqs", feature = "sns"))]
mod sqs_claim_check;
mod support;
mod table_contract;
mod tls;
mod tracing;
mod wal;
mod wal_ops;
mod webhooks;
