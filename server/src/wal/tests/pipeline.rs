//! The pipelined group commit: a large backlog is written while the fsync before it runs,
//! the durable LSN never passes what an fsync covered, and a failed fsync fails everything
//! written behind it. The storage here lets each fsync through on the test's word, so the
//! interleavings are forced, not hoped for.
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tenure_protocol::LeaseId;

use super::{grant, leases_by_key};
use crate::wal::record::{Record, SEGMENT_HEADER_LEN};
use crate::wal::storage::{FileWrapper, FsStorage, SegmentFile, WrapFiles};
use crate::wal::writer::WRITE_AHEAD_BYTES_MIN;
use crate::wal::{open, open_with_storage, Lsn, SyncMode, Wal, WalError, WalOptions};

/// How long a test waits for the syncer to reach a state before it fails; generous, as the
/// machine may be busy.
const WAIT_MAX: Duration = Duration::from_secs(20);
/// A gated fsync fails after waiting this long, so a failed test cannot leave the syncer
/// blocked for ever; longer than `WAIT_MAX`, so the test's own check fails first.
const SYNC_GATE_WAIT_MAX: Duration = Duration::from_secs(40);

/// What the gated storage saw, and how many fsyncs it lets through.
#[derive(Default)]
struct GateState {
    /// Bytes written to segment files, headers included.
    bytes_written: u64,
    /// `sync_data` calls begun (counting from 1).
    syncs_started: u64,
    /// `sync_data` call `n` returns once `n <= syncs_allowed`.
    syncs_allowed: u64,
    /// `sync_data` call `n` fails with EIO if `n >= this`.
    syncs_fail_from: Option<u64>,
    /// `bytes_written` when the last successful `sync_data` began: what is on disk for sure.
    bytes_synced: u64,
    /// While set, `write_all` waits before writing.
    writes_held: bool,
    /// `write_all` calls waiting because `writes_held` is set.
    writes_waiting: u64,
}

#[derive(Default)]
pub(super) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap()
    }

    /// Waits until `reached` holds; fails the test naming `what` if it never does.
    fn wait_until(&self, what: &str, reached: impl Fn(&GateState) -> bool) {
        let (guard, timeout) = self
            .changed
            .wait_timeout_while(self.lock(), WAIT_MAX, |s| !reached(s))
            .unwrap();
        drop(guard);
        assert!(!timeout.timed_out(), "never happened: {what}");
    }

    pub(super) fn allow_syncs(&self, up_to: u64) {
        self.lock().syncs_allowed = up_to;
        self.changed.notify_all();
    }

    /// Holds every segment write from now on (`true`), or lets them all through.
    pub(super) fn hold_writes(&self, held: bool) {
        self.lock().writes_held = held;
        self.changed.notify_all();
    }
}

/// Segment files whose fsyncs wait for the gate, and whose writes too while it holds them.
struct GatedSyncFile {
    inner: Box<dyn SegmentFile>,
    gate: Arc<Gate>,
}

impl FileWrapper for Arc<Gate> {
    fn wrap(&self, inner: Box<dyn SegmentFile>) -> Box<dyn SegmentFile> {
        Box::new(GatedSyncFile {
            inner,
            gate: Arc::clone(self),
        })
    }
}

impl SegmentFile for GatedSyncFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let mut state = self.gate.lock();
        if state.writes_held {
            state.writes_waiting += 1;
            self.gate.changed.notify_all();
            state = self
                .gate
                .changed
                .wait_while(state, |s| s.writes_held)
                .unwrap();
            state.writes_waiting -= 1;
        }
        drop(state);
        self.inner.write_all(buf)?;
        self.gate.lock().bytes_written += buf.len() as u64;
        self.gate.changed.notify_all();
        Ok(())
    }

    fn sync_data(&mut self) -> io::Result<()> {
        let mut state = self.gate.lock();
        state.syncs_started += 1;
        let (call, covered) = (state.syncs_started, state.bytes_written);
        self.gate.changed.notify_all();
        let (mut state, timeout) = self
            .gate
            .changed
            .wait_timeout_while(state, SYNC_GATE_WAIT_MAX, |s| s.syncs_allowed < call)
            .unwrap();
        if timeout.timed_out() || state.syncs_fail_from.is_some_and(|n| call >= n) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.sync_data()?;
        state.bytes_synced = state.bytes_synced.max(covered);
        Ok(())
    }

    fn try_clone(&self) -> io::Result<Box<dyn SegmentFile>> {
        Ok(Box::new(GatedSyncFile {
            inner: self.inner.try_clone()?,
            gate: Arc::clone(&self.gate),
        }))
    }
}

