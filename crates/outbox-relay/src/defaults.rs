//! Every default of a relay's settings, defined here once.
//!
//! [`RelayConfig::default`](crate::RelayConfig), [`Backoff::default`](crate::Backoff)
//! and [`WalSettings::default`](crate::WalSettings) are built from these,
//! and the CLI's flags default to them: its `default_value_t`s name them,
//! and where a flag's default is written for people (`"200ms"`, `"1MiB"`),
//! a test in `outbox-cli` parses `outbox relay` with no flags and compares
//! the whole resulting config with `RelayConfig::default()`.

use std::time::Duration;

/// `--batch-size`: rows claimed and delivered per transaction.
pub const BATCH_SIZE: u32 = 100;

/// `--max-attempts`: failed attempts after which a row is a dead letter.
/// None by default (`i32::MAX`, which no row reaches): the retry window
/// ([`RETRY_FOR`]) decides. Not the `outbox` crate's
/// `DEFAULT_MAX_ATTEMPTS` (5), which is the rule migration 0004 applied to
/// rows failed before dead letters were recorded.
pub const MAX_ATTEMPTS: i32 = i32::MAX;

/// `--retry-for`: how long a row is retried after its first failed
/// attempt; its first failure after that makes it a dead letter. A day,
/// as webhook platforms retry (Standard Webhooks: about a day). With the
/// default backoff that is 273 to 299 attempts (jitter decides): 11 in the
/// first 7 minutes (200 ms doubling), then one every 5 to 5.5 minutes.
pub const RETRY_FOR: Duration = Duration::from_secs(24 * 60 * 60);

/// `--backoff-base`: the delay after a row's first failed attempt.
pub const BACKOFF_BASE: Duration = Duration::from_millis(200);

/// `--backoff-max`: the cap on a row's retry delay, and on the
/// `Retry-After` a row or a breaker's probe waits for.
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);

/// `--poll-interval` with NOTIFY: only a fallback.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);

/// `--poll-interval` with `--no-notify`: then it is the delivery latency.
pub const POLL_INTERVAL_WITHOUT_NOTIFY: Duration = Duration::from_secs(1);

/// `--connect-timeout`: how long to keep trying PostgreSQL at startup.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `--lease-timeout`: how soon a dead relay's partitions move to the others.
pub const LEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// `--max-event-bytes`: 1 MiB, NATS's default `max_payload` and Kafka's
/// default `message.max.bytes`.
pub const MAX_EVENT_BYTES: u64 = 1024 * 1024;

/// `--batch-max-bytes`: 16 MiB, a hundred events of 160 kB.
pub const BATCH_MAX_BYTES: u64 = 16 * 1024 * 1024;

/// `--claim-timeout`: six times the sinks' default timeout.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(60);

/// `--pooler`: nothing between the relay and PostgreSQL, or a session-mode
/// pool; the relay prepares its statements once per session.
pub const POOLER: crate::config::Pooler = crate::config::Pooler::None;

/// `--wal-window`: events read whose position the server was not sent.
pub const WAL_WINDOW: u32 = 5000;

/// `--wal-retained-warn`: 1 GiB of WAL held back by the slot.
pub const WAL_RETAINED_WARN: u64 = 1 << 30;
