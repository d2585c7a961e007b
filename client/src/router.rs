//! Which connection a request goes over: the endpoints, the live [`Conn`], reconnection with
//! backoff, `NOT_LEADER` redirects, leaving a hung node, and the time-out of each request.
//!
//! [`Router`] is the engine under [`Client`](crate::Client) and under every lease guard: it
//! sends untyped [`Request`]s and hands back the [`Answer`], so that leases can renew and
//! release without the client type (which builds leases) and the client module holds only
//! the typed, public requests. The behaviour is described for users in the client module's
//! documentation (reconnection, several endpoints).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use rand::Rng;
use tenure_protocol::handshake::ServerLimits;
use tenure_protocol::{ErrorCode, LeaseId, Request, Response};
use tokio::time::Instant;

use crate::conn::Conn;
use crate::error::{unexpected, Error, Result};
use crate::options::{ClientConfig, Credentials};
use crate::outcome::{renew_outcome, ReleaseOutcome, RenewOutcome};

/// Redirects a request may follow beyond one per endpoint (`NOT_LEADER` answers) in one
/// round; after a round that found no leader the client pauses before the next.
const REDIRECTS_EXTRA: usize = 3;
/// Longest a request keeps looking for a leader (rounds of redirects, with pauses) before the
/// last `NOT_LEADER` is returned as it is, if its own time-out is not shorter: an election
/// with default timings takes well under a second, and a request sent mid-election should
/// be served by the new leader rather than fail.
const LEADER_SEARCH_MAX: Duration = Duration::from_secs(10);
/// Share of a request's time-out the leader search may use: the rest is left for its last
/// exchange, so that a search that found no leader ends with that `NOT_LEADER` (which says
/// why, e.g. a node removed from the cluster) rather than a bare time-out.
const LEADER_SEARCH_SHARE: f64 = 0.8;
/// Pause between rounds of redirects that found no leader (nodes that name a dead leader
/// or none), doubled per round up to [`ROUND_PAUSE_MAX`].
const ROUND_PAUSE_MIN: Duration = Duration::from_millis(50);
/// See [`ROUND_PAUSE_MIN`].
const ROUND_PAUSE_MAX: Duration = Duration::from_millis(400);
/// Pause before trying the next endpoint while no leader is known (an election under way).
const ELECTION_PAUSE: Duration = Duration::from_millis(100);

/// A request's answer, the connection it came over, and an instant taken before the send
/// that got it (the last one, when NOT_LEADER made the client send it again): local
/// deadlines count from there (PROTOCOL.md 3.3), not from a first send that a slow follower
/// may have held for seconds.
pub(crate) struct Answer {
    pub(crate) response: Response,
    pub(crate) conn: Arc<Conn>,
    pub(crate) sent_at: Instant,
}

/// What [`Router::call_acquire`] returns: the answer that settled the ACQUIRE, an instant
/// taken before its first send (a lease counts from there too, PROTOCOL.md 3.9), and the
/// connection of its first send (a release-on-disconnect lease a repeat found stays tied to
/// the connection of the send that was granted, which is no later than the first one sent).
pub(crate) struct AcquireAnswer {
    pub(crate) answer: Answer,
    pub(crate) first_sent_at: Instant,
    pub(crate) first_conn: Option<Arc<Conn>>,
}

/// Pause before an ACQUIRE whose outcome is unknown is sent again, doubled per retry up to
/// [`RETRY_PAUSE_MAX`]: a fail-over takes an election (about a second), a restart longer.
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(50);
/// See [`RETRY_PAUSE_MIN`].
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(800);
/// Shortest time-out of a send [`Router::call_retrying`] makes near the end of its time.
const RETRY_TIMEOUT_MIN: Duration = Duration::from_millis(1);
/// Longest a request that keeps leases alive (a renewal, a session's keep-alive) waits for
/// the next reconnect attempt after a failed one, where other requests wait the whole
/// backoff (up to `reconnect_delay_max`, 5 s by default). A restart shorter than a lease's
/// time left must not outlast it for want of an attempt: with the backoff alone the attempts
/// of a 3 s outage came at +2.4 s and then after the lease's deadline. The attempts stay
/// serialized (one at a time per client), so a client keeping many leases still tries at
/// most once per this delay.
const RECONNECT_DELAY_KEEPING_MAX: Duration = Duration::from_millis(250);

/// Whether the caller of an ACQUIRE still waits for its answer, kept what it got, or gave up
/// (and which grant was released since, so that it is released once).
enum Settle {
    Open,
    Kept,
    GaveUp { released: Option<LeaseId> },
}

