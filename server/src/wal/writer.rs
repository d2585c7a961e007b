//! The append path: group commit, rotation, snapshots, waiting for durability.
//!
//! ```text
//!  append() ──encode──▶ pending chunks ──writer: write(2)──▶ segment file ◀── fsync thread:
//!   (short mutex,        (VecDeque, bounded   (≤ batch_bytes_max    │         fdatasync of all
//!    no I/O)              by pending_bytes_max  per write)          │         written so far
//!                         until durable)                            ▼
//!                         durable LSN ◀── watch::Sender<DurableState> + Condvar
//! ```
//!
//! Callers append under their own locks (a lock-table shard), so `append` only encodes
//! into memory. The syncer (`syncer.rs`) writes what is pending while the previous fsync
//! runs, and the next fsync covers everything written meanwhile: that is group commit,
//! pipelined. The segment a record lands in is decided at append time, so a snapshot's first
//! record can name its own segment; the syncer only follows the chunks' marks.
use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tokio::sync::watch;

use super::record::{self, Record, SegmentHeader, SEGMENT_HEADER_LEN};
use super::recovery::{self, Recovered};
use super::storage::{FsStorage, SegmentFile, Storage};
use super::syncer::{self, create_segment, delete_segments_before};
use super::{segment_name, SyncMode, WalError, WalOptions};
use crate::record::{Change, RecoveredLease, RecoveredSession};
use crate::record::{DurableState, Lsn};

/// A chunk of pending records is sealed at this size so the syncer can bound a batch.
const CHUNK_BYTES_MAX: usize = 256 << 10;
/// `open` writes a snapshot of what it recovered, and deletes the older segments, when it
/// finds at least this many segments. Every start adds a segment, so without this a server
/// restarted often keeps every segment it ever wrote and replays them all; with it the log
/// after a start is at most one older segment plus the new one. A log of one segment is left
/// alone, which keeps the restart after a crash as fast as the replay.
const OPEN_SNAPSHOT_SEGMENTS_MIN: usize = 2;
/// Bytes waiting during an fsync from which the write-ahead thread writes them before the
/// fsync returns. Below it the syncer writes them itself after the fsync: a small write
/// costs microseconds, less than waking another thread for it, and writing every few records
/// as they come took a quarter of a core at 100 000 records/s. A snapshot's part (hundreds
/// of KiB) is what is worth overlapping.
pub(super) const WRITE_AHEAD_BYTES_MIN: usize = 64 << 10;
/// Emptied chunk buffers kept for reuse, so steady-state appends allocate nothing.
pub(super) const SPARE_CHUNKS_MAX: usize = 64;

/// Counters for STATS and benchmarks; `records / fsyncs` is the group-commit factor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalStats {
    /// Records accepted by `append`.
    pub records_appended: u64,
    /// Records written and (unless sync is off) fsynced.
    pub records: u64,
    /// Record bytes written to segment files (headers excluded).
    pub bytes: u64,
    /// Groups synced, one fsync each when syncing; a group is every batch written while the
    /// fsync before it ran.
    pub batches: u64,
    /// `fdatasync` calls, segment creation included.
    pub fsyncs: u64,
    /// Segment files created.
    pub segments_created: u64,
    /// Segment files deleted after a snapshot.
    pub segments_deleted: u64,
    /// Snapshots whose end record was appended.
    pub snapshots_completed: u64,
    /// Segment files on disk, as of the last batch written.
    pub segments_on_disk: u64,
}

/// Proof that a snapshot is in progress; hand it back to [`Wal::end_snapshot`]. Dropping it
/// instead abandons the snapshot: nothing is deleted and a new one may begin.
#[must_use = "dropping the guard abandons the snapshot"]
pub struct SnapshotGuard {
    segment_seq: u64,
    shared: Arc<Shared>,
    ended: bool,
}

impl SnapshotGuard {
    /// The segment the snapshot opened.
    pub fn segment_seq(&self) -> u64 {
        self.segment_seq
    }
}

impl Drop for SnapshotGuard {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let Ok(mut state) = self.shared.state.lock() else {
            return;
        };
        if state
            .snapshot
            .as_ref()
            .is_some_and(|s| s.segment_seq == self.segment_seq)
        {
            state.snapshot = None;
            state.snapshot_retry_log_bytes = state.log_bytes + self.shared.options.segment_size_max;
            tracing::warn!(segment_seq = self.segment_seq, "WAL snapshot abandoned");
        }
    }
}

