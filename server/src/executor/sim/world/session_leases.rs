//! Sessions in the world simulation: connections open sessions, take leases in them (on
//! keys of their own, so the lease model is not told of them), keep them alive and close
//! them; a restart restores sessions before leases (as WAL recovery and a new leader do), and
//! then every session that must be live comes back with each acknowledged lease in it (same
//! lease id and token, its deadline the restart plus the session's TTL), and a session whose
//! close was acknowledged stays ended, its leases with it.

use bytes::Bytes;
use rand::Rng;
use tenure_protocol::{ErrorCode, LeaseId, Request, Response, SessionId};

use super::{World, CONNS};
use crate::executor::{answer_lost, Outcome, Undo};
use crate::journal::{settle, Journal, LeaseSource, Settled};
use crate::record::Lease;

/// Keys only session leases take (the lease model's keys are others).
const SESSION_KEYS: [&[u8]; 3] = [b"session/0", b"session/1", b"session/2"];
/// Sessions the world keeps open at once, well under one connection's limit.
const SESSIONS_OPEN_MAX: usize = 3;

/// A session as its client knows it from acknowledged answers.
#[derive(Debug)]
pub(in crate::executor::sim) struct Known {
    id: SessionId,
    ttl_ms: u32,
    /// Its deadline on the executor's clock by the last acknowledged open or keep-alive: the
    /// server ends it no earlier.
    deadline_ms: u64,
    /// Acknowledged leases in it: key, lease id, token.
    leases: Vec<(Bytes, LeaseId, u64)>,
    /// A close was acknowledged.
    closed: bool,
}

impl World {
    /// One session action: open, acquire in one, keep one alive, or close one.
    pub(super) async fn session_step(&mut self) {
        let c = self.rng.random_range(0..CONNS);
        // The ticker's session pass: ended sessions are forgotten and their ends logged.
        let now_ms = self.exec.clock.now_ms();
        self.exec.reap_sessions(now_ms);
        let live: Vec<usize> = (0..self.known_sessions.len())
            .filter(|i| !self.known_sessions[*i].closed)
            .collect();
        if live.is_empty() || (live.len() < SESSIONS_OPEN_MAX && self.rng.random_bool(0.3)) {
            return self.session_open(c).await;
        }
        let i = live[self.rng.random_range(0..live.len())];
        match self.rng.random_range(0..10) {
            0..6 => self.session_acquire(c, i).await,
            6..9 => self.session_keepalive(c, i).await,
            _ => self.session_close(c, i).await,
        }
    }

    /// The answer once it is durable (the journal made durable at once), or `None` if its
    /// record was lost (the change taken back as the server does).
    fn settle_now(&mut self, c: usize, outcome: Outcome) -> Option<Response> {
        let (response, ticket, undo): (_, _, Option<Undo>) = match outcome {
            Outcome::Reply(response, ticket) => (response, ticket, None),
            Outcome::Changed {
                response,
                ticket,
                undo,
            } => (response, ticket, Some(undo)),
            _ => panic!("a session request that waited"),
        };
        self.journal.make_durable();
        let progress = self.journal.progress().borrow().clone();
        match settle(ticket, &progress) {
            Settled::Durable => Some(response),
            Settled::Lost(why) => {
                let _ = answer_lost(&self.exec, &mut self.conns[c].ctx, undo, &why);
                None
            }
            Settled::Waiting => unreachable!("made durable"),
        }
    }

    async fn session_open(&mut self, c: usize) {
        let ttl_ms = self.rng.random_range(100..=600);
        let session_id = None;
        let outcome = self
            .execute(c, Request::SessionOpen { ttl_ms, session_id })
            .await;
        let now_ms = self.exec.clock.now_ms();
        if let Some(Response::Session { session_id, .. }) = self.settle_now(c, outcome) {
            self.coverage.sessions_opened += 1;
            self.known_sessions.push(Known {
                id: session_id,
                ttl_ms,
                deadline_ms: now_ms + u64::from(ttl_ms),
                leases: Vec::new(),
                closed: false,
            });
        }
    }

