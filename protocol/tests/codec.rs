//! Codec tests: round trips, every truncated prefix, every over-limit length.

use bytes::{BufMut, Bytes, BytesMut};
use tenure_protocol::cluster::{
    Digest, Member, Role, Status, StatusExtension, STATUS_EXTENSION_LEN,
};
use tenure_protocol::frame::{
    decode_request, decode_response, encode_request, encode_response, split_frame,
};
use tenure_protocol::handshake::{Hello, HelloAck, ServerLimits, VERSION};
use tenure_protocol::limits::*;
use tenure_protocol::{ErrorCode, EventKind, Holder, LeaseId, ProtocolError, Request, Response};

fn key(n: usize) -> Bytes {
    Bytes::from(vec![b'k'; n])
}

fn sample_requests() -> Vec<Request> {
    let lease_id = LeaseId::from_u128(0xdead_beef_0000_0000_0000_0000_0000_0001);
    vec![
        Request::Ping,
        Request::Acquire {
            key: key(1),
            ttl_ms: TTL_MS_MIN,
            wait_ms: 0,
            release_on_disconnect: false,
            meta: Bytes::new(),
            acquire_id: None,
            kind: Default::default(),
            session_id: None,
        },
        Request::Acquire {
            key: key(KEY_LEN_MAX),
            ttl_ms: TTL_MS_MAX,
            wait_ms: WAIT_MS_MAX,
            release_on_disconnect: true,
            meta: Bytes::from(vec![7u8; META_LEN_MAX]),
            acquire_id: None,
            kind: Default::default(),
            session_id: None,
        },
        Request::Acquire {
            key: key(3),
            ttl_ms: 1000,
            wait_ms: 5,
            release_on_disconnect: true,
            meta: Bytes::from_static(b"m"),
            acquire_id: Some(tenure_protocol::AcquireId::from_u128(0xabc)),
            kind: Default::default(),
            session_id: None,
        },
        Request::Acquire {
            key: key(3),
            ttl_ms: 1000,
            wait_ms: 5,
            release_on_disconnect: false,
            meta: Bytes::from_static(b"m"),
            acquire_id: Some(tenure_protocol::AcquireId::from_u128(0xabd)),
            kind: tenure_protocol::LeaseKind::Permits { count: 2, limit: 5 },
            session_id: None,
        },
        Request::Acquire {
            key: key(2),
            ttl_ms: 0,
            wait_ms: 7,
            release_on_disconnect: false,
            meta: Bytes::from_static(b"m"),
            acquire_id: Some(tenure_protocol::AcquireId::from_u128(0xabc)),
            session_id: Some(tenure_protocol::SessionId::from_u128(0xdef)),
            kind: tenure_protocol::LeaseKind::Permits { count: 1, limit: 3 },
        },
        Request::SessionOpen {
            ttl_ms: 10_000,
            session_id: None,
        },
        Request::SessionOpen {
            ttl_ms: 10_000,
            session_id: Some(tenure_protocol::SessionId::from_u128(3)),
        },
        Request::SessionKeepalive {
            session_id: tenure_protocol::SessionId::from_u128(1),
        },
        Request::SessionClose {
            session_id: tenure_protocol::SessionId::from_u128(2),
        },
        Request::Renew {
            key: key(5),
            lease_id,
            ttl_ms: 30_000,
        },
        Request::Release {
            key: key(5),
            lease_id,
        },
        Request::Inspect {
            key: key(3),
            kinds: Default::default(),
        },
        Request::Inspect {
            key: key(3),
            kinds: true,
        },
        Request::Acquire {
            key: key(KEY_LEN_MAX),
            ttl_ms: TTL_MS_MAX,
            wait_ms: WAIT_MS_MAX,
            release_on_disconnect: true,
            meta: Bytes::from(vec![7u8; META_LEN_MAX]),
            acquire_id: None,
            kind: tenure_protocol::LeaseKind::Permits {
                count: tenure_protocol::limits::PERMITS_MAX,
                limit: tenure_protocol::limits::PERMITS_MAX,
            },
            session_id: None,
        },
        Request::Acquire {
            key: key(3),
            ttl_ms: TTL_MS_MAX,
            wait_ms: 0,
            release_on_disconnect: false,
            meta: Bytes::new(),
            acquire_id: Some(tenure_protocol::AcquireId::from_u128(7)),
            kind: tenure_protocol::LeaseKind::Shared,
            session_id: None,
        },
        Request::Check {
            key: key(3),
            token: u64::MAX,
        },
        Request::Stats,
        Request::Watch { key: key(2) },
        Request::Unwatch { key: key(2) },
        Request::Auth {
            name: key(3),
            secret: tenure_protocol::Secret(key(4)),
        },
        Request::ClusterStatus { extended: false },
        Request::ClusterStatus { extended: true },
        Request::ClusterInit {
            members: (1..=CLUSTER_MEMBERS_MAX as u64).map(member).collect(),
        },
        Request::ClusterAdd { member: member(4) },
        Request::ClusterRemove { id: u64::MAX },
    ]
}

