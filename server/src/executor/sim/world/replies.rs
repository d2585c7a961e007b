//! The replies the simulated connections wait for: a waiter's grant (checked to be FIFO),
//! a reply whose ticket became durable (the client learns from it), and a change lost to a
//! journal failure (its "nothing changed" checked to be true).

use tenure_protocol::Response;

use super::{is_nothing_changed, Asked, Pending, Waiting, World, CONNS};
use crate::executor::sim::model::{Belief, CLIENT_SLACK_MS};
use crate::executor::WaitResult;
use crate::executor::{answer_lost, Undo};
use crate::journal::{settle, Journal, Settled, TICKET_NOW};

impl World {
    /// Answers whatever became answerable: waiters told of a grant or a time-out, replies
    /// whose ticket became durable or was lost.
    pub(super) fn poll(&mut self) {
        self.poll_lines();
        let progress = self.journal.progress().borrow().clone();
        for c in 0..CONNS {
            let mut still = Vec::new();
            for pending in std::mem::take(&mut self.conns[c].pending) {
                let ticket = match &pending.state {
                    Waiting::Durable { ticket, .. } => *ticket,
                    Waiting::InLine { .. } => {
                        still.push(pending);
                        continue;
                    }
                };
                match settle(ticket, &progress) {
                    Settled::Waiting => still.push(pending),
                    Settled::Durable => self.answered(c, pending),
                    Settled::Lost(why) => self.lost(c, pending, &why),
                }
            }
            self.conns[c].pending = still;
        }
    }

    /// Reads every waiter's channel; a grant must go to the first live waiter in line.
    fn poll_lines(&mut self) {
        let now_ms = self.exec.clock.now_ms();
        let mut granted = Vec::new();
        for conn in &mut self.conns {
            for pending in &mut conn.pending {
                let Waiting::InLine { rx, order, .. } = &mut pending.state else {
                    continue;
                };
                let Ok(result) = rx.try_recv() else { continue };
                let (order, rod) = (*order, pending.release_on_disconnect);
                pending.state = match result {
                    WaitResult::Granted {
                        grant,
                        ticket,
                        waited_ms,
                    } => {
                        granted.push((pending.key.clone(), order));
                        if rod {
                            conn.ctx.own(pending.key.clone(), grant.lease_id);
                        }
                        let response = Response::Granted {
                            token: grant.token,
                            lease_id: grant.lease_id,
                            ttl_ms: grant.ttl_ms,
                            waited_ms,
                        };
                        let undo = Undo::Grant {
                            key: pending.key.clone(),
                            lease_id: grant.lease_id,
                        };
                        Waiting::Durable {
                            response,
                            ticket,
                            undo: Some(undo),
                        }
                    }
                    other => answered_in_line(other),
                };
            }
        }
        self.coverage.handoffs += granted.len();
        for (key, order) in granted {
            self.check_fifo(&key, order, now_ms);
        }
    }

    /// No waiter still in line on `key`, ahead of the one granted (`order`), and whose wait
    /// has not run out, was passed over.
    fn check_fifo(&self, key: &[u8], order: u64, now_ms: u64) {
        for conn in &self.conns {
            for pending in &conn.pending {
                if let Waiting::InLine {
                    order: ahead,
                    wait_end_ms,
                    ..
                } = pending.state
                {
                    assert!(
                        pending.key != key
                            || ahead > order
                            || wait_end_ms <= now_ms + CLIENT_SLACK_MS,
                        "hand-off to waiter {order} passed over live waiter {ahead} on {key:?}"
                    );
                }
            }
        }
    }

