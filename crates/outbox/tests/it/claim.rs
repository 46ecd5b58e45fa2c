//! The relay's claims through the typed seam, on leases set by hand: what a
//! batch takes, in which order, and what a partition that moved leaves out.

use outbox::Config;
use outbox::sql::{ClaimParams, ClaimScope, OutboxSql, Partitions, RelayStatements};
use tokio_postgres::Client;
use uuid::Uuid;

use crate::support::{Db, connect};

const ME: Uuid = Uuid::from_u128(1);
const OTHER: Uuid = Uuid::from_u128(2);

/// The partition of `aggregate_id` among 64, as the claim computes it.
async fn partition_of(db: &Db, aggregate_id: &str) -> i32 {
    db.client
        .query_one(
            "SELECT ((hashtextextended($1, 0) % 64 + 64) % 64)::int4",
            &[&aggregate_id],
        )
        .await
        .unwrap()
        .get(0)
}

/// 40 events over aggregates a0..a9 in id order; every lease is ours but
/// `a3`'s, which another relay holds.
async fn setup() -> (Db, i32) {
    let db = Db::start().await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'orders', 'a' || (g % 10), 'E', '{}' FROM generate_series(0, 39) g;",
        )
        .await
        .unwrap();
    let theirs = partition_of(&db, "a3").await;
    db.client
        .execute(
            "UPDATE outbox_leases SET owner = CASE WHEN partition = $1 THEN $2::uuid ELSE $3::uuid END",
            &[&theirs, &OTHER, &ME],
        )
        .await
        .unwrap();
    (db, theirs)
}

async fn claim(client: &Client, s: &RelayStatements, limit: i64, claimable: &[i32]) -> Vec<String> {
    let p = ClaimParams {
        types: &[],
        deadline: None,
        floor: 0,
        limit,
        max_bytes: i64::MAX,
        scope: ClaimScope::Partitions(Partitions {
            relay_id: ME,
            claimable,
            count: 64,
            strict: None,
        }),
    };
    s.claim(client, &p)
        .await
        .unwrap()
        .rows
        .into_iter()
        .map(|r| format!("{}:{}", r.id, r.aggregate_id))
        .collect()
}

