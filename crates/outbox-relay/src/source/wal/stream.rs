//! The replication connection: `START_REPLICATION … LOGICAL` with pgoutput
//! over the same host, credentials and TLS settings as every other
//! connection of the relay, through `pgwire-replication`.
//!
//! Why that crate: it speaks the replication protocol on its own (no
//! libpq, no fork of tokio-postgres), uses the rustls and ring the relay
//! already links, keeps the standby status updates going while the relay
//! applies backpressure, and passes logical decoding messages through,
//! which the table-less `emit` needs. `pg_walstream` brings aws-lc-rs (a
//! second TLS provider and a C build); supabase/etl's client is a fork of
//! tokio-postgres that is not on crates.io.

use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, SslMode as WireSsl, TlsConfig};
use tokio_postgres::config::Host;

use crate::pg::{PgConfig, Roots, SslMode};

/// How often the confirmed position is reported while it moves: short, as
/// events count against the window until it went out (a crash re-sends
/// what the server was not told), so this bounds the throughput at the
/// window per interval.
pub(crate) const STATUS_INTERVAL: Duration = Duration::from_millis(10);

/// Messages the replication client buffers ahead of the relay: a few
/// batches' worth. Counted in messages, not bytes, so with very large
/// events this is what bounds the memory read ahead.
const BUFFERED_EVENTS: usize = 256;

/// The replication session's settings for `pg`, reading `slot` through
/// `publication`.
pub(crate) fn config(pg: &PgConfig, slot: &str, publication: &str) -> ReplicationConfig {
    let postgres = pg.postgres();
    let port = postgres.get_ports().first().copied().unwrap_or(5432);
    let host = match postgres.get_hosts().first() {
        Some(Host::Tcp(name)) => name.clone(),
        Some(Host::Unix(dir)) => dir.display().to_string(),
        None => "localhost".to_owned(),
    };
    let user = postgres.get_user().unwrap_or("postgres").to_owned();
    let password = postgres
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let database = postgres.get_dbname().unwrap_or(&user).to_owned();
    let application = postgres
        .get_application_name()
        .unwrap_or("outbox-relay")
        .to_owned();
    let unix = matches!(postgres.get_hosts().first(), Some(Host::Unix(_)));
    let mut tls = TlsConfig::disabled();
    tls.mode = match (pg.ssl_mode(), pg.roots()) {
        // As libpq: no TLS over a Unix socket, whatever sslmode says.
        _ if unix => WireSsl::Disable,
        (SslMode::Disable, _) => WireSsl::Disable,
        (SslMode::Prefer, _) => WireSsl::Prefer,
        // As libpq: `require` with a root certificate checks the chain.
        (SslMode::Require, Roots::File(_)) | (SslMode::VerifyCa, _) => WireSsl::VerifyCa,
        (SslMode::Require, _) => WireSsl::Require,
        (SslMode::VerifyFull, _) => WireSsl::VerifyFull,
    };
    if let Roots::File(path) = pg.roots() {
        tls.ca_pem_path = Some(path.clone());
    }
    if let (Some(cert), Some(key)) = (pg.client_cert(), pg.client_key()) {
        tls.client_cert_pem_path = Some(cert.to_path_buf());
        tls.client_key_pem_path = Some(key.to_path_buf());
    }
    ReplicationConfig::new(host, user, password, database, slot, publication)
        .with_port(port)
        .with_tls(tls)
        // Timestamps in tuples print one way, whatever the server's defaults.
        .with_options("-c DateStyle=ISO -c TimeZone=UTC")
        .with_application_name(application)
        .with_start_lsn(Lsn::ZERO)
        .with_status_interval(STATUS_INTERVAL)
        .with_wakeup_interval(Duration::from_secs(1))
        .with_buffer_size(BUFFERED_EVENTS)
}

/// Opens the stream and waits until the server accepted
/// `START_REPLICATION`: from then on this session holds the slot.
pub(crate) async fn open(
    config: ReplicationConfig,
) -> Result<ReplicationClient, pgwire_replication::PgWireError> {
    let mut client = ReplicationClient::connect(config).await?;
    client.wait_started().await?;
    Ok(client)
}

/// Whether the server refused because another session streams the slot
/// (the reader that lost its turn has not let go yet).
pub(crate) fn is_slot_busy(error: &pgwire_replication::PgWireError) -> bool {
    // object_in_use: "replication slot … is active for PID …".
    matches!(error, pgwire_replication::PgWireError::Server(m) if m.contains("SQLSTATE 55006"))
}
