//! Connecting to PostgreSQL: the one place a `DATABASE_URL` becomes a
//! [`PgConfig`] and a config becomes a connection, for the relay's sessions,
//! the operator commands, the consumer workers, the lab and the bench alike.
//!
//! # TLS, as libpq does it
//!
//! tokio-postgres parses `sslmode` only as `disable`, `prefer` or `require`
//! and rejects `verify-ca`, `verify-full`, `sslrootcert`, `sslcert` and
//! `sslkey`. [`parse_url`] takes those out of the URL (or `key=value`
//! string) first, hands the rest to tokio-postgres, and builds a rustls
//! [`ClientConfig`] that checks what libpq's mode checks:
//!
//! | `sslmode` | TLS | server certificate |
//! |---|---|---|
//! | `disable` | never | – |
//! | `prefer` (default) | if the server offers it | not checked, unless `sslrootcert` is given (then as `verify-ca`) |
//! | `require` | always | not checked, unless `sslrootcert` is given (then as `verify-ca`) |
//! | `verify-ca` | always | chain up to a trusted root; any host name |
//! | `verify-full` | always | chain, and the host name (or IP) connected to |
//!
//! The roots `verify-*` trust: the PEM file `sslrootcert` names; the
//! system's (`rustls-native-certs`, which honours `SSL_CERT_FILE` and
//! `SSL_CERT_DIR`) with `sslrootcert=system`, which like libpq ≥ 16 makes
//! `verify-full` the default and refuses weaker modes; without
//! `sslrootcert`, libpq's `~/.postgresql/root.crt` if it exists, else the
//! system's (libpq would fail there instead). `sslcert` and `sslkey` (PEM;
//! PKCS#8, PKCS#1 or SEC1 keys) name a client certificate, both or neither;
//! unlike libpq, `~/.postgresql/postgresql.crt` is not picked up unasked.
//! Files are read once, when the URL is parsed: an unreadable one is a
//! configuration error at startup (exit 2), not a connection failure later,
//! and a relay picks up renewed certificates when restarted.
//!
//! The TLS glue is `tokio-postgres-rustls`: the integration maintained
//! alongside tokio-postgres's own releases (0.14, 2026), on the rustls 0.23
//! and ring the workspace already builds for its sinks, and it computes the
//! `tls-server-end-point` channel binding from the certificate's signature
//! hash, so `scram-sha-256` servers that offer `SCRAM-SHA-256-PLUS` work (the
//! forks `tokio-postgres-rustls-improved` and `postgres_rustls` exist for
//! bugs since fixed upstream, or need a newer compiler). Every connection
//! carries the same stream type, [`TlsStream`], whether TLS was used or
//! not, so the relay's sessions can poll it for notifications.
//!
//! # Startup
//!
//! [`connect`] keeps trying until the connect timeout, logging each failed
//! attempt with the server's message (and sending `OUTBOX_CONNECT=retrying`
//! to `NOTIFY_SOCKET`), except for failures retrying cannot fix (wrong
//! password, no such database, a certificate refused), which fail at once
//! ([`ConnectError::is_permanent`]). The relay applies the same [`Startup`]
//! rules to its sessions.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use rustls::ClientConfig;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::Host;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;
use tracing::warn;

use crate::error::error_chain;

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

    /// How long [`connect`] keeps trying (`--connect-timeout`).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
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
        client_cert: settings.client.map(|(cert, _)| cert),
        tls: MakeRustlsConnect::new(config),
        connect_timeout,
    })
}

/// The TLS parameters as written, taken out of the URL.
#[derive(Debug, Default, PartialEq, Eq)]
struct TlsParams {
    sslmode: Option<String>,
    sslrootcert: Option<String>,
    sslcert: Option<String>,
    sslkey: Option<String>,
}

impl TlsParams {
    /// Takes `key` if it is one of ours (the last occurrence wins, as in
    /// libpq).
    fn take(&mut self, key: &str, value: &str) -> bool {
        let slot = match key {
            "sslmode" => &mut self.sslmode,
            "sslrootcert" => &mut self.sslrootcert,
            "sslcert" => &mut self.sslcert,
            "sslkey" => &mut self.sslkey,
            _ => return false,
        };
        *slot = Some(value.to_owned());
        true
    }

