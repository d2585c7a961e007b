//! The Raft log of one node: an append-only file, and the vote and purge point in a small
//! state file replaced atomically.
//!
//! # Files (in the node's data directory)
//! - `raft.log`: records back to back, each `len u32 | crc u32 | index u64 | term u64 |
//!   entry` (big-endian; `len` counts the entry bytes, `crc` is CRC-32 of index, term and
//!   entry; the entry is openraft's `Entry` in postcard). Indexes are consecutive but for
//!   jumps forward to at most the purge point + 1: after a snapshot installed beyond this
//!   log's end (the node was behind), the leader's next entries follow the old, purged
//!   records until a purge cuts those off ([`may_follow`]).
//! - `raft.state`: postcard of [`Persisted`] (the vote, the last purged log id), written to
//!   `raft.state.tmp`, fsynced, renamed over, and the directory fsynced: it is the old file
//!   or the new one after a crash, never a mix.
//!
//! # Durability
//! An append is written and `fdatasync`ed before openraft is told it is durable (the vote
//! too, before `save_vote` returns). Opening reads every record; the first one that is
//! short or fails its checksum ends the log, and the file is cut there (a torn write of an
//! append that was never reported durable), unless an intact record follows somewhere after
//! it (not inside the bad record's own declared bytes, which may hold a client's metadata:
//! `record::inside_bad_record`), or the record that ends the log is intact but out of order
//! (a gap in the indexes):
//! that is damage, not a torn write, and opening refuses, naming the offsets. As with
//! the WAL, one crash pattern is refused too: an unsynced append of several records whose
//! first pages never reached the disk but whose later ones did. Nothing past such a hole was
//! acknowledged, so an operator who sees zeros at the named offset may cut the file there. A truncation cuts the file and syncs; a purge
//! first records the purge point in `raft.state`, then, once the purged records outweigh the
//! kept ones, rewrites `raft.log` without them (a temporary file renamed over): records at
//! the head of the file up to the purge point are dropped again on open, whether a crash
//! came in between or the head was not cut yet. A purge past the log's end (a snapshot
//! installed on a node that was behind) keeps the old records too, and the next appends
//! follow them: such a jump to at most the purge point + 1 is the only gap opening takes
//! ([`may_follow`]; refusing it kept such a node from ever starting again, outside finding
//! F6).
//!
//! Every write to `raft.log` (appends, truncations, the purge's rewrite) goes to one writer
//! thread per log, in the order the calls were made, and the in-memory index is updated at
//! the call, so it is always the file's future. openraft's `append` returns once its records
//! are queued, and the writer reports them durable through openraft's `LogFlushed` callback
//! after their `fdatasync`: the Raft core does not wait for the disk, so while one append is
//! written and synced it goes on answering heartbeats, votes and pre-votes, ticking, and (on
//! the leader) sending heartbeats; before, each append's write and fsync stalled all of it
//! (CLUSTER.md, "Heartbeats and bulk appends"). Truncations wait for the writer (their file
//! work follows every append queued before them), on a blocking thread ([`blocking`]), as
//! vote saves do; openraft makes one storage call at a time. Purges do not wait: their file
//! work is queued like an append's ([`LogStore::purge_to`] says why that is safe).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, LogState, RaftLogReader, Vote};
use serde::{Deserialize, Serialize};

use super::peer_check::TERM_MAX;
use super::{storage_error, Entry, LogId, NodeId, StorageError, TypeConfig};
use crate::record;

/// Bytes before a record's entry: length, checksum, index, term.
const RECORD_HEADER_LEN: usize = 4 + 4 + 8 + 8;
/// Longest entry a record may hold; a longer length on disk is damage, not a reason to
/// allocate. Entries are batches the leader caps far below this.
pub const ENTRY_LEN_MAX: usize = 64 << 20;

/// A purge cuts the file's head off once it holds at least this many purged bytes, and no
/// fewer than the kept ones: each kept byte is copied about once per doubling of the file.
const COMPACT_BYTES_MIN: u64 = 4 << 20;

