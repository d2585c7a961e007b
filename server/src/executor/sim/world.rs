//! The simulated world: one executor over a [`MemJournal`], the connections talking to it,
//! the disk it restarts from, and the steps that drive them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::{rngs::StdRng, Rng, SeedableRng};
use tenure_protocol::{AcquireId, ErrorCode, LeaseId, LeaseKind, Request, Response};
use tokio::sync::oneshot;
use tokio::time::Instant;

mod replies;
mod session_leases;

use super::disk::Disk;
use super::model::{Model, CLIENT_SLACK_MS};
use crate::clock::Clock;
use crate::config::Config;
use crate::executor::Session;
use crate::executor::Undo;
use crate::executor::WaitResult;
use crate::executor::{Executor, ExecutorParts, Outcome};
use crate::journal::mem::MemJournal;
use crate::journal::{Journal, Ticket, TICKET_NOW};

/// Simulated connections (clients).
const CONNS: usize = 5;
/// The key space: few keys, so requests collide.
const KEYS: [&[u8]; 5] = [
    b"a",
    b"b",
    b"c",
    b"a-key-longer-than-the-inline-limit",
    b"s",
];
/// Keys acquired now and then as read leases (else exclusively: their write side): a plain
/// lock on them turns into a read/write key when a reader comes.
const READ_WRITE_KEYS: [&[u8]; 2] = [b"a", b"b"];
/// The semaphore key, and its number of permits.
const SEMAPHORE_KEY: &[u8] = b"s";
const SEMAPHORE_LIMIT: u32 = 2;
/// Tokens per reservation: small, so reservations (and the restart margin) happen often.
const TOKEN_BLOCK: u64 = 16;
/// Most expiries per shard per tick, as the ticker's budget.
const EXPIRATIONS_PER_TICK_MAX: usize = 4;
/// Chance per step of a fault: a journal failure or a restart.
const FAULT_CHANCE: f64 = 0.02;
/// Shards of the executor's table.
const SHARDS: usize = 3;
/// Acquire ids the clients remember, to send again as retries.
const ACQUIRE_IDS_KEPT: usize = 16;

/// Counts of what a run exercised: each must happen somewhere in the default run, or the
/// simulation checks less than it claims.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Coverage {
    /// Grants acknowledged.
    pub grants: usize,
    /// Grants that came by hand-off.
    pub handoffs: usize,
    /// Restarts from the journal.
    pub restarts: usize,
    /// Renewals whose reply waited for the journal (a longer TTL than the lease's record).
    pub renewals_logged: usize,
    /// Changes answered "nothing changed" after a journal failure caught them (undone).
    pub undone: usize,
    /// Acquires refused "nothing changed" at once.
    pub refused: usize,
    /// Repeats of an ACQUIRE answered with its lease (REGRANTED).
    pub regranted: usize,
    /// Of those, repeats of a read lease or a permit lease.
    pub regranted_shared: usize,
    /// Repeats of an ACQUIRE answered with how its lease ended (ACQUIRE_ENDED).
    pub ended: usize,
    /// Sessions whose open was acknowledged.
    pub sessions_opened: usize,
    /// Session leases found back in their session after a restart.
    pub session_leases_back: usize,
}

impl Coverage {
    /// Adds `other`'s counts.
    pub fn add(&mut self, other: Coverage) {
        self.grants += other.grants;
        self.handoffs += other.handoffs;
        self.restarts += other.restarts;
        self.renewals_logged += other.renewals_logged;
        self.undone += other.undone;
        self.refused += other.refused;
        self.regranted += other.regranted;
        self.regranted_shared += other.regranted_shared;
        self.ended += other.ended;
        self.sessions_opened += other.sessions_opened;
        self.session_leases_back += other.session_leases_back;
    }

    /// Panics unless every count is above zero.
    pub fn check_all_seen(&self) {
        let Coverage {
            grants,
            handoffs,
            restarts,
            renewals_logged,
            undone,
            refused,
            regranted,
            regranted_shared,
            ended,
            sessions_opened,
            session_leases_back,
        } = *self;
        for (what, count) in [
            ("grants", grants),
            ("hand-offs", handoffs),
            ("restarts", restarts),
            ("renewals answered once durable", renewals_logged),
            ("undone changes", undone),
            ("refused acquires", refused),
            ("repeats answered with their lease", regranted),
            (
                "repeats of read or permit leases regranted",
                regranted_shared,
            ),
            ("repeats answered with their lease's end", ended),
            ("sessions opened", sessions_opened),
            ("session leases back after a restart", session_leases_back),
        ] {
            assert!(count > 0, "the simulation never exercised {what}: {self:?}");
        }
    }
}

