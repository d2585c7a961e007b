//! [`Client`]: one multiplexed connection shared by many tasks, with typed outcomes.
//!
//! Every method validates its arguments against the wire limits before sending, waits at most
//! [`ClientConfig::request_timeout`] for the answer (a blocking acquire adds its wait), and
//! returns the server's answer as an enum: LOCKED, LOST, NOT_OWNER and STALE are outcomes, not
//! errors.
//!
//! # Reconnection
//! When the connection dies, every request in flight fails with [`Error::ConnectionLost`]
//! (except an ACQUIRE, which is sent again with its acquire id: see [`Client::acquire`]) and
//! every lease guard hears about it at once. The client does not reconnect by itself: the
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
use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::handshake::ServerLimits;
use tenure_protocol::kind::LeaseKind;
use tenure_protocol::limits::WAIT_MS_MAX;
use tenure_protocol::{AcquireId, LeaseId, Request, Response, SessionId};
use tokio::time::Instant;

use crate::cluster::{Member, Status, CHANGE_TIMEOUT_MIN};
use crate::error::{unexpected, Error, Result};
use crate::lease::{Granted, KeepAliveOptions, Lease, LeaseGuard};
use crate::router::{AcquireAnswer, Answer, Router};

// Re-exported so that the paths `tenure::client::X` written before these types moved to
// their own modules keep working.
pub use crate::lease::AcquireOutcome;
pub use crate::options::{AcquireOptions, ClientConfig, ClientOptions, Credentials};
pub use crate::outcome::{
    CheckOutcome, KeyState, LockedBy, ReleaseOutcome, RenewOutcome, WatchEvent,
};
pub use crate::watch::{Watch, WATCH_EVENTS_MAX};

/// A handle to one connection to a tenure server, cheap to clone and share between tasks.
///
/// Requests from all clones are multiplexed on one TCP connection by request id, so many can
/// be in flight at once (up to the server's in-flight cap) and a blocking acquire does not
/// hold up the others. Dropping the last clone (and every [`Lease`], guard and [`Watch`],
/// which hold clones) closes the connection.
#[derive(Clone)]
pub struct Client {
    /// The connection manager that every lease, guard and election of this client shares.
    router: Router,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("addr", &self.router.addr())
            .field("connected", &self.is_connected())
            .finish()
    }
}

