"""Counting semaphores and read/write locks (PROTOCOL.md 3.10): the `kind` an ACQUIRE carries,
the errors of a kind that does not fit, and INSPECT's answer by kind (HELD_KINDS).

Each permit and each read lease is a lease of its own, with its own lease id, renewal,
release and fencing token, so `client.semaphore(...)`, `client.read_lock(...)` and
`client.write_lock(...)` give the lock's own guard (`LeaseGuard` / `AsyncLeaseGuard`): the
same loss signals (`lost`, `check()`, `on_lost`), renewal and `token`.

Fencing reads and writes: a resource keeps the greatest write token it applied (`fence`) and
takes the token with every request::

    UPDATE accounts SET balance = :balance, fence = :t WHERE id = :id AND fence < :t;  -- write
    SELECT balance FROM accounts WHERE id = :id AND fence < :t;                        -- read

A write's token is greater than every read lease's before it (a writer is granted only once no
reader holds), so a reader paused past its lease, after which a writer wrote, reads no row.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Union

from . import _wire as w
from .errors import BadPermits, ProtocolError
from .results import Free, Held

#: ACQUIRE flag bit 3: a kind follows the other fields.
FLAG_KIND = 0x08
#: `kind` byte of a shared (read) lease.
KIND_SHARED = 1
#: `kind` byte of semaphore permits; `count u32` and `limit u32` follow.
KIND_PERMITS = 2
#: Most permits a semaphore key has (and most readers of one key).
PERMITS_MAX = 4096
#: INSPECT flag bit 0: answer a read/write or semaphore key with HELD_KINDS.
INSPECT_FLAG_KINDS = 0x01
#: HELD_KINDS reply opcode.
HELD_KINDS = 0x96
#: TTL of `semaphore()`, `read_lock()` and `write_lock()` when none is given, in seconds; the
#: guard renews every third of it.
DEFAULT_TTL = 30.0

#: The `kind` bytes of a read lease.
SHARED = bytes([KIND_SHARED])


def permits(count: int, limit: int) -> bytes:
    """The `kind` bytes of `count` permits of a semaphore of `limit`; `BadPermits` (raised
    before anything is sent) unless 1 <= count <= limit <= PERMITS_MAX."""
    for name, value in (("count", count), ("permits", limit)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadPermits(31, f"{name} is an int, not {value!r}")
    if not 1 <= limit <= PERMITS_MAX or not 1 <= count <= limit:
        raise BadPermits(31, f"permits {count} of {limit}: need 1 <= count <= limit <= {PERMITS_MAX}")
    return struct.pack(">BII", KIND_PERMITS, count, limit)


@dataclass(frozen=True)
class HeldKinds(Held):
    """INSPECT with kinds found a read/write or semaphore key held: HELD's fields (the newest
    holder's token and meta, the time until the first holder's lease ends, the waiters of
    every kind), then the key's holders and waiters by kind."""

    limit: int = 0
    """A semaphore's number of permits; 0 for a read/write key."""
    holders: int = 0
    in_use: int = 0
    """Permits held (a semaphore) or read leases (a read/write key)."""
    writer: bool = False
    waiting_shared: int = 0
    """Waiters for a read lease or permits."""
    waiting_exclusive: int = 0
    """Waiters for the key alone (writers)."""


def inspect_body(key: bytes) -> bytes:
    return w.bytes16(key) + bytes([INSPECT_FLAG_KINDS])


def parse_inspect(opcode: int, reply: bytes) -> Union[Free, Held, HeldKinds]:
    """FREE, HELD (a plain lock or a free-standing key) or HELD_KINDS; any other opcode is a
    `ProtocolError`."""
    r = w.Reader(reply)
    if opcode == w.FREE:
        return Free()
    if opcode == w.HELD:
        return Held(*w.parse_held(r))
    if opcode != HELD_KINDS:
        raise ProtocolError(f"reply opcode 0x{opcode:02x} to INSPECT with kinds")
    held = w.parse_held(r)
    limit, holders, in_use, writer, waiting_shared, waiting_exclusive = (
        r.u32(), r.u32(), r.u32(), r.u8(), r.u32(), r.u32()
    )
    return HeldKinds(*held, limit, holders, in_use, writer == 1, waiting_shared, waiting_exclusive)
