//! The syncer: writes batches of pending chunks to the active segment, fsyncs them, publishes
//! the durable LSN, deletes the segments a durable snapshot replaced; pipelined, so a large
//! write overlaps the fsync before it.
//!
//! ```text
//!  pending chunks ─┬─ syncer thread: write a batch ─┐        ┌─ fdatasync everything written,
//!  (State::chunks) │                                ├─ Pipe ─┤  publish the last LSN it covers,
//!                  └─ write-ahead thread: during an ┘        └─ again (in order, per fsync)
//!                     fsync, a backlog ≥ 64 KiB
//! ```
//!
//! The syncer thread loops as a plain group commit does: write one batch (≤ batch_bytes_max)
//! of what is pending, fsync, publish. While its fsync runs, records pile up; small ones
//! wait for the syncer to write them right after (a write of a few KiB costs microseconds,
//! less than waking another thread), but once `WRITE_AHEAD_BYTES_MIN` is waiting (a
//! snapshot's part), the write-ahead thread writes it meanwhile, so the next fsync starts at
//! once. Both write through one `Writer` under a mutex, in append order, and hand each batch
//! written over as a `Written` mark. The fsync takes every mark handed over before it began
//! and publishes only the last one's LSN: a mark is handed over after its write returned, so
//! the fsync covers every record that LSN names; batches written during it wait for the
//! next.
//!
//! Rotation keeps the rule that a segment is synced whole before the next exists: only the
//! syncer thread opens a segment, and only once every batch written to the current one is
//! synced; the write-ahead thread never writes a batch that opens one.
//!
//! On the first failed write or fsync the WAL is failed for good (a failed fsync is never
//! retried: the kernel may already have dropped the pages). The failing thread marks the
//! pipe failed and waits for the write or fsync in progress elsewhere: an fsync that
//! succeeds still publishes what it covered (all of it fully written), and no write starts
//! after the mark. Then the active segment is cut back to its last synced length and the
//! failure is published; the durable LSN never moves again, so every batch written after the
//! failed one fails too.
use std::collections::VecDeque;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

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
    // Durable before the segment that relies on it exists: see the `floor` module.
    super::floor::write_floor(storage, header.token_floor, sync_mode)?;
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

/// Deletes the segments in `segments` (oldest first) older than `seq`, oldest first, and
/// stops at the first that fails, kept to retry: the segments left are always one run of
/// consecutive numbers, which recovery requires (a newer one deleted past a failed older one
/// left a gap, and recovery refused to start: review 9, finding 4).
pub(super) fn delete_segments_before(
    storage: &dyn Storage,
    seq: u64,
    segments: &mut VecDeque<(u64, u64)>,
) -> u64 {
    let mut deleted = 0;
    while let Some(&(old, _)) = segments.front().filter(|&&(old, _)| old < seq) {
        let name = segment_name(old);
        if let Err(e) = storage.remove(&name) {
            tracing::warn!(path = %storage.path(&name).display(), error = %e, "WAL: cannot delete old segment; newer ones wait for it");
            break;
        }
        segments.pop_front();
        deleted += 1;
    }
    if deleted > 0 {
        if let Err(e) = storage.sync_dir() {
            tracing::warn!(error = %e, "WAL: cannot sync directory after deleting segments");
        }
    }
    deleted
}

