//! [`Lease`]: one grant of a lock, with a local deadline that never over-estimates; and
//! [`LeaseGuard`]: a lease renewed in the background that reports its loss at once; and
//! [`AcquireOutcome`], the answer to an acquire.
//!
//! # The local deadline
//! The server starts a lease's clock when it grants (or renews) it, which is after the client
//! sent the request. The client takes an [`Instant`] *before* sending and adds the granted TTL,
//! so its deadline is never later than the server's (up to clock rate differences, which the
//! guard's margin absorbs).
//!
//! A blocking acquire may be granted long after it was sent: the grant says how long it
//! waited in line on the server (`waited_ms`), and the deadline is
//! `sent_at + waited + ttl`. The server counts the wait from its receipt of the request, which
//! is after `sent_at`, so this is still never later than the server's deadline; without the
//! wait a lease won after waiting longer than its TTL would look expired on arrival.
//!
//! The server counts whole milliseconds: the instant a lease starts and the wait it reports
//! are each rounded down, so its lease can end up to 1 ms before the exact `start + ttl`, and
//! `waited_ms` can exceed the true wait by up to 1 ms. Every local deadline is therefore
//! [`SERVER_ROUNDING`] (2 ms) earlier than the sum, which keeps it at or before the server's
//! even when the request reached the server within a millisecond of being sent. Over long
//! spans the client's and the server's monotonic clocks may also run at slightly different
//! rates (NTP-disciplined machines: well under 0.1 %), and in a cluster the lease is counted
//! again by a new leader's clock: so the margin is the larger of the 2 ms and
//! [`CLOCK_RATE_SLACK_DIVISOR`]`⁻¹` (0.1 %) of the span ([`deadline_margin`]).
//!
//! # How a guard reports loss
//! ```text
//!  sent ──renew──renew──renew──X (no confirmation)        deadline
//!   |<─renew_every─>|                        give_up_at ──┘ (deadline - margin)
//! ```
//! A guard fires its loss signal ([`LeaseGuard::lost`], [`LeaseGuard::cancellation_token`],
//! [`LeaseGuard::is_valid`]) at the first of: a renewal answered LOST; the connection a
//! `release_on_disconnect` lease is tied to closing; `give_up_at` passing without a confirmed
//! renewal (server down, connection lost and not regained, renewals stuck). A timer is set for
//! `give_up_at`, so the signal fires on time even while a renewal is still in flight.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::{LeaseId, Request};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::conn::Shared;
use crate::error::{Error, Result};
use crate::outcome::{renew_outcome, LockedBy, ReleaseOutcome, RenewOutcome};
use crate::router::{Purpose, Router};

/// One grant of a lock: the key, its fencing token, its lease id and a local deadline.
///
/// A `Lease` does nothing by itself: it expires at its TTL unless renewed. Dropping it does not
/// release the lock. For background renewal turn it into a [`LeaseGuard`] with
/// [`Lease::keep_alive`].
pub struct Lease {
    router: Router,
    key: Bytes,
    token: u64,
    lease_id: LeaseId,
    ttl: Duration,
    /// How long the acquire waited in line on the server before the grant.
    waited: Duration,
    deadline: Instant,
    /// The connection the lease dies with, when taken with `release_on_disconnect`.
    tied_to: Option<Arc<Shared>>,
    /// Whether a repeat of the ACQUIRE found this grant (REGRANTED, PROTOCOL.md 3.9).
    repeat: bool,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("lease_id", &self.lease_id)
            .field("ttl", &self.ttl)
            .field("waited", &self.waited)
            .field("time_left", &self.time_left())
            .finish()
    }
}

/// The answer to an acquire: the lock (as a [`Lease`] or [`LeaseGuard`]), or who holds it.
///
/// It lives here rather than with the other outcomes because its default payload is a
/// [`Lease`].
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

/// What a GRANTED reply said, for [`Lease::new`].
pub(crate) struct Granted {
    pub(crate) token: u64,
    pub(crate) lease_id: LeaseId,
    pub(crate) ttl: Duration,
    /// Time the acquire waited on the server before the grant.
    pub(crate) waited: Duration,
}

/// What the local deadline gives up for the server's whole-millisecond clock: one
/// millisecond for the rounding of the lease's start, one for the rounding of `waited_ms`.
pub const SERVER_ROUNDING: Duration = Duration::from_millis(2);

/// The local deadline also gives up this fraction (1/1000, 0.1 %) of the span it counts, for
/// the difference in rate between the client's monotonic clock and the server's (or the next
/// leader's, in a cluster): NTP keeps it well below this.
pub const CLOCK_RATE_SLACK_DIVISOR: u32 = 1000;

