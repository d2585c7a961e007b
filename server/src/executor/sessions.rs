//! Sessions (PROTOCOL.md 3.11): one keep-alive for many leases, whose end frees them all.
//!
//! A session lease is an ordinary lease of the table whose deadline is kept equal to its
//! session's: it is granted for the session's time left, and a keep-alive renews every lease
//! of the session to the session's TTL at the same `now` the session's own deadline moves
//! to. So the table's expiry ends a session's leases exactly at the session's deadline (each
//! key handed to its next waiter, with an expired event), INSPECT shows the session's time
//! left, and nothing on the plain-lock path changes. The cost is one table renewal per lease
//! per keep-alive, under the session table's lock (held across the renewals, so a grant in
//! the session cannot slip between a keep-alive's deadline and its renewals).
//!
//! # What a session lease costs here
//!
//! Memory is most of what a held lock costs (issue 25's goal: under 100 bytes RSS per held
//! lock, sessions included), so a session lease is kept in two compact places and nowhere else:
//!
//! ```text
//!   by_lease: HashMap<LeaseId, u32>     the session's number; 20 bytes and a control byte
//!   Entry::leases: Vec<Kept>            lease id + key length + the key inline: 40 bytes
//!   Entry::live: usize                  the session's leases still held, exact
//! ```
//!
//! where there were a map per session (lease id to a `Bytes`, 48 bytes and a control byte),
//! a heap copy of the key, and `by_lease` naming the session by its 16-byte id. The session's
//! number indexes `numbers` (freed and reused at the session's end, when every lease of it
//! left `by_lease`). A RELEASE of a session lease removes it from `by_lease` and counts it
//! off its session at once, but leaves its list entry: finding it would search the list.
//! The list is pruned (every entry `by_lease` no longer gives to the session goes) at each
//! keep-alive, which reads the list anyway; when it is full (its capacity) with an eighth or
//! more of it ended, instead of growing; and once it holds twice its live leases and
//! `PRUNED_SLACK` more. So a session that churns its leases keeps a list about its size, and
//! a prune (it reads the list) costs O(1) a lease attached or released over time. `--session-leases-max`, STATS and the limits read the exact counts, never the list.
//! A key longer than a slot's inline key (the load generator's are shorter) is kept, as one
//! copy, in `long_keys`. The table is not searched by lease: the session keeps each key,
//! so keep-alive renewals, close and expiry call the table by key as any request does.
//!
//! Lock order: the session table, then a shard; never the other way round.
//!
//! [`SessionTable`] is the bookkeeping, with `now` as an argument; the `impl Executor` below
//! runs the requests on it.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tenure_protocol::{AcquireId, EndedHow, ErrorCode, LeaseId, Request, Response, SessionId};

use super::{clamp_ms, error, Executor, Outcome, Session, Undo, WaitResult};
use crate::journal::{Change, Journal, JournalError, Ticket, TICKET_NOW};
use crate::obs::stats::Stats;
use crate::record::{FreeReason, RecoveredLease, RecoveredSession, SessionEnd};
use crate::table;

/// Most live sessions opened on one connection (PROTOCOL.md 3.11), so one connection cannot
/// take the server's whole `--sessions-max`.
pub const SESSIONS_PER_CONNECTION_MAX: u32 = 64;
/// The connection a session restored from the journal counts against: none (a restart or a
/// fail-over closed every connection). Real connection ids count up from 1.
const RESTORED_CONN_ID: u64 = u64::MAX;

/// Most ended sessions the ticker forgets per pass, so an expiry storm cannot starve requests.
pub const SESSION_REAPS_PER_TICK_MAX: usize = 1024;
const _: () = assert!(SESSION_REAPS_PER_TICK_MAX > 0);

/// How long an ended session's id is remembered (in memory only): a SESSION_OPEN naming it
/// meanwhile hears that it ended, where it would open the id again, empty, for a TTL. Such an
/// open is a late resend of the one that opened the session (say from a slow connection its
/// client gave up on): the clients resend for 15 s by default, so ten minutes is ample.
pub const SESSION_ENDED_KEEP_MS: u64 = 600_000;
/// Most ended session ids remembered at once (about 50 bytes each); the oldest go first.
pub const SESSIONS_ENDED_MAX: usize = 16_384;
const _: () = assert!(SESSIONS_ENDED_MAX > 0);

/// Longest key a session's list keeps beside its lease id, as the table keeps one in its
/// slot (`table::slot`): the load generator's keys fit. A longer key is in
/// `SessionTable::long_keys`.
const SESSION_KEY_INLINE_MAX: usize = 23;
/// `Kept::key_len` of a key in `SessionTable::long_keys`.
const KEY_LONG: u8 = u8::MAX;
const _: () = assert!(SESSION_KEY_INLINE_MAX < KEY_LONG as usize);
/// A session's list is pruned once it holds twice its live leases and this many more, so a
/// session that churns leases prunes about once per this many releases at the least.
const PRUNED_SLACK: usize = 16;
const _: () = assert!(PRUNED_SLACK > 0);

/// A lease as its session's list keeps it: 40 bytes with its key, and no allocation for a
/// key of up to `SESSION_KEY_INLINE_MAX` bytes.
#[derive(Clone, Copy, Debug)]
struct Kept {
    /// The lease.
    lease_id: LeaseId,
    /// The key's length, or `KEY_LONG`.
    key_len: u8,
    /// A key of up to `SESSION_KEY_INLINE_MAX` bytes, zero-padded.
    key_inline: [u8; SESSION_KEY_INLINE_MAX],
}
const _: () = assert!(size_of::<Kept>() == 40);

/// A session lease's key as the session table hands it out: a copy of a short key, or the
/// table's copy of a long one. It reads as the key's bytes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LeaseKey {
    /// A key of up to `SESSION_KEY_INLINE_MAX` bytes: its length and the bytes.
    Inline(u8, [u8; SESSION_KEY_INLINE_MAX]),
    /// A longer key.
    Long(Bytes),
}

impl std::ops::Deref for LeaseKey {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            LeaseKey::Inline(len, bytes) => &bytes[..usize::from(*len)],
            LeaseKey::Long(key) => key,
        }
    }
}

/// One live session.
#[derive(Debug)]
struct Entry {
    /// Its TTL, fixed at SESSION_OPEN.
    ttl_ms: u32,
    /// The journal ticket of its opening record ([`TICKET_NOW`] if restored): a repeat of
    /// its SESSION_OPEN is answered once that is durable, as the first send is.
    open_ticket: Ticket,
    /// When it ends unless kept alive, in the executor's clock.
    deadline_ms: u64,
    /// `deadline_ms` as its waiters see it (0 once the session ended): their slots hold it,
    /// so the table, under a shard's lock, never hands a key to a waiter of an ended session.
    deadline_cell: Arc<AtomicU64>,
    /// The identity that opened it (`None` without identities): only it may use the session.
    owner: Option<String>,
    /// The connection that opened it, counted against [`SESSIONS_PER_CONNECTION_MAX`].
    conn_id: u64,
    /// Its number in [`SessionTable::numbers`], which `by_lease` names it by.
    no: u32,
    /// Its leases, in the order they joined, with their keys; a lease that ended on its own
    /// (RELEASE, a grant taken back) stays here until the list is pruned
    /// ([`SessionTable::prune`]), so a RELEASE does not search the list.
    leases: Vec<Kept>,
    /// Its leases still held: exactly the entries of `leases` that `by_lease` gives to it.
    live: usize,
    /// Its ACQUIREs waiting in line: (key, the table's waiter id), unique per shard. Its
    /// end takes each out of its queue; they count against `--session-leases-max`.
    waiters: HashSet<(Bytes, u64)>,
}

impl Entry {
    /// Drops the list's leases that `by_lease` no longer gives to this session.
    fn prune(&mut self, by_lease: &HashMap<LeaseId, u32>) {
        let no = self.no;
        self.leases
            .retain(|kept| by_lease.get(&kept.lease_id) == Some(&no));
        // A list that shrank a lot gives its memory back (a session that held many once).
        if self.leases.capacity() > 4 * self.leases.len() + PRUNED_SLACK {
            self.leases.shrink_to(2 * self.leases.len());
        }
        assert_eq!(
            self.leases.len(),
            self.live,
            "a session miscounted its leases"
        );
    }

    fn new(no: u32, ttl_ms: u32, deadline_ms: u64, owner: Option<String>, conn_id: u64) -> Entry {
        Entry {
            no,
            ttl_ms,
            open_ticket: TICKET_NOW,
            deadline_ms,
            deadline_cell: Arc::new(AtomicU64::new(deadline_ms)),
            owner,
            conn_id,
            leases: Vec::new(),
            live: 0,
            waiters: HashSet::new(),
        }
    }
}

/// Every live session, by id, with their deadlines in order and which session each session
/// lease belongs to.
#[derive(Debug)]
pub struct SessionTable {
    /// Most live sessions (`--sessions-max`).
    sessions_max: usize,
    /// Most leases per session (`--session-leases-max`).
    leases_max: usize,
    by_id: HashMap<SessionId, Entry>,
    deadlines: BTreeSet<(u64, SessionId)>,
    /// The number of the session each session lease is in (its `Entry::no`).
    by_lease: HashMap<LeaseId, u32>,
    /// Each session number's session, `None` while the number is free.
    numbers: Vec<Option<SessionId>>,
    /// Numbers of `numbers` free for the next session.
    numbers_free: Vec<u32>,
    /// The keys of session leases too long for [`Kept`], by lease id.
    long_keys: HashMap<LeaseId, Bytes>,
    /// Live sessions by the connection that opened them.
    by_conn: HashMap<u64, u32>,
    /// Live sessions by the identity that opened them, for its `sessions-max`.
    by_owner: HashMap<String, usize>,
    /// Ended sessions (closed or expired) by id, with when they ended: for at most
    /// [`SESSION_ENDED_KEEP_MS`], and the newest [`SESSIONS_ENDED_MAX`].
    ended: HashMap<SessionId, u64>,
    /// `ended` oldest first (an id that ended again since has a later entry too).
    ended_order: VecDeque<(u64, SessionId)>,
}