/// Starts the syncer's threads, which append to `file` (segment `seq`, `synced_len` bytes
/// long and durable); `on_disk` lists the segments that exist, oldest first. The handle is
/// the syncer's, which stops and joins the write-ahead thread before it ends.
pub(super) fn spawn(
    shared: Arc<Shared>,
    file: Box<dyn SegmentFile>,
    seq: u64,
    synced_len: u64,
    on_disk: VecDeque<(u64, u64)>,
) -> io::Result<JoinHandle<()>> {
    let pipe = Arc::new(Pipe {
        state: Mutex::new(PipeState {
            written: VecDeque::new(),
            next_file: None,
            seq,
            synced_len,
            writing: false,
            syncing: false,
            failed: false,
        }),
        changed: Condvar::new(),
    });
    let sync_file = file.try_clone()?;
    let writer = Arc::new(Mutex::new(Writer {
        shared: Arc::clone(&shared),
        pipe: Arc::clone(&pipe),
        file,
        seq,
        batch: Vec::new(),
    }));
    let ahead = WriteAhead {
        shared: Arc::clone(&shared),
        pipe: Arc::clone(&pipe),
        writer: Arc::clone(&writer),
    };
    let ahead_thread = std::thread::Builder::new()
        .name("tenure-wal-ahead".into())
        .spawn(move || ahead.run())?;
    let syncer = Syncer {
        shared: Arc::clone(&shared),
        pipe,
        writer,
        file: sync_file,
        on_disk,
        ahead_thread: Some(ahead_thread),
    };
    let spawned = std::thread::Builder::new()
        .name("tenure-wal-sync".into())
        .spawn(move || syncer.run());
    if spawned.is_err() {
        // No syncer to stop it: let the write-ahead thread end instead of waiting for ever.
        stop_ahead(&shared);
    }
    spawned
}

/// What the writing side hands the fsync, and who is busy.
struct Pipe {
    state: Mutex<PipeState>,
    /// Signalled on every change of `PipeState`.
    changed: Condvar,
}

struct PipeState {
    /// Batches written and not yet covered by an fsync, oldest first; all in segment `seq`.
    written: VecDeque<Written>,
    /// A segment just created, for the fsync side to sync from now on.
    next_file: Option<(u64, Box<dyn SegmentFile>)>,
    /// The active segment, and how much of it is durable: the length a failure cuts it to.
    seq: u64,
    synced_len: u64,
    /// A write (or segment creation) is in progress.
    writing: bool,
    /// An fsync is in progress; its outcome is published before this is cleared.
    syncing: bool,
    /// A write or fsync failed: no thread starts another call.
    failed: bool,
}

/// One batch, written in full to the active segment.
struct Written {
    last_lsn: u64,
    records: u64,
    bytes: u64,
    /// The batch holds the end record of the snapshot that opened segment `seq`.
    snapshot_end: Option<u64>,
}

impl Pipe {
    fn lock(&self) -> MutexGuard<'_, PipeState> {
        self.state.lock().expect("WAL pipe lock poisoned")
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, PipeState>) -> MutexGuard<'a, PipeState> {
        self.changed.wait(guard).expect("WAL pipe lock poisoned")
    }

    /// Clears a busy flag (and hands over `written`, if any); wakes whoever waits.
    fn done(&self, busy: fn(&mut PipeState) -> &mut bool, written: Option<Written>) {
        let mut pipe = self.lock();
        *busy(&mut pipe) = false;
        pipe.written.extend(written);
        drop(pipe);
        self.changed.notify_all();
    }
}

fn writing(pipe: &mut PipeState) -> &mut bool {
    &mut pipe.writing
}

fn syncing(pipe: &mut PipeState) -> &mut bool {
    &mut pipe.syncing
}

/// The writing side: the active segment's file and the batch being written. Behind a mutex,
/// as the syncer and the write-ahead thread both write, one at a time and in append order.
struct Writer {
    shared: Arc<Shared>,
    pipe: Arc<Pipe>,
    file: Box<dyn SegmentFile>,
    seq: u64,
    /// The batch being written; its buffers go back to the spares at the next take.
    batch: Vec<Chunk>,
}

/// Why a batch was not written.
enum Stop {
    /// A write failed: the WAL must fail.
    Failed(String),
    /// Another thread failed the WAL first; nothing more to do.
    Quiet,
}

