//! A sink with scripted answers, for testing the relay's cycle in process
//! (see `source::fake`).
//!
//! Each call of [`Sink::deliver`] takes the next scripted [`Call`]: a rule
//! answering each row, and whether to park until the test releases it (so
//! a test acts while a batch is at the sink). Once the script runs out,
//! every row is acknowledged. Probes answer from their own script, then
//! available. Every call is recorded in the shared [`Journal`].

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox::OutboxRow;
use tokio::sync::Notify;

use super::{Delivery, DeliveryError, Sink};
use crate::source::fake::{Event, Journal};

/// How one call answers each row.
pub(crate) type Rule = Arc<dyn Fn(&OutboxRow) -> Delivery + Send + Sync>;

/// One scripted call of [`Sink::deliver`].
pub(crate) struct Call {
    rule: Rule,
    park: bool,
}

impl Call {
    /// Answers each row with `rule`.
    pub(crate) fn each(rule: impl Fn(&OutboxRow) -> Delivery + Send + Sync + 'static) -> Self {
        Self {
            rule: Arc::new(rule),
            park: false,
        }
    }

    /// Answers every row with `answer`.
    pub(crate) fn all(answer: Delivery) -> Self {
        Self::each(move |_| answer.clone())
    }

    /// Acknowledges every row.
    pub(crate) fn ok() -> Self {
        Self::all(Ok(()))
    }

    /// Every row fails, retryably.
    pub(crate) fn retryable() -> Self {
        Self::all(Err(DeliveryError::retryable("fake: try again")))
    }

    /// Every row is refused for good.
    pub(crate) fn permanent() -> Self {
        Self::all(Err(DeliveryError::permanent("fake: refused")))
    }

    /// The sink is unavailable for every row.
    pub(crate) fn unavailable() -> Self {
        Self::all(Err(DeliveryError::unavailable("fake: connection refused")))
    }

    /// Parks before answering until [`Gate::release`]; [`Gate::reached`]
    /// resolves once the call is parked.
    pub(crate) fn parked(mut self) -> Self {
        self.park = true;
        self
    }
}

/// Where a parked call waits. Permits are kept, so neither side can miss
/// the other.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    reached: Notify,
    release: Notify,
}

impl Gate {
    /// Resolves once a parked call is waiting.
    pub(crate) async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets the parked call answer.
    pub(crate) fn release(&self) {
        self.release.notify_one();
    }
}

/// See the [module docs](self).
pub(crate) struct FakeSink {
    journal: Journal,
    calls: Mutex<VecDeque<Call>>,
    probes: Mutex<VecDeque<bool>>,
    gate: Arc<Gate>,
}

impl FakeSink {
    /// A sink recording into `journal` that acknowledges everything.
    pub(crate) fn new(journal: &Journal) -> Self {
        Self {
            journal: journal.clone(),
            calls: Mutex::default(),
            probes: Mutex::default(),
            gate: Arc::default(),
        }
    }

    /// The next call of `deliver` answers as `call` says.
    #[must_use]
    pub(crate) fn then(self, call: Call) -> Self {
        self.calls.lock().unwrap().push_back(call);
        self
    }

    /// The next probes answer available (true) or unavailable (false), in
    /// order; the startup probe is the first.
    #[must_use]
    pub(crate) fn probes(self, answers: impl IntoIterator<Item = bool>) -> Self {
        self.probes.lock().unwrap().extend(answers);
        self
    }

    /// Where parked calls wait.
    pub(crate) fn gate(&self) -> Arc<Gate> {
        Arc::clone(&self.gate)
    }
}

impl Sink for FakeSink {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn deliver<'a>(&'a self, batch: &'a [OutboxRow]) -> BoxFuture<'a, Vec<Delivery>> {
        self.journal
            .push(Event::Sent(batch.iter().map(|r| r.id).collect()));
        let call = self.calls.lock().unwrap().pop_front().unwrap_or_else(Call::ok);
        async move {
            if call.park {
                self.gate.reached.notify_one();
                self.gate.release.notified().await;
            }
            let answers: Vec<Delivery> = batch.iter().map(|row| (call.rule)(row)).collect();
            let answered = batch.iter().map(|r| r.id).zip(answers.iter().cloned()).collect();
            self.journal.push(Event::Answered(answered));
            answers
        }
        .boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), DeliveryError>> {
        let up = self.probes.lock().unwrap().pop_front().unwrap_or(true);
        self.journal.push(Event::Probed(up));
        async move {
            if up {
                Ok(())
            } else {
                Err(DeliveryError::unavailable("fake: probe refused"))
            }
        }
        .boxed()
    }
}