/// Why a session request was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The id names no live session (of this identity).
    NoSession,
    /// The session ends in this many ms, less than a lease's shortest TTL: it takes no new
    /// lease (answered `NO_SESSION`, as it is all but ended).
    Ending(u64),
    /// As many sessions are live as the server allows.
    SessionsFull,
    /// This connection opened as many live sessions as one may.
    ConnectionFull,
    /// The identity has as many live sessions as its `sessions-max`, this many.
    IdentityFull(usize),
    /// The session holds as many leases as it may.
    LeasesFull,
    /// A SESSION_OPEN named the id of a session another identity opened, or one opened with
    /// another TTL (this one): not a repeat of the open that made it.
    NotTheOpen(Option<u32>),
}

/// What a SESSION_OPEN naming a session id finds ([`SessionTable::find_open`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Reopen {
    /// No session has the id: open it.
    Absent,
    /// A repeat: the session its first send opened is live, with this TTL, opened by the
    /// record of this ticket.
    Repeat(u32, Ticket),
}

impl SessionTable {
    /// An empty table with these limits.
    pub fn new(sessions_max: usize, leases_max: usize) -> SessionTable {
        SessionTable {
            sessions_max,
            leases_max,
            by_id: HashMap::new(),
            deadlines: BTreeSet::new(),
            by_lease: HashMap::new(),
            numbers: Vec::new(),
            numbers_free: Vec::new(),
            long_keys: HashMap::new(),
            by_conn: HashMap::new(),
            by_owner: HashMap::new(),
            ended: HashMap::new(),
            ended_order: VecDeque::new(),
        }
    }

    /// Whether `owner` may open one more session under its quota `max` (its identity's
    /// `sessions-max`; `None`: no quota).
    ///
    /// # Errors
    /// [`Refusal::IdentityFull`] at `max` live sessions of `owner`, over all its connections.
    pub fn owner_room(&self, owner: Option<&str>, max: Option<usize>) -> Result<(), Refusal> {
        let (Some(owner), Some(max)) = (owner, max) else {
            return Ok(());
        };
        let live = self.by_owner.get(owner).copied().unwrap_or(0);
        if live >= max {
            return Err(Refusal::IdentityFull(max));
        }
        Ok(())
    }

    /// Opens session `id` of `ttl_ms` at `now_ms`, for connection `conn_id`.
    ///
    /// # Errors
    /// [`Refusal::SessionsFull`] at `sessions_max` live sessions,
    /// [`Refusal::ConnectionFull`] at [`SESSIONS_PER_CONNECTION_MAX`] of this connection's.
    pub fn open(
        &mut self,
        now_ms: u64,
        id: SessionId,
        ttl_ms: u32,
        (owner, conn_id): (Option<String>, u64),
    ) -> Result<(), Refusal> {
        if self.by_id.len() >= self.sessions_max {
            return Err(Refusal::SessionsFull);
        }
        let opened = self.by_conn.entry(conn_id).or_insert(0);
        if *opened >= SESSIONS_PER_CONNECTION_MAX {
            return Err(Refusal::ConnectionFull);
        }
        *opened += 1;
        if let Some(owner) = &owner {
            *self.by_owner.entry(owner.clone()).or_insert(0) += 1;
        }
        let deadline_ms = now_ms + u64::from(ttl_ms);
        let entry = Entry::new(self.number(id), ttl_ms, deadline_ms, owner, conn_id);
        assert!(
            self.by_id.insert(id, entry).is_none(),
            "session id {id} reused"
        );
        self.deadlines.insert((deadline_ms, id));
        Ok(())
    }

    /// What a SESSION_OPEN of `ttl_ms` naming session `id`, sent by `owner` at `now_ms`,
    /// finds: no such session (open it), or the session a first send of it opened.
    ///
    /// # Errors
    /// [`Refusal::NoSession`] if that session has ended already (its deadline passed, or it
    /// ended within [`SESSION_ENDED_KEEP_MS`]), [`Refusal::NotTheOpen`] if another identity
    /// opened it, or with another TTL.
    pub fn find_open(
        &self,
        now_ms: u64,
        id: SessionId,
        (owner, ttl_ms): (Option<&str>, u32),
    ) -> Result<Reopen, Refusal> {
        let Some(entry) = self.by_id.get(&id) else {
            return match self.ended.get(&id) {
                Some(&ended_ms) if now_ms < ended_ms + SESSION_ENDED_KEEP_MS => {
                    Err(Refusal::NoSession)
                }
                _ => Ok(Reopen::Absent),
            };
        };
        if entry.owner.as_deref() != owner {
            return Err(Refusal::NotTheOpen(None));
        }
        if entry.ttl_ms != ttl_ms {
            return Err(Refusal::NotTheOpen(Some(entry.ttl_ms)));
        }
        if entry.deadline_ms <= now_ms {
            return Err(Refusal::NoSession);
        }
        Ok(Reopen::Repeat(entry.ttl_ms, entry.open_ticket))
    }

    /// Notes the journal ticket of session `id`'s opening record, for repeats of its open.
    pub fn opened_by(&mut self, id: SessionId, ticket: Ticket) {
        if let Some(entry) = self.by_id.get_mut(&id) {
            entry.open_ticket = ticket;
        }
    }

    /// Puts back a session the journal recovered, running its TTL again from `now_ms`, with
    /// no leases yet; no limit refuses it (it was admitted once). A known id is left alone.
    pub fn restore(&mut self, now_ms: u64, id: SessionId, ttl_ms: u32, owner: Option<String>) {
        if self.by_id.contains_key(&id) {
            return;
        }
        *self.by_conn.entry(RESTORED_CONN_ID).or_insert(0) += 1;
        // Counted toward its identity's `sessions-max` as at open, so its end gives the
        // place back (and a restart cannot lift an identity over its quota).
        if let Some(owner) = &owner {
            *self.by_owner.entry(owner.clone()).or_insert(0) += 1;
        }
        let deadline_ms = now_ms + u64::from(ttl_ms);
        let entry = Entry::new(
            self.number(id),
            ttl_ms,
            deadline_ms,
            owner,
            RESTORED_CONN_ID,
        );
        self.by_id.insert(id, entry);
        self.deadlines.insert((deadline_ms, id));
    }

    /// The TTL of session `id`, if it is in the table (live or not yet reaped).
    pub fn ttl_of(&self, id: SessionId) -> Option<u32> {
        self.by_id.get(&id).map(|e| e.ttl_ms)
    }

    /// Calls `each` with every session's id, TTL and owner, for a snapshot.
    pub fn for_each(&self, mut each: impl FnMut(SessionId, u32, Option<&str>)) {
        for (id, entry) in &self.by_id {
            each(*id, entry.ttl_ms, entry.owner.as_deref());
        }
    }

    /// Whether `id` is live at `now_ms` for `owner`.
    pub fn is_live(&self, now_ms: u64, id: SessionId, owner: Option<&str>) -> bool {
        self.live(now_ms, id, owner).is_some()
    }

    /// Takes back an open whose record never became durable: forgets the session and
    /// returns its leases (none, unless a client guessed its id), to free in the table.
    pub fn unopen(&mut self, id: SessionId) -> Vec<(LeaseId, LeaseKey)> {
        if !self.by_id.contains_key(&id) {
            return Vec::new();
        }
        self.remove(id).leases
    }

    /// The live session `id` as `owner` sees it: `None` if it is unknown, past its deadline
    /// at `now_ms`, or another identity's.
    fn live(&self, now_ms: u64, id: SessionId, owner: Option<&str>) -> Option<&Entry> {
        self.by_id
            .get(&id)
            .filter(|e| e.deadline_ms > now_ms && e.owner.as_deref() == owner)
    }

    /// The session's time left at `now_ms`, if `owner` may use it.
    ///
    /// # Errors
    /// [`Refusal::NoSession`] if it is not live; [`Refusal::Ending`] if it ends in less
    /// than the shortest TTL a lease may have (the table cannot hold a lease for less, and a
    /// longer one would outlive the session); [`Refusal::LeasesFull`] if it may take no more
    /// leases.
    pub fn room(&self, now_ms: u64, id: SessionId, owner: Option<&str>) -> Result<u64, Refusal> {
        let entry = self.live(now_ms, id, owner).ok_or(Refusal::NoSession)?;
        let left_ms = entry.deadline_ms - now_ms;
        if left_ms < u64::from(tenure_protocol::limits::TTL_MS_MIN) {
            return Err(Refusal::Ending(left_ms));
        }
        // Waiting ACQUIREs count too: each may become a lease of the session.
        if entry.live + entry.waiters.len() >= self.leases_max {
            return Err(Refusal::LeasesFull);
        }
        Ok(left_ms)
    }

    /// Moves the session's deadline to `now_ms + ttl`, and returns its TTL and leases (to
    /// renew in the table).
    ///
    /// # Errors
    /// [`Refusal::NoSession`] if it is not live at `now_ms`: an ended session is not revived.
    pub fn keep(
        &mut self,
        now_ms: u64,
        id: SessionId,
        owner: Option<&str>,
    ) -> Result<(u32, Vec<(LeaseId, LeaseKey)>), Refusal> {
        self.live(now_ms, id, owner).ok_or(Refusal::NoSession)?;
        let entry = self.by_id.get_mut(&id).expect("checked live");
        self.deadlines.remove(&(entry.deadline_ms, id));
        entry.deadline_ms = now_ms + u64::from(entry.ttl_ms);
        entry
            .deadline_cell
            .store(entry.deadline_ms, Ordering::Release);
        self.deadlines.insert((entry.deadline_ms, id));
        let ttl_ms = entry.ttl_ms;
        // The keep-alive reads the whole list anyway: the ended leases go now.
        self.prune(id);
        let entry = &self.by_id[&id];
        let leases = entry.leases.iter().map(|k| self.lease_of(k)).collect();
        Ok((ttl_ms, leases))
    }

    /// Ends the session now and returns its leases (to free in the table) and its waiters
    /// (to take out of their queues, first).
    ///
    /// # Errors
    /// [`Refusal::NoSession`] if it is not live at `now_ms`.
    pub fn close(
        &mut self,
        now_ms: u64,
        id: SessionId,
        owner: Option<&str>,
    ) -> Result<Ended, Refusal> {
        self.live(now_ms, id, owner).ok_or(Refusal::NoSession)?;
        let ended = self.remove(id);
        self.remember_ended(now_ms, id);
        Ok(ended)
    }