impl Writer {
    /// Moves up to one batch of pending chunks into `self.batch`, without waiting; `false` if
    /// there is none to take. `ahead`: only if `State::write_ahead_due`, so never a batch
    /// that opens a segment. Otherwise not one that opens a segment while batches written
    /// to the current one wait for their fsync: a segment is synced whole before the next.
    fn take_batch(&mut self, ahead: bool) -> bool {
        let shared = Arc::clone(&self.shared);
        let mut state = shared.state.lock().expect("WAL state lock poisoned");
        for mut chunk in self.batch.drain(..) {
            if state.spare.len() < SPARE_CHUNKS_MAX {
                chunk.buf.clear();
                state.spare.push(chunk.buf);
            }
        }
        let Some(front) = state.chunks.front() else {
            return false;
        };
        let blocked = if ahead {
            !state.write_ahead_due()
        } else {
            front.rotate_to.is_some() && !self.pipe.lock().written.is_empty()
        };
        if state.failed.is_some() || blocked {
            return false;
        }
        let mut bytes = 0;
        while let Some(next) = state.chunks.front() {
            let first = self.batch.is_empty();
            let fits = bytes + next.buf.len() <= shared.options.batch_bytes_max;
            // A new segment always starts a batch, so each batch goes to one file.
            if !first && (!fits || next.rotate_to.is_some()) {
                break;
            }
            let chunk = state.chunks.pop_front().expect("front checked");
            bytes += chunk.buf.len();
            self.batch.push(chunk);
        }
        state.unwritten_bytes -= bytes;
        true
    }

    /// Writes the batch (after starting its segment, if it opens one) and hands it to the
    /// fsync side.
    fn write_batch(&mut self) -> Result<(), Stop> {
        if let Some(header) = self.batch[0].rotate_to {
            self.rotate(header)?;
        }
        self.begin()?;
        let storage = &*self.shared.storage;
        let mut result = Ok(());
        for chunk in &self.batch {
            if let Err(e) = self.file.write_all(&chunk.buf) {
                let path = storage.path(&segment_name(self.seq));
                result = Err(Stop::Failed(format!("writing {}: {e}", path.display())));
                break;
            }
        }
        let written = result.is_ok().then(|| Written {
            last_lsn: self.batch.last().expect("batches are never empty").last_lsn,
            records: self.batch.iter().map(|c| c.records).sum(),
            bytes: self.batch.iter().map(|c| c.buf.len() as u64).sum(),
            snapshot_end: self.batch.iter().rev().find_map(|c| c.snapshot_end),
        });
        self.pipe.done(writing, written);
        result
    }

    /// Marks a write in progress; `Stop::Quiet` if the WAL failed.
    fn begin(&self) -> Result<(), Stop> {
        let mut pipe = self.pipe.lock();
        if pipe.failed {
            return Err(Stop::Quiet);
        }
        pipe.writing = true;
        Ok(())
    }

    /// Creates segment `header.seq` (only the syncer does, once everything written to the
    /// current one is synced) and hands it to the fsync side.
    fn rotate(&mut self, header: SegmentHeader) -> Result<(), Stop> {
        assert_eq!(header.seq, self.seq + 1, "segments are created in order");
        self.begin()?;
        let sync_mode = self.shared.options.sync_mode;
        let storage = &*self.shared.storage;
        let created = create_segment(storage, header, sync_mode).and_then(|file| {
            let clone = file.try_clone();
            let path = storage.path(&segment_name(header.seq));
            clone.map(|clone| (file, clone)).map_err(|e| (path, e))
        });
        let (file, clone) = match created {
            Ok(files) => files,
            Err((path, e)) => {
                self.pipe.done(writing, None);
                return Err(Stop::Failed(format!("creating {}: {e}", path.display())));
            }
        };
        (self.file, self.seq) = (file, header.seq);
        let mut pipe = self.pipe.lock();
        assert!(
            pipe.written.is_empty() && pipe.next_file.is_none(),
            "a segment is synced whole before the next is created"
        );
        pipe.next_file = Some((header.seq, clone));
        pipe.seq = header.seq;
        pipe.synced_len = record::SEGMENT_HEADER_LEN as u64;
        drop(pipe);
        let mut state = self.shared.state.lock().expect("WAL state lock poisoned");
        state.stats.segments_created += 1;
        state.stats.fsyncs += u64::from(sync_mode == SyncMode::Data);
        drop(state);
        self.pipe.done(writing, None);
        Ok(())
    }
}

/// The write-ahead thread: while an fsync runs, writes a large backlog (a snapshot's part)
/// so the next fsync can start at once instead of after that write.
struct WriteAhead {
    shared: Arc<Shared>,
    pipe: Arc<Pipe>,
    writer: Arc<Mutex<Writer>>,
}