/// A request a connection sent and has no answer to yet.
struct Pending {
    key: Bytes,
    /// What was asked.
    asked: Asked,
    /// An ACQUIRE's release-on-disconnect flag.
    release_on_disconnect: bool,
    /// An ACQUIRE's acquire id.
    acquire_id: Option<AcquireId>,
    /// An ACQUIRE's kind.
    kind: LeaseKind,
    /// Sim time it was sent at, and the step.
    sent_ms: u64,
    sent_step: u64,
    state: Waiting,
}

/// The request a [`Pending`] answers.
#[derive(Clone, Copy, Debug)]
enum Asked {
    Acquire,
    /// RELEASE of this lease.
    Release(LeaseId),
    /// RENEW of this lease.
    Renew(LeaseId),
}

/// What a pending request waits for. (Its variants differ in size: a few dozen of them live
/// at a time in the simulation, so boxing one would buy nothing.)
#[allow(clippy::large_enum_variant)]
enum Waiting {
    /// A queued acquire: its place in line (`order`) and its wait's end on the executor's
    /// clock.
    InLine {
        rx: oneshot::Receiver<WaitResult>,
        order: u64,
        wait_end_ms: u64,
    },
    /// A reply held back until `ticket` is durable.
    Durable {
        response: Response,
        ticket: Ticket,
        undo: Option<Undo>,
    },
}

/// One simulated connection.
struct Conn {
    ctx: Session,
    next_id: u64,
    pending: Vec<Pending>,
}

/// See the module docs of [`super`].
pub(super) struct World {
    rng: StdRng,
    step: u64,
    /// Sim time zero.
    origin: Instant,
    config: Config,
    journal: Arc<MemJournal>,
    exec: Arc<Executor>,
    disk: Disk,
    conns: Vec<Conn>,
    model: Model,
    /// Counts places in line, over all keys, to check hand-offs are FIFO.
    queued: u64,
    next_conn_id: u64,
    /// What happened, to check that the run exercised it.
    coverage: Coverage,
    /// Acquire ids sent, with their key, newest last, to send again as retries.
    acquire_ids: Vec<(Bytes, AcquireId, LeaseKind)>,
    /// Sessions as their clients know them.
    known_sessions: Vec<session_leases::Known>,
}

impl World {
    pub async fn new(seed: u64) -> World {
        let mut config = Config::for_tests(std::path::Path::new("/nonexistent"));
        config.shards = SHARDS;
        config.token_block = TOKEN_BLOCK;
        let journal = MemJournal::new(true);
        let exec = start_executor(&config, &journal, 1).await;
        let mut world = World {
            rng: StdRng::seed_from_u64(seed),
            step: 0,
            origin: Instant::now(),
            config,
            journal,
            exec,
            disk: Disk::new(),
            conns: Vec::new(),
            model: Model::default(),
            queued: 0,
            next_conn_id: 0,
            coverage: Coverage::default(),
            acquire_ids: Vec::new(),
            known_sessions: Vec::new(),
        };
        for _ in 0..CONNS {
            let conn = world.new_conn();
            world.conns.push(conn);
        }
        world
    }

