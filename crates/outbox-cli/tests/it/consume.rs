//! `outbox consume` (the Redis Streams worker; the NATS and RabbitMQ ones below): a worker killed with SIGKILL
//! after its side effect committed and before its XACK leaves the entry
//! pending; another worker takes it over with XAUTOCLAIM, the inbox knows
//! it, and the side effect happened exactly once per event.

use outbox::InboxConfig;
use outbox_testkit::{Nats, Redis, Spawned};
use redis::AsyncCommands;

use crate::support::{Db, LONG, outbox_cmd, run_cli, text, wait_until};

const STREAM: &str = "outbox.event.orders";
const APPLY: &str = "INSERT INTO shipments (event_id, order_id, kind) VALUES ($1, $2, $3)";

async fn worker(db: &Db, redis: &Redis, name: &str, envs: &[(&str, &str)]) -> Spawned {
    let mut cmd = outbox_cmd();
    cmd.args([
        "consume",
        "--from",
        &redis.url(),
        "--stream",
        STREAM,
        "--group",
        "shipping",
    ])
    .args(["--consumer", name, "--claim-idle", "1s", "--apply", APPLY])
    .args(["--log-format", "json"])
    .env("DATABASE_URL", &db.url)
    .envs(envs.iter().copied());
    let w = Spawned::spawn_notified(cmd).expect("spawn consumer");
    w.wait_for_notification("READY=1", LONG)
        .await
        .expect("consumer ready");
    w
}

/// An inbox, a shipments table the side effect fills, and 20 events (10
/// aggregates) published to `sink` by the relay.
async fn publish_twenty(db: &mut Db, sink: &str) {
    twenty_waiting(db).await;
    drain(db, sink).await;
}

/// An inbox, a shipments table the side effect fills, and 20 events (10
/// aggregates) in the outbox, not yet published.
async fn twenty_waiting(db: &mut Db) {
    outbox::migrate_inbox(&mut db.client, &InboxConfig::default())
        .await
        .unwrap();
    db.client
        .batch_execute("CREATE TABLE shipments (id bigserial, event_id uuid, order_id text, kind text)")
        .await
        .unwrap();
    db.insert_events(20, 2).await;
}

/// `outbox relay --drain` to `sink`, exiting 0.
async fn drain(db: &Db, sink: &str) {
    let relay = run_cli(
        &["relay", "--sink", sink, "--drain"],
        &[("DATABASE_URL", db.url.as_str())],
    )
    .await;
    assert_eq!(relay.status.code(), Some(0), "{}", text(&relay.stderr));
}

#[tokio::test]
async fn a_worker_killed_before_its_ack_is_taken_over_and_ships_once() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    publish_twenty(&mut db, &redis.url()).await;
    // Not an outbox event: must be moved aside, not block the group.
    let mut r = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: String = r.xadd(STREAM, "*", &[("junk", "1")]).await.unwrap();

    let mut first = worker(&db, &redis, "a", &[("OUTBOX_FAILPOINT", "pause-after-commit")]).await;
    first
        .wait_for_notification("OUTBOX_FAILPOINT=pause-after-commit reached", LONG)
        .await
        .unwrap();
    first.kill().unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM shipments").await,
        1,
        "the effect committed"
    );

    let second = worker(&db, &redis, "b", &[]).await;
    wait_until("every event shipped and nothing pending", LONG, || async {
        let mut r = r.clone();
        let pending: redis::streams::StreamPendingReply = r.xpending(STREAM, "shipping").await.unwrap();
        db.count("SELECT count(*) FROM shipments").await == 20 && pending.count() == 0
    })
    .await;
    second.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    let mut second = second;
    assert!(second.wait(LONG).await.unwrap().success());

    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) FROM shipments").await,
        20
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 20);
    let stopped = second
        .lines()
        .into_iter()
        .find(|l| l.contains("consumer stopped"))
        .expect("a summary line");
    // The first worker had read all 21 entries in one XREADGROUP, so the
    // second took over all of them: 19 new, the one already shipped
    // recognised by the inbox, the junk one moved aside.
    let stopped: serde_json::Value = serde_json::from_str(&stopped).expect(&stopped);
    let fields = &stopped["fields"];
    for (field, n) in [
        ("processed", 19),
        ("duplicates", 1),
        ("claimed", 21),
        ("malformed", 1),
    ] {
        assert_eq!(fields[field], n, "{field}: {stopped}");
    }
    let malformed: i64 = r.xlen(format!("{STREAM}.malformed")).await.unwrap();
    assert_eq!(malformed, 1);
}

