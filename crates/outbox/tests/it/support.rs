//! A throwaway cluster with a fresh, migrated database per test.

use outbox::Config;
use outbox_testkit::Postgres;
use tokio_postgres::Client;

pub struct Db {
    // Held so the cluster outlives the test.
    _pg: Postgres,
    pub url: String,
    pub client: Client,
}

impl Db {
    pub async fn start() -> Db {
        let pg = Postgres::start().await.expect("start postgres");
        let url = pg.fresh_database().await.expect("create database");
        let mut client = connect(&url).await;
        outbox::migrate(&mut client, &Config::default())
            .await
            .expect("migrate");
        Db { _pg: pg, url, client }
    }

    pub async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.expect(sql).get(0)
    }

    /// The first column of every row `sql` returns.
    pub async fn column<T: for<'a> tokio_postgres::types::FromSql<'a>>(&self, sql: &str) -> Vec<T> {
        let rows = self.client.query(sql, &[]).await.expect(sql);
        rows.iter().map(|r| r.get(0)).collect()
    }
}

pub async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client
}
