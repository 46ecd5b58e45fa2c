//! A scripted HTTP endpoint: records every POST it gets and answers with the
//! status (and body, and `Retry-After`) the test chose, so delivery, retries
//! and backoff can be observed; an outage of a set length answers every
//! method, as a load balancer in front of a receiver that is down does.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::Error;
use crate::support::lock;

/// How long [`Receiver::shutdown`] lets open connections finish.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`Receiver::restart`] tries to bind its old port.
const RESTART_TIMEOUT: Duration = Duration::from_secs(10);

/// How the [`Receiver`] answers POSTs. Whatever is scripted, every request is
/// recorded with the status it actually got.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Respond {
    /// Always 200.
    Ok,
    /// Always this status.
    Status(u16),
    /// The first `times` requests get `status`, later ones 200.
    FailFirst {
        /// How many requests fail.
        times: usize,
        /// The status they get.
        status: u16,
    },
    /// One status per request in order, then 200.
    Sequence(Vec<u16>),
}

impl Respond {
    /// The status for the request with this 0-based index since the script
    /// was set.
    fn status_for(&self, index: usize) -> u16 {
        match self {
            Respond::Ok => 200,
            Respond::Status(status) => *status,
            Respond::FailFirst { times, status } if index < *times => *status,
            Respond::FailFirst { .. } => 200,
            Respond::Sequence(statuses) => statuses.get(index).copied().unwrap_or(200),
        }
    }
}

/// One POST the [`Receiver`] got.
#[derive(Clone, Debug)]
pub struct Post {
    /// When it arrived.
    pub at: Instant,
    /// The request path, e.g. `/events`.
    pub path: String,
    /// The request headers, names lowercase, in arrival order.
    pub headers: Vec<(String, String)>,
    /// The body parsed as JSON; `Null` if it was not JSON.
    pub body: serde_json::Value,
    /// The body as it arrived, for signature checks.
    pub raw: Vec<u8>,
    /// The status we answered.
    pub status: u16,
}

