//! Amazon SQS sink: one message per event on one queue, standard or FIFO,
//! sent with `SendMessageBatch`.
//!
//! URL forms (every AWS setting may also come from where every AWS tool
//! reads it; see [`super::aws`]):
//!
//! - `sqs://<queue-name>[?region=…&endpoint=…&account=…]`: the queue URL is
//!   looked up with `GetQueueUrl` (in `account`'s queues if given).
//! - `sqs://<host>/<account-id>/<queue-name>[?…]`: the queue URL itself,
//!   `https://<host>/<account-id>/<queue-name>`, as the console shows it;
//!   with a host `sqs.<region>.amazonaws.com` that is also the region.
//!
//! A queue whose name ends in `.fifo` is a FIFO queue: each message's
//! `MessageGroupId` is the event's aggregate id, so SQS keeps an
//! aggregate's events in order and hands them to one consumer at a time,
//! and its `MessageDeduplicationId` is the event_id, so SQS drops a re-send
//! within its five-minute deduplication interval (a relay killed between
//! "sent" and "marked" stores nothing twice).
//!
//! The body and attributes are [`aws::Message`]'s. Before the first batch
//! (and at each probe) the sink reads the queue's `MaximumMessageSize`: a
//! message over it is refused here, permanently, naming the limit, and the
//! relay refuses a payload over it before it gets here; batch calls stay
//! within it too. Unless the URL names a claim check
//! (`?claim-check=s3://…`, see [`super::claim_check`]): then such a
//! message's body goes to S3 and the message carries a pointer to it.
//!
//! SQS answers each entry of a batch call: a sender fault (invalid
//! characters, say) is permanent, anything else retryable. A call that got
//! no answer, was throttled, or met a 5xx, refused credentials or KMS key,
//! or a missing queue makes the sink unavailable (no attempt spent; the
//! breaker probes with `GetQueueAttributes`, and the claim check's bucket
//! while its stores fail). Order per
//! aggregate: see [`super::aws`]'s waves. A standard queue itself promises
//! no order ("best effort"); a FIFO queue does, per group.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry};
use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::OutboxRow;
use tokio::sync::OnceCell;

use super::aws::{self, CallError, Entry, Settings};
use super::claim_check::{self, ClaimCheck};
use super::format::Formatter;
use super::{Delivery, DeliveryError, Sink, SinkError, SinkOptions};

/// The longest queue name SQS accepts, `.fifo` included.
const MAX_QUEUE_NAME: usize = 80;
/// Shown in a too-large message: where the limit comes from.
const LIMIT_SOURCE: &str = "the queue's MaximumMessageSize";

/// Which queue a URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Queue {
    /// A name, looked up with `GetQueueUrl`.
    Name(String),
    /// A queue URL.
    Url {
        /// `https://host/account/name`.
        url: String,
        /// Its last path segment.
        name: String,
    },
}

impl Queue {
    fn name(&self) -> &str {
        match self {
            Self::Name(name) | Self::Url { name, .. } => name,
        }
    }
}

/// The queue once found: its URL and size limit.
#[derive(Debug, Clone)]
struct Resolved {
    url: String,
}

/// Delivers to an SQS queue.
pub struct SqsSink {
    queue: Queue,
    settings: Settings,
    timeout: Duration,
    formatter: Formatter,
    client: OnceCell<Client>,
    resolved: OnceCell<Resolved>,
    /// The queue's `MaximumMessageSize` as last read (0 before).
    max_bytes: AtomicU64,
    /// Where messages over the limit go, if anywhere.
    claim_check: Option<ClaimCheck>,
}

impl SqsSink {
    /// A sink for `url` (see the module documentation); makes no connection.
    pub fn new(url: &str, options: &SinkOptions) -> Result<Self, SinkError> {
        let (queue, settings) = parse(url)?;
        Ok(Self {
            claim_check: ClaimCheck::new(&settings, options.timeout),
            queue,
            settings,
            timeout: options.timeout,
            formatter: options.formatter.clone(),
            client: OnceCell::new(),
            resolved: OnceCell::new(),
            max_bytes: AtomicU64::new(0),
        })
    }

    /// Whether the queue is a FIFO queue.
    pub fn is_fifo(&self) -> bool {
        aws::is_fifo(self.queue.name())
    }

    async fn client(&self) -> Result<&Client, DeliveryError> {
        self.client
            .get_or_try_init(|| async {
                let config = aws::sdk_config(&self.settings, self.timeout).await;
                if let Some(problem) = aws::config_problem(&config, "sqs") {
                    return Err(DeliveryError::unavailable(problem));
                }
                Ok(Client::new(&config))
            })
            .await
    }

