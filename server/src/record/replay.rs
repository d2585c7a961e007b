//! Replay: the leases and token floor a sequence of records leaves ([`LeaseReplay`]), the
//! rules both WAL recovery and the cluster's replicated state apply, and the leases it
//! reports ([`RecoveredLease`]).
use std::collections::HashMap;

use tenure_protocol::{AcquireId, LeaseId, LeaseKind, SessionId};

use super::change::{Change, Lease};
use super::codec::{Record, GRANT_FLAG_RELEASE_ON_DISCONNECT};

/// A session that was opened and not ended when the server stopped (or, in a cluster, as
/// the committed entries leave it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredSession {
    /// The session id.
    pub session_id: SessionId,
    /// Its TTL; a restart (or a new leader) counts it again from then.
    pub ttl_ms: u32,
    /// The identity that opened it; empty without identities.
    pub owner: Vec<u8>,
}

impl RecoveredSession {
    /// The record that brings this session back: what a snapshot of it writes, before any
    /// grant in it.
    pub fn as_record(&self) -> Record<'_> {
        Change::SessionOpen {
            session_id: self.session_id,
            ttl_ms: self.ttl_ms,
            owner: &self.owner,
        }
        .record()
    }
}

/// A lease that was granted and not freed when the server stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredLease {
    /// The locked key.
    pub key: Vec<u8>,
    /// The lease id the holder presents.
    pub lease_id: LeaseId,
    /// The lease's fencing token.
    pub token: u64,
    /// Lease length as granted; the server counts it again from restart.
    pub ttl_ms: u32,
    /// Grant flags (`GRANT_FLAG_*`) as recorded.
    pub flags: u8,
    /// Holder metadata.
    pub meta: Vec<u8>,
    /// The ACQUIRE's acquire id, if it had one.
    pub acquire_id: Option<AcquireId>,
    /// The session it is in, if any: its deadline is the session's.
    pub session_id: Option<SessionId>,
    /// What the lease holds (several shared or permit leases may hold one key).
    pub kind: LeaseKind,
}

impl RecoveredLease {
    /// The lease as the journal records it: a snapshot of it writes
    /// `Change::Grant(lease.as_lease()).record()`, the one Grant builder.
    pub fn as_lease(&self) -> Lease<'_> {
        Lease {
            key: &self.key,
            lease_id: self.lease_id,
            token: self.token,
            ttl_ms: self.ttl_ms,
            release_on_disconnect: self.flags & GRANT_FLAG_RELEASE_ON_DISCONNECT != 0,
            meta: &self.meta,
            acquire_id: self.acquire_id,
            session_id: self.session_id,
            kind: self.kind,
        }
    }

    /// The Grant record that brings this lease back: what a snapshot of it writes.
    pub fn as_grant(&self) -> Record<'_> {
        Change::Grant(self.as_lease()).record()
    }
}

/// The held leases and the token floor that Reserve, Grant and Free records build up, by the
/// replay rules of the WAL's [module docs](crate::wal): WAL recovery and the cluster's replicated
/// state apply records through this one function.
#[derive(Default, Clone, Debug)]
pub(crate) struct LeaseReplay {
    /// The held exclusive leases by key.
    pub leases: HashMap<Vec<u8>, Held>,
    /// The held shared (read) and permit leases by key, several per key. A key is in at
    /// most one of the two maps: an exclusive grant replaces the key's shared holders, a
    /// shared one its exclusive holder (the table grants either only once the other ended).
    pub shared: HashMap<Vec<u8>, Vec<Held>>,
    /// Every token the records mention is below this.
    pub token_floor: u64,
    /// The open sessions by id: their TTL and owner. A lease whose session is not here
    /// ended with it (a crash may have come between the session's end and its leases' frees).
    pub sessions: HashMap<SessionId, (u32, Vec<u8>)>,
}

/// A held lease, as the records left it.
#[derive(Clone, Debug)]
pub(crate) struct Held {
    pub lease_id: LeaseId,
    pub token: u64,
    pub ttl_ms: u32,
    pub flags: u8,
    pub meta: Vec<u8>,
    pub acquire_id: Option<AcquireId>,
    pub session_id: Option<SessionId>,
    pub kind: LeaseKind,
}

impl Held {
    /// This lease of `key` as the journal records it (as [`RecoveredLease::as_lease`], without
    /// a copy of the key and metadata: a snapshot writes every held lease this way).
    pub fn as_lease<'a>(&'a self, key: &'a [u8]) -> Lease<'a> {
        Lease {
            key,
            lease_id: self.lease_id,
            token: self.token,
            ttl_ms: self.ttl_ms,
            release_on_disconnect: self.flags & GRANT_FLAG_RELEASE_ON_DISCONNECT != 0,
            meta: &self.meta,
            acquire_id: self.acquire_id,
            session_id: self.session_id,
            kind: self.kind,
        }
    }
}

/// Whether two leases may hold one key together: both shared, or permits of one limit.
fn same_family(a: LeaseKind, b: LeaseKind) -> bool {
    match (a, b) {
        (LeaseKind::Shared, LeaseKind::Shared) => true,
        (LeaseKind::Permits { limit: x, .. }, LeaseKind::Permits { limit: y, .. }) => x == y,
        _ => false,
    }
}

