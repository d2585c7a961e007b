//! [`Session`]: what one connection leaves in the shared state, so it can take it all back
//! when it closes: the leases to release on disconnect, its waiters, and its watches (the
//! event queue and the watched keys).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use tenure_protocol::{LeaseId, SessionId};
use tokio::sync::mpsc;

use super::watch::{WatchEvent, WatchSink};
use super::Executor;
use crate::identity::Usage;
use crate::record::FreeReason;

/// Per-connection facts the executor needs, and what the connection must undo on close.
pub struct Session {
    /// Server-unique connection number.
    pub conn_id: u64,
    /// The peer's address, for logs and the failed-AUTH throttle.
    pub peer: std::net::SocketAddr,
    /// Leases to release when the connection closes (acquired with release-on-disconnect).
    owned: Vec<(Bytes, LeaseId)>,
    /// Waiters (queued acquires) by request id: the key, the table's waiter id, and the
    /// session the ACQUIRE named (whose count of waiters it is in).
    waits: HashMap<u64, Wait>,
    /// This connection's event queue, created on its first WATCH.
    pub sink: Option<Arc<WatchSink>>,
    /// Receiver of `sink`, read by the connection loop.
    pub events: Option<mpsc::Receiver<WatchEvent>>,
    /// The keys this connection watches, each with the request id of its WATCH: one watch per
    /// key, a repeated WATCH replaces it.
    pub watches: HashMap<Bytes, u64>,
    /// Events a WATCH took out of `events` so they are sent before its reply (see
    /// `Executor::watch`); the connection sends them, then the reply.
    pub drained: Vec<WatchEvent>,
    /// Who this connection is, when identities are configured.
    pub auth: Auth,
    /// The held-locks place of the acquire being run (identities only): a grant keeps it.
    pub held_place: Option<crate::identity::PlaceCell>,
    /// The identity's quota refusal of the acquire being run, given only if it is not a
    /// repeat: a repeat is not a new hold, so it is answered before any quota (PROTOCOL.md
    /// 3.7, "Which refusal comes first").
    pub refusal_unless_repeat: Option<tenure_protocol::Response>,
    /// The deadline of the session the acquire being run names, for its waiter's slot.
    pub(super) session_deadline: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// One queued acquire of a connection: its key, the table's waiter id, its session.
type Wait = (Bytes, u64, Option<SessionId>);

/// A connection's standing when identities are configured.
#[derive(Debug)]
pub enum Auth {
    /// No identities are configured: everything is allowed, nothing is counted.
    Open,
    /// Not authenticated yet, after `failures` failed AUTHs.
    Pending {
        /// Failed AUTHs on this connection so far.
        failures: u32,
    },
    /// Authenticated as `name`; its waiters count against `usage`.
    As {
        /// The identity's name (looked up again per request, so a reload applies at once).
        name: String,
        /// The identity's counters, shared by all its connections.
        usage: Arc<Usage>,
        /// What proved it, which must still hold after a reload.
        credential: Credential,
    },
}

/// How a connection proved its identity.
#[derive(Debug, Clone)]
pub enum Credential {
    /// AUTH with the secret whose hash this was: a reload that changes the hash (a rotated
    /// secret) ends the session.
    Secret(Arc<str>),
    /// A client certificate (mutual TLS) with the identity's name.
    Certificate,
}

impl Credential {
    /// Whether this credential still proves `identity` as the identities in force have it.
    pub fn holds_for(&self, identity: &crate::identity::Identity) -> bool {
        match self {
            Credential::Secret(hash) => **hash == *identity.secret_hash(),
            Credential::Certificate => true,
        }
    }
}

impl Auth {
    fn usage(&self) -> Option<&Usage> {
        match self {
            Auth::As { usage, .. } => Some(usage),
            _ => None,
        }
    }
}

impl Session {
    /// A context for a new connection.
    pub fn new(conn_id: u64) -> Session {
        Session::with_peer(conn_id, std::net::SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// A context for a new connection from `peer`.
    pub fn with_peer(conn_id: u64, peer: std::net::SocketAddr) -> Session {
        Session {
            conn_id,
            peer,
            owned: Vec::new(),
            waits: HashMap::new(),
            sink: None,
            events: None,
            watches: HashMap::new(),
            drained: Vec::new(),
            auth: Auth::Open,
            held_place: None,
            refusal_unless_repeat: None,
            session_deadline: None,
        }
    }

    /// Remembers a release-on-disconnect lease.
    pub fn own(&mut self, key: Bytes, lease_id: LeaseId) {
        self.owned.push((key, lease_id));
    }

    /// Forgets `lease_id` on `key`: it was released.
    pub fn disown(&mut self, key: &[u8], lease_id: LeaseId) {
        self.owned
            .retain(|(k, l)| !(*l == lease_id && k.as_ref() == key));
    }

    /// Forgets `lease_id` on whatever key: its grant was taken back.
    pub fn forget_owned(&mut self, lease_id: LeaseId) {
        self.owned.retain(|(_, l)| *l != lease_id);
    }

    /// Remembers a waiter this connection queued for request `id`, in `session` if its
    /// ACQUIRE named one.
    pub fn add_wait(&mut self, id: u64, key: Bytes, waiter_id: u64, session: Option<SessionId>) {
        self.waits.insert(id, (key, waiter_id, session));
    }

    /// Forgets the waiter of request `id`: it was answered.
    pub fn remove_wait(&mut self, id: u64) {
        if self.waits.remove(&id).is_some() {
            self.give_back_waiters(1);
        }
    }

    /// Returns `n` waiter places to this connection's identity (when it has one: an
    /// authenticated connection counts every waiter it queues, see `conn::auth`).
    fn give_back_waiters(&self, n: usize) {
        if let Some(usage) = self.auth.usage() {
            for _ in 0..n {
                usage.give_back_waiter();
            }
        }
    }

    /// Takes the waiters on keys `drop` selects out of their queues, and returns their request
    /// ids; each one's channel then closes, and the connection answers it.
    pub fn cancel_waits_where(
        &mut self,
        executor: &Executor,
        mut drop: impl FnMut(&[u8]) -> bool,
    ) -> Vec<u64> {
        let ids: Vec<u64> = self
            .waits
            .iter()
            .filter(|(_, (key, _, _))| drop(key))
            .map(|(id, _)| *id)
            .collect();
        self.give_back_waiters(ids.len());
        for id in &ids {
            if let Some((key, waiter_id, session)) = self.waits.remove(id) {
                executor.shard(&key).cancel_waiter(&key, waiter_id);
                if let Some(session) = session {
                    executor.forget_session_waiter(session, &key, waiter_id);
                }
            }
        }
        ids
    }

    /// Takes this connection's waiters out of their queues. Each one's channel then closes,
    /// and the connection answers it with the reason it is ending.
    pub fn cancel_waits(&mut self, executor: &Executor) {
        self.give_back_waiters(self.waits.len());
        let waits: Vec<Wait> = self.waits.drain().map(|(_, wait)| wait).collect();
        for (key, waiter_id, _) in &waits {
            executor.shard(key).cancel_waiter(key, *waiter_id);
        }
        forget_in_sessions(executor, &waits);
    }

    /// Whether `event` belongs to a watch this connection still has. An event of a watch
    /// that was ended (UNWATCH, or replaced by a later UNWATCH and WATCH) may still sit in the
    /// queue; it must not be sent after the watch was reported ended.
    pub fn is_live(&self, event: &WatchEvent) -> bool {
        self.watches.get(&event.key) == Some(&event.watch_id)
    }

    /// Moves the events already queued for live watches into `drained`.
    pub fn drain_live_events(&mut self) {
        if let Some(rx) = self.events.as_mut() {
            while let Ok(event) = rx.try_recv() {
                if self.watches.get(&event.key) == Some(&event.watch_id) {
                    self.drained.push(event);
                }
            }
        }
    }

    /// This connection's event queue, made on first use with room for `queue_max` events.
    pub fn sink_or_new(&mut self, queue_max: usize) -> Arc<WatchSink> {
        let events = &mut self.events;
        let sink = self.sink.get_or_insert_with(|| {
            let (sink, rx) = WatchSink::new(queue_max);
            *events = Some(rx);
            sink
        });
        Arc::clone(sink)
    }

    /// Drops everything a closing connection leaves behind: its watches, its waiters, and
    /// the leases it asked to have released on disconnect.
    pub fn disconnect(&mut self, executor: &Arc<Executor>) {
        for (key, _) in self.watches.drain() {
            executor.watches.remove(&key, self.conn_id);
        }
        self.give_back_waiters(self.waits.len());
        let waits: Vec<Wait> = self.waits.drain().map(|(_, wait)| wait).collect();
        executor.cancel_waits(waits.iter().map(|(key, id, _)| (key.clone(), *id)));
        forget_in_sessions(executor, &waits);
        let now_ms = executor.clock.now_ms();
        for (key, lease_id) in self.owned.drain(..) {
            let mut shard = executor.shard(&key);
            executor.free(&mut shard, now_ms, &key, lease_id, FreeReason::Disconnected);
        }
    }
}

/// Takes cancelled waits out of their sessions' counts (one hold of the session table's
/// lock, after the shards', never under one).
fn forget_in_sessions(executor: &Executor, waits: &[Wait]) {
    let mut in_sessions = waits
        .iter()
        .filter_map(|(key, id, s)| Some((key, *id, (*s)?)));
    let Some(first) = in_sessions.next() else {
        return;
    };
    let mut table = executor.sessions().lock();
    for (key, waiter_id, session) in std::iter::once(first).chain(in_sessions) {
        table.forget_waiter(session, key, waiter_id);
    }
}