    /// What the parameters mean, or the parameter at fault and why.
    fn settings(&self) -> Result<TlsSettings, (&'static str, String)> {
        let mode = match self.sslmode.as_deref() {
            None if self.sslrootcert.as_deref() == Some("system") => SslMode::VerifyFull,
            None => SslMode::Prefer,
            Some("allow") => {
                return Err((
                    "sslmode",
                    "\"allow\" is not supported; use \"prefer\" or \"disable\"".into(),
                ));
            }
            Some(value) => SslMode::parse(value).ok_or_else(|| {
                (
                    "sslmode",
                    format!("{value:?} is not one of disable, prefer, require, verify-ca, verify-full"),
                )
            })?,
        };
        let explicit = match self.sslrootcert.as_deref() {
            None | Some("") => None,
            Some("system") if mode != SslMode::VerifyFull => {
                return Err((
                    "sslrootcert",
                    format!(
                        "\"system\" needs sslmode=verify-full (the default with it), not {mode}: \
                         the system's roots vouch for any name they issued"
                    ),
                ));
            }
            Some("system") => Some(Roots::System),
            Some(path) => Some(Roots::File(PathBuf::from(path))),
        };
        let roots = match (mode, explicit) {
            (SslMode::Disable, _) => Roots::Unchecked,
            (_, Some(roots)) => roots,
            (SslMode::Prefer | SslMode::Require, None) => Roots::Unchecked,
            (_, None) => match default_root_file() {
                Some(file) => Roots::File(file),
                None => Roots::System,
            },
        };
        let client = match (self.sslcert.as_deref(), self.sslkey.as_deref()) {
            (None | Some(""), None | Some("")) => None,
            (Some(cert), Some(key)) if !cert.is_empty() && !key.is_empty() => {
                Some((PathBuf::from(cert), PathBuf::from(key)))
            }
            (Some(c), _) if !c.is_empty() => return Err(("sslkey", "missing: sslcert needs it".into())),
            _ => return Err(("sslcert", "missing: sslkey needs it".into())),
        };
        Ok(TlsSettings { mode, roots, client })
    }
}

/// libpq's default root file, if it exists.
fn default_root_file() -> Option<PathBuf> {
    let file = PathBuf::from(std::env::var_os("HOME")?).join(".postgresql/root.crt");
    file.is_file().then_some(file)
}

/// What the TLS parameters mean.
#[derive(Debug)]
struct TlsSettings {
    mode: SslMode,
    roots: Roots,
    /// Certificate and key files.
    client: Option<(PathBuf, PathBuf)>,
}

/// A file that could not be used, before the URL is attached.
struct FileError {
    param: &'static str,
    path: String,
    doing: &'static str,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl FileError {
    fn new(
        param: &'static str,
        path: &Path,
        doing: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> FileError {
        FileError {
            param,
            path: path.display().to_string(),
            doing,
            source: source.into(),
        }
    }

    fn into_url_error(self, url: &str) -> UrlError {
        UrlError::File {
            url: redact(url),
            param: self.param,
            path: self.path,
            doing: self.doing,
            source: self.source,
        }
    }
}

impl TlsSettings {
    /// The rustls config checking what the mode checks.
    fn client_config(&self) -> Result<ClientConfig, FileError> {
        let provider = ring();
        let verifier: Arc<dyn ServerCertVerifier> = match &self.roots {
            Roots::Unchecked => Arc::new(Unchecked(provider.clone())),
            roots => {
                let roots = Arc::new(load_roots(roots)?);
                let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                    .build()
                    .map_err(|e| FileError::new("sslrootcert", Path::new(""), "building the verifier", e))?;
                if self.mode == SslMode::VerifyFull {
                    webpki
                } else {
                    Arc::new(ChainOnly(webpki))
                }
            }
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            // ring supports every default version: an invariant of rustls.
            .expect("ring supports rustls's default protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match &self.client {
            None => builder.with_no_client_auth(),
            Some((cert_file, key_file)) => {
                let certs = read_certs("sslcert", cert_file)?;
                let key = PrivateKeyDer::from_pem_file(key_file)
                    .map_err(|e| FileError::new("sslkey", key_file, "reading the private key (PEM)", e))?;
                builder.with_client_auth_cert(certs, key).map_err(|e| {
                    FileError::new("sslkey", key_file, "using it with sslcert's certificate", e)
                })?
            }
        };
        // What libpq 17 sends; required with `sslnegotiation=direct`.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(config)
    }
}

fn ring() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The config of a connection whose certificate is not checked.
fn unchecked_config(provider: Arc<CryptoProvider>) -> ClientConfig {
    let mut config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        // ring supports every default version: an invariant of rustls.
        .expect("ring supports rustls's default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Unchecked(provider)))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    config
}

fn read_certs(param: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, FileError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| FileError::new(param, path, "reading the certificates (PEM)", e))?;
    if certs.is_empty() {
        return Err(FileError::new(
            param,
            path,
            "reading the certificates (PEM)",
            "no certificate in the file",
        ));
    }
    Ok(certs)
}

fn load_roots(roots: &Roots) -> Result<RootCertStore, FileError> {
    let mut store = RootCertStore::empty();
    match roots {
        Roots::Unchecked => {}
        Roots::File(path) => {
            for cert in read_certs("sslrootcert", path)? {
                store
                    .add(cert)
                    .map_err(|e| FileError::new("sslrootcert", path, "adding a root certificate", e))?;
            }
        }
        Roots::System => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = match found.errors.first() {
                    Some(e) => format!("none found: {e}"),
                    None => "none found (set SSL_CERT_FILE or SSL_CERT_DIR)".to_owned(),
                };
                return Err(FileError::new(
                    "sslrootcert",
                    Path::new("system"),
                    "loading the system's root certificates",
                    why,
                ));
            }
        }
    }
    Ok(store)
}

