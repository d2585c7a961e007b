//! [`Session`]: one keep-alive for many locks; and [`SessionGuard`], a lock held in a
//! session, which needs no renewal of its own.
//!
//! A session is server state with a TTL of its own (PROTOCOL.md 3.11): SESSION_OPEN starts
//! it, each SESSION_KEEPALIVE counts its TTL again, SESSION_CLOSE ends it and frees every
//! lock taken in it, and a session whose TTL runs out ends the same way. An ACQUIRE that
//! names a session takes a lease with no TTL of its own: it lives while the session does. A
//! session is not tied to a connection: a keep-alive over a new connection (to the new
//! leader, in a cluster) continues it.
//!
//! # The local deadline
//! As for a lease (see [`crate::lease`]): the client takes an [`Instant`] before sending a
//! keep-alive and, once the keep-alive is confirmed, counts the session (and so every lock in
//! it) as alive until that instant plus the session's TTL less [`deadline_margin`](crate::lease::deadline_margin). The
//! server counts the TTL from its receipt of the keep-alive, which is later, so the local
//! deadline is never later than the server's.
//!
//! ```text
//!  open ──keep-alive──keep-alive──X (no confirmation)        deadline
//!   |<──ttl/3──>|                             give_up_at ──┘ (deadline - margin)
//! ```
//! The session fires its loss signal ([`Session::lost`], [`Session::cancellation_token`],
//! [`Session::is_valid`]) at the first of: a keep-alive answered NO_SESSION (the server let
//! it expire, or it was closed: [`LossReason::SessionEnded`]); `give_up_at` passing without a confirmed keep-alive; the
//! owner closing or dropping it. Every [`SessionGuard`] of the session fires with it.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, LeaseId, LeaseKind, Request, Response, SessionId};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::error::{unexpected, Error, Result};
use crate::lease::{local_deadline, AcquireOutcome, LossReason, Validity};
use crate::options::AcquireOptions;
use crate::outcome::ReleaseOutcome;
use crate::router::{Answer, Purpose, Router};

/// How a [`Session`] keeps itself alive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionOptions {
    /// Time between keep-alives, counted from the instant before each send; `None` means a
    /// third of the TTL.
    pub keep_alive_every: Option<Duration>,
    /// How long before the local deadline the session declares itself lost if no keep-alive
    /// was confirmed, to absorb timer lateness; `None` means a tenth of the TTL.
    pub margin: Option<Duration>,
}

/// What a session and its guards share with the keep-alive task.
struct SessionState {
    id: SessionId,
    ttl: Duration,
    every: Duration,
    /// The local deadline and the loss signal.
    validity: Validity,
    /// Cleared by [`Session::close`], which closes by itself.
    close_on_stop: AtomicBool,
}

impl std::ops::Deref for SessionState {
    type Target = Validity;
    fn deref(&self) -> &Validity {
        &self.validity
    }
}

/// A session: one background keep-alive for every lock taken with [`Session::lock`].
///
/// Dropping it (or [`Session::close`]) stops the keep-alives, fires the loss signal of the
/// session and of each of its guards with [`LossReason::Released`], and sends SESSION_CLOSE,
/// which frees every lock of the session at once (each to its next waiter).
pub struct Session {
    state: Arc<SessionState>,
    client: Client,
    stop: CancellationToken,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.state.id)
            .field("ttl", &self.state.ttl)
            .field("valid", &self.is_valid())
            .finish()
    }
}

/// Milliseconds for the wire; out-of-range values become `u32::MAX`, which the limit checks
/// then reject by name.
fn duration_ms(duration: Duration) -> u32 {
    u32::try_from(duration.as_millis()).unwrap_or(u32::MAX)
}

impl Client {
    /// Opens a session of `ttl` with default [`SessionOptions`] (a keep-alive every third of
    /// the TTL).
    ///
    /// # Errors
    /// As [`Client::session_with`].
    pub async fn session(&self, ttl: Duration) -> Result<Session> {
        self.session_with(ttl, SessionOptions::default()).await
    }

    /// Opens a session of `ttl` that keeps itself alive in the background as `options` say.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a TTL outside `TTL_MS_MIN..=TTL_MS_MAX` or options that leave
    /// no time to keep alive before the margin; the server's refusal (a session limit) as
    /// [`Error::Server`]; otherwise any [`Error`] a request can meet.
    pub async fn session_with(&self, ttl: Duration, options: SessionOptions) -> Result<Session> {
        let every = options.keep_alive_every.unwrap_or(ttl / 3);
        let margin = options.margin.unwrap_or(ttl / 10);
        if every.is_zero() || every + margin >= ttl {
            return Err(Error::Invalid {
                code: ErrorCode::BadTtl,
                message: format!(
                    "keep_alive_every {every:?} + margin {margin:?} must be shorter than the \
                     session ttl {ttl:?}"
                ),
            });
        }
        let answer = self.session_open_answered(ttl, None).await?;
        let (id, ttl) = match answer.response {
            Response::Session { session_id, ttl_ms } => {
                (session_id, Duration::from_millis(u64::from(ttl_ms)))
            }
            other => return Err(unexpected("SESSION_OPEN", other)),
        };
        let state = Arc::new(SessionState {
            id,
            ttl,
            every,
            validity: Validity::new(
                answer.sent_at,
                local_deadline(answer.sent_at, Duration::ZERO, ttl),
                margin,
            ),
            close_on_stop: AtomicBool::new(true),
        });
        let stop = CancellationToken::new();
        tokio::spawn(keep_alive(self.clone(), Arc::clone(&state), stop.clone()));
        Ok(Session {
            state,
            client: self.clone(),
            stop,
        })
    }
}

/// Most rounds of SESSION_OPEN, each with a fresh id, one open sends: a resend whose session
/// ended before its answer came (a TTL shorter than the time the answer took) hears
/// NO_SESSION, or is answered past the deadline counted from its first send, and the open
/// starts again with a new id, this many times at most.
const SESSION_OPEN_ROUNDS_MAX: u32 = 3;
const _: () = assert!(SESSION_OPEN_ROUNDS_MAX > 0);

