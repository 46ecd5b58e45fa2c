//! The statements of the naive relays the bench compares the relay against:
//! the floor (claim and mark in one statement, no sink) and the reference
//! relay's shape (claim a batch, then mark row by row). They are the
//! bench's baselines, not the library's contract: the relay's own
//! statements are `outbox::sql`'s, and these may drift from them only in
//! ways the baselines are meant to show.

use outbox::Config;

/// Columns in the order `outbox::OutboxRow::try_from` reads them.
const ROW_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, first_failed_at";

/// `$1` limit. The reference relay's claim: a batch of due rows that are
/// not dead letters, locked for the transaction, in id order. It names
/// `dead_at` so it walks the same partial index as the relay's claim.
const SELECT_BATCH: &str = "SELECT {cols} FROM {t} \
      WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= clock_timestamp() \
      ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";

/// `$1` limit. Claim and mark in one statement with no sink in between:
/// the floor any relay's claim and mark cost.
const CLAIM_AND_MARK: &str = "UPDATE {t} SET published_at = clock_timestamp() WHERE id IN ( \
        SELECT id FROM {t} WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= clock_timestamp() \
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)";

/// `$1` id. One row at a time, as the reference relay marks. Primary key
/// lookup.
const MARK_ONE: &str = "UPDATE {t} SET published_at = clock_timestamp() WHERE id = $1";

/// The baselines' statements for one outbox table.
pub(super) struct NaiveSql {
    pub(super) select_batch: String,
    pub(super) claim_and_mark: String,
    pub(super) mark_one: String,
}

impl NaiveSql {
    pub(super) fn new(config: &Config) -> Self {
        let t = config.qualified();
        let render = |template: &str| template.replace("{cols}", ROW_COLUMNS).replace("{t}", &t);
        Self {
            select_batch: render(SELECT_BATCH),
            claim_and_mark: render(CLAIM_AND_MARK),
            mark_one: render(MARK_ONE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::NaiveSql;

    #[test]
    fn renders_the_table_and_no_placeholders() {
        let sql = NaiveSql::new(&outbox::Config::new("app", "events").unwrap());
        for s in [&sql.select_batch, &sql.claim_and_mark, &sql.mark_one] {
            assert!(s.contains("\"app\".\"events\""), "{s}");
            assert!(!s.contains('{'), "{s}");
        }
    }
}
