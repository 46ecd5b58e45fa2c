//! A PostgreSQL failover under a running relay (issue 32): a primary with a
//! synchronous streaming standby, writers and the relay on a multi-host
//! `DATABASE_URL` with `target_session_attrs=read-write`; the primary is
//! killed (immediate shutdown) and the standby promoted while events flow.
//! Writers retry what failed and keep a ledger of which commits were
//! acknowledged. Afterwards: every acknowledged commit delivered, nothing
//! delivered that no writer wrote, no aggregate reordered (first
//! deliveries, as a consumer behind an inbox sees them), and the same relay
//! process still running: nobody restarted it or ran a recovery.
//!
//! A commit whose acknowledgement was lost in the crash (the `COMMIT` was
//! sent, its answer never came) may or may not be on the new primary: if
//! delivered it is counted apart, not as a phantom. The writer retries that
//! event under a new `event_id`, so an aggregate may see the same step
//! twice; never an earlier one after a later one.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::{Config, Event, Outbox};
use outbox_testkit::{PgSettings, Post, Postgres, Receiver, Replication, Respond, Spawned};
use serde_json::json;
use tokio_postgres::Client;

use crate::metrics::{http_addr, ready, scrape, value};
use crate::support::{LONG, start_relay, stop_relay, wait_until};

/// Writers, aggregates per writer and events per aggregate: 1,600 events.
const WRITERS: usize = 4;
const AGGREGATES: usize = 10;
const STEPS: usize = 40;
/// Acknowledged commits before the primary is killed.
const KILL_AFTER: usize = 400;

/// What became of one event a writer tried to commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// `COMMIT` answered: it is in the database.
    Acked,
    /// `COMMIT` was sent and no answer came: in the database or not.
    Unknown,
}

#[derive(Debug, Clone)]
struct Attempt {
    aggregate: String,
    step: usize,
    outcome: Outcome,
    /// When the writer learned the outcome.
    at: Instant,
}

/// What the writers tried, by `event_id`.
#[derive(Default)]
struct Ledger {
    attempts: Mutex<HashMap<String, Attempt>>,
}

impl Ledger {
    fn record(&self, event: &Event, step: usize, outcome: Outcome) {
        self.attempts.lock().unwrap().insert(
            event.event_id.to_string(),
            Attempt {
                aggregate: event.aggregate_id.clone(),
                step,
                outcome,
                at: Instant::now(),
            },
        );
    }

    fn acked(&self) -> usize {
        let attempts = self.attempts.lock().unwrap();
        attempts.values().filter(|a| a.outcome == Outcome::Acked).count()
    }

    fn snapshot(&self) -> HashMap<String, Attempt> {
        self.attempts.lock().unwrap().clone()
    }
}

/// A primary with a synchronous standby and a migrated outbox, and the
/// multi-host URL of its database.
struct Pair {
    primary: Postgres,
    standby: Postgres,
    url: String,
}

impl Pair {
    /// `settings` for the primary (the standby copies them); `params` end
    /// the URL after `target_session_attrs=read-write`.
    async fn start(settings: PgSettings, wal: bool, host: &str, params: &str) -> Pair {
        let primary = Postgres::start_with(settings).await.expect("start the primary");
        let url = primary.fresh_database().await.expect("create database");
        let db = url.rsplit('/').next().unwrap().to_owned();
        let mut client = connect(&primary_only(&primary, host, &db, params))
            .await
            .expect("connect");
        outbox::migrate(&mut client, &Config::default())
            .await
            .expect("migrate");
        if wal {
            outbox::wal::migrate_wal(&client, &Config::default())
                .await
                .expect("migrate --wal");
        }
        let standby = primary
            .start_standby(Replication::Sync)
            .await
            .expect("start a synchronous standby");
        let url = format!(
            "postgres://postgres@{host}:{},{host}:{}/{db}?target_session_attrs=read-write{params}",
            primary.port(),
            standby.port()
        );
        Pair {
            primary,
            standby,
            url,
        }
    }
}

