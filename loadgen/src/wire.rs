//! What the scenarios send and hear, and how it is put on the wire for each target.
//!
//! A scenario speaks in [`Op`]s and [`Outcome`]s; [`Proto`] turns an op into bytes and bytes back
//! into outcomes, either in tenure's binary framing or as Redis commands (see [`crate::resp`]).
//! The tenure frames for the four ops the load generator sends are written by hand straight into
//! the connection's output buffer, so a request costs no allocation; a unit test proves the bytes
//! equal what `tenure_protocol::frame::encode_request` writes.

use anyhow::{bail, Context};
use bytes::{BufMut, BytesMut};
use tenure_protocol::frame::{decode_response, op, split_frame};
use tenure_protocol::{LeaseId, Response};

use crate::etcd::{self, EtcdState, HttpReply};
use crate::resp::{self, Reply, Scripts};

/// Prefix of every key the load generator uses: key number `n` is the lock named `job:{n}`.
pub const KEY_PREFIX: &[u8] = b"job:";
/// Prefix of the per-key fencing counter in the fenced Redis recipe.
pub const FENCE_PREFIX: &[u8] = b"fence:job:";

/// The four requests a scenario can send.
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
}

impl OpKind {
    /// Every kind, in report order.
    pub const ALL: [OpKind; 4] = [
        OpKind::Acquire,
        OpKind::Renew,
        OpKind::Release,
        OpKind::Ping,
    ];

    /// Lower-case name for reports.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Acquire => "acquire",
            OpKind::Renew => "renew",
            OpKind::Release => "release",
            OpKind::Ping => "ping",
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
    /// Lease to renew or release; for a Redis acquire, the value the client stores.
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
    /// The target answered with an error, or with a reply that does not fit the request.
    Error(String),
}

impl Outcome {
    /// Number of outcome classes, for counter arrays.
    pub const COUNT: usize = 8;
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
        }
    }
}

/// The protocol of one connection.
#[derive(Clone, Debug)]
pub enum Proto {
    /// tenure's binary protocol: replies carry the request id and may come out of order.
    Tenure,
    /// Redis RESP2 with the usual lock recipes: replies come in request order.
    Redis {
        /// SHA1s of the loaded scripts.
        scripts: Scripts,
        /// Acquire through the fenced script (SET NX PX plus INCR of a per-key counter).
        fenced: bool,
    },
    /// etcd's v3 JSON gateway over HTTP/1.1: replies come in request order, an acquire's two.
    Etcd(EtcdState),
}

impl Proto {
    /// Whether replies come back in request order (and so carry no id).
    pub fn in_order(&self) -> bool {
        matches!(self, Proto::Redis { .. } | Proto::Etcd(_))
    }

    /// Appends the request for `op`, tagged `id` where the protocol has ids.
    pub fn encode(&mut self, id: u64, op: &Op, dst: &mut BytesMut) {
        match self {
            Proto::Tenure => encode_tenure(id, op, dst),
            Proto::Redis { scripts, fenced } => resp::encode_op(scripts, *fenced, op, dst),
            Proto::Etcd(state) => state.encode(op, dst),
        }
    }

    /// Takes one reply off the front of `src`: the request id (`None` for in-order protocols)
    /// and the reply, still to be matched with its op by [`Proto::outcome`].
    ///
    /// # Errors
    /// When the stream is broken (bad length, bad RESP type): the connection must close.
    pub fn decode(&mut self, src: &mut BytesMut) -> anyhow::Result<Option<(Option<u64>, Decoded)>> {
        match self {
            Proto::Tenure => {
                let Some((opcode, id, body)) = split_frame(src).context("tenure frame")? else {
                    return Ok(None);
                };
                let reply = match decode_response(opcode, body) {
                    Ok(response) => tenure_outcome(response),
                    Err(e) => Outcome::Error(format!("undecodable reply: {e:?}")),
                };
                Ok(Some((Some(id), Decoded::Tenure(reply))))
            }
            Proto::Redis { .. } => Ok(resp::decode(src)?.map(|r| (None, Decoded::Redis(r)))),
            Proto::Etcd(state) => Ok(state.decode(src)?.map(|r| (None, Decoded::Etcd(r)))),
        }
    }

    /// The outcome of `op` given its decoded reply.
    pub fn outcome(&self, op: &Op, decoded: Decoded) -> Outcome {
        match decoded {
            Decoded::Tenure(outcome) => outcome,
            Decoded::Redis(reply) => {
                let fenced = matches!(self, Proto::Redis { fenced: true, .. });
                resp::outcome(op, fenced, reply)
            }
            Decoded::Etcd(replies) => etcd::outcome(op, &replies),
        }
    }
}

/// A reply taken off the wire, before it is matched with its op.
#[derive(Debug)]
pub enum Decoded {
    /// tenure replies stand alone.
    Tenure(Outcome),
    /// Redis replies mean something only next to the command that asked.
    Redis(Reply),
    /// The HTTP responses of one etcd op (two for an acquire).
    Etcd(Vec<HttpReply>),
}

