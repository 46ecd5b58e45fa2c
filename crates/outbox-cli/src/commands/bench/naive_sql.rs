//! The statements of the two baselines `outbox bench` measures the relay
//! against, not the library's contract: the floor (claim and mark in one
//! autocommit statement, no sink) and the naive relay (a locking read, then
//! one UPDATE per row, as the reference relay marks).

use outbox::Config;

/// The rendered statements for the bench's table.
pub(super) struct NaiveSql {
    /// `$1` batch size. Claim and mark in one statement; same index as the
    /// relay's claim.
    pub(super) claim_and_mark: String,
    /// `$1` max attempts, `$2` batch size. The claim as a plain locking read.
    pub(super) select_batch: String,
    /// `$1` id. Primary key lookup.
    pub(super) mark_one: String,
}

impl NaiveSql {
    pub(super) fn new(config: &Config) -> Self {
        let t = config.qualified();
        Self {
            claim_and_mark: format!(
                "UPDATE {t} SET published_at = clock_timestamp() WHERE id IN ( \
                   SELECT id FROM {t} WHERE published_at IS NULL AND next_attempt_at <= clock_timestamp() \
                    ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            select_batch: format!(
                "SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts \
                   FROM {t} WHERE published_at IS NULL AND next_attempt_at <= clock_timestamp() AND attempts < $1 \
                  ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED"
            ),
            mark_one: format!("UPDATE {t} SET published_at = clock_timestamp() WHERE id = $1"),
        }
    }
}