impl fmt::Debug for SnapshotGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SnapshotGuard")
            .field("segment_seq", &self.segment_seq)
            .finish()
    }
}

/// The write-ahead log. `Send + Sync`; share it through an `Arc`.
pub struct Wal {
    shared: Arc<Shared>,
    syncer: Mutex<Option<JoinHandle<()>>>,
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// The syncer waits here for chunks (or shutdown).
    pub(super) work: Condvar,
    /// The write-ahead thread waits here for a large backlog during an fsync (or shutdown).
    pub(super) ahead: Condvar,
    /// Blocking waiters wait here for the durable LSN.
    pub(super) durable: Condvar,
    pub(super) durable_tx: watch::Sender<DurableState>,
    pub(super) storage: Arc<dyn Storage>,
    pub(super) options: WalOptions,
}

pub(super) struct State {
    /// Encoded records not yet taken by the syncer, oldest first; appends go to the back.
    pub(super) chunks: VecDeque<Chunk>,
    /// Bytes appended and not yet durable (pending, or written and waiting for an fsync).
    pub(super) pending_bytes: usize,
    pub(super) spare: Vec<Vec<u8>>,
    pub(super) next_lsn: u64,
    pub(super) durable_lsn: u64,
    /// Above every token in any record appended so far (or recovered).
    pub(super) token_floor: u64,
    /// Segment the next record goes to, and its size so far, header included.
    pub(super) segment_seq: u64,
    pub(super) segment_bytes: u64,
    /// `(seq, bytes)` of every segment not yet deleted, as appended; `log_bytes` is the sum.
    pub(super) segments: VecDeque<(u64, u64)>,
    pub(super) log_bytes: u64,
    pub(super) snapshot: Option<SnapshotState>,
    /// Size of the last snapshot (or of the recovered leases): what live state costs on disk.
    pub(super) live_bytes_estimate: u64,
    /// After an abandoned snapshot, `should_snapshot` waits for the log to pass this size.
    pub(super) snapshot_retry_log_bytes: u64,
    /// `open` found several segments but too much live state to snapshot them itself: the
    /// next `should_snapshot` says yes whatever the sizes.
    pub(super) snapshot_due: bool,
    pub(super) failed: Option<Arc<str>>,
    pub(super) syncer_waiting: bool,
    /// Bytes in `chunks`: appended, not yet written.
    pub(super) unwritten_bytes: usize,
    /// The syncer is in an fsync; meanwhile a large backlog is written ahead.
    pub(super) fsync_busy: bool,
    pub(super) ahead_waiting: bool,
    /// The syncer stopped: so does the write-ahead thread.
    pub(super) ahead_stop: bool,
    pub(super) shutdown: bool,
    pub(super) stats: WalStats,
}

pub(super) struct SnapshotState {
    pub(super) segment_seq: u64,
    pub(super) log_bytes_at_begin: u64,
}

/// Records destined for one segment, written in one piece.
pub(super) struct Chunk {
    pub(super) buf: Vec<u8>,
    pub(super) records: u64,
    pub(super) last_lsn: u64,
    /// Start the segment this header describes before writing this chunk.
    pub(super) rotate_to: Option<SegmentHeader>,
    /// This chunk holds the end record of the snapshot opened in segment `seq`.
    pub(super) snapshot_end: Option<u64>,
}

/// Opens the log in `dir` (created if missing), recovers it and starts the syncer.
///
/// # Errors
/// [`WalError::Corrupt`] if the log is damaged beyond a torn tail; [`WalError::Io`] if a
/// file operation fails.
pub fn open(
    dir: impl AsRef<std::path::Path>,
    options: WalOptions,
) -> Result<(Wal, Recovered), WalError> {
    let dir = dir.as_ref();
    let storage = FsStorage::new(dir).map_err(|source| WalError::Io {
        path: dir.into(),
        source,
    })?;
    open_with_storage(Arc::new(storage), options)
}

