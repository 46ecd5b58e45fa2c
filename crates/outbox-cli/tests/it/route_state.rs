//! Issue 36: relays publish their routes' state and a per-minute rollup on
//! their heartbeat, and honour a route pause. Two routes to two real HTTP
//! receivers; every wait polls the tables or the receivers.

use outbox::sql::{RouteSql, RouteState};
use outbox::{Config, Event};
use outbox_testkit::{Receiver, Respond};
use serde_json::json;

use crate::routing::config_file;
use crate::support::{Db, LONG, start_relay, stop_relay, wait_until};

/// Ticks (and heartbeats) every second.
const FAST: [&str; 2] = ["--lease-timeout", "3s"];

fn sql() -> RouteSql {
    RouteSql::new(&Config::default()).unwrap()
}

/// `n` events of `aggregate_type`, one aggregate each, from `from` on.
fn events(aggregate_type: &str, from: usize, n: usize) -> Vec<Event> {
    (from..from + n)
        .map(|i| {
            Event::new(
                aggregate_type,
                format!("{aggregate_type}-{i}"),
                "Happened",
                json!({ "i": i }),
            )
        })
        .collect()
}

/// A routes file: `orders` to `orders`, everything else to `rest`.
fn two_routes(rest: &Receiver, orders: &Receiver) -> String {
    config_file(&format!(
        "[default]\nsink = \"{}\"\n\n[routes.orders]\nsink = \"{}?token=secret\"\n",
        rest.url(),
        orders.url()
    ))
}

/// The live rows of `route`.
async fn state_of(db: &Db, route: &str) -> Vec<RouteState> {
    let states = sql().states(&db.client, LONG).await.unwrap();
    states.into_iter().filter(|s| s.route == route).collect()
}

/// The rollup's sums for `route`: delivered, failed, dead.
async fn rolled_up(db: &Db, route: &str) -> (i64, i64, i64) {
    let since = chrono::Utc::now() - chrono::Duration::hours(1);
    sql()
        .rollup(&db.client, since)
        .await
        .unwrap()
        .iter()
        .filter(|r| r.route == route)
        .fold((0, 0, 0), |(d, f, x), r| {
            (d + r.delivered, f + r.failed, x + r.dead)
        })
}

#[tokio::test]
async fn route_state_counts_each_routes_deliveries_and_the_rollup_sums_to_them() {
    let db = Db::start().await;
    let rest = Receiver::start(Respond::Ok).await.unwrap();
    let orders = Receiver::start(Respond::Ok).await.unwrap();
    let config = two_routes(&rest, &orders);
    let relay = start_relay(
        &db.url,
        "unused://x",
        &["--config", &config, FAST[0], FAST[1]],
        &[],
    )
    .await;
    outbox::enqueue_all(&db.client, &events("orders", 0, 7))
        .await
        .unwrap();
    outbox::enqueue_all(&db.client, &events("invoices", 0, 5))
        .await
        .unwrap();
    db.wait_drained("every row published").await;
    assert_eq!(
        (orders.count(), rest.count()),
        (7, 5),
        "each receiver got its route's"
    );

    wait_until("route state and rollup caught up", LONG, || async {
        let o = state_of(&db, "orders").await;
        let d = state_of(&db, "default").await;
        o.len() == 1
            && d.len() == 1
            && o[0].delivered == 7
            && d[0].delivered == 5
            && rolled_up(&db, "orders").await == (7, 0, 0)
            && rolled_up(&db, "default").await == (5, 0, 0)
    })
    .await;
    let o = &state_of(&db, "orders").await[0];
    let d = &state_of(&db, "default").await[0];
    assert_eq!(o.aggregate_types.as_deref(), Some(&["orders".to_owned()][..]));
    assert_eq!(
        d.aggregate_types, None,
        "the default route takes every other type"
    );
    assert_eq!(
        o.sink,
        format!("http {}?token=***", orders.url()),
        "its address, the secret masked"
    );
    assert_eq!(d.sink, format!("http {}", rest.url()));
    assert_eq!(
        (o.breaker.as_str(), o.paused, o.failed, o.dead),
        ("closed", false, 0, 0)
    );
    assert_eq!(o.relay_id, d.relay_id, "one relay");
    // Another heartbeat adds nothing: the rollup gets deltas, not totals.
    let beat = o.updated_at;
    wait_until("a later heartbeat", LONG, || async {
        state_of(&db, "orders").await[0].updated_at > beat
    })
    .await;
    assert_eq!(rolled_up(&db, "orders").await, (7, 0, 0));
    assert_eq!(rolled_up(&db, "default").await, (5, 0, 0));

    stop_relay(relay).await;
    assert_eq!(
        db.count("SELECT count(*) FROM outbox_route_state").await,
        0,
        "a relay stopping deletes its rows"
    );
    assert_eq!(rolled_up(&db, "orders").await, (7, 0, 0), "the rollup stays");
    let _ = std::fs::remove_file(config);
}