/// What a local deadline `span` (wait plus TTL) after the send gives up: the larger of
/// [`SERVER_ROUNDING`] and 0.1 % of the span (PROTOCOL.md 3.3).
pub fn deadline_margin(span: Duration) -> Duration {
    SERVER_ROUNDING.max(span / CLOCK_RATE_SLACK_DIVISOR)
}

/// The latest instant at which the server's lease can be trusted to still run: `ttl` after a
/// grant or renewal sent at `sent_at` that waited `waited` in line on the server, less
/// [`deadline_margin`].
pub(crate) fn local_deadline(sent_at: Instant, waited: Duration, ttl: Duration) -> Instant {
    let span = waited + ttl;
    sent_at + span.saturating_sub(deadline_margin(span))
}

impl Lease {
    /// A lease granted in answer to a request sent no earlier than `sent_at`: the server's
    /// lease started `granted.waited` after its receipt of the request, so it ends no earlier
    /// than `sent_at + waited + ttl` less the server's rounding ([`local_deadline`]).
    pub(crate) fn new(
        router: Router,
        key: Bytes,
        granted: Granted,
        sent_at: Instant,
        tied_to: Option<Arc<Shared>>,
    ) -> Lease {
        let Granted {
            token,
            lease_id,
            ttl,
            waited,
        } = granted;
        Lease {
            router,
            key,
            token,
            lease_id,
            ttl,
            waited,
            deadline: local_deadline(sent_at, waited, ttl),
            tied_to,
            repeat: false,
        }
    }

    /// Marks the lease as one a repeat of its ACQUIRE found (REGRANTED), counted both from
    /// the first send and from the repeat (PROTOCOL.md 3.9): the local deadline moves to
    /// `deadline` if that is earlier.
    pub(crate) fn found_by_repeat(&mut self, deadline: Instant) {
        self.deadline = self.deadline.min(deadline);
        self.repeat = true;
    }

    /// Whether this grant was found by a repeat of its ACQUIRE (REGRANTED, PROTOCOL.md 3.9):
    /// an earlier send of the same acquire id was granted, and its answer was lost. Its
    /// [`Lease::ttl`] is then the TTL asked for, or for a lease in a session the time the
    /// session had left.
    pub fn is_repeat(&self) -> bool {
        self.repeat
    }

    /// The lock's name.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The fencing token: larger than every token granted for this key before. Pass it with
    /// every write to the protected resource (see [`crate::fence`]).
    pub fn fencing_token(&self) -> u64 {
        self.token
    }

    /// The lease id, needed to renew or release.
    pub fn lease_id(&self) -> LeaseId {
        self.lease_id
    }

    /// The lease length granted by the last grant or renewal.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How long the acquire waited in line on the server before it was granted (zero for an
    /// immediate grant), by the server's clock. Zero for a grant that a repeat of the ACQUIRE
    /// found (its first answer lost, PROTOCOL.md 3.9): the server reports no wait then, and a
    /// deadline counted from the first send with no wait is never later than the server's.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The local deadline: an instant taken before the last successful grant or renewal was
    /// sent, plus the time the grant waited on the server (for the grant only), plus the TTL
    /// granted. Never later than the server's. A [`tokio::time::Instant`]: under a paused test
    /// clock it is virtual time (`into_std()` gives the `std` one).
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Time left until the local deadline; zero once it has passed.
    pub fn time_left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// True once the local deadline has passed.
    pub fn is_expired(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// True when the lease was taken with `release_on_disconnect`.
    pub fn release_on_disconnect(&self) -> bool {
        self.tied_to.is_some()
    }

    /// Renews for the same TTL; see [`Lease::renew_for`].
    ///
    /// # Errors
    /// As [`Client::renew`](crate::Client::renew).
    pub async fn renew(&mut self) -> Result<RenewOutcome> {
        self.renew_for(self.ttl).await
    }

    /// Extends the lease to `ttl` from now. On RENEWED the local deadline moves to an instant
    /// taken before sending (the last send, after a `NOT_LEADER`) plus the TTL granted; on
    /// LOST it moves to the past.
    ///
    /// # Errors
    /// As [`Client::renew`](crate::Client::renew); the deadline is left alone.
    pub async fn renew_for(&mut self, ttl: Duration) -> Result<RenewOutcome> {
        let request = Request::Renew {
            key: self.key.clone(),
            lease_id: self.lease_id,
            ttl_ms: u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX),
        };
        // From before the send that got the answer (a re-send after NOT_LEADER, maybe).
        let (outcome, sent_at) = self.router.renew_sent_at(request).await?;
        match outcome {
            RenewOutcome::Renewed { ttl } => {
                self.ttl = ttl;
                self.deadline = local_deadline(sent_at, Duration::ZERO, ttl);
            }
            RenewOutcome::Lost => self.deadline = self.deadline.min(sent_at),
        }
        Ok(outcome)
    }

