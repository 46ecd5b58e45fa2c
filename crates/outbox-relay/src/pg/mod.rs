//! Connecting to PostgreSQL: the one place a `DATABASE_URL` becomes a
//! [`PgConfig`] and a config becomes a connection, for the relay's sessions,
//! the operator commands, the consumer workers, the lab and the bench alike.
//! This module owns the public face ([`parse_url`], [`connect`],
//! [`connect_once`] and the types they take and return); the work is in
//! three submodules:
//!
//! | module | owns |
//! |---|---|
//! | `params` | taking libpq's TLS parameters out of a URL or `key=value` string, what they mean, redacting passwords for messages |
//! | `tls` | the rustls config per `sslmode`: roots, client certificates, the verifiers |
//! | `startup` | [`ConnectError`], which failures are permanent, the retry loop |
//!
//! # TLS, as libpq does it
//!
//! tokio-postgres parses `sslmode` only as `disable`, `prefer` or `require`
//! and rejects `verify-ca`, `verify-full`, `sslrootcert`, `sslcert` and
//! `sslkey`. [`parse_url`] takes those out of the URL (or `key=value`
//! string) first (`params`), hands the rest to tokio-postgres, and builds a
//! rustls `ClientConfig` (`tls`) that checks what libpq's mode checks:
//!
//! | `sslmode` | TLS | server certificate |
//! |---|---|---|
//! | `disable` | never | – |
//! | `prefer` (default) | if the server offers it | not checked, unless `sslrootcert` is given (then as `verify-ca`) |
//! | `require` | always | not checked, unless `sslrootcert` is given (then as `verify-ca`) |
//! | `verify-ca` | always | chain up to a trusted root; any host name |
//! | `verify-full` | always | chain, and the host name (or IP) connected to |
//!
//! Which roots `verify-*` trusts ([`Roots`]) and how client certificates
//! are given are in `tls`'s docs. Files are read once, when the URL is
//! parsed: an unreadable one is a configuration error at startup (exit 2),
//! not a connection failure later, and a relay picks up renewed
//! certificates when restarted. Every connection carries the same stream
//! type, `TlsStream`, whether TLS was used or not, so the relay's
//! sessions can poll it for notifications.
//!
//! # Startup
//!
//! [`connect`] keeps trying until the connect timeout, logging each failed
//! attempt with the server's message (and sending `OUTBOX_CONNECT=retrying`
//! to `NOTIFY_SOCKET`), except for failures retrying cannot fix (wrong
//! password, no such database, a certificate refused), which fail at once
//! ([`ConnectError::is_permanent`]). The relay applies the same rules
//! (`startup::Startup`) to its sessions.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::error_chain;

mod params;
mod startup;
mod tls;

pub use params::redact;
pub use startup::ConnectError;
pub(crate) use startup::Startup;

use params::split_tls_params;
use tls::{ring, unchecked_config};

/// The stream of every connection [`open`] makes: TLS or not, one type.
pub(crate) type TlsStream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// What `sslmode` asks for (libpq's names, without `allow`). See the
/// [module docs](self) for what each checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// TLS if the server offers it, the certificate not checked.
    #[default]
    Prefer,
    /// TLS, the certificate not checked (unless `sslrootcert` is given).
    Require,
    /// TLS, the certificate chain checked, not the host name.
    VerifyCa,
    /// TLS, the chain and the host name checked.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Option<SslMode> {
        Some(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// What tokio-postgres is told: it only decides whether to ask for
    /// TLS; the certificate checks are in the rustls config.
    fn negotiation(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as Pg;
        match self {
            SslMode::Disable => Pg::Disable,
            SslMode::Prefer => Pg::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Pg::Require,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        })
    }
}

/// Where the roots that check the server's certificate come from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Roots {
    /// None: the certificate is not checked (`prefer`, `require`).
    Unchecked,
    /// A PEM file (`sslrootcert=<path>`, or `~/.postgresql/root.crt`).
    File(PathBuf),
    /// The system's (`sslrootcert=system`, or no `root.crt`).
    System,
}

/// A connection config: tokio-postgres's, plus the TLS settings it cannot
/// hold and how long to keep trying at startup. Build with [`parse_url`]
/// (or from a [`tokio_postgres::Config`], whose `sslmode` is kept).
#[derive(Clone)]
pub struct PgConfig {
    postgres: Config,
    ssl_mode: SslMode,
    roots: Roots,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    tls: MakeRustlsConnect,
    connect_timeout: Duration,
}