    /// Connection `c` gets the reply `pending` waited for; the client learns from it.
    pub(super) fn answered(&mut self, c: usize, pending: Pending) {
        let Waiting::Durable { response, .. } = pending.state else {
            unreachable!("answered before its reply")
        };
        match (response, pending.asked) {
            (
                Response::Granted {
                    token,
                    lease_id,
                    ttl_ms,
                    waited_ms,
                },
                Asked::Acquire,
            ) => {
                let belief = Belief {
                    client: c,
                    key: pending.key.to_vec(),
                    lease_id,
                    token,
                    renew_sent_step: 0,
                    release_on_disconnect: pending.release_on_disconnect,
                    kind: pending.kind,
                    deadline_ms: pending.sent_ms + u64::from(waited_ms) + u64::from(ttl_ms)
                        - CLIENT_SLACK_MS,
                };
                if let Some(id) = pending.acquire_id {
                    self.model.id_granted(id, &pending.key, token, lease_id);
                }
                self.model.grant_acked(belief, self.step, pending.sent_step);
            }
            (
                Response::Regranted {
                    token,
                    lease_id,
                    ttl_left_ms,
                },
                Asked::Acquire,
            ) => {
                self.coverage.regranted += 1;
                if !pending.kind.is_exclusive() {
                    self.coverage.regranted_shared += 1;
                }
                let belief = Belief {
                    client: c,
                    key: pending.key.to_vec(),
                    lease_id,
                    token,
                    renew_sent_step: 0,
                    release_on_disconnect: false,
                    // The sim repeats an ACQUIRE with its first send's kind.
                    kind: pending.kind,
                    // Counted from the repeat's send, as a RENEW's (PROTOCOL.md 3.9).
                    deadline_ms: pending.sent_ms + u64::from(ttl_left_ms) - CLIENT_SLACK_MS,
                };
                let id = pending.acquire_id.expect("only a repeat is REGRANTED");
                self.model.regrant_acked(id, belief);
            }
            (Response::AcquireEnded { .. }, Asked::Acquire) => self.coverage.ended += 1,
            (Response::Released, Asked::Release(lease_id)) => {
                self.model.released.insert(lease_id);
            }
            (Response::Renewed { ttl_ms }, Asked::Renew(lease_id)) => {
                let deadline_ms = pending.sent_ms + u64::from(ttl_ms) - CLIENT_SLACK_MS;
                self.model.renewed(lease_id, pending.sent_step, deadline_ms);
            }
            (Response::Lost, Asked::Renew(lease_id)) => self.model.drop_belief(lease_id),
            _ => {}
        }
    }

    /// The journal failed before `pending`'s change was durable: the connection answers it
    /// as the real one does, and a "nothing changed" must be true.
    fn lost(&mut self, c: usize, pending: Pending, why: &str) {
        let Waiting::Durable { response, undo, .. } = pending.state else {
            unreachable!("lost before its reply")
        };
        let answer = answer_lost(&self.exec, &mut self.conns[c].ctx, undo, why);
        if !is_nothing_changed(&answer) {
            return;
        }
        self.coverage.undone += 1;
        let holder = self.holder_token(&pending.key);
        match response {
            Response::Granted {
                token, lease_id, ..
            } => {
                assert_ne!(holder, Some(token), "an undone grant is still visible");
                self.model.refused.insert(lease_id);
            }
            Response::Released => {
                assert!(holder.is_some(), "an undone release left the key free");
            }
            _ => {}
        }
    }
}

/// What a waiter hears in place of a grant: LOCKED, an error, or a repeat's answer.
fn answered_in_line(result: WaitResult) -> Waiting {
    match result {
        WaitResult::TimedOut { token, .. } => Waiting::Durable {
            response: Response::Locked {
                token,
                ttl_left_ms: 0,
            },
            ticket: TICKET_NOW,
            undo: None,
        },
        WaitResult::Failed(code, message) => Waiting::Durable {
            response: Response::Error { code, message },
            ticket: TICKET_NOW,
            undo: None,
        },
        WaitResult::Ended { how, token } => Waiting::Durable {
            response: Response::AcquireEnded { how, token },
            ticket: TICKET_NOW,
            undo: None,
        },
        WaitResult::Regranted {
            token,
            lease_id,
            ttl_left_ms,
            ticket,
        } => Waiting::Durable {
            response: Response::Regranted {
                token,
                lease_id,
                ttl_left_ms: u32::try_from(ttl_left_ms).unwrap_or(u32::MAX),
            },
            ticket,
            undo: None,
        },
        WaitResult::Granted { .. } => unreachable!("a grant is taken up by poll_lines"),
    }
}
