//! Admission of connections that have not proved who they are yet, so that no neighbour
//! can fill the server with them.
//!
//! When the server can authenticate (identities, or a client CA), a connection is *pending*
//! from its accept until it proves who it is: an AUTH that succeeds, or a TLS handshake with
//! a client certificate. Pending connections are bounded twice: at most `per_address_max`
//! from one peer address, and at most `total_max` in all. A new connection over either bound
//! is not refused: the oldest pending connection (of that address, or of all) is evicted to
//! make room. Refusing the newcomer would let whoever got there first hold the places for
//! good, refilling them as each reaches the handshake limit; evicting the oldest means a
//! silent socket lasts only until that many newer connections arrive, and an honest client
//! next to it gets in and has that long to authenticate. The same goes for a newcomer that
//! finds the server at its connection limit while any connection is pending
//! ([`Admission::evict_oldest`]): otherwise authenticated connections at half the limit and
//! silent sockets in the other half would keep every newcomer out (outside test a38, F1).
//!
//! ```text
//!   accept ──► admit(id, ip) ──► PendingPlace ──► authenticated: dropped ──► gone
//!                 │ over a bound
//!                 └──► the oldest pending place's token is cancelled: it closes
//! ```
//!
//! An IPv6 peer counts by its /64 network, the block one host or one site is usually given:
//! counted by single addresses, one host could open a connection from each of its 2^64.
//!
//! Without a way to authenticate there is nothing to wait for, and none of this runs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio_util::sync::CancellationToken;

/// The pending connections of one server.
#[derive(Debug)]
pub struct Admission {
    /// Most pending connections from one peer address.
    per_address_max: usize,
    /// Most pending connections in all; also the most evicted ones closing outside
    /// `--connections-max` at once ([`PendingPlace::into_closing`]).
    total_max: usize,
    state: Mutex<State>,
    /// Evicted connections closing that gave their connection place back early.
    closing: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct State {
    /// Every pending connection by id: ids rise with each accept, so the first is the oldest.
    pending: BTreeMap<u64, (IpAddr, Arc<Told>)>,
    /// The ids of the pending connections of each address; no empty sets.
    by_address: HashMap<IpAddr, BTreeSet<u64>>,
}

/// Why a pending connection was evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evicted {
    /// Its address had `per_address_max` pending connections and another arrived.
    Address,
    /// The server had `total_max` pending connections and another arrived.
    Total,
    /// The server had `--connections-max` connections and another arrived: the oldest
    /// pending one makes room for it, so that authenticated connections filling the rest
    /// and silent sockets the pending half cannot keep every newcomer out.
    Full,
}

/// How an evicted connection is told, and why.
#[derive(Debug, Default)]
struct Told {
    token: CancellationToken,
    /// Set before `token` is cancelled.
    why: OnceLock<Evicted>,
}

/// A pending connection's place; dropping it (once the connection proved who it is, or
/// closed) gives the place back.
#[derive(Debug)]
pub struct PendingPlace {
    admission: Arc<Admission>,
    conn_id: u64,
    told: Arc<Told>,
}

impl PendingPlace {
    /// Completes once the connection is evicted, with the reason; never otherwise.
    pub async fn evicted(&self) -> Evicted {
        self.told.token.cancelled().await;
        *self
            .told
            .why
            .get()
            .expect("the reason is set before the token")
    }
}

impl PendingPlace {
    /// For a connection evicted and now closing (its reason written, then up to the linger
    /// time for the peer to read it): a place among the closing connections, in which it
    /// may give its connection place back at once, so that the closing does not hold a place
    /// of `--connections-max` (outside test a39, F1: a stranger's sockets that never close
    /// each held theirs for the whole linger, and newcomers found nobody left to evict).
    /// `None` when as many are closing as may be pending (the fds stay bounded): the
    /// connection then closes at once, without lingering.
    pub fn into_closing(self) -> Option<ClosingPlace> {
        let closing = Arc::clone(&self.admission.closing);
        let max = self.admission.total_max;
        let taken = closing.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        });
        // Made only once taken: a `ClosingPlace` gives its place back when dropped, so one
        // made and dropped on a refusal (`then_some` builds its value either way) counted a
        // place off that was never counted on, and the bound drifted away (outside test a42,
        // J1 and J3: unbounded on a fresh server, then below zero and never lingering).
        taken.is_ok().then(|| ClosingPlace(closing))
    }
}

