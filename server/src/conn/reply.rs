//! The reply queue: replies wait here, in order, until the journal is durable past the change
//! they report; then they are encoded into the write buffer. Pushed frames (watch events,
//! the end of a watch) go through the same queue, so nothing overtakes an earlier reply.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, Response};

use super::Conn;
use crate::executor::Undo;
use crate::executor::WatchEvent;
use crate::journal::{self, Progress, Settled, Ticket, TICKET_NOW};
use crate::obs::metrics::Timing;

/// A reply waiting for the journal to be durable up to `ticket`.
pub(super) struct PendingReply {
    ticket: Ticket,
    id: u64,
    reply: Reply,
    /// For a grant or release: how to take it back if its record never becomes durable.
    undo: Option<Undo>,
    /// Pushed by the server (an event, or the end of a watch), not the answer to a request.
    pushed: bool,
    /// When the request this answers was read, for its latency metric.
    timing: Option<Timing>,
}

/// A protocol response, or a console-only line (HELP, BYE) that has no binary form.
enum Reply {
    Response(Response),
    Line(&'static str),
}

impl Conn {
    pub(super) fn on_event(&mut self, event: WatchEvent) {
        self.push_event(event);
        self.end_watches_if_overflowed();
    }

    /// Queues an event, unless its watch has ended since it was queued.
    fn push_event(&mut self, event: WatchEvent) {
        if self.ctx.is_live(&event) {
            self.queue_event(event);
        }
    }

    pub(super) fn queue_event(&mut self, event: WatchEvent) {
        let WatchEvent {
            watch_id,
            kind,
            key,
            token,
            meta,
        } = event;
        let response = Response::Event {
            kind,
            key,
            token,
            meta,
        };
        self.push_pushed(watch_id, response);
    }

    /// If the event queue overflowed: sends every event it still holds (all from before the
    /// overflow), then ends each watch with its own WATCH_LIMIT error, so no event of a watch
    /// follows its end. The queue is dropped; a later WATCH starts a new one.
    pub(super) fn end_watches_if_overflowed(&mut self) {
        let overflowed = self
            .ctx
            .sink
            .as_ref()
            .is_some_and(|sink| sink.overflowed.load(Ordering::Relaxed));
        if !overflowed {
            return;
        }
        // The full queue takes nothing more, so this drains it (bounded by its size).
        while let Some(event) = self.ctx.events.as_mut().and_then(|rx| rx.try_recv().ok()) {
            self.push_event(event);
        }
        let mut ended: Vec<(Bytes, u64)> = self.ctx.watches.drain().collect();
        ended.sort_unstable_by_key(|&(_, id)| id);
        for (key, watch_id) in ended {
            self.executor.watches().remove(&key, self.ctx.conn_id);
            let message = "events were not read fast enough; every watch on this connection ended"
                .to_string();
            let code = ErrorCode::WatchLimit;
            self.push_pushed(watch_id, Response::Error { code, message });
        }
        // Dropping the receiver makes a notification racing with this one fail harmlessly.
        self.ctx.sink = None;
        self.ctx.events = None;
    }

    /// Queues a frame that answers no request: an event or the end of a watch.
    pub(super) fn push_pushed(&mut self, id: u64, response: Response) {
        self.events_queued += 1;
        self.queue.push_back(PendingReply {
            ticket: TICKET_NOW,
            id,
            reply: Reply::Response(response),
            undo: None,
            pushed: true,
            timing: None,
        });
    }

    /// Queues the reply to request `id`, to be sent once `ticket` is durable.
    pub(super) fn push(&mut self, id: u64, response: Response, ticket: Ticket) {
        self.queue.push_back(PendingReply {
            ticket,
            id,
            reply: Reply::Response(response),
            undo: None,
            pushed: false,
            timing: self.timing.take(),
        });
    }

    /// Queues the reply to a grant or release, with the way to undo it.
    pub(super) fn push_change(&mut self, id: u64, response: Response, ticket: Ticket, undo: Undo) {
        self.queue.push_back(PendingReply {
            ticket,
            id,
            reply: Reply::Response(response),
            undo: Some(undo),
            pushed: false,
            timing: self.timing.take(),
        });
    }

    /// Console-only lines carry no state, so they need no durability; they still go through
    /// the queue to stay in order behind earlier replies.
    pub(super) fn push_line(&mut self, line: &'static str) {
        self.queue.push_back(PendingReply {
            ticket: TICKET_NOW,
            id: 0,
            reply: Reply::Line(line),
            undo: None,
            pushed: false,
            timing: None,
        });
    }

    /// Moves every reply whose ticket is settled into the write buffer, in order: as it is
    /// if durable, or, if the journal failed first, as an error after taking the change back.
    pub(super) fn flush_ready(&mut self, progress: &Progress) {
        // One clock read and one tally for the replies flushed together (see `metrics`).
        let mut now = None;
        let mut tally = crate::obs::metrics::ReplyTally::default();
        while let Some(front) = self.queue.front() {
            let settled = journal::settle(front.ticket, progress);
            if let Settled::Waiting = settled {
                break;
            }
            let PendingReply {
                id,
                reply,
                undo,
                pushed,
                timing,
                ..
            } = self.queue.pop_front().expect("front exists");
            if pushed {
                self.events_queued -= 1;
            }
            let response = match reply {
                Reply::Response(response) => response,
                Reply::Line(line) => {
                    self.wbuf.extend_from_slice(line.as_bytes());
                    self.wbuf.extend_from_slice(b"\n");
                    continue;
                }
            };
            let response = match settled {
                // The journal cut the record off; take the change back here too, so that
                // "nothing changed" holds now as well as after a restart.
                Settled::Lost(why) => {
                    crate::executor::answer_lost(&self.executor, &mut self.ctx, undo, &why)
                }
                Settled::Durable | Settled::Waiting => response,
            };
            if let Some(timing) = timing {
                let at = *now.get_or_insert_with(std::time::Instant::now);
                let metrics = &self.executor.stats().metrics;
                metrics.tally(&mut tally, timing, &response, at);
            }
            self.surface.encode(id, &response, &mut self.wbuf);
        }
        self.executor.stats().metrics.add_tally(&mut tally);
    }
}
