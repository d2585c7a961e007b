//! Recovery: read every segment in order, cut a torn tail, refuse corruption, replay.
//!
//! The rules for telling a torn tail from corruption are in the [module docs](super).
use std::path::PathBuf;

use super::record::{self, DecodeError, HeaderError, Record, SEGMENT_HEADER_LEN};
use super::storage::Storage;
use super::{parse_segment_name, segment_name, WalError, SEGMENT_SIZE_LIMIT};
use crate::record::{Held, LeaseReplay, RecoveredLease, RecoveredSession};

/// What recovery found in the log.
#[derive(Debug, Clone, Default)]
pub struct Recovered {
    /// Every fencing token ever visible is below this; new tokens must start here. `open`
    /// adds [`WalOptions::token_floor_margin`](super::WalOptions) to what the log shows.
    pub token_floor: u64,
    /// Held leases, in no particular order (a lease of a session that ended is left out).
    pub leases: Vec<RecoveredLease>,
    /// Open sessions, in no particular order: restored before their leases.
    pub sessions: Vec<RecoveredSession>,
    /// Records replayed.
    pub records: u64,
    /// Segment files read.
    pub segments: u32,
    /// The file whose torn tail was cut off and the offset it was cut at, if any.
    pub torn_tail_truncated: Option<(PathBuf, u64)>,
    /// The newest segment's header was torn and the file removed. The floor that header
    /// carried is gone with it, so `open` adds one more token block than usual.
    pub header_removed: bool,
}

/// Recovery's result plus what the writer needs to continue the log.
pub(crate) struct Replayed {
    pub recovered: Recovered,
    /// `(seq, bytes)` of every remaining segment, oldest first.
    pub segments: Vec<(u64, u64)>,
    /// Segment of the newest snapshot whose end record was found.
    pub snapshot_complete_seq: Option<u64>,
    /// Encoded size of the recovered leases as Grant records: what a snapshot would take.
    pub live_bytes: u64,
}

#[derive(Default)]
struct Replay {
    live: LeaseReplay,
    records: u64,
    /// The oldest segment on disk: where replay starts.
    first_seq: u64,
    snapshot_open: Option<u64>,
    snapshot_complete: Option<u64>,
    /// The end of a snapshot that began in a segment before `first_seq`: its first segments
    /// were deleted after a newer snapshot completed, and a crash stopped the deletion before
    /// it reached the segment holding its end. Replaying the rest of it is harmless (its
    /// Grants are copies of leases whose later records follow), but a newer complete snapshot
    /// must follow, or the deleted segments held state that is now lost.
    orphan_end: Option<(u64, usize)>,
}

impl Replay {
    /// Applies one record found at `offset` of segment `seq`; `Err` is a corruption reason.
    fn apply(&mut self, record: &Record<'_>, seq: u64, offset: usize) -> Result<(), String> {
        self.records += 1;
        if self.live.apply(record) {
            return Ok(());
        }
        match *record {
            Record::SnapshotBegin { segment_seq } => {
                if segment_seq != seq || offset != SEGMENT_HEADER_LEN {
                    return Err(format!(
                        "snapshot begin for segment {segment_seq:016x} is not the first record of it"
                    ));
                }
                self.snapshot_open = Some(segment_seq);
            }
            Record::SnapshotEnd { segment_seq } => {
                let began_in_a_deleted_segment = segment_seq < self.first_seq
                    && self.snapshot_open.is_none()
                    && self.snapshot_complete.is_none()
                    && self.orphan_end.is_none();
                if began_in_a_deleted_segment {
                    self.orphan_end = Some((seq, offset));
                    return Ok(());
                }
                if self.snapshot_open != Some(segment_seq) {
                    return Err(format!(
                        "snapshot end for segment {segment_seq:016x} without begin"
                    ));
                }
                self.snapshot_open = None;
                self.snapshot_complete = Some(segment_seq);
            }
            Record::Reserve { .. }
            | Record::Grant { .. }
            | Record::Free { .. }
            | Record::Renew { .. }
            | Record::SessionOpen { .. }
            | Record::SessionEnd { .. } => {}
        }
        Ok(())
    }
}

