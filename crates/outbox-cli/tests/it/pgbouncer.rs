//! Issue 32: the relay, the writer and the consumer through PgBouncer. In
//! transaction mode (`--pooler transaction`) and in session mode (as
//! direct), everything is delivered once and in order per aggregate; a
//! relay killed or frozen mid-stream loses nothing; a relay not told of a
//! transaction-mode pooler stops with exit 2 instead of looping, having
//! marked nothing it did not deliver; batches failing in a row make the
//! relay unready until one commits.
//!
//! The transaction-mode pools run `server_round_robin = 1` over several
//! warm server connections: each transaction of a client then runs on
//! another server connection than the one before, so whatever a session
//! keeps across transactions (a prepared statement, a `SET`) is missing,
//! or found by the next client, every time rather than by chance.

use std::collections::HashSet;

use nix::sys::signal::Signal;
use outbox::{Event, Outbox, Statements};
use outbox_testkit::{PgBouncer, PoolMode, Redis, Spawned};
use serde_json::json;
use tokio_postgres::SimpleQueryMessage;

use crate::metrics::{http_addr, ready};
use crate::support::{
    Db, LONG, connect, distinct_events, first_delivery_violations, order_violations, read_stream, run_cli,
    start_relay, start_relay_paused, stop_relay, text, wait_until,
};

/// The stream the Redis sink writes `orders` events to.
const STREAM: &str = "outbox.event.orders";

/// Server connections the transaction-mode pools keep warm.
const WARM: usize = 3;

/// A migrated database, directly (`db`, for setup and checks) and through
/// PgBouncer (`url`).
struct Pooled {
    db: Db,
    bouncer: PgBouncer,
    url: String,
}

impl Pooled {
    async fn start(mode: PoolMode) -> Pooled {
        let db = Db::start().await;
        let rotate: &[(&str, &str)] = match mode {
            PoolMode::Transaction => &[("server_round_robin", "1")],
            PoolMode::Session => &[],
        };
        let bouncer = PgBouncer::start_with(&db.pg, mode, rotate).await.unwrap();
        let url = bouncer.url(database(&db.url));
        if mode == PoolMode::Transaction {
            warm(&url).await;
        }
        Pooled { db, bouncer, url }
    }
}

/// The database a URL names.
fn database(url: &str) -> &str {
    url.rsplit('/').next().unwrap()
}

/// Opens `WARM` server connections behind the pool: as many transactions
/// open at once, each needing its own.
async fn warm(url: &str) {
    let mut clients = Vec::new();
    for _ in 0..WARM {
        let client = connect(url).await;
        client.batch_execute("BEGIN; SELECT 1").await.unwrap();
        clients.push(client);
    }
    for client in &clients {
        client.batch_execute("COMMIT").await.unwrap();
    }
}

/// One line of what a server connection behind the pool holds for its
/// next client: prepared statements, channels listened on, the plan
/// settings the relay pins, the idle timeout, and its backend pid.
async fn session_state(client: &tokio_postgres::Client) -> (Vec<String>, String) {
    // A simple query: nothing of its own is prepared.
    let messages = client
        .simple_query(
            "SELECT (SELECT count(*) FROM pg_prepared_statements), \
                    (SELECT count(*) FROM pg_listening_channels()), \
                    current_setting('enable_seqscan'), current_setting('enable_sort'), \
                    current_setting('jit'), current_setting('idle_in_transaction_session_timeout'), \
                    pg_backend_pid()",
        )
        .await
        .unwrap();
    let row = messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .unwrap();
    let state = (0..6).map(|i| row.get(i).unwrap().to_owned()).collect();
    (state, row.get(6).unwrap().to_owned())
}

/// Every server connection behind the pool is as a fresh session is:
/// nothing prepared, no LISTEN, no setting changed. Visits each of them (the
/// pool rotates) and says how many it saw.
async fn nothing_left_on_sessions(p: &Pooled) -> usize {
    let (fresh, _) = session_state(&p.db.client).await;
    assert_eq!(fresh[..2], ["0", "0"], "a direct session holds nothing");
    let client = connect(&p.url).await;
    let mut pids = HashSet::new();
    for _ in 0..30 {
        let (state, pid) = session_state(&client).await;
        assert_eq!(state, fresh, "server connection {pid} as a fresh session");
        pids.insert(pid);
    }
    pids.len()
}