    /// Remembers that session `id` ended at `now_ms` (for [`SessionTable::find_open`]), and
    /// forgets the ended ids past their time or over the count.
    fn remember_ended(&mut self, now_ms: u64, id: SessionId) {
        self.ended.insert(id, now_ms);
        self.ended_order.push_back((now_ms, id));
        while let Some(&(ended_ms, oldest)) = self.ended_order.front() {
            let stale = ended_ms + SESSION_ENDED_KEEP_MS <= now_ms;
            if !stale && self.ended_order.len() <= SESSIONS_ENDED_MAX {
                break;
            }
            self.ended_order.pop_front();
            // Only its latest end forgets it (an id reopened after it was forgotten, and
            // ended again, has a later entry).
            if self.ended.get(&oldest) == Some(&ended_ms) {
                self.ended.remove(&oldest);
            }
        }
    }

    /// Counts a waiter (`waiter_id` on `key`) that an ACQUIRE in session `id` queued.
    pub fn add_waiter(&mut self, id: SessionId, key: &[u8], waiter_id: u64) {
        let entry = self.by_id.get_mut(&id).expect("a waiter of a live session");
        // A copy, for the reason `attach` gives.
        let inserted = entry
            .waiters
            .insert((Bytes::copy_from_slice(key), waiter_id));
        assert!(inserted, "waiter {waiter_id} counted twice");
    }

    /// Forgets a waiter of session `id` that left its queue (answered or cancelled); a
    /// no-op if the session ended (its end took the waiters) or forgot it already.
    pub fn forget_waiter(&mut self, id: SessionId, key: &Bytes, waiter_id: u64) {
        if let Some(entry) = self.by_id.get_mut(&id) {
            entry.waiters.remove(&(key.clone(), waiter_id));
        }
    }

    /// The deadline session `id`'s waiters read (see [`Entry`]), if it is in the table.
    pub fn deadline_cell(&self, id: SessionId) -> Option<Arc<AtomicU64>> {
        self.by_id.get(&id).map(|e| Arc::clone(&e.deadline_cell))
    }

    /// Waiting ACQUIREs in sessions.
    pub fn waiters_len(&self) -> usize {
        self.by_id.values().map(|e| e.waiters.len()).sum()
    }

    /// Forgets session `id`, and returns its leases still held and its waiters.
    fn remove(&mut self, id: SessionId) -> Ended {
        let entry = self.by_id.remove(&id).expect("a session to remove");
        self.deadlines.remove(&(entry.deadline_ms, id));
        // Its waiters still in line are no longer live to the table (it skips them).
        entry.deadline_cell.store(0, Ordering::Release);
        let opened = self
            .by_conn
            .get_mut(&entry.conn_id)
            .expect("counted at open");
        *opened -= 1;
        if *opened == 0 {
            self.by_conn.remove(&entry.conn_id);
        }
        if let Some(owner) = &entry.owner {
            let live = self.by_owner.get_mut(owner).expect("counted at open");
            *live -= 1;
            if *live == 0 {
                self.by_owner.remove(owner);
            }
        }
        let mut leases = Vec::with_capacity(entry.live);
        for kept in &entry.leases {
            if self.by_lease.get(&kept.lease_id) == Some(&entry.no) {
                leases.push(self.lease_of(kept));
                self.forget_lease(kept.lease_id);
            }
        }
        assert_eq!(
            leases.len(),
            entry.live,
            "session {id} miscounted its leases"
        );
        self.numbers[entry.no as usize] = None;
        self.numbers_free.push(entry.no);
        Ended {
            leases,
            waiters: entry.waiters.into_iter().collect(),
        }
    }

    /// A free number for session `id`.
    fn number(&mut self, id: SessionId) -> u32 {
        let no = match self.numbers_free.pop() {
            Some(no) => no,
            None => {
                self.numbers.push(None);
                u32::try_from(self.numbers.len() - 1).expect("fewer than 2^32 sessions")
            }
        };
        self.numbers[no as usize] = Some(id);
        no
    }

    /// A lease of a session's list, with its key.
    fn lease_of(&self, kept: &Kept) -> (LeaseId, LeaseKey) {
        let key = match kept.key_len {
            KEY_LONG => LeaseKey::Long(self.long_keys[&kept.lease_id].clone()),
            len => LeaseKey::Inline(len, kept.key_inline),
        };
        (kept.lease_id, key)
    }

    /// Takes `lease_id` out of `by_lease` (and its long key); its session's list keeps it
    /// until pruned.
    fn forget_lease(&mut self, lease_id: LeaseId) -> Option<u32> {
        let no = self.by_lease.remove(&lease_id)?;
        self.long_keys.remove(&lease_id);
        Some(no)
    }

    /// Drops the leases of session `id`'s list that are no longer its.
    fn prune(&mut self, id: SessionId) {
        let entry = self.by_id.get_mut(&id).expect("prune a live session");
        entry.prune(&self.by_lease);
    }

    /// Adds a lease the table granted to session `id` (a lease already in a session is left
    /// where it is).
    pub fn attach(&mut self, id: SessionId, lease_id: LeaseId, key: &[u8]) {
        let entry = self.by_id.get_mut(&id).expect("attach to a live session");
        if self.by_lease.contains_key(&lease_id) {
            return;
        }
        // The key is copied, never kept as the request's `Bytes`: that is a slice of the
        // connection's read buffer, which a lease kept for its lifetime would pin whole.
        let mut kept = Kept {
            lease_id,
            key_len: KEY_LONG,
            key_inline: [0; SESSION_KEY_INLINE_MAX],
        };
        if key.len() <= SESSION_KEY_INLINE_MAX {
            kept.key_inline[..key.len()].copy_from_slice(key);
            kept.key_len = key.len() as u8;
        } else {
            self.long_keys.insert(lease_id, Bytes::copy_from_slice(key));
        }
        // A full list is pruned rather than grown while an eighth of it or more has ended:
        // a session that churns its leases keeps a list about its size, and a prune, which
        // reads the whole list, comes at most once per an eighth of it attached.
        let stale = entry.leases.len() - entry.live;
        if entry.leases.len() == entry.leases.capacity() && stale > entry.leases.len() / 8 {
            entry.prune(&self.by_lease);
        }
        entry.leases.push(kept);
        entry.live += 1;
        self.by_lease.insert(lease_id, entry.no);
    }

    /// Forgets a session lease that ended on its own (RELEASE, a grant taken back): its
    /// session's count drops now, its list entry goes when the list is next pruned (at the
    /// latest when the list holds twice its live leases and `PRUNED_SLACK` more).
    pub fn detach(&mut self, lease_id: LeaseId) {
        let Some(no) = self.forget_lease(lease_id) else {
            return;
        };
        let id = self.numbers[no as usize].expect("a lease of a numbered session");
        let entry = self.by_id.get_mut(&id).expect("a numbered session is live");
        entry.live -= 1;
        if entry.leases.len() >= 2 * entry.live + PRUNED_SLACK {
            self.prune(id);
        }
    }

    /// Whether `lease_id` is a session lease.
    pub fn holds(&self, lease_id: LeaseId) -> bool {
        self.by_lease.contains_key(&lease_id)
    }

    /// The session `lease_id` is in, if any.
    pub fn session_of(&self, lease_id: LeaseId) -> Option<SessionId> {
        let no = self.by_lease.get(&lease_id)?;
        self.numbers[*no as usize]
    }

    /// Forgets sessions past their deadline at `now_ms`, at most `max`; returns how many.
    /// (Their leases have the same deadline, so the table's expiry ends them.)
    pub fn reap(&mut self, now_ms: u64, max: usize) -> usize {
        self.reap_ended(now_ms, max).len()
    }

    /// [`SessionTable::reap`], returning the ids forgotten (for their records) with their
    /// waiters (to take out of their queues).
    pub fn reap_ended(&mut self, now_ms: u64, max: usize) -> Vec<(SessionId, Vec<(Bytes, u64)>)> {
        let ended: Vec<SessionId> = self
            .deadlines
            .iter()
            .take_while(|(deadline_ms, _)| *deadline_ms <= now_ms)
            .take(max)
            .map(|(_, id)| *id)
            .collect();
        ended
            .into_iter()
            .map(|id| {
                let waiters = self.remove(id).waiters;
                self.remember_ended(now_ms, id);
                (id, waiters)
            })
            .collect()
    }

    /// Live sessions (some may be past their deadline, not yet reaped).
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether no session is live.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Leases in sessions.
    pub fn leases_len(&self) -> usize {
        self.by_lease.len()
    }

    /// Checks the table's invariants (tests call it after every step).
    pub fn check_invariants(&self) {
        assert_eq!(self.deadlines.len(), self.by_id.len());
        for (deadline_ms, id) in &self.deadlines {
            assert_eq!(self.by_id[id].deadline_ms, *deadline_ms);
            let cell = self.by_id[id].deadline_cell.load(Ordering::Relaxed);
            assert_eq!(cell, *deadline_ms);
        }
        let opened: u32 = self.by_conn.values().sum();
        assert_eq!(opened as usize, self.by_id.len());
        let owned: usize = self.by_owner.values().sum();
        let with_owner = self.by_id.values().filter(|e| e.owner.is_some()).count();
        assert_eq!(owned, with_owner);
        self.check_leases();
    }

    /// [`SessionTable::check_invariants`] for the leases: each session's count is exact,
    /// its list holds each of its leases once, `by_lease` names live sessions only, and a
    /// long key is kept for every long-keyed session lease and no other.
    fn check_leases(&self) {
        let live: usize = self.by_id.values().map(|e| e.live).sum();
        assert_eq!(live, self.by_lease.len());
        let numbered = self.numbers.iter().filter(|n| n.is_some()).count();
        assert_eq!(numbered, self.by_id.len());
        assert_eq!(numbered + self.numbers_free.len(), self.numbers.len());
        let mut long = 0;
        for (id, entry) in &self.by_id {
            assert_eq!(self.numbers[entry.no as usize], Some(*id));
            let mut seen = HashSet::new();
            for kept in &entry.leases {
                if self.by_lease.get(&kept.lease_id) == Some(&entry.no) {
                    assert!(seen.insert(kept.lease_id), "lease listed twice in {id}");
                    let is_long = kept.key_len == KEY_LONG;
                    assert_eq!(is_long, self.long_keys.contains_key(&kept.lease_id));
                    long += usize::from(is_long);
                }
            }
            assert_eq!(seen.len(), entry.live, "session {id} miscounted its leases");
        }
        assert_eq!(long, self.long_keys.len());
        for no in self.by_lease.values() {
            assert!(self.numbers[*no as usize].is_some());
        }
    }
}