/// The connection a send waits on (for its caller to leave if it hangs), the first
/// connection any send of the same request went out on, and whether any of them was
/// answered that its outcome is unknown (it may have been executed).
#[derive(Default)]
struct Sending {
    waiting_on: Mutex<Option<Arc<Conn>>>,
    first: Arc<OnceLock<Arc<Conn>>>,
    maybe_executed: Arc<AtomicBool>,
    /// The NOT_LEADER message to report if the search for a leader ends without an answer
    /// of its own (a node it cannot reach, or the request's time-out): the last one, or
    /// the first that said the outcome is unknown, which no later refusal may hide.
    refused: Mutex<Option<String>>,
}

impl Sending {
    /// Notes that a send is waiting on `conn` (or on nothing, `None`).
    fn waiting(&self, conn: Option<&Arc<Conn>>) {
        if let Some(conn) = conn {
            let _ = self.first.set(Arc::clone(conn));
        }
        *self.waiting_on.lock().expect("client mutex poisoned") = conn.cloned();
    }

    /// Whether a send is out on a connection, waiting for its answer.
    fn is_waiting(&self) -> bool {
        self.waiting_on
            .lock()
            .expect("client mutex poisoned")
            .is_some()
    }

    /// Notes a NOT_LEADER `message` (see `refused`).
    fn refused_with(&self, message: &str) {
        let mut refused = self.refused.lock().expect("client mutex poisoned");
        if !refused
            .as_deref()
            .is_some_and(|m| m.starts_with(OUTCOME_UNKNOWN))
        {
            *refused = Some(message.to_owned());
        }
    }

    /// The NOT_LEADER message the search met, to report (see `refused`).
    fn refused_message(&self) -> Option<String> {
        self.refused.lock().expect("client mutex poisoned").clone()
    }

    /// [`Sending::refused_message`] as the error to report instead of a failure.
    fn refusal(&self) -> Option<Error> {
        Some(Error::Server {
            code: ErrorCode::NotLeader,
            message: self.refused_message()?,
        })
    }

    /// Takes the connection a send is waiting on.
    fn take(&self) -> Option<Arc<Conn>> {
        self.waiting_on
            .lock()
            .expect("client mutex poisoned")
            .take()
    }
}

/// One send of an ACQUIRE, on a task of its own.
struct Attempt {
    router: Router,
    request: Request,
    key: Bytes,
    settle: Arc<Mutex<Settle>>,
    /// The connection the send waits on, for the caller to leave if it hangs.
    sending: Arc<Sending>,
}

impl Attempt {
    /// Sends the ACQUIRE (no time-out here: the connection's life bounds the wait) and hands
    /// the result to the caller; releases a grant the caller no longer waits for. The search
    /// for a leader gets the share of one request time-out any request's does, so a round of
    /// NOT_LEADER comes back as that, in time for the caller to send again, not as "no answer".
    async fn run(self, tx: tokio::sync::mpsc::UnboundedSender<Result<Answer>>) {
        let search = self.router.inner.config.request_timeout;
        let result = self
            .router
            .call_on(self.request.clone(), search, &self.sending, Purpose::Other)
            .await;
        if let Err(tokio::sync::mpsc::error::SendError(Ok(answer))) = tx.send(result) {
            release_unkept(&self.router, &self.settle, &self.key, &answer.response).await;
        }
    }
}

/// The request with its wait set to `wait_ms` (a retry waits only what is left).
fn with_wait(request: &Request, wait_ms: u32) -> Request {
    let mut request = request.clone();
    if let Request::Acquire { wait_ms: wait, .. } = &mut request {
        *wait = wait_ms;
    }
    request
}

/// Whole milliseconds from `now` until `until`, zero once it passed.
fn millis_until(until: Instant, now: Instant) -> u32 {
    let left = until.saturating_duration_since(now).as_millis();
    u32::try_from(left).unwrap_or(u32::MAX)
}

fn ms(value: u32) -> Duration {
    Duration::from_millis(u64::from(value))
}

/// An answer that leaves the ACQUIRE's outcome unknown: a transient ERROR (`NOT_LEADER` from
/// a leader that lost its leadership mid-write, `SHUTTING_DOWN`, `UNAVAILABLE`, ...).
fn is_unknown_answer(response: &Response) -> bool {
    matches!(response, Response::Error { .. })
        && unexpected("ACQUIRE", response.clone()).is_transient()
}

/// How a server begins the message of an ERROR whose request may have been executed (a
/// change in flight when its leader lost its place: PROTOCOL.md 3.8).
const OUTCOME_UNKNOWN: &str = "the outcome is unknown";

/// Whether `response` is an ERROR saying its request may have been executed.
fn says_outcome_unknown(response: &Response) -> bool {
    matches!(response, Response::Error { message, .. } if message.starts_with(OUTCOME_UNKNOWN))
}

