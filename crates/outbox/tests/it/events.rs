//! The console's event browsing (`EventsSql`): every statement variant's
//! plan is a walk of the index it names, in keyset order, with no Seq Scan
//! and no Sort, for the plan PostgreSQL keeps for a prepared statement
//! (generic) and for the values given (custom), on 20,000 rows in mixed
//! states; with that index dropped the same check fails. Then the pages
//! themselves: keyset paging both ways returns every matching row once,
//! and the scan bound stops a walk that finds few.

use chrono::{DateTime, Utc};
use outbox::sql::{AggregateQuery, EventFilter, EventState, EventsQuery, EventsSql, Keyset};
use outbox::{Config, Layout};
use serde_json::Value;
use tokio_postgres::Client;

use crate::support::{Db, connect};

/// 20,000 events: aggregates `a0`..`a498` of types orders/payments, event
/// types `E0`..`E6`, created a second apart; by `g % 10`: 0..=5 delivered,
/// 6 waiting, 7 retrying (`timeout`), 8 dead (`permanent: HTTP 422`), 9
/// given up (the same error).
const FILL: &str = "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, created_at, \
        published_at, attempts, last_error, next_attempt_at, dead_at, given_up_at) \
     SELECT CASE WHEN g % 3 = 0 THEN 'payments' ELSE 'orders' END, 'a' || (g % 499), 'E' || (g % 7), \
            jsonb_build_object('g', g), now() - (20000 - g) * interval '1 second', \
            CASE WHEN g % 10 <= 5 THEN now() END, \
            CASE WHEN g % 10 >= 7 THEN 3 ELSE 0 END, \
            CASE WHEN g % 10 = 7 THEN 'timeout' WHEN g % 10 >= 8 THEN 'permanent: HTTP 422' END, \
            now() + CASE WHEN g % 10 = 7 THEN interval '1 hour' ELSE interval '0' END, \
            CASE WHEN g % 10 >= 8 THEN now() END, CASE WHEN g % 10 = 9 THEN now() END \
       FROM generate_series(1, 20000) g";

async fn fill(client: &Client, table: &str) {
    client
        .batch_execute(&format!("{}; ANALYZE {table}", FILL.replace("{t}", table)))
        .await
        .unwrap();
}

/// Every node of a plan, depth first.
fn nodes(plan: &Value) -> Vec<&Value> {
    let mut out = vec![plan];
    for child in plan["Plans"].as_array().into_iter().flatten() {
        out.extend(nodes(child));
    }
    out
}

/// Ok if the plan walks one of `indexes` in `direction` (`Forward`,
/// `Backward`) and has no Seq Scan, Sort or bitmap scan; else what is
/// wrong, with the plan.
fn walks(explained: &Value, indexes: &[String], direction: &str) -> Result<(), String> {
    let plan = &explained[0]["Plan"];
    let all = nodes(plan);
    let bad: Vec<&str> = all
        .iter()
        .filter_map(|n| n["Node Type"].as_str())
        .filter(|t| ["Seq Scan", "Sort", "Incremental Sort", "Bitmap Heap Scan"].contains(t))
        .collect();
    let walk = all.iter().any(|n| {
        matches!(n["Node Type"].as_str(), Some("Index Scan" | "Index Only Scan"))
            && n["Index Name"]
                .as_str()
                .is_some_and(|i| indexes.iter().any(|x| x == i))
            && n["Scan Direction"] == direction
    });
    if bad.is_empty() && walk {
        Ok(())
    } else {
        Err(format!(
            "wanted a {direction} walk of {indexes:?}, no {bad:?}:\n{plan:#}"
        ))
    }
}

/// The indexes named `index` on the table: the index itself, and on a
/// partitioned table each partition's.
async fn index_names(client: &Client, index: &str) -> Vec<String> {
    let names: Vec<String> = client
        .query(
            "SELECT relid::regclass::text FROM pg_partition_tree($1::text::regclass)",
            &[&index],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0).trim_start_matches("public.").to_owned())
        .collect();
    // A plain table's index is no partition tree: itself alone.
    if names.is_empty() {
        vec![index.to_owned()]
    } else {
        names
    }
}

