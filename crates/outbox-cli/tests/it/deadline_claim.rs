//! `outbox relay --claim deadline`: a batch claimed by a deadline in a short
//! transaction, delivered with none open, marked in a second one that checks
//! the claim is still the relay's. Crashes between delivery and mark, an
//! expired claim's late mark (fencing), strict order through a failure, and
//! a routes file whose routes claim differently.

use std::collections::HashMap;

use nix::sys::signal::Signal;
use outbox_testkit::{Receiver, Redis, Respond};

use crate::metrics::{get, http_addr, scrape, value};
use crate::support::{
    Db, LONG, distinct_events, first_delivery_violations, read_stream, start_relay, start_relay_paused,
    stop_relay, wait_until,
};

/// Batch connections of relays with a transaction open (lock mode holds one
/// while a batch is at the sink; lease mode never does).
const OPEN_TRANSACTIONS: &str = "SELECT count(*) FROM pg_stat_activity \
     WHERE application_name = 'outbox-relay' AND xact_start IS NOT NULL";

/// kill -9 between "Redis stored the batch" and the mark: no transaction
/// was open to roll back, the claim simply runs out, and a new relay sends
/// everything, the killed batch twice and nothing else twice.
#[tokio::test]
async fn kill_between_delivery_and_mark_redelivers_once_the_claim_expires() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.insert_events(500, 10).await;
    let lease = [
        "--claim",
        "deadline",
        "--claim-timeout",
        "2s",
        "--batch-size",
        "50",
    ];
    let mut relay = start_relay_paused(&db.url, &redis.url(), &lease).await;
    let stream = "outbox.event.orders";
    assert_eq!(
        read_stream(&redis.url(), stream).await.len(),
        50,
        "one batch sent"
    );
    // Parked between delivery and mark: rows claimed (the batch at the sink
    // and the one claimed ahead), none published, no transaction open.
    assert_eq!(db.unpublished().await, 500);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE claimed_by IS NOT NULL")
            .await,
        100
    );
    assert_eq!(db.count(OPEN_TRANSACTIONS).await, 0, "no transaction open");
    relay.kill().unwrap();
    relay.wait(LONG).await.unwrap();

    let relay = start_relay(&db.url, &redis.url(), &lease, &[]).await;
    db.wait_drained("every row published after the claims expired")
        .await;
    stop_relay(relay).await;
    let events = read_stream(&redis.url(), stream).await;
    assert_eq!(distinct_events(&events), 500, "nothing lost");
    assert_eq!(events.len(), 550, "the killed batch of 50 twice, nothing else");
    assert_eq!(first_delivery_violations(&events), 0);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE claimed_by IS NOT NULL OR claimed_until IS NOT NULL")
            .await,
        0,
        "every claim cleared by its mark"
    );
}

/// A reset of the relay's pipeline forgets a batch whose claim committed
/// (here: the first mark fails, while the claim pipelined after it on the
/// same connection commits the next batch). Those rows, still claimed under
/// the relay's id, must not let the relay pass them: the next claim gives
/// them back first, so the aggregates' later events follow them. Before
/// the fix, the relay delivered an aggregate's third event long before its
/// second, whose claim had to run out first (the reordering seen in CI
/// after a failover, where the claim's answer was lost with the primary).
#[tokio::test]
async fn claims_forgotten_by_a_reset_are_given_back_before_later_events_pass_them() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    // Ids 1..6: aggregate 0 steps 0,1,2 at ids 1,3,5, aggregate 1 at 2,4,6.
    db.insert_events(6, 3).await;
    db.client
        .batch_execute(
            "CREATE SEQUENCE first_mark; \
             CREATE FUNCTION fail_the_first_mark() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF nextval('first_mark') = 1 THEN RAISE EXCEPTION 'the test fails the first mark'; END IF; \
             RETURN NEW; END $$; \
             CREATE TRIGGER fail_the_first_mark BEFORE UPDATE ON outbox FOR EACH ROW \
             WHEN (OLD.published_at IS NULL AND NEW.published_at IS NOT NULL) \
             EXECUTE FUNCTION fail_the_first_mark();",
        )
        .await
        .unwrap();
    // Batches of one are full, so each claims the next ahead: batch 1
    // (id 1) is at the sink while id 2 is claimed; id 2 is at the sink while
    // id 1's mark fails and id 3's claim commits. A short timeout keeps the
    // run short if claims are left to run out.
    let args = [
        "--claim",
        "deadline",
        "--claim-timeout",
        "3s",
        "--batch-size",
        "1",
    ];
    let relay = start_relay(&db.url, &redis.url(), &args, &[]).await;
    db.wait_drained("every row published").await;
    stop_relay(relay).await;
    assert_eq!(
        db.count("SELECT last_value FROM first_mark").await,
        7,
        "one failed mark, six good ones"
    );
    let events = read_stream(&redis.url(), "outbox.event.orders").await;
    assert_eq!(distinct_events(&events), 6, "nothing lost");
    assert_eq!(
        first_delivery_violations(&events),
        0,
        "no event before an earlier one of its aggregate: {:?}",
        events.iter().map(|e| e.outbox_id).collect::<Vec<_>>()
    );
    // Ids 1 and 2 were delivered before the reset and again after it.
    assert_eq!(events.len(), 8);
}

