//! Bounded memory: a claim takes rows while their payloads fit in
//! `--batch-max-bytes`, so a backlog of large events drains with the
//! relay's peak resident set near one event, not a batch of them.

use outbox::Event;
use outbox_testkit::{Receiver, Respond};
use serde_json::json;

use crate::support::{Db, start_relay, stop_relay};

/// 30 MB, the size the issue measured.
const EVENT: usize = 30 << 20;

/// `len` bytes of JSON-safe text: hex digits of a xorshift sequence, which
/// PostgreSQL cannot compress, or one repeated letter, which it compresses
/// about a hundredfold (the claim must measure it decompressed).
fn blob(len: usize, compressible: bool, seed: u64) -> String {
    if compressible {
        return "x".repeat(len);
    }
    let mut state = seed | 1;
    let mut out = String::with_capacity(len);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.push_str(&format!("{state:016x}"));
    }
    out.truncate(len);
    out
}

#[tokio::test]
async fn a_backlog_of_30_mb_events_drains_with_peak_rss_below_three_events() {
    let mut db = Db::start().await;
    // Six events, half compressible: without the byte bound one claim takes
    // them all (measured with ten: 637 MB).
    const EVENTS: usize = 6;
    let receiver = Receiver::start(Respond::Ok).await.unwrap();
    let relay = start_relay(&db.url, &receiver.url(), &["--max-event-bytes", "64MiB"], &[]).await;
    let idle = relay.peak_rss().expect("the relay runs");
    // One transaction, so the relay meets them as one backlog.
    let tx = db.client.transaction().await.unwrap();
    for i in 0..EVENTS {
        let payload = json!({ "blob": blob(EVENT, i % 2 == 0, i as u64 + 1) });
        let event = Event::new("files", i.to_string(), "FileStored", payload);
        outbox::enqueue(&tx, &event).await.unwrap();
    }
    tx.commit().await.unwrap();
    db.wait_drained("the large events").await;
    let peak = relay.peak_rss().expect("the relay runs");
    stop_relay(relay).await;

    assert_eq!(receiver.count(), EVENTS, "each delivered once");
    let sizes: Vec<usize> = receiver.received().iter().map(|r| r.raw.len()).collect();
    assert!(sizes.iter().all(|s| *s > EVENT), "{sizes:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE attempts > 0").await,
        0,
        "no attempt failed"
    );
    // The bound of the issue: a 30 MB event is held about twice (its
    // payload, its message) beside the relay's own size.
    let bound = 3 * EVENT as u64;
    assert!(
        peak < bound,
        "peak RSS {} MB (idle: {} MB), over 3 × 30 MB",
        peak >> 20,
        idle >> 20
    );
    eprintln!("peak RSS of the relay: {} MB, idle {} MB", peak >> 20, idle >> 20);
}