/// `verify-ca`: the chain is checked as `verify-full` checks it; only a
/// name mismatch is forgiven. Safe because rustls checks the name last,
/// after the chain (`WebPkiServerVerifier::verify_server_cert`).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without `sslrootcert`: any certificate (libpq's
/// "I trust that the network will make sure I always connect to the server
/// I want"); the handshake's signatures are still checked.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Splits the TLS parameters off `url`: the rest, for tokio-postgres, and
/// ours. Mirrors tokio-postgres's grammar: a URL's parameters start at the
/// first `?` after the credentials and are percent-encoded; a `key=value`
/// string's values may be single-quoted, with `\` escaping.
fn split_tls_params(url: &str) -> Result<(String, TlsParams), String> {
    let mut ours = TlsParams::default();
    if let Some((head, query)) = url_query(url) {
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let key = decode(key)?;
            if !ours.take(&key, &decode(value)?) {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            head.to_owned()
        } else {
            format!("{head}?{}", kept.join("&"))
        };
        return Ok((rest, ours));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok((url.to_owned(), ours));
    }
    let mut rest = String::new();
    for (key, value) in key_values(url)? {
        if !ours.take(&key, &value) {
            if !rest.is_empty() {
                rest.push(' ');
            }
            rest.push_str(&format!("{key}={}", quote(&value)));
        }
    }
    Ok((rest, ours))
}

/// A URL's part before the parameters and the parameters, if it is a URL
/// with parameters.
fn url_query(url: &str) -> Option<(&str, &str)> {
    let body = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|prefix| url.strip_prefix(prefix))?;
    // tokio-postgres takes everything up to the first `@` as credentials.
    let after_credentials = body.find('@').map_or(0, |at| at + 1);
    let start = url.len() - body.len() + after_credentials;
    let question = url[start..].find('?')? + start;
    Some((&url[..question], &url[question + 1..]))
}

fn decode(s: &str) -> Result<String, String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|e| format!("a parameter is not UTF-8 once percent-decoded: {e}"))
}

/// libpq's `key=value` syntax, as tokio-postgres parses it.
fn key_values(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut it = s.chars().peekable();
    let mut out = Vec::new();
    loop {
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        let mut key = String::new();
        while let Some(c) = it.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        if key.is_empty() {
            if it.peek().is_some() {
                return Err("expected a keyword before `=`".to_owned());
            }
            return Ok(out);
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        if it.next() != Some('=') {
            return Err(format!("expected `=` after {key:?}"));
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if it.next_if_eq(&'\'').is_some() {
            loop {
                match it.next() {
                    Some('\'') => break,
                    Some('\\') => value.extend(it.next()),
                    Some(c) => value.push(c),
                    None => return Err("unterminated quoted connection parameter value".to_owned()),
                }
            }
        } else {
            while let Some(c) = it.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(it.next());
                } else {
                    value.push(c);
                }
            }
            if value.is_empty() {
                return Err(format!("no value for {key:?}"));
            }
        }
        out.push((key, value));
    }
}