/// The error an ACQUIRE's retries ran out with, said to leave the outcome unknown when an
/// earlier send may have been executed: a later refusal (a cut-off leader's "does not
/// serve", which is not executed) must not read as the whole ACQUIRE's (outside test a66,
/// 1: the grant of the first send committed after the partition healed, its caller told it
/// was not executed).
fn unknown_if(maybe_executed: bool, failure: Error) -> Error {
    match failure {
        Error::Server { code, message }
            if maybe_executed && !message.starts_with(OUTCOME_UNKNOWN) =>
        {
            Error::Server {
                code,
                message: format!(
                    "{OUTCOME_UNKNOWN}: an earlier send of this ACQUIRE may have been \
                     executed (its answer was lost), and it may still take effect; the last \
                     answer: {message}"
                ),
            }
        }
        failure => failure,
    }
}

/// What the caller of an ACQUIRE heard next from its sends.
enum Step {
    /// An answer that settles it: a grant, LOCKED, ACQUIRE_ENDED or a definite ERROR.
    Settled(Answer),
    /// A failure that is no unknown outcome: sending again would not help.
    Failed(Error),
    /// Every send out failed with an unknown outcome; the last one's error.
    Unknown(Error),
    /// The newest send got no answer in time.
    NoAnswer,
}

/// The caller's end of one ACQUIRE's sends. Dropped before the ACQUIRE settled (the caller's
/// future was dropped), it counts as giving up: grants already here and still to come are
/// released.
struct Waiting {
    router: Router,
    key: Bytes,
    settle: Arc<Mutex<Settle>>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Result<Answer>>,
    /// Sends whose result has not arrived.
    in_flight: usize,
    /// The last ERROR a send was answered with that left the outcome unknown.
    answered: Option<Error>,
    /// Whether a send may have been executed: a server said its outcome is unknown, its
    /// connection was lost, or it got no answer in time. Shared with every [`Sending`].
    maybe_executed: Arc<AtomicBool>,
}

impl Waiting {
    /// Waits until `until` for what settles the ACQUIRE or shows its outcome unknown.
    async fn next(&mut self, until: Instant) -> Step {
        loop {
            let result = match tokio::time::timeout_at(until, self.rx.recv()).await {
                Err(_) => return Step::NoAnswer,
                Ok(None) => unreachable!("the caller holds a sender"),
                Ok(Some(result)) => result,
            };
            let error = match result {
                Ok(answer) if !is_unknown_answer(&answer.response) => return Step::Settled(answer),
                Ok(answer) => {
                    if says_outcome_unknown(&answer.response) {
                        self.note_maybe_executed();
                    }
                    unexpected("ACQUIRE", answer.response)
                }
                Err(e) => {
                    if matches!(e, Error::ConnectionLost(_)) {
                        self.note_maybe_executed();
                    }
                    e
                }
            };
            self.note_answer(&error);
            self.in_flight -= 1;
            if !error.is_transient() {
                return Step::Failed(error);
            }
            if self.in_flight == 0 {
                return Step::Unknown(error);
            }
            // An older send failed while a newer one is still out: wait for that one.
        }
    }

    /// Notes that a send may have been executed.
    fn note_maybe_executed(&self) {
        self.maybe_executed.store(true, Ordering::Relaxed);
    }

    /// Keeps `error`, if a server's answer, as the last one a send got.
    fn note_answer(&mut self, error: &Error) {
        if let Error::Server { code, message } = error {
            self.answered = Some(Error::Server {
                code: *code,
                message: message.clone(),
            });
        }
    }

    /// The caller keeps `response`: a grant still to come is the same lease (one acquire id,
    /// one grant), so nothing is released; after any other answer, grants are released.
    fn kept(&mut self, response: &Response) {
        let granted = matches!(
            response,
            Response::Granted { .. } | Response::Regranted { .. }
        );
        *self.settle.lock().expect("client mutex poisoned") = if granted {
            Settle::Kept
        } else {
            Settle::GaveUp { released: None }
        };
        self.rx.close();
    }

