//! The checker: the invariants of CLUSTER.md's first section, proved (or refuted) from the
//! client-side history alone.
//!
//! A lease's *local deadline* is what its holder may count on (PROTOCOL.md 3.3): from the
//! answer of its grant to `sent + waited + ttl`, and from the answer of each acknowledged
//! renewal to that renewal's `sent + ttl` (which may be sooner: a RENEW sets the TTL, it
//! may shorten it), less the clock margin, and it ends at the send of its release. Rules:
//! - **tokens**: per key, acknowledged grants have distinct tokens, and a grant answered
//!   before another was sent has the smaller token;
//! - **overlap** ("writer alone"): the local deadlines of two different leases on one key
//!   never overlap, unless both are read leases or both permit leases of a semaphore
//!   (PROTOCOL.md 3.10): a lock or write lease is alone inside its deadline;
//! - **permits** ("at most N holders"): at every instant, the permits of the permit leases
//!   inside their local deadlines on a semaphore key sum to at most its limit;
//! - **lost grant**: a read (INSPECT, a LOCKED answer, a RENEW or CHECK of the lease
//!   itself) answered while a lease's local deadline was still ahead, sent after that
//!   deadline was known and before any release of it was sent, shows that lease, unless a
//!   RENEW of it sent before the read's answer shortened the deadline to before that answer;
//!   for a lock or write lease "shows" is its token, for a read or permit lease a token at
//!   least its own (INSPECT and LOCKED name the newest holder), and a CHECK of its token
//!   shows it if CURRENT;
//! - **released came back**: nothing sent after a release's answer shows the released lease;
//! - **current after its end**: CHECK never answers CURRENT for a token once a grant it
//!   excludes (a write after a read, anything after a write) was answered before the CHECK
//!   was sent: that grant was made only once the token's lease had ended.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use tenure::{LeaseId, LeaseKind};

use super::history::{Kind, Op, Outcome};

/// The client's clock margin: the server's 2 ms resolution (PROTOCOL.md 3.3).
const MARGIN_MIN: Duration = Duration::from_millis(2);
/// The cluster margin's share of the TTL, for clock-rate drift (CLUSTER.md): ttl / 1000.
const MARGIN_TTL_DIVISOR: u32 = 1000;

/// Which invariant an operation broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// Fencing tokens repeated or went backwards on a key.
    Tokens,
    /// Two leases that exclude each other (a lock or write lease and any other, a read lease
    /// and permits) were inside their local deadlines at once on one key.
    Overlap,
    /// More permits than a semaphore's limit were inside their local deadlines at once.
    Permits,
    /// A lease within its local deadline, not released, was not seen held.
    LostGrant,
    /// A lease whose release was acknowledged was seen again.
    ReleasedCameBack,
    /// CHECK answered CURRENT for a token after a grant its lease excludes was answered.
    CurrentAfterEnd,
    /// The cluster did not serve again within the bound after a fault.
    Unavailable,
}

/// One broken invariant, with the evidence.
#[derive(Clone, Debug)]
pub struct Violation {
    /// The rule broken.
    pub rule: Rule,
    /// The key (empty for [`Rule::Unavailable`]).
    pub key: String,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} on {:?}: {}", self.rule, self.key, self.detail)
    }
}

/// What the history says about one acknowledged lease.
#[derive(Clone, Debug)]
struct Lease {
    key: String,
    client: usize,
    token: u64,
    id: LeaseId,
    /// What it holds: the key alone, a read lease or permits.
    kind: LeaseKind,
    /// When the grant was sent and answered.
    sent: Instant,
    answered: Instant,
    /// The grant's local deadline.
    grant_end: Instant,
    /// Every RENEW of it, in the order sent.
    renewals: Vec<Renewal>,
    /// The earliest send of a RELEASE of it, whatever its outcome.
    release_sent: Option<Instant>,
    /// The earliest answer of a RELEASE of it answered RELEASED.
    release_acked: Option<Instant>,
}

/// One RENEW of a lease, whatever its outcome.
#[derive(Clone, Copy, Debug)]
struct Renewal {
    sent: Instant,
    answered: Instant,
    /// The TTL asked for.
    ttl_ms: u32,
    /// The TTL confirmed, if RENEWED.
    renewed_ms: Option<u32>,
}

