//! The syncer thread: takes batches of pending chunks, writes them to the active segment,
//! fsyncs once per batch, publishes the durable LSN, and deletes the segments a durable
//! snapshot replaced. On the first failed write or fsync it marks the WAL failed and stops
//! for good (a failed fsync is never retried: the kernel may already have dropped the pages).
use std::collections::VecDeque;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use super::record::{self, SegmentHeader};
use super::storage::{SegmentFile, Storage};
use super::writer::{Chunk, Shared, SPARE_CHUNKS_MAX};
use super::{segment_name, SyncMode};

/// Creates segment `header.seq` with its header, durable (file and directory entry) on
/// return.
pub(super) fn create_segment(
    storage: &dyn Storage,
    header: SegmentHeader,
    sync_mode: SyncMode,
) -> Result<Box<dyn SegmentFile>, (PathBuf, io::Error)> {
    let name = segment_name(header.seq);
    let with_path = |e| (storage.path(&name), e);
    let mut file = storage.create(&name).map_err(with_path)?;
    file.write_all(&record::encode_segment_header(header))
        .map_err(with_path)?;
    if sync_mode == SyncMode::Data {
        file.sync_data().map_err(with_path)?;
        storage.sync_dir().map_err(|e| (storage.path(""), e))?;
    }
    Ok(file)
}

/// Deletes every segment in `segments` older than `seq`; keeps those that fail, to retry.
pub(super) fn delete_segments_before(
    storage: &dyn Storage,
    seq: u64,
    segments: &mut VecDeque<(u64, u64)>,
) -> u64 {
    let mut deleted = 0;
    segments.retain(|&(old, _)| {
        if old >= seq {
            return true;
        }
        let name = segment_name(old);
        match storage.remove(&name) {
            Ok(()) => {
                deleted += 1;
                false
            }
            Err(e) => {
                tracing::warn!(path = %storage.path(&name).display(), error = %e, "WAL: cannot delete old segment");
                true
            }
        }
    });
    if deleted > 0 {
        if let Err(e) = storage.sync_dir() {
            tracing::warn!(error = %e, "WAL: cannot sync directory after deleting segments");
        }
    }
    deleted
}

/// Starts the syncer thread, which appends to `file` (segment `seq`, `synced_len` bytes
/// long and durable); `on_disk` lists the segments that exist, oldest first.
pub(super) fn spawn(
    shared: Arc<Shared>,
    file: Box<dyn SegmentFile>,
    seq: u64,
    synced_len: u64,
    on_disk: VecDeque<(u64, u64)>,
) -> io::Result<std::thread::JoinHandle<()>> {
    let syncer = Syncer {
        shared,
        file,
        seq,
        synced_len,
        on_disk,
        batch: Vec::new(),
    };
    std::thread::Builder::new()
        .name("tenure-wal-sync".into())
        .spawn(move || syncer.run())
}

/// The syncer thread's own state: the active segment file and what it has written.
struct Syncer {
    shared: Arc<Shared>,
    file: Box<dyn SegmentFile>,
    seq: u64,
    /// Bytes of the active segment known durable: its header and every batch synced so far.
    /// A failed batch is cut back to this, so nothing unacknowledged survives a restart.
    synced_len: u64,
    /// `(seq, _)` of the segments on disk, oldest first (for deletion after a snapshot).
    on_disk: VecDeque<(u64, u64)>,
    /// The batch being written; kept to reuse its allocation.
    batch: Vec<Chunk>,
}

/// What a written batch did, for the stats.
#[derive(Default)]
struct BatchOutcome {
    fsyncs: u64,
    segments_created: u64,
}

impl Syncer {
    fn run(mut self) {
        while self.take_batch() {
            match self.write_batch() {
                Ok(outcome) => self.publish(outcome),
                Err(why) => return self.fail(why),
            }
        }
    }

    /// Waits for chunks and moves up to one batch of them into `self.batch`; `false` once
    /// shut down with nothing left, or after a failure.
    fn take_batch(&mut self) -> bool {
        let shared = Arc::clone(&self.shared);
        let mut state = shared.state.lock().expect("WAL state lock poisoned");
        loop {
            if state.failed.is_some() {
                return false;
            }
            if !state.chunks.is_empty() {
                break;
            }
            if state.shutdown {
                return false;
            }
            state.syncer_waiting = true;
            state = shared.work.wait(state).expect("WAL state lock poisoned");
            state.syncer_waiting = false;
        }
        let mut bytes = 0;
        while let Some(next) = state.chunks.front() {
            let first = self.batch.is_empty();
            let fits = bytes + next.buf.len() <= shared.options.batch_bytes_max;
            // A new segment always starts a batch, so each fsync covers one file.
            if !first && (!fits || next.rotate_to.is_some()) {
                break;
            }
            let chunk = state.chunks.pop_front().expect("front checked");
            bytes += chunk.buf.len();
            self.batch.push(chunk);
        }
        state.pending_bytes -= bytes;
        true
    }

