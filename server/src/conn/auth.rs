//! AUTH and the checks every request passes when identities are configured: who the
//! connection is, which keys and operations that identity may use, and its waiter quota.
//! Without identities none of this runs beyond one `Option` test per request.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, Request, Response, Secret};

use super::ctx::Auth;
use super::requests::Later;
use super::Conn;
use crate::console;
use crate::executor::Outcome;
use crate::identity::{try_take_held, Identities, Identity};
use crate::journal::TICKET_NOW;

/// Failed AUTHs after which the connection is closed.
pub(super) const AUTH_FAILURES_MAX: u32 = 5;
/// Delay before the reply to the first failed AUTH; it doubles with each further failure.
const AUTH_FAILURE_DELAY_BASE: Duration = Duration::from_millis(100);
/// Longest delay before the reply to a failed AUTH.
const AUTH_FAILURE_DELAY_MAX: Duration = Duration::from_secs(2);
/// The one reply to every failed AUTH, whatever failed: the name or the secret.
const AUTH_FAILED: &str = "authentication failed";

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
    pub(super) fn on_auth(&mut self, id: u64, name: Bytes, secret: Secret) {
        let Some(identities) = self.executor.identities.clone() else {
            let message = "this server has no identities configured; AUTH is not needed";
            self.push(id, error(ErrorCode::BadArgs, message), TICKET_NOW);
            return;
        };
        let failures = match &self.ctx.auth {
            Auth::Pending { failures } => *failures,
            _ => {
                let message = "this connection is already authenticated";
                self.push(id, error(ErrorCode::BadArgs, message), TICKET_NOW);
                return;
            }
        };
        let timing = self.timing.take();
        self.later.push(Box::pin(async move {
            let verified = identities.verify_bounded(name.clone(), secret.0).await;
            if verified.is_none() {
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
    pub(super) fn on_auth_done(&mut self, id: u64, name: Bytes, verified: Option<String>) {
        let (Some(identities), Auth::Pending { failures }) =
            (self.executor.identities.as_ref(), &self.ctx.auth)
        else {
            return; // `on_auth` answered every other case
        };
        let failures = *failures;
        let Some(verified) = verified else {
            let mut shown = String::new();
            console::escape(&name, &mut shown); // the name only: never the secret
            let failures = failures + 1;
            let conn_id = self.ctx.conn_id;
            tracing::warn!(conn_id, name = %shown, failures, "authentication failed");
            self.ctx.auth = Auth::Pending { failures };
            self.push(
                id,
                error(ErrorCode::Unauthenticated, AUTH_FAILED),
                TICKET_NOW,
            );
            if failures >= AUTH_FAILURES_MAX {
                tracing::warn!(conn_id, failures, "closing after too many failed AUTHs");
                self.closing = true;
            }
            return;
        };
        tracing::debug!(conn_id = self.ctx.conn_id, name = %verified, "authenticated");
        let usage = identities.usage(&verified);
        self.ctx.auth = Auth::As {
            name: verified,
            usage,
        };
        self.push(id, Response::Authenticated { name }, TICKET_NOW);
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
        let identity = match &self.ctx.auth {
            Auth::Open => None,
            Auth::Pending { .. } => {
                if !matches!(request, Request::Ping) {
                    let message = "AUTH first: identities are configured on this server";
                    return reply(error(ErrorCode::Unauthenticated, message));
                }
                None
            }
            Auth::As { name, .. } => match identities.get(name) {
                Some(identity) => Some(identity),
                None => {
                    let message = format!("identity `{name}` was removed");
                    return reply(error(ErrorCode::Unauthenticated, message));
                }
            },
        };
        if let Some(identity) = &identity {
            if let Err(response) = permit(identity, &request) {
                return reply(response);
            }
        }
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
            return reply(error(ErrorCode::Quota, message));
        };
        let waits = wait_ms > 0;
        if waits && !usage.try_take_waiter(identity.waiters_max) {
            let max = identity.waiters_max.unwrap_or(0);
            let message = format!(
                "waiters-max: identity `{}` has {max} acquires waiting already",
                identity.name
            );
            return reply(error(ErrorCode::Quota, message));
        }
        self.ctx.held_place = Some(Arc::new(Mutex::new(Some(place))));
        let outcome = self.execute(id, request, received_ms);
        // Unless a grant kept it or a waiter holds it, the held place is given back here.
        self.ctx.held_place = None;
        // The waiter place stays taken while the acquire waits; `ConnCtx` gives it back.
        if waits && !matches!(outcome, Outcome::Wait { .. }) {
            usage.give_back_waiter();
        }
        outcome
    }
}

fn reply(response: Response) -> Outcome {
    Outcome::Reply(response, TICKET_NOW)
}

/// Whether `identity` may make `request`: the key within its prefixes, and STATS and WATCH
/// only with their permission.
fn permit(identity: &Identity, request: &Request) -> Result<(), Response> {
    let key = match request {
        Request::Ping | Request::Auth { .. } => return Ok(()),
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
        | Request::Inspect { key }
        | Request::Check { key, .. }
        | Request::Watch { key }
        | Request::Unwatch { key } => key,
    };
    if identity.allows_key(key) {
        return Ok(());
    }
    let mut shown = String::new();
    console::escape(key, &mut shown);
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
