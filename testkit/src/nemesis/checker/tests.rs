//! Hand-made histories: a consistent one passes, and each rule, broken, is caught.

use std::time::{Duration, Instant};

use tenure::{LeaseId, LeaseKind};

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
        self.grant_kind(client, span_ms, token, lease, LeaseKind::Exclusive);
    }

    /// A grant of a lease of `lease_kind`: a read lease, permits, or the key alone.
    fn grant_kind(
        &mut self,
        client: usize,
        span_ms: (u64, u64),
        token: u64,
        lease: u8,
        lease_kind: LeaseKind,
    ) {
        let kind = Kind::Acquire {
            ttl_ms: TTL_MS,
            wait_ms: 0,
            lease_kind,
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

    /// A CHECK of `token`, answered CURRENT (`current`) or STALE.
    fn check(&mut self, span_ms: (u64, u64), token: u64, current: bool) {
        let outcome = if current {
            Outcome::Current
        } else {
            Outcome::Stale
        };
        self.op(9, span_ms, Kind::Check { token }, outcome);
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
        lease_kind: LeaseKind::Exclusive,
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
        lease_kind: LeaseKind::Exclusive,
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
    // LOCKED names a granted token even with no holder (PROTOCOL.md 3.2): token 0 is none.
    let wait = Kind::Acquire {
        ttl_ms: TTL_MS,
        wait_ms: 500,
        lease_kind: LeaseKind::Exclusive,
    };
    s.op(4, (6000, 6600), wait, Outcome::Locked { token: 0 });
    let found = orphans(&s.ops);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found.iter().any(|o| o.contains("token 0")), "{found:?}");
}

/// One permit of a semaphore of 3, and `count` of them.
const PERMIT: LeaseKind = LeaseKind::Permits { count: 1, limit: 3 };
const fn permits(count: u32) -> LeaseKind {
    LeaseKind::Permits { count, limit: 3 }
}

/// Semaphore permits up to the limit, readers together, then a writer alone once the readers
/// are gone, with the CHECKs and INSPECTs that fit: all consistent.
fn consistent_kinds() -> Script {
    let mut s = Script::new();
    // A semaphore of 3: 1 + 2 permits at once, then 1 more once the 2 are released.
    s.grant_kind(1, (0, 10), 5, 1, PERMIT);
    s.grant_kind(2, (100, 110), 6, 2, permits(2));
    s.inspect((200, 205), Outcome::Held { token: 6 }); // the newest holder
    s.check((210, 215), 5, true);
    s.release(2, (300, 310), 2);
    s.grant_kind(3, (400, 410), 7, 3, PERMIT);
    s.check((420, 425), 6, false);
    s.check((430, 435), 5, true); // a later permit grant leaves it current
    for op in &mut s.ops {
        op.key = "sem".into();
    }
    // A read/write key: two readers at once, a writer once both ended.
    s.grant_kind(4, (0, 10), 8, 4, LeaseKind::Shared);
    s.grant_kind(5, (50, 60), 9, 5, LeaseKind::Shared);
    s.inspect((100, 105), Outcome::Held { token: 9 });
    s.check((110, 115), 8, true);
    s.release(4, (200, 210), 4);
    s.release(5, (220, 230), 5);
    s.grant(6, (300, 310), 10, 6);
    s.check((320, 325), 8, false);
    s.check((330, 335), 10, true);
    s
}

#[test]
fn a_consistent_history_of_permits_and_read_leases_passes() {
    assert_eq!(consistent_kinds().rules(), Vec::<Rule>::new());
}

/// `count` single permits from clients 1.., granted 100 ms apart, none released.
fn grant_single_permits(s: &mut Script, count: u8) {
    for n in 0..count {
        let at = u64::from(n) * 100;
        s.grant_kind(
            1 + usize::from(n),
            (at, at + 10),
            5 + u64::from(n),
            n + 1,
            PERMIT,
        );
    }
}

#[test]
fn more_permits_than_the_limit_inside_their_deadlines_are_caught() {
    // 2 + 2 permits of 3 at once; two permit leases sharing the key is no overlap.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, permits(2));
    s.grant_kind(2, (100, 110), 6, 2, permits(2));
    assert_eq!(s.rules(), vec![Rule::Permits]);
    // Four single permits of 3, all inside their deadlines at 300 ms.
    let mut s = Script::new();
    grant_single_permits(&mut s, 4);
    assert_eq!(s.rules(), vec![Rule::Permits]);
    // The fourth once a release was sent: fine.
    let mut s = Script::new();
    grant_single_permits(&mut s, 3);
    s.release(1, (250, 260), 1);
    s.grant_kind(4, (300, 310), 8, 4, PERMIT);
    assert_eq!(s.rules(), Vec::<Rule>::new());
}

#[test]
fn a_writer_beside_another_holder_is_caught() {
    // A writer granted while a reader is inside its deadline.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    s.grant(2, (500, 510), 6, 2);
    assert!(s.rules().contains(&Rule::Overlap), "{:?}", s.rules());
    // A reader granted while a writer is inside its deadline.
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.grant_kind(2, (500, 510), 6, 2, LeaseKind::Shared);
    assert!(s.rules().contains(&Rule::Overlap), "{:?}", s.rules());
    // Two writers of a read/write key.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 4, 3, LeaseKind::Shared);
    s.release(1, (20, 30), 3);
    s.grant(2, (100, 110), 5, 1);
    s.grant(3, (500, 510), 6, 2);
    assert!(s.rules().contains(&Rule::Overlap), "{:?}", s.rules());
    // A reader beside permits: the two families never share a key.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, PERMIT);
    s.grant_kind(2, (500, 510), 6, 2, LeaseKind::Shared);
    assert!(s.rules().contains(&Rule::Overlap), "{:?}", s.rules());
    // Readers together, and a writer after the readers' deadlines: fine.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    s.grant_kind(2, (500, 510), 6, 2, LeaseKind::Shared);
    s.grant(3, (1600, 1610), 7, 3);
    assert_eq!(s.rules(), Vec::<Rule>::new());
}

#[test]
fn tokens_must_increase_across_grants_of_every_kind() {
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    // After 5 was answered; and a grant naming a token below a live reader's is a lost
    // grant of that reader.
    s.grant_kind(2, (100, 110), 4, 2, LeaseKind::Shared);
    assert_eq!(s.rules(), vec![Rule::Tokens, Rule::LostGrant]);
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, PERMIT);
    s.grant_kind(2, (100, 110), 5, 2, PERMIT); // 5 again
    assert_eq!(s.rules(), vec![Rule::Tokens]);
    // A write after a read with a smaller token.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    s.release(1, (100, 110), 1);
    s.grant(2, (200, 210), 3, 2);
    assert_eq!(s.rules(), vec![Rule::Tokens]);
}

