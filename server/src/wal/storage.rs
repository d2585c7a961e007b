//! The few file operations the WAL needs, behind a trait so tests can inject disk faults.
//!
//! [`FsStorage`] is the real thing: one directory of segment files. [`FaultyStorage`] wraps
//! it and can make a write stop part way, fail an fsync, or report a full disk after a set
//! number of bytes; it is public so server tests can exercise the "WAL failed" path too.
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A directory of segment files, addressed by file name.
pub trait Storage: Send + Sync {
    /// The full path of `name`, for log lines and error messages.
    fn path(&self, name: &str) -> PathBuf;
    /// Names of all files in the directory (in no particular order).
    fn list(&self) -> io::Result<Vec<String>>;
    /// The length of `name` in bytes.
    fn len(&self, name: &str) -> io::Result<u64>;
    /// The whole content of `name`.
    fn read(&self, name: &str) -> io::Result<Vec<u8>>;
    /// Creates `name`, which must not exist, for appending.
    fn create(&self, name: &str) -> io::Result<Box<dyn SegmentFile>>;
    /// Cuts `name` to `len` bytes and makes that durable.
    fn truncate(&self, name: &str, len: u64) -> io::Result<()>;
    /// Deletes `name`.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Makes creations and deletions in the directory durable.
    fn sync_dir(&self) -> io::Result<()>;
}

/// A segment file open for appending.
pub trait SegmentFile: Send {
    /// Appends all of `buf`, or fails (possibly after writing a prefix of it).
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()>;
    /// Makes everything written so far durable (`fdatasync`).
    fn sync_data(&mut self) -> io::Result<()>;
    /// Another handle to the same file (a `dup`), so one thread can sync it while another
    /// writes: what the WAL's pipelined group commit does. Faults and counters are shared.
    fn try_clone(&self) -> io::Result<Box<dyn SegmentFile>>;
}

/// Segment files in a real directory.
#[derive(Debug)]
pub struct FsStorage {
    dir: PathBuf,
}

impl FsStorage {
    /// Uses `dir`, creating it if missing.
    ///
    /// # Errors
    /// If the directory cannot be created.
    pub fn new(dir: impl AsRef<Path>) -> io::Result<FsStorage> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir)?;
        Ok(FsStorage { dir })
    }
}

impl Storage for FsStorage {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn list(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            if let Ok(name) = entry?.file_name().into_string() {
                names.push(name);
            }
        }
        Ok(names)
    }

    fn len(&self, name: &str) -> io::Result<u64> {
        Ok(fs::metadata(self.path(name))?.len())
    }

    fn read(&self, name: &str) -> io::Result<Vec<u8>> {
        fs::read(self.path(name))
    }

    fn create(&self, name: &str) -> io::Result<Box<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(self.path(name))?;
        Ok(Box::new(FsSegmentFile { file }))
    }

    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(self.path(name))?;
        file.set_len(len)?;
        file.sync_all()
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        fs::remove_file(self.path(name))
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }
}

struct FsSegmentFile {
    file: File,
}

impl SegmentFile for FsSegmentFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.file.write_all(buf)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn try_clone(&self) -> io::Result<Box<dyn SegmentFile>> {
        Ok(Box::new(FsSegmentFile {
            file: self.file.try_clone()?,
        }))
    }
}

/// Faults a [`FaultyStorage`] will inject; change them at any time through [`Faults`].
#[derive(Debug, Default, Clone)]
pub struct FaultPlan {
    /// The next write stores only this many bytes of its buffer, then fails with EIO.
    pub short_write_next: Option<usize>,
    /// Writes fail with ENOSPC once this many bytes were written in total (the write that
    /// crosses the line stores the part that fits).
    pub disk_full_after_bytes: Option<u64>,
    /// The n-th `sync_data` call (counting from 1) and every one after it fails with EIO.
    pub sync_fails_from: Option<u64>,
}

/// Shared, adjustable fault settings plus counters of what the storage saw.
#[derive(Debug, Default)]
pub struct Faults {
    state: Mutex<FaultState>,
}

#[derive(Debug, Default)]
struct FaultState {
    plan: FaultPlan,
    bytes_written: u64,
    syncs: u64,
}

impl Faults {
    /// Replaces the fault plan.
    pub fn set(&self, plan: FaultPlan) {
        self.state.lock().expect("faults lock").plan = plan;
    }

    /// Bytes written through the storage so far.
    pub fn bytes_written(&self) -> u64 {
        self.state.lock().expect("faults lock").bytes_written
    }

    /// `sync_data` calls so far.
    pub fn syncs(&self) -> u64 {
        self.state.lock().expect("faults lock").syncs
    }
}