/// Node `id` with addresses at their longest (`host:port`, a port of its own).
fn member(id: u64) -> Member {
    let addr = |c: char| {
        let port = format!(":{}", 60_000 + id);
        c.to_string().repeat(CLUSTER_ADDR_LEN_MAX - port.len()) + &port
    };
    Member {
        id,
        peer_addr: addr('p'),
        client_addr: addr('c'),
    }
}

/// A CLUSTER reply at its largest.
fn cluster_status() -> Status {
    Status {
        node_id: 2,
        role: Role::Follower,
        term: 7,
        leader_id: 1,
        leader_addr: "l".repeat(CLUSTER_ADDR_LEN_MAX),
        last_log_index: 40,
        last_applied_index: 39,
        members: (1..=CLUSTER_MEMBERS_MAX as u64)
            .map(|id| (member(id), id != 4))
            .collect(),
        extension: None,
    }
}

fn extension() -> StatusExtension {
    StatusExtension {
        identities_digest: Digest([1, 2, 3, 4, 5, 6, 7, 8]),
        trust_digest: Digest::default(),
        last_contact_ms: Some(42),
    }
}

fn sample_responses() -> Vec<Response> {
    let lease_id = LeaseId::from_u128(u128::MAX);
    vec![
        Response::Pong,
        Response::Session {
            session_id: tenure_protocol::SessionId::from_u128(3),
            ttl_ms: 10_000,
        },
        Response::SessionClosed { released: 100 },
        Response::Granted {
            token: 42,
            lease_id,
            ttl_ms: 30_000,
            waited_ms: 0,
        },
        Response::Granted {
            token: 43,
            lease_id,
            ttl_ms: TTL_MS_MAX,
            waited_ms: u32::MAX,
        },
        Response::Locked {
            token: 41,
            ttl_left_ms: 12,
        },
        Response::Renewed { ttl_ms: 5 },
        Response::Lost,
        Response::Released,
        Response::NotOwner,
        Response::Free,
        Response::HeldKinds {
            token: 9,
            ttl_left_ms: 250,
            waiters: 3,
            meta: Bytes::from_static(b"m"),
            kinds: tenure_protocol::kind::HolderKinds {
                limit: 4,
                holders: 2,
                in_use: 3,
                writer: false,
                waiting_shared: 2,
                waiting_exclusive: 1,
            },
        },
        Response::Held {
            token: 9,
            ttl_left_ms: 100,
            waiters: 3,
            meta: Bytes::from_static(b"10.0.0.1:80"),
        },
        Response::Current,
        Response::Stale,
        Response::Stats(vec![("held".into(), 5), ("connections".into(), 1)]),
        Response::Watching { holder: None },
        Response::Watching {
            holder: Some(Holder {
                token: 12,
                ttl_left_ms: 250,
                waiters: 2,
                meta: Bytes::from_static(b"leader-1"),
            }),
        },
        Response::Unwatched,
        Response::Authenticated { name: key(5) },
        Response::Cluster(cluster_status()),
        Response::Cluster(Status {
            extension: Some(Box::new(extension())),
            ..cluster_status()
        }),
        Response::Cluster(Status {
            extension: Some(Box::new(StatusExtension {
                last_contact_ms: None,
                ..extension()
            })),
            ..cluster_status()
        }),
        Response::Event {
            kind: EventKind::Expired,
            key: key(4),
            token: 8,
            meta: Bytes::new(),
        },
        Response::Error {
            code: ErrorCode::BadTtl,
            message: "ttl out of range".into(),
        },
    ]
}

#[test]
fn every_request_round_trips() {
    for (i, request) in sample_requests().into_iter().enumerate() {
        let mut buf = BytesMut::new();
        encode_request(i as u64 + 100, &request, &mut buf);
        let (opcode, id, body) = split_frame(&mut buf).unwrap().unwrap();
        assert_eq!(id, i as u64 + 100);
        assert_eq!(decode_request(opcode, body).unwrap(), request);
        assert!(buf.is_empty());
    }
}

#[test]
fn every_response_round_trips() {
    for (i, response) in sample_responses().into_iter().enumerate() {
        let mut buf = BytesMut::new();
        encode_response(i as u64, &response, &mut buf);
        let (opcode, id, body) = split_frame(&mut buf).unwrap().unwrap();
        assert_eq!(id, i as u64);
        assert_eq!(decode_response(opcode, body).unwrap(), response);
    }
}

