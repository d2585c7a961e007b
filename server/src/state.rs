//! The server's shared state and the one executor both surfaces (binary, console) call.
//!
//! A request runs on its connection's task: it locks one shard for the few hundred
//! nanoseconds the table needs, appends a WAL record while still holding the lock (so the log
//! orders changes to a key exactly as the table made them), and leaves. The reply then waits,
//! on the connection, until the WAL's durable position passes that record: that is how a grant
//! or a release is synced before anyone hears of it, with many of them sharing one fsync.
//!
//! Fencing tokens come from a [`TokenAllocator`] that only hands out tokens below a limit
//! already synced in the WAL, so a token is durable before it is visible anywhere (a GRANTED
//! reply, a LOCKED reply, INSPECT), in every durability mode.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tenure_protocol::{ErrorCode, EventKind, Holder, LeaseId, Request, Response};
use tokio::sync::{oneshot, watch, Notify};

use crate::clock::Clock;
use crate::config::{Config, Durability};
use crate::stats::Stats;
use crate::table::{self, Acquire, AcquireArgs, Event, Handoff, LockTable, Quotas, TableLimits};
use crate::tokens::TokenAllocator;
use crate::wal::{self, DurableState, FreeReason, Lsn, Record, Wal};
use crate::watch::{WatchEvent, WatchSink, Watches};

/// What a waiting acquire is eventually told.
#[derive(Debug)]
pub enum WaitResult {
    /// The lock was handed over; reply once `lsn` is durable.
    Granted {
        /// The grant.
        grant: table::Grant,
        /// WAL position of the grant record.
        lsn: Lsn,
        /// Time from taking the request up to the grant, for the reply's `waited_ms`.
        waited_ms: u32,
    },
    /// The wait ran out while someone else held the lock.
    TimedOut {
        /// The holder's token.
        token: u64,
        /// Time left on the holder's lease.
        ttl_left_ms: u64,
    },
    /// The hand-over could not be made durable.
    Failed(ErrorCode, String),
}

/// A queued acquire's way back to its connection.
pub struct WaitSlot {
    tx: oneshot::Sender<WaitResult>,
    release_on_disconnect: bool,
    /// When the request was taken up (`now_ms`), so a hand-off can tell how long it waited.
    received_ms: u64,
}

impl table::Waiter for WaitSlot {
    fn is_live(&self) -> bool {
        !self.tx.is_closed()
    }
}

/// What the connection does with a request after the executor ran it.
pub enum Outcome {
    /// Reply with this once the WAL is durable up to `lsn` (0: at once).
    Reply(Response, Lsn),
    /// The acquire is queued; the answer arrives on `rx`.
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
    /// [`Shared::execute_again`].
    NeedTokens {
        /// The request to run again.
        request: Request,
        /// When it was first taken up; its grant's `waited_ms` counts from here.
        received_ms: u64,
    },
    /// A grant or release: reply once `lsn` is durable, or `undo` it if the WAL fails first.
    Changed {
        /// The reply to send once durable.
        response: Response,
        /// WAL position of the change's record.
        lsn: Lsn,
        /// How to take the change back.
        undo: Undo,
    },
}

/// How to take back a change whose WAL record never became durable, so that the client's
/// "not durable, nothing changed" holds on the live server as it does after a restart.
#[derive(Debug)]
pub enum Undo {
    /// Revoke a grant (handing the lock to the next waiter, as a release would).
    Grant {
        /// The lock.
        key: Bytes,
        /// The grant's lease.
        lease_id: LeaseId,
    },
    /// Put a released lease back, unless someone else holds the key by now.
    Release {
        /// The lock.
        key: Bytes,
        /// The released lease.
        lease_id: LeaseId,
        /// Its fencing token.
        token: u64,
        /// Time it had left, in milliseconds; it gets at least that again.
        ttl_ms: u32,
        /// Its holder metadata.
        meta: Bytes,
    },
}

/// Per-connection facts the executor needs.
pub struct ConnCtx {
    /// Server-unique connection number.
    pub conn_id: u64,
    /// Leases to release when the connection closes (acquired with release-on-disconnect).
    pub owned: Vec<(Bytes, LeaseId)>,
    /// This connection's event queue, created on its first WATCH.
    pub sink: Option<Arc<WatchSink>>,
    /// Receiver of `sink`, taken by the connection loop.
    pub events: Option<tokio::sync::mpsc::Receiver<WatchEvent>>,
    /// The keys this connection watches, each with the request id of its WATCH: one watch per
    /// key, a repeated WATCH replaces it.
    pub watches: HashMap<Bytes, u64>,
    /// Events a WATCH took out of `events` so they are sent before its reply (see
    /// [`Shared::execute`] on WATCH); the connection sends them, then the reply.
    pub drained: Vec<WatchEvent>,
}

