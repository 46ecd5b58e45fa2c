//! `redis-group`: the broker is at-least-once too.
//!
//! The relay XADDs events to a Redis stream; consumers read it in a group
//! (`XREADGROUP`). A consumer that dies after its side effect committed but
//! before its `XACK` leaves the entries it read pending (`XPENDING`);
//! another consumer takes them over with `XAUTOCLAIM` and processes them
//! again. The inbox recognises the one already applied, so every order
//! ships once. Both consumers are `outbox consume` processes; the first is
//! parked by `OUTBOX_FAILPOINT=pause-after-commit` and kill -9'd.

use outbox_testkit::Spawned;
use redis::AsyncCommands;

use super::shop::SCHEMA;
use crate::report::{Outcome, Verdict};
use crate::scratch::{LONG, Scratch, wait_until};

const EVENTS: i64 = 5;
const PREFIX: &str = "outbox_lab.event";
const STREAM: &str = "outbox_lab.event.orders";
const GROUP: &str = "shipping";

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let mut out = Outcome::new(
        "redis-group",
        "Redis consumer group: a consumer dies before XACK",
        "Redelivery happens on every hop: a consumer that dies before acknowledging leaves its entries \
         pending, and whoever takes them over sees them again. The inbox keeps the side effect single.",
        format!(
            "{EVENTS} events relayed to the stream {STREAM}; `outbox consume --group {GROUP} --claim-idle 1s` \
             consumer a (parked after its first commit, kill -9), then consumer b; side effect: one shipment row"
        ),
    );
    lab.reset().await?;
    let redis_url = lab.redis_url().await?;
    let mut redis = redis::Client::open(redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let _: i64 = redis.del(STREAM).await?;
    let events: Vec<_> = (1..=EVENTS)
        .map(|o| Scratch::order_event(o, "OrderPaid"))
        .collect();
    lab.outbox.enqueue_all(&lab.db, &events).await?;
    lab.run_cli(&[
        "relay",
        "--sink",
        &redis_url,
        "--stream-prefix",
        PREFIX,
        "--drain",
    ])
    .await?;
    let in_stream: i64 = redis.xlen(STREAM).await?;

    let mut first = consumer(
        lab,
        &redis_url,
        "a",
        &[("OUTBOX_FAILPOINT", "pause-after-commit")],
    )
    .await?;
    first
        .wait_for_notification("OUTBOX_FAILPOINT=pause-after-commit reached", LONG)
        .await?;
    first.kill()?;
    first.wait(LONG).await?;
    let shipped_before = lab.shop().await?.shipments;
    let pending: redis::streams::StreamPendingReply = redis.xpending(STREAM, GROUP).await?;
    let pending_after_death = pending.count();

    let second = consumer(lab, &redis_url, "b", &[]).await?;
    wait_until("every order shipped and nothing pending", async || {
        let pending: redis::streams::StreamPendingReply = redis.clone().xpending(STREAM, GROUP).await?;
        Ok(lab.shop().await?.shipments >= EVENTS && pending.count() == 0)
    })
    .await?;
    second.signal(nix::sys::signal::Signal::SIGTERM)?;
    let mut second = second;
    second.wait(LONG).await?;
    let stopped = second
        .lines()
        .into_iter()
        .find(|l| l.contains("consumer stopped"))
        .unwrap_or_default();
    let fields = serde_json::from_str::<serde_json::Value>(&stopped)
        .map(|v| v["fields"].clone())
        .unwrap_or_default();
    let shop = lab.shop().await?;
    let _: i64 = redis.del(STREAM).await?;

    out.row(
        "entries in the stream",
        in_stream,
        EVENTS.to_string(),
        Verdict::check(in_stream == EVENTS),
    );
    out.row(
        "consumer a killed after 1 commit, before XACK: shipped / pending",
        format!("{shipped_before} / {pending_after_death}"),
        "entries stay pending",
        Verdict::check(shipped_before == 1 && pending_after_death > 0),
    );
    out.row(
        "consumer b: claimed (XAUTOCLAIM) / processed / duplicates skipped by the inbox",
        format!(
            "{} / {} / {}",
            fields["claimed"], fields["processed"], fields["duplicates"]
        ),
        "the dead consumer's entries / the rest / 1",
        Verdict::check(fields["duplicates"] == 1),
    );
    out.row(
        "shipments / orders shipped twice",
        format!("{} / {}", shop.shipments, shop.shipped_twice),
        format!("{EVENTS} / 0"),
        Verdict::check(shop.shipments == EVENTS && shop.shipped_twice == 0),
    );
    Ok(out)
}

/// `outbox consume` on the lab stream, shipping through the lab's inbox.
async fn consumer(
    lab: &Scratch,
    redis_url: &str,
    name: &str,
    envs: &[(&str, &str)],
) -> anyhow::Result<Spawned> {
    let apply = format!("INSERT INTO {SCHEMA}.shipments (order_id) VALUES (($2::text)::bigint)");
    let mut cmd = lab.outbox_cmd(&[
        "consume",
        "--from",
        redis_url,
        "--stream",
        STREAM,
        "--group",
        GROUP,
        "--consumer",
        name,
        "--claim-idle",
        "1s",
        "--apply",
        &apply,
        "--inbox-schema",
        SCHEMA,
        "--inbox-table",
        "processed_events",
        "--log-format",
        "json",
    ])?;
    cmd.envs(envs.iter().copied());
    let c = Spawned::spawn_notified(cmd)?;
    c.wait_for_notification("READY=1", LONG).await?;
    Ok(c)
}