/// GRANTED, byte by byte as PROTOCOL.md 3.2 draws it: `waited_ms` is the last four bytes.
#[test]
fn granted_layout_ends_with_waited_ms() {
    let granted = Response::Granted {
        token: 0x0102_0304_0506_0708,
        lease_id: LeaseId::from_u128(0x1112_1314_1516_1718_191a_1b1c_1d1e_1f20),
        ttl_ms: 30_000,
        waited_ms: 4_250,
    };
    let mut buf = BytesMut::new();
    encode_response(7, &granted, &mut buf);
    let mut expected = vec![0, 0, 0, 41, 0x82, 0, 0, 0, 0, 0, 0, 0, 7];
    expected.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    expected.extend(0x11u8..=0x20);
    expected.extend_from_slice(&30_000u32.to_be_bytes());
    expected.extend_from_slice(&[0x00, 0x00, 0x10, 0x9a]); // waited_ms = 4250
    assert_eq!(&buf[..], &expected[..]);
    let (opcode, id, body) = split_frame(&mut buf).unwrap().unwrap();
    assert_eq!((opcode, id), (0x82, 7));
    assert_eq!(decode_response(opcode, body).unwrap(), granted);
}

/// AUTH and AUTHENTICATED, byte by byte as PROTOCOL.md 3.7 draws them.
#[test]
fn auth_layout_is_the_documented_one() {
    let auth = Request::Auth {
        name: Bytes::from_static(b"orders"),
        secret: tenure_protocol::Secret(Bytes::from_static(b"s3cret")),
    };
    let mut buf = BytesMut::new();
    encode_request(1, &auth, &mut buf);
    let mut expected = vec![0, 0, 0, 0x19, 0x0a, 0, 0, 0, 0, 0, 0, 0, 1];
    expected.extend_from_slice(b"\x00\x06orders\x00\x06s3cret");
    assert_eq!(&buf[..], &expected[..]);
    let (opcode, id, body) = split_frame(&mut buf).unwrap().unwrap();
    assert_eq!((opcode, id), (0x0a, 1));
    assert_eq!(decode_request(opcode, body).unwrap(), auth);
    assert!(
        !format!("{auth:?}").contains("s3cret"),
        "Debug hides the secret"
    );

    let reply = Response::Authenticated {
        name: Bytes::from_static(b"orders"),
    };
    encode_response(1, &reply, &mut buf);
    assert_eq!(&buf[4..5], &[0x8f]);
    assert_eq!(&buf[13..], b"\x00\x06orders");
    for code in [
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::Quota,
        ErrorCode::NotLeader,
    ] {
        assert_eq!(ErrorCode::from_u16(code as u16), code, "{code} is in ALL");
    }
    assert_eq!(ErrorCode::NotLeader as u16, 23);
    assert_eq!(ErrorCode::NotLeader.name(), "NOT_LEADER");
    assert_eq!(
        (
            ErrorCode::Unauthenticated as u16,
            ErrorCode::Forbidden as u16,
            ErrorCode::Quota as u16
        ),
        (20, 21, 22)
    );
}

/// Every strict prefix of a valid frame is "not yet" and consumes nothing.
#[test]
fn every_truncated_prefix_waits_for_more() {
    for request in sample_requests() {
        let mut whole = BytesMut::new();
        encode_request(1, &request, &mut whole);
        for cut in 0..whole.len() {
            let mut part = BytesMut::from(&whole[..cut]);
            assert!(
                split_frame(&mut part).unwrap().is_none(),
                "{request:?} cut at {cut}"
            );
            assert_eq!(part.len(), cut, "a partial frame must not be consumed");
        }
    }
}

/// A frame whose length prefix is intact but whose body is cut short at every point is a
/// per-frame error, never a panic or a misread.
#[test]
fn every_truncated_body_is_a_frame_error() {
    for request in sample_requests() {
        let mut whole = BytesMut::new();
        encode_request(1, &request, &mut whole);
        let (opcode, _, body) = split_frame(&mut whole).unwrap().unwrap();
        for cut in 0..body.len() {
            // The one exception: CLUSTER_STATUS's flags byte is optional, so its extended
            // form cut before it is the plain form.
            if request == (Request::ClusterStatus { extended: true }) && cut == 0 {
                let plain = decode_request(opcode, body.slice(..cut)).unwrap();
                assert_eq!(plain, Request::ClusterStatus { extended: false });
                continue;
            }
            // Likewise INSPECT's flags byte: cut before it, the plain INSPECT of that key.
            if let Request::Inspect { key, kinds: true } = &request {
                if cut == body.len() - 1 {
                    let plain = decode_request(opcode, body.slice(..cut)).unwrap();
                    let key = key.clone();
                    assert_eq!(plain, Request::Inspect { key, kinds: false });
                    continue;
                }
            }
            // And SESSION_OPEN's session id: cut before it, an open without one.
            if let Request::SessionOpen {
                ttl_ms,
                session_id: Some(_),
            } = request
            {
                if cut == 4 {
                    let plain = decode_request(opcode, body.slice(..cut)).unwrap();
                    let session_id = None;
                    assert_eq!(plain, Request::SessionOpen { ttl_ms, session_id });
                    continue;
                }
            }
            let err = decode_request(opcode, body.slice(..cut)).unwrap_err();
            assert_eq!(
                err.code,
                ErrorCode::BadFrame,
                "{request:?} body cut at {cut}: {err}"
            );
        }
    }
    for response in sample_responses() {
        let mut whole = BytesMut::new();
        encode_response(1, &response, &mut whole);
        let (opcode, _, body) = split_frame(&mut whole).unwrap().unwrap();
        for cut in 0..body.len() {
            // The one exception: a CLUSTER reply cut right before its optional extension
            // is the reply without it.
            if let Response::Cluster(
                status @ Status {
                    extension: Some(_), ..
                },
            ) = &response
            {
                if cut == body.len() - 2 - STATUS_EXTENSION_LEN {
                    let plain = decode_response(opcode, body.slice(..cut)).unwrap();
                    let expected = Status {
                        extension: None,
                        ..status.clone()
                    };
                    assert_eq!(plain, Response::Cluster(expected));
                    continue;
                }
            }
            assert!(
                decode_response(opcode, body.slice(..cut)).is_err(),
                "{response:?} cut at {cut}"
            );
        }
    }
}