/// Batches of 1, one of ours in flight on another connection at a time, take
/// what one large batch takes, in id order. Under a stale view (it still
/// lists `a3`'s partition) the large claim takes nothing (all or nothing,
/// until the next tick) and a batch of 1 never takes a row of `a3`.
#[tokio::test]
async fn few_and_all_partition_claims_take_the_same_rows_and_skip_a_moved_partition() {
    let (db, theirs) = setup().await;
    let sql = OutboxSql::new(&Config::default());
    let every: Vec<i32> = (0..64).collect();
    let mine: Vec<i32> = every.iter().copied().filter(|p| *p != theirs).collect();
    let (a, b) = (connect(&db.url).await, connect(&db.url).await);
    let (sa, sb) = (
        sql.prepare_relay(&a).await.unwrap(),
        sql.prepare_relay(&b).await.unwrap(),
    );

    a.batch_execute("BEGIN").await.unwrap();
    assert_eq!(claim(&a, &sa, 64, &every).await, Vec::<String>::new());
    let all = claim(&a, &sa, 64, &mine).await;
    a.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(all.len(), 36, "{all:?}");
    assert!(all.iter().all(|r| !r.ends_with(":a3")), "{all:?}");

    // Batches of 1, two in flight at a time as the relay pipelines them:
    // together they take the same rows, in id order.
    let mut ones = Vec::new();
    let mut open = false;
    for i in 0.. {
        let (c, s) = if i % 2 == 0 { (&a, &sa) } else { (&b, &sb) };
        c.batch_execute("BEGIN").await.unwrap();
        let batch = claim(c, s, 1, &mine).await;
        let other = if i % 2 == 0 { &b } else { &a };
        if open {
            other.batch_execute("COMMIT").await.unwrap();
        }
        open = true;
        if batch.is_empty() {
            c.batch_execute("COMMIT").await.unwrap();
            break;
        }
        assert_eq!(batch.len(), 1, "a batch of 1 with one in flight is full");
        ones.extend(batch);
    }
    assert_eq!(ones, all);
    db.client
        .execute("UPDATE outbox SET published_at = NULL", &[])
        .await
        .unwrap();
    for _ in 0..5 {
        a.batch_execute("BEGIN").await.unwrap();
        let stale = claim(&a, &sa, 1, &every).await;
        assert!(stale.iter().all(|r| !r.ends_with(":a3")), "{stale:?}");
        a.batch_execute("COMMIT").await.unwrap();
    }
    db.client
        .execute(
            "UPDATE outbox SET published_at = now() WHERE aggregate_id <> 'a3'",
            &[],
        )
        .await
        .unwrap();
    let left: i64 = db
        .client
        .query_one("SELECT count(*) FROM outbox WHERE published_at IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 4, "a3's four events stay for the relay that holds it");
}

/// While a batch of 1 is in flight, its partition's lease is locked: the
/// owner change another relay's tick would make waits for it.
#[tokio::test]
async fn a_batch_of_one_holds_its_partitions_lease_until_it_ends() {
    let (db, _) = setup().await;
    let sql = OutboxSql::new(&Config::default());
    let every: Vec<i32> = (0..64).collect();
    let a = connect(&db.url).await;
    let sa = sql.prepare_relay(&a).await.unwrap();
    a.batch_execute("BEGIN").await.unwrap();
    let batch = claim(&a, &sa, 1, &every).await;
    let aggregate = batch[0].split(':').nth(1).unwrap().to_owned();
    let held = partition_of(&db, &aggregate).await;

    let tick = connect(&db.url).await;
    tick.batch_execute("SET lock_timeout = '200ms'").await.unwrap();
    let moved = tick
        .execute(
            "UPDATE outbox_leases SET owner = $2 WHERE partition = $1",
            &[&held, &OTHER],
        )
        .await;
    assert!(moved.is_err(), "the lease moved under a batch in flight");
    // A partition the batch does not touch is not locked.
    let free = (0..64).find(|p| *p != held).unwrap();
    tick.execute(
        "UPDATE outbox_leases SET owner = $2 WHERE partition = $1",
        &[&free, &OTHER],
    )
    .await
    .unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    tick.execute(
        "UPDATE outbox_leases SET owner = $2 WHERE partition = $1",
        &[&held, &OTHER],
    )
    .await
    .unwrap();
}

/// Six events of about 100 kB each: odd ids compress, even ids do not.
async fn six_large_events(db: &Db) {
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'orders', 'a' || g, 'E', jsonb_build_object('p', CASE WHEN g % 2 = 1
                 THEN repeat('x', 100000)
                 ELSE (SELECT string_agg(md5(g::text || ':' || h), '') FROM generate_series(1, 3125) h) END)
               FROM generate_series(1, 6) g;",
        )
        .await
        .unwrap();
}

/// A claim of any row, at most `limit` rows and `max_bytes` payload bytes.
fn any_row(limit: i64, max_bytes: i64) -> ClaimParams<'static> {
    ClaimParams {
        types: &[],
        deadline: None,
        floor: 0,
        limit,
        max_bytes,
        scope: ClaimScope::All,
    }
}

/// Ids and cut flag of a claim of any row, at most `limit` rows and
/// `max_bytes` payload bytes.
async fn claim_bytes(c: &Client, s: &RelayStatements, limit: i64, max_bytes: i64) -> (Vec<i64>, bool) {
    let claimed = s.claim(c, &any_row(limit, max_bytes)).await.unwrap();
    (claimed.rows.iter().map(|r| r.id).collect(), claimed.cut)
}

