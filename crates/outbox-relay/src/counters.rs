//! Running totals of a relay, shared with whoever started it (the CLI's
//! drain summary, the bench, tests that wait on progress instead of logs).

use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;

/// Running totals, readable while the relay runs.
#[derive(Debug, Default)]
pub struct Counters {
    /// Rows marked published.
    pub delivered: AtomicU64,
    /// Failed delivery attempts (held-back rows not included).
    pub failed: AtomicU64,
    /// Rows that became dead letters.
    pub dead_lettered: AtomicU64,
    /// Batches committed with at least one row.
    pub batches: AtomicU64,
    /// Why a `drain` relay stopped early: its sink (or a route's) was
    /// unavailable, with due rows left undelivered.
    pub sink_unavailable: OnceLock<String>,
}
