//! Hand-made histories: a consistent one passes, and each rule, broken, is caught.

use std::time::{Duration, Instant};

use tenure::LeaseId;

use super::{check, orphans, Rule};
use crate::nemesis::history::{Kind, Op, Outcome};

const TTL_MS: u32 = 1000;

/// Builds operations at millisecond offsets from one instant.
struct Script {
    t0: Instant,
    ops: Vec<Op>,
}

impl Script {
    fn new() -> Script {
        Script {
            t0: Instant::now(),
            ops: Vec::new(),
        }
    }

    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn op(&mut self, client: usize, span_ms: (u64, u64), kind: Kind, outcome: Outcome) {
        self.ops.push(Op {
            client,
            key: "k".into(),
            kind,
            sent: self.at(span_ms.0),
            answered: self.at(span_ms.1),
            outcome,
        });
    }

    fn grant(&mut self, client: usize, span_ms: (u64, u64), token: u64, lease: u8) {
        let kind = Kind::Acquire {
            ttl_ms: TTL_MS,
            wait_ms: 0,
        };
        let outcome = Outcome::Granted {
            token,
            lease: id(lease),
            ttl_ms: TTL_MS,
            waited_ms: 0,
        };
        self.op(client, span_ms, kind, outcome);
    }

    fn release(&mut self, client: usize, span_ms: (u64, u64), lease: u8) {
        let kind = Kind::Release { lease: id(lease) };
        self.op(client, span_ms, kind, Outcome::Released);
    }

    fn inspect(&mut self, span_ms: (u64, u64), outcome: Outcome) {
        self.op(9, span_ms, Kind::Inspect, outcome);
    }

    fn rules(&self) -> Vec<Rule> {
        let mut rules: Vec<Rule> = check(&self.ops).into_iter().map(|v| v.rule).collect();
        rules.sort();
        rules.dedup();
        rules
    }
}

fn id(n: u8) -> LeaseId {
    LeaseId([n; 16])
}

/// Two leases one after the other, with a renewal, reads and a release: all consistent.
fn consistent() -> Script {
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.op(
        1,
        (500, 510),
        Kind::Renew {
            lease: id(1),
            ttl_ms: TTL_MS,
        },
        Outcome::Renewed { ttl_ms: TTL_MS },
    );
    s.inspect((900, 905), Outcome::Held { token: 5 });
    s.release(1, (1200, 1210), 1);
    s.inspect((1300, 1305), Outcome::Free);
    s.grant(2, (1400, 1410), 7, 2);
    s
}

#[test]
fn a_consistent_history_passes() {
    assert_eq!(consistent().rules(), Vec::<Rule>::new());
}

#[test]
fn a_token_that_goes_backwards_or_repeats_is_caught() {
    let mut s = consistent();
    s.grant(3, (3000, 3010), 6, 3); // after token 7 was answered
    assert_eq!(s.rules(), vec![Rule::Tokens]);
    let mut s = consistent();
    s.grant(3, (3000, 3010), 7, 3); // token 7 again
    assert_eq!(s.rules(), vec![Rule::Tokens]);
}

#[test]
fn two_leases_inside_their_deadlines_at_once_are_caught() {
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.grant(2, (500, 510), 7, 2); // lease 1 runs to 1000 ms
    assert!(s.rules().contains(&Rule::Overlap), "{:?}", s.rules());
    // The same second grant after lease 1's local deadline passed is fine.
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.grant(2, (1500, 1510), 7, 2);
    assert_eq!(s.rules(), Vec::<Rule>::new());
}

#[test]
fn a_renewal_extends_the_deadline_the_overlap_rule_counts() {
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    let renew = Kind::Renew {
        lease: id(1),
        ttl_ms: TTL_MS,
    };
    s.op(1, (800, 810), renew, Outcome::Renewed { ttl_ms: TTL_MS });
    s.grant(2, (1500, 1510), 7, 2); // lease 1 runs to 1800 ms now
    assert!(s.rules().contains(&Rule::Overlap), "{:?}", s.rules());
}

