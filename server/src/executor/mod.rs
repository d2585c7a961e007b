//! The executor: one request in, the table call it needs, one [`Outcome`] out. Both surfaces
//! (binary, console) call it; it never blocks on I/O.
//!
//! A request runs on its connection's task: it locks one shard for the few hundred
//! nanoseconds the table needs, hands the change to the [`Journal`] while still holding the
//! lock (so the journal orders changes to a key exactly as the table made them), and leaves.
//! The reply then waits, on the connection, until the journal is durable past the change's
//! ticket: what "durable" means, and what is logged at all, is the journal's business.
//! The executor owns everything a request changes besides the table: hand-offs to waiters
//! (`handoff`), token reservations (`tokens`), watch registration (`watch`), taking back a
//! change that never became durable (`undo`), each connection's [`Session`], the STATS
//! reply (`stats_reply`) and the expiry ticker (`ticker`). Here: the dispatch; `acquire`,
//! `release` and `refuse` (the error replies) hold the longer requests.

mod acquire;
mod handoff;
mod refuse;
mod release;
mod repeat;
mod session;
mod sessions;
#[cfg(test)]
mod sim;
mod stats_reply;
mod ticker;
mod tokens;
mod undo;
mod watch;

use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tenure_protocol::{ErrorCode, Holder, LeaseId, Request, Response};
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::Config;
use crate::identity::Identities;
use crate::journal::{Change, Journal, Lease, Ticket, TICKET_NOW};
use crate::obs::stats::Stats;
use crate::record::RecoveredLease;
use crate::table::{self, LeaseIdCipher, LockTable, Quotas, TableLimits};
pub use handoff::{session_ended_result, WaitResult, WaitSlot};
pub use session::{Auth, Credential, Session};
pub use sessions::{SessionTable, Sessions};
pub use stats_reply::stats_pairs;
pub use ticker::tick;
pub use tokens::Tokens;
pub use undo::{answer_lost, Undo};
pub use watch::{WatchEvent, WatchSink, Watches};

/// What the connection does with a request after the executor ran it.
pub enum Outcome {
    /// Reply with this once the journal is durable up to the ticket ([`TICKET_NOW`]: at once).
    Reply(Response, Ticket),
    /// The acquire is queued as a waiter; the answer arrives on `rx`.
    Wait {
        /// Where the grant or time-out arrives.
        rx: oneshot::Receiver<WaitResult>,
        /// The key waited on, to leave the queue if the connection closes.
        key: Bytes,
        /// The table's id for this waiter.
        waiter_id: u64,
        /// Whether a grant should be released when this connection closes.
        release_on_disconnect: bool,
        /// The session a grant is to join ([`Executor::join_session`]), if any.
        session_id: Option<tenure_protocol::SessionId>,
    },
    /// No durable fencing tokens are left: reserve more, then run the request again with
    /// [`Executor::execute_again`].
    NeedTokens {
        /// The request to run again.
        request: Request,
        /// When it was first taken up; its grant's `waited_ms` counts from here.
        received_ms: u64,
    },
    /// A grant or release: reply once `ticket` is durable, or `undo` it if the journal fails.
    Changed {
        /// The reply to send once durable.
        response: Response,
        /// The change's ticket.
        ticket: Ticket,
        /// How to take the change back.
        undo: Undo,
    },
}

/// Everything the tasks share: the table's shards and the services around it. Built once,
/// from [`ExecutorParts`], by [`Executor::new`]; nothing is set on it afterwards.
pub struct Executor {
    /// The limits in force.
    config: Config,
    /// The monotonic clock; the only one the server reads.
    clock: Clock,
    shards: Box<[Mutex<LockTable<WaitSlot>>]>,
    /// Held locks and waiters over all shards, against the server-wide limits.
    quotas: Arc<Quotas>,
    /// Fencing tokens, below a durable limit, and their reservation.
    tokens: Arc<Tokens>,
    /// Where changes are made durable.
    journal: Arc<dyn Journal>,
    /// Counters.
    stats: Stats,
    /// Who watches which key.
    watches: Watches,
    /// Live sessions and their leases (PROTOCOL.md 3.11).
    sessions: Sessions,
    /// In token-only durability, grants are refused until this `now_ms` after a restart.
    grants_refused_until_ms: u64,
    /// The identities in force; `None`: none configured, every connection may do anything
    /// (and the request path checks nothing else).
    identities: Option<Arc<Identities>>,
    /// Cluster mode: the node's cluster administration (CLUSTER requests); `None` on a
    /// single-node server, which answers them [`NOT_CLUSTER`].
    cluster: Option<Arc<dyn ClusterAdmin>>,
    /// Added to the clock's reading for STATS `uptime_ms`: 0 on a single node; a cluster
    /// leader's executor, whose clock starts at its takeover, carries its node's uptime then.
    uptime_offset_ms: u64,
}