    /// The caller gave up: grants already here are released, and every send still out
    /// releases its grant when it arrives.
    async fn gave_up(&mut self) {
        *self.settle.lock().expect("client mutex poisoned") = Settle::GaveUp { released: None };
        self.rx.close();
        while let Ok(result) = self.rx.try_recv() {
            if let Ok(answer) = result {
                if is_unknown_answer(&answer.response) {
                    self.note_answer(&unexpected("ACQUIRE", answer.response.clone()));
                }
                release_unkept(&self.router, &self.settle, &self.key, &answer.response).await;
            }
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        {
            let mut settle = self.settle.lock().expect("client mutex poisoned");
            if !matches!(*settle, Settle::Open) {
                return;
            }
            *settle = Settle::GaveUp { released: None };
        }
        self.rx.close();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        while let Ok(result) = self.rx.try_recv() {
            if let Ok(answer) = result {
                let (router, key) = (self.router.clone(), self.key.clone());
                let settle = Arc::clone(&self.settle);
                runtime.spawn(async move {
                    release_unkept(&router, &settle, &key, &answer.response).await;
                });
            }
        }
    }
}

/// Releases the lease in `response` if it is a grant the caller did not keep, once per
/// lease id.
async fn release_unkept(router: &Router, settle: &Mutex<Settle>, key: &[u8], response: &Response) {
    let lease_id = match response {
        Response::Granted { lease_id, .. } | Response::Regranted { lease_id, .. } => *lease_id,
        _ => return,
    };
    {
        let mut settle = settle.lock().expect("client mutex poisoned");
        match &mut *settle {
            Settle::GaveUp { released } if *released != Some(lease_id) => {
                *released = Some(lease_id);
            }
            _ => return,
        }
    }
    tracing::debug!("releasing a grant that arrived after its caller gave up");
    let _ = router.release(key, lease_id).await;
}

/// A handle to the connection manager, cheap to clone: the [`Client`](crate::Client) and
/// every lease and guard hold one, so the connection lives as long as any of them.
#[derive(Clone)]
pub(crate) struct Router {
    inner: Arc<Inner>,
}

/// The state every clone of a [`Router`] shares.
struct Inner {
    /// The address(es) as given: `host:port`, or several separated by commas (a cluster).
    addr: String,
    /// Every address to try, in order.
    endpoints: Vec<String>,
    /// The address the next connection goes to: the leader a follower named, else the
    /// endpoint after the one that last failed.
    next: Mutex<String>,
    config: ClientConfig,
    /// The live connection, and the address it went to.
    current: Mutex<Option<Arc<Conn>>>,
    current_addr: Mutex<String>,
    reconnect: tokio::sync::Mutex<Backoff>,
}

/// Moves the next connection to the endpoint after `target` when dropped armed: a connect
/// abandoned by its caller.
struct MoveOnIfDropped<'a> {
    router: &'a Router,
    target: &'a str,
    armed: bool,
}

impl Drop for MoveOnIfDropped<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.router.advance_from(self.target);
        }
    }
}

/// Reconnect state: failed attempts in a row and when the next one may start.
struct Backoff {
    failures: u32,
    retry_at: Option<Instant>,
    /// When the last attempt failed: a request that keeps leases alive may try again
    /// [`RECONNECT_DELAY_KEEPING_MAX`] after it, if that is before `retry_at`.
    failed_at: Option<Instant>,
}

impl Backoff {
    /// When an attempt for a request of `purpose` may start; `None`: now.
    fn retry_at(&self, purpose: Purpose) -> Option<Instant> {
        match (purpose, self.failed_at) {
            (Purpose::Keeping, Some(failed_at)) => self
                .retry_at
                .map(|retry_at| retry_at.min(failed_at + RECONNECT_DELAY_KEEPING_MAX)),
            _ => self.retry_at,
        }
    }
}

/// Whether a request keeps leases alive, and so may reconnect sooner than the backoff
/// ([`RECONNECT_DELAY_KEEPING_MAX`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// Any request.
    Other,
    /// A renewal, a session's keep-alive or its close, a release.
    Keeping,
}

/// Sends AUTH on a new connection, before anything else; closes it if refused.
async fn authenticate(conn: &Arc<Conn>, credentials: &Credentials) -> Result<()> {
    let request = Request::Auth {
        name: Bytes::copy_from_slice(credentials.name.as_bytes()),
        secret: tenure_protocol::Secret(credentials.secret.clone()),
    };
    request.validate().map_err(Error::invalid)?;
    match conn.call(request).await? {
        Response::Authenticated { .. } => Ok(()),
        other => {
            conn.shared.fail("authentication refused");
            Err(unexpected("AUTH", other))
        }
    }
}

impl Router {
    /// Parses `addr` (one or several comma-separated endpoints) and connects to the first
    /// that answers, each tried once.
    ///
    /// # Errors
    /// As [`Client::connect`](crate::Client::connect).
    pub(crate) async fn connect(addr: impl Into<String>, config: ClientConfig) -> Result<Router> {
        let addr = addr.into();
        let endpoints: Vec<String> = addr
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_owned)
            .collect();
        let Some(first) = endpoints.first().cloned() else {
            return Err(Error::Invalid {
                code: ErrorCode::BadArgs,
                message: format!("no server address in {addr:?}"),
            });
        };
        let router = Router {
            inner: Arc::new(Inner {
                addr,
                endpoints,
                next: Mutex::new(first),
                config,
                current: Mutex::new(None),
                current_addr: Mutex::new(String::new()),
                reconnect: tokio::sync::Mutex::new(Backoff {
                    failures: 0,
                    retry_at: None,
                    failed_at: None,
                }),
            }),
        };
        // Each endpoint once, at once: a cluster with one node down still connects.
        let mut last = None;
        for _ in 0..router.inner.endpoints.len() {
            match router.connection().await {
                Ok(_) => return Ok(router),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one endpoint was tried"))
    }

    /// The address(es) as given.
    pub(crate) fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// Every address to try, in order.
    pub(crate) fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
    }