/// Reads and replays every segment in `storage`, cutting a torn tail off the newest.
///
/// # Errors
/// [`WalError::Corrupt`] for damage that is not a torn tail or a gap in the segment
/// sequence; [`WalError::Io`] if a file cannot be listed, read or truncated.
pub(crate) fn recover(storage: &dyn Storage) -> Result<Replayed, WalError> {
    let seqs = list_segments(storage)?;
    let mut replay = Replay {
        first_seq: seqs.first().copied().unwrap_or(0),
        ..Replay::default()
    };
    let mut segments = Vec::with_capacity(seqs.len());
    let mut torn = None;
    let mut header_removed = false;
    for (i, &seq) in seqs.iter().enumerate() {
        let is_last = i + 1 == seqs.len();
        match replay_segment(storage, seq, is_last, &mut replay)? {
            SegmentEnd::Clean(len) => segments.push((seq, len)),
            SegmentEnd::Truncated(len) => {
                segments.push((seq, len));
                torn = Some((storage.path(&segment_name(seq)), len));
            }
            SegmentEnd::Removed => {
                torn = Some((storage.path(&segment_name(seq)), 0));
                header_removed = true;
            }
        }
    }
    // The floor files keep each start's floor even when the only segment lost its header.
    replay.live.token_floor = replay
        .live
        .token_floor
        .max(super::floor::read_floor(storage)?);
    check_orphan_end(storage, &replay)?;
    let token_floor = replay.live.token_floor;
    let sessions = replay.live.to_sessions();
    let (leases, lease_bytes) = recovered_leases(replay.live.into_held());
    let session_bytes: usize = sessions.iter().map(|s| s.as_record().encoded_len()).sum();
    let live_bytes = lease_bytes + session_bytes as u64;
    let recovered = Recovered {
        token_floor,
        leases,
        sessions,
        records: replay.records,
        segments: u32::try_from(seqs.len()).expect("fewer than 2^32 segments"),
        torn_tail_truncated: torn,
        header_removed,
    };
    let snapshot_complete_seq = replay.snapshot_complete;
    Ok(Replayed {
        recovered,
        segments,
        snapshot_complete_seq,
        live_bytes,
    })
}

/// A snapshot end whose beginning was deleted needs a later complete snapshot: segments
/// are only deleted once a snapshot after them is durable, so without one some are missing.
fn check_orphan_end(storage: &dyn Storage, replay: &Replay) -> Result<(), WalError> {
    if let Some((seq, offset)) = replay.orphan_end {
        // Segments are only deleted once a snapshot after them is durable.
        if replay.snapshot_complete.is_none() {
            return Err(WalError::Corrupt {
                path: storage.path(&segment_name(seq)),
                offset: offset as u64,
                reason: "the oldest segment ends a snapshot whose beginning is gone, and no \
                         later snapshot completed: older segments are missing"
                    .into(),
            });
        }
    }
    Ok(())
}

/// The replayed leases as recovery reports them, and their size as Grant records.
fn recovered_leases(leases: impl Iterator<Item = (Vec<u8>, Held)>) -> (Vec<RecoveredLease>, u64) {
    let mut live_bytes = 0u64;
    let leases: Vec<RecoveredLease> = leases
        .map(|(key, held)| {
            let lease = RecoveredLease {
                key,
                lease_id: held.lease_id,
                token: held.token,
                ttl_ms: held.ttl_ms,
                flags: held.flags,
                meta: held.meta,
                acquire_id: held.acquire_id,
                session_id: held.session_id,
                kind: held.kind,
            };
            live_bytes += grant_len(&lease) as u64;
            lease
        })
        .collect();
    (leases, live_bytes)
}

fn grant_len(lease: &RecoveredLease) -> usize {
    lease.as_grant().encoded_len()
}

/// Sequence numbers of the segment files, ascending and checked for gaps.
fn list_segments(storage: &dyn Storage) -> Result<Vec<u64>, WalError> {
    let names = storage.list().map_err(|source| WalError::Io {
        path: storage.path(""),
        source,
    })?;
    let mut seqs: Vec<u64> = names
        .iter()
        .filter_map(|name| parse_segment_name(name))
        .collect();
    seqs.sort_unstable();
    for pair in seqs.windows(2) {
        if pair[1] != pair[0] + 1 {
            return Err(WalError::Corrupt {
                path: storage.path(&segment_name(pair[1])),
                offset: 0,
                reason: format!("segment {} is missing before it", segment_name(pair[0] + 1)),
            });
        }
    }
    Ok(seqs)
}

enum SegmentEnd {
    /// Every byte decoded; the segment's length.
    Clean(u64),
    /// A torn tail was cut off; the new length.
    Truncated(u64),
    /// The header itself was torn and nothing followed it: the file was deleted.
    Removed,
}