/// A place among the evicted connections closing outside `--connections-max`; dropping it
/// (once the connection is closed) gives it back.
#[derive(Debug)]
pub struct ClosingPlace(Arc<AtomicUsize>);

impl Drop for ClosingPlace {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for PendingPlace {
    fn drop(&mut self) {
        let mut state = self
            .admission
            .state
            .lock()
            .expect("admission lock poisoned");
        state.forget(self.conn_id);
    }
}

impl Admission {
    /// Room for `per_address_max` pending connections from one address, `total_max` in all.
    ///
    /// # Panics
    /// If either is 0 (config validation refuses it).
    pub fn new(per_address_max: usize, total_max: usize) -> Admission {
        assert!(
            per_address_max >= 1 && total_max >= 1,
            "admission bounds of 0"
        );
        Admission {
            per_address_max,
            total_max,
            state: Mutex::default(),
            closing: Arc::default(),
        }
    }

    /// Most pending connections from one address.
    pub fn per_address_max(&self) -> usize {
        self.per_address_max
    }

    /// Most pending connections in all.
    pub fn total_max(&self) -> usize {
        self.total_max
    }

    /// Admits connection `conn_id` from `ip` as pending, evicting the oldest pending
    /// connection of `ip`, or of all, if a bound is reached.
    pub fn admit(self: &Arc<Self>, conn_id: u64, ip: IpAddr) -> PendingPlace {
        let ip = source_of(ip);
        let told = Arc::new(Told::default());
        let mut state = self.state.lock().expect("admission lock poisoned");
        let of_address = state.by_address.get(&ip);
        if of_address.map_or(0, BTreeSet::len) >= self.per_address_max {
            if let Some(oldest) = of_address.and_then(|ids| ids.first().copied()) {
                state.evict(oldest, Evicted::Address);
            }
        } else if state.pending.len() >= self.total_max {
            if let Some((&oldest, _)) = state.pending.first_key_value() {
                state.evict(oldest, Evicted::Total);
            }
        }
        state.pending.insert(conn_id, (ip, Arc::clone(&told)));
        state.by_address.entry(ip).or_default().insert(conn_id);
        drop(state);
        PendingPlace {
            admission: Arc::clone(self),
            conn_id,
            told,
        }
    }

    /// Evicts the oldest pending connection, for a newcomer that found every connection
    /// place taken ([`Evicted::Full`]); false if none is pending (every place is then held
    /// by an authenticated connection, and the newcomer is refused).
    pub fn evict_oldest(&self) -> bool {
        let mut state = self.state.lock().expect("admission lock poisoned");
        let Some((&oldest, _)) = state.pending.first_key_value() else {
            return false;
        };
        state.evict(oldest, Evicted::Full);
        true
    }

    /// Pending connections now.
    pub fn pending_count(&self) -> usize {
        let state = self.state.lock().expect("admission lock poisoned");
        state.pending.len()
    }
}

/// What a peer address counts as: itself for IPv4 (also when mapped into IPv6), its /64
/// network for IPv6.
fn source_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let network = v6.to_bits() & !((1u128 << 64) - 1);
            IpAddr::V6(std::net::Ipv6Addr::from_bits(network))
        }
    }
}

impl State {
    /// Forgets `conn_id`; its place is free.
    fn forget(&mut self, conn_id: u64) -> Option<Arc<Told>> {
        let (ip, told) = self.pending.remove(&conn_id)?;
        if let Some(ids) = self.by_address.get_mut(&ip) {
            ids.remove(&conn_id);
            if ids.is_empty() {
                self.by_address.remove(&ip);
            }
        }
        Some(told)
    }

