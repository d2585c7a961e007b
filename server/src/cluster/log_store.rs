//! The Raft log of one node: an append-only file, and the vote and purge point in a small
//! state file replaced atomically.
//!
//! # Files (in the node's data directory)
//! - `raft.log`: records back to back, each `len u32 | crc u32 | index u64 | term u64 |
//!   entry` (big-endian; `len` counts the entry bytes, `crc` is CRC-32 of index, term and
//!   entry; the entry is openraft's `Entry` in postcard). Indexes are consecutive.
//! - `raft.state`: postcard of [`Persisted`] (the vote, the last purged log id), written to
//!   `raft.state.tmp`, fsynced, renamed over, and the directory fsynced: it is the old file
//!   or the new one after a crash, never a mix.
//!
//! # Durability
//! An append is written and `fdatasync`ed before openraft is told it is durable (the vote
//! too, before `save_vote` returns). Opening reads every record; the first one that is
//! short or fails its checksum ends the log, and the file is cut there (a torn write of an
//! append that was never reported durable), unless an intact record follows somewhere after
//! it: that is damage, not a torn write, and opening refuses, naming the offsets. As with
//! the WAL, one crash pattern is refused too: an unsynced append of several records whose
//! first pages never reached the disk but whose later ones did. Nothing past such a hole was
//! acknowledged, so an operator who sees zeros at the named offset may cut the file there. A truncation cuts the file and syncs; a purge
//! first records the purge point in `raft.state`, then rewrites `raft.log` without the purged
//! records (a temporary file renamed over), so a crash in between leaves records that are
//! dropped again on open.
//!
//! Every write to `raft.log` (appends, truncations, the purge's rewrite) goes to one writer
//! thread per log, in the order the calls were made, and the in-memory index is updated at
//! the call, so it is always the file's future. openraft's `append` returns once its records
//! are queued, and the writer reports them durable through openraft's `LogFlushed` callback
//! after their `fdatasync`: the Raft core does not wait for the disk, so while one append is
//! written and synced it goes on answering heartbeats, votes and pre-votes, ticking, and (on
//! the leader) sending heartbeats; before, each append's write and fsync stalled all of it
//! (CLUSTER.md, "Heartbeats and bulk appends"). Truncations and purges wait for the writer
//! (their file work follows every append queued before them), on a blocking thread
//! ([`blocking`]), as vote saves do; openraft makes one storage call at a time.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, LogState, RaftLogReader, Vote};
use serde::{Deserialize, Serialize};

use super::peer_check::TERM_MAX;
use super::{storage_error, Entry, LogId, NodeId, StorageError, TypeConfig};

/// Bytes before a record's entry: length, checksum, index, term.
const RECORD_HEADER_LEN: usize = 4 + 4 + 8 + 8;
/// Longest entry a record may hold; a longer length on disk is damage, not a reason to
/// allocate. Entries are batches the leader caps far below this.
pub const ENTRY_LEN_MAX: usize = 64 << 20;

const LOG_FILE: &str = "raft.log";
const STATE_FILE: &str = "raft.state";

/// What `raft.state` holds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Persisted {
    /// The last vote saved.
    pub vote: Option<Vote<NodeId>>,
    /// Every entry up to this one is purged (covered by a snapshot).
    pub last_purged: Option<LogId>,
}

/// The log and its files; clones share them (the reader openraft asks for is a clone).
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    dir: PathBuf,
    /// Where the file work goes, in order ([`start_writer`]).
    writer: mpsc::Sender<Job>,
    /// Entries by index, with the file offset each record starts at.
    entries: BTreeMap<u64, (Entry, u64)>,
    /// Where the next record goes.
    end: u64,
    persisted: Persisted,
    /// Whether `open` cut a torn tail off, and where: for the log, and tests.
    torn_tail_at: Option<u64>,
    /// A write or sync failed: the file may hold part of a record, and whether the kernel
    /// kept the rest is unknown ("fsyncgate"), so nothing is written again. Set by the
    /// writer thread.
    failed: Arc<AtomicBool>,
}

