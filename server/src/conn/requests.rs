//! Running what a connection reads: requests go to the executor, and what cannot be answered
//! at once (a waiter's grant or time-out, a retry after a token reservation) is awaited as
//! a [`Later`] beside the socket.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, Request, Response};

use super::surface::{Fatal, Input, Surface};
use super::Conn;
use crate::console;
use crate::executor::Outcome;
use crate::executor::Undo;
use crate::executor::WaitResult;
use crate::journal::TICKET_NOW;
use crate::obs::metrics::Timing;

/// Something a connection waits for besides its socket: a queued acquire's answer, or a
/// token reservation before an acquire can run again.
pub(super) enum Later {
    Wait {
        id: u64,
        /// The latency clock of the waiting acquire.
        timing: Option<Timing>,
        result: Result<WaitResult, ()>,
        key: Bytes,
        release_on_disconnect: bool,
        /// The session a grant joins, with the waiter's id (its place in the session's count).
        session: Option<(tenure_protocol::SessionId, u64)>,
    },
    Retry {
        id: u64,
        request: Request,
        /// When the request was first taken up.
        received_ms: u64,
        reserved: Result<(), String>,
    },
    /// A CLUSTER request answered (cluster mode).
    Cluster {
        id: u64,
        response: Response,
        timing: Option<Timing>,
    },
    /// An AUTH verified (`verified`: the identity's name) or not, or refused unverified
    /// because its (address, name) has spaced-out turns up to the wait bound.
    Auth {
        id: u64,
        name: Bytes,
        verified: Result<Option<Arc<crate::identity::Identity>>, crate::identity::Spaced>,
        /// The AUTH's metrics timing, for its reply.
        timing: Option<Timing>,
    },
}

impl Conn {
    /// Decodes and runs everything whole in the read buffer.
    pub(super) fn handle_input(&mut self) -> Result<(), Fatal> {
        // The console promises replies in order, so while a blocking acquire waits there, later
        // lines stay unread in the buffer; the binary protocol answers by id and goes on.
        let console = matches!(self.surface, Surface::Console { .. });
        // One clock read for the requests taken up together (see `metrics`).
        let mut now = None;
        while !self.closing && !self.authenticating && (!console || self.later.is_empty()) {
            let Some(input) = self.surface.decode(&mut self.rbuf)? else {
                break;
            };
            match input {
                Input::Request(id, request) => {
                    let at = *now.get_or_insert_with(std::time::Instant::now);
                    self.on_request(id, request, None, at)
                }
                Input::Bad(id, e) => {
                    crate::obs::stats::Stats::bump(&self.executor.stats().errors);
                    let code = e.code;
                    let message = self.executor.undecodable_message(e);
                    self.push(id, Response::Error { code, message }, TICKET_NOW);
                }
                Input::Help => self.push_line(console::HELP),
                Input::Quit => {
                    self.push_line("BYE");
                    self.closing = true;
                }
            }
        }
        Ok(())
    }

    /// Requests read and not yet answered: replies waiting for the journal, and acquires
    /// waiting in line or for fencing tokens. Events are not requests; a WATCH counts until
    /// its reply.
    fn in_flight(&self) -> usize {
        self.queue.len() - self.events_queued + self.later.len()
    }

    /// Runs a request taken up `at`; `received_ms` is when it was first taken up if this is a
    /// retry.
    fn on_request(&mut self, id: u64, request: Request, received_ms: Option<u64>, at: Instant) {
        self.timing = Some(Timing::start(&request, at));
        if self.in_flight() >= self.executor.config().in_flight_max as usize {
            let max = self.executor.config().in_flight_max;
            let message = format!("{max} requests already in flight on this connection");
            let code = ErrorCode::TooManyInFlight;
            crate::obs::stats::Stats::bump(&self.executor.stats().errors);
            self.push(id, Response::Error { code, message }, TICKET_NOW);
            return;
        }
        if let Request::Watch { .. } = request {
            // A new watch starts on a queue that takes events, not on one that overflowed.
            self.end_watches_if_overflowed();
        }
        if let Request::Auth { .. } = &request {
            // Counted here: AUTH never reaches the executor, which counts the rest.
            self.executor.stats().count_op(&request);
        }
        let request = match request {
            Request::Auth { name, secret } => return self.on_auth(id, name, secret),
            Request::ClusterStatus { .. }
            | Request::ClusterInit { .. }
            | Request::ClusterAdd { .. }
            | Request::ClusterRemove { .. } => return self.on_cluster(id, request),
            request => request,
        };
        let outcome = match self.executor.identities().clone() {
            None => self.execute(id, request, received_ms),
            Some(identities) => self.execute_as(&identities, id, request, received_ms),
        };
        // Events a WATCH or UNWATCH drained were checked against the watches before it.
        for event in std::mem::take(&mut self.ctx.drained) {
            self.queue_event(event);
        }
        self.on_outcome(id, outcome);
    }

