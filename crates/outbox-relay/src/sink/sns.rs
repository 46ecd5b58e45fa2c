//! Amazon SNS sink: one message per event on one topic, standard or FIFO,
//! published with `PublishBatch`; SNS fans it out to the topic's
//! subscriptions (SQS queues, Lambda, HTTP, …).
//!
//! URL forms (every AWS setting may also come from where every AWS tool
//! reads it; see [`super::aws`]):
//!
//! - `sns://arn:aws:sns:<region>:<account-id>:<topic-name>[?endpoint=…]`:
//!   the topic's ARN, which names its region.
//! - `sns://<topic-name>[?region=…&endpoint=…&account=…]`: with `account`,
//!   the ARN is made from the region and account; without, it is found
//!   with `ListTopics` (which needs `sns:ListTopics`).
//!
//! A topic whose name ends in `.fifo` is a FIFO topic: `MessageGroupId` is
//! the event's aggregate id and `MessageDeduplicationId` the event_id, as
//! on a FIFO queue (SNS drops a re-send within five minutes, and delivers
//! a group in order to FIFO queues).
//!
//! Body and attributes are [`aws::Message`]'s, the same as SQS's: a queue
//! subscribed with raw message delivery receives them as they are; without
//! it, SNS wraps them in its JSON envelope (`Message`, `MessageAttributes`).
//! A message over SNS's 256 KiB (body and attributes) is refused here,
//! permanently, naming the limit, unless the URL names a claim check
//! (`?claim-check=s3://…`, see [`super::claim_check`]): then its body goes
//! to S3 and the message carries a pointer to it. Failures are classified
//! as for SQS: a sender fault of an entry is permanent, any other entry
//! failure retryable; no answer, throttling, a 5xx, refused credentials or
//! KMS key, or a missing topic make the sink unavailable (the breaker
//! probes with `GetTopicAttributes`, and the claim check's bucket while its
//! stores fail). The waves of [`super::aws`] keep per-aggregate
//! order; a standard topic itself promises none.

use std::time::Duration;

use aws_sdk_sns::Client;
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::OutboxRow;
use tokio::sync::OnceCell;

use super::aws::{self, CallError, Entry, Settings};
use super::claim_check::{self, ClaimCheck};
use super::format::Formatter;
use super::{Delivery, DeliveryError, Sink, SinkError, SinkOptions};

/// The longest topic name SNS accepts, `.fifo` included.
const MAX_TOPIC_NAME: usize = 256;
/// SNS's limit on a message, body and attributes, and on a whole batch.
pub const MAX_MESSAGE_BYTES: usize = aws::MAX_BATCH_BYTES;

/// Which topic a URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Topic {
    /// An ARN.
    Arn {
        /// `arn:<partition>:sns:<region>:<account>:<name>`.
        arn: String,
        /// Its name.
        name: String,
    },
    /// A name, its ARN found from the account or with `ListTopics`.
    Name(String),
}

impl Topic {
    fn name(&self) -> &str {
        match self {
            Self::Arn { name, .. } | Self::Name(name) => name,
        }
    }
}

/// Delivers to an SNS topic.
pub struct SnsSink {
    topic: Topic,
    settings: Settings,
    timeout: Duration,
    formatter: Formatter,
    client: OnceCell<Client>,
    arn: OnceCell<String>,
    /// Where messages over the limit go, if anywhere.
    claim_check: Option<ClaimCheck>,
}

impl SnsSink {
    /// A sink for `url` (see the module documentation); makes no connection.
    pub fn new(url: &str, options: &SinkOptions) -> Result<Self, SinkError> {
        let (topic, settings) = parse(url)?;
        Ok(Self {
            claim_check: ClaimCheck::new(&settings, options.timeout),
            topic,
            settings,
            timeout: options.timeout,
            formatter: options.formatter.clone(),
            client: OnceCell::new(),
            arn: OnceCell::new(),
        })
    }

    /// Whether the topic is a FIFO topic.
    pub fn is_fifo(&self) -> bool {
        aws::is_fifo(self.topic.name())
    }

    async fn client(&self) -> Result<&Client, DeliveryError> {
        self.client
            .get_or_try_init(|| async {
                let config = aws::sdk_config(&self.settings, self.timeout).await;
                if let Some(problem) = aws::config_problem(&config, "sns") {
                    return Err(DeliveryError::unavailable(problem));
                }
                Ok(Client::new(&config))
            })
            .await
    }

