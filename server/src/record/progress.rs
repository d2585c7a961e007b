//! How far a log is durable: [`Lsn`] and the [`DurableState`] a log publishes.
use std::sync::Arc;

/// Log sequence number: the position of a record among those appended since `open`
/// (1 for the first; 0 means "nothing", always durable). Only meaningful within one process.
pub type Lsn = u64;

/// What the syncer publishes after every batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DurableState {
    /// Every record up to and including this LSN is durable.
    pub lsn: Lsn,
    /// Set once a write or fsync failed; `lsn` then never moves again.
    pub failed: Option<Arc<str>>,
}
