//! What `tenure run` and `tenure elect` hold while their command runs: a lock in a session of
//! its own (the default), or a lease renewed alone (`--no-session`, and against a server that
//! does not know sessions).
//!
//! A session's lock needs no renewal, so nothing would tell its holder that someone released
//! it with its lease id (`tenure release KEY LEASE`); a lease renewed alone would hear of it
//! only at its next renewal, a third of its TTL later, while the command ran on and the key's
//! next holder worked beside it. So the key is WATCHed in either form, and its release or
//! expiry under our token is a loss at once.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tenure::{
    AcquireOptions, AcquireOutcome, Client, ErrorCode, EventKind, KeyState, LeaseGuard, LeaseKind,
    LossReason, Session, SessionGuard,
};

/// Pause before a lost watch of a session's key subscribes again.
const REWATCH_PAUSE: Duration = Duration::from_millis(100);
/// Pause between attempts to give a lost lock back ([`Hold::give_back_after_loss`]): the
/// client's own reconnect pacing for lease keeping is 250 ms, so a shorter pause only
/// meets the same refusal.
const GIVE_BACK_PAUSE: Duration = Duration::from_millis(100);

/// The lock a command runs under.
pub enum Hold {
    /// A lease renewed in the background.
    Lease {
        /// The lease.
        guard: LeaseGuard,
        /// The client the key is watched through.
        client: Client,
        /// As for a session's lock.
        alone: bool,
    },
    /// A lock in a session of its own, whose keep-alive keeps it.
    Session {
        /// The session, closed when the command ends.
        session: Session,
        /// The lock in it.
        guard: SessionGuard,
        /// The client the key is watched through.
        client: Client,
        /// True for a plain lock (the key alone), false for a read lease or permits, whose
        /// key others hold beside us.
        alone: bool,
    },
}

/// A loss signal that owns what it waits on.
pub type Lost = Pin<Box<dyn Future<Output = Loss> + Send>>;

/// How a hold was lost.
#[derive(Debug)]
pub struct Loss {
    /// Why.
    pub reason: LossReason,
    /// Whether the key's watch saw it, rather than the lease's renewal or the session's
    /// keep-alive.
    pub seen_by_watch: bool,
}

impl Hold {
    /// A lease renewed alone, held as `kind` through `client`.
    pub fn lease(guard: LeaseGuard, client: &Client, kind: LeaseKind) -> Hold {
        Hold::Lease {
            guard,
            client: client.clone(),
            alone: kind == LeaseKind::Exclusive,
        }
    }

    /// The fencing token.
    pub fn fencing_token(&self) -> u64 {
        match self {
            Hold::Lease { guard, .. } => guard.fencing_token(),
            Hold::Session { guard, .. } => guard.fencing_token(),
        }
    }

    /// Whether the grant was found by a repeat of its ACQUIRE (its first answer was lost).
    pub fn is_repeat(&self) -> bool {
        match self {
            Hold::Lease { guard, .. } => guard.is_repeat(),
            Hold::Session { guard, .. } => guard.is_repeat(),
        }
    }

    /// The lease id.
    pub fn lease_id(&self) -> tenure::LeaseId {
        match self {
            Hold::Lease { guard, .. } => guard.lease_id(),
            Hold::Session { guard, .. } => guard.lease_id(),
        }
    }

    /// Time left until the lock's local deadline (less the margin), when `tenure` stops the
    /// command unless the lock was confirmed since; zero once lost.
    pub fn time_left(&self) -> Duration {
        match self {
            Hold::Lease { guard, .. } => guard.time_left(),
            Hold::Session { guard, .. } => guard.time_left(),
        }
    }

    /// Time left until the guardian is to stop the command should `tenure` not have (it is
    /// stopped or stuck): halfway from [`Hold::time_left`] to the local deadline itself, so
    /// a `tenure` that runs acts first, and the guardian still acts within the margin, before
    /// the server can end the lock. Zero once lost.
    pub fn guardian_time_left(&self) -> Duration {
        let left = self.time_left();
        if left.is_zero() {
            return left;
        }
        let deadline = match self {
            Hold::Lease { guard, .. } => guard.deadline(),
            Hold::Session { guard, .. } => guard.deadline(),
        };
        let to_deadline = deadline.saturating_duration_since(tokio::time::Instant::now());
        left + to_deadline.saturating_sub(left) / 2
    }

    /// The session id, for a lock held in a session.
    pub fn session_id(&self) -> Option<tenure::SessionId> {
        match self {
            Hold::Lease { .. } => None,
            Hold::Session { session, .. } => Some(session.id()),
        }
    }

