//! AUTH and the checks every request passes when identities are configured: who the
//! connection is, which keys and operations that identity may use, and its waiter quota.
//! Without identities none of this runs beyond one `Option` test per request.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, Request, Response, Secret};

use super::requests::Later;
use super::Conn;
use crate::admission::{Evicted, PendingPlace};
use crate::console;
use crate::executor::Outcome;
use crate::executor::{Auth, Credential};
use crate::identity::{
    try_take_connection, try_take_held, ConnectionPlace, FailureLine, Identities, Identity, Spaced,
    Usage,
};
use crate::journal::TICKET_NOW;
use crate::obs::stats::Stats;

/// Failed AUTHs after which the connection is closed.
pub(super) const AUTH_FAILURES_MAX: u32 = 5;
/// Delay before the reply to the first failed AUTH; it doubles with each further failure.
const AUTH_FAILURE_DELAY_BASE: Duration = Duration::from_millis(100);
/// Longest delay before the reply to a failed AUTH.
const AUTH_FAILURE_DELAY_MAX: Duration = Duration::from_secs(2);
/// The one reply to every failed AUTH, whatever failed: the name or the secret.
const AUTH_FAILED: &str = "authentication failed";
/// The reply to an AUTH refused unverified: its (address, name) recently failed AUTHs, and
/// the turns those space out are taken for the next seconds. Said whether or not the name
/// exists (unknown names share one such bucket per address).
pub(super) const AUTH_SPACED: &str =
    "too many AUTHs for this name from this address after failed ones; not verified, retry later";

fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error {
        code,
        message: message.into(),
    }
}

/// How long a connection's `failures`-th failed AUTH waits before its reply.
fn failure_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    AUTH_FAILURE_DELAY_BASE
        .saturating_mul(1 << doublings)
        .min(AUTH_FAILURE_DELAY_MAX)
}

impl Conn {
    /// Starts verifying an AUTH off the async workers; the answer arrives as [`Later::Auth`].
    /// Nothing after it is read until it is answered.
    pub(super) fn on_auth(&mut self, id: u64, name: Bytes, secret: Secret) {
        let Some(identities) = self.executor.identities().clone() else {
            let message = "this server has no identities configured; AUTH is not needed";
            Stats::bump(&self.executor.stats().errors);
            self.push(id, error(ErrorCode::BadArgs, message), TICKET_NOW);
            return;
        };
        let failures = match &self.ctx.auth {
            Auth::Pending { failures } => *failures,
            // The certificate already proved this identity: AUTH as it again changes nothing.
            Auth::As {
                name: current,
                credential: Credential::Certificate,
                ..
            } if current.as_bytes() == name.as_ref() => {
                self.push(id, Response::Authenticated { name }, TICKET_NOW);
                return;
            }
            _ => {
                let message = "this connection is already authenticated";
                Stats::bump(&self.executor.stats().errors);
                self.push(id, error(ErrorCode::BadArgs, message), TICKET_NOW);
                return;
            }
        };
        let timing = self.timing.take();
        let peer = self.ctx.peer.ip();
        self.authenticating = true;
        self.answers_due += 1;
        self.later.push(Box::pin(async move {
            let verified = identities.verify_from(peer, name.clone(), secret.0).await;
            if !matches!(verified, Ok(Some(_))) {
                tokio::time::sleep(failure_delay(failures + 1)).await;
            }
            Later::Auth {
                id,
                name,
                verified,
                timing,
            }
        }));
    }