    /// The configuration the client was made with.
    pub(crate) fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// The address the next connection goes to.
    fn next_target(&self) -> String {
        self.inner
            .next
            .lock()
            .expect("client mutex poisoned")
            .clone()
    }

    /// Makes the next connection go to the endpoint after `failed` in the list (to the first
    /// if `failed` is not in it, as a leader's address named by a follower may not be).
    fn advance_from(&self, failed: &str) {
        let endpoints = &self.inner.endpoints;
        let at = endpoints.iter().position(|e| e == failed);
        let next = at.map_or(0, |i| (i + 1) % endpoints.len());
        *self.inner.next.lock().expect("client mutex poisoned") = endpoints[next].clone();
    }

    /// there is no connection.
    pub(crate) fn server_limits(&self) -> Option<ServerLimits> {
        let current = self.inner.current.lock().expect("client mutex poisoned");
        current.as_ref().map(|conn| conn.limits)
    }

    /// True while the client has a live connection.
    pub(crate) fn is_connected(&self) -> bool {
        self.live().is_some()
    }

    /// Closes the connection at once, as a crash would: requests in flight fail with
    /// [`Error::ConnectionLost`], locks taken with `release_on_disconnect` are freed by the
    /// server, and lease guards hear about it. The next request reconnects.
    pub(crate) fn disconnect(&self) {
        let conn = self
            .inner
            .current
            .lock()
            .expect("client mutex poisoned")
            .take();
        if let Some(conn) = conn {
            conn.shared.fail("disconnected by the client");
        }
    }

    /// The current connection, unless it has closed.
    fn live(&self) -> Option<Arc<Conn>> {
        let current = self.inner.current.lock().expect("client mutex poisoned");
        current.as_ref().filter(|conn| !conn.is_closed()).cloned()
    }

    /// The live connection, opening a new one if needed (after the backoff delay, if the last
    /// attempt failed).
    pub(crate) async fn connection(&self) -> Result<Arc<Conn>> {
        self.connection_for(Purpose::Other).await
    }

    /// [`Router::connection`] for a request of `purpose`: one that keeps leases alive waits
    /// at most [`RECONNECT_DELAY_KEEPING_MAX`] after a failed attempt.
    async fn connection_for(&self, purpose: Purpose) -> Result<Arc<Conn>> {
        if let Some(conn) = self.live() {
            return Ok(conn);
        }
        let mut backoff = self.inner.reconnect.lock().await;
        if let Some(conn) = self.live() {
            return Ok(conn);
        }
        if let Some(retry_at) = backoff.retry_at(purpose) {
            tokio::time::sleep_until(retry_at).await;
        }
        // An attempt ahead of the backoff (lease keeping's): its failure must not raise the
        // backoff of everyone else, which counts the attempts the backoff itself allowed.
        let early = backoff
            .retry_at
            .is_some_and(|retry_at| Instant::now() < retry_at);
        let config = &self.inner.config;
        let target = self.next_target();
        // A caller that stops waiting mid-connect (its own time-out, shorter than
        // connect_timeout) must not leave the next attempt aimed at the same hung node.
        let mut moved_on = MoveOnIfDropped {
            router: self,
            target: &target,
            armed: self.inner.endpoints.len() > 1,
        };
        let opened = tokio::time::timeout(config.connect_timeout, async {
            let conn = Conn::open(&target, config.in_flight_max, config.tls.as_ref()).await?;
            if let Some(credentials) = &config.credentials {
                authenticate(&conn, credentials).await?;
            }
            Ok(conn)
        })
        .await
        .unwrap_or(Err(Error::Timeout(config.connect_timeout)));
        moved_on.armed = false;
        match opened {
            Ok(conn) => {
                backoff.failures = 0;
                backoff.retry_at = None;
                backoff.failed_at = None;
                *self.inner.current.lock().expect("client mutex poisoned") = Some(conn.clone());
                *self
                    .inner
                    .current_addr
                    .lock()
                    .expect("client mutex poisoned") = target.clone();
                Ok(conn)
            }
            Err(e) if early => {
                backoff.failed_at = Some(Instant::now());
                self.advance_from(&target);
                Err(e)
            }
            Err(e) => {
                backoff.failed_at = Some(Instant::now());
                backoff.failures = backoff.failures.saturating_add(1);
                self.advance_from(&target);
                // With several endpoints the next one is tried at once; the delay comes
                // after a whole round of them has failed.
                let rounds = backoff.failures / self.endpoint_count();
                let round_done = backoff.failures % self.endpoint_count() == 0;
                backoff.retry_at =
                    round_done.then(|| Instant::now() + self.reconnect_delay(rounds));
                Err(e)
            }
        }
    }

    /// How many endpoints there are: a whole round of failed attempts is that many.
    fn endpoint_count(&self) -> u32 {
        u32::try_from(self.inner.endpoints.len()).unwrap_or(u32::MAX)
    }

