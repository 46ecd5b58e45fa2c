-- Lease claims (`outbox relay --claim lease`): a relay claims a batch in a
-- short transaction by writing who holds it and until when, commits, and
-- delivers with no transaction open. The claim also moves next_attempt_at
-- to the same deadline, so the claim's walk of the partial index skips a
-- held row like any row not yet due, and finds it due again once the claim
-- expired: no second index, no scan of claimed rows to find expired ones.
-- The mark that follows delivery matches on (claimed_by, claimed_until),
-- so a relay whose claim expired and was taken cannot mark rows it lost.
ALTER TABLE {table} ADD COLUMN claimed_until timestamptz, ADD COLUMN claimed_by uuid;