/// [`open`] over any [`Storage`], such as a fault-injecting one.
///
/// # Errors
/// As [`open`].
///
/// # Panics
/// If `options` are inconsistent (a segment or batch smaller than one record).
pub fn open_with_storage(
    storage: Arc<dyn Storage>,
    options: WalOptions,
) -> Result<(Wal, Recovered), WalError> {
    assert!(options.segment_size_max >= (SEGMENT_HEADER_LEN + record::RECORD_LEN_MAX) as u64);
    assert!(options.segment_size_max <= super::SEGMENT_SIZE_LIMIT);
    assert!(options.batch_bytes_max >= record::RECORD_LEN_MAX);
    assert!(options.pending_bytes_max >= options.batch_bytes_max);
    let mut replayed = recovery::recover(&*storage)?;
    let started = start_segment(&*storage, &mut replayed, &options)?;
    let (seq, segment_bytes, segments) = (started.seq, started.bytes, started.segments);
    let on_disk = segments.clone();
    let state = State {
        chunks: VecDeque::new(),
        pending_bytes: 0,
        spare: Vec::new(),
        next_lsn: 1,
        durable_lsn: 0,
        token_floor: replayed.recovered.token_floor,
        segment_seq: seq,
        segment_bytes,
        log_bytes: segments.iter().map(|&(_, bytes)| bytes).sum(),
        segments,
        snapshot: None,
        live_bytes_estimate: started.live_bytes,
        snapshot_retry_log_bytes: 0,
        snapshot_due: started.snapshot_due,
        failed: None,
        syncer_waiting: false,
        unwritten_bytes: 0,
        fsync_busy: false,
        ahead_waiting: false,
        ahead_stop: false,
        shutdown: false,
        stats: started.stats,
    };
    let shared = Arc::new(Shared {
        state: Mutex::new(state),
        work: Condvar::new(),
        ahead: Condvar::new(),
        durable: Condvar::new(),
        durable_tx: watch::Sender::new(DurableState::default()),
        storage,
        options,
    });
    let file = started.file;
    let handle = syncer::spawn(Arc::clone(&shared), file, seq, segment_bytes, on_disk).map_err(
        |source| WalError::Io {
            path: shared.storage.path(""),
            source,
        },
    )?;
    Ok((
        Wal {
            shared,
            syncer: Mutex::new(Some(handle)),
        },
        replayed.recovered,
    ))
}

/// The segment [`open`] appends to, and what starting it did.
struct Started {
    file: Box<dyn SegmentFile>,
    seq: u64,
    /// Its length, header and any snapshot included, all durable.
    bytes: u64,
    /// Every remaining segment as `(seq, bytes)`, the new one last.
    segments: VecDeque<(u64, u64)>,
    /// Size of the live state as Grant records.
    live_bytes: u64,
    /// See [`State::snapshot_due`].
    snapshot_due: bool,
    stats: WalStats,
}

/// Finishes what recovery found (deletes segments a complete snapshot replaced, adds the
/// token floor margin) and creates the next segment, with a snapshot of `replayed` in it if
/// the log had several segments; the segments that snapshot replaces are then deleted.
fn start_segment(
    storage: &dyn Storage,
    replayed: &mut recovery::Replayed,
    options: &WalOptions,
) -> Result<Started, WalError> {
    let mut segments: VecDeque<(u64, u64)> = replayed.segments.iter().copied().collect();
    if let Some(snapshot_seq) = replayed.snapshot_complete_seq {
        // A crash between a snapshot's end and the deletion of what it replaces.
        delete_segments_before(storage, snapshot_seq, &mut segments);
    }
    if replayed.recovered.segments > 0 || replayed.recovered.token_floor > 0 {
        // A log that ends at a record boundary looks whole, yet a disk that loses synced
        // bytes may have dropped its last records, the last token reservation among them.
        // Reservations step by at most `token_floor_margin`, and the one before the lost one
        // survives (in a record or in the segment header), so starting this far above what
        // survives stays above every token handed out. It costs one block per start.
        let floor = &mut replayed.recovered.token_floor;
        *floor = floor.saturating_add(options.token_floor_margin);
        if replayed.recovered.header_removed {
            // The removed segment's header carried its start's floor (what survives plus one
            // block), and the reservation that followed it is gone too: a header torn by a
            // crash while creating the file cannot be told from one a disk cut after the
            // start's first grants, so take the cautious case, one block more.
            *floor = floor.saturating_add(options.token_floor_margin);
        }
    }
    let seq = segments.back().map_or(1, |&(last, _)| last + 1);
    let header = SegmentHeader {
        seq,
        token_floor: replayed.recovered.token_floor,
    };
    let several = segments.len() >= OPEN_SNAPSHOT_SEGMENTS_MIN;
    // A snapshot written here goes into one segment; a larger one is left to the server's
    // snapshot, which rotates, and is asked for at once (`snapshot_due`).
    let fits = SEGMENT_HEADER_LEN as u64 + replayed.live_bytes + open_snapshot_overhead(seq)
        <= options.segment_size_max;
    let io_error = |(path, source)| WalError::Io { path, source };
    let mut file = create_segment(storage, header, options.sync_mode).map_err(io_error)?;
    // The header is synced before the snapshot is written, as for every segment: a crash
    // while writing it must leave a torn tail, never a lost header with records after it.
    let written = (several && fits)
        .then(|| write_open_snapshot(&mut *file, seq, &replayed.recovered, options))
        .transpose()
        .map_err(|source| io_error((storage.path(&segment_name(seq)), source)))?;
    let mut started = Started {
        file,
        seq,
        bytes: SEGMENT_HEADER_LEN as u64,
        segments,
        live_bytes: replayed.live_bytes,
        snapshot_due: several && !fits,
        stats: WalStats {
            segments_created: 1,
            ..WalStats::default()
        },
    };
    if let Some((bytes, records)) = written {
        // The snapshot is durable: nothing older is needed any more.
        let deleted = delete_segments_before(storage, seq, &mut started.segments);
        (started.bytes, started.live_bytes) = (started.bytes + bytes, bytes);
        started.stats.segments_deleted = deleted;
        (started.stats.records, started.stats.bytes) = (records, bytes);
        started.stats.snapshots_completed = 1;
    }
    started.segments.push_back((seq, started.bytes));
    Ok(started)
}