impl Post {
    /// The first value of header `name` (give it lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A real HTTP server (axum) on 127.0.0.1 and a free port that records every
/// POST to any path and answers as scripted with [`Respond`]. Other methods
/// get 405 (or the outage's status, see [`Receiver::set_outage`]) and are
/// recorded apart, as [`probes`](Receiver::probes).
///
/// Dropping it stops accepting connections; [`shutdown`](Self::shutdown)
/// also waits for open ones to finish.
#[derive(Debug)]
pub struct Receiver {
    addr: SocketAddr,
    state: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    log: Mutex<Vec<Post>>,
    script: Mutex<Script>,
    retry_after: Mutex<Option<u64>>,
    /// Bodies longer than this get 413 (recorded).
    max_body: Mutex<Option<usize>>,
    /// Bodies containing this text get no answer: the connection is
    /// dropped (not recorded), as by a receiver that crashes on them.
    poison: Mutex<Option<String>>,
    /// Bodies containing this text get this status (recorded), whatever
    /// the script says.
    refuse: Mutex<Option<(String, u16)>>,
    /// How long each POST waits, once recorded, before its answer: a slow
    /// consumer.
    delay: Mutex<Option<Duration>>,
    /// The body of every answer that is not a success.
    body: Mutex<Option<String>>,
    /// Until this instant every request, whatever its method, gets this
    /// status, whatever the script says.
    outage: Mutex<Option<(u16, Instant)>>,
    /// Requests with another method than POST: when, and the status.
    probes: Mutex<Vec<(Instant, u16)>>,
    /// How many requests are in `log`; waiters watch it.
    count: watch::Sender<usize>,
    /// While true, every POST, once recorded, waits for it to turn false
    /// before its answer.
    held: watch::Sender<bool>,
}

#[derive(Debug)]
struct Script {
    respond: Respond,
    /// Requests answered since `respond` was set.
    answered: usize,
}

impl Receiver {
    /// Starts the server and returns once it is listening.
    pub async fn start(respond: Respond) -> Result<Receiver, Error> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(Error::io("binding the HTTP receiver to 127.0.0.1"))?;
        let addr = listener
            .local_addr()
            .map_err(Error::io("reading the HTTP receiver's address"))?;
        let state = Arc::new(Shared {
            log: Mutex::new(Vec::new()),
            script: Mutex::new(Script { respond, answered: 0 }),
            retry_after: Mutex::new(None),
            max_body: Mutex::new(None),
            poison: Mutex::new(None),
            refuse: Mutex::new(None),
            delay: Mutex::new(None),
            body: Mutex::new(None),
            outage: Mutex::new(None),
            probes: Mutex::new(Vec::new()),
            count: watch::Sender::new(0),
            held: watch::Sender::new(false),
        });
        let mut receiver = Receiver {
            addr,
            state,
            stop: None,
            server: None,
        };
        receiver.serve(listener);
        Ok(receiver)
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let app = Router::new()
            .fallback(record)
            // Batches of events can be large; a 413 from a limit would be an
            // unrecorded answer nobody scripted.
            .layer(DefaultBodyLimit::disable())
            .with_state(Arc::clone(&self.state));
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let shutdown = async {
                // A dropped sender (the Receiver was dropped) also stops it.
                let _ = stopped.await;
            };
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::warn!(error = %e, "testkit HTTP receiver failed");
            }
        });
        self.stop = Some(stop);
        self.server = Some(server);
    }

    /// Stops listening (an outage: connections are refused), letting open
    /// connections finish (up to 5 s). What was received is kept; stopping
    /// a stopped receiver does nothing.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(mut server) = self.server.take()
            && tokio::time::timeout(SHUTDOWN_TIMEOUT, &mut server).await.is_err()
        {
            server.abort();
        }
    }

    /// Listens again on the same port (a running receiver is stopped first),
    /// with the same script and log, retrying for up to 10 s while the port
    /// is still held.
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await;
        let deadline = Instant::now() + RESTART_TIMEOUT;
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(listener) => break listener,
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::Io {
                        doing: format!("binding the HTTP receiver to {} again", self.addr),
                        source: e,
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        self.serve(listener);
        Ok(())
    }

    /// Answers 413 (and records it) to every POST whose body is longer than
    /// `bytes` from now on (`None` removes the limit).
    pub fn set_max_body(&self, bytes: Option<usize>) {
        *lock(&self.state.max_body) = bytes;
    }

    /// Drops the connection, with no answer, of every POST whose body
    /// contains `text` from now on (`None` stops it): a receiver that
    /// crashes on one event. Those requests are not recorded.
    pub fn set_poison(&self, text: Option<&str>) {
        *lock(&self.state.poison) = text.map(str::to_owned);
    }

    /// Answers `status` (and records it) to every POST whose body contains
    /// `text` from now on, whatever the script says (`None` stops it): a
    /// consumer that refuses one event while it takes the others. The
    /// script does not count these requests.
    pub fn set_refuse(&self, refuse: Option<(&str, u16)>) {
        *lock(&self.state.refuse) = refuse.map(|(text, status)| (text.to_owned(), status));
    }

    /// Answers every POST `delay` after it arrived from now on (`None`:
    /// at once): a slow consumer. The request is recorded on arrival, so
    /// [`wait_for_count`](Self::wait_for_count) sees it while it waits;
    /// requests wait concurrently.
    pub fn set_delay(&self, delay: Option<Duration>) {
        *lock(&self.state.delay) = delay;
    }

    /// Holds every POST, once recorded, until [`release`](Self::release):
    /// a batch kept at the sink for as long as a test needs it there.
    pub fn hold(&self) {
        self.state.held.send_replace(true);
    }

    /// Answers the held POSTs and holds no more.
    pub fn release(&self) {
        self.state.held.send_replace(false);
    }

    /// Answers every request that is not a success with this body from now
    /// on (`None`: an empty one): a receiver saying why it refused.
    pub fn set_body(&self, body: Option<&str>) {
        *lock(&self.state.body) = body.map(str::to_owned);
    }

    /// Answers every request, POST or not (a `HEAD` probe too), with
    /// `status` for `duration` from now, whatever the script says; then the
    /// script again, which does not count the requests answered meanwhile.
    /// A load balancer in front of a receiver that is down or rolling out.
    pub fn set_outage(&self, status: u16, duration: Duration) {
        *lock(&self.state.outage) = Some((status, Instant::now() + duration));
    }

    /// Requests with another method than POST (the HTTP sink's `HEAD`
    /// probes) so far: when each arrived and the status it got.
    pub fn probes(&self) -> Vec<(Instant, u16)> {
        lock(&self.state.probes).clone()
    }

    /// `http://127.0.0.1:<port>/events` (any path is accepted).
    pub fn url(&self) -> String {
        format!("http://{}/events", self.addr)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Replaces the script; `FailFirst` and `Sequence` count from the next
    /// request.
    pub fn set_respond(&self, respond: Respond) {
        *lock(&self.state.script) = Script { respond, answered: 0 };
    }

    /// Adds `Retry-After: <secs>` to every non-2xx answer from now on
    /// (`None` removes it).
    pub fn set_retry_after(&self, secs: Option<u64>) {
        *lock(&self.state.retry_after) = secs;
    }

    /// Every POST so far, in arrival order.
    pub fn received(&self) -> Vec<Post> {
        lock(&self.state.log).clone()
    }

    /// How many POSTs arrived so far.
    pub fn count(&self) -> usize {
        lock(&self.state.log).len()
    }

    /// Waits until at least `n` POSTs have arrived and returns all of them
    /// (possibly more than `n`).
    pub async fn wait_for_count(&self, n: usize, timeout: Duration) -> Result<Vec<Post>, Error> {
        let mut count = self.state.count.subscribe();
        // The sender lives in `self.state`, so the channel cannot close
        // while we borrow `self`.
        // `wait_for`'s guard holds the channel's read lock: drop it before
        // `received` takes the log, since `record` takes the log and then
        // the channel's write lock (holding both was a deadlock).
        let arrived =
            tokio::time::timeout(timeout, async { count.wait_for(|&c| c >= n).await.map(drop) }).await;
        match arrived {
            Ok(_) => Ok(self.received()),
            Err(_) => Err(Error::Timeout {
                waiting_for: format!("{n} requests at {}", self.url()),
                timeout,
                detail: format!("{} arrived", self.count()),
            }),
        }
    }

    /// Stops accepting, lets open connections finish (up to 5 s) and
    /// returns when the server is gone.
    pub async fn shutdown(mut self) {
        self.stop().await;
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        // Dropping `stop` starts a graceful shutdown of the server task; we
        // cannot wait for it here.
        self.stop.take();
    }
}

