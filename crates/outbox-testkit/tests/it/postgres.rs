//! A cluster survives a crash and a clean stop, keeping port and data.

use std::time::Instant;

use outbox_testkit::Postgres;

#[tokio::test]
async fn fresh_databases_kill_and_restart() {
    let started = Instant::now();
    let mut pg = Postgres::start().await.expect("start postgres");
    eprintln!("Postgres::start took {:?}", started.elapsed());
    assert!(pg.is_running());
    let port = pg.port();

    let first = pg.fresh_database().await.expect("first database");
    let second = pg.fresh_database().await.expect("second database");
    assert_ne!(first, second);
    let prefix = format!("postgres://postgres@127.0.0.1:{port}/t_");
    assert!(first.starts_with(&prefix), "{first}");

    let name = first.rsplit('/').next().unwrap();
    let client = pg.connect(name).await.expect("connect to the first database");
    client
        .batch_execute("CREATE TABLE t (x int); INSERT INTO t VALUES (42)")
        .await
        .unwrap();

    pg.kill().expect("kill");
    assert!(!pg.is_running());
    assert!(
        client.simple_query("SELECT 1").await.is_err(),
        "the old connection must be dead after a crash"
    );

    let restarted = Instant::now();
    pg.restart().await.expect("restart after kill");
    eprintln!("Postgres::restart after kill took {:?}", restarted.elapsed());
    assert!(pg.is_running());
    assert_eq!(pg.port(), port);

    let client = pg.connect(name).await.expect("reconnect after the crash");
    let x: i32 = client.query_one("SELECT x FROM t", &[]).await.unwrap().get(0);
    assert_eq!(x, 42, "a committed row survives the crash");
    let second_name = second.rsplit('/').next().unwrap();
    pg.connect(second_name)
        .await
        .expect("the second database survives too");

    pg.stop().await.expect("stop");
    assert!(!pg.is_running());
    pg.stop().await.expect("stopping twice is fine");
    pg.restart().await.expect("restart after stop");
    assert_eq!(pg.port(), port);
    let client = pg.connect(name).await.expect("reconnect after the stop");
    let x: i32 = client.query_one("SELECT x FROM t", &[]).await.unwrap().get(0);
    assert_eq!(x, 42);
}

#[tokio::test]
async fn two_clusters_at_once_are_separate() {
    let (a, b) = tokio::join!(Postgres::start(), Postgres::start());
    let (a, b) = (a.expect("start a"), b.expect("start b"));
    assert_ne!(a.port(), b.port());
    let client = a.connect("postgres").await.unwrap();
    client.batch_execute("CREATE DATABASE only_in_a").await.unwrap();
    let in_b: i64 = b
        .connect("postgres")
        .await
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = 'only_in_a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(in_b, 0);
}

#[tokio::test]
async fn drop_kills_the_server() {
    let pg = Postgres::start().await.expect("start postgres");
    let port = pg.port();
    drop(pg);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "nothing listens on port {port} after drop"
    );
}
