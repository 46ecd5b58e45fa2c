//! TLS to PostgreSQL as libpq does it (`sslmode`, `sslrootcert`,
//! `sslcert`, `sslkey`), against clusters started with `ssl=on` and
//! certificates made here; and startup: waiting for a PostgreSQL that is
//! not up yet, failing at once when retrying cannot help.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use outbox::{Event, Outbox};
use outbox_relay::pg::{self, ConnectError, PgConfig, SslMode};
use outbox_testkit::{PgSettings, Postgres, Redis, Spawned};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use serde_json::json;
use tempfile::TempDir;
use tokio_postgres::Client;

use crate::support::{LONG, outbox_cmd, run_cli, text};

const TIMEOUT: Duration = Duration::from_secs(10);

/// A certificate authority, and PEM files in a directory of their own.
pub struct Ca {
    pub issuer: CertifiedIssuer<'static, KeyPair>,
    dir: TempDir,
}

/// A certificate and its key, as PEM text and as files.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("root.crt"), issuer.pem()).unwrap();
        Ca { issuer, dir }
    }

    /// The CA's certificate file (`sslrootcert`).
    pub fn root(&self) -> String {
        self.dir.path().join("root.crt").display().to_string()
    }

    /// A server certificate for `localhost` (and no IP address).
    pub fn server(&self) -> Issued {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, "localhost");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue("server", params)
    }

    /// A client certificate for the database user `user` (its CN).
    pub fn client(&self, user: &str) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, user);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(user, params)
    }

    fn issue(&self, name: &str, params: CertificateParams) -> Issued {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let issued = Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert: self.dir.path().join(format!("{name}.crt")),
            key: self.dir.path().join(format!("{name}.key")),
        };
        std::fs::write(&issued.cert, &issued.cert_pem).unwrap();
        std::fs::write(&issued.key, &issued.key_pem).unwrap();
        issued
    }
}

/// A cluster serving TLS with a certificate for `localhost` from `ca`.
async fn tls_cluster(ca: &Ca, settings: PgSettings) -> Postgres {
    let server = ca.server();
    Postgres::start_with(settings.tls(server.cert_pem, server.key_pem))
        .await
        .expect("start postgres with ssl=on")
}

/// A TLS cluster whose `pg_hba.conf` takes only a client certificate from
/// `ca` (`hostssl … cert`), and the name of a fresh database on it.
async fn cert_only_cluster(ca: &Ca) -> (Postgres, String) {
    let settings = PgSettings::default()
        .client_ca(ca.issuer.pem())
        .hba("hostssl all all 127.0.0.1/32 cert");
    let pg = tls_cluster(ca, settings).await;
    let db_url = pg.fresh_database().await.unwrap();
    let db = db_url.rsplit('/').next().unwrap().to_owned();
    (pg, db)
}

/// `postgres://postgres@{host}:{port}/{db}?{params}`.
pub fn url(pg: &Postgres, host: &str, db: &str, params: &str) -> String {
    format!("postgres://postgres@{host}:{}/{db}?{params}", pg.port())
}

fn config(url: &str) -> PgConfig {
    pg::parse_url(url, TIMEOUT).unwrap_or_else(|e| panic!("{url}: {}", chain(&e)))
}

pub async fn connect(url: &str) -> Result<Client, ConnectError> {
    pg::connect(&config(url)).await
}