    /// Releases the lock.
    ///
    /// # Errors
    /// As [`Client::release`](crate::Client::release).
    pub async fn release(self) -> Result<ReleaseOutcome> {
        self.router.release(&self.key, self.lease_id).await
    }

    /// Starts renewing in the background with default [`KeepAliveOptions`].
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn keep_alive(self) -> LeaseGuard {
        self.keep_alive_with(KeepAliveOptions::default())
    }

    /// Starts renewing in the background every `options.renew_every`.
    ///
    /// # Panics
    /// Outside a tokio runtime, or when `renew_every + margin` is not shorter than the TTL
    /// (the guard could then never renew in time).
    pub fn keep_alive_with(self, options: KeepAliveOptions) -> LeaseGuard {
        LeaseGuard::start(self, options)
    }
}

/// How a [`LeaseGuard`] renews.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeepAliveOptions {
    /// Time between renewals; `None` means a third of the TTL.
    pub renew_every: Option<Duration>,
    /// How long before the local deadline the guard declares the lease lost if no renewal was
    /// confirmed, to absorb clock rate differences and timer lateness; `None` means a tenth of
    /// the TTL.
    pub margin: Option<Duration>,
}

/// Why a [`LeaseGuard`] (or a [`crate::Leadership`]) stopped holding its lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LossReason {
    /// A renewal was answered LOST: the server expired the lease, or someone released it with
    /// its lease id.
    Revoked,
    /// The lease was taken with `release_on_disconnect` and its connection closed, so the server
    /// freed the lock.
    Disconnected(Arc<str>),
    /// No renewal was confirmed before the local deadline less the margin; `last_error` is why
    /// the last renewal failed, if one did.
    Expired {
        /// The last renewal's error, if any.
        last_error: Option<String>,
    },
    /// The guard was released or dropped by its owner.
    Released,
    /// The lock was held in a [`crate::Session`] and the server said the session has ended
    /// (a keep-alive or an acquire answered NO_SESSION: it expired, or was closed).
    SessionEnded,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossReason::Revoked => f.write_str("renewal answered LOST"),
            LossReason::Disconnected(why) => write!(f, "connection closed: {why}"),
            LossReason::Expired { last_error: None } => f.write_str("lease ran out unconfirmed"),
            LossReason::Expired {
                last_error: Some(e),
            } => write!(f, "lease ran out unconfirmed (last renewal: {e})"),
            LossReason::Released => f.write_str("released by its owner"),
            LossReason::SessionEnded => f.write_str("session ended at the server (NO_SESSION)"),
        }
    }
}

/// What the guard and its renewal task share.
struct GuardState {
    key: Bytes,
    token: u64,
    lease_id: LeaseId,
    ttl: Duration,
    renew_every: Duration,
    /// The local deadline and the loss signal.
    validity: Validity,
    /// Cleared by [`LeaseGuard::release`], which releases by itself.
    release_on_stop: AtomicBool,
}

impl std::ops::Deref for GuardState {
    type Target = Validity;
    fn deref(&self) -> &Validity {
        &self.validity
    }
}

/// A local deadline that only moves later, and the one loss signal that fires at most once:
/// what a [`LeaseGuard`] and a [`Session`](crate::Session) both keep.
pub(crate) struct Validity {
    margin: Duration,
    /// Origin of `deadline_us`.
    pub(crate) base: Instant,
    /// The local deadline in microseconds after `base`, rounded down.
    deadline_us: AtomicU64,
    pub(crate) lost: AtomicBool,
    pub(crate) reason: OnceLock<LossReason>,
    pub(crate) loss: CancellationToken,
}

impl Validity {
    /// Valid until `deadline` (moved later by [`Validity::extend`]) less `margin`; the
    /// deadline is kept in microseconds after `base`.
    pub(crate) fn new(base: Instant, deadline: Instant, margin: Duration) -> Validity {
        let validity = Validity {
            margin,
            base,
            deadline_us: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            reason: OnceLock::new(),
            loss: CancellationToken::new(),
        };
        validity.extend(deadline);
        validity
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.base + Duration::from_micros(self.deadline_us.load(Ordering::Acquire))
    }

    pub(crate) fn extend(&self, deadline: Instant) {
        let us = u64::try_from(deadline.saturating_duration_since(self.base).as_micros())
            .expect("deadline within 500,000 years");
        self.deadline_us.fetch_max(us, Ordering::AcqRel);
    }