    /// Runs a request in the executor; `received_ms` is when it was first taken up if this
    /// is a retry.
    pub(super) fn execute(
        &mut self,
        id: u64,
        request: Request,
        received_ms: Option<u64>,
    ) -> Outcome {
        match received_ms {
            None => self.executor.execute(&mut self.ctx, id, request),
            Some(received_ms) => {
                self.executor
                    .execute_again(&mut self.ctx, id, request, received_ms)
            }
        }
    }

    /// Queues the reply to request `id`, or what it waits for.
    fn on_outcome(&mut self, id: u64, outcome: Outcome) {
        match outcome {
            Outcome::Reply(response, ticket) => self.push(id, response, ticket),
            Outcome::Changed {
                response,
                ticket,
                undo,
            } => self.push_change(id, response, ticket, undo),
            Outcome::Wait {
                rx,
                key,
                waiter_id,
                release_on_disconnect,
                session_id,
            } => {
                self.ctx.add_wait(id, key.clone(), waiter_id, session_id);
                let session = session_id.map(|session_id| (session_id, waiter_id));
                let timing = self.timing.take();
                self.later.push(Box::pin(async move {
                    let result = rx.await.map_err(|_| ());
                    Later::Wait {
                        id,
                        timing,
                        result,
                        key,
                        release_on_disconnect,
                        session,
                    }
                }));
            }
            Outcome::NeedTokens {
                request,
                received_ms,
            } => {
                self.timing = None; // the retry times itself
                let tokens = Arc::clone(self.executor.tokens());
                self.answers_due += 1;
                self.later.push(Box::pin(async move {
                    let reserved = tokens.reserve().await.map_err(|e| e.to_string());
                    Later::Retry {
                        id,
                        request,
                        received_ms,
                        reserved,
                    }
                }));
            }
        }
    }

    pub(super) fn on_later(&mut self, done: Later) {
        if !matches!(done, Later::Wait { .. }) {
            self.answers_due -= 1;
        }
        match done {
            Later::Wait {
                id,
                timing,
                result,
                key,
                release_on_disconnect,
                session,
            } => {
                self.ctx.remove_wait(id);
                self.timing = timing;
                let named = session.map(|(session_id, _)| session_id);
                let result = self.join_session_on_hand_off(id, session, &key, result);
                let result = result.map(|r| self.executor.checked_regrant(r, named));
                self.on_wait_done(id, result, key, release_on_disconnect);
            }
            Later::Retry {
                id,
                request,
                received_ms,
                reserved,
            } => match reserved {
                // Runs (and counts) the acquire again; reservations are rare enough not to matter.
                Ok(()) => self.on_request(id, request, Some(received_ms), Instant::now()),
                Err(message) => {
                    let message = format!("could not reserve fencing tokens: {message}");
                    let code = ErrorCode::Unavailable;
                    self.push(id, Response::Error { code, message }, TICKET_NOW);
                }
            },
            Later::Cluster {
                id,
                response,
                timing,
            } => {
                self.timing = timing;
                self.push(id, response, TICKET_NOW);
            }
            Later::Auth {
                id,
                name,
                verified,
                timing,
            } => {
                self.timing = timing;
                self.on_auth_done(id, name, verified);
            }
        }
    }

    /// A hand-off to a session's waiter joins its session here, or is freed (and the waiter
    /// told why) if the session ended while it waited. Any other end of a session's wait
    /// leaves the session's count of waiters; one the table dropped because its session
    /// ended (the channel closed, not by this connection) is answered `NO_SESSION`.
    fn join_session_on_hand_off(
        &mut self,
        id: u64,
        session: Option<(tenure_protocol::SessionId, u64)>,
        key: &Bytes,
        result: Result<WaitResult, ()>,
    ) -> Result<WaitResult, ()> {
        let Some((session_id, waiter_id)) = session else {
            return result;
        };
        match result {
            Ok(WaitResult::Granted {
                grant,
                ticket,
                waited_ms,
            }) => {
                let joined = (self.executor).join_session(
                    &self.ctx,
                    (session_id, waiter_id),
                    key,
                    grant,
                    ticket,
                );
                match joined {
                    Ok((grant, ticket)) => Ok(WaitResult::Granted {
                        grant,
                        ticket,
                        waited_ms,
                    }),
                    Err((code, message)) => Ok(WaitResult::Failed(code, message)),
                }
            }
            result => {
                (self.executor).forget_session_waiter(session_id, key, waiter_id);
                // Cancelled by this connection (a reload, its end) or a lost leadership: said
                // by `wait_cancelled`; otherwise the table dropped it for its session's end.
                let cancelled_here = self.cancel_reasons.contains_key(&id)
                    || self.fatal
                    || self.stopping
                    || self.executor.journal().not_leader().is_some();
                match result {
                    Err(()) if !cancelled_here => Ok(crate::executor::session_ended_result()),
                    result => result,
                }
            }
        }
    }

