//! Replay: the leases and token floor a sequence of records leaves ([`LeaseReplay`]), the
//! rules both WAL recovery and the cluster's replicated state apply, and the leases it
//! reports ([`RecoveredLease`]).
use std::collections::HashMap;

use tenure_protocol::{AcquireId, LeaseId};

use super::change::{Change, Lease};
use super::codec::{Record, GRANT_FLAG_RELEASE_ON_DISCONNECT};

/// A lease that was granted and not freed when the server stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredLease {
    /// The locked key.
    pub key: Vec<u8>,
    /// The lease id the holder presents.
    pub lease_id: LeaseId,
    /// The lease's fencing token.
    pub token: u64,
    /// Lease length as granted; the server counts it again from restart.
    pub ttl_ms: u32,
    /// Grant flags (`GRANT_FLAG_*`) as recorded.
    pub flags: u8,
    /// Holder metadata.
    pub meta: Vec<u8>,
    /// The ACQUIRE's acquire id, if it had one.
    pub acquire_id: Option<AcquireId>,
}

impl RecoveredLease {
    /// The lease as the journal records it: a snapshot of it writes
    /// `Change::Grant(lease.as_lease()).record()`, the one Grant builder.
    pub fn as_lease(&self) -> Lease<'_> {
        Lease {
            key: &self.key,
            lease_id: self.lease_id,
            token: self.token,
            ttl_ms: self.ttl_ms,
            release_on_disconnect: self.flags & GRANT_FLAG_RELEASE_ON_DISCONNECT != 0,
            meta: &self.meta,
            acquire_id: self.acquire_id,
        }
    }

    /// The Grant record that brings this lease back: what a snapshot of it writes.
    pub fn as_grant(&self) -> Record<'_> {
        Change::Grant(self.as_lease()).record()
    }
}

/// The held leases and the token floor that Reserve, Grant and Free records build up, by the
/// replay rules of the WAL's [module docs](crate::wal): WAL recovery and the cluster's replicated
/// state apply records through this one function.
#[derive(Default, Clone, Debug)]
pub(crate) struct LeaseReplay {
    /// The held leases by key.
    pub leases: HashMap<Vec<u8>, Held>,
    /// Every token the records mention is below this.
    pub token_floor: u64,
}

/// A held lease, as the records left it.
#[derive(Clone, Debug)]
pub(crate) struct Held {
    pub lease_id: LeaseId,
    pub token: u64,
    pub ttl_ms: u32,
    pub flags: u8,
    pub meta: Vec<u8>,
    pub acquire_id: Option<AcquireId>,
}

impl LeaseReplay {
    /// Applies a Reserve, Grant, Free or Renew record; `false` for any other record, which is the
    /// caller's to handle.
    pub fn apply(&mut self, record: &Record<'_>) -> bool {
        match *record {
            Record::Reserve { token_limit } => self.token_floor = self.token_floor.max(token_limit),
            Record::Grant {
                key,
                lease_id,
                token,
                ttl_ms,
                flags,
                meta,
                acquire_id,
            } => {
                self.raise_floor(token);
                let held = Held {
                    lease_id: LeaseId(lease_id),
                    token,
                    ttl_ms,
                    flags,
                    meta: meta.to_vec(),
                    acquire_id: acquire_id.map(AcquireId),
                };
                match self.leases.get_mut(key) {
                    Some(slot) => *slot = held,
                    None => {
                        self.leases.insert(key.to_vec(), held);
                    }
                }
            }
            Record::Free { key, token, .. } => {
                self.raise_floor(token);
                if self.leases.get(key).is_some_and(|held| held.token == token) {
                    self.leases.remove(key);
                }
            }
            Record::Renew { key, token, ttl_ms } => {
                self.raise_floor(token);
                if let Some(held) = self.leases.get_mut(key).filter(|held| held.token == token) {
                    held.ttl_ms = ttl_ms;
                }
            }
            Record::SnapshotBegin { .. } | Record::SnapshotEnd { .. } => return false,
        }
        true
    }

    fn raise_floor(&mut self, token: u64) {
        self.token_floor = self.token_floor.max(token.saturating_add(1));
    }

    /// The held leases as recovery reports them.
    pub fn to_recovered(&self) -> Vec<RecoveredLease> {
        self.leases
            .iter()
            .map(|(key, held)| RecoveredLease {
                key: key.clone(),
                lease_id: held.lease_id,
                token: held.token,
                ttl_ms: held.ttl_ms,
                flags: held.flags,
                meta: held.meta.clone(),
                acquire_id: held.acquire_id,
            })
            .collect()
    }
}
