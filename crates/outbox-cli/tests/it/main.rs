//! Integration tests of the `outbox` library, relay and CLI against real
//! PostgreSQL, Redis and HTTP receivers started by the testkit. One binary
//! for the whole crate to save link time.

#![allow(unreachable_pub, missing_docs)]

mod admin;
mod amqp;
mod cli;
mod config;
mod conformance;
mod consume;
mod crash;
mod deploy;
mod formats;
mod idle;
#[cfg(feature = "kafka")]
mod kafka;
mod lab;
mod lease;
mod logs;
mod memory;
mod metrics;
mod nats;
mod ordering;
mod outage;
mod partitions;
mod relay;
mod replay;
mod retention;
mod retry;
mod routing;
mod scale;
mod soak;
mod support;
mod tls;
mod wal;
mod wal_ops;
mod webhooks;