    /// Resolves when the lock is lost: the lease's or the session's loss, or the key
    /// released or expired under our token.
    pub fn lost(&self) -> Lost {
        let released = self.released_behind_our_back();
        match self {
            Hold::Lease { guard, .. } => {
                let lost = guard.lost();
                Box::pin(async move {
                    tokio::select! {
                        reason = lost => Loss { reason, seen_by_watch: false },
                        reason = released => Loss { reason, seen_by_watch: true },
                    }
                })
            }
            Hold::Session {
                session,
                guard,
                client,
                ..
            } => {
                let lost = guard.lost();
                let released = why_released(client.clone(), session.id(), released);
                Box::pin(async move {
                    let reason = tokio::select! {
                        reason = lost => reason,
                        reason = released => reason,
                    };
                    // Nothing renews a session's lock: a revocation is what its watch saw.
                    let seen_by_watch = matches!(reason, LossReason::Revoked);
                    Loss {
                        reason,
                        seen_by_watch,
                    }
                })
            }
        }
    }

    /// The key's watch for our lease's end ([`released_behind_our_back`]).
    fn released_behind_our_back(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let (key, client, alone) = match self {
            Hold::Lease {
                guard,
                client,
                alone,
            } => (guard.key(), client, *alone),
            Hold::Session {
                guard,
                client,
                alone,
                ..
            } => (guard.key(), client, *alone),
        };
        released_behind_our_back(client.clone(), key, self.fencing_token(), alone)
    }

    /// After the lock was counted lost (its deadline passed unconfirmed, say over a restart
    /// that outlasted it by a little), frees it if the server still has it, so the next
    /// waiter need not wait out its TTL: closes its session (or releases its lease), trying
    /// until `within` is spent (the server may still be down; the TTL frees it then). Names
    /// only our own session or lease id, so it frees nothing of anyone else's.
    pub async fn give_back_after_loss(self, within: Duration) {
        let give_up_at = tokio::time::Instant::now() + within;
        match self {
            Hold::Session {
                client,
                session,
                guard,
                ..
            } => {
                let session_id = session.id();
                // The session's own close on drop would not outlive our exit.
                drop((session, guard));
                retry_until(give_up_at, || client.close_session(session_id)).await;
            }
            Hold::Lease { guard, client, .. } => {
                let (key, lease_id) = (
                    tenure::Bytes::copy_from_slice(guard.key()),
                    guard.lease_id(),
                );
                // The guard's release stops its renewals and fires its loss; a restored
                // lease of a server that was down then is given back by the retries after.
                let first = tokio::time::timeout(within, guard.release()).await;
                if matches!(first, Ok(Err(ref e)) if e.is_transient()) {
                    tokio::time::sleep(GIVE_BACK_PAUSE).await;
                    retry_until(give_up_at, || client.release(&key, lease_id)).await;
                }
            }
        }
    }

    /// Gives the lock back: releases the lease, or closes the session (which frees it).
    ///
    /// # Errors
    /// Any error the request meets.
    pub async fn release(self) -> tenure::Result<()> {
        match self {
            Hold::Lease { guard, .. } => guard.release().await.map(drop),
            Hold::Session { session, guard, .. } => {
                // Closing frees the lock with the session; the guard, dropped after the
                // close fired its loss, sends nothing of its own.
                let closed = session.close().await;
                drop(guard);
                closed
            }
        }
    }
}

/// Sends `request` until it is answered with anything but a transient error (an answer, or a
/// refusal such as `NO_SESSION`: the lock ended already), or `give_up_at` passes.
async fn retry_until<T, F: Future<Output = tenure::Result<T>>>(
    give_up_at: tokio::time::Instant,
    mut request: impl FnMut() -> F,
) {
    while tokio::time::Instant::now() < give_up_at {
        let left = give_up_at - tokio::time::Instant::now();
        match tokio::time::timeout(left, request()).await {
            Ok(Err(e)) if e.is_transient() => {
                tracing::debug!(error = %e, "giving back a lost lock; retrying");
            }
            Ok(_) | Err(_) => return,
        }
        tokio::time::sleep(GIVE_BACK_PAUSE.min(left)).await;
    }
}

