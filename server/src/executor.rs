//! The executor: one request in, the table call it needs, one [`Outcome`] out. Both surfaces
//! (binary, console) call it; it never blocks on I/O.
//!
//! A request runs on its connection's task: it locks one shard for the few hundred
//! nanoseconds the table needs, hands the change to the [`Journal`] while still holding the
//! lock (so the journal orders changes to a key exactly as the table made them), and leaves.
//! The reply then waits, on the connection, until the journal is durable past the change's
//! ticket: what "durable" means, and what is logged at all, is the journal's business.
//! Hand-offs to waiters are in [`crate::handoff`], token reservations in [`crate::tokens`],
//! watch registration in [`crate::watch`], undo in [`crate::journal`].

use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tenure_protocol::{ErrorCode, Holder, LeaseId, Request, Response};
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::Config;
use crate::conn::ConnCtx;
use crate::handoff::{WaitResult, WaitSlot};
use crate::journal::{Change, Journal, JournalError, Lease, Ticket, Undo, TICKET_NOW};
use crate::stats::Stats;
use crate::table::{self, Acquire, AcquireArgs, LockTable, Quotas, TableLimits};
use crate::tokens::Tokens;
use crate::wal::FreeReason;
use crate::watch::Watches;

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

/// Everything the tasks share: the table's shards and the services around it.
pub struct Executor {
    /// The limits in force.
    pub config: Config,
    /// The monotonic clock; the only one the server reads.
    pub clock: Clock,
    shards: Box<[Mutex<LockTable<WaitSlot>>]>,
    /// Held locks and waiters over all shards, against the server-wide limits.
    pub(crate) quotas: Arc<Quotas>,
    /// Fencing tokens, below a durable limit, and their reservation.
    pub tokens: Arc<Tokens>,
    /// Where changes are made durable.
    pub journal: Arc<dyn Journal>,
    /// Counters.
    pub stats: Stats,
    /// Who watches which key.
    pub watches: Watches,
    /// In token-only durability, grants are refused until this `now_ms` after a restart.
    grants_refused_until_ms: u64,
}

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
    /// Builds the executor around a recovered journal whose tokens start at `token_floor`.
    pub fn new(
        config: Config,
        clock: Clock,
        journal: Arc<dyn Journal>,
        token_floor: u64,
        grants_refused_until_ms: u64,
    ) -> Executor {
        // One count for all shards: a limit split per shard is not the limit that was set.
        let quotas = Arc::new(Quotas::new(TableLimits {
            held_max: config.held_max,
            waiters_max: config.waiters_max,
            waiters_per_key_max: config.waiters_per_key_max,
        }));
        // A random seed per process, so clients cannot pick keys that collide in the index.
        let hash_seed: u64 = rand::random();
        let shards = (0..config.shards)
            .map(|_| Mutex::new(LockTable::with_quotas(Arc::clone(&quotas), hash_seed)))
            .collect();
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
            grants_refused_until_ms,
        }
    }

    /// The shard that owns `key`.
    pub fn shard(&self, key: &[u8]) -> MutexGuard<'_, LockTable<WaitSlot>> {
        let i = table::shard_of(key, self.shards.len());
        self.shards[i]
            .lock()
            .expect("a lock-table shard was poisoned by a panic")
    }

    /// Every shard in turn, for the ticker, snapshots and STATS.
    pub fn shards(&self) -> impl Iterator<Item = &Mutex<LockTable<WaitSlot>>> {
        self.shards.iter()
    }

    /// Runs one request. Never blocks on I/O: anything slow is handed back as an [`Outcome`].
    pub fn execute(
        self: &Arc<Self>,
        ctx: &mut ConnCtx,
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
        ctx: &mut ConnCtx,
        request_id: u64,
        request: Request,
        received_ms: u64,
    ) -> Outcome {
        let now_ms = self.clock.now_ms();
        self.run(ctx, request_id, request, received_ms.min(now_ms), now_ms)
    }

    fn run(
        self: &Arc<Self>,
        ctx: &mut ConnCtx,
        request_id: u64,
        request: Request,
        received_ms: u64,
        now_ms: u64,
    ) -> Outcome {
        self.stats.count_op(&request);
        let response = match request {
            Request::Ping => Response::Pong,
            Request::Acquire { .. } => return self.acquire(ctx, now_ms, received_ms, request),
            Request::Renew {
                key,
                lease_id,
                ttl_ms,
            } => self.renew(now_ms, &key, lease_id, ttl_ms),
            Request::Release { key, lease_id } => return self.release(ctx, now_ms, key, lease_id),
            Request::Inspect { key } => match holder(self.shard(&key).inspect(now_ms, &key)) {
                None => Response::Free,
                Some(Holder {
                    token,
                    ttl_left_ms,
                    waiters,
                    meta,
                }) => Response::Held {
                    token,
                    ttl_left_ms,
                    waiters,
                    meta,
                },
            },
            Request::Check { key, token } => match self.shard(&key).check(now_ms, &key, token) {
                table::Check::Current => Response::Current,
                table::Check::Stale => Response::Stale,
            },
            Request::Stats => Response::Stats(crate::stats::stats_pairs(self)),
            Request::Watch { key } => self.watch(ctx, now_ms, request_id, key),
            Request::Unwatch { key } => self.unwatch(ctx, &key),
        };
        Outcome::Reply(response, TICKET_NOW)
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
    fn renew(&self, now_ms: u64, key: &[u8], lease_id: LeaseId, ttl_ms: u32) -> Response {
        if ttl_ms > self.config.ttl_ms_max {
            return self.ttl_too_long(ttl_ms);
        }
        match self.shard(key).renew(now_ms, key, lease_id, ttl_ms) {
            table::Renew::Renewed { ttl_ms } => Response::Renewed { ttl_ms },
            table::Renew::Lost => Response::Lost,
        }
    }

    fn ttl_too_long(&self, ttl_ms: u32) -> Response {
        Stats::bump(&self.stats.errors);
        error(
            ErrorCode::BadTtl,
            format!(
                "ttl_ms {ttl_ms} over this server's limit of {}",
                self.config.ttl_ms_max
            ),
        )
    }

    /// Why an acquire must be refused before the table is touched, if it must.
    fn refuse_acquire(&self, now_ms: u64, ttl_ms: u32) -> Option<Response> {
        if ttl_ms > self.config.ttl_ms_max {
            return Some(self.ttl_too_long(ttl_ms));
        }
        if now_ms < self.grants_refused_until_ms {
            Stats::bump(&self.stats.errors);
            let left_ms = self.grants_refused_until_ms - now_ms;
            let message =
                format!("restarted in token-only durability: no grants for {left_ms} ms more");
            return Some(error(ErrorCode::Recovering, message));
        }
        self.refuse_if_journal_failed()
    }

    fn acquire(
        self: &Arc<Self>,
        ctx: &mut ConnCtx,
        now_ms: u64,
        received_ms: u64,
        request: Request,
    ) -> Outcome {
        let Request::Acquire {
            key,
            ttl_ms,
            wait_ms,
            release_on_disconnect,
            meta,
        } = &request
        else {
            unreachable!("acquire called with {request:?}")
        };
        if let Some(refusal) = self.refuse_acquire(now_ms, *ttl_ms) {
            return Outcome::Reply(refusal, TICKET_NOW);
        }
        let (tx, rx) = oneshot::channel();
        let waiter = (*wait_ms > 0).then(|| WaitSlot::new(tx, *release_on_disconnect, received_ms));
        let args = AcquireArgs {
            key,
            lease_id: LeaseId::from_u128(rand::random()),
            ttl_ms: *ttl_ms,
            wait_ms: *wait_ms,
            waiter,
            meta,
        };
        let mut shard = self.shard(key);
        let mut events = Vec::new();
        let outcome = shard.acquire(now_ms, args, &self.tokens.allocator, &mut events);
        // Settling the key may have ended a lease or handed it on before this request's turn.
        self.apply_events(&mut shard, now_ms, &mut events);
        match outcome {
            Acquire::Granted(grant) => {
                let waited_ms = clamp_ms(now_ms - received_ms);
                self.granted(ctx, &mut shard, now_ms, &request, grant, waited_ms)
            }
            Acquire::Locked { token, ttl_left_ms } => {
                Stats::bump(&self.stats.locked);
                let ttl_left_ms = clamp_ms(ttl_left_ms);
                Outcome::Reply(Response::Locked { token, ttl_left_ms }, TICKET_NOW)
            }
            Acquire::Queued { waiter_id } => Outcome::Wait {
                rx,
                key: key.clone(),
                waiter_id,
                release_on_disconnect: *release_on_disconnect,
            },
            Acquire::Full(limit) => Outcome::Reply(self.full_error(limit), TICKET_NOW),
            Acquire::TokensExhausted { .. } => {
                drop(shard);
                self.tokens.reserve_ahead();
                Outcome::NeedTokens {
                    request,
                    received_ms,
                }
            }
        }
    }

    /// The refusal for a limit the table hit, naming the limit and its setting.
    fn full_error(&self, limit: table::Limit) -> Response {
        Stats::bump(&self.stats.errors);
        let config = &self.config;
        let (code, message) = match limit {
            table::Limit::HeldLocks => (
                ErrorCode::HeldLimit,
                format!(
                    "the server holds {} locks, its limit (--held-max)",
                    config.held_max
                ),
            ),
            table::Limit::Waiters => (
                ErrorCode::WaitersLimit,
                format!(
                    "the server has {} waiters, its limit (--waiters-max)",
                    config.waiters_max
                ),
            ),
            table::Limit::WaitersPerKey => (
                ErrorCode::WaitersLimit,
                format!(
                    "this key has {} waiters, its limit (--waiters-per-key-max)",
                    config.waiters_per_key_max
                ),
            ),
        };
        error(code, message)
    }

    /// Logs a grant the table just made (still under its shard's lock) and builds its reply,
    /// or takes it back if it cannot be logged.
    fn granted(
        self: &Arc<Self>,
        ctx: &mut ConnCtx,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        request: &Request,
        grant: table::Grant,
        waited_ms: u32,
    ) -> Outcome {
        let Request::Acquire {
            key,
            release_on_disconnect,
            meta,
            ..
        } = request
        else {
            unreachable!("granted called with {request:?}")
        };
        let table::Grant {
            token,
            lease_id,
            ttl_ms,
        } = grant;
        let lease = Lease {
            key,
            lease_id,
            token,
            ttl_ms,
            release_on_disconnect: *release_on_disconnect,
            meta,
        };
        let ticket = match self.journal.append(&Change::Grant(lease)) {
            Ok(ticket) => ticket,
            Err(e) => {
                // Not durable, so it must not stand: take it back before anyone hears of it.
                self.free(shard, now_ms, key, lease_id, FreeReason::Released);
                return Outcome::Reply(self.unavailable(&e), TICKET_NOW);
            }
        };
        Stats::bump(&self.stats.grants);
        self.watches
            .notify(key, tenure_protocol::EventKind::Granted, token, meta);
        if *release_on_disconnect {
            ctx.own(key.clone(), lease_id);
        }
        self.tokens.reserve_ahead();
        let response = Response::Granted {
            token,
            lease_id,
            ttl_ms,
            waited_ms,
        };
        if !self.journal.logs_leases() {
            return Outcome::Reply(response, TICKET_NOW); // nothing was logged, nothing to undo
        }
        let undo = Undo::Grant {
            key: key.clone(),
            lease_id,
        };
        Outcome::Changed {
            response,
            ticket,
            undo,
        }
    }

    fn unavailable(&self, e: &JournalError) -> Response {
        Stats::bump(&self.stats.errors);
        tracing::error!(error = %e, "a change could not be logged; refusing it");
        error(
            ErrorCode::Unavailable,
            format!("not durable, nothing changed: {e}"),
        )
    }

    fn release(
        self: &Arc<Self>,
        ctx: &mut ConnCtx,
        now_ms: u64,
        key: Bytes,
        lease_id: LeaseId,
    ) -> Outcome {
        if let Some(refusal) = self.refuse_if_journal_failed() {
            return Outcome::Reply(refusal, TICKET_NOW);
        }
        let mut shard = self.shard(&key);
        // What the lease looked like, to put it back if the release never becomes durable
        // (only logged changes can fail to become durable).
        let before = match shard.inspect(now_ms, &key) {
            table::Inspect::Held {
                token,
                ttl_left_ms,
                meta,
                ..
            } if self.journal.logs_leases() => {
                Some((token, ttl_left_ms, Bytes::copy_from_slice(meta)))
            }
            _ => None,
        };
        let Some(ticket) = self.free(&mut shard, now_ms, &key, lease_id, FreeReason::Released)
        else {
            return Outcome::Reply(Response::NotOwner, TICKET_NOW);
        };
        drop(shard);
        ctx.disown(&key, lease_id);
        match ticket {
            Ok(ticket) => match before {
                Some((token, ttl_left_ms, meta)) => Outcome::Changed {
                    response: Response::Released,
                    ticket,
                    undo: Undo::Release {
                        key,
                        lease_id,
                        token,
                        ttl_ms: clamp_ms(ttl_left_ms).max(tenure_protocol::limits::TTL_MS_MIN),
                        meta,
                    },
                },
                None => Outcome::Reply(Response::Released, ticket),
            },
            Err(e) => {
                // The journal failed (or filled its backlog) between the check above and the
                // append: the lock is free here, but a restart would bring the lease back.
                Stats::bump(&self.stats.errors);
                tracing::error!(error = %e, "a release could not be logged");
                let message = format!(
                    "released, but not durable: the lease may come back after a restart: {e}"
                );
                Outcome::Reply(error(ErrorCode::Unavailable, message), TICKET_NOW)
            }
        }
    }

    /// A refusal for a change the journal can no longer make durable, checked before the
    /// table is touched, so "nothing changed" is true when it is said.
    fn refuse_if_journal_failed(&self) -> Option<Response> {
        let failed = self.journal.failed()?;
        Stats::bump(&self.stats.errors);
        let message = format!("not durable, nothing changed: the WAL failed: {failed}");
        Some(error(ErrorCode::Unavailable, message))
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

/// The live leases, shard by shard, for the journal's snapshots.
impl crate::journal::LeaseSource for Executor {
    fn parts(&self) -> usize {
        self.shards.len()
    }

    fn for_each_lease(&self, part: usize, each: &mut dyn FnMut(Lease<'_>)) {
        let shard = self.shards[part].lock().expect("shard poisoned");
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
            })
        });
    }

    fn token_limit(&self) -> u64 {
        self.tokens.allocator.limit()
    }
}