pub(crate) const LOG_FILE: &str = "raft.log";
pub(crate) const STATE_FILE: &str = "raft.state";

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
    /// Entries by index, with the offset each record starts at, counted from `base`'s origin:
    /// the file's byte `at - base`.
    entries: BTreeMap<u64, (Entry, u64)>,
    /// Where the next record goes (the same count).
    end: u64,
    /// The offset of the file's first byte: where the last compaction cut its head off.
    base: u64,
    /// `raft.state`; the writer thread saves a purge's point there, after the call.
    state_file: Arc<StateFile>,
    /// The writer thread, joined when the log is dropped: a node reopened in the same
    /// process must not find the last one's file work still running.
    writer_thread: Option<std::thread::JoinHandle<()>>,
    /// Whether `open` cut a torn tail off, and where: for the log, and tests.
    torn_tail_at: Option<u64>,
    /// A write or sync failed: the file may hold part of a record, and whether the kernel
    /// kept the rest is unknown ("fsyncgate"), so nothing is written again. Set by the
    /// writer thread.
    failed: Arc<AtomicBool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Without a sender the thread ends, after the jobs already sent.
        drop(std::mem::replace(&mut self.writer, mpsc::channel().0));
        if let Some(thread) = self.writer_thread.take() {
            let _ = thread.join();
        }
    }
}

/// `raft.state` and what it is to hold.
struct StateFile {
    dir: PathBuf,
    /// The vote and purge point as last asked for (the vote once saved).
    wanted: Mutex<Persisted>,
    /// Held while the file is written: one write at a time, each of the newest `wanted`.
    writing: Mutex<()>,
}

impl StateFile {
    fn wanted(&self) -> std::sync::MutexGuard<'_, Persisted> {
        self.wanted.lock().expect("Raft state poisoned")
    }

    /// Writes `wanted`, changed by `change` first, and keeps the change once it is saved.
    /// Blocking.
    fn save(&self, change: impl Fn(&mut Persisted)) -> std::io::Result<()> {
        let _writing = self.writing.lock().expect("Raft state poisoned");
        let mut persisted = self.wanted().clone();
        change(&mut persisted);
        write_atomically(&self.dir, STATE_FILE, &postcard_bytes(&persisted)?)?;
        // Only the change: a purge may have moved the purge point meanwhile.
        change(&mut self.wanted());
        Ok(())
    }
}

/// One piece of file work for the writer thread; it gets the file (which it may replace).
type Job = Box<dyn FnOnce(&mut File) + Send>;