    /// The topic's ARN, found once.
    async fn resolve(&self) -> Result<(&Client, &str), DeliveryError> {
        let client = self.client().await?;
        let arn = self
            .arn
            .get_or_try_init(|| async {
                match &self.topic {
                    Topic::Arn { arn, .. } => Ok(arn.clone()),
                    Topic::Name(name) => match &self.settings.account {
                        Some(account) => {
                            let region = client
                                .config()
                                .region()
                                .map(ToString::to_string)
                                .unwrap_or_default();
                            Ok(format!(
                                "arn:{}:sns:{region}:{account}:{name}",
                                partition(&region)
                            ))
                        }
                        None => self.find(client, name).await,
                    },
                }
            })
            .await?;
        Ok((client, arn.as_str()))
    }

    /// The ARN of topic `name`, from `ListTopics`.
    async fn find(&self, client: &Client, name: &str) -> Result<String, DeliveryError> {
        let suffix = format!(":{name}");
        let mut token: Option<String> = None;
        loop {
            let page = client
                .list_topics()
                .set_next_token(token.take())
                .send()
                .await
                .map_err(|e| aws::unavailable("sns", "listing topics", &e))?;
            if let Some(arn) = page
                .topics()
                .iter()
                .filter_map(|t| t.topic_arn())
                .find(|arn| arn.ends_with(&suffix))
            {
                return Ok(arn.to_owned());
            }
            match page.next_token() {
                Some(next) => token = Some(next.to_owned()),
                None => {
                    return Err(DeliveryError::unavailable(format!(
                        "sns: no topic named {name:?} in this account and region (create it, or fix the sink URL; \
                         the sink never creates topics)"
                    )));
                }
            }
        }
    }

    fn entry(
        &self,
        i: usize,
        row: &OutboxRow,
        message: aws::Message,
    ) -> Result<Entry<PublishBatchRequestEntry>, DeliveryError> {
        let bytes = message.bytes();
        let (body, attributes) = message.into_parts();
        let mut builder = PublishBatchRequestEntry::builder()
            .id(i.to_string())
            .message(body);
        for (name, data_type, value) in attributes {
            let value = MessageAttributeValue::builder()
                .data_type(data_type)
                .string_value(value)
                .build()
                .map_err(|e| DeliveryError::permanent(format!("sns: attribute {name:?}: {e}")))?;
            builder = builder.message_attributes(name, value);
        }
        if self.is_fifo() {
            let (group, dedup) = aws::fifo_ids("sns", row)?;
            builder = builder.message_group_id(group).message_deduplication_id(dedup);
        }
        let item = builder
            .build()
            .map_err(|e| DeliveryError::permanent(format!("sns: {e}")))?;
        Ok(Entry { row: i, bytes, item })
    }

    async fn send(
        &self,
        client: &Client,
        arn: &str,
        entries: Vec<PublishBatchRequestEntry>,
    ) -> Result<Vec<Delivery>, CallError> {
        let ids: Vec<String> = entries.iter().map(|e| e.id().to_owned()).collect();
        let answer = client
            .publish_batch()
            .topic_arn(arn)
            .set_publish_batch_request_entries(Some(entries))
            .send()
            .await
            .map_err(|e| aws::call_error("sns", &e))?;
        Ok(aws::answers(
            "sns",
            "PublishBatch",
            &ids,
            |id| answer.successful().iter().any(|s| s.id() == Some(id)),
            |id| {
                let f = answer.failed().iter().find(|f| f.id() == id)?;
                Some((f.code(), f.sender_fault(), f.message()))
            },
        ))
    }

    async fn deliver_batch(&self, batch: &[OutboxRow]) -> Vec<Delivery> {
        let (client, arn) = match self.resolve().await {
            Ok(r) => r,
            Err(e) => return batch.iter().map(|_| Err(e.clone())).collect(),
        };
        let limit = (MAX_MESSAGE_BYTES, "SNS's message size limit");
        let messages = aws::messages("sns", &self.formatter, batch, limit, self.claim_check.as_ref()).await;
        let prepared = batch
            .iter()
            .zip(messages)
            .enumerate()
            .map(|(i, (row, message))| self.entry(i, row, message?))
            .collect();
        aws::deliver(batch, prepared, MAX_MESSAGE_BYTES, |entries| {
            self.send(client, arn, entries)
        })
        .await
    }
}

/// The ARN partition of a region.
fn partition(region: &str) -> &'static str {
    if region.starts_with("cn-") {
        "aws-cn"
    } else if region.starts_with("us-gov-") {
        "aws-us-gov"
    } else {
        "aws"
    }
}

