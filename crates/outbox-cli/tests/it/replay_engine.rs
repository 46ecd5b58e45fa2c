//! The replay engine (`outbox_relay::replay`) in process, against a
//! scripted sink: how a failed delivery goes, now that it goes through the
//! relay's breaker, plan and backoff. An outage the breaker waits out
//! spends no attempt; retryable failures cost attempts and fail the job at
//! `--max-attempts`, its cursor just before the event; a sink that answers
//! its probes but fails every page costs attempts after three strikes.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use outbox::OutboxRow;
use outbox::sql::{NewReplay, ReplayFilter, ReplayJob, ReplaySql};
use outbox_relay::replay::{End, Replay, ReplayError, Settings};
use outbox_relay::{Backoff, Delivery, DeliveryError, Sink};
use tokio_util::sync::CancellationToken;

use crate::support::Db;

/// What the sink answers one `deliver` call.
#[derive(Debug, Clone, Copy)]
enum Answer {
    /// Every row delivered.
    Ok,
    /// Every row unavailable.
    Down,
    /// Rows before this index delivered, this one a retryable failure,
    /// the rest delivered.
    FailAt(usize),
}

/// A sink that answers from a script (then `Ok`, or `Down` for ever with
/// `down_for_ever`), and fails its first `failing_probes` probes.
#[derive(Default)]
struct Scripted {
    script: Mutex<VecDeque<Answer>>,
    down_for_ever: bool,
    failing_probes: AtomicUsize,
    calls: AtomicUsize,
    probes: AtomicUsize,
    /// Ids acknowledged, in order.
    acked: Mutex<Vec<i64>>,
}

impl Scripted {
    fn new(script: &[Answer]) -> Self {
        Self {
            script: Mutex::new(script.iter().copied().collect()),
            ..Self::default()
        }
    }
}

impl Sink for &'static Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let fallback = if self.down_for_ever {
            Answer::Down
        } else {
            Answer::Ok
        };
        let answer = self.script.lock().unwrap().pop_front().unwrap_or(fallback);
        let answers: Vec<Delivery> = batch
            .iter()
            .enumerate()
            .map(|(i, _)| match answer {
                Answer::Down => Err(DeliveryError::unavailable("connection refused")),
                Answer::FailAt(at) if i == at => Err(DeliveryError::retryable("HTTP 503")),
                _ => Ok(()),
            })
            .collect();
        let mut acked = self.acked.lock().unwrap();
        for (row, answer) in batch.iter().zip(&answers) {
            if answer.is_ok() {
                acked.push(row.id);
            }
        }
        Box::pin(async move { answers })
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        self.probes.fetch_add(1, Ordering::SeqCst);
        let failing = self
            .failing_probes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        Box::pin(async move {
            if failing {
                Err(DeliveryError::unavailable("connection refused"))
            } else {
                Ok(())
            }
        })
    }
}

/// 20 published events and a job replaying them all; their ids.
async fn twenty_and_a_job(db: &Db) -> (ReplaySql, ReplayJob, Vec<i64>) {
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'orders', 'agg-' || (g % 4), 'Step', jsonb_build_object('g', g), now()
               FROM generate_series(1, 20) g",
        )
        .await
        .unwrap();
    let ids: Vec<i64> = db
        .client
        .query("SELECT id FROM outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let sql = ReplaySql::new(&outbox::Config::default()).unwrap();
    let filter = ReplayFilter::default();
    let (upto_id, matched) = sql.count_matching(&db.client, &filter).await.unwrap();
    let removed = sql.removed(&db.client, &filter).await.unwrap();
    let job = sql
        .create_job(
            &db.client,
            &NewReplay {
                target: "scripted://",
                format: "native",
                filter: &filter,
                rate: f64::INFINITY,
                upto_id,
                matched,
                removed,
            },
        )
        .await
        .unwrap();
    assert_eq!(matched, 20);
    (sql, job, ids)
}

fn settings(max_attempts: i32) -> Settings {
    Settings {
        rate: f64::INFINITY,
        backoff: Backoff {
            base: Duration::from_millis(1),
            max: Duration::from_millis(10),
            max_attempts,
            retry_for: outbox_relay::defaults::RETRY_FOR,
        },
        pause_after_id: None,
    }
}