/// One piece of file work for the writer thread; it gets the file (which it may replace).
type Job = Box<dyn FnOnce(&mut File) + Send>;

/// Starts the writer thread of one log: it owns `raft.log` and does its jobs in the order
/// sent. It ends when every [`LogStore`] clone is gone, after the jobs already sent.
fn start_writer(file: File) -> std::io::Result<mpsc::Sender<Job>> {
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name("raft-log".into())
        .spawn(move || {
            let mut file = file;
            for job in rx {
                job(&mut file);
            }
        })?;
    Ok(tx)
}

/// Runs `work` on the writer thread after every job sent before, and returns its result
/// through `done`; `failed` is set if it fails.
fn file_job(
    writer: &mpsc::Sender<Job>,
    failed: &Arc<AtomicBool>,
    work: impl FnOnce(&mut File) -> std::io::Result<()> + Send + 'static,
    done: impl FnOnce(std::io::Result<()>) + Send + 'static,
) {
    let failed_flag = Arc::clone(failed);
    let job: Job = Box::new(move |file| {
        let result = if failed_flag.load(Ordering::Acquire) {
            Err(unusable())
        } else {
            work(file)
        };
        if result.is_err() {
            failed_flag.store(true, Ordering::Release);
        }
        done(result);
    });
    if let Err(mpsc::SendError(job)) = writer.send(job) {
        // The thread is gone (it panicked): nothing can be written any more.
        failed.store(true, Ordering::Release);
        drop(job);
    }
}

fn unusable() -> std::io::Error {
    std::io::Error::other("an earlier write to the Raft log failed; it takes no more")
}

/// Waits for the result a [`file_job`] sends on `rx`. Blocking.
fn wait_job(rx: &mpsc::Receiver<std::io::Result<()>>) -> std::io::Result<()> {
    rx.recv()
        .unwrap_or_else(|_| Err(std::io::Error::other("the Raft log's writer thread ended")))
}

/// The term a saved vote over [`TERM_MAX`] is lowered to when the node starts: far above
/// any real term, and far enough below [`TERM_MAX`] for 2^47 more elections.
pub const TERM_CLAMPED: u64 = TERM_MAX / 2;

/// The vote a node must start with instead of `vote`, if `vote`'s term is over
/// [`TERM_MAX`]: one of term [`TERM_CLAMPED`] for the same node, not committed.
///
/// Only a forged frame taken by a version without the peer checks can have put it there
/// (issue 22): openraft would overflow `term + 1` at its next election, and after every
/// restart. Lowering a vote is safe when no node ever acted in a term between the two: no
/// honest node reaches [`TERM_CLAMPED`] (2^47 elections), nodes refuse every frame over
/// [`TERM_MAX`], and a node holding the forged vote refused every lower one, so it never
/// voted in a term above the last real one it saw. `log_term` is the term of the log's
/// last entry: a vote may never fall below it.
///
/// # Errors
/// When the log's last term is over [`TERM_CLAMPED`] (no lowered vote can stay above it).
pub fn clamp_vote(vote: Vote<NodeId>, log_term: u64) -> Result<Option<Vote<NodeId>>, String> {
    let term = vote.leader_id().term;
    if term <= TERM_MAX {
        return Ok(None);
    }
    if log_term > TERM_CLAMPED {
        return Err(format!(
            "the saved vote's term {term} is over TERM_MAX ({TERM_MAX}) and the log's last term \
             {log_term} over {TERM_CLAMPED}: refusing to start; move this node's data \
             directory aside and start it empty to rejoin (CLUSTER.md)"
        ));
    }
    Ok(Some(Vote::new(TERM_CLAMPED, vote.leader_id().node_id)))
}