/// A syncing WAL over gated storage in `dir`; every fsync from now on waits for the gate.
fn open_gated(dir: &std::path::Path) -> (Wal, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    gate.allow_syncs(u64::MAX); // open syncs the new segment's header
    let storage = WrapFiles::new(FsStorage::new(dir).unwrap(), Arc::clone(&gate));
    let options = WalOptions {
        sync_mode: SyncMode::Data,
        ..WalOptions::default()
    };
    let (wal, _) = open_with_storage(Arc::new(storage), options).unwrap();
    let started = gate.lock().syncs_started;
    gate.allow_syncs(started);
    (wal, gate)
}

/// Meta of the grants in a bulk append: large, so a few dozen fill a write ahead.
const BULK_META: [u8; 1000] = [b'm'; 1000];

/// A grant of `key` with `BULK_META`.
fn grant_with_bulk_meta(key: &[u8]) -> Record<'_> {
    Record::Grant {
        key,
        lease_id: LeaseId::from_u128(7).0,
        token: 1,
        ttl_ms: 1_000,
        flags: 0,
        meta: &BULK_META,
        acquire_id: None,
        session_id: None,
        kind: Default::default(),
    }
}

/// Appends grants `{prefix}-{i}` until they are worth a write ahead, and waits until the
/// syncer has written them (not synced them); their keys and the last LSN.
fn append_bulk_written(wal: &Wal, gate: &Gate, prefix: &str) -> (Vec<Vec<u8>>, Lsn) {
    let before = gate.lock().bytes_written;
    let (mut keys, mut bytes, mut lsn) = (Vec::new(), 0, 0);
    while bytes < WRITE_AHEAD_BYTES_MIN as u64 {
        let key = format!("{prefix}-{}", keys.len()).into_bytes();
        let record = grant_with_bulk_meta(&key);
        lsn = wal.append(&record).unwrap();
        bytes += record.encoded_len() as u64;
        keys.push(key);
    }
    let what = format!("{prefix} written while the fsync before it runs");
    gate.wait_until(&what, |s| s.bytes_written >= before + bytes);
    (keys, lsn)
}

/// Waits until the durable LSN is at least `lsn` or the WAL failed; the durable LSN.
fn durable_after(wal: &Wal, lsn: Lsn) -> Lsn {
    let deadline = Instant::now() + WAIT_MAX;
    loop {
        let state = wal.subscribe().borrow().clone();
        if state.lsn >= lsn || state.failed.is_some() {
            return state.lsn;
        }
        assert!(Instant::now() < deadline, "LSN {lsn} never became durable");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_batch_is_written_while_the_fsync_before_it_runs_and_waits_for_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, gate) = open_gated(dir.path());
    let base = gate.lock().syncs_started;
    let fsyncs_before = wal.stats().fsyncs;
    let a = wal.append(&grant(b"a", 1)).unwrap();
    gate.wait_until("the fsync of a began", |s| s.syncs_started == base + 1);
    // The old syncer wrote b only after the fsync of a returned: this is the overlap.
    let (keys, b) = append_bulk_written(&wal, &gate, "b");
    assert_eq!(
        wal.durable_lsn(),
        0,
        "nothing is durable before its fsync returns"
    );
    gate.allow_syncs(base + 1);
    assert_eq!(durable_after(&wal, a), a);
    gate.wait_until("the fsync of b began", |s| s.syncs_started == base + 2);
    // b's bytes may well have reached the disk with a's fsync, but that fsync began before
    // b was handed over, so nothing vouches for them.
    assert_eq!(
        wal.durable_lsn(),
        a,
        "b is not durable before its own fsync"
    );
    gate.allow_syncs(base + 2);
    assert_eq!(durable_after(&wal, b), b);
    let stats = wal.stats();
    let records = 1 + keys.len() as u64;
    assert_eq!((stats.fsyncs - fsyncs_before, stats.records), (2, records));
    gate.allow_syncs(u64::MAX);
    wal.sync_and_stop().unwrap();
}

