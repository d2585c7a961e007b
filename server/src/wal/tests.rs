//! End-to-end tests of the WAL: append, group commit, rotation, snapshots, injected disk
//! faults and restart, plus two ignored benchmarks (fsync throughput, recovery time).
use std::collections::HashMap;
use std::sync::Arc;

use tenure_protocol::LeaseId;

use super::record::{self, FreeReason, Record};
use super::storage::{FaultPlan, Faults, FaultyStorage, FsStorage, Storage, WrapFiles};
use super::*;

fn fast() -> WalOptions {
    WalOptions {
        sync_mode: SyncMode::Off,
        ..WalOptions::default()
    }
}

fn grant(key: &[u8], token: u64) -> Record<'_> {
    Record::Grant {
        key,
        lease_id: LeaseId::from_u128(u128::from(token)).0,
        token,
        ttl_ms: 1_000,
        flags: 0,
        meta: b"meta",
        acquire_id: None,
        session_id: None,
        kind: Default::default(),
    }
}

fn free(key: &[u8], token: u64) -> Record<'_> {
    Record::Free {
        key,
        token,
        reason: FreeReason::Released,
    }
}

fn leases_by_key(recovered: &Recovered) -> HashMap<Vec<u8>, u64> {
    recovered
        .leases
        .iter()
        .map(|l| (l.key.clone(), l.token))
        .collect()
}

fn segment_files(dir: &std::path::Path) -> Vec<u64> {
    let mut seqs: Vec<u64> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| crate::wal::parse_segment_name(e.unwrap().file_name().to_str()?))
        .collect();
    seqs.sort_unstable();
    seqs
}

fn faulty(dir: &std::path::Path) -> (Arc<dyn Storage>, Arc<Faults>) {
    let faults = Arc::new(Faults::default());
    let storage = FaultyStorage::new(FsStorage::new(dir).unwrap(), Arc::clone(&faults));
    (Arc::new(storage), faults)
}

#[test]
fn appended_records_come_back_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, recovered) = open(dir.path(), fast()).unwrap();
    assert_eq!((recovered.leases.len(), recovered.token_floor), (0, 0));
    assert_eq!(
        wal.append(&Record::Reserve { token_limit: 1000 }).unwrap(),
        1
    );
    wal.append(&grant(b"a", 1)).unwrap();
    wal.append(&grant(b"b", 2)).unwrap();
    wal.append(&free(b"a", 1)).unwrap();
    let last = wal.append(&Record::Grant {
        key: b"c",
        lease_id: LeaseId::from_u128(77).0,
        token: 3,
        ttl_ms: 9_000,
        flags: crate::wal::GRANT_FLAG_RELEASE_ON_DISCONNECT,
        meta: b"holder",
        acquire_id: None,
        session_id: None,
        kind: Default::default(),
    });
    assert_eq!(wal.flush().unwrap(), last.unwrap());
    assert_eq!(wal.durable_lsn(), 5);
    assert_eq!(wal.token_floor(), 1000);
    wal.sync_and_stop().unwrap();
    let (wal, recovered) = open(dir.path(), fast()).unwrap();
    assert_eq!(
        leases_by_key(&recovered),
        HashMap::from([(b"b".to_vec(), 2), (b"c".to_vec(), 3)])
    );
    let c = recovered.leases.iter().find(|l| l.key == b"c").unwrap();
    let expect = RecoveredLease {
        key: b"c".to_vec(),
        lease_id: LeaseId::from_u128(77),
        token: 3,
        ttl_ms: 9_000,
        flags: 1,
        meta: b"holder".to_vec(),
        acquire_id: None,
        session_id: None,
        kind: Default::default(),
    };
    assert_eq!(c, &expect);
    assert_eq!(
        (recovered.token_floor, recovered.records, recovered.segments),
        (1000, 5, 1)
    );
    assert_eq!(wal.appended_lsn(), 0, "LSNs restart with each process");
    drop(wal); // Drop syncs and joins, like shutdown
    assert_eq!(segment_files(dir.path()), vec![1, 2]);
}

#[test]
fn group_commit_batches_concurrent_appends() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        sync_mode: SyncMode::Data,
        ..WalOptions::default()
    };
    let (wal, _) = open(dir.path(), options).unwrap();
    let wal = Arc::new(wal);
    let threads = 8u64;
    let per_thread = 100u64;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || {
                for i in 0..per_thread {
                    let key = format!("t{t}/k{i}");
                    let lsn = wal
                        .append(&grant(key.as_bytes(), t * per_thread + i))
                        .unwrap();
                    wal.wait_durable_blocking(lsn).unwrap();
                }
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
    let stats = wal.stats();
    assert_eq!((stats.records_appended, stats.records), (800, 800));
    assert!(
        stats.batches < 800 && stats.fsyncs <= stats.batches + 2,
        "{stats:?}"
    );
    let (_, recovered) = open_after(wal, dir.path());
    assert_eq!(recovered.leases.len(), 800);
    assert_eq!(recovered.token_floor, 800);
}

