//! `idle`: what a relay with nothing to do costs PostgreSQL.
//!
//! A polling relay runs a claim transaction per poll whether or not there
//! is work; with NOTIFY it waits on its connection and only the slow
//! fallback poll (and the lease heartbeat of `--ordering partition`) costs
//! transactions. Counted in `pg_stat_database.xact_commit` of a database
//! the lab creates for this alone (`outbox_lab_idle`), so nothing but the
//! relay commits there. A backend publishes its counters when it exits, so
//! each figure is the difference of two whole relay lifetimes, read after
//! the relay exited: one that idles, one that stops at once. Start-up and
//! shutdown cancel out.

use std::time::{Duration, Instant};

use anyhow::Context;

use crate::latency::Wakeup;
use crate::report::{Outcome, Verdict};
use crate::scratch::Scratch;

const DB: &str = "outbox_lab_idle";

pub(super) async fn run(lab: &mut Scratch) -> anyhow::Result<Outcome> {
    let seconds: u64 = if lab.quick { 2 } else { 10 };
    let mut out = Outcome::new(
        "idle",
        "Idle cost: transactions per idle period",
        "An idle outbox should cost next to nothing. Polling costs a transaction per poll; NOTIFY \
         costs only its fallback poll and the relay's lease heartbeat.",
        format!(
            "empty outbox in a database of its own ({DB}); relay lifetime idling {seconds} s minus one stopping \
             at once, from pg_stat_database.xact_commit; HTTP sink (never called)"
        ),
    );
    lab.db
        .batch_execute(&format!("DROP DATABASE IF EXISTS {DB}"))
        .await
        .context("dropping an old idle database")?;
    lab.db
        .batch_execute(&format!("CREATE DATABASE {DB}"))
        .await
        .with_context(|| format!("the idle experiment creates database {DB}: the role needs CREATEDB"))?;
    let mut db = lab.connect_to(DB).await?;
    outbox::migrate(&mut db, &lab.config).await?;
    drop(db);
    let url = lab.url_of(DB);
    let modes = [
        ("poll 100 ms", Wakeup::Poll { interval_ms: 100 }, "~100"),
        ("poll 1000 ms", Wakeup::Poll { interval_ms: 1000 }, "~10"),
        (
            "NOTIFY + 1 s fallback poll",
            Wakeup::NotifyOrPoll { fallback_ms: 1000 },
            "~10",
        ),
    ];
    for (label, wakeup, reference) in modes {
        lab.step(&format!("idle: {label}, {seconds} s"));
        let idle = lifetime(lab, &url, wakeup, Duration::from_secs(seconds)).await?;
        let base = lifetime(lab, &url, wakeup, Duration::ZERO).await?;
        let per_10s = (idle - base) as f64 * 10.0 / seconds as f64;
        out.row(
            format!("{label}: transactions per 10 idle seconds"),
            format!("{per_10s:.0}"),
            reference,
            Verdict::Timing,
        );
    }
    lab.db.batch_execute(&format!("DROP DATABASE {DB}")).await?;
    Ok(out)
}

/// Transactions committed in the idle database over one relay lifetime
/// that idled `idle` after start-up.
async fn lifetime(lab: &Scratch, url: &str, wakeup: Wakeup, idle: Duration) -> anyhow::Result<i64> {
    let before = xact_commit(lab).await?;
    let args = wakeup.relay_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay = lab
        .spawn_relay_on(url, "http://127.0.0.1:9/unused", &args, &[])
        .await?;
    // The lab's probes run in another database: they do not count here.
    let gone = format!("SELECT count(*) FROM pg_stat_activity WHERE datname = '{DB}'");
    lab.idle_and_stop(relay, idle, &gone).await?;
    // Leaving pg_stat_activity and publishing the counters are two steps
    // of a backend's exit: wait until the counter holds still for 300 ms.
    let mut last = xact_commit(lab).await?;
    let mut still_since = Instant::now();
    while still_since.elapsed() < Duration::from_millis(300) {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let now = xact_commit(lab).await?;
        if now != last {
            (last, still_since) = (now, Instant::now());
        }
    }
    Ok(last - before)
}

async fn xact_commit(lab: &Scratch) -> anyhow::Result<i64> {
    lab.count(&format!(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = '{DB}'"
    ))
    .await
}
