//! What is printed, logged and stored in place of a secret in a URL: the
//! one masking function for sink URLs (`outbox config show`, `replay
//! --list` and the replay job's stored target, sink errors) and for
//! `DATABASE_URL` (through [`crate::pg::redact`], which adds libpq's
//! `key=value` syntax).
//!
//! A URL's password and **every** query value become `***`: a webhook's
//! `?token=`, `?sig=`, `?api_key=` or `?code=` cannot all be named in a
//! list, so none is trusted ([`url`]). Only a caller that knows every
//! parameter its URLs may hold keeps the harmless ones visible
//! ([`url_keeping`]: libpq's connection settings such as `sslmode`). The
//! text is masked where it stands, not parsed and printed again, so what is
//! shown is what was written, secrets aside, and a URL no parser accepts
//! (`kafka://a:9092,b:9092?…`) is masked the same way.

/// What stands in for a secret.
pub const HIDDEN: &str = "***";

/// `value` with the password of its user information and every query
/// value (and any fragment) replaced by `***`; a value that is not a URL
/// but may hold a secret (an `@`, a `=`) is not shown at all.
///
/// ```
/// use outbox_relay::redact;
///
/// assert_eq!(
///     redact::url("https://user:pw@example.com/hook?token=abc&region=eu"),
///     "https://user:***@example.com/hook?token=***&region=***"
/// );
/// assert_eq!(redact::url("redis://127.0.0.1:6379/0"), "redis://127.0.0.1:6379/0");
/// ```
pub fn url(value: &str) -> String {
    url_keeping(value, &[])
}

/// Like [`url`], but the values of the query parameters named in `keep`
/// stay visible.
pub fn url_keeping(value: &str, keep: &[&str]) -> String {
    let Some(scheme_end) = value.find("://") else {
        return unparsed(value);
    };
    let (scheme, rest) = value.split_at(scheme_end + 3);
    // The user information ends at the last `@` before the query, not at
    // the first `/` or `#`: a password with an unencoded `/` (base64) or
    // `#` is still hidden, at the cost of hiding more of a path that holds
    // an `@`.
    let query_at = rest.find('?').unwrap_or(rest.len());
    let (userinfo, rest) = match rest[..query_at].rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    // A fragment may hold anything.
    let (rest, fragment) = match rest.split_once('#') {
        Some((rest, "")) => (rest, Some("")),
        Some((rest, _)) => (rest, Some(HIDDEN)),
        None => (rest, None),
    };
    let mut out = String::with_capacity(value.len());
    out.push_str(scheme);
    if let Some(userinfo) = userinfo {
        match userinfo.split_once(':') {
            Some((user, _)) => {
                out.push_str(user);
                out.push(':');
                out.push_str(HIDDEN);
            }
            None => out.push_str(userinfo),
        }
        out.push('@');
    }
    match rest.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            out.push_str(&masked_query(query, keep));
        }
        None => out.push_str(rest),
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

/// A query string with every value but those of `keep` hidden; an empty
/// value hides nothing and stays empty.
fn masked_query(query: &str, keep: &[&str]) -> String {
    query
        .split('&')
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or(("", pair));
            let name = percent_encoding::percent_decode_str(key).decode_utf8_lossy();
            if value.is_empty() || keep.contains(&&*name) {
                pair.to_owned()
            } else if pair.contains('=') {
                format!("{key}={HIDDEN}")
            } else {
                // `?abc123`: a value without a name.
                HIDDEN.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// A value that is not a URL: shown unless it may hold a secret.
fn unparsed(value: &str) -> String {
    if value.contains(['@', '=']) {
        format!("<{} characters, not shown>", value.chars().count())
    } else {
        value.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 35: none of these values may show, whatever its name.
    #[test]
    fn every_query_value_is_hidden() {
        let names = [
            "token",
            "access_token",
            "api_key",
            "apikey",
            "key",
            "sig",
            "auth",
            "secret",
            "password",
            "foo",
        ];
        let query: Vec<String> = names.iter().map(|n| format!("{n}=v4lue-{n}")).collect();
        let shown = url(&format!("https://example.com/hook?{}", query.join("&")));
        assert!(!shown.contains("v4lue"), "{shown}");
        let expected: Vec<String> = names.iter().map(|n| format!("{n}=***")).collect();
        assert_eq!(shown, format!("https://example.com/hook?{}", expected.join("&")));
    }

    #[test]
    fn passwords_fragments_and_odd_urls() {
        assert_eq!(
            url("amqp://user:pw@rabbit:5672/%2f"),
            "amqp://user:***@rabbit:5672/%2f"
        );
        assert_eq!(url("redis://u@h:6379/0?x="), "redis://u@h:6379/0?x=");
        // An unencoded `/` or `@` in the password.
        assert_eq!(url("https://u:a/b@c#d@h/x"), "https://u:***@h/x");
        assert_eq!(url("https://h/x?s3cret#frag"), "https://h/x?***#***");
        assert_eq!(
            url("kafka://a:9092,b:9092?sasl_password=p&linger=5"),
            "kafka://a:9092,b:9092?sasl_password=***&linger=***"
        );
        assert_eq!(url("https://h/x?%74oken=1"), "https://h/x?%74oken=***");
        assert_eq!(url("not a url"), "not a url");
        assert_eq!(url("user:pw@host"), "<12 characters, not shown>");
        assert_eq!(
            url_keeping("postgres://u:p@h/db?sslmode=require&password=p", &["sslmode"]),
            "postgres://u:***@h/db?sslmode=require&password=***"
        );
    }
}