/// Appends `a`, then while a's fsync runs, grants `b-{i}` worth a write ahead, whose write
/// the gate holds; lets a's fsync (and all later ones) through and waits until a is
/// durable. Returns b's keys and last LSN: written ahead, not yet written, not synced.
fn hold_a_write_ahead_past_its_fsync(wal: &Wal, gate: &Gate) -> (Vec<Vec<u8>>, Lsn) {
    let base = gate.lock().syncs_started;
    let a = wal.append(&grant(b"a", 1)).unwrap();
    gate.wait_until("the fsync of a began", |s| s.syncs_started == base + 1);
    gate.hold_writes(true);
    let (mut keys, mut b, mut bytes) = (Vec::new(), 0, 0);
    while bytes < WRITE_AHEAD_BYTES_MIN as u64 {
        let key = format!("b-{}", keys.len()).into_bytes();
        let record = grant_with_bulk_meta(&key);
        b = wal.append(&record).unwrap();
        bytes += record.encoded_len() as u64;
        keys.push(key);
    }
    gate.wait_until("b's write ahead began", |s| s.writes_waiting == 1);
    gate.allow_syncs(u64::MAX);
    assert_eq!(durable_after(wal, a), a);
    (keys, b)
}

/// A write ahead that ends after the fsync it overlapped returned must still get its own
/// fsync, even if nothing more is ever appended: the syncer, idle by then, is woken for it.
/// (It used to sleep until the next append, which never came after the last part of a
/// snapshot on an idle server: the snapshot, and the shutdown behind it, waited for ever.)
#[test]
fn a_write_ahead_that_ends_after_the_fsync_is_synced_without_another_append() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, gate) = open_gated(dir.path());
    let (_, b) = hold_a_write_ahead_past_its_fsync(&wal, &gate);
    let deadline = Instant::now() + WAIT_MAX;
    while !wal.syncer_is_idle() {
        assert!(Instant::now() < deadline, "the syncer never went idle");
        std::thread::sleep(Duration::from_millis(1));
    }
    gate.hold_writes(false);
    assert_eq!(durable_after(&wal, b), b, "b was written but never synced");
    wal.sync_and_stop().unwrap();
}

/// Stopping the WAL while a write ahead runs still syncs that write before it returns.
#[test]
fn stopping_during_a_write_ahead_syncs_it_first() {
    /// Time for the syncer to see the stop before the write ends (if it would leave early,
    /// this gives it the chance to).
    const STOP_SEEN_AFTER: Duration = Duration::from_millis(100);
    let dir = tempfile::tempdir().unwrap();
    let (wal, gate) = open_gated(dir.path());
    let (keys, b) = hold_a_write_ahead_past_its_fsync(&wal, &gate);
    let wal = Arc::new(wal);
    let stopping = std::thread::spawn({
        let wal = Arc::clone(&wal);
        move || wal.sync_and_stop()
    });
    std::thread::sleep(STOP_SEEN_AFTER);
    gate.hold_writes(false);
    stopping.join().unwrap().unwrap();
    assert_eq!(
        wal.durable_lsn(),
        b,
        "stopped with b written but not synced"
    );
    let fast = WalOptions {
        sync_mode: SyncMode::Off,
        ..WalOptions::default()
    };
    drop(wal);
    let (_wal, recovered) = open(dir.path(), fast).unwrap();
    assert_eq!(leases_by_key(&recovered).len(), keys.len() + 1);
}