fn primary_only(pg: &Postgres, host: &str, db: &str, params: &str) -> String {
    format!(
        "postgres://postgres@{host}:{}/{db}?target_session_attrs=read-write{params}",
        pg.port()
    )
}

/// One connection through the relay's own connector (TLS settings, several
/// hosts), one attempt.
async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let config = outbox_relay::pg::parse_url(url, Duration::from_secs(2)).expect("a valid URL");
    outbox_relay::pg::connect_once(&config).await
}

/// Where one write attempt failed.
enum Failed {
    /// Before `COMMIT` was sent: nothing was committed.
    Before,
    /// `COMMIT` was sent and no answer came.
    AtCommit,
}

async fn write_one(client: &mut Client, event: &Event) -> Result<(), Failed> {
    let tx = client.transaction().await.map_err(|_| Failed::Before)?;
    Outbox::default()
        .enqueue(&tx, event)
        .await
        .map_err(|_| Failed::Before)?;
    tx.commit().await.map_err(|_| Failed::AtCommit)
}

/// One writer: its aggregates' steps in order, each event in a
/// transaction of its own, retried under a new `event_id` until a commit
/// is acknowledged.
async fn writer(url: String, writer: usize, ledger: Arc<Ledger>) {
    let mut client: Option<Client> = None;
    for step in 0..STEPS {
        for a in 0..AGGREGATES {
            let aggregate = format!("w{writer}-a{a}");
            loop {
                let c = match &mut client {
                    Some(c) if !c.is_closed() => c,
                    _ => match connect(&url).await {
                        Ok(c) => client.insert(c),
                        Err(_) => {
                            // No primary yet: the next attempt, soon.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    },
                };
                let event = Event::new(
                    "orders",
                    aggregate.clone(),
                    "Step",
                    json!({"aggregate": aggregate, "step": step}),
                );
                match write_one(c, &event).await {
                    Ok(()) => {
                        ledger.record(&event, step, Outcome::Acked);
                        break;
                    }
                    Err(Failed::Before) => client = None,
                    Err(Failed::AtCommit) => {
                        ledger.record(&event, step, Outcome::Unknown);
                        client = None;
                    }
                }
            }
        }
    }
}

/// What the sink saw against the ledger; the counts not asserted are
/// printed (through `Debug`): what a failover costs.
#[derive(Debug)]
#[allow(dead_code)]
struct Verdict {
    acked: usize,
    /// Acknowledged and never delivered.
    lost: usize,
    /// Delivered and never written (in no ledger entry).
    phantom: usize,
    /// Delivered, their acknowledgement lost in the crash.
    unknown_delivered: usize,
    unknown_not_delivered: usize,
    /// Deliveries of an event already delivered.
    repeats: usize,
    /// First deliveries whose step is below one already delivered for
    /// their aggregate.
    reordered: usize,
}

fn check(ledger: &HashMap<String, Attempt>, received: &[Post]) -> Verdict {
    let delivered: Vec<&Post> = received.iter().filter(|p| p.status < 300).collect();
    let mut seen = HashSet::new();
    let mut last_step: HashMap<String, usize> = HashMap::new();
    let (mut phantom, mut repeats, mut reordered) = (0, 0, 0);
    for post in &delivered {
        let id = post.body["event_id"].as_str().unwrap().to_owned();
        if !seen.insert(id.clone()) {
            repeats += 1;
            continue;
        }
        let Some(attempt) = ledger.get(&id) else {
            phantom += 1;
            continue;
        };
        assert_eq!(post.body["payload"]["step"], attempt.step, "the payload of {id}");
        let last = last_step.entry(attempt.aggregate.clone()).or_insert(0);
        if attempt.step < *last {
            reordered += 1;
        }
        *last = (*last).max(attempt.step);
    }
    let of = |outcome: Outcome, delivered: bool| {
        ledger
            .iter()
            .filter(|(id, a)| a.outcome == outcome && seen.contains(*id) == delivered)
            .count()
    };
    Verdict {
        acked: of(Outcome::Acked, true) + of(Outcome::Acked, false),
        lost: of(Outcome::Acked, false),
        phantom,
        unknown_delivered: of(Outcome::Unknown, true),
        unknown_not_delivered: of(Outcome::Unknown, false),
        repeats,
        reordered,
    }
}

/// The relay's arguments per scenario.
struct Scenario<'a> {
    name: &'a str,
    settings: PgSettings,
    wal: bool,
    /// The host name in URLs (TLS checks names).
    host: &'a str,
    /// URL parameters after `target_session_attrs=read-write`.
    params: String,
    relay: &'a [&'a str],
    /// Promote only once the relay's partition lease ran out (a failover
    /// slower than the lease timeout).
    past_the_lease: bool,
}

