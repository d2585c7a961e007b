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

/// A snapshot copies each part (a lock-table shard) in this many passes, each taking the
/// leases whose key hashes to it, and waits for each pass to be durable. At the sizing
/// estimate's 500 000 leases in 64 shards a part is about 500 KiB of records, whose fsync
/// took about 2.5 ms on the development disk against 0.5 ms for a few KiB; every reply
/// queued behind it waited that long, and snapshots ran about 5 % of the time, so they set
/// the p99. A pass is about 64 KiB. Each pass walks the whole part under its lock, but
/// skipping a lease costs a hash, far less than logging it.
const SNAPSHOT_PASSES_PER_PART: u64 = 8;

/// Which pass of its part copies the lease of `key` (FNV-1a: cheap, and spreads sequential
/// keys evenly).
fn snapshot_pass(key: &[u8]) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0100_0000_01b3;
    let hash = key.iter().fold(FNV_OFFSET, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    });
    hash % SNAPSHOT_PASSES_PER_PART
}

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
            Change::Grant(_)
            | Change::Free { .. }
            | Change::Renew { .. }
            | Change::SessionOpen { .. }
            | Change::SessionEnd { .. } => self.logs_leases(),
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
    /// that part's traffic: a lease's copy is logged while its key cannot change, so each of
    /// its changes is logged either before (and the copy shows it) or after the copy. A part
    /// is copied in `SNAPSHOT_PASSES_PER_PART` passes by key hash, which keeps that per key.
    /// After each pass the copy waits until it is durable: the WAL's backlog then never
    /// holds more than one pass's worth, clients' records are not refused for lack of room
    /// while a large table is copied, and no fsync carries more than a pass of copies ahead
    /// of their records.
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
        // Sessions first: replay must know a session before the grants in it.
        let mut result = Ok(0);
        source.for_each_session(&mut |session| {
            if result.is_ok() {
                result = self.wal.append(&session.record());
            }
        });
        if let Err(e) = result.and_then(|lsn| self.wal.wait_durable_blocking(lsn)) {
            tracing::warn!(error = %e, "WAL snapshot abandoned");
            return false;
        }
        let passes = (0..source.parts())
            .flat_map(|part| (0..SNAPSHOT_PASSES_PER_PART).map(move |pass| (part, pass)));
        for (part, pass) in passes {
            let mut result = Ok(0);
            // Written whatever the durability mode: a snapshot copies what the table holds.
            source.for_each_lease(part, &mut |lease| {
                if result.is_ok() && snapshot_pass(lease.key) == pass {
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use tenure_protocol::LeaseId;

    use super::*;
    use crate::journal::Lease;
    use crate::wal::{open, SyncMode, WalOptions};

    /// One part of many leases; remembers, at each visit, how far the WAL had appended and
    /// how far it was durable.
    struct OnePart {
        keys: Vec<Vec<u8>>,
        wal: Mutex<Option<std::sync::Weak<WalJournal>>>,
        visits: Mutex<Vec<(u64, u64)>>,
    }

    impl LeaseSource for OnePart {
        fn for_each_session(&self, _each: &mut dyn FnMut(Change<'_>)) {}

        fn parts(&self) -> usize {
            1
        }

        fn for_each_lease(&self, _part: usize, each: &mut dyn FnMut(Lease<'_>)) {
            let journal = self
                .wal
                .lock()
                .unwrap()
                .as_ref()
                .unwrap()
                .upgrade()
                .unwrap();
            let wal = journal.wal().unwrap();
            self.visits
                .lock()
                .unwrap()
                .push((wal.appended_lsn(), wal.durable_lsn()));
            for (i, key) in self.keys.iter().enumerate() {
                each(Lease {
                    key,
                    lease_id: LeaseId::from_u128(i as u128 + 1),
                    token: i as u64 + 1,
                    ttl_ms: 60_000,
                    release_on_disconnect: false,
                    meta: b"",
                    acquire_id: None,
                    session_id: None,
                    kind: Default::default(),
                });
            }
        }

        fn token_limit(&self) -> u64 {
            self.keys.len() as u64 + 1
        }
    }

    /// A part's copy is logged in passes, each durable before the next begins, so no fsync
    /// carries a whole part (a snapshot's fsyncs held up every reply queued behind them);
    /// every lease is still copied exactly once.
    #[test]
    fn a_snapshot_copies_a_part_in_passes_each_durable_before_the_next() {
        const LEASES: usize = 4_000;
        let dir = tempfile::tempdir().unwrap();
        let options = WalOptions {
            sync_mode: SyncMode::Off,
            ..WalOptions::default()
        };
        let (wal, _) = open(dir.path(), options.clone()).unwrap();
        let journal = Arc::new(WalJournal::new(wal, Durability::Full, None));
        let source = OnePart {
            keys: (0..LEASES)
                .map(|i| format!("lock-{i:06}").into_bytes())
                .collect(),
            wal: Mutex::new(Some(Arc::downgrade(&journal))),
            visits: Mutex::default(),
        };
        let before = journal.wal().unwrap().appended_lsn();
        journal.snapshot(&source);
        let visits = source.visits.lock().unwrap().clone();
        assert_eq!(visits.len() as u64, SNAPSHOT_PASSES_PER_PART, "{visits:?}");
        let end = journal.wal().unwrap().appended_lsn();
        let mut appended: Vec<u64> = visits.iter().map(|&(appended, _)| appended).collect();
        appended.push(end - 1); // the last pass ends before SnapshotEnd
        let pass_max = LEASES as u64 / SNAPSHOT_PASSES_PER_PART * 2;
        for (i, (window, &(appended_at, durable_at))) in
            appended.windows(2).zip(&visits).enumerate()
        {
            // The first pass need not wait: before it come only SnapshotBegin and Reserve.
            if i > 0 {
                assert_eq!(
                    appended_at, durable_at,
                    "a pass begins once the last is durable"
                );
            }
            assert!(
                window[1] - window[0] <= pass_max,
                "a pass too large: {visits:?}"
            );
        }
        assert!(before < visits[0].0, "SnapshotBegin and Reserve come first");
        journal.sync_and_stop().unwrap();
        drop(journal);
        let (_wal, recovered) = open(dir.path(), options).unwrap();
        let tokens: HashMap<Vec<u8>, u64> = recovered
            .leases
            .iter()
            .map(|l| (l.key.clone(), l.token))
            .collect();
        assert_eq!(tokens.len(), LEASES);
        for (i, key) in source.keys.iter().enumerate() {
            assert_eq!(tokens.get(key), Some(&(i as u64 + 1)));
        }
    }
}
