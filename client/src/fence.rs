//! Fencing at the protected resource: accept a write only if its fencing token is not older
//! than the newest one the resource has seen.
//!
//! A lease can run out while its holder is paused (a GC pause, a swapped-out VM, a slow disk),
//! and the holder cannot notice until it wakes. Meanwhile the server grants the lock again with
//! a larger fencing token. Renewal and the loss signal of a [`crate::LeaseGuard`] make this
//! rare; only a check *at the resource* makes it harmless:
//!
//! ```text
//!   A: acquire -> token 33 ....... paused ....... write(33) ──> rejected (33 < 34)
//!   B:                 acquire -> token 34, write(34) ──> accepted, highest = 34
//! ```
//!
//! The check and the write must be one atomic step at the resource, or a stale writer can slip
//! in between them. [`Fence`] does that for in-memory resources. For a SQL table, keep the
//! highest accepted token in a column and make the comparison part of the write:
//!
//! ```sql
//! UPDATE t SET data = :data, fence = :token WHERE id = :id AND fence <= :token;
//! -- rows affected = 0: the token is stale; reject the write and tell the caller.
//! ```
//!
//! Equal tokens are accepted because one holder usually writes several times under one grant.
//! Those writes are not ordered by the token, so a delayed write of the same holder can
//! overwrite a later one. When that matters, number the holder's writes and fence on the pair
//! `(token, seq)`, accepting it only if it is strictly greater ([`SequencedFence`]):
//!
//! ```sql
//! UPDATE t SET data = :data, fence = :token, seq = :seq
//!  WHERE id = :id AND (fence < :token OR (fence = :token AND seq < :seq));
//! ```
//!
//! A fence orders the grants it has seen; it does not prove that a lease is still alive. A new
//! grant that has not written yet does not stop the old holder: install the new token at the
//! resource (a first write, or an explicit "take over" step) before relying on it.

use std::collections::HashMap;
use std::sync::Mutex;

use thiserror::Error;

/// A write was refused because the resource has accepted a newer fencing token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("stale fencing token: the resource has accepted token {highest}")]
pub struct Rejected {
    /// The highest token the resource has accepted.
    pub highest: u64,
}

/// A write was refused because the resource has accepted a newer `(token, seq)` pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("stale write: the resource has accepted token {highest_token} seq {highest_seq}")]
pub struct SequenceRejected {
    /// The token of the newest accepted write.
    pub highest_token: u64,
    /// The sequence number of the newest accepted write.
    pub highest_seq: u64,
}

/// The highest accepted fencing token per resource name; [`Fence::try_accept`] compares and
/// records in one step under a mutex.
///
/// The map has no size limit of its own: it holds one entry per resource name the caller
/// protects, so the caller's set of resources bounds it.
#[derive(Debug, Default)]
pub struct Fence {
    highest: Mutex<HashMap<String, u64>>,
}

impl Fence {
    /// An empty fence: every resource accepts its first token.
    pub fn new() -> Fence {
        Fence::default()
    }

    /// Accepts `token` for `resource` if it is at least the highest token accepted so far, and
    /// records it. Do the write only after this returns `Ok`, while still holding whatever
    /// serializes writes to the resource.
    ///
    /// # Errors
    /// [`Rejected`] with the highest accepted token when `token` is older.
    pub fn try_accept(&self, resource: &str, token: u64) -> Result<(), Rejected> {
        let mut highest = self.highest.lock().expect("fence mutex poisoned");
        match highest.get_mut(resource) {
            Some(seen) if *seen > token => Err(Rejected { highest: *seen }),
            Some(seen) => {
                *seen = token;
                Ok(())
            }
            None => {
                highest.insert(resource.to_owned(), token);
                Ok(())
            }
        }
    }

    /// Whether a read under a read lease of `token` (a read/write key, PROTOCOL.md 3.10) may be
    /// answered: only while no write with a greater token has been accepted for `resource`.
    /// A writer is granted only once no reader holds, with a greater token than every reader
    /// before it, so a reader paused past its lease, after which a writer wrote, is refused.
    /// Records nothing. Do the read only after this returns `Ok`, while still holding whatever
    /// serializes writes to the resource (the SQL form is `WHERE fence < :token`; see
    /// [`crate::rwlock`]).
    ///
    /// # Errors
    /// [`Rejected`] with the highest accepted token when a newer write came first.
    pub fn check_read(&self, resource: &str, token: u64) -> Result<(), Rejected> {
        match self.highest(resource) {
            Some(highest) if highest > token => Err(Rejected { highest }),
            _ => Ok(()),
        }
    }

    /// The highest token accepted for `resource`, if any.
    pub fn highest(&self, resource: &str) -> Option<u64> {
        let highest = self.highest.lock().expect("fence mutex poisoned");
        highest.get(resource).copied()
    }
}