impl Client {
    /// SESSION_OPEN's answer, sent again with the same session id (128 random bits picked
    /// here) while its outcome is unknown ([`Router::call_retrying`]): a send after a lost
    /// answer finds the session an earlier send opened, so no empty session is left behind
    /// (PROTOCOL.md 3.11). The answer's `sent_at` is taken before the first send: any send
    /// may have opened the session, the first one at the earliest. Before outside test a49
    /// (P1) the first lost answer was returned as the error.
    ///
    /// A resend that hears NO_SESSION, or is answered past that deadline, starts a new round
    /// with a new id ([`SESSION_OPEN_ROUNDS_MAX`]). With `chosen`, that id is sent, in one
    /// round: a session of that id that has ended is the answer (NO_SESSION).
    async fn session_open_answered(
        &self,
        ttl: Duration,
        chosen: Option<SessionId>,
    ) -> Result<Answer> {
        let rounds = if chosen.is_some() {
            1
        } else {
            SESSION_OPEN_ROUNDS_MAX
        };
        for round in 1..=rounds {
            let first_sent_at = Instant::now();
            let session_id = chosen.unwrap_or_else(|| SessionId::from_u128(rand::random()));
            let request = Request::SessionOpen {
                ttl_ms: duration_ms(ttl),
                session_id: Some(session_id),
            };
            let mut answer = self.router().call_retrying(request).await?;
            answer.sent_at = first_sent_at;
            // Ended: the server says so, or the answer came past the deadline counted from
            // the first send (the server forgot the session a send opened, and a later one
            // opened the id again: outside test a60, F2). Either way, a new round.
            let ended = match &answer.response {
                Response::Error { code, .. } => *code == ErrorCode::NoSession,
                Response::Session { ttl_ms, .. } => {
                    let ttl = Duration::from_millis(u64::from(*ttl_ms));
                    Instant::now() >= local_deadline(first_sent_at, Duration::ZERO, ttl)
                }
                _ => false,
            };
            if !ended || round == rounds {
                return Ok(answer);
            }
            tracing::debug!("the session an earlier send opened has ended; opening another");
        }
        unreachable!("the last round returns")
    }
}

/// The requests a [`Session`] is made of, one at a time, for programs that keep a session
/// alive themselves (the `tenure console`): nothing here runs in the background.
impl Client {
    /// Sends SESSION_OPEN: the new session's id and TTL. Nobody keeps it alive: send
    /// [`Client::keep_session_alive`] within each TTL (a [`Session`] does it for you).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a TTL out of range; the server's refusal as [`Error::Server`];
    /// otherwise any [`Error`] a request can meet.
    pub async fn open_session(&self, ttl: Duration) -> Result<(SessionId, Duration)> {
        self.open_session_as(ttl, None).await
    }

    /// [`Client::open_session`] with the session id `chosen` (128 random bits; `None`: one
    /// picked here): an open sent again with the id of a live session it opened is answered
    /// with that session, and opens none (PROTOCOL.md 3.11).
    ///
    /// # Errors
    /// As [`Client::open_session`]; [`ErrorCode::NoSession`] if the session of that id was
    /// opened and has ended, [`ErrorCode::SessionMismatch`] if another identity opened it or
    /// it was opened with another TTL.
    pub async fn open_session_as(
        &self,
        ttl: Duration,
        chosen: Option<SessionId>,
    ) -> Result<(SessionId, Duration)> {
        match self.session_open_answered(ttl, chosen).await?.response {
            Response::Session { session_id, ttl_ms } => {
                Ok((session_id, Duration::from_millis(u64::from(ttl_ms))))
            }
            other => Err(unexpected("SESSION_OPEN", other)),
        }
    }

    /// Sends SESSION_KEEPALIVE for `id`: the session's TTL, counted again from the server's
    /// handling of the request.
    ///
    /// # Errors
    /// [`Error::Server`] with [`ErrorCode::NoSession`] when the session has ended; otherwise
    /// any [`Error`] a request can meet.
    pub async fn keep_session_alive(&self, id: SessionId) -> Result<Duration> {
        let request = Request::SessionKeepalive { session_id: id };
        let timeout = self.config().request_timeout;
        match self.router().call(request, timeout).await?.response {
            Response::Session { ttl_ms, .. } => Ok(Duration::from_millis(u64::from(ttl_ms))),
            other => Err(unexpected("SESSION_KEEPALIVE", other)),
        }
    }

    /// Sends SESSION_CLOSE for `id`: how many leases its end freed.
    ///
    /// # Errors
    /// [`Error::Server`] with [`ErrorCode::NoSession`] when the session had ended already;
    /// otherwise any [`Error`] a request can meet.
    pub async fn close_session(&self, id: SessionId) -> Result<u32> {
        let request = Request::SessionClose { session_id: id };
        let timeout = self.config().request_timeout;
        // Freeing leases is lease keeping too: a close after a restart reconnects as soon
        // as a keep-alive would, not after the whole backoff.
        let purpose = Purpose::Keeping;
        match self
            .router()
            .call_for(request, timeout, purpose)
            .await?
            .response
        {
            Response::SessionClosed { released } => Ok(released),
            other => Err(unexpected("SESSION_CLOSE", other)),
        }
    }

    /// Acquires `key` in session `id` (a lease with no TTL of its own, living while the
    /// session does), waiting in line up to `options.wait`. The [`crate::Lease`]'s TTL is
    /// the session's time left at the grant; do not renew it (the server refuses), keep the
    /// session alive instead.
    ///
    /// `kind` is as [`Client::acquire_kind`]'s: a read lease or semaphore permits live in a
    /// session as a plain lease does (PROTOCOL.md 3.11).
    ///
    /// # Errors
    /// As [`Client::acquire_kind`]; [`ErrorCode::NoSession`] when the session is not live.
    pub async fn acquire_in_session(
        &self,
        key: impl AsRef<[u8]>,
        id: SessionId,
        kind: LeaseKind,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome> {
        self.acquire_in(key, Duration::ZERO, kind, options, Some(id), None)
            .await
            .map_err(Error::of_kind)
    }
}

impl Session {
    /// The session id the server chose (128 random bits).
    pub fn id(&self) -> SessionId {
        self.state.id
    }

    /// The session's TTL as the server granted it.
    pub fn ttl(&self) -> Duration {
        self.state.ttl
    }