impl WriteAhead {
    fn run(self) {
        while self.wait_due() {
            let mut writer = self.writer.lock().expect("WAL writer lock poisoned");
            if !writer.take_batch(true) {
                continue;
            }
            match writer.write_batch() {
                Ok(()) => {
                    drop(writer);
                    self.wake_syncer();
                }
                Err(Stop::Failed(why)) => {
                    drop(writer);
                    return fail(&self.shared, &self.pipe, why);
                }
                Err(Stop::Quiet) => return,
            }
        }
    }

    /// Wakes the syncer if it sleeps: the fsync this write overlapped may have returned
    /// while it ran, and the syncer, finding nothing pending then, gone to wait for appends
    /// that may never come. It checks for written batches under the state lock before it
    /// sleeps, and the batch was handed over before this takes that lock, so either it saw
    /// the batch or it is asleep now and is woken.
    fn wake_syncer(&self) {
        let state = self.shared.state.lock().expect("WAL state lock poisoned");
        let waiting = state.syncer_waiting;
        drop(state);
        if waiting {
            self.shared.work.notify_one();
        }
    }

    /// Waits until a write ahead is due; `false` once the syncer stops.
    fn wait_due(&self) -> bool {
        let shared = &*self.shared;
        let mut state = shared.state.lock().expect("WAL state lock poisoned");
        loop {
            if state.failed.is_some() || state.ahead_stop {
                return false;
            }
            if state.write_ahead_due() {
                return true;
            }
            state.ahead_waiting = true;
            state = shared.ahead.wait(state).expect("WAL state lock poisoned");
            state.ahead_waiting = false;
        }
    }
}

/// Tells the write-ahead thread to end.
fn stop_ahead(shared: &Shared) {
    shared
        .state
        .lock()
        .expect("WAL state lock poisoned")
        .ahead_stop = true;
    shared.ahead.notify_all();
}

/// The syncer thread: writes a batch, fsyncs everything written, publishes, and again. Its
/// handle on the active segment is for fsyncs only.
struct Syncer {
    shared: Arc<Shared>,
    pipe: Arc<Pipe>,
    writer: Arc<Mutex<Writer>>,
    file: Box<dyn SegmentFile>,
    /// `(seq, _)` of the segments on disk, oldest first (for deletion after a snapshot).
    on_disk: VecDeque<(u64, u64)>,
    ahead_thread: Option<JoinHandle<()>>,
}

/// What one fsync covered: every batch handed over before it started.
#[derive(Default)]
struct Group {
    last_lsn: u64,
    records: u64,
    bytes: u64,
    snapshot_end: Option<u64>,
}

impl Syncer {
    fn run(mut self) {
        while self.wait_for_work() {
            let mut writer = self.writer.lock().expect("WAL writer lock poisoned");
            let written = match writer.take_batch(false) {
                true => writer.write_batch(),
                false => Ok(()),
            };
            drop(writer);
            match written {
                Ok(()) => {}
                Err(Stop::Failed(why)) => {
                    fail(&self.shared, &self.pipe, why);
                    break;
                }
                Err(Stop::Quiet) => break,
            }
            if !self.sync_written() {
                break;
            }
        }
        stop_ahead(&self.shared);
        if let Some(handle) = self.ahead_thread.take() {
            if handle.join().is_err() {
                tracing::error!("WAL write-ahead thread panicked");
            }
        }
    }

    /// Waits for chunks, or batches written ahead; `false` once shut down with nothing
    /// left, or after a failure.
    fn wait_for_work(&self) -> bool {
        let shared = &*self.shared;
        let mut state = shared.state.lock().expect("WAL state lock poisoned");
        loop {
            if state.failed.is_some() {
                return false;
            }
            let pipe = self.pipe.lock();
            if !state.chunks.is_empty() || !pipe.written.is_empty() {
                return true;
            }
            // A write ahead in progress hands over a batch to sync, and wakes this thread.
            if state.shutdown && !pipe.writing {
                return false;
            }
            drop(pipe);
            state.syncer_waiting = true;
            state = shared.work.wait(state).expect("WAL state lock poisoned");
            state.syncer_waiting = false;
        }
    }