    /// Exponential backoff with "equal jitter": a random delay in `[d/2, d]`, where `d`
    /// doubles per failure from the minimum up to the maximum.
    fn reconnect_delay(&self, failures: u32) -> Duration {
        let config = &self.inner.config;
        let doublings = failures.saturating_sub(1).min(20);
        let delay = config
            .reconnect_delay_min
            .saturating_mul(1 << doublings)
            .min(config.reconnect_delay_max);
        let half = delay / 2;
        half + half.mul_f64(rand::rng().random::<f64>())
    }

    /// [`Router::call`] of a request without an id whose send is safe to repeat: one whose
    /// outcome is unknown ([`Error::is_transient`]: a lost connection, a time-out,
    /// `NOT_LEADER`, `SHUTTING_DOWN`) is sent again, pausing as an ACQUIRE's retries do,
    /// until [`ClientConfig::acquire_retry_for`] (at least the request time-out) after the
    /// first send. The answer is the last send's, with that send's `sent_at`.
    pub(crate) async fn call_retrying(&self, request: Request) -> Result<Answer> {
        let config = self.config();
        let give_up_at = Instant::now() + config.acquire_retry_for.max(config.request_timeout);
        let mut pause = RETRY_PAUSE_MIN;
        // The previous send's unknown outcome: what the caller hears if the next send is cut
        // short by the retries running out, as for an ACQUIRE (outside test a61: it heard a
        // "no answer within 201ms" of the cut-short send, not the connection's end).
        let mut last: Option<Error> = None;
        loop {
            let left = give_up_at.saturating_duration_since(Instant::now());
            let timeout = config.request_timeout.min(left).max(RETRY_TIMEOUT_MIN);
            match self.call(request.clone(), timeout).await {
                Err(e) if e.is_transient() && Instant::now() + pause < give_up_at => {
                    tracing::debug!(error = %e, "outcome unknown; sending it again");
                    last = Some(e);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                Err(Error::Timeout(t)) if t < config.request_timeout && last.is_some() => {
                    return Err(last.expect("checked"));
                }
                answered => return answered,
            }
        }
    }

    /// Sends `request` and waits up to `timeout` for the answer; returns the connection it
    /// went over and when the send that got it started. An ERROR reply is returned as a
    /// response, not an error.
    pub(crate) async fn call(&self, request: Request, timeout: Duration) -> Result<Answer> {
        self.call_for(request, timeout, Purpose::Other).await
    }

    /// [`Router::call`] for a request of `purpose` (see [`Purpose`]).
    pub(crate) async fn call_for(
        &self,
        request: Request,
        timeout: Duration,
        purpose: Purpose,
    ) -> Result<Answer> {
        let sending = Sending::default();
        let answer =
            tokio::time::timeout(timeout, self.call_on(request, timeout, &sending, purpose));
        answer.await.unwrap_or_else(|_| {
            let hung = sending.take();
            if let Some(conn) = hung.as_ref() {
                self.leave_hung(conn, timeout);
            }
            // Cut short while still searching (not waiting on a node that took the request):
            // the NOT_LEADER the search met says more than "no answer" (outside test a67, 4).
            match sending.refusal() {
                Some(refusal) if hung.is_none() => Err(refusal),
                _ => Err(Error::Timeout(timeout)),
            }
        })
    }

    /// [`Router::call`] without its time-out: `sending` holds the connection a send is
    /// waiting on, for the caller to leave if its time-out strikes then.
    async fn call_on(
        &self,
        request: Request,
        timeout: Duration,
        sending: &Sending,
        purpose: Purpose,
    ) -> Result<Answer> {
        request.validate().map_err(Error::invalid)?;
        let search_until =
            Instant::now() + timeout.mul_f64(LEADER_SEARCH_SHARE).min(LEADER_SEARCH_MAX);
        {
            let mut redirects = 0;
            let mut pause = ROUND_PAUSE_MIN;
            loop {
                let conn = match self.connection_for(purpose).await {
                    Ok(conn) => conn,
                    // A cluster's node that cannot be reached (often the dead leader the
                    // others still name): `connection` moved on to the next endpoint, and
                    // backs off after a whole round of them failed.
                    // Or one whose front (a proxy) accepts and closes: ConnectionLost.
                    Err(Error::Io(_) | Error::Timeout(_) | Error::ConnectionLost(_))
                        if self.inner.endpoints.len() > 1 && Instant::now() < search_until =>
                    {
                        continue;
                    }
                    // The search's NOT_LEADER, not the failure of a node it cannot reach,
                    // which says neither which node nor why (outside test a65, 2). An
                    // error, as that failure was, so that callers send again alike.
                    Err(e @ (Error::Io(_) | Error::Timeout(_) | Error::ConnectionLost(_))) => {
                        return Err(sending.refusal().unwrap_or(e));
                    }
                    Err(e) => return Err(e),
                };
                let sent_at = Instant::now();
                sending.waiting(Some(&conn));
                let response = conn.call(request.clone()).await?;
                sending.waiting(None);
                let Response::Error {
                    code: ErrorCode::NotLeader,
                    message,
                } = &response
                else {
                    return Ok(Answer {
                        response,
                        conn,
                        sent_at,
                    });
                };
                // A follower executes nothing, so the request is sent again to the leader;
                // a leader that lost its place mid-change may have executed it, which the
                // answer the search ends with must still say (outside test a67, 2).
                if says_outcome_unknown(&response) {
                    sending.maybe_executed.store(true, Ordering::Relaxed);
                }
                sending.refused_with(message);
                redirects += 1;
                if redirects > self.redirects_max() {
                    // A round found no leader: an election is under way, or the nodes still
                    // name one that died. Pause, then look again while time is left.
                    if Instant::now() + pause >= search_until {
                        let response = match sending.refused_message() {
                            Some(message) => Response::Error {
                                code: ErrorCode::NotLeader,
                                message,
                            },
                            None => response,
                        };
                        return Ok(Answer {
                            response,
                            conn,
                            sent_at,
                        });
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(ROUND_PAUSE_MAX);
                    redirects = 0;
                }
                self.follow(&conn, message).await;
            }
        }
    }

    /// After a request on `conn` got no answer within `timeout`: with several endpoints the
    /// node may be hung (a stopped process still accepts connections and never answers), so
    /// the connection is closed and the next one goes to the next endpoint; a live leader is
    /// found again through NOT_LEADER. With one endpoint there is nowhere else to go, and
    /// the connection stays (a slow answer is not a dead server).
    fn leave_hung(&self, conn: &Arc<Conn>, timeout: Duration) {
        if self.inner.endpoints.len() < 2 {
            return;
        }
        {
            let mut current = self.inner.current.lock().expect("client mutex poisoned");
            if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                return; // already replaced: someone else dealt with it
            }
            *current = None;
        }
        let addr = self
            .inner
            .current_addr
            .lock()
            .expect("client mutex poisoned")
            .clone();
        tracing::debug!(%addr, ?timeout, "no answer in time; trying the next endpoint");
        conn.shared
            .fail(&format!("{addr}: no answer within {timeout:?}"));
        self.advance_from(&addr);
    }

    /// Sends an ACQUIRE that carries an acquire id and, while its outcome is unknown (the
    /// connection lost, no answer in time, a transient ERROR such as `NOT_LEADER` or
    /// `SHUTTING_DOWN`), sends the same ACQUIRE with the same acquire id again, on a new
    /// connection and to the new leader, until `give_up_at` (PROTOCOL.md 3.9). A blocking
    /// ACQUIRE is sent again with the wait it has left (`wait_until`), never the whole wait.
    ///
    /// Each send runs on a task of its own that outlives the caller: a grant that arrives
    /// after the caller stopped waiting (it gave up, or its future was dropped) is released
    /// by that task, once per lease id, unless it is the grant the caller kept. Otherwise a
    /// grant nobody will ever hear of would block the key for its whole TTL.
    ///
    /// # Errors
    /// The last unknown outcome's error once `give_up_at` has passed, or the first error
    /// that is not transient.
    pub(crate) async fn call_acquire(
        &self,
        request: Request,
        key: Bytes,
        wait_until: Instant,
        give_up_at: Instant,
    ) -> Result<AcquireAnswer> {
        let first_sent_at = Instant::now();
        let first_conn = Arc::new(OnceLock::new());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut waiting = Waiting {
            router: self.clone(),
            key: key.clone(),
            settle: Arc::new(Mutex::new(Settle::Open)),
            rx,
            in_flight: 0,
            answered: None,
            maybe_executed: Arc::default(),
        };
        let mut pause = RETRY_PAUSE_MIN;
        let mut hung = Vec::new();
        // The previous send's unknown outcome, what the caller hears if the next send is cut
        // short by the retries running out (not by a time-out of its own).
        let mut last: Option<Error> = None;
        let failure = loop {
            let now = Instant::now();
            let wait_ms = millis_until(wait_until, now);
            let sending = Arc::new(Sending {
                first: Arc::clone(&first_conn),
                maybe_executed: Arc::clone(&waiting.maybe_executed),
                ..Sending::default()
            });
            let attempt = Attempt {
                router: self.clone(),
                request: with_wait(&request, wait_ms),
                key: key.clone(),
                settle: Arc::clone(&waiting.settle),
                sending: Arc::clone(&sending),
            };
            tokio::spawn(attempt.run(tx.clone()));
            waiting.in_flight += 1;
            let answer_by = now + self.inner.config.request_timeout + ms(wait_ms);
            let failure = match waiting.next(answer_by.min(give_up_at)).await {
                Step::Settled(answer) => {
                    waiting.kept(&answer.response);
                    let first_conn = first_conn.get().cloned();
                    return Ok(AcquireAnswer {
                        answer,
                        first_sent_at,
                        first_conn,
                    });
                }
                Step::Failed(e) => break e,
                Step::Unknown(e) => e,
                Step::NoAnswer => {
                    if sending.is_waiting() {
                        waiting.note_maybe_executed();
                    }
                    hung.push(sending);
                    match last.take() {
                        // Say every node answered NOT_LEADER: the last send, still looking
                        // for a leader when the time ran out, is no "no answer".
                        Some(previous) if give_up_at < answer_by => break previous,
                        _ => Error::Timeout(answer_by.saturating_duration_since(now)),
                    }
                }
            };
            if Instant::now() + pause >= give_up_at {
                break failure;
            }
            tracing::debug!(error = %failure, "ACQUIRE outcome unknown; sending it again");
            last = Some(failure);
            self.leave_all_hung(hung.drain(..));
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_PAUSE_MAX);
        };
        self.leave_all_hung(hung.drain(..));
        waiting.gave_up().await;
        // The last answer a send got (NOT_LEADER, say) is reported rather than a later
        // send's time-out, which names neither the node nor why (outside test a65, 2: a
        // cut-off leader's NOT_LEADER gave way to a stopped follower's "no answer in 1s").
        let failure = match (failure, waiting.answered.take()) {
            (Error::Timeout(_) | Error::Io(_) | Error::ConnectionLost(_), Some(answer)) => answer,
            (failure, _) => failure,
        };
        Err(unknown_if(
            waiting.maybe_executed.load(Ordering::Relaxed),
            failure,
        ))
    }