/// A `key=value` value, quoted so tokio-postgres reads it back unchanged.
fn quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('\'');
    for c in value.chars() {
        if c == '\'' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('\'');
    out
}

/// The URL or `key=value` string without its password, for messages.
fn redact(url: &str) -> String {
    const HIDDEN: &str = "***";
    if let Some(body) = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|prefix| url.strip_prefix(prefix))
    {
        let prefix = &url[..url.len() - body.len()];
        let (credentials, rest) = match body.split_once('@') {
            Some((credentials, rest)) => match credentials.split_once(':') {
                Some((user, _)) => (format!("{user}:{HIDDEN}@"), rest),
                None => (format!("{credentials}@"), rest),
            },
            None => (String::new(), body),
        };
        let rest = match rest.split_once('?') {
            Some((path, query)) => {
                let query: Vec<String> = query
                    .split('&')
                    .map(|pair| match pair.split_once('=') {
                        Some((key, _)) if decode(key).as_deref() == Ok("password") => {
                            format!("{key}={HIDDEN}")
                        }
                        _ => pair.to_owned(),
                    })
                    .collect();
                format!("{path}?{}", query.join("&"))
            }
            None => rest.to_owned(),
        };
        return format!("{prefix}{credentials}{rest}");
    }
    match key_values(url) {
        Ok(pairs) => pairs
            .iter()
            .map(|(key, value)| match key.as_str() {
                "password" => format!("{key}={HIDDEN}"),
                _ => format!("{key}={}", quote(value)),
            })
            .collect::<Vec<_>>()
            .join(" "),
        // Unparseable: whatever it holds may be a password.
        Err(_) => format!("<{} characters, not shown>", url.chars().count()),
    }
}

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// A failure retrying cannot fix: the server refused the login or the
    /// database, or the TLS handshake failed (a certificate refused).
    #[error("connecting to postgres at {target}: {why} (not retried)")]
    Refused {
        /// Where (`host:port/dbname`).
        target: String,
        /// The failure in a few words (`authentication failed`).
        why: &'static str,
        /// The error, with the server's message.
        #[source]
        source: tokio_postgres::Error,
    },
    /// PostgreSQL was still unreachable when the connect timeout ran out.
    #[error("connecting to postgres at {target} (gave up after {timeout:?}, {attempts} attempts)")]
    GaveUp {
        /// Where (`host:port/dbname`).
        target: String,
        /// The connect timeout.
        timeout: Duration,
        /// How many attempts failed.
        attempts: u32,
        /// The last attempt's error.
        #[source]
        source: tokio_postgres::Error,
    },
}

impl ConnectError {
    /// True when retrying could not help: configuration, not availability
    /// (the CLI's exit code 2).
    pub fn is_permanent(&self) -> bool {
        matches!(self, ConnectError::Refused { .. })
    }

    /// The last error from tokio-postgres.
    pub fn postgres(&self) -> &tokio_postgres::Error {
        match self {
            ConnectError::Refused { source, .. } | ConnectError::GaveUp { source, .. } => source,
        }
    }
}

/// Whether retrying a failed connection attempt may help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Not up yet, restarting, out of connection slots, a network error.
    Transient,
    /// Why it never will, in a few words.
    Permanent(&'static str),
}

/// Classifies a failed attempt. The server's own errors by SQLSTATE: it is
/// starting, stopping or full (57P03, 57P01, 57P02, 53300, other class 53
/// and 08) is transient, anything else it says is permanent (28000 and
/// 28P01 authentication, 3D000 no such database, 42501 no CONNECT
/// privilege). A certificate rustls refused, or a TLS alert from the
/// server, is permanent; other I/O errors (refused, reset, timed out) and
/// a closed connection are transient; what is left (no TLS on a server
/// asked for it, a bad option) is permanent.
pub(crate) fn classify(error: &tokio_postgres::Error) -> Failure {
    if let Some(db) = error.as_db_error() {
        return classify_code(db.code());
    }
    let mut io = false;
    let mut cause = std::error::Error::source(error);
    while let Some(e) = cause {
        if let Some(e) = e.downcast_ref::<std::io::Error>() {
            io = true;
            if let Some(tls) = e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                return classify_tls(tls);
            }
        }
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return classify_tls(tls);
        }
        cause = e.source();
    }
    if io || error.is_closed() {
        Failure::Transient
    } else {
        Failure::Permanent("refused by the client's TLS or connection settings")
    }
}