/// The term of the log's last entry (or its purge point), 0 for none.
///
/// # Errors
/// When it is over [`TERM_MAX`]: entries no real leader wrote (a forged append an older
/// version took), which no node may keep.
fn last_log_term(
    entries: &BTreeMap<u64, (Entry, u64)>,
    last_purged: Option<LogId>,
    path: &Path,
) -> std::io::Result<u64> {
    // Terms never fall along a log: the last entry (or the purge point) has the highest.
    let last = entries.values().next_back().map(|(entry, _)| entry.log_id);
    let Some(id) = last.or(last_purged) else {
        return Ok(0);
    };
    if id.leader_id.term <= TERM_MAX {
        return Ok(id.leader_id.term);
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "Raft log {} holds entry {} of term {}, over TERM_MAX ({TERM_MAX}): written by a \
             forged peer frame an older version took. Refusing to start; move this node's \
             data directory aside and start it empty to rejoin (CLUSTER.md)",
            path.display(),
            id.index,
            id.leader_id.term
        ),
    ))
}

impl LogStore {
    /// Opens (or creates) the log in `dir`, cutting a torn tail off.
    ///
    /// # Errors
    /// When a file cannot be read, written or synced, or `raft.state` is damaged; when the
    /// log holds a term over [`TERM_MAX`], or the vote does and cannot be lowered
    /// ([`clamp_vote`]).
    pub fn open(dir: &Path) -> std::io::Result<LogStore> {
        std::fs::create_dir_all(dir)?;
        let persisted = match std::fs::read(dir.join(STATE_FILE)) {
            Ok(bytes) => postcard::from_bytes(&bytes).map_err(std::io::Error::other)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Persisted::default(),
            Err(e) => return Err(e),
        };
        let path = dir.join(LOG_FILE);
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .append(true)
            .open(&path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let (entries, end) = parse(&bytes, persisted.last_purged.map(|id| id.index));
        if let Some(at) = intact_record_after(&bytes, end as usize) {
            // Not a torn write: an acknowledged entry may follow the damage, and a node that
            // forgot entries it acknowledged could elect a leader without them.
            return Err(std::io::Error::other(format!(
                "Raft log {} is damaged at byte {end}: an intact record follows at byte {at}",
                path.display()
            )));
        }
        let torn_tail_at = (end < bytes.len() as u64).then_some(end);
        if let Some(at) = torn_tail_at {
            tracing::warn!(path = %path.display(), offset = at, "cut a torn record off the end of the Raft log");
            file.set_len(at)?;
            file.sync_all()?;
        }
        let log_term = last_log_term(&entries, persisted.last_purged, &path)?;
        let vote = persisted.vote;
        let lowered = match vote {
            Some(vote) => clamp_vote(vote, log_term)
                .map_err(|why| std::io::Error::new(std::io::ErrorKind::InvalidData, why))?,
            None => None,
        };
        let store = LogStore {
            inner: Arc::new(Mutex::new(Inner {
                dir: dir.to_path_buf(),
                writer: start_writer(file)?,
                entries,
                end,
                persisted,
                torn_tail_at,
                failed: Arc::new(AtomicBool::new(false)),
            })),
        };
        if let Some(lowered) = lowered {
            tracing::warn!(
                from = %vote.expect("clamped a vote"),
                to = %lowered,
                "the saved vote's term is over TERM_MAX, which no peer may send (a forged \
                 frame an older version took): lowered, see CLUSTER.md"
            );
            store.save_vote_sync(lowered)?;
        }
        Ok(store)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("Raft log poisoned")
    }

    /// Where `open` cut a torn tail, if it did.
    pub fn torn_tail_at(&self) -> Option<u64> {
        self.lock().torn_tail_at
    }

    /// Appends `entries` and syncs them. Blocking.
    ///
    /// # Errors
    /// When the write or the sync fails; nothing appended since is to be trusted then.
    pub fn append_sync(&self, entries: impl IntoIterator<Item = Entry>) -> std::io::Result<()> {
        let (tx, rx) = mpsc::channel();
        self.append_then(entries, move |result| drop(tx.send(result)))?;
        wait_job(&rx)
    }

    /// Appends `entries`: in memory at once, and to the file by the writer thread, which
    /// calls `flushed` once they are written and synced (or failed). Does not block on I/O.
    ///
    /// # Errors
    /// When an earlier write failed or an entry cannot be encoded (`flushed` is not called).
    pub fn append_then(
        &self,
        entries: impl IntoIterator<Item = Entry>,
        flushed: impl FnOnce(std::io::Result<()>) + Send + 'static,
    ) -> std::io::Result<()> {
        let mut inner = self.lock();
        inner.usable()?;
        let mut buf = Vec::new();
        let mut added = Vec::new();
        for entry in entries {
            let at = inner.end + buf.len() as u64;
            encode(&entry, &mut buf)?;
            added.push((entry, at));
        }
        inner.end += buf.len() as u64;
        for (entry, at) in added {
            inner.entries.insert(entry.log_id.index, (entry, at));
        }
        // Sent under the lock: the writer's order is the order the index changed in.
        let write = move |file: &mut File| file.write_all(&buf).and_then(|()| file.sync_data());
        file_job(&inner.writer, &inner.failed, write, flushed);
        Ok(())
    }

    /// Entries with index in `range`, in order.
    pub fn entries(&self, range: impl RangeBounds<u64>) -> Vec<Entry> {
        let inner = self.lock();
        inner
            .entries
            .range(range)
            .map(|(_, (entry, _))| entry.clone())
            .collect()
    }

    /// Removes every entry from `index` on, in memory and on disk. Blocking.
    ///
    /// # Errors
    /// When the file cannot be cut or synced.
    pub fn truncate_from(&self, index: u64) -> std::io::Result<()> {
        let mut inner = self.lock();
        inner.usable()?;
        let Some(&(_, at)) = inner.entries.range(index..).next().map(|(_, v)| v) else {
            return Ok(());
        };
        inner.end = at;
        let _ = inner.entries.split_off(&index);
        let (tx, rx) = mpsc::channel();
        let cut = move |file: &mut File| file.set_len(at).and_then(|()| file.sync_all());
        file_job(&inner.writer, &inner.failed, cut, move |r| drop(tx.send(r)));
        drop(inner);
        wait_job(&rx)
    }

    /// Drops every entry up to `log_id`: the purge point is saved first, then the file is
    /// rewritten without them. Blocking.
    ///
    /// # Errors
    /// When a file cannot be written, synced or renamed.
    pub fn purge_to(&self, log_id: LogId) -> std::io::Result<()> {
        let asked = std::time::Instant::now();
        let mut inner = self.lock();
        let locked = std::time::Instant::now();
        inner.usable()?;
        let mut persisted = inner.persisted.clone();
        persisted.last_purged = Some(log_id);
        write_atomically(&inner.dir, STATE_FILE, &postcard_bytes(&persisted)?)?;
        inner.persisted = persisted;
        let state_saved = std::time::Instant::now();
        let kept = inner.entries.split_off(&(log_id.index + 1));
        let mut buf = Vec::new();
        let mut entries = BTreeMap::new();
        for (index, (entry, _)) in kept {
            let at = buf.len() as u64;
            encode(&entry, &mut buf)?;
            entries.insert(index, (entry, at));
        }
        // The entries kept are out of `inner.entries` now: on failure the store is done.
        let encoded = std::time::Instant::now();
        let purged = std::mem::replace(&mut inner.entries, entries);
        let (purged_count, kept_count) = (purged.len(), inner.entries.len());
        drop(purged);
        let freed = std::time::Instant::now();
        inner.end = buf.len() as u64;
        let kept_bytes = buf.len();
        let dir = inner.dir.clone();
        let rewrite = move |file: &mut File| {
            write_atomically(&dir, LOG_FILE, &buf)?;
            *file = OpenOptions::new()
                .read(true)
                .append(true)
                .open(dir.join(LOG_FILE))?;
            Ok(())
        };
        let (tx, rx) = mpsc::channel();
        file_job(&inner.writer, &inner.failed, rewrite, move |r| {
            drop(tx.send(r))
        });
        drop(inner);
        let result = wait_job(&rx);
        tracing::info!(
            index = log_id.index,
            purged = purged_count,
            kept = kept_count,
            kept_bytes,
            lock_wait_ms = (locked - asked).as_millis() as u64,
            state_file_ms = (state_saved - locked).as_millis() as u64,
            encode_ms = (encoded - state_saved).as_millis() as u64,
            free_ms = (freed - encoded).as_millis() as u64,
            rewrite_ms = freed.elapsed().as_millis() as u64,
            "log purged"
        );
        result
    }

    /// Saves `vote` atomically. Blocking.
    ///
    /// # Errors
    /// When the state file cannot be written, synced or renamed.
    pub fn save_vote_sync(&self, vote: Vote<NodeId>) -> std::io::Result<()> {
        let mut inner = self.lock();
        let mut persisted = inner.persisted.clone();
        persisted.vote = Some(vote);
        write_atomically(&inner.dir, STATE_FILE, &postcard_bytes(&persisted)?)?;
        inner.persisted = persisted;
        Ok(())
    }

    /// The vote last saved.
    pub fn vote(&self) -> Option<Vote<NodeId>> {
        self.lock().persisted.vote
    }

    /// The last purged and the last log id.
    pub fn state(&self) -> LogState<TypeConfig> {
        let inner = self.lock();
        let last_purged_log_id = inner.persisted.last_purged;
        let last_log_id = inner
            .entries
            .last_key_value()
            .map(|(_, (entry, _))| entry.log_id)
            .or(last_purged_log_id);
        LogState {
            last_purged_log_id,
            last_log_id,
        }
    }
}

impl Inner {
    fn usable(&self) -> std::io::Result<()> {
        if self.failed.load(Ordering::Acquire) {
            return Err(unusable());
        }
        Ok(())
    }
}

fn postcard_bytes(value: &impl Serialize) -> std::io::Result<Vec<u8>> {
    postcard::to_stdvec(value).map_err(std::io::Error::other)
}

/// Appends one record of `entry` to `out`.
fn encode(entry: &Entry, out: &mut Vec<u8>) -> std::io::Result<()> {
    let body = postcard_bytes(entry)?;
    if body.len() > ENTRY_LEN_MAX {
        return Err(std::io::Error::other("Raft entry over ENTRY_LEN_MAX"));
    }
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    let mut hasher = crc32fast::Hasher::new();
    let index = entry.log_id.index.to_be_bytes();
    let term = entry.log_id.leader_id.term.to_be_bytes();
    hasher.update(&index);
    hasher.update(&term);
    hasher.update(&body);
    out.extend_from_slice(&hasher.finalize().to_be_bytes());
    out.extend_from_slice(&index);
    out.extend_from_slice(&term);
    out.extend_from_slice(&body);
    Ok(())
}

/// The entries in `bytes` and where the intact records end; entries up to `purged` are left
/// out (a purge interrupted before its rewrite).
fn parse(bytes: &[u8], purged: Option<u64>) -> (BTreeMap<u64, (Entry, u64)>, u64) {
    let mut entries = BTreeMap::new();
    let mut at = 0usize;
    let mut last_index: Option<u64> = None;
    while let Some((entry, len)) = decode_at(&bytes[at..]) {
        let index = entry.log_id.index;
        // A gap in the indexes is not a log this store wrote: treat it as the end.
        if last_index.is_some_and(|last| index != last + 1) {
            break;
        }
        last_index = Some(index);
        if purged.is_none_or(|purged| index > purged) {
            entries.insert(index, (entry, at as u64));
        }
        at += len;
    }
    (entries, at as u64)
}

/// The offset of the first intact record after the bad bytes at `bad`, if there is one:
/// then the damage is not a torn tail (a torn write is the last thing in the file).
fn intact_record_after(bytes: &[u8], bad: usize) -> Option<usize> {
    (bad + 1..bytes.len()).find(|&at| decode_at(&bytes[at..]).is_some())
}

/// The record at the start of `buf` and its length, if it is whole and intact.
fn decode_at(buf: &[u8]) -> Option<(Entry, usize)> {
    if buf.len() < RECORD_HEADER_LEN {
        return None;
    }
    let len = u32::from_be_bytes(buf[0..4].try_into().ok()?) as usize;
    if len > ENTRY_LEN_MAX || buf.len() < RECORD_HEADER_LEN + len {
        return None;
    }
    let stored = u32::from_be_bytes(buf[4..8].try_into().ok()?);
    let total = RECORD_HEADER_LEN + len;
    if crc32fast::hash(&buf[8..total]) != stored {
        return None;
    }
    let entry: Entry = postcard::from_bytes(&buf[RECORD_HEADER_LEN..total]).ok()?;
    let index = u64::from_be_bytes(buf[8..16].try_into().ok()?);
    (entry.log_id.index == index).then_some((entry, total))
}

/// Replaces `dir/name` with `bytes`: a temporary file written and synced, renamed over, and
/// the directory synced, so a crash leaves the old file or the new one.
pub(crate) fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut file = File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, dir.join(name))?;
    File::open(dir)?.sync_all()
}

