//! The claim check of the SQS and SNS sinks (`?claim-check=s3://bucket/prefix`):
//! a message over the queue's or topic's size limit (or over
//! `claim-check-over`) is not refused but stored in S3, and the message
//! carries a pointer to it instead, in the format of AWS's extended client
//! libraries (Java, Python, .NET, JavaScript, for SQS and SNS), so their
//! consumers read it unchanged:
//!
//! - the body is `["software.amazon.payloadoffloading.PayloadS3Pointer",
//!   {"s3BucketName":"<bucket>","s3Key":"<key>"}]`;
//! - a `Number` attribute `ExtendedPayloadSize` holds the stored body's
//!   size in bytes (with `claim-check-legacy=true`, the 1.x Java client's
//!   `SQSLargePayloadSize` and pointer class
//!   `com.amazon.sqs.javamessaging.MessageS3Pointer`).
//!
//! The object holds exactly the body the message would have had (the
//! format's document or payload), with its content type. Its key is
//! `<prefix>/<event_id>/<random uuid>`: an operator finds an event's
//! objects by its id, and a message sent twice (a relay killed between
//! "sent" and "marked") points at two objects, so a consumer that deletes
//! an object with its message (the extended clients do by default) never
//! leaves the other message pointing at nothing. An object whose message
//! was then not sent (the queue refused it, the relay died in between) is
//! left behind: a lifecycle rule on the prefix removes such leftovers.
//!
//! The bucket is reached with the sink's own AWS settings (credentials,
//! region, `?endpoint=`); path-style addressing is used when an endpoint is
//! overridden (an emulator, a VPC endpoint), else virtual-hosted, and
//! `claim-check-path-style=` decides otherwise. A failure to store is
//! classified as a queue's failure is: no answer, throttling, a 5xx,
//! refused credentials or a missing bucket leave the event unsent without
//! spending an attempt (the sink cannot deliver it yet); S3 refusing the
//! object itself is permanent.
//!
//! While stores fail that way, the sink's probe stores an empty object at
//! `<prefix>outbox-probe` too ([`probe`]): a batch
//! of stored messages alone opens the sink's breaker, and a probe that
//! asked only the queue would let the next such batch fail again, until
//! the breaker took those failures for the events' own and spent their
//! attempts. A `PutObject` asks for the permission the stores use, where
//! `HeadBucket` would ask for `s3:ListBucket`. `relay --check` stores it
//! always.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use aws_sdk_s3::Client;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use outbox::OutboxRow;
use tokio::sync::OnceCell;

use super::DeliveryError;
use super::aws::{self, CallError};

/// The size attribute the extended clients of today write and read.
pub const SIZE_ATTRIBUTE: &str = "ExtendedPayloadSize";
/// The size attribute of the 1.x Java extended client, which every later
/// one still reads.
pub const LEGACY_SIZE_ATTRIBUTE: &str = "SQSLargePayloadSize";
/// The pointer class the extended clients of today write.
const POINTER_CLASS: &str = "software.amazon.payloadoffloading.PayloadS3Pointer";
/// The pointer class of the 1.x Java extended client.
const LEGACY_POINTER_CLASS: &str = "com.amazon.sqs.javamessaging.MessageS3Pointer";
/// S3's limit on a key, in bytes.
const MAX_KEY: usize = 1024;
/// What a key adds to the prefix: `<event_id>/<uuid>`.
const KEY_SUFFIX: usize = 36 + 1 + 36;
/// The probe's object, after the prefix: no event id reads so.
const PROBE_KEY: &str = "outbox-probe";

/// The `claim-check…` parameters of an `sqs://` or `sns://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The bucket.
    pub bucket: String,
    /// The key prefix: empty, or ending in `/`.
    pub prefix: String,
    /// `claim-check-over=`: store messages over this many bytes even when
    /// the queue would take them (0: every message); else only those over
    /// the limit.
    pub over: Option<usize>,
    /// `claim-check-legacy=true`: the 1.x Java client's names.
    pub legacy: bool,
    /// `claim-check-path-style=`: else path-style exactly when an
    /// endpoint is overridden.
    pub path_style: Option<bool>,
}

impl Settings {
    /// `s3://bucket[/prefix]` as a bucket and prefix, or why it is not one.
    pub fn location(value: &str) -> Result<Settings, String> {
        let rest = value
            .strip_prefix("s3://")
            .ok_or_else(|| format!("claim-check {value:?} is not an s3://<bucket>[/<prefix>] URL"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if let Some(problem) = bucket_problem(bucket) {
            return Err(format!("claim-check bucket {bucket:?}: {problem}"));
        }
        let prefix = prefix.trim_matches('/');
        let prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        if prefix.len() + KEY_SUFFIX > MAX_KEY {
            return Err(format!(
                "claim-check prefix is {} bytes; with the event id and a uuid a key would pass S3's {MAX_KEY}",
                prefix.len()
            ));
        }
        if prefix.contains("//") || prefix.chars().any(char::is_control) {
            return Err(format!(
                "claim-check prefix {prefix:?}: no empty segments ('//') or control characters"
            ));
        }
        Ok(Settings {
            bucket: bucket.to_owned(),
            prefix,
            over: None,
            legacy: false,
            path_style: None,
        })
    }
}

/// Why S3 would refuse `bucket` as a bucket name, if it would: 3 to 63
/// lowercase letters, digits, `.` and `-`, starting and ending with a
/// letter or digit, no `..`, not an IP address.
fn bucket_problem(bucket: &str) -> Option<&'static str> {
    if !(3..=63).contains(&bucket.len()) {
        Some("a bucket name is 3 to 63 characters")
    } else if !bucket
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '-'))
    {
        Some("only a-z, 0-9, '.' and '-' are allowed")
    } else if !bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        || !bucket.ends_with(|c: char| c.is_ascii_alphanumeric())
    {
        Some("it must start and end with a letter or digit")
    } else if bucket.contains("..") {
        Some("no '..'")
    } else if bucket.parse::<std::net::Ipv4Addr>().is_ok() {
        Some("not an IP address")
    } else {
        None
    }
}