    async fn session_acquire(&mut self, c: usize, i: usize) {
        let key = Bytes::from_static(SESSION_KEYS[self.rng.random_range(0..SESSION_KEYS.len())]);
        let request = Request::Acquire {
            key: key.clone(),
            ttl_ms: 0,
            wait_ms: 0,
            release_on_disconnect: false,
            meta: Bytes::new(),
            acquire_id: None,
            kind: Default::default(),
            session_id: Some(self.known_sessions[i].id),
        };
        let outcome = self.execute(c, request).await;
        if let Some(Response::Granted {
            token, lease_id, ..
        }) = self.settle_now(c, outcome)
        {
            self.known_sessions[i].leases.push((key, lease_id, token));
        }
    }

    async fn session_keepalive(&mut self, c: usize, i: usize) {
        let session_id = self.known_sessions[i].id;
        let now_ms = self.exec.clock.now_ms();
        let outcome = self
            .execute(c, Request::SessionKeepalive { session_id })
            .await;
        let answer = self.settle_now(c, outcome);
        let known = &mut self.known_sessions[i];
        match answer {
            Some(Response::Session { .. }) => {
                assert!(
                    known.deadline_ms > now_ms,
                    "an ended session was kept alive"
                );
                known.deadline_ms = now_ms + u64::from(known.ttl_ms);
            }
            Some(Response::Error {
                code: ErrorCode::NoSession,
                ..
            }) => {
                assert!(known.deadline_ms <= now_ms, "a live session is unknown");
                // Ended by expiry: its leases went with it.
                self.known_sessions.remove(i);
            }
            // Lost: the server may have moved its deadline or not.
            _ => {
                self.known_sessions.remove(i);
            }
        }
    }

    async fn session_close(&mut self, c: usize, i: usize) {
        let session_id = self.known_sessions[i].id;
        let outcome = self.execute(c, Request::SessionClose { session_id }).await;
        match self.settle_now(c, outcome) {
            Some(Response::SessionClosed { .. }) => self.known_sessions[i].closed = true,
            // Lost ("may be lost"), or already ended: what a restart brings back is unknown.
            _ => {
                self.known_sessions.remove(i);
            }
        }
    }

    /// After a restart at `now_ms` (the new executor's clock): what must be back is back,
    /// what was ended stays ended. Sessions whose state is not known are forgotten.
    pub(super) fn check_sessions_after_restart(&mut self, crash_ms: u64, now_ms: u64) {
        let mut held = Vec::new();
        for part in 0..self.exec.parts() {
            self.exec.for_each_lease(part, &mut |l: Lease<'_>| {
                held.push((l.lease_id, l.token, l.ttl_ms, l.session_id));
            });
        }
        let table = self.exec.sessions().lock();
        for known in &self.known_sessions {
            if known.closed {
                assert_eq!(table.ttl_of(known.id), None, "a closed session came back");
                for (_, lease_id, _) in &known.leases {
                    assert!(
                        held.iter().all(|h| h.0 != *lease_id),
                        "a lease of a closed session came back"
                    );
                }
            } else if known.deadline_ms > crash_ms {
                assert_eq!(table.ttl_of(known.id), Some(known.ttl_ms), "{known:?} lost");
                for (_, lease_id, token) in &known.leases {
                    let back = held.iter().find(|h| h.0 == *lease_id);
                    let expected = (*lease_id, *token, known.ttl_ms, Some(known.id));
                    assert_eq!(back, Some(&expected), "a session lease did not come back");
                    self.coverage.session_leases_back += 1;
                }
            }
        }
        drop(table);
        // Only the sessions that had to come back are known still, from the restart on.
        self.known_sessions
            .retain(|k| !k.closed && k.deadline_ms > crash_ms);
        for known in &mut self.known_sessions {
            known.deadline_ms = now_ms + u64::from(known.ttl_ms);
        }
    }
}