impl ConnCtx {
    /// A context for a new connection.
    pub fn new(conn_id: u64) -> ConnCtx {
        ConnCtx {
            conn_id,
            owned: Vec::new(),
            sink: None,
            events: None,
            watches: HashMap::new(),
            drained: Vec::new(),
        }
    }

    /// Whether `event` belongs to a watch this connection still has. An event of a watch
    /// that was ended (UNWATCH, or replaced by a later UNWATCH and WATCH) may still sit in the
    /// queue; it must not be sent after the watch was reported ended.
    pub fn is_live(&self, event: &WatchEvent) -> bool {
        self.watches.get(&event.key) == Some(&event.watch_id)
    }
}

/// Everything the tasks share.
pub struct Shared {
    /// The limits in force.
    pub config: Config,
    /// The monotonic clock; the only one the server reads.
    pub clock: Clock,
    shards: Box<[Mutex<LockTable<WaitSlot>>]>,
    /// Held locks and waiters over all shards, against the server-wide limits.
    quotas: Arc<Quotas>,
    /// Fencing tokens, below a durable limit.
    pub tokens: TokenAllocator,
    /// The write-ahead log.
    pub wal: Wal,
    /// Counters.
    pub stats: Stats,
    /// Who watches which key.
    pub watches: Watches,
    reserving: AtomicBool,
    reserved: Notify,
    /// In token-only durability, grants are refused until this `now_ms` after a restart.
    grants_refused_until_ms: u64,
    /// The data directory's lock, held while the server runs.
    pub dir_lock: Option<std::fs::File>,
    /// The WAL's durable position and failure, read before changes that need the WAL.
    durable_rx: watch::Receiver<DurableState>,
}

/// Most queued acquires of a closing connection cancelled under one hold of a shard's mutex.
const CANCELS_PER_LOCK_MAX: usize = 256;

fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error {
        code,
        message: message.into(),
    }
}

fn clamp_ms(ms: u64) -> u32 {
    u32::try_from(ms).unwrap_or(u32::MAX)
}

