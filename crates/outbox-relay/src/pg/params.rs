//! libpq's TLS parameters (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`)
//! taken out of a `postgres://` URL or a `key=value` string, before
//! tokio-postgres (which rejects most of them) sees the rest; what they
//! mean together ([`TlsParams::settings`]); and the URL with its passwords
//! hidden, for messages (URLs through [`crate::redact`]). Owns the grammar, not the files: reading
//! certificates is `tls`'s. The invariant: the rest reaches tokio-postgres
//! with every other parameter unchanged.

use std::path::PathBuf;

use super::tls::{TlsSettings, default_root_file};
use super::{Roots, SslMode};

/// The TLS parameters as written, taken out of the URL.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct TlsParams {
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
    pub(super) fn settings(&self) -> Result<TlsSettings, (&'static str, String)> {
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

/// Splits the TLS parameters off `url`: the rest, for tokio-postgres, and
/// ours. Mirrors tokio-postgres's grammar: a URL's parameters start at the
/// first `?` after the credentials and are percent-encoded; a `key=value`
/// string's values may be single-quoted, with `\` escaping.
pub(super) fn split_tls_params(url: &str) -> Result<(String, TlsParams), String> {
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

/// libpq's connection parameters that hold no secret, whose values
/// [`redact`] keeps visible in a URL; any other parameter's value
/// (`password`, `sslpassword`, one libpq does not know) is hidden.
const SETTINGS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "requirepeer",
    "require_auth",
    "channel_binding",
    "krbsrvname",
    "gsslib",
    "target_session_attrs",
    "load_balance_hosts",
];

/// A `DATABASE_URL` (URL or `key=value` string) without its passwords, for
/// messages and `outbox config show`: a URL through the one URL masking
/// ([`crate::redact::url_keeping`]) with libpq's harmless settings kept,
/// a `key=value` string with `password` and `sslpassword` hidden.
pub fn redact(url: &str) -> String {
    use crate::redact::HIDDEN;
    if ["postgres://", "postgresql://"]
        .iter()
        .any(|prefix| url.starts_with(prefix))
    {
        return crate::redact::url_keeping(url, SETTINGS);
    }
    match key_values(url) {
        Ok(pairs) => pairs
            .iter()
            .map(|(key, value)| {
                if SETTINGS.contains(&key.as_str()) {
                    format!("{key}={}", quote(value))
                } else {
                    format!("{key}={HIDDEN}")
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
        // Unparseable: whatever it holds may be a password.
        Err(_) => format!("<{} characters, not shown>", url.chars().count()),
    }
}

#[cfg(test)]
mod tests {
    use tokio_postgres::Config;

    use super::*;

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
    fn redact_hides_passwords_in_both_syntaxes() {
        assert_eq!(
            redact("postgres://u:secret@h/db?sslmode=require&sslpassword=s&x=1"),
            "postgres://u:***@h/db?sslmode=require&sslpassword=***&x=***"
        );
        assert_eq!(
            redact("postgres://u@h/db?password=secret"),
            "postgres://u@h/db?password=***"
        );
        assert_eq!(redact("postgres://h1,h2/db"), "postgres://h1,h2/db");
        assert_eq!(redact("host=h password='se cret'"), "host='h' password=***");
        assert_eq!(redact("host=h sslpassword=k"), "host='h' sslpassword=***");
        assert!(!redact("host=h password='secret").contains("secret"));
    }
}