#[test]
fn trailing_bytes_are_rejected() {
    let mut buf = BytesMut::new();
    encode_request(1, &Request::Ping, &mut buf);
    let (opcode, _, _) = split_frame(&mut buf).unwrap().unwrap();
    let one = decode_request(opcode, Bytes::from_static(b"x")).unwrap_err();
    assert_eq!(one.code, ErrorCode::BadFrame);
    assert_eq!(one.message, "1 unexpected byte after the body");
    let three = decode_request(opcode, Bytes::from_static(b"xyz")).unwrap_err();
    assert_eq!(three.message, "3 unexpected bytes after the body");
}

#[test]
fn over_limit_length_prefix_is_fatal_before_buffering() {
    for len in [FRAME_LEN_MAX + 1, FRAME_LEN_MAX * 2, u32::MAX as usize] {
        let mut buf = BytesMut::new();
        buf.put_u32(len as u32);
        let err = split_frame(&mut buf).unwrap_err();
        assert!(
            matches!(err, ProtocolError::FrameTooLarge { .. }),
            "{len}: {err}"
        );
        assert!(
            buf.capacity() < 64 * 1024,
            "must not reserve for an over-long frame"
        );
    }
    for len in 0..FRAME_LEN_MIN {
        let mut buf = BytesMut::new();
        buf.put_u32(len as u32);
        let err = split_frame(&mut buf).unwrap_err();
        assert!(matches!(err, ProtocolError::FrameTooShort { .. }));
        assert_eq!(err.code(), Some(ErrorCode::FrameTooShort));
    }
    // Exactly at the limit is accepted (as a frame; its body is then judged on its own).
    let mut buf = BytesMut::new();
    buf.put_u32(FRAME_LEN_MAX as u32);
    buf.put_u8(0x01);
    buf.put_u64(7);
    buf.put_bytes(0, FRAME_LEN_MAX - FRAME_LEN_MIN);
    let (opcode, id, body) = split_frame(&mut buf).unwrap().unwrap();
    assert_eq!((opcode, id), (0x01, 7));
    assert_eq!(
        decode_request(opcode, body).unwrap_err().code,
        ErrorCode::BadFrame
    );
}

#[test]
fn field_limits_are_enforced() {
    let lease_id = LeaseId::default();
    let cases: Vec<(Request, ErrorCode)> = vec![
        (
            Request::Inspect {
                key: key(0),
                kinds: Default::default(),
            },
            ErrorCode::BadKey,
        ),
        (
            Request::Inspect {
                key: key(KEY_LEN_MAX + 1),
                kinds: Default::default(),
            },
            ErrorCode::BadKey,
        ),
        (
            Request::Renew {
                key: key(1),
                lease_id,
                ttl_ms: TTL_MS_MIN - 1,
            },
            ErrorCode::BadTtl,
        ),
        (
            Request::Renew {
                key: key(1),
                lease_id,
                ttl_ms: TTL_MS_MAX + 1,
            },
            ErrorCode::BadTtl,
        ),
        (
            Request::Acquire {
                key: key(1),
                ttl_ms: 1000,
                wait_ms: WAIT_MS_MAX + 1,
                release_on_disconnect: false,
                meta: Bytes::new(),
                acquire_id: None,
                kind: Default::default(),
                session_id: None,
            },
            ErrorCode::BadWait,
        ),
        (
            Request::Acquire {
                key: key(1),
                ttl_ms: 1000,
                wait_ms: 0,
                release_on_disconnect: false,
                meta: Bytes::from(vec![0; META_LEN_MAX + 1]),
                acquire_id: None,
                kind: Default::default(),
                session_id: None,
            },
            ErrorCode::MetaTooLong,
        ),
    ];
    for (request, code) in cases {
        assert_eq!(request.validate().unwrap_err().code, code, "{request:?}");
        // The decoder applies the same checks to what arrives on the wire.
        let mut buf = BytesMut::new();
        encode_request(1, &request, &mut buf);
        let (opcode, _, body) = split_frame(&mut buf).unwrap().unwrap();
        assert_eq!(decode_request(opcode, body).unwrap_err().code, code);
    }
}