    /// Answers an AUTH once verified; after `AUTH_FAILURES_MAX` failures the connection closes.
    pub(super) fn on_auth_done(
        &mut self,
        id: u64,
        name: Bytes,
        verified: Result<Option<Arc<Identity>>, Spaced>,
    ) {
        self.authenticating = false;
        let (Some(identities), Auth::Pending { failures }) =
            (self.executor.identities().as_ref(), &self.ctx.auth)
        else {
            return; // `on_auth` answered every other case
        };
        let (identities, failures) = (Arc::clone(identities), *failures);
        // Refused unverified counts as a failure on this connection (closed after the
        // fifth), so that it cannot spin; not against the (address, name), which no
        // verification failed.
        let reply = if verified.is_err() {
            AUTH_SPACED
        } else {
            AUTH_FAILED
        };
        let Ok(Some(verified)) = verified else {
            let mut shown = String::new();
            console::escape(&name, &mut shown); // the name only: never the secret
            let failures = failures + 1;
            let (conn_id, peer) = (self.ctx.conn_id, self.ctx.peer);
            if let Some(unlogged) = identities.failure_logged(FailureLine::Failed) {
                tracing::warn!(conn_id, %peer, name = %shown, failures, unlogged, "{reply}");
            }
            self.ctx.auth = Auth::Pending { failures };
            self.push(id, error(ErrorCode::Unauthenticated, reply), TICKET_NOW);
            if failures >= AUTH_FAILURES_MAX {
                if let Some(unlogged) = identities.failure_logged(FailureLine::Closed) {
                    let why = "closing after too many failed AUTHs";
                    tracing::warn!(conn_id, %peer, failures, unlogged, "{why}");
                }
                self.closing = true;
            }
            return;
        };
        let (conn_id, peer) = (self.ctx.conn_id, self.ctx.peer);
        let usage = identities.usage(&verified.name);
        let place = match take_connection_place(&verified, &usage) {
            Ok(place) => place,
            Err(message) => {
                tracing::info!(conn_id, %peer, name = %verified.name, "refused: connections-max");
                self.push(id, error(ErrorCode::ConnectionsLimit, message), TICKET_NOW);
                self.closing = true;
                return;
            }
        };
        tracing::debug!(conn_id, %peer, name = %verified.name, "authenticated");
        self.ctx.auth = Auth::As {
            name: verified.name.clone(),
            usage,
            credential: Credential::Secret(Arc::from(verified.secret_hash())),
        };
        self.identity_place = Some(place);
        self.auth_deadline = None;
        self.pending = None; // no longer among the unauthenticated
        self.push(id, Response::Authenticated { name }, TICKET_NOW);
    }

    /// This unauthenticated connection was evicted to make room for a newer one (see
    /// `admission`): it is told so and closed, an AUTH in progress dropped unanswered as at
    /// the handshake limit.
    pub(super) fn on_evicted(&mut self, why: Evicted) {
        // Closing from here on: within the bound on closing ones it gives its connection
        // place back now, not after the linger, so a newcomer can take it; past the bound it
        // keeps the place for its short close, without lingering (its peer may then not read
        // the reason), so open connections stay within the limit plus the bound (outside
        // test a41, H3: given back past the bound too, a flood's closing ones ran over it).
        match self.pending.take().and_then(PendingPlace::into_closing) {
            Some(closing) => {
                self.closing_place = Some(closing);
                self.place = None;
            }
            None => self.linger = false,
        }
        self.executor.stats().metrics.evicted();
        if self.authenticating {
            self.later.clear();
            self.answers_due = 0;
            self.authenticating = false;
        }
        let config = self.executor.config();
        let message = match why {
            Evicted::Address => format!(
                "closed: {} connections from {} had not authenticated, its limit \
                 (--unauthenticated-per-address-max); the oldest goes first",
                config.unauthenticated_per_address_max,
                self.ctx.peer.ip()
            ),
            Evicted::Total => format!(
                "closed: {} connections had not authenticated, half of --connections-max; \
                 the oldest goes first",
                config.unauthenticated_max()
            ),
            Evicted::Full => format!(
                "closed: the server has {} connections, its --connections-max, and this one \
                 had not authenticated; the oldest goes first",
                config.connections_max
            ),
        };
        let (conn_id, peer) = (self.ctx.conn_id, self.ctx.peer);
        tracing::debug!(conn_id, %peer, ?why, "unauthenticated connection evicted");
        self.close_with(ErrorCode::ConnectionsLimit, message);
    }