/// Its PostgreSQL connection terminated under it (a restart, a failover),
/// the worker connects again and ships everything once (`outbox-lab soak`
/// found it exiting instead).
#[tokio::test]
async fn a_worker_whose_connection_is_terminated_connects_again_and_ships_once() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    twenty_waiting(&mut db).await;
    let mut w = worker(&db, &redis, "a", &[]).await;

    let others = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                  AND backend_type = 'client backend' AND pid <> pg_backend_pid()";
    assert_eq!(db.count(others).await, 1, "the worker's one connection");
    db.client
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() \
              AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )
        .await
        .unwrap();
    wait_until("the worker's backend gone", LONG, || async {
        db.count(others).await == 0
    })
    .await;

    // The worker finds out at its first event.
    drain(&db, &redis.url()).await;
    wait_until("every event shipped", LONG, || async {
        db.count("SELECT count(*) FROM shipments").await == 20
    })
    .await;
    assert!(
        w.exit_status().is_none(),
        "the worker still runs: {:?}",
        w.lines()
    );
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) FROM shipments").await,
        20
    );
    w.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(w.wait(LONG).await.unwrap().success(), "{:?}", w.lines());
}

#[tokio::test]
async fn an_apply_statement_that_does_not_prepare_is_a_configuration_error() {
    let mut db = Db::start().await;
    outbox::migrate_inbox(&mut db.client, &InboxConfig::default())
        .await
        .unwrap();
    let out = run_cli(
        &[
            "consume",
            "--from",
            "redis://127.0.0.1:1",
            "--stream",
            "s",
            "--group",
            "g",
            "--apply",
            "INSERT INTO nowhere VALUES ($1)",
        ],
        &[("DATABASE_URL", db.url.as_str())],
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("nowhere"), "{}", text(&out.stderr));
}

#[tokio::test]
async fn a_nats_worker_killed_before_its_ack_is_redelivered_and_ships_once() {
    let mut db = Db::start().await;
    let nats = Nats::start().await.unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "OUTBOX".into(),
        subjects: vec!["outbox.event.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    publish_twenty(&mut db, &nats.url()).await;
    js.publish("outbox.event.junk", "not an event".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let worker = |envs: &'static [(&'static str, &'static str)]| {
        let mut cmd = outbox_cmd();
        cmd.args([
            "consume",
            "--from",
            &nats.url(),
            "--stream",
            "OUTBOX",
            "--group",
            "shipping",
        ])
        .args(["--claim-idle", "1s", "--apply", APPLY, "--log-format", "json"])
        .env("DATABASE_URL", &db.url)
        .envs(envs.iter().copied());
        Spawned::spawn_notified(cmd).expect("spawn consumer")
    };
    let mut first = worker(&[("OUTBOX_FAILPOINT", "pause-after-commit")]);
    first
        .wait_for_notification("OUTBOX_FAILPOINT=pause-after-commit reached", LONG)
        .await
        .unwrap();
    first.kill().unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM shipments").await,
        1,
        "the effect committed"
    );

    let mut second = worker(&[]);
    second.wait_for_notification("READY=1", LONG).await.unwrap();
    wait_until("every event shipped", LONG, || async {
        db.count("SELECT count(*) FROM processed_events").await == 20
    })
    .await;
    // The junk message and the last acks may still be in flight: wait for
    // the consumer's own account of them before stopping it.
    wait_until("nothing left unacknowledged", LONG, || async {
        let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
            .get_stream("OUTBOX")
            .await
            .unwrap()
            .get_consumer("shipping")
            .await
            .unwrap();
        let info = consumer.info().await.unwrap().clone();
        info.num_ack_pending == 0 && info.num_pending == 0
    })
    .await;
    second.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(second.wait(LONG).await.unwrap().success());

    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 20);
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) FROM shipments").await,
        20
    );
    let stopped = second
        .lines()
        .into_iter()
        .find(|l| l.contains("consumer stopped"))
        .expect("a summary line");
    let stopped: serde_json::Value = serde_json::from_str(&stopped).expect(&stopped);
    let fields = &stopped["fields"];
    assert_eq!(fields["processed"], 19, "{stopped}");
    assert_eq!(fields["duplicates"], 1, "{stopped}");
    assert_eq!(fields["malformed"], 1, "{stopped}");
    assert!(fields["claimed"].as_u64().unwrap() >= 1, "{stopped}");
}