/// Stores bodies in S3 for one sink.
pub struct ClaimCheck {
    settings: Settings,
    aws: aws::Settings,
    timeout: Duration,
    client: OnceCell<Client>,
    /// The length of every pointer (keys differ only in hex digits).
    pointer_bytes: usize,
    /// The last store failed with S3 unavailable, and no probe since
    /// got through.
    failing: AtomicBool,
}

/// A body stored in S3: the pointer that replaces it, and the size
/// attribute to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The message's new body.
    pub pointer: String,
    /// The `Number` attribute's name.
    pub attribute: &'static str,
    /// The stored body's size in bytes, the attribute's value.
    pub bytes: usize,
}

impl ClaimCheck {
    /// A claim check for a sink whose AWS settings are `aws` (which carry
    /// the claim check's own); makes no connection. `None` without one.
    pub fn new(aws: &aws::Settings, timeout: Duration) -> Option<ClaimCheck> {
        let settings = aws.claim_check.clone()?;
        let mut claim_check = ClaimCheck {
            settings,
            aws: aws.clone(),
            timeout,
            client: OnceCell::new(),
            pointer_bytes: 0,
            failing: AtomicBool::new(false),
        };
        let placeholder = uuid::Uuid::nil();
        claim_check.pointer_bytes = claim_check
            .pointer(&claim_check.key(placeholder, placeholder))
            .len();
        Some(claim_check)
    }

    /// The length of the pointer that replaces a stored body.
    pub fn pointer_bytes(&self) -> usize {
        self.pointer_bytes
    }

    fn key(&self, event_id: uuid::Uuid, unique: uuid::Uuid) -> String {
        format!("{}{event_id}/{unique}", self.settings.prefix)
    }

    fn pointer(&self, key: &str) -> String {
        let class = if self.settings.legacy {
            LEGACY_POINTER_CLASS
        } else {
            POINTER_CLASS
        };
        serde_json::json!([class, {"s3BucketName": self.settings.bucket, "s3Key": key}]).to_string()
    }

    /// Messages over this many bytes are stored, given the queue's or
    /// topic's `limit`.
    pub fn threshold(&self, limit: usize) -> usize {
        self.settings.over.map_or(limit, |over| over.min(limit))
    }

    /// The size attribute this claim check writes.
    pub fn size_attribute(&self) -> &'static str {
        if self.settings.legacy {
            LEGACY_SIZE_ATTRIBUTE
        } else {
            SIZE_ATTRIBUTE
        }
    }

    async fn client(&self) -> &Client {
        self.client
            .get_or_init(|| async {
                let config = aws::sdk_config(&self.aws, self.timeout).await;
                let overridden =
                    config.endpoint_url().is_some() || std::env::var_os("AWS_ENDPOINT_URL_S3").is_some();
                let s3 = aws_sdk_s3::config::Builder::from(&config)
                    .force_path_style(self.settings.path_style.unwrap_or(overridden))
                    .build();
                Client::from_conf(s3)
            })
            .await
    }

    /// Stores `body`, the message `row` would have had, and answers the
    /// pointer that replaces it. `service` names the sink in errors.
    pub async fn store(
        &self,
        service: &str,
        row: &OutboxRow,
        body: &str,
        content_type: Option<&str>,
    ) -> Result<Stored, DeliveryError> {
        let key = self.key(row.event_id, uuid::Uuid::new_v4());
        let bucket = &self.settings.bucket;
        let stored = self
            .client()
            .await
            .put_object()
            .bucket(bucket)
            .key(&key)
            .set_content_type(content_type.map(str::to_owned))
            .body(ByteStream::from(body.as_bytes().to_vec()))
            .send()
            .await
            .map_err(|e| store_error(service, &format!("storing the body in s3://{bucket}/{key}"), &e));
        if let Err(e) = &stored {
            if e.is_unavailable() {
                self.failing.store(true, Ordering::Relaxed);
            }
            stored?;
        }
        self.failing.store(false, Ordering::Relaxed);
        Ok(Stored {
            pointer: self.pointer(&key),
            attribute: self.size_attribute(),
            bytes: body.len(),
        })
    }

    /// Stores an empty object at `<prefix>outbox-probe`, as a message's
    /// body is stored; any failure is the sink unavailable, with its cause.
    /// `service` names the sink in errors.
    async fn store_probe(&self, service: &str) -> Result<(), DeliveryError> {
        let bucket = &self.settings.bucket;
        let key = format!("{}{PROBE_KEY}", self.settings.prefix);
        self.client()
            .await
            .put_object()
            .bucket(bucket)
            .key(&key)
            .body(ByteStream::from_static(b""))
            .send()
            .await
            .map_err(|e| {
                let doing = format!("storing the probe object s3://{bucket}/{key}");
                DeliveryError::unavailable(store_error(service, &doing, &e).to_string())
            })?;
        self.failing.store(false, Ordering::Relaxed);
        Ok(())
    }
}