impl Shared {
    /// Builds the state around a recovered WAL.
    pub fn new(
        config: Config,
        clock: Clock,
        wal: Wal,
        token_floor: u64,
        grants_refused_until_ms: u64,
    ) -> Shared {
        let shard_count = config.shards;
        let durable_rx = wal.subscribe();
        // One count for all shards: a limit split per shard is not the limit that was set.
        let quotas = Arc::new(Quotas::new(TableLimits {
            held_max: config.held_max,
            waiters_max: config.waiters_max,
            waiters_per_key_max: config.waiters_per_key_max,
        }));
        // A random seed per process, so clients cannot pick keys that collide in the index.
        let hash_seed: u64 = rand::random();
        let shards = (0..shard_count)
            .map(|_| Mutex::new(LockTable::with_quotas(Arc::clone(&quotas), hash_seed)))
            .collect();
        Shared {
            config,
            clock,
            shards,
            quotas,
            // Token 0 means "no token"; a fresh log has floor 0. Nothing is reserved yet: `run`
            // syncs the first block before accepting connections.
            tokens: TokenAllocator::new(token_floor.max(1), token_floor.max(1)),
            wal,
            stats: Stats::default(),
            watches: Watches::default(),
            reserving: AtomicBool::new(false),
            reserved: Notify::new(),
            grants_refused_until_ms,
            dir_lock: None,
            durable_rx,
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

    fn full(&self) -> bool {
        self.config.durability == Durability::Full
    }

    /// Logs a grant (full durability) and returns the position its reply must wait for.
    fn log_grant(
        &self,
        key: &[u8],
        grant: &table::Grant,
        meta: &[u8],
        release_on_disconnect: bool,
    ) -> Result<Lsn, wal::WalError> {
        if !self.full() {
            return Ok(0);
        }
        let flags = if release_on_disconnect {
            wal::GRANT_FLAG_RELEASE_ON_DISCONNECT
        } else {
            0
        };
        self.wal.append(&Record::Grant {
            key,
            lease_id: grant.lease_id.0,
            token: grant.token,
            ttl_ms: grant.ttl_ms,
            flags,
            meta,
        })
    }

    /// Logs that `key`'s lease `token` ended.
    fn log_free(&self, key: &[u8], token: u64, reason: FreeReason) -> Result<Lsn, wal::WalError> {
        if !self.full() {
            return Ok(0);
        }
        self.wal.append(&Record::Free { key, token, reason })
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
            } => {
                if ttl_ms > self.config.ttl_ms_max {
                    return Outcome::Reply(self.ttl_too_long(ttl_ms), 0);
                }
                match self.shard(&key).renew(now_ms, &key, lease_id, ttl_ms) {
                    table::Renew::Renewed { ttl_ms } => Response::Renewed { ttl_ms },
                    table::Renew::Lost => {
                        self.stats.metrics.renew_lost(lease_id);
                        Response::Lost
                    }
                }
            }
            Request::Release { key, lease_id } => return self.release(ctx, now_ms, key, lease_id),
            Request::Inspect { key } => match self.shard(&key).inspect(now_ms, &key) {
                table::Inspect::Free => Response::Free,
                table::Inspect::Held {
                    token,
                    ttl_left_ms,
                    waiters,
                    meta,
                } => Response::Held {
                    token,
                    ttl_left_ms: clamp_ms(ttl_left_ms),
                    waiters,
                    meta: Bytes::copy_from_slice(meta),
                },
            },
            Request::Check { key, token } => match self.shard(&key).check(now_ms, &key, token) {
                table::Check::Current => Response::Current,
                table::Check::Stale => Response::Stale,
            },
            Request::Stats => Response::Stats(self.stats_pairs()),
            Request::Watch { key } => self.watch(ctx, now_ms, request_id, key),
            Request::Unwatch { key } => {
                if ctx.watches.remove(&key).is_some() {
                    self.watches.remove(&key, ctx.conn_id);
                }
                Response::Unwatched
            }
        };
        Outcome::Reply(response, 0)
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
        if *ttl_ms > self.config.ttl_ms_max {
            return Outcome::Reply(self.ttl_too_long(*ttl_ms), 0);
        }
        if now_ms < self.grants_refused_until_ms {
            Stats::bump(&self.stats.errors);
            let left_ms = self.grants_refused_until_ms - now_ms;
            let message =
                format!("restarted in token-only durability: no grants for {left_ms} ms more");
            return Outcome::Reply(error(ErrorCode::Recovering, message), 0);
        }
        if let Some(refusal) = self.refuse_if_wal_failed() {
            return Outcome::Reply(refusal, 0);
        }
        let (tx, rx) = oneshot::channel();
        let waiter = (*wait_ms > 0).then_some(WaitSlot {
            tx,
            release_on_disconnect: *release_on_disconnect,
            received_ms,
        });
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
        let outcome = shard.acquire(now_ms, args, &self.tokens, &mut events);
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
                Outcome::Reply(Response::Locked { token, ttl_left_ms }, 0)
            }
            Acquire::Queued { waiter_id } => Outcome::Wait {
                rx,
                key: key.clone(),
                waiter_id,
                release_on_disconnect: *release_on_disconnect,
            },
            Acquire::Full(limit) => Outcome::Reply(self.full_error(limit), 0),
            Acquire::TokensExhausted { .. } => {
                drop(shard);
                self.reserve_ahead();
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
        let lsn = match self.log_grant(key, &grant, meta, *release_on_disconnect) {
            Ok(lsn) => lsn,
            Err(e) => {
                // Not durable, so it must not stand: take it back before anyone hears of it.
                self.free(shard, now_ms, key, grant.lease_id, FreeReason::Released);
                return Outcome::Reply(self.unavailable(&e), 0);
            }
        };
        Stats::bump(&self.stats.grants);
        self.watches
            .notify(key, EventKind::Granted, grant.token, meta);
        if *release_on_disconnect {
            ctx.owned.push((key.clone(), grant.lease_id));
        }
        self.reserve_ahead();
        let table::Grant {
            token,
            lease_id,
            ttl_ms,
        } = grant;
        let response = Response::Granted {
            token,
            lease_id,
            ttl_ms,
            waited_ms,
        };
        if !self.full() {
            return Outcome::Reply(response, 0); // nothing was logged, so nothing to undo
        }
        Outcome::Changed {
            response,
            lsn,
            undo: Undo::Grant {
                key: key.clone(),
                lease_id,
            },
        }
    }

