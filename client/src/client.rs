//! [`Client`]: one multiplexed connection shared by many tasks, with typed outcomes.
//!
//! Every method validates its arguments against the wire limits before sending, waits at most
//! [`ClientConfig::request_timeout`] for the answer (a blocking acquire adds its wait), and
//! returns the server's answer as an enum: LOCKED, LOST, NOT_OWNER and STALE are outcomes, not
//! errors.
//!
//! # Reconnection
//! When the connection dies, every request in flight fails with [`Error::ConnectionLost`]
//! and every lease guard hears about it at once. The client does not reconnect by itself: the
//! next request does. A failed attempt makes the following one wait an exponentially growing,
//! jittered delay (from [`ClientConfig::reconnect_delay_min`] up to
//! [`ClientConfig::reconnect_delay_max`]); the first success resets it.
//!
//! With several endpoints (a cluster), a request that gets no answer within its time-out
//! also closes its connection and points the next one at the next endpoint: a hung node (a
//! stopped process still accepts connections but never answers) is left rather than waited
//! on again. A connect abandoned by its caller moves on likewise. A lease guard's renewal
//! then waits at most `min(request_timeout, renew_every)` per attempt, so it can retry at
//! the new leader before its lease runs out.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use rand::Rng;
use tenure_protocol::handshake::ServerLimits;
use tenure_protocol::limits::{IN_FLIGHT_MAX_DEFAULT, WAIT_MS_MAX};
use tenure_protocol::{ErrorCode, EventKind, LeaseId, Request, Response};
use tokio::time::Instant;

use crate::conn::{Conn, WatchRegistration};
use crate::error::{Error, Result};
use crate::lease::{Granted, KeepAliveOptions, Lease, LeaseGuard};

/// Most events a watch queues for a consumer that is not reading; past it the watch is
/// dropped with [`Error::WatchOverflow`] rather than stall the connection.
pub const WATCH_EVENTS_MAX: usize = 1024;

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

/// How a [`Client`] talks to the server.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Longest wait for the answer to one request; a blocking acquire adds its `wait`.
    pub request_timeout: Duration,
    /// Longest wait to open a connection and finish the handshake.
    pub connect_timeout: Duration,
    /// Delay before the attempt that follows a first failed reconnect.
    pub reconnect_delay_min: Duration,
    /// Cap on the delay between reconnect attempts.
    pub reconnect_delay_max: Duration,
    /// Most requests kept in flight on the connection; the server's cap (announced in the
    /// handshake) wins when it is lower.
    pub in_flight_max: u32,
    /// The identity to authenticate as, right after the handshake of every connection
    /// (reconnects included); `None` for a server without identities.
    pub credentials: Option<Credentials>,
    /// TLS to the server; `None`: plain TCP.
    pub tls: Option<crate::tls::TlsOptions>,
}

/// [`ClientConfig`] by another name: the options a [`Client`] is made with.
pub type ClientOptions = ClientConfig;

impl ClientConfig {
    /// These options, speaking TLS as `tls` says.
    pub fn with_tls(mut self, tls: crate::tls::TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    /// These options, authenticating as `name` with `secret` on every connection.
    pub fn with_credentials(mut self, name: impl Into<String>, secret: impl Into<Bytes>) -> Self {
        self.credentials = Some(Credentials {
            name: name.into(),
            secret: secret.into(),
        });
        self
    }
}

/// An identity's name and secret. `Debug` does not show the secret.
#[derive(Clone)]
pub struct Credentials {
    /// The identity's name.
    pub name: String,
    /// Its secret.
    pub secret: Bytes,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("name", &self.name)
            .field("secret", &"<secret>")
            .finish()
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            reconnect_delay_min: Duration::from_millis(50),
            reconnect_delay_max: Duration::from_secs(5),
            in_flight_max: IN_FLIGHT_MAX_DEFAULT,
            credentials: None,
            tls: None,
        }
    }
}

/// Options of one acquire.
#[derive(Clone, Debug, Default)]
pub struct AcquireOptions {
    /// How long to wait in line if the lock is held; zero answers LOCKED at once. Waiters are
    /// served first come, first served.
    pub wait: Duration,
    /// Holder metadata, readable by INSPECT and watchers (for example a leader's address).
    pub meta: Bytes,
    /// Free the lock the moment this client's connection closes, instead of at the lease's
    /// end. The lease is then tied to this connection: after a reconnect it is gone.
    pub release_on_disconnect: bool,
}

impl AcquireOptions {
    /// Options that wait in line up to `wait`.
    pub fn wait(wait: Duration) -> AcquireOptions {
        AcquireOptions {
            wait,
            ..AcquireOptions::default()
        }
    }
}

/// The current holder of a lock, as reported to an acquire that did not get it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockedBy {
    /// The holder's fencing token.
    pub token: u64,
    /// Time left on the holder's lease, by the server's clock.
    pub ttl_left: Duration,
}

/// The answer to an acquire: the lock (as a [`Lease`] or [`LeaseGuard`]), or who holds it.
#[derive(Debug)]
pub enum AcquireOutcome<T = Lease> {
    /// The lock is yours.
    Granted(T),
    /// Someone else holds the lock (and the wait, if any, ran out).
    Locked(LockedBy),
}