/// The claim check's part of an SQS or SNS sink's probe, if the sink has
/// one (`service` names it in errors): the probe object stored `always`
/// (`relay --check`), else only while stores fail. While S3 takes objects,
/// or before any message needed it, the sink's probe asks the queue alone.
pub async fn probe(
    claim_check: Option<&ClaimCheck>,
    service: &str,
    always: bool,
) -> Result<(), DeliveryError> {
    match claim_check {
        Some(c) if always || c.failing.load(Ordering::Relaxed) => c.store_probe(service).await,
        _ => Ok(()),
    }
}

/// Error codes of S3, answered with a 3xx or 4xx, that mean the bucket
/// cannot take anything yet, whatever the object: it does not exist, is in
/// another region than the sink's (the signature's region is then wrong
/// too), or the account or key is refused.
const BUCKET_UNUSABLE: &[&str] = &[
    "NoSuchBucket",
    "PermanentRedirect",
    "AuthorizationHeaderMalformed",
    "AllAccessDisabled",
    "AccountProblem",
    "InvalidAccessKeyId",
];

/// A failed `PutObject` (`doing`), as a delivery error of the event whose
/// body it was: unavailable unless S3 refused the object itself.
fn store_error<E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static>(
    service: &str,
    doing: &str,
    e: &SdkError<E>,
) -> DeliveryError {
    match aws::call_error(&format!("{service} claim check: {doing}"), e) {
        CallError::Refused(m) | CallError::Retryable(m)
            if e.code().is_some_and(|code| BUCKET_UNUSABLE.contains(&code)) =>
        {
            DeliveryError::unavailable(format!(
                "{m} (the bucket must exist, in the sink's region, and take PutObject from these \
                 credentials; the sink never creates buckets)"
            ))
        }
        call => call.delivery(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_locations() {
        let s = Settings::location("s3://payloads").unwrap();
        assert_eq!((s.bucket.as_str(), s.prefix.as_str()), ("payloads", ""));
        let s = Settings::location("s3://my.payloads-1/outbox/orders/").unwrap();
        assert_eq!(
            (s.bucket.as_str(), s.prefix.as_str()),
            ("my.payloads-1", "outbox/orders/")
        );
        for (value, needle) in [
            ("payloads", "not an s3://"),
            ("http://payloads", "not an s3://"),
            ("s3://", "3 to 63"),
            ("s3://ab", "3 to 63"),
            ("s3://Payloads", "only a-z"),
            ("s3://my_bucket", "only a-z"),
            ("s3://-payloads", "start and end"),
            ("s3://pay..loads", "'..'"),
            ("s3://192.168.1.1", "IP address"),
            ("s3://payloads/a//b", "empty segments"),
        ] {
            let e = Settings::location(value).unwrap_err();
            assert!(e.contains(needle), "{value}: {e}");
        }
        let long = format!("s3://payloads/{}", "p".repeat(MAX_KEY - KEY_SUFFIX));
        assert!(Settings::location(&long).unwrap_err().contains("1024"));
        let longest = format!("s3://payloads/{}", "p".repeat(MAX_KEY - KEY_SUFFIX - 1));
        assert!(Settings::location(&longest).is_ok());
    }

    #[test]
    fn the_threshold_is_the_limit_or_lower() {
        let mut aws = aws::Settings {
            claim_check: Some(Settings::location("s3://payloads").unwrap()),
            ..aws::Settings::default()
        };
        let c = ClaimCheck::new(&aws, Duration::from_secs(1)).unwrap();
        assert_eq!(c.threshold(262_144), 262_144);
        assert_eq!(c.size_attribute(), SIZE_ATTRIBUTE);
        let key = c.key(uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        assert_eq!(c.pointer(&key).len(), c.pointer_bytes());
        assert_eq!(
            c.pointer(&key),
            format!(
                r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{{"s3BucketName":"payloads","s3Key":"{key}"}}]"#
            )
        );
        if let Some(s) = aws.claim_check.as_mut() {
            s.over = Some(0);
            s.legacy = true;
        }
        let c = ClaimCheck::new(&aws, Duration::from_secs(1)).unwrap();
        assert_eq!(c.threshold(262_144), 0);
        assert_eq!(c.size_attribute(), LEGACY_SIZE_ATTRIBUTE);
        assert!(ClaimCheck::new(&aws::Settings::default(), Duration::from_secs(1)).is_none());
    }
}
