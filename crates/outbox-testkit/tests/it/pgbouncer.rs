//! A PgBouncer passes queries to its PostgreSQL, pools as told (in
//! transaction mode one client's transactions run on the server connections
//! others freed; in session mode on its own), dies with `kill`, and comes
//! back on the same port.

use outbox_testkit::{PgBouncer, PoolMode, Postgres};
use tokio_postgres::{Client, NoTls};

async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

async fn backend_pid(client: &Client) -> i32 {
    client
        .query_typed_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// The backend pids of two clients' transactions, the second's after the
/// first's ended: in transaction mode the second runs on the server
/// connection the first freed.
async fn pids_of_two_clients(url: &str) -> (i32, i32) {
    let (a, b) = (connect(url).await.unwrap(), connect(url).await.unwrap());
    a.batch_execute("BEGIN").await.unwrap();
    let pid_a = backend_pid(&a).await;
    a.batch_execute("COMMIT").await.unwrap();
    (pid_a, backend_pid(&b).await)
}

#[tokio::test]
async fn pools_by_mode_dies_and_comes_back() {
    let pg = Postgres::start().await.expect("start postgres");
    let url = pg.fresh_database().await.unwrap();
    let database = url.rsplit('/').next().unwrap();

    let session = PgBouncer::start(&pg, PoolMode::Session)
        .await
        .expect("start pgbouncer");
    let (a, b) = pids_of_two_clients(&session.url(database)).await;
    assert_ne!(a, b, "session mode: a server connection per client");

    let mut bouncer = PgBouncer::start(&pg, PoolMode::Transaction)
        .await
        .expect("start pgbouncer");
    assert_eq!(bouncer.mode(), PoolMode::Transaction);
    let through = bouncer.url(database);
    assert_eq!(
        through,
        format!("postgres://postgres@127.0.0.1:{}/{database}", bouncer.port())
    );
    let (a, b) = pids_of_two_clients(&through).await;
    assert_eq!(
        a, b,
        "transaction mode: the second client gets the first's server connection"
    );

    let client = connect(&through).await.unwrap();
    bouncer.kill().expect("kill");
    assert!(
        client.simple_query("SELECT 1").await.is_err(),
        "the client lost its connection"
    );
    assert!(connect(&through).await.is_err(), "nothing answers after kill");
    bouncer.kill().expect("killing twice is fine");

    let port = bouncer.port();
    bouncer.restart().await.expect("restart");
    assert_eq!(bouncer.port(), port);
    let client = connect(&through).await.expect("connects after restart");
    assert_eq!(
        client
            .query_typed_one("SELECT current_database()::text", &[])
            .await
            .unwrap()
            .get::<_, String>(0),
        database
    );
    drop(bouncer);
    assert!(connect(&through).await.is_err(), "nothing answers after drop");
}