fn tenure_outcome(response: Response) -> Outcome {
    match response {
        Response::Pong => Outcome::Pong,
        Response::Granted {
            token, lease_id, ..
        } => Outcome::Granted {
            lease: lease_id.as_u128(),
            token,
        },
        Response::Locked { .. } => Outcome::Locked,
        Response::Renewed { .. } => Outcome::Renewed,
        Response::Lost => Outcome::Lost,
        Response::Released => Outcome::Released,
        Response::NotOwner => Outcome::NotOwner,
        Response::Error { code, .. } => Outcome::Error(format!("{code:?}")),
        other => Outcome::Error(format!("unexpected reply {other:?}")),
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

/// Appends a tenure key field (u16 length, then `job:{key}`).
fn put_key16(dst: &mut BytesMut, key: u64) {
    let mut digits = [0u8; 20];
    let digits = decimal(key, &mut digits);
    dst.put_u16((KEY_PREFIX.len() + digits.len()) as u16);
    dst.put_slice(KEY_PREFIX);
    dst.put_slice(digits);
}

/// Appends one tenure request frame for `op`; see the crate `tenure_protocol::frame` diagram.
fn encode_tenure(id: u64, op: &Op, dst: &mut BytesMut) {
    let start = dst.len();
    dst.put_u32(0); // length, patched below
    let opcode = match op.kind {
        OpKind::Acquire => op::ACQUIRE,
        OpKind::Renew => op::RENEW,
        OpKind::Release => op::RELEASE,
        OpKind::Ping => op::PING,
    };
    dst.put_u8(opcode);
    dst.put_u64(id);
    match op.kind {
        OpKind::Acquire => {
            put_key16(dst, op.key);
            dst.put_u32(op.ttl_ms);
            dst.put_u32(op.wait_ms);
            dst.put_u8(0); // flags: the lock outlives the connection
            dst.put_u16(0); // no holder metadata
        }
        OpKind::Renew => {
            put_key16(dst, op.key);
            dst.put_slice(&LeaseId::from_u128(op.lease).0);
            dst.put_u32(op.ttl_ms);
        }
        OpKind::Release => {
            put_key16(dst, op.key);
            dst.put_slice(&LeaseId::from_u128(op.lease).0);
        }
        OpKind::Ping => {}
    }
    let len = (dst.len() - start - 4) as u32;
    dst[start..start + 4].copy_from_slice(&len.to_be_bytes());
}

/// Checks that a request would pass the server's validation before a run starts.
///
/// # Errors
/// When a TTL or wait is out of the protocol's range.
pub fn validate_limits(ttl_ms: u32, wait_ms: u32) -> anyhow::Result<()> {
    use tenure_protocol::limits::{TTL_MS_MAX, TTL_MS_MIN, WAIT_MS_MAX};
    if !(TTL_MS_MIN..=TTL_MS_MAX).contains(&ttl_ms) {
        bail!("--ttl {ttl_ms} ms is outside {TTL_MS_MIN}..={TTL_MS_MAX} ms");
    }
    if wait_ms > WAIT_MS_MAX {
        bail!("--wait {wait_ms} ms is over {WAIT_MS_MAX} ms");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tenure_protocol::frame::encode_request;
    use tenure_protocol::Request;

    fn op(kind: OpKind) -> Op {
        Op {
            kind,
            key: 1_234_567,
            lease: 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10,
            ttl_ms: 30_000,
            wait_ms: 250,
            tag: 0,
            intended_ns: 0,
            sent_ns: 0,
        }
    }

    #[test]
    fn hand_encoder_matches_protocol_crate() {
        let key = Bytes::from_static(b"job:1234567");
        let lease_id = LeaseId::from_u128(op(OpKind::Ping).lease);
        let cases = [
            (
                OpKind::Acquire,
                Request::Acquire {
                    key: key.clone(),
                    ttl_ms: 30_000,
                    wait_ms: 250,
                    release_on_disconnect: false,
                    meta: Bytes::new(),
                },
            ),
            (
                OpKind::Renew,
                Request::Renew {
                    key: key.clone(),
                    lease_id,
                    ttl_ms: 30_000,
                },
            ),
            (OpKind::Release, Request::Release { key, lease_id }),
            (OpKind::Ping, Request::Ping),
        ];
        for (kind, request) in cases {
            let mut ours = BytesMut::new();
            encode_tenure(77, &op(kind), &mut ours);
            let mut theirs = BytesMut::new();
            encode_request(77, &request, &mut theirs);
            assert_eq!(ours, theirs, "{kind:?}");
        }
    }

    #[test]
    fn decimal_digits() {
        let mut buf = [0u8; 20];
        assert_eq!(decimal(0, &mut buf), b"0");
        assert_eq!(decimal(907, &mut buf), b"907");
        assert_eq!(decimal(u64::MAX, &mut buf), b"18446744073709551615");
    }
}