impl fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // tokio-postgres's Debug already hides the password.
        f.debug_struct("PgConfig")
            .field("postgres", &self.postgres)
            .field("ssl_mode", &self.ssl_mode)
            .field("roots", &self.roots)
            .field("client_cert", &self.client_cert)
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

impl PgConfig {
    /// The tokio-postgres side: host, user, database, application name.
    pub fn postgres(&self) -> &Config {
        &self.postgres
    }

    /// The tokio-postgres side, to change (e.g. `dbname`). Its `ssl_mode`
    /// is overridden by [`ssl_mode`](Self::ssl_mode) at connect time.
    pub fn postgres_mut(&mut self) -> &mut Config {
        &mut self.postgres
    }

    /// The `sslmode`.
    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// Where the roots checking the server's certificate come from.
    pub fn roots(&self) -> &Roots {
        &self.roots
    }

    /// The client certificate's file (`sslcert`), if one is presented.
    pub fn client_cert(&self) -> Option<&Path> {
        self.client_cert.as_deref()
    }

    /// The client certificate's key file (`sslkey`), with
    /// [`client_cert`](Self::client_cert).
    pub fn client_key(&self) -> Option<&Path> {
        self.client_key.as_deref()
    }

    /// How long [`connect`] keeps trying (`--connect-timeout`).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Whether the URL names more than one host (libpq's `host=a,b`, or
    /// `postgres://a:1,b:2/db`): a primary and its standbys.
    pub fn has_several_hosts(&self) -> bool {
        self.host_count() > 1
    }

    fn host_count(&self) -> usize {
        let pg = &self.postgres;
        pg.get_hosts().len().max(pg.get_hostaddrs().len())
    }

    /// With several hosts, connects only to one that takes writes
    /// (`target_session_attrs=read-write`) unless the URL asked for
    /// something else than `any`, libpq's default: what a relay needs, as
    /// every one of its sessions writes or must see what writers
    /// committed. One host: unchanged.
    pub fn prefer_primary(&mut self) {
        use tokio_postgres::config::TargetSessionAttrs;
        if self.has_several_hosts() && self.postgres.get_target_session_attrs() == TargetSessionAttrs::Any {
            self.postgres.target_session_attrs(TargetSessionAttrs::ReadWrite);
        }
    }

    /// One config per host the URL names, in the URL's order: that host
    /// alone (with its `hostaddr` and port), everything else the same, and
    /// `target_session_attrs=any`, so the caller can ask each host what it
    /// is. A config of one host gives itself.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let config = outbox_relay::pg::parse_url(
    ///     "postgres://app@db1:5432,db2:5433/shop?target_session_attrs=read-write",
    ///     Duration::from_secs(10),
    /// )?;
    /// let hosts: Vec<String> = config.per_host().iter().map(|c| c.target()).collect();
    /// assert_eq!(hosts, ["db1:5432/shop", "db2:5433/shop"]);
    /// # Ok::<_, outbox_relay::pg::UrlError>(())
    /// ```
    pub fn per_host(&self) -> Vec<PgConfig> {
        if !self.has_several_hosts() {
            return vec![self.clone()];
        }
        let pg = &self.postgres;
        (0..self.host_count())
            .map(|i| {
                let mut one = Config::new();
                if let Some(user) = pg.get_user() {
                    one.user(user);
                }
                if let Some(password) = pg.get_password() {
                    one.password(password);
                }
                if let Some(dbname) = pg.get_dbname() {
                    one.dbname(dbname);
                }
                if let Some(options) = pg.get_options() {
                    one.options(options);
                }
                if let Some(name) = pg.get_application_name() {
                    one.application_name(name);
                }
                if let Some(timeout) = pg.get_connect_timeout() {
                    one.connect_timeout(*timeout);
                }
                if let Some(timeout) = pg.get_tcp_user_timeout() {
                    one.tcp_user_timeout(*timeout);
                }
                one.ssl_mode(pg.get_ssl_mode())
                    .ssl_negotiation(pg.get_ssl_negotiation())
                    .channel_binding(pg.get_channel_binding())
                    .keepalives(pg.get_keepalives())
                    .keepalives_idle(pg.get_keepalives_idle());
                if let Some(interval) = pg.get_keepalives_interval() {
                    one.keepalives_interval(interval);
                }
                if let Some(retries) = pg.get_keepalives_retries() {
                    one.keepalives_retries(retries);
                }
                match pg.get_hosts().get(i) {
                    Some(Host::Tcp(name)) => {
                        one.host(name);
                    }
                    Some(Host::Unix(dir)) => {
                        one.host_path(dir);
                    }
                    None => {}
                }
                if let Some(addr) = pg.get_hostaddrs().get(i) {
                    one.hostaddr(*addr);
                }
                if let Some(port) = pg.get_ports().get(i).or(pg.get_ports().first()) {
                    one.port(*port);
                }
                PgConfig {
                    postgres: one,
                    ..self.clone()
                }
            })
            .collect()
    }