    /// A CLUSTER request: answered by the node's cluster administration once Raft has done
    /// it (beside the socket, as a waiter is), or at once on a single-node server.
    fn on_cluster(&mut self, id: u64, request: Request) {
        self.executor.stats().count_op(&request);
        let Some(admin) = self.executor.cluster().clone() else {
            // Counted as the unknown opcode it is to a server older than cluster mode.
            crate::obs::stats::Stats::bump(&self.executor.stats().errors);
            let (code, message) = (
                ErrorCode::UnknownOpcode,
                crate::executor::NOT_CLUSTER.into(),
            );
            return self.push(id, Response::Error { code, message }, TICKET_NOW);
        };
        if let Some(identities) = self.executor.identities().clone() {
            if let Err(response) = self.identity_for(&identities, &request) {
                return self.push(id, response, TICKET_NOW);
            }
        }
        let changes_membership = !matches!(request, Request::ClusterStatus { .. });
        if changes_membership
            && self.executor.identities().is_none()
            && !self.ctx.peer.ip().is_loopback()
        {
            // With identities, only an `admin` identity gets here (`auth::permit`). Without
            // them nobody is known, and a membership change decides who holds every lease:
            // only someone on this host may make one.
            let message = "membership changes need an identity with admin permission, or a \
                           loopback connection when the server has no identities";
            let (code, message) = (ErrorCode::Forbidden, message.to_string());
            return self.push(id, Response::Error { code, message }, TICKET_NOW);
        }
        let timing = self.timing.take();
        self.answers_due += 1;
        self.later.push(Box::pin(async move {
            let response = admin.serve(request).await;
            Later::Cluster {
                id,
                response,
                timing,
            }
        }));
    }

    /// Answers a waiter (request `id`) with what it was told, or why it was cancelled.
    fn on_wait_done(
        &mut self,
        id: u64,
        result: Result<WaitResult, ()>,
        key: Bytes,
        release_on_disconnect: bool,
    ) {
        let response = match result {
            Ok(WaitResult::Granted {
                grant,
                ticket,
                waited_ms,
            }) => {
                if release_on_disconnect {
                    self.ctx.own(key.clone(), grant.lease_id);
                }
                let response = Response::Granted {
                    token: grant.token,
                    lease_id: grant.lease_id,
                    ttl_ms: grant.ttl_ms,
                    waited_ms,
                };
                let undo = Undo::Grant {
                    key,
                    lease_id: grant.lease_id,
                };
                self.push_change(id, response, ticket, undo);
                return;
            }
            Ok(WaitResult::TimedOut { token, ttl_left_ms }) => Response::Locked {
                token,
                ttl_left_ms: u32::try_from(ttl_left_ms).unwrap_or(u32::MAX),
            },
            Ok(WaitResult::Failed(code, message)) => Response::Error { code, message },
            Ok(WaitResult::Ended { how, token }) => Response::AcquireEnded { how, token },
            Ok(WaitResult::Regranted {
                token,
                lease_id,
                ttl_left_ms,
                ticket,
            }) => {
                let ttl_left_ms = u32::try_from(ttl_left_ms).unwrap_or(u32::MAX);
                let response = Response::Regranted {
                    token,
                    lease_id,
                    ttl_left_ms,
                };
                self.push(id, response, ticket);
                return;
            }
            Err(()) => self.wait_cancelled(id),
        };
        self.push(id, response, TICKET_NOW);
    }

    /// The answer to a wait cancelled: by a reload that took its permission away, or because
    /// this connection is ending.
    fn wait_cancelled(&mut self, id: u64) -> Response {
        if let Some((code, message)) = self.cancel_reasons.remove(&id) {
            return Response::Error { code, message };
        }
        // Cluster mode: the connection ends because its node no longer leads.
        if let Some(leader) = self.executor.journal().not_leader() {
            return Response::Error {
                code: ErrorCode::NotLeader,
                message: leader.to_string(),
            };
        }
        match &self.fatal_error {
            Some((code, _)) => Response::Error {
                code: *code,
                message: "the wait was cancelled: a later frame broke the stream".to_string(),
            },
            None => Response::Error {
                code: ErrorCode::ShuttingDown,
                message: "the wait was cancelled: the server is shutting down".to_string(),
            },
        }
    }
}