    /// Leaves the connection each of `hung` sends still waits on (see [`Router::leave_hung`]).
    fn leave_all_hung(&self, hung: impl Iterator<Item = Arc<Sending>>) {
        for sending in hung {
            if let Some(conn) = sending.take() {
                self.leave_hung(&conn, self.inner.config.request_timeout);
            }
        }
    }

    /// After `NOT_LEADER` from `conn`: closes it and points the next connection at the
    /// leader it named, or, while no leader is known (an election), at the next endpoint
    /// after a short pause.
    pub(crate) async fn follow(&self, conn: &Arc<Conn>, message: &str) {
        {
            let mut current = self.inner.current.lock().expect("client mutex poisoned");
            if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                *current = None;
            }
        }
        conn.shared.fail("not the leader");
        let target = self.next_target();
        match tenure_protocol::error::leader_hint(message) {
            // A node may name itself: one taking over (it will serve in a moment), or a
            // leader cut off from its followers that openraft still calls leader. Asking it
            // again could go on as long as the partition does while the majority elected
            // someone else, so it counts as "no leader known": the next endpoint is asked.
            Some(Some(leader)) if leader != target => {
                *self.inner.next.lock().expect("client mutex poisoned") = leader.to_owned();
            }
            _ => {
                self.advance_from(&target);
                tokio::time::sleep(ELECTION_PAUSE).await;
            }
        }
    }

    /// Most NOT_LEADER answers one request follows before it reports one: a round of the
    /// endpoints, and a few more for a leader that changes meanwhile.
    pub(crate) fn redirects_max(&self) -> usize {
        self.inner.endpoints.len() + REDIRECTS_EXTRA
    }

    /// Sends `request` with the configured time-out and returns the answer alone.
    pub(crate) async fn call_plain(&self, request: Request) -> Result<Response> {
        let timeout = self.inner.config.request_timeout;
        Ok(self.call(request, timeout).await?.response)
    }

    /// Sends RENEW `request`; returns its outcome and when the send that got it started.
    pub(crate) async fn renew_sent_at(&self, request: Request) -> Result<(RenewOutcome, Instant)> {
        let timeout = self.inner.config.request_timeout;
        let answer = self.call(request, timeout).await?;
        Ok((renew_outcome(answer.response)?, answer.sent_at))
    }

    /// Sends a RELEASE of `key` by `lease_id` and reads its outcome.
    pub(crate) async fn release(&self, key: &[u8], lease_id: LeaseId) -> Result<ReleaseOutcome> {
        let request = Request::Release {
            key: Bytes::copy_from_slice(key),
            lease_id,
        };
        // Freeing a lease is lease keeping too (as a session's close is): a release after a
        // restart reconnects as soon as a renewal would, not after the whole backoff, so the
        // next waiter need not wait out the restored lease's TTL (outside test a36, claim 5).
        let timeout = self.inner.config.request_timeout;
        let answer = self.call_for(request, timeout, Purpose::Keeping).await?;
        match answer.response {
            Response::Released => Ok(ReleaseOutcome::Released),
            Response::NotOwner => Ok(ReleaseOutcome::NotOwner),
            other => Err(unexpected("RELEASE", other)),
        }
    }
}