/// Bytes of the records a snapshot writes besides its grants.
fn open_snapshot_overhead(seq: u64) -> u64 {
    let records = [
        Record::SnapshotBegin { segment_seq: seq },
        Change::Reserve { token_limit: 0 }.record(),
        Record::SnapshotEnd { segment_seq: seq },
    ];
    records.iter().map(|r| r.encoded_len() as u64).sum()
}

/// Writes a snapshot of `recovered` into the new segment `seq`, right after its header, and
/// syncs it: `SnapshotBegin`, a Reserve of the token floor, a SessionOpen per session (before
/// the grants in them), a Grant per lease, `SnapshotEnd`.
/// Every older segment may be deleted once this returns. Returns `(bytes, records)` written.
fn write_open_snapshot(
    file: &mut dyn SegmentFile,
    seq: u64,
    recovered: &Recovered,
    options: &WalOptions,
) -> std::io::Result<(u64, u64)> {
    let head = [
        Record::SnapshotBegin { segment_seq: seq },
        Change::Reserve {
            token_limit: recovered.token_floor,
        }
        .record(),
    ];
    // The one Grant builder, as live grants and table snapshots use.
    let sessions = recovered.sessions.iter().map(RecoveredSession::as_record);
    let grants = recovered.leases.iter().map(RecoveredLease::as_grant);
    let grants = sessions.chain(grants);
    let end = Record::SnapshotEnd { segment_seq: seq };
    let mut buf = Vec::with_capacity(options.batch_bytes_max);
    let (mut bytes, mut records) = (0u64, 0u64);
    let mut flush = |buf: &mut Vec<u8>| {
        file.write_all(buf)?;
        if options.sync_mode == SyncMode::Data {
            file.sync_data()?;
        }
        bytes += buf.len() as u64;
        buf.clear();
        Ok::<(), std::io::Error>(())
    };
    for record in head.into_iter().chain(grants).chain([end]) {
        // Written and synced a batch at a time, as the syncer does: memory stays bounded at
        // a million leases, and a crash can tear only the last unsynced batch.
        if buf.len() + record.encoded_len() > options.batch_bytes_max {
            flush(&mut buf)?;
        }
        record::encode(&record, &mut buf);
        records += 1;
    }
    flush(&mut buf)?;
    Ok((bytes, records))
}