fn open_after(wal: Arc<Wal>, dir: &std::path::Path) -> (Wal, Recovered) {
    Arc::try_unwrap(wal)
        .expect("last reference")
        .sync_and_stop()
        .unwrap();
    open(dir, fast()).unwrap()
}

#[test]
fn rotation_and_snapshot_delete_old_segments_and_keep_live_state() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_size_max: 16 << 10,
        ..fast()
    };
    let (wal, _) = open(dir.path(), options.clone()).unwrap();
    let mut live: HashMap<Vec<u8>, u64> = HashMap::new();
    let mut token = 0;
    for round in 0..2_000u64 {
        let key = format!("k{}", round % 300).into_bytes();
        if let Some(held) = live.remove(&key) {
            wal.append(&free(&key, held)).unwrap();
        } else {
            token += 1;
            wal.append(&grant(&key, token)).unwrap();
            live.insert(key, token);
        }
    }
    wal.flush().unwrap();
    let before = segment_files(dir.path());
    assert!(before.len() > 3, "rotation made {before:?}");
    assert!(wal.should_snapshot());
    let snapshot = wal.begin_snapshot(0).unwrap();
    assert!(matches!(
        wal.begin_snapshot(0),
        Err(WalError::SnapshotInProgress)
    ));
    assert!(!wal.should_snapshot());
    let snapshot_seq = snapshot.segment_seq();
    assert_eq!(snapshot_seq, before.last().unwrap() + 1);
    let table: Vec<(Vec<u8>, u64)> = live.iter().map(|(k, &t)| (k.clone(), t)).collect();
    for (i, (key, held)) in table.iter().enumerate() {
        wal.append(&grant(key, *held)).unwrap();
        if i % 10 == 0 {
            token += 1; // interleaved traffic: a new key granted mid-snapshot
            let key = format!("new{i}").into_bytes();
            wal.append(&grant(&key, token)).unwrap();
            live.insert(key, token);
        }
        if i == 50 {
            wal.append(&free(b"new0", live.remove(&b"new0"[..]).unwrap()))
                .unwrap();
        }
    }
    let end = wal.end_snapshot(snapshot).unwrap();
    wal.wait_durable_blocking(end).unwrap();
    wal.sync_and_stop().unwrap();
    let after = segment_files(dir.path());
    assert!(after.iter().all(|&seq| seq >= snapshot_seq), "{after:?}");
    let (wal, recovered) = open(dir.path(), options).unwrap();
    assert_eq!(leases_by_key(&recovered), live);
    assert_eq!(recovered.token_floor, token + 1);
    assert!(!wal.should_snapshot());
}

#[test]
fn crash_mid_snapshot_keeps_old_segments_and_open_finishes_deletion() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = open(dir.path(), fast()).unwrap();
    wal.append(&grant(b"a", 1)).unwrap();
    wal.append(&grant(b"b", 2)).unwrap();
    let snapshot = wal.begin_snapshot(0).unwrap();
    wal.append(&grant(b"a", 1)).unwrap();
    wal.flush().unwrap();
    drop(snapshot); // the process "dies" before the snapshot ends
    drop(wal);
    let (wal, recovered) = open(dir.path(), fast()).unwrap();
    let both = HashMap::from([(b"a".to_vec(), 1), (b"b".to_vec(), 2)]);
    assert_eq!(
        leases_by_key(&recovered),
        both,
        "b lives only in the old segment"
    );
    // Having recovered two segments, open wrote its own snapshot and deleted both.
    assert_eq!(segment_files(dir.path()), vec![3]);
    // A complete snapshot; then put an old segment back as if deletion had not happened.
    let snapshot = wal.begin_snapshot(0).unwrap();
    wal.append(&grant(b"a", 1)).unwrap();
    wal.append(&grant(b"b", 2)).unwrap();
    wal.end_snapshot(snapshot).unwrap();
    wal.sync_and_stop().unwrap();
    assert_eq!(segment_files(dir.path()), vec![4]);
    std::fs::write(dir.path().join(segment_name(3)), encode_header(3)).unwrap();
    let (_wal, recovered) = open(dir.path(), fast()).unwrap();
    assert_eq!(leases_by_key(&recovered), both);
    assert_eq!(segment_files(dir.path()), vec![4, 5]);
}