impl Lease {
    /// The intervals in which the holder is inside its local deadline, counting only what
    /// it knew before `known_at` (everything when `None`).
    ///
    /// A RENEW sets the lease to its TTL from when the server handles it, which may be
    /// *shorter* than before: from its send, the holder counts on no more than the earlier
    /// of its deadline so far and `sent + ttl` (the server handled it, or not, after the
    /// send); once RENEWED arrives, on exactly `sent + ttl`.
    fn segments(&self, known_at: Option<Instant>) -> Vec<(Instant, Instant)> {
        let known = |t: Instant| known_at.is_none_or(|k| t < k);
        let mut out = Vec::new();
        if !known(self.answered) {
            return out;
        }
        let (mut start, mut end) = (self.answered, self.grant_end);
        for r in &self.renewals {
            if !known(r.sent) {
                break;
            }
            end = end.min(r.sent + ms(r.ttl_ms) - margin(r.ttl_ms));
            let Some(renewed_ms) = r.renewed_ms.filter(|_| known(r.answered)) else {
                continue;
            };
            let renewed_end = r.sent + ms(renewed_ms) - margin(renewed_ms);
            if end <= r.answered {
                out.push((start, end));
                start = r.answered;
            }
            end = renewed_end;
        }
        out.push((start, end));
        out.retain(|(s, e)| e > s);
        out
    }

    /// The local deadline as known to a request sent at `at`.
    fn deadline_known_at(&self, at: Instant) -> Option<Instant> {
        self.segments(Some(at)).last().map(|&(_, end)| end)
    }

    /// The segments of local deadline, each ended at the send of a release.
    fn inside(&self) -> Vec<(Instant, Instant)> {
        let mut segments = self.segments(None);
        for (start, end) in &mut segments {
            *end = self.release_sent.map_or(*end, |r| (*end).min(r));
            *start = (*start).min(*end);
        }
        segments.retain(|(s, e)| e > s);
        segments
    }
}

fn margin(ttl_ms: u32) -> Duration {
    MARGIN_MIN.max(Duration::from_millis(u64::from(
        ttl_ms / MARGIN_TTL_DIVISOR,
    )))
}

fn ms(n: u32) -> Duration {
    Duration::from_millis(u64::from(n))
}

/// Every acknowledged lease of the history, by lease id.
fn leases(ops: &[Op]) -> HashMap<LeaseId, Lease> {
    let mut leases = HashMap::new();
    for op in ops {
        if let Outcome::Granted {
            token,
            lease,
            ttl_ms,
            waited_ms,
        } = op.outcome
        {
            let grant_end = op.sent + ms(waited_ms) + ms(ttl_ms) - margin(ttl_ms);
            let kind = match op.kind {
                Kind::Acquire { lease_kind, .. } => lease_kind,
                _ => LeaseKind::Exclusive,
            };
            leases.insert(
                lease,
                Lease {
                    key: op.key.clone(),
                    client: op.client,
                    token,
                    id: lease,
                    kind,
                    sent: op.sent,
                    answered: op.answered,
                    grant_end,
                    renewals: Vec::new(),
                    release_sent: None,
                    release_acked: None,
                },
            );
        }
    }
    for op in ops {
        match (op.kind, &op.outcome) {
            (Kind::Renew { lease, ttl_ms }, outcome) => {
                if let Some(l) = leases.get_mut(&lease) {
                    let renewed_ms = match outcome {
                        Outcome::Renewed { ttl_ms } => Some(*ttl_ms),
                        _ => None,
                    };
                    l.renewals.push(Renewal {
                        sent: op.sent,
                        answered: op.answered,
                        ttl_ms,
                        renewed_ms,
                    });
                }
            }
            (Kind::Release { lease }, outcome) => {
                if let Some(l) = leases.get_mut(&lease) {
                    l.release_sent = Some(l.release_sent.map_or(op.sent, |r| r.min(op.sent)));
                    if *outcome == Outcome::Released {
                        let acked = l.release_acked.map_or(op.answered, |r| r.min(op.answered));
                        l.release_acked = Some(acked);
                    }
                }
            }
            _ => {}
        }
    }
    for lease in leases.values_mut() {
        lease.renewals.sort_by_key(|r| r.sent);
    }
    leases
}

/// Every violation the history shows; empty when it is consistent.
pub fn check(ops: &[Op]) -> Vec<Violation> {
    let leases = leases(ops);
    let mut by_key: HashMap<&str, Vec<&Lease>> = HashMap::new();
    for lease in leases.values() {
        by_key.entry(lease.key.as_str()).or_default().push(lease);
    }
    let mut violations = Vec::new();
    for (key, list) in &mut by_key {
        list.sort_by_key(|l| l.answered);
        check_tokens(key, list, &mut violations);
        check_overlap(key, list, &mut violations);
    }
    let mut reads_by_key: HashMap<&str, Vec<&Op>> = HashMap::new();
    for op in ops {
        reads_by_key.entry(op.key.as_str()).or_default().push(op);
    }
    for (key, list) in &by_key {
        for op in reads_by_key.get(*key).into_iter().flatten() {
            check_current(list, op, &mut violations);
        }
    }
    for lease in leases.values() {
        for op in reads_by_key.get(lease.key.as_str()).into_iter().flatten() {
            check_read(lease, op, &mut violations);
        }
    }
    violations
}

