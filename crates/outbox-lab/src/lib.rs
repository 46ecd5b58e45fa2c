//! `outbox lab` and `outbox bench`: the reference design's experiments and
//! the relay's measurements, run against throwaway services.
//!
//! - [`mod@lab`]: each experiment breaks something (a dual write, a crash before
//!   the mark, a watermark relay...) and reports `measure | ours | reference
//!   | verdict`, as text, JSON and one HTML page with plots;
//! - [`mod@bench`]: throughput, latency, idle cost and writer rate, each figure
//!   beside a baseline measured in the same run.
//!
//! Both work in one harness (`scratch`: a scratch schema, the throwaway
//! PostgreSQL and redis-server, the `outbox relay` child processes) and
//! render through one report module (`report`, with `plot` beside it).
//!
//! The relays and helper applications run as child processes of
//! [`std::env::current_exe`] (its `relay` and `lab --app` commands), so these
//! entry points are meant to be called from the `outbox` binary.
//!
//! Errors are [`anyhow::Error`]: this is a tool crate whose errors end up
//! printed by the CLI, not matched on. The one distinction the CLI needs (a
//! usage mistake, exit code 2) is a [`ConfigError`] somewhere in the chain.

pub mod bench;
pub mod lab;
mod latency;
mod plot;
mod report;
mod scratch;
pub mod soak;

use std::time::Duration;

pub use scratch::Database;

/// A usage mistake found by the lab or the bench itself (an unknown
/// experiment, a sink that is not Redis, a malformed `DATABASE_URL`): the
/// CLI exits 2 for it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// A humantime duration greater than zero, for the duration flags.
fn positive_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 200ms, 1s, 5m)"))?;
    if d.is_zero() {
        return Err("must be greater than zero".to_owned());
    }
    Ok(d)
}