    /// Sim time, in ms since the start.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).expect("short run")
    }

    fn new_conn(&mut self) -> Conn {
        self.next_conn_id += 1;
        Conn {
            ctx: Session::new(self.next_conn_id),
            next_id: 1,
            pending: Vec::new(),
        }
    }

    /// One random action, then what follows from it, then every invariant.
    pub async fn step(&mut self) {
        self.step += 1;
        let c = self.rng.random_range(0..CONNS);
        match self.rng.random_range(0..100) {
            0..18 => self.acquire(c, false).await,
            18..32 => self.acquire(c, true).await,
            32..42 => self.renew(c),
            42..52 => self.release(c),
            52..60 => self.inspect_and_check(c),
            60..62 => self.disconnect(c),
            62..78 => self.advance(1..60).await,
            78..81 => self.advance(100..700).await,
            81..89 => self.journal.make_durable(),
            89..97 => self.make_some_durable(),
            _ => self.session_step().await,
        }
        if self.failed() || self.rng.random_bool(FAULT_CHANCE) {
            self.fault().await;
        }
        // Token reservations run as spawned tasks; let them.
        tokio::task::yield_now().await;
        self.tick();
        self.poll();
        self.check();
    }

    /// What the seed exercised.
    pub fn finish(&self) -> Coverage {
        let mut coverage = self.coverage;
        coverage.grants = self.model.acked.values().map(Vec::len).sum();
        coverage
    }

    fn key(&mut self) -> Bytes {
        Bytes::from_static(KEYS[self.rng.random_range(0..KEYS.len())])
    }

    /// What an ACQUIRE of `key` asks for: permits of the semaphore key, a read lease now and
    /// then on a read/write key, else the key alone.
    fn kind_for(&mut self, key: &[u8]) -> LeaseKind {
        if key == SEMAPHORE_KEY {
            let count = self.rng.random_range(1..=SEMAPHORE_LIMIT);
            return LeaseKind::Permits {
                count,
                limit: SEMAPHORE_LIMIT,
            };
        }
        if READ_WRITE_KEYS.contains(&key) && self.rng.random_bool(0.5) {
            return LeaseKind::Shared;
        }
        LeaseKind::Exclusive
    }

    fn ttl_ms(&mut self) -> u32 {
        self.rng.random_range(100..=500)
    }

    /// Runs `request` on connection `c`, reserving tokens when the executor asks to.
    async fn execute(&mut self, c: usize, request: Request) -> Outcome {
        let conn = &mut self.conns[c];
        let id = conn.next_id;
        conn.next_id += 1;
        let mut outcome = self.exec.execute(&mut conn.ctx, id, request);
        while let Outcome::NeedTokens {
            request,
            received_ms,
        } = outcome
        {
            if let Err(e) = self.exec.tokens.reserve().await {
                let message = format!("could not reserve fencing tokens: {e}");
                let code = ErrorCode::Unavailable;
                return Outcome::Reply(Response::Error { code, message }, TICKET_NOW);
            }
            let conn = &mut self.conns[c];
            outcome = self
                .exec
                .execute_again(&mut conn.ctx, id, request, received_ms);
        }
        outcome
    }

    /// The token holding `key` as INSPECT tells it, or `None` if free.
    fn holder_token(&mut self, key: &Bytes) -> Option<u64> {
        let mut ctx = Session::new(0);
        let request = Request::Inspect {
            key: key.clone(),
            kinds: Default::default(),
        };
        match self.exec.execute(&mut ctx, 0, request) {
            Outcome::Reply(Response::Held { token, .. }, _) => Some(token),
            Outcome::Reply(Response::Free, _) => None,
            _ => panic!("INSPECT answers HELD or FREE at once"),
        }
    }

    /// An acquire id for the next ACQUIRE on `key`, and its kind: none, a new one, or now
    /// and then one sent before (a retry of it, on its own key, of the same kind: a client
    /// sends the same ACQUIRE again).
    fn acquire_id(&mut self, key: &mut Bytes) -> (Option<AcquireId>, LeaseKind) {
        match self.rng.random_range(0..10) {
            0..3 => {
                let id = AcquireId::from_u128(self.rng.random());
                let kind = self.kind_for(key);
                if self.acquire_ids.len() == ACQUIRE_IDS_KEPT {
                    self.acquire_ids.remove(0);
                }
                self.acquire_ids.push((key.clone(), id, kind));
                (Some(id), kind)
            }
            3..6 if !self.acquire_ids.is_empty() => {
                let i = self.rng.random_range(0..self.acquire_ids.len());
                let (retry_key, id, kind) = self.acquire_ids[i].clone();
                *key = retry_key;
                (Some(id), kind)
            }
            _ => (None, self.kind_for(key)),
        }
    }

    /// The tokens of every unexpired lease on `key` (several on a read/write or semaphore
    /// key), read from the table directly.
    fn holder_tokens(&self, key: &[u8]) -> Vec<u64> {
        let now_ms = self.exec.clock.now_ms();
        let mut tokens = Vec::new();
        self.exec.shard(key).for_each_held(now_ms, |held| {
            if held.key == key {
                tokens.push(held.token);
            }
        });
        tokens
    }

    async fn acquire(&mut self, c: usize, blocking: bool) {
        let mut key = self.key();
        let (acquire_id, kind) = self.acquire_id(&mut key);
        let ttl_ms = self.ttl_ms();
        let wait_ms = if blocking {
            self.rng.random_range(50..=800)
        } else {
            0
        };
        let release_on_disconnect = self.rng.random_bool(0.5);
        let request = Request::Acquire {
            key: key.clone(),
            ttl_ms,
            wait_ms,
            release_on_disconnect,
            meta: Bytes::from_static(b"sim"),
            acquire_id,
            kind,
            session_id: None,
        };
        let before = self.holder_token(&key);
        let holders_before = self.holder_tokens(&key);
        let sent_ms = self.now_ms();
        let outcome = self.execute(c, request).await;
        let state = match outcome {
            Outcome::Wait {
                rx,
                key: waited_key,
                waiter_id,
                ..
            } => {
                self.conns[c]
                    .ctx
                    .add_wait(self.step, waited_key, waiter_id, None);
                self.queued += 1;
                Waiting::InLine {
                    rx,
                    order: self.queued,
                    wait_end_ms: self.exec.clock.now_ms() + u64::from(wait_ms),
                }
            }
            outcome => reply_of(outcome),
        };
        if let (Some(id), Waiting::Durable { response, .. }) = (acquire_id, &state) {
            self.model.check_repeat(&key, id, &holders_before, response);
        }
        if let Waiting::Durable {
            response,
            ticket: TICKET_NOW,
            ..
        } = &state
        {
            if is_nothing_changed(response) {
                self.coverage.refused += 1;
                assert_eq!(self.holder_token(&key), before, "a refused acquire changed");
            }
        }
        let pending = Pending {
            key,
            asked: Asked::Acquire,
            release_on_disconnect,
            acquire_id,
            kind,
            sent_ms,
            sent_step: self.step,
            state,
        };
        self.answer_or_hold(c, pending);
    }

    /// A lease some client believes it holds, to renew or release from whichever
    /// connection (a lease belongs to its id, not to a connection), or now and then a lease
    /// id that holds nothing.
    fn pick_lease(&mut self) -> (Bytes, LeaseId) {
        let beliefs = &self.model.beliefs;
        if beliefs.is_empty() || self.rng.random_bool(0.15) {
            let wrong = LeaseId::from_u128(self.rng.random());
            return (self.key(), wrong);
        }
        let belief = &beliefs[self.rng.random_range(0..beliefs.len())];
        (Bytes::copy_from_slice(&belief.key), belief.lease_id)
    }

    /// A RENEW to any TTL in range, longer or shorter than the lease's grant, from any
    /// connection, also while other renewals of the lease wait for their answers.
    fn renew(&mut self, c: usize) {
        let (key, lease_id) = self.pick_lease();
        let ttl_ms = self.ttl_ms();
        let request = Request::Renew {
            key: key.clone(),
            lease_id,
            ttl_ms,
        };
        let sent_ms = self.now_ms();
        let deadline_ms = sent_ms + u64::from(ttl_ms) - CLIENT_SLACK_MS;
        self.model.renewal_sent(lease_id, self.step, deadline_ms);
        let outcome = {
            let conn = &mut self.conns[c];
            self.exec.execute(&mut conn.ctx, 0, request)
        };
        let state = reply_of(outcome);
        if let Waiting::Durable { ticket, .. } = &state {
            if *ticket != TICKET_NOW {
                self.coverage.renewals_logged += 1;
            }
        }
        let pending = Pending {
            key,
            asked: Asked::Renew(lease_id),
            kind: LeaseKind::Exclusive,
            release_on_disconnect: false,
            acquire_id: None,
            sent_ms,
            sent_step: self.step,
            state,
        };
        self.answer_or_hold(c, pending);
    }

    fn release(&mut self, c: usize) {
        let (key, lease_id) = self.pick_lease();
        // The client stops acting as holder the moment it sends RELEASE.
        self.model.drop_belief(lease_id);
        let request = Request::Release {
            key: key.clone(),
            lease_id,
        };
        let before = self.holder_token(&key);
        let sent_ms = self.now_ms();
        let outcome = {
            let conn = &mut self.conns[c];
            self.exec.execute(&mut conn.ctx, 0, request)
        };
        let state = reply_of(outcome);
        if let Waiting::Durable {
            response,
            ticket: TICKET_NOW,
            ..
        } = &state
        {
            if is_nothing_changed(response) {
                self.coverage.refused += 1;
                assert_eq!(self.holder_token(&key), before, "a refused release changed");
            }
        }
        let pending = Pending {
            key,
            asked: Asked::Release(lease_id),
            kind: LeaseKind::Exclusive,
            release_on_disconnect: false,
            acquire_id: None,
            sent_ms,
            sent_step: self.step,
            state,
        };
        self.answer_or_hold(c, pending);
    }

    /// Answers `pending` now if its reply waits for nothing, else holds it until it does.
    fn answer_or_hold(&mut self, c: usize, pending: Pending) {
        if let Waiting::Durable {
            ticket: TICKET_NOW, ..
        } = pending.state
        {
            self.answered(c, pending);
        } else {
            self.conns[c].pending.push(pending);
        }
    }
}