    /// An unauthenticated connection's time to AUTH ran out: it is told so and closed, also
    /// if an AUTH is still waiting its turn or being verified (that AUTH is dropped
    /// unanswered: otherwise a queue of slow AUTHs would keep connections past the limit).
    pub(super) fn on_auth_deadline(&mut self) {
        self.auth_deadline = None;
        if !matches!(self.ctx.auth, Auth::Pending { .. }) {
            return;
        }
        if self.authenticating {
            // Unauthenticated, the connection has nothing else in `later`: no waits, no
            // token retries (both need an identity first).
            self.later.clear();
            self.answers_due = 0;
            self.authenticating = false;
        }
        let limit = self.executor.config().handshake_timeout.as_millis();
        let (conn_id, peer) = (self.ctx.conn_id, self.ctx.peer);
        tracing::debug!(conn_id, %peer, "no AUTH within the handshake limit; closing");
        let message = format!("no AUTH within {limit} ms; closing");
        self.fatal_error = Some((ErrorCode::Unauthenticated, message));
        self.closing = true;
        self.fatal = true;
    }

    /// After a reload: the connection's identity must still exist with the credential that
    /// proved it, or the session ends; its waits and watches must still be allowed, or they
    /// end.
    pub(super) fn recheck_identity(&mut self) {
        let Some(identities) = self.executor.identities().clone() else {
            return;
        };
        let Auth::As {
            name, credential, ..
        } = &self.ctx.auth
        else {
            return;
        };
        match identities.get(name) {
            None => {
                let reason = format!("identity `{name}` was removed; AUTH again");
                self.revoke(reason);
            }
            Some(identity) if !credential.holds_for(&identity) => {
                let reason = format!("the secret of identity `{name}` changed; AUTH again");
                self.revoke(reason);
            }
            Some(identity) => self.drop_disallowed(&identity),
        }
    }

    /// Ends the session: its waits and watches end with `UNAUTHENTICATED` and `reason`, and
    /// the connection must AUTH again, within the handshake limit.
    fn revoke(&mut self, reason: String) {
        let (conn_id, peer) = (self.ctx.conn_id, self.ctx.peer);
        tracing::info!(conn_id, %peer, %reason, "session ended by a reload");
        // Waiter places go back to the identity the waits were counted against, so before
        // the connection stops being it.
        self.end_waits_and_watches(|_| true, true, ErrorCode::Unauthenticated, &reason);
        self.ctx.auth = Auth::Pending { failures: 0 };
        self.identity_place = None;
        self.auth_deadline =
            Some(tokio::time::Instant::now() + self.executor.config().handshake_timeout);
    }

    /// Ends the waits and watches `identity` no longer allows (a prefix or the WATCH
    /// permission taken away by a reload), each with `FORBIDDEN`.
    fn drop_disallowed(&mut self, identity: &Identity) {
        let reason = format!(
            "identity `{}` may no longer use this key or operation (reloaded)",
            identity.name
        );
        let all_watches = !identity.watch;
        let allowed = |key: &[u8]| identity.allows_key(key);
        self.end_waits_and_watches(
            |key| !allowed(key),
            all_watches,
            ErrorCode::Forbidden,
            &reason,
        );
    }