    /// Writes the batch and syncs it; `Err` describes the first failure.
    fn write_batch(&mut self) -> Result<BatchOutcome, String> {
        let sync_mode = self.shared.options.sync_mode;
        let storage = &*self.shared.storage;
        let mut outcome = BatchOutcome::default();
        if let Some(header) = self.batch[0].rotate_to {
            let seq = header.seq;
            assert_eq!(seq, self.seq + 1, "segments are created in order");
            self.file = create_segment(storage, header, sync_mode)
                .map_err(|(path, e)| format!("creating {}: {e}", path.display()))?;
            self.seq = seq;
            self.synced_len = record::SEGMENT_HEADER_LEN as u64;
            self.on_disk.push_back((seq, 0));
            outcome.segments_created += 1;
            outcome.fsyncs += u64::from(sync_mode == SyncMode::Data);
        }
        let path = || storage.path(&segment_name(self.seq)).display().to_string();
        for chunk in &self.batch {
            self.file
                .write_all(&chunk.buf)
                .map_err(|e| format!("writing {}: {e}", path()))?;
        }
        let started = std::time::Instant::now();
        if sync_mode == SyncMode::Data {
            self.file
                .sync_data()
                .map_err(|e| format!("fdatasync {}: {e}", path()))?;
            outcome.fsyncs += 1;
        }
        let records = self.batch.iter().map(|c| c.records).sum();
        let synced = (sync_mode == SyncMode::Data).then(|| started.elapsed());
        self.shared.options.metrics.batch_written(records, synced);
        self.synced_len += self.batch.iter().map(|c| c.buf.len() as u64).sum::<u64>();
        Ok(outcome)
    }

    /// Advances the durable LSN past the batch, recycles its buffers, deletes segments a
    /// now-durable snapshot replaced.
    fn publish(&mut self, outcome: BatchOutcome) {
        let last = self.batch.last().expect("batches are never empty");
        let lsn = last.last_lsn;
        let snapshot_end = self.batch.iter().rev().find_map(|c| c.snapshot_end);
        let mut state = self.shared.state.lock().expect("WAL state lock poisoned");
        state.durable_lsn = lsn;
        state.stats.batches += 1;
        state.stats.fsyncs += outcome.fsyncs;
        state.stats.segments_created += outcome.segments_created;
        state.stats.segments_on_disk = self.on_disk.len() as u64;
        for mut chunk in self.batch.drain(..) {
            state.stats.records += chunk.records;
            state.stats.bytes += chunk.buf.len() as u64;
            if state.spare.len() < SPARE_CHUNKS_MAX {
                chunk.buf.clear();
                state.spare.push(chunk.buf);
            }
        }
        drop(state);
        self.shared.durable.notify_all();
        self.shared.durable_tx.send_modify(|s| s.lsn = lsn);
        if let Some(seq) = snapshot_end {
            let deleted = delete_segments_before(&*self.shared.storage, seq, &mut self.on_disk);
            let mut state = self.shared.state.lock().expect("WAL state lock poisoned");
            state.stats.segments_deleted += deleted;
            state.stats.segments_on_disk = self.on_disk.len() as u64;
        }
    }

    /// Enters the failed state for good: drops pending records, wakes every waiter.
    fn fail(self, why: String) {
        tracing::error!(error = %why, "WAL write failed; no further records will be durable");
        // Part of the failed batch may have reached the file (a short write's prefix, or pages
        // whose fsync failed but were written back anyway). None of it was acknowledged, so cut
        // the segment back to what was synced: a restart must not bring those records back.
        let name = segment_name(self.seq);
        match self.shared.storage.truncate(&name, self.synced_len) {
            Ok(()) => tracing::warn!(
                path = %self.shared.storage.path(&name).display(),
                len = self.synced_len,
                "WAL: cut the failed batch off the active segment"
            ),
            Err(e) => tracing::error!(
                path = %self.shared.storage.path(&name).display(),
                error = %e,
                "WAL: cannot cut the failed batch off; a restart may bring unacknowledged records back"
            ),
        }
        let why: Arc<str> = why.into();
        // Watch first: whoever sees the failure through the state lock sees it here too.
        self.shared
            .durable_tx
            .send_modify(|s| s.failed = Some(Arc::clone(&why)));
        let mut state = self.shared.state.lock().expect("WAL state lock poisoned");
        state.failed = Some(why);
        state.chunks.clear();
        state.pending_bytes = 0;
        drop(state);
        self.shared.durable.notify_all();
    }
}