/// The byte bound takes the longest prefix that fits and always the first
/// row, whether payloads are stored compressed (a repeated string) or not
/// (hex digits of hashes); rows past the cut stay locked, unmarked, until
/// the claim's transaction ends, and are claimed next.
#[tokio::test]
async fn a_claim_takes_rows_while_their_payloads_fit_and_always_the_first() {
    let db = Db::start().await;
    six_large_events(&db).await;
    let compressed = db
        .count("SELECT count(*) FROM outbox WHERE pg_column_compression(payload) IS NOT NULL")
        .await;
    assert_eq!(compressed, 3, "the repeated payloads are stored compressed");
    let sql = OutboxSql::new(&Config::default());
    let (a, b) = (connect(&db.url).await, connect(&db.url).await);
    let (sa, sb) = (
        sql.prepare_relay(&a).await.unwrap(),
        sql.prepare_relay(&b).await.unwrap(),
    );

    a.batch_execute("BEGIN").await.unwrap();
    assert_eq!(claim_bytes(&a, &sa, 100, 250_000).await, (vec![1, 2], true));
    // Rows 3 to 6 are locked by the cut claim: another claim skips them.
    b.batch_execute("BEGIN").await.unwrap();
    assert_eq!(claim_bytes(&b, &sb, 100, 250_000).await, (vec![], false));
    b.batch_execute("ROLLBACK").await.unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    let marked = db
        .count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
        .await;
    assert_eq!(marked, 2, "only the rows returned are marked");

    // Over the bound on its own, the first row still goes, alone.
    a.batch_execute("BEGIN").await.unwrap();
    assert_eq!(claim_bytes(&a, &sa, 100, 1_000).await, (vec![3], true));
    a.batch_execute("COMMIT").await.unwrap();
    // Everything fits: not cut.
    a.batch_execute("BEGIN").await.unwrap();
    assert_eq!(claim_bytes(&a, &sa, 100, 1_000_000).await, (vec![4, 5, 6], false));
    a.batch_execute("COMMIT").await.unwrap();
}

/// [`RelayStatements::claim_whole_first`] (unprepared, as a fleet claims):
/// `claim`'s ids and cut flag at every step, whether the batch fits whole
/// (its leaner claim takes it) or not (compressed or too large: `CUT`
/// decides, in the same transaction, over rows the first try locked).
async fn claim_whole_first(c: &Client, s: &RelayStatements, max_bytes: i64) -> (Vec<i64>, bool) {
    let claimed = s.claim_whole_first(c, &any_row(100, max_bytes)).await.unwrap();
    (claimed.rows.iter().map(|r| r.id).collect(), claimed.cut)
}

/// Which statement of its transaction (`cmin`, from 0) marked the batch
/// `claim_whole_first` takes now (in a transaction rolled back): 0 when the
/// leaner claim took it, 1 when it locked the rows and `CUT` decided.
async fn marked_by(c: &Client, s: &RelayStatements, max_bytes: i64) -> i64 {
    s.begin(c).await.unwrap();
    let claimed = s.claim_whole_first(c, &any_row(100, max_bytes)).await.unwrap();
    assert!(!claimed.rows.is_empty());
    let command = c
        .query_one(
            "SELECT max(cmin::text::int8) FROM outbox WHERE xmin::text = pg_current_xact_id()::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    c.batch_execute("ROLLBACK").await.unwrap();
    command
}

#[tokio::test]
async fn a_claim_tried_whole_first_takes_what_the_byte_bound_takes() {
    let db = Db::start().await;
    six_large_events(&db).await;
    let sql = OutboxSql::new(&Config::default());
    let (a, b) = (connect(&db.url).await, connect(&db.url).await);
    let idle = std::time::Duration::from_secs(60);
    let (sa, sb) = (
        sql.unprepared_relay(idle).await.unwrap(),
        sql.unprepared_relay(idle).await.unwrap(),
    );

    sa.begin(&a).await.unwrap();
    assert_eq!(claim_whole_first(&a, &sa, 250_000).await, (vec![1, 2], true));
    sb.begin(&b).await.unwrap();
    assert_eq!(claim_whole_first(&b, &sb, 250_000).await, (vec![], false));
    b.batch_execute("ROLLBACK").await.unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    sa.begin(&a).await.unwrap();
    assert_eq!(claim_whole_first(&a, &sa, 1_000).await, (vec![3], true));
    a.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        marked_by(&a, &sa, 1_000_000).await,
        1,
        "compressed: `CUT` decides"
    );
    sa.begin(&a).await.unwrap();
    assert_eq!(
        claim_whole_first(&a, &sa, 1_000_000).await,
        (vec![4, 5, 6], false)
    );
    a.batch_execute("COMMIT").await.unwrap();

    // Small payloads, stored as they are: whole when they fit, else cut.
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'orders', 'b' || g, 'E', jsonb_build_object('n', g) FROM generate_series(7, 10) g;",
        )
        .await
        .unwrap();
    assert_eq!(marked_by(&a, &sa, 1_000_000).await, 0, "fits whole: one claim");
    assert_eq!(marked_by(&a, &sa, 10).await, 1, "too large whole: `CUT` decides");
    sa.begin(&a).await.unwrap();
    assert_eq!(claim_whole_first(&a, &sa, 10).await, (vec![7], true));
    sb.begin(&b).await.unwrap();
    assert_eq!(
        claim_whole_first(&b, &sb, 1_000_000).await,
        (vec![], false),
        "8 to 10 stay locked"
    );
    b.batch_execute("ROLLBACK").await.unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    sa.begin(&a).await.unwrap();
    assert_eq!(
        claim_whole_first(&a, &sa, 1_000_000).await,
        (vec![8, 9, 10], false)
    );
    sb.begin(&b).await.unwrap();
    assert_eq!(claim_whole_first(&b, &sb, 1_000_000).await, (vec![], false));
    b.batch_execute("ROLLBACK").await.unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    let marked = db
        .count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
        .await;
    assert_eq!(marked, 10, "every row returned is marked, once");
    sa.begin(&a).await.unwrap();
    assert_eq!(claim_whole_first(&a, &sa, 1_000_000).await, (vec![], false));
    a.batch_execute("COMMIT").await.unwrap();
}