/// Like [`Fence`], but orders one holder's own writes too: each write carries `(token, seq)`
/// with `seq` increasing per write under one token, and is accepted only if the pair is
/// strictly greater than the newest accepted pair.
#[derive(Debug, Default)]
pub struct SequencedFence {
    highest: Mutex<HashMap<String, (u64, u64)>>,
}

impl SequencedFence {
    /// An empty fence: every resource accepts its first write.
    pub fn new() -> SequencedFence {
        SequencedFence::default()
    }

    /// Accepts the write `(token, seq)` for `resource` iff `token` is greater than the highest
    /// accepted token, or equal to it with `seq` greater than the highest accepted sequence
    /// number; records it when accepted.
    ///
    /// # Errors
    /// [`SequenceRejected`] with the newest accepted pair otherwise (a replayed or delayed
    /// write of the same holder, or any write of an older holder).
    pub fn try_accept(&self, resource: &str, token: u64, seq: u64) -> Result<(), SequenceRejected> {
        let mut highest = self.highest.lock().expect("fence mutex poisoned");
        match highest.get_mut(resource) {
            Some(seen) if *seen >= (token, seq) => Err(SequenceRejected {
                highest_token: seen.0,
                highest_seq: seen.1,
            }),
            Some(seen) => {
                *seen = (token, seq);
                Ok(())
            }
            None => {
                highest.insert(resource.to_owned(), (token, seq));
                Ok(())
            }
        }
    }

    /// The newest accepted `(token, seq)` for `resource`, if any.
    pub fn highest(&self, resource: &str) -> Option<(u64, u64)> {
        let highest = self.highest.lock().expect("fence mutex poisoned");
        highest.get(resource).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn stale_token_is_rejected_equal_and_newer_accepted() {
        let fence = Fence::new();
        assert_eq!(fence.highest("db"), None);
        assert_eq!(fence.try_accept("db", 33), Ok(()));
        assert_eq!(
            fence.try_accept("db", 33),
            Ok(()),
            "same holder writes again"
        );
        assert_eq!(fence.try_accept("db", 34), Ok(()));
        assert_eq!(fence.try_accept("db", 33), Err(Rejected { highest: 34 }));
        assert_eq!(fence.highest("db"), Some(34));
        // Resources are independent.
        assert_eq!(fence.try_accept("other", 1), Ok(()));
        assert_eq!(fence.highest("other"), Some(1));
    }

    #[test]
    fn a_read_is_refused_once_a_newer_write_was_accepted() {
        let fence = Fence::new();
        assert_eq!(fence.check_read("db", 5), Ok(()), "nothing written yet");
        assert_eq!(fence.try_accept("db", 4), Ok(()));
        assert_eq!(fence.check_read("db", 5), Ok(()), "the write came before");
        assert_eq!(fence.try_accept("db", 6), Ok(()));
        assert_eq!(fence.check_read("db", 5), Err(Rejected { highest: 6 }));
        assert_eq!(
            fence.check_read("db", 7),
            Ok(()),
            "a reader after the writer"
        );
        assert_eq!(fence.highest("db"), Some(6), "reads record nothing");
    }

    #[test]
    fn sequenced_orders_one_holders_writes() {
        let fence = SequencedFence::new();
        assert_eq!(fence.try_accept("db", 7, 1), Ok(()));
        assert_eq!(fence.try_accept("db", 7, 2), Ok(()));
        let replay = fence.try_accept("db", 7, 2);
        assert_eq!(
            replay,
            Err(SequenceRejected {
                highest_token: 7,
                highest_seq: 2
            })
        );
        assert!(fence.try_accept("db", 7, 1).is_err(), "delayed older write");
        assert_eq!(
            fence.try_accept("db", 8, 0),
            Ok(()),
            "new holder restarts seq"
        );
        assert!(
            fence.try_accept("db", 7, 99).is_err(),
            "old holder, any seq"
        );
        assert_eq!(fence.highest("db"), Some((8, 0)));
    }

    #[test]
    fn concurrent_accepts_end_at_the_largest_token() {
        let fence = Arc::new(Fence::new());
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let fence = Arc::clone(&fence);
                std::thread::spawn(move || {
                    let mut accepted = Vec::new();
                    for i in 0..1000u64 {
                        let token = i * 4 + t;
                        if fence.try_accept("r", token).is_ok() {
                            accepted.push(token);
                        }
                    }
                    accepted
                })
            })
            .collect();
        let mut all: Vec<u64> = threads
            .into_iter()
            .flat_map(|h| h.join().expect("thread panicked"))
            .collect();
        all.sort_unstable();
        assert_eq!(fence.highest("r"), all.last().copied());
        assert_eq!(fence.highest("r"), Some(3999));
    }
}