/// Starts the writer thread of one log: it owns `raft.log` and does its jobs in the order
/// sent. It ends when every [`LogStore`] clone is gone, after the jobs already sent.
fn start_writer(file: File) -> std::io::Result<(mpsc::Sender<Job>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel::<Job>();
    let thread = std::thread::Builder::new()
        .name("raft-log".into())
        .spawn(move || {
            let mut file = file;
            for job in rx {
                job(&mut file);
            }
        })?;
    Ok((tx, thread))
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
            return Err(damaged(&path, end as usize, at));
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
        let (writer, writer_thread) = start_writer(file)?;
        let state_file = Arc::new(StateFile {
            dir: dir.to_path_buf(),
            wanted: Mutex::new(persisted),
            writing: Mutex::new(()),
        });
        let store = LogStore {
            inner: Arc::new(Mutex::new(Inner {
                dir: dir.to_path_buf(),
                writer,
                writer_thread: Some(writer_thread),
                entries,
                end,
                base: 0,
                state_file,
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
        // The base is the file's as the writer will find it: every compaction that moved it
        // was queued before.
        let file_at = at - inner.base;
        let (tx, rx) = mpsc::channel();
        let cut = move |file: &mut File| file.set_len(file_at).and_then(|()| file.sync_all());
        file_job(&inner.writer, &inner.failed, cut, move |r| drop(tx.send(r)));
        drop(inner);
        wait_job(&rx)
    }

    /// Drops every entry up to `log_id`, in memory at once; the file work is queued, not
    /// waited for. Does not block on I/O.
    ///
    /// The Raft core waits for a purge, and it used to wait for all of it: the purge point
    /// saved and synced, the kept entries encoded again and the file rewritten and synced,
    /// the purged ones freed, the log's lock held for most of it (which every replication
    /// stream's read waits for) — the leader sent nothing meanwhile (BENCHMARKS.md, issue 24).
    /// Now the writer thread, after every append queued before, frees the purged entries,
    /// saves the purge point, then cuts the file's head off if it holds more purged bytes
    /// than kept ones ([`compact`]). Until the purge point is saved a crash brings the
    /// purged entries back (openraft purges them again); once it is, opening skips them
    /// whether the head was cut or not. Neither leaves a hole. A failure of that work
    /// makes the log refuse every later write, as a failed append does.
    ///
    /// # Errors
    /// When an earlier write failed.
    pub fn purge_to(&self, log_id: LogId) -> std::io::Result<()> {
        let mut inner = self.lock();
        inner.usable()?;
        inner.state_file.wanted().last_purged = Some(log_id);
        let kept = inner.entries.split_off(&(log_id.index + 1));
        let purged = std::mem::replace(&mut inner.entries, kept);
        let first_kept = inner
            .entries
            .values()
            .next()
            .map_or(inner.end, |&(_, at)| at);
        let (dead, live) = (first_kept - inner.base, inner.end - first_kept);
        let cut = (dead >= live.max(COMPACT_BYTES_MIN)).then_some(dead);
        if cut.is_some() {
            inner.base = first_kept;
        }
        let (state_file, dir) = (Arc::clone(&inner.state_file), inner.dir.clone());
        let work = move |file: &mut File| {
            let (count, started) = (purged.len(), std::time::Instant::now());
            drop(purged);
            let freed = started.elapsed();
            state_file.save(|_| {})?;
            let saved = started.elapsed();
            if let Some(head) = cut {
                compact(&dir, file, head)?;
            }
            tracing::info!(
                index = log_id.index,
                purged = count,
                free_ms = freed.as_millis() as u64,
                state_file_ms = (saved - freed).as_millis() as u64,
                compact_ms = (started.elapsed() - saved).as_millis() as u64,
                cut_bytes = cut.unwrap_or(0),
                "log purged"
            );
            Ok(())
        };
        file_job(&inner.writer, &inner.failed, work, |result| {
            if let Err(e) = result {
                tracing::error!(error = %e, "the Raft log's purge failed; it takes no more writes");
            }
        });
        Ok(())
    }

    /// Saves `vote` atomically. Blocking.
    ///
    /// # Errors
    /// When the state file cannot be written, synced or renamed.
    pub fn save_vote_sync(&self, vote: Vote<NodeId>) -> std::io::Result<()> {
        let state_file = Arc::clone(&self.lock().state_file);
        state_file.save(|persisted| persisted.vote = Some(vote))
    }

    /// The vote last saved.
    pub fn vote(&self) -> Option<Vote<NodeId>> {
        self.lock().state_file.wanted().vote
    }

    /// The last purged and the last log id.
    pub fn state(&self) -> LogState<TypeConfig> {
        let inner = self.lock();
        let last_purged_log_id = inner.state_file.wanted().last_purged;
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
/// out (a purge whose head cut is not due yet, or was interrupted).
fn parse(bytes: &[u8], purged: Option<u64>) -> (BTreeMap<u64, (Entry, u64)>, u64) {
    let mut entries = BTreeMap::new();
    let mut at = 0usize;
    let mut last_index: Option<u64> = None;
    while let Some((entry, len)) = decode_at(&bytes[at..]) {
        let index = entry.log_id.index;
        // Any other gap in the indexes is not a log this store wrote: treat it as the end.
        if last_index.is_some_and(|last| !may_follow(last, index, purged)) {
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

/// Whether a record of `index` may follow one of `last` in `raft.log`, given the saved purge
/// point `purged`: the next index, or a jump forward to at most `purged + 1`.
///
/// The jump is a snapshot installed beyond the end of this node's log (it was behind): the
/// purge point moves past every entry, the file's head is not cut unless the purged bytes
/// are due for it ([`LogStore::purge_to`]), and the leader's next entries, `purged + 1` on,
/// are appended after the old records. Every record before the jump is then at or below the
/// purge point and skipped, so nothing purged comes back; the purge point was saved before
/// any of those appends was written (the writer's order), so a jump over unsaved entries
/// (past `purged + 1`) is a hole, never this.
fn may_follow(last: u64, index: u64, purged: Option<u64>) -> bool {
    index.checked_sub(1) == Some(last)
        || purged.is_some_and(|purged| last < index && index - 1 <= purged)
}

/// The offset of the first intact record at or after the bad bytes at `bad`, if there is
/// one: then the damage is not a torn tail (a torn write is the last thing in the file).
/// At `bad` itself: an intact record that does not follow the one before (a gap in the
/// indexes) is no torn write either, and cutting it could drop an acknowledged entry. Not
/// one that may be the content of the bad record itself (a client's metadata holding a
/// record's bytes: [`record::inside_bad_record`]).
fn intact_record_after(bytes: &[u8], bad: usize) -> Option<usize> {
    (bad..bytes.len()).find(|&at| {
        decode_at(&bytes[at..]).is_some()
            && !record::inside_bad_record(bytes, bad, at, RECORD_HEADER_LEN, ENTRY_LEN_MAX)
    })
}

/// The error of a log whose records end at `end` with an intact record at `at` (no torn
/// tail): bad bytes in between, or, at `end` itself, a gap in the indexes.
fn damaged(path: &Path, end: usize, at: usize) -> std::io::Error {
    let path = path.display();
    std::io::Error::other(if at == end {
        format!(
            "Raft log {path} is damaged at byte {end}: the intact record there does not \
             follow the one before it (a gap in the indexes)"
        )
    } else {
        format!("Raft log {path} is damaged at byte {end}: an intact record follows at byte {at}")
    })
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

/// Cuts the first `head` bytes (purged records) off `raft.log`, whose open handle `file`
/// is: the rest copied to a temporary file, synced, renamed over, the directory synced,
/// and `file` reopened. A crash leaves the old file or the new one. Blocking.
fn compact(dir: &Path, file: &mut File, head: u64) -> std::io::Result<()> {
    let path = dir.join(LOG_FILE);
    let tmp = dir.join(format!("{LOG_FILE}.tmp"));
    let mut from = File::open(&path)?;
    from.seek(SeekFrom::Start(head))?;
    let mut to = File::create(&tmp)?;
    // copy_file_range on Linux: the kernel copies, no buffer of ours.
    std::io::copy(&mut from, &mut to)?;
    to.sync_all()?;
    drop(to);
    std::fs::rename(&tmp, &path)?;
    File::open(dir)?.sync_all()?;
    *file = OpenOptions::new().read(true).append(true).open(&path)?;
    Ok(())
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
        // No I/O to wait for ([`LogStore::purge_to`]): on the core's task, not a thread.
        self.purge_to(log_id)
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

    /// A log in `dir` of two entries, closed; its length.
    fn two_entries(dir: &Path) -> u64 {
        let store = LogStore::open(dir).unwrap();
        store
            .append_sync((1..=2).map(|i| entry(1, i, b"abc")))
            .unwrap();
        std::fs::metadata(dir.join(LOG_FILE)).unwrap().len()
    }

    #[test]
    fn a_torn_tail_is_cut_and_the_log_continues() {
        let dir = tempfile::tempdir().unwrap();
        let intact = two_entries(dir.path());
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

    /// An entry carries clients' metadata, which may hold the bytes of a whole Raft-log
    /// record: torn by a crash, that entry is still a torn tail, not damage with "an intact
    /// record following" that kept the node from starting (review 9, finding 3); with an
    /// entry written after it, it is damage as before.
    #[test]
    fn a_torn_entry_holding_a_records_bytes_is_a_torn_tail() {
        let mut copy = Vec::new();
        encode(&entry(1, 3, b"copy"), &mut copy).unwrap();
        let holder = entry(1, 3, &[copy.as_slice(), &[b'x'; 200]].concat());
        let mut record = Vec::new();
        encode(&holder, &mut record).unwrap();
        for followed in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let intact = two_entries(dir.path());
            let mut file = OpenOptions::new()
                .append(true)
                .open(dir.path().join(LOG_FILE))
                .unwrap();
            // The crash: the entry's last 100 bytes never reached the disk.
            file.write_all(&record[..record.len() - 100]).unwrap();
            file.write_all(&[0; 100]).unwrap();
            if followed {
                let mut next = Vec::new();
                encode(&entry(1, 4, b"abc"), &mut next).unwrap();
                file.write_all(&next).unwrap();
            }
            drop(file);
            match LogStore::open(dir.path()) {
                Ok(store) if !followed => {
                    assert_eq!(store.torn_tail_at(), Some(intact));
                    assert_eq!(indexes(&store), vec![1, 2]);
                }
                Err(e) if followed => assert!(e.to_string().contains("damaged"), "{e}"),
                other => panic!("followed {followed}: {:?}", other.map(|s| s.torn_tail_at())),
            }
        }
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

    /// Holds the writer thread of `store` until the returned sender is dropped.
    fn hold_writer(store: &LogStore) -> mpsc::Sender<()> {
        let (release, held) = mpsc::channel::<()>();
        let inner = store.lock();
        let wait = move |_: &mut File| {
            let _ = held.recv();
            Ok(())
        };
        file_job(&inner.writer, &inner.failed, wait, |_| {});
        release
    }

    /// The Raft core waits for a purge: it must not wait for the disk (issue 24).
    #[test]
    fn a_purge_does_not_wait_for_the_file_work() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync((1..=5).map(|i| entry(1, i, b"abc")))
            .unwrap();
        let release = hold_writer(&store);
        let (done, purged) = mpsc::channel();
        let purging = store.clone();
        let purger = std::thread::spawn(move || {
            let purge = purging.purge_to(LogId::new(CommittedLeaderId::new(1, 1), 3));
            let _ = done.send(purge.is_ok());
        });
        let returned = purged.recv_timeout(std::time::Duration::from_secs(20));
        drop(release);
        // Its clone of the store gone, dropping `store` below is the last and joins the
        // writer (a reopen beside a live clone could read the state before the purge's save).
        purger.join().unwrap();
        assert_eq!(returned, Ok(true), "purge_to waited for the writer thread");
        assert_eq!(indexes(&store), vec![4, 5]);
        assert_eq!(store.state().last_purged_log_id.unwrap().index, 3);
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&store), vec![4, 5]);
        assert_eq!(store.state().last_purged_log_id.unwrap().index, 3);
    }

    /// A purge that leaves more purged bytes than kept ones cuts the file's head off; the
    /// offsets of what follows (appends, a truncation) stay right.
    #[test]
    fn a_purge_cuts_the_head_off_and_later_writes_land_right() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        let big = vec![7u8; 64 << 10];
        let count = COMPACT_BYTES_MIN / big.len() as u64 + 4;
        store
            .append_sync((1..=count).map(|i| entry(1, i, &big)))
            .unwrap();
        let kept_from = count - 2;
        store
            .purge_to(LogId::new(CommittedLeaderId::new(1, 1), kept_from - 1))
            .unwrap();
        store.truncate_from(count).unwrap();
        store.append_sync([entry(2, count, b"new")]).unwrap();
        let len = std::fs::metadata(dir.path().join(LOG_FILE)).unwrap().len();
        assert!(
            len < 3 * big.len() as u64,
            "the head was cut: {len} bytes left"
        );
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&store), vec![kept_from, count - 1, count]);
        assert_eq!(store.entries(count..)[0], entry(2, count, b"new"));
        assert_eq!(
            store.entries(kept_from..=kept_from)[0],
            entry(1, kept_from, &big)
        );
        assert_eq!(store.torn_tail_at(), None);
    }

    fn purge_point(term: u64, index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    /// Appends half of `entry`'s record to the log in `dir`: a kill in the middle of its
    /// write.
    fn append_torn(dir: &Path, entry: &Entry) {
        let mut record = Vec::new();
        encode(entry, &mut record).unwrap();
        let mut file = OpenOptions::new()
            .append(true)
            .open(dir.join(LOG_FILE))
            .unwrap();
        file.write_all(&record[..record.len() / 2]).unwrap();
    }

    /// Outside finding F6: a node behind the leader (its log's tail torn by a kill) installs
    /// a snapshot past its log's end. The purge moves past every entry, the file is too
    /// small for its head to be cut, and the leader's next entries are appended after the
    /// old ones: opening took that jump in the indexes for damage in the middle, and the
    /// node never started again.
    #[test]
    fn entries_after_a_snapshot_past_the_log_end_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        store
            .append_sync((1..=5).map(|i| entry(1, i, b"old")))
            .unwrap();
        drop(store);
        append_torn(dir.path(), &entry(1, 6, b"torn"));
        let store = LogStore::open(dir.path()).unwrap();
        assert!(store.torn_tail_at().is_some());
        // The snapshot up to 20 installed, then the leader's entries from 21.
        store.purge_to(purge_point(3, 20)).unwrap();
        assert_eq!(indexes(&store), Vec::<u64>::new());
        store
            .append_sync((21..=23).map(|i| entry(3, i, b"new")))
            .unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&store), vec![21, 22, 23]);
        assert_eq!(store.state().last_purged_log_id.unwrap().index, 20);
        assert_eq!(store.torn_tail_at(), None);
        // A truncation after the jump, and a second snapshot past the end.
        store.truncate_from(23).unwrap();
        store.append_sync([entry(4, 23, b"other")]).unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(
            store.entries(21..),
            vec![
                entry(3, 21, b"new"),
                entry(3, 22, b"new"),
                entry(4, 23, b"other")
            ]
        );
        store.purge_to(purge_point(4, 30)).unwrap();
        store.append_sync([entry(5, 31, b"newer")]).unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.entries(..), vec![entry(5, 31, b"newer")]);
        assert_eq!(store.state().last_purged_log_id.unwrap().index, 30);
    }

    /// Writes `indexes`' records as `raft.log` and a purge point to `raft.state` in `dir`.
    fn write_log(dir: &Path, indexes: &[u64], purged: Option<u64>) {
        let mut bytes = Vec::new();
        for &i in indexes {
            encode(&entry(1, i, b"abc"), &mut bytes).unwrap();
        }
        std::fs::write(dir.join(LOG_FILE), &bytes).unwrap();
        let persisted = Persisted {
            vote: None,
            last_purged: purged.map(|index| purge_point(1, index)),
        };
        std::fs::write(dir.join(STATE_FILE), postcard_bytes(&persisted).unwrap()).unwrap();
    }

    /// Only a jump to the first entry after the purge point (or to an earlier one's) is a
    /// log this store wrote: one past it skips entries that were never purged.
    #[test]
    fn a_jump_in_the_indexes_past_the_purge_point_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for (written, purged) in [
            (&[1, 2, 4][..], None),
            (&[1, 2, 7], Some(5)),
            (&[1, 2, 6, 7, 9], Some(5)),
            (&[4, 5, 6, 3, 4], Some(5)),
        ] {
            write_log(dir.path(), written, purged);
            let refused = LogStore::open(dir.path()).err();
            let message = refused.map(|e| e.to_string()).unwrap_or_default();
            assert!(
                message.contains("damaged at byte"),
                "{written:?}: {message}"
            );
        }
        for (written, purged, kept) in [
            (&[1, 2, 6, 7][..], Some(5), &[6, 7][..]),
            (&[1, 2, 4, 5, 9], Some(8), &[9]),
            (&[1, 2], Some(8), &[]),
        ] {
            write_log(dir.path(), written, purged);
            let store = LogStore::open(dir.path()).unwrap();
            assert_eq!(indexes(&store), kept, "{written:?}");
        }
    }

    /// One call the crash-point run makes.
    enum Step {
        Append(u64, std::ops::RangeInclusive<u64>),
        Truncate(u64),
        Purge(u64),
    }

    /// The files after a step, and the log they hold: its entries and purge point.
    struct Point {
        log: Vec<u8>,
        state: Option<Vec<u8>>,
        model: BTreeMap<u64, Entry>,
        purged: u64,
    }

    /// Runs `steps` on a new log, and returns the files and the log after each.
    fn run(steps: Vec<Step>) -> Vec<Point> {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        let (mut model, mut purged) = (BTreeMap::new(), 0);
        let mut points = Vec::new();
        for step in steps {
            match step {
                Step::Append(term, range) => {
                    let added: Vec<Entry> = range.map(|i| entry(term, i, b"x")).collect();
                    model.extend(added.iter().map(|e| (e.log_id.index, e.clone())));
                    store.append_sync(added).unwrap();
                }
                Step::Truncate(from) => {
                    store.truncate_from(from).unwrap();
                    model.split_off(&from);
                }
                Step::Purge(upto) => {
                    store.purge_to(purge_point(1, upto)).unwrap();
                    // An empty append waits for the purge's file work.
                    store.append_sync([]).unwrap();
                    model = model.split_off(&(upto + 1));
                    purged = upto;
                }
            }
            points.push(Point {
                log: std::fs::read(dir.path().join(LOG_FILE)).unwrap(),
                state: std::fs::read(dir.path().join(STATE_FILE)).ok(),
                model: model.clone(),
                purged,
            });
        }
        points
    }

    /// Opens `point`'s files with `raft.log` cut to `cut` bytes and checks what it keeps,
    /// then that the log takes its next entry.
    fn check_crash_point(point: &Point, cut: usize) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOG_FILE), &point.log[..cut]).unwrap();
        if let Some(state) = &point.state {
            std::fs::write(dir.path().join(STATE_FILE), state).unwrap();
        }
        let store = LogStore::open(dir.path()).unwrap_or_else(|e| panic!("cut {cut}: {e}"));
        let kept = store.entries(..);
        for e in &kept {
            let held = point.model.get(&e.log_id.index);
            assert_eq!(Some(e), held, "cut {cut}: an entry the log no longer held");
        }
        let first = point.purged + 1;
        let expected: Vec<u64> = (first..first + kept.len() as u64).collect();
        assert_eq!(indexes(&store), expected, "cut {cut}");
        if cut == point.log.len() {
            assert_eq!(kept.len(), point.model.len(), "cut {cut}: entries lost");
        }
        let next = first + kept.len() as u64;
        store.append_sync([entry(9, next, b"next")]).unwrap();
        drop(store);
        let store = LogStore::open(dir.path()).unwrap_or_else(|e| panic!("cut {cut}: {e}"));
        let mut grown = expected;
        grown.push(next);
        assert_eq!(indexes(&store), grown, "cut {cut}, then an append");
    }

    /// Every state the files pass through in a run of appends, truncations and purges (two
    /// of them past the log's end, as a snapshot installed on a node that was behind), cut
    /// at every byte (a kill in the middle of any write: a torn tail of any length): opening
    /// never refuses, keeps only entries the log held then (nothing truncated or purged
    /// comes back) and every one when nothing was cut, and the log takes its next entry.
    #[test]
    fn every_crash_point_of_a_run_opens_and_keeps_the_log() {
        let points = run(vec![
            Step::Append(1, 1..=4),
            Step::Truncate(3),
            Step::Append(2, 3..=5),
            Step::Purge(2),
            Step::Purge(9),
            Step::Append(3, 10..=12),
            Step::Truncate(11),
            Step::Append(4, 11..=11),
            Step::Purge(20),
            Step::Append(5, 21..=22),
        ]);
        for point in &points {
            for cut in 0..=point.log.len() {
                check_crash_point(point, cut);
            }
        }
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