/// The job's state, cursor, sent count and last error, as saved.
async fn saved(db: &Db) -> (String, i64, i64, Option<String>) {
    let row = db
        .client
        .query_one(
            "SELECT state, cursor_id, sent, last_error FROM outbox_replays",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

#[tokio::test]
async fn an_outage_is_waited_out_by_the_breaker_and_spends_no_attempt() {
    let db = Db::start().await;
    let (sql, job, ids) = twenty_and_a_job(&db).await;
    // Down for two pages and two probes; one attempt allowed, so a single
    // unavailable answer counted as an attempt would fail the job.
    let sink: &'static Scripted = Box::leak(Box::new(Scripted::new(&[Answer::Down, Answer::Down])));
    sink.failing_probes.store(2, Ordering::SeqCst);
    let mut replay = Replay::new(&db.client, &sql, Box::new(sink), job, settings(1));
    let mut pages = 0;
    let end = tokio::time::timeout(
        Duration::from_secs(30),
        replay.run(&CancellationToken::new(), &mut |_| pages += 1),
    )
    .await
    .expect("the replay finishes within 30 s")
    .expect("an outage does not fail the job");
    assert_eq!(end, End::Done);
    assert_eq!(sink.calls.load(Ordering::SeqCst), 3, "down, down, delivered");
    // Two failed probes, one that answered (half-open, then down again),
    // and one more that answered.
    assert_eq!(sink.probes.load(Ordering::SeqCst), 4);
    assert_eq!(*sink.acked.lock().unwrap(), ids, "each once, in order");
    assert_eq!(pages, 1);
    assert_eq!(saved(&db).await, ("done".to_owned(), ids[19], 20, None));
}

#[tokio::test]
async fn retryable_failures_cost_attempts_and_fail_the_job_before_the_event() {
    let db = Db::start().await;
    let (sql, job, ids) = twenty_and_a_job(&db).await;
    // The sixth event fails three times: pages from the cursor start with it.
    let sink: &'static Scripted = Box::leak(Box::new(Scripted::new(&[
        Answer::FailAt(5),
        Answer::FailAt(0),
        Answer::FailAt(0),
        Answer::Ok,
    ])));
    let mut replay = Replay::new(&db.client, &sql, Box::new(sink), job, settings(3));
    let error = replay
        .run(&CancellationToken::new(), &mut |_| {})
        .await
        .expect_err("three failures of one event fail the job at --max-attempts 3");
    assert!(
        matches!(&error, ReplayError::Exhausted { attempts: 3, event, .. } if event.contains(&format!("event id {}", ids[5]))),
        "{error:?}"
    );
    assert_eq!(
        sink.calls.load(Ordering::SeqCst),
        3,
        "the script's fourth page never went"
    );
    assert_eq!(
        sink.probes.load(Ordering::SeqCst),
        0,
        "a refusal is not an outage"
    );
    let (state, cursor, sent, last_error) = saved(&db).await;
    assert_eq!((state.as_str(), cursor, sent), ("failed", ids[4], 5));
    let last_error = last_error.expect("the job says why");
    assert!(
        last_error.contains("3 times (--max-attempts)") && last_error.contains("HTTP 503"),
        "{last_error}"
    );

    // Two failures, then delivered: the attempts reset with the next event.
    let db = Db::start().await;
    let (sql, job, ids) = twenty_and_a_job(&db).await;
    let sink: &'static Scripted = Box::leak(Box::new(Scripted::new(&[
        Answer::FailAt(5),
        Answer::FailAt(0),
        Answer::FailAt(1),
        Answer::FailAt(0),
    ])));
    let mut replay = Replay::new(&db.client, &sql, Box::new(sink), job, settings(3));
    let end = replay.run(&CancellationToken::new(), &mut |_| {}).await.unwrap();
    assert_eq!(end, End::Done);
    assert_eq!(sink.calls.load(Ordering::SeqCst), 5);
    assert_eq!(saved(&db).await, ("done".to_owned(), ids[19], 20, None));
}

#[tokio::test]
async fn a_sink_that_answers_probes_but_fails_every_page_costs_attempts_after_three_strikes() {
    let db = Db::start().await;
    let (sql, job, _) = twenty_and_a_job(&db).await;
    let sink: &'static Scripted = Box::leak(Box::new(Scripted {
        down_for_ever: true,
        ..Scripted::default()
    }));
    let mut replay = Replay::new(&db.client, &sql, Box::new(sink), job, settings(1));
    let error = tokio::time::timeout(
        Duration::from_secs(30),
        replay.run(&CancellationToken::new(), &mut |_| {}),
    )
    .await
    .expect("the replay ends within 30 s")
    .expect_err("the strikes cost the one attempt allowed");
    assert!(
        matches!(&error, ReplayError::Exhausted { attempts: 1, .. }),
        "{error:?}"
    );
    // The page that opened the breaker, then three half-open strikes.
    assert_eq!(sink.calls.load(Ordering::SeqCst), 4);
    assert_eq!(sink.probes.load(Ordering::SeqCst), 3);
    let (state, _, sent, _) = saved(&db).await;
    assert_eq!((state.as_str(), sent), ("failed", 0));
}

#[tokio::test]
async fn cancelling_during_an_outage_stops_the_job_at_its_cursor() {
    let db = Db::start().await;
    let (sql, job, _) = twenty_and_a_job(&db).await;
    let sink: &'static Scripted = Box::leak(Box::new(Scripted::new(&[Answer::Down])));
    sink.failing_probes.store(usize::MAX, Ordering::SeqCst);
    let cancel = CancellationToken::new();
    let mut replay = Replay::new(&db.client, &sql, Box::new(sink), job, settings(1));
    let stop = {
        let cancel = cancel.clone();
        async move {
            // Cancel once the breaker is probing: the outage began.
            while sink.probes.load(Ordering::SeqCst) < 2 {
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            cancel.cancel();
        }
    };
    let (end, ()) = tokio::time::timeout(
        Duration::from_secs(30),
        futures::future::join(replay.run(&cancel, &mut |_| {}), stop),
    )
    .await
    .expect("stops within 30 s");
    assert_eq!(end.unwrap(), End::Stopped);
    assert_eq!(sink.calls.load(Ordering::SeqCst), 1);
    let (state, cursor, sent, _) = saved(&db).await;
    assert_eq!((state.as_str(), cursor, sent), ("stopped", 0, 0));
}
