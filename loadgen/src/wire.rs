//! tenure's binary protocol for the four ops the load generator sends (an ACQUIRE of the
//! run's kind: the key alone, a read lease or semaphore permits).
//!
//! The frames are written by hand straight into the connection's output buffer, so a request
//! costs no allocation; a unit test proves the bytes equal what
//! `tenure_protocol::frame::encode_request` writes. Replies are decoded by the protocol crate
//! and mapped onto [`Outcome`]s; they carry the request id, so they may come out of order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use anyhow::{bail, Context};
use bytes::{BufMut, BytesMut};
use tenure_protocol::frame::{
    decode_response, op, split_frame, FLAG_ACQUIRE_ID, FLAG_KIND, FLAG_SESSION,
};
use tenure_protocol::kind::{KIND_PERMITS, KIND_SHARED};
use tenure_protocol::{LeaseId, LeaseKind, Response};

use crate::op::{decimal, Op, OpKind, Outcome, KEY_PREFIX};

/// Takes one reply frame off the front of `src`: its request id and what it means.
///
/// # Errors
/// When the stream is broken (a bad length): the connection must close.
pub fn decode(src: &mut BytesMut) -> anyhow::Result<Option<(u64, Outcome)>> {
    let Some((opcode, id, body)) = split_frame(src).context("tenure frame")? else {
        return Ok(None);
    };
    let reply = match decode_response(opcode, body) {
        Ok(response) => outcome(response),
        Err(e) => Outcome::Error(format!("undecodable reply: {e:?}")),
    };
    Ok(Some((id, reply)))
}

/// The outcome a decoded tenure response means.
fn outcome(response: Response) -> Outcome {
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
        Response::Session { session_id, .. } => Outcome::Session {
            id: u128::from_be_bytes(session_id.0),
        },
        Response::Error { code, .. } => Outcome::Error(format!("{code:?}")),
        other => Outcome::Error(format!("unexpected reply {other:?}")),
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

/// This process's acquire ids: a random half chosen once (so a second run against the same
/// server repeats none of the first's ids, which it remembers as ended) and a count, one more
/// per ACQUIRE. Key, instant and request id do not make one unique: lanes on two connections
/// send the same request id for the same key in the same tick, and a repeated id is answered
/// REGRANTED with the other lane's lease.
fn next_acquire_id() -> [u8; 16] {
    static SALT: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let salt = *SALT.get_or_init(rand::random);
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&salt.to_be_bytes());
    id[8..].copy_from_slice(&COUNT.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    id
}

/// Appends an ACQUIRE's fields after its request id: the optional fields after the meta in
/// increasing flag-bit order (PROTOCOL.md 3.1), the acquire id (bit 1), then the session
/// (bit 2: the session id in `op.lease`, and TTL 0, PROTOCOL.md 3.11), then the kind (bit 3).
fn put_acquire(op: &Op, how: Acquiring, dst: &mut BytesMut) {
    put_key16(dst, op.key);
    dst.put_u32(if how.session { 0 } else { op.ttl_ms });
    dst.put_u32(op.wait_ms);
    // Flags: the lock outlives the connection; bit 1 with an acquire id, bit 2 in a
    // session, bit 3 with a kind.
    let mut flags = 0;
    if how.acquire_id {
        flags |= FLAG_ACQUIRE_ID;
    }
    if how.session {
        flags |= FLAG_SESSION;
    }
    if !how.kind.is_exclusive() {
        flags |= FLAG_KIND;
    }
    dst.put_u8(flags);
    dst.put_u16(0); // no holder metadata
    if how.acquire_id {
        dst.put_slice(&next_acquire_id());
    }
    if how.session {
        dst.put_slice(&op.lease.to_be_bytes());
    }
    let kind = how.kind;
    match kind {
        LeaseKind::Exclusive => {}
        LeaseKind::Shared => dst.put_u8(KIND_SHARED),
        LeaseKind::Permits { count, limit } => {
            dst.put_u8(KIND_PERMITS);
            dst.put_u32(count);
            dst.put_u32(limit);
        }
    }
}

/// How a connection's ACQUIREs are sent ([`encode`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Acquiring {
    /// Each carries an acquire id (flag bit 1), unique per ACQUIRE in this process and
    /// random across processes.
    pub acquire_id: bool,
    /// Each is in the session whose id is the op's `lease` (flag bit 2), with TTL 0.
    pub session: bool,
    /// What each asks for.
    pub kind: LeaseKind,
}

