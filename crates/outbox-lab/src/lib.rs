//! `outbox-lab`: the reference design's experiments, the relay's
//! measurements, the crash-consistency soak and the demo, run against
//! throwaway services. A binary of its own, so the production binary
//! `outbox` links neither this crate nor the testkit.
//!
//! - [`mod@lab`]: each experiment breaks something (a dual write, a crash before
//!   the mark, a watermark relay...) and reports `measure | ours | reference
//!   | verdict`, as text, JSON and one HTML page with plots;
//! - [`mod@bench`]: throughput, latency, idle cost and writer rate, each figure
//!   beside a baseline measured in the same run;
//! - [`mod@soak`]: writers, relays and consumers under a seeded storm of
//!   faults, every delivery checked against a ledger;
//! - [`mod@demo`]: the whole pattern end to end, printed as it happens.
//!
//! They work in one harness (`scratch`: a scratch schema, the throwaway
//! PostgreSQL and redis-server, the child processes) and render through
//! one report module (`report`, with `plot` beside it).
//!
//! The relays and the other commands measured run as child processes of
//! the production binary `outbox` (`OUTBOX_BIN`, else the `outbox` beside
//! this executable); the lab's own helpers (`lab --app`, the soak's doomed
//! writer) are children of [`std::env::current_exe`], so these entry
//! points are meant to be called from the `outbox-lab` binary.
//!
//! Errors are [`anyhow::Error`]: this is a tool crate whose errors end up
//! printed by the binary, not matched on. The one distinction it needs (a
//! usage mistake, exit code 2) is a [`ConfigError`] somewhere in the chain.

pub mod bench;
pub mod demo;
pub mod lab;
mod latency;
mod plot;
mod report;
mod scratch;
pub mod soak;

use std::time::Duration;

pub use scratch::Database;

/// A usage mistake found by the lab, the bench, the soak or the demo
/// itself (an unknown experiment, a sink that is not Redis, a malformed
/// `DATABASE_URL`, a server the soak was not told it owns, no `outbox`
/// binary): `outbox-lab` exits 2 for it.
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