    pub(crate) fn give_up_at(&self) -> Instant {
        let deadline = self.deadline();
        deadline.checked_sub(self.margin).unwrap_or(deadline)
    }

    pub(crate) fn fire(&self, reason: LossReason) {
        if self.reason.set(reason).is_ok() {
            self.lost.store(true, Ordering::Release);
            self.loss.cancel();
        }
    }

    pub(crate) fn is_valid(&self) -> bool {
        !self.lost.load(Ordering::Acquire) && Instant::now() < self.give_up_at()
    }

    /// Why the signal fired; only once it has.
    pub(crate) fn reason(&self) -> LossReason {
        self.reason
            .get()
            .cloned()
            .expect("reason is set before the signal fires")
    }
}

/// A lease renewed in the background that makes its loss impossible to miss.
///
/// Watch for loss in any of three ways: `select!` on [`LeaseGuard::lost`], hand
/// [`LeaseGuard::cancellation_token`] to the work, or poll [`LeaseGuard::is_valid`] before each
/// step. See the [module docs](self) for when loss fires.
///
/// Dropping the guard stops renewal, fires the loss signal with [`LossReason::Released`] and
/// releases the lock in the background (best effort). It does so also after a loss to
/// [`LossReason::Expired`] (renewals unconfirmed: the server may have restarted and restored
/// the lease), but not after [`LossReason::Revoked`] or [`LossReason::Disconnected`].
pub struct LeaseGuard {
    state: Arc<GuardState>,
    router: Router,
    stop: CancellationToken,
    /// Whether the grant was found by a repeat of its ACQUIRE ([`Lease::is_repeat`]).
    repeat: bool,
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("key", &self.state.key)
            .field("token", &self.state.token)
            .field("lease_id", &self.state.lease_id)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl LeaseGuard {
    fn start(lease: Lease, options: KeepAliveOptions) -> LeaseGuard {
        let renew_every = options.renew_every.unwrap_or(lease.ttl / 3);
        let margin = options.margin.unwrap_or(lease.ttl / 10);
        assert!(
            renew_every + margin < lease.ttl,
            "renew_every {renew_every:?} + margin {margin:?} must be shorter than the ttl {:?}",
            lease.ttl
        );
        let base = lease.deadline - lease.ttl;
        let state = Arc::new(GuardState {
            key: lease.key,
            token: lease.token,
            lease_id: lease.lease_id,
            ttl: lease.ttl,
            renew_every,
            validity: Validity::new(base, lease.deadline, margin),
            release_on_stop: AtomicBool::new(true),
        });
        let stop = CancellationToken::new();
        tokio::spawn(keep_alive(
            lease.router.clone(),
            Arc::clone(&state),
            lease.tied_to,
            stop.clone(),
        ));
        LeaseGuard {
            state,
            router: lease.router,
            stop,
            repeat: lease.repeat,
        }
    }

    /// The lock's name.
    pub fn key(&self) -> &[u8] {
        &self.state.key
    }

    /// The fencing token of the lease: pass it with every write to the protected resource.
    pub fn fencing_token(&self) -> u64 {
        self.state.token
    }

    /// Whether the grant was found by a repeat of its ACQUIRE: an earlier send was granted
    /// and its answer lost ([`Lease::is_repeat`]).
    pub fn is_repeat(&self) -> bool {
        self.repeat
    }

    /// The lease id.
    pub fn lease_id(&self) -> LeaseId {
        self.state.lease_id
    }

    /// The local deadline: an instant taken before the last confirmed renewal (or the grant)
    /// was sent, plus the TTL (and, for the grant, the time it waited on the server). A
    /// [`tokio::time::Instant`], like [`Lease::deadline`].
    pub fn deadline(&self) -> Instant {
        self.state.deadline()
    }

    /// Time left until the guard gives up (the local deadline less the margin); zero once lost.
    pub fn time_left(&self) -> Duration {
        if self.state.lost.load(Ordering::Acquire) {
            return Duration::ZERO;
        }
        self.state
            .give_up_at()
            .saturating_duration_since(Instant::now())
    }

    /// True while the lease is held as far as this client can tell: no loss has fired and the
    /// local deadline less the margin has not passed. Cheap: an atomic load and a clock read.
    pub fn is_valid(&self) -> bool {
        self.state.is_valid()
    }

    /// Why the lease was lost, once it was.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.state.reason.get().cloned()
    }