#[test]
fn unknown_opcode_and_flags() {
    assert_eq!(
        decode_request(0x7f, Bytes::new()).unwrap_err().code,
        ErrorCode::UnknownOpcode
    );
    let mut body = BytesMut::new();
    body.put_u16(1);
    body.put_u8(b'k');
    body.put_u32(1000);
    body.put_u32(0);
    body.put_u8(0x80); // an unknown flag
    body.put_u16(0);
    let err = decode_request(0x02, body.freeze()).unwrap_err();
    assert_eq!(err.code, ErrorCode::BadFrame);
}

/// The all-zero acquire id is not 128 random bits (every client that forgot to pick one would
/// share it): BAD_ARGS, as a field out of range.
#[test]
fn the_all_zero_acquire_id_is_bad_args() {
    let mut body = BytesMut::new();
    body.put_u16(1);
    body.put_u8(b'k');
    body.put_u32(1000);
    body.put_u32(0);
    body.put_u8(0x02);
    body.put_u16(0);
    body.put_slice(&[0; 16]);
    let err = decode_request(0x02, body.freeze()).unwrap_err();
    assert_eq!(err.code, ErrorCode::BadArgs);
}

/// ACQUIRE's flag bit 1 announces a 16-byte acquire id after `meta`: one byte short of it, or
/// one byte more, is malformed; without the flag the id's bytes are trailing garbage.
#[test]
fn an_acquire_id_is_exactly_sixteen_bytes_after_meta() {
    let body = |flags: u8, id_len: usize| {
        let mut body = BytesMut::new();
        body.put_u16(1);
        body.put_u8(b'k');
        body.put_u32(1000);
        body.put_u32(0);
        body.put_u8(flags);
        body.put_u16(0);
        body.put_slice(&vec![0xab; id_len]);
        body.freeze()
    };
    let Request::Acquire { acquire_id, .. } = decode_request(0x02, body(0x02, 16)).unwrap() else {
        panic!("an ACQUIRE");
    };
    assert_eq!(acquire_id, Some(tenure_protocol::AcquireId([0xab; 16])));
    for (flags, id_len) in [(0x02, 15), (0x02, 17), (0x02, 0), (0x00, 16)] {
        let err = decode_request(0x02, body(flags, id_len)).unwrap_err();
        assert_eq!(
            err.code,
            ErrorCode::BadFrame,
            "flags {flags:#x}, {id_len} bytes"
        );
    }
}

/// With both flag bits 1 and 3 set, the acquire id comes first after `meta`, then the kind
/// fields (increasing flag-bit order, PROTOCOL.md 3.2), byte for byte.
#[test]
fn an_acquire_id_comes_before_the_kind_fields() {
    let request = Request::Acquire {
        key: Bytes::from_static(b"k"),
        ttl_ms: 1000,
        wait_ms: 0,
        release_on_disconnect: false,
        meta: Bytes::new(),
        acquire_id: Some(tenure_protocol::AcquireId([0xab; 16])),
        kind: tenure_protocol::LeaseKind::Permits { count: 2, limit: 5 },
        session_id: None,
    };
    let mut buf = BytesMut::new();
    encode_request(9, &request, &mut buf);
    let (opcode, _, body) = split_frame(&mut buf).unwrap().unwrap();
    let mut expected = BytesMut::new();
    expected.put_u16(1);
    expected.put_u8(b'k');
    expected.put_u32(1000);
    expected.put_u32(0);
    expected.put_u8(0x0a);
    expected.put_u16(0);
    expected.put_slice(&[0xab; 16]);
    expected.put_u8(tenure_protocol::kind::KIND_PERMITS);
    expected.put_u32(2);
    expected.put_u32(5);
    assert_eq!(&body[..], &expected[..]);
    assert_eq!(decode_request(opcode, body).unwrap(), request);
}

#[test]
fn error_codes_round_trip_and_unknown_maps_to_unknown() {
    for code in ErrorCode::ALL {
        assert_eq!(ErrorCode::from_u16(code as u16), code);
    }
    assert_eq!(ErrorCode::from_u16(60_000), ErrorCode::Unknown);
}