impl Wal {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().expect("WAL state lock poisoned")
    }

    /// Queues `record` for the disk and returns its LSN; it is durable once
    /// [`Wal::durable_lsn`] reaches that. Never blocks on I/O.
    ///
    /// # Errors
    /// [`WalError::Failed`] after a write failure, [`WalError::Stopped`] after
    /// [`Wal::sync_and_stop`], [`WalError::Backlog`] if more than `pending_bytes_max` bytes
    /// are already waiting. In every case nothing was queued.
    ///
    /// # Panics
    /// If key or meta exceed their limits.
    pub fn append(&self, record: &Record<'_>) -> Result<Lsn, WalError> {
        let mut state = self.lock();
        state.check_writable()?;
        if state.pending_bytes >= self.shared.options.pending_bytes_max {
            return Err(WalError::Backlog {
                pending_bytes: state.pending_bytes,
            });
        }
        let lsn = state.push(record, &self.shared.options, false);
        self.wake_syncer(state);
        Ok(lsn)
    }

    fn wake_syncer(&self, state: MutexGuard<'_, State>) {
        // Skip the futex syscall while the syncer is busy: it looks again before sleeping.
        let waiting = state.syncer_waiting;
        let ahead = state.ahead_waiting && state.write_ahead_due();
        drop(state);
        if waiting {
            self.shared.work.notify_one();
        }
        if ahead {
            self.shared.ahead.notify_one();
        }
    }

    /// LSN of the last record appended (0 if none).
    pub fn appended_lsn(&self) -> Lsn {
        self.lock().next_lsn - 1
    }

    /// LSN up to which every record is durable (0 if none).
    pub fn durable_lsn(&self) -> Lsn {
        self.lock().durable_lsn
    }

    /// The syncer waits for work: nothing pending as far as it knows.
    #[cfg(test)]
    pub(super) fn syncer_is_idle(&self) -> bool {
        self.lock().syncer_waiting
    }

    /// A receiver of the durable LSN and failure state, for async waiters.
    pub fn subscribe(&self) -> watch::Receiver<DurableState> {
        self.shared.durable_tx.subscribe()
    }

    /// Above every fencing token in any record appended so far or recovered.
    pub fn token_floor(&self) -> u64 {
        self.lock().token_floor
    }

    /// Counters since `open`.
    pub fn stats(&self) -> WalStats {
        self.lock().stats
    }

    /// The syncer's fsync latency and batch-size histograms.
    pub fn metrics(&self) -> &crate::obs::metrics::WalMetrics {
        &self.shared.options.metrics
    }

    /// Waits until `lsn` is durable.
    ///
    /// # Errors
    /// [`WalError::Failed`] if the WAL failed before `lsn` became durable.
    ///
    /// # Panics
    /// If `lsn` was never appended (the wait could never end).
    pub async fn wait_durable(&self, lsn: Lsn) -> Result<(), WalError> {
        assert!(
            lsn <= self.appended_lsn(),
            "waiting for LSN {lsn} that was never appended"
        );
        wait_durable_on(&mut self.subscribe(), lsn).await
    }

    /// [`Wal::wait_durable`] for threads outside an async runtime.
    ///
    /// # Errors
    /// As [`Wal::wait_durable`].
    ///
    /// # Panics
    /// As [`Wal::wait_durable`].
    pub fn wait_durable_blocking(&self, lsn: Lsn) -> Result<(), WalError> {
        let mut state = self.lock();
        assert!(
            lsn < state.next_lsn,
            "waiting for LSN {lsn} that was never appended"
        );
        while state.durable_lsn < lsn {
            if let Some(why) = &state.failed {
                return Err(WalError::Failed(Arc::clone(why)));
            }
            state = self
                .shared
                .durable
                .wait(state)
                .expect("WAL state lock poisoned");
        }
        Ok(())
    }

    /// Waits until everything appended so far is durable; returns the last LSN.
    ///
    /// # Errors
    /// As [`Wal::wait_durable`].
    pub fn flush(&self) -> Result<Lsn, WalError> {
        let lsn = self.appended_lsn();
        self.wait_durable_blocking(lsn)?;
        Ok(lsn)
    }

    /// Whether the log has grown enough past the live state that a snapshot would pay:
    /// more than `max(segment_size_max, 2 × live state)` bytes on disk, no snapshot running,
    /// and, after an abandoned snapshot, another `segment_size_max` bytes appended since.
    /// Also yes after an `open` that found several segments and more live state than it
    /// snapshots itself.
    pub fn should_snapshot(&self) -> bool {
        let state = self.lock();
        let threshold = self
            .shared
            .options
            .segment_size_max
            .max(state.live_bytes_estimate.saturating_mul(2))
            .max(state.snapshot_retry_log_bytes);
        let due = state.snapshot_due || state.log_bytes > threshold;
        state.failed.is_none() && state.snapshot.is_none() && due
    }

    /// Starts a snapshot: opens a new segment with `SnapshotBegin` and a Reserve of
    /// `token_limit` (the allocator's durable limit) or the highest token the log has seen,
    /// whichever is more. The caller then appends a Grant for every live lease (under each
    /// shard's lock; interleaving with normal traffic is fine) and calls
    /// [`Wal::end_snapshot`]. Once that end record is durable, older segments are deleted.
    ///
    /// # Errors
    /// [`WalError::SnapshotInProgress`] if one is running; [`WalError::Failed`] or
    /// [`WalError::Stopped`] if the log takes no more writes.
    pub fn begin_snapshot(&self, token_limit: u64) -> Result<SnapshotGuard, WalError> {
        let mut state = self.lock();
        state.check_writable()?;
        if state.snapshot.is_some() {
            return Err(WalError::SnapshotInProgress);
        }
        let segment_seq = state.segment_seq + 1;
        let log_bytes_at_begin = state.log_bytes;
        let options = &self.shared.options;
        state.push(&Record::SnapshotBegin { segment_seq }, options, true);
        assert_eq!(state.segment_seq, segment_seq);
        let token_limit = token_limit.max(state.token_floor);
        state.push(&Change::Reserve { token_limit }.record(), options, false);
        state.snapshot = Some(SnapshotState {
            segment_seq,
            log_bytes_at_begin,
        });
        state.snapshot_due = false;
        self.wake_syncer(state);
        Ok(SnapshotGuard {
            segment_seq,
            shared: Arc::clone(&self.shared),
            ended: false,
        })
    }

    /// Ends the snapshot `guard` started; returns the LSN of the end record. Segments before
    /// the snapshot's are deleted by the syncer once that LSN is durable.
    ///
    /// # Errors
    /// [`WalError::Failed`] after a write failure (no segment is deleted then).
    pub fn end_snapshot(&self, mut guard: SnapshotGuard) -> Result<Lsn, WalError> {
        let mut state = self.lock();
        state.check_writable()?;
        guard.ended = true;
        let snapshot = state
            .snapshot
            .take()
            .expect("end_snapshot without begin_snapshot");
        assert_eq!(
            snapshot.segment_seq, guard.segment_seq,
            "end_snapshot with a stale guard"
        );
        let segment_seq = guard.segment_seq;
        let lsn = state.push(
            &Record::SnapshotEnd { segment_seq },
            &self.shared.options,
            false,
        );
        state.snapshot_retry_log_bytes = 0;
        let chunk = state.chunks.back_mut().expect("push left a chunk");
        chunk.snapshot_end = Some(segment_seq);
        state.live_bytes_estimate = state.log_bytes - snapshot.log_bytes_at_begin;
        while state
            .segments
            .front()
            .is_some_and(|&(seq, _)| seq < segment_seq)
        {
            let (_, bytes) = state.segments.pop_front().expect("front checked");
            state.log_bytes -= bytes;
        }
        state.stats.snapshots_completed += 1;
        self.wake_syncer(state);
        Ok(lsn)
    }

    /// Writes and syncs everything appended so far, stops the syncer, and reports whether
    /// the WAL had failed. Later appends fail with [`WalError::Stopped`]. Idempotent;
    /// dropping the `Wal` does the same.
    ///
    /// # Errors
    /// [`WalError::Failed`] if any write failed, so some appended records are not durable.
    pub fn sync_and_stop(&self) -> Result<(), WalError> {
        let handle = self
            .syncer
            .lock()
            .expect("WAL syncer handle lock poisoned")
            .take();
        if let Some(handle) = handle {
            self.lock().shutdown = true;
            self.shared.work.notify_one();
            if handle.join().is_err() {
                tracing::error!("WAL syncer thread panicked");
            }
        }
        match &self.lock().failed {
            Some(why) => Err(WalError::Failed(Arc::clone(why))),
            None => Ok(()),
        }
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        if let Err(e) = self.sync_and_stop() {
            tracing::error!(error = %e, "WAL dropped after a failure");
        }
    }
}