    /// The local deadline: an instant taken before the last confirmed keep-alive (or the
    /// open) was sent, plus the TTL; never later than the server's. The session counts as
    /// lost [`deadline_margin`](crate::lease::deadline_margin) before it ([`Session::is_valid`]).
    pub fn deadline(&self) -> Instant {
        self.state.deadline()
    }

    /// True while the session (and every lock in it) is alive as far as this client can
    /// tell: no loss has fired and the local deadline less the margin has not passed.
    pub fn is_valid(&self) -> bool {
        self.state.is_valid()
    }

    /// Why the session was lost, once it was.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.state.reason.get().cloned()
    }

    /// A future that resolves when the session is lost, with the reason; it does not borrow
    /// the session.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let state = Arc::clone(&self.state);
        async move {
            state.loss.cancelled().await;
            state.reason()
        }
    }

    /// A token cancelled when the session is lost. Cancelling it yourself changes nothing.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.state.loss.child_token()
    }

    /// Takes `key` in this session without waiting; see [`Session::lock_with`].
    ///
    /// # Errors
    /// As [`Session::lock_with`].
    pub async fn lock(&self, key: impl AsRef<[u8]>) -> Result<AcquireOutcome<SessionGuard>> {
        self.lock_with(key, AcquireOptions::default()).await
    }

    /// Takes `key` in this session, waiting in line up to `options.wait`. The lock needs no
    /// renewal: it lives while the session does, and its guard reports the session's loss.
    /// `options.release_on_disconnect` must be false: a session outlives connections.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad key, wait or metadata, `release_on_disconnect`, or a
    /// session this client already counts as lost (code `NO_SESSION`, nothing sent); the
    /// same `NO_SESSION` error when the session is lost while the ACQUIRE waits (its local
    /// deadline passed with no keep-alive confirmed, say while the server was down): the
    /// wait is given up and nothing is held by this client, though the server may still
    /// queue or grant the ACQUIRE in the session until it is closed or ends (close it, or
    /// drop it, to free the key at once); the server's refusal ([`Error::Server`]: the
    /// session ended, too many locks in it); otherwise any [`Error`] a request can meet. A
    /// refusal because the session ended also fires the session's loss signal.
    pub async fn lock_with(
        &self,
        key: impl AsRef<[u8]>,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome<SessionGuard>> {
        self.lock_kind_with(key, LeaseKind::Exclusive, options)
            .await
    }

    /// Takes `key` as `kind` in this session (a read lease or semaphore permits live in a
    /// session as a plain lock does, PROTOCOL.md 3.11), waiting in line up to
    /// `options.wait`; otherwise as [`Session::lock_with`].
    ///
    /// # Errors
    /// As [`Session::lock_with`]; a kind that does not match the key's as
    /// [`Error::KindMismatch`] or [`Error::BadPermits`].
    pub async fn lock_kind_with(
        &self,
        key: impl AsRef<[u8]>,
        kind: LeaseKind,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome<SessionGuard>> {
        if options.release_on_disconnect {
            return Err(Error::Invalid {
                code: ErrorCode::BadFrame,
                message: "a session's lock cannot be released on disconnect".into(),
            });
        }
        if !self.is_valid() {
            // Not sent: a grant in a session this client counts as lost would be invalid on
            // arrival, and would hold the key until the server's end of the session.
            return Err(self.lost_error("the session is lost"));
        }
        let key = Bytes::copy_from_slice(key.as_ref());
        let acquire = self.client.acquire_in(
            &key,
            Duration::ZERO,
            kind,
            options,
            Some(self.state.id),
            None,
        );
        // A wait outlived by the session is given up: the crate would otherwise send the
        // ACQUIRE again after a reconnect in a session nobody keeps alive any more, and a
        // grant in it would be invalid on arrival. Loss first when both are ready.
        let outcome = tokio::select! {
            biased;
            _ = self.state.loss.cancelled() => Err(self.lost_error(LOST_WHILE_WAITING)),
            outcome = acquire => outcome.map_err(Error::of_kind),
        };
        match outcome {
            Ok(AcquireOutcome::Granted(_)) if !self.is_valid() => {
                Err(self.lost_error(LOST_WHILE_WAITING))
            }
            Ok(AcquireOutcome::Granted(lease)) => Ok(AcquireOutcome::Granted(SessionGuard {
                state: Arc::clone(&self.state),
                router: self.client.router().clone(),
                key,
                token: lease.fencing_token(),
                lease_id: lease.lease_id(),
                waited: lease.waited(),
                repeat: lease.is_repeat(),
                released: OnceLock::new(),
                loss: self.state.loss.child_token(),
            })),
            Ok(AcquireOutcome::Locked(by)) => Ok(AcquireOutcome::Locked(by)),
            Err(e) => {
                if is_session_ended(&e) {
                    self.state.fire(LossReason::SessionEnded);
                }
                Err(e)
            }
        }
    }

    /// The error of a lock not taken because this client counts the session as lost:
    /// `what`, and the loss reason (or the local deadline).
    fn lost_error(&self, what: &str) -> Error {
        let reason = self
            .loss_reason()
            .map_or("its deadline passed".into(), |r| r.to_string());
        Error::Invalid {
            code: ErrorCode::NoSession,
            message: format!("{what}: {reason}"),
        }
    }

    /// Closes the session: every lock in it is freed at once (each handed to its next
    /// waiter), and the loss signal of the session and its guards fires with
    /// [`LossReason::Released`].
    ///
    /// # Errors
    /// Any [`Error`] a request can meet; the session then ends at its TTL. An answer that the
    /// session had ended already is not an error.
    pub async fn close(self) -> Result<()> {
        self.state.close_on_stop.store(false, Ordering::Release);
        self.state.fire(LossReason::Released);
        self.stop.cancel();
        close(&self.client, self.state.id).await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The keep-alive task sees the stop and closes the session (see `keep_alive`).
        self.stop.cancel();
    }
}

/// A lock held in a [`Session`]: it needs no renewal and is lost when the session is.
///
/// Dropping it (or [`SessionGuard::release`]) releases the lock alone; the session and its
/// other locks go on.
pub struct SessionGuard {
    state: Arc<SessionState>,
    router: Router,
    key: Bytes,
    token: u64,
    lease_id: LeaseId,
    /// How long the acquire waited in line on the server.
    waited: Duration,
    /// Whether the grant was found by a repeat of its ACQUIRE ([`crate::Lease::is_repeat`]).
    repeat: bool,
    /// Set when the owner released this lock (the session's loss is in `state`).
    released: OnceLock<()>,
    /// Cancelled with the session's loss, or by a release of this lock alone.
    loss: CancellationToken,
}

impl fmt::Debug for SessionGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionGuard")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("session", &self.state.id)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl SessionGuard {
    /// The lock's name.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The fencing token: pass it with every write to the protected resource.
    pub fn fencing_token(&self) -> u64 {
        self.token
    }

    /// The lease id of the lock (a release names it).
    pub fn lease_id(&self) -> LeaseId {
        self.lease_id
    }

    /// How long the acquire waited in line on the server before the grant (zero for an
    /// immediate grant), by the server's clock.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// Whether the grant was found by a repeat of its ACQUIRE: an earlier send was granted
    /// and its answer lost ([`crate::Lease::is_repeat`]).
    pub fn is_repeat(&self) -> bool {
        self.repeat
    }

    /// The session the lock lives in.
    pub fn session_id(&self) -> SessionId {
        self.state.id
    }

    /// The session's local deadline (see [`Session::deadline`]).
    pub fn deadline(&self) -> Instant {
        self.state.deadline()
    }

    /// Time left until the guard gives up (the session's local deadline less the margin);
    /// zero once lost.
    pub fn time_left(&self) -> Duration {
        if !self.is_valid() {
            return Duration::ZERO;
        }
        self.state
            .give_up_at()
            .saturating_duration_since(Instant::now())
    }

    /// True while the lock is held as far as this client can tell: not released, and the
    /// session valid.
    pub fn is_valid(&self) -> bool {
        self.released.get().is_none() && self.state.is_valid()
    }

    /// Why the lock was lost, once it was: the session's reason, or
    /// [`LossReason::Released`] after a release of this lock.
    pub fn loss_reason(&self) -> Option<LossReason> {
        match self.released.get() {
            Some(()) => Some(LossReason::Released),
            None => self.state.reason.get().cloned(),
        }
    }

    /// A future that resolves when the lock is lost, with the reason; it does not borrow the
    /// guard.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let state = Arc::clone(&self.state);
        let loss = self.loss.clone();
        async move {
            loss.cancelled().await;
            // The session's signal cancels this one too; this one alone means a release.
            if state.loss.is_cancelled() {
                state.reason()
            } else {
                LossReason::Released
            }
        }
    }

    /// A token cancelled when the lock is lost. Cancelling it yourself changes nothing.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.loss.child_token()
    }

    /// Releases this lock alone; its loss signal fires with [`LossReason::Released`].
    ///
    /// # Errors
    /// Any [`Error`] a request can meet.
    pub async fn release(self) -> Result<ReleaseOutcome> {
        let _ = self.released.set(());
        self.loss.cancel();
        self.router.release(&self.key, self.lease_id).await
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        if self.released.set(()).is_err() || self.state.lost.load(Ordering::Acquire) {
            // Released by its owner, or gone with its session.
            self.loss.cancel();
            return;
        }
        self.loss.cancel();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (router, key, lease_id) = (self.router.clone(), self.key.clone(), self.lease_id);
            runtime.spawn(async move {
                let _ = router.release(&key, lease_id).await;
            });
        }
    }
}

