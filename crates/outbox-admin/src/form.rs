//! `application/x-www-form-urlencoded` bodies and query strings with
//! repeated keys (`id=1&id=2`, what checkboxes send), which serde's flat
//! structs cannot hold.

/// Every key/value pair, in order.
#[derive(Debug, Default)]
pub(crate) struct Params(Vec<(String, String)>);

impl Params {
    pub(crate) fn parse(raw: &[u8]) -> Params {
        Params(url::form_urlencoded::parse(raw).into_owned().collect())
    }

    /// Pairs built by the server (the JSON API's bodies), read as a form.
    pub(crate) fn from_pairs(pairs: Vec<(String, String)>) -> Params {
        Params(pairs)
    }

    pub(crate) fn query(raw: Option<&str>) -> Params {
        Params::parse(raw.unwrap_or("").as_bytes())
    }

    /// The first value of `key`, None if absent or blank.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// Every non-blank value of `key`.
    pub(crate) fn all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == key)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::Params;

    #[test]
    fn repeated_keys_and_blanks() {
        let p = Params::parse(b"id=1&id=2&id=&error=a+%3Cb%3E&empty=");
        assert_eq!(p.all("id").collect::<Vec<_>>(), ["1", "2"]);
        assert_eq!(p.get("error"), Some("a <b>"));
        assert_eq!(p.get("empty"), None);
        assert_eq!(p.get("missing"), None);
    }
}