/// One of the relay's `/readyz` checks (`postgres`, `leases`).
async fn check_of(addr: &str, name: &str) -> String {
    ready(addr).await.1["checks"][name]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn postgres_check(addr: &str) -> String {
    check_of(addr, "postgres").await
}

/// Runs `scenario` and checks the outcome; returns the relay, still
/// running, and its `--http` address, for more checks.
async fn failover(scenario: Scenario<'_>) -> (Spawned, String) {
    let Pair {
        mut primary,
        mut standby,
        url,
    } = Pair::start(scenario.settings, scenario.wal, scenario.host, &scenario.params).await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    // A slower sink, so the table holds undelivered rows when the primary
    // dies (what the WAL source must backfill).
    receiver.set_delay(Some(Duration::from_millis(2)));
    let addr = http_addr();
    let mut args = vec!["--http", addr.as_str()];
    args.extend_from_slice(scenario.relay);
    let relay = start_relay(&url, &receiver.url(), &args, &[]).await;
    let pid = relay.pid();
    let ledger = Arc::new(Ledger::default());
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| tokio::spawn(writer(url.clone(), w, Arc::clone(&ledger))))
        .collect();

    wait_until("writes and deliveries under way", LONG, || async {
        ledger.acked() >= KILL_AFTER && receiver.count() >= KILL_AFTER / 4
    })
    .await;
    let killed = Instant::now();
    primary.stop_immediate().await.expect("kill the primary");
    // Before the promotion the relay finds no host that takes writes: the
    // dead primary refuses, the standby is refused by
    // target_session_attrs=read-write. It says so, and keeps trying.
    wait_until("the relay refused by the standby", LONG, || async {
        postgres_check(&addr).await.contains("does not allow writes")
    })
    .await;
    let refused = Instant::now();
    if scenario.past_the_lease {
        wait_until("the relay's lease ran out", LONG, || async {
            check_of(&addr, "leases").await.starts_with("heartbeat expired")
        })
        .await;
    }
    let outage = Instant::now();
    standby.promote().await.expect("promote the standby");
    let promoted = Instant::now();

    for w in writers {
        tokio::time::timeout(LONG, w)
            .await
            .expect("the writers finish on the new primary")
            .unwrap();
    }
    let ledger = ledger.snapshot();
    let acked: HashSet<&String> = ledger
        .iter()
        .filter(|(_, a)| a.outcome == Outcome::Acked)
        .map(|(id, _)| id)
        .collect();
    assert_eq!(
        acked.len(),
        WRITERS * AGGREGATES * STEPS,
        "one acknowledged commit per step"
    );
    let everything = async {
        loop {
            let received = receiver.received();
            let ids: HashSet<&str> = received
                .iter()
                .filter_map(|p| p.body["event_id"].as_str())
                .collect();
            if acked.iter().all(|id| ids.contains(id.as_str())) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    if tokio::time::timeout(LONG, everything).await.is_err() {
        for line in relay.lines().iter().rev().take(60).rev() {
            eprintln!("relay: {line}");
        }
        panic!(
            "{}: acknowledged events not delivered after {LONG:?}",
            scenario.name
        );
    }
    let received = receiver.received();
    let verdict = check(&ledger, &received);
    // After the promotion: the first delivery at all, and the first of an
    // event acknowledged by the new primary.
    let first_after = received.iter().map(|p| p.at).find(|at| *at > promoted);
    let first_new = received
        .iter()
        .filter(|p| {
            p.body["event_id"]
                .as_str()
                .and_then(|id| ledger.get(id))
                .is_some_and(|a| a.at > promoted)
        })
        .map(|p| p.at)
        .min();
    eprintln!(
        "{}: {verdict:?}; refused {:?} after the kill, promotion started {:?} after that and took {:?}; \
         first delivery {:?} after the promotion, first of a new event {:?} after it",
        scenario.name,
        refused - killed,
        outage - refused,
        promoted - outage,
        first_after.map(|at| at - promoted),
        first_new.map(|at| at - promoted),
    );
    assert_eq!(verdict.acked, WRITERS * AGGREGATES * STEPS);
    assert_eq!(
        verdict.lost, 0,
        "{}: acknowledged and lost: {verdict:?}",
        scenario.name
    );
    assert_eq!(verdict.phantom, 0, "{}: {verdict:?}", scenario.name);
    assert_eq!(verdict.reordered, 0, "{}: {verdict:?}", scenario.name);
    assert_eq!(relay.pid(), pid);
    assert!(
        relay.exit_status().is_none(),
        "{}: the relay exited: {:#?}",
        scenario.name,
        relay.lines()
    );
    wait_until("/readyz ok on the new primary", LONG, || async {
        postgres_check(&addr).await == "ok"
    })
    .await;
    (relay, addr)
}

fn poll<'a>(name: &'a str, claim: &'a [&'a str]) -> Scenario<'a> {
    Scenario {
        name,
        settings: PgSettings::default(),
        wal: false,
        host: "127.0.0.1",
        params: String::new(),
        relay: claim,
        past_the_lease: false,
    }
}