    /// Where this connects, for messages: `host:port/dbname`, never the
    /// password.
    pub fn target(&self) -> String {
        let pg = &self.postgres;
        let port = |i: usize| {
            pg.get_ports()
                .get(i)
                .or(pg.get_ports().first())
                .copied()
                .unwrap_or(5432)
        };
        let hosts: Vec<String> = pg
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, host)| match host {
                Host::Tcp(name) => format!("{name}:{}", port(i)),
                Host::Unix(dir) => format!("{}/.s.PGSQL.{}", dir.display(), port(i)),
            })
            .collect();
        let hosts = if hosts.is_empty() {
            "localhost:5432".to_owned()
        } else {
            hosts.join(",")
        };
        let db = pg.get_dbname().or(pg.get_user()).unwrap_or_default();
        format!("{hosts}/{db}")
    }
}

impl From<Config> for PgConfig {
    /// Keeps the config's `sslmode` (the server's certificate unchecked,
    /// as tokio-postgres alone could not check it either), its connect
    /// timeout as the time to keep trying, or a single attempt without one.
    fn from(postgres: Config) -> PgConfig {
        use tokio_postgres::config::SslMode as Pg;
        let ssl_mode = match postgres.get_ssl_mode() {
            Pg::Disable => SslMode::Disable,
            Pg::Require => SslMode::Require,
            _ => SslMode::Prefer,
        };
        let connect_timeout = postgres.get_connect_timeout().copied().unwrap_or_default();
        let tls = MakeRustlsConnect::new(unchecked_config(ring()));
        PgConfig {
            postgres,
            ssl_mode,
            roots: Roots::Unchecked,
            client_cert: None,
            client_key: None,
            tls,
            connect_timeout,
        }
    }
}

