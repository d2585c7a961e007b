"""The binary protocol of protocol/PROTOCOL.md: handshake, frames, opcodes, limits.

Pure encoding and decoding, no I/O. Every integer is big-endian.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

MAGIC = b"\x00TNR"
VERSION = 1
HELLO = MAGIC + struct.pack(">HH", VERSION, 0)

#: Bytes of the handshake answer before its body.
HANDSHAKE_HEADER_LEN = 10
#: Largest handshake answer body a client accepts (PROTOCOL.md 2).
HANDSHAKE_BODY_MAX = 1024
#: Limits body of a version-1 accepted answer: six u32.
LIMITS_BODY_LEN = 24

#: Most bytes after a frame's length prefix, from either side.
FRAME_LEN_MAX = 8192
#: Opcode and request id.
FRAME_LEN_MIN = 9
#: The smallest `frame_len_max` a server may announce: the largest valid ACQUIRE (maximal
#: key and metadata, an acquire id, a session id and a semaphore's kind fields).
FRAME_LEN_MAX_FLOOR = 2111

KEY_LEN_MAX = 1024
META_LEN_MAX = 1024
TTL_MS_MIN = 10
TTL_MS_MAX = 86_400_000
WAIT_MS_MAX = 3_600_000
AUTH_NAME_LEN_MAX = 64
AUTH_SECRET_LEN_MAX = 256
U32_MAX = 0xFFFF_FFFF

# Request opcodes (bit 7 clear).
PING = 0x01
ACQUIRE = 0x02
RENEW = 0x03
RELEASE = 0x04
INSPECT = 0x05
CHECK = 0x06
STATS = 0x07
WATCH = 0x08
UNWATCH = 0x09
AUTH = 0x0A
SESSION_OPEN = 0x0F
SESSION_KEEPALIVE = 0x10
SESSION_CLOSE = 0x11

# Response opcodes (bit 7 set).
PONG = 0x81
GRANTED = 0x82
LOCKED = 0x83
RENEWED = 0x84
LOST = 0x85
RELEASED = 0x86
NOT_OWNER = 0x87
FREE = 0x88
HELD = 0x89
CURRENT = 0x8A
STALE = 0x8B
STATS_REPLY = 0x8C
WATCHING = 0x8D
UNWATCHED = 0x8E
AUTHENTICATED = 0x8F
SESSION = 0x93
SESSION_CLOSED = 0x94
EVENT = 0xA0
ERROR = 0xFF

#: ACQUIRE flag: free the lock when the acquiring connection closes.
FLAG_RELEASE_ON_DISCONNECT = 0x01
#: ACQUIRE flag: a 16-byte acquire id follows `meta` (PROTOCOL.md 3.9).
FLAG_ACQUIRE_ID = 0x02
#: A repeated ACQUIRE's lease, still running: token, lease id, time left (PROTOCOL.md 3.9).
REGRANTED = 0x91
#: A repeated ACQUIRE's lease has ended: how (1 released, 2 expired, 3 disconnected), token.
ACQUIRE_ENDED = 0x92
#: ACQUIRE_ENDED's `how`, by number.
ENDED_HOW = {1: "released", 2: "expired", 3: "disconnected", 4: "session"}
#: ACQUIRE flag: a 16-byte session id follows `meta` (and the acquire id); the lease lives
#: while that session does (PROTOCOL.md 3.11).
FLAG_SESSION = 0x04

#: ERROR code: the session id names no live session.
NO_SESSION = 25
#: RENEW of a lease held in a session (PROTOCOL.md 3.11).
SESSION_LEASE = 28

_HEADER = struct.Struct(">IBQ")


@dataclass(frozen=True)
class ServerLimits:
    """The limits a server announced in its handshake answer."""

    frame_len_max: int
    in_flight_max: int
    ttl_ms_max: int
    wait_ms_max: int
    key_len_max: int
    meta_len_max: int


class ProtocolViolation(Exception):
    """The peer sent bytes this protocol does not allow."""


def bytes16(data: bytes) -> bytes:
    """A u16 length followed by `data`."""
    return struct.pack(">H", len(data)) + data


def frame(opcode: int, request_id: int, body: bytes = b"") -> bytes:
    """One whole frame: length prefix, opcode, request id, body."""
    return _HEADER.pack(FRAME_LEN_MIN + len(body), opcode, request_id) + body


def acquire_body(
    key: bytes,
    ttl_ms: int,
    wait_ms: int,
    flags: int,
    meta: bytes,
    acquire_id: bytes = b"",
    session: bytes = b"",
) -> bytes:
    """An ACQUIRE's body; with `acquire_id` (16 bytes) flag bit 1 is set and the id follows
    `meta`; with a `session` id (16 bytes) flag bit 2 is set and it follows (after the acquire
    id: optional fields in increasing flag-bit order). A kind (bit 3) is the caller's to add
    after both."""
    if acquire_id:
        assert len(acquire_id) == 16, "an acquire id is 16 bytes"
        flags |= FLAG_ACQUIRE_ID
    if session:
        assert len(session) == 16, "a session id is 16 bytes"
        flags |= FLAG_SESSION
    head = bytes16(key) + struct.pack(">IIB", ttl_ms, wait_ms, flags) + bytes16(meta)
    return head + acquire_id + session


def with_wait(body: bytes, wait_ms: int) -> bytes:
    """An ACQUIRE body with its `wait_ms` replaced (a retry waits only what is left)."""
    at = 2 + int.from_bytes(body[:2], "big") + 4
    return body[:at] + struct.pack(">I", wait_ms) + body[at + 4 :]
def session_open_body(ttl_ms: int, session_id: bytes = b"") -> bytes:
    """SESSION_OPEN's body; with `session_id` (16 bytes, the client's pick), a resend finds
    the session an earlier send opened (PROTOCOL.md 3.11)."""
    return struct.pack(">I", ttl_ms) + session_id


def renew_body(key: bytes, lease_id: bytes, ttl_ms: int) -> bytes:
    return bytes16(key) + lease_id + struct.pack(">I", ttl_ms)


def release_body(key: bytes, lease_id: bytes) -> bytes:
    return bytes16(key) + lease_id


def check_body(key: bytes, token: int) -> bytes:
    return bytes16(key) + struct.pack(">Q", token)


def auth_body(name: bytes, secret: bytes) -> bytes:
    return bytes16(name) + bytes16(secret)


# Most bytes read of a console refusal sent in place of the handshake answer.
REFUSAL_LINE_MAX = 512


def is_console_refusal(header: bytes) -> bool:
    """Whether a handshake answer's first bytes begin the console line a server at its
    connection limit sends instead (`ERR CONNECTIONS_LIMIT ...`, PROTOCOL.md 2)."""
    return header[:4] != MAGIC and header.startswith(b"ERR ")


def refusal_text(line: bytes) -> str:
    """The words of a console refusal line, for the error raised."""
    text = line[:REFUSAL_LINE_MAX].split(b"\n", 1)[0].rstrip(b"\r")
    return "connection refused by server: " + text.decode("utf-8", "replace")


def parse_handshake_header(header: bytes) -> Tuple[int, int, int]:
    """(version, status, body_len) of a handshake answer's first 10 bytes.

    Raises ProtocolViolation when the magic is missing: a server at its connection limit
    answers with a console line instead (PROTOCOL.md 2).
    """
    if header[:4] != MAGIC:
        text = header.decode("utf-8", "replace")
        raise ProtocolViolation(f"not a tenure server (no tenure magic in its answer): {text!r}")
    version, status, body_len = struct.unpack(">HHH", header[4:10])
    if body_len > HANDSHAKE_BODY_MAX:
        raise ProtocolViolation(f"handshake body of {body_len} bytes: not a tenure server")
    return version, status, body_len


def parse_limits(body: bytes) -> ServerLimits:
    """The limits of an accepted handshake; later servers may append more, which are skipped."""
    if len(body) < LIMITS_BODY_LEN:
        raise ProtocolViolation(f"accepted handshake with a {len(body)}-byte body")
    limits = ServerLimits(*struct.unpack(">6I", body[:LIMITS_BODY_LEN]))
    if not FRAME_LEN_MAX_FLOOR <= limits.frame_len_max <= FRAME_LEN_MAX:
        raise ProtocolViolation(f"frame_len_max {limits.frame_len_max} out of range")
    if limits.in_flight_max == 0:
        # Every request would wait out its time-out (outside test a48, N11).
        raise ProtocolViolation("server allows no requests in flight")
    return limits


def check_version(version: int) -> None:
    """Refuses an accepted handshake in a version this client does not speak, as the Rust
    client does (outside test a48, N11: its requests waited out their time-outs)."""
    if version != VERSION:
        raise ProtocolViolation(f"server speaks protocol version {version}, this client speaks {VERSION}")


class Reader:
    """Reads the fields of one frame body in order."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise ProtocolViolation("frame body too short")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "big")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "big")

    def bytes16(self) -> bytes:
        return self.take(self.u16())


def parse_stats(body: bytes) -> List[Tuple[str, int]]:
    r = Reader(body)
    count = r.u16()
    pairs = []
    for _ in range(count):
        name = r.take(r.u8()).decode("ascii", "replace")
        pairs.append((name, r.u64()))
    return pairs


def parse_held(r: Reader) -> Tuple[int, int, int, bytes]:
    """token, ttl_left_ms, waiters, meta: the fields of HELD (and of a held WATCHING)."""
    return r.u64(), r.u32(), r.u32(), r.bytes16()


def parse_error(body: bytes) -> Tuple[int, str]:
    r = Reader(body)
    code = r.u16()
    return code, r.bytes16().decode("utf-8", "replace")


def leader_hint(message: str) -> Optional[Tuple[Optional[str]]]:
    """Where a NOT_LEADER message says the leader is.

    `(addr,)` for a known leader, `(None,)` for `leader=unknown`, None for another form.
    The word `leader=...` is looked for anywhere in the message, as the Rust client does.
    """
    for word in message.split():
        if word.startswith("leader="):
            rest = word[len("leader=") :]
            if not rest:
                return None
            return (None,) if rest == "unknown" else (rest,)
    return None