#[tokio::test]
async fn a_route_whose_sink_is_down_is_reported_open_while_the_other_delivers() {
    let db = Db::start().await;
    let rest = Receiver::start(Respond::Ok).await.unwrap();
    let mut orders = Receiver::start(Respond::Ok).await.unwrap();
    let config = two_routes(&rest, &orders);
    orders.stop().await;
    let relay = start_relay(
        &db.url,
        "unused://x",
        &["--config", &config, FAST[0], FAST[1]],
        &[],
    )
    .await;
    outbox::enqueue_all(&db.client, &events("orders", 0, 4))
        .await
        .unwrap();
    outbox::enqueue_all(&db.client, &events("invoices", 0, 6))
        .await
        .unwrap();

    wait_until("orders reported open, invoices delivered", LONG, || async {
        let o = state_of(&db, "orders").await;
        let d = state_of(&db, "default").await;
        o.len() == 1 && o[0].breaker == "open" && d.len() == 1 && d[0].delivered == 6
    })
    .await;
    // The fault happened: no order left, none spent an attempt.
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'orders' AND published_at IS NULL AND attempts = 0")
            .await,
        4
    );
    assert_eq!(rest.count(), 6);
    let o = &state_of(&db, "orders").await[0];
    let since = o.breaker_since.expect("open since when");
    assert!(
        chrono::Utc::now() - since < chrono::Duration::minutes(5),
        "{since}"
    );
    let error = o.last_error.as_deref().expect("why");
    assert!(o.last_error_at.is_some());
    assert!(error.contains("127.0.0.1"), "the sink's own words: {error}");
    assert_eq!((o.delivered, o.failed), (0, 0), "unavailable is no attempt");
    assert_eq!(state_of(&db, "default").await[0].breaker, "closed");

    orders.restart().await.unwrap();
    db.wait_drained("the orders delivered once back").await;
    wait_until("orders reported closed", LONG, || async {
        let o = state_of(&db, "orders").await;
        o.len() == 1 && o[0].breaker == "closed" && o[0].delivered == 4
    })
    .await;
    assert_eq!(orders.count(), 4);
    stop_relay(relay).await;
    let _ = std::fs::remove_file(config);
}

#[tokio::test]
async fn a_paused_route_delivers_nothing_until_resumed_and_then_everything_once() {
    let db = Db::start().await;
    let rest = Receiver::start(Respond::Ok).await.unwrap();
    let orders = Receiver::start(Respond::Ok).await.unwrap();
    let config = two_routes(&rest, &orders);
    let relay = start_relay(
        &db.url,
        "unused://x",
        &["--config", &config, FAST[0], FAST[1]],
        &[],
    )
    .await;
    outbox::enqueue_all(&db.client, &events("orders", 0, 3))
        .await
        .unwrap();
    outbox::enqueue_all(&db.client, &events("invoices", 0, 3))
        .await
        .unwrap();
    db.wait_drained("the first rows published").await;

    let sql = sql();
    assert!(
        sql.pause(&db.client, "orders", "ops@example", Some("receiver migration"))
            .await
            .unwrap()
    );
    assert!(
        !sql.pause(&db.client, "orders", "someone else", None)
            .await
            .unwrap(),
        "paused already"
    );
    let paused = sql.paused(&db.client).await.unwrap();
    assert_eq!(paused.len(), 1);
    assert_eq!(
        (paused[0].paused_by.as_deref(), paused[0].reason.as_deref()),
        (Some("ops@example"), Some("receiver migration")),
        "the first pause's, kept"
    );
    wait_until("the relay honours the pause", LONG, || async {
        state_of(&db, "orders").await.first().is_some_and(|s| s.paused)
    })
    .await;
    assert!(!state_of(&db, "default").await[0].paused);

    outbox::enqueue_all(&db.client, &events("orders", 3, 4))
        .await
        .unwrap();
    outbox::enqueue_all(&db.client, &events("invoices", 3, 4))
        .await
        .unwrap();
    // The relay claimed the paused route's rows and answered them itself.
    wait_until("invoices delivered, orders held by the pause", LONG, || async {
        rest.count() == 7
            && db
                .count(
                    "SELECT count(*) FROM outbox WHERE aggregate_type = 'orders' \
                      AND last_error LIKE '%route orders is paused%'",
                )
                .await
                == 4
    })
    .await;
    assert_eq!(orders.count(), 3, "nothing more sent to the paused route");
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'orders' AND published_at IS NULL AND attempts = 0")
            .await,
        4,
        "waiting, no attempt spent"
    );
    assert_eq!(
        state_of(&db, "orders").await[0].breaker,
        "closed",
        "its sink said nothing"
    );

    assert!(sql.resume(&db.client, "orders").await.unwrap());
    assert!(
        !sql.resume(&db.client, "orders").await.unwrap(),
        "not paused any more"
    );
    assert!(sql.paused(&db.client).await.unwrap().is_empty());
    db.wait_drained("the paused route's rows delivered").await;
    let received = orders.wait_for_count(7, LONG).await.unwrap();
    let distinct: std::collections::HashSet<String> = received
        .iter()
        .map(|p| p.body["event_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        (received.len(), distinct.len()),
        (7, 7),
        "each order exactly once"
    );
    wait_until("the resume reported", LONG, || async {
        state_of(&db, "orders")
            .await
            .first()
            .is_some_and(|s| !s.paused && s.delivered == 7)
    })
    .await;
    stop_relay(relay).await;
    assert_eq!(orders.count(), 7);
    assert_eq!(rest.count(), 7);
    let _ = std::fs::remove_file(config);
}

