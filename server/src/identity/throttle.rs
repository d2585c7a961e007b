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
//!
//! Each AUTH of a spaced bucket is given its turn when it arrives (turns are handed out in
//! arrival order, one gap apart), and one whose turn would come more than
//! [`SPACED_WAIT_MAX`] later is refused at once instead of queueing ([`Start::Full`]): the
//! wait of every AUTH stays bounded, far under the handshake limit, however many guessers
//! share its bucket, and the guessers still get one verification per gap between them.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Gap after the first failure; it doubles with each further one.
const SPACING_BASE: Duration = Duration::from_millis(100);
/// Largest gap between two verifications of one bucket.
const SPACING_MAX: Duration = Duration::from_secs(2);
/// Longest an AUTH of a spaced bucket waits for its turn; past it the AUTH is refused at
/// once. Room for the turn after a verification running now and one more.
pub const SPACED_WAIT_MAX: Duration = Duration::from_secs(3);
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

const _: () = assert!(
    SPACED_WAIT_MAX.as_millis() >= SPACING_MAX.as_millis(),
    "an AUTH must always be able to take the turn after the current one"
);

/// When an AUTH of a bucket may be verified ([`Throttle::try_start`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Start {
    /// Now.
    Now,
    /// After this wait: its turn is kept for it.
    After(Duration),
    /// Not at all: its turn would be more than [`SPACED_WAIT_MAX`] away.
    Full,
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
    /// Asks to start a verification of `bucket` at `now`: at once for a bucket without
    /// recent failures (recording nothing); otherwise the bucket's next turn, the one after
    /// it set one gap later (from the failures known now), or [`Start::Full`] when that
    /// turn is more than [`SPACED_WAIT_MAX`] away (and nothing is taken).
    pub fn try_start(&mut self, bucket: &Bucket, now: Instant) -> Start {
        let Some(p) = self.peers.get_mut(bucket) else {
            return Start::Now;
        };
        if now.saturating_duration_since(p.last_failure) > FORGET_AFTER {
            self.peers.remove(bucket);
            return Start::Now;
        }
        let turn = p.next_at.max(now);
        let wait = turn - now;
        if wait > SPACED_WAIT_MAX {
            return Start::Full;
        }
        p.next_at = turn + spacing(p.failures);
        if wait.is_zero() {
            Start::Now
        } else {
            Start::After(wait)
        }
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

    fn after(ms: u64) -> Start {
        Start::After(Duration::from_millis(ms))
    }

    #[test]
    fn a_peer_without_failures_waits_for_nothing() {
        let mut t = Throttle::default();
        let now = Instant::now();
        t.failed(ip(1), now);
        assert_eq!(t.try_start(&ip(2), now), Start::Now);
    }

    #[test]
    fn a_failing_peer_s_verifications_take_turns_one_gap_apart() {
        let mut t = Throttle::default();
        let now = Instant::now();
        t.failed(ip(1), now);
        // Many AUTHs at once from that peer: one starts, the next ones get turns a gap
        // apart, in the order they came.
        let starts: Vec<_> = (0..3).map(|_| t.try_start(&ip(1), now)).collect();
        assert_eq!(starts, [Start::Now, after(100), after(200)]);
        let later = now + Duration::from_millis(300);
        assert_eq!(t.try_start(&ip(1), later), Start::Now);
        // Its gap is the one the failures known when it started give.
        t.failed(ip(1), later);
        assert_eq!(
            t.try_start(&ip(1), later),
            after(100),
            "set when it started"
        );
        assert_eq!(t.try_start(&ip(1), later), after(300));
        for _ in 0..10 {
            t.failed(ip(1), later);
        }
        let next = later + Duration::from_millis(500);
        assert_eq!(t.try_start(&ip(1), next), Start::Now);
        assert_eq!(t.try_start(&ip(1), next), Start::After(SPACING_MAX));
    }

    /// However many AUTHs share a bucket, none waits longer than `SPACED_WAIT_MAX`: the
    /// ones past it are refused at once, and take no turn.
    #[test]
    fn turns_past_the_wait_bound_are_refused_at_once() {
        let mut t = Throttle::default();
        let now = Instant::now();
        for _ in 0..10 {
            t.failed(ip(1), now);
        }
        let starts: Vec<_> = (0..20).map(|_| t.try_start(&ip(1), now)).collect();
        let waits = |s: &Start| match s {
            Start::Now => Some(Duration::ZERO),
            Start::After(wait) => Some(*wait),
            Start::Full => None,
        };
        let taken: Vec<Duration> = starts.iter().filter_map(waits).collect();
        assert_eq!(taken, [Duration::ZERO, SPACING_MAX], "{starts:?}");
        assert!(taken.iter().all(|wait| *wait <= SPACED_WAIT_MAX));
        // Once the turns have passed, the next AUTH gets one again.
        let later = now + SPACING_MAX * 2;
        assert_eq!(t.try_start(&ip(1), later), Start::Now);
        assert_eq!(t.try_start(&ip(1), later), Start::After(SPACING_MAX));
    }

    #[test]
    fn a_quiet_peer_is_forgotten_and_memory_is_bounded() {
        let mut t = Throttle::default();
        let start = Instant::now();
        t.failed(ip(1), start);
        let later = start + FORGET_AFTER + Duration::from_secs(1);
        assert_eq!(t.try_start(&ip(1), later), Start::Now);
        assert_eq!(t.len(), 0);
        for n in 0..(BUCKETS_MAX as u32 + 10) {
            t.failed(ip(n), start + Duration::from_millis(u64::from(n)));
        }
        assert_eq!(t.len(), BUCKETS_MAX);
        // The oldest went first.
        assert_eq!(t.try_start(&ip(0), start), Start::Now);
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
        assert_eq!(t.try_start(&guessed, now), Start::Now);
        assert_ne!(
            t.try_start(&guessed, now),
            Start::Now,
            "the guessed name is spaced"
        );
        assert_eq!(t.try_start(&neighbour, now), Start::Now);
        assert_eq!(
            t.try_start(&neighbour, now),
            Start::Now,
            "its neighbour is not"
        );
    }
}