/// Through `mode`, optionally with `--pooler transaction`: a drain of 5,000
/// events over 500 aggregates delivers each once, in order per aggregate.
async fn drains_exactly_once_in_order(mode: PoolMode, claim: &str, pooler: &[&str]) -> Pooled {
    let mut p = Pooled::start(mode).await;
    let redis = Redis::start().await.unwrap();
    p.db.insert_events(5000, 10).await;
    let sink = redis.url();
    let mut args = vec!["relay", "--sink", &sink, "--drain", "--claim", claim];
    args.extend_from_slice(pooler);
    let out = run_cli(&args, &[("DATABASE_URL", &p.url)]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(p.db.unpublished().await, 0, "every row published");
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(events.len(), 5000, "each event once");
    assert_eq!(distinct_events(&events), 5000);
    let aggregates: HashSet<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
    assert_eq!(aggregates.len(), 500);
    assert_eq!(order_violations(&events), 0, "in order per aggregate");
    p
}

#[tokio::test]
async fn issue_32_lock_claims_through_transaction_mode() {
    let p = drains_exactly_once_in_order(PoolMode::Transaction, "lock", &["--pooler", "transaction"]).await;
    let seen = nothing_left_on_sessions(&p).await;
    assert!(seen >= WARM, "the pool rotated over {seen} server connections");
}

#[tokio::test]
async fn issue_32_deadline_claims_through_transaction_mode() {
    let p =
        drains_exactly_once_in_order(PoolMode::Transaction, "deadline", &["--pooler", "transaction"]).await;
    let seen = nothing_left_on_sessions(&p).await;
    assert!(seen >= WARM, "the pool rotated over {seen} server connections");
}

#[tokio::test]
async fn issue_32_lock_claims_through_session_mode() {
    drains_exactly_once_in_order(PoolMode::Session, "lock", &[]).await;
}

#[tokio::test]
async fn issue_32_deadline_claims_through_session_mode() {
    drains_exactly_once_in_order(PoolMode::Session, "deadline", &[]).await;
}

/// Through transaction mode without `--pooler transaction`, a plain pool
/// (which hands the relay's second connection the server connection its
/// first just freed): found at startup, before anything is claimed or left
/// on a session.
#[tokio::test]
async fn issue_32_transaction_mode_without_the_setting_exits_2_at_startup() {
    let db = Db::start().await;
    let bouncer = PgBouncer::start(&db.pg, PoolMode::Transaction).await.unwrap();
    let mut db = db;
    db.insert_events(200, 10).await;
    let redis = Redis::start().await.unwrap();
    let url = bouncer.url(database(&db.url));
    let out = run_cli(&["relay", "--sink", &redis.url()], &[("DATABASE_URL", &url)]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("a transaction-mode pooler"), "{stderr}");
    assert!(
        stderr.contains("run the relay with --pooler transaction"),
        "{stderr}"
    );
    assert!(stderr.contains("ran on one server connection"), "{stderr}");
    assert_eq!(db.unpublished().await, 200, "nothing marked");
    assert!(read_stream(&redis.url(), STREAM).await.is_empty(), "nothing sent");
}

/// The same with a rotating pool, where the relay's two connections get
/// two server connections at startup: the first statement run where it was
/// not prepared (26000) or prepared where another was (42P05) stops the
/// relay, unready, with exit 2; no row is marked published that the sink
/// did not get.
#[tokio::test]
async fn issue_32_transaction_mode_without_the_setting_stops_on_a_missing_statement() {
    let mut p = Pooled::start(PoolMode::Transaction).await;
    p.db.insert_events(500, 10).await;
    let redis = Redis::start().await.unwrap();
    let out = run_cli(
        &["relay", "--sink", &redis.url(), "--batch-size", "50"],
        &[("DATABASE_URL", &p.url)],
    )
    .await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("run the relay with --pooler transaction"),
        "{stderr}"
    );
    assert!(
        stderr.contains("(SQLSTATE 26000)") || stderr.contains("(SQLSTATE 42P05)"),
        "stopped by the statement error: {stderr}"
    );
    let sent: HashSet<String> = read_stream(&redis.url(), STREAM)
        .await
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    let published: Vec<String> =
        p.db.client
            .query(
                "SELECT event_id::text FROM outbox WHERE published_at IS NOT NULL",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
    let unsent: Vec<&String> = published.iter().filter(|id| !sent.contains(*id)).collect();
    assert!(unsent.is_empty(), "marked published, never sent: {unsent:?}");
}

/// Batches of 50 through a transaction-mode pool, leases that lapse in 3 s.
const PAUSED_FLAGS: [&str; 6] = [
    "--pooler",
    "transaction",
    "--batch-size",
    "50",
    "--lease-timeout",
    "3s",
];

/// A relay with [`PAUSED_FLAGS`], parked between its first delivery and
/// its mark (a batch at the sink, and one claimed ahead, still open).
async fn start_paused(p: &Pooled, redis: &Redis) -> Spawned {
    start_relay_paused(&p.url, &redis.url(), &PAUSED_FLAGS).await
}

/// kill -9 of a relay parked between delivery and mark, through transaction
/// mode: it recorded no backend pid for a takeover to terminate; a new relay
/// delivers everything, the killed batch twice and nothing else twice, in
/// order.
#[tokio::test]
async fn issue_32_kill_9_mid_stream_through_transaction_mode() {
    let mut p = Pooled::start(PoolMode::Transaction).await;
    p.db.insert_events(2000, 10).await;
    let redis = Redis::start().await.unwrap();
    let mut relay = start_paused(&p, &redis).await;
    assert_eq!(
        read_stream(&redis.url(), STREAM).await.len(),
        50,
        "one batch sent"
    );
    assert_eq!(p.db.unpublished().await, 2000, "none marked");
    assert_eq!(
        p.db.count("SELECT count(*) FROM outbox_relays WHERE cardinality(backend_pids) = 0")
            .await,
        1,
        "the relay ticks without backend pids"
    );
    relay.kill().unwrap();
    relay.wait(LONG).await.unwrap();

    let relay = start_relay(&p.url, &redis.url(), &PAUSED_FLAGS, &[]).await;
    p.db.wait_drained("everything delivered after the restart").await;
    stop_relay(relay).await;
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(distinct_events(&events), 2000, "nothing lost");
    assert_eq!(events.len(), 2050, "the killed batch twice, nothing else");
    assert_eq!(first_delivery_violations(&events), 0, "in order per aggregate");
}

/// A relay frozen (SIGSTOP) with a batch at the sink and one claimed ahead,
/// their transactions open and locking rows and lease rows: behind a
/// transaction-mode pooler nobody may terminate its backends, so the server
/// ends those transactions itself once idle for the lease timeout
/// (`SET LOCAL idle_in_transaction_session_timeout`), and another relay
/// takes the partitions and delivers every event.
#[tokio::test]
async fn issue_32_a_frozen_relays_locks_end_with_the_lease_timeout() {
    let mut p = Pooled::start(PoolMode::Transaction).await;
    p.db.insert_events(1000, 10).await;
    let redis = Redis::start().await.unwrap();
    let mut frozen = start_paused(&p, &redis).await;
    frozen.signal(Signal::SIGSTOP).unwrap();
    let locking = "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = 'outbox-relay' AND state = 'idle in transaction'";
    assert_eq!(p.db.count(locking).await, 2, "two transactions hold rows");

    let other = start_relay(&p.url, &redis.url(), &PAUSED_FLAGS, &[]).await;
    p.db.wait_drained("every event delivered by the other relay")
        .await;
    assert_eq!(p.db.count(locking).await, 0, "the server ended them");
    stop_relay(other).await;
    frozen.kill().unwrap();
    frozen.wait(LONG).await.unwrap();
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(distinct_events(&events), 1000, "nothing lost");
    assert_eq!(first_delivery_violations(&events), 0, "in order per aggregate");
}

/// PgBouncer itself killed mid-stream and restarted: the relay reconnects
/// through it and delivers everything, in order.
#[tokio::test]
async fn issue_32_pgbouncer_killed_mid_stream() {
    let mut p = Pooled::start(PoolMode::Transaction).await;
    p.db.insert_events(2000, 10).await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(
        &p.url,
        &redis.url(),
        &["--pooler", "transaction", "--batch-size", "20"],
        &[],
    )
    .await;
    relay
        .wait_for_notification("OUTBOX_BATCH=committed", LONG)
        .await
        .unwrap();
    p.bouncer.kill().unwrap();
    assert!(p.db.unpublished().await > 0, "killed mid-stream");
    p.bouncer.restart().await.unwrap();
    p.db.wait_drained("everything delivered after PgBouncer came back")
        .await;
    stop_relay(relay).await;
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(distinct_events(&events), 2000, "nothing lost");
    assert_eq!(first_delivery_violations(&events), 0, "in order per aggregate");
}

/// With `--listen-url` (a direct connection) a relay behind a transaction
/// pooler is woken by the insert trigger: with a poll of an hour and no
/// leases to tick, nothing else could wake it.
#[tokio::test]
async fn issue_32_listen_url_wakes_a_relay_behind_a_transaction_pooler() {
    let mut p = Pooled::start(PoolMode::Transaction).await;
    let redis = Redis::start().await.unwrap();
    let relay = start_relay(
        &p.url,
        &redis.url(),
        &[
            "--pooler",
            "transaction",
            "--listen-url",
            &p.db.url.clone(),
            "--ordering",
            "none",
            "--poll-interval",
            "1h",
        ],
        &[],
    )
    .await;
    p.db.insert_events(3, 1).await;
    p.db.wait_drained("the events delivered on a notification").await;
    stop_relay(relay).await;
    assert_eq!(read_stream(&redis.url(), STREAM).await.len(), 3);
}

/// `--listen-url` without `--pooler transaction` is a configuration error.
#[tokio::test]
async fn issue_32_listen_url_needs_the_transaction_pooler() {
    let out = run_cli(
        &[
            "relay",
            "--sink",
            "redis://127.0.0.1:1",
            "--listen-url",
            "postgres://postgres@127.0.0.1:1/x",
        ],
        &[("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x")],
    )
    .await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--listen-url is for --pooler transaction"),
        "{stderr}"
    );
}