/// What [`Session::lock_kind_with`] says of a wait it gave up because the session was lost.
const LOST_WHILE_WAITING: &str = "the session was lost while this ACQUIRE waited";

/// True when `error` is the server saying the session does not exist (any more).
fn is_session_ended(error: &Error) -> bool {
    matches!(
        error,
        Error::Server {
            code: ErrorCode::NoSession,
            ..
        }
    )
}

/// Sends SESSION_CLOSE for `id`; a session already ended is not an error.
async fn close(client: &Client, id: SessionId) -> Result<()> {
    match client.close_session(id).await {
        Ok(_) => Ok(()),
        Err(e) if is_session_ended(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The keep-alive task: keeps the session alive until it is lost or stopped, then (when the
/// session was dropped) fires [`LossReason::Released`] and closes it.
async fn keep_alive(client: Client, state: Arc<SessionState>, stop: CancellationToken) {
    keep_alive_until_lost(client.router(), &state, &stop).await;
    if stop.is_cancelled() && state.close_on_stop.load(Ordering::Acquire) {
        // A session given up unconfirmed may still live on the server: close it anyway.
        let ended = matches!(state.reason.get(), Some(LossReason::SessionEnded));
        state.fire(LossReason::Released);
        if !ended {
            let _ = close(&client, state.id).await;
        }
    }
}

/// What one keep-alive attempt came to.
enum KeepAlive {
    /// Confirmed: the session runs `ttl` from `sent_at`.
    Confirmed { sent_at: Instant, ttl: Duration },
    /// The server says the session ended.
    Ended,
    /// No answer, or an error; worth retrying until `give_up_at`.
    Failed(String),
    /// Stopped, or `give_up_at` passed, while the keep-alive was in flight.
    Interrupted,
}

async fn keep_alive_until_lost(router: &Router, state: &SessionState, stop: &CancellationToken) {
    let mut next_at = state.base + state.every;
    let mut last_error: Option<String> = None;
    let retry_delay = (state.every / 4).max(Duration::from_millis(5));
    loop {
        let give_up_at = state.give_up_at();
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(give_up_at) => {
                return state.fire(LossReason::Expired { last_error });
            }
            _ = tokio::time::sleep_until(next_at) => {}
        }
        let attempt = tokio::select! {
            biased;
            _ = stop.cancelled() => KeepAlive::Interrupted,
            _ = tokio::time::sleep_until(give_up_at) => KeepAlive::Interrupted,
            attempt = keep_alive_once(router, state) => attempt,
        };
        match attempt {
            KeepAlive::Confirmed { sent_at, ttl } => {
                state.extend(local_deadline(sent_at, Duration::ZERO, ttl));
                next_at = sent_at + state.every;
                last_error = None;
            }
            KeepAlive::Ended => return state.fire(LossReason::SessionEnded),
            KeepAlive::Failed(error) => {
                tracing::debug!(%error, "session keep-alive failed; retrying");
                last_error = Some(error);
                next_at = Instant::now() + retry_delay;
            }
            // The loop's next turn sees which.
            KeepAlive::Interrupted => next_at = Instant::now(),
        }
    }
}

/// Sends one SESSION_KEEPALIVE. With several endpoints an attempt waits no longer than the
/// time between keep-alives, so a hung node (then left for the next endpoint) leaves time to
/// retry elsewhere before the give-up point.
async fn keep_alive_once(router: &Router, state: &SessionState) -> KeepAlive {
    let mut timeout = router.config().request_timeout;
    if router.endpoints().len() > 1 {
        timeout = timeout.min(state.every);
    }
    let request = Request::SessionKeepalive {
        session_id: state.id,
    };
    match router.call_for(request, timeout, Purpose::Keeping).await {
        Ok(answer) => match answer.response {
            // `sent_at` is from before the send that got the answer (after NOT_LEADER, the
            // last), so the new deadline never over-estimates the server's.
            Response::Session { ttl_ms, .. } => KeepAlive::Confirmed {
                sent_at: answer.sent_at,
                ttl: Duration::from_millis(u64::from(ttl_ms)),
            },
            Response::Error {
                code: ErrorCode::NoSession,
                ..
            } => KeepAlive::Ended,
            other => KeepAlive::Failed(unexpected("SESSION_KEEPALIVE", other).to_string()),
        },
        Err(e) => KeepAlive::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::sync::Mutex;

    use super::*;
    use crate::fake::{self, Script};
    use tenure_protocol::handshake::VERSION;

    const TTL_MS: u32 = 3_000;
    const ID: u128 = 0xfeed;

    /// A server that opens sessions, grants acquires in them, and answers keep-alives with
    /// `keep_alive` (recording when each arrived) and closes with SESSION_CLOSED.
    fn script(keep_alive: Option<Response>, seen: Arc<Mutex<Vec<Instant>>>) -> Script {
        Arc::new(move |request| match request {
            Request::SessionOpen { ttl_ms, .. } => Some(Response::Session {
                session_id: SessionId::from_u128(ID),
                ttl_ms: *ttl_ms,
            }),
            Request::SessionKeepalive { .. } => {
                seen.lock().unwrap().push(Instant::now());
                keep_alive.clone()
            }
            Request::Acquire {
                ttl_ms, session_id, ..
            } => {
                assert_eq!((*ttl_ms, *session_id), (0, Some(SessionId::from_u128(ID))));
                Some(Response::Granted {
                    token: 7,
                    lease_id: LeaseId::from_u128(1),
                    ttl_ms: TTL_MS,
                    waited_ms: 0,
                })
            }
            Request::SessionClose { .. } => Some(Response::SessionClosed { released: 1 }),
            _ => Some(Response::Released),
        })
    }

    fn kept() -> Option<Response> {
        Some(Response::Session {
            session_id: SessionId::from_u128(ID),
            ttl_ms: TTL_MS,
        })
    }

    fn ttl() -> Duration {
        Duration::from_millis(u64::from(TTL_MS))
    }

    /// The crate's "this session is lost" refusal (never sent to the server).
    fn is_no_session(error: &Error) -> bool {
        matches!(
            error,
            Error::Invalid {
                code: ErrorCode::NoSession,
                ..
            }
        )
    }

    /// The session ids of the SESSION_OPENs a fake server got, in order.
    type Opens = Arc<Mutex<Vec<SessionId>>>;

    /// A client (1 s request time-out) of a fake server that answers its `n`th SESSION_OPEN
    /// (from 1) with `answer(n, ttl_ms, session id)` (`None`: no answer) and everything else
    /// with [`kept`]; and the ids the opens named.
    async fn opening(
        answer: impl Fn(usize, u32, SessionId) -> Option<Response> + Send + Sync + 'static,
    ) -> (fake::FakeServer, Client, Opens) {
        let (script, ids) = open_script(answer);
        let server = fake::start(VERSION, 16, script).await;
        let client = client_of(server.addr.clone()).await;
        (server, client, ids)
    }

    /// [`opening`]'s script, and the ids the opens named.
    fn open_script(
        answer: impl Fn(usize, u32, SessionId) -> Option<Response> + Send + Sync + 'static,
    ) -> (Script, Opens) {
        let ids = Opens::default();
        let sent = Arc::clone(&ids);
        let script: Script = Arc::new(move |request| match request {
            Request::SessionOpen { ttl_ms, session_id } => {
                let id = session_id.expect("the client picks the session id");
                let mut sent = sent.lock().unwrap();
                sent.push(id);
                answer(sent.len(), *ttl_ms, id)
            }
            _ => kept(),
        });
        (script, ids)
    }

    /// A client of `addr` with a request time-out of 1 s.
    async fn client_of(addr: String) -> Client {
        let config = crate::ClientConfig {
            request_timeout: Duration::from_secs(1),
            ..crate::ClientConfig::default()
        };
        Client::connect_with(addr, config).await.unwrap()
    }

    /// An open answered only after its session's deadline counted from the first send (a
    /// TTL shorter than the time a resend took) is not taken: the server may have forgotten
    /// the session the first send opened and opened the id again, empty, for the resend. A
    /// new round opens another id (outside test a60, F2: the caller got a dead session).
    #[tokio::test(start_paused = true)]
    async fn an_open_answered_past_its_deadline_opens_another() {
        let (_server, client, ids) = opening(|n, ttl_ms, session_id| {
            (n > 1).then_some(Response::Session { session_id, ttl_ms })
        })
        .await;
        // The first send's answer is lost; the resend is answered after the 1 s time-out.
        let ttl = Duration::from_millis(600);
        let session = client.session(ttl).await.expect("the third send's session");
        let sent = ids.lock().unwrap().clone();
        assert_eq!(sent.len(), 3);
        assert_eq!(sent[0], sent[1]);
        assert_ne!(sent[1], sent[2], "a new round, a new id");
        assert_eq!(session.id(), sent[2]);
        assert!(session.is_valid());
    }

    /// An open never answered: when the retries run out the caller hears the last whole
    /// send's time-out, not that of the send the end of the retries cut short (outside
    /// test a61).
    #[tokio::test(start_paused = true)]
    async fn an_open_whose_retries_run_out_reports_a_whole_sends_failure() {
        let (script, ids) = open_script(|_, _, _| None);
        let server = fake::start(VERSION, 16, script).await;
        let config = crate::ClientConfig {
            request_timeout: Duration::from_secs(1),
            acquire_retry_for: Duration::from_millis(2_500),
            ..crate::ClientConfig::default()
        };
        let client = Client::connect_with(server.addr.clone(), config)
            .await
            .unwrap();
        let e = client.session(ttl()).await.unwrap_err();
        assert!(
            matches!(e, Error::Timeout(t) if t == Duration::from_secs(1)),
            "{e:?}"
        );
        let sent = ids.lock().unwrap().clone();
        assert!(
            sent.len() >= 3 && sent.iter().all(|id| *id == sent[0]),
            "{sent:?}"
        );
    }

    /// A front (a proxy or load balancer) before a server whose backend goes down: its first
    /// connection goes through and is cut after `FRONT_CUT_AFTER`; connections for `down`
    /// after that are accepted and closed at once; the rest go through.
    async fn front(server: String, down: Duration) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let started = Instant::now();
        tokio::spawn(async move {
            for n in 0.. {
                let (mut stream, _) = listener.accept().await.unwrap();
                let elapsed = started.elapsed();
                if n > 0 && elapsed < FRONT_CUT_AFTER + down {
                    continue;
                }
                let cut_after = if n == 0 {
                    FRONT_CUT_AFTER
                } else {
                    Duration::MAX
                };
                let server = server.clone();
                tokio::spawn(async move {
                    let mut backend = tokio::net::TcpStream::connect(server).await.unwrap();
                    let relay = tokio::io::copy_bidirectional(&mut stream, &mut backend);
                    let _ = tokio::time::timeout(cut_after, relay).await;
                });
            }
        });
        addr
    }

    /// How long [`front`]'s first connection lasts.
    const FRONT_CUT_AFTER: Duration = Duration::from_millis(300);

    /// A lost SESSION_OPEN is sent again through connections a front accepts and closes
    /// before the handshake's answer, until one gets through: not given up at the first
    /// (outside test a60, F1: the open's session was left behind; this test passed before
    /// that fix too, its scripts `cli_orphan.sh` and `cli_acquire_orphan.sh` did not). The
    /// cluster's other node knows no leader. In real time: the front's sockets are real,
    /// and a paused clock would run the time-outs out meanwhile.
    #[tokio::test]
    async fn a_lost_open_is_sent_again_through_connections_closed_in_the_handshake() {
        let (script, ids) = open_script(|n, ttl_ms, session_id| {
            (n > 1).then_some(Response::Session { session_id, ttl_ms })
        });
        let server = fake::start(VERSION, 16, script).await;
        let no_leader: Script = Arc::new(|_| {
            Some(Response::Error {
                code: ErrorCode::NotLeader,
                message: "unknown".into(),
            })
        });
        let follower = fake::start(VERSION, 16, no_leader).await;
        let front = front(server.addr.clone(), Duration::from_secs(2)).await;
        let client = client_of(format!("{front},{}", follower.addr)).await;
        // A TTL longer than the outage, so the resend's answer comes in time.
        let ttl = Duration::from_secs(30);
        let session = client.session(ttl).await.expect("the resend's answer");
        let sent = ids.lock().unwrap().clone();
        assert_eq!(sent.len(), 2);
        assert_eq!((sent[0], sent[1]), (session.id(), session.id()));
    }

    /// The first SESSION_OPEN is never answered (its reply lost); the client sends it again
    /// with the same session id, so a server that applied the first opens nothing more, and
    /// the session is counted from the first send, the earliest that can have opened it
    /// (outside test a49, P1).
    #[tokio::test(start_paused = true)]
    async fn a_session_open_whose_reply_is_lost_is_sent_again_with_its_id() {
        let (_server, client, ids) = opening(|n, ttl_ms, session_id| {
            (n > 1).then_some(Response::Session { session_id, ttl_ms })
        })
        .await;
        let started = Instant::now();
        let session = client
            .session(ttl())
            .await
            .expect("the second send's answer");
        let sent = ids.lock().unwrap().clone();
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[0], sent[1], "a resend keeps its session id");
        assert_eq!(session.id(), sent[0]);
        // Counted from the first send, not the second (1 s later, after its time-out).
        assert!(session.deadline() <= started + ttl());
        assert!(session.deadline() >= started + ttl() - deadline_margin_of(ttl()));
        // Open without a Session too (the console's primitive): a new id of its own.
        let (id, _) = client.open_session(ttl()).await.unwrap();
        assert_ne!(id, sent[0]);
        let chosen = SessionId::from_u128(0x5e5);
        let (id, _) = client.open_session_as(ttl(), Some(chosen)).await.unwrap();
        assert_eq!(id, chosen);
    }

    /// An open whose session ended before its answer came (NO_SESSION to a resend) starts
    /// again with a new session id; with the caller's own id, NO_SESSION is the answer.
    #[tokio::test(start_paused = true)]
    async fn a_session_open_whose_session_ended_meanwhile_opens_another() {
        let (_server, client, ids) = opening(|n, ttl_ms, session_id| match n {
            1 => None,
            2 => Some(Response::Error {
                code: ErrorCode::NoSession,
                message: "session was opened, and has ended".into(),
            }),
            _ => Some(Response::Session { session_id, ttl_ms }),
        })
        .await;
        let session = client
            .session(ttl())
            .await
            .expect("the third send's session");
        let sent = ids.lock().unwrap().clone();
        assert_eq!(sent.len(), 3);
        assert_eq!(sent[0], sent[1]);
        assert_ne!(sent[1], sent[2], "a new round, a new id");
        assert_eq!(session.id(), sent[2]);
        let (_server, client, _) = opening(|_, _, _| {
            Some(Response::Error {
                code: ErrorCode::NoSession,
                message: "ended".into(),
            })
        })
        .await;
        let chosen = SessionId::from_u128(0x5e5);
        let e = client
            .open_session_as(ttl(), Some(chosen))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Server {
                    code: ErrorCode::NoSession,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn keep_alives_go_every_third_of_the_ttl_and_move_the_deadline() {
        let seen = Arc::default();
        let server = fake::start(VERSION, 16, script(kept(), Arc::clone(&seen))).await;
        let client = Client::connect(server.addr.clone()).await.unwrap();
        let before = Instant::now();
        let session = client.session(ttl()).await.unwrap();
        let guard = session.lock("k").await.unwrap().granted().unwrap();
        assert!(session.deadline() >= before + ttl() - deadline_margin_of(ttl()));
        tokio::time::sleep(ttl() * 4).await;
        assert!(session.is_valid() && guard.is_valid());
        let seen = seen.lock().unwrap().clone();
        assert!(seen.len() >= 11 && seen.len() <= 13, "{}", seen.len());
        for pair in seen.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(
                gap >= ttl() / 3 && gap <= ttl() / 3 + Duration::from_millis(5),
                "{gap:?}"
            );
        }
        // Counted from before the last keep-alive was sent: never past the server's.
        let last = *seen.last().unwrap();
        assert!(session.deadline() <= last + ttl());
        assert!(session.deadline() >= last + ttl() - deadline_margin_of(ttl()) - ms(5));
    }

    fn deadline_margin_of(span: Duration) -> Duration {
        crate::lease::deadline_margin(span)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn a_keep_alive_answered_no_session_fires_every_guard() {
        let ended = Some(Response::Error {
            code: ErrorCode::NoSession,
            message: "no live session".into(),
        });
        let server = fake::start(VERSION, 16, script(ended, Arc::default())).await;
        let client = Client::connect(server.addr.clone()).await.unwrap();
        let session = client.session(ttl()).await.unwrap();
        let a = session.lock("a").await.unwrap().granted().unwrap();
        let b = session.lock("b").await.unwrap().granted().unwrap();
        let started = Instant::now();
        let reason = tokio::time::timeout(ttl(), a.lost()).await.unwrap();
        assert_eq!(reason, LossReason::SessionEnded);
        assert_eq!(b.lost().await, LossReason::SessionEnded);
        assert!(
            started.elapsed() <= ttl() / 3 + ms(10),
            "{:?}",
            started.elapsed()
        );
        assert!(!session.is_valid() && !a.is_valid() && !b.is_valid());
        assert!(a.cancellation_token().is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn unanswered_keep_alives_give_up_at_the_deadline_less_the_margin() {
        let server = fake::start(VERSION, 16, script(None, Arc::default())).await;
        let client = Client::connect(server.addr.clone()).await.unwrap();
        let session = client.session(ttl()).await.unwrap();
        let guard = session.lock("k").await.unwrap().granted().unwrap();
        let give_up_at = session.deadline() - ttl() / 10;
        let reason = guard.lost().await;
        assert!(matches!(reason, LossReason::Expired { .. }), "{reason:?}");
        let late = Instant::now() - give_up_at;
        assert!(late <= ms(2), "fired {late:?} after the give-up instant");
        // A session counted lost takes no more locks: nothing is sent.
        let refused = session.lock("other").await.unwrap_err();
        assert!(is_no_session(&refused), "{refused:?}");
    }

    /// A lock still waiting in line when its session is lost (keep-alives unanswered, as
    /// while the server is down) gives its wait up at the session's give-up instant with
    /// NO_SESSION, rather than waiting on (and being sent again) in a session nobody keeps.
    #[tokio::test(start_paused = true)]
    async fn a_wait_outlived_by_its_session_ends_with_no_session() {
        let inner = script(None, Arc::default());
        let queued: Script = Arc::new(move |request| match request {
            Request::Acquire { .. } => None, // in line, never granted
            other => inner(other),
        });
        let server = fake::start(VERSION, 16, queued).await;
        let client = Client::connect(server.addr.clone()).await.unwrap();
        let session = client.session(ttl()).await.unwrap();
        let give_up_at = session.deadline() - ttl() / 10;
        let options = AcquireOptions {
            wait: ttl() * 20,
            ..AcquireOptions::default()
        };
        let waited = tokio::time::timeout(ttl() * 2, session.lock_with("k", options)).await;
        let refused = waited.expect("the wait ends with the session").unwrap_err();
        assert!(is_no_session(&refused), "{refused:?}");
        assert!(
            Instant::now() >= give_up_at,
            "ended before the give-up instant"
        );
        assert!(matches!(
            session.loss_reason(),
            Some(LossReason::Expired { .. })
        ));
    }

    /// The leader keeps the session alive until `moved` is set, then answers NOT_LEADER
    /// naming `next` (a fail-over); the keep-alives follow it there.
    #[tokio::test(start_paused = true)]
    async fn keep_alives_follow_the_leader_and_the_session_goes_on_there() {
        let seen_there = Arc::new(Mutex::new(Vec::new()));
        let next = fake::start(VERSION, 16, script(kept(), Arc::clone(&seen_there))).await;
        let moved = Arc::new(AtomicBool::new(false));
        let (moved_here, next_addr) = (Arc::clone(&moved), next.addr.clone());
        let inner = script(kept(), Arc::default());
        let first: Script = Arc::new(move |request| {
            if moved_here.load(Ordering::Relaxed) {
                return Some(Response::Error {
                    code: ErrorCode::NotLeader,
                    message: format!("leader={next_addr}"),
                });
            }
            inner(request)
        });
        let first = fake::start(VERSION, 16, first).await;
        let addrs = format!("{},{}", first.addr, next.addr);
        let client = Client::connect(addrs).await.unwrap();
        let session = client.session(ttl()).await.unwrap();
        let guard = session.lock("k").await.unwrap().granted().unwrap();
        tokio::time::sleep(ttl()).await;
        moved.store(true, Ordering::Relaxed);
        let moved_at = Instant::now();
        tokio::time::sleep(ttl() * 3).await;
        assert!(
            session.is_valid() && guard.is_valid(),
            "{:?}",
            guard.loss_reason()
        );
        assert!(
            session.deadline() > moved_at + ttl(),
            "kept alive at the new leader"
        );
        assert!(seen_there.lock().unwrap().len() >= 8);
    }

    /// The server crashes (every connection closed, then connections refused), comes back
    /// on its address answering SHUTTING_DOWN for a while, then keeps the session alive
    /// again: the keep-alives are retried throughout and the session and its locks go on,
    /// since no failure lasted until the give-up point.
    #[tokio::test(start_paused = true)]
    async fn keep_alives_are_retried_through_a_crash_a_restart_and_shutting_down() {
        let server = fake::start(VERSION, 16, script(kept(), Arc::default())).await;
        let addr = server.addr.clone();
        let client = Client::connect(addr.clone()).await.unwrap();
        let session = client.session(ttl()).await.unwrap();
        let a = session.lock("a").await.unwrap().granted().unwrap();
        let b = session.lock("b").await.unwrap().granted().unwrap();
        tokio::time::sleep(ttl()).await;
        drop(server);
        // Down for a fifth of the TTL: keep-alives meet a closed connection, then refusals.
        tokio::time::sleep(ttl() / 5).await;
        let shutting_down = Arc::new(AtomicU32::new(3));
        let (left, inner) = (Arc::clone(&shutting_down), script(kept(), Arc::default()));
        let restarted: Script = Arc::new(move |request| {
            let keep_alive = matches!(request, Request::SessionKeepalive { .. });
            if keep_alive
                && left
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok()
            {
                return Some(Response::Error {
                    code: ErrorCode::ShuttingDown,
                    message: "shutting down".into(),
                });
            }
            inner(request)
        });
        let restarted = fake::start_at(&addr, VERSION, 16, restarted).await;
        let back_at = Instant::now();
        tokio::time::sleep(ttl() * 2).await;
        assert_eq!(
            shutting_down.load(Ordering::Relaxed),
            0,
            "answered SHUTTING_DOWN"
        );
        assert!(
            session.is_valid() && a.is_valid() && b.is_valid(),
            "{:?}",
            session.loss_reason()
        );
        assert!(
            session.deadline() > back_at + ttl(),
            "kept alive at the restarted server"
        );
        assert_eq!((a.fencing_token(), b.fencing_token()), (7, 7));
        drop(restarted);
    }

    /// A restart shorter than the session's time left does not outlast it for want of a
    /// reconnect attempt: keep-alives wait at most `RECONNECT_DELAY_KEEPING_MAX` after a
    /// failed one, not the client's backoff (here 3-6 s, past the session's deadline, so the
    /// session was lost before: outside test a33).
    #[tokio::test(start_paused = true)]
    async fn keep_alives_reconnect_sooner_than_the_backoff() {
        let server = fake::start(VERSION, 16, script(kept(), Arc::default())).await;
        let addr = server.addr.clone();
        let config = crate::ClientConfig {
            reconnect_delay_min: Duration::from_secs(6),
            reconnect_delay_max: Duration::from_secs(6),
            ..crate::ClientConfig::default()
        };
        let client = Client::connect_with(addr.clone(), config).await.unwrap();
        let session = client.session(ttl()).await.unwrap();
        let a = session.lock("a").await.unwrap().granted().unwrap();
        tokio::time::sleep(ttl()).await;
        drop(server);
        // Down for half the TTL: the next keep-alive meets a refusal, and the backoff would
        // put the next attempt 3 to 6 s later.
        tokio::time::sleep(ttl() / 2).await;
        let restarted = fake::start_at(&addr, VERSION, 16, script(kept(), Arc::default())).await;
        let back_at = Instant::now();
        tokio::time::sleep(ttl() * 2).await;
        assert!(
            session.is_valid() && a.is_valid(),
            "{:?}",
            session.loss_reason()
        );
        assert!(
            session.deadline() > back_at + ttl(),
            "kept alive after the restart"
        );
        drop(restarted);
    }

    /// A session lock's ACQUIRE whose reply is lost (first send unanswered, then answered
    /// SHUTTING_DOWN) is sent again with the same acquire id and session, and the repeat's
    /// REGRANTED is the caller's one lock.
    #[tokio::test(start_paused = true)]
    async fn a_session_lock_whose_reply_is_lost_is_retried_with_its_acquire_id() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (sends, inner) = (Arc::clone(&seen), script(kept(), Arc::default()));
        let script: Script = Arc::new(move |request| match request {
            Request::Acquire {
                acquire_id,
                session_id,
                ..
            } => {
                let mut sends = sends.lock().unwrap();
                sends.push((*acquire_id, *session_id));
                match sends.len() {
                    1 => None,
                    2 => Some(Response::Error {
                        code: ErrorCode::ShuttingDown,
                        message: "shutting down".into(),
                    }),
                    _ => Some(Response::Regranted {
                        token: 11,
                        lease_id: LeaseId::from_u128(5),
                        ttl_left_ms: TTL_MS,
                    }),
                }
            }
            other => inner(other),
        });
        let server = fake::start(VERSION, 16, script).await;
        let config = crate::ClientConfig {
            request_timeout: ms(500),
            ..crate::ClientConfig::default()
        };
        let client = Client::connect_with(server.addr.clone(), config)
            .await
            .unwrap();
        let session = client.session(ttl()).await.unwrap();
        let guard = session.lock("k").await.unwrap().granted().unwrap();
        assert_eq!(
            (guard.fencing_token(), guard.lease_id()),
            (11, LeaseId::from_u128(5))
        );
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(seen[0].0.is_some(), "a session lock carries an acquire id");
        assert!(
            seen.iter().all(|send| *send == seen[0]),
            "sent again as it was: {seen:?}"
        );
        assert_eq!(seen[0].1, Some(session.id()));
        assert!(guard.is_valid());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_session_closes_it_and_a_released_lock_goes_alone() {
        let closes = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&closes);
        let inner = script(kept(), Arc::default());
        let script: Script = Arc::new(move |request| {
            if matches!(request, Request::SessionClose { .. }) {
                counted.fetch_add(1, Ordering::Relaxed);
            }
            inner(request)
        });
        let server = fake::start(VERSION, 16, script).await;
        let client = Client::connect(server.addr.clone()).await.unwrap();
        let session = client.session(ttl()).await.unwrap();
        let a = session.lock("a").await.unwrap().granted().unwrap();
        let b = session.lock("b").await.unwrap().granted().unwrap();
        let a_lost = a.lost();
        a.release().await.unwrap();
        assert_eq!(a_lost.await, LossReason::Released);
        assert!(b.is_valid(), "the other lock goes on");
        let b_lost = b.lost();
        drop(session);
        assert_eq!(b_lost.await, LossReason::Released);
        tokio::time::sleep(ms(50)).await;
        assert_eq!(
            closes.load(Ordering::Relaxed),
            1,
            "closed once, in the background"
        );
    }
}