impl World {
    fn inspect_and_check(&mut self, c: usize) {
        let key = self.key();
        let token = self.holder_token(&key);
        let now_ms = self.now_ms();
        let Some(belief) = self.model.belief_on(&key).cloned() else {
            return;
        };
        if belief.deadline_ms <= now_ms + CLIENT_SLACK_MS {
            return; // at the edge: the server may have ended it a moment sooner
        }
        if belief.kind.is_exclusive() {
            assert_eq!(
                token,
                Some(belief.token),
                "a believed lease is not the holder"
            );
        } else {
            // Several hold: INSPECT names the newest, at or above this one.
            assert!(
                token >= Some(belief.token),
                "a believed reader's key is free"
            );
        }
        let request = Request::Check {
            key,
            token: belief.token,
        };
        let conn = &mut self.conns[c];
        let outcome = self.exec.execute(&mut conn.ctx, 0, request);
        assert!(
            matches!(outcome, Outcome::Reply(Response::Current, _)),
            "a believed lease's token is not CURRENT"
        );
    }

    /// Closes connection `c` (its release-on-disconnect leases are freed, its waiters
    /// leave) and opens a new one in its place; the client forgets its leases.
    fn disconnect(&mut self, c: usize) {
        let mut conn = self.new_conn();
        std::mem::swap(&mut conn, &mut self.conns[c]);
        conn.ctx.disconnect(&self.exec);
        let released: Vec<(Bytes, u64)> = (self.model.beliefs.iter())
            .filter(|b| b.client == c && b.release_on_disconnect)
            .map(|b| (Bytes::copy_from_slice(&b.key), b.token))
            .collect();
        for (key, token) in released {
            let holder = self.holder_token(&key);
            assert_ne!(
                holder,
                Some(token),
                "a release-on-disconnect lease outlived its conn"
            );
        }
        self.model.drop_client(c);
    }