    fn unavailable(&self, e: &wal::WalError) -> Response {
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
        if let Some(refusal) = self.refuse_if_wal_failed() {
            return Outcome::Reply(refusal, 0);
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
            } if self.full() => Some((token, ttl_left_ms, Bytes::copy_from_slice(meta))),
            _ => None,
        };
        let Some(lsn) = self.free(&mut shard, now_ms, &key, lease_id, FreeReason::Released) else {
            return Outcome::Reply(Response::NotOwner, 0);
        };
        drop(shard);
        ctx.owned.retain(|(k, l)| !(*l == lease_id && *k == key));
        match lsn {
            Ok(lsn) => match before {
                Some((token, ttl_left_ms, meta)) => Outcome::Changed {
                    response: Response::Released,
                    lsn,
                    undo: Undo::Release {
                        key,
                        lease_id,
                        token,
                        ttl_ms: clamp_ms(ttl_left_ms).max(tenure_protocol::limits::TTL_MS_MIN),
                        meta,
                    },
                },
                None => Outcome::Reply(Response::Released, lsn),
            },
            Err(e) => {
                // The WAL failed (or filled its backlog) between the check above and the
                // append: the lock is free here, but a restart would bring the lease back.
                Stats::bump(&self.stats.errors);
                tracing::error!(error = %e, "a release could not be logged");
                let message = format!(
                    "released, but not durable: the lease may come back after a restart: {e}"
                );
                Outcome::Reply(error(ErrorCode::Unavailable, message), 0)
            }
        }
    }

    /// A refusal for a change the WAL can no longer make durable, checked before the table is
    /// touched, so "nothing changed" is true when it is said.
    fn refuse_if_wal_failed(&self) -> Option<Response> {
        if self.config.durability != Durability::Full {
            return None;
        }
        let failed = self.durable_rx.borrow().failed.clone()?;
        Stats::bump(&self.stats.errors);
        let message = format!("not durable, nothing changed: the WAL failed: {failed}");
        Some(error(ErrorCode::Unavailable, message))
    }

    /// Releases `lease_id`'s hold on `key` if it has one: logs and announces it, then hands
    /// the lock to the next live waiter. `None` if the lease did not hold the key; otherwise
    /// the WAL position of the free record, or the error that kept it from being logged.
    fn free(
        self: &Arc<Self>,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
        reason: FreeReason,
    ) -> Option<Result<Lsn, wal::WalError>> {
        let mut events = Vec::new();
        let result = shard.release(now_ms, key, lease_id, &self.tokens, &mut events);
        let outcome = match result {
            table::Release::NotOwner => None,
            table::Release::Released { token, handoff } => {
                let lsn = self.log_free(key, token, reason);
                let kind = if reason == FreeReason::Expired {
                    EventKind::Expired
                } else {
                    EventKind::Released
                };
                self.watches.notify(key, kind, token, b"");
                if let Some(handoff) = handoff {
                    events.push(Event::HandedOff(handoff));
                }
                Some(lsn)
            }
        };
        self.apply_events(shard, now_ms, &mut events);
        outcome
    }

    /// Gives a lock to a waiter: log the grant, then send it. A waiter that vanished in
    /// between, or a grant that cannot be logged, frees the lock again for the next in line.
    fn hand_off(
        self: &Arc<Self>,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        handoff: Handoff<WaitSlot>,
    ) {
        let Handoff {
            waiter,
            grant,
            key,
            meta,
            ..
        } = handoff;
        let WaitSlot {
            tx,
            release_on_disconnect,
            received_ms,
        } = waiter;
        let logged = self.log_grant(&key, &grant, &meta, release_on_disconnect);
        let message = match &logged {
            Ok(lsn) => WaitResult::Granted {
                grant,
                lsn: *lsn,
                // The lease runs from `now_ms` (the table counts a hand-off's TTL from the
                // call that settled the key), so this is exactly the time in line.
                waited_ms: clamp_ms(now_ms.saturating_sub(received_ms)),
            },
            Err(e) => WaitResult::Failed(ErrorCode::Unavailable, format!("not durable: {e}")),
        };
        if tx.send(message).is_ok() && logged.is_ok() {
            Stats::bump(&self.stats.grants);
            Stats::bump(&self.stats.handoffs);
            self.watches
                .notify(&key, EventKind::Granted, grant.token, &meta);
            self.reserve_ahead();
            return;
        }
        // Nobody will ever hear of this grant: free it so the next waiter is not held up.
        self.free(shard, now_ms, &key, grant.lease_id, FreeReason::Released);
    }

    /// Takes back a change whose WAL record never became durable; its requester is told so.
    /// Returns whether the live state is now as if the change had never been made.
    pub fn undo(self: &Arc<Self>, undo: Undo) -> bool {
        let now_ms = self.clock.now_ms();
        match undo {
            Undo::Grant { key, lease_id } => {
                let mut shard = self.shard(&key);
                self.free(&mut shard, now_ms, &key, lease_id, FreeReason::Released);
                true
            }
            Undo::Release {
                key,
                lease_id,
                token,
                ttl_ms,
                meta,
            } => {
                let mut shard = self.shard(&key);
                // No grant can be made once the WAL failed, so the key is free unless a
                // waiter's hand-off from this very release is not yet taken back; then the
                // release stands here, and a restart brings the lease back.
                if let table::Inspect::Free = shard.inspect(now_ms, &key) {
                    shard.restore(now_ms, &key, lease_id, token, ttl_ms, &meta);
                    // Watchers were told of the release; they learn the lease is back.
                    self.watches.notify(&key, EventKind::Granted, token, &meta);
                    true
                } else {
                    tracing::warn!("a release that failed to log could not be undone: key is held");
                    false
                }
            }
        }
    }

    /// Acts on everything the table did on its own: expiries, hand-offs, waits that ran out.
    /// Every grant the table makes reaches the server through here or an `Acquire::Granted`.
    pub fn apply_events(
        self: &Arc<Self>,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        events: &mut Vec<Event<WaitSlot>>,
    ) {
        for event in std::mem::take(events) {
            match event {
                Event::Expired {
                    key,
                    token,
                    lease_id,
                    handoff,
                } => {
                    Stats::bump(&self.stats.expirations);
                    self.stats.metrics.expired(lease_id);
                    // Not waited for: an expiry lost in a crash comes back as a held lease
                    // whose TTL runs again, which is the safe direction.
                    let _ = self.log_free(&key, token, FreeReason::Expired);
                    self.watches.notify(&key, EventKind::Expired, token, b"");
                    if let Some(handoff) = handoff {
                        self.hand_off(shard, now_ms, handoff);
                    }
                }
                Event::HandedOff(handoff) => self.hand_off(shard, now_ms, handoff),
                Event::WaitTimedOut {
                    waiter,
                    holder_token,
                    ttl_left_ms,
                    ..
                } => {
                    Stats::bump(&self.stats.locked);
                    let _ = waiter.tx.send(WaitResult::TimedOut {
                        token: holder_token,
                        ttl_left_ms,
                    });
                }
            }
        }
    }

    /// Starts (or replaces) this connection's watch of `key` and answers with the key's state.
    ///
    /// Under the key's shard lock, so no change can fall between: the key is settled (a lease
    /// over by the clock ends now, with its event), events already queued for this connection
    /// are taken out to go before the reply, the state is read, and the watch registered.
    /// Every change after that is notified under the same lock, so it comes as an event after
    /// the reply; every change before it is in the state or in an event before the reply.
    fn watch(
        self: &Arc<Self>,
        ctx: &mut ConnCtx,
        now_ms: u64,
        request_id: u64,
        key: Bytes,
    ) -> Response {
        let max = self.config.watches_per_connection_max;
        if !ctx.watches.contains_key(&key) && ctx.watches.len() >= max {
            Stats::bump(&self.stats.errors);
            return error(
                ErrorCode::WatchLimit,
                format!("this connection already watches {max} keys"),
            );
        }
        let mut shard = self.shard(&key);
        let mut events = Vec::new();
        shard.settle_key(now_ms, &key, &self.tokens, &mut events);
        self.apply_events(&mut shard, now_ms, &mut events);
        if let Some(rx) = ctx.events.as_mut() {
            while let Ok(event) = rx.try_recv() {
                if ctx.watches.get(&event.key) == Some(&event.watch_id) {
                    ctx.drained.push(event);
                }
            }
        }
        let holder = match shard.inspect(now_ms, &key) {
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
        };
        let sink = ctx.sink.get_or_insert_with(|| {
            let (sink, rx) = WatchSink::new(self.config.watch_queue_max);
            ctx.events = Some(rx);
            sink
        });
        self.watches.add(key.clone(), ctx.conn_id, request_id, sink);
        drop(shard);
        ctx.watches.insert(key, request_id);
        Response::Watching { holder }
    }

    /// Drops everything a closing connection leaves behind: its watches, its queued
    /// acquires, and the leases it asked to have released on disconnect.
    pub fn disconnect(
        self: &Arc<Self>,
        ctx: &mut ConnCtx,
        waits: impl IntoIterator<Item = (Bytes, u64)>,
    ) {
        for (key, _) in ctx.watches.drain() {
            self.watches.remove(&key, ctx.conn_id);
        }
        self.cancel_waits(waits);
        let now_ms = self.clock.now_ms();
        for (key, lease_id) in ctx.owned.drain(..) {
            let mut shard = self.shard(&key);
            self.free(&mut shard, now_ms, &key, lease_id, FreeReason::Disconnected);
        }
    }

    /// Takes a closing connection's queued acquires out of their queues, shard by shard, at
    /// most `CANCELS_PER_LOCK_MAX` per hold of a shard's mutex, so a connection leaving with a
    /// hundred thousand waiters does not keep other requests out of a shard meanwhile.
    fn cancel_waits(&self, waits: impl IntoIterator<Item = (Bytes, u64)>) {
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

    /// Starts reserving the next block of tokens if fewer than half a block are left.
    pub fn reserve_ahead(self: &Arc<Self>) {
        if self.tokens.remaining() < self.config.token_block / 2
            && !self.reserving.load(Ordering::Relaxed)
        {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let me = Arc::clone(self);
                handle.spawn(async move { me.reserve_tokens().await });
            }
        }
    }

    /// Reserves the next block of fencing tokens: log the new limit, wait until it is synced,
    /// then let the allocator use it. Concurrent callers share one reservation.
    ///
    /// # Errors
    /// The WAL failure, if the reservation could not be made durable.
    pub async fn reserve_tokens(&self) -> Result<(), wal::WalError> {
        let notified = self.reserved.notified();
        if self.reserving.swap(true, Ordering::AcqRel) {
            notified.await;
            return Ok(());
        }
        let new_limit = self.tokens.limit() + self.config.token_block;
        let result = async {
            let lsn = self.wal.append(&Record::Reserve {
                token_limit: new_limit,
            })?;
            self.wal.wait_durable(lsn).await
        }
        .await;
        if result.is_ok() {
            self.tokens.extend_limit(new_limit);
        }
        self.reserving.store(false, Ordering::Release);
        self.reserved.notify_waiters();
        result
    }

    /// Held locks, waiters, connections, requests by kind and WAL counters.
    pub fn stats_pairs(&self) -> Vec<(String, u64)> {
        let held = self.quotas.held.count() as u64;
        let waiters = self.quotas.waiters.count() as u64;
        let mut table_bytes = 0u64;
        for shard in self.shards() {
            table_bytes += shard.lock().expect("shard poisoned").memory_bytes() as u64;
        }
        let s = &self.stats;
        let wal = self.wal.stats();
        let mut pairs = vec![
            ("held".to_string(), held),
            ("waiters".to_string(), waiters),
            ("connections".to_string(), Stats::get(&s.connections)),
            ("watches".to_string(), self.watches.len() as u64),
            ("grants".to_string(), Stats::get(&s.grants)),
            ("handoffs".to_string(), Stats::get(&s.handoffs)),
            ("locked".to_string(), Stats::get(&s.locked)),
            ("expirations".to_string(), Stats::get(&s.expirations)),
            ("errors".to_string(), Stats::get(&s.errors)),
            (
                "connections_total".to_string(),
                Stats::get(&s.connections_total),
            ),
            (
                "connections_refused".to_string(),
                Stats::get(&s.connections_refused),
            ),
            ("token_next".to_string(), self.tokens.next_token()),
            ("token_limit".to_string(), self.tokens.limit()),
            ("wal_records".to_string(), wal.records),
            ("wal_fsyncs".to_string(), wal.fsyncs),
            ("wal_bytes".to_string(), wal.bytes),
            ("table_bytes".to_string(), table_bytes),
            ("uptime_ms".to_string(), self.clock.now_ms()),
        ];
        pairs.extend(s.op_pairs());
        pairs
    }

    /// The WAL's durable position and failure, for connections to wait on.
    pub fn durable(&self) -> watch::Receiver<DurableState> {
        self.wal.subscribe()
    }
}