    /// Cancels the waits on keys `ended` selects, and the watches on them (or every watch if
    /// `all_watches`), answering each with `code` and `reason`.
    fn end_waits_and_watches(
        &mut self,
        ended: impl Fn(&[u8]) -> bool,
        all_watches: bool,
        code: ErrorCode,
        reason: &str,
    ) {
        for id in self.ctx.cancel_waits_where(&self.executor, &ended) {
            self.cancel_reasons.insert(id, (code, reason.to_owned()));
        }
        let mut watches: Vec<(Bytes, u64)> = self
            .ctx
            .watches
            .iter()
            .filter(|(key, _)| all_watches || ended(key))
            .map(|(key, id)| (key.clone(), *id))
            .collect();
        watches.sort_unstable_by_key(|&(_, id)| id);
        for (key, watch_id) in watches {
            self.ctx.watches.remove(&key);
            self.executor.watches().remove(&key, self.ctx.conn_id);
            let message = reason.to_owned();
            self.push_pushed(watch_id, Response::Error { code, message });
        }
    }

    /// The identity `request` runs as (`None`: none needed, before AUTH only PING), or the
    /// refusal if the connection has none or its identity may not make it.
    pub(super) fn identity_for(
        &mut self,
        identities: &Identities,
        request: &Request,
    ) -> Result<Option<Arc<Identity>>, Response> {
        let identity = match &self.ctx.auth {
            Auth::Open => None,
            Auth::Pending { .. } => {
                if !matches!(request, Request::Ping) {
                    let message = "AUTH first: identities are configured on this server";
                    return Err(error(ErrorCode::Unauthenticated, message));
                }
                None
            }
            Auth::As {
                name, credential, ..
            } => match identities.get(name) {
                Some(identity) if credential.holds_for(&identity) => Some(identity),
                _ => {
                    // A reload this connection has not rechecked yet: do it now.
                    self.recheck_identity();
                    let message = "AUTH again: this connection's identity changed or was removed";
                    return Err(error(ErrorCode::Unauthenticated, message));
                }
            },
        };
        if let Some(identity) = &identity {
            permit(identity, request)?;
        }
        Ok(identity)
    }

    /// Runs `request` as the connection's identity: refused if that identity may not, else
    /// executed with its waiter counted against the identity's quota.
    pub(super) fn execute_as(
        &mut self,
        identities: &Arc<Identities>,
        id: u64,
        request: Request,
        received_ms: Option<u64>,
    ) -> Outcome {
        let identity = match self.identity_for(identities, &request) {
            Ok(identity) => identity,
            Err(response) => return reply(response),
        };
        let (Some(identity), Auth::As { usage, .. }) = (identity, &self.ctx.auth) else {
            return self.execute(id, request, received_ms);
        };
        let Request::Acquire { wait_ms, .. } = request else {
            return self.execute(id, request, received_ms);
        };
        let usage = Arc::clone(usage);
        let Some(place) = try_take_held(&usage, identity.held_max) else {
            let max = identity.held_max.unwrap_or(0);
            let message = format!(
                "held-max: identity `{}` holds (or waits for) {max} locks already",
                identity.name
            );
            return self.refuse_unless_repeat(id, request, received_ms, message);
        };
        let waits = wait_ms > 0;
        if waits && !usage.try_take_waiter(identity.waiters_max) {
            let max = identity.waiters_max.unwrap_or(0);
            let message = format!(
                "waiters-max: identity `{}` has {max} acquires waiting already",
                identity.name
            );
            drop(place); // a refused acquire or a repeat holds no new place
            return self.refuse_unless_repeat(id, request, received_ms, message);
        }
        self.ctx.held_place = Some(Arc::new(Mutex::new(Some(place))));
        let outcome = self.execute(id, request, received_ms);
        // Unless a grant kept it or a waiter holds it, the held place is given back here.
        self.ctx.held_place = None;
        // The waiter place stays taken while the acquire waits; `Session` gives it back.
        if waits && !matches!(outcome, Outcome::Wait { .. }) {
            usage.give_back_waiter();
        }
        outcome
    }
}