impl fmt::Debug for Wal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("Wal")
            .field("appended_lsn", &(state.next_lsn - 1))
            .field("durable_lsn", &state.durable_lsn)
            .field("segment_seq", &state.segment_seq)
            .field("failed", &state.failed)
            .finish()
    }
}

/// Waits on `receiver` until `lsn` is durable; for tasks that keep their own receiver.
///
/// # Errors
/// [`WalError::Failed`] if the WAL failed (or was dropped) before `lsn` became durable.
pub async fn wait_durable_on(
    receiver: &mut watch::Receiver<DurableState>,
    lsn: Lsn,
) -> Result<(), WalError> {
    let reached = receiver
        .wait_for(|s| s.lsn >= lsn || s.failed.is_some())
        .await;
    let state = reached.map_err(|_| WalError::Failed("WAL was shut down".into()))?;
    if state.lsn >= lsn {
        return Ok(());
    }
    Err(WalError::Failed(Arc::clone(
        state.failed.as_ref().expect("wait_for condition"),
    )))
}

impl State {
    /// Whether the write-ahead thread should write now: an fsync runs, enough is waiting to
    /// be worth a thread hop, and it does not open a segment (that waits for the syncer).
    pub(super) fn write_ahead_due(&self) -> bool {
        self.fsync_busy
            && self.unwritten_bytes >= WRITE_AHEAD_BYTES_MIN
            && self.chunks.front().is_some_and(|c| c.rotate_to.is_none())
    }