/// Whether this session is encrypted, in the server's own words.
async fn ssl_in_use(client: &Client) -> bool {
    client
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// The error and its sources on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

/// Connecting fails at once (no retries until the connect timeout) with a
/// permanent error whose chain contains `words`.
async fn refused(url: &str, words: &str) {
    let started = Instant::now();
    let error = connect(url)
        .await
        .err()
        .unwrap_or_else(|| panic!("{url} connected"));
    let message = chain(&error);
    assert!(error.is_permanent(), "{url}: {message}");
    assert!(message.contains(words), "{url}: {message:?} lacks {words:?}");
    assert!(
        started.elapsed() < TIMEOUT / 2,
        "{url}: retried for {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn tls_sslmodes_check_what_libpq_checks() {
    let ca = Ca::new("outbox test CA");
    let pg = tls_cluster(&ca, PgSettings::default()).await;
    let root = ca.root();

    // The check below can fail: without TLS the server says so.
    let plain = connect(&url(&pg, "127.0.0.1", "postgres", "sslmode=disable"))
        .await
        .unwrap();
    assert!(!ssl_in_use(&plain).await, "sslmode=disable is plaintext");
    // prefer (the default) and require encrypt without checking the
    // certificate: 127.0.0.1 is not a name it holds, and no CA is given.
    for params in ["", "sslmode=prefer", "sslmode=require"] {
        let client = connect(&url(&pg, "127.0.0.1", "postgres", params)).await.unwrap();
        assert!(ssl_in_use(&client).await, "{params:?} encrypts");
    }
    let full = format!("sslmode=verify-full&sslrootcert={root}");
    let client = connect(&url(&pg, "localhost", "postgres", &full)).await.unwrap();
    assert!(
        ssl_in_use(&client).await,
        "verify-full with the right CA and name"
    );
    // verify-ca checks the chain, not the name.
    let verify_ca = format!("sslmode=verify-ca&sslrootcert={root}");
    let client = connect(&url(&pg, "127.0.0.1", "postgres", &verify_ca))
        .await
        .unwrap();
    assert!(ssl_in_use(&client).await, "verify-ca ignores the host name");
    // key=value strings take the same parameters.
    let kv = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=verify-full sslrootcert='{root}'",
        pg.port()
    );
    assert_eq!(config(&kv).ssl_mode(), SslMode::VerifyFull);
    assert!(ssl_in_use(&connect(&kv).await.unwrap()).await);

    // Refusals name their cause and are not retried.
    refused(&url(&pg, "127.0.0.1", "postgres", &full), "not valid for name").await;
    let other = Ca::new("another CA");
    let wrong_ca = format!("sslmode=verify-full&sslrootcert={}", other.root());
    refused(&url(&pg, "localhost", "postgres", &wrong_ca), "UnknownIssuer").await;
    let wrong_ca = format!("sslmode=verify-ca&sslrootcert={}", other.root());
    refused(&url(&pg, "localhost", "postgres", &wrong_ca), "UnknownIssuer").await;
    // require with sslrootcert checks the chain, as libpq does.
    let require = format!("sslmode=require&sslrootcert={}", other.root());
    refused(&url(&pg, "127.0.0.1", "postgres", &require), "UnknownIssuer").await;

    // Through the binary: exit code 2 at once, the cause in its words.
    let started = Instant::now();
    let out = run_cli(
        &["stats", "--connect-timeout", "60s"],
        &[("DATABASE_URL", &url(&pg, "127.0.0.1", "postgres", &full))],
    )
    .await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not valid for name"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn tls_client_certificate_only_hba_wants_the_right_certificate() {
    let ca = Ca::new("outbox test CA");
    let (pg, db) = cert_only_cluster(&ca).await;
    let root = ca.root();
    let me = ca.client("postgres");
    let with_cert = format!(
        "sslmode=verify-full&sslrootcert={root}&sslcert={}&sslkey={}",
        me.cert.display(),
        me.key.display()
    );

    let client = connect(&url(&pg, "localhost", &db, &with_cert)).await.unwrap();
    assert!(ssl_in_use(&client).await);
    let dn: String = client
        .query_one(
            "SELECT client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(dn, "/CN=postgres", "the server saw our certificate");

    // No certificate: the server refuses the login, not retried.
    let without = format!("sslmode=verify-full&sslrootcert={root}");
    refused(&url(&pg, "localhost", &db, &without), "certificate").await;
    // No TLS: no pg_hba.conf line matches.
    refused(&url(&pg, "localhost", &db, "sslmode=disable"), "pg_hba.conf").await;
    // A certificate from another CA: the server ends the handshake.
    let other = Ca::new("another CA");
    let stranger = other.client("postgres");
    let foreign = format!(
        "sslmode=verify-full&sslrootcert={root}&sslcert={}&sslkey={}",
        stranger.cert.display(),
        stranger.key.display()
    );
    let Err(error) = connect(&url(&pg, "localhost", &db, &foreign)).await else {
        panic!("a certificate from another CA was accepted");
    };
    assert!(error.is_permanent(), "{}", chain(&error));
}

#[tokio::test]
async fn tls_relay_delivers_end_to_end() {
    let ca = Ca::new("outbox test CA");
    let (pg, db) = cert_only_cluster(&ca).await;
    let me = ca.client("postgres");
    // The database accepts nothing but TLS with our certificate, so every
    // connection below (migrate, the relay's three sessions) used it.
    let url = url(
        &pg,
        "localhost",
        &db,
        &format!(
            "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
            ca.root(),
            me.cert.display(),
            me.key.display()
        ),
    );
    let env = [("DATABASE_URL", url.as_str())];
    let migrate = run_cli(&["migrate"], &env).await;
    assert_eq!(migrate.status.code(), Some(0), "{}", text(&migrate.stderr));

    let client = connect(&url).await.unwrap();
    let events: Vec<Event> = (0..25)
        .map(|i| Event::new("orders", format!("order-{}", i % 5), "Placed", json!({ "i": i })))
        .collect();
    Outbox::default().enqueue_all(&client, &events).await.unwrap();

    let redis = Redis::start().await.unwrap();
    let relay = run_cli(
        &[
            "relay",
            "--drain",
            "--sink",
            &redis.url(),
            "--stream-prefix",
            "tls",
        ],
        &env,
    )
    .await;
    assert_eq!(relay.status.code(), Some(0), "{}", text(&relay.stderr));
    let unpublished: i64 = client
        .query_one("SELECT count(*) FROM outbox WHERE published_at IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(unpublished, 0, "every row marked");
    let events = crate::support::read_stream(&redis.url(), "tls.orders").await;
    assert_eq!(events.len(), 25, "25 delivered");
    assert_eq!(crate::support::distinct_events(&events), 25, "25 distinct");
}

#[tokio::test]
async fn migrate_started_before_postgres_waits_for_it() {
    let mut pg = Postgres::start().await.unwrap();
    let db_url = pg.fresh_database().await.unwrap();
    pg.stop().await.unwrap();

    let mut cmd = outbox_cmd();
    cmd.args(["migrate", "--connect-timeout", "60s"])
        .env("DATABASE_URL", &db_url);
    let mut migrate = Spawned::spawn_notified(cmd).unwrap();
    // It has tried, failed and said so: PostgreSQL is down.
    migrate
        .wait_for_notification("OUTBOX_CONNECT=retrying", LONG)
        .await
        .expect("migrate retries while postgres is down");
    assert!(
        migrate.exit_status().is_none(),
        "still waiting: {:#?}",
        migrate.lines()
    );
    // The deliberate delay: PostgreSQL comes up about 3 s later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.restart().await.unwrap();

    let status = migrate.wait(LONG).await.unwrap();
    let lines = migrate.lines();
    assert_eq!(status.code(), Some(0), "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.contains("applied 0001_create_outbox")),
        "{lines:#?}"
    );
    let retries = migrate.count_lines("postgres not reachable yet");
    assert!(retries >= 2, "each failed attempt logged: {lines:#?}");
    // The server's words (or the OS's, while nothing listens) are in each.
    assert!(
        lines
            .iter()
            .filter(|l| l.contains("postgres not reachable yet"))
            .all(|l| l.contains("refused") || l.contains("57P03")),
        "{lines:#?}"
    );
}

#[tokio::test]
async fn missing_database_fails_at_once_with_exit_2() {
    let pg = Postgres::start().await.unwrap();
    let url = pg.url("nope");
    for args in [
        &["migrate", "--connect-timeout", "60s"][..],
        &[
            "relay",
            "--sink",
            "redis://127.0.0.1:1",
            "--connect-timeout",
            "60s",
        ][..],
    ] {
        let started = Instant::now();
        let out = run_cli(args, &[("DATABASE_URL", &url)]).await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(r#"database "nope" does not exist"#),
            "{args:?}: {stderr}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{args:?} took {:?} of its 60 s",
            started.elapsed()
        );
    }
}

#[tokio::test]
async fn tls_configuration_errors_exit_2_naming_the_parameter() {
    // Nothing listens there: these fail before connecting.
    let base = format!(
        "postgres://postgres@localhost:{}/postgres",
        outbox_testkit::free_port()
    );
    for (params, words) in [
        (
            "sslmode=verify-full&sslrootcert=/nonexistent/root.crt",
            "sslrootcert=/nonexistent/root.crt",
        ),
        ("sslmode=verify-fully", "sslmode"),
        ("sslmode=require&sslrootcert=system", "sslrootcert"),
        ("sslcert=/tmp/c.crt", "sslkey"),
    ] {
        let out = run_cli(
            &["stats", "--connect-timeout", "60s"],
            &[("DATABASE_URL", &format!("{base}?{params}"))],
        )
        .await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{params}: {stderr}");
        assert!(stderr.contains(words), "{params}: {stderr}");
    }
}