/// A payload over `LARGE_PAYLOAD` is read in pieces and comes back equal,
/// multibyte characters included, compressed or not.
#[tokio::test]
async fn a_large_payload_is_read_in_pieces_and_arrives_whole() {
    let db = Db::start().await;
    let big = outbox::sql::LARGE_PAYLOAD as usize * 3 + 17;
    let plain: String = (0..big).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    let payloads = [
        serde_json::json!({"blob": "é".repeat(big / 2), "n": 1}),
        serde_json::json!({"blob": plain, "list": [1, 2, 3]}),
    ];
    for p in &payloads {
        let event = outbox::Event::new("files", "f", "Stored", p.clone());
        outbox::enqueue(&db.client, &event).await.unwrap();
    }
    let sql = OutboxSql::new(&Config::default());
    let a = connect(&db.url).await;
    let sa = sql.prepare_relay(&a).await.unwrap();
    a.batch_execute("BEGIN").await.unwrap();
    let p = ClaimParams {
        types: &[],
        deadline: None,
        floor: 0,
        limit: 10,
        max_bytes: i64::MAX,
        scope: ClaimScope::All,
    };
    let claimed = sa.claim(&a, &p).await.unwrap();
    a.batch_execute("ROLLBACK").await.unwrap();
    let got: Vec<&serde_json::Value> = claimed.rows.iter().map(|r| &r.payload).collect();
    assert_eq!(got, payloads.iter().collect::<Vec<_>>());
    // Claims of one row have a statement of their own (no byte bound).
    let one = ClaimParams { limit: 1, ..p };
    for expected in &payloads {
        a.batch_execute("BEGIN").await.unwrap();
        let claimed = sa.claim(&a, &one).await.unwrap();
        a.batch_execute("COMMIT").await.unwrap();
        assert_eq!(claimed.rows.len(), 1);
        assert_eq!(&claimed.rows[0].payload, expected);
    }
}

/// A deadline claim by `owner` over every partition (the lease rows must name
/// it), in its own transaction: the claimed rows as `id:aggregate`, and the
/// fence its mark needs.
async fn lease_claim(
    client: &Client,
    s: &RelayStatements,
    owner: Uuid,
    limit: i64,
    timeout_ms: f64,
) -> (Vec<String>, Vec<i64>, Option<outbox::sql::Fence>) {
    let every: Vec<i32> = (0..64).collect();
    let p = ClaimParams {
        types: &[],
        deadline: Some(outbox::sql::DeadlineClaim { owner, timeout_ms }),
        floor: 0,
        limit,
        max_bytes: i64::MAX,
        scope: ClaimScope::Partitions(Partitions {
            relay_id: owner,
            claimable: &every,
            count: 64,
            strict: None,
        }),
    };
    let claimed = s.claim(client, &p).await.unwrap();
    let names = claimed
        .rows
        .iter()
        .map(|r| format!("{}:{}", r.id, r.aggregate_id))
        .collect();
    let ids = claimed.rows.iter().map(|r| r.id).collect();
    (names, ids, claimed.fence)
}