async fn record(
    State(state): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let outage = lock(&state.outage)
        .filter(|(_, until)| Instant::now() < *until)
        .map(|(status, _)| status);
    if method != Method::POST {
        let status = outage
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::METHOD_NOT_ALLOWED);
        lock(&state.probes).push((Instant::now(), status.as_u16()));
        return answer(&state, status);
    }
    let contains = |text: &str| body.windows(text.len().max(1)).any(|w| w == text.as_bytes());
    let poisoned = lock(&state.poison).as_deref().is_some_and(contains);
    if poisoned {
        // Unwinding out of the handler ends the connection's task, so the
        // client sees the connection closed before any answer. Not a panic:
        // nothing is printed.
        std::panic::resume_unwind(Box::new("testkit receiver: poisoned request"));
    }
    let at = Instant::now();
    let too_large = lock(&state.max_body).is_some_and(|max| body.len() > max);
    let refused = lock(&state.refuse)
        .as_ref()
        .and_then(|(text, status)| contains(text).then_some(*status));
    let wanted = if too_large {
        413
    } else if let Some(status) = refused {
        status
    } else if let Some(status) = outage {
        status
    } else {
        let mut script = lock(&state.script);
        let wanted = script.respond.status_for(script.answered);
        script.answered += 1;
        wanted
    };
    // An invalid scripted status cannot be sent; record what we did send.
    let status = StatusCode::from_u16(wanted).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let received = Post {
        at,
        path: uri.path().to_owned(),
        headers: headers
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_ascii_lowercase(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        raw: body.to_vec(),
        status: status.as_u16(),
    };
    {
        // Recorded before answering: once the client has its response the
        // request is visible to the test.
        let mut log = lock(&state.log);
        log.push(received);
        state.count.send_replace(log.len());
    }
    let delay = *lock(&state.delay);
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    // A closed sender (never: `state` owns it) would end the wait too.
    let _ = state.held.subscribe().wait_for(|held| !*held).await;
    answer(&state, status)
}

/// `status`, and unless it is a success the scripted body and
/// `Retry-After`.
fn answer(state: &Shared, status: StatusCode) -> Response {
    if status.is_success() {
        return status.into_response();
    }
    let body = lock(&state.body).clone().unwrap_or_default();
    let mut response = (status, body).into_response();
    if let Some(secs) = *lock(&state.retry_after) {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}