#[test]
fn abandoned_snapshot_allows_another_and_limit_is_reserved() {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Wal>();
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_size_max: 8 << 10,
        ..fast()
    };
    let (wal, _) = open(dir.path(), options).unwrap();
    let fill = |count: u64| {
        for i in 0..count {
            wal.append(&free(b"nothing", i)).unwrap();
        }
    };
    wal.append(&grant(b"a", 1)).unwrap();
    fill(500);
    assert!(wal.should_snapshot());
    let abandoned = wal.begin_snapshot(5000).unwrap();
    assert_eq!(wal.token_floor(), 5000);
    drop(abandoned);
    assert!(
        !wal.should_snapshot(),
        "no retry right after an abandoned snapshot"
    );
    fill(500);
    assert!(wal.should_snapshot(), "retry after another segment's worth");
    let snapshot = wal.begin_snapshot(0).unwrap();
    let snapshot_seq = snapshot.segment_seq();
    wal.append(&grant(b"a", 1)).unwrap();
    wal.end_snapshot(snapshot).unwrap();
    wal.sync_and_stop().unwrap();
    assert!(matches!(
        wal.append(&grant(b"b", 2)),
        Err(WalError::Stopped)
    ));
    wal.sync_and_stop().unwrap(); // idempotent
    drop(wal);
    assert_eq!(segment_files(dir.path()), vec![snapshot_seq]);
    let (_wal, recovered) = open(dir.path(), fast()).unwrap();
    assert_eq!(
        recovered.token_floor, 5000,
        "the snapshot's Reserve carries the floor"
    );
    assert_eq!(
        leases_by_key(&recovered),
        HashMap::from([(b"a".to_vec(), 1)])
    );
}

fn encode_header(seq: u64) -> Vec<u8> {
    let header = record::SegmentHeader {
        seq,
        token_floor: 0,
    };
    record::encode_segment_header(header).to_vec()
}

/// Appends records one by one, remembering each LSN, until an append fails.
fn append_until_failure(wal: &Wal, count: u64) -> Vec<(Lsn, Vec<u8>)> {
    let mut appended = Vec::new();
    for i in 0..count {
        let key = format!("key-{i:05}").into_bytes();
        match wal.append(&grant(&key, i + 1)) {
            Ok(lsn) => appended.push((lsn, key)),
            Err(WalError::Failed(_)) => break,
            Err(e) => panic!("{e}"),
        }
        if i % 7 == 0 {
            let _ = wal.flush();
        }
    }
    appended
}

/// After a fault: the durable LSN stopped, everything up to it survives a restart.
fn check_after_fault(wal: Wal, appended: &[(Lsn, Vec<u8>)], dir: &std::path::Path) {
    assert!(wal.flush().is_err());
    let state = wal.subscribe().borrow().clone();
    assert!(state.failed.is_some());
    let durable = wal.durable_lsn();
    assert_eq!(state.lsn, durable);
    assert!(
        durable < wal.appended_lsn(),
        "something must have been lost"
    );
    assert!(matches!(
        wal.append(&grant(b"late", 1)),
        Err(WalError::Failed(_))
    ));
    assert!(matches!(wal.begin_snapshot(0), Err(WalError::Failed(_))));
    assert!(!wal.should_snapshot());
    assert!(wal.sync_and_stop().is_err());
    let (_wal, recovered) = open(dir, fast()).unwrap();
    let keys = leases_by_key(&recovered);
    for (lsn, key) in appended {
        if *lsn <= durable {
            assert!(keys.contains_key(key), "acknowledged {key:?} at {lsn} lost");
        }
    }
    assert!(!keys.contains_key(&b"late"[..]));
}

#[test]
fn failed_fsync_stops_durability_for_good() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = faulty(dir.path());
    let options = WalOptions {
        sync_mode: SyncMode::Data,
        ..WalOptions::default()
    };
    let (wal, _) = open_with_storage(storage, options).unwrap();
    faults.set(FaultPlan {
        sync_fails_from: Some(faults.syncs() + 5),
        ..FaultPlan::default()
    });
    let appended = append_until_failure(&wal, 200);
    let syncs = faults.syncs();
    check_after_fault(wal, &appended, dir.path());
    assert_eq!(faults.syncs(), syncs, "no fsync retried after a failure");
}