/// Orphaned grants: a token the history shows holding a key (an INSPECT's HELD, an ACQUIRE's
/// LOCKED) that no ACQUIRE of the history was answered GRANTED with, so no client knew its
/// lease id: a grant whose answer was lost, holding the key for its TTL. The harness's probes
/// use keys nobody reads, so this counts the load's. One line per (key, token).
///
/// A LOCKED always names a token the key was granted under, even when no lease held it as
/// the waiter's time ran out (PROTOCOL.md 3.2): one naming token 0 (no grant's, they start
/// at 1) is an orphan too.
pub fn orphans(ops: &[Op]) -> Vec<String> {
    use std::collections::BTreeSet;
    let granted: BTreeSet<(&str, u64)> = ops
        .iter()
        .filter_map(|op| match op.outcome {
            Outcome::Granted { token, .. } => Some((op.key.as_str(), token)),
            _ => None,
        })
        .collect();
    let seen: BTreeSet<(&str, u64)> = ops
        .iter()
        .filter_map(|op| match op.outcome {
            Outcome::Held { token } | Outcome::Locked { token } => Some((op.key.as_str(), token)),
            _ => None,
        })
        .collect();
    seen.difference(&granted)
        .map(|(key, token)| format!("{key:?} held by token {token}, granted to no client"))
        .collect()
}

/// Tokens: distinct per key, and ordered by real time (`list` sorted by answer).
fn check_tokens(key: &str, list: &[&Lease], violations: &mut Vec<Violation>) {
    let mut seen: HashMap<u64, LeaseId> = HashMap::new();
    for l in list {
        if seen
            .insert(l.token, l.id)
            .is_some_and(|other| other != l.id)
        {
            violations.push(Violation {
                rule: Rule::Tokens,
                key: key.to_owned(),
                detail: format!("token {} granted twice", l.token),
            });
        }
    }
    // The largest token among the grants answered so far, for each prefix of `list`.
    let mut prefix_max: Vec<u64> = Vec::with_capacity(list.len());
    for l in list {
        prefix_max.push(prefix_max.last().copied().unwrap_or(0).max(l.token));
    }
    for l in list {
        let before = list.partition_point(|a| a.answered < l.sent);
        if before > 0 && prefix_max[before - 1] >= l.token {
            violations.push(Violation {
                rule: Rule::Tokens,
                key: key.to_owned(),
                detail: format!(
                    "token {} (client {}) granted after token {} was answered",
                    l.token,
                    l.client,
                    prefix_max[before - 1]
                ),
            });
        }
    }
}

/// Whether two leases of one key may be inside their deadlines at once: two read leases, or
/// two permit leases (whose permits [`check_overlap`] sums against the limit).
fn may_share(a: LeaseKind, b: LeaseKind) -> bool {
    matches!(
        (a, b),
        (LeaseKind::Shared, LeaseKind::Shared)
            | (LeaseKind::Permits { .. }, LeaseKind::Permits { .. })
    )
}

/// The permits a lease holds and the limit of its key (`None`: not a permit lease).
fn permits(kind: LeaseKind) -> Option<(u32, u32)> {
    match kind {
        LeaseKind::Permits { count, limit } => Some((count, limit)),
        _ => None,
    }
}

/// Local deadlines of different leases on one key overlap only where both may share the key,
/// and permit leases inside theirs never hold more than the limit.
fn check_overlap(key: &str, list: &[&Lease], violations: &mut Vec<Violation>) {
    let mut segments: Vec<(Instant, Instant, &Lease)> = list
        .iter()
        .flat_map(|l| l.inside().into_iter().map(move |(s, e)| (s, e, *l)))
        .collect();
    segments.sort_by_key(|&(start, _, _)| start);
    let mut open: Vec<(Instant, Instant, &Lease)> = Vec::new();
    for (start, end, lease) in segments {
        open.retain(|&(_, e, _)| e > start);
        let excluded = open
            .iter()
            .find(|(_, _, o)| o.id != lease.id && !may_share(o.kind, lease.kind));
        if let Some(&(s, e, other)) = excluded {
            violations.push(Violation {
                rule: Rule::Overlap,
                key: key.to_owned(),
                detail: format!(
                    "token {} (client {}) inside its deadline from +{:?} while token {} \
                     (client {}) was, {:?} into {:?}",
                    lease.token,
                    lease.client,
                    start.duration_since(lease.sent),
                    other.token,
                    other.client,
                    start.duration_since(s),
                    e.duration_since(s),
                ),
            });
        }
        check_permits(key, &open, start, lease, violations);
        open.push((start, end, lease));
    }
}