/// Deadline claims (`--claim deadline`): no transaction spans the delivery, so the
/// partitions can move while a batch is out. The new owner's claim skips
/// aggregates with an earlier event under a live claim (order), takes them
/// once the claim expired, and the old holder's mark then touches nothing
/// (fencing).
#[tokio::test]
async fn lease_claims_keep_aggregates_behind_live_claims_and_fence_expired_ones() {
    let (db, _) = setup().await;
    let spec = outbox::sql::ClaimSpec {
        deadline: true,
        types: None,
    };
    let sql = OutboxSql::with_claims(&Config::default(), spec);
    let (a, b) = (connect(&db.url).await, connect(&db.url).await);
    let (sa, sb) = (
        sql.prepare_relay(&a).await.unwrap(),
        sql.prepare_relay(&b).await.unwrap(),
    );
    let set_owner = async |owner: Uuid| {
        db.client
            .execute("UPDATE outbox_leases SET owner = $1", &[&owner])
            .await
            .unwrap();
    };
    set_owner(ME).await;
    // ME claims a0..a4's first events, for a minute, and commits at once.
    let (mine, my_ids, fence) = lease_claim(&a, &sa, ME, 5, 60_000.0).await;
    let fence = fence.expect("a deadline claim returns its fence");
    assert_eq!(mine.len(), 5, "{mine:?}");
    assert_eq!(fence.owner, ME);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL AND state LIKE 'idle in%'"
        )
        .await,
        0,
        "no transaction stays open"
    );

    // The partitions move to OTHER while ME's batch is out: OTHER takes
    // nothing of a0..a4 (their first events are claimed), all of a5..a9.
    set_owner(OTHER).await;
    let (theirs, _, _) = lease_claim(&b, &sb, OTHER, 40, 60_000.0).await;
    assert_eq!(theirs.len(), 20, "{theirs:?}");
    for held in ["a0", "a1", "a2", "a3", "a4"] {
        assert!(
            theirs.iter().all(|r| !r.ends_with(&format!(":{held}"))),
            "{held} stays behind ME's live claim: {theirs:?}"
        );
    }

    // ME's mark under its live claim publishes its five.
    fn marks(delivered: &[i64], fence: outbox::sql::Fence) -> outbox::sql::DeadlineMarks<'_> {
        outbox::sql::DeadlineMarks {
            failed: outbox::sql::MarkFailedParams {
                ids: &[],
                errors: &[],
                attempts: &[],
                delay_ms: &[],
                dead: &[],
            },
            delivered,
            fence,
        }
    }
    assert_eq!(
        sa.mark_deadline_claim(&a, &marks(&my_ids, fence)).await.unwrap(),
        (5, 0)
    );

    // Fencing: ME claims the next five for 1 ms; the claim expires, OTHER
    // takes and publishes them, and ME's late mark changes nothing.
    set_owner(ME).await;
    let (late, late_ids, late_fence) = lease_claim(&a, &sa, ME, 5, 1.0).await;
    assert_eq!(late.len(), 5, "{late:?}");
    db.client.batch_execute("SELECT pg_sleep(0.01)").await.unwrap();
    set_owner(OTHER).await;
    let (taken, taken_ids, taken_fence) = lease_claim(&b, &sb, OTHER, 5, 60_000.0).await;
    assert_eq!(taken, late, "the expired claim's rows, taken over");
    assert_eq!(
        sb.mark_deadline_claim(&b, &marks(&taken_ids, taken_fence.unwrap()))
            .await
            .unwrap(),
        (5, 0)
    );
    let marks_of_late = async || -> Vec<String> {
        let rows = db
            .client
            .query(
                "SELECT published_at::text FROM outbox WHERE id = ANY($1) ORDER BY id",
                &[&late_ids],
            )
            .await
            .unwrap();
        rows.iter().map(|r| r.get(0)).collect()
    };
    let before = marks_of_late().await;
    assert_eq!(
        sa.mark_deadline_claim(&a, &marks(&late_ids, late_fence.unwrap()))
            .await
            .unwrap(),
        (0, 0),
        "the old holder marks nothing"
    );
    let after = marks_of_late().await;
    assert_eq!(before, after, "OTHER's marks stand");
}

