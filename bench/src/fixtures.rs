//! Frames and keys shared by the benches, built the way a client would build them.

use bytes::{Bytes, BytesMut};
use tenure_protocol::frame::{encode_request, encode_response};
use tenure_protocol::{LeaseId, Request, Response};

/// The lock name for key number `n`, as the load generator spells it.
pub fn key(n: u64) -> Bytes {
    Bytes::from(format!("job:{n}"))
}

/// An ACQUIRE for key `n`: 30 s lease, no wait, no metadata.
pub fn acquire(n: u64) -> Request {
    Request::Acquire {
        key: key(n),
        ttl_ms: 30_000,
        wait_ms: 0,
        release_on_disconnect: false,
        meta: Bytes::new(),
        acquire_id: None,
        kind: Default::default(),
        session_id: None,
    }
}

/// A GRANTED reply with token `n`.
pub fn granted(n: u64) -> Response {
    Response::Granted {
        token: n,
        lease_id: LeaseId::from_u128(0x5eed_0000_0000_0000_0000_0000_0000_0000 | u128::from(n)),
        ttl_ms: 30_000,
        waited_ms: 0,
    }
}

/// `count` ACQUIRE frames back to back, request ids `0..count`.
pub fn acquire_frames(count: u64) -> BytesMut {
    let mut out = BytesMut::new();
    for n in 0..count {
        encode_request(n, &acquire(n), &mut out);
    }
    out
}

/// `count` GRANTED frames back to back, request ids `0..count`.
pub fn granted_frames(count: u64) -> BytesMut {
    let mut out = BytesMut::new();
    for n in 0..count {
        encode_response(n, &granted(n), &mut out);
    }
    out
}