/// One statement variant: the list or aggregate query, the index it walks
/// and in which direction.
enum Case<'a> {
    List(EventsQuery<'a>, &'static str, &'static str),
    Aggregate(AggregateQuery<'a>, &'static str, &'static str),
}

fn list(filter: EventFilter<'_>, keyset: Keyset) -> EventsQuery<'_> {
    EventsQuery {
        filter,
        keyset,
        limit: 50,
        scan: outbox::sql::EVENTS_SCAN,
    }
}

fn cases(now: DateTime<Utc>) -> Vec<Case<'static>> {
    let every = EventFilter {
        aggregate_type: Some("orders"),
        event_type: Some("E3"),
        created_from: Some(now - chrono::Duration::hours(2)),
        created_before: Some(now),
        error_contains: Some("422"),
        ..EventFilter::default()
    };
    let state = |state| EventFilter {
        state: Some(state),
        ..EventFilter::default()
    };
    let mut out = Vec::new();
    for keyset in [Keyset::Start, Keyset::Before(15_000), Keyset::After(5_000)] {
        let dir = if matches!(keyset, Keyset::After(_)) {
            "Forward"
        } else {
            "Backward"
        };
        out.extend([
            Case::List(list(EventFilter::default(), keyset), "outbox_pkey", dir),
            Case::List(list(every, keyset), "outbox_pkey", dir),
            Case::List(list(state(EventState::Delivered), keyset), "outbox_pkey", dir),
            Case::List(
                list(state(EventState::Waiting), keyset),
                "outbox_unpublished_idx",
                dir,
            ),
            Case::List(
                list(
                    EventFilter {
                        state: Some(EventState::Retrying),
                        ..every
                    },
                    keyset,
                ),
                "outbox_unpublished_idx",
                dir,
            ),
            Case::List(list(state(EventState::Dead), keyset), "outbox_dead_idx", dir),
            Case::List(
                list(
                    EventFilter {
                        state: Some(EventState::GivenUp),
                        ..every
                    },
                    keyset,
                ),
                "outbox_dead_idx",
                dir,
            ),
            Case::List(
                list(
                    EventFilter {
                        aggregate_id: Some("a7"),
                        state: Some(EventState::Dead),
                        ..every
                    },
                    keyset,
                ),
                "outbox_by_aggregate_idx",
                dir,
            ),
        ]);
    }
    for (keyset, dir) in [
        (Keyset::Start, "Forward"),
        (Keyset::After(3_000), "Forward"),
        (Keyset::Before(3_000), "Backward"),
    ] {
        for aggregate_type in [None, Some("orders")] {
            out.push(Case::Aggregate(
                AggregateQuery {
                    aggregate_id: "a7",
                    aggregate_type,
                    keyset,
                    limit: 200,
                },
                "outbox_by_aggregate_idx",
                dir,
            ));
        }
    }
    out
}

/// Each case's plan, generic and custom, against its index; `Err` lists
/// every case whose plan is not the walk.
async fn check(client: &Client, sql: &EventsSql, only: Option<&str>) -> Result<usize, String> {
    let mut failed = Vec::new();
    let mut checked = 0;
    for case in cases(Utc::now()) {
        let index = match &case {
            Case::List(_, index, _) | Case::Aggregate(_, index, _) => *index,
        };
        if only.is_some_and(|o| o != index) {
            continue;
        }
        let names = index_names(client, index).await;
        for generic in [true, false] {
            let (plan, dir) = match &case {
                Case::List(q, _, dir) => (sql.explain_events(client, q, generic).await, *dir),
                Case::Aggregate(q, _, dir) => (sql.explain_aggregate_events(client, q, generic).await, *dir),
            };
            let plan = plan.unwrap();
            checked += 1;
            if let Err(e) = walks(&plan, &names, dir) {
                failed.push(format!("{index} (generic {generic}): {e}"));
            }
        }
    }
    if failed.is_empty() {
        Ok(checked)
    } else {
        Err(failed.join("\n\n"))
    }
}

/// Every statement variant walks its index, in the generic plan and the
/// custom one; dropping each index makes its statements' check fail.
#[tokio::test]
async fn every_events_statement_walks_its_index_and_fails_without_it() {
    let db = Db::start().await;
    fill(&db.client, "outbox").await;
    let sql = EventsSql::new(&Config::default());
    let client = connect(&db.url).await;
    let checked = check(&client, &sql, None).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        checked,
        3 * 8 * 2 + 3 * 2 * 2,
        "every variant, generic and custom"
    );

    for (index, drop) in [
        ("outbox_pkey", "ALTER TABLE outbox DROP CONSTRAINT outbox_pkey"),
        ("outbox_unpublished_idx", "DROP INDEX outbox_unpublished_idx"),
        ("outbox_dead_idx", "DROP INDEX outbox_dead_idx"),
        ("outbox_by_aggregate_idx", "DROP INDEX outbox_by_aggregate_idx"),
    ] {
        // Names resolved before the drop, which is rolled back.
        let names = index_names(&client, index).await;
        client.batch_execute(&format!("BEGIN; {drop}")).await.unwrap();
        let mut broken = 0;
        for case in cases(Utc::now()) {
            let plan = match &case {
                Case::List(q, i, _) if *i == index => sql.explain_events(&client, q, false).await,
                Case::Aggregate(q, i, _) if *i == index => {
                    sql.explain_aggregate_events(&client, q, false).await
                }
                _ => continue,
            };
            let dir = match &case {
                Case::List(_, _, d) | Case::Aggregate(_, _, d) => *d,
            };
            assert!(
                walks(&plan.unwrap(), &names, dir).is_err(),
                "{index} dropped, yet a plan passed"
            );
            broken += 1;
        }
        client.batch_execute("ROLLBACK").await.unwrap();
        assert!(broken >= 3, "{index}: {broken} cases");
    }
    check(&client, &sql, None).await.unwrap();
}

