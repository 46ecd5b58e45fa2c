//! A private RabbitMQ node speaks AMQP, stops, and comes back on the same
//! port; dropping it leaves no Erlang VM listening.

use outbox_testkit::RabbitMq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::LONG;

/// Sends the AMQP 0-9-1 protocol header and returns the first frame's type
/// and class/method ids: a broker answers with `connection.start` (1, 10, 10).
async fn hello(port: u16) -> std::io::Result<(u8, u16, u16)> {
    let exchange = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
        stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
        let mut head = [0u8; 11];
        stream.read_exact(&mut head).await?;
        Ok::<_, std::io::Error>((
            head[0],
            u16::from_be_bytes([head[7], head[8]]),
            u16::from_be_bytes([head[9], head[10]]),
        ))
    };
    tokio::time::timeout(LONG, exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "AMQP hello timed out"))?
}

#[tokio::test]
async fn start_stop_restart() {
    let mut node = RabbitMq::start().await.expect("start rabbitmq");
    let port = node.port();
    assert_eq!(node.url(), format!("amqp://guest:guest@127.0.0.1:{port}/%2f"));
    assert_eq!(hello(port).await.unwrap(), (1, 10, 10), "connection.start");

    node.stop().await.expect("stop");
    assert!(hello(port).await.is_err(), "nothing answers after stop");
    node.stop().await.expect("stopping twice is fine");

    node.restart().await.expect("restart");
    assert_eq!(node.port(), port);
    assert_eq!(hello(port).await.unwrap(), (1, 10, 10));

    drop(node);
    assert!(hello(port).await.is_err(), "nothing answers after drop");
}
