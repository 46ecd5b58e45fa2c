//! Standard Webhooks signatures (<https://www.standardwebhooks.com>): the
//! relay's HTTP sink signs with them when given a secret, and receivers
//! verify with [`verify`] (or any Standard Webhooks library).
//!
//! Three headers travel with each request: `webhook-id` (the event_id, the
//! same on every retry, so receivers deduplicate on it), `webhook-timestamp`
//! (Unix seconds of this attempt) and `webhook-signature`
//! (`v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, several separated by
//! spaces while a secret is rotated). The timestamp is signed, so a receiver
//! rejects replays older than its tolerance.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header names, lowercase as the specification writes them.
pub const ID_HEADER: &str = "webhook-id";
/// See [`ID_HEADER`].
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
/// See [`ID_HEADER`].
pub const SIGNATURE_HEADER: &str = "webhook-signature";

/// Why a secret or a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookError {
    /// The secret is not base64 (optionally prefixed `whsec_`) or is empty.
    #[error("invalid webhook secret: {0}")]
    InvalidSecret(String),
    /// `webhook-timestamp` is not a whole number of seconds.
    #[error("invalid webhook-timestamp {0:?}")]
    InvalidTimestamp(String),
    /// The timestamp is further from now than the tolerance allows.
    #[error("webhook-timestamp {timestamp} is more than {tolerance:?} away from now ({now})")]
    OutsideTolerance {
        /// The request's timestamp.
        timestamp: i64,
        /// The verifier's clock.
        now: i64,
        /// The allowed distance.
        tolerance: Duration,
    },
    /// No `v1` signature in the header matches.
    #[error("no matching webhook signature")]
    NoMatch,
}

/// A signing key: the bytes behind a `whsec_…` secret.
#[derive(Clone)]
pub struct WebhookSecret {
    key: Vec<u8>,
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(…)")
    }
}

impl WebhookSecret {
    /// Parses `whsec_<base64>` (the prefix is optional, as in the reference
    /// libraries).
    pub fn parse(secret: &str) -> Result<Self, WebhookError> {
        let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
        let key = STANDARD
            .decode(encoded)
            .map_err(|e| WebhookError::InvalidSecret(format!("expected whsec_<base64>: {e}")))?;
        if key.is_empty() {
            return Err(WebhookError::InvalidSecret("empty".to_owned()));
        }
        Ok(Self { key })
    }

    /// The `webhook-signature` value for one request.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        format!(
            "v1,{}",
            STANDARD.encode(self.mac(id, timestamp, body).finalize().into_bytes())
        )
    }

    fn mac(&self, id: &str, timestamp: i64, body: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes keys of any length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }
}

/// Checks a request's headers and raw body: the timestamp within
/// `tolerance` of `now` (Unix seconds) and one `v1` signature made with
/// `secret`. Compares in constant time.
pub fn verify(
    secret: &WebhookSecret,
    id: &str,
    timestamp: &str,
    signatures: &str,
    body: &[u8],
    now: i64,
    tolerance: Duration,
) -> Result<(), WebhookError> {
    let ts: i64 = timestamp
        .trim()
        .parse()
        .map_err(|_| WebhookError::InvalidTimestamp(timestamp.to_owned()))?;
    if ts.abs_diff(now) > tolerance.as_secs() {
        return Err(WebhookError::OutsideTolerance {
            timestamp: ts,
            now,
            tolerance,
        });
    }
    let matches = signatures
        .split_whitespace()
        .filter_map(|s| s.strip_prefix("v1,"))
        .filter_map(|b64| STANDARD.decode(b64).ok())
        .any(|sig| secret.mac(id, ts, body).verify_slice(&sig).is_ok());
    if matches {
        Ok(())
    } else {
        Err(WebhookError::NoMatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The Standard Webhooks specification's published test vector.
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: i64 = 1_614_265_330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    const MINUTES: Duration = Duration::from_secs(300);

    #[test]
    fn signs_the_specification_test_vector() {
        let secret = WebhookSecret::parse(SECRET).unwrap();
        assert_eq!(secret.sign(ID, TS, BODY), SIGNATURE);
        let unprefixed = WebhookSecret::parse(SECRET.trim_start_matches("whsec_")).unwrap();
        assert_eq!(unprefixed.sign(ID, TS, BODY), SIGNATURE);
    }

    #[test]
    fn verifies_the_vector_and_refuses_tampering() {
        let secret = WebhookSecret::parse(SECRET).unwrap();
        let ts = TS.to_string();
        assert_eq!(
            verify(&secret, ID, &ts, SIGNATURE, BODY, TS + 10, MINUTES),
            Ok(())
        );
        // Several signatures during a rotation: one match is enough.
        let rotated = format!("v1,bm9wZQ== {SIGNATURE}");
        assert_eq!(verify(&secret, ID, &ts, &rotated, BODY, TS, MINUTES), Ok(()));
        assert_eq!(
            verify(
                &secret,
                ID,
                &ts,
                SIGNATURE,
                br#"{"test": 2432232315}"#,
                TS,
                MINUTES
            ),
            Err(WebhookError::NoMatch)
        );
        assert_eq!(
            verify(&secret, "msg_other", &ts, SIGNATURE, BODY, TS, MINUTES),
            Err(WebhookError::NoMatch)
        );
        assert!(matches!(
            verify(&secret, ID, &ts, SIGNATURE, BODY, TS + 301, MINUTES),
            Err(WebhookError::OutsideTolerance { .. })
        ));
        assert!(matches!(
            verify(&secret, ID, "soon", SIGNATURE, BODY, TS, MINUTES),
            Err(WebhookError::InvalidTimestamp(_))
        ));
    }

    #[test]
    fn refuses_bad_secrets() {
        assert!(WebhookSecret::parse("whsec_not base64!").is_err());
        assert!(WebhookSecret::parse("whsec_").is_err());
    }
}