impl<T> AcquireOutcome<T> {
    /// The lease, if granted.
    pub fn granted(self) -> Option<T> {
        match self {
            AcquireOutcome::Granted(lease) => Some(lease),
            AcquireOutcome::Locked(_) => None,
        }
    }
}

/// The answer to a renew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenewOutcome {
    /// The lease now runs `ttl` from the server's receipt of the renewal.
    Renewed {
        /// The lease length granted.
        ttl: Duration,
    },
    /// The lease is gone (expired, released, or never this lease id's): stop working.
    Lost,
}

/// The answer to a release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The lock was released.
    Released,
    /// The lease id does not hold the lock (it expired or was released); nothing changed.
    NotOwner,
}

/// The answer to an inspect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyState {
    /// Nobody holds the key.
    Free,
    /// The key is held.
    Held {
        /// The holder's fencing token.
        token: u64,
        /// Time left on the holder's lease, by the server's clock.
        ttl_left: Duration,
        /// Acquires waiting in line.
        waiters: u32,
        /// The holder's metadata.
        meta: Bytes,
    },
}

/// The answer to a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckOutcome {
    /// The token belongs to the live holder.
    Current,
    /// The token does not belong to the live holder.
    Stale,
}

/// One change to a watched key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    /// What happened.
    pub kind: EventKind,
    /// The key that changed.
    pub key: Bytes,
    /// The fencing token of the lease granted, released or expired.
    pub token: u64,
    /// The new holder's metadata (empty unless `kind` is `Granted`).
    pub meta: Bytes,
}

/// A handle to one connection to a tenure server, cheap to clone and share between tasks.
///
/// Requests from all clones are multiplexed on one TCP connection by request id, so many can
/// be in flight at once (up to the server's in-flight cap) and a blocking acquire does not
/// hold up the others. Dropping the last clone (and every [`Lease`], guard and [`Watch`],
/// which hold clones) closes the connection.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

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
    client: &'a Client,
    target: &'a str,
    armed: bool,
}

impl Drop for MoveOnIfDropped<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.client.advance_from(self.target);
        }
    }
}

/// Reconnect state: failed attempts in a row and when the next one may start.
struct Backoff {
    failures: u32,
    retry_at: Option<Instant>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("addr", &self.inner.addr)
            .field("connected", &self.is_connected())
            .finish()
    }
}

fn duration_ms(duration: Duration) -> u32 {
    // Out-of-range values become u32::MAX, which the limit checks then reject by name.
    u32::try_from(duration.as_millis()).unwrap_or(u32::MAX)
}

