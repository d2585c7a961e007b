//! One pipelined connection's state: its protocol, its output buffer, the ops in flight and
//! the backlog. The socket tasks that move its bytes are in `crate::socket`.
//!
//! Everything runs on one thread, so the state of all connections and the scenario sit in one
//! `Rc<RefCell<World>>` (`crate::world`). A scenario *submits* an op: it is encoded at once into
//! the connection's output buffer if fewer than `pipeline_max` requests are in flight, or queued
//! in the backlog (keeping its intended send time, so the wait counts as latency). The writer
//! task swaps the output buffer for its spare and writes it whole, which batches every op
//! submitted since its last write into one `write` call. The reader task reads whatever has
//! arrived and hands it to `World::on_bytes`, which decodes every complete reply, matches it to
//! its op here ([`Conn::take`]) and lets the scenario react.
//!
//! In-flight ops live in a slab whose index is the tenure request id (replies may come back out
//! of order there: blocking acquires); for Redis, which answers in order, a queue of slab
//! indices in send order finds the op instead.

use std::collections::VecDeque;
use std::rc::Rc;

use anyhow::{bail, Context};
use bytes::BytesMut;
use tokio::sync::Notify;

use crate::op::Op;
use crate::proto::Proto;

/// Most ops one connection may hold back for lack of pipeline room before the run is declared
/// overloaded: past this the target is not keeping up and the backlog would only eat memory.
pub const BACKLOG_MAX: usize = 2_000_000;
/// Read buffer growth step, and the output buffer's first size, in bytes.
pub const READ_CHUNK: usize = 64 * 1024;

/// The state of one connection shared by its tasks and the scenario.
pub struct Conn {
    /// Encoder and decoder.
    pub proto: Proto,
    /// Encoded requests not yet handed to the socket.
    pub out: BytesMut,
    /// Wakes the writer when `out` has bytes.
    pub notify: Rc<Notify>,
    /// Why the connection stopped working, if it did.
    pub failed: Option<String>,
    /// Set when the backlog passed [`BACKLOG_MAX`].
    pub overloaded: bool,
    slots: Vec<Option<Op>>,
    free: Vec<u32>,
    order: VecDeque<u32>,
    in_flight: usize,
    pipeline_max: usize,
    backlog: VecDeque<Op>,
}

impl Conn {
    /// A connection allowing `pipeline_max` requests in flight.
    pub fn new(proto: Proto, pipeline_max: usize) -> Conn {
        assert!(pipeline_max >= 1 && pipeline_max <= u32::MAX as usize);
        Conn {
            proto,
            out: BytesMut::with_capacity(READ_CHUNK),
            notify: Rc::new(Notify::new()),
            failed: None,
            overloaded: false,
            slots: Vec::with_capacity(pipeline_max),
            free: Vec::new(),
            order: VecDeque::with_capacity(pipeline_max),
            in_flight: 0,
            pipeline_max,
            backlog: VecDeque::new(),
        }
    }

    /// Sends `op` now if the pipeline has room, else queues it.
    pub fn submit(&mut self, op: Op, now_ns: u64) {
        if self.in_flight < self.pipeline_max && self.backlog.is_empty() {
            self.send(op, now_ns);
        } else if self.backlog.len() < BACKLOG_MAX {
            self.backlog.push_back(op);
        } else {
            self.overloaded = true;
        }
    }

    fn send(&mut self, mut op: Op, now_ns: u64) {
        op.sent_ns = now_ns;
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.slots[slot as usize];
        assert!(entry.is_none(), "slab slot {slot} reused while in flight");
        *entry = Some(op);
        // Request id 0 is reserved by the protocol, so ids are slots shifted by one.
        self.proto.encode(u64::from(slot) + 1, &op, &mut self.out);
        if self.proto.in_order() {
            self.order.push_back(slot);
        }
        self.in_flight += 1;
    }

    /// Removes and returns the op a reply answers: by id, or the oldest for in-order protocols.
    ///
    /// # Errors
    /// When the reply matches nothing in flight: the peer is confused and the stream is lost.
    pub fn take(&mut self, id: Option<u64>) -> anyhow::Result<Op> {
        let slot = match id {
            Some(id) => id
                .checked_sub(1)
                .and_then(|slot| u32::try_from(slot).ok())
                .context("reply id out of range")?,
            None => self
                .order
                .pop_front()
                .context("reply with nothing in flight")?,
        };
        let Some(op) = self.slots.get_mut(slot as usize).and_then(Option::take) else {
            bail!("reply for request id {slot}, which is not in flight");
        };
        self.free.push(slot);
        self.in_flight -= 1;
        Ok(op)
    }

    /// Moves queued ops into the pipeline while it has room.
    pub fn refill(&mut self, now_ns: u64) {
        while self.in_flight < self.pipeline_max {
            let Some(op) = self.backlog.pop_front() else {
                break;
            };
            self.send(op, now_ns);
        }
    }

    /// Requests sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Ops waiting for pipeline room.
    pub fn backlog(&self) -> usize {
        self.backlog.len()
    }

    /// Wakes the writer if there is something to write.
    pub fn flush(&self) {
        if !self.out.is_empty() {
            self.notify.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::OpKind;

    fn ping(tag: u64) -> Op {
        Op {
            kind: OpKind::Ping,
            key: 0,
            lease: 0,
            ttl_ms: 0,
            wait_ms: 0,
            tag,
            intended_ns: 0,
            sent_ns: 0,
            lease_kind: None,
        }
    }

    #[test]
    fn pipeline_limit_backlog_and_out_of_order_replies() {
        let mut conn = Conn::new(Proto::tenure(), 2);
        for tag in 0..5 {
            conn.submit(ping(tag), 0);
        }
        assert_eq!((conn.in_flight(), conn.backlog()), (2, 3));
        // Request ids are slots plus one: id 0 is reserved by the protocol.
        assert_eq!(conn.take(Some(2)).unwrap().tag, 1);
        conn.refill(0);
        assert_eq!((conn.in_flight(), conn.backlog()), (2, 2));
        // Slot 1 was reused by the op tagged 2.
        assert_eq!(conn.take(Some(2)).unwrap().tag, 2);
        assert_eq!(conn.take(Some(1)).unwrap().tag, 0);
        assert!(conn.take(Some(1)).is_err());
        assert!(conn.take(Some(0)).is_err(), "id 0 answers no request");
        assert!(conn.take(Some(9)).is_err());
    }
}
