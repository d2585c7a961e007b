//! A repeat of an ACQUIRE (same key, same acquire id): answered with the first one's lease
//! while it runs, or with how it ended, and never granted twice (PROTOCOL.md "Acquire ids").

use std::sync::Arc;

use tenure_protocol::{AcquireId, Response};

use super::{clamp_ms, Executor, Outcome, WaitResult, WaitSlot};
use crate::obs::stats::Stats;
use crate::table::{LockTable, Repeat};

impl Executor {
    /// The answer to a repeat of `acquire_id` on `key`, or `None` if nothing is known of it
    /// (a first send, or one forgotten): then it is acquired as any ACQUIRE. Changes nothing
    /// but what settling the key would change anyway (a lease past its deadline ends).
    pub(super) fn repeat(
        self: &Arc<Self>,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        key: &[u8],
        acquire_id: AcquireId,
    ) -> Option<Outcome> {
        let repeat = shard.repeat_of(now_ms, key, acquire_id);
        self.repeat_answer(shard, now_ms, key, acquire_id, repeat)
    }

    /// [`Executor::repeat`] for a repeat found to meet `repeat` at `now_ms`.
    pub(super) fn repeat_answer(
        self: &Arc<Self>,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        key: &[u8],
        acquire_id: AcquireId,
        mut repeat: Repeat,
    ) -> Option<Outcome> {
        if repeat == Repeat::Unsettled {
            // Its lease is past its deadline: it ends first, so the repeat hears "expired".
            let mut events = Vec::new();
            shard.settle_key(now_ms, key, &self.tokens.allocator, &mut events);
            self.apply_events(shard, now_ms, &mut events);
            repeat = shard.repeat_of(now_ms, key, acquire_id);
        }
        let response = match repeat {
            Repeat::New => return None,
            Repeat::Unsettled => unreachable!("a settled key's lease is not past its deadline"),
            Repeat::Live {
                token,
                lease_id,
                ttl_left_ms,
                ticket,
            } => {
                // The reply waits for the grant's own record, as the first reply did: a
                // repeat arriving before it is durable must not show it early.
                let response = Response::Regranted {
                    token,
                    lease_id,
                    ttl_left_ms: clamp_ms(ttl_left_ms),
                };
                Stats::bump(&self.stats.repeats);
                return Some(self.confirmed(response, ticket));
            }
            Repeat::Ended { how, token } => Response::AcquireEnded { how, token },
        };
        Stats::bump(&self.stats.repeats);
        Some(self.confirmed(response, crate::journal::TICKET_NOW))
    }

    /// What a waiter with `acquire_id`, handed `key`, is told instead of a grant if it
    /// repeats an ACQUIRE already granted: `None` for a first send (then it is granted).
    /// A second send that queued beside the first meets its lease ended by its turn on a
    /// plain key (it held the key the second waited for): ACQUIRE_ENDED. On a read/write
    /// or semaphore key another send's lease may still hold beside this grant (both
    /// granted in one pass over the queue; the hand-offs are made in no promised order):
    /// REGRANTED with it.
    pub(super) fn repeat_in_line(
        &self,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        key: &[u8],
        acquire_id: AcquireId,
    ) -> Option<WaitResult> {
        match shard.repeat_of(now_ms, key, acquire_id) {
            Repeat::Ended { how, token } => Some(WaitResult::Ended { how, token }),
            Repeat::Live {
                token,
                lease_id,
                ttl_left_ms,
                ticket,
            } => Some(WaitResult::Regranted {
                token,
                lease_id,
                ttl_left_ms,
                ticket,
            }),
            Repeat::New | Repeat::Unsettled => None,
        }
    }
}
