//! `crash-before-mark`: at least once, by construction.
//!
//! The relay delivers, then marks. Killed between the two, its batch rolls
//! back with its locks, and the next relay sends those events again. Five
//! events, batch size 3, the relay parked by `OUTBOX_FAILPOINT=pause-after-deliver`
//! once the receiver acknowledged the first three, and kill -9'd there: the
//! receiver gets 8 requests for 5 events. A naive consumer ships three
//! orders twice; the inbox ships each once.

use std::collections::HashSet;

use anyhow::bail;
use outbox_testkit::{Receiver, Respond};

use super::shop::{SCHEMA, event_id};
use crate::report::{Outcome, Verdict};
use crate::scratch::{LONG, Scratch};

const EVENTS: i64 = 5;
const BATCH: &str = "3";

/// The killed relay's partitions move to the fresh one once its heartbeat
/// lapses: a short lease keeps the experiment to a second or so.
const LEASE: &str = "1s";

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let mut out = Outcome::new(
        "crash-before-mark",
        "Relay killed after sending, before marking",
        "The relay sends, then marks published. Killed in between, nothing is marked, so everything is \
         sent again: duplicates, never losses. The consumer's inbox turns them into one side effect each.",
        format!(
            "{EVENTS} OrderPaid events (orders 1..{EVENTS}); relay --batch-size {BATCH} with \
             OUTBOX_FAILPOINT=pause-after-deliver, kill -9 once parked, then a fresh relay"
        ),
    );
    lab.reset().await?;
    let receiver = Receiver::start(Respond::Ok).await?;
    let tx = lab.db.transaction().await?;
    for order in 1..=EVENTS {
        lab.outbox
            .enqueue(&tx, &Scratch::order_event(order, "OrderPaid"))
            .await?;
    }
    tx.commit().await?;

    let mut relay = lab
        .spawn_relay_parked(
            &receiver.url(),
            &["--batch-size", BATCH, "--lease-timeout", LEASE],
            "pause-after-deliver",
        )
        .await?;
    // The fault happened: 3 acknowledged by the receiver, none marked.
    let (sent, unpublished) = (receiver.count(), lab.unpublished().await?);
    if (sent, unpublished) != (3, EVENTS) {
        bail!("expected 3 sent and {EVENTS} unpublished at the failpoint, got {sent} and {unpublished}");
    }
    relay.kill()?;
    relay.wait(LONG).await?;
    let after_kill = lab.unpublished().await?;

    let relay = lab
        .spawn_relay(
            &receiver.url(),
            &["--batch-size", BATCH, "--lease-timeout", LEASE],
            &[],
        )
        .await?;
    lab.wait_drained("all events published after the restart").await?;
    lab.stop_relay(relay).await?;
    let received = receiver.received();
    receiver.shutdown().await;
    let distinct: HashSet<_> = received.iter().map(event_id).collect::<Result<_, _>>()?;

    lab.ship_naively(&received).await?;
    let naive = lab.shop().await?;
    lab.db
        .batch_execute(&format!("TRUNCATE {SCHEMA}.shipments"))
        .await?;
    let skipped = lab.ship_through_inbox(&received).await?;
    let inbox = lab.shop().await?;

    out.row(
        "sent, then killed before mark: still unpublished",
        after_kill,
        "5",
        Verdict::check(after_kill == EVENTS),
    );
    out.row("requests received", received.len(), "8", Verdict::Timing);
    out.row(
        "distinct events received",
        distinct.len(),
        "5",
        Verdict::check(distinct.len() as i64 == EVENTS),
    );
    out.row(
        "naive consumer: shipments / orders shipped twice",
        format!("{} / {}", naive.shipments, naive.shipped_twice),
        "8 / 3",
        Verdict::naive(naive.shipped_twice > 0),
    );
    out.row(
        "inbox consumer: shipments / orders shipped twice / duplicates skipped",
        format!("{} / {} / {skipped}", inbox.shipments, inbox.shipped_twice),
        "5 / 0 / 3",
        Verdict::check(inbox.shipments == EVENTS && inbox.shipped_twice == 0),
    );
    Ok(out)
}