#[test]
fn long_error_message_is_cut_on_a_char_boundary() {
    let message = "é".repeat(ERROR_MESSAGE_LEN_MAX);
    let mut buf = BytesMut::new();
    encode_response(
        1,
        &Response::Error {
            code: ErrorCode::BadArgs,
            message,
        },
        &mut buf,
    );
    let (opcode, _, body) = split_frame(&mut buf).unwrap().unwrap();
    match decode_response(opcode, body).unwrap() {
        Response::Error { message, .. } => {
            assert!(message.len() <= ERROR_MESSAGE_LEN_MAX && !message.contains('\u{FFFD}'))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn handshake_round_trip_and_bad_magic() {
    let mut buf = BytesMut::new();
    Hello { version: VERSION }.encode(&mut buf);
    for cut in 0..buf.len() {
        assert!(Hello::decode(&mut BytesMut::from(&buf[..cut]))
            .unwrap()
            .is_none());
    }
    assert_eq!(
        Hello::decode(&mut buf).unwrap(),
        Some(Hello { version: VERSION })
    );
    let ack = HelloAck {
        version: VERSION,
        limits: ServerLimits::with(128, 60_000),
    };
    let mut buf = BytesMut::new();
    ack.encode(&mut buf);
    assert_eq!(buf.len(), 34);
    for cut in 0..buf.len() {
        assert!(HelloAck::decode(&mut BytesMut::from(&buf[..cut]))
            .unwrap()
            .is_none());
    }
    assert_eq!(HelloAck::decode(&mut buf).unwrap(), Some(ack));
    let mut bad = BytesMut::from(&b"PING\r\nxx"[..]);
    assert!(Hello::decode(&mut bad).is_err());
}

#[test]
fn handshake_flags_are_reserved_and_limits_extend() {
    let flagged = [0x00, b'T', b'N', b'R', 0, 1, 0x80, 0];
    assert!(matches!(
        Hello::decode(&mut BytesMut::from(&flagged[..])),
        Err(ProtocolError::BadHandshake(_))
    ));
    // A later server may append limits: they are skipped, and what follows stays in the buffer.
    let mut buf = BytesMut::new();
    let ack = HelloAck {
        version: VERSION,
        limits: ServerLimits::with(9, 1000),
    };
    ack.encode(&mut buf);
    buf[9] += 4;
    buf.extend_from_slice(&[1, 2, 3, 4, 0xEE]);
    assert_eq!(HelloAck::decode(&mut buf).unwrap(), Some(ack));
    assert_eq!(&buf[..], &[0xEE]);
    // A refusal, byte by byte.
    let mut buf = BytesMut::new();
    HelloAck::encode_refusal(VERSION, ErrorCode::BadHandshake, "no", &mut buf);
    assert_eq!(
        &buf[..],
        &[0, b'T', b'N', b'R', 0, 1, 0, 14, 0, 2, b'n', b'o']
    );
    match HelloAck::decode(&mut buf) {
        Err(ProtocolError::HandshakeRefused {
            version,
            code,
            message,
        }) => assert_eq!(
            (version, code, &*message),
            (VERSION, ErrorCode::BadHandshake, "no")
        ),
        other => panic!("{other:?}"),
    }
    // A frame limit that cannot hold every request is not accepted.
    let mut buf = BytesMut::new();
    let small = ServerLimits {
        frame_len_max: 100,
        ..ServerLimits::with(9, 1000)
    };
    HelloAck {
        version: VERSION,
        limits: small,
    }
    .encode(&mut buf);
    assert!(HelloAck::decode(&mut buf).is_err());
}

/// A seeded stand-in for a fuzzer (the stable toolchain has no libFuzzer): mutate valid frames
/// and make up random ones, and feed them to the decoders. Nothing may panic, and whatever
/// decodes must encode back to bytes that decode to the same request.
#[test]
fn mutated_and_random_frames_never_panic_and_round_trip() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("TENURE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x7e0e);
    let rounds: usize = std::env::var("TENURE_FUZZ_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50_000);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut seeds = Vec::new();
    for request in sample_requests() {
        let mut buf = BytesMut::new();
        encode_request(rng.random(), &request, &mut buf);
        seeds.push(buf.to_vec());
    }
    for response in sample_responses() {
        let mut buf = BytesMut::new();
        encode_response(rng.random(), &response, &mut buf);
        seeds.push(buf.to_vec());
    }
    let mut decoded = 0usize;
    for round in 0..rounds {
        let mut bytes = if rng.random_bool(0.1) {
            (0..rng.random_range(0..64)).map(|_| rng.random()).collect()
        } else {
            seeds[rng.random_range(0..seeds.len())].clone()
        };
        for _ in 0..rng.random_range(1..4) {
            if bytes.is_empty() {
                break;
            }
            let at = rng.random_range(0..bytes.len());
            match rng.random_range(0..4) {
                0 => bytes[at] = rng.random(),
                1 => bytes[at] ^= 1 << rng.random_range(0..8),
                2 => bytes.truncate(at),
                _ => bytes.insert(at, rng.random()),
            }
        }
        let context = format!("seed {seed} round {round}: {bytes:02x?}");
        let mut buf = BytesMut::from(&bytes[..]);
        // Both decoders see every frame; at most one of them may like it.
        while let Ok(Some((opcode, id, body))) = split_frame(&mut buf) {
            if let Ok(request) = decode_request(opcode, body.clone()) {
                decoded += 1;
                let mut again = BytesMut::new();
                encode_request(id, &request, &mut again);
                let (opcode2, id2, body2) = split_frame(&mut again).unwrap().unwrap();
                assert_eq!((opcode2, id2), (opcode, id), "{context}");
                assert_eq!(
                    decode_request(opcode2, body2).unwrap(),
                    request,
                    "{context}"
                );
            }
            let _ = decode_response(opcode, body);
        }
        let _ = Hello::decode(&mut BytesMut::from(&bytes[..]));
        let _ = HelloAck::decode(&mut BytesMut::from(&bytes[..]));
    }
    // Mutations that keep a frame valid (a changed key byte, ttl, id) must be common, or the
    // round-trip check above would be testing nothing.
    assert!(
        decoded > rounds / 20,
        "only {decoded} of {rounds} mutated frames decoded"
    );
}

#[test]
fn watching_matches_the_example_in_protocol_md() {
    let mut out = BytesMut::new();
    let holder = Holder {
        token: 12,
        ttl_left_ms: 250,
        waiters: 0,
        meta: Bytes::from_static(b"ab"),
    };
    let watching = Response::Watching {
        holder: Some(holder),
    };
    tenure_protocol::frame::encode_response(7, &watching, &mut out);
    let expected: &[u8] = &[
        0, 0, 0, 0x1e, 0x8d, 0, 0, 0, 0, 0, 0, 0, 7, 1, 0, 0, 0, 0, 0, 0, 0, 0x0c, 0, 0, 0, 0xfa,
        0, 0, 0, 0, 0, 2, b'a', b'b',
    ];
    assert_eq!(&out[..], expected);
    let mut free = BytesMut::new();
    let watching = Response::Watching { holder: None };
    tenure_protocol::frame::encode_response(7, &watching, &mut free);
    assert_eq!(&free[4..], &[0x8d, 0, 0, 0, 0, 0, 0, 0, 7, 0]);
}

/// CLUSTER_STATUS without flags is the empty body every server knows, and its reply has no
/// extension: a client that never asks for it parses exactly the layout it always did. With
/// flags the body is one byte; unknown flag bits are refused.
#[test]
fn cluster_status_asks_for_the_extension_with_a_flags_byte() {
    let mut buf = BytesMut::new();
    encode_request(3, &Request::ClusterStatus { extended: false }, &mut buf);
    assert_eq!(&buf[..], &[0, 0, 0, 9, 0x0b, 0, 0, 0, 0, 0, 0, 0, 3]);
    let mut buf = BytesMut::new();
    encode_request(3, &Request::ClusterStatus { extended: true }, &mut buf);
    assert_eq!(&buf[..], &[0, 0, 0, 10, 0x0b, 0, 0, 0, 0, 0, 0, 0, 3, 0x01]);
    for flags in [0x02u8, 0x81] {
        let e = decode_request(0x0b, Bytes::from(vec![flags])).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadFrame, "{flags:#x}");
    }
    let plain = cluster_status();
    let mut without = BytesMut::new();
    encode_response(1, &Response::Cluster(plain.clone()), &mut without);
    let extended = Status {
        extension: Some(Box::new(extension())),
        ..plain
    };
    let mut with = BytesMut::new();
    encode_response(1, &Response::Cluster(extended), &mut with);
    // The extension only appends: ext_len, then its fields, after the members.
    let tail = &with[without.len()..];
    assert_eq!(&tail[..2], &[0, 24]);
    assert_eq!(&tail[2..10], &[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(&tail[10..18], &[0; 8]);
    assert_eq!(&tail[18..], &42u64.to_be_bytes());
    assert_eq!(
        &with[4..without.len()],
        &without[4..],
        "same fields before it"
    );
}

/// A later server may append fields to the extension: they are skipped. An extension
/// shorter than this version's fields, or whose length is not the rest of the body, is refused.
#[test]
fn cluster_extension_skips_later_fields_and_refuses_short_ones() {
    let mut buf = BytesMut::new();
    let status = Status {
        extension: Some(Box::new(extension())),
        ..cluster_status()
    };
    encode_response(1, &Response::Cluster(status.clone()), &mut buf);
    let (opcode, _, body) = split_frame(&mut buf).unwrap().unwrap();
    let at = body.len() - 26;
    let mut longer = body[..at].to_vec();
    longer.put_u16(24 + 5);
    longer.extend_from_slice(&body[at + 2..]);
    longer.extend_from_slice(&[9; 5]);
    let decoded = decode_response(opcode, Bytes::from(longer)).unwrap();
    assert_eq!(decoded, Response::Cluster(status));
    let mut short = body[..at].to_vec();
    short.put_u16(16);
    short.extend_from_slice(&body[at + 2..at + 18]);
    let e = decode_response(opcode, Bytes::from(short)).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadFrame);
    let mut lying = body.to_vec();
    lying.push(0);
    let e = decode_response(opcode, Bytes::from(lying)).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadFrame);
}

/// The session frames, byte by byte as PROTOCOL.md 3.11 lays them out, and ACQUIRE's flag bit
/// 2: a session id of exactly 16 bytes after the acquire id.
#[test]
fn session_frames_are_laid_out_as_documented() {
    let session_id = tenure_protocol::SessionId::from_u128(0x0102);
    let frame = |request: &Request| {
        let mut buf = BytesMut::new();
        encode_request(7, request, &mut buf);
        buf.to_vec()
    };
    let open = frame(&Request::SessionOpen {
        ttl_ms: 10_000,
        session_id: None,
    });
    assert_eq!(open[..5], [0, 0, 0, 13, 0x0f]);
    assert_eq!(open[13..], 10_000u32.to_be_bytes());
    // With the client's session id: the TTL, then the 16 bytes.
    let open = frame(&Request::SessionOpen {
        ttl_ms: 10_000,
        session_id: Some(session_id),
    });
    assert_eq!(open[..5], [0, 0, 0, 29, 0x0f]);
    assert_eq!(open[13..17], 10_000u32.to_be_bytes());
    assert_eq!(open[17..], session_id.0);
    let keep = frame(&Request::SessionKeepalive { session_id });
    assert_eq!(
        (keep[3], keep[4], &keep[13..]),
        (25, 0x10, &session_id.0[..])
    );
    let close = frame(&Request::SessionClose { session_id });
    assert_eq!((close[3], close[4]), (25, 0x11));
    for response in [
        Response::Session {
            session_id,
            ttl_ms: 10_000,
        },
        Response::SessionClosed { released: 3 },
    ] {
        let mut buf = BytesMut::new();
        encode_response(7, &response, &mut buf);
        let len = if matches!(response, Response::Session { .. }) {
            29
        } else {
            13
        };
        assert_eq!(buf.len(), 4 + len);
        let (opcode, id, body) = split_frame(&mut buf).unwrap().unwrap();
        assert_eq!(id, 7);
        assert_eq!(decode_response(opcode, body).unwrap(), response);
    }
    // Wrong sizes are malformed.
    assert_eq!(
        decode_request(0x10, Bytes::from_static(&[0; 15]))
            .unwrap_err()
            .code,
        ErrorCode::BadFrame
    );
    assert_eq!(
        decode_request(0x0f, Bytes::from_static(&[0, 0, 0x27, 0x10, 0]))
            .unwrap_err()
            .code,
        ErrorCode::BadFrame
    );
    assert_eq!(
        decode_request(0x0f, Bytes::from_static(&[0, 0, 0, 1]))
            .unwrap_err()
            .code,
        ErrorCode::BadTtl
    );
    // An id cut short, or one byte too many, is malformed; an all-zero id is refused.
    let mut body = vec![0, 0, 0x27, 0x10];
    body.extend([7; 15]);
    for body in [body.clone(), [body.clone(), vec![7, 7]].concat()] {
        let e = decode_request(0x0f, Bytes::from(body)).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadFrame, "{e:?}");
    }
    let mut zero = vec![0, 0, 0x27, 0x10];
    zero.extend([0; 16]);
    let e = decode_request(0x0f, Bytes::from(zero)).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadArgs, "{e:?}");
    // ACQUIRE with acquire id and session: acquire id first, then the session id.
    let acquire = Request::Acquire {
        key: Bytes::from_static(b"k"),
        ttl_ms: 0,
        wait_ms: 0,
        release_on_disconnect: false,
        meta: Bytes::new(),
        acquire_id: Some(tenure_protocol::AcquireId([0xaa; 16])),
        session_id: Some(session_id),
        kind: Default::default(),
    };
    let bytes = frame(&acquire);
    assert_eq!(bytes[4 + 9 + 3 + 8], 0x06, "flags");
    assert_eq!(bytes[bytes.len() - 32..bytes.len() - 16], [0xaa; 16]);
    assert_eq!(bytes[bytes.len() - 16..], session_id.0);
    let mut buf = BytesMut::from(&bytes[..]);
    let (opcode, _, body) = split_frame(&mut buf).unwrap().unwrap();
    assert_eq!(decode_request(opcode, body.clone()).unwrap(), acquire);
    // One byte short of the session id.
    let short = body.slice(..body.len() - 1);
    assert_eq!(
        decode_request(opcode, short).unwrap_err().code,
        ErrorCode::BadFrame
    );
    // A session lease takes ttl_ms 0, and no release on disconnect.
    let mut with_ttl = acquire.clone();
    if let Request::Acquire { ttl_ms, .. } = &mut with_ttl {
        *ttl_ms = 1000;
    }
    assert_eq!(with_ttl.validate().unwrap_err().code, ErrorCode::BadTtl);
    let mut on_disconnect = acquire;
    if let Request::Acquire {
        release_on_disconnect,
        ..
    } = &mut on_disconnect
    {
        *release_on_disconnect = true;
    }
    assert_eq!(
        on_disconnect.validate().unwrap_err().code,
        ErrorCode::BadFrame
    );
}