/// Runs file I/O on a blocking thread and waits for it.
pub(crate) async fn blocking(
    io: impl FnOnce() -> std::io::Result<()> + Send + 'static,
) -> std::io::Result<()> {
    tokio::task::spawn_blocking(io)
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
}

fn log_error(verb: ErrorVerb, e: &std::io::Error) -> StorageError {
    storage_error(ErrorSubject::Logs, verb, e)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        Ok(self.entries(range))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        Ok(self.state())
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let (store, vote) = (self.clone(), *vote);
        blocking(move || store.save_vote_sync(vote))
            .await
            .map_err(|e| storage_error(ErrorSubject::Vote, ErrorVerb::Write, &e))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(self.vote())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        // Queued, not waited for: the writer thread tells openraft when the records are
        // durable (module docs), and the core goes on meanwhile.
        self.append_then(entries, move |result| callback.log_io_completed(result))
            .map_err(|e| log_error(ErrorVerb::Write, &e))
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let store = self.clone();
        blocking(move || store.truncate_from(log_id.index))
            .await
            .map_err(|e| log_error(ErrorVerb::Delete, &e))
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let store = self.clone();
        blocking(move || store.purge_to(log_id))
            .await
            .map_err(|e| log_error(ErrorVerb::Delete, &e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload};

    fn entry(term: u64, index: u64, records: &[u8]) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Normal(super::super::Batch {
                records: records.to_vec(),
            }),
        }
    }

    fn indexes(store: &LogStore) -> Vec<u64> {
        store.entries(..).iter().map(|e| e.log_id.index).collect()
    }

    #[test]
    fn appends_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync((1..=3).map(|i| entry(1, i, b"abc")))
            .unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&store), vec![1, 2, 3]);
        assert_eq!(store.entries(2..3)[0], entry(1, 2, b"abc"));
        assert_eq!(store.state().last_log_id.unwrap().index, 3);
        assert_eq!(store.torn_tail_at(), None);
    }

    #[test]
    fn a_torn_tail_is_cut_and_the_log_continues() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync((1..=2).map(|i| entry(1, i, b"abc")))
            .unwrap();
        let intact = std::fs::metadata(dir.path().join(LOG_FILE)).unwrap().len();
        drop(store);
        // Half of a third record: a crash in the middle of its write.
        let mut third = Vec::new();
        encode(&entry(1, 3, b"torn"), &mut third).unwrap();
        let mut file = OpenOptions::new()
            .append(true)
            .open(dir.path().join(LOG_FILE))
            .unwrap();
        file.write_all(&third[..third.len() / 2]).unwrap();
        drop(file);

        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.torn_tail_at(), Some(intact));
        assert_eq!(indexes(&store), vec![1, 2]);
        store.append_sync([entry(2, 3, b"new")]).unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&store), vec![1, 2, 3]);
        assert_eq!(store.entries(3..)[0], entry(2, 3, b"new"));
    }

    #[test]
    fn a_flipped_bit_ends_the_log_at_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync((1..=3).map(|i| entry(1, i, b"abc")))
            .unwrap();
        drop(store);
        let path = dir.path().join(LOG_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&store), vec![1, 2]);
    }

    #[test]
    fn damage_followed_by_an_intact_record_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync((1..=3).map(|i| entry(1, i, b"abc")))
            .unwrap();
        drop(store);
        let path = dir.path().join(LOG_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let mut first = Vec::new();
        encode(&entry(1, 1, b"abc"), &mut first).unwrap();
        bytes[first.len() + RECORD_HEADER_LEN] ^= 0x40; // inside the second record
        std::fs::write(&path, &bytes).unwrap();
        let refused = LogStore::open(dir.path()).err().expect("refused");
        let message = refused.to_string();
        assert!(message.contains("damaged at byte"), "{message}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "nothing cut");
    }

    /// A vote over TERM_MAX on disk (taken from a forged frame by an older version) used to
    /// panic the node after every restart: it is lowered to TERM_CLAMPED, for good.
    #[test]
    fn a_saved_vote_over_term_max_is_lowered_when_the_log_allows() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync((1..=3).map(|i| entry(4, i, b"abc")))
            .unwrap();
        store
            .save_vote_sync(Vote::new_committed(u64::MAX, 99))
            .unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.vote(), Some(Vote::new(TERM_CLAMPED, 99)));
        assert_eq!(indexes(&store), vec![1, 2, 3]);
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.vote(), Some(Vote::new(TERM_CLAMPED, 99)), "saved");
        // A vote within the bound is kept as it is.
        store
            .save_vote_sync(Vote::new_committed(TERM_MAX, 2))
            .unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.vote(), Some(Vote::new_committed(TERM_MAX, 2)));
    }

    #[test]
    fn a_log_of_a_term_over_term_max_is_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync([entry(4, 1, b"abc"), entry(u64::MAX, 2, b"forged")])
            .unwrap();
        drop(store);
        let message = LogStore::open(dir.path())
            .err()
            .expect("refused")
            .to_string();
        assert!(message.contains("over TERM_MAX"), "{message}");
        // A vote over the bound above a log already past TERM_CLAMPED cannot be lowered.
        let vote = Vote::new_committed(u64::MAX, 1);
        assert!(clamp_vote(vote, TERM_CLAMPED + 1).is_err());
        assert_eq!(
            clamp_vote(vote, TERM_CLAMPED),
            Ok(Some(Vote::new(TERM_CLAMPED, 1)))
        );
    }

    #[test]
    fn truncate_and_purge_persist() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync((1..=6).map(|i| entry(1, i, b"abc")))
            .unwrap();
        store.truncate_from(5).unwrap();
        store.append_sync([entry(2, 5, b"other")]).unwrap();
        store
            .purge_to(LogId::new(CommittedLeaderId::new(1, 1), 2))
            .unwrap();
        assert_eq!(indexes(&store), vec![3, 4, 5]);
        store.append_sync([entry(2, 6, b"more")]).unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&store), vec![3, 4, 5, 6]);
        assert_eq!(store.entries(5..6)[0], entry(2, 5, b"other"));
        let state = store.state();
        assert_eq!(state.last_purged_log_id.unwrap().index, 2);
        assert_eq!(state.last_log_id.unwrap().index, 6);
    }

    #[test]
    fn the_vote_is_kept_across_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.vote(), None);
        let vote = Vote::new(3, 2);
        store.save_vote_sync(vote).unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.vote(), Some(vote));
        assert!(!dir.path().join("raft.state.tmp").exists());
    }
}
