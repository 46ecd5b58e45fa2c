//! What an idle relay costs PostgreSQL, in committed transactions
//! (`pg_stat_database.xact_commit`), the figure relays are compared on.
//!
//! A count of transactions is a count, not a speed: a slow machine ticks less
//! often and so commits less, never more, and the bounds below hold however
//! slow it is. What they bound is the relay's own doing: one lease tick per
//! poll interval while idle, and a fixed number of transactions to start and
//! stop. PostgreSQL 15 publishes a backend's counters lazily (an idle
//! session's may wait until it exits), so both are read once every backend
//! of the relay has gone.

use std::time::{Duration, Instant};

use outbox::Config;
use outbox_testkit::{PgSettings, Postgres, Redis};
use tokio_postgres::Client;

use crate::support::{LONG, connect, start_relay, stop_relay, wait_until};

/// A relay's transactions besides its ticks, from start to exit, with a poll
/// interval under a third of the lease timeout (so the lease tick is the
/// poll and the relay claims nothing of its own while idle):
/// - 3 backends logging in (two batch sessions, the lease session), one
///   transaction each;
/// - 2 batch sessions' settings (`SET`s, `LISTEN`), one simple query each;
/// - 2 batch sessions' setups (the schema check, the backend's identity, a
///   dozen statements prepared) in one transaction each: prepared one by
///   one, each prepare is a transaction of its own, 30 more in all (the
///   issue: 46–53 transactions in the first 10 s at `--poll-interval 1s`);
/// - 1 read of the next retry on the listening session;
/// - 1 or 2 empty claims: the one the relay tries as it starts (after its
///   first lease tick, which READY waits for), and one more if a later
///   tick woke it (partitions gained);
/// - 1 tick prepared, 1 goodbye (the partitions handed back) and the
///   delete of its route state, pipelined behind it (issue 36);
/// - the privilege check before anything else (issue 35): its own login
///   and its one query.
const START_AND_STOP: i64 = 15;

const POLL: Duration = Duration::from_millis(200);

/// Ticks to idle through.
const TICKS: usize = 20;

#[tokio::test]
async fn idle_cost_an_idle_relay_commits_one_tick_per_poll_interval() {
    let pg = Postgres::start_with(
        PgSettings::default()
            // Nothing but the relay commits in its database: the first tick
            // rewrites the 64 lease rows, which autovacuum would come for.
            .set("autovacuum", "off")
            // pg_stat_user_functions counts the tick function's calls: the
            // ticks, exactly.
            .set("track_functions", "pl"),
    )
    .await
    .unwrap();
    let url = pg.fresh_database().await.unwrap();
    let database = url.rsplit('/').next().unwrap().to_owned();
    let mut migrating = connect(&url).await;
    outbox::migrate(&mut migrating, &Config::default()).await.unwrap();
    drop(migrating);
    // Counted from another database, so counting adds nothing to the count.
    let admin = pg.connect("postgres").await.unwrap();
    wait_until("the migrating session to exit", LONG, || gone(&admin, &database)).await;
    let redis = Redis::start().await.unwrap();

    let before = xact_commit(&admin, &database).await;
    let started = Instant::now();
    let poll = format!("{}ms", POLL.as_millis());
    let relay = start_relay(&url, &redis.url(), &["--poll-interval", &poll], &[]).await;
    // Waits on the tick function's call count, which the lease session
    // publishes as it goes idle (at most once a second); each look is one
    // transaction of this test's in the relay's database, counted and taken
    // off below.
    let watching = connect(&url).await;
    let looks = std::sync::atomic::AtomicI64::new(0);
    wait_until(&format!("{TICKS} lease ticks"), LONG, || {
        let (looks, watching) = (&looks, &watching);
        async move {
            looks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tick_calls(watching).await >= TICKS
        }
    })
    .await;
    drop(watching);
    stop_relay(relay).await;
    wait_until("the relay's backends to exit", LONG, || gone(&admin, &database)).await;
    // The watching session's own transactions: one per look, and its login.
    let watched = looks.into_inner() + 1;
    let elapsed = started.elapsed();
    let commits = xact_commit(&admin, &database).await - before - watched;

    let db = connect(&url).await;
    let ticks: i64 = db
        .query_one(
            "SELECT calls FROM pg_stat_user_functions WHERE funcname = 'outbox_relay_tick'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ticks >= TICKS as i64, "{ticks} ticks counted, {TICKS} waited for");
    // Each tick carries the relay's route state (issue 36): one upsert of
    // its one route, a transaction of its own, pipelined behind the tick.
    let published: i64 = db
        .query_one(
            "SELECT n_tup_ins + n_tup_upd FROM pg_stat_user_tables WHERE relname = 'outbox_route_state'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        (ticks - 1..=ticks).contains(&published),
        "{published} route-state writes for {ticks} ticks: one per tick"
    );
    // One tick per poll interval, each at most 10% early (the jitter), the
    // first at once.
    let intervals = elapsed.as_secs_f64() / (POLL.as_secs_f64() * 0.9);
    assert!(
        ticks as f64 <= intervals + 1.0,
        "{ticks} ticks in {elapsed:?}: more than one per {POLL:?}"
    );
    assert!(
        (START_AND_STOP - 1..=START_AND_STOP).contains(&(commits - ticks - published)),
        "{commits} transactions over the relay's life, {ticks} of them ticks and {published} \
         route-state writes: expected {START_AND_STOP} (or one fewer) besides them"
    );
}

/// Whether no session is connected to `database`: its counters are published.
async fn gone(admin: &Client, database: &str) -> bool {
    let n: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
            &[&database],
        )
        .await
        .unwrap()
        .get(0);
    n == 0
}

async fn xact_commit(admin: &Client, database: &str) -> i64 {
    admin
        .query_one(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = $1",
            &[&database],
        )
        .await
        .unwrap()
        .get(0)
}

/// The tick function's calls as published so far, in one transaction (a
/// simple query: no prepare).
async fn tick_calls(c: &Client) -> usize {
    let messages = c
        .simple_query("SELECT calls FROM pg_stat_user_functions WHERE funcname = 'outbox_relay_tick'")
        .await
        .unwrap();
    messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).and_then(|v| v.parse().ok()),
            _ => None,
        })
        .unwrap_or(0)
}