/// What a session's end leaves to do outside the session table's lock.
#[derive(Debug, Default)]
pub struct Ended {
    /// Its leases, to free (after the waiters are out of line).
    pub leases: Vec<(LeaseId, LeaseKey)>,
    /// Its waiters, to take out of their queues and answer `NO_SESSION`.
    pub waiters: Vec<(Bytes, u64)>,
}

/// The executor's sessions: the table under its lock, and counters for STATS.
pub struct Sessions {
    table: Mutex<SessionTable>,
    /// Leases handed to a session's waiter that have not joined the session yet (its
    /// connection takes the grant up, `Executor::join_session`), with that session. The
    /// hand-off is made under a shard's lock, where the session table's may not be taken;
    /// this lock is taken under either and nothing is locked under it. A repeat of the
    /// waiter's ACQUIRE in between names the session the lease is joining, and is
    /// answered as if it had joined (outside test a30, finding F1).
    joining: Mutex<HashMap<LeaseId, SessionId>>,
    /// Session leases, read without the lock so plain RENEW and RELEASE skip it.
    leases: AtomicUsize,
    /// Sessions ended by SESSION_CLOSE.
    pub closed: AtomicU64,
    /// Sessions ended by their deadline.
    pub expired: AtomicU64,
}

impl Sessions {
    /// No sessions yet, with these limits.
    pub fn new(sessions_max: usize, leases_max: usize) -> Sessions {
        Sessions {
            table: Mutex::new(SessionTable::new(sessions_max, leases_max)),
            joining: Mutex::new(HashMap::new()),
            leases: AtomicUsize::new(0),
            closed: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        }
    }

    /// The table, locked.
    pub fn lock(&self) -> MutexGuard<'_, SessionTable> {
        self.table
            .lock()
            .expect("the session table was poisoned by a panic")
    }

    /// Notes that `lease_id` was handed to a waiter of session `id` and is to join it.
    pub(super) fn joining(&self, lease_id: LeaseId, id: SessionId) {
        self.joining_map().insert(lease_id, id);
    }

    /// `lease_id` joined its session, or never will: it is no longer joining one.
    pub(super) fn joined(&self, lease_id: LeaseId) {
        self.joining_map().remove(&lease_id);
    }

    /// Every lease joining a session now, with its session.
    pub(super) fn joining_copy(&self) -> HashMap<LeaseId, SessionId> {
        self.joining_map().clone()
    }

    /// The session `lease_id` is joining, if it is.
    fn joining_of(&self, lease_id: LeaseId) -> Option<SessionId> {
        self.joining_map().get(&lease_id).copied()
    }

    fn joining_map(&self) -> MutexGuard<'_, HashMap<LeaseId, SessionId>> {
        self.joining
            .lock()
            .expect("the joining leases were poisoned by a panic")
    }

    /// The table, locked, if any lease is in a session (else `None`, without the lock).
    pub fn lock_if_any(&self) -> Option<MutexGuard<'_, SessionTable>> {
        (self.leases.load(Ordering::Relaxed) > 0).then(|| self.lock())
    }

    /// `(live sessions, session leases)` for STATS.
    pub fn counts(&self) -> (usize, usize) {
        let table = self.lock();
        (table.len(), table.leases_len())
    }

    /// Whether `lease_id` is a session lease; without taking the lock when there are none.
    pub fn holds(&self, lease_id: LeaseId) -> bool {
        self.leases.load(Ordering::Relaxed) > 0 && self.lock().holds(lease_id)
    }

    /// Forgets a session lease that was released; without the lock when there are none.
    pub fn detach(&self, lease_id: LeaseId) {
        if self.leases.load(Ordering::Relaxed) > 0 {
            let mut table = self.lock();
            table.detach(lease_id);
            self.leases.store(table.leases_len(), Ordering::Relaxed);
        }
    }

    /// The ticker's pass: forgets ended sessions, bounded, and logs each one's end (under
    /// the table's lock, so a snapshot's copy of the sessions is ordered against it). An end
    /// that cannot be logged is only warned of: the session has ended here all the same, and
    /// a restart brings it back for a full TTL, as it brings back a lease whose free was lost.
    /// Returns the ended sessions' waiters, to take out of their queues.
    pub fn reap(&self, now_ms: u64, journal: &dyn Journal) -> Vec<(Bytes, u64)> {
        let mut table = self.lock();
        if table.is_empty() {
            return Vec::new();
        }
        let ended = table.reap_ended(now_ms, SESSION_REAPS_PER_TICK_MAX);
        for (session_id, _) in &ended {
            let end = Change::SessionEnd {
                session_id: *session_id,
                how: SessionEnd::Expired,
            };
            if let Err(e) = journal.append(&end) {
                tracing::warn!(error = %e, "a session's expiry could not be logged");
            }
        }
        self.leases.store(table.leases_len(), Ordering::Relaxed);
        self.expired
            .fetch_add(ended.len() as u64, Ordering::Relaxed);
        ended.into_iter().flat_map(|(_, waiters)| waiters).collect()
    }
}

fn refusal(refusal: Refusal, id: SessionId, config: &crate::config::Config) -> Response {
    refusal_of(refusal, id, config, None)
}

/// [`refusal`], naming `owner` (the identity a quota refusal is about).
fn refusal_of(
    refusal: Refusal,
    id: SessionId,
    config: &crate::config::Config,
    owner: Option<&str>,
) -> Response {
    match refusal {
        Refusal::NoSession => error(ErrorCode::NoSession, format!("no live session {id}")),
        Refusal::Ending(left_ms) => error(
            ErrorCode::NoSession,
            format!(
                "session {id} ends in {left_ms} ms, under the shortest lease TTL ({} ms): it \
                 takes no new lease",
                tenure_protocol::limits::TTL_MS_MIN
            ),
        ),
        Refusal::SessionsFull => error(
            ErrorCode::SessionsLimit,
            format!(
                "the server has {} live sessions, its limit (--sessions-max)",
                config.sessions_max
            ),
        ),
        Refusal::ConnectionFull => error(
            ErrorCode::SessionsLimit,
            format!(
                "this connection opened {SESSIONS_PER_CONNECTION_MAX} live sessions, the \
                 limit per connection"
            ),
        ),
        Refusal::IdentityFull(max) => error(
            ErrorCode::SessionsLimit,
            format!(
                "sessions-max: identity `{}` has {max} live sessions already",
                owner.unwrap_or_default()
            ),
        ),
        Refusal::LeasesFull => error(
            ErrorCode::SessionLeasesLimit,
            format!(
                "session {id} holds and waits for {} leases, its limit (--session-leases-max)",
                config.session_leases_max
            ),
        ),
        // The session stays unnamed and its owner unsaid, as for a mismatched ACQUIRE.
        Refusal::NotTheOpen(None) => error(
            ErrorCode::SessionMismatch,
            "a session with this id was opened by another identity",
        ),
        Refusal::NotTheOpen(Some(ttl_ms)) => error(
            ErrorCode::SessionMismatch,
            format!("a session with this id was opened with ttl_ms {ttl_ms}"),
        ),
    }
}

/// `SESSION_MISMATCH` if `outcome` answers a repeat (REGRANTED) of a lease that is not in
/// `expected` (the session the repeat named, or none).
pub(super) fn mismatch(
    outcome: &Outcome,
    expected: Option<SessionId>,
    (sessions, table): (&Sessions, &SessionTable),
) -> Option<Outcome> {
    let Outcome::Reply(Response::Regranted { lease_id, .. }, _) = outcome else {
        return None;
    };
    let actual = table
        .session_of(*lease_id)
        .or_else(|| sessions.joining_of(*lease_id));
    if actual == expected {
        return None;
    }
    // Which session it is in stays unsaid: a session id lets its holder close the session
    // (and free every lease in it), and the sender of a mismatched repeat may not be that
    // holder.
    let message = match (actual, expected) {
        (Some(_), Some(_)) => "the first send's lease is in another session",
        (Some(_), None) => "the first send's lease is in a session; name it",
        (None, _) => "the first send's lease is in no session",
    };
    Some(Outcome::Reply(
        error(ErrorCode::SessionMismatch, message),
        TICKET_NOW,
    ))
}

impl Executor {
    /// A waiting repeat whose wait ended REGRANTED with its first send's lease (3.9) must
    /// have named the session that lease is in, or none if it is in none, as one that did
    /// not wait (3.11): otherwise it hears `SESSION_MISMATCH` (outside test a34, finding F1:
    /// it was told of a lease its session does not keep). Checked by its connection, not
    /// where the table answered it: that was under a shard's lock, and the session table's
    /// lock comes first.
    pub fn checked_regrant(&self, result: WaitResult, named: Option<SessionId>) -> WaitResult {
        let WaitResult::Regranted {
            token, lease_id, ..
        } = &result
        else {
            return result;
        };
        let regranted = Outcome::Reply(
            Response::Regranted {
                token: *token,
                lease_id: *lease_id,
                ttl_left_ms: 0,
            },
            TICKET_NOW,
        );
        let refusal = match named {
            None => self.sessions.mismatch_without_session(&regranted),
            Some(id) => mismatch(
                &regranted,
                Some(id),
                (&self.sessions, &self.sessions.lock()),
            ),
        };
        match refusal {
            Some(Outcome::Reply(Response::Error { code, message }, _)) => {
                WaitResult::Failed(code, message)
            }
            _ => result,
        }
    }
}

impl Sessions {
    /// [`mismatch`] for a repeat that named no session; without the lock when there are no
    /// session leases.
    pub(super) fn mismatch_without_session(&self, outcome: &Outcome) -> Option<Outcome> {
        if !matches!(outcome, Outcome::Reply(Response::Regranted { .. }, _)) {
            return None;
        }
        if self.leases.load(Ordering::Relaxed) == 0 && self.joining_map().is_empty() {
            return None;
        }
        mismatch(outcome, None, (self, &self.lock()))
    }
}

/// The identity a connection acts as, which owns the sessions it opens.
fn owner(ctx: &Session) -> Option<&str> {
    match &ctx.auth {
        super::Auth::As { name, .. } => Some(name),
        _ => None,
    }
}

