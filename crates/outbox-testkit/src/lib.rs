//! # outbox-testkit
//!
//! Throwaway real services for the outbox's tests and for `outbox-lab`
//! (its demo, lab, bench and soak; the production binary `outbox` never
//! links this crate): nothing is mocked, everything is started fresh on
//! 127.0.0.1 and a free port, and vanishes when its value is dropped.
//!
//! | item | owns |
//! |---|---|
//! | [`Postgres`], [`PgSettings`] | a PostgreSQL cluster: start (with TLS, a `pg_hba.conf` of its own), fresh databases, stop, crash, restart |
//! | [`Replication`] | a streaming standby of a cluster ([`Postgres::start_standby`], synchronous or not) and its promotion: a failover |
//! | [`PgBouncer`], [`PoolMode`] | a PgBouncer in front of a [`Postgres`], session or transaction pooling: start, kill, restart |
//! | [`Redis`] | a redis-server without persistence: start, stop, restart |
//! | [`Nats`] | a nats-server with JetStream and its own store: start, stop, restart |
//! | [`Kafka`] | a Kafka-protocol broker (tansu) with its own store: start, stop, restart |
//! | [`Moto`] | an AWS emulator (moto) for SQS and SNS whose state survives a restart: start, stop, restart |
//! | [`RabbitMq`] | a private RabbitMQ node: start, stop, restart |
//! | [`Receiver`], [`Respond`], [`Post`] | an HTTP endpoint that records POSTs and answers as scripted |
//! | [`OtlpReceiver`], [`ReceivedSpan`] | an OTLP/HTTP trace receiver (`POST /v1/traces`, protobuf) that keeps every span |
//! | [`Spawned`] | a child process: captured output lines, optionally a `NOTIFY_SOCKET`; signal, wait, kill (what it started too) on drop. Every server above runs in one |
//! | [`Notifications`] | a `NOTIFY_SOCKET` to wait on: `READY=1`, `OUTBOX_FAILPOINT=… reached` |
//! | [`conformance`] | the scenarios every sink passes, and the sinks that run them |
//! | [`free_port`] | a port nobody listens on |
//! | [`Error`] | what went wrong, and what was being done |
//!
//! It depends on no test framework, so production binaries (the demo) can
//! use it. Everything is async on tokio and must run inside a runtime.
//!
//! Environment:
//!
//! | variable | effect |
//! |---|---|
//! | `OUTBOX_MOTO_SERVER` | the `moto_server` script [`Moto`] runs, with the Python its `#!` line names (default: one written by pip on `PATH`, else `~/.cache/outbox-tools/moto/bin/moto_server`) |
//! | `OUTBOX_TANSU` | the tansu binary [`Kafka`] runs (default: `tansu` on `PATH`, else `~/.cache/outbox-tools/bin/tansu`) |
//! | `OUTBOX_PG_BIN` | directory holding `initdb` and `postgres` |
//! | `OUTBOX_TESTKIT_TMPDIR` | where clusters and the initdb template go (default: `TMPDIR`, else `/dev/shm` when it has 1 GiB free, else `/tmp`) |
//! | `OUTBOX_TESTKIT_ECHO` | echo [`Spawned`] output to stderr |
//!
//! ```no_run
//! # async fn run() -> Result<(), outbox_testkit::Error> {
//! use outbox_testkit::Postgres;
//!
//! let mut pg = Postgres::start().await?;
//! let url = pg.fresh_database().await?;
//! pg.kill()?; // a crash
//! pg.restart().await?; // crash recovery; same port, same data
//! # let _ = url; Ok(()) }
//! ```

pub mod conformance;
mod error;
pub mod kafka;
pub mod moto;
mod nats;
mod notify;
mod otlp;
mod pgbouncer;
mod postgres;
mod rabbitmq;
mod receiver;
mod redis;
mod spawned;
mod standby;
mod support;

pub use error::Error;
pub use kafka::Kafka;
pub use moto::Moto;
pub use nats::Nats;
pub use notify::Notifications;
pub use otlp::{OtlpReceiver, ReceivedSpan};
pub use pgbouncer::{PgBouncer, PoolMode};
pub use postgres::{PgSettings, Postgres};
pub use rabbitmq::RabbitMq;
pub use receiver::{Post, Receiver, Respond};
pub use redis::Redis;
pub use spawned::Spawned;
pub use standby::Replication;

/// A TCP port on 127.0.0.1 that nobody listens on right now: binds port 0,
/// reads the port the kernel chose, and releases it. Someone else may take
/// it before you bind it.
///
/// # Panics
///
/// If binding 127.0.0.1:0 fails, which means the machine has no usable
/// loopback interface.
pub fn free_port() -> u16 {
    support::try_free_port().expect("binding 127.0.0.1:0 works on any machine with a loopback interface")
}