/// Resolves with [`LossReason::Revoked`] once `key` is seen free, or released or expired
/// under `token`, or (held `alone`) held under another token; resubscribes after a failed
/// watch. A read lease or permits share the key, so there another holder's token (newer, or
/// the one INSPECT shows) says nothing about ours: only our own end, or a free key, counts.
/// Against a server without WATCH it never resolves: the renewals alone tell of a loss.
fn released_behind_our_back(
    client: Client,
    key: &[u8],
    token: u64,
    alone: bool,
) -> impl Future<Output = LossReason> + Send + 'static {
    let key = tenure::Bytes::copy_from_slice(key);
    async move {
        loop {
            let mut watch = match client.watch(&key).await {
                Ok(watch) => watch,
                Err(e) if sessions_unknown(&e) => std::future::pending().await,
                Err(_) => {
                    tokio::time::sleep(REWATCH_PAUSE).await;
                    continue;
                }
            };
            match watch.initial_state() {
                KeyState::Held { token: held, .. } if *held == token || !alone => {}
                _ => return LossReason::Revoked,
            }
            while let Some(event) = watch.next().await {
                let Ok(event) = event else { break };
                let ended = matches!(event.kind, EventKind::Released | EventKind::Expired);
                if ended && event.token == token || alone && event.token > token {
                    return LossReason::Revoked;
                }
            }
            tokio::time::sleep(REWATCH_PAUSE).await;
        }
    }
}

/// The reason of a loss `released` (the watch) saw: [`LossReason::SessionEnded`] when the
/// session itself has ended (closed by someone with its id, or expired: the watch may see its
/// leases freed before the session's next keep-alive would hear NO_SESSION), else what the
/// watch said (the key released with our lease id, or expired).
async fn why_released(
    client: Client,
    session_id: tenure::SessionId,
    released: impl Future<Output = LossReason> + Send + 'static,
) -> LossReason {
    let reason = released.await;
    match client.keep_session_alive(session_id).await {
        Err(tenure::Error::Server {
            code: ErrorCode::NoSession,
            ..
        }) => LossReason::SessionEnded,
        _ => reason,
    }
}

/// What a LOST line says of `loss`: a revocation the key's watch saw was not answered to a
/// renewal.
pub fn loss_text(loss: &Loss) -> String {
    match &loss.reason {
        LossReason::Revoked if loss.seen_by_watch => {
            "released or expired at the server under our token (seen by WATCH)".to_string()
        }
        other => other.to_string(),
    }
}

/// Whether `error` says the server does not know sessions (one older than them), or WATCH.
pub fn sessions_unknown(error: &tenure::Error) -> bool {
    matches!(
        error,
        tenure::Error::Server {
            code: ErrorCode::UnknownOpcode,
            ..
        }
    )
}

/// Whether `error` says the session of a lock still being waited for ended (the server
/// answered `NO_SESSION`) or was lost at the client (its local deadline passed unconfirmed,
/// say while the server was down): nothing was granted to the caller, and a new session may
/// queue again. Only for the ACQUIRE's error: a session that ended after its grant is a loss.
pub fn session_ended_while_waiting(error: &tenure::Error) -> bool {
    matches!(
        error,
        tenure::Error::Server {
            code: ErrorCode::NoSession,
            ..
        } | tenure::Error::Invalid {
            code: ErrorCode::NoSession,
            ..
        }
    )
}

/// What a warning says of `error` before the wait is queued again: a session that ended
/// before the grant is named as such (the crate reports one it counts lost itself as an
/// argument it would not send), anything else as it reads.
pub fn requeue_reason(error: &tenure::Error) -> String {
    match error {
        tenure::Error::Server {
            code: ErrorCode::NoSession,
            message,
        }
        | tenure::Error::Invalid {
            code: ErrorCode::NoSession,
            message,
        } => format!("the session ended before the grant (NO_SESSION: {message})"),
        other => other.to_string(),
    }
}

/// Takes `key` as `kind` in a new session of `ttl`, waiting in line up to `options.wait`; a LOCKED
/// answer or an error closes the session again (freeing anything the server may still have
/// queued or granted in it). Granted: the hold and how long it waited in line.
///
/// # Errors
/// Any error opening the session or acquiring meets (see [`sessions_unknown`] and
/// [`session_ended_while_waiting`]).
pub async fn lock_in_session(
    client: &Client,
    key: &str,
    ttl: Duration,
    kind: LeaseKind,
    options: AcquireOptions,
) -> tenure::Result<AcquireOutcome<(Hold, Duration)>> {
    let session = client.session(ttl).await?;
    match session.lock_kind_with(key, kind, options).await {
        Ok(AcquireOutcome::Granted(guard)) => {
            let waited = guard.waited();
            let client = client.clone();
            let hold = Hold::Session {
                session,
                guard,
                client,
                alone: kind == LeaseKind::Exclusive,
            };
            Ok(AcquireOutcome::Granted((hold, waited)))
        }
        Ok(AcquireOutcome::Locked(by)) => {
            let _ = session.close().await;
            Ok(AcquireOutcome::Locked(by))
        }
        Err(e) => {
            let _ = session.close().await;
            Err(e)
        }
    }
}