#[test]
fn a_failed_fsync_fails_the_batch_written_behind_it_and_everything_after() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, gate) = open_gated(dir.path());
    let base = gate.lock().syncs_started;
    let a = wal.append(&grant(b"a", 1)).unwrap();
    gate.wait_until("the fsync of a began", |s| s.syncs_started == base + 1);
    let (b_keys, b) = append_bulk_written(&wal, &gate, "b");
    gate.allow_syncs(base + 1);
    assert_eq!(durable_after(&wal, a), a);
    gate.wait_until("the fsync of b began", |s| s.syncs_started == base + 2);
    let (c_keys, c) = append_bulk_written(&wal, &gate, "c");
    gate.lock().syncs_fail_from = Some(base + 2);
    gate.allow_syncs(u64::MAX);
    assert_eq!(durable_after(&wal, c), a, "the durable LSN stops before b");
    let state = wal.subscribe().borrow().clone();
    assert!(state.failed.is_some(), "the failure is published");
    assert_eq!((state.lsn, wal.durable_lsn()), (a, a));
    assert!(wal.wait_durable_blocking(a).is_ok(), "a stays durable");
    for lsn in [b, c] {
        assert!(matches!(
            wal.wait_durable_blocking(lsn),
            Err(WalError::Failed(_))
        ));
    }
    assert!(matches!(
        wal.append(&grant(b"d", 4)),
        Err(WalError::Failed(_))
    ));
    assert!(wal.sync_and_stop().is_err());
    let syncs = gate.lock().syncs_started;
    assert_eq!(
        syncs,
        base + 2,
        "no fsync after the failed one, none retried"
    );
    let fast = WalOptions {
        sync_mode: SyncMode::Off,
        ..WalOptions::default()
    };
    let (_wal, recovered) = open(dir.path(), fast).unwrap();
    let keys = leases_by_key(&recovered);
    assert!(keys.contains_key(&b"a"[..]), "the durable grant survives");
    for key in b_keys.iter().chain(&c_keys).chain([&b"d".to_vec()]) {
        let name = String::from_utf8_lossy(key);
        assert!(!keys.contains_key(key), "{name} was never durable");
    }
}

#[test]
fn the_durable_lsn_grows_in_order_and_never_passes_what_an_fsync_covered() {
    const THREADS: u64 = 4;
    const APPENDS_PER_THREAD: u64 = 500;
    let dir = tempfile::tempdir().unwrap();
    let (wal, gate) = open_gated(dir.path());
    gate.allow_syncs(u64::MAX);
    let wal = Arc::new(wal);
    let header = SEGMENT_HEADER_LEN as u64;
    assert_eq!(gate.lock().bytes_written, header);
    // Every key has the same length, so LSN n ends at byte `header + n * len`.
    let len = grant(b"k00000000", 0).encoded_len() as u64;
    let writers: Vec<_> = (0..THREADS)
        .map(|t| {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || {
                for i in 0..APPENDS_PER_THREAD {
                    let key = format!("k{t:02}{i:06}");
                    let lsn = wal.append(&grant(key.as_bytes(), i + 1)).unwrap();
                    if i % 16 == 0 {
                        wal.wait_durable_blocking(lsn).unwrap();
                    }
                }
            })
        })
        .collect();
    let total = THREADS * APPENDS_PER_THREAD;
    let deadline = Instant::now() + WAIT_MAX;
    let (mut last, mut receiver, mut looks) = (0, wal.subscribe(), 0u64);
    while last < total {
        assert!(Instant::now() < deadline, "stuck at LSN {last} of {total}");
        let seen = receiver.borrow_and_update().lsn;
        // Read after the LSN: `bytes_synced` only grows, so this errs on the safe side.
        let synced = gate.lock().bytes_synced;
        assert!(
            seen >= last,
            "the durable LSN went back from {last} to {seen}"
        );
        assert!(
            header + seen * len <= synced,
            "LSN {seen} published, but the fsyncs covered only {synced} bytes"
        );
        last = seen;
        looks += 1;
        std::thread::yield_now();
    }
    for writer in writers {
        writer.join().unwrap();
    }
    assert!(looks > 1);
    let stats = wal.stats();
    assert_eq!(stats.records, total);
    assert!(stats.fsyncs <= total + 1, "one fsync per group at most");
    wal.sync_and_stop().unwrap();
}

/// Writing every few records as they come cost a quarter of a core at 100 000 records/s:
/// a small backlog waits for the syncer, which writes it once its fsync returns.
#[test]
fn a_small_backlog_waits_for_the_syncer_instead_of_being_written_ahead() {
    /// Far longer than a write ahead would take to happen.
    const QUIET_FOR: Duration = Duration::from_millis(300);
    let dir = tempfile::tempdir().unwrap();
    let (wal, gate) = open_gated(dir.path());
    let base = gate.lock().syncs_started;
    let a = wal.append(&grant(b"a", 1)).unwrap();
    gate.wait_until("the fsync of a began", |s| s.syncs_started == base + 1);
    let written = gate.lock().bytes_written;
    let b = wal.append(&grant(b"b", 2)).unwrap();
    std::thread::sleep(QUIET_FOR);
    assert_eq!(gate.lock().bytes_written, written, "b was written ahead");
    gate.allow_syncs(u64::MAX);
    assert_eq!(durable_after(&wal, b), b);
    assert!(a < b);
    wal.sync_and_stop().unwrap();
}
