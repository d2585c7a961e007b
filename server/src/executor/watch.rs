//! Watches: connections subscribed to a key's changes.
//!
//! The registry is a `DashMap` from key to subscribers: notifications come from whichever task
//! changed the key (a connection, or the expiry ticker) while holding that key's shard lock, so
//! the registry must be reachable from every task without a lock of its own that all of them
//! would share. Keys nobody watches cost one atomic load per change.
//!
//! Delivery never waits: each watching connection has a bounded queue. A connection that does
//! not read its events fast enough loses its watches (and is told so) rather than slowing the
//! task that changed the key or growing memory. Once an event did not fit, the queue takes no
//! more: what it holds is a gap-free prefix of every watched key's changes, which the
//! connection sends before it reports the watches ended.
//!
//! WATCH and UNWATCH themselves are here too (`Executor::watch`); the connection's side of
//! its watches (its queue, its watched keys) is its [`Session`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;
use tenure_protocol::EventKind;
use tokio::sync::mpsc;

use super::Session;
use super::{error, holder, Executor};
use crate::obs::stats::Stats;
use tenure_protocol::{ErrorCode, Response};

/// One change pushed to a watching connection.
#[derive(Clone, Debug)]
pub struct WatchEvent {
    /// The request id of the WATCH this event answers.
    pub watch_id: u64,
    /// What happened.
    pub kind: EventKind,
    /// The key that changed.
    pub key: Bytes,
    /// The token of the lease granted, released or expired.
    pub token: u64,
    /// The new holder's metadata, for grants.
    pub meta: Bytes,
}

/// The receiving end of one connection's events, and its overflow flag.
pub struct WatchSink {
    tx: mpsc::Sender<WatchEvent>,
    /// Set when an event did not fit; from then on the sink takes no events, and the
    /// connection ends its watches once it has sent the ones queued before.
    pub overflowed: AtomicBool,
}

impl WatchSink {
    /// A sink with room for `queue_max` undelivered events, and its receiver.
    pub fn new(queue_max: usize) -> (Arc<WatchSink>, mpsc::Receiver<WatchEvent>) {
        let (tx, rx) = mpsc::channel(queue_max.max(1));
        (
            Arc::new(WatchSink {
                tx,
                overflowed: AtomicBool::new(false),
            }),
            rx,
        )
    }
}

struct Subscriber {
    conn_id: u64,
    watch_id: u64,
    sink: Arc<WatchSink>,
}

/// Every watch on the server.
#[derive(Default)]
pub struct Watches {
    by_key: DashMap<Bytes, Vec<Subscriber>>,
    count: AtomicUsize,
}