#[tokio::test]
async fn an_amqp_worker_killed_before_its_ack_is_redelivered_and_ships_once() {
    use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;

    use crate::amqp::{MACHINE_BROKER, Topology};

    let mut db = Db::start().await;
    // A durable, non-exclusive queue: the workers consume it on their own
    // connections.
    let topology = Topology::new(MACHINE_BROKER, "orders.#", true).await;
    outbox::migrate_inbox(&mut db.client, &InboxConfig::default())
        .await
        .unwrap();
    db.client
        .batch_execute("CREATE TABLE shipments (id bigserial, event_id uuid, order_id text, kind text)")
        .await
        .unwrap();
    db.insert_events(20, 2).await;
    let relay = run_cli(
        &[
            "relay",
            "--sink",
            MACHINE_BROKER,
            "--amqp-exchange",
            &topology.exchange,
            "--drain",
        ],
        &[("DATABASE_URL", db.url.as_str())],
    )
    .await;
    assert_eq!(relay.status.code(), Some(0), "{}", text(&relay.stderr));
    // Not an outbox event: must be rejected, not redelivered for ever.
    topology
        .channel
        .basic_publish(
            "".into(),
            topology.queue.as_str().into(),
            BasicPublishOptions::default(),
            b"not an event",
            lapin::BasicProperties::default(),
        )
        .await
        .unwrap();
    let depth = || async {
        topology
            .channel
            .queue_declare(
                topology.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    };
    wait_until("21 messages queued", LONG, || async { depth().await == 21 }).await;

    let worker = |envs: &'static [(&'static str, &'static str)]| {
        let mut cmd = outbox_cmd();
        cmd.args(["consume", "--from", MACHINE_BROKER, "--queue", &topology.queue])
            .args(["--prefetch", "50", "--apply", APPLY, "--log-format", "json"])
            .env("DATABASE_URL", &db.url)
            .envs(envs.iter().copied());
        Spawned::spawn_notified(cmd).expect("spawn consumer")
    };
    let mut first = worker(&[("OUTBOX_FAILPOINT", "pause-after-commit")]);
    first
        .wait_for_notification("OUTBOX_FAILPOINT=pause-after-commit reached", LONG)
        .await
        .unwrap();
    first.kill().unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM shipments").await,
        1,
        "the effect committed"
    );

    let mut second = worker(&[]);
    second.wait_for_notification("READY=1", LONG).await.unwrap();
    wait_until("every event shipped", LONG, || async {
        db.count("SELECT count(*) FROM processed_events").await == 20
    })
    .await;
    // The junk message is last in the queue.
    second
        .wait_for_notification("OUTBOX_MESSAGE=rejected", LONG)
        .await
        .unwrap();
    second.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(second.wait(LONG).await.unwrap().success());
    assert_eq!(
        depth().await,
        0,
        "nothing requeued: every message acknowledged or rejected"
    );

    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 20);
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) FROM shipments").await,
        20
    );
    let stopped = second
        .lines()
        .into_iter()
        .find(|l| l.contains("consumer stopped"))
        .expect("a summary line");
    let stopped: serde_json::Value = serde_json::from_str(&stopped).expect(&stopped);
    let fields = &stopped["fields"];
    assert_eq!(fields["processed"], 19, "{stopped}");
    assert_eq!(fields["duplicates"], 1, "{stopped}");
    assert_eq!(fields["malformed"], 1, "{stopped}");
    // At least the committed one came back flagged redelivered.
    assert!(fields["claimed"].as_u64().unwrap() >= 1, "{stopped}");
    topology
        .channel
        .queue_delete(topology.queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    topology.delete_exchange().await;
}

/// `crates/outbox/examples/<name>`, as `cargo test` built it beside the
/// test binary (`target/<profile>/deps/it-…` → `target/<profile>/examples`).
fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let path = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>/deps")
        .join("examples")
        .join(name);
    assert!(
        path.is_file(),
        "{} is not built: cargo build -p outbox --features redis --examples",
        path.display()
    );
    path
}

/// The Redis worker example, run as a user runs it: it ships each of 20
/// events once, and a re-send of all 20 (the relay after a crash between
/// send and mark) ships nothing more.
#[tokio::test]
async fn the_redis_worker_example_ships_each_event_once_across_a_resend() {
    let mut db = Db::start().await;
    let redis = Redis::start().await.unwrap();
    publish_twenty(&mut db, &redis.url()).await;

    let mut cmd = tokio::process::Command::new(example("redis_worker"));
    cmd.env("DATABASE_URL", &db.url).env("REDIS_URL", redis.url());
    let mut worker = Spawned::spawn(cmd).expect("spawn the example");
    wait_until("20 shipments", LONG, || async {
        db.count("SELECT count(*) FROM shipments").await == 20
    })
    .await;

    // Every row unmarked and relayed again: 20 more entries, same event_ids.
    db.client
        .execute("UPDATE outbox SET published_at = NULL", &[])
        .await
        .unwrap();
    let relay = run_cli(
        &["relay", "--sink", &redis.url(), "--drain"],
        &[("DATABASE_URL", db.url.as_str())],
    )
    .await;
    assert_eq!(relay.status.code(), Some(0), "{}", text(&relay.stderr));
    let mut r = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    assert_eq!(r.xlen::<_, i64>(STREAM).await.unwrap(), 40);
    wait_until("all 40 entries read and acknowledged", LONG, || async {
        let mut r = r.clone();
        let groups: redis::streams::StreamInfoGroupsReply = r.xinfo_groups(STREAM).await.unwrap();
        let stream: redis::streams::StreamInfoStreamReply = r.xinfo_stream(STREAM).await.unwrap();
        groups.groups.iter().any(|g| {
            g.name == "shipping" && g.pending == 0 && g.last_delivered_id == stream.last_generated_id
        })
    })
    .await;

    worker.signal(nix::sys::signal::Signal::SIGINT).unwrap();
    assert!(worker.wait(LONG).await.unwrap().success(), "{:?}", worker.lines());
    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 20);
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) FROM shipments").await,
        20
    );
    let summary = worker
        .lines()
        .into_iter()
        .find(|l| l.starts_with("WorkerStats"))
        .expect("the example prints its stats");
    assert!(summary.contains("processed: 20, duplicates: 20"), "{summary}");
}
