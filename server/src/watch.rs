//! Watches: connections subscribed to a key's changes.
//!
//! The registry is a `DashMap` from key to subscribers: notifications come from whichever task
//! changed the key (a connection, or the expiry ticker) while holding that key's shard lock, so
//! the registry must be reachable from every task without a lock of its own that all of them
//! would share. Keys nobody watches cost one atomic load per change.
//!
//! Delivery never waits: each watching connection has a bounded queue. A connection that does
//! not read its events fast enough loses its watches (and is told so) rather than slowing the
//! task that changed the key or growing memory.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;
use tenure_protocol::EventKind;
use tokio::sync::mpsc;

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
    /// Set when an event did not fit: the connection's watches were dropped.
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
            return;
        }
        subs.push(Subscriber {
            conn_id,
            watch_id,
            sink: Arc::clone(sink),
        });
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether `conn_id` watches `key`.
    pub fn is_watching(&self, key: &[u8], conn_id: u64) -> bool {
        self.by_key
            .get(key)
            .is_some_and(|subs| subs.iter().any(|s| s.conn_id == conn_id))
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
    /// full is marked overflowed; its connection drops its watches and reports it.
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
        assert!(watches.remove(b"k", 1));
        assert!(!watches.remove(b"k", 1));
        assert!(watches.is_empty());
    }
}
