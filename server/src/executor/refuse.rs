//! The executor's refusals: the error replies for a request it will not run, each naming
//! the limit or failure and counting it in STATS `errors`.

use tenure_protocol::{ErrorCode, FrameError, Response};

use super::{error, Executor};
use crate::journal::JournalError;
use crate::obs::stats::Stats;
use crate::table;

impl Executor {
    pub(super) fn ttl_too_long(&self, ttl_ms: u32) -> Response {
        Stats::bump(&self.stats.errors);
        error(ErrorCode::BadTtl, self.ttl_too_long_message(ttl_ms))
    }

    fn ttl_too_long_message(&self, ttl_ms: u32) -> String {
        format!(
            "ttl_ms {ttl_ms} over this server's limit of {}",
            self.config.ttl_ms_max
        )
    }

    /// The reason to answer a request that could not be decoded with: the decoder's, but a
    /// lease length over the wire format's range is told this server's own limit
    /// (`--ttl-max-ms`), as one under it would be, so a client hears one bound, not two.
    pub fn undecodable_message(&self, e: FrameError) -> String {
        match e.refused_ttl_ms() {
            Some(ttl_ms) if ttl_ms > self.config.ttl_ms_max => self.ttl_too_long_message(ttl_ms),
            // Under the shortest lease: the decoder's own words.
            _ => e.message,
        }
    }

    /// Whether [`Executor::refuse_acquire`] may refuse an acquire now: the same checks,
    /// counting nothing, so a repeat (which no refusal refuses) is found first.
    pub(super) fn may_refuse_acquire(&self, now_ms: u64, ttl_ms: u32) -> bool {
        ttl_ms > self.config.ttl_ms_max
            || now_ms < self.grants_refused_until_ms
            || self.journal.failed().is_some()
    }

    /// Why an acquire must be refused before the table is touched, if it must.
    pub(super) fn refuse_acquire(&self, now_ms: u64, ttl_ms: u32) -> Option<Response> {
        if ttl_ms > self.config.ttl_ms_max {
            return Some(self.ttl_too_long(ttl_ms));
        }
        if now_ms < self.grants_refused_until_ms {
            Stats::bump(&self.stats.errors);
            let left_ms = self.grants_refused_until_ms - now_ms;
            let message =
                format!("restarted in token-only durability: no grants for {left_ms} ms more");
            return Some(error(ErrorCode::Recovering, message));
        }
        self.refuse_if_journal_failed()
    }

    /// The refusal for a limit the table hit, naming the limit and its setting.
    /// The answer to an ACQUIRE whose kind does not fit its key (see `table::shared`).
    pub(super) fn kind_mismatch(
        &self,
        asked: tenure_protocol::LeaseKind,
        key_limit: Option<u32>,
    ) -> Response {
        Stats::bump(&self.stats.errors);
        let message = match (key_limit, asked) {
            (Some(limit), tenure_protocol::LeaseKind::Permits { limit: asked, .. }) => {
                format!("the key is a semaphore of {limit} permits, not {asked}")
            }
            (Some(limit), _) => format!(
                "the key is a semaphore of {limit} permits: acquire it with PERMITS={limit}"
            ),
            (None, _) => "the key is a lock (plain or read/write), not a semaphore".to_string(),
        };
        Response::Error {
            code: ErrorCode::KindMismatch,
            message,
        }
    }

    pub(super) fn full_error(&self, limit: table::Limit) -> Response {
        Stats::bump(&self.stats.errors);
        let config = &self.config;
        let (code, message) = match limit {
            table::Limit::HeldLocks => (
                ErrorCode::HeldLimit,
                format!(
                    "the server holds {}, its limit (--held-max)",
                    count_of(self.quotas.held.count(), config.held_max, "locks")
                ),
            ),
            table::Limit::Waiters => (
                ErrorCode::WaitersLimit,
                format!(
                    "the server has {}, its limit (--waiters-max)",
                    count_of(self.quotas.waiters.count(), config.waiters_max, "waiters")
                ),
            ),
            table::Limit::WaitersPerKey => (
                ErrorCode::WaitersLimit,
                format!(
                    "this key has {} waiters, its limit (--waiters-per-key-max)",
                    config.waiters_per_key_max
                ),
            ),
        };
        error(code, message)
    }

    pub(super) fn unavailable(&self, e: &JournalError) -> Response {
        Stats::bump(&self.stats.errors);
        if let JournalError::NotLeader(leader) = e {
            return error(ErrorCode::NotLeader, leader.as_ref());
        }
        tracing::error!(error = %e, "a change could not be logged; refusing it");
        error(
            ErrorCode::Unavailable,
            format!("not durable, nothing changed: {e}"),
        )
    }

    /// A refusal for a change the journal can no longer make durable, checked before the
    /// table is touched, so "nothing changed" is true when it is said.
    pub(super) fn refuse_if_journal_failed(&self) -> Option<Response> {
        let failed = self.journal.failed()?;
        Stats::bump(&self.stats.errors);
        if let Some(leader) = self.journal.not_leader() {
            return Some(error(ErrorCode::NotLeader, leader.as_ref()));
        }
        let message = format!("not durable, nothing changed: the WAL failed: {failed}");
        Some(error(ErrorCode::Unavailable, message))
    }

    /// Cluster mode: the `NOT_LEADER` refusal while this node does not lead.
    pub(super) fn refuse_if_not_leader(&self) -> Option<Response> {
        let leader = self.journal.not_leader()?;
        Stats::bump(&self.stats.errors);
        Some(error(ErrorCode::NotLeader, leader.as_ref()))
    }
}

/// "`count` `things`" for a limit's refusal, `count` being the real count: at least `max` (it
/// was reached), and above it when more are held than the limit lets in now (leases brought
/// back by a restart with a lower limit, or several waiters handed a key at once), then
/// "`count` `things`, over `max`".
fn count_of(count: usize, max: usize, things: &str) -> String {
    if count > max {
        format!("{count} {things}, over {max}")
    } else {
        format!("{max} {things}")
    }
}