/// Wraps each segment file a storage creates: the one thing a storage that intercepts
/// writes or syncs (fault injection, tests' gates) changes.
pub trait FileWrapper: Send + Sync {
    /// The file the WAL gets in place of `file`.
    fn wrap(&self, file: Box<dyn SegmentFile>) -> Box<dyn SegmentFile>;
}

/// An [`FsStorage`] whose segment files go through a [`FileWrapper`]; every other file and
/// operation is the directory's own.
pub struct WrapFiles<W> {
    inner: FsStorage,
    wrapper: W,
}

impl<W: FileWrapper> WrapFiles<W> {
    /// `inner` with its files wrapped by `wrapper`.
    pub fn new(inner: FsStorage, wrapper: W) -> WrapFiles<W> {
        WrapFiles { inner, wrapper }
    }
}

impl<W: FileWrapper> Storage for WrapFiles<W> {
    fn path(&self, name: &str) -> PathBuf {
        self.inner.path(name)
    }

    fn list(&self) -> io::Result<Vec<String>> {
        self.inner.list()
    }

    fn len(&self, name: &str) -> io::Result<u64> {
        self.inner.len(name)
    }

    fn read(&self, name: &str) -> io::Result<Vec<u8>> {
        self.inner.read(name)
    }

    fn create(&self, name: &str) -> io::Result<Box<dyn SegmentFile>> {
        let file = self.inner.create(name)?;
        // Segment files only: the floor file beside them is written once per segment, and
        // the gates and faults count and stop the log's own writes and syncs.
        if super::parse_segment_name(name).is_some() {
            Ok(self.wrapper.wrap(file))
        } else {
            Ok(file)
        }
    }

    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        self.inner.truncate(name, len)
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        self.inner.remove(name)
    }

    fn sync_dir(&self) -> io::Result<()> {
        self.inner.sync_dir()
    }
}

/// An [`FsStorage`] whose segment files fail as a [`FaultPlan`] says:
/// `FaultyStorage::new(inner, faults)`, the faults controlled through `faults`.
pub type FaultyStorage = WrapFiles<Arc<Faults>>;

impl FileWrapper for Arc<Faults> {
    fn wrap(&self, inner: Box<dyn SegmentFile>) -> Box<dyn SegmentFile> {
        Box::new(FaultyFile {
            inner,
            faults: Arc::clone(self),
        })
    }
}

struct FaultyFile {
    inner: Box<dyn SegmentFile>,
    faults: Arc<Faults>,
}

impl SegmentFile for FaultyFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let mut state = self.faults.state.lock().expect("faults lock");
        let mut allowed = buf.len();
        let mut error = None;
        if let Some(n) = state.plan.short_write_next.take() {
            allowed = allowed.min(n);
            error = Some(io::Error::from_raw_os_error(libc::EIO));
        }
        if let Some(limit) = state.plan.disk_full_after_bytes {
            let room =
                usize::try_from(limit.saturating_sub(state.bytes_written)).unwrap_or(usize::MAX);
            if room < allowed {
                allowed = room;
                error = Some(io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
        self.inner.write_all(&buf[..allowed])?;
        state.bytes_written += allowed as u64;
        match error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn sync_data(&mut self) -> io::Result<()> {
        let mut state = self.faults.state.lock().expect("faults lock");
        state.syncs += 1;
        if state.plan.sync_fails_from.is_some_and(|n| state.syncs >= n) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.sync_data()
    }

    fn try_clone(&self) -> io::Result<Box<dyn SegmentFile>> {
        Ok(Box::new(FaultyFile {
            inner: self.inner.try_clone()?,
            faults: Arc::clone(&self.faults),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faulty_file_stops_where_told() {
        let dir = tempfile::tempdir().unwrap();
        let faults = Arc::new(Faults::default());
        let storage = FaultyStorage::new(FsStorage::new(dir.path()).unwrap(), faults.clone());
        // Segment files are the ones the faults reach.
        let name = crate::wal::segment_name(1);
        let mut file = storage.create(&name).unwrap();
        file.write_all(b"hello").unwrap();
        faults.set(FaultPlan {
            short_write_next: Some(2),
            ..FaultPlan::default()
        });
        let err = file.write_all(b"world").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO));
        file.write_all(b"!").unwrap(); // the short write fault fires once
        faults.set(FaultPlan {
            disk_full_after_bytes: Some(10),
            ..FaultPlan::default()
        });
        let err = file.write_all(b"abcdef").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(storage.read(&name).unwrap(), b"hellowo!ab");
        faults.set(FaultPlan {
            sync_fails_from: Some(1),
            ..FaultPlan::default()
        });
        assert!(file.sync_data().is_err());
        assert!(file.sync_data().is_err());
        assert_eq!(faults.syncs(), 2);
        assert!(
            storage.create(&name).is_err(),
            "create must not reuse a name"
        );
    }
}