    async fn advance(&mut self, range_ms: std::ops::Range<u64>) {
        let ms = self.rng.random_range(range_ms);
        tokio::time::advance(Duration::from_millis(ms)).await;
    }

    /// Makes a prefix of what is not yet durable durable: a restart then loses the rest.
    fn make_some_durable(&mut self) {
        let durable = self.journal.progress().borrow().lsn;
        let last = self.journal.last_ticket();
        if last > durable {
            let to = self.rng.random_range(durable..=last);
            self.journal.make_durable_to(to);
        }
    }

    /// A journal failure or a restart; a failed journal is restarted soon after, as an
    /// operator would, but not before a few requests were refused.
    async fn fault(&mut self) {
        if self.failed() {
            if self.rng.random_bool(0.1) {
                self.restart().await;
            }
        } else if self.rng.random_bool(0.3) {
            self.journal.fail("injected by the simulation");
        } else if self.rng.random_bool(0.5) {
            self.restart().await;
        }
    }

    fn failed(&self) -> bool {
        self.journal.progress().borrow().failed.is_some()
    }

    /// The ticker's pass: expiries and waits that ran out, bounded per shard.
    fn tick(&mut self) {
        let now_ms = self.exec.clock.now_ms();
        let mut events = Vec::new();
        for shard in self.exec.shards() {
            let mut shard = shard.lock().expect("shard poisoned");
            shard.advance(
                now_ms,
                EXPIRATIONS_PER_TICK_MAX,
                &self.exec.tokens.allocator,
                &mut events,
            );
            self.exec.apply_events(&mut shard, now_ms, &mut events);
        }
    }