/// The permits rule at `start`, where `lease` enters its deadline beside the `open` ones.
fn check_permits(
    key: &str,
    open: &[(Instant, Instant, &Lease)],
    start: Instant,
    lease: &Lease,
    violations: &mut Vec<Violation>,
) {
    let Some((count, limit)) = permits(lease.kind) else {
        return;
    };
    let others: u32 = open
        .iter()
        .filter(|(_, _, o)| o.id != lease.id)
        .filter_map(|(_, _, o)| permits(o.kind).map(|(c, _)| c))
        .sum();
    if others + count > limit {
        violations.push(Violation {
            rule: Rule::Permits,
            key: key.to_owned(),
            detail: format!(
                "token {} (client {}) inside its deadline with {count} permits from +{:?} \
                 while others held {others}: over the limit of {limit}",
                lease.token,
                lease.client,
                start.duration_since(lease.sent),
            ),
        });
    }
}

/// The current-after-its-end rule for one answer on a key whose leases are `list`.
fn check_current(list: &[&Lease], op: &Op, violations: &mut Vec<Violation>) {
    let (Kind::Check { token }, Outcome::Current) = (&op.kind, &op.outcome) else {
        return;
    };
    let Some(checked) = list.iter().find(|l| l.token == *token) else {
        return;
    };
    let excluding = list
        .iter()
        .find(|l| l.token > *token && l.answered < op.sent && !may_share(l.kind, checked.kind));
    if let Some(later) = excluding {
        violations.push(Violation {
            rule: Rule::CurrentAfterEnd,
            key: op.key.clone(),
            detail: format!(
                "CHECK of token {token} ({:?}, client {}) answered CURRENT after token {} \
                 ({:?}, client {}) was granted",
                checked.kind, checked.client, later.token, later.kind, later.client
            ),
        });
    }
}

/// The token an answer shows holding its key, and whether it is a successful renewal of
/// `lease` (`None` for answers that say nothing about the holder).
fn shown(op: &Op, lease: &Lease) -> Option<Shown> {
    match (&op.kind, &op.outcome) {
        (Kind::Inspect, Outcome::Free) => Some(Shown::Free),
        (Kind::Inspect, Outcome::Held { token }) => Some(Shown::Token(*token)),
        (Kind::Acquire { .. }, Outcome::Locked { token }) => Some(Shown::Token(*token)),
        (Kind::Acquire { .. }, Outcome::Granted { token, .. }) => Some(Shown::Token(*token)),
        (Kind::Renew { lease: id, .. }, Outcome::Renewed { .. }) if *id == lease.id => {
            Some(Shown::Token(lease.token))
        }
        (Kind::Renew { lease: id, .. }, Outcome::Lost) if *id == lease.id => Some(Shown::Free),
        (Kind::Check { token }, Outcome::Current) if *token == lease.token => {
            Some(Shown::Token(lease.token))
        }
        (Kind::Check { token }, Outcome::Stale) if *token == lease.token => Some(Shown::Free),
        _ => None,
    }
}

/// What one answer says holds a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shown {
    Free,
    Token(u64),
}

/// The lost-grant and released-came-back rules for one lease and one answer on its key.
fn check_read(lease: &Lease, op: &Op, violations: &mut Vec<Violation>) {
    let Some(shown) = shown(op, lease) else {
        return;
    };
    let unreleased = lease.release_sent.is_none_or(|r| r >= op.answered);
    // The deadline must be known when the read was sent, and no RENEW sent before the
    // read's answer may have shortened it: the server may have handled that renewal
    // first, and then handed the key on once the shorter TTL ran out.
    let within = |at: Instant| {
        lease
            .deadline_known_at(at)
            .is_some_and(|deadline| deadline > op.answered)
    };
    let must_hold = unreleased && within(op.sent) && within(op.answered);
    // A read or permit lease shares its key: an answer names the newest holder, whose token
    // is at least this one's while this one holds.
    let shows_it = match shown {
        Shown::Free => false,
        Shown::Token(t) if lease.kind.is_exclusive() => t == lease.token,
        Shown::Token(t) => t >= lease.token,
    };
    if must_hold && !shows_it {
        violations.push(Violation {
            rule: Rule::LostGrant,
            key: lease.key.clone(),
            detail: format!(
                "token {} (client {}) within its deadline, yet {:?} answered {:?}",
                lease.token, lease.client, op.kind, op.outcome
            ),
        });
    }
    let after_release = lease.release_acked.is_some_and(|r| op.sent > r);
    if after_release && shown == Shown::Token(lease.token) {
        violations.push(Violation {
            rule: Rule::ReleasedCameBack,
            key: lease.key.clone(),
            detail: format!(
                "token {} (client {}) released, then {:?} answered {:?}",
                lease.token, lease.client, op.kind, op.outcome
            ),
        });
    }
}

#[cfg(test)]
mod tests;
