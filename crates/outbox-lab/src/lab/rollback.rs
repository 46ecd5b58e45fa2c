//! `rollback`: the writer's half of the guarantee. The order and its event
//! are written in one transaction, so they share its fate: after a
//! ROLLBACK, and after the writer process is killed with the transaction
//! open, there is neither an order nor an event. Nothing was sent, so
//! nothing needs taking back.

use anyhow::bail;
use outbox_testkit::Spawned;

use super::app::{self, APP_NAME, Path};
use super::shop::SCHEMA;
use crate::report::{Outcome, Verdict};
use crate::scratch::{LONG, Scratch, wait_until};

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let mut out = Outcome::new(
        "rollback",
        "Writer: ROLLBACK and a crash before COMMIT leave nothing",
        "INSERT order + INSERT event in one transaction, then ROLLBACK; and the same in a separate \
         process that is kill -9'd while its transaction is open. Both must leave 0 orders and 0 events.",
        "one order + one OrderPlaced event per transaction; the crash: `outbox-lab lab --app outbox:send-then-crash`, \
         killed once PostgreSQL shows its backend idle in transaction"
            .to_owned(),
    );
    lab.reset().await?;
    let orders = format!("SELECT count(*) FROM {SCHEMA}.orders");

    // 1. An explicit ROLLBACK.
    let table = lab.table();
    let tx = lab.db.transaction().await?;
    let order_id: i64 = tx
        .query_one(
            &format!("INSERT INTO {SCHEMA}.orders (customer) VALUES ('rollback') RETURNING id"),
            &[],
        )
        .await?
        .get(0);
    lab.outbox
        .enqueue(&tx, &Scratch::order_event(order_id, "OrderPlaced"))
        .await?;
    // The fault is in place: both rows exist inside the transaction.
    let inside: i64 = tx
        .query_one(
            &format!("SELECT (SELECT count(*) FROM {SCHEMA}.orders) + (SELECT count(*) FROM {table})"),
            &[],
        )
        .await?
        .get(0);
    if inside != 2 {
        bail!("the transaction should see its order and its event, saw {inside} rows");
    }
    tx.rollback().await?;
    let (o, e) = (lab.count(&orders).await?, lab.rows().await?);
    out.row(
        "ROLLBACK: orders / outbox rows",
        format!("{o} / {e}"),
        "0 / 0",
        Verdict::check(o == 0 && e == 0),
    );

    // 2. The writer process dies with the transaction open.
    let cmd = lab.lab_cmd(&[
        "lab",
        "--app",
        &format!("outbox:{}:killed", Path::SendThenCrash.name()),
        "--app-sink",
        "http://127.0.0.1:9/unused",
    ])?;
    let mut app = Spawned::spawn_notified(cmd)?;
    app.wait_for_notification(&app::parked(app::BEFORE_COMMIT), LONG)
        .await?;
    let open_tx = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{APP_NAME}' AND state = 'idle in transaction'"
    );
    if lab.count(&open_tx).await? != 1 {
        bail!("the app's transaction should be open before the kill");
    }
    app.kill()?;
    app.wait(LONG).await?;
    let gone = format!("SELECT count(*) = 0 FROM pg_stat_activity WHERE application_name = '{APP_NAME}'");
    wait_until("the killed writer's backend to exit", async || {
        Ok(lab.db.query_one(&gone, &[]).await?.get::<_, bool>(0))
    })
    .await?;
    let (o, e) = (lab.count(&orders).await?, lab.rows().await?);
    out.row(
        "writer killed (SIGKILL) before COMMIT: orders / outbox rows",
        format!("{o} / {e}"),
        "0 / 0",
        Verdict::check(o == 0 && e == 0),
    );
    Ok(out)
}