fn replay_segment(
    storage: &dyn Storage,
    seq: u64,
    is_last: bool,
    replay: &mut Replay,
) -> Result<SegmentEnd, WalError> {
    let name = segment_name(seq);
    let path = storage.path(&name);
    let io_error = |source| WalError::Io {
        path: path.clone(),
        source,
    };
    let corrupt = |offset: usize, reason: String| WalError::Corrupt {
        path: path.clone(),
        offset: offset as u64,
        reason,
    };
    let len = storage.len(&name).map_err(io_error)?;
    if len > SEGMENT_SIZE_LIMIT {
        let reason = format!("segment is {len} bytes, more than any this server writes");
        return Err(corrupt(SEGMENT_SIZE_LIMIT as usize, reason));
    }
    let data = storage.read(&name).map_err(io_error)?;
    match record::decode_segment_header(&data) {
        Ok(header) if header.seq == seq => {
            replay.live.token_floor = replay.live.token_floor.max(header.token_floor);
        }
        Ok(header) => {
            let reason = format!("header names segment {:016x}", header.seq);
            return Err(corrupt(0, reason));
        }
        Err(e) if is_last && header_torn(&e, &data) => {
            // A crash while creating the segment, or a disk that lost synced bytes: then the
            // grants and releases the segment held are gone (tokens stay safe, see `floor`).
            tracing::error!(path = %path.display(), error = %e, "WAL: removing newest segment, its header was torn; locks it recorded (if any) are lost");
            storage.remove(&name).map_err(io_error)?;
            return Ok(SegmentEnd::Removed);
        }
        Err(e) => return Err(corrupt(0, e.to_string())),
    }
    let mut offset = SEGMENT_HEADER_LEN;
    while offset < data.len() {
        match record::decode(&data[offset..]) {
            Ok((record, len)) => {
                replay
                    .apply(&record, seq, offset)
                    .map_err(|reason| corrupt(offset, reason))?;
                offset += len;
            }
            Err(e) if !is_last => {
                return Err(corrupt(
                    offset,
                    format!("{e} (in a segment older than the newest)"),
                ));
            }
            Err(e) => {
                if let Some(reason) = corruption_not_tear(&data, offset, &e) {
                    return Err(corrupt(offset, reason));
                }
                tracing::warn!(
                    path = %path.display(), offset, dropped_bytes = data.len() - offset, error = %e,
                    "WAL: truncating torn tail"
                );
                storage.truncate(&name, offset as u64).map_err(io_error)?;
                return Ok(SegmentEnd::Truncated(offset as u64));
            }
        }
    }
    Ok(SegmentEnd::Clean(data.len() as u64))
}

/// A bad header in the newest segment is a torn creation if no record bytes follow it.
fn header_torn(error: &HeaderError, data: &[u8]) -> bool {
    let after_header = data.get(SEGMENT_HEADER_LEN..).unwrap_or(&[]);
    !matches!(error, HeaderError::Version(_)) && after_header.iter().all(|&b| b == 0)
}

/// Given a bad record at `offset` of the newest segment, the reason it is corruption rather
/// than a torn tail, or `None` if it is a tear.
fn corruption_not_tear(data: &[u8], offset: usize, error: &DecodeError) -> Option<String> {
    if matches!(
        error,
        DecodeError::Malformed(_) | DecodeError::UnknownType(_)
    ) {
        // The checksum matched: these are bytes someone wrote on purpose, not a tear.
        return Some(error.to_string());
    }
    if data[offset..].iter().all(|&b| b == 0) {
        return None;
    }
    let next = valid_record_after(data, offset)?;
    Some(format!(
        "{error}; a valid record follows at byte offset {next}"
    ))
}

