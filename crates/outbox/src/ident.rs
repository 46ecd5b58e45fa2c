//! Validated, quoted SQL identifiers.
//!
//! Schema, table and channel names come from flags, environment variables and
//! config files, and end up inside SQL text where bind parameters cannot go.
//! This module is the only way such a name gets there: [`Ident::new`] accepts
//! `[a-z_][a-z0-9_]*` of at most 63 bytes (PostgreSQL's `NAMEDATALEN - 1`) and
//! [`Ident::quoted`] renders it double-quoted. Anything else is a configuration
//! error, so `outbox; drop table x` never reaches the server.

use std::fmt;

use crate::Error;

/// The longest identifier PostgreSQL keeps without truncating it.
const MAX_LEN: usize = 63;

/// A lowercase SQL identifier that is safe to render into a statement.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// Validates `name`; `what` names the flag or setting it came from, for the
    /// error message.
    ///
    /// ```
    /// use outbox::Ident;
    /// assert_eq!(Ident::new("table", "outbox").unwrap().quoted(), "\"outbox\"");
    /// assert!(Ident::new("table", "outbox; drop table x").is_err());
    /// ```
    pub fn new(what: &'static str, name: &str) -> Result<Self, Error> {
        let mut chars = name.chars();
        let valid_start = matches!(chars.next(), Some('a'..='z' | '_'));
        let valid_rest = chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'));
        if !valid_start || !valid_rest || name.len() > MAX_LEN {
            return Err(Error::InvalidIdentifier {
                what,
                name: name.to_owned(),
            });
        }
        Ok(Self(name.to_owned()))
    }

    /// The bare name, as PostgreSQL stores it in the catalogs.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name double-quoted, for SQL text. Validation rules out `"` so no
    /// escaping is needed.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }

    /// A derived identifier such as `outbox_unpublished_idx`, validated like
    /// any other so a long table name cannot produce a truncated index name.
    pub(crate) fn suffixed(&self, what: &'static str, suffix: &str) -> Result<Self, Error> {
        Self::new(what, &format!("{}{suffix}", self.0))
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_names() {
        for name in ["outbox", "_x", "a1_b2", &"a".repeat(63)] {
            assert_eq!(Ident::new("table", name).unwrap().as_str(), name);
        }
    }

    #[test]
    fn refuses_anything_that_needs_escaping() {
        for name in [
            "",
            "Outbox",
            "1abc",
            "outbox; drop table x",
            "out\"box",
            "a-b",
            "a.b",
            &"a".repeat(64),
        ] {
            let err = Ident::new("--table", name).unwrap_err();
            assert!(err.to_string().contains("--table"), "{err}");
        }
    }
}
