//! The floor file: each start's token floor, kept a second time outside the log.
//!
//! A new segment's header carries the token floor, and the next reservation follows in that
//! segment. When that segment is the only one (a snapshot has deleted the older ones), a
//! disk that cuts it inside its header takes every trace of the floor with it, and the next
//! start would begin again at a floor already used. So the floor is also written into a
//! small file of its own, named after it:
//!
//! ```text
//! floor-<floor as 16 hex digits>.tok    floor u64 LE | CRC-32 (IEEE) of those 8 bytes, u32 LE
//! ```
//!
//! Every segment's creation writes one, at a start and at a rotation alike (a rotation whose
//! snapshot then deletes the older segments leaves the same single segment behind). The new
//! file is synced (and the directory with it) before the segment is created; only then are
//! older floor files deleted, so a crash while writing one leaves the previous one.
//! Recovery takes the highest floor among the files whose content matches their name and
//! checksum, and ignores (with a warning) any other: a torn floor file is a crash during a
//! start that created nothing after it, so the log alone still covers that case.

use std::io;
use std::path::PathBuf;

use super::storage::Storage;
use super::{SyncMode, WalError};

/// Bytes of a floor file: the floor and its checksum.
const FLOOR_FILE_LEN: usize = 12;

/// The name of the floor file holding `floor`.
pub(crate) fn floor_name(floor: u64) -> String {
    format!("floor-{floor:016x}.tok")
}

/// The floor a floor file's name carries, if `name` is one.
fn parse_floor_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("floor-")?.strip_suffix(".tok")?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

fn encode(floor: u64) -> [u8; FLOOR_FILE_LEN] {
    let floor = floor.to_le_bytes();
    let mut bytes = [0; FLOOR_FILE_LEN];
    bytes[..8].copy_from_slice(&floor);
    bytes[8..].copy_from_slice(&crc32fast::hash(&floor).to_le_bytes());
    bytes
}

/// The floor in `bytes` if they are a whole, intact floor file for `named`.
fn decode(bytes: &[u8], named: u64) -> Option<u64> {
    let bytes: &[u8; FLOOR_FILE_LEN] = bytes.try_into().ok()?;
    let floor = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(bytes[8..].try_into().expect("4 bytes"));
    (crc == crc32fast::hash(&bytes[..8]) && floor == named).then_some(floor)
}

/// The highest floor recorded in an intact floor file, 0 if there is none.
///
/// # Errors
/// [`WalError::Io`] if the directory cannot be listed or a floor file cannot be read.
pub(crate) fn read_floor(storage: &dyn Storage) -> Result<u64, WalError> {
    let io_error = |path, source| WalError::Io { path, source };
    let names = storage.list().map_err(|e| io_error(storage.path(""), e))?;
    let mut highest = 0;
    for (name, named) in names.iter().filter_map(|n| Some((n, parse_floor_name(n)?))) {
        let bytes = storage
            .read(name)
            .map_err(|e| io_error(storage.path(name), e))?;
        match decode(&bytes, named) {
            Some(floor) => highest = highest.max(floor),
            None => tracing::warn!(
                path = %storage.path(name).display(), bytes = bytes.len(),
                "WAL: ignoring a damaged floor file (a crash while a start wrote it)"
            ),
        }
    }
    Ok(highest)
}

/// Records `floor` in a floor file, durable before this returns, then deletes the floor
/// files of lower floors. Errors deleting those are left for the next start.
///
/// # Errors
/// The file and the error if the new file cannot be written or synced.
pub(crate) fn write_floor(
    storage: &dyn Storage,
    floor: u64,
    sync_mode: SyncMode,
) -> Result<(), (PathBuf, io::Error)> {
    let name = floor_name(floor);
    let with_path = |e| (storage.path(&name), e);
    let names = storage.list().map_err(with_path)?;
    let mut present = names.contains(&name);
    if present && decode(&storage.read(&name).map_err(with_path)?, floor).is_none() {
        // A crash while writing this same floor (a log with no records yet chose it again).
        storage.remove(&name).map_err(with_path)?;
        present = false;
    }
    if !present {
        let mut file = storage.create(&name).map_err(with_path)?;
        file.write_all(&encode(floor)).map_err(with_path)?;
        if sync_mode == SyncMode::Data {
            file.sync_data().map_err(with_path)?;
            storage.sync_dir().map_err(with_path)?;
        }
    }
    let lower = |n: &&String| parse_floor_name(n).is_some_and(|old| old < floor);
    for old in names.iter().filter(lower) {
        if let Err(e) = storage.remove(old) {
            tracing::warn!(path = %storage.path(old).display(), error = %e, "WAL: could not delete an old floor file");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::storage::FsStorage;

    #[test]
    fn names_round_trip_and_reject_others() {
        for floor in [0, 1, 0xabc, u64::MAX] {
            assert_eq!(parse_floor_name(&floor_name(floor)), Some(floor));
        }
        for name in [
            "floor-1.tok",
            "floor-000000000000000g.tok",
            "wal-0000000000000001.log",
        ] {
            assert_eq!(parse_floor_name(name), None, "{name}");
        }
    }

    #[test]
    fn the_highest_intact_floor_wins_and_older_files_go() {
        let dir = tempfile::tempdir().unwrap();
        let storage = FsStorage::new(dir.path()).unwrap();
        assert_eq!(read_floor(&storage).unwrap(), 0, "no file: no floor");
        for floor in [5_000, 9_000, 9_000] {
            write_floor(&storage, floor, SyncMode::Data).unwrap();
        }
        assert_eq!(read_floor(&storage).unwrap(), 9_000);
        assert_eq!(storage.list().unwrap(), vec![floor_name(9_000)]);
    }

    #[test]
    fn a_torn_or_mismatched_floor_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let storage = FsStorage::new(dir.path()).unwrap();
        write_floor(&storage, 7_000, SyncMode::Data).unwrap();
        let whole = encode(20_000);
        for cut in 0..FLOOR_FILE_LEN {
            std::fs::write(dir.path().join(floor_name(20_000)), &whole[..cut]).unwrap();
            assert_eq!(read_floor(&storage).unwrap(), 7_000, "cut at {cut}");
        }
        // Intact bytes under another file's name say nothing about that name.
        std::fs::write(dir.path().join(floor_name(30_000)), whole).unwrap();
        assert_eq!(read_floor(&storage).unwrap(), 7_000);
        // A torn file of the same floor is written again whole.
        std::fs::write(dir.path().join(floor_name(7_000)), &encode(7_000)[..3]).unwrap();
        write_floor(&storage, 7_000, SyncMode::Data).unwrap();
        assert_eq!(read_floor(&storage).unwrap(), 7_000);
    }
}