/// What an [`Executor`] is built from: the one way to make one.
pub struct ExecutorParts {
    /// The limits in force.
    pub config: Config,
    /// The clock the executor reads.
    pub clock: Clock,
    /// A recovered journal.
    pub journal: Arc<dyn Journal>,
    /// Tokens start here (the journal's recovered floor).
    pub token_floor: u64,
    /// In token-only durability, grants are refused until this `now_ms` after a restart.
    pub grants_refused_until_ms: u64,
    /// The identities in force, if any.
    pub identities: Option<Arc<Identities>>,
    /// Cluster mode: the node's cluster administration.
    pub cluster: Option<Arc<dyn ClusterAdmin>>,
    /// Added to the clock's reading for STATS `uptime_ms`.
    pub uptime_offset_ms: u64,
}

impl ExecutorParts {
    /// The parts of a single-node executor without identities: `journal` with tokens from
    /// `token_floor`, grants allowed at once.
    pub fn new(config: Config, clock: Clock, journal: Arc<dyn Journal>, token_floor: u64) -> Self {
        ExecutorParts {
            config,
            clock,
            journal,
            token_floor,
            grants_refused_until_ms: 0,
            identities: None,
            cluster: None,
            uptime_offset_ms: 0,
        }
    }
}

/// A node's cluster administration, as the executor holds it for its connections: CLUSTER
/// requests are answered by it (implemented in `cluster::admin`, so neither the executor
/// nor the connection imports the cluster).
pub trait ClusterAdmin: Send + Sync + 'static {
    /// Answers a CLUSTER request once Raft has done it.
    fn serve(&self, request: Request) -> BoxFuture<'_, Response>;
}

/// Why a single-node server refuses a CLUSTER request (with `UNKNOWN_COMMAND`, as a server
/// older than them would).
pub const NOT_CLUSTER: &str =
    "not in cluster mode: this is a single-node server (start it with --cluster)";

/// Most queued acquires of a closing connection cancelled under one hold of a shard's mutex.
const CANCELS_PER_LOCK_MAX: usize = 256;

pub(crate) fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error {
        code,
        message: message.into(),
    }
}

pub(crate) fn clamp_ms(ms: u64) -> u32 {
    u32::try_from(ms).unwrap_or(u32::MAX)
}

impl Executor {
    /// Builds the executor from its parts; the journal's tokens start at `token_floor`.
    pub fn new(parts: ExecutorParts) -> Executor {
        let ExecutorParts {
            config,
            clock,
            journal,
            token_floor,
            grants_refused_until_ms,
            identities,
            cluster,
            uptime_offset_ms,
        } = parts;
        // One count for all shards: a limit split per shard is not the limit that was set.
        let quotas = Arc::new(Quotas::new(TableLimits {
            held_max: config.held_max,
            waiters_max: config.waiters_max,
            waiters_per_key_max: config.waiters_per_key_max,
        }));
        // A random seed per process, so clients cannot pick keys that collide in the index.
        let hash_seed: u64 = rand::random();
        // Secret, and the process's own: see `table::acquire_ids`.
        let lease_ids = Arc::new(LeaseIdCipher::new([rand::random(), rand::random()]));
        let shards = (0..config.shards)
            .map(|_| {
                let mut table = LockTable::with_quotas(Arc::clone(&quotas), hash_seed);
                table.set_lease_ids(Arc::clone(&lease_ids));
                Mutex::new(table)
            })
            .collect();
        let sessions = Sessions::new(config.sessions_max, config.session_leases_max);
        let tokens = Arc::new(Tokens::new(
            token_floor,
            config.token_block,
            Arc::clone(&journal),
        ));
        Executor {
            config,
            clock,
            shards,
            quotas,
            tokens,
            journal,
            stats: Stats::default(),
            watches: Watches::default(),
            sessions,
            grants_refused_until_ms,
            identities,
            cluster,
            uptime_offset_ms,
        }
    }

