//! The rustls `ClientConfig` each `sslmode` gets (the table in the
//! [parent module's docs](super)): the roots, the client certificate, and
//! the two verifiers libpq's weaker modes need (`verify-ca`'s chain
//! without the name, `prefer`/`require`'s nothing). Not the parsing of the
//! parameters (`params`) nor connecting.
//!
//! The roots `verify-*` trust: the PEM file `sslrootcert` names; the
//! system's (`rustls-native-certs`, which honours `SSL_CERT_FILE` and
//! `SSL_CERT_DIR`) with `sslrootcert=system`, which like libpq ≥ 16 makes
//! `verify-full` the default and refuses weaker modes; without
//! `sslrootcert`, libpq's `~/.postgresql/root.crt` if it exists, else the
//! system's (libpq would fail there instead). `sslcert` and `sslkey` (PEM;
//! PKCS#8, PKCS#1 or SEC1 keys) name a client certificate, both or neither;
//! unlike libpq, `~/.postgresql/postgresql.crt` is not picked up unasked.
//!
//! The TLS glue is `tokio-postgres-rustls`: the integration maintained
//! alongside tokio-postgres's own releases (0.14, 2026), on the rustls 0.23
//! and ring the workspace already builds for its sinks, and it computes the
//! `tls-server-end-point` channel binding from the certificate's signature
//! hash, so `scram-sha-256` servers that offer `SCRAM-SHA-256-PLUS` work (the
//! forks `tokio-postgres-rustls-improved` and `postgres_rustls` exist for
//! bugs since fixed upstream, or need a newer compiler).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ClientConfig;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::params::redact;
use super::{Roots, SslMode, UrlError};

/// libpq's default root file, if it exists.
pub(super) fn default_root_file() -> Option<PathBuf> {
    let file = PathBuf::from(std::env::var_os("HOME")?).join(".postgresql/root.crt");
    file.is_file().then_some(file)
}

/// What the TLS parameters mean.
#[derive(Debug)]
pub(super) struct TlsSettings {
    pub(super) mode: SslMode,
    pub(super) roots: Roots,
    /// Certificate and key files.
    pub(super) client: Option<(PathBuf, PathBuf)>,
}

/// A file that could not be used, before the URL is attached.
pub(super) struct FileError {
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

    pub(super) fn into_url_error(self, url: &str) -> UrlError {
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
    pub(super) fn client_config(&self) -> Result<ClientConfig, FileError> {
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

pub(super) fn ring() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The config of a connection whose certificate is not checked.
pub(super) fn unchecked_config(provider: Arc<CryptoProvider>) -> ClientConfig {
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

#[cfg(test)]
mod tests {
    use super::*;

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