    /// The queue's URL, looked up once.
    async fn resolve(&self) -> Result<(&Client, &Resolved), DeliveryError> {
        let client = self.client().await?;
        let resolved = self
            .resolved
            .get_or_try_init(|| async {
                let resolved = match &self.queue {
                    Queue::Url { url, .. } => Resolved { url: url.clone() },
                    Queue::Name(name) => {
                        let answer = client
                            .get_queue_url()
                            .queue_name(name)
                            .set_queue_owner_aws_account_id(self.settings.account.clone())
                            .send()
                            .await
                            .map_err(|e| {
                                aws::unavailable("sqs", &format!("looking up queue {name:?}"), &e)
                            })?;
                        let url = answer.queue_url().ok_or_else(|| {
                            DeliveryError::unavailable(format!(
                                "sqs: GetQueueUrl for {name:?} answered no URL"
                            ))
                        })?;
                        Resolved { url: url.to_owned() }
                    }
                };
                self.read_limit(client, &resolved.url).await?;
                Ok(resolved)
            })
            .await?;
        Ok((client, resolved))
    }

    /// Reads the queue's `MaximumMessageSize`: a round trip, so also the probe.
    async fn read_limit(&self, client: &Client, url: &str) -> Result<(), DeliveryError> {
        let answer = client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::MaximumMessageSize)
            .send()
            .await
            .map_err(|e| aws::unavailable("sqs", &format!("reading the attributes of queue {url}"), &e))?;
        let limit = answer
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::MaximumMessageSize))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(aws::MAX_BATCH_BYTES as u64);
        self.max_bytes.store(limit, Ordering::Relaxed);
        Ok(())
    }

    fn limit(&self) -> usize {
        match self.max_bytes.load(Ordering::Relaxed) {
            0 => aws::MAX_BATCH_BYTES,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        }
    }

    fn entry(
        &self,
        i: usize,
        row: &OutboxRow,
        message: aws::Message,
    ) -> Result<Entry<SendMessageBatchRequestEntry>, DeliveryError> {
        let bytes = message.bytes();
        let (body, attributes) = message.into_parts();
        let mut builder = SendMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .message_body(body);
        for (name, data_type, value) in attributes {
            let value = MessageAttributeValue::builder()
                .data_type(data_type)
                .string_value(value)
                .build()
                .map_err(|e| DeliveryError::permanent(format!("sqs: attribute {name:?}: {e}")))?;
            builder = builder.message_attributes(name, value);
        }
        if self.is_fifo() {
            let (group, dedup) = aws::fifo_ids("sqs", row)?;
            builder = builder.message_group_id(group).message_deduplication_id(dedup);
        }
        let item = builder
            .build()
            .map_err(|e| DeliveryError::permanent(format!("sqs: {e}")))?;
        Ok(Entry { row: i, bytes, item })
    }

    async fn send(
        &self,
        client: &Client,
        url: &str,
        entries: Vec<SendMessageBatchRequestEntry>,
    ) -> Result<Vec<Delivery>, CallError> {
        let ids: Vec<String> = entries.iter().map(|e| e.id().to_owned()).collect();
        let answer = client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| aws::call_error("sqs", &e))?;
        Ok(aws::answers(
            "sqs",
            "SendMessageBatch",
            &ids,
            |id| answer.successful().iter().any(|s| s.id() == id),
            |id| {
                let f = answer.failed().iter().find(|f| f.id() == id)?;
                Some((f.code(), f.sender_fault(), f.message()))
            },
        ))
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        let (client, resolved) = match self.resolve().await {
            Ok(r) => r,
            Err(e) => return batch.iter().map(|_| Err(e.clone())).collect(),
        };
        // Read once: a probe may change it while the batch is built, and
        // the messages and the calls must be held to the same limit.
        let limit = self.limit();
        let messages = aws::messages(
            "sqs",
            &self.formatter,
            batch,
            (limit, LIMIT_SOURCE),
            self.claim_check.as_ref(),
        )
        .await;
        let prepared = batch
            .iter()
            .zip(messages)
            .enumerate()
            .map(|(i, (row, message))| self.entry(i, row, message?))
            .collect();
        let url = resolved.url.as_str();
        aws::deliver(batch, prepared, limit, |entries| self.send(client, url, entries)).await
    }
}