    /// The limits in force.
    #[inline]
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The clock the executor reads.
    #[inline]
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Fencing tokens and their reservation.
    #[inline]
    pub fn tokens(&self) -> &Arc<Tokens> {
        &self.tokens
    }

    /// Where changes are made durable.
    #[inline]
    pub fn journal(&self) -> &Arc<dyn Journal> {
        &self.journal
    }

    /// The counters.
    #[inline]
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Who watches which key.
    #[inline]
    pub fn watches(&self) -> &Watches {
        &self.watches
    }

    /// Live sessions.
    #[inline]
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// The identities in force, if any are configured.
    #[inline]
    pub fn identities(&self) -> &Option<Arc<Identities>> {
        &self.identities
    }

    /// Cluster mode: the node's cluster administration.
    #[inline]
    pub fn cluster(&self) -> &Option<Arc<dyn ClusterAdmin>> {
        &self.cluster
    }

    /// What STATS adds to the clock for `uptime_ms`.
    #[inline]
    pub fn uptime_offset_ms(&self) -> u64 {
        self.uptime_offset_ms
    }

    /// The shard that owns `key`.
    pub fn shard(&self, key: &[u8]) -> MutexGuard<'_, LockTable<WaitSlot>> {
        let i = table::shard_of(key, self.shards.len());
        self.shards[i]
            .lock()
            .expect("a lock-table shard was poisoned by a panic")
    }

    /// Puts back the leases a journal recovered, each running again from `now_ms`; a lease
    /// in a session (restored first, [`Executor::restore_sessions`]) joins it, with its
    /// deadline, and one whose session ended is left out.
    pub fn restore(&self, now_ms: u64, leases: impl IntoIterator<Item = RecoveredLease>) {
        for lease in leases {
            let Some(ttl_ms) = self.restored_ttl(&lease) else {
                continue;
            };
            self.shard(&lease.key).restore_kind(
                now_ms,
                &lease.key,
                lease.lease_id,
                lease.token,
                ttl_ms,
                lease.kind,
                &lease.meta,
            );
            if let Some(acquire_id) = lease.acquire_id {
                self.shard(&lease.key)
                    .note_acquire_id(lease.token, acquire_id, TICKET_NOW);
            }
        }
    }

    /// Every shard in turn, for the ticker, snapshots and STATS.
    pub fn shards(&self) -> impl Iterator<Item = &Mutex<LockTable<WaitSlot>>> {
        self.shards.iter()
    }

    /// Runs one request. Never blocks on I/O: anything slow is handed back as an [`Outcome`].
    pub fn execute(
        self: &Arc<Self>,
        ctx: &mut Session,
        request_id: u64,
        request: Request,
    ) -> Outcome {
        // One clock read for both, so an immediate grant reports `waited_ms` 0 exactly.
        let now_ms = self.clock.now_ms();
        self.run(ctx, request_id, request, now_ms, now_ms)
    }

    /// Runs a request again that was first taken up at `received_ms` and answered
    /// [`Outcome::NeedTokens`]: a grant now reports the time since then as `waited_ms`, since
    /// the client counts its lease from before it sent the request, not from this retry.
    pub fn execute_again(
        self: &Arc<Self>,
        ctx: &mut Session,
        request_id: u64,
        request: Request,
        received_ms: u64,
    ) -> Outcome {
        let now_ms = self.clock.now_ms();
        self.run(ctx, request_id, request, received_ms.min(now_ms), now_ms)
    }

    fn run(
        self: &Arc<Self>,
        ctx: &mut Session,
        request_id: u64,
        request: Request,
        received_ms: u64,
        now_ms: u64,
    ) -> Outcome {
        self.stats.count_op(&request);
        let is_read = matches!(
            &request,
            Request::Renew { .. } | Request::Inspect { .. } | Request::Check { .. }
        );
        if is_read {
            if let Some(refusal) = self.refuse_if_not_leader() {
                return Outcome::Reply(refusal, TICKET_NOW);
            }
        }
        let mut ticket = TICKET_NOW;
        let response = match request {
            Request::Ping => Response::Pong,
            Request::Acquire { .. } => return self.acquire_any(ctx, now_ms, received_ms, request),
            Request::SessionOpen { .. }
            | Request::SessionKeepalive { .. }
            | Request::SessionClose { .. } => return self.session_request(ctx, now_ms, request),
            Request::Renew {
                key,
                lease_id,
                ttl_ms,
            } => match self.renew(now_ms, &key, lease_id, ttl_ms) {
                // A renewal to a longer TTL waits for its record too.
                Outcome::Reply(response, logged) => {
                    ticket = ticket.max(logged);
                    response
                }
                other => return other,
            },
            Request::Release { key, lease_id } => return self.release(ctx, now_ms, key, lease_id),
            Request::Inspect { key, kinds } => self.inspect(now_ms, &key, kinds),
            Request::Check { key, token } => match self.shard(&key).check(now_ms, &key, token) {
                table::Check::Current => Response::Current,
                table::Check::Stale => Response::Stale,
            },
            Request::Stats => match self.refuse_if_not_leader() {
                Some(refusal) => refusal,
                None => Response::Stats(stats_pairs(self)),
            },
            Request::Watch { key } => match self.refuse_if_not_leader() {
                Some(refusal) => refusal,
                None => self.watch(ctx, now_ms, request_id, key),
            },
            Request::Unwatch { key } => self.unwatch(ctx, &key),
            // The connection answers AUTH itself (it must verify off the async workers).
            Request::Auth { .. } => error(ErrorCode::BadArgs, "AUTH is not served here"),
            // And the cluster requests (they wait on Raft).
            Request::ClusterStatus { .. }
            | Request::ClusterInit { .. }
            | Request::ClusterAdd { .. }
            | Request::ClusterRemove { .. } => error(ErrorCode::UnknownOpcode, NOT_CLUSTER),
        };
        if is_read {
            return self.confirmed(response, ticket);
        }
        Outcome::Reply(response, ticket)
    }
}

