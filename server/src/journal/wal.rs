//! [`WalJournal`]: the local write-ahead log as the server's [`Journal`], and the durability
//! mode's policy of what is logged.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::{
    Change, Durability, Journal, JournalError, JournalStats, LeaseSource, Progress, Ticket,
    TICKET_NOW,
};
use crate::wal::Wal;

/// The local WAL, logging what `durability` asks for.
pub struct WalJournal {
    wal: Wal,
    durability: Durability,
    /// The WAL's durable position and failure, read before changes that need the WAL.
    progress: watch::Receiver<Progress>,
    /// The data directory's lock, held as long as the log is in use.
    _dir_lock: Option<std::fs::File>,
}

impl WalJournal {
    /// Wraps a recovered `wal`, which keeps `dir_lock` (its directory's lock) meanwhile.
    pub fn new(wal: Wal, durability: Durability, dir_lock: Option<std::fs::File>) -> WalJournal {
        let progress = wal.subscribe();
        WalJournal {
            wal,
            durability,
            progress,
            _dir_lock: dir_lock,
        }
    }
}

impl Journal for WalJournal {
    fn logs_leases(&self) -> bool {
        self.durability == Durability::Full
    }

    fn append(&self, change: &Change<'_>) -> Result<Ticket, JournalError> {
        let logged = match change {
            Change::Grant(_) | Change::Free { .. } | Change::Renew { .. } => self.logs_leases(),
            Change::Reserve { .. } => true,
        };
        if !logged {
            return Ok(TICKET_NOW);
        }
        Ok(self.wal.append(&change.record())?)
    }

    fn failed(&self) -> Option<Arc<str>> {
        if !self.logs_leases() {
            return None;
        }
        self.progress.borrow().failed.clone()
    }

    fn progress(&self) -> watch::Receiver<Progress> {
        self.wal.subscribe()
    }

    fn reserve_tokens(&self, token_limit: u64) -> BoxFuture<'_, Result<(), JournalError>> {
        Box::pin(async move {
            let lsn = self.append(&Change::Reserve { token_limit })?;
            Ok(self.wal.wait_durable(lsn).await?)
        })
    }

    fn stats(&self) -> JournalStats {
        let wal = self.wal.stats();
        JournalStats {
            records: wal.records,
            fsyncs: wal.fsyncs,
            bytes: wal.bytes,
        }
    }

    fn snapshot_due(&self) -> bool {
        self.wal.should_snapshot()
    }

    /// Copies every live lease into the WAL so old segments can be deleted (see `wal`).
    ///
    /// Each part is copied under its own lock, so the log orders the copy correctly against
    /// that part's traffic. After each part the copy waits until it is durable: the WAL's
    /// backlog then never holds more than one part's worth, and clients' records are not
    /// refused for lack of room while a large table is copied.
    fn snapshot(&self, source: &dyn LeaseSource) {
        let started = std::time::Instant::now();
        let done = self.copy_leases(source);
        self.wal.metrics().snapshot_done(started.elapsed(), done);
    }

    fn wal(&self) -> Option<&Wal> {
        Some(&self.wal)
    }

    fn sync_and_stop(&self) -> Result<(), JournalError> {
        Ok(self.wal.sync_and_stop()?)
    }
}

impl WalJournal {
    /// The snapshot's copy; `false` if it was abandoned.
    fn copy_leases(&self, source: &dyn LeaseSource) -> bool {
        let ticket = match self.wal.begin_snapshot(source.token_limit()) {
            Ok(ticket) => ticket,
            Err(e) => {
                tracing::warn!(error = %e, "could not start a WAL snapshot");
                return false;
            }
        };
        for part in 0..source.parts() {
            let mut result = Ok(0);
            // Written whatever the durability mode: a snapshot copies what the table holds.
            source.for_each_lease(part, &mut |lease| {
                if result.is_ok() {
                    result = self.wal.append(&Change::Grant(lease).record());
                }
            });
            if let Err(e) = result.and_then(|lsn| self.wal.wait_durable_blocking(lsn)) {
                tracing::warn!(error = %e, "WAL snapshot abandoned");
                return false;
            }
        }
        if let Err(e) = self.wal.end_snapshot(ticket) {
            tracing::warn!(error = %e, "could not finish a WAL snapshot");
            return false;
        }
        true
    }
}
