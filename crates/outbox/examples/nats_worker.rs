//! A NATS JetStream consumer with the inbox: every event on the `OUTBOX`
//! stream ships its order once, however often JetStream delivers it.
//!
//! The worker pulls from the durable consumer `shipping`, runs
//! [`common::ship`] in the inbox transaction and acks after the commit; a
//! message not acked within `ack_wait` is delivered again.
//!
//! ```sh
//! nats stream add OUTBOX --subjects 'outbox.event.>' --defaults
//! outbox relay --sink nats://127.0.0.1:4222 &
//! DATABASE_URL=postgres://postgres@127.0.0.1/test NATS_URL=nats://127.0.0.1:4222 \
//!   cargo run -p outbox --features nats --example nats_worker
//! ```

mod common;

use outbox::worker::nats::NatsWorker;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut db, inbox) = common::database().await?;
    let worker = NatsWorker::new(&common::var("NATS_URL")?, "OUTBOX", "shipping", inbox);
    let stats = worker
        .run(&mut db, common::ctrl_c(), async |tx, m| common::ship(tx, m).await)
        .await?;
    println!("{stats:?}");
    Ok(())
}