impl LeaseReplay {
    /// Applies a Reserve, Grant, Free, Renew or session record; `false` for any other record
    /// (the snapshot markers), which is the caller's to handle.
    pub fn apply(&mut self, record: &Record<'_>) -> bool {
        match *record {
            Record::Reserve { token_limit } => self.token_floor = self.token_floor.max(token_limit),
            Record::Grant {
                key,
                lease_id,
                token,
                ttl_ms,
                flags,
                meta,
                acquire_id,
                session_id,
                kind,
            } => {
                self.raise_floor(token);
                let held = Held {
                    lease_id: LeaseId(lease_id),
                    token,
                    ttl_ms,
                    flags,
                    meta: meta.to_vec(),
                    acquire_id: acquire_id.map(AcquireId),
                    session_id: session_id.map(SessionId),
                    kind,
                };
                if kind.is_exclusive() {
                    self.grant_exclusive(key, held);
                } else {
                    self.grant_shared(key, held);
                }
            }
            Record::Free { key, token, .. } => {
                self.raise_floor(token);
                if self.leases.get(key).is_some_and(|held| held.token == token) {
                    self.leases.remove(key);
                } else if let Some(holders) = self.shared.get_mut(key) {
                    holders.retain(|held| held.token != token);
                    if holders.is_empty() {
                        self.shared.remove(key);
                    }
                }
            }
            Record::Renew { key, token, ttl_ms } => {
                self.raise_floor(token);
                let shared = self.shared.get_mut(key).into_iter().flatten();
                if let Some(held) = self
                    .leases
                    .get_mut(key)
                    .into_iter()
                    .chain(shared)
                    .find(|held| held.token == token)
                {
                    held.ttl_ms = ttl_ms;
                }
            }
            Record::SessionOpen {
                session_id,
                ttl_ms,
                owner,
            } => {
                self.sessions
                    .insert(SessionId(session_id), (ttl_ms, owner.to_vec()));
            }
            Record::SessionEnd { session_id, .. } => {
                self.sessions.remove(&SessionId(session_id));
            }
            Record::SnapshotBegin { .. } | Record::SnapshotEnd { .. } => return false,
        }
        true
    }

    /// Whether `held` still holds: in no session, or in one still open.
    fn stands(sessions: &HashMap<SessionId, (u32, Vec<u8>)>, held: &Held) -> bool {
        held.session_id.is_none_or(|id| sessions.contains_key(&id))
    }

    /// The open sessions as recovery reports them.
    pub fn to_sessions(&self) -> Vec<RecoveredSession> {
        self.sessions
            .iter()
            .map(|(id, (ttl_ms, owner))| RecoveredSession {
                session_id: *id,
                ttl_ms: *ttl_ms,
                owner: owner.clone(),
            })
            .collect()
    }

    /// An exclusive grant: the key's only holder from now on.
    fn grant_exclusive(&mut self, key: &[u8], held: Held) {
        if !self.shared.is_empty() {
            self.shared.remove(key);
        }
        match self.leases.get_mut(key) {
            Some(slot) => *slot = held,
            None => {
                self.leases.insert(key.to_vec(), held);
            }
        }
    }

    /// A shared or permit grant: one more holder of the key (a snapshot's copy of one it
    /// has replaces it).
    fn grant_shared(&mut self, key: &[u8], held: Held) {
        self.leases.remove(key);
        let holders = self.shared.entry(key.to_vec()).or_default();
        // A holder of another family (another limit) must have ended unseen: the table never
        // mixes them on one key.
        holders.retain(|other| other.token != held.token && same_family(other.kind, held.kind));
        holders.push(held);
    }

    /// Every held lease, exclusive and shared, by key (a lease of an ended session left
    /// out).
    pub fn held(&self) -> impl Iterator<Item = (&Vec<u8>, &Held)> {
        let shared = self
            .shared
            .iter()
            .flat_map(|(key, holders)| holders.iter().map(move |held| (key, held)));
        let sessions = &self.sessions;
        self.leases
            .iter()
            .chain(shared)
            .filter(move |(_, held)| Self::stands(sessions, held))
    }

    /// Every held lease, taken (a lease of an ended session left out).
    pub fn into_held(self) -> impl Iterator<Item = (Vec<u8>, Held)> {
        let shared = self
            .shared
            .into_iter()
            .flat_map(|(key, holders)| holders.into_iter().map(move |held| (key.clone(), held)));
        let sessions = self.sessions;
        self.leases
            .into_iter()
            .chain(shared)
            .filter(move |(_, held)| Self::stands(&sessions, held))
    }

    fn raise_floor(&mut self, token: u64) {
        self.token_floor = self.token_floor.max(token.saturating_add(1));
    }

    /// The held leases as recovery reports them.
    pub fn to_recovered(&self) -> Vec<RecoveredLease> {
        self.held()
            .map(|(key, held)| RecoveredLease {
                key: key.clone(),
                lease_id: held.lease_id,
                token: held.token,
                ttl_ms: held.ttl_ms,
                flags: held.flags,
                meta: held.meta.clone(),
                acquire_id: held.acquire_id,
                session_id: held.session_id,
                kind: held.kind,
            })
            .collect()
    }
}