#[test]
fn short_write_is_a_torn_tail_on_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = faulty(dir.path());
    let (wal, _) = open_with_storage(storage, fast()).unwrap();
    for i in 0..20u64 {
        wal.append(&grant(format!("before-{i}").as_bytes(), i + 1))
            .unwrap();
    }
    wal.flush().unwrap();
    faults.set(FaultPlan {
        short_write_next: Some(30),
        ..FaultPlan::default()
    });
    let appended = append_until_failure(&wal, 100);
    check_after_fault(wal, &appended, dir.path());
    drop(open(dir.path(), fast()).unwrap()); // the torn tail was cut on the first reopen
    let (_wal, recovered) = open(dir.path(), fast()).unwrap();
    assert_eq!(recovered.torn_tail_truncated, None);
    assert!(recovered.leases.len() >= 20);
}

#[test]
fn disk_full_fails_cleanly_and_keeps_what_was_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = faulty(dir.path());
    let options = WalOptions {
        segment_size_max: 8 << 10,
        ..fast()
    };
    let (wal, _) = open_with_storage(storage, options).unwrap();
    faults.set(FaultPlan {
        disk_full_after_bytes: Some(20_000),
        ..FaultPlan::default()
    });
    let appended = append_until_failure(&wal, 2_000);
    check_after_fault(wal, &appended, dir.path());
}

#[tokio::test]
async fn async_waiters_see_durability_and_failure() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = faulty(dir.path());
    let options = WalOptions {
        sync_mode: SyncMode::Data,
        ..WalOptions::default()
    };
    let (wal, _) = open_with_storage(storage, options).unwrap();
    let wal = Arc::new(wal);
    let tasks: Vec<_> = (0..50u64)
        .map(|i| {
            let wal = Arc::clone(&wal);
            tokio::spawn(async move {
                let lsn = wal.append(&grant(format!("k{i}").as_bytes(), i)).unwrap();
                wal.wait_durable(lsn).await
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    faults.set(FaultPlan {
        sync_fails_from: Some(1),
        ..FaultPlan::default()
    });
    let lsn = wal.append(&grant(b"doomed", 99)).unwrap();
    let mut receiver = wal.subscribe();
    let err = wait_durable_on(&mut receiver, lsn).await.unwrap_err();
    assert!(err.to_string().contains("fdatasync"), "{err}");
    assert!(wal.wait_durable(lsn).await.is_err());
    assert!(
        wal.wait_durable(lsn - 1).await.is_ok(),
        "earlier records stay durable"
    );
}

#[test]
fn backlog_is_refused_not_buffered_without_bound() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(pipeline::Gate::default());
    gate.allow_syncs(u64::MAX);
    let storage = WrapFiles::new(FsStorage::new(dir.path()).unwrap(), Arc::clone(&gate));
    let options = WalOptions {
        pending_bytes_max: 8 << 10,
        batch_bytes_max: 4 << 10,
        ..fast()
    };
    let (wal, _) = open_with_storage(Arc::new(storage), options).unwrap();
    gate.hold_writes(true);
    let big = [0u8; 1000];
    let mut accepted = 0;
    let refused = loop {
        let record = Record::Grant {
            key: b"k",
            lease_id: [0; 16],
            token: 1,
            ttl_ms: 1,
            flags: 0,
            meta: &big,
            acquire_id: None,
            session_id: None,
            kind: Default::default(),
        };
        match wal.append(&record) {
            Ok(_) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 100, "backlog never refused");
    };
    assert!(matches!(refused, WalError::Backlog { .. }), "{refused}");
    gate.hold_writes(false);
    wal.flush().unwrap();
    wal.append(&grant(b"k", 2)).unwrap();
    wal.sync_and_stop().unwrap();
}

/// `open` compacts a log of several segments into a snapshot of its own (flags, metadata
/// and lease ids included) and deletes the rest; a log of one segment is left alone.
#[test]
fn open_snapshots_a_log_of_several_segments_and_deletes_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = open(dir.path(), fast()).unwrap();
    let flagged = Record::Grant {
        key: b"flagged",
        lease_id: LeaseId::from_u128(77).0,
        token: 7,
        ttl_ms: 2_000,
        flags: GRANT_FLAG_RELEASE_ON_DISCONNECT,
        meta: b"who",
        acquire_id: None,
        session_id: None,
        kind: Default::default(),
    };
    wal.append(&flagged).unwrap();
    wal.append(&grant(b"gone", 8)).unwrap();
    wal.append(&free(b"gone", 8)).unwrap();
    drop(wal);
    let (wal, recovered) = open(dir.path(), fast()).unwrap();
    assert_eq!(
        wal.stats().snapshots_completed,
        0,
        "one segment: left alone"
    );
    assert_eq!(recovered.leases.len(), 1);
    drop(wal);
    assert_eq!(segment_files(dir.path()), vec![1, 2]);
    let (wal, recovered) = open(dir.path(), fast()).unwrap();
    let stats = wal.stats();
    assert_eq!((stats.snapshots_completed, stats.segments_deleted), (1, 2));
    drop(wal);
    assert_eq!(segment_files(dir.path()), vec![3]);
    for round in 0..3 {
        let (_wal, again) = open(dir.path(), fast()).unwrap();
        assert_eq!(again.leases, recovered.leases, "round {round}");
        assert_eq!(again.leases[0].as_grant(), flagged, "round {round}");
        // Only the snapshot is replayed (begin, reserve, one grant, end), not the history.
        assert_eq!(again.records, 4, "round {round}");
        assert!(segment_files(dir.path()).len() <= 2, "round {round}");
    }
}

/// The segment header keeps the token floor, so losing every record of the newest segment
/// still leaves it; `token_floor_margin` then covers a reservation lost with those records.
#[test]
fn header_keeps_the_token_floor_when_records_are_lost() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        token_floor_margin: 100,
        ..fast()
    };
    let (wal, recovered) = open(dir.path(), options.clone()).unwrap();
    assert_eq!(recovered.token_floor, 0, "an empty log has nothing to lose");
    wal.append(&Record::Reserve { token_limit: 100 }).unwrap();
    drop(wal);
    let (wal, recovered) = open(dir.path(), options.clone()).unwrap();
    assert_eq!(recovered.token_floor, 200);
    // The reservation a server makes at start, then a disk losing it (and all after it).
    wal.append(&Record::Reserve { token_limit: 300 }).unwrap();
    drop(wal);
    let newest = dir.path().join(segment_name(2));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&newest)
        .unwrap();
    file.set_len(record::SEGMENT_HEADER_LEN as u64).unwrap();
    let (_wal, recovered) = open(dir.path(), options).unwrap();
    assert_eq!(
        recovered.token_floor, 300,
        "header floor 200 plus the margin: above every token the lost reservation covered"
    );
}

