//! Spacing out the AUTHs of a (peer address, identity name) that recently failed some.
//!
//! A per-connection delay alone does not slow a guesser down: it opens another connection.
//! So failures are also remembered by [`Bucket`], the peer address and the name the AUTH
//! gave, and that bucket's next verifications are spaced out, one after the other, by a gap
//! that doubles with each failure. A guesser is then held to a trickle of guesses per name,
//! and the argon2 work it can make the server do is bounded; buckets without failures are not
//! delayed. The name is part of the key so that a guesser behind a NAT (or on the same host)
//! slows only the AUTHs for the names it guesses, not those of every neighbour at that
//! address. Every name the identities file does not hold shares one bucket per address
//! (the empty name, which no identity has): spraying made-up names neither escapes the
//! spacing nor fills the table.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Gap after the first failure; it doubles with each further one.
const SPACING_BASE: Duration = Duration::from_millis(100);
/// Largest gap between two verifications of one bucket.
const SPACING_MAX: Duration = Duration::from_secs(2);
/// A bucket without a failure for this long is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(60);
/// Most buckets remembered; past it the one whose last failure is oldest is forgotten.
const BUCKETS_MAX: usize = 4096;

/// Whose failures space out whose AUTHs: the peer address, and the identity name the AUTH
/// gave (empty for a name the identities file does not hold).
pub type Bucket = (IpAddr, String);

#[derive(Debug)]
struct Peer {
    failures: u32,
    last_failure: Instant,
    /// When the bucket's next verification may start.
    next_at: Instant,
}

/// Recent failures by bucket.
#[derive(Debug, Default)]
pub struct Throttle {
    peers: HashMap<Bucket, Peer>,
}

fn spacing(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    SPACING_BASE.saturating_mul(1 << doublings).min(SPACING_MAX)
}

impl Throttle {
    /// Asks to start a verification of `bucket` at `now`: zero if it may start now (and then
    /// the bucket's next one may start only one gap later), else how long to wait before
    /// asking again. A bucket without recent failures starts at once, and records nothing.
    /// Starts are granted one at a time, each gap computed from the failures known then, so
    /// a burst of guesses waiting together is spaced by gaps that keep doubling.
    pub fn try_start(&mut self, bucket: &Bucket, now: Instant) -> Duration {
        let Some(p) = self.peers.get_mut(bucket) else {
            return Duration::ZERO;
        };
        if now.saturating_duration_since(p.last_failure) > FORGET_AFTER {
            self.peers.remove(bucket);
            return Duration::ZERO;
        }
        if p.next_at > now {
            return p.next_at - now;
        }
        p.next_at = now + spacing(p.failures);
        Duration::ZERO
    }

    /// Records a failed AUTH from `peer` at `now`.
    pub fn failed(&mut self, peer: Bucket, now: Instant) {
        if self.peers.len() >= BUCKETS_MAX && !self.peers.contains_key(&peer) {
            self.peers
                .retain(|_, p| now.saturating_duration_since(p.last_failure) <= FORGET_AFTER);
            if self.peers.len() >= BUCKETS_MAX {
                let oldest = self
                    .peers
                    .iter()
                    .min_by_key(|(_, p)| p.last_failure)
                    .map(|(bucket, _)| bucket.clone());
                if let Some(ip) = oldest {
                    self.peers.remove(&ip);
                }
            }
        }
        let p = self.peers.entry(peer).or_insert(Peer {
            failures: 0,
            last_failure: now,
            next_at: now,
        });
        p.failures = p.failures.saturating_add(1);
        p.last_failure = now;
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u32) -> Bucket {
        (IpAddr::from(n.to_be_bytes()), "orders".to_string())
    }

    #[test]
    fn a_peer_without_failures_waits_for_nothing() {
        let mut t = Throttle::default();
        let now = Instant::now();
        t.failed(ip(1), now);
        assert_eq!(t.try_start(&ip(2), now), Duration::ZERO);
    }

    #[test]
    fn a_failing_peer_s_verifications_are_spaced_one_after_another() {
        let mut t = Throttle::default();
        let now = Instant::now();
        t.failed(ip(1), now);
        // Many AUTHs at once from that peer: one starts, the others wait one gap.
        let waits: Vec<_> = (0..3).map(|_| t.try_start(&ip(1), now)).collect();
        assert_eq!(waits, [0, 100, 100].map(Duration::from_millis));
        let later = now + Duration::from_millis(100);
        assert!(t.try_start(&ip(1), later).is_zero());
        // Its gap is the one the failures known when it started give.
        t.failed(ip(1), later);
        let gap = t.try_start(&ip(1), later);
        assert_eq!(gap, Duration::from_millis(100), "set when it started");
        let after = later + gap;
        assert!(t.try_start(&ip(1), after).is_zero());
        assert_eq!(t.try_start(&ip(1), after), Duration::from_millis(200));
        for _ in 0..10 {
            t.failed(ip(1), after);
        }
        let next = after + Duration::from_millis(200);
        assert!(t.try_start(&ip(1), next).is_zero());
        assert_eq!(t.try_start(&ip(1), next), SPACING_MAX);
    }

    #[test]
    fn a_quiet_peer_is_forgotten_and_memory_is_bounded() {
        let mut t = Throttle::default();
        let start = Instant::now();
        t.failed(ip(1), start);
        let later = start + FORGET_AFTER + Duration::from_secs(1);
        assert_eq!(t.try_start(&ip(1), later), Duration::ZERO);
        assert_eq!(t.len(), 0);
        for n in 0..(BUCKETS_MAX as u32 + 10) {
            t.failed(ip(n), start + Duration::from_millis(u64::from(n)));
        }
        assert_eq!(t.len(), BUCKETS_MAX);
        // The oldest went first.
        assert_eq!(t.try_start(&ip(0), start), Duration::ZERO);
    }

    #[test]
    fn another_name_at_the_same_address_is_not_spaced() {
        let mut t = Throttle::default();
        let now = Instant::now();
        let guessed = ip(1);
        let neighbour = (guessed.0, "admin".to_string());
        for _ in 0..10 {
            t.failed(guessed.clone(), now);
        }
        assert!(t.try_start(&guessed, now).is_zero());
        assert!(
            !t.try_start(&guessed, now).is_zero(),
            "the guessed name is spaced"
        );
        assert!(t.try_start(&neighbour, now).is_zero());
        assert!(
            t.try_start(&neighbour, now).is_zero(),
            "its neighbour is not"
        );
    }
}