#[tokio::test]
async fn issue_32_polling_relay_follows_a_failover_with_lock_claims() {
    let (relay, _) = failover(poll("poll, lock claims", &[])).await;
    assert!(
        relay.notified("STATUS=reconnected"),
        "the batch sessions came back"
    );
    stop_relay(relay).await;
}

/// The standby is promoted only after the relay's partition lease ran out
/// (`--lease-timeout 3s`): the relay claims again once its lease task,
/// reconnected, ticked on the new primary.
#[tokio::test]
async fn issue_32_polling_relay_follows_a_failover_slower_than_its_lease() {
    let (relay, _) = failover(Scenario {
        past_the_lease: true,
        ..poll("poll, outage past the lease", &["--lease-timeout", "3s"])
    })
    .await;
    stop_relay(relay).await;
}

#[tokio::test]
async fn issue_32_polling_relay_follows_a_failover_with_deadline_claims() {
    let (relay, _) = failover(poll("poll, deadline claims", &["--claim", "deadline"])).await;
    assert!(
        relay.notified("STATUS=reconnected"),
        "the batch sessions came back"
    );
    stop_relay(relay).await;
}

/// Log tailing: the slot is not on the standby (PostgreSQL 15 has no
/// failover slots), so the relay makes it again on the promoted server
/// and delivers the rows the table holds before streaming it.
#[tokio::test]
async fn issue_32_wal_relay_makes_its_slot_again_after_a_failover() {
    let (relay, addr) = failover(Scenario {
        name: "wal",
        settings: PgSettings::default().set("wal_level", "logical"),
        wal: true,
        host: "127.0.0.1",
        params: String::new(),
        relay: &["--source", "wal"],
        past_the_lease: false,
    })
    .await;
    let (body, s) = scrape(&addr).await;
    assert_eq!(
        value(&s, "outbox_wal_slot_recreated_total", &[("reason", "missing")]),
        Some(1.0),
        "{body}"
    );
    let backfilled = value(&s, "outbox_wal_backfilled_events_total", &[]).unwrap_or(0.0);
    assert!(
        backfilled > 0.0,
        "rows were waiting when the primary died: {body}"
    );
    eprintln!("wal: {backfilled} rows backfilled");
    stop_relay(relay).await;
}