/// A relay frozen after delivering a batch (SIGSTOP at the failpoint) past
/// its claim timeout: another relay claims, sends and marks the rows; the
/// first, woken, finds its claim taken and marks nothing (it counts the
/// rows in `outbox_claims_lost_total`), so the second relay's marks stand.
#[tokio::test]
async fn an_expired_claim_is_not_marked_by_its_old_holder() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    db.insert_events(100, 10).await;
    let addr = http_addr();
    // `--ordering none`: any relay may claim any row, so the second one
    // needs no partition of the first.
    let lease = [
        "--claim",
        "deadline",
        "--claim-timeout",
        "1s",
        "--ordering",
        "none",
    ];
    let frozen = start_relay(
        &db.url,
        &redis.url(),
        &[&lease[..], &["--http", &addr]].concat(),
        &[("OUTBOX_FAILPOINT", "sleep-after-deliver-ms=1500")],
    )
    .await;
    frozen
        .wait_for_notification("OUTBOX_FAILPOINT=sleep-after-deliver reached", LONG)
        .await
        .unwrap();
    frozen.signal(Signal::SIGSTOP).unwrap();
    let stream = "outbox.event.orders";
    assert_eq!(read_stream(&redis.url(), stream).await.len(), 100);

    let other = start_relay(
        &db.url,
        &redis.url(),
        &[&lease[..], &["--poll-interval", "100ms"]].concat(),
        &[],
    )
    .await;
    db.wait_drained("the expired claim taken over and published")
        .await;
    let marks = "SELECT string_agg(published_at::text, ',' ORDER BY id) FROM outbox";
    let by_other: String = db.client.query_one(marks, &[]).await.unwrap().get(0);

    frozen.signal(Signal::SIGCONT).unwrap();
    wait_until("the woken relay's mark found its claim taken", LONG, || async {
        // Nothing answers until the relay is scheduled again.
        if get(&addr, "/metrics").await.is_none() {
            return false;
        }
        let (_, scrape) = scrape(&addr).await;
        value(&scrape, "outbox_claims_lost_total", &[]) == Some(100.0)
    })
    .await;
    let after: String = db.client.query_one(marks, &[]).await.unwrap().get(0);
    assert_eq!(after, by_other, "the old holder changed no mark");
    stop_relay(frozen).await;
    stop_relay(other).await;
    let events = read_stream(&redis.url(), stream).await;
    assert_eq!((events.len(), distinct_events(&events)), (200, 100));
}