    /// A future that resolves when the lease is lost, with the reason. It does not borrow the
    /// guard, so it can be moved into another task or `select!`ed on next to the work.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let state = Arc::clone(&self.state);
        async move {
            state.loss.cancelled().await;
            state
                .reason
                .get()
                .cloned()
                .expect("reason is set before the signal fires")
        }
    }

    /// A token cancelled when the lease is lost. Cancelling it yourself does not affect the
    /// guard.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.state.loss.child_token()
    }

    /// Stops renewing and releases the lock; the loss signal fires with
    /// [`LossReason::Released`] (so work still watching it stops).
    ///
    /// # Errors
    /// As [`Client::release`](crate::Client::release).
    pub async fn release(self) -> Result<ReleaseOutcome> {
        self.state.release_on_stop.store(false, Ordering::Release);
        self.state.fire(LossReason::Released);
        self.stop.cancel();
        self.router
            .release(&self.state.key, self.state.lease_id)
            .await
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.stop.cancel();
        // A lease whose renewals could not be confirmed (the server unreachable) may still
        // exist: a restarted server restores it. The renewal task has ended by then, so the
        // release is sent from here, best effort. A lease answered LOST, or freed with its
        // connection, is gone already.
        let unconfirmed = matches!(self.state.reason.get(), Some(LossReason::Expired { .. }));
        if unconfirmed && self.state.release_on_stop.load(Ordering::Acquire) {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let (router, key, lease_id) = (
                    self.router.clone(),
                    self.state.key.clone(),
                    self.state.lease_id,
                );
                runtime.spawn(async move {
                    let _ = router.release(&key, lease_id).await;
                });
            }
        }
    }
}

/// The renewal task: renews until the lease is lost or the guard stops, then (when the guard
/// was dropped) fires [`LossReason::Released`] and releases the lock.
async fn keep_alive(
    router: Router,
    state: Arc<GuardState>,
    tied_to: Option<Arc<Shared>>,
    stop: CancellationToken,
) {
    renew_until_lost(&router, &state, tied_to, &stop).await;
    if stop.is_cancelled() && state.release_on_stop.load(Ordering::Acquire) {
        let was_lost = state.lost.load(Ordering::Acquire);
        state.fire(LossReason::Released);
        if !was_lost {
            let _ = router.release(&state.key, state.lease_id).await;
        }
    }
}

/// What woke the renewal loop.
enum Wake {
    Stop,
    GiveUp,
    ConnectionClosed,
    Renew,
}

/// What one renewal attempt came to.
enum Renewal {
    /// RENEWED: the lease runs `ttl` from `sent_at`, over the connection `conn`.
    Confirmed {
        sent_at: Instant,
        ttl: Duration,
        conn: Arc<Shared>,
    },
    /// LOST.
    Revoked,
    /// No answer, or an error; worth retrying until `give_up_at`.
    Failed(String),
    /// The guard stopped while the renewal was in flight.
    Stopped,
    /// `give_up_at` passed while the renewal was in flight.
    GaveUp,
}

async fn renew_until_lost(
    router: &Router,
    state: &GuardState,
    tied_to: Option<Arc<Shared>>,
    stop: &CancellationToken,
) {
    let tied = tied_to.is_some();
    // The connection whose closing is acted on: the tied one (loss), or the one the last
    // renewal went over (then the next renewal is sent at once, over a new connection).
    let mut watched = tied_to;
    let mut next_renew = state.deadline() - state.ttl + state.renew_every;
    let mut last_error: Option<String> = None;
    let retry_delay = (state.renew_every / 4).max(Duration::from_millis(5));
    loop {
        let give_up_at = state.give_up_at();
        let closed = watched.clone();
        let wake = tokio::select! {
            biased;
            _ = stop.cancelled() => Wake::Stop,
            _ = tokio::time::sleep_until(give_up_at) => Wake::GiveUp,
            _ = async { closed.as_ref().expect("guarded").closed.cancelled().await }, if closed.is_some() => {
                Wake::ConnectionClosed
            }
            _ = tokio::time::sleep_until(next_renew) => Wake::Renew,
        };
        match wake {
            Wake::Stop => return,
            Wake::GiveUp => return state.fire(LossReason::Expired { last_error }),
            Wake::ConnectionClosed if tied => {
                let why = match watched.as_ref().map(|shared| shared.lost_error()) {
                    Some(Error::ConnectionLost(why)) => why,
                    _ => Arc::from("connection closed"),
                };
                return state.fire(LossReason::Disconnected(why));
            }
            Wake::ConnectionClosed => {
                watched = None;
                next_renew = Instant::now();
                continue;
            }
            Wake::Renew => {}
        }
        match renew_once(router, state, stop, give_up_at).await {
            Renewal::Confirmed { sent_at, ttl, conn } => {
                state.extend(local_deadline(sent_at, Duration::ZERO, ttl));
                next_renew = sent_at + state.renew_every;
                last_error = None;
                if !tied {
                    watched = Some(conn);
                }
            }
            Renewal::Revoked => return state.fire(LossReason::Revoked),
            Renewal::Failed(error) => {
                tracing::debug!(%error, "renewal failed; retrying");
                last_error = Some(error);
                next_renew = Instant::now() + retry_delay;
            }
            Renewal::Stopped => return,
            Renewal::GaveUp => return state.fire(LossReason::Expired { last_error }),
        }
    }
}