/// The open sessions, for the journal's snapshots.
pub(super) fn for_each_session(sessions: &Sessions, each: &mut dyn FnMut(Change<'_>)) {
    sessions.lock().for_each(|session_id, ttl_ms, owner| {
        each(Change::SessionOpen {
            session_id,
            ttl_ms,
            owner: owner.unwrap_or("").as_bytes(),
        })
    });
}

impl Executor {
    /// The ticker's pass over the sessions ([`Sessions::reap`]), then the ended sessions'
    /// waiters out of their queues.
    pub fn reap_sessions(self: &Arc<Self>, now_ms: u64) {
        let waiters = self.sessions.reap(now_ms, &*self.journal);
        self.end_session_waiters(now_ms, waiters);
    }

    /// Takes the waiters of an ended session out of their queues, answering each
    /// `NO_SESSION`, and serves each queue again: a head that left a semaphore's or a
    /// read/write lock's queue may let later waiters in at once. Called without the session
    /// table's lock (each shard is locked in turn, never under it). A waiter already handed
    /// its key is not found here; its connection's `join_session` refuses it instead.
    pub(super) fn end_session_waiters(self: &Arc<Self>, now_ms: u64, waiters: Vec<(Bytes, u64)>) {
        let mut events = Vec::new();
        for (key, waiter_id) in waiters {
            let mut shard = self.shard(&key);
            let Some(slot) = shard.take_waiter(&key, waiter_id) else {
                continue;
            };
            // Dropping the slot gives its identity's held-locks place back.
            slot.answer(super::handoff::session_ended_result());
            shard.settle_key(now_ms, &key, &self.tokens.allocator, &mut events);
            self.apply_events(&mut shard, now_ms, &mut events);
        }
    }

    /// Forgets a session's waiter that left its queue otherwise (timed out, cancelled,
    /// answered without a grant).
    pub fn forget_session_waiter(&self, id: SessionId, key: &Bytes, waiter_id: u64) {
        self.sessions.lock().forget_waiter(id, key, waiter_id);
    }

    /// ACQUIRE, in a session or not: a repeat must name the session its first send named.
    pub(super) fn acquire_any(
        self: &Arc<Self>,
        ctx: &mut Session,
        now_ms: u64,
        received_ms: u64,
        request: Request,
    ) -> Outcome {
        let Request::Acquire {
            acquire_id,
            session_id,
            ..
        } = &request
        else {
            unreachable!("acquire_any called with {request:?}")
        };
        if session_id.is_some() {
            return self.acquire_in_session(ctx, now_ms, received_ms, request);
        }
        let repeatable = acquire_id.is_some();
        let outcome = self.acquire(ctx, now_ms, received_ms, request);
        if repeatable {
            if let Some(refusal) = self.sessions.mismatch_without_session(&outcome) {
                return refusal;
            }
        }
        outcome
    }

    /// SESSION_OPEN, SESSION_KEEPALIVE or SESSION_CLOSE. A follower's executor (its journal
    /// refuses everything) opens, keeps and closes no session.
    pub(super) fn session_request(
        self: &Arc<Self>,
        ctx: &Session,
        now_ms: u64,
        request: Request,
    ) -> Outcome {
        if let Some(refusal) = self.refuse_if_not_leader() {
            return Outcome::Reply(refusal, TICKET_NOW);
        }
        match request {
            Request::SessionOpen { ttl_ms, session_id } => {
                self.session_open(ctx, now_ms, ttl_ms, session_id)
            }
            // Answered once the journal vouches this node still led after the keep-alive.
            Request::SessionKeepalive { session_id } => {
                match self.session_keepalive(ctx, now_ms, session_id) {
                    Outcome::Reply(response, ticket) => self.confirmed(response, ticket),
                    other => other,
                }
            }
            Request::SessionClose { session_id } => self.session_close(ctx, now_ms, session_id),
            other => unreachable!("session_request called with {other:?}"),
        }
    }

    /// SESSION_OPEN: the session is logged (before any grant in it can be) and answered
    /// once durable; taken back if it never becomes durable. An open naming the id of a
    /// session it opened before (a repeat after a lost answer) is answered with that session
    /// and changes nothing.
    pub(super) fn session_open(
        &self,
        ctx: &Session,
        now_ms: u64,
        ttl_ms: u32,
        chosen: Option<SessionId>,
    ) -> Outcome {
        let id = chosen.unwrap_or_else(|| SessionId::from_u128(rand::random()));
        let name = owner(ctx);
        let quota = self.sessions_quota(name);
        let opener = (name.map(str::to_string), ctx.conn_id);
        let mut sessions = self.sessions.lock();
        // Before any limit, `--ttl-max-ms` too (a restart may have lowered it under a live
        // session's TTL: outside test a60, F3): a repeat is not a new session, as a repeated
        // ACQUIRE is not a new hold (3.7).
        match sessions.find_open(now_ms, id, (name, ttl_ms)) {
            Ok(Reopen::Absent) => {}
            Ok(Reopen::Repeat(ttl_ms, ticket)) => {
                let response = Response::Session {
                    session_id: id,
                    ttl_ms,
                };
                return Outcome::Reply(response, ticket);
            }
            Err(Refusal::NoSession) => {
                let message = format!("session {id} was opened, and has ended");
                return Outcome::Reply(error(ErrorCode::NoSession, message), TICKET_NOW);
            }
            Err(r) => return Outcome::Reply(refusal(r, id, &self.config), TICKET_NOW),
        }
        if ttl_ms > self.config.ttl_ms_max {
            return Outcome::Reply(self.ttl_too_long(ttl_ms), TICKET_NOW);
        }
        // Checked and counted under one hold of the lock: exact over all its connections.
        let opened = sessions
            .owner_room(name, quota)
            .and_then(|()| sessions.open(now_ms, id, ttl_ms, opener));
        if let Err(r) = opened {
            return Outcome::Reply(refusal_of(r, id, &self.config, name), TICKET_NOW);
        }
        let record = Change::SessionOpen {
            session_id: id,
            ttl_ms,
            owner: owner(ctx).unwrap_or("").as_bytes(),
        };
        let ticket = match self.journal.append(&record) {
            Ok(ticket) => ticket,
            Err(e) => {
                sessions.unopen(id);
                return Outcome::Reply(self.unavailable(&e), TICKET_NOW);
            }
        };
        let response = Response::Session {
            session_id: id,
            ttl_ms,
        };
        if !self.journal.logs_leases() {
            return Outcome::Reply(response, TICKET_NOW);
        }
        sessions.opened_by(id, ticket);
        let undo = Undo::SessionOpen { session_id: id };
        Outcome::Changed {
            response,
            ticket,
            undo,
        }
    }

    /// Takes back a SESSION_OPEN whose record never became durable (its leases, if a client
    /// guessed the id, are freed).
    pub(super) fn undo_session_open(self: &Arc<Self>, id: SessionId) {
        let leases = {
            let mut sessions = self.sessions.lock();
            let leases = sessions.unopen(id);
            self.sessions
                .leases
                .store(sessions.leases_len(), Ordering::Relaxed);
            leases
        };
        let now_ms = self.clock.now_ms();
        for (lease_id, key) in leases {
            let mut shard = self.shard(&key);
            self.free(&mut shard, now_ms, &key, lease_id, FreeReason::Released);
        }
    }

    /// Puts back the sessions a journal recovered, each running its TTL again from
    /// `now_ms`; call before [`Executor::restore`], which attaches their leases.
    pub fn restore_sessions(
        &self,
        now_ms: u64,
        sessions: impl IntoIterator<Item = RecoveredSession>,
    ) {
        let mut table = self.sessions.lock();
        for session in sessions {
            let owner = (!session.owner.is_empty())
                .then(|| String::from_utf8_lossy(&session.owner).into_owned());
            table.restore(now_ms, session.session_id, session.ttl_ms, owner);
        }
    }

    /// The TTL a recovered lease runs again with: its own, or, in a session, its session's
    /// (it joins the session here). `None`: its session ended, and the lease with it.
    pub(super) fn restored_ttl(&self, lease: &RecoveredLease) -> Option<u32> {
        let Some(id) = lease.session_id else {
            return Some(lease.ttl_ms);
        };
        let mut table = self.sessions.lock();
        let ttl_ms = table.ttl_of(id)?;
        table.attach(id, lease.lease_id, &lease.key);
        self.sessions
            .leases
            .store(table.leases_len(), Ordering::Relaxed);
        Some(ttl_ms)
    }

    /// The `sessions-max` of identity `name` as the identities in force have it.
    fn sessions_quota(&self, name: Option<&str>) -> Option<usize> {
        let identities = self.identities.as_ref()?;
        identities.get(name?)?.sessions_max
    }

    /// SESSION_KEEPALIVE: the session's deadline, and every lease's in it, moves to `now +
    /// ttl`. Answered once every renewal that had to be logged is durable.
    pub(super) fn session_keepalive(&self, ctx: &Session, now_ms: u64, id: SessionId) -> Outcome {
        let mut sessions = self.sessions.lock();
        let (ttl_ms, leases) = match sessions.keep(now_ms, id, owner(ctx)) {
            Ok(kept) => kept,
            Err(r) => return Outcome::Reply(refusal(r, id, &self.config), TICKET_NOW),
        };
        let mut ticket = TICKET_NOW;
        for (lease_id, key) in leases {
            match self.renew_in_session(now_ms, &key, lease_id, ttl_ms) {
                Some(Ok(logged)) => ticket = ticket.max(logged),
                // Released meanwhile: not the session's any more.
                None => sessions.detach(lease_id),
                Some(Err(response)) => return Outcome::Reply(response, TICKET_NOW),
            }
        }
        self.sessions
            .leases
            .store(sessions.leases_len(), Ordering::Relaxed);
        let response = Response::Session {
            session_id: id,
            ttl_ms,
        };
        Outcome::Reply(response, ticket)
    }

    /// Renews one session lease to `ttl_ms` from `now_ms`: `None` if it no longer holds its
    /// key, else the ticket to wait for (or the refusal if a longer TTL could not be logged).
    fn renew_in_session(
        &self,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
        ttl_ms: u32,
    ) -> Option<Result<Ticket, Response>> {
        let mut shard = self.shard(key);
        let durable_lsn = || self.journal.progress().borrow().lsn;
        match shard.renew(now_ms, key, lease_id, ttl_ms, durable_lsn) {
            table::Renew::Renewed { wait_lsn, .. } => Some(Ok(wait_lsn)),
            table::Renew::Unlogged { token } => {
                let renewal = crate::journal::Change::Renew { key, token, ttl_ms };
                Some(match self.journal.append(&renewal) {
                    Ok(ticket) => {
                        shard.renew_logged(now_ms, key, token, ttl_ms, ticket);
                        Ok(ticket)
                    }
                    Err(e) => Err(self.unavailable(&e)),
                })
            }
            table::Renew::Lost => None,
        }
    }

    /// SESSION_CLOSE: every lease in the session is freed, each key handed on.
    pub(super) fn session_close(
        self: &Arc<Self>,
        ctx: &Session,
        now_ms: u64,
        id: SessionId,
    ) -> Outcome {
        let ended = {
            let mut sessions = self.sessions.lock();
            if !sessions.is_live(now_ms, id, owner(ctx)) {
                let r = Refusal::NoSession;
                return Outcome::Reply(refusal(r, id, &self.config), TICKET_NOW);
            }
            // The end is logged before the frees: a crash between them leaves the leases'
            // grants with no open session, and recovery drops them with it.
            let end = Change::SessionEnd {
                session_id: id,
                how: SessionEnd::Closed,
            };
            if let Err(e) = self.journal.append(&end) {
                return Outcome::Reply(self.unavailable(&e), TICKET_NOW);
            }
            let ended = sessions.close(now_ms, id, owner(ctx));
            self.sessions
                .leases
                .store(sessions.leases_len(), Ordering::Relaxed);
            ended.expect("checked live")
        };
        self.sessions.closed.fetch_add(1, Ordering::Relaxed);
        // Its waiters leave their queues first, so no key freed below goes to one of them.
        self.end_session_waiters(now_ms, ended.waiters);
        let (mut ticket, mut released, mut lost) = (TICKET_NOW, 0u32, None);
        for (lease_id, key) in ended.leases {
            let mut shard = self.shard(&key);
            // Its own reason, so a repeat of its ACQUIRE hears "its session ended" (how 4).
            match self.free(&mut shard, now_ms, &key, lease_id, FreeReason::Session) {
                Some(Ok(logged)) => {
                    ticket = ticket.max(logged);
                    released += 1;
                }
                // Freed here all the same (as a RELEASE whose record is lost): every other
                // lease of the session is freed too, as the session is gone here.
                Some(Err(e)) => {
                    released += 1;
                    lost.get_or_insert(e);
                }
                None => {}
            }
        }
        match lost {
            None => Outcome::Reply(Response::SessionClosed { released }, ticket),
            Some(JournalError::NotLeader(leader)) => {
                Outcome::Reply(error(ErrorCode::NotLeader, leader.as_ref()), TICKET_NOW)
            }
            Some(e) => {
                Stats::bump(&self.stats.errors);
                tracing::error!(error = %e, "a session's close could not be logged");
                let message = format!(
                    "closed, but not durable: the session and its leases may come back after \
                     a restart: {e}"
                );
                Outcome::Reply(error(ErrorCode::Unavailable, message), TICKET_NOW)
            }
        }
    }

    /// A waiter of session `id` was handed `grant` (on another task, outside the session
    /// table's lock, for the session's time left when it queued): it joins the session now,
    /// renewed to the session's time left, or, if the session ended meanwhile, is freed at
    /// once (its key handed on) and answered `NO_SESSION`.
    ///
    /// # Errors
    /// The error to answer the waiter with.
    pub fn join_session(
        self: &Arc<Self>,
        ctx: &Session,
        (id, waiter_id): (SessionId, u64),
        key: &Bytes,
        mut grant: table::Grant,
        ticket: Ticket,
    ) -> Result<(table::Grant, Ticket), (ErrorCode, String)> {
        let now_ms = self.clock.now_ms();
        let mut sessions = self.sessions.lock();
        // No longer waiting: under the same hold as the lease it becomes, so the session's
        // count of leases held and waited for cannot slip past its limit in between.
        sessions.forget_waiter(id, key, waiter_id);
        // Joined below, or freed: under the same hold, so a repeat finds it one or the other.
        self.sessions.joined(grant.lease_id);
        let joined = match sessions.room(now_ms, id, owner(ctx)) {
            Ok(left_ms) => {
                let left_ms = clamp_ms(left_ms).max(1);
                match self.renew_in_session(now_ms, key, grant.lease_id, left_ms) {
                    Some(Ok(renewed)) => {
                        sessions.attach(id, grant.lease_id, key);
                        grant.ttl_ms = left_ms;
                        Ok((grant, ticket.max(renewed)))
                    }
                    Some(Err(Response::Error { code, message })) => Err((code, message)),
                    Some(Err(other)) => unreachable!("a renewal refused with {other:?}"),
                    None => Err((
                        ErrorCode::NoSession,
                        "the lease ended before it joined".into(),
                    )),
                }
            }
            Err(r) => match refusal(r, id, &self.config) {
                Response::Error { code, message } => Err((code, message)),
                other => unreachable!("a refusal answered {other:?}"),
            },
        };
        self.sessions
            .leases
            .store(sessions.leases_len(), Ordering::Relaxed);
        drop(sessions);
        if joined.is_err() {
            // Not the session's: it must not outlive it. Freed as a release, and its
            // acquire id forgotten: the waiter is told NO_SESSION, never of the grant, so a
            // retry must hear the same, not how a grant it never had ended.
            let mut shard = self.shard(key);
            shard.forget_acquire_id(key, grant.token);
            let _ = self.free(
                &mut shard,
                now_ms,
                key,
                grant.lease_id,
                FreeReason::Released,
            );
        }
        joined
    }

    /// A repeat of `acquire_id` on `key` in a session that takes no new lease (ended, or
    /// about to): [`Executor::repeat`]'s answer, where an expiry is its session's end (a
    /// session lease has no TTL of its own: it expires only when its session does; an ended
    /// lease's session is not kept, so a repeat naming another session than its first send
    /// did is not caught here, as it is not for any ended lease).
    fn repeat_in_ended(
        self: &Arc<Self>,
        now_ms: u64,
        key: &[u8],
        acquire_id: AcquireId,
    ) -> Option<Outcome> {
        let mut shard = self.shard(key);
        match self.repeat(&mut shard, now_ms, key, acquire_id)? {
            Outcome::Reply(
                Response::AcquireEnded {
                    how: EndedHow::Expired,
                    token,
                },
                ticket,
            ) => {
                let how = EndedHow::Session;
                Some(Outcome::Reply(
                    Response::AcquireEnded { how, token },
                    ticket,
                ))
            }
            outcome => Some(outcome),
        }
    }

    /// ACQUIRE naming a session: run as an ACQUIRE of the session's time left, under the
    /// session table's lock, and a grant joins the session.
    pub(super) fn acquire_in_session(
        self: &Arc<Self>,
        ctx: &mut Session,
        now_ms: u64,
        received_ms: u64,
        mut request: Request,
    ) -> Outcome {
        let Request::Acquire {
            key,
            ttl_ms,
            session_id: Some(id),
            acquire_id,
            ..
        } = &mut request
        else {
            unreachable!("acquire_in_session called with {request:?}")
        };
        let (id, key, acquire_id) = (*id, key.clone(), *acquire_id);
        // A follower's session table lags the leader's: its NO_SESSION would tell a client
        // that a live session ended. Like every request there, this one is NOT_LEADER (3.8).
        if let Some(refusal) = self.refuse_if_not_leader() {
            return Outcome::Reply(refusal, TICKET_NOW);
        }
        let mut sessions = self.sessions.lock();
        let left_ms = match sessions.room(now_ms, id, owner(ctx)) {
            Ok(left_ms) => left_ms,
            Err(r) => {
                // A repeat of a grant is answered with it (or how it ended) before the
                // session's state: an ended session cannot take a new lease, but the first
                // send's outcome is still known.
                let repeat = acquire_id.and_then(|a| self.repeat_in_ended(now_ms, &key, a));
                if let Some(outcome) = repeat {
                    let found = mismatch(&outcome, Some(id), (&self.sessions, &sessions));
                    return found.unwrap_or(outcome);
                }
                // The server's own state (BAD_TTL, RECOVERING, UNAVAILABLE) comes before
                // the session's in 3.7's order.
                let refused = self.refuse_acquire(now_ms, *ttl_ms);
                let refused = refused.unwrap_or_else(|| refusal(r, id, &self.config));
                return Outcome::Reply(refused, TICKET_NOW);
            }
        };
        *ttl_ms = clamp_ms(left_ms);
        // A waiter's slot reads its session's deadline (`WaitSlot::session_ended`).
        ctx.session_deadline = sessions.deadline_cell(id);
        let outcome = self.acquire(ctx, now_ms, received_ms, request);
        ctx.session_deadline = None;
        if let Some(refusal) = mismatch(&outcome, Some(id), (&self.sessions, &sessions)) {
            return refusal;
        }
        if let Outcome::Wait { waiter_id, .. } = &outcome {
            // Counted before its connection can hear of a hand-off (`join_session` takes
            // this lock), and taken out of line by the session's end.
            sessions.add_waiter(id, &key, *waiter_id);
        }
        if let Outcome::Reply(Response::Granted { lease_id, .. }, _)
        | Outcome::Changed {
            response: Response::Granted { lease_id, .. },
            ..
        } = &outcome
        {
            // A grant taken back later (not durable) is detached by the undo's release path
            // or, at the latest, by the next keep-alive, whose renewal finds it gone.
            sessions.attach(id, *lease_id, &key);
        }
        self.sessions
            .leases
            .store(sessions.leases_len(), Ordering::Relaxed);
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(n: u128) -> LeaseId {
        LeaseId::from_u128(n)
    }

    #[test]
    fn a_keep_alive_moves_the_deadline_and_an_ended_session_is_not_revived() {
        let mut t = SessionTable::new(1000, 1000);
        let id = SessionId::from_u128(1);
        t.open(1000, id, 500, (None, 1)).unwrap();
        assert_eq!(t.room(1000, id, None), Ok(500));
        t.attach(id, lease(7), b"a");
        t.check_invariants();
        // Kept alive just before its deadline: runs its TTL again, with its leases.
        let (ttl_ms, leases) = t.keep(1499, id, None).unwrap();
        assert_eq!((ttl_ms, leases.len()), (500, 1));
        assert_eq!(t.room(1500, id, None), Ok(499));
        // At its deadline it has ended, reaped or not: no keep-alive revives it.
        assert_eq!(t.keep(1999, id, None).err(), Some(Refusal::NoSession));
        assert_eq!(t.room(1999, id, None), Err(Refusal::NoSession));
        assert_eq!(t.reap(1998, 10), 0);
        assert_eq!(t.reap(1999, 10), 1);
        t.check_invariants();
        assert!(t.is_empty() && !t.holds(lease(7)));
    }

    #[test]
    fn an_open_naming_a_known_session_id_is_its_repeat_only_for_its_opener() {
        let mut t = SessionTable::new(1, 1000);
        let id = SessionId::from_u128(3);
        let orders = (Some("orders"), 500);
        assert_eq!(t.find_open(0, id, orders), Ok(Reopen::Absent));
        t.open(0, id, 500, (Some("orders".into()), 1)).unwrap();
        t.opened_by(id, 42);
        // A repeat, with its opening record's ticket: at the server's limit of one session
        // too, as it opens none.
        assert_eq!(t.find_open(10, id, orders), Ok(Reopen::Repeat(500, 42)));
        let other = SessionId::from_u128(4);
        let full = t.open(10, other, 500, (Some("orders".into()), 1));
        assert_eq!(full, Err(Refusal::SessionsFull));
        // Not a repeat: another identity, no identity, another TTL.
        let theirs = t.find_open(10, id, (Some("billing"), 500));
        assert_eq!(theirs, Err(Refusal::NotTheOpen(None)));
        assert_eq!(
            t.find_open(10, id, (None, 500)),
            Err(Refusal::NotTheOpen(None))
        );
        let longer = t.find_open(10, id, (Some("orders"), 900));
        assert_eq!(longer, Err(Refusal::NotTheOpen(Some(500))));
        // Past its deadline it has ended: a repeat hears so, from anyone, for
        // SESSION_ENDED_KEEP_MS after the reap forgot the session; then the id opens anew.
        assert_eq!(t.find_open(500, id, orders), Err(Refusal::NoSession));
        assert_eq!(t.reap(500, 10), 1);
        assert_eq!(t.find_open(500, id, orders), Err(Refusal::NoSession));
        let later = 500 + SESSION_ENDED_KEEP_MS;
        assert_eq!(
            t.find_open(later - 1, id, (None, 9)),
            Err(Refusal::NoSession)
        );
        assert_eq!(t.find_open(later, id, orders), Ok(Reopen::Absent));
        t.check_invariants();
    }

    #[test]
    fn a_closed_sessions_id_is_remembered_for_a_while_and_the_newest_ones_only() {
        let mut t = SessionTable::new(SESSIONS_ENDED_MAX + 1, 10);
        let orders = (Some("orders"), 500);
        let opener = || (Some("orders".to_string()), 1);
        let id = SessionId::from_u128(7);
        t.open(0, id, 500, opener()).unwrap();
        t.close(10, id, Some("orders")).unwrap();
        assert_eq!(t.find_open(10, id, orders), Err(Refusal::NoSession));
        // A session opened under the id after it was forgotten, and ended again: the later
        // end counts, whatever the first one's entry does when it is dropped.
        let reopened_at = 10 + SESSION_ENDED_KEEP_MS;
        assert_eq!(t.find_open(reopened_at, id, orders), Ok(Reopen::Absent));
        t.open(reopened_at, id, 500, opener()).unwrap();
        t.close(reopened_at + 1, id, Some("orders")).unwrap();
        let ended_again = reopened_at + 1;
        let now = ended_again + 5;
        // Fill the memory past its count: the oldest go, the latest stay.
        for n in 0..SESSIONS_ENDED_MAX as u128 {
            let other = SessionId::from_u128(1000 + n);
            t.open(now, other, 500, (None, 2)).unwrap();
            t.close(now, other, None).unwrap();
        }
        assert!(t.ended.len() <= SESSIONS_ENDED_MAX);
        assert_eq!(t.ended_order.len(), SESSIONS_ENDED_MAX);
        assert_eq!(t.find_open(now, id, orders), Ok(Reopen::Absent));
        let newest = SessionId::from_u128(1000 + SESSIONS_ENDED_MAX as u128 - 1);
        assert_eq!(
            t.find_open(now, newest, (None, 500)),
            Err(Refusal::NoSession)
        );
        t.check_invariants();
    }

    #[test]
    fn past_the_count_exactly_the_oldest_ended_ids_are_forgotten() {
        let mut t = SessionTable::new(SESSIONS_ENDED_MAX + 1, 10);
        let extra = 100u128;
        let total = SESSIONS_ENDED_MAX as u128 + extra;
        for n in 0..total {
            let id = SessionId::from_u128(1 + n);
            // A few ids a millisecond, and some ended by expiry rather than closed.
            let now = u64::try_from(n / 3).unwrap();
            t.open(now, id, 1, (None, 2)).unwrap();
            if n % 5 == 0 {
                assert_eq!(t.reap(now + 1, usize::MAX), 1);
            } else {
                t.close(now, id, None).unwrap();
            }
        }
        let now = u64::try_from(total / 3 + 1).unwrap();
        for n in 0..total {
            let remembered = t.find_open(now, SessionId::from_u128(1 + n), (None, 1));
            let expected = if n < extra {
                Ok(Reopen::Absent)
            } else {
                Err(Refusal::NoSession)
            };
            assert_eq!(remembered, expected, "the {n}th to end");
        }
        assert_eq!(t.ended.len(), SESSIONS_ENDED_MAX);
        t.check_invariants();
    }

    #[test]
    fn close_returns_every_lease_and_forgets_them() {
        let mut t = SessionTable::new(1000, 1000);
        let id = SessionId::from_u128(2);
        t.open(0, id, 1000, (Some("orders".into()), 1)).unwrap();
        for n in 0..5 {
            t.attach(id, lease(n), format!("k{n}").as_bytes());
        }
        t.detach(lease(3));
        t.check_invariants();
        // Another identity's view: no such session.
        assert_eq!(t.close(1, id, None).err(), Some(Refusal::NoSession));
        assert_eq!(
            t.close(1, id, Some("billing")).err(),
            Some(Refusal::NoSession)
        );
        let mut leases = t.close(1, id, Some("orders")).unwrap().leases;
        leases.sort();
        assert_eq!(leases.len(), 4);
        assert!(leases.iter().all(|(l, _)| *l != lease(3)));
        assert_eq!(t.leases_len(), 0);
        assert_eq!(
            t.close(1, id, Some("orders")).err(),
            Some(Refusal::NoSession)
        );
        t.check_invariants();
    }

    #[test]
    fn one_connection_opens_at_most_its_share_and_an_end_gives_a_place_back() {
        let mut t = SessionTable::new(1000, 10);
        for n in 0..SESSIONS_PER_CONNECTION_MAX {
            t.open(0, SessionId::from_u128(n.into()), 100, (None, 7))
                .unwrap();
        }
        let one_more = SessionId::from_u128(1 << 100);
        assert_eq!(
            t.open(0, one_more, 100, (None, 7)),
            Err(Refusal::ConnectionFull)
        );
        // Another connection may; and a session that ends gives its place back.
        t.open(0, one_more, 100, (None, 8)).unwrap();
        t.close(0, SessionId::from_u128(0), None).unwrap();
        t.open(0, SessionId::from_u128(1 << 101), 100, (None, 7))
            .unwrap();
        t.check_invariants();
    }

    #[test]
    fn reaping_is_bounded_per_pass_and_in_deadline_order() {
        let mut t = SessionTable::new(1000, 1000);
        for n in 0..10u128 {
            t.open(n as u64, SessionId::from_u128(n), 100, (None, 1))
                .unwrap();
        }
        assert_eq!(t.reap(200, 3), 3);
        // The three earliest went first.
        for n in 0..3u128 {
            assert_eq!(
                t.room(0, SessionId::from_u128(n), None),
                Err(Refusal::NoSession)
            );
        }
        assert_eq!(t.room(0, SessionId::from_u128(3), None), Ok(103));
        assert_eq!(t.reap(200, 100), 7);
        t.check_invariants();
    }

    #[test]
    fn an_identitys_quota_counts_over_its_connections_and_an_end_gives_a_place_back() {
        let mut t = SessionTable::new(1000, 10);
        let opener = |conn_id| (Some("orders".to_string()), conn_id);
        let quota = Some(2);
        // Two sessions on two connections fill the quota of 2; a third connection is refused.
        for (n, conn_id) in [(1, 1), (2, 2)] {
            assert_eq!(t.owner_room(Some("orders"), quota), Ok(()));
            t.open(0, SessionId::from_u128(n), 100, opener(conn_id))
                .unwrap();
        }
        assert_eq!(
            t.owner_room(Some("orders"), quota),
            Err(Refusal::IdentityFull(2))
        );
        // Other identities, and connections without identities, are not counted with it.
        assert_eq!(t.owner_room(Some("billing"), quota), Ok(()));
        assert_eq!(t.owner_room(None, quota), Ok(()));
        assert_eq!(t.owner_room(Some("orders"), None), Ok(()));
        // A close gives its place back, and so does an expiry once reaped.
        t.close(1, SessionId::from_u128(1), Some("orders")).unwrap();
        assert_eq!(t.owner_room(Some("orders"), quota), Ok(()));
        t.open(50, SessionId::from_u128(3), 100, opener(3)).unwrap();
        assert!(t.owner_room(Some("orders"), quota).is_err());
        assert_eq!(t.reap(100, 10), 1); // session 2, opened at 0 for 100 ms
        assert_eq!(t.owner_room(Some("orders"), quota), Ok(()));
        t.check_invariants();
    }

    #[test]
    fn a_restored_owned_session_counts_toward_its_quota_and_may_close_or_expire() {
        let mut t = SessionTable::new(1000, 10);
        let quota = Some(2);
        // Two sessions of "orders" come back from the journal (a restart or a takeover).
        for n in 1..=2 {
            t.restore(0, SessionId::from_u128(n), 100, Some("orders".into()));
        }
        t.restore(0, SessionId::from_u128(1), 100, Some("orders".into())); // known: no-op
        t.check_invariants();
        assert_eq!(
            t.owner_room(Some("orders"), quota),
            Err(Refusal::IdentityFull(2))
        );
        // Its end gives its place back, closed or expired (without the count at restore,
        // the end found no count for the owner and panicked under the session lock).
        t.attach(SessionId::from_u128(1), lease(5), b"a");
        let leases = (t.close(1, SessionId::from_u128(1), Some("orders")).unwrap()).leases;
        assert_eq!(leases.len(), 1);
        assert_eq!(t.owner_room(Some("orders"), quota), Ok(()));
        assert_eq!(t.reap(100, 10), 1);
        assert!(t.is_empty());
        t.check_invariants();
    }

    #[test]
    fn a_session_about_to_end_takes_no_new_lease() {
        let mut t = SessionTable::new(10, 10);
        let id = SessionId::from_u128(9);
        t.open(0, id, 100, (None, 1)).unwrap();
        let min = u64::from(tenure_protocol::limits::TTL_MS_MIN);
        assert_eq!(t.room(100 - min, id, None), Ok(min));
        // Under the shortest TTL left: a lease for it would be refused by the table (a
        // crash, before this check) or outlive the session.
        assert_eq!(t.room(101 - min, id, None), Err(Refusal::Ending(min - 1)));
        assert_eq!(t.room(99, id, None), Err(Refusal::Ending(1)));
        // It still lives: a keep-alive continues it, and then it takes leases again.
        t.keep(99, id, None).unwrap();
        assert_eq!(t.room(99, id, None), Ok(100));
    }

    #[test]
    fn waiting_acquires_count_against_the_leases_limit_and_leave_with_the_session() {
        let mut t = SessionTable::new(10, 3);
        let (id, other) = (SessionId::from_u128(1), SessionId::from_u128(2));
        t.open(0, id, 100, (None, 1)).unwrap();
        t.open(0, other, 100, (None, 1)).unwrap();
        t.attach(id, lease(1), b"a");
        t.add_waiter(id, b"b", 7);
        assert_eq!(t.room(0, id, None), Ok(100));
        // One held and two waiting fill a limit of 3: a fourth is refused, held or waiting.
        t.add_waiter(id, b"c", 7);
        assert_eq!(t.room(0, id, None), Err(Refusal::LeasesFull));
        assert_eq!(t.room(0, other, None), Ok(100));
        // A waiter that left its queue gives its place back (twice is harmless).
        t.forget_waiter(id, &Bytes::from_static(b"c"), 7);
        t.forget_waiter(id, &Bytes::from_static(b"c"), 7);
        assert_eq!(t.room(0, id, None), Ok(100));
        assert_eq!(t.waiters_len(), 1);
        // The deadline its waiters read moves with a keep-alive, and is 0 once it ended.
        let cell = t.deadline_cell(id).unwrap();
        t.keep(50, id, None).unwrap();
        assert_eq!(cell.load(Ordering::Relaxed), 150);
        t.check_invariants();
        let ended = t.close(60, id, None).unwrap();
        assert_eq!(ended.waiters, vec![(Bytes::from_static(b"b"), 7)]);
        assert_eq!(ended.leases.len(), 1);
        assert_eq!(cell.load(Ordering::Relaxed), 0);
        // An expiry hands its waiters back too.
        t.add_waiter(other, b"a", 9);
        let reaped = t.reap_ended(100, 10);
        assert_eq!(reaped, vec![(other, vec![(Bytes::from_static(b"a"), 9)])]);
        assert_eq!(t.waiters_len(), 0);
        t.check_invariants();
    }

    #[test]
    fn the_limits_refuse_one_more_session_and_one_more_lease() {
        let mut t = SessionTable::new(3, 2);
        for n in 0..3 {
            t.open(0, SessionId::from_u128(n), 100, (None, 1)).unwrap();
        }
        t.attach(SessionId::from_u128(0), lease(1), b"a");
        t.attach(SessionId::from_u128(0), lease(2), b"b");
        assert_eq!(
            t.room(0, SessionId::from_u128(0), None),
            Err(Refusal::LeasesFull)
        );
        let one_more = SessionId::from_u128(u128::MAX);
        assert_eq!(
            t.open(0, one_more, 100, (None, 2)),
            Err(Refusal::SessionsFull)
        );
    }

    /// The leases `keep` hands back, sorted, as (lease, key).
    fn kept(t: &mut SessionTable, now_ms: u64, id: SessionId) -> Vec<(LeaseId, Vec<u8>)> {
        let (_, leases) = t.keep(now_ms, id, None).unwrap();
        let mut leases: Vec<_> = leases.into_iter().map(|(l, k)| (l, k.to_vec())).collect();
        leases.sort();
        leases
    }

    #[test]
    fn released_leases_leave_the_list_lazily_and_the_count_at_once() {
        let mut t = SessionTable::new(10, 1000);
        let id = SessionId::from_u128(1);
        t.open(0, id, 1000, (None, 1)).unwrap();
        for n in 0..100 {
            t.attach(id, lease(n), format!("k{n}").as_bytes());
        }
        // A release drops the count at once; the list keeps the entry until pruned.
        for n in 0..60 {
            t.detach(lease(n));
            t.check_invariants();
            assert_eq!(t.by_id[&id].live, 99 - n as usize);
        }
        assert_eq!(t.leases_len(), 40);
        let listed = t.by_id[&id].leases.len();
        assert!(
            (40..2 * 40 + PRUNED_SLACK).contains(&listed),
            "{listed} listed for 40 live: pruned too late or lost an entry"
        );
        // A keep-alive prunes the whole list, and hands back exactly the leases held.
        let leases = kept(&mut t, 1, id);
        assert_eq!(t.by_id[&id].leases.len(), 40);
        let expected: Vec<_> = (60..100)
            .map(|n| (lease(n), format!("k{n}").into_bytes()))
            .collect();
        let mut expected = expected;
        expected.sort();
        assert_eq!(leases, expected);
        // Released twice, or never a session lease: nothing changes.
        t.detach(lease(0));
        t.detach(lease(5000));
        assert_eq!(t.leases_len(), 40);
        t.check_invariants();
    }

    #[test]
    fn a_key_released_and_acquired_again_before_a_keep_alive_is_handed_back_once() {
        let mut t = SessionTable::new(10, 1000);
        let id = SessionId::from_u128(1);
        t.open(0, id, 1000, (None, 1)).unwrap();
        // Two keys, one a prefix of the other, and the same key under a new lease id after
        // its release: the stale entry (same key) is not handed back, the new one is.
        t.attach(id, lease(1), b"job:1");
        t.attach(id, lease(2), b"job:10");
        t.detach(lease(1));
        t.attach(id, lease(3), b"job:1");
        t.check_invariants();
        assert_eq!(t.session_of(lease(3)), Some(id));
        assert_eq!(t.session_of(lease(1)), None);
        let expected = vec![
            (lease(2), b"job:10".to_vec()),
            (lease(3), b"job:1".to_vec()),
        ];
        assert_eq!(kept(&mut t, 1, id), expected);
        // And at the session's end too: released once, re-acquired, closed.
        t.detach(lease(3));
        t.attach(id, lease(4), b"job:1");
        let mut ended: Vec<_> = (t.close(2, id, None).unwrap().leases)
            .into_iter()
            .map(|(l, k)| (l, k.to_vec()))
            .collect();
        ended.sort();
        assert_eq!(
            ended,
            vec![
                (lease(2), b"job:10".to_vec()),
                (lease(4), b"job:1".to_vec())
            ]
        );
        assert_eq!(t.leases_len(), 0);
        t.check_invariants();
    }

    #[test]
    fn the_lease_limit_counts_live_leases_exactly_whatever_the_list_holds() {
        let mut t = SessionTable::new(10, 3);
        let id = SessionId::from_u128(1);
        t.open(0, id, 1000, (None, 1)).unwrap();
        for n in 0..3 {
            t.attach(id, lease(n), b"k");
        }
        assert_eq!(t.room(0, id, None), Err(Refusal::LeasesFull));
        // Released, not yet pruned: its place is free at once ...
        t.detach(lease(1));
        assert_eq!(t.by_id[&id].leases.len(), 3);
        assert_eq!(t.room(0, id, None), Ok(1000));
        t.attach(id, lease(9), b"k");
        assert_eq!(t.room(0, id, None), Err(Refusal::LeasesFull));
        // ... and a lease attached twice (a repeat) counts once.
        t.attach(id, lease(9), b"k");
        assert_eq!(t.leases_len(), 3);
        t.check_invariants();
        // Many releases and grants in turn never let the count drift from the leases held.
        for n in 10..200 {
            t.detach(lease(n - 1));
            t.detach(lease(0));
            t.attach(id, lease(n), b"k");
            assert_eq!(t.by_id[&id].live, t.leases_len());
            t.check_invariants();
        }
        assert!(t.by_id[&id].leases.len() < 2 * 3 + PRUNED_SLACK + 1);
    }

    #[test]
    fn long_keys_and_reused_session_numbers_keep_their_own_leases() {
        let mut t = SessionTable::new(10, 100);
        let (a, b) = (SessionId::from_u128(1), SessionId::from_u128(2));
        t.open(0, a, 1000, (None, 1)).unwrap();
        let long = vec![b'x'; SESSION_KEY_INLINE_MAX + 1];
        let longest = vec![b'y'; tenure_protocol::limits::KEY_LEN_MAX];
        let fits = vec![b'z'; SESSION_KEY_INLINE_MAX];
        t.attach(a, lease(1), &long);
        t.attach(a, lease(2), &longest);
        t.attach(a, lease(3), &fits);
        t.check_invariants();
        t.detach(lease(1));
        t.check_invariants();
        let mut expected = vec![(lease(2), longest.clone()), (lease(3), fits.clone())];
        expected.sort();
        assert_eq!(kept(&mut t, 1, a), expected);
        // Session a ends; b takes its number, and none of a's leases.
        assert_eq!(t.close(1, a, None).unwrap().leases.len(), 2);
        t.open(1, b, 1000, (None, 1)).unwrap();
        assert_eq!(t.session_of(lease(2)), None);
        t.attach(b, lease(4), &long);
        assert_eq!(t.session_of(lease(4)), Some(b));
        assert_eq!(kept(&mut t, 2, b), vec![(lease(4), long)]);
        t.check_invariants();
    }

    #[test]
    fn a_session_that_churns_its_leases_keeps_a_list_about_its_size() {
        let mut t = SessionTable::new(10, 1000);
        let id = SessionId::from_u128(1);
        t.open(0, id, 1000, (None, 1)).unwrap();
        for n in 0..100 {
            t.attach(id, lease(n), b"k");
        }
        let capacity = t.by_id[&id].leases.capacity();
        // Each lease released and another granted, ten times over, with no keep-alive: the
        // list is pruned when full rather than grown.
        for n in 100..1100 {
            t.detach(lease(n - 100));
            t.attach(id, lease(n), b"k");
            assert_eq!(t.by_id[&id].live, 100);
        }
        assert_eq!(t.by_id[&id].leases.capacity(), capacity);
        t.check_invariants();
        assert_eq!(kept(&mut t, 1, id).len(), 100);
    }
}