/// On the daily-partitioned layout the aggregate index is on every
/// partition (one made after the migration too), and each walk is a
/// merge of the partitions' index walks, never a sort.
#[tokio::test]
async fn events_statements_walk_the_partitions_indexes_on_the_daily_layout() {
    let db = Db::start().await;
    let config = Config {
        layout: Layout::Daily,
        ..Config::new("public", "daily").unwrap()
    };
    let mut client = connect(&db.url).await;
    outbox::migrate(&mut client, &config).await.unwrap();
    client
        .batch_execute(
            "CREATE TABLE daily_today PARTITION OF daily \
               FOR VALUES FROM (date_trunc('day', now()) - interval '1 day') TO (date_trunc('day', now()) + interval '1 day')",
        )
        .await
        .unwrap();
    fill(&client, "daily").await;
    let names = index_names(&client, "daily_by_aggregate_idx").await;
    assert_eq!(names.len(), 3, "the parent's, the default's, today's: {names:?}");
    let sql = EventsSql::new(&config);
    for generic in [true, false] {
        let q = list(
            EventFilter {
                aggregate_id: Some("a7"),
                ..EventFilter::default()
            },
            Keyset::Start,
        );
        let plan = sql.explain_events(&client, &q, generic).await.unwrap();
        walks(&plan, &names, "Backward").unwrap_or_else(|e| panic!("{e}"));
        let q = AggregateQuery {
            aggregate_id: "a7",
            aggregate_type: None,
            keyset: Keyset::Start,
            limit: 200,
        };
        let plan = sql.explain_aggregate_events(&client, &q, generic).await.unwrap();
        walks(&plan, &names, "Forward").unwrap_or_else(|e| panic!("{e}"));
        let pkey = index_names(&client, "daily_pkey").await;
        let plan = sql
            .explain_events(&client, &list(EventFilter::default(), Keyset::Start), generic)
            .await
            .unwrap();
        walks(&plan, &pkey, "Backward").unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Every id `filter` matches, newest first, by the statement's own
/// definition of the states (read back with plain SQL).
async fn expected(db: &Db, condition: &str) -> Vec<i64> {
    db.column(&format!(
        "SELECT id FROM outbox WHERE {condition} ORDER BY id DESC"
    ))
    .await
}

/// Paging older to the end and newer back to the start returns each
/// matching row once, in order, with pages of exactly 50 (the first page
/// again at the end); a scan bound smaller than the gaps between matches
/// yields short pages that still add up to every row.
#[tokio::test]
async fn keyset_pages_return_every_matching_row_once_both_ways() {
    let db = Db::start().await;
    fill(&db.client, "outbox").await;
    let sql = EventsSql::new(&Config::default());
    let filter = EventFilter {
        state: Some(EventState::Dead),
        aggregate_type: Some("orders"),
        error_contains: Some("422"),
        ..EventFilter::default()
    };
    let want = expected(
        &db,
        "published_at IS NULL AND dead_at IS NOT NULL AND given_up_at IS NULL AND aggregate_type = 'orders'",
    )
    .await;
    assert_eq!(want.len(), 1333, "g % 10 = 8 and g % 3 <> 0 among 20,000");
    for scan in [outbox::sql::EVENTS_SCAN, 37] {
        let mut keyset = Keyset::Start;
        let mut pages: Vec<Vec<i64>> = Vec::new();
        loop {
            let q = EventsQuery {
                filter,
                keyset,
                limit: 50,
                scan,
            };
            let page = sql.list_events(&db.client, &q).await.unwrap();
            assert!(page.events.iter().all(|e| e.state == EventState::Dead));
            pages.push(page.events.iter().map(|e| e.id).collect());
            match page.next {
                Some(next) => keyset = Keyset::Before(next),
                None => break,
            }
        }
        let older: Vec<i64> = pages.iter().flatten().copied().collect();
        assert_eq!(older, want, "older pages, scan {scan}");
        if scan == outbox::sql::EVENTS_SCAN {
            assert_eq!(pages.len(), 27, "26 full pages and 33 rows");
            assert!(pages[..26].iter().all(|p| p.len() == 50));
        } else {
            assert!(pages.len() > 27, "short pages when the bound stops the walk");
        }
        // Back up from the last page.
        let last = pages.last().unwrap();
        let mut keyset = Keyset::After(*last.first().unwrap_or(&0));
        let mut newer: Vec<i64> = last.clone();
        loop {
            let q = EventsQuery {
                filter,
                keyset,
                limit: 50,
                scan,
            };
            let page = sql.list_events(&db.client, &q).await.unwrap();
            let ids: Vec<i64> = page.events.iter().map(|e| e.id).collect();
            newer.splice(0..0, ids);
            match page.prev {
                Some(prev) => keyset = Keyset::After(prev),
                None => break,
            }
        }
        assert_eq!(newer, want, "newer pages, scan {scan}");
    }

    // An aggregate, oldest first, 200 a page both ways; its first pending
    // event marked on every row of its type.
    let want: Vec<i64> = db
        .column("SELECT id FROM outbox WHERE aggregate_id = 'a7' ORDER BY id")
        .await;
    let mut first_pending: Vec<i64> = db
        .column(
            "SELECT min(id) FROM outbox WHERE aggregate_id = 'a7' AND published_at IS NULL AND given_up_at IS NULL \
              GROUP BY aggregate_type ORDER BY 1",
        )
        .await;
    assert_eq!(first_pending.len(), 2, "a7 has pending events of both types");
    let q = |keyset, limit| AggregateQuery {
        aggregate_id: "a7",
        aggregate_type: None,
        keyset,
        limit,
    };
    let page = sql
        .aggregate_events(&db.client, &q(Keyset::Start, 200))
        .await
        .unwrap();
    assert_eq!(page.events.iter().map(|e| e.event.id).collect::<Vec<_>>(), want);
    assert_eq!((page.next, page.prev), (None, None));
    let blockers: Vec<i64> = page
        .events
        .iter()
        .filter(|e| e.blocker)
        .map(|e| e.event.id)
        .collect();
    first_pending.sort_unstable();
    assert_eq!(blockers, first_pending, "one per aggregate type");
    let mut ids = Vec::new();
    let mut keyset = Keyset::Start;
    loop {
        let page = sql.aggregate_events(&db.client, &q(keyset, 7)).await.unwrap();
        ids.extend(page.events.iter().map(|e| e.event.id));
        match page.next {
            Some(next) => keyset = Keyset::After(next),
            None => break,
        }
    }
    assert_eq!(ids, want, "pages of 7");
    let earlier = sql
        .aggregate_events(&db.client, &q(Keyset::Before(want[10]), 7))
        .await
        .unwrap();
    assert_eq!(
        earlier.events.iter().map(|e| e.event.id).collect::<Vec<_>>(),
        want[3..10]
    );
    assert_eq!((earlier.prev, earlier.next), (Some(want[3]), Some(want[9])));
}