#[test]
fn a_grant_not_seen_held_within_its_deadline_is_caught() {
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.inspect((500, 505), Outcome::Free);
    assert_eq!(s.rules(), vec![Rule::LostGrant]);
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    let renew = Kind::Renew {
        lease: id(1),
        ttl_ms: TTL_MS,
    };
    s.op(1, (500, 505), renew, Outcome::Lost);
    assert_eq!(s.rules(), vec![Rule::LostGrant]);
    // Once a release was sent, or past the deadline, FREE is fine.
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.op(
        1,
        (400, 600),
        Kind::Release { lease: id(1) },
        Outcome::Unknown("lost".into()),
    );
    s.inspect((500, 505), Outcome::Free);
    s.inspect((1500, 1505), Outcome::Free);
    assert_eq!(s.rules(), Vec::<Rule>::new());
}

#[test]
fn a_released_lease_seen_again_is_caught() {
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.release(1, (100, 110), 1);
    s.inspect((200, 205), Outcome::Held { token: 5 });
    assert_eq!(s.rules(), vec![Rule::ReleasedCameBack]);
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.release(1, (100, 110), 1);
    let renew = Kind::Renew {
        lease: id(1),
        ttl_ms: TTL_MS,
    };
    s.op(1, (200, 205), renew, Outcome::Renewed { ttl_ms: TTL_MS });
    assert_eq!(s.rules(), vec![Rule::ReleasedCameBack]);
}

#[test]
fn a_renewal_to_a_shorter_ttl_ends_the_deadline_sooner() {
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1); // runs to 1000 ms
    let renew = Kind::Renew {
        lease: id(1),
        ttl_ms: 100,
    };
    s.op(1, (100, 110), renew, Outcome::Renewed { ttl_ms: 100 }); // now to 200 ms
    s.inspect((300, 305), Outcome::Free);
    s.grant(2, (400, 410), 7, 2);
    assert_eq!(s.rules(), Vec::<Rule>::new());
    // Inside the shortened deadline, FREE is still a lost grant.
    s.inspect((150, 155), Outcome::Free);
    assert_eq!(s.rules(), vec![Rule::LostGrant]);
}

/// Seed 11's shape: a blocking ACQUIRE sent while the holder's deadline was far ahead, the
/// holder then renewing to a shorter TTL, and the key handed on once that ran out. No two
/// local deadlines overlap; the waiter's grant is not a lost grant of the first lease.
#[test]
fn a_shorter_renewal_sent_while_a_read_waits_is_counted() {
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1); // runs to 998 ms
    let wait = Kind::Acquire {
        ttl_ms: TTL_MS,
        wait_ms: 2000,
    };
    let renew = Kind::Renew {
        lease: id(1),
        ttl_ms: 100,
    };
    s.op(1, (200, 210), renew, Outcome::Renewed { ttl_ms: 100 }); // now to 298 ms
    let granted = Outcome::Granted {
        token: 7,
        lease: id(2),
        ttl_ms: TTL_MS,
        waited_ms: 150,
    };
    s.op(2, (150, 305), wait, granted); // handed on at >= 300 ms
    assert_eq!(s.rules(), Vec::<Rule>::new());
    // Answered inside the shortened deadline, the hand-off would still be a lost grant.
    let early = Outcome::Granted {
        token: 8,
        lease: id(3),
        ttl_ms: TTL_MS,
        waited_ms: 100,
    };
    s.op(3, (160, 265), wait, early);
    assert!(s.rules().contains(&Rule::LostGrant));
}

#[test]
fn a_holder_token_no_client_was_granted_is_an_orphan() {
    let mut s = consistent();
    assert!(
        orphans(&s.ops).is_empty(),
        "every token seen held was granted"
    );
    // A grant whose answer was lost: the key is seen held by a token nobody was told.
    let kind = Kind::Acquire {
        ttl_ms: TTL_MS,
        wait_ms: 0,
    };
    s.op(
        3,
        (5000, 5010),
        kind,
        Outcome::Unknown("connection lost".into()),
    );
    s.inspect((5020, 5030), Outcome::Held { token: 99 });
    let found = orphans(&s.ops);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("token 99"), "{found:?}");
}