/// `FIND_CLAIM_FLOOR` in one snapshot: the head is the first waiting, due
/// row from the floor (published rows, dead letters and rows not due yet
/// are passed), else one past the last row; the gap is the first id with no
/// visible row below the head (an open transaction's insert, a rolled-back
/// id), not looked for below the settled bound; with a gap come the
/// transactions in progress, the open one among them.
#[tokio::test]
async fn the_floor_statement_finds_the_head_and_the_first_gap() {
    let db = Db::start().await;
    let sql = OutboxSql::new(&Config::default());
    let c = connect(&db.url).await;
    let s = sql.prepare_relay(&c).await.unwrap();
    let insert = |n: i64| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'orders', 'a' || g, 'E', '{{}}' FROM generate_series(1, {n}) g"
        )
    };
    let floor = |from: i64, settled: i64| {
        let (c, s) = (&c, &s);
        async move {
            s.find_floor(c, &outbox::sql::FloorParams { from, settled })
                .await
                .unwrap()
        }
    };
    db.client.batch_execute(&insert(10)).await.unwrap();
    db.client
        .batch_execute("UPDATE outbox SET published_at = now() WHERE id <= 3")
        .await
        .unwrap();
    // Id 11 is taken by a transaction still open.
    let open = connect(&db.url).await;
    open.batch_execute(&format!("BEGIN; {}", insert(1)))
        .await
        .unwrap();
    let xid: i64 = open
        .query_one("SELECT pg_current_xact_id()::text::int8", &[])
        .await
        .unwrap()
        .get(0);
    db.client.batch_execute(&insert(2)).await.unwrap();

    // From 0: no id 0 is a gap (sequences start at 1), below head 4.
    let f = floor(0, 0).await;
    assert_eq!((f.head, f.gap), (4, Some(0)));
    assert!(f.in_progress.contains(&xid), "{f:?}");
    // From 1: ids 1 to 3 are there, published; no gap before 4.
    let f = floor(1, 0).await;
    assert_eq!((f.head, f.gap, f.in_progress.is_empty()), (4, None, true));

    // 4 published, 5 a dead letter, 6 to 10 not due yet, 12 published.
    db.client
        .batch_execute(
            "UPDATE outbox SET published_at = now() WHERE id IN (4, 7, 8, 9, 10, 12);
             UPDATE outbox SET dead_at = now(), attempts = 5 WHERE id = 5;
             UPDATE outbox SET next_attempt_at = now() + interval '1 hour' WHERE id = 6;",
        )
        .await
        .unwrap();
    let f = floor(4, 0).await;
    assert_eq!((f.head, f.gap), (13, Some(11)), "{f:?}");
    assert!(f.in_progress.contains(&xid));
    // Below the settled bound a missing id is not a gap.
    let f = floor(4, 12).await;
    assert_eq!((f.head, f.gap), (13, None));

    // Committed, the open row is the head: waiting and due.
    open.batch_execute("COMMIT").await.unwrap();
    let f = floor(4, 0).await;
    assert_eq!((f.head, f.gap), (11, None));

    // Nothing waiting from 11 on: one past the last row, past the dead
    // entries of the published ones.
    db.client
        .batch_execute("UPDATE outbox SET published_at = now() WHERE id IN (11, 13)")
        .await
        .unwrap();
    let f = floor(11, 0).await;
    assert_eq!((f.head, f.gap), (14, None));
    // An id rolled back at the end: a gap below nothing, so none.
    db.client
        .batch_execute(&format!("BEGIN; {}; ROLLBACK", insert(1)))
        .await
        .unwrap();
    let f = floor(14, 0).await;
    assert_eq!((f.head, f.gap), (14, None));
    // Past every row: the floor itself.
    assert_eq!(floor(100, 0).await.head, 100);
}