/// A `DATABASE_URL` that cannot be used. The URL is shown without its
/// password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// tokio-postgres (or the pre-parse of the TLS parameters) rejected it.
    #[error("invalid DATABASE_URL {url:?}: {reason}")]
    Syntax {
        /// The value, password replaced by `***`.
        url: String,
        /// What the parser said.
        reason: String,
    },
    /// A parameter's value, or two parameters together, make no sense.
    #[error("invalid DATABASE_URL {url:?}: {param}: {reason}")]
    Param {
        /// The value, password replaced by `***`.
        url: String,
        /// The parameter at fault (`sslmode`, `sslrootcert`, …).
        param: &'static str,
        /// Why.
        reason: String,
    },
    /// A certificate or key file the URL names cannot be used.
    #[error("invalid DATABASE_URL {url:?}: {param}={path}: {doing}")]
    File {
        /// The value, password replaced by `***`.
        url: String,
        /// The parameter at fault (`sslrootcert`, `sslcert`, `sslkey`).
        param: &'static str,
        /// The file (or `system`).
        path: String,
        /// What failed.
        doing: &'static str,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Parses `url` (a `postgres://` URL or a `key=value` string, libpq's
/// syntax) with libpq's TLS parameters, reads the certificate files it
/// names, and sets `connect_timeout` as both the time to keep trying at
/// startup and each attempt's TCP connect timeout.
///
/// ```
/// use std::time::Duration;
/// use outbox_relay::pg::{self, SslMode};
///
/// let config = pg::parse_url(
///     "postgres://app:secret@db.internal/shop?sslmode=require&application_name=shop",
///     Duration::from_secs(10),
/// )?;
/// assert_eq!(config.ssl_mode(), SslMode::Require);
/// assert_eq!(config.target(), "db.internal:5432/shop");
/// # Ok::<_, pg::UrlError>(())
/// ```
pub fn parse_url(url: &str, connect_timeout: Duration) -> Result<PgConfig, UrlError> {
    let (rest, tls) = split_tls_params(url).map_err(|reason| UrlError::Syntax {
        url: redact(url),
        reason,
    })?;
    let settings = tls.settings().map_err(|(param, reason)| UrlError::Param {
        url: redact(url),
        param,
        reason,
    })?;
    let mut postgres: Config = rest
        .parse()
        .map_err(|e: tokio_postgres::Error| UrlError::Syntax {
            url: redact(url),
            reason: error_chain(&e),
        })?;
    postgres.connect_timeout(connect_timeout);
    let config = settings.client_config().map_err(|e| e.into_url_error(url))?;
    postgres.ssl_mode(settings.mode.negotiation());
    Ok(PgConfig {
        postgres,
        ssl_mode: settings.mode,
        roots: settings.roots,
        client_cert: settings.client.as_ref().map(|(cert, _)| cert.clone()),
        client_key: settings.client.map(|(_, key)| key),
        tls: MakeRustlsConnect::new(config),
        connect_timeout,
    })
}

/// Opens one connection (one attempt) and returns it with the driver the
/// caller must poll (the relay's sessions read notifications from it).
pub(crate) async fn open(
    config: &PgConfig,
) -> Result<(Client, Connection<Socket, TlsStream>), tokio_postgres::Error> {
    let mut postgres = config.postgres.clone();
    let unix_only =
        !postgres.get_hosts().is_empty() && postgres.get_hosts().iter().all(|h| matches!(h, Host::Unix(_)));
    // As libpq: no TLS over Unix sockets, whatever sslmode says.
    postgres.ssl_mode(if unix_only {
        tokio_postgres::config::SslMode::Disable
    } else {
        config.ssl_mode.negotiation()
    });
    postgres.connect(config.tls.clone()).await
}

/// One connection whose driver runs in a task, `application_name` `outbox`
/// unless the config names one (the relay names itself `outbox-relay`),
/// retrying as the [module docs](self#startup) say.
pub async fn connect(config: &PgConfig) -> Result<Client, ConnectError> {
    let mut startup = Startup::new(config, config.connect_timeout);
    loop {
        match connect_once(config).await {
            Ok(client) => return Ok(client),
            Err(error) => tokio::time::sleep(startup.failed(error)?).await,
        }
    }
}

/// Like [`connect`], one attempt.
pub async fn connect_once(config: &PgConfig) -> Result<Client, tokio_postgres::Error> {
    let mut config = config.clone();
    if config.postgres.get_application_name().is_none() {
        config.postgres.application_name("outbox");
    }
    let (client, connection) = open(&config).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::warn!(error = %error_chain(&error), "postgres connection closed");
        }
    });
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(3);

    #[test]
    fn modes_parse_and_tokio_postgres_only_sees_what_it_knows() {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        let pem = rcgen::CertifiedIssuer::self_signed(params, key).unwrap().pem();
        let root = std::env::temp_dir().join(format!("outbox-pg-modes-{}.pem", std::process::id()));
        std::fs::write(&root, pem).unwrap();
        for (mode, expected, negotiation) in [
            (
                "disable",
                SslMode::Disable,
                tokio_postgres::config::SslMode::Disable,
            ),
            ("prefer", SslMode::Prefer, tokio_postgres::config::SslMode::Prefer),
            (
                "require",
                SslMode::Require,
                tokio_postgres::config::SslMode::Require,
            ),
            (
                "verify-ca",
                SslMode::VerifyCa,
                tokio_postgres::config::SslMode::Require,
            ),
            (
                "verify-full",
                SslMode::VerifyFull,
                tokio_postgres::config::SslMode::Require,
            ),
        ] {
            let url = format!("postgres://h/db?sslmode={mode}&sslrootcert={}", root.display());
            let config = parse_url(&url, T).unwrap();
            assert_eq!(config.ssl_mode(), expected, "{mode}");
            assert_eq!(config.postgres().get_ssl_mode(), negotiation, "{mode}");
            let checked = !matches!(expected, SslMode::Disable);
            assert_eq!(config.roots() == &Roots::File(root.clone()), checked, "{mode}");
            let kv = parse_url(
                &format!("host=h sslmode={mode} sslrootcert='{}'", root.display()),
                T,
            )
            .unwrap();
            assert_eq!(kv.ssl_mode(), expected, "{mode}");
        }
        let _ = std::fs::remove_file(&root);
        let default = parse_url("postgres://h/db", T).unwrap();
        assert_eq!(default.ssl_mode(), SslMode::Prefer);
        assert_eq!(default.roots(), &Roots::Unchecked);
        assert_eq!(default.connect_timeout(), T);
        assert_eq!(default.postgres().get_connect_timeout(), Some(&T));
    }

    #[test]
    fn roots_follow_libpq() {
        let system = parse_url("postgres://h/db?sslrootcert=system", T).unwrap();
        assert_eq!(
            system.ssl_mode(),
            SslMode::VerifyFull,
            "system implies verify-full"
        );
        assert_eq!(system.roots(), &Roots::System);
        let require = parse_url("postgres://h/db?sslmode=require", T).unwrap();
        assert_eq!(require.roots(), &Roots::Unchecked);
        let disable = parse_url("postgres://h/db?sslmode=disable&sslrootcert=/nonexistent", T).unwrap();
        assert_eq!(disable.roots(), &Roots::Unchecked, "disable reads no file");
    }

    fn param_error(url: &str) -> (&'static str, String) {
        match parse_url(url, T).unwrap_err() {
            UrlError::Param {
                param,
                reason,
                url: shown,
            } => {
                assert!(!shown.contains("secret"), "{shown}");
                (param, reason)
            }
            other => panic!("{url}: {other}"),
        }
    }

    #[test]
    fn errors_name_the_parameter_at_fault() {
        let (param, reason) = param_error("postgres://u:secret@h/db?sslmode=verify_full");
        assert_eq!(param, "sslmode");
        assert!(reason.contains("verify_full"), "{reason}");
        assert_eq!(param_error("postgres://h/db?sslmode=allow").0, "sslmode");
        let (param, reason) = param_error("postgres://h/db?sslmode=require&sslrootcert=system");
        assert_eq!(param, "sslrootcert");
        assert!(reason.contains("verify-full"), "{reason}");
        assert_eq!(param_error("postgres://h/db?sslcert=/c.pem").0, "sslkey");
        assert_eq!(param_error("host=h password=secret sslkey=/k.pem").0, "sslcert");

        match parse_url(
            "postgres://u:secret@h/db?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem",
            T,
        )
        .unwrap_err()
        {
            e @ UrlError::File { .. } => {
                let UrlError::File { param, path, .. } = &e else {
                    unreachable!()
                };
                assert_eq!((*param, path.as_str()), ("sslrootcert", "/nonexistent/ca.pem"));
                let chain = error_chain(&e);
                assert!(chain.contains("sslrootcert=/nonexistent/ca.pem"), "{chain}");
                assert!(chain.contains("No such file"), "{chain}");
                assert!(!chain.contains("secret"), "{chain}");
            }
            other => panic!("{other}"),
        }
        match parse_url("postgres://h/db?sslmode=nope&bogus=1", T).unwrap_err() {
            UrlError::Param { param: "sslmode", .. } => {}
            other => panic!("{other}"),
        }
        match parse_url("postgres://h/db?bogus=1", T).unwrap_err() {
            UrlError::Syntax { reason, .. } => assert!(reason.contains("bogus"), "{reason}"),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn several_hosts_are_kept_and_split_one_per_host() {
        use tokio_postgres::config::TargetSessionAttrs;
        for url in [
            "postgres://u:secret@h1:5432,h2:5433/db?target_session_attrs=read-write&application_name=a&sslmode=require",
            "host=h1,h2 port=5432,5433 user=u password=secret dbname=db target_session_attrs=read-write application_name=a sslmode=require",
        ] {
            let config = parse_url(url, T).unwrap();
            assert!(config.has_several_hosts(), "{url}");
            assert_eq!(config.target(), "h1:5432,h2:5433/db", "{url}");
            assert_eq!(
                config.postgres().get_target_session_attrs(),
                TargetSessionAttrs::ReadWrite,
                "{url}"
            );
            let hosts = config.per_host();
            let targets: Vec<String> = hosts.iter().map(PgConfig::target).collect();
            assert_eq!(targets, ["h1:5432/db", "h2:5433/db"], "{url}");
            for one in &hosts {
                let pg = one.postgres();
                assert_eq!(pg.get_user(), Some("u"));
                assert_eq!(pg.get_password(), Some(&b"secret"[..]));
                assert_eq!(pg.get_application_name(), Some("a"));
                assert_eq!(pg.get_connect_timeout(), Some(&T));
                assert_eq!(pg.get_target_session_attrs(), TargetSessionAttrs::Any);
                assert_eq!(one.ssl_mode(), SslMode::Require);
                assert!(!one.has_several_hosts());
            }
        }
        let mut one = parse_url("postgres://h/db", T).unwrap();
        assert_eq!(one.per_host().len(), 1);
        one.prefer_primary();
        assert_eq!(
            one.postgres().get_target_session_attrs(),
            TargetSessionAttrs::Any,
            "one host: as written"
        );
        let mut two = parse_url("postgres://h1,h2/db", T).unwrap();
        two.prefer_primary();
        assert_eq!(
            two.postgres().get_target_session_attrs(),
            TargetSessionAttrs::ReadWrite
        );
    }

    #[test]
    fn target_names_host_port_and_database() {
        assert_eq!(
            parse_url("postgres://u:secret@h:6/db", T).unwrap().target(),
            "h:6/db"
        );
        assert_eq!(
            parse_url("host=a,b port=1,2 user=me", T).unwrap().target(),
            "a:1,b:2/me"
        );
    }
}