    /// Evicts `conn_id`: forgotten here, and told why through its token.
    fn evict(&mut self, conn_id: u64, why: Evicted) {
        if let Some(told) = self.forget(conn_id) {
            let _ = told.why.set(why);
            told.token.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, n])
    }

    fn evicted(place: &PendingPlace) -> Option<Evicted> {
        place.evicted().now_or_never()
    }

    /// At most `total_max` evicted connections close outside the connection limit at once;
    /// one that closed gives its place among them back.
    #[test]
    fn closing_places_are_bounded_and_given_back() {
        let admission = Arc::new(Admission::new(8, 2));
        let places: Vec<_> = (1..=3)
            .map(|id| admission.admit(id, ip(id as u8)))
            .collect();
        let mut closing: Vec<_> = places.into_iter().map(PendingPlace::into_closing).collect();
        assert!(closing[0].is_some() && closing[1].is_some());
        assert!(closing[2].is_none(), "a third over a bound of two");
        let refused_again = admission.admit(4, ip(4)).into_closing();
        assert!(
            refused_again.is_none(),
            "a refusal gave back a place it never took"
        );
        assert_eq!(admission.closing.load(Ordering::Acquire), 2);
        closing[0] = None;
        let again = admission.admit(5, ip(5)).into_closing();
        assert!(again.is_some(), "the place given back is taken again");
        drop((closing, again));
        assert_eq!(
            admission.closing.load(Ordering::Acquire),
            0,
            "all given back"
        );
    }

    #[test]
    fn an_address_over_its_bound_loses_its_oldest_pending_connection() {
        let admission = Arc::new(Admission::new(2, 10));
        let a1 = admission.admit(1, ip(1));
        let b = admission.admit(2, ip(2));
        let a2 = admission.admit(3, ip(1));
        assert_eq!(
            (evicted(&a1), evicted(&a2), evicted(&b)),
            (None, None, None)
        );
        let a3 = admission.admit(4, ip(1));
        assert_eq!(evicted(&a1), Some(Evicted::Address));
        assert_eq!(
            (evicted(&a2), evicted(&a3), evicted(&b)),
            (None, None, None)
        );
        assert_eq!(admission.pending_count(), 3);
        drop(a1); // already forgotten: dropping it frees nothing more
        assert_eq!(admission.pending_count(), 3);
    }

    #[test]
    fn an_ipv6_peer_counts_by_its_64_network_and_a_mapped_ipv4_as_itself() {
        let admission = Arc::new(Admission::new(1, 10));
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let same_network: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other_network: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        let first = admission.admit(1, one);
        let _other = admission.admit(2, other_network);
        assert_eq!(evicted(&first), None);
        let _second = admission.admit(3, same_network);
        assert_eq!(evicted(&first), Some(Evicted::Address));
        let v4 = admission.admit(4, ip(1));
        let _mapped = admission.admit(5, "::ffff:127.0.0.1".parse().unwrap());
        assert_eq!(evicted(&v4), Some(Evicted::Address));
    }

    #[test]
    fn the_server_over_its_bound_loses_its_oldest_pending_connection() {
        let admission = Arc::new(Admission::new(5, 3));
        let places: Vec<_> = (1..=3)
            .map(|n| admission.admit(u64::from(n), ip(n)))
            .collect();
        let fourth = admission.admit(4, ip(4));
        assert_eq!(evicted(&places[0]), Some(Evicted::Total));
        assert!(places[1..].iter().all(|p| evicted(p).is_none()));
        assert_eq!(evicted(&fourth), None);
        assert_eq!(admission.pending_count(), 3);
    }

    #[test]
    fn a_place_given_back_makes_room_and_leaves_nothing_behind() {
        let admission = Arc::new(Admission::new(1, 1));
        let first = admission.admit(1, ip(1));
        drop(first);
        let second = admission.admit(2, ip(1));
        assert_eq!(evicted(&second), None);
        drop(second);
        let state = admission.state.lock().unwrap();
        assert!(state.pending.is_empty() && state.by_address.is_empty());
    }
}
