//! Connecting to PostgreSQL: the one place a `DATABASE_URL` becomes a
//! config and a config becomes a connection, for the relay's sessions, the
//! operator commands, the lab and the bench alike (and so the one place
//! that will choose TLS).

use std::time::Duration;

use tokio_postgres::tls::NoTlsStream;
use tokio_postgres::{Client, Config, Connection, NoTls, Socket};

/// A `DATABASE_URL` that does not parse. The URL is shown without its
/// password.
#[derive(Debug, thiserror::Error)]
#[error("invalid DATABASE_URL {url:?}: {reason}")]
pub struct InvalidUrl {
    /// The value, password replaced by `***`.
    pub url: String,
    /// What the parser said.
    pub reason: String,
}

/// Parses `url` (a URL or `key=value` string) and sets the connect timeout.
pub fn parse_url(url: &str, connect_timeout: Duration) -> Result<Config, InvalidUrl> {
    let mut config: Config = url.parse().map_err(|e: tokio_postgres::Error| InvalidUrl {
        url: redact(url),
        reason: e.to_string(),
    })?;
    config.connect_timeout(connect_timeout);
    Ok(config)
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => url.to_owned(),
    }
}

/// Opens a connection and returns it with the driver the caller must poll
/// (the relay's sessions read notifications from it).
pub(crate) async fn open(
    config: &Config,
) -> Result<(Client, Connection<Socket, NoTlsStream>), tokio_postgres::Error> {
    config.connect(NoTls).await
}

/// One connection whose driver runs in a task, `application_name` `outbox`
/// unless the config names one (the relay names itself `outbox-relay`).
pub async fn connect(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let mut config = config.clone();
    if config.get_application_name().is_none() {
        config.application_name("outbox");
    }
    let (client, connection) = open(&config).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::warn!(%error, "postgres connection closed");
        }
    });
    Ok(client)
}