impl Executor {
    /// A read's reply, answered once the journal vouches that this node still led after the
    /// table was read (cluster mode; a local journal vouches at once). The ticket is taken
    /// after the read, so it also comes after every change the read saw (each took its
    /// ticket under the shard lock, before the read could see it): the reply never shows a
    /// change that is not yet durable.
    fn confirmed(&self, response: Response, ticket: Ticket) -> Outcome {
        match self.journal.confirm() {
            Ok(confirmed) => Outcome::Reply(response, ticket.max(confirmed)),
            Err(e) => Outcome::Reply(self.unavailable(&e), TICKET_NOW),
        }
    }
}

/// A key's holder as the wire reports it, or `None` if the key is free.
pub(crate) fn holder(inspect: table::Inspect<'_>) -> Option<Holder> {
    match inspect {
        table::Inspect::Free => None,
        table::Inspect::Held {
            token,
            ttl_left_ms,
            waiters,
            meta,
        } => Some(Holder {
            token,
            ttl_left_ms: clamp_ms(ttl_left_ms),
            waiters,
            meta: Bytes::copy_from_slice(meta),
        }),
    }
}

impl Executor {
    /// INSPECT: the key's holder, or FREE.
    fn inspect(&self, now_ms: u64, key: &[u8], kinds: bool) -> Response {
        let shard = self.shard(key);
        let shared = kinds.then(|| shard.inspect_kinds(now_ms, key)).flatten();
        match (holder(shard.inspect(now_ms, key)), shared) {
            (None, _) => Response::Free,
            (Some(h), Some(view)) => Response::HeldKinds {
                token: h.token,
                ttl_left_ms: h.ttl_left_ms,
                waiters: h.waiters,
                meta: h.meta,
                kinds: tenure_protocol::kind::HolderKinds {
                    limit: view.limit,
                    holders: view.holders,
                    in_use: view.in_use,
                    writer: view.writer,
                    waiting_shared: view.waiting_shared,
                    waiting_exclusive: view.waiting_exclusive,
                },
            },
            (
                Some(Holder {
                    token,
                    ttl_left_ms,
                    waiters,
                    meta,
                }),
                None,
            ) => Response::Held {
                token,
                ttl_left_ms,
                waiters,
                meta,
            },
        }
    }

