//! The replication connection: `START_REPLICATION … LOGICAL` with pgoutput
//! with the same credentials and TLS settings as every other connection of
//! the relay, through `pgwire-replication`, to the one host that is not a
//! standby.
//!
//! The crate takes one host, and a slot lives on the primary only. So with
//! several hosts in the URL (a primary and its standbys), [`primary`] asks
//! each in turn, on a normal connection, whether it is in recovery, and
//! the stream goes to the first that is not: after a failover, the one
//! promoted. The session is opened gated ([`connect`]): it reports the
//! server's system identifier and timeline (`IDENTIFY_SYSTEM`), so the
//! source can tell a failover and prepare the slot, before [`start`] sends
//! `START_REPLICATION` on that same session.
//!
//! Why that crate: it speaks the replication protocol on its own (no
//! libpq, no fork of tokio-postgres), uses the rustls and ring the relay
//! already links, keeps the standby status updates going while the relay
//! applies backpressure, and passes logical decoding messages through,
//! which the table-less `emit` needs. `pg_walstream` brings aws-lc-rs (a
//! second TLS provider and a C build); supabase/etl's client is a fork of
//! tokio-postgres that is not on crates.io.

use std::time::Duration;

use outbox::sql::WalSql;
use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, SslMode as WireSsl, TlsConfig,
};
use tokio_postgres::config::Host;

use super::backfill::Server;
use crate::error::error_chain;
use crate::pg::{PgConfig, Roots, SslMode};
use crate::source::SourceError;

/// How often the confirmed position is reported while it moves: short, as
/// events count against the window until it went out (a crash re-sends
/// what the server was not told), so this bounds the throughput at the
/// window per interval.
pub(crate) const STATUS_INTERVAL: Duration = Duration::from_millis(10);

/// Messages the replication client buffers ahead of the relay: a few
/// batches' worth. Counted in messages, not bytes, so with very large
/// events this is what bounds the memory read ahead.
const BUFFERED_EVENTS: usize = 256;

/// Which host of `pg` to stream from: with several hosts, the first that is
/// not a standby (`pg_is_in_recovery()`), as a config of that host alone;
/// with one, `pg` itself.
pub(crate) async fn primary(pg: &PgConfig, sql: &WalSql) -> Result<PgConfig, SourceError> {
    if !pg.has_several_hosts() {
        return Ok(pg.clone());
    }
    let mut tried = Vec::new();
    for one in pg.per_host() {
        let asked = async {
            let client = crate::pg::connect_once(&one).await?;
            sql.in_recovery(&client).await
        };
        match asked.await {
            Ok(false) => return Ok(one),
            Ok(true) => tried.push(format!("{}: a standby", one.target())),
            Err(error) => tried.push(format!("{}: {}", one.target(), error_chain(&error))),
        }
    }
    Err(SourceError::NoPrimary(tried.join("; ")))
}

/// The replication session's settings for `pg` (its first host), reading
/// `slot` through `publication`.
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

/// Opens a gated session (authenticated, not streaming yet) and asks the
/// server who it is.
pub(crate) async fn connect(config: ReplicationConfig) -> Result<(ReplicationClient, Server), PgWireError> {
    let mut client = ReplicationClient::connect_gated(config).await?;
    let system = client.identify_system().await?;
    Ok((
        client,
        Server {
            system: system.system_id,
            timeline: system.timeline,
        },
    ))
}

/// Sends `START_REPLICATION` on a session from [`connect`] and waits until
/// the server accepted it: from then on this session holds the slot.
pub(crate) async fn start(client: &mut ReplicationClient) -> Result<(), PgWireError> {
    client.start().await?;
    client.wait_started().await
}

/// Whether the server refused because another session streams the slot
/// (the reader that lost its turn has not let go yet).
pub(crate) fn is_slot_busy(error: &PgWireError) -> bool {
    // object_in_use: "replication slot … is active for PID …".
    matches!(error, PgWireError::Server(m) if m.contains("SQLSTATE 55006"))
}
