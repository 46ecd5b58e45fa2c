//! A sink conformance suite: the scenarios every sink of the relay must
//! pass, written once, run against each broker.
//!
//! Modelled on river's `riverdrivertest`: a sink implements
//! [`SinkUnderTest`] (start its own throwaway broker, say how the relay
//! reaches it, stop and restart it on the same port, read back everything
//! it holds as a common [`Delivered`] list), and each scenario is a function
//! generic over it:
//!
//! | scenario | what must hold |
//! |---|---|
//! | [`in_order`] | 5,000 events over 500 aggregates: each delivered exactly once, in per-aggregate order, the outbox fully marked |
//! | [`broker_down`] | the broker down 10 s mid-stream and back: nothing lost, the outbox drained, the relay never exits |
//! | [`kill_between_ack_and_mark`] | the relay SIGKILLed after the broker acknowledged a batch and before marking it, then restarted: every event delivered, the re-send carries the same `event_id` |
//! | [`oversized`] | a message over the broker's size limit is a dead letter at once (`attempts` = max), the others are delivered |
//! | [`bad_urls`] | a malformed sink URL exits 2 naming what is wrong |
//!
//! The scenarios run the real `outbox` binary (its path is the `relay`
//! argument) against a fresh PostgreSQL cluster, wait on state (row counts
//! in the outbox, counts read from the broker), never on sleeps or log text,
//! and panic with what they saw when something does not hold. Each returns
//! the [`Run`] so a caller can assert more on the same data.
//!
//! The sinks here: [`RedisSink`], [`HttpSink`], [`NatsSink`], [`AmqpSink`].
//! The Kafka one lives with the Kafka tests, because its client (librdkafka)
//! is optional in the `outbox` binary; so do the SQS and SNS ones (the AWS
//! SDK), with the SQS tests, which give the relay AWS credentials through
//! [`SinkUnderTest::relay_env`].

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use tokio_postgres::Client;

use crate::{Error, Nats, Postgres, RabbitMq, Receiver, Redis, Respond, Spawned};

/// How long any one wait of a scenario may take.
pub const LONG: Duration = Duration::from_secs(90);
/// How long [`broker_down`] keeps the broker down.
pub const OUTAGE: Duration = Duration::from_secs(30);
/// The aggregate type of every event the scenarios write.
pub const AGGREGATE_TYPE: &str = "orders";
/// The row header every event of [`kill_between_ack_and_mark`] carries.
pub const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// The relay's default `--max-attempts`: a dead letter has this many.
pub const MAX_ATTEMPTS: i32 = 5;

/// One message as a consumer of the broker reads it back.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivered {
    /// The event's `event_id`.
    pub event_id: String,
    /// The event's `aggregate_id`.
    pub aggregate_id: String,
    /// The outbox row's id: the order within an aggregate.
    pub outbox_id: i64,
    /// The event's payload.
    pub payload: Value,
    /// The id the sink stamps for consumers to deduplicate by
    /// (`Nats-Msg-Id`, AMQP `message_id`, Kafka `id`, HTTP
    /// `Idempotency-Key`); `None` where the sink stamps none. Where a
    /// broker can carry several, they are joined with `,`.
    pub dedup_id: Option<String>,
    /// The row's headers as the consumer sees them, in order.
    pub headers: Vec<(String, String)>,
    /// What else the broker carries, by name: AMQP properties
    /// (`delivery_mode`, `content_type`), the Kafka `key` and `partition`.
    pub properties: Vec<(String, String)>,
}

impl Delivered {
    /// The first value of row header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The value of property `name`.
    pub fn property(&self, name: &str) -> Option<&str> {
        self.properties
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Reads the fields every native-format JSON body has (`event_id`,
    /// `aggregate_id`, `outbox_id`, `payload`, and `headers` where the body
    /// carries them).
    pub fn from_json(body: &[u8]) -> Result<Delivered, String> {
        let body: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
        let text = |name: &str| {
            body[name]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| format!("no string {name:?} in {body}"))
        };
        Ok(Delivered {
            event_id: text("event_id")?,
            aggregate_id: text("aggregate_id")?,
            outbox_id: body["outbox_id"]
                .as_i64()
                .ok_or_else(|| format!("no outbox_id in {body}"))?,
            payload: body["payload"].clone(),
            dedup_id: None,
            headers: header_pairs(&body["headers"]),
            properties: Vec::new(),
        })
    }
}

/// A JSON object of headers as (name, value) pairs; strings as they are,
/// anything else as its JSON text.
fn header_pairs(headers: &Value) -> Vec<(String, String)> {
    headers
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            let v = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            (k.clone(), v)
        })
        .collect()
}

/// Which scenario a [`SinkUnderTest::check`] is called from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// [`in_order`]
    InOrder,
    /// [`broker_down`]
    BrokerDown,
    /// [`kill_between_ack_and_mark`]
    KillBetweenAckAndMark,
    /// [`oversized`]
    Oversized,
}

/// A sink and its throwaway broker, as the scenarios drive them.
pub trait SinkUnderTest: Sized {
    /// Short name, e.g. `redis`.
    const NAME: &'static str;
    /// A word every `last_error` of a row that failed because the broker is
    /// unreachable contains.
    const ERROR_WORD: &'static str;
    /// Whether the broker drops a re-sent message by its id, so each event
    /// is stored exactly once even after a crash.
    const DEDUPLICATES: bool;
    /// Whether the sink stamps [`Delivered::dedup_id`].
    const STAMPS_ID: bool;
    /// A word the permanent error of an oversized message contains.
    const TOO_LARGE: &'static str = "too large";

