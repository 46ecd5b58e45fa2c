//! A redis-server answers PING, stops, and comes back on the same port.

use std::time::Instant;

use outbox_testkit::Redis;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::LONG;

async fn ping(port: u16) -> std::io::Result<String> {
    let exchange = async {
        let mut stream = BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?);
        stream.get_mut().write_all(b"PING\r\n").await?;
        let mut line = String::new();
        stream.read_line(&mut line).await?;
        Ok(line)
    };
    tokio::time::timeout(LONG, exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "PING timed out"))?
}

#[tokio::test]
async fn start_stop_restart() {
    let started = Instant::now();
    let mut redis = Redis::start().await.expect("start redis");
    eprintln!("Redis::start took {:?}", started.elapsed());
    let port = redis.port();
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{port}"));
    assert_eq!(ping(port).await.unwrap(), "+PONG\r\n");

    redis.stop().await.expect("stop");
    assert!(ping(port).await.is_err(), "nothing answers after stop");
    redis.stop().await.expect("stopping twice is fine");

    redis.restart().await.expect("restart");
    assert_eq!(redis.port(), port);
    assert_eq!(ping(port).await.unwrap(), "+PONG\r\n");

    redis.restart().await.expect("restart while running");
    assert_eq!(ping(port).await.unwrap(), "+PONG\r\n");

    drop(redis);
    assert!(ping(port).await.is_err(), "nothing answers after drop");
}