fn unexpected(request: &str, response: Response) -> Error {
    match response {
        Response::Error { code, message } => Error::Server { code, message },
        other => Error::Protocol(format!("unexpected reply {other:?} to {request}")),
    }
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

impl Client {
    /// Connects to `addr` (`host:port`) with the default [`ClientConfig`].
    ///
    /// `addr` may list several servers separated by commas (`a:7878,b:7878,c:7878`), the
    /// nodes of a cluster: the first that accepts a connection is used, and a node answering
    /// `NOT_LEADER` is left for the leader it names (the request is sent again there; a
    /// follower executes nothing). While no leader is known the client tries the next node
    /// after a short pause, up to one redirect per node and three more per round; rounds that
    /// find no leader are repeated after a pause (50 ms doubling to 400 ms) for up to the
    /// request's time-out or 10 s, whichever is shorter, then the last NOT_LEADER is
    /// returned ([`Error::Server`], transient). A leader
    /// that loses its leadership mid-request answers NOT_LEADER too, and then the request may
    /// have taken effect: an ACQUIRE sent again may find the key held by that first, unknown
    /// grant (LOCKED) until its TTL runs out.
    ///
    /// A node that takes a request and never answers (a stopped process) is left once the
    /// request times out: the connection is closed and the next request starts at the next
    /// address (see the module documentation).
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Timeout`] when the server cannot be reached, or a handshake
    /// error ([`Error::Protocol`], [`Error::VersionMismatch`]).
    pub async fn connect(addr: impl Into<String>) -> Result<Client> {
        Client::connect_with(addr, ClientConfig::default()).await
    }

    /// Connects to `addr` with `config`.
    ///
    /// # Errors
    /// As [`Client::connect`].
    pub async fn connect_with(addr: impl Into<String>, config: ClientConfig) -> Result<Client> {
        let addr = addr.into();
        let endpoints: Vec<String> = addr
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_owned)
            .collect();
        let Some(first) = endpoints.first().cloned() else {
            return Err(Error::Invalid {
                code: tenure_protocol::ErrorCode::BadArgs,
                message: format!("no server address in {addr:?}"),
            });
        };
        let client = Client {
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
                }),
            }),
        };
        // Each endpoint once, at once: a cluster with one node down still connects.
        let mut last = None;
        for _ in 0..client.inner.endpoints.len() {
            match client.connection().await {
                Ok(_) => return Ok(client),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one endpoint was tried"))
    }

    /// The server address(es) this client was given (`a,b,c` for a cluster).
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// Every server address this client tries, in order.
    pub fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
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

    /// The configuration this client was made with.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// The limits the server announced in the handshake of the current connection (longest
    /// TTL and wait, key and metadata lengths, frame size, requests in flight); `None` while
    /// there is no connection.
    pub fn server_limits(&self) -> Option<ServerLimits> {
        let current = self.inner.current.lock().expect("client mutex poisoned");
        current.as_ref().map(|conn| conn.limits)
    }

    /// True while the client has a live connection.
    pub fn is_connected(&self) -> bool {
        self.live().is_some()
    }

    /// Closes the connection at once, as a crash would: requests in flight fail with
    /// [`Error::ConnectionLost`], locks taken with `release_on_disconnect` are freed by the
    /// server, and lease guards hear about it. The next request reconnects.
    pub fn disconnect(&self) {
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

    fn live(&self) -> Option<Arc<Conn>> {
        let current = self.inner.current.lock().expect("client mutex poisoned");
        current.as_ref().filter(|conn| !conn.is_closed()).cloned()
    }

    /// The live connection, opening a new one if needed (after the backoff delay, if the last
    /// attempt failed).
    pub(crate) async fn connection(&self) -> Result<Arc<Conn>> {
        if let Some(conn) = self.live() {
            return Ok(conn);
        }
        let mut backoff = self.inner.reconnect.lock().await;
        if let Some(conn) = self.live() {
            return Ok(conn);
        }
        if let Some(retry_at) = backoff.retry_at {
            tokio::time::sleep_until(retry_at).await;
        }
        let config = &self.inner.config;
        let target = self.next_target();
        // A caller that stops waiting mid-connect (its own time-out, shorter than
        // connect_timeout) must not leave the next attempt aimed at the same hung node.
        let mut moved_on = MoveOnIfDropped {
            client: self,
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
                *self.inner.current.lock().expect("client mutex poisoned") = Some(conn.clone());
                *self
                    .inner
                    .current_addr
                    .lock()
                    .expect("client mutex poisoned") = target.clone();
                Ok(conn)
            }
            Err(e) => {
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

    /// Sends `request` and waits up to `timeout` for the answer; returns the connection it
    /// went over and when the send that got it started. An ERROR reply is returned as a
    /// response, not an error.
    pub(crate) async fn call(&self, request: Request, timeout: Duration) -> Result<Answer> {
        let waiting_on = Mutex::new(None);
        let answer = tokio::time::timeout(timeout, self.call_on(request, timeout, &waiting_on));
        answer.await.unwrap_or_else(|_| {
            let hung = waiting_on.lock().expect("client mutex poisoned").take();
            if let Some(conn) = hung {
                self.leave_hung(&conn, timeout);
            }
            Err(Error::Timeout(timeout))
        })
    }

    /// [`Client::call`] without its time-out: `waiting_on` holds the connection a send is
    /// waiting on, for the caller to leave if its time-out strikes then.
    async fn call_on(
        &self,
        request: Request,
        timeout: Duration,
        waiting_on: &Mutex<Option<Arc<Conn>>>,
    ) -> Result<Answer> {
        request.validate().map_err(Error::invalid)?;
        let search_until =
            Instant::now() + timeout.mul_f64(LEADER_SEARCH_SHARE).min(LEADER_SEARCH_MAX);
        {
            let mut redirects = 0;
            let mut pause = ROUND_PAUSE_MIN;
            loop {
                let conn = match self.connection().await {
                    Ok(conn) => conn,
                    // A cluster's node that cannot be reached (often the dead leader the
                    // others still name): `connection` moved on to the next endpoint, and
                    // backs off after a whole round of them failed.
                    Err(Error::Io(_) | Error::Timeout(_))
                        if self.inner.endpoints.len() > 1 && Instant::now() < search_until =>
                    {
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let sent_at = Instant::now();
                *waiting_on.lock().expect("client mutex poisoned") = Some(Arc::clone(&conn));
                let response = conn.call(request.clone()).await?;
                *waiting_on.lock().expect("client mutex poisoned") = None;
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
                // A follower executes nothing, so the request is sent again to the leader.
                redirects += 1;
                if redirects > self.inner.endpoints.len() + REDIRECTS_EXTRA {
                    // A round found no leader: an election is under way, or the nodes still
                    // name one that died. Pause, then look again while time is left.
                    if Instant::now() + pause >= search_until {
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

    /// Sends an ACQUIRE and waits up to `timeout` for its answer, as [`Client::call`], except
    /// that the request runs on a task of its own that outlives the caller: if the caller
    /// stops waiting (the time-out passed, or its future was dropped) and the answer turns
    /// out to be a grant, that task releases it. Otherwise a grant nobody will ever hear of
    /// would block the key for its whole TTL.
    async fn call_acquire(
        &self,
        request: Request,
        key: Bytes,
        timeout: Duration,
    ) -> Result<Answer> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let client = self.clone();
        let waiting_on = Arc::new(Mutex::new(None));
        let sending = Arc::clone(&waiting_on);
        tokio::spawn(async move {
            // No time-out here: the connection's life bounds the wait.
            let answer = client.call_on(request, Duration::MAX, &sending).await;
            if let Err(Ok(Answer {
                response: Response::Granted { lease_id, .. },
                ..
            })) = tx.send(answer)
            {
                tracing::debug!("releasing a grant that arrived after its caller gave up");
                let _ = client.release(&key, lease_id).await;
            }
        });
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(Error::ConnectionLost("the acquire's task ended".into())),
            Err(_) => {
                // The server answers a blocking acquire (LOCKED) when its wait ends, so no
                // answer by now means a hung node; a grant it still sends is unknown anyway.
                let hung = waiting_on.lock().expect("client mutex poisoned").take();
                if let Some(conn) = hung {
                    self.leave_hung(&conn, timeout);
                }
                Err(Error::Timeout(timeout))
            }
        }
    }

    /// After `NOT_LEADER` from `conn`: closes it and points the next connection at the
    /// leader it named, or, while no leader is known (an election), at the next endpoint
    /// after a short pause.
    async fn follow(&self, conn: &Arc<Conn>, message: &str) {
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

    async fn call_plain(&self, request: Request) -> Result<Response> {
        let timeout = self.inner.config.request_timeout;
        Ok(self.call(request, timeout).await?.response)
    }

    /// Asks for `key` for `ttl`, waiting in line up to `options.wait` if it is held.
    ///
    /// The returned [`Lease`]'s local deadline is counted from an instant taken before the
    /// request was sent (before the last send, if `NOT_LEADER` made the client send it again
    /// to the leader), plus the time the server says the request waited in line before the
    /// grant, plus the TTL, so it is never later than the server's.
    ///
    /// A grant that arrives after the caller stopped waiting (the time-out passed, or the
    /// future was dropped) is released by the client, so a key is not left held by a lease
    /// nobody knows of.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty or over-long key, a TTL outside
    /// `TTL_MS_MIN..=TTL_MS_MAX`, a wait over `WAIT_MS_MAX` or over-long metadata; otherwise
    /// any [`Error`] a request can meet.
    pub async fn acquire(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome> {
        let key = Bytes::copy_from_slice(key.as_ref());
        let wait_ms = duration_ms(options.wait);
        let request = Request::Acquire {
            key: key.clone(),
            ttl_ms: duration_ms(ttl),
            wait_ms,
            release_on_disconnect: options.release_on_disconnect,
            meta: options.meta,
        };
        let timeout = self.inner.config.request_timeout
            + Duration::from_millis(u64::from(wait_ms.min(WAIT_MS_MAX)));
        let Answer {
            response,
            conn,
            sent_at,
        } = self.call_acquire(request, key.clone(), timeout).await?;
        match response {
            Response::Granted {
                token,
                lease_id,
                ttl_ms,
                waited_ms,
            } => {
                let granted = Granted {
                    token,
                    lease_id,
                    ttl: Duration::from_millis(u64::from(ttl_ms)),
                    waited: Duration::from_millis(u64::from(waited_ms)),
                };
                let tied_to = options.release_on_disconnect.then(|| conn.shared.clone());
                let lease = Lease::new(self.clone(), key, granted, sent_at, tied_to);
                Ok(AcquireOutcome::Granted(lease))
            }
            Response::Locked { token, ttl_left_ms } => Ok(AcquireOutcome::Locked(LockedBy {
                token,
                ttl_left: Duration::from_millis(u64::from(ttl_left_ms)),
            })),
            other => Err(unexpected("ACQUIRE", other)),
        }
    }

    /// Acquires like [`Client::acquire`] and starts renewing the lease in the background
    /// with default [`KeepAliveOptions`]; see [`LeaseGuard`] for how loss is reported.
    ///
    /// # Errors
    /// As [`Client::acquire`].
    pub async fn lock(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome<LeaseGuard>> {
        Ok(match self.acquire(key, ttl, options).await? {
            AcquireOutcome::Granted(lease) => {
                AcquireOutcome::Granted(lease.keep_alive_with(KeepAliveOptions::default()))
            }
            AcquireOutcome::Locked(by) => AcquireOutcome::Locked(by),
        })
    }

    /// Extends lease `lease_id` on `key` to `ttl` from the server's receipt of the request.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad key or TTL; otherwise any [`Error`] a request can meet.
    pub async fn renew(
        &self,
        key: impl AsRef<[u8]>,
        lease_id: LeaseId,
        ttl: Duration,
    ) -> Result<RenewOutcome> {
        let request = Request::Renew {
            key: Bytes::copy_from_slice(key.as_ref()),
            lease_id,
            ttl_ms: duration_ms(ttl),
        };
        Ok(self.renew_sent_at(request).await?.0)
    }

    /// Sends RENEW `request`; returns its outcome and when the send that got it started.
    pub(crate) async fn renew_sent_at(&self, request: Request) -> Result<(RenewOutcome, Instant)> {
        let timeout = self.inner.config.request_timeout;
        let answer = self.call(request, timeout).await?;
        Ok((renew_outcome(answer.response)?, answer.sent_at))
    }

    /// Releases `key` if lease `lease_id` holds it.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad key; otherwise any [`Error`] a request can meet.
    pub async fn release(
        &self,
        key: impl AsRef<[u8]>,
        lease_id: LeaseId,
    ) -> Result<ReleaseOutcome> {
        let request = Request::Release {
            key: Bytes::copy_from_slice(key.as_ref()),
            lease_id,
        };
        match self.call_plain(request).await? {
            Response::Released => Ok(ReleaseOutcome::Released),
            Response::NotOwner => Ok(ReleaseOutcome::NotOwner),
            other => Err(unexpected("RELEASE", other)),
        }
    }

    /// Reads the state of `key`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad key; otherwise any [`Error`] a request can meet.
    pub async fn inspect(&self, key: impl AsRef<[u8]>) -> Result<KeyState> {
        let request = Request::Inspect {
            key: Bytes::copy_from_slice(key.as_ref()),
        };
        match self.call_plain(request).await? {
            Response::Free => Ok(KeyState::Free),
            Response::Held {
                token,
                ttl_left_ms,
                waiters,
                meta,
            } => Ok(KeyState::Held {
                token,
                ttl_left: Duration::from_millis(u64::from(ttl_left_ms)),
                waiters,
                meta,
            }),
            other => Err(unexpected("INSPECT", other)),
        }
    }

    /// Asks whether `token` belongs to the live holder of `key`. Useful for a resource that
    /// cannot store a fence, at the price of a round trip (and a race: the answer can be out
    /// of date when it arrives; prefer [`crate::fence`]).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad key; otherwise any [`Error`] a request can meet.
    pub async fn check(&self, key: impl AsRef<[u8]>, token: u64) -> Result<CheckOutcome> {
        let request = Request::Check {
            key: Bytes::copy_from_slice(key.as_ref()),
            token,
        };
        match self.call_plain(request).await? {
            Response::Current => Ok(CheckOutcome::Current),
            Response::Stale => Ok(CheckOutcome::Stale),
            other => Err(unexpected("CHECK", other)),
        }
    }

    /// The server's counters, name and value.
    ///
    /// # Errors
    /// Any [`Error`] a request can meet.
    pub async fn stats(&self) -> Result<Vec<(String, u64)>> {
        match self.call_plain(Request::Stats).await? {
            Response::Stats(pairs) => Ok(pairs),
            other => Err(unexpected("STATS", other)),
        }
    }

    /// Round trip to the server.
    ///
    /// # Errors
    /// Any [`Error`] a request can meet.
    pub async fn ping(&self) -> Result<Duration> {
        let started = Instant::now();
        match self.call_plain(Request::Ping).await? {
            Response::Pong => Ok(started.elapsed()),
            other => Err(unexpected("PING", other)),
        }
    }

    /// Subscribes to changes of `key`: every grant, release and expiry, in the server's order.
    ///
    /// [`Watch::initial_state`] is the key's state when the server registered the watch; the
    /// stream yields every change after it and none before it, so no INSPECT (and no race
    /// with it) is needed. A hand-off shows as two events: released (or expired), then granted.
    ///
    /// The watch lives on the current connection: when it closes the stream yields
    /// [`Error::ConnectionLost`] and ends (watch again; [`crate::Election::observe`] does).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad key, [`Error::Server`] when the server refuses (for
    /// example [`tenure_protocol::ErrorCode::WatchLimit`]); otherwise any [`Error`] a request can meet.
    pub async fn watch(&self, key: impl AsRef<[u8]>) -> Result<Watch> {
        let key = Bytes::copy_from_slice(key.as_ref());
        Request::Watch { key: key.clone() }
            .validate()
            .map_err(Error::invalid)?;
        let timeout = self.inner.config.request_timeout;
        let started = async {
            let conn = self.connection().await?;
            let (reply, registration) = conn.watch(key.clone(), WATCH_EVENTS_MAX).await?;
            Ok::<_, Error>((reply, registration, conn))
        };
        let (reply, registration, conn) = tokio::time::timeout(timeout, started)
            .await
            .unwrap_or(Err(Error::Timeout(timeout)))?;
        let initial_state = match reply {
            Response::Watching { holder: None } => KeyState::Free,
            Response::Watching { holder: Some(h) } => KeyState::Held {
                token: h.token,
                ttl_left: Duration::from_millis(u64::from(h.ttl_left_ms)),
                waiters: h.waiters,
                meta: h.meta,
            },
            other => {
                conn.shared.remove_watch(registration.id, &key);
                return Err(unexpected("WATCH", other));
            }
        };
        Ok(Watch {
            conn,
            key,
            registration,
            initial_state,
            ended: false,
        })
    }
}

pub(crate) fn renew_outcome(response: Response) -> Result<RenewOutcome> {
    match response {
        Response::Renewed { ttl_ms } => Ok(RenewOutcome::Renewed {
            ttl: Duration::from_millis(u64::from(ttl_ms)),
        }),
        Response::Lost => Ok(RenewOutcome::Lost),
        other => Err(unexpected("RENEW", other)),
    }
}

/// A stream of [`WatchEvent`]s for one key, from [`Client::watch`].
///
/// Ends after yielding one error: [`Error::ConnectionLost`] when the connection closes,
/// [`Error::WatchOverflow`] when the consumer fell [`WATCH_EVENTS_MAX`] events behind, or
/// [`Error::Server`] when the server ended the watch (its own queue for this connection
/// overflowed).
/// Dropping it unsubscribes.
pub struct Watch {
    conn: Arc<Conn>,
    key: Bytes,
    registration: WatchRegistration,
    initial_state: KeyState,
    ended: bool,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch").field("key", &self.key).finish()
    }
}

impl Watch {
    /// The key being watched.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The key's state when the watch started (`ttl_left` as of then): the stream's events
    /// are exactly the changes after it.
    pub fn initial_state(&self) -> &KeyState {
        &self.initial_state
    }

    /// The next event, or the error that ended the watch; `None` after that error.
    pub async fn next(&mut self) -> Option<Result<WatchEvent>> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<WatchEvent>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.registration.events.poll_recv(cx) {
            Poll::Ready(Some(Ok(event))) => Poll::Ready(Some(Ok(event))),
            Poll::Ready(Some(Err(e))) => {
                self.ended = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.ended = true;
                let error = if self.registration.overflow.load(Ordering::Acquire) {
                    Error::WatchOverflow
                } else if self.conn.is_closed() {
                    self.conn.shared.lost_error()
                } else {
                    Error::Protocol("the server ended the watch".into())
                };
                Poll::Ready(Some(Err(error)))
            }
        }
    }
}

impl Stream for Watch {
    type Item = Result<WatchEvent>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_event(cx)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let others = self
            .conn
            .shared
            .remove_watch(self.registration.id, &self.key);
        if others || self.conn.is_closed() {
            return;
        }
        // Unsubscribing is a courtesy (the server drops watches with the connection), so it
        // is skipped when no runtime is around to send it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let conn = Arc::clone(&self.conn);
            let key = self.key.clone();
            let _unwatch = runtime.spawn(async move {
                let _ = conn.call(Request::Unwatch { key }).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake;
    use std::sync::atomic::AtomicU32;
    use tenure_protocol::handshake::{HelloAck, VERSION};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A script that answers everything with NOT_LEADER and `message()`, counting calls.
    fn not_leader(
        message: impl Fn() -> String + Send + Sync + 'static,
        calls: Arc<AtomicU32>,
    ) -> fake::Script {
        Arc::new(move |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            Some(Response::Error {
                code: ErrorCode::NotLeader,
                message: message(),
            })
        })
    }

    /// Whether `err` is the server's NOT_LEADER.
    fn is_not_leader(err: &Error) -> bool {
        matches!(
            err,
            Error::Server {
                code: ErrorCode::NotLeader,
                ..
            }
        )
    }

    /// A fake node that answers everything with NOT_LEADER naming `leader`.
    async fn follower(leader: &str, calls: Arc<AtomicU32>) -> fake::FakeServer {
        let message = format!("leader={leader}");
        fake::start(VERSION, 16, not_leader(move || message.clone(), calls)).await
    }

    fn pong() -> fake::Script {
        Arc::new(|_| Some(Response::Pong))
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_that_arrives_after_its_caller_gave_up_is_released() {
        let released = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&released);
        let lease_id = LeaseId::from_u128(42);
        let script: fake::Script = Arc::new(move |request| match request {
            Request::Acquire { .. } => Some(Response::Granted {
                token: 7,
                lease_id,
                ttl_ms: 60_000,
                waited_ms: 0,
            }),
            Request::Release { key, lease_id } => {
                seen.lock().unwrap().push((key.clone(), *lease_id));
                Some(Response::Released)
            }
            _ => Some(Response::Pong),
        });
        // Every answer comes 3 s late; the client waits 1 s.
        let server = fake::start_delayed(VERSION, 16, script, Duration::from_secs(3)).await;
        let config = ClientConfig {
            request_timeout: Duration::from_secs(1),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(server.addr.clone(), config)
            .await
            .unwrap();
        let err = client
            .acquire("k", Duration::from_secs(60), AcquireOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Timeout(_)), "{err:?}");
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            *released.lock().unwrap(),
            vec![(Bytes::from_static(b"k"), lease_id)],
            "the late grant is given back, once"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_s_not_leader_sends_the_request_to_the_leader_it_names() {
        let leader = fake::start(VERSION, 16, pong()).await;
        let asked = Arc::new(AtomicU32::new(0));
        let follower = follower(&leader.addr, Arc::clone(&asked)).await;
        let client = Client::connect(format!("{},{}", follower.addr, leader.addr))
            .await
            .unwrap();
        client.ping().await.unwrap();
        client.ping().await.unwrap();
        assert_eq!(asked.load(Ordering::Relaxed), 1, "the leader is remembered");
        assert_eq!(client.endpoints().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_endpoint_is_skipped_at_once_and_unknown_leaders_are_waited_out() {
        let leader = fake::start(VERSION, 16, pong()).await;
        // A port nothing listens on.
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead_addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        let asked = Arc::new(AtomicU32::new(0));
        let electing = follower("unknown", Arc::clone(&asked)).await;
        let addrs = format!("{dead_addr}, {},{}", electing.addr, leader.addr);
        let client = Client::connect(addrs.clone()).await.unwrap();
        client.ping().await.unwrap();
        assert_eq!(asked.load(Ordering::Relaxed), 1);
        assert_eq!(client.addr(), addrs);
    }

    #[tokio::test(start_paused = true)]
    async fn not_leader_forever_is_returned_once_the_request_time_is_spent() {
        let asked = Arc::new(AtomicU32::new(0));
        let a = follower("unknown", Arc::clone(&asked)).await;
        let b = follower("unknown", Arc::clone(&asked)).await;
        let client = Client::connect(format!("{},{}", a.addr, b.addr))
            .await
            .unwrap();
        let err = client.ping().await.unwrap_err();
        assert!(is_not_leader(&err), "{err:?}");
        assert!(err.is_transient(), "an election ends");
        // Rounds of 2 + 3 + 1 requests, paused between, until the time-out (1 s in the
        // virtual clock) would pass: more than one round, and bounded.
        let asked = asked.load(Ordering::Relaxed);
        assert!(asked > 2 + 3 + 1 && asked < 100, "{asked}");
        assert!(Client::connect(" , ").await.is_err(), "no address at all");
    }

    /// One address, a node that never knows a leader (removed from its cluster): the request
    /// ends with that node's NOT_LEADER, which says why, not with a bare time-out.
    #[tokio::test(start_paused = true)]
    async fn a_search_with_one_address_ends_with_the_nodes_answer() {
        let message = || "this node is not in the cluster's membership; leader=unknown".into();
        let script = not_leader(message, Arc::new(AtomicU32::new(0)));
        // Each answer takes a while, so the search's last exchange needs time of its own.
        let removed = fake::start_delayed(VERSION, 16, script, Duration::from_millis(300)).await;
        let config = ClientConfig {
            request_timeout: Duration::from_secs(5),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(removed.addr.clone(), config)
            .await
            .unwrap();
        let err = client.ping().await.unwrap_err();
        assert!(is_not_leader(&err), "{err:?}");
        assert!(err.to_string().contains("membership"), "{err}");
    }

    /// A leader cut off from its followers may still think it leads and name itself in its
    /// NOT_LEADER answers: the client asks the next endpoint instead of it, again and again.
    #[tokio::test(start_paused = true)]
    async fn a_node_that_names_itself_is_not_asked_again_at_once() {
        let leader = fake::start(VERSION, 16, pong()).await;
        let own = Arc::new(Mutex::new(String::new()));
        let asked = Arc::new(AtomicU32::new(0));
        let named = Arc::clone(&own);
        let message = move || format!("leader={}", named.lock().unwrap());
        let isolated = fake::start(VERSION, 16, not_leader(message, Arc::clone(&asked))).await;
        *own.lock().unwrap() = isolated.addr.clone();
        let client = Client::connect(format!("{},{}", isolated.addr, leader.addr))
            .await
            .unwrap();
        client.ping().await.unwrap();
        assert_eq!(
            asked.load(Ordering::Relaxed),
            1,
            "asked once, then the next node"
        );
    }

    /// A leader that grants every acquire (ttl 10 s, no wait) and, the first time only,
    /// answers a renewal with NOT_LEADER naming `slow` (which sends it back here).
    fn granting_leader(slow: Arc<Mutex<String>>) -> fake::Script {
        let renewals = AtomicU32::new(0);
        Arc::new(move |request| match request {
            Request::Acquire { .. } => Some(Response::Granted {
                token: 1,
                lease_id: LeaseId::from_u128(5),
                ttl_ms: 10_000,
                waited_ms: 0,
            }),
            Request::Renew { .. } if renewals.fetch_add(1, Ordering::Relaxed) == 0 => {
                Some(Response::Error {
                    code: ErrorCode::NotLeader,
                    message: format!("leader={}", slow.lock().unwrap()),
                })
            }
            Request::Renew { .. } => Some(Response::Renewed { ttl_ms: 10_000 }),
            _ => Some(Response::Pong),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_counts_from_the_re_send_not_the_first_send() {
        let ttl = Duration::from_secs(10);
        let slow_addr = Arc::new(Mutex::new(String::new()));
        let leader = fake::start(VERSION, 16, granting_leader(Arc::clone(&slow_addr))).await;
        // A follower that takes 3 s to say NOT_LEADER (a node stopped, then resumed).
        let delay = Duration::from_secs(3);
        let message = format!("leader={}", leader.addr);
        let script = not_leader(move || message.clone(), Arc::new(AtomicU32::new(0)));
        let slow = fake::start_delayed(VERSION, 16, script, delay).await;
        *slow_addr.lock().unwrap() = slow.addr.clone();
        let client = Client::connect(format!("{},{}", slow.addr, leader.addr))
            .await
            .unwrap();
        let started = Instant::now();
        let mut lease = client
            .acquire("k", ttl, AcquireOptions::default())
            .await
            .unwrap()
            .granted()
            .unwrap();
        let least = started + delay + ttl - crate::lease::deadline_margin(ttl);
        assert!(
            lease.deadline() >= least,
            "acquire: counted from the first send"
        );
        // RENEW: the leader sends it to the slow node, which sends it back 3 s later.
        let started = Instant::now();
        let outcome = lease.renew().await.unwrap();
        assert_eq!(outcome, RenewOutcome::Renewed { ttl });
        let least = started + delay + ttl - crate::lease::deadline_margin(ttl);
        assert!(
            lease.deadline() >= least,
            "renew: counted from the first send"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_acquire_that_times_out_on_a_hung_node_sends_the_next_one_elsewhere() {
        let hung = fake::start(VERSION, 16, Arc::new(|_| None)).await;
        let granting = fake::start(VERSION, 16, granting_leader(Arc::default())).await;
        let config = ClientConfig {
            request_timeout: Duration::from_secs(1),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(format!("{},{}", hung.addr, granting.addr), config)
            .await
            .unwrap();
        let ttl = Duration::from_secs(10);
        let first = client.acquire("k", ttl, AcquireOptions::default()).await;
        assert!(matches!(first, Err(Error::Timeout(_))), "{first:?}");
        let second = client.acquire("k", ttl, AcquireOptions::default()).await;
        assert!(
            matches!(second, Ok(AcquireOutcome::Granted(_))),
            "{second:?}"
        );
    }

    #[tokio::test]
    async fn a_server_of_another_version_is_refused() {
        let server = fake::start(VERSION + 1, 16, Arc::new(|_| Some(Response::Pong))).await;
        match Client::connect(server.addr.clone()).await {
            Err(Error::VersionMismatch { server, client }) => {
                assert_eq!((server, client), (VERSION + 1, VERSION));
            }
            other => panic!("expected a version mismatch, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn error_frames_become_server_errors_and_silence_a_timeout() {
        let script: fake::Script = Arc::new(|request| match request {
            Request::Ping => None,
            _ => Some(Response::Error {
                code: ErrorCode::Unavailable,
                message: "fsync failed".into(),
            }),
        });
        let server = fake::start(VERSION, 16, script).await;
        let config = ClientConfig {
            request_timeout: Duration::from_millis(100),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(server.addr.clone(), config)
            .await
            .expect("connect");
        match client.inspect("k").await {
            Err(Error::Server { code, message }) => {
                assert_eq!(
                    (code, message.as_str()),
                    (ErrorCode::Unavailable, "fsync failed")
                );
            }
            other => panic!("expected a server error, got {other:?}"),
        }
        let started = Instant::now();
        assert!(matches!(client.ping().await, Err(Error::Timeout(_))));
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(100),
            "virtual time, exactly"
        );
        assert!(
            client.is_connected(),
            "a timeout does not close the connection"
        );
    }

    /// Accepts one connection and refuses its hello as a server of `version` would.
    async fn refuse(listener: &tokio::net::TcpListener, version: u16) {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut hello = [0u8; tenure_protocol::handshake::HELLO_LEN];
        stream.read_exact(&mut hello).await.unwrap();
        let mut out = bytes::BytesMut::new();
        HelloAck::encode_refusal(version, ErrorCode::BadHandshake, "go away", &mut out);
        stream.write_all(&out).await.unwrap();
    }

    #[tokio::test]
    async fn a_refused_handshake_is_the_servers_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (_, connected) = tokio::join!(refuse(&listener, VERSION), Client::connect(&*addr));
        match connected {
            Err(Error::Server { code, message }) => {
                assert_eq!(
                    (code, message.as_str()),
                    (ErrorCode::BadHandshake, "go away")
                );
            }
            other => panic!("expected the refusal, got {other:?}"),
        }
        let newer = refuse(&listener, VERSION + 1);
        let (_, connected) = tokio::join!(newer, Client::connect(&*addr));
        assert!(
            matches!(connected, Err(Error::VersionMismatch { server, .. }) if server == VERSION + 1),
            "{connected:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn requests_in_flight_never_exceed_the_servers_cap() {
        // The fake never answers, so a client that respects the announced cap of 2 sends two
        // requests and keeps the rest waiting for a permit until they time out.
        let seen = Arc::new(AtomicU32::new(0));
        let counter = Arc::clone(&seen);
        let script: fake::Script = Arc::new(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
            None
        });
        let server = fake::start(VERSION, 2, script).await;
        let config = ClientConfig {
            request_timeout: Duration::from_millis(200),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(server.addr.clone(), config)
            .await
            .expect("connect");
        let pings = (0..5).map(|_| client.ping());
        let results = futures_util::future::join_all(pings).await;
        assert!(results.iter().all(|r| matches!(r, Err(Error::Timeout(_)))));
        assert_eq!(seen.load(Ordering::SeqCst), 2, "only the cap was sent");
    }
}