    fn check_writable(&self) -> Result<(), WalError> {
        match &self.failed {
            Some(why) => Err(WalError::Failed(Arc::clone(why))),
            None if self.shutdown => Err(WalError::Stopped),
            None => Ok(()),
        }
    }

    /// Encodes `record` into the pending chunks; starts a new segment first if `rotate` or
    /// if the record would overflow a non-empty segment.
    fn push(&mut self, record: &Record<'_>, options: &WalOptions, rotate: bool) -> Lsn {
        let len = record.encoded_len();
        let header = SEGMENT_HEADER_LEN as u64;
        let full = self.segment_bytes > header
            && self.segment_bytes + len as u64 > options.segment_size_max;
        // Chunks never exceed a batch, so a batch of whole chunks respects batch_bytes_max.
        let chunk_bytes_max = CHUNK_BYTES_MAX.min(options.batch_bytes_max);
        if rotate || full {
            self.segment_seq += 1;
            self.segment_bytes = header;
            self.segments.push_back((self.segment_seq, header));
            self.log_bytes += header;
            // Every token handed out so far is below the floor of the records appended so
            // far: the header keeps that floor even if the disk later loses records.
            let header = SegmentHeader {
                seq: self.segment_seq,
                token_floor: self.token_floor,
            };
            let chunk = self.new_chunk(Some(header));
            self.chunks.push_back(chunk);
        } else if self
            .chunks
            .back()
            .is_none_or(|c| c.buf.len() + len > chunk_bytes_max)
        {
            let chunk = self.new_chunk(None);
            self.chunks.push_back(chunk);
        }
        let lsn = self.next_lsn;
        let chunk = self.chunks.back_mut().expect("a chunk was just ensured");
        record::encode(record, &mut chunk.buf);
        chunk.records += 1;
        chunk.last_lsn = lsn;
        self.next_lsn += 1;
        self.pending_bytes += len;
        self.unwritten_bytes += len;
        self.segment_bytes += len as u64;
        self.segments.back_mut().expect("the active segment").1 += len as u64;
        self.log_bytes += len as u64;
        self.stats.records_appended += 1;
        self.token_floor = self.token_floor.max(match *record {
            Record::Reserve { token_limit } => token_limit,
            Record::Grant { token, .. }
            | Record::Free { token, .. }
            | Record::Renew { token, .. } => token.saturating_add(1),
            Record::SnapshotBegin { .. }
            | Record::SnapshotEnd { .. }
            | Record::SessionOpen { .. }
            | Record::SessionEnd { .. } => 0,
        });
        lsn
    }

    fn new_chunk(&mut self, rotate_to: Option<SegmentHeader>) -> Chunk {
        let buf = self
            .spare
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(CHUNK_BYTES_MAX + record::RECORD_LEN_MAX));
        Chunk {
            buf,
            records: 0,
            last_lsn: 0,
            rotate_to,
            snapshot_end: None,
        }
    }
}