    /// RENEW. One to a TTL longer than the lease's last journal record is logged and
    /// answered once durable, so a restart gives the lease at least that TTL again; any
    /// other is answered at once (see the table's "Renewals and the journal").
    fn renew(self: &Arc<Self>, now_ms: u64, key: &[u8], lease_id: LeaseId, ttl_ms: u32) -> Outcome {
        if ttl_ms > self.config.ttl_ms_max {
            return Outcome::Reply(self.ttl_too_long(ttl_ms), TICKET_NOW);
        }
        if self.sessions.holds(lease_id) {
            let message = "RENEW of a session lease: keep its session alive instead";
            return Outcome::Reply(error(ErrorCode::SessionLease, message), TICKET_NOW);
        }
        let mut shard = self.shard(key);
        let durable_lsn = || self.journal.progress().borrow().lsn;
        let response = match shard.renew(now_ms, key, lease_id, ttl_ms, durable_lsn) {
            table::Renew::Renewed { ttl_ms, wait_lsn } => {
                return Outcome::Reply(Response::Renewed { ttl_ms }, wait_lsn)
            }
            table::Renew::Unlogged { token } => {
                let renewal = Change::Renew { key, token, ttl_ms };
                return match self.journal.append(&renewal) {
                    Ok(ticket) => {
                        shard.renew_logged(now_ms, key, token, ttl_ms, ticket);
                        Outcome::Reply(Response::Renewed { ttl_ms }, ticket)
                    }
                    // Not logged, so not made: the lease keeps its deadline.
                    Err(e) => Outcome::Reply(self.unavailable(&e), TICKET_NOW),
                };
            }
            table::Renew::Lost => {
                // A lease past its deadline that the ticker has not reaped yet ends now, as
                // the ticker would end it, so this late RENEW counts as one of an expired lease.
                let mut events = Vec::new();
                shard.settle_key(now_ms, key, &self.tokens.allocator, &mut events);
                self.apply_events(&mut shard, now_ms, &mut events);
                self.stats.metrics.renew_lost(lease_id);
                Response::Lost
            }
        };
        Outcome::Reply(response, TICKET_NOW)
    }

    /// Takes queued acquires (key, waiter id) out of their queues, shard by shard, at most
    /// `CANCELS_PER_LOCK_MAX` per hold of a shard's mutex, so a connection leaving with a
    /// hundred thousand waiters does not keep other requests out of a shard meanwhile.
    pub fn cancel_waits(&self, waits: impl IntoIterator<Item = (Bytes, u64)>) {
        let shard_count = self.shards.len();
        let mut waits: Vec<(usize, Bytes, u64)> = waits
            .into_iter()
            .map(|(key, waiter_id)| (table::shard_of(&key, shard_count), key, waiter_id))
            .collect();
        waits.sort_unstable_by_key(|&(shard, _, waiter_id)| (shard, waiter_id));
        for same_shard in waits.chunk_by(|a, b| a.0 == b.0) {
            for batch in same_shard.chunks(CANCELS_PER_LOCK_MAX) {
                let mut shard = self.shards[batch[0].0]
                    .lock()
                    .expect("a lock-table shard was poisoned by a panic");
                for (_, key, waiter_id) in batch {
                    shard.cancel_waiter(key, *waiter_id);
                }
            }
        }
    }
}

/// The live leases, shard by shard, and the sessions, for the journal's snapshots.
impl crate::journal::LeaseSource for Executor {
    fn for_each_session(&self, each: &mut dyn FnMut(Change<'_>)) {
        sessions::for_each_session(&self.sessions, each);
    }

    fn parts(&self) -> usize {
        self.shards.len()
    }

    fn for_each_lease(&self, part: usize, each: &mut dyn FnMut(Lease<'_>)) {
        // Which session each lease is in: the session table is locked first (the lock
        // order), and only while there are session leases.
        let sessions = self.sessions.lock_if_any();
        let shard = self.shards[part].lock().expect("shard poisoned");
        // Hand-offs are made under the shard's lock: none of its leases starts joining a
        // session while it is held. Empty but for hand-offs not yet taken up.
        let joining = self.sessions.joining_copy();
        let now_ms = self.clock.now_ms();
        shard.for_each_held(now_ms, |held| {
            each(Lease {
                key: held.key,
                lease_id: held.lease_id,
                token: held.token,
                ttl_ms: held.ttl_ms,
                // The table does not keep the flag; recovery does not use it (the
                // connection it belonged to is gone after a restart).
                release_on_disconnect: false,
                meta: held.meta,
                acquire_id: shard.held_acquire_id(held.key, held.token),
                // A lease handed to a session's waiter is in its session, joined or not.
                session_id: (sessions.as_ref().and_then(|s| s.session_of(held.lease_id)))
                    .or_else(|| joining.get(&held.lease_id).copied()),
                kind: held.kind,
            })
        });
    }

    fn token_limit(&self) -> u64 {
        self.tokens.allocator.limit()
    }
}
