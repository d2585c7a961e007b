//! The simulated disk: the records that became durable, across every restart, laid out as
//! one WAL segment so the real recovery code reads them.

use std::io;
use std::path::PathBuf;

use crate::journal::mem::MemJournal;
use crate::journal::Journal;
use crate::wal::record::{encode_segment_header, SegmentHeader};
use crate::wal::recovery::{self, Recovered};
use crate::wal::{SegmentFile, Storage};

/// The one segment's file name (sequence 1).
const SEGMENT_NAME: &str = "wal-0000000000000001.log";

/// Everything durable so far, as one segment file.
pub(super) struct Disk {
    segment: Vec<u8>,
}

impl Disk {
    /// An empty segment (just its header).
    pub fn new() -> Disk {
        let header = encode_segment_header(SegmentHeader {
            seq: 1,
            token_floor: 1,
        });
        Disk {
            segment: header.to_vec(),
        }
    }

    /// Appends what `journal` made durable (a crash loses the rest).
    pub fn keep_durable(&mut self, journal: &MemJournal) {
        let durable_lsn = journal.progress().borrow().lsn;
        for kept in journal.kept() {
            if kept.ticket <= durable_lsn {
                self.segment.extend_from_slice(&kept.record);
            }
        }
    }

    /// Runs the WAL's recovery over the segment, adding the start-up margin the WAL adds
    /// (`token_floor_margin`, which the server sets to its token block).
    pub fn recover(&self, token_block: u64) -> Recovered {
        let replayed = recovery::recover(self).expect("the simulated log is readable");
        let mut recovered = replayed.recovered;
        recovered.token_floor = recovered.token_floor.saturating_add(token_block);
        recovered
    }
}

impl Storage for Disk {
    fn path(&self, name: &str) -> PathBuf {
        PathBuf::from("/sim").join(name)
    }

    fn list(&self) -> io::Result<Vec<String>> {
        Ok(vec![SEGMENT_NAME.to_string()])
    }

    fn len(&self, _name: &str) -> io::Result<u64> {
        Ok(self.segment.len() as u64)
    }

    fn read(&self, _name: &str) -> io::Result<Vec<u8>> {
        Ok(self.segment.clone())
    }

    fn create(&self, _name: &str) -> io::Result<Box<dyn SegmentFile>> {
        Err(io::Error::other(
            "the simulated disk is read by recovery only",
        ))
    }

    fn truncate(&self, _name: &str, _len: u64) -> io::Result<()> {
        Err(io::Error::other("the simulated log has no torn tail"))
    }

    fn remove(&self, _name: &str) -> io::Result<()> {
        Err(io::Error::other(
            "the simulated disk is read by recovery only",
        ))
    }

    fn sync_dir(&self) -> io::Result<()> {
        Ok(())
    }
}
