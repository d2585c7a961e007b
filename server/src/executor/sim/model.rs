//! What the simulated clients know, and the invariants checked against it: the clients'
//! view of who holds what (from the replies they actually got), the tokens they saw, the
//! releases they were told of, and the changes they were told never happened.

use std::collections::{BTreeMap, HashMap, HashSet};

use tenure_protocol::{AcquireId, LeaseId, LeaseKind, Response};

/// Milliseconds a client counts its lease short: the server's clock resolution
/// (PROTOCOL.md §3.3).
pub(super) const CLIENT_SLACK_MS: u64 = 2;

/// A lease a client was told it holds, and until when it believes so.
#[derive(Clone, Debug)]
pub(super) struct Belief {
    pub client: usize,
    pub key: Vec<u8>,
    pub lease_id: LeaseId,
    pub token: u64,
    /// Whether it is released when the acquiring connection closes.
    pub release_on_disconnect: bool,
    /// What it holds: the key alone, a read lease, or permits.
    pub kind: LeaseKind,
    /// Sim time the client stops acting as holder: `sent + waited + ttl - slack`, or a
    /// renewal's `sent + ttl - slack`.
    pub deadline_ms: u64,
    /// The step the latest RENEW of the lease was sent at (0: none yet).
    pub renew_sent_step: u64,
}

/// Everything the clients were told, over the whole run (across restarts).
#[derive(Default)]
pub(super) struct Model {
    /// Leases clients believe they hold; a client drops one when it sends RELEASE for it,
    /// hears LOST, disconnects, or its deadline passes.
    pub beliefs: Vec<Belief>,
    /// Every acknowledged grant: key → (token, step it was acknowledged at).
    pub acked: BTreeMap<Vec<u8>, Vec<(u64, u64)>>,
    /// Largest token acknowledged before the latest restart.
    pub token_before_restart: u64,
    /// Leases whose RELEASE was acknowledged (durable): they must never come back.
    pub released: HashSet<LeaseId>,
    /// Grants answered UNAVAILABLE "nothing changed": they must never be seen.
    pub refused: HashSet<LeaseId>,
    /// The latest grant a client was told of for each acquire id: key, token, lease id.
    pub id_grants: HashMap<AcquireId, (Vec<u8>, u64, LeaseId)>,
    /// Leases granted with release on disconnect.
    pub tied: HashSet<LeaseId>,
}

impl Model {
    /// A grant acknowledged at `step` to a request sent at `sent_step`: its token must be new
    /// for the key, above every token for the key acknowledged before the request was sent,
    /// and above every token acknowledged before the latest restart.
    pub fn grant_acked(&mut self, belief: Belief, step: u64, sent_step: u64) {
        let seen = self.acked.entry(belief.key.clone()).or_default();
        for &(token, at_step) in seen.iter() {
            assert_ne!(
                token, belief.token,
                "token {token} granted twice for one key"
            );
            assert!(
                at_step >= sent_step || token < belief.token,
                "token {} granted after token {token} was acknowledged for the same key",
                belief.token
            );
        }
        assert!(
            belief.token > self.token_before_restart,
            "token {} not above {} acknowledged before a restart",
            belief.token,
            self.token_before_restart
        );
        assert!(
            !self.released.contains(&belief.lease_id),
            "a released lease granted again"
        );
        seen.push((belief.token, step));
        if belief.release_on_disconnect {
            self.tied.insert(belief.lease_id);
        }
        self.beliefs.push(belief);
    }

    /// A grant to an ACQUIRE with acquire id `id` was acknowledged.
    pub fn id_granted(&mut self, id: AcquireId, key: &[u8], token: u64, lease_id: LeaseId) {
        self.id_grants.insert(id, (key.to_vec(), token, lease_id));
    }

    /// The answer to a send of acquire id `id` on `key`, taken up while the leases with the
    /// tokens `holders` held the key (several on a read/write or semaphore key), against the
    /// naive rule: while the lease a client was told of for `id` holds the key, every send
    /// of `id` is answered with that lease; a REGRANTED names a holder, never a grant that
    /// was undone; an ACQUIRE_ENDED never names a holder.
    pub fn check_repeat(&self, key: &[u8], id: AcquireId, holders: &[u64], answer: &Response) {
        if let Response::Error { .. } = answer {
            return; // refused (a failed journal): nothing to compare
        }
        if let Some((k, token, lease_id)) = self.id_grants.get(&id) {
            if k.as_slice() == key && holders.contains(token) {
                assert_eq!(
                    answer,
                    &Response::Regranted {
                        token: *token,
                        lease_id: *lease_id,
                        ttl_left_ms: match answer {
                            Response::Regranted { ttl_left_ms, .. } => *ttl_left_ms,
                            _ => 0,
                        },
                    },
                    "a send of {id:?} while its lease holds the key"
                );
            }
        }
        match answer {
            Response::Regranted {
                token, lease_id, ..
            } => {
                assert!(
                    holders.contains(token),
                    "REGRANTED names a lease not holding"
                );
                assert!(
                    !self.refused.contains(lease_id),
                    "REGRANTED names a grant answered 'nothing changed'"
                );
            }
            Response::AcquireEnded { token, .. } => {
                assert!(!holders.contains(token), "ACQUIRE_ENDED names a holder");
            }
            _ => {}
        }
    }