    /// Fsyncs every batch written so far and publishes it; `false` after a failure.
    fn sync_written(&mut self) -> bool {
        let Some(group) = self.take_group() else {
            return !self.pipe.lock().failed;
        };
        let synced = self.sync();
        let failed = synced.as_ref().err().cloned();
        if let Ok(elapsed) = synced {
            self.publish(&group, elapsed);
        }
        if let Some(why) = failed {
            self.pipe.done(syncing, None);
            fail(&self.shared, &self.pipe, why);
            return false;
        }
        self.pipe.lock().synced_len += group.bytes;
        self.pipe.done(syncing, None);
        if let Some(seq) = group.snapshot_end {
            self.delete_before(seq);
        }
        true
    }

    /// Takes every written batch, marks the fsync begun; `None` if there is none or the WAL
    /// failed.
    fn take_group(&mut self) -> Option<Group> {
        let mut pipe = self.pipe.lock();
        if pipe.failed || pipe.written.is_empty() {
            return None;
        }
        if let Some((seq, file)) = pipe.next_file.take() {
            self.file = file;
            self.on_disk.push_back((seq, 0));
        }
        let mut group = Group::default();
        for batch in pipe.written.drain(..) {
            group.last_lsn = batch.last_lsn;
            group.records += batch.records;
            group.bytes += batch.bytes;
            group.snapshot_end = batch.snapshot_end.or(group.snapshot_end);
        }
        pipe.syncing = true;
        drop(pipe);
        let mut state = self.shared.state.lock().expect("WAL state lock poisoned");
        state.fsync_busy = true;
        let ahead = state.ahead_waiting && state.write_ahead_due();
        drop(state);
        if ahead {
            self.shared.ahead.notify_one();
        }
        Some(group)
    }

    /// Syncs the active segment (unless sync is off); the fsync's duration, if one was made.
    fn sync(&mut self) -> Result<Option<std::time::Duration>, String> {
        if self.shared.options.sync_mode != SyncMode::Data {
            return Ok(None);
        }
        let started = std::time::Instant::now();
        match self.file.sync_data() {
            Ok(()) => Ok(Some(started.elapsed())),
            Err(e) => {
                let seq = self.pipe.lock().seq;
                let path = self.shared.storage.path(&segment_name(seq));
                Err(format!("fdatasync {}: {e}", path.display()))
            }
        }
    }

    /// Advances the durable LSN past the group; counts it.
    fn publish(&mut self, group: &Group, synced: Option<std::time::Duration>) {
        self.shared
            .options
            .metrics
            .batch_written(group.records, synced);
        let mut state = self.shared.state.lock().expect("WAL state lock poisoned");
        state.durable_lsn = group.last_lsn;
        state.fsync_busy = false;
        // Bytes count against the backlog until durable, not just until written: a disk
        // that stops syncing must fill the backlog, as it did before writes were pipelined.
        state.pending_bytes -= usize::try_from(group.bytes).expect("a group fits in memory");
        state.stats.batches += 1;
        state.stats.fsyncs += u64::from(synced.is_some());
        state.stats.records += group.records;
        state.stats.bytes += group.bytes;
        state.stats.segments_on_disk = self.on_disk.len() as u64;
        drop(state);
        self.shared.durable.notify_all();
        self.shared
            .durable_tx
            .send_modify(|s| s.lsn = group.last_lsn);
    }

    /// Deletes the segments a now-durable snapshot (opened in segment `seq`) replaced.
    fn delete_before(&mut self, seq: u64) {
        let deleted = delete_segments_before(&*self.shared.storage, seq, &mut self.on_disk);
        let mut state = self.shared.state.lock().expect("WAL state lock poisoned");
        state.stats.segments_deleted += deleted;
        state.stats.segments_on_disk = self.on_disk.len() as u64;
    }
}