/// `n` events, one transaction each, round robin over aggregates `a0`..`a3`,
/// steps from `from`.
async fn write_steps(client: &mut Client, from: usize, n: usize) {
    for i in from..from + n {
        let event = Event::new(
            "orders",
            format!("a{}", i % 4),
            "Step",
            json!({"aggregate": format!("a{}", i % 4), "step": i / 4}),
        );
        let tx = client.transaction().await.unwrap();
        Outbox::default().enqueue(&tx, &event).await.unwrap();
        tx.commit().await.unwrap();
    }
}

/// Per aggregate, the steps of first deliveries in arrival order, and
/// how many deliveries each event got.
fn arrivals(received: &[Post]) -> (HashMap<String, Vec<u64>>, HashMap<String, usize>) {
    let mut steps: HashMap<String, Vec<u64>> = HashMap::new();
    let mut times: HashMap<String, usize> = HashMap::new();
    for post in received {
        let id = post.body["event_id"].as_str().unwrap().to_owned();
        let n = times.entry(id).or_insert(0);
        *n += 1;
        if *n == 1 {
            let aggregate = post.body["aggregate_id"].as_str().unwrap().to_owned();
            steps
                .entry(aggregate)
                .or_default()
                .push(post.body["payload"]["step"].as_u64().unwrap());
        }
    }
    (steps, times)
}

/// 100 events delivered and deleted on the first primary, then a failover
/// while nobody streams; on the promoted server 50 events, then a slot
/// appears (`setup`: made by someone else, or by `outbox migrate --wal`),
/// then 50 more. The 50 in between are in no slot: only the table has
/// them. Returns the receiver, once all 200 arrived, and the relay.
async fn slot_made_by_someone_else(setup: &str) -> (Receiver, Spawned, String, Client) {
    let Pair {
        mut primary,
        mut standby,
        url,
    } = Pair::start(
        PgSettings::default().set("wal_level", "logical"),
        true,
        "127.0.0.1",
        "",
    )
    .await;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let addr = http_addr();
    let args = ["--source", "wal", "--http", addr.as_str()];
    let relay = start_relay(&url, &receiver.url(), &args, &[]).await;
    let mut client = connect(&url).await.unwrap();
    write_steps(&mut client, 0, 100).await;
    receiver.wait_for_count(100, LONG).await.unwrap();
    wait_until("the delivered rows deleted", LONG, || async {
        client
            .query_one("SELECT count(*) FROM outbox", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 0
    })
    .await;
    // The relay sleeps through the failover ("sigstop"), or is stopped
    // and started again ("migrate").
    let sigstop = setup == "sigstop";
    let mut asleep = None;
    if sigstop {
        relay.signal(nix::sys::signal::Signal::SIGSTOP).unwrap();
        asleep = Some(relay);
    } else {
        stop_relay(relay).await;
    }
    primary.stop_immediate().await.unwrap();
    standby.promote().await.unwrap();
    let mut client = connect(&url).await.unwrap();
    write_steps(&mut client, 100, 50).await;
    if sigstop {
        outbox::sql::WalSql::new(&Config::default())
            .unwrap()
            .create_slot(&client)
            .await
            .unwrap();
    } else {
        let out = crate::support::run_cli(&["migrate", "--wal"], &[("DATABASE_URL", url.as_str())]).await;
        assert!(out.status.success(), "{}", crate::support::text(&out.stderr));
        assert!(
            crate::support::text(&out.stdout).contains("replication slot public_outbox: created"),
            "{}",
            crate::support::text(&out.stdout)
        );
        assert!(
            crate::wal::backfill_owed(&client).await,
            "migrate --wal marked the publication"
        );
    }
    write_steps(&mut client, 150, 50).await;
    let relay = match asleep {
        Some(relay) => {
            relay.signal(nix::sys::signal::Signal::SIGCONT).unwrap();
            relay
        }
        None => start_relay(&url, &receiver.url(), &args, &[]).await,
    };
    if tokio::time::timeout(LONG, receiver.wait_for_count(200, LONG))
        .await
        .is_err()
    {
        for line in relay.lines().iter().rev().take(60).rev() {
            eprintln!("relay: {line}");
        }
    }
    receiver.wait_for_count(200, LONG).await.unwrap();
    wait_until("the backfill's mark cleared", LONG, || async {
        !crate::wal::backfill_owed(&client).await
    })
    .await;
    (receiver, relay, addr, client)
}

/// Checks the 200 events of [`slot_made_by_someone_else`] arrived once
/// each, in order per aggregate, 150 of them from the table.
async fn check_backfilled(receiver: &Receiver, addr: &str) {
    let received = receiver.received();
    let (steps, times) = arrivals(&received);
    assert_eq!(times.len(), 200, "every event");
    assert!(
        times.values().all(|n| *n == 1),
        "each once (the stream's copies of backfilled rows dropped): {} deliveries",
        received.len()
    );
    for (aggregate, steps) in &steps {
        assert!(steps.is_sorted(), "{aggregate}: {steps:?}");
        assert_eq!(steps.len(), 50, "{aggregate}");
    }
    let (body, s) = scrape(addr).await;
    assert_eq!(
        value(&s, "outbox_wal_backfilled_events_total", &[]),
        Some(100.0),
        "{body}"
    );
    assert_eq!(
        value(&s, "outbox_wal_slot_recreated_total", &[("reason", "missing")]),
        None,
        "the slot was there: {body}"
    );
}

/// A slot on the promoted server the relay did not make (Patroni's
/// permanent slots, or a script): the relay sees the timeline change
/// (`IDENTIFY_SYSTEM`), keeps the slot and delivers the table's rows
/// first. Without that, the 50 rows written before the slot existed would
/// never be delivered.
#[tokio::test]
async fn issue_32_wal_relay_backfills_when_the_promoted_server_already_has_a_slot() {
    let (receiver, relay, addr, _client) = slot_made_by_someone_else("sigstop").await;
    check_backfilled(&receiver, &addr).await;
    let lines = stop_relay(relay).await;
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.contains("the server changed under the relay (timeline 1 → 2)"))
            .count(),
        1,
        "{lines:#?}"
    );
}

