//! `dual-write`: why the outbox exists.
//!
//! The shop commits an order in PostgreSQL and tells shipping over HTTP:
//! two systems, no transaction spanning both. The naive app (see `app.rs`)
//! goes down each of the reference's five paths once: nothing fails; the
//! process dies after COMMIT; it POSTs first and then rolls back; it POSTs
//! first and then dies before COMMIT; the receiver refuses the connection
//! after COMMIT. A naive shipping service ships whatever arrives. Counted
//! afterwards: ghost shipments (of orders that do not exist) and orders
//! that never ship. Then the same five paths through the outbox, with the
//! relay delivering to a receiver that is down at first, and shipping
//! behind the inbox: no ghost, nothing missing.
//!
//! A sixth request shows the refused connection's other cost: the user is
//! told the order failed although it was committed, retries, and pays twice.

use anyhow::Context;
use outbox_testkit::{Receiver, Respond, Spawned};

use super::app::{self, Path};
use super::shop::{SCHEMA, Shop};
use crate::report::{Outcome, Verdict};
use crate::scratch::{LONG, Scratch};

/// What one request of the app did.
struct Request {
    /// The app answered success to the user.
    succeeded: bool,
}

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let mut out = Outcome::new(
        "dual-write",
        "The dual-write problem: commit then POST vs the outbox",
        "A naive shop commits the order and then POSTs to shipping (or POSTs first, then commits). Each \
         of five failure paths is run once by a real process that is kill -9'd at its crash point. \
         The naive shipping service ships whatever arrives; the outbox run ships behind the inbox.",
        "paths: ok, crash-after-commit, send-then-rollback, send-then-crash, receiver-down (connection refused); \
         app = separate process (outbox-lab lab --app); receiver = HTTP server on 127.0.0.1; \
         outbox run: relay (HTTP sink) against a receiver answering 503 to its first 2 requests"
            .to_owned(),
    );

    // The naive app.
    lab.reset().await?;
    let receiver = Receiver::start(Respond::Ok).await?;
    let refused = refused_url().await?;
    let mut naive_misled = 0;
    for (i, path) in Path::ALL.into_iter().enumerate() {
        let sink = if path == Path::ReceiverDown {
            refused.as_str()
        } else {
            &receiver.url()
        };
        let customer = format!("c{i}");
        let r = request(lab, "naive", path, &customer, sink).await?;
        naive_misled += usize::from(misled(lab, &r, path, &customer).await?);
    }
    lab.ship_naively(&receiver.received()).await?;
    let naive = lab.shop().await?;
    // The user whose request failed on a refused connection tries again.
    let first = request(lab, "naive", Path::ReceiverDown, "retry", &refused).await?;
    if !first.succeeded {
        request(lab, "naive", Path::Ok, "retry", &receiver.url()).await?;
    }
    let naive_retry_orders = lab
        .count(&format!(
            "SELECT count(*) FROM {SCHEMA}.orders WHERE customer = 'retry'"
        ))
        .await?;
    receiver.shutdown().await;

    // The same paths through the outbox.
    lab.reset().await?;
    let mut outbox_misled = 0;
    for (i, path) in Path::ALL.into_iter().enumerate() {
        // The outbox app sends nothing; the sink is unused.
        let customer = format!("c{i}");
        let r = request(lab, "outbox", path, &customer, &refused).await?;
        outbox_misled += usize::from(misled(lab, &r, path, &customer).await?);
    }
    let retry = request(lab, "outbox", Path::ReceiverDown, "retry", &refused).await?;
    if !retry.succeeded {
        request(lab, "outbox", Path::Ok, "retry", &refused).await?;
    }
    let outbox_retry_orders = lab
        .count(&format!(
            "SELECT count(*) FROM {SCHEMA}.orders WHERE customer = 'retry'"
        ))
        .await?;
    lab.db
        .execute(
            &format!("DELETE FROM {SCHEMA}.orders WHERE customer = 'retry'"),
            &[],
        )
        .await?;
    lab.db
        .execute(
            &format!(
                "DELETE FROM {} WHERE aggregate_id NOT IN (SELECT id::text FROM {SCHEMA}.orders)",
                lab.table()
            ),
            &[],
        )
        .await?;
    let events = lab.rows().await?;
    let receiver = Receiver::start(Respond::FailFirst {
        times: 2,
        status: 503,
    })
    .await?;
    let relay = lab
        .spawn_relay(&receiver.url(), &["--backoff-base", "50ms"], &[])
        .await?;
    lab.wait_drained("every event published").await?;
    lab.stop_relay(relay).await?;
    let received = receiver.received();
    let refusals = received.iter().filter(|r| r.status == 503).count();
    lab.ship_through_inbox(&received).await?;
    let ours = lab.shop().await?;
    receiver.shutdown().await;

    let Shop {
        orders, shipments, ..
    } = naive;
    out.row(
        "naive: orders / shipments",
        format!("{orders} / {shipments}"),
        "3 / 3",
        Verdict::Timing,
    );
    out.row(
        "naive: ghost shipments",
        naive.ghosts,
        "2",
        Verdict::naive(naive.ghosts > 0),
    );
    out.row(
        "naive: orders without shipment",
        naive.unshipped,
        "2",
        Verdict::naive(naive.unshipped > 0),
    );
    out.row(
        "naive: orders after a refused connection and the user's retry",
        naive_retry_orders,
        "2 (a second order)",
        Verdict::naive(naive_retry_orders > 1),
    );
    out.row(
        "outbox: orders / events / shipments",
        format!("{} / {events} / {}", ours.orders, ours.shipments),
        "3 / 3 / 3",
        Verdict::check(ours.orders == events && ours.shipments == ours.orders),
    );
    out.row(
        "outbox: ghost shipments",
        ours.ghosts,
        "0",
        Verdict::check(ours.ghosts == 0),
    );
    out.row(
        "outbox: orders without shipment",
        ours.unshipped,
        "0",
        Verdict::check(ours.unshipped == 0),
    );
    out.row(
        "outbox: orders shipped twice",
        ours.shipped_twice,
        "0",
        Verdict::check(ours.shipped_twice == 0),
    );
    out.row(
        "outbox: requests refused by the receiver, then retried by the relay",
        refusals,
        "(receiver down)",
        Verdict::check(refusals == 2),
    );
    out.row(
        "outbox: orders after the receiver was down (no error, no user retry)",
        outbox_retry_orders,
        "1",
        Verdict::check(outbox_retry_orders == 1),
    );
    out.row(
        "requests answered 'failed' although the order was committed: naive / outbox",
        format!("{naive_misled} / {outbox_misled}"),
        "1 (Connection refused) / 0",
        Verdict::check(outbox_misled == 0),
    );
    Ok(out)
}

