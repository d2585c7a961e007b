//! Where a reply waiting on a ticket stands against the journal's progress.
use std::sync::Arc;

use super::{Progress, Ticket};

/// What becomes of a reply that waited on a ticket.
pub enum Settled {
    /// Not yet decided: keep waiting.
    Waiting,
    /// Durable (or it never needed the journal): send the reply.
    Durable,
    /// The journal failed before the ticket became durable, for this reason.
    Lost(Arc<str>),
}

/// Where a reply waiting on `ticket` stands, given the journal's `progress`.
pub fn settle(ticket: Ticket, progress: &Progress) -> Settled {
    if ticket <= progress.lsn {
        return Settled::Durable;
    }
    match &progress.failed {
        Some(why) => Settled::Lost(Arc::clone(why)),
        None => Settled::Waiting,
    }
}