    /// The server restarts from what was durable: every connection is gone, the clients
    /// keep what they were told and go on.
    async fn restart(&mut self) {
        self.coverage.restarts += 1;
        self.disk.keep_durable(&self.journal);
        let recovered = self.disk.recover(self.config.token_block);
        let now_ms = self.now_ms();
        self.model.check_exclusion(now_ms);
        for belief in &self.model.beliefs {
            let back = recovered
                .leases
                .iter()
                .find(|l| l.key == belief.key && l.lease_id == belief.lease_id);
            assert!(
                back.is_some_and(|l| l.lease_id == belief.lease_id && l.token == belief.token),
                "an acknowledged lease did not come back: {belief:?}, found {back:?}"
            );
        }
        for lease in &recovered.leases {
            assert!(
                !self.model.released.contains(&lease.lease_id),
                "a lease acknowledged as released came back: {lease:?}"
            );
            assert!(
                !self.model.refused.contains(&lease.lease_id),
                "a grant answered 'nothing changed' came back: {lease:?}"
            );
        }
        let token_max = self.model.token_max();
        assert!(
            recovered.token_floor > token_max,
            "token floor {} after a restart, yet token {token_max} was granted",
            recovered.token_floor
        );
        self.model.token_before_restart = token_max;
        let crash_ms = self.exec.clock.now_ms();
        self.journal = MemJournal::new(true);
        self.exec = start_executor(&self.config, &self.journal, recovered.token_floor).await;
        // As WAL recovery and a new leader do: sessions first, so their leases join them.
        let exec_now_ms = self.exec.clock.now_ms();
        self.exec.restore_sessions(exec_now_ms, recovered.sessions);
        self.exec.restore(exec_now_ms, recovered.leases);
        self.check_sessions_after_restart(crash_ms, exec_now_ms);
        for c in 0..CONNS {
            self.conns[c] = self.new_conn();
        }
        // Their connections are gone: such leases came back as ordinary ones.
        for belief in &mut self.model.beliefs {
            belief.release_on_disconnect = false;
        }
    }

    /// Every invariant that must hold between steps.
    fn check(&mut self) {
        for shard in self.exec.shards() {
            shard.lock().expect("shard poisoned").check_invariants();
        }
        let now_ms = self.now_ms();
        self.model.check_exclusion(now_ms);
    }
}

/// The reply of an outcome that is one (not a wait), and what it waits for.
fn reply_of(outcome: Outcome) -> Waiting {
    match outcome {
        Outcome::Reply(response, ticket) => Waiting::Durable {
            response,
            ticket,
            undo: None,
        },
        Outcome::Changed {
            response,
            ticket,
            undo,
        } => Waiting::Durable {
            response,
            ticket,
            undo: Some(undo),
        },
        Outcome::Wait { .. } => panic!("only ACQUIRE waits in line"),
        Outcome::NeedTokens { .. } => unreachable!("World::execute reserves tokens"),
    }
}

/// Whether `response` says the change was refused and nothing changed.
fn is_nothing_changed(response: &Response) -> bool {
    matches!(
        response,
        Response::Error { code: ErrorCode::Unavailable, message } if message.contains("nothing changed")
    )
}

async fn start_executor(config: &Config, journal: &Arc<MemJournal>, floor: u64) -> Arc<Executor> {
    let journal = Arc::clone(journal) as Arc<dyn Journal>;
    let exec = Arc::new(Executor::new(ExecutorParts::new(
        config.clone(),
        Clock::start(),
        journal,
        floor,
    )));
    exec.tokens.reserve().await.expect("first reservation");
    exec
}