/// Milliseconds for the wire.
fn duration_ms(duration: Duration) -> u32 {
    // Out-of-range values become u32::MAX, which the limit checks then reject by name.
    u32::try_from(duration.as_millis()).unwrap_or(u32::MAX)
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
    /// have taken effect: an ACQUIRE is sent again with its acquire id, so a grant it got is
    /// found again rather than orphaned (see [`Client::acquire`]).
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
        let router = Router::connect(addr, config).await?;
        Ok(Client { router })
    }

    /// The server address(es) this client was given (`a,b,c` for a cluster).
    pub fn addr(&self) -> &str {
        self.router.addr()
    }

    /// Every server address this client tries, in order.
    pub fn endpoints(&self) -> &[String] {
        self.router.endpoints()
    }

    /// The connection manager, for the modules that build on the client (sessions).
    pub(crate) fn router(&self) -> &Router {
        &self.router
    }

    /// The configuration this client was made with.
    pub fn config(&self) -> &ClientConfig {
        self.router.config()
    }

    /// The limits the server announced in the handshake of the current connection (longest
    /// TTL and wait, key and metadata lengths, frame size, requests in flight); `None` while
    /// there is no connection.
    pub fn server_limits(&self) -> Option<ServerLimits> {
        self.router.server_limits()
    }

    /// True while the client has a live connection.
    pub fn is_connected(&self) -> bool {
        self.router.is_connected()
    }

    /// Closes the connection at once, as a crash would: requests in flight fail with
    /// [`Error::ConnectionLost`], locks taken with `release_on_disconnect` are freed by the
    /// server, and lease guards hear about it. The next request reconnects.
    pub fn disconnect(&self) {
        self.router.disconnect();
    }

    /// Asks for `key` for `ttl`, waiting in line up to `options.wait` if it is held.
    ///
    /// # Exactly once
    /// The ACQUIRE carries a fresh random acquire id (128 bits from `rand`'s thread-local
    /// CSPRNG, seeded by the operating system; PROTOCOL.md 3.9). When its outcome is unknown (the connection was lost or
    /// reset, no answer came in time, a leader stepping down answered `NOT_LEADER`, the
    /// server is shutting down or restarting), the same ACQUIRE with the same acquire id is
    /// sent again (on a new connection, to the new leader in a cluster) until
    /// `options.wait` plus [`ClientConfig::acquire_retry_for`] after the first send. The server
    /// answers a repeat of a grant with that grant, so the caller sees one grant or one
    /// refusal, never a second lease or an orphan. A blocking ACQUIRE sent again waits only
    /// what is left of `options.wait`. If the first send was granted and that lease has
    /// ended by the time a repeat reaches the server, the answer is
    /// [`Error::AcquireEnded`].
    ///
    /// # The local deadline
    /// A GRANTED answer means the answering server knew no live grant of this acquire id, so
    /// the returned [`Lease`]'s local deadline is counted from an instant taken before the
    /// send that got it, plus the time the server says that send waited in line, plus the
    /// TTL: never later than the server's. A grant that a repeat found (REGRANTED) was made
    /// to an earlier send, no earlier than the first: it counts from before the *first* send
    /// plus the TTL, or from before the repeat plus the time the server said was left,
    /// whichever is earlier.
    ///
    /// A grant that arrives after the caller stopped waiting (the retries ran out, or the
    /// future was dropped) is released by the client, so a key is not left held by a lease
    /// nobody knows of.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty or over-long key, a TTL outside
    /// `TTL_MS_MIN..=TTL_MS_MAX`, a wait over `WAIT_MS_MAX` or over-long metadata;
    /// [`Error::AcquireEnded`] as above; otherwise the last error of the retries (any
    /// [`Error`] a request can meet).
    pub async fn acquire(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome> {
        self.acquire_kind(key, ttl, LeaseKind::Exclusive, options)
            .await
    }

    /// Asks for `key` as [`Client::acquire`] does, for a lease of `kind` (PROTOCOL.md 3.10):
    /// the key alone ([`LeaseKind::Exclusive`], a plain lock or a write lease), a read lease
    /// beside other readers ([`LeaseKind::Shared`]), or permits of a semaphore
    /// ([`LeaseKind::Permits`]). [`Client::semaphore`], [`Client::read_lock`] and
    /// [`Client::write_lock`] are this with a guard.
    ///
    /// # Errors
    /// As [`Client::acquire`]; and [`Error::KindMismatch`] when the key is held or awaited
    /// as another kind (or a semaphore of another limit), [`Error::BadPermits`] for permit
    /// counts out of range (checked before sending).
    pub async fn acquire_kind(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        kind: LeaseKind,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome> {
        self.acquire_in(key, ttl, kind, options, None, None)
            .await
            .map_err(Error::of_kind)
    }

    /// [`Client::acquire_kind`] with the caller's own acquire id (PROTOCOL.md 3.9), in
    /// `session` when one is named: sent again with the same id, an ACQUIRE whose first
    /// send was granted is answered with that grant. For a person retrying by hand (the
    /// `tenure console`'s `ID=`); a program lets the client choose, as `acquire_kind` does.
    ///
    /// # Errors
    /// As [`Client::acquire_kind`].
    pub async fn acquire_with_id(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        kind: LeaseKind,
        options: AcquireOptions,
        session: Option<SessionId>,
        acquire_id: AcquireId,
    ) -> Result<AcquireOutcome> {
        self.acquire_in(key, ttl, kind, options, session, Some(acquire_id))
            .await
            .map_err(Error::of_kind)
    }

    /// The ACQUIRE itself, its errors untyped ([`Client::acquire_kind`] types them), in
    /// `session` when one is named (the lease then lives while the session does; see
    /// [`crate::session`]), with `acquire_id` or, without one, a fresh random id.
    pub(crate) async fn acquire_in(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        kind: LeaseKind,
        options: AcquireOptions,
        session: Option<SessionId>,
        acquire_id: Option<AcquireId>,
    ) -> Result<AcquireOutcome> {
        let acquire_id = acquire_id.unwrap_or_else(|| AcquireId::from_u128(rand::random()));
        let key = Bytes::copy_from_slice(key.as_ref());
        let wait_ms = duration_ms(options.wait);
        let request = Request::Acquire {
            key: key.clone(),
            ttl_ms: duration_ms(ttl),
            wait_ms,
            release_on_disconnect: options.release_on_disconnect,
            meta: options.meta,
            acquire_id: Some(acquire_id),
            kind,
            session_id: session,
        };
        // Checked before the first send, so a bad argument is not retried.
        request.validate().map_err(Error::invalid)?;
        let config = self.router.config();
        let wait = Duration::from_millis(u64::from(wait_ms.min(WAIT_MS_MAX)));
        let now = Instant::now();
        let give_up_at = now + wait + config.acquire_retry_for.max(config.request_timeout);
        let answer = self
            .router
            .call_acquire(request, key.clone(), now + wait, give_up_at)
            .await?;
        self.acquired(key, ttl, options.release_on_disconnect, answer)
    }

    /// The outcome an ACQUIRE's settling answer means.
    fn acquired(
        &self,
        key: Bytes,
        ttl: Duration,
        release_on_disconnect: bool,
        answer: AcquireAnswer,
    ) -> Result<AcquireOutcome> {
        let AcquireAnswer {
            answer:
                Answer {
                    response,
                    conn,
                    sent_at,
                },
            first_sent_at,
            first_conn,
        } = answer;
        // GRANTED: the answering server knew no live grant of this acquire id, so its lease
        // began after the send that got the answer (a blocking one re-sent after 50 s in
        // line must not look expired on arrival). REGRANTED: granted to an earlier send,
        // no earlier than the first.
        let (granted, tied_to, counted_from, repeat_deadline) = match response {
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
                (granted, Some(conn), sent_at, None)
            }
            Response::Regranted {
                token,
                lease_id,
                ttl_left_ms,
            } => {
                let (granted, repeat) = regranted(token, lease_id, ttl, ttl_left_ms, sent_at);
                // Tied to the connection of a send no later than the granted one.
                (granted, first_conn, first_sent_at, Some(repeat))
            }
            Response::Locked { token, ttl_left_ms } => {
                return Ok(AcquireOutcome::Locked(LockedBy {
                    token,
                    ttl_left: Duration::from_millis(u64::from(ttl_left_ms)),
                }))
            }
            Response::AcquireEnded { how, token } => {
                return Err(Error::AcquireEnded { how, token });
            }
            other => return Err(unexpected("ACQUIRE", other)),
        };
        let tied_to = tied_to
            .filter(|_| release_on_disconnect)
            .map(|conn| conn.shared.clone());
        let mut lease = Lease::new(self.router.clone(), key, granted, counted_from, tied_to);
        if let Some(repeat) = repeat_deadline {
            lease.found_by_repeat(repeat);
        }
        Ok(AcquireOutcome::Granted(lease))
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

    /// Acquires like [`Client::acquire_kind`] and starts renewing the lease in the background
    /// with default [`KeepAliveOptions`], as [`Client::lock`] does.
    ///
    /// # Errors
    /// As [`Client::acquire_kind`].
    pub async fn lock_kind(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        kind: LeaseKind,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome<LeaseGuard>> {
        Ok(match self.acquire_kind(key, ttl, kind, options).await? {
            AcquireOutcome::Granted(lease) => AcquireOutcome::Granted(lease.keep_alive()),
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
        Ok(self.router.renew_sent_at(request).await?.0)
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
        self.router.release(key.as_ref(), lease_id).await
    }

    /// Reads the state of `key`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad key; otherwise any [`Error`] a request can meet.
    pub async fn inspect(&self, key: impl AsRef<[u8]>) -> Result<KeyState> {
        let request = Request::Inspect {
            key: Bytes::copy_from_slice(key.as_ref()),
            kinds: Default::default(),
        };
        match self.router.call_plain(request).await? {
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
        match self.router.call_plain(request).await? {
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
        match self.router.call_plain(Request::Stats).await? {
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
        match self.router.call_plain(Request::Ping).await? {
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
    /// A follower's `NOT_LEADER` is followed to the leader, as for any request, so a watch
    /// started again after a fail-over is registered at the new leader.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad key, [`Error::Server`] when the server refuses (for
    /// example [`tenure_protocol::ErrorCode::WatchLimit`]); otherwise any [`Error`] a request can meet.
    pub async fn watch(&self, key: impl AsRef<[u8]>) -> Result<Watch> {
        Watch::start(&self.router, key.as_ref()).await
    }

    // Cluster administration (PROTOCOL.md 3.8; the vocabulary is in `crate::cluster`).

    /// The connected node's view of its cluster: its role and term, the leader, its log
    /// position and the membership, and its [`StatusExtension`](crate::cluster::StatusExtension)
    /// (the digests of its identities and trust set, its last contact) when the server has
    /// it: a server older than the extension refuses the request for it with `BAD_FRAME`, and
    /// is asked again without (`extension` is then `None`).
    ///
    /// # Errors
    /// [`Error::Server`] from a single-node server; otherwise any [`Error`] a request can meet.
    pub async fn cluster_status(&self) -> Result<Status> {
        let timeout = self.config().request_timeout;
        let extended = Request::ClusterStatus { extended: true };
        match self.cluster_call(extended, timeout).await {
            Err(Error::Server {
                code: tenure_protocol::ErrorCode::BadFrame,
                ..
            }) => {
                let plain = Request::ClusterStatus { extended: false };
                self.cluster_call(plain, timeout).await
            }
            answer => answer,
        }
    }

    /// Makes `members` the cluster's first membership, all voters, on the connected node
    /// (which must be among them and not yet initialised).
    ///
    /// # Errors
    /// [`Error::Server`] with [`ErrorCode::ClusterRefused`](crate::ErrorCode::ClusterRefused)
    /// when the node is initialised already or not among `members`; otherwise any [`Error`].
    pub async fn cluster_init(&self, members: Vec<Member>) -> Result<Status> {
        let request = Request::ClusterInit { members };
        self.cluster_call(request, self.change_timeout()).await
    }

    /// Adds `member`: a learner first, then, once it has caught up, a voter (joint
    /// consensus). Adding a voter again at the same addresses changes nothing.
    ///
    /// # Errors
    /// [`Error::Server`]: `CLUSTER_REFUSED` for an id present at other addresses or a change
    /// already under way, `UNAVAILABLE` when the node did not catch up in time (it stays a
    /// learner); otherwise any [`Error`].
    pub async fn cluster_add(&self, member: Member) -> Result<Status> {
        let request = Request::ClusterAdd { member };
        self.cluster_call(request, self.change_timeout()).await
    }

    /// Removes node `id` from the membership (the leader too: it steps down once the change
    /// is committed). The node may then be stopped.
    ///
    /// # Errors
    /// [`Error::Server`]: `CLUSTER_REFUSED` for an id that is not a member or the last
    /// voter; otherwise any [`Error`].
    pub async fn cluster_remove(&self, id: u64) -> Result<Status> {
        let request = Request::ClusterRemove { id };
        self.cluster_call(request, self.change_timeout()).await
    }

    /// Sends `request` and returns the answer, for the requests of the modules built on the
    /// client (`semaphore`).
    pub(crate) async fn call_plain(&self, request: Request) -> Result<Response> {
        self.router.call_plain(request).await
    }

    fn change_timeout(&self) -> Duration {
        self.config().request_timeout.max(CHANGE_TIMEOUT_MIN)
    }

    async fn cluster_call(&self, request: Request, timeout: Duration) -> Result<Status> {
        let kind = request.kind();
        match self.router.call(request, timeout).await?.response {
            Response::Cluster(status) => Ok(status),
            Response::Error { code, message } => Err(Error::Server { code, message }),
            other => Err(Error::Protocol(format!(
                "unexpected reply {other:?} to {kind}"
            ))),
        }
    }
}

/// A REGRANTED answer's lease, and the deadline its `ttl_left_ms` sets.
///
/// The grant happened between the first send and the repeat's arrival, so the lease ends no
/// earlier than the first send plus the TTL: no wait is added.
fn regranted(
    token: u64,
    lease_id: LeaseId,
    ttl: Duration,
    ttl_left_ms: u32,
    sent_at: Instant,
) -> (Granted, Instant) {
    let left = Duration::from_millis(u64::from(ttl_left_ms));
    // A session's ACQUIRE asks for no TTL of its own (0): its lease has the session's time
    // left, as a first grant's answer would have said.
    let ttl = if ttl.is_zero() { left } else { ttl };
    let granted = Granted {
        token,
        lease_id,
        ttl,
        waited: Duration::ZERO,
    };
    let repeat = crate::lease::local_deadline(sent_at, Duration::ZERO, left);
    (granted, repeat)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use tenure_protocol::handshake::{HelloAck, VERSION};
    use tenure_protocol::ErrorCode;
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

    /// A leader that lost its place mid-request: its first NOT_LEADER says the outcome is
    /// unknown, every later one that it does not serve; `calls` counts them.
    fn unknown_then_refused(calls: Arc<AtomicU32>) -> fake::Script {
        let answered = Arc::new(AtomicU32::new(0));
        let message = move || {
            if answered.fetch_add(1, Ordering::Relaxed) == 0 {
                "the outcome is unknown: this node stopped leading; leader=unknown".into()
            } else {
                "this node was elected but does not serve; leader=unknown".into()
            }
        };
        not_leader(message, calls)
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
        // No time to send it again: the caller gives up after the first time-out.
        let config = ClientConfig {
            request_timeout: Duration::from_secs(1),
            acquire_retry_for: Duration::ZERO,
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

    /// The caller drops its acquire (its own time-out, shorter than the client's retries):
    /// the grant that arrives later is given back, once.
    #[tokio::test(start_paused = true)]
    async fn a_grant_that_arrives_after_its_caller_dropped_the_acquire_is_released() {
        let released = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&released);
        let script: fake::Script = Arc::new(move |request| match request {
            Request::Acquire { .. } => Some(Response::Granted {
                token: 7,
                lease_id: LeaseId::from_u128(43),
                ttl_ms: 60_000,
                waited_ms: 0,
            }),
            Request::Release { lease_id, .. } => {
                seen.lock().unwrap().push(*lease_id);
                Some(Response::Released)
            }
            _ => Some(Response::Pong),
        });
        let server = fake::start_delayed(VERSION, 16, script, Duration::from_secs(3)).await;
        let client = Client::connect(server.addr.clone()).await.unwrap();
        let acquire = client.acquire("k", Duration::from_secs(60), AcquireOptions::default());
        let dropped = tokio::time::timeout(Duration::from_secs(1), acquire).await;
        assert!(dropped.is_err(), "the caller stopped waiting");
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(*released.lock().unwrap(), vec![LeaseId::from_u128(43)]);
    }

    /// The ACQUIREs a script saw: acquire id and wait of each.
    type Seen = Arc<Mutex<Vec<(Option<AcquireId>, u32)>>>;

    /// A server that never answers the first ACQUIRE (its reply lost) and answers every
    /// later one with `repeat`.
    fn losing_first_reply(seen: Seen, repeat: Response) -> fake::Script {
        Arc::new(move |request| match request {
            Request::Acquire {
                acquire_id,
                wait_ms,
                ..
            } => {
                let mut seen = seen.lock().unwrap();
                seen.push((*acquire_id, *wait_ms));
                (seen.len() > 1).then(|| repeat.clone())
            }
            _ => Some(Response::Released),
        })
    }

    async fn retrying_client(addr: &str) -> Client {
        let config = ClientConfig {
            request_timeout: Duration::from_secs(1),
            ..ClientConfig::default()
        };
        Client::connect_with(addr, config).await.unwrap()
    }

    /// The first reply is lost; the client sends the same ACQUIRE with the same acquire id
    /// again, and the REGRANTED answer is the caller's one grant, counted from the first
    /// send.
    #[tokio::test(start_paused = true)]
    async fn an_acquire_whose_reply_is_lost_is_sent_again_with_its_acquire_id() {
        let seen = Seen::default();
        let regranted = Response::Regranted {
            token: 9,
            lease_id: LeaseId::from_u128(77),
            ttl_left_ms: 50_000,
        };
        let server = fake::start(VERSION, 16, losing_first_reply(seen.clone(), regranted)).await;
        let client = retrying_client(&server.addr).await;
        let ttl = Duration::from_secs(60);
        let started = Instant::now();
        let options = AcquireOptions::wait(Duration::from_secs(3));
        let lease = client.acquire("k", ttl, options).await.unwrap();
        let lease = lease.granted().expect("the repeat's grant");
        assert_eq!(
            (lease.fencing_token(), lease.lease_id()),
            (9, LeaseId::from_u128(77))
        );
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(seen[0].0.is_some(), "every ACQUIRE carries an acquire id");
        assert_eq!(seen[0].0, seen[1].0, "the same acquire id, sent again");
        assert_eq!(seen[0].1, 3000);
        assert!(seen[1].1 < 3000, "the retry waits what is left: {seen:?}");
        let from_first = started + ttl - crate::lease::deadline_margin(ttl);
        assert!(
            lease.deadline() <= from_first,
            "not later than the first send's count"
        );
        // Sent again after about 4 s (1 s + the 3 s wait) with 50 s left: that count is earlier.
        assert!(lease.deadline() < from_first - Duration::from_secs(3));
        // Another acquire has another acquire id.
        let again = client.acquire("k", ttl, AcquireOptions::default()).await;
        assert!(again.is_ok(), "{again:?}");
    }

    /// The repeat finds the caller's lease already ended: a definite, non-transient error.
    #[tokio::test(start_paused = true)]
    async fn a_repeat_of_an_ended_grant_is_reported_as_ended() {
        let ended = Response::AcquireEnded {
            how: tenure_protocol::EndedHow::Expired,
            token: 4,
        };
        let server = fake::start(VERSION, 16, losing_first_reply(Seen::default(), ended)).await;
        let client = retrying_client(&server.addr).await;
        let err = client
            .acquire("k", Duration::from_secs(2), AcquireOptions::default())
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::AcquireEnded {
                    how: tenure_protocol::EndedHow::Expired,
                    token: 4
                }
            ),
            "{err:?}"
        );
        assert!(!err.is_transient());
        assert!(err.to_string().contains("expired"), "{err}");
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

    /// A cut-off leader answers NOT_LEADER, then cannot be reached (it is gone), and the
    /// other node accepts connections and never answers (stopped): the ACQUIRE ends with
    /// that NOT_LEADER, not with the time-out of a later connect, which says nothing of why
    /// (outside test a65, 2).
    #[tokio::test(start_paused = true)]
    async fn an_acquire_that_runs_out_reports_the_last_answer_not_a_later_time_out() {
        let answered = Arc::new(AtomicU32::new(0));
        let node = fake::start(
            VERSION,
            16,
            not_leader(|| "leader=unknown".into(), Arc::clone(&answered)),
        )
        .await;
        let stopped = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addrs = format!("{},{}", node.addr, stopped.local_addr().unwrap());
        let config = ClientConfig {
            request_timeout: Duration::from_secs(3),
            acquire_retry_for: Duration::from_secs(8),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(addrs, config).await.unwrap();
        let acquire = client.acquire("k", Duration::from_secs(10), AcquireOptions::default());
        let gone = async {
            while answered.load(Ordering::Relaxed) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            drop(node);
            std::future::pending::<()>().await
        };
        let err = tokio::select! {
            result = acquire => result.unwrap_err(),
            () = gone => unreachable!(),
        };
        assert!(is_not_leader(&err), "{err:?}");
        assert_eq!(answered.load(Ordering::Relaxed), 1);
        drop(stopped);
    }

    /// The first send is in flight when its leader loses its quorum ("the outcome is
    /// unknown"), every later one is refused unrun ("does not serve"): the caller is told the
    /// outcome is unknown, as the first send may still commit (outside test a66, 1).
    #[tokio::test(start_paused = true)]
    async fn a_refusal_after_a_send_of_unknown_outcome_leaves_the_outcome_unknown() {
        let node = fake::start(VERSION, 16, unknown_then_refused(Arc::default())).await;
        let config = ClientConfig {
            request_timeout: Duration::from_secs(1),
            acquire_retry_for: Duration::from_secs(3),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(node.addr.clone(), config)
            .await
            .unwrap();
        let err = client
            .acquire("k", Duration::from_secs(10), AcquireOptions::default())
            .await
            .unwrap_err();
        assert!(is_not_leader(&err), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("NOT_LEADER: the outcome is unknown: an earlier send"),
            "{text}"
        );
        assert!(
            text.contains("the last answer: this node was elected"),
            "{text}"
        );
    }

    /// Any request (a PING here; a RELEASE in outside test a67, 2) in flight when its
    /// leader lost its place is answered "the outcome is unknown", its re-sends "does not
    /// serve": the caller hears the first, which a later refusal must not hide.
    #[tokio::test(start_paused = true)]
    async fn a_search_keeps_the_answer_that_said_the_outcome_is_unknown() {
        let asked = Arc::new(AtomicU32::new(0));
        let node = fake::start(VERSION, 16, unknown_then_refused(Arc::clone(&asked))).await;
        let client = Client::connect(node.addr.clone()).await.unwrap();
        let err = client.ping().await.unwrap_err();
        assert!(is_not_leader(&err), "{err:?}");
        assert!(err.to_string().contains("the outcome is unknown"), "{err}");
        assert!(asked.load(Ordering::Relaxed) > 1, "sent again");
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
        // GRANTED (not REGRANTED): the leader knew no earlier grant of this acquire id, so
        // the lease counts from the send it answered, after the slow follower's 3 s.
        let least = started + delay + ttl - crate::lease::deadline_margin(ttl);
        assert!(
            lease.deadline() >= least,
            "acquire: counted from the re-send"
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
        // The first send times out on the hung node; the same ACQUIRE is sent again to the
        // next one, which grants it.
        let first = client.acquire("k", ttl, AcquireOptions::default()).await;
        assert!(matches!(first, Ok(AcquireOutcome::Granted(_))), "{first:?}");
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

    /// Accepts one connection on `listener` and reads its hello; returns the stream and the
    /// handshake's answer (accepting, 16 in flight), encoded but not yet written, so that a
    /// test can send more in the same segment.
    async fn accept_with_hello_ack(
        listener: &tokio::net::TcpListener,
    ) -> (tokio::net::TcpStream, bytes::BytesMut) {
        use tenure_protocol::handshake::ServerLimits;
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut hello = [0u8; tenure_protocol::handshake::HELLO_LEN];
        stream.read_exact(&mut hello).await.unwrap();
        let mut out = bytes::BytesMut::new();
        let limits = ServerLimits::with(16, tenure_protocol::limits::TTL_MS_MAX);
        HelloAck {
            version: VERSION,
            limits,
        }
        .encode(&mut out);
        (stream, out)
    }

    /// A server that closes a connection right after its handshake says why in an ERROR of
    /// request id 0, often in the same segment as the handshake's answer (mutual TLS over an
    /// identity's connections-max). The bytes read past the answer used to be dropped, and
    /// the frame after them was read from its middle: "frame of 1635269152 bytes".
    #[tokio::test]
    async fn an_error_sent_right_behind_the_handshake_is_read_whole() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = async {
            let (mut stream, mut out) = accept_with_hello_ack(&listener).await;
            let refusal = Response::Error {
                code: ErrorCode::ConnectionsLimit,
                message: "connections-max: identity `orders` has 3 connections already".into(),
            };
            tenure_protocol::frame::encode_response(0, &refusal, &mut out);
            stream.write_all(&out).await.unwrap();
            // Then closes, as the server does.
        };
        let ((), connected) = tokio::join!(server, Client::connect(&*addr));
        let client = connected.expect("the handshake itself succeeded");
        let answer = client.ping().await;
        let text = format!("{answer:?}");
        assert!(text.contains("connections-max"), "{text}");
        assert!(!text.contains("bytes is over the limit"), "{text}");
    }

    /// An ERROR of request id 0 answers no request: the server closes the connection behind
    /// it, and the requests in flight fail at once, not at their time-outs, even if the close
    /// is slow to arrive (outside test a48, N14).
    #[tokio::test]
    async fn an_error_of_request_id_0_fails_the_requests_in_flight_at_once() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (held_tx, held_rx) = tokio::sync::oneshot::channel();
        let server = async move {
            let (mut stream, mut out) = accept_with_hello_ack(&listener).await;
            stream.write_all(&out).await.unwrap();
            // The first bytes of a request: answer it with an id-0 ERROR, and keep the
            // connection open (a peer that does not close as the server does).
            let mut first = [0u8; 1];
            stream.read_exact(&mut first).await.unwrap();
            out.clear();
            let refusal = Response::Error {
                code: ErrorCode::ShuttingDown,
                message: "shutting down".into(),
            };
            tenure_protocol::frame::encode_response(0, &refusal, &mut out);
            stream.write_all(&out).await.unwrap();
            let _ = held_tx.send(stream);
        };
        tokio::spawn(server);
        let config = ClientConfig {
            request_timeout: Duration::from_secs(60),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(addr, config).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(20), client.ping())
            .await
            .expect("the ping fails long before its 60 s time-out");
        let text = format!("{answer:?}");
        assert!(text.contains("server closes the connection"), "{text}");
        assert!(text.contains("shutting down"), "{text}");
        drop(held_rx);
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