/// The queue and settings an `sqs://` URL names.
fn parse(url: &str) -> Result<(Queue, Settings), SinkError> {
    let (target, mut settings) = aws::split_url(url, "sqs")?;
    let invalid = |reason: String| SinkError::InvalidUrl {
        url: url.to_owned(),
        reason,
    };
    let target = target.strip_suffix('/').unwrap_or(&target);
    let parts: Vec<&str> = target.split('/').collect();
    let queue = match parts.as_slice() {
        [""] => {
            return Err(invalid(
                "no queue: expected sqs://<queue-name> or sqs://<host>/<account-id>/<queue-name>".to_owned(),
            ));
        }
        [name] => Queue::Name((*name).to_owned()),
        [host, account, name] => {
            if host.is_empty() || host.contains(['@', ' ']) {
                return Err(invalid(format!("{host:?} is not a host")));
            }
            if account.len() != 12 || !account.chars().all(|c| c.is_ascii_digit()) {
                return Err(invalid(format!("{account:?} is not a 12-digit AWS account id")));
            }
            if settings.account.is_some() {
                return Err(invalid(
                    "?account= is for a queue given by name; this URL names the account already".to_owned(),
                ));
            }
            // sqs.<region>.amazonaws.com[.cn] names the region.
            if settings.region.is_none()
                && let Some(region) = host
                    .strip_prefix("sqs.")
                    .and_then(|rest| rest.split_once(".amazonaws.com"))
                    .map(|(region, _)| region)
                    .filter(|r| !r.is_empty() && !r.contains('.'))
            {
                settings.region = Some(region.to_owned());
            }
            Queue::Url {
                url: format!("https://{host}/{account}/{name}"),
                name: (*name).to_owned(),
            }
        }
        _ => {
            return Err(invalid(
                "expected sqs://<queue-name> or sqs://<host>/<account-id>/<queue-name>".to_owned(),
            ));
        }
    };
    if let Some(problem) = aws::name_problem(queue.name(), MAX_QUEUE_NAME) {
        return Err(invalid(format!("queue name {:?}: {problem}", queue.name())));
    }
    Ok((queue, settings))
}

impl Sink for SqsSink {
    fn name(&self) -> &'static str {
        "sqs"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            let (client, resolved) = self.resolve().await?;
            self.read_limit(client, &resolved.url).await?;
            claim_check::probe(self.claim_check.as_ref(), "sqs", false).await
        }
        .boxed()
    }

    fn check(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            self.probe().await?;
            claim_check::probe(self.claim_check.as_ref(), "sqs", true).await
        }
        .boxed()
    }

    fn max_event_bytes(&self) -> Option<u64> {
        // With a claim check, a payload of any size has somewhere to go.
        if self.claim_check.is_some() {
            return None;
        }
        Some(self.max_bytes.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let (q, s) = parse("sqs://orders?region=eu-west-1&endpoint=http://127.0.0.1:5000").unwrap();
        assert_eq!(q, Queue::Name("orders".into()));
        assert_eq!(s.region.as_deref(), Some("eu-west-1"));
        let (q, s) = parse("sqs://sqs.us-east-2.amazonaws.com/123456789012/Orders.fifo").unwrap();
        assert_eq!(
            q,
            Queue::Url {
                url: "https://sqs.us-east-2.amazonaws.com/123456789012/Orders.fifo".into(),
                name: "Orders.fifo".into()
            }
        );
        assert_eq!(s.region.as_deref(), Some("us-east-2"), "the region from the host");
        let (_, s) = parse("sqs://sqs.us-east-2.amazonaws.com/123456789012/q?region=eu-west-1").unwrap();
        assert_eq!(s.region.as_deref(), Some("eu-west-1"), "?region= wins");
        let (_, s) = parse("sqs://vpce-1.sqs.eu-west-1.vpce.amazonaws.com/123456789012/q").unwrap();
        assert_eq!(s.region, None, "not a regional host: the default chain's region");
    }

    #[test]
    fn refuses_bad_urls() {
        for (url, needle) in [
            ("sqs://", "no queue"),
            ("sqs://a/b", "expected sqs://<queue-name>"),
            ("sqs://my queue", "' ' is not allowed"),
            ("sqs://orders.txt", "'.' is not allowed"),
            ("sqs://h/12/q", "12-digit"),
            ("sqs://h/123456789012/q?account=123456789012", "names the account"),
            ("sqs://q?endpoint=nope", "not a URL"),
            ("sqs://q?visibility=1", "unknown parameter"),
        ] {
            let e = parse(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
        assert!(
            SqsSink::new("sqs://orders.fifo", &SinkOptions::default())
                .unwrap()
                .is_fifo()
        );
        assert!(
            !SqsSink::new("sqs://orders", &SinkOptions::default())
                .unwrap()
                .is_fifo()
        );
    }
}