/// Appends one tenure request frame for `op`; see the crate `tenure_protocol::frame` diagram.
/// An ACQUIRE is sent as `how` says, asking for its own `op.lease_kind` if it names one, else
/// for `how.kind` (the connection's); the other requests have no acquire id, session or kind
/// (a keep-alive's session id is the op's `lease`; a `lease` of 0 opens a session instead).
pub fn encode(id: u64, op: &Op, how: Acquiring, dst: &mut BytesMut) {
    let start = dst.len();
    dst.put_u32(0); // length, patched below
    let opcode = match op.kind {
        OpKind::Acquire => op::ACQUIRE,
        OpKind::Renew => op::RENEW,
        OpKind::Release => op::RELEASE,
        OpKind::Ping => op::PING,
        OpKind::KeepAlive if op.lease == 0 => op::SESSION_OPEN,
        OpKind::KeepAlive => op::SESSION_KEEPALIVE,
    };
    dst.put_u8(opcode);
    dst.put_u64(id);
    match op.kind {
        OpKind::Acquire => {
            let kind = op.lease_kind.unwrap_or(how.kind);
            put_acquire(op, Acquiring { kind, ..how }, dst)
        }
        OpKind::KeepAlive if op.lease == 0 => dst.put_u32(op.ttl_ms),
        OpKind::KeepAlive => dst.put_slice(&op.lease.to_be_bytes()),
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
    use crate::op::{Op, OpKind};
    use bytes::Bytes;
    use tenure_protocol::frame::encode_request;
    use tenure_protocol::Request;

    fn plain() -> Acquiring {
        Acquiring::default()
    }

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
            lease_kind: None,
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
                    acquire_id: None,
                    kind: Default::default(),
                    session_id: None,
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
            encode(77, &op(kind), plain(), &mut ours);
            let mut theirs = BytesMut::new();
            encode_request(77, &request, &mut theirs);
            assert_eq!(ours, theirs, "{kind:?}");
        }
        // An ACQUIRE with an acquire id, a new one for each ACQUIRE of the same op.
        let with_id = Acquiring {
            acquire_id: true,
            ..plain()
        };
        let mut ours = BytesMut::new();
        encode(77, &op(OpKind::Acquire), with_id, &mut ours);
        let id = acquire_id_of(&ours);
        let mut again = BytesMut::new();
        encode(77, &op(OpKind::Acquire), with_id, &mut again);
        assert_ne!(acquire_id_of(&again), id, "an acquire id is never repeated");
        let request = Request::Acquire {
            key: Bytes::from_static(b"job:1234567"),
            ttl_ms: 30_000,
            wait_ms: 250,
            release_on_disconnect: false,
            meta: Bytes::new(),
            acquire_id: Some(tenure_protocol::AcquireId(id)),
            kind: Default::default(),
            session_id: None,
        };
        let mut theirs = BytesMut::new();
        encode_request(77, &request, &mut theirs);
        assert_eq!(ours, theirs, "with an acquire id");
    }

    #[test]
    fn session_requests_match_the_protocol_crate() {
        let session = 0x1112_1314_1516_1718_191a_1b1c_1d1e_1f20_u128;
        let session_id = tenure_protocol::SessionId(session.to_be_bytes());
        let keepalive = Op {
            lease: session,
            ..op(OpKind::KeepAlive)
        };
        let open = Op {
            lease: 0,
            ..op(OpKind::KeepAlive)
        };
        let acquire = Op {
            lease: session,
            ..op(OpKind::Acquire)
        };
        let in_session = Acquiring {
            session: true,
            ..plain()
        };
        let cases = [
            (
                open,
                Request::SessionOpen {
                    ttl_ms: 30_000,
                    session_id: None,
                },
            ),
            (keepalive, Request::SessionKeepalive { session_id }),
            (
                acquire,
                Request::Acquire {
                    key: Bytes::from_static(b"job:1234567"),
                    ttl_ms: 0,
                    wait_ms: 250,
                    release_on_disconnect: false,
                    meta: Bytes::new(),
                    acquire_id: None,
                    kind: Default::default(),
                    session_id: Some(session_id),
                },
            ),
        ];
        for (op, request) in cases {
            let mut ours = BytesMut::new();
            encode(77, &op, in_session, &mut ours);
            let mut theirs = BytesMut::new();
            encode_request(77, &request, &mut theirs);
            assert_eq!(ours, theirs, "{request:?}");
        }
    }

    /// The acquire id of an ACQUIRE frame for `op()` without meta: after length, opcode,
    /// request id, key (2 + 11 bytes), TTL, wait, flags and the meta's length.
    fn acquire_id_of(frame: &[u8]) -> [u8; 16] {
        let at = 4 + 1 + 8 + 2 + 11 + 4 + 4 + 1 + 2;
        frame[at..at + 16].try_into().expect("16 bytes")
    }

    #[test]
    fn an_acquire_of_a_kind_matches_the_protocol_crate() {
        let kinds = [
            LeaseKind::Shared,
            LeaseKind::Permits { count: 1, limit: 4 },
            LeaseKind::Permits { count: 3, limit: 7 },
        ];
        // With and without an acquire id: the id (flag bit 1) goes before the kind (bit 3).
        for kind in kinds {
            for with_id in [false, true] {
                let mut ours = BytesMut::new();
                let how = Acquiring {
                    acquire_id: with_id,
                    session: false,
                    kind,
                };
                encode(77, &op(OpKind::Acquire), how, &mut ours);
                let acquire_id = with_id.then(|| tenure_protocol::AcquireId(acquire_id_of(&ours)));
                let request = Request::Acquire {
                    key: Bytes::from_static(b"job:1234567"),
                    ttl_ms: 30_000,
                    wait_ms: 250,
                    release_on_disconnect: false,
                    meta: Bytes::new(),
                    acquire_id,
                    kind,
                    session_id: None,
                };
                let mut theirs = BytesMut::new();
                encode_request(77, &request, &mut theirs);
                assert_eq!(ours, theirs, "{kind:?}, {acquire_id:?}");
            }
            // Only ACQUIRE carries the kind or an acquire id.
            let mut renew = BytesMut::new();
            let how = Acquiring {
                acquire_id: true,
                session: true,
                kind,
            };
            encode(77, &op(OpKind::Renew), how, &mut renew);
            let mut without = BytesMut::new();
            encode(77, &op(OpKind::Renew), plain(), &mut without);
            assert_eq!(renew, without);
        }
    }
}