/// Strict order with deadline claim, two relays sharing the partitions: one
/// event refused twice holds its aggregate's later events back until it
/// goes through; every aggregate arrives in order, each event once.
#[tokio::test]
async fn strict_order_holds_through_a_failure_with_lease_claims() {
    let mut db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    db.insert_events(300, 10).await;
    // Aggregate order-3's sixth event (seq 5) is refused until released.
    receiver.set_refuse(Some((r#""agg":3,"seq":5"#, 500)));
    let flags = [
        "--claim",
        "deadline",
        "--ordering",
        "strict",
        "--backoff-base",
        "50ms",
        "--batch-size",
        "20",
    ];
    let a = start_relay(&db.url, &receiver.url(), &flags, &[]).await;
    let b = start_relay(&db.url, &receiver.url(), &flags, &[]).await;
    wait_until("the event refused twice", LONG, || async {
        receiver.received().iter().filter(|r| r.status == 500).count() >= 2
    })
    .await;
    receiver.set_refuse(None);
    db.wait_drained("every event delivered").await;
    stop_relay(a).await;
    stop_relay(b).await;

    let mut seqs: HashMap<i64, Vec<i64>> = HashMap::new();
    for r in receiver.received().iter().filter(|r| r.status == 200) {
        let payload = &r.body["payload"];
        seqs.entry(payload["agg"].as_i64().unwrap())
            .or_default()
            .push(payload["seq"].as_i64().unwrap());
    }
    assert_eq!(seqs.len(), 30);
    for (agg, got) in &seqs {
        assert_eq!(
            *got,
            (0..10).collect::<Vec<_>>(),
            "aggregate {agg} in order, each once"
        );
    }
}

/// A routes file whose HTTP route claims by lease while the default route
/// (Redis) locks: two claim loops. Parked after each one's first batch,
/// the HTTP route's rows carry a claim and no transaction is open for
/// them, while the Redis route's batch holds its transaction.
#[tokio::test]
async fn a_route_can_claim_by_lease_while_the_others_lock() {
    let db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT CASE WHEN g % 2 = 0 THEN 'orders' ELSE 'webhooks' END, (g % 7)::text, 'E', '{}'
               FROM generate_series(1, 200) g",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.toml");
    // `lease`, the mode's name before `deadline`: deployed files keep working.
    std::fs::write(
        &config,
        format!(
            "[default]\nsink = \"{}\"\n\n[routes.webhooks]\nsink = \"{}\"\nclaim = \"lease\"\n",
            redis.url(),
            receiver.url()
        ),
    )
    .unwrap();
    let mut relay = start_relay(
        &db.url,
        &redis.url(),
        &["--config", config.to_str().unwrap(), "--batch-size", "10"],
        &[("OUTBOX_FAILPOINT", "pause-after-deliver")],
    )
    .await;
    wait_until("both claim loops parked after a batch", LONG, || async {
        receiver.count() >= 10 && read_stream(&redis.url(), "outbox.event.orders").await.len() >= 10
    })
    .await;
    let claimed = |ty: &str| {
        format!("SELECT count(*) FROM outbox WHERE aggregate_type = '{ty}' AND claimed_by IS NOT NULL")
    };
    wait_until("the lease loop's claims visible", LONG, || async {
        db.count(&claimed("webhooks")).await > 0
    })
    .await;
    assert_eq!(db.count(&claimed("orders")).await, 0, "the Redis route locks");
    // The lock loop's two: its batch at the sink and the one it claimed
    // ahead (100 orders, batches of 10). The lease loop's connections add
    // none.
    assert_eq!(
        db.count(OPEN_TRANSACTIONS).await,
        2,
        "the Redis route's transactions only"
    );
    relay.kill().unwrap();
    relay.wait(LONG).await.unwrap();
    assert_eq!(db.unpublished().await, 200, "nothing marked before the kill");
}

/// A claim timeout under twice the sink's timeout is allowed but named: a
/// batch whose requests time out would outlive its claim.
#[tokio::test]
async fn a_claim_timeout_shorter_than_the_sinks_is_warned_about() {
    let env = [("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x")];
    let show = |timeout: &'static str| {
        let args = [
            "config",
            "show",
            "--sink",
            "redis://127.0.0.1:6379",
            "--claim",
            "deadline",
            "--claim-timeout",
            timeout,
        ];
        async move { crate::support::run_cli(&args, &env).await }
    };
    let short = show("5s").await;
    assert_eq!(short.status.code(), Some(0));
    let stderr = crate::support::text(&short.stderr);
    assert!(
        stderr.contains("--claim-timeout is under twice the sink's timeout")
            && stderr.contains("claim_timeout=5s"),
        "{stderr}"
    );
    let default = show("60s").await;
    assert_eq!(default.status.code(), Some(0));
    assert!(
        !crate::support::text(&default.stderr).contains("--claim-timeout is under"),
        "the default is long enough"
    );
}