/// How long one renewal attempt waits: the request time-out; with several endpoints no
/// longer than the time between renewals, so that a hung node (the client then moves to
/// another endpoint) leaves time to retry elsewhere before the give-up point. With one
/// endpoint there is nowhere else to go, and a slow answer is still worth waiting for.
fn attempt_timeout(router: &Router, state: &GuardState) -> Duration {
    let timeout = router.config().request_timeout;
    if router.endpoints().len() > 1 {
        timeout.min(state.renew_every)
    } else {
        timeout
    }
}

/// Sends one renewal and waits for it, racing the give-up timer so that a stuck renewal cannot
/// delay the loss signal.
async fn renew_once(
    router: &Router,
    state: &GuardState,
    stop: &CancellationToken,
    give_up_at: Instant,
) -> Renewal {
    let request = Request::Renew {
        key: state.key.clone(),
        lease_id: state.lease_id,
        ttl_ms: u32::try_from(state.ttl.as_millis()).expect("granted ttl fits in u32"),
    };
    let renewal = tokio::select! {
        biased;
        _ = stop.cancelled() => return Renewal::Stopped,
        _ = tokio::time::sleep_until(give_up_at) => return Renewal::GaveUp,
        renewal = router.call_for(request, attempt_timeout(router, state), Purpose::Keeping) => renewal,
    };
    // `sent_at` is taken before the send that got the answer (the last, after NOT_LEADER),
    // so the new deadline never over-estimates the server's.
    let renewal = renewal.and_then(|a| Ok((renew_outcome(a.response)?, a.conn, a.sent_at)));
    match renewal {
        Ok((RenewOutcome::Renewed { ttl }, conn, sent_at)) => Renewal::Confirmed {
            sent_at,
            ttl,
            conn: Arc::clone(&conn.shared),
        },
        Ok((RenewOutcome::Lost, _, _)) => Renewal::Revoked,
        Err(e) => Renewal::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{AcquireOptions, AcquireOutcome, Client};
    use crate::fake::{self, Script};
    use tenure_protocol::handshake::VERSION;
    use tenure_protocol::Response;

    const TTL_MS: u32 = 300;

    /// A server that grants every acquire and answers renewals with `renew`.
    fn script(renew: Option<Response>) -> Script {
        Arc::new(move |request| match request {
            Request::Acquire { .. } => Some(Response::Granted {
                token: 42,
                lease_id: LeaseId::from_u128(9),
                ttl_ms: TTL_MS,
                waited_ms: 0,
            }),
            Request::Renew { .. } => renew.clone(),
            _ => Some(Response::Released),
        })
    }

    async fn guard(server: &fake::FakeServer) -> LeaseGuard {
        let client = Client::connect(server.addr.clone()).await.expect("connect");
        let ttl = Duration::from_millis(u64::from(TTL_MS));
        match client.lock("k", ttl, AcquireOptions::default()).await {
            Ok(AcquireOutcome::Granted(guard)) => guard,
            other => panic!("expected a grant, got {other:?}"),
        }
    }

    #[test]
    fn long_leases_give_up_a_thousandth_for_clock_rates_short_ones_the_rounding() {
        let at = Instant::now();
        let second = Duration::from_secs(1);
        // Short spans: the server's 2 ms rounding is the larger part.
        assert_eq!(
            local_deadline(at, Duration::ZERO, second),
            at + second - SERVER_ROUNDING
        );
        // A minute's lease (30 s wait + 30 s TTL) gives up 60 ms: a clock running 0.1 % slow
        // on the server, or on the next leader, still ends its lease after this deadline.
        let half = Duration::from_secs(30);
        let minute = Duration::from_secs(60);
        assert_eq!(
            local_deadline(at, half, half),
            at + minute - Duration::from_millis(60)
        );
        assert_eq!(deadline_margin(Duration::ZERO), SERVER_ROUNDING);
    }

    #[tokio::test(start_paused = true)]
    async fn a_guard_leaves_a_hung_node_for_another_endpoint_before_its_lease_runs_out() {
        // A grants, then hangs (a SIGSTOPped leader: nothing is answered); B renews.
        let grant_then_hang: Script = Arc::new(|request| match request {
            Request::Acquire { .. } => Some(Response::Granted {
                token: 42,
                lease_id: LeaseId::from_u128(9),
                ttl_ms: 6_000,
                waited_ms: 0,
            }),
            _ => None,
        });
        let hung = fake::start(VERSION, 16, grant_then_hang).await;
        let renewing = fake::start(
            VERSION,
            16,
            script(Some(Response::Renewed { ttl_ms: 6_000 })),
        )
        .await;
        let client = Client::connect(format!("{},{}", hung.addr, renewing.addr))
            .await
            .expect("connect");
        let ttl = Duration::from_secs(6);
        let options = KeepAliveOptions {
            renew_every: Some(Duration::from_secs(1)),
            ..KeepAliveOptions::default()
        };
        // The default request time-out (5 s) is most of the TTL: one stuck renewal, retried
        // on the same connection, would let the lease run out.
        let guard = match client.acquire("k", ttl, AcquireOptions::default()).await {
            Ok(AcquireOutcome::Granted(lease)) => lease.keep_alive_with(options),
            other => panic!("expected a grant, got {other:?}"),
        };
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(guard.is_valid(), "lost: {:?}", guard.loss_reason());
        assert!(guard.time_left() > Duration::from_secs(3), "renewed at B");
    }

    /// Virtual time a grant or renewal may take over the fake network: a few hops.
    const ROUND_TRIP_MAX: Duration = Duration::from_millis(10);

    #[tokio::test(start_paused = true)]
    async fn hung_renewals_fire_loss_at_the_deadline_less_the_margin() {
        let server = fake::start(VERSION, 16, script(None)).await;
        let before = Instant::now();
        let guard = guard(&server).await;
        let after = Instant::now();
        assert_eq!(guard.fencing_token(), 42);
        let ttl = Duration::from_millis(u64::from(TTL_MS));
        // Counted from the send, less the server's rounding.
        let counted = ttl - deadline_margin(ttl);
        assert!(guard.deadline() >= before + counted);
        assert!(guard.deadline() <= after + counted);
        let reason = guard.lost().await;
        let fired_at = Instant::now();
        assert!(matches!(reason, LossReason::Expired { .. }), "{reason:?}");
        // The margin is ttl/10; in virtual time the loss fires at deadline - margin, exactly.
        assert_eq!(fired_at, guard.deadline() - ttl / 10);
        assert!(!guard.is_valid());
        assert_eq!(guard.time_left(), Duration::ZERO);
    }

    /// A restart shorter than the lease's time left does not outlast it for want of a
    /// reconnect attempt: renewals wait at most `RECONNECT_DELAY_KEEPING_MAX` after a failed
    /// one, not the client's backoff (here 3-6 s, past the lease's deadline).
    #[tokio::test(start_paused = true)]
    async fn renewals_reconnect_sooner_than_the_backoff() {
        const LONG_TTL_MS: u32 = 3_000;
        let long: Script = Arc::new(|request| match request {
            Request::Acquire { .. } => Some(Response::Granted {
                token: 42,
                lease_id: LeaseId::from_u128(9),
                ttl_ms: LONG_TTL_MS,
                waited_ms: 0,
            }),
            Request::Renew { .. } => Some(Response::Renewed {
                ttl_ms: LONG_TTL_MS,
            }),
            _ => Some(Response::Released),
        });
        let server = fake::start(VERSION, 16, Arc::clone(&long)).await;
        let config = crate::ClientConfig {
            reconnect_delay_min: Duration::from_secs(6),
            reconnect_delay_max: Duration::from_secs(6),
            ..crate::ClientConfig::default()
        };
        let client = Client::connect_with(server.addr.clone(), config)
            .await
            .expect("connect");
        let ttl = Duration::from_millis(u64::from(LONG_TTL_MS));
        let guard = match client.lock("k", ttl, AcquireOptions::default()).await {
            Ok(AcquireOutcome::Granted(guard)) => guard,
            other => panic!("expected a grant, got {other:?}"),
        };
        let addr = server.addr.clone();
        tokio::time::sleep(ttl).await;
        drop(server);
        tokio::time::sleep(ttl / 2).await;
        let restarted = fake::start_at(&addr, VERSION, 16, long).await;
        let back_at = Instant::now();
        tokio::time::sleep(ttl * 2).await;
        assert!(guard.is_valid(), "{:?}", guard.loss_reason());
        assert!(
            guard.deadline() > back_at + ttl,
            "renewed after the restart"
        );
        drop(restarted);
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_keep_moving_the_deadline() {
        let renewed = Response::Renewed { ttl_ms: TTL_MS };
        let server = fake::start(VERSION, 16, script(Some(renewed))).await;
        let guard = guard(&server).await;
        let first_deadline = guard.deadline();
        let ttl = Duration::from_millis(u64::from(TTL_MS));
        tokio::time::sleep(ttl * 5).await; // virtual time: the clock is paused
        assert!(guard.is_valid());
        assert!(guard.loss_reason().is_none());
        assert!(guard.deadline() > first_deadline + ttl * 4);
        assert!(guard.deadline() <= Instant::now() + ttl);
        // Renewed within the last renewal period (ttl/3) plus a round trip.
        assert!(guard.deadline() + ttl / 3 + ROUND_TRIP_MAX >= Instant::now() + ttl);
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_count_from_before_the_request_was_sent() {
        // Every answer takes 100 ms, so a deadline counted from the reply would be 100 ms
        // later than one counted from the send.
        let delay = Duration::from_millis(100);
        let renewed = Response::Renewed { ttl_ms: TTL_MS };
        let server = fake::start_delayed(VERSION, 16, script(Some(renewed)), delay).await;
        let ttl = Duration::from_millis(u64::from(TTL_MS));
        let guard = guard(&server).await;
        let first_deadline = guard.deadline();
        assert!(guard.deadline() + delay <= Instant::now() + ttl);
        // Let renewals (every 100 ms, each answered 100 ms later) go through.
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(50)).await; // virtual time
            assert!(guard.is_valid());
            assert!(guard.deadline() + delay <= Instant::now() + ttl);
        }
        assert!(guard.deadline() > first_deadline, "renewals were confirmed");
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_that_waited_counts_the_lease_from_the_grant() {
        // The server says the acquire waited 2 TTLs in line: the lease started then, so the
        // deadline is sent_at + waited + ttl, not sent_at + ttl (which has passed already
        // for a wait longer than the TTL).
        let waited_ms = 2 * TTL_MS;
        let script: Script = Arc::new(move |request| match request {
            Request::Acquire { .. } => Some(Response::Granted {
                token: 42,
                lease_id: LeaseId::from_u128(9),
                ttl_ms: TTL_MS,
                waited_ms,
            }),
            _ => None,
        });
        // The answer comes after the wait, as a real server's would.
        let waited = Duration::from_millis(u64::from(waited_ms));
        let server = fake::start_delayed(VERSION, 16, script, waited).await;
        let client = Client::connect(server.addr.clone()).await.expect("connect");
        let ttl = Duration::from_millis(u64::from(TTL_MS));
        let before = Instant::now();
        let lease = client
            .acquire("k", ttl, AcquireOptions::default())
            .await
            .expect("acquire")
            .granted()
            .expect("granted");
        let after = Instant::now();
        assert!(after >= before + waited, "the fake answered after the wait");
        assert_eq!(lease.waited(), waited);
        // Less the margin (rounding, clock rates), and never a moment more.
        let counted = waited + ttl - deadline_margin(waited + ttl);
        assert!(lease.deadline() >= before + counted);
        assert!(lease.deadline() <= before + ROUND_TRIP_MAX + counted);
        assert!(!lease.is_expired());
        tokio::time::sleep_until(lease.deadline()).await;
        assert!(lease.is_expired(), "expired at its deadline, exactly");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_renewal_fires_revoked_and_the_token_is_cancelled() {
        let server = fake::start(VERSION, 16, script(Some(Response::Lost))).await;
        let guard = guard(&server).await;
        let token = guard.cancellation_token();
        assert_eq!(guard.lost().await, LossReason::Revoked);
        assert!(token.is_cancelled());
        assert_eq!(guard.loss_reason(), Some(LossReason::Revoked));
    }

    #[tokio::test(start_paused = true)]
    async fn durability_errors_are_retried_until_the_deadline() {
        let unavailable = Response::Error {
            code: tenure_protocol::ErrorCode::Unavailable,
            message: "disk full".into(),
        };
        let server = fake::start(VERSION, 16, script(Some(unavailable))).await;
        let guard = guard(&server).await;
        let give_up_at = guard.deadline() - Duration::from_millis(u64::from(TTL_MS) / 10);
        let reason = guard.lost().await;
        assert_eq!(
            Instant::now(),
            give_up_at,
            "retried until deadline - margin, exactly"
        );
        match reason {
            LossReason::Expired {
                last_error: Some(e),
            } => assert!(e.contains("disk full"), "{e}"),
            other => panic!("expected Expired with the last error, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn releasing_a_guard_fires_released() {
        let renewed = Response::Renewed { ttl_ms: TTL_MS };
        let server = fake::start(VERSION, 16, script(Some(renewed))).await;
        let guard = guard(&server).await;
        let lost = guard.lost();
        assert_eq!(
            guard.release().await.expect("release"),
            ReleaseOutcome::Released
        );
        assert_eq!(lost.await, LossReason::Released);
    }
}