/// The writer commits through transaction mode: tokio-postgres as it is,
/// sqlx with `Statements::Unnamed`. sqlx's default (a statement prepared
/// and cached per connection) fails there on the second transaction.
#[tokio::test]
async fn issue_32_the_writer_commits_through_transaction_mode() {
    let p = Pooled::start(PoolMode::Transaction).await;
    let event = |i: usize| Event::new("orders", format!("order-{i}"), "Placed", json!({"i": i}));
    let outbox = Outbox::default();
    let mut client = connect(&p.url).await;
    for i in 0..10 {
        let tx = client.transaction().await.unwrap();
        outbox.enqueue(&tx, &event(i)).await.unwrap();
        outbox.enqueue_all(&tx, &[event(i), event(i)]).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(p.db.count("SELECT count(*) FROM outbox").await, 30);

    let unnamed = Outbox::default().with_statements(Statements::Unnamed);
    let mut conn: sqlx::PgConnection = sqlx::Connection::connect(&p.url).await.unwrap();
    for i in 0..10 {
        let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
        unnamed.enqueue_sqlx(&mut tx, &event(i)).await.unwrap();
        unnamed
            .enqueue_all_sqlx(&mut tx, &[event(i), event(i)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(p.db.count("SELECT count(*) FROM outbox").await, 60);

    let mut conn: sqlx::PgConnection = sqlx::Connection::connect(&p.url).await.unwrap();
    let mut failed = None;
    for i in 0..3 {
        let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
        if let Err(e) = outbox.enqueue_sqlx(&mut tx, &event(i)).await {
            failed = Some(e.to_string() + &format!(": {:?}", std::error::Error::source(&e)));
            break;
        }
        tx.commit().await.unwrap();
    }
    let failed = failed.expect("a cached statement fails in another transaction");
    assert!(
        failed.contains("26000") || failed.contains("does not exist"),
        "{failed}"
    );
    assert_eq!(
        p.db.count("SELECT count(*) FROM outbox").await,
        61,
        "only the first committed"
    );
}

/// Batches failing in a row with one error (here every claim's UPDATE is
/// refused by a trigger): after a few the relay is unready and says why;
/// once a batch commits it is ready again.
#[tokio::test]
async fn issue_32_batches_failing_in_a_row_make_the_relay_unready() {
    let mut db = Db::start().await;
    db.client
        .batch_execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$; \
             CREATE TRIGGER refuse BEFORE UPDATE ON outbox FOR EACH ROW EXECUTE FUNCTION refuse()",
        )
        .await
        .unwrap();
    let redis = Redis::start().await.unwrap();
    let addr = http_addr();
    let relay = start_relay(
        &db.url,
        &redis.url(),
        &["--http", &addr, "--ordering", "none"],
        &[],
    )
    .await;
    db.insert_events(10, 1).await;
    wait_until("the relay unready", LONG, || async {
        ready(&addr).await.0 == 503
    })
    .await;
    // Unready it stays while the trigger refuses.
    let (_, body) = ready(&addr).await;
    let why = body["checks"]["postgres"].as_str().unwrap_or_default().to_owned();
    assert!(why.starts_with("batches keep failing: "), "{why}");
    assert!(why.contains("refused by the test"), "{why}");
    assert_eq!(db.unpublished().await, 10, "nothing committed meanwhile");

    db.client
        .batch_execute("DROP TRIGGER refuse ON outbox")
        .await
        .unwrap();
    wait_until("the relay ready again", LONG, || async {
        ready(&addr).await.0 == 200
    })
    .await;
    db.wait_drained("everything delivered").await;
    let lines = stop_relay(relay).await;
    let reported: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("batches keep failing with the same error"))
        .collect();
    assert_eq!(reported.len(), 1, "said once, at error level: {reported:?}");
    assert!(reported[0].contains("ERROR"), "{}", reported[0]);
    let events = read_stream(&redis.url(), STREAM).await;
    assert_eq!(distinct_events(&events), 10);
}

/// The operator commands through transaction mode, each run several times
/// so the pool hands them different server connections: `migrate`,
/// `stats`, `relays`, `dlq`, `cleanup` run every statement unnamed (or in
/// one transaction), so none finds a statement missing or another
/// client's. (`replay` cannot: its job lock is a session advisory lock.)
#[tokio::test]
async fn issue_32_commands_through_transaction_mode() {
    let p = Pooled::start(PoolMode::Transaction).await;
    let fresh = p.db.pg.fresh_database().await.unwrap();
    let url = p.bouncer.url(database(&fresh));
    warm(&url).await;
    let env = [("DATABASE_URL", url.as_str())];
    let ok = |out: std::process::Output| {
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    for _ in 0..2 {
        ok(run_cli(&["migrate"], &env).await);
        ok(run_cli(&["migrate", "--inbox"], &env).await);
    }
    let direct = connect(&fresh).await;
    direct
        .batch_execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, dead_at, last_error) \
             SELECT gen_random_uuid(), 'orders', 'o' || i, 'Placed', '{}', now(), 'refused' \
               FROM generate_series(1, 6) AS i",
        )
        .await
        .unwrap();
    for _ in 0..WARM {
        let stats: serde_json::Value =
            serde_json::from_str(&ok(run_cli(&["stats", "--json"], &env).await)).unwrap();
        assert_eq!(stats["dead_letters"], 6, "{stats}");
        ok(run_cli(&["relays"], &env).await);
        ok(run_cli(&["dlq", "list"], &env).await);
        ok(run_cli(&["cleanup", "--older-than", "1h"], &env).await);
    }
    ok(run_cli(&["dlq", "give-up", "--id", "1"], &env).await);
    ok(run_cli(&["dlq", "requeue", "--id", "2", "--id", "3"], &env).await);
    let count = |sql: &'static str| {
        let direct = &direct;
        async move { direct.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE given_up_at IS NOT NULL").await,
        1
    );
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE dead_at IS NULL").await,
        2
    );
}
