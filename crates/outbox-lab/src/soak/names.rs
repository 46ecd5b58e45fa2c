//! The soak's names: its schema, its two outboxes (one polled, one
//! log-tailed) with their channels and streams, and the aggregate types.

use super::schedule::Src;

/// Where the soak works; dropped at the end when it runs on a given
/// `DATABASE_URL`.
pub(crate) const SCHEMA: &str = "outbox_soak";

/// The aggregate types: the polling relays hold the first to `partition`
/// order and the second to `strict`.
pub(crate) const TYPES: [&str; 2] = ["orders", "payments"];

pub(crate) fn table(src: Src) -> &'static str {
    match src {
        Src::Poll => "poll_outbox",
        Src::Wal => "wal_outbox",
    }
}

pub(crate) fn channel(src: Src) -> &'static str {
    match src {
        Src::Poll => "outbox_soak_poll",
        Src::Wal => "outbox_soak_wal",
    }
}

/// The relays' `--stream-prefix`.
pub(crate) fn prefix(src: Src) -> String {
    format!("soak.{}", src.name())
}

/// The stream a relay of `src` writes events of `aggregate_type` to.
pub(crate) fn stream(src: Src, aggregate_type: &str) -> String {
    format!("{}.{aggregate_type}", prefix(src))
}

/// The outbox of `src`.
pub(crate) fn config(src: Src) -> anyhow::Result<outbox::Config> {
    Ok(outbox::Config::new(SCHEMA, table(src))?.with_channel(channel(src))?)
}

/// Rows of `src`'s outbox still to deliver: unpublished and not dead
/// (the WAL source deletes what it delivered).
pub(crate) fn waiting(src: Src) -> String {
    match src {
        Src::Poll => format!(
            "SELECT count(*) FROM {SCHEMA}.{} WHERE published_at IS NULL AND dead_at IS NULL",
            table(src)
        ),
        Src::Wal => format!(
            "SELECT count(*) FROM {SCHEMA}.{} WHERE dead_at IS NULL",
            table(src)
        ),
    }
}

/// `$1` slot, `$2` an LSN as text: whether the slot confirmed it (its
/// relays delivered everything written before).
pub(crate) const CONFIRMED: &str = "SELECT coalesce(bool_or(confirmed_flush_lsn >= $2::text::pg_lsn), false) \
     FROM pg_replication_slots WHERE slot_name = $1";