/// Live state larger than a segment is not snapshotted by `open` (its snapshot would not fit
/// in one segment); the server's snapshot is asked for at once instead.
#[test]
fn open_leaves_a_snapshot_larger_than_a_segment_to_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_size_max: 8 << 10,
        ..fast()
    };
    let (wal, _) = open(dir.path(), options.clone()).unwrap();
    let keys: Vec<String> = (0..400).map(|i| format!("key-{i:04}")).collect();
    for (token, key) in (1..).zip(&keys) {
        wal.append(&grant(key.as_bytes(), token)).unwrap();
    }
    drop(wal);
    let before = segment_files(dir.path());
    assert!(before.len() >= 2, "{before:?}");
    let (wal, recovered) = open(dir.path(), options).unwrap();
    assert_eq!(recovered.leases.len(), keys.len());
    assert_eq!(wal.stats().snapshots_completed, 0);
    assert!(wal.should_snapshot(), "asked for at once");
    let snapshot = wal.begin_snapshot(0).unwrap();
    assert!(!wal.should_snapshot(), "asked for once");
    drop(snapshot);
}

/// A snapshot `open` could not finish (the disk filled up) deletes nothing; the next open
/// recovers everything from the older segments and then compacts them.
#[test]
fn open_snapshot_cut_short_deletes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for (key, token) in [(&b"a"[..], 1), (&b"b"[..], 2)] {
        let (wal, _) = open(dir.path(), fast()).unwrap();
        wal.append(&grant(key, token)).unwrap();
    }
    assert_eq!(segment_files(dir.path()), vec![1, 2]);
    let (storage, faults) = faulty(dir.path());
    faults.set(FaultPlan {
        disk_full_after_bytes: Some(record::SEGMENT_HEADER_LEN as u64 + 20),
        ..FaultPlan::default()
    });
    let refused = open_with_storage(storage, fast()).expect_err("disk full");
    assert!(matches!(refused, WalError::Io { .. }), "{refused}");
    assert_eq!(segment_files(dir.path()), vec![1, 2, 3], "nothing deleted");
    let (_wal, recovered) = open(dir.path(), fast()).unwrap();
    let both = HashMap::from([(b"a".to_vec(), 1), (b"b".to_vec(), 2)]);
    assert_eq!(leases_by_key(&recovered), both);
    assert_eq!(segment_files(dir.path()), vec![4]);
}

mod pipeline;