    /// Starts a fresh broker the relay can deliver to at once (streams,
    /// exchanges, queues and topics created).
    fn start() -> impl Future<Output = Result<Self, Error>>;
    /// The relay's `--sink`.
    fn url(&self) -> String;
    /// Flags the relay needs besides `--sink` (e.g. `--amqp-exchange`).
    fn relay_flags(&self) -> Vec<String> {
        Vec::new()
    }
    /// Environment the relay needs (e.g. AWS credentials and region for
    /// an emulator).
    fn relay_env(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Stops the broker; its port refuses connections afterwards.
    fn stop(&mut self) -> impl Future<Output = Result<(), Error>>;
    /// Starts it again on the same port with what it had stored.
    fn restart(&mut self) -> impl Future<Output = Result<(), Error>>;
    /// Everything the broker holds, per aggregate in delivery order.
    fn delivered(&self) -> impl Future<Output = Result<Vec<Delivered>, Error>>;
    /// How many messages the broker holds, by its own count.
    fn stored(&self) -> impl Future<Output = Result<usize, Error>> {
        async { Ok(self.delivered().await?.len()) }
    }
    /// The message size in bytes above which the broker (or the sink's
    /// client) refuses a message; `None` where there is none to test.
    fn max_message_bytes(&self) -> Option<usize>;
    /// Relay flags that make [`max_message_bytes`](Self::max_message_bytes)
    /// the limit (e.g. a producer option).
    fn oversize_flags(&self) -> Vec<String> {
        Vec::new()
    }
    /// Malformed `--sink` URLs of this scheme and a needle each one's
    /// error message contains.
    fn bad_urls() -> Vec<(&'static str, &'static str)>;
    /// Assertions only this sink makes on what a scenario delivered (keys,
    /// partitions, broker properties); panics when one fails.
    fn check(&self, scenario: Scenario, delivered: &[Delivered]) {
        let _ = (scenario, delivered);
    }
}

/// What a scenario leaves behind: the database, the broker and what it
/// delivered, for more assertions.
pub struct Run<S> {
    /// The cluster (kept running).
    pub pg: Postgres,
    /// The migrated database's URL.
    pub url: String,
    /// A connection to it.
    pub client: Client,
    /// The broker.
    pub sink: S,
    /// What the broker held at the end.
    pub delivered: Vec<Delivered>,
}

/// The database and the relay binary a scenario runs with.
struct Harness {
    relay: PathBuf,
    pg: Postgres,
    url: String,
    client: Client,
}

impl Harness {
    async fn start(relay: &Path) -> Harness {
        let pg = Postgres::start().await.expect("start postgres");
        let url = pg.fresh_database().await.expect("create a database");
        let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect to postgres");
        tokio::spawn(connection);
        outbox::migrate(&mut client, &outbox::Config::default())
            .await
            .expect("migrate");
        Harness {
            relay: relay.to_owned(),
            pg,
            url,
            client,
        }
    }

    fn finish<S>(self, sink: S, delivered: Vec<Delivered>) -> Run<S> {
        Run {
            pg: self.pg,
            url: self.url,
            client: self.client,
            sink,
            delivered,
        }
    }

    async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.expect(sql).get(0)
    }