#[tokio::test]
async fn a_relay_with_one_sink_has_one_route_and_pausing_it_stops_its_claims() {
    let db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let sql = sql();
    assert!(sql.pause(&db.client, "default", "ops", None).await.unwrap());
    let relay = start_relay(&db.url, &receiver.url(), &FAST, &[]).await;
    wait_until("the relay honours the pause", LONG, || async {
        state_of(&db, "default").await.first().is_some_and(|s| s.paused)
    })
    .await;
    let d = &state_of(&db, "default").await[0];
    assert_eq!(
        (d.sink.as_str(), d.aggregate_types.as_ref()),
        (format!("http {}", receiver.url()).as_str(), None)
    );
    outbox::enqueue_all(&db.client, &events("orders", 0, 5))
        .await
        .unwrap();
    // Two heartbeats after the rows were written: had the relay claimed
    // them, it would have sent them by then.
    for _ in 0..2 {
        let beat = state_of(&db, "default").await[0].updated_at;
        wait_until("a heartbeat", LONG, || async {
            state_of(&db, "default").await[0].updated_at > beat
        })
        .await;
    }
    assert_eq!(receiver.count(), 0, "nothing sent while paused");
    assert_eq!(
        db.count(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND attempts = 0 AND last_error IS NULL"
        )
        .await,
        5,
        "not even claimed"
    );
    assert!(sql.resume(&db.client, "default").await.unwrap());
    db.wait_drained("delivered once resumed").await;
    assert_eq!(receiver.wait_for_count(5, LONG).await.unwrap().len(), 5);
    stop_relay(relay).await;
}

/// Route state refused by the server (a constraint here; a revoked grant
/// alike) costs nothing but the console's view: delivery goes on, the
/// failure is logged once, and once the write succeeds again the counts and
/// the rollup carry everything booked meanwhile.
#[tokio::test]
async fn a_refused_route_state_write_never_stops_delivery_and_catches_up() {
    let db = Db::start().await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let relay = start_relay(&db.url, &receiver.url(), &FAST, &[]).await;
    wait_until("the first route state", LONG, || async {
        state_of(&db, "default").await.len() == 1
    })
    .await;
    db.client
        .batch_execute("ALTER TABLE outbox_route_state ADD CONSTRAINT refuse CHECK (delivered < 0) NOT VALID")
        .await
        .unwrap();
    outbox::enqueue_all(&db.client, &events("orders", 0, 5))
        .await
        .unwrap();
    db.wait_drained("delivered while route state is refused").await;
    assert_eq!(receiver.count(), 5);
    // Three lease ticks (each carrying a refused write) after delivery.
    for _ in 0..3 {
        let beat = db
            .count("SELECT (extract(epoch FROM heartbeat_at) * 1e6)::int8 FROM outbox_relays")
            .await;
        wait_until("a lease tick", LONG, || async {
            db.count("SELECT (extract(epoch FROM heartbeat_at) * 1e6)::int8 FROM outbox_relays")
                .await
                > beat
        })
        .await;
    }
    assert_eq!(
        state_of(&db, "default").await[0].delivered,
        0,
        "the write was refused"
    );
    assert_eq!(relay.count_lines("writing route state failed"), 1, "logged once");

    db.client
        .batch_execute("ALTER TABLE outbox_route_state DROP CONSTRAINT refuse")
        .await
        .unwrap();
    wait_until("route state caught up", LONG, || async {
        state_of(&db, "default").await[0].delivered == 5 && rolled_up(&db, "default").await == (5, 0, 0)
    })
    .await;
    assert_eq!(relay.count_lines("route state written again"), 1);
    stop_relay(relay).await;
}