/// After a failover a person (or a deploy) runs `outbox migrate --wal` on
/// the promoted server before the relay starts: the slot it makes starts
/// late, so it leaves the mark on the publication, and the relay delivers
/// the table's rows first.
#[tokio::test]
async fn issue_32_migrate_wal_after_a_failover_leaves_the_backfill_to_the_relay() {
    let (receiver, relay, addr, _client) = slot_made_by_someone_else("migrate").await;
    check_backfilled(&receiver, &addr).await;
    stop_relay(relay).await;
}

/// Both servers take TLS only (`hostssl`), and the URL checks the
/// certificate and the name of each host it tries (`verify-full`):
/// the relay, its replication connection and the writers follow the
/// failover over TLS.
async fn over_tls(name: &str, wal: bool, relay: &[&str]) -> (Spawned, String) {
    let ca = crate::tls::Ca::new("failover CA");
    let server = ca.server();
    let mut settings = PgSettings::default()
        .tls(server.cert_pem, server.key_pem)
        .hba("hostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust");
    if wal {
        settings = settings.set("wal_level", "logical");
    }
    failover(Scenario {
        name,
        settings,
        wal,
        // The certificate's name: each host's is checked.
        host: "localhost",
        params: format!("&sslmode=verify-full&sslrootcert={}", ca.root()),
        relay,
        past_the_lease: false,
    })
    .await
}

#[tokio::test]
async fn issue_32_polling_relay_follows_a_failover_over_tls() {
    let (relay, _) = over_tls("poll over TLS", false, &[]).await;
    stop_relay(relay).await;
}

#[tokio::test]
async fn issue_32_wal_relay_follows_a_failover_over_tls() {
    let (relay, addr) = over_tls("wal over TLS", true, &["--source", "wal"]).await;
    let (body, s) = scrape(&addr).await;
    assert_eq!(
        value(&s, "outbox_wal_slot_recreated_total", &[("reason", "missing")]),
        Some(1.0),
        "{body}"
    );
    stop_relay(relay).await;
}
