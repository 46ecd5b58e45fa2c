//! A Redis Streams consumer with the inbox: every `outbox.event.orders` entry
//! ships its order once, however often Redis delivers it.
//!
//! The worker reads with `XREADGROUP`, runs [`common::ship`] in the inbox
//! transaction, `XACK`s after the commit, and takes over entries a dead
//! worker left pending (`XAUTOCLAIM`) after `claim_idle`.
//!
//! ```sh
//! outbox relay --sink redis://127.0.0.1:6379 &     # fills outbox.event.orders
//! DATABASE_URL=postgres://postgres@127.0.0.1/test REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run -p outbox --features redis --example redis_worker
//! ```

mod common;

use std::time::Duration;

use outbox::worker::redis::RedisWorker;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut db, inbox) = common::database().await?;
    let consumer = format!("example-{}", std::process::id());
    let mut worker = RedisWorker::new(
        &common::var("REDIS_URL")?,
        "outbox.event.orders",
        "shipping",
        consumer,
        inbox,
    )?;
    worker.claim_idle = Duration::from_secs(5);
    let stats = worker
        .run(&mut db, common::ctrl_c(), async |tx, m| common::ship(tx, m).await)
        .await?;
    println!("{stats:?}");
    Ok(())
}
