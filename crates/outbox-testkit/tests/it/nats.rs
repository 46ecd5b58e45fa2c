//! A nats-server greets with JetStream on, stops, and comes back on the same
//! port and store.

use outbox_testkit::Nats;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;

use crate::LONG;

/// The server's `INFO` greeting, parsed.
async fn info(port: u16) -> std::io::Result<serde_json::Value> {
    let greeting = async {
        let mut stream = BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?);
        let mut line = String::new();
        stream.read_line(&mut line).await?;
        Ok::<_, std::io::Error>(line)
    };
    let line = tokio::time::timeout(LONG, greeting)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "INFO timed out"))??;
    let json = line.strip_prefix("INFO ").unwrap_or_default();
    serde_json::from_str(json).map_err(std::io::Error::other)
}

#[tokio::test]
async fn start_stop_restart() {
    let mut nats = Nats::start().await.expect("start nats");
    let port = nats.port();
    assert_eq!(nats.url(), format!("nats://127.0.0.1:{port}"));
    assert_eq!(info(port).await.unwrap()["jetstream"], true);

    nats.stop().await.expect("stop");
    assert!(info(port).await.is_err(), "nothing answers after stop");
    nats.stop().await.expect("stopping twice is fine");

    nats.restart().await.expect("restart");
    assert_eq!(nats.port(), port);
    assert_eq!(info(port).await.unwrap()["jetstream"], true);

    drop(nats);
    assert!(info(port).await.is_err(), "nothing answers after drop");
}