impl Watches {
    /// Subscribes `conn_id`'s `watch_id` to `key`. Replaces an earlier watch of the same key by
    /// the same connection, so a repeated WATCH does not double the events.
    pub fn add(&self, key: Bytes, conn_id: u64, watch_id: u64, sink: &Arc<WatchSink>) {
        let mut subs = self.by_key.entry(key).or_default();
        if let Some(sub) = subs.iter_mut().find(|s| s.conn_id == conn_id) {
            sub.watch_id = watch_id;
            sub.sink = Arc::clone(sink);
            return;
        }
        subs.push(Subscriber {
            conn_id,
            watch_id,
            sink: Arc::clone(sink),
        });
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends `conn_id`'s watch on `key`; returns whether there was one.
    pub fn remove(&self, key: &[u8], conn_id: u64) -> bool {
        let mut removed = false;
        // The closure edits the list in place and asks for the entry to go once it is empty.
        self.by_key.remove_if_mut(key, |_, subs| {
            let before = subs.len();
            subs.retain(|s| s.conn_id != conn_id);
            removed = subs.len() < before;
            subs.is_empty()
        });
        if removed {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
        removed
    }

    /// Number of watches on the server.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether nobody watches anything.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pushes a change of `key` to its watchers without waiting. A watcher whose queue is
    /// full is marked overflowed and gets no later event: it would leave a gap. Callers hold
    /// `key`'s shard lock, so one key's events enter every queue in the order of its changes.
    pub fn notify(&self, key: &[u8], kind: EventKind, token: u64, meta: &[u8]) {
        if self.is_empty() {
            return;
        }
        let Some(subs) = self.by_key.get(key) else {
            return;
        };
        let key = subs.key().clone();
        let meta = Bytes::copy_from_slice(meta);
        for sub in subs.iter() {
            if sub.sink.overflowed.load(Ordering::Relaxed) {
                continue;
            }
            let event = WatchEvent {
                watch_id: sub.watch_id,
                kind,
                key: key.clone(),
                token,
                meta: meta.clone(),
            };
            if sub.sink.tx.try_send(event).is_err() {
                sub.sink.overflowed.store(true, Ordering::Relaxed);
            }
        }
    }
}

impl Executor {
    /// Starts (or replaces) this connection's watch of `key` and answers with the key's state.
    ///
    /// Under the key's shard lock, so no change can fall between: the key is settled (a lease
    /// over by the clock ends now, with its event), events already queued for this connection
    /// are taken out to go before the reply, the state is read, and the watch registered.
    /// Every change after that is notified under the same lock, so it comes as an event after
    /// the reply; every change before it is in the state or in an event before the reply.
    pub(crate) fn watch(
        self: &Arc<Self>,
        ctx: &mut Session,
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
        shard.settle_key(now_ms, &key, &self.tokens.allocator, &mut events);
        self.apply_events(&mut shard, now_ms, &mut events);
        ctx.drain_live_events();
        let holder = holder(shard.inspect(now_ms, &key));
        let sink = ctx.sink_or_new(self.config.watch_queue_max);
        self.watches
            .add(key.clone(), ctx.conn_id, request_id, &sink);
        drop(shard);
        ctx.watches.insert(key, request_id);
        Response::Watching { holder }
    }

    /// Ends this connection's watch of `key`, if it has one.
    ///
    /// Every change notified before the watch leaves the registry is sent before UNWATCHED,
    /// even one this connection's own request made a moment ago whose event has not been
    /// picked up yet (pipelined `ACQUIRE k`, `UNWATCH k`): the event is drained while the
    /// watch still counts as live, and nothing can be notified after the registry removal.
    pub(crate) fn unwatch(&self, ctx: &mut Session, key: &[u8]) -> Response {
        if ctx.watches.contains_key(key) {
            self.watches.remove(key, ctx.conn_id);
            ctx.drain_live_events();
            ctx.watches.remove(key);
        }
        Response::Unwatched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_notify_remove() {
        let watches = Watches::default();
        let (sink, mut rx) = WatchSink::new(2);
        let key = Bytes::from_static(b"k");
        watches.notify(b"k", EventKind::Granted, 1, b"");
        assert!(rx.try_recv().is_err(), "no watch yet");
        watches.add(key.clone(), 1, 10, &sink);
        watches.add(key.clone(), 1, 11, &sink); // replaces, does not double
        assert_eq!(watches.len(), 1);
        watches.notify(b"k", EventKind::Granted, 5, b"m");
        let event = rx.try_recv().unwrap();
        assert_eq!(
            (event.watch_id, event.token, &event.meta[..]),
            (11, 5, &b"m"[..])
        );
        watches.notify(b"other", EventKind::Expired, 6, b"");
        assert!(rx.try_recv().is_err());
        // Overflow marks the sink instead of blocking.
        for token in 0..3 {
            watches.notify(b"k", EventKind::Released, token, b"");
        }
        assert!(sink.overflowed.load(Ordering::Relaxed));
        // Once overflowed, nothing more enters, even with room again: no gaps.
        while rx.try_recv().is_ok() {}
        watches.notify(b"k", EventKind::Released, 9, b"");
        assert!(rx.try_recv().is_err(), "an event after the gap was queued");
        assert!(watches.remove(b"k", 1));
        assert!(!watches.remove(b"k", 1));
        assert!(watches.is_empty());
    }
}