impl Conn {
    /// Refuses an ACQUIRE over its identity's quota with `QUOTA` (`message`), unless it has
    /// an acquire id and is a repeat: then it is answered as one (a repeat is not a new
    /// hold; PROTOCOL.md 3.7), holding no place of the quota.
    fn refuse_unless_repeat(
        &mut self,
        id: u64,
        request: Request,
        received_ms: Option<u64>,
        message: String,
    ) -> Outcome {
        let refusal = error(ErrorCode::Quota, message);
        if !matches!(
            request,
            Request::Acquire {
                acquire_id: Some(_),
                ..
            }
        ) {
            return reply(refusal);
        }
        self.ctx.refusal_unless_repeat = Some(refusal);
        let outcome = self.execute(id, request, received_ms);
        self.ctx.refusal_unless_repeat = None;
        outcome
    }
}

/// One place of `identity`'s `connections-max` (counted in `usage`), or the refusal's message.
pub(super) fn take_connection_place(
    identity: &Identity,
    usage: &Arc<Usage>,
) -> Result<ConnectionPlace, String> {
    try_take_connection(usage, identity.connections_max).ok_or_else(|| {
        format!(
            "connections-max: identity `{}` has {} connections already",
            identity.name,
            identity.connections_max.unwrap_or(0)
        )
    })
}

fn reply(response: Response) -> Outcome {
    Outcome::Reply(response, TICKET_NOW)
}

/// Whether `identity` may make `request`: the key within its prefixes, and STATS and WATCH
/// only with their permission.
fn permit(identity: &Identity, request: &Request) -> Result<(), Response> {
    let key = match request {
        Request::Ping | Request::Auth { .. } => return Ok(()),
        // A session belongs to the identity that opened it (the executor checks that); its
        // leases' keys are checked by their ACQUIREs.
        Request::SessionOpen { .. }
        | Request::SessionKeepalive { .. }
        | Request::SessionClose { .. } => return Ok(()),
        // Only a cluster node asks (a single node answers these "not in cluster mode").
        Request::ClusterStatus { .. } if identity.stats || identity.admin => return Ok(()),
        Request::ClusterStatus { .. } => {
            let message = format!(
                "identity `{}` may not use CLUSTER STATUS (stats or admin)",
                identity.name
            );
            return Err(error(ErrorCode::Forbidden, message));
        }
        Request::ClusterInit { .. }
        | Request::ClusterAdd { .. }
        | Request::ClusterRemove { .. }
            if identity.admin =>
        {
            return Ok(())
        }
        Request::ClusterInit { .. }
        | Request::ClusterAdd { .. }
        | Request::ClusterRemove { .. } => {
            let message = format!(
                "identity `{}` may not change the membership (admin)",
                identity.name
            );
            return Err(error(ErrorCode::Forbidden, message));
        }
        Request::Stats if identity.stats => return Ok(()),
        Request::Stats => {
            let message = format!("identity `{}` may not use STATS", identity.name);
            return Err(error(ErrorCode::Forbidden, message));
        }
        Request::Watch { .. } | Request::Unwatch { .. } if !identity.watch => {
            let message = format!("identity `{}` may not use WATCH", identity.name);
            return Err(error(ErrorCode::Forbidden, message));
        }
        Request::Acquire { key, .. }
        | Request::Renew { key, .. }
        | Request::Release { key, .. }
        | Request::Inspect { key, kinds: _ }
        | Request::Check { key, .. }
        | Request::Watch { key }
        | Request::Unwatch { key } => key,
    };
    if identity.allows_key(key) {
        return Ok(());
    }
    let mut shown = String::new();
    console::quote(key, &mut shown);
    let message = format!(
        "identity `{}` may not use key {shown}: outside its prefixes",
        identity.name
    );
    Err(error(ErrorCode::Forbidden, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_delay_grows_and_is_bounded() {
        assert_eq!(failure_delay(1), AUTH_FAILURE_DELAY_BASE);
        assert_eq!(failure_delay(2), AUTH_FAILURE_DELAY_BASE * 2);
        assert_eq!(failure_delay(100), AUTH_FAILURE_DELAY_MAX);
    }
}
