//! [`MemJournal`]: an in-memory [`Journal`] for tests and the simulation. It keeps every
//! change it was given, makes them durable only when told ([`MemJournal::make_durable`]), and
//! fails on cue ([`MemJournal::fail`]), so a test decides exactly when a write is lost.

use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::{
    Change, Journal, JournalError, JournalStats, LeaseSource, Progress, Ticket, TICKET_NOW,
};
use crate::wal::{Record, WalError};

/// A change as the journal kept it, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    /// Its ticket.
    pub ticket: Ticket,
    /// The record it would be in the WAL, encoded.
    pub record: Vec<u8>,
}

/// See the module docs.
pub struct MemJournal {
    logs_leases: bool,
    /// Test hook, run once by the next [`Journal::confirm`] after it took its ticket: what
    /// another connection does in between (see [`MemJournal::confirm_then`]).
    confirm_hook: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    kept: Mutex<Vec<Kept>>,
    progress_tx: watch::Sender<Progress>,
    /// Appends left before the journal fails, and why ([`MemJournal::fail_after`]).
    fail_after: Mutex<Option<(u64, Arc<str>)>>,
}

impl MemJournal {
    /// A journal that logs grants, frees and renewals if `logs_leases` (durability `full`).
    pub fn new(logs_leases: bool) -> Arc<MemJournal> {
        let (progress_tx, _) = watch::channel(Progress::default());
        Arc::new(MemJournal {
            logs_leases,
            confirm_hook: Mutex::new(None),
            kept: Mutex::new(Vec::new()),
            progress_tx,
            fail_after: Mutex::new(None),
        })
    }

    /// Everything appended so far, in order.
    pub fn kept(&self) -> Vec<Kept> {
        self.kept.lock().expect("poisoned").clone()
    }

    /// Makes everything appended so far durable, unless the journal failed: a failed
    /// journal's `lsn` never moves again (the [`Journal`] contract).
    pub fn make_durable(&self) {
        self.make_durable_to(self.last_ticket());
    }

    /// The ticket of the last change appended ([`TICKET_NOW`] if none).
    pub fn last_ticket(&self) -> Ticket {
        let kept = self.kept.lock().expect("poisoned");
        kept.last().map_or(TICKET_NOW, |k| k.ticket)
    }

    /// Makes the changes up to `ticket` durable (a prefix: the journal is a log), unless
    /// the journal failed.
    pub fn make_durable_to(&self, ticket: Ticket) {
        let ticket = ticket.min(self.last_ticket());
        self.progress_tx.send_if_modified(|p| {
            let lsn = ticket.max(p.lsn);
            let moves = p.failed.is_none() && lsn != p.lsn;
            if moves {
                p.lsn = lsn;
            }
            moves
        });
    }

    /// Makes reads wait like a replicated journal's: the next [`Journal::confirm`] returns
    /// the last ticket handed out, then runs `between` (another connection's request that
    /// slips in after the ticket was taken).
    pub fn confirm_then(&self, between: impl FnOnce() + Send + 'static) {
        *self.confirm_hook.lock().expect("poisoned") = Some(Box::new(between));
    }

    /// Fails the journal: nothing not yet durable ever will be.
    pub fn fail(&self, why: &str) {
        self.progress_tx
            .send_modify(|p| p.failed = Some(why.into()));
    }

    /// Fails the journal (as [`MemJournal::fail`]) once `appends` more appends succeeded:
    /// a write lost in the middle of a request's several.
    pub fn fail_after(&self, appends: u64, why: &str) {
        *self.fail_after.lock().expect("poisoned") = Some((appends, why.into()));
    }

    fn keep(&self, record: &Record<'_>) -> Result<Ticket, JournalError> {
        {
            let mut fail_after = self.fail_after.lock().expect("poisoned");
            match fail_after.as_mut() {
                Some((0, why)) => {
                    let why = Arc::clone(why);
                    *fail_after = None;
                    self.progress_tx.send_modify(|p| p.failed = Some(why));
                }
                Some((left, _)) => *left -= 1,
                None => {}
            }
        }
        if let Some(why) = &self.progress_tx.borrow().failed {
            // As a cluster's journal refuses once its node no longer leads.
            if why.as_ref() == super::NOT_LEADER {
                return Err(JournalError::NotLeader(Arc::from("leader=unknown")));
            }
            return Err(WalError::Failed(Arc::clone(why)).into());
        }
        let mut kept = self.kept.lock().expect("poisoned");
        let ticket = kept.len() as Ticket + 1;
        let mut bytes = Vec::new();
        crate::record::encode(record, &mut bytes);
        kept.push(Kept {
            ticket,
            record: bytes,
        });
        Ok(ticket)
    }
}

impl Journal for MemJournal {
    fn logs_leases(&self) -> bool {
        self.logs_leases
    }

    fn append(&self, change: &Change<'_>) -> Result<Ticket, JournalError> {
        if !self.logs_leases && !matches!(change, Change::Reserve { .. }) {
            return Ok(TICKET_NOW);
        }
        self.keep(&change.record())
    }

    fn failed(&self) -> Option<Arc<str>> {
        if !self.logs_leases {
            return None;
        }
        self.progress_tx.borrow().failed.clone()
    }

    fn progress(&self) -> watch::Receiver<Progress> {
        self.progress_tx.subscribe()
    }

    fn reserve_tokens(&self, token_limit: u64) -> BoxFuture<'_, Result<(), JournalError>> {
        Box::pin(async move {
            let ticket = self.keep(&Change::Reserve { token_limit }.record())?;
            // Reservations are made durable at once: tests steer grants, not tokens.
            self.make_durable();
            crate::wal::wait_durable_on(&mut self.progress(), ticket).await?;
            Ok(())
        })
    }

    fn stats(&self) -> JournalStats {
        JournalStats {
            records: self.kept.lock().expect("poisoned").len() as u64,
            ..JournalStats::default()
        }
    }

    fn snapshot_due(&self) -> bool {
        false
    }

    fn snapshot(&self, source: &dyn LeaseSource) {
        source.for_each_session(&mut |session| {
            let _ = self.keep(&session.record());
        });
        for part in 0..source.parts() {
            source.for_each_lease(part, &mut |lease| {
                let _ = self.keep(&Change::Grant(lease).record());
            });
        }
    }

    fn confirm(&self) -> Result<Ticket, JournalError> {
        let Some(between) = self.confirm_hook.lock().expect("poisoned").take() else {
            return Ok(TICKET_NOW);
        };
        let ticket = self.last_ticket();
        between();
        Ok(ticket)
    }

    fn sync_and_stop(&self) -> Result<(), JournalError> {
        match &self.progress_tx.borrow().failed {
            Some(why) => Err(WalError::Failed(Arc::clone(why)).into()),
            None => Ok(()),
        }
    }
}
