//! The testkit against the real programs: PostgreSQL, PgBouncer, redis-server,
//! nats-server, rabbitmq-server, an HTTP client and `sh`. Every wait is bounded.

mod nats;
mod notify;
mod pgbouncer;
mod postgres;
mod rabbitmq;
mod receiver;
mod redis;
mod spawned;

use std::time::Duration;

/// The bound on any single wait in these tests.
pub const LONG: Duration = Duration::from_secs(60);
