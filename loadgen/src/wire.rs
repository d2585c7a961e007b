//! tenure's binary protocol for the four ops the load generator sends.
//!
//! The frames are written by hand straight into the connection's output buffer, so a request
//! costs no allocation; a unit test proves the bytes equal what
//! `tenure_protocol::frame::encode_request` writes. Replies are decoded by the protocol crate
//! and mapped onto [`Outcome`]s; they carry the request id, so they may come out of order.

use anyhow::{bail, Context};
use bytes::{BufMut, BytesMut};
use tenure_protocol::frame::{decode_response, op, split_frame, FLAG_ACQUIRE_ID};
use tenure_protocol::{LeaseId, Response};

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

/// Appends one tenure request frame for `op`; see the crate `tenure_protocol::frame` diagram.
/// With `acquire_id`, an ACQUIRE carries one (flag bit 1), unique per op: its key and the
/// instant it was meant for.
pub fn encode(id: u64, op: &Op, acquire_id: bool, dst: &mut BytesMut) {
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
            // flags: the lock outlives the connection; an acquire id or none
            dst.put_u8(if acquire_id { FLAG_ACQUIRE_ID } else { 0 });
            dst.put_u16(0); // no holder metadata
            if acquire_id {
                dst.put_u64(op.key);
                dst.put_u64(op.intended_ns ^ id.rotate_left(48));
            }
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
    use crate::op::{Op, OpKind};
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
                    acquire_id: None,
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
            encode(77, &op(kind), false, &mut ours);
            let mut theirs = BytesMut::new();
            encode_request(77, &request, &mut theirs);
            assert_eq!(ours, theirs, "{kind:?}");
        }
        // An ACQUIRE with an acquire id: the op's key, then its instant mixed with the id.
        let mut ours = BytesMut::new();
        encode(77, &op(OpKind::Acquire), true, &mut ours);
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&1_234_567u64.to_be_bytes());
        id[8..].copy_from_slice(&77u64.rotate_left(48).to_be_bytes());
        let request = Request::Acquire {
            key: Bytes::from_static(b"job:1234567"),
            ttl_ms: 30_000,
            wait_ms: 250,
            release_on_disconnect: false,
            meta: Bytes::new(),
            acquire_id: Some(tenure_protocol::AcquireId(id)),
            session_id: None,
        };
        let mut theirs = BytesMut::new();
        encode_request(77, &request, &mut theirs);
        assert_eq!(ours, theirs, "with an acquire id");
    }
}