fn classify_tls(error: &rustls::Error) -> Failure {
    match error {
        rustls::Error::InvalidCertificate(_) => Failure::Permanent("the server's certificate was refused"),
        rustls::Error::AlertReceived(_) => Failure::Permanent("the server refused the TLS handshake"),
        _ => Failure::Permanent("the TLS handshake failed"),
    }
}

fn classify_code(code: &SqlState) -> Failure {
    let class = &code.code()[..2];
    if *code == SqlState::CANNOT_CONNECT_NOW
        || *code == SqlState::ADMIN_SHUTDOWN
        || *code == SqlState::CRASH_SHUTDOWN
        || class == "53"
        || class == "08"
    {
        Failure::Transient
    } else if class == "28" {
        Failure::Permanent("authentication failed")
    } else if *code == SqlState::INVALID_CATALOG_NAME {
        Failure::Permanent("the database does not exist")
    } else if *code == SqlState::INSUFFICIENT_PRIVILEGE {
        Failure::Permanent("permission denied")
    } else {
        Failure::Permanent("refused by the server")
    }
}

/// The server's words if it answered (`FATAL: database "x" does not exist
/// (SQLSTATE 3D000)`), else the error chain.
pub(crate) fn server_message(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        ),
        None => error_chain(error),
    }
}

/// Startup's retry rules, shared by [`connect`] and the relay's sessions:
/// 100 ms doubling to 2 s, jittered, until the connect timeout; a
/// permanent failure ends it at once.
#[derive(Debug)]
pub(crate) struct Startup {
    target: String,
    timeout: Duration,
    deadline: Instant,
    delay: Duration,
    attempts: u32,
}

impl Startup {
    pub(crate) fn new(config: &PgConfig, timeout: Duration) -> Startup {
        Startup {
            target: config.target(),
            timeout,
            deadline: Instant::now() + timeout,
            delay: Duration::from_millis(100),
            attempts: 0,
        }
    }