/// The first offset after `offset` where a whole record with a good checksum starts, other
/// than one that may be the content of the bad record at `offset` itself
/// ([`record::inside_bad_record`]).
fn valid_record_after(data: &[u8], offset: usize) -> Option<usize> {
    (offset + 1..data.len()).find(|&at| {
        let rest = &data[at..];
        // Cheap filters first, so scanning a long garbage tail stays fast.
        let plausible = rest.len() >= record::RECORD_HEADER_LEN
            && record::is_known_type(rest[8])
            && rest[0..2] == [0, 0];
        let (header_len, len_max) = (record::RECORD_HEADER_LEN, record::PAYLOAD_LEN_MAX);
        plausible
            && record::decode(rest).is_ok()
            && !record::inside_bad_record(data, offset, at, header_len, len_max)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::record::{encode, encode_segment_header, FreeReason, SegmentHeader};
    use crate::wal::storage::FsStorage;
    use tenure_protocol::LeaseId;

    fn grant<'a>(key: &'a [u8], token: u64) -> Record<'a> {
        Record::Grant {
            key,
            lease_id: LeaseId::from_u128(u128::from(token) * 1000).0,
            token,
            ttl_ms: 5_000,
            flags: 0,
            meta: b"m",
            acquire_id: None,
            session_id: None,
            kind: Default::default(),
        }
    }

    /// Writes one segment holding `records`; returns its bytes and each record's end offset.
    fn free(key: &[u8], token: u64) -> Record<'_> {
        Record::Free {
            key,
            token,
            reason: FreeReason::Released,
        }
    }

    fn write_segment(dir: &std::path::Path, seq: u64, records: &[Record<'_>]) -> Vec<usize> {
        let header = SegmentHeader {
            seq,
            token_floor: 0,
        };
        let mut bytes = encode_segment_header(header).to_vec();
        let mut ends = Vec::new();
        for record in records {
            encode(record, &mut bytes);
            ends.push(bytes.len());
        }
        std::fs::write(dir.join(segment_name(seq)), &bytes).unwrap();
        ends
    }

    fn recover_dir(dir: &std::path::Path) -> Result<Replayed, WalError> {
        recover(&FsStorage::new(dir).unwrap())
    }

    fn sorted_keys(recovered: &Recovered) -> Vec<(Vec<u8>, u64)> {
        let mut keys: Vec<_> = recovered
            .leases
            .iter()
            .map(|l| (l.key.clone(), l.token))
            .collect();
        keys.sort();
        keys
    }

    #[test]
    fn replays_grants_frees_and_reserves() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(
            dir.path(),
            1,
            &[
                Record::Reserve { token_limit: 100 },
                grant(b"a", 1),
                grant(b"b", 2),
                Record::Free {
                    key: b"a",
                    token: 1,
                    reason: FreeReason::Released,
                },
                Record::Free {
                    key: b"b",
                    token: 99,
                    reason: FreeReason::Expired,
                }, // stale
            ],
        );
        write_segment(dir.path(), 2, &[grant(b"a", 3), grant(b"b", 250)]);
        let replayed = recover_dir(dir.path()).unwrap();
        let r = &replayed.recovered;
        assert_eq!(
            sorted_keys(r),
            vec![(b"a".to_vec(), 3), (b"b".to_vec(), 250)]
        );
        assert_eq!(r.token_floor, 251);
        assert_eq!(
            (r.records, r.segments, r.torn_tail_truncated.clone()),
            (7, 2, None)
        );
        let a = r.leases.iter().find(|l| l.key == b"a").unwrap();
        assert_eq!(
            (a.lease_id, a.ttl_ms, a.meta.as_slice()),
            (LeaseId::from_u128(3000), 5_000, &b"m"[..])
        );
        assert_eq!(replayed.segments.len(), 2);
        assert!(replayed.live_bytes > 0);
    }

    #[test]
    fn a_renewal_gives_its_lease_the_longer_ttl_and_only_that_lease() {
        let dir = tempfile::tempdir().unwrap();
        let renew = |key: &'static [u8], token, ttl_ms| Record::Renew { key, token, ttl_ms };
        write_segment(
            dir.path(),
            1,
            &[
                grant(b"a", 1),
                grant(b"b", 2),
                renew(b"a", 1, 60_000),
                renew(b"b", 9, 70_000), // another lease of b: stale
                grant(b"c", 3),
                renew(b"c", 3, 80_000),
                Record::Free {
                    key: b"c",
                    token: 3,
                    reason: FreeReason::Released,
                },
                renew(b"c", 3, 90_000), // its lease is gone
            ],
        );
        // A later grant of the key starts from its own TTL again.
        write_segment(dir.path(), 2, &[renew(b"a", 1, 65_000), grant(b"d", 4)]);
        let r = recover_dir(dir.path()).unwrap().recovered;
        let ttl_of = |key: &[u8]| r.leases.iter().find(|l| l.key == key).map(|l| l.ttl_ms);
        assert_eq!(ttl_of(b"a"), Some(65_000));
        assert_eq!(ttl_of(b"b"), Some(5_000));
        assert_eq!(ttl_of(b"c"), None);
        assert_eq!(ttl_of(b"d"), Some(5_000));
        assert_eq!(
            r.token_floor, 10,
            "a renewal's token raises the floor like a free's"
        );
        // What a snapshot of the recovered state writes keeps the renewed TTL.
        let a = r.leases.iter().find(|l| l.key == b"a").unwrap();
        assert!(matches!(a.as_grant(), Record::Grant { ttl_ms: 65_000, .. }));
    }

    #[test]
    fn reserve_alone_sets_the_floor_and_empty_dir_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(recover_dir(dir.path()).unwrap().recovered.token_floor, 0);
        write_segment(dir.path(), 7, &[Record::Reserve { token_limit: 4096 }]);
        let r = recover_dir(dir.path()).unwrap().recovered;
        assert_eq!((r.token_floor, r.leases.len()), (4096, 0));
    }

    #[test]
    fn truncation_at_every_offset_recovers_the_records_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let records = [
            Record::Reserve { token_limit: 10 },
            grant(b"k1", 1),
            grant(b"k2", 2),
            Record::Free {
                key: b"k1",
                token: 1,
                reason: FreeReason::Released,
            },
            grant(b"k3", 3),
        ];
        let ends = write_segment(dir.path(), 1, &records);
        let name = dir.path().join(segment_name(1));
        let full = std::fs::read(&name).unwrap();
        for cut in SEGMENT_HEADER_LEN..full.len() {
            std::fs::write(&name, &full[..cut]).unwrap();
            let r = recover_dir(dir.path())
                .unwrap_or_else(|e| panic!("cut {cut}: {e}"))
                .recovered;
            let whole = ends.iter().filter(|&&end| end <= cut).count();
            assert_eq!(r.records, whole as u64, "cut {cut}");
            let good_end = if whole == 0 {
                SEGMENT_HEADER_LEN
            } else {
                ends[whole - 1]
            };
            let expect_torn = (cut != good_end).then(|| (name.clone(), good_end as u64));
            assert_eq!(r.torn_tail_truncated, expect_torn, "cut {cut}");
            assert_eq!(
                std::fs::metadata(&name).unwrap().len(),
                good_end as u64,
                "cut {cut}"
            );
        }
    }

    #[test]
    fn flipped_byte_in_the_middle_refuses_with_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let records = [grant(b"k1", 1), grant(b"k2", 2), grant(b"k3", 3)];
        let ends = write_segment(dir.path(), 1, &records);
        let name = dir.path().join(segment_name(1));
        let full = std::fs::read(&name).unwrap();
        // Every byte of the first two records: a later valid record proves it is not a tear.
        for at in SEGMENT_HEADER_LEN..ends[1] {
            let mut bad = full.clone();
            bad[at] ^= 0x5a;
            std::fs::write(&name, &bad).unwrap();
            let Err(e) = recover_dir(dir.path()) else {
                panic!("flip at {at} accepted")
            };
            let WalError::Corrupt { path, offset, .. } = &e else {
                panic!("{e}")
            };
            assert_eq!(path, &name);
            let record_start = if at < ends[0] {
                SEGMENT_HEADER_LEN
            } else {
                ends[0]
            };
            assert_eq!(*offset, record_start as u64);
            let message = e.to_string();
            assert!(message.contains(&name.display().to_string()), "{message}");
            assert!(
                message.contains(&format!("offset {record_start}")),
                "{message}"
            );
        }
        std::fs::write(&name, &full).unwrap();
        assert_eq!(recover_dir(dir.path()).unwrap().recovered.records, 3);
    }

    #[test]
    fn damage_in_an_older_segment_refuses_even_at_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_segment(dir.path(), 1, &[grant(b"k1", 1), grant(b"k2", 2)]);
        write_segment(dir.path(), 2, &[grant(b"k3", 3)]);
        let name = dir.path().join(segment_name(1));
        let full = std::fs::read(&name).unwrap();
        std::fs::write(&name, &full[..full.len() - 1]).unwrap();
        let e = recover_dir(dir.path()).err().expect("refused");
        assert!(
            matches!(&e, WalError::Corrupt { offset, .. } if *offset == ends[0] as u64),
            "{e}"
        );
    }

    #[test]
    fn impossible_length_with_data_after_refuses_without_allocating() {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_segment(dir.path(), 1, &[grant(b"k1", 1), grant(b"k2", 2)]);
        let name = dir.path().join(segment_name(1));
        let mut bad = std::fs::read(&name).unwrap();
        bad[SEGMENT_HEADER_LEN..SEGMENT_HEADER_LEN + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        std::fs::write(&name, &bad).unwrap();
        let e = recover_dir(dir.path()).err().expect("refused");
        assert!(e.to_string().contains("impossible payload length"), "{e}");
        assert!(e
            .to_string()
            .contains(&format!("valid record follows at byte offset {}", ends[0])));
        // The same damage on the last record, with nothing valid after it, is a torn tail.
        let mut torn = bad[..SEGMENT_HEADER_LEN].to_vec();
        torn.extend_from_slice(&bad[ends[0]..ends[1]]);
        torn[SEGMENT_HEADER_LEN..SEGMENT_HEADER_LEN + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        std::fs::write(&name, &torn).unwrap();
        let r = recover_dir(dir.path()).unwrap().recovered;
        assert_eq!(
            (r.records, r.torn_tail_truncated),
            (0, Some((name, SEGMENT_HEADER_LEN as u64)))
        );
    }

    /// An open session and its leases come back; an ended one does not, nor its leases
    /// whose frees the crash cut off; a torn SessionEnd at the tail leaves its session open.
    #[test]
    fn recovers_open_sessions_and_drops_the_leases_of_ended_ones() {
        use crate::record::SessionEnd;
        let in_session = |key: &'static [u8], token: u64, session: u8| {
            let mut record = grant(key, token);
            if let Record::Grant {
                flags, session_id, ..
            } = &mut record
            {
                *flags |= crate::record::GRANT_FLAG_SESSION;
                *session_id = Some([session; 16]);
            }
            record
        };
        let opened = |session: u8| Record::SessionOpen {
            session_id: [session; 16],
            ttl_ms: 7_000,
            owner: b"orders",
        };
        let dir = tempfile::tempdir().unwrap();
        let ends = write_segment(
            dir.path(),
            1,
            &[
                opened(1),
                opened(2),
                in_session(b"a", 1, 1),
                in_session(b"b", 2, 2),
                grant(b"plain", 3),
                Record::SessionEnd {
                    session_id: [2; 16],
                    how: SessionEnd::Closed,
                },
                Record::SessionEnd {
                    session_id: [1; 16],
                    how: SessionEnd::Expired,
                },
            ],
        );
        let r = recover_dir(dir.path()).unwrap().recovered;
        assert!(r.sessions.is_empty());
        assert_eq!(sorted_keys(&r), vec![(b"plain".to_vec(), 3)]);
        // Cut inside the last record: a torn tail, so session 1 is still open, with "a".
        let name = dir.path().join(segment_name(1));
        let bytes = std::fs::read(&name).unwrap();
        std::fs::write(&name, &bytes[..ends[6] - 3]).unwrap();
        let r = recover_dir(dir.path()).unwrap().recovered;
        assert_eq!(r.sessions.len(), 1);
        let session = &r.sessions[0];
        assert_eq!(
            (session.session_id.0, session.ttl_ms, &session.owner[..]),
            ([1; 16], 7_000, &b"orders"[..])
        );
        assert_eq!(
            sorted_keys(&r),
            vec![(b"a".to_vec(), 1), (b"plain".to_vec(), 3)]
        );
        let a = r.leases.iter().find(|l| l.key == b"a").unwrap();
        assert_eq!(a.session_id.map(|id| id.0), Some([1; 16]));
    }

    #[test]
    fn zero_filled_tail_is_torn() {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_segment(dir.path(), 1, &[grant(b"k1", 1), grant(b"k2", 2)]);
        let name = dir.path().join(segment_name(1));
        let mut bytes = std::fs::read(&name).unwrap();
        bytes.resize(bytes.len() + 8192, 0);
        std::fs::write(&name, &bytes).unwrap();
        let r = recover_dir(dir.path()).unwrap().recovered;
        assert_eq!(
            (r.records, r.torn_tail_truncated),
            (2, Some((name.clone(), ends[1] as u64)))
        );
        // A zeroed last record (a page that never reached the disk) is torn as well.
        let mut bytes = std::fs::read(&name).unwrap();
        bytes[ends[0]..].fill(0);
        std::fs::write(&name, &bytes).unwrap();
        let r = recover_dir(dir.path()).unwrap().recovered;
        assert_eq!(
            (r.records, r.torn_tail_truncated),
            (1, Some((name, ends[0] as u64)))
        );
    }

    #[test]
    fn garbage_tail_without_a_valid_record_is_torn() {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_segment(dir.path(), 1, &[grant(b"k1", 1)]);
        let name = dir.path().join(segment_name(1));
        let mut bytes = std::fs::read(&name).unwrap();
        bytes.extend((0..3000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
        std::fs::write(&name, &bytes).unwrap();
        let r = recover_dir(dir.path()).unwrap().recovered;
        assert_eq!(
            (r.records, r.torn_tail_truncated),
            (1, Some((name, ends[0] as u64)))
        );
    }

    #[test]
    fn torn_header_of_the_newest_segment_removes_it() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(dir.path(), 1, &[grant(b"k1", 1)]);
        let name = dir.path().join(segment_name(2));
        let header = SegmentHeader {
            seq: 2,
            token_floor: 0,
        };
        std::fs::write(&name, &encode_segment_header(header)[..10]).unwrap();
        let r = recover_dir(dir.path()).unwrap();
        assert_eq!(r.recovered.torn_tail_truncated, Some((name.clone(), 0)));
        assert_eq!((r.recovered.records, r.segments.len()), (1, 1));
        assert!(!name.exists());
        // A bad header with records after it is corruption, as is a bad header in an older one.
        let mut bytes = vec![0u8; SEGMENT_HEADER_LEN];
        encode(&grant(b"k2", 2), &mut bytes);
        std::fs::write(&name, &bytes).unwrap();
        let e = recover_dir(dir.path()).err().expect("refused");
        assert!(matches!(e, WalError::Corrupt { offset: 0, .. }), "{e}");
    }

    #[test]
    fn missing_segment_and_wrong_header_seq_refuse() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(dir.path(), 1, &[grant(b"k1", 1)]);
        write_segment(dir.path(), 3, &[grant(b"k1", 1)]);
        let e = recover_dir(dir.path()).err().expect("refused");
        assert!(e.to_string().contains(&segment_name(2)), "{e}");
        let bytes = std::fs::read(dir.path().join(segment_name(3))).unwrap();
        std::fs::write(dir.path().join(segment_name(2)), bytes).unwrap();
        let e = recover_dir(dir.path()).err().expect("refused");
        assert!(e.to_string().contains("header names segment"), "{e}");
    }

    #[test]
    fn oversized_segment_is_refused_without_reading_it() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(dir.path(), 1, &[grant(b"k1", 1)]);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(segment_name(1)))
            .unwrap();
        file.set_len(SEGMENT_SIZE_LIMIT + 1).unwrap(); // sparse: costs no disk
        let e = recover_dir(dir.path()).err().expect("refused");
        assert!(
            e.to_string().contains("more than any this server writes"),
            "{e}"
        );
    }

    #[test]
    fn snapshot_markers_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(dir.path(), 1, &[grant(b"k1", 1)]);
        write_segment(
            dir.path(),
            2,
            &[
                Record::SnapshotBegin { segment_seq: 2 },
                grant(b"k1", 1),
                Record::SnapshotEnd { segment_seq: 2 },
            ],
        );
        assert_eq!(
            recover_dir(dir.path()).unwrap().snapshot_complete_seq,
            Some(2)
        );
        write_segment(
            dir.path(),
            2,
            &[grant(b"k1", 1), Record::SnapshotBegin { segment_seq: 2 }],
        );
        assert!(
            recover_dir(dir.path()).is_err(),
            "begin must open its segment"
        );
        write_segment(dir.path(), 2, &[Record::SnapshotEnd { segment_seq: 2 }]);
        assert!(recover_dir(dir.path()).is_err(), "end without begin");
    }

    /// A snapshot spanning segments 1-2 was replaced by one in segment 3; the deletion of
    /// the old segments stopped (kill -9) after segment 1. The log left starts inside the old
    /// snapshot: it must recover (it used to be refused as "end without begin" on every
    /// start), and to the same leases as the whole log would.
    #[test]
    fn a_log_whose_oldest_segment_ends_a_partly_deleted_snapshot_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let old_first_half = [
            Record::SnapshotBegin { segment_seq: 1 },
            grant(b"gone", 1),
            grant(b"kept", 2),
        ];
        write_segment(dir.path(), 1, &old_first_half);
        let old_second_half = [
            grant(b"late", 3),
            Record::SnapshotEnd { segment_seq: 1 },
            free(b"gone", 1),
            grant(b"new", 4),
        ];
        write_segment(dir.path(), 2, &old_second_half);
        let new_snapshot = [
            Record::SnapshotBegin { segment_seq: 3 },
            grant(b"kept", 2),
            grant(b"late", 3),
            grant(b"new", 4),
            Record::SnapshotEnd { segment_seq: 3 },
            free(b"late", 3),
        ];
        write_segment(dir.path(), 3, &new_snapshot);
        let whole = recover_dir(dir.path()).unwrap();
        std::fs::remove_file(dir.path().join(segment_name(1))).unwrap();
        let rest = recover_dir(dir.path()).unwrap();
        assert_eq!(sorted_keys(&rest.recovered), sorted_keys(&whole.recovered));
        assert_eq!(
            sorted_keys(&rest.recovered),
            vec![(b"kept".to_vec(), 2), (b"new".to_vec(), 4)]
        );
        assert_eq!(rest.recovered.token_floor, whole.recovered.token_floor);
        assert_eq!(rest.snapshot_complete_seq, Some(3));
    }

    /// The same log without the newer snapshot: the deleted segment held state nothing
    /// replaces, so recovery refuses it rather than start without it.
    #[test]
    fn a_log_starting_inside_a_snapshot_with_none_after_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(
            dir.path(),
            2,
            &[grant(b"late", 3), Record::SnapshotEnd { segment_seq: 1 }],
        );
        write_segment(dir.path(), 3, &[grant(b"new", 4)]);
        let err = recover_dir(dir.path()).err().expect("refused");
        assert!(
            err.to_string().contains("older segments are missing"),
            "{err}"
        );
    }

    /// A client's metadata may hold the bytes of a whole WAL record; a crash that tears the
    /// Grant carrying it (its last page never written) is still a torn tail, not damage
    /// with "a valid record following", which kept the server from starting (review 9,
    /// finding 3). The copy is told from a record written after the torn one by the torn
    /// record's own length and checksum.
    #[test]
    fn a_torn_grant_whose_meta_holds_a_record_is_still_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut fake = Vec::new();
        encode(&Record::Reserve { token_limit: 5 }, &mut fake);
        fake.extend_from_slice(&[b'x'; 100]);
        let mut torn = grant(b"k2", 2);
        if let Record::Grant { meta, .. } = &mut torn {
            *meta = &fake;
        }
        let ends = write_segment(dir.path(), 1, &[grant(b"k1", 1), torn]);
        let name = dir.path().join(segment_name(1));
        let mut bytes = std::fs::read(&name).unwrap();
        // The crash: the Grant's last bytes (after its meta) never reached the disk.
        let cut = ends[1] - 50;
        bytes[cut..].fill(0);
        std::fs::write(&name, &bytes).unwrap();
        let r = recover_dir(dir.path());
        assert!(r.is_ok(), "refused: {}", r.err().unwrap());
        assert_eq!(
            r.unwrap().recovered.torn_tail_truncated,
            Some((name, ends[0] as u64))
        );
    }

    /// The other side of the test above: the same torn Grant followed by a record written
    /// after it is damage, and so is a Grant whose length field alone was damaged (its
    /// checksum then matches its bytes up to the next record).
    #[test]
    fn a_record_after_a_bad_one_is_still_damage_wherever_its_bytes_are() {
        let mut fake = Vec::new();
        encode(&Record::Reserve { token_limit: 5 }, &mut fake);
        let mut meta_holding_a_record = grant(b"k2", 2);
        if let Record::Grant { meta, .. } = &mut meta_holding_a_record {
            *meta = &fake;
        }
        for damage in ["payload", "length"] {
            let dir = tempfile::tempdir().unwrap();
            let records = [grant(b"k1", 1), meta_holding_a_record, grant(b"k3", 3)];
            let ends = write_segment(dir.path(), 1, &records);
            let name = dir.path().join(segment_name(1));
            let mut bytes = std::fs::read(&name).unwrap();
            match damage {
                "payload" => bytes[ends[1] - 2] ^= 1,
                _ => bytes[ends[0] + 3] = bytes[ends[0] + 3].wrapping_add(40),
            }
            std::fs::write(&name, &bytes).unwrap();
            let err = recover_dir(dir.path())
                .err()
                .expect("damage taken for a tear");
            assert!(
                err.to_string().contains("a valid record follows"),
                "{damage}: {err}"
            );
        }
    }
}