/// Runs one request of the app as its own process; kills it at its crash
/// point.
async fn request(
    lab: &Scratch,
    style: &str,
    path: Path,
    customer: &str,
    sink: &str,
) -> anyhow::Result<Request> {
    let spec = format!("{style}:{}:{customer}", path.name());
    let cmd = lab.lab_cmd(&["lab", "--app", &spec, "--app-sink", sink])?;
    let mut app = Spawned::spawn_notified(cmd)?;
    if let Some(at) = path.crash_point() {
        app.wait_for_notification(&app::parked(at), LONG)
            .await
            .with_context(|| format!("the app ({spec}) reaching its crash point"))?;
        app.kill()?;
        app.wait(LONG).await?;
        return Ok(Request { succeeded: false });
    }
    let status = app.wait(LONG).await?;
    Ok(Request {
        succeeded: status.success(),
    })
}

/// Whether the app told the user the request failed although it committed
/// the order (a crashed app told nothing).
async fn misled(lab: &Scratch, r: &Request, path: Path, customer: &str) -> anyhow::Result<bool> {
    if r.succeeded || path.crashes() {
        return Ok(false);
    }
    let committed = lab
        .db
        .query_one(
            &format!("SELECT count(*) FROM {SCHEMA}.orders WHERE customer = $1"),
            &[&customer],
        )
        .await?
        .get::<_, i64>(0);
    Ok(committed > 0)
}

/// A URL on which nothing listens: connecting is refused.
async fn refused_url() -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
    let port = listener.local_addr()?.port();
    drop(listener);
    Ok(format!("http://127.0.0.1:{port}/events"))
}