    /// Books a failed attempt: how long to wait before the next, or the
    /// error to give up with. Logs each transient failure with the
    /// server's message.
    pub(crate) fn failed(&mut self, error: tokio_postgres::Error) -> Result<Duration, ConnectError> {
        self.attempts += 1;
        if let Failure::Permanent(why) = classify(&error) {
            return Err(ConnectError::Refused {
                target: self.target.clone(),
                why,
                source: error,
            });
        }
        let delay = self.delay.mul_f64(rand::rng().random_range(0.8..1.0));
        if Instant::now() + delay >= self.deadline {
            return Err(ConnectError::GaveUp {
                target: self.target.clone(),
                timeout: self.timeout,
                attempts: self.attempts,
                source: error,
            });
        }
        warn!(
            target_db = %self.target,
            attempt = self.attempts,
            retry_in = ?delay,
            error = %server_message(&error),
            "postgres not reachable yet; retrying"
        );
        outbox::notify::send("OUTBOX_CONNECT=retrying");
        self.delay = (self.delay * 2).min(Duration::from_secs(2));
        Ok(delay)
    }
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
            tracing::warn!(%error, "postgres connection closed");
        }
    });
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(3);

    fn params(url: &str) -> (String, TlsParams) {
        split_tls_params(url).unwrap()
    }

    #[test]
    fn url_tls_params_are_taken_out_and_the_rest_kept() {
        let (rest, ours) = params(
            "postgres://u:p%3Fw@h:5433/db?application_name=a&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca%20x.pem&sslcert=c.pem&sslkey=k.pem&options=-c%20x%3Dy",
        );
        assert_eq!(
            rest,
            "postgres://u:p%3Fw@h:5433/db?application_name=a&options=-c%20x%3Dy"
        );
        assert_eq!(ours.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(ours.sslrootcert.as_deref(), Some("/tmp/ca x.pem"));
        assert_eq!(ours.sslcert.as_deref(), Some("c.pem"));
        assert_eq!(ours.sslkey.as_deref(), Some("k.pem"));

        let (rest, ours) = params("postgresql://h/db?sslmode=require");
        assert_eq!(rest, "postgresql://h/db");
        assert_eq!(ours.sslmode.as_deref(), Some("require"));
        // A `?` in the credentials is not the start of the parameters.
        let (rest, ours) = params("postgres://u:a?b@h/db");
        assert_eq!(rest, "postgres://u:a?b@h/db");
        assert_eq!(ours, TlsParams::default());
    }

    #[test]
    fn key_value_tls_params_are_taken_out_and_the_rest_kept() {
        let (rest, ours) = params(
            "host=h port = 5433 password='it\\'s' sslmode=verify-ca sslrootcert='/a b/ca.pem' dbname=x\\ y",
        );
        assert_eq!(rest, "host='h' port='5433' password='it\\'s' dbname='x y'");
        assert_eq!(ours.sslmode.as_deref(), Some("verify-ca"));
        assert_eq!(ours.sslrootcert.as_deref(), Some("/a b/ca.pem"));
        let config: Config = rest.parse().unwrap();
        assert_eq!(config.get_password(), Some(&b"it's"[..]));
        assert_eq!(config.get_dbname(), Some("x y"));
        assert_eq!(config.get_ports(), [5433]);

        let err = split_tls_params("host='h").unwrap_err();
        assert!(err.contains("unterminated"), "{err}");
    }

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
    fn redact_hides_passwords_in_both_syntaxes() {
        assert_eq!(
            redact("postgres://u:secret@h/db?x=1"),
            "postgres://u:***@h/db?x=1"
        );
        assert_eq!(
            redact("postgres://u@h/db?password=secret"),
            "postgres://u@h/db?password=***"
        );
        assert_eq!(redact("postgres://h1,h2/db"), "postgres://h1,h2/db");
        assert_eq!(redact("host=h password='se cret'"), "host='h' password=***");
        assert!(!redact("host=h password='secret").contains("secret"));
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

    #[test]
    fn server_errors_are_classified_by_sqlstate() {
        for (code, transient) in [
            (SqlState::CANNOT_CONNECT_NOW, true),
            (SqlState::TOO_MANY_CONNECTIONS, true),
            (SqlState::ADMIN_SHUTDOWN, true),
            (SqlState::CONNECTION_FAILURE, true),
            (SqlState::INVALID_PASSWORD, false),
            (SqlState::INVALID_AUTHORIZATION_SPECIFICATION, false),
            (SqlState::INVALID_CATALOG_NAME, false),
            (SqlState::INSUFFICIENT_PRIVILEGE, false),
        ] {
            assert_eq!(
                classify_code(&code) == Failure::Transient,
                transient,
                "{}",
                code.code()
            );
        }
    }

    /// A CA and a leaf certificate for `localhost` it signed, as DER.
    fn chain(ca_name: &str) -> (CertificateDer<'static>, CertificateDer<'static>) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, ca_name);
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&leaf_key, &ca)
            .unwrap();
        (ca.der().clone(), leaf.der().clone())
    }

    #[test]
    fn verify_ca_forgives_the_name_and_nothing_else() {
        let (ca, leaf) = chain("our CA");
        let (other_ca, _) = chain("another CA");
        let verifier = |root: &CertificateDer<'static>| {
            let mut roots = RootCertStore::empty();
            roots.add(root.clone()).unwrap();
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), ring())
                .build()
                .unwrap()
        };
        let check = |v: &dyn ServerCertVerifier, name: &str| {
            v.verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from(name.to_owned()).unwrap(),
                &[],
                UnixTime::now(),
            )
        };
        let full = verifier(&ca);
        let chain_only = ChainOnly(verifier(&ca));
        assert!(check(&*full, "localhost").is_ok());
        assert!(check(&*full, "elsewhere").is_err(), "verify-full checks the name");
        assert!(check(&chain_only, "elsewhere").is_ok(), "verify-ca does not");
        let wrong = ChainOnly(verifier(&other_ca));
        match check(&wrong, "localhost") {
            Err(rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)) => {}
            other => panic!("a foreign CA must be refused: {other:?}"),
        }
    }
}
