//! [`ConnCtx`]: what one connection leaves in the shared state, so it can take it all back
//! when it closes: the leases to release on disconnect, its waiters, and its watches (the
//! event queue and the watched keys).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use tenure_protocol::LeaseId;
use tokio::sync::mpsc;

use crate::executor::Executor;
use crate::wal::FreeReason;
use crate::watch::{WatchEvent, WatchSink};

/// Per-connection facts the executor needs, and what the connection must undo on close.
pub struct ConnCtx {
    /// Server-unique connection number.
    pub conn_id: u64,
    /// Leases to release when the connection closes (acquired with release-on-disconnect).
    owned: Vec<(Bytes, LeaseId)>,
    /// Waiters (queued acquires) by request id: the key and the table's waiter id.
    waits: HashMap<u64, (Bytes, u64)>,
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
}

impl ConnCtx {
    /// A context for a new connection.
    pub fn new(conn_id: u64) -> ConnCtx {
        ConnCtx {
            conn_id,
            owned: Vec::new(),
            waits: HashMap::new(),
            sink: None,
            events: None,
            watches: HashMap::new(),
            drained: Vec::new(),
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

    /// Remembers a waiter this connection queued for request `id`.
    pub fn add_wait(&mut self, id: u64, key: Bytes, waiter_id: u64) {
        self.waits.insert(id, (key, waiter_id));
    }

    /// Forgets the waiter of request `id`: it was answered.
    pub fn remove_wait(&mut self, id: u64) {
        self.waits.remove(&id);
    }

    /// Takes this connection's waiters out of their queues. Each one's channel then closes,
    /// and the connection answers it with the reason it is ending.
    pub fn cancel_waits(&mut self, executor: &Executor) {
        for (_, (key, waiter_id)) in self.waits.drain() {
            executor.shard(&key).cancel_waiter(&key, waiter_id);
        }
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
        executor.cancel_waits(self.waits.drain().map(|(_, wait)| wait));
        let now_ms = executor.clock.now_ms();
        for (key, lease_id) in self.owned.drain(..) {
            let mut shard = executor.shard(&key);
            executor.free(&mut shard, now_ms, &key, lease_id, FreeReason::Disconnected);
        }
    }
}