#[test]
fn a_shared_lease_must_be_seen_held_by_a_token_at_least_its_own() {
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    s.grant_kind(2, (100, 110), 7, 2, LeaseKind::Shared);
    s.inspect((200, 205), Outcome::Held { token: 7 }); // the newest reader: fine
    assert_eq!(s.rules(), Vec::<Rule>::new());
    s.inspect((300, 305), Outcome::Held { token: 4 }); // older than a live reader
    assert_eq!(s.rules(), vec![Rule::LostGrant]);
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, PERMIT);
    s.inspect((200, 205), Outcome::Free);
    assert_eq!(s.rules(), vec![Rule::LostGrant]);
}

#[test]
fn check_answers_that_contradict_the_grants_are_caught() {
    // STALE for a reader inside its deadline.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    s.check((500, 505), 5, false);
    assert_eq!(s.rules(), vec![Rule::LostGrant]);
    // CURRENT for a reader after a writer was granted (past the reader's deadline).
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    s.grant(2, (1500, 1510), 7, 2);
    s.check((1600, 1605), 5, true);
    assert_eq!(s.rules(), vec![Rule::CurrentAfterEnd]);
    // CURRENT for a writer after a reader was granted.
    let mut s = Script::new();
    s.grant(1, (0, 10), 5, 1);
    s.grant_kind(2, (1500, 1510), 7, 2, LeaseKind::Shared);
    s.check((1600, 1605), 5, true);
    assert_eq!(s.rules(), vec![Rule::CurrentAfterEnd]);
    // CURRENT for a released reader.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    s.release(1, (100, 110), 1);
    s.check((200, 205), 5, true);
    assert_eq!(s.rules(), vec![Rule::ReleasedCameBack]);
    // CURRENT past the deadline with no write since, or sent before the write's answer: fine.
    let mut s = Script::new();
    s.grant_kind(1, (0, 10), 5, 1, LeaseKind::Shared);
    s.check((1200, 1205), 5, true);
    s.grant(2, (1500, 1510), 7, 2);
    s.check((1505, 1515), 5, true);
    assert_eq!(s.rules(), Vec::<Rule>::new());
}