    async fn unpublished(&self) -> i64 {
        self.count("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await
    }

    async fn published(&self) -> i64 {
        self.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await
    }

    /// Inserts `n` events, `per_aggregate` per aggregate, aggregates
    /// interleaved; payload `{"agg": a, "seq": s}`.
    async fn insert_events(&mut self, n: usize, per_aggregate: usize) {
        let aggregates = n.div_ceil(per_aggregate);
        let events: Vec<outbox::Event> = (0..n)
            .map(|i| {
                let (agg, seq) = (i % aggregates, i / aggregates);
                outbox::Event::new(
                    AGGREGATE_TYPE,
                    format!("order-{agg}"),
                    format!("Step{seq}"),
                    json!({"agg": agg, "seq": seq}),
                )
            })
            .collect();
        for chunk in events.chunks(1000) {
            self.enqueue(chunk).await;
        }
    }

    async fn enqueue(&mut self, events: &[outbox::Event]) -> Vec<uuid::Uuid> {
        let tx = self.client.transaction().await.expect("begin");
        let ids = outbox::Outbox::default()
            .enqueue_all(&tx, events)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
        ids
    }

    /// Spawns `outbox relay --sink <url> <flags>` (not waiting for it).
    fn relay(&self, sink: &str, flags: &[String], envs: &[(&str, &str)]) -> Spawned {
        let mut cmd = tokio::process::Command::new(&self.relay);
        for (key, _) in std::env::vars() {
            if key.starts_with("OUTBOX_") || key == "DATABASE_URL" || key == "RUST_LOG" {
                cmd.env_remove(key);
            }
        }
        cmd.env("RUST_LOG", "info,outbox_relay=debug")
            .env("DATABASE_URL", &self.url)
            .envs(envs.iter().copied())
            .arg("relay")
            .arg("--sink")
            .arg(sink)
            .args(flags);
        Spawned::spawn(cmd).expect("spawn the relay")
    }

    /// [`Harness::relay`] to `sink`, with its [`SinkUnderTest::relay_env`].
    fn relay_to<S: SinkUnderTest>(&self, sink: &S, flags: &[String], envs: &[(&str, &str)]) -> Spawned {
        let own = sink.relay_env();
        let mut all: Vec<(&str, &str)> = own.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        all.extend_from_slice(envs);
        self.relay(&sink.url(), flags, &all)
    }

    /// SIGTERM, and the documented exit: 0.
    async fn stop_relay(mut relay: Spawned) {
        assert_running(&relay);
        relay
            .signal(nix::sys::signal::Signal::SIGTERM)
            .expect("SIGTERM the relay");
        let status = relay.wait(LONG).await.expect("the relay exits on SIGTERM");
        assert_eq!(
            status.code(),
            Some(0),
            "relay exit status; lines: {:#?}",
            relay.lines()
        );
        assert_eq!(relay.count_lines("relay stopped"), 1, "the relay says it stopped");
    }
}

fn assert_running(relay: &Spawned) {
    if let Some(status) = relay.exit_status() {
        panic!("the relay exited ({status}); its lines: {:#?}", relay.lines());
    }
}

/// Polls `check` every 20 ms until it is true; panics naming `what` after
/// [`LONG`], or at once if `relay` exited.
async fn wait_until<F, Fut>(what: &str, relay: Option<&Spawned>, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + LONG;
    while !check().await {
        if let Some(relay) = relay {
            assert_running(relay);
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {LONG:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn flags<S: SinkUnderTest>(sink: &S, extra: &[&str]) -> Vec<String> {
    let mut flags = sink.relay_flags();
    flags.extend(extra.iter().map(|s| (*s).to_owned()));
    flags
}

async fn start<S: SinkUnderTest>() -> S {
    match S::start().await {
        Ok(sink) => sink,
        Err(e) => panic!("starting the {} broker: {e}", S::NAME),
    }
}

async fn delivered<S: SinkUnderTest>(sink: &S) -> Vec<Delivered> {
    match sink.delivered().await {
        Ok(d) => d,
        Err(e) => panic!("reading back from {}: {e}", S::NAME),
    }
}

async fn stored<S: SinkUnderTest>(sink: &S) -> usize {
    match sink.stored().await {
        Ok(n) => n,
        Err(e) => panic!("counting what {} holds: {e}", S::NAME),
    }
}

/// No row has spent an attempt (so none is a dead letter); the message
/// names the errors of those that did.
async fn assert_no_attempt_spent<S: SinkUnderTest>(h: &Harness, when: &str) {
    let spent = h
        .client
        .query(
            "SELECT coalesce(last_error, ''), count(*) FROM outbox WHERE attempts > 0 GROUP BY 1 ORDER BY 2 DESC",
            &[],
        )
        .await
        .expect("rows that spent an attempt");
    let errors: Vec<(String, i64)> = spent.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(
        errors.is_empty(),
        "{}: the outage spent attempts {when}: {errors:?}",
        S::NAME
    );
}

/// How many different event_ids `delivered` holds.
pub fn distinct(delivered: &[Delivered]) -> usize {
    delivered
        .iter()
        .map(|d| d.event_id.as_str())
        .collect::<HashSet<_>>()
        .len()
}

/// Per-aggregate order violations: a message whose outbox id is lower than
/// one delivered before it for the same aggregate.
pub fn order_violations(delivered: &[Delivered]) -> usize {
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut violations = 0;
    for d in delivered {
        let prev = last.entry(&d.aggregate_id).or_insert(i64::MIN);
        if d.outbox_id < *prev {
            violations += 1;
        }
        *prev = (*prev).max(d.outbox_id);
    }
    violations
}

/// Every delivered message carries the sink's dedup id, and it is the
/// event_id.
fn assert_dedup_ids<S: SinkUnderTest>(delivered: &[Delivered]) {
    if !S::STAMPS_ID {
        return;
    }
    for d in delivered {
        assert_eq!(
            d.dedup_id.as_deref(),
            Some(d.event_id.as_str()),
            "{}: the dedup id is the event_id",
            S::NAME
        );
    }
}

/// Scenario 1: 5,000 events over 500 aggregates (10 each, interleaved),
/// relayed in batches of 500. Every event arrives exactly once by event_id,
/// in per-aggregate order, the broker's own count agrees, every message
/// carries the sink's dedup id, and every row is marked published.
pub async fn in_order<S: SinkUnderTest>(relay: &Path) -> Run<S> {
    let mut h = Harness::start(relay).await;
    let sink = start::<S>().await;
    h.insert_events(5_000, 10).await;

    let relay = h.relay_to(&sink, &flags(&sink, &["--batch-size", "500"]), &[]);
    wait_until("all 5,000 events published", Some(&relay), || async {
        h.unpublished().await == 0
    })
    .await;
    Harness::stop_relay(relay).await;

    assert_eq!(stored(&sink).await, 5_000, "{}: the broker's own count", S::NAME);
    let delivered = delivered(&sink).await;
    assert_eq!(
        delivered.len(),
        5_000,
        "{}: no duplicates without a crash",
        S::NAME
    );
    assert_eq!(distinct(&delivered), 5_000, "{}: every event", S::NAME);
    assert_eq!(
        order_violations(&delivered),
        0,
        "{}: per-aggregate order",
        S::NAME
    );
    let aggregates: HashSet<&str> = delivered.iter().map(|d| d.aggregate_id.as_str()).collect();
    assert_eq!(aggregates.len(), 500, "{}: aggregates", S::NAME);
    assert_dedup_ids::<S>(&delivered);
    assert_eq!(h.published().await, 5_000, "{}: the outbox fully marked", S::NAME);
    sink.check(Scenario::InOrder, &delivered);
    h.finish(sink, delivered)
}

/// Scenario 2: 2,000 events (500 aggregates), relayed with the default
/// settings (batches of 100, 5 attempts); once 200 are published the
/// broker stops, 2,000 more events are written (so rows are left however
/// fast the relay was), and the broker stays down for [`OUTAGE`]. An outage
/// is not an event failure: meanwhile no row has spent an attempt (so none
/// is a dead letter), the rows given back say `sink unavailable` and name
/// the broker, and the relay keeps running. Once the broker is back the
/// outbox drains and all 4,000 events are there; a deduplicating broker
/// holds each exactly once, another at most the batch at the broker when it
/// stopped (100) twice. How soon delivery resumed after the broker's return
/// is printed (a measurement, not asserted).
pub async fn broker_down<S: SinkUnderTest>(relay: &Path) -> Run<S> {
    let mut h = Harness::start(relay).await;
    let mut sink = start::<S>().await;
    h.insert_events(2_000, 4).await;
    let relay = h.relay_to(&sink, &flags(&sink, &[]), &[]);
    wait_until("200 events published", Some(&relay), || async {
        h.published().await >= 200
    })
    .await;

    sink.stop().await.expect("stop the broker");
    let stopped = Instant::now();
    h.insert_events(2_000, 4).await;
    wait_until(
        "the broker down for the outage, found unavailable",
        Some(&relay),
        || async {
            stopped.elapsed() >= OUTAGE
                && h.count("SELECT count(*) FROM outbox WHERE last_error LIKE 'sink unavailable: %'")
                    .await
                    > 0
        },
    )
    .await;
    let left = h.unpublished().await;
    assert!(
        (2_000..=3_800).contains(&left),
        "{}: {left} rows left while the broker is down",
        S::NAME
    );
    assert_no_attempt_spent::<S>(&h, "during the outage").await;
    let error: String = h
        .client
        .query_one(
            "SELECT last_error FROM outbox WHERE last_error LIKE 'sink unavailable: %' LIMIT 1",
            &[],
        )
        .await
        .expect("a row the outage gave back")
        .get(0);
    assert!(error.contains(S::ERROR_WORD), "{}: {error}", S::NAME);
    assert_running(&relay);

    let before = h.published().await;
    sink.restart().await.expect("restart the broker");
    let back = Instant::now();
    wait_until(
        "delivering again once the broker is back",
        Some(&relay),
        || async { h.published().await > before },
    )
    .await;
    let resumed = back.elapsed();
    wait_until(
        "everything published once the broker is back",
        Some(&relay),
        || async { h.unpublished().await == 0 },
    )
    .await;
    eprintln!(
        "{}: broker down {:.1} s; delivering again {} ms after it was back, {left} rows drained in {} ms",
        S::NAME,
        back.duration_since(stopped).as_secs_f64(),
        resumed.as_millis(),
        back.elapsed().as_millis()
    );
    Harness::stop_relay(relay).await;

    let delivered = delivered(&sink).await;
    assert_eq!(distinct(&delivered), 4_000, "{}: nothing lost", S::NAME);
    let duplicates = delivered.len() - 4_000;
    if S::DEDUPLICATES {
        assert_eq!(duplicates, 0, "{}: re-sends were dropped by their id", S::NAME);
        assert_eq!(stored(&sink).await, 4_000, "{}: the broker's own count", S::NAME);
    } else {
        // Only the batch at the broker when it stopped can be sent twice.
        assert!(duplicates <= 100, "{}: {duplicates} duplicates", S::NAME);
    }
    assert_no_attempt_spent::<S>(&h, "after the broker's return").await;
    assert_dedup_ids::<S>(&delivered);
    sink.check(Scenario::BrokerDown, &delivered);
    h.finish(sink, delivered)
}

/// Scenario 3: 5 events on 5 aggregates, each with row headers
/// `traceparent` and `id: spoofed`, payload `{"order_id": n}`. A relay
/// with batches of 3 and the `pause-after-deliver` failpoint delivers 3,
/// which the broker stores, and parks before marking; it is SIGKILLed
/// there (nothing marked, the batch rolled back) and a plain relay started.
/// Then the outbox drains, every event is delivered, a deduplicating
/// broker holds 5, another 8 (the 3 re-sent), every message carries its
/// own event_id as the dedup id (the row header did not replace it) and
/// the row headers arrive.
pub async fn kill_between_ack_and_mark<S: SinkUnderTest>(relay: &Path) -> Run<S> {
    let mut h = Harness::start(relay).await;
    let sink = start::<S>().await;
    let events: Vec<outbox::Event> = (1..=5)
        .map(|order| {
            outbox::Event::new(
                AGGREGATE_TYPE,
                order.to_string(),
                "OrderPaid",
                json!({"order_id": order}),
            )
            .with_header("traceparent", TRACEPARENT)
            // Must not replace a sink's own id.
            .with_header("id", "spoofed")
        })
        .collect();
    let ids: HashSet<String> = h.enqueue(&events).await.iter().map(ToString::to_string).collect();

    let batch = flags(&sink, &["--batch-size", "3"]);
    let mut relay = h.relay_to(&sink, &batch, &[("OUTBOX_FAILPOINT", "pause-after-deliver")]);
    // The failpoint parks the relay for good after the broker acknowledged
    // the first batch, so 3 stored means it is between the ack and the mark.
    wait_until("the first batch of 3 stored", Some(&relay), || async {
        stored(&sink).await >= 3
    })
    .await;
    assert_eq!(stored(&sink).await, 3, "{}: the fault: 3 stored", S::NAME);
    assert_eq!(h.unpublished().await, 5, "{}: none marked", S::NAME);
    relay.kill().expect("SIGKILL the relay");
    relay.wait(LONG).await.expect("reap the relay");
    assert_eq!(
        h.unpublished().await,
        5,
        "{}: the killed batch was rolled back, not marked",
        S::NAME
    );

    let relay = h.relay_to(&sink, &batch, &[]);
    wait_until("all 5 published after the restart", Some(&relay), || async {
        h.unpublished().await == 0
    })
    .await;
    Harness::stop_relay(relay).await;

    let delivered = delivered(&sink).await;
    let expected = if S::DEDUPLICATES { 5 } else { 8 };
    assert_eq!(
        (delivered.len(), distinct(&delivered)),
        (expected, 5),
        "{}: (stored, distinct)",
        S::NAME
    );
    let seen: HashSet<String> = delivered.iter().map(|d| d.event_id.clone()).collect();
    assert_eq!(seen, ids, "{}: exactly the enqueued events", S::NAME);
    assert_dedup_ids::<S>(&delivered);
    for d in &delivered {
        assert_eq!(
            d.header("traceparent"),
            Some(TRACEPARENT),
            "{}: headers arrive",
            S::NAME
        );
    }
    sink.check(Scenario::KillBetweenAckAndMark, &delivered);
    h.finish(sink, delivered)
}

/// Scenario 4: aggregates `order-0`, `big`, `order-1`, `order-2`, the big
/// one twice the broker's size limit. The three small ones are delivered;
/// the big one fails permanently on its first attempt, so it is a dead
/// letter at once (`dead_at` set, `attempts` 1, `last_error`
/// `permanent: <ERROR_WORD>…` naming the size).
///
/// # Panics
///
/// If the sink has no size limit ([`SinkUnderTest::max_message_bytes`]).
pub async fn oversized<S: SinkUnderTest>(relay: &Path) -> Run<S> {
    let mut h = Harness::start(relay).await;
    let sink = start::<S>().await;
    let limit = sink
        .max_message_bytes()
        .unwrap_or_else(|| panic!("{} declares no message size limit", S::NAME));
    let small = |i: usize| {
        outbox::Event::new(
            AGGREGATE_TYPE,
            format!("order-{i}"),
            "OrderPlaced",
            json!({"i": i}),
        )
    };
    let big = outbox::Event::new(
        AGGREGATE_TYPE,
        "big",
        "OrderPlaced",
        json!({"blob": "x".repeat(2 * limit)}),
    );
    h.enqueue(&[small(0), big, small(1), small(2)]).await;

    let mut extra = sink.relay_flags();
    extra.extend(sink.oversize_flags());
    let relay = h.relay_to(&sink, &extra, &[]);
    wait_until("3 delivered and the big one dead", Some(&relay), || async {
        h.published().await == 3
            && h.count("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
                .await
                == 1
    })
    .await;
    Harness::stop_relay(relay).await;

    let row = h
        .client
        .query_one(
            "SELECT attempts, last_error, published_at IS NULL FROM outbox WHERE aggregate_id = 'big'",
            &[],
        )
        .await
        .expect("the big row");
    let (attempts, error, unpublished): (i32, String, bool) = (row.get(0), row.get(1), row.get(2));
    assert!(
        error
            .to_lowercase()
            .starts_with(&format!("permanent: {}", S::ERROR_WORD))
            && error.contains(S::TOO_LARGE),
        "{}: {error}",
        S::NAME
    );
    assert_eq!(attempts, 1, "{}: dead-lettered on its first attempt", S::NAME);
    assert!(unpublished, "{}: the big one is not marked", S::NAME);
    let delivered = delivered(&sink).await;
    let mut aggregates: Vec<&str> = delivered.iter().map(|d| d.aggregate_id.as_str()).collect();
    aggregates.sort_unstable();
    if !S::DEDUPLICATES {
        // A refused message can take the channel, and with it the confirms
        // of messages the broker already stored, down (RabbitMQ): those are
        // resent, at least once.
        aggregates.dedup();
    }
    assert_eq!(aggregates, ["order-0", "order-1", "order-2"], "{}", S::NAME);
    sink.check(Scenario::Oversized, &delivered);
    h.finish(sink, delivered)
}

/// Scenario 5: every [`SinkUnderTest::bad_urls`] URL makes `outbox relay`
/// exit 2 with the needle in its message (checked before any connection,
/// so no broker or database is started).
pub async fn bad_urls<S: SinkUnderTest>(relay: &Path) {
    for (url, needle) in S::bad_urls() {
        let mut cmd = tokio::process::Command::new(relay);
        for (key, _) in std::env::vars() {
            if key.starts_with("OUTBOX_") || key == "DATABASE_URL" {
                cmd.env_remove(key);
            }
        }
        // Nothing listens on port 1: a relay that got past its
        // configuration would fail differently.
        cmd.env("DATABASE_URL", "postgres://127.0.0.1:1/unused")
            .args(["relay", "--sink", url])
            .kill_on_drop(true);
        let out = tokio::time::timeout(LONG, cmd.output())
            .await
            .expect("the relay exits")
            .expect("run the relay");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {url:?}: {stderr}", S::NAME);
        assert!(
            stderr.contains(needle),
            "{}: {url:?}: expected {needle:?} in {stderr}",
            S::NAME
        );
    }
}

/// The stream the Redis sink writes the scenarios' events to.
pub const REDIS_STREAM: &str = "outbox.event.orders";

/// The relay's `--max-event-bytes` in the Redis oversized scenario.
pub const REDIS_MAX_EVENT_BYTES: usize = 4096;

/// Redis Streams: a persistent redis-server (so a restart keeps the
/// stream), read back with `XRANGE`. Redis keeps re-sends. It has no size
/// limit of its own to test (its smallest `proto-max-bulk-len` is 1 MB, and
/// going over it breaks the connection rather than refusing the message),
/// so the oversized scenario runs against the relay's `--max-event-bytes`.
#[derive(Debug)]
pub struct RedisSink {
    /// The server.
    pub redis: Redis,
}

impl SinkUnderTest for RedisSink {
    const NAME: &'static str = "redis";
    const ERROR_WORD: &'static str = "redis";
    const DEDUPLICATES: bool = false;
    const STAMPS_ID: bool = false;

    async fn start() -> Result<Self, Error> {
        Ok(RedisSink {
            redis: Redis::start_persistent().await?,
        })
    }

    fn url(&self) -> String {
        self.redis.url()
    }

    async fn stop(&mut self) -> Result<(), Error> {
        self.redis.stop().await
    }

    async fn restart(&mut self) -> Result<(), Error> {
        self.redis.restart().await
    }

    async fn delivered(&self) -> Result<Vec<Delivered>, Error> {
        use redis::AsyncCommands;
        let failed = |e: redis::RedisError| Error::Failed {
            doing: format!("reading {REDIS_STREAM} from {}", self.redis.url()),
            detail: e.to_string(),
        };
        let client = redis::Client::open(self.redis.url()).map_err(failed)?;
        let mut conn = client.get_multiplexed_async_connection().await.map_err(failed)?;
        let reply: redis::streams::StreamRangeReply = conn.xrange_all(REDIS_STREAM).await.map_err(failed)?;
        reply
            .ids
            .iter()
            .map(|entry| {
                let field = |name: &str| entry.get::<String>(name);
                let bad = |what: &str| Error::Failed {
                    doing: format!("reading entry {} of {REDIS_STREAM}", entry.id),
                    detail: format!("{what} missing or malformed"),
                };
                let headers: Value = match field("headers") {
                    Some(h) => serde_json::from_str(&h).map_err(|_| bad("headers"))?,
                    None => Value::Null,
                };
                Ok(Delivered {
                    event_id: field("event_id").ok_or_else(|| bad("event_id"))?,
                    aggregate_id: field("aggregate_id").ok_or_else(|| bad("aggregate_id"))?,
                    outbox_id: field("outbox_id")
                        .and_then(|s| s.parse().ok())
                        .ok_or_else(|| bad("outbox_id"))?,
                    payload: field("payload")
                        .and_then(|p| serde_json::from_str(&p).ok())
                        .ok_or_else(|| bad("payload"))?,
                    dedup_id: None,
                    headers: header_pairs(&headers),
                    properties: Vec::new(),
                })
            })
            .collect()
    }

    /// Redis refuses nothing by size short of 512 MB (and going over its
    /// `proto-max-bulk-len` breaks the connection instead), so the limit is
    /// the relay's own `--max-event-bytes`.
    fn max_message_bytes(&self) -> Option<usize> {
        Some(REDIS_MAX_EVENT_BYTES)
    }

    fn oversize_flags(&self) -> Vec<String> {
        vec!["--max-event-bytes".into(), REDIS_MAX_EVENT_BYTES.to_string()]
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("redis://", "redis://"),
            ("redis://127.0.0.1:notaport", "invalid port number"),
        ]
    }
}

/// The size limit of [`HttpSink`]'s receiver.
pub const HTTP_MAX_BODY: usize = 4096;

/// Webhooks: a [`Receiver`] answering 200, and 413 to bodies over
/// [`HTTP_MAX_BODY`]; "stopping the broker" stops it listening. What it
/// delivered is every request it answered with 200, in arrival order, the
/// dedup id its `Idempotency-Key`.
#[derive(Debug)]
pub struct HttpSink {
    /// The receiver.
    pub receiver: Receiver,
}

impl SinkUnderTest for HttpSink {
    const NAME: &'static str = "http";
    const ERROR_WORD: &'static str = "http";
    const DEDUPLICATES: bool = false;
    const STAMPS_ID: bool = true;
    const TOO_LARGE: &'static str = "413";

    async fn start() -> Result<Self, Error> {
        let receiver = Receiver::start(Respond::Ok).await?;
        receiver.set_max_body(Some(HTTP_MAX_BODY));
        Ok(HttpSink { receiver })
    }

    fn url(&self) -> String {
        self.receiver.url()
    }

    async fn stop(&mut self) -> Result<(), Error> {
        self.receiver.stop().await;
        Ok(())
    }

    async fn restart(&mut self) -> Result<(), Error> {
        self.receiver.restart().await
    }

    async fn delivered(&self) -> Result<Vec<Delivered>, Error> {
        self.receiver
            .received()
            .iter()
            .filter(|r| (200..300).contains(&r.status))
            .map(|r| {
                let mut d = Delivered::from_json(&r.raw).map_err(|detail| Error::Failed {
                    doing: format!("reading a request to {}", self.receiver.url()),
                    detail,
                })?;
                d.dedup_id = r.header("idempotency-key").map(str::to_owned);
                if let Some(t) = r.header("content-type") {
                    d.properties.push(("content_type".into(), t.to_owned()));
                }
                Ok(d)
            })
            .collect()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(HTTP_MAX_BODY)
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("http://", "empty host"),
            ("https://", "empty host"),
            ("http://127.0.0.1:notaport/events", "invalid port number"),
        ]
    }
}

/// The JetStream stream [`NatsSink`] creates for `outbox.event.>`.
pub const NATS_STREAM: &str = "OUTBOX";
/// The `max_payload` of [`NatsSink`]'s server.
pub const NATS_MAX_PAYLOAD: usize = 4096;

/// NATS JetStream: a nats-server with `max_payload` [`NATS_MAX_PAYLOAD`]
/// and stream [`NATS_STREAM`] on `outbox.event.>`, read back with an
/// ordered consumer. JetStream drops a re-send by its `Nats-Msg-Id`.
#[derive(Debug)]
pub struct NatsSink {
    /// The server.
    pub nats: Nats,
}

impl NatsSink {
    async fn stream(&self) -> Result<async_nats::jetstream::stream::Stream, Error> {
        let client = async_nats::connect(self.nats.url())
            .await
            .map_err(|e| Error::Failed {
                doing: format!("connecting to {}", self.nats.url()),
                detail: e.to_string(),
            })?;
        async_nats::jetstream::new(client)
            .get_stream(NATS_STREAM)
            .await
            .map_err(|e| Error::Failed {
                doing: format!("getting stream {NATS_STREAM}"),
                detail: e.to_string(),
            })
    }
}

impl SinkUnderTest for NatsSink {
    const NAME: &'static str = "nats";
    const ERROR_WORD: &'static str = "nats";
    const DEDUPLICATES: bool = true;
    const STAMPS_ID: bool = true;
    const TOO_LARGE: &'static str = "max payload";

    async fn start() -> Result<Self, Error> {
        let nats = Nats::start_with_max_payload(NATS_MAX_PAYLOAD).await?;
        let failed = |e: String| Error::Failed {
            doing: format!("creating stream {NATS_STREAM} on {}", nats.url()),
            detail: e,
        };
        let client = async_nats::connect(nats.url())
            .await
            .map_err(|e| failed(e.to_string()))?;
        async_nats::jetstream::new(client)
            .create_stream(async_nats::jetstream::stream::Config {
                name: NATS_STREAM.into(),
                subjects: vec!["outbox.event.>".into()],
                ..Default::default()
            })
            .await
            .map_err(|e| failed(e.to_string()))?;
        Ok(NatsSink { nats })
    }

    fn url(&self) -> String {
        self.nats.url()
    }

    async fn stop(&mut self) -> Result<(), Error> {
        self.nats.stop().await
    }

    async fn restart(&mut self) -> Result<(), Error> {
        self.nats.restart().await
    }

    async fn stored(&self) -> Result<usize, Error> {
        let stream = self.stream().await?;
        let info = stream.get_info().await.map_err(|e| Error::Failed {
            doing: format!("reading stream {NATS_STREAM}'s info"),
            detail: e.to_string(),
        })?;
        Ok(usize::try_from(info.state.messages).unwrap_or(usize::MAX))
    }

    async fn delivered(&self) -> Result<Vec<Delivered>, Error> {
        use async_nats::jetstream::consumer::pull::OrderedConfig;
        let n = self.stored().await?;
        let failed = |e: String| Error::Failed {
            doing: format!("reading stream {NATS_STREAM}"),
            detail: e,
        };
        let consumer = self
            .stream()
            .await?
            .create_consumer(OrderedConfig::default())
            .await
            .map_err(|e| failed(e.to_string()))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| failed(e.to_string()))?
            .take(n);
        let mut out = Vec::with_capacity(n);
        loop {
            let next = tokio::time::timeout(LONG, messages.next())
                .await
                .map_err(|_| failed(format!("got {} of {n} messages within {LONG:?}", out.len())))?;
            let Some(m) = next else { break };
            let m = m.map_err(|e| failed(e.to_string()))?;
            let mut d = Delivered::from_json(&m.payload).map_err(failed)?;
            for (name, values) in m.headers.iter().flat_map(|h| h.iter()) {
                for value in values {
                    if AsRef::<str>::as_ref(name) == "Nats-Msg-Id" {
                        d.dedup_id = Some(value.as_str().to_owned());
                    } else {
                        d.headers.push((name.to_string(), value.as_str().to_owned()));
                    }
                }
            }
            out.push(d);
        }
        Ok(out)
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(NATS_MAX_PAYLOAD)
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![("nats://", "nats://"), ("nats://127.0.0.1:notaport", "notaport")]
    }
}

/// The throwaway node's `max_message_size`: small, so the oversized
/// scenario's message is refused by the broker itself.
const AMQP_MAX_MESSAGE: usize = 4096;

/// RabbitMQ: a private node (the scenarios stop it, so not the machine's)
/// with a durable topic exchange and a durable queue bound to it with `#`,
/// read back by consuming without acknowledging (the messages stay). It
/// keeps re-sends; its `max_message_size` is [`AMQP_MAX_MESSAGE`].
#[derive(Debug)]
pub struct AmqpSink {
    /// The node.
    pub broker: RabbitMq,
    /// The exchange the relay publishes to (`--amqp-exchange`).
    pub exchange: String,
    /// The queue bound to it.
    pub queue: String,
}

impl AmqpSink {
    async fn channel(&self) -> Result<(lapin::Connection, lapin::Channel), Error> {
        let failed = |e: lapin::Error| Error::Failed {
            doing: format!("connecting to {}", self.broker.url()),
            detail: e.to_string(),
        };
        let connection =
            lapin::Connection::connect(&self.broker.url(), lapin::ConnectionProperties::default())
                .await
                .map_err(failed)?;
        let channel = connection.create_channel().await.map_err(failed)?;
        Ok((connection, channel))
    }
}

fn amqp_failed(doing: &str) -> impl Fn(lapin::Error) -> Error + '_ {
    move |e| Error::Failed {
        doing: doing.to_owned(),
        detail: e.to_string(),
    }
}

impl SinkUnderTest for AmqpSink {
    const NAME: &'static str = "amqp";
    const ERROR_WORD: &'static str = "amqp";
    const DEDUPLICATES: bool = false;
    const STAMPS_ID: bool = true;

    async fn start() -> Result<Self, Error> {
        use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
        use lapin::types::FieldTable;
        let broker = RabbitMq::start_with_max_message_size(AMQP_MAX_MESSAGE).await?;
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let sink = AmqpSink {
            broker,
            exchange: format!("outbox-test-{suffix}"),
            queue: format!("outbox-test-{suffix}"),
        };
        let (_connection, channel) = sink.channel().await?;
        let failed = amqp_failed("declaring the test topology");
        channel
            .exchange_declare(
                sink.exchange.as_str().into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(&failed)?;
        channel
            .queue_declare(
                sink.queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(&failed)?;
        channel
            .queue_bind(
                sink.queue.as_str().into(),
                sink.exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(&failed)?;
        Ok(sink)
    }

    fn url(&self) -> String {
        self.broker.url()
    }

    fn relay_flags(&self) -> Vec<String> {
        vec!["--amqp-exchange".into(), self.exchange.clone()]
    }

    async fn stop(&mut self) -> Result<(), Error> {
        self.broker.stop().await
    }

    async fn restart(&mut self) -> Result<(), Error> {
        self.broker.restart().await
    }

    async fn stored(&self) -> Result<usize, Error> {
        use lapin::options::QueueDeclareOptions;
        let (_connection, channel) = self.channel().await?;
        let queue = channel
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .map_err(amqp_failed("declaring the queue passively"))?;
        Ok(queue.message_count() as usize)
    }

    async fn delivered(&self) -> Result<Vec<Delivered>, Error> {
        use lapin::options::BasicConsumeOptions;
        use lapin::types::AMQPValue;
        let n = self.stored().await?;
        // Not acknowledged: when the connection closes they are queued again.
        let (_connection, channel) = self.channel().await?;
        let consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await
            .map_err(amqp_failed("consuming the queue"))?;
        let mut consumer = consumer.take(n);
        let failed = |detail: String| Error::Failed {
            doing: format!("reading queue {}", self.queue),
            detail,
        };
        let mut out = Vec::with_capacity(n);
        loop {
            let next = tokio::time::timeout(LONG, consumer.next())
                .await
                .map_err(|_| failed(format!("got {} of {n} messages within {LONG:?}", out.len())))?;
            let Some(delivery) = next else { break };
            let delivery = delivery.map_err(|e| failed(e.to_string()))?;
            let mut d = Delivered::from_json(&delivery.data).map_err(failed)?;
            let p = &delivery.properties;
            d.dedup_id = p.message_id().as_ref().map(|m| m.as_str().to_owned());
            if let Some(mode) = p.delivery_mode() {
                d.properties.push(("delivery_mode".into(), mode.to_string()));
            }
            if let Some(t) = p.content_type() {
                d.properties.push(("content_type".into(), t.as_str().to_owned()));
            }
            for (name, value) in p.headers().iter().flat_map(|h| h.inner().iter()) {
                let value = match value {
                    AMQPValue::LongString(s) => s.to_string(),
                    other => format!("{other:?}"),
                };
                d.headers.push((name.as_str().to_owned(), value));
            }
            out.push(d);
        }
        Ok(out)
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(AMQP_MAX_MESSAGE)
    }

    fn bad_urls() -> Vec<(&'static str, &'static str)> {
        vec![
            ("amqp://", "amqp://"),
            ("amqp://guest:guest@127.0.0.1:notaport/%2f", "notaport"),
        ]
    }

    fn check(&self, _scenario: Scenario, delivered: &[Delivered]) {
        for d in delivered {
            assert_eq!(d.property("delivery_mode"), Some("2"), "amqp: persistent");
            assert_eq!(
                d.property("content_type"),
                Some("application/json"),
                "amqp: content type"
            );
        }
    }
}
