//! A RabbitMQ consumer with the inbox: every message on the `shipping`
//! queue ships its order once, however often RabbitMQ delivers it.
//!
//! The worker consumes with manual acks and a `basic.qos` prefetch, runs
//! [`common::ship`] in the inbox transaction and acks after the commit; a
//! message whose channel closed unacked is redelivered.
//!
//! ```sh
//! # a queue `shipping` bound to exchange `outbox` with key `orders.#`
//! outbox relay --sink amqp://guest:guest@127.0.0.1:5672/%2f &
//! DATABASE_URL=postgres://postgres@127.0.0.1/test AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!   cargo run -p outbox --features amqp --example amqp_worker
//! ```

mod common;

use outbox::worker::amqp::AmqpWorker;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut db, inbox) = common::database().await?;
    let worker = AmqpWorker::new(&common::var("AMQP_URL")?, "shipping", inbox);
    let stats = worker
        .run(&mut db, common::ctrl_c(), async |tx, m| common::ship(tx, m).await)
        .await?;
    println!("{stats:?}");
    Ok(())
}
