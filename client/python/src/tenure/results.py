"""Typed results of every operation. LOCKED, LOST, NOT_OWNER and STALE are outcomes here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Union

#: The server counts whole milliseconds, rounded down: a lease's start can read up to 1 ms
#: early and `waited_ms` up to 1 ms long, so local deadlines are taken at least 2 ms earlier
#: than the sum (PROTOCOL.md 3.3).
SERVER_ROUNDING_S = 0.002

#: Local deadlines also give up this fraction (0.1 %) of the span they count, for the
#: difference in rate between this machine's monotonic clock and the server's (or, in a
#: cluster, the next leader's); NTP keeps it well below this.
CLOCK_RATE_SLACK = 0.001


def deadline_margin_s(span_ms: int) -> float:
    """What a local deadline `span_ms` (wait plus TTL) after the send gives up, in seconds:
    the larger of the server's 2 ms rounding and 0.1 % of the span."""
    return max(SERVER_ROUNDING_S, span_ms / 1000.0 * CLOCK_RATE_SLACK)


def local_deadline(sent_at: float, waited_ms: int, ttl_ms: int) -> float:
    """The instant (time.monotonic) a lease ends at the latest by the server's clock.

    `sent_at` is taken before the request was sent; the server took it up later, so counting
    from it never over-estimates the lease. `waited_ms` is the time a blocking acquire spent in
    line on the server before it was granted.
    """
    span_ms = waited_ms + ttl_ms
    return sent_at + span_ms / 1000.0 - deadline_margin_s(span_ms)


@dataclass(frozen=True)
class Granted:
    """ACQUIRE answered GRANTED: this client holds `key` until `deadline` unless it renews.

    `deadline` is a `time.monotonic()` instant counted from before the request was sent, plus
    the server's `waited_ms`, plus `ttl_ms`, less `deadline_margin_s` (2 ms, or 0.1 % of a span
    over 2 s): never later than the server's end of
    the lease.
    """

    key: bytes
    #: The fencing token: larger than every token granted before. Send it with every write.
    token: int
    #: 16 bytes naming this lease; RENEW and RELEASE present it.
    lease_id: bytes
    ttl_ms: int
    #: How long the request waited in line on the server before the grant.
    waited_ms: int
    deadline: float
    release_on_disconnect: bool = False

    @property
    def lease_id_hex(self) -> str:
        """The lease id as the console writes it: 32 lowercase hex digits."""
        return self.lease_id.hex()

    def time_left(self) -> float:
        """Seconds until the local deadline; 0 once it passed."""
        return max(0.0, self.deadline - time.monotonic())

    def is_expired(self) -> bool:
        """True once the local deadline passed (the server may have granted the key again)."""
        return time.monotonic() >= self.deadline


#: A granted lease; the same class as `Granted`.
Lease = Granted


@dataclass(frozen=True)
class Locked:
    """ACQUIRE answered LOCKED: someone else holds the key (and the wait, if any, ran out)."""

    #: The holder's fencing token.
    token: int
    #: The holder's time left, by the server's clock.
    ttl_left_ms: int


@dataclass(frozen=True)
class Renewed:
    """RENEW answered RENEWED: the lease now runs `ttl_ms` from the renewal."""

    ttl_ms: int
    #: The new local deadline (time.monotonic), counted from before the RENEW was sent.
    deadline: float


@dataclass(frozen=True)
class Lost:
    """RENEW answered LOST: the lease ran out or was released; the key may be someone else's."""


@dataclass(frozen=True)
class Released:
    """RELEASE answered RELEASED: the key is free (or handed to the next waiter)."""


@dataclass(frozen=True)
class NotOwner:
    """RELEASE answered NOT_OWNER: this lease no longer held the key; nothing changed."""


@dataclass(frozen=True)
class Free:
    """INSPECT (or WATCH) found the key free."""


@dataclass(frozen=True)
class Held:
    """INSPECT (or WATCH) found the key held."""

    token: int
    ttl_left_ms: int
    waiters: int
    meta: bytes = b""


@dataclass(frozen=True)
class Current:
    """CHECK answered CURRENT: the token is the one of the lease holding the key now."""


@dataclass(frozen=True)
class Stale:
    """CHECK answered STALE: the token is not the current holder's."""


class EventKind(enum.IntEnum):
    """What changed in a watched key."""

    GRANTED = 1
    RELEASED = 2
    EXPIRED = 3


@dataclass(frozen=True)
class Event:
    """A change of a watched key (PROTOCOL.md 3.4)."""

    kind: EventKind
    key: bytes
    token: int
    meta: bytes = b""


@dataclass(frozen=True)
class Leader:
    """The leader of an election group as an observer sees it."""

    #: The leader's term: the fencing token of its grant.
    term: int
    #: The value the leader campaigned with.
    value: bytes = field(default=b"")


AcquireResult = Union[Granted, Locked]
RenewResult = Union[Renewed, Lost]
ReleaseResult = Union[Released, NotOwner]
KeyState = Union[Free, Held]
CheckResult = Union[Current, Stale]