    /// A repeat of acquire id `id` was answered REGRANTED: the client holds that lease too
    /// (one belief per lease), if it is the one it was told of for `id` and not tied to a
    /// connection (the sim does not follow whose). Its id and token must be the ones told.
    pub fn regrant_acked(&mut self, id: AcquireId, belief: Belief) {
        let tied = self.tied.contains(&belief.lease_id);
        if let Some((key, token, lease_id)) = self.id_grants.get(&id) {
            if *token == belief.token {
                assert_eq!(
                    *lease_id, belief.lease_id,
                    "REGRANTED with another lease id"
                );
                assert_eq!(*key, belief.key);
            }
        }
        let known = self.id_grants.get(&id).is_some_and(|g| g.1 == belief.token);
        let believed = self.beliefs.iter().any(|b| b.lease_id == belief.lease_id);
        if known && !tied && !believed {
            self.beliefs.push(belief);
        }
    }

    /// The client stops believing in `lease_id` (release sent, LOST, disconnect).
    pub fn drop_belief(&mut self, lease_id: LeaseId) {
        self.beliefs.retain(|b| b.lease_id != lease_id);
    }

    /// A RENEW of `lease_id` to `deadline_ms` is sent at `step`. The server applies renewals
    /// in the order they arrive and the latest one sets the deadline, so the client stops
    /// counting on more than that at once, but counts on it only once answered (`renewed`):
    /// until then the renewal may not have happened, or not yet be durable.
    pub fn renewal_sent(&mut self, lease_id: LeaseId, step: u64, deadline_ms: u64) {
        for belief in self.beliefs.iter_mut().filter(|b| b.lease_id == lease_id) {
            belief.deadline_ms = belief.deadline_ms.min(deadline_ms);
            belief.renew_sent_step = step;
        }
    }

    /// The RENEW of `lease_id` sent at `sent_step` was answered RENEWED, to `deadline_ms`:
    /// the client counts on that, unless it sent a later renewal meanwhile.
    pub fn renewed(&mut self, lease_id: LeaseId, sent_step: u64, deadline_ms: u64) {
        for belief in self.beliefs.iter_mut().filter(|b| b.lease_id == lease_id) {
            if belief.renew_sent_step == sent_step {
                belief.deadline_ms = deadline_ms;
            }
        }
    }

    /// Client `client` is gone: it acts on none of its leases any more.
    pub fn drop_client(&mut self, client: usize) {
        self.beliefs.retain(|b| b.client != client);
    }

    /// Forgets beliefs whose deadline passed, then checks exclusion among the clients
    /// inside their local deadlines at `now_ms`, per key: an exclusive (write) lease alone;
    /// read leases only beside read leases; permits adding up to at most their limit.
    pub fn check_exclusion(&mut self, now_ms: u64) {
        self.beliefs.retain(|b| b.deadline_ms > now_ms);
        let mut by_key: BTreeMap<&[u8], Vec<&Belief>> = BTreeMap::new();
        for belief in &self.beliefs {
            by_key.entry(&belief.key).or_default().push(belief);
        }
        for inside in by_key.values().filter(|inside| inside.len() > 1) {
            let fine = match inside[0].kind {
                LeaseKind::Exclusive => false,
                LeaseKind::Shared => inside.iter().all(|b| b.kind == LeaseKind::Shared),
                LeaseKind::Permits { limit, .. } => {
                    let mut held = 0;
                    for belief in inside {
                        match belief.kind {
                            LeaseKind::Permits { count, limit: l } if l == limit => held += count,
                            _ => held = u32::MAX,
                        }
                    }
                    held <= limit
                }
            };
            assert!(
                fine,
                "clients inside their deadlines at {now_ms} ms beyond exclusion: {inside:?}"
            );
        }
    }

    /// The largest token any client was told of.
    pub fn token_max(&self) -> u64 {
        self.acked
            .values()
            .flat_map(|seen| seen.iter().map(|&(token, _)| token))
            .max()
            .unwrap_or(0)
    }

    /// The belief a live client holds on `key`, if any.
    pub fn belief_on(&self, key: &[u8]) -> Option<&Belief> {
        self.beliefs.iter().find(|b| b.key == key)
    }
}