/// Enters the failed state for good, unless another thread already did: waits for the
/// write or fsync in progress elsewhere (the caller has cleared its own busy flag), cuts the
/// active segment back to its synced length, drops pending records and wakes every waiter.
fn fail(shared: &Shared, pipe: &Pipe, why: String) {
    let mut guard = pipe.lock();
    if guard.failed {
        return;
    }
    guard.failed = true;
    pipe.changed.notify_all();
    while guard.syncing || guard.writing {
        guard = pipe.wait(guard);
    }
    let (seq, synced_len) = (guard.seq, guard.synced_len);
    drop(guard);
    tracing::error!(error = %why, "WAL write failed; no further records will be durable");
    // Part of the failed batch, or of batches written after it, may have reached the file
    // (a short write's prefix, or pages whose fsync failed but were written back anyway).
    // None of it was acknowledged, so cut the segment back to what was synced: a restart
    // must not bring those records back.
    let name = segment_name(seq);
    match shared.storage.truncate(&name, synced_len) {
        Ok(()) => tracing::warn!(
            path = %shared.storage.path(&name).display(),
            len = synced_len,
            "WAL: cut the failed batch off the active segment"
        ),
        Err(e) => tracing::error!(
            path = %shared.storage.path(&name).display(),
            error = %e,
            "WAL: cannot cut the failed batch off; a restart may bring unacknowledged records back"
        ),
    }
    let why: Arc<str> = why.into();
    // Watch first: whoever sees the failure through the state lock sees it here too.
    shared
        .durable_tx
        .send_modify(|s| s.failed = Some(Arc::clone(&why)));
    let mut state = shared.state.lock().expect("WAL state lock poisoned");
    state.failed = Some(why);
    state.chunks.clear();
    (state.pending_bytes, state.unwritten_bytes) = (0, 0);
    state.fsync_busy = false;
    drop(state);
    shared.durable.notify_all();
    // A writer waiting for chunks sees the failure and stops.
    shared.work.notify_one();
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::wal::storage::{FsStorage, SegmentFile};

    /// A directory whose `remove` of one file fails.
    struct FailsToRemove {
        inner: FsStorage,
        name: String,
    }

    impl Storage for FailsToRemove {
        fn path(&self, name: &str) -> PathBuf {
            self.inner.path(name)
        }
        fn list(&self) -> std::io::Result<Vec<String>> {
            self.inner.list()
        }
        fn len(&self, name: &str) -> std::io::Result<u64> {
            self.inner.len(name)
        }
        fn read(&self, name: &str) -> std::io::Result<Vec<u8>> {
            self.inner.read(name)
        }
        fn create(&self, name: &str) -> std::io::Result<Box<dyn SegmentFile>> {
            self.inner.create(name)
        }
        fn truncate(&self, name: &str, len: u64) -> std::io::Result<()> {
            self.inner.truncate(name, len)
        }
        fn remove(&self, name: &str) -> std::io::Result<()> {
            if name == self.name {
                return Err(std::io::Error::other("injected"));
            }
            self.inner.remove(name)
        }
        fn sync_dir(&self) -> std::io::Result<()> {
            self.inner.sync_dir()
        }
    }

    /// Segments are deleted oldest first, and one that cannot be deleted keeps every newer
    /// one: the segments left are consecutive, as recovery requires (review 9, finding 4).
    #[test]
    fn a_segment_that_cannot_be_deleted_keeps_the_newer_ones() {
        let dir = tempfile::tempdir().unwrap();
        let storage = FailsToRemove {
            inner: FsStorage::new(dir.path()).unwrap(),
            name: segment_name(2),
        };
        let mut segments: VecDeque<(u64, u64)> = (1..=5).map(|seq| (seq, 0)).collect();
        for &(seq, _) in &segments {
            storage.create(&segment_name(seq)).unwrap();
        }
        assert_eq!(delete_segments_before(&storage, 5, &mut segments), 1);
        let left: Vec<u64> = segments.iter().map(|&(seq, _)| seq).collect();
        assert_eq!(left, vec![2, 3, 4, 5]);
        let mut on_disk = storage.list().unwrap();
        on_disk.sort();
        assert_eq!(on_disk, (2..=5).map(segment_name).collect::<Vec<_>>());
        // Once it can be, it and the ones after it go.
        let storage = FsStorage::new(dir.path()).unwrap();
        assert_eq!(delete_segments_before(&storage, 5, &mut segments), 3);
        assert_eq!(segments, VecDeque::from([(5, 0)]));
    }
}