/// The topic and settings an `sns://` URL names.
fn parse(url: &str) -> Result<(Topic, Settings), SinkError> {
    let (target, mut settings) = aws::split_url(url, "sns")?;
    let invalid = |reason: String| SinkError::InvalidUrl {
        url: url.to_owned(),
        reason,
    };
    let topic = if let Some(rest) = target.strip_prefix("arn:") {
        // arn:<partition>:sns:<region>:<account>:<name>
        let parts: Vec<&str> = rest.split(':').collect();
        let [partition, service, region, account, name] = parts.as_slice() else {
            return Err(invalid(
                "expected an ARN arn:aws:sns:<region>:<account-id>:<topic-name>".to_owned(),
            ));
        };
        if partition.is_empty() || *service != "sns" {
            return Err(invalid(format!("{target:?} is not an SNS topic ARN")));
        }
        if account.len() != 12 || !account.chars().all(|c| c.is_ascii_digit()) {
            return Err(invalid(format!("{account:?} is not a 12-digit AWS account id")));
        }
        if region.is_empty() {
            return Err(invalid("the ARN has no region".to_owned()));
        }
        if settings.account.is_some() {
            return Err(invalid(
                "?account= is for a topic given by name; the ARN names the account".to_owned(),
            ));
        }
        settings.region.get_or_insert_with(|| (*region).to_owned());
        Topic::Arn {
            arn: target.clone(),
            name: (*name).to_owned(),
        }
    } else if target.is_empty() {
        return Err(invalid(
            "no topic: expected sns://<topic-name> or sns://arn:aws:sns:<region>:<account-id>:<topic-name>"
                .to_owned(),
        ));
    } else {
        Topic::Name(target.clone())
    };
    if let Some(problem) = aws::name_problem(topic.name(), MAX_TOPIC_NAME) {
        return Err(invalid(format!("topic name {:?}: {problem}", topic.name())));
    }
    Ok((topic, settings))
}

impl Sink for SnsSink {
    fn name(&self) -> &'static str {
        "sns"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.deliver_batch(batch).boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            let (client, arn) = self.resolve().await?;
            client
                .get_topic_attributes()
                .topic_arn(arn)
                .send()
                .await
                .map_err(|e| {
                    aws::unavailable("sns", &format!("reading the attributes of topic {arn}"), &e)
                })?;
            claim_check::probe(self.claim_check.as_ref(), "sns", false).await
        }
        .boxed()
    }

    fn check(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        async {
            self.probe().await?;
            claim_check::probe(self.claim_check.as_ref(), "sns", true).await
        }
        .boxed()
    }

    fn max_event_bytes(&self) -> Option<u64> {
        // With a claim check, a payload of any size has somewhere to go.
        self.claim_check.is_none().then_some(MAX_MESSAGE_BYTES as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let (t, s) =
            parse("sns://arn:aws:sns:eu-west-1:123456789012:orders.fifo?endpoint=http://127.0.0.1:1")
                .unwrap();
        assert_eq!(
            t,
            Topic::Arn {
                arn: "arn:aws:sns:eu-west-1:123456789012:orders.fifo".into(),
                name: "orders.fifo".into()
            }
        );
        assert_eq!(s.region.as_deref(), Some("eu-west-1"), "the ARN's region");
        let (t, s) = parse("sns://orders?region=us-east-1&account=123456789012").unwrap();
        assert_eq!(t, Topic::Name("orders".into()));
        assert_eq!(s.account.as_deref(), Some("123456789012"));
        assert_eq!(partition("cn-north-1"), "aws-cn");
        assert_eq!(partition("us-east-1"), "aws");
    }

    #[test]
    fn refuses_bad_urls() {
        for (url, needle) in [
            ("sns://", "no topic"),
            (
                "sns://arn:aws:sqs:us-east-1:123456789012:q",
                "not an SNS topic ARN",
            ),
            ("sns://arn:aws:sns:us-east-1:1:q", "12-digit"),
            ("sns://arn:aws:sns:us-east-1:q", "expected an ARN"),
            ("sns://a/b", "'/' is not allowed"),
            ("sns://q?account=123456789012&x=1", "unknown parameter"),
        ] {
            let e = parse(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
        assert!(
            SnsSink::new("sns://orders.fifo", &SinkOptions::default())
                .unwrap()
                .is_fifo()
        );
    }
}
