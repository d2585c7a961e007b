//! The shared vocabulary of a run: the [`Op`]s a scenario sends, the [`Outcome`]s it hears,
//! and how keys are named. Every codec (`wire` for tenure, `resp` for Redis, `etcd`) and every
//! layer above them speaks these; this module imports nothing of the crate (only the
//! protocol crate's [`LeaseKind`]).

use tenure_protocol::LeaseKind;

/// Prefix of every key the load generator uses: key number `n` is the lock named `job:{n}`.
pub const KEY_PREFIX: &[u8] = b"job:";
/// Prefix of the per-key fencing counter in the fenced Redis recipe.
pub const FENCE_PREFIX: &[u8] = b"fence:job:";

/// The requests a scenario can send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Take a lock.
    Acquire = 0,
    /// Extend a held lease.
    Renew = 1,
    /// Give a lock back.
    Release = 2,
    /// Round trip that touches no lock.
    Ping = 3,
    /// tenure sessions (PROTOCOL.md 3.11): SESSION_KEEPALIVE of the session in `Op::lease`,
    /// or SESSION_OPEN (of `Op::ttl_ms`) when that is 0.
    KeepAlive = 4,
}

impl OpKind {
    /// Number of kinds, for arrays indexed by `OpKind as usize`.
    pub const COUNT: usize = 5;
    /// Every kind, in report order.
    pub const ALL: [OpKind; Self::COUNT] = [
        OpKind::Acquire,
        OpKind::Renew,
        OpKind::Release,
        OpKind::Ping,
        OpKind::KeepAlive,
    ];

    /// Lower-case name for reports.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Acquire => "acquire",
            OpKind::Renew => "renew",
            OpKind::Release => "release",
            OpKind::Ping => "ping",
            OpKind::KeepAlive => "keepalive",
        }
    }
}

/// One request in flight, with everything needed to account for its reply.
#[derive(Clone, Copy, Debug)]
pub struct Op {
    /// What is asked.
    pub kind: OpKind,
    /// Key number: the lock is `job:{key}`.
    pub key: u64,
    /// Lease to renew or release; for a Redis acquire, the value the client stores; for a
    /// tenure acquire in a session (`--sessions`) and a keep-alive, the session id.
    pub lease: u128,
    /// Lease length asked for (acquire, renew), in milliseconds.
    pub ttl_ms: u32,
    /// How long an acquire may wait in line, in milliseconds (tenure only).
    pub wait_ms: u32,
    /// The scenario's own reference: a lock number, a lane or a client.
    pub tag: u64,
    /// When the op was meant to be sent, in nanoseconds since the run's start: latency counts
    /// from here, so a late send shows up as latency instead of vanishing (no coordinated omission).
    pub intended_ns: u64,
    /// When the op was encoded for sending, nanoseconds since the run's start (set by the
    /// connection): the gap to `intended_ns` is the generator's own lag.
    pub sent_ns: u64,
    /// tenure: the lease this ACQUIRE asks for, whatever its connection's kind (`None`: the
    /// connection's, from `--permits` or `--shared`). The read-mostly scenario mixes reads
    /// and writes on one connection.
    pub lease_kind: Option<LeaseKind>,
}

/// What came back for one op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The lock is ours.
    Granted {
        /// Lease to present on renew and release.
        lease: u128,
        /// Fencing token (0 for the unfenced Redis recipe, which has none).
        token: u64,
    },
    /// Someone else holds the lock.
    Locked,
    /// The lease was extended.
    Renewed,
    /// The lease is gone (renew came too late).
    Lost,
    /// The lock was released.
    Released,
    /// Release refused: the lease does not hold the lock.
    NotOwner,
    /// Reply to a ping.
    Pong,
    /// A tenure session is open or was kept alive (SESSION).
    Session {
        /// Its session id.
        id: u128,
    },
    /// The target answered with an error, or with a reply that does not fit the request.
    Error(String),
}

impl Outcome {
    /// Number of outcome classes, for counter arrays.
    pub const COUNT: usize = 9;
    /// Names of the classes, indexed by [`Outcome::index`].
    pub const NAMES: [&'static str; Self::COUNT] = [
        "granted",
        "locked",
        "renewed",
        "lost",
        "released",
        "not_owner",
        "pong",
        "error",
        "session",
    ];

    /// Position of this outcome's class in [`Outcome::NAMES`].
    pub fn index(&self) -> usize {
        match self {
            Outcome::Granted { .. } => 0,
            Outcome::Locked => 1,
            Outcome::Renewed => 2,
            Outcome::Lost => 3,
            Outcome::Released => 4,
            Outcome::NotOwner => 5,
            Outcome::Pong => 6,
            Outcome::Error(_) => 7,
            Outcome::Session { .. } => 8,
        }
    }
}

/// Writes `n` in decimal into the end of `buf` and returns the digits.
pub fn decimal(n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    let mut rest = n;
    loop {
        at -= 1;
        buf[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            return &buf[at..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_digits() {
        let mut buf = [0u8; 20];
        assert_eq!(decimal(0, &mut buf), b"0");
        assert_eq!(decimal(907, &mut buf), b"907");
        assert_eq!(decimal(u64::MAX, &mut buf), b"18446744073709551615");
    }
}
