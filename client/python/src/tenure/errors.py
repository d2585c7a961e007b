"""Exceptions. Outcomes such as LOCKED, LOST, NOT_OWNER and STALE are results, not errors."""

from __future__ import annotations

from typing import Dict, Optional, Type


class TenureError(Exception):
    """Base of every error this package raises."""


class InvalidArgument(TenureError, ValueError):
    """An argument outside the protocol's limits; nothing was sent."""


class ConnectionLost(TenureError, ConnectionError):
    """The connection closed (or could not be opened) before the answer came.

    An ACQUIRE or RELEASE that met this may or may not have been applied: INSPECT (or retry
    a RELEASE) after reconnecting.
    """


class CannotConnect(ConnectionLost):
    """No connection could be opened: refused, unreachable, timed out, or TLS failed (the
    server was never reached, or is down now). The request was not sent, so it was not
    applied. A subclass of `ConnectionLost`, which code written before it still catches."""


class ProtocolError(TenureError):
    """The server sent a reply this client cannot read (not the opcode the request expects)."""


class HandshakeError(CannotConnect):
    """The server refused the handshake, or is not a tenure server. No request was sent on
    the connection, so none was applied: a `CannotConnect` (and so a `ConnectionLost`).

    `code` and `name` are the refusal's error code and name (PROTOCOL.md 3.5) when the
    server gave one, as at its connection limit (`CONNECTIONS_LIMIT`, 11); else `None`.
    """

    def __init__(self, message: str, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.code = code
        self.name = None if code is None else ERROR_NAMES.get(code, "UNKNOWN")


def refusal_code(line: bytes) -> Optional[int]:
    """The error code a console refusal line (`ERR <NAME> <reason>`) names, if it names one."""
    words = line.split(b"\n", 1)[0].split()
    if len(words) < 2 or words[0] != b"ERR":
        return None
    name = words[1].decode("ascii", "replace")
    return next((code for code, known in ERROR_NAMES.items() if known == name and code), None)


class RequestTimeout(TenureError, TimeoutError):
    """No answer within the client's timeout. The request may still be applied later."""


class NotAcquired(TenureError):
    """`lock()` could not get the lock within its wait: someone else holds it."""

    def __init__(self, key: bytes, token: int, ttl_left_ms: int) -> None:
        super().__init__(
            f"lock {key!r} is held (holder's token {token}, {ttl_left_ms} ms left)"
        )
        self.key = key
        #: The holder's fencing token.
        self.token = token
        #: The holder's time left, by the server's clock.
        self.ttl_left_ms = ttl_left_ms


class AcquireEnded(TenureError):
    """An ACQUIRE whose first answer was lost was sent again with its acquire id, and the
    server says it had granted this very ACQUIRE and that lease has ended since (`how`:
    "released", "expired", "disconnected" or "session": its session ended). Nothing is held now and nothing was granted
    twice: acquire again to take the lock. Not transient."""

    def __init__(self, how: str, token: int) -> None:
        super().__init__(f"the acquire was granted (token {token}) and that lease has already ended: {how}")
        #: How the lease ended.
        self.how = how
        #: The ended lease's fencing token.
        self.token = token


class LeaseLost(TenureError):
    """A lease guard no longer holds its lock; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"lease lost: {reason}")
        self.reason = reason


class ServerError(TenureError):
    """An ERROR frame from the server. `code` is the number of PROTOCOL.md 3.5."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{ERROR_NAMES.get(code, 'UNKNOWN')} ({code}): {message}")
        self.code = code
        self.name = ERROR_NAMES.get(code, "UNKNOWN")
        self.message = message


ERROR_NAMES: Dict[int, str] = {
    0: "UNKNOWN",
    1: "BAD_FRAME",
    2: "FRAME_TOO_LARGE",
    3: "UNKNOWN_COMMAND",
    4: "BAD_KEY",
    5: "BAD_TTL",
    6: "BAD_WAIT",
    7: "META_TOO_LONG",
    8: "TOO_MANY_IN_FLIGHT",
    9: "HELD_LIMIT",
    10: "WAITERS_LIMIT",
    11: "CONNECTIONS_LIMIT",
    12: "UNAVAILABLE",
    13: "SHUTTING_DOWN",
    14: "BAD_HANDSHAKE",
    15: "WATCH_LIMIT",
    16: "BAD_ARGS",
    17: "LINE_TOO_LONG",
    18: "RECOVERING",
    19: "FRAME_TOO_SHORT",
    20: "UNAUTHENTICATED",
    21: "FORBIDDEN",
    22: "QUOTA",
    23: "NOT_LEADER",
    24: "CLUSTER_REFUSED",
    25: "NO_SESSION",
    26: "SESSIONS_LIMIT",
    27: "SESSION_LEASES_LIMIT",
    28: "SESSION_LEASE",
    29: "SESSION_MISMATCH",
    30: "KIND_MISMATCH",
    31: "BAD_PERMITS",
}


class BadRequest(ServerError):
    """The server found the request malformed (BAD_FRAME, BAD_KEY, BAD_TTL, BAD_ARGS, ...)."""


class LimitReached(ServerError):
    """A server limit refused the request (HELD_LIMIT, WAITERS_LIMIT, TOO_MANY_IN_FLIGHT...)."""


class Unavailable(ServerError):
    """UNAVAILABLE: the change could not be made durable."""


class ShuttingDown(ServerError):
    """SHUTTING_DOWN: the server is stopping."""


class Recovering(ServerError):
    """RECOVERING: token-only durability refuses grants for a while after a restart."""


class WatchLimit(ServerError):
    """WATCH_LIMIT: too many watches, or events not read fast enough; the watch ended."""


class Unauthenticated(ServerError):
    """UNAUTHENTICATED: no (or a failed) AUTH on a server with identities."""


class Forbidden(ServerError):
    """FORBIDDEN: the identity may not use this key or operation."""


class Quota(ServerError):
    """QUOTA: the identity holds or waits for as many locks as it may."""


class NotLeader(ServerError):
    """NOT_LEADER: this node of a cluster is not the leader (returned once redirects ran out)."""


class NoSession(ServerError):
    """NO_SESSION: the session id names no live session (closed, expired, never opened)."""


class ClusterRefused(ServerError):
    """CLUSTER_REFUSED: a cluster INIT, ADD or REMOVE was refused; the message says why."""


class KindMismatch(ServerError):
    """KIND_MISMATCH: the key is held or awaited as another kind (PROTOCOL.md 3.10): permits of
    a plain or read/write key, a plain or read lease of a semaphore, or a semaphore of another
    number of permits. The message says which; nothing changed."""


class BadPermits(BadRequest):
    """BAD_PERMITS: permit counts out of range (1 <= count <= permits <= 4096). Raised before
    sending for counts the client can check itself."""


_BY_CODE: Dict[int, Type[ServerError]] = {
    1: BadRequest,
    3: BadRequest,
    4: BadRequest,
    5: BadRequest,
    6: BadRequest,
    7: BadRequest,
    16: BadRequest,
    8: LimitReached,
    9: LimitReached,
    10: LimitReached,
    11: LimitReached,
    12: Unavailable,
    13: ShuttingDown,
    15: WatchLimit,
    18: Recovering,
    20: Unauthenticated,
    21: Forbidden,
    22: Quota,
    23: NotLeader,
    24: ClusterRefused,
    25: NoSession,
    26: LimitReached,
    27: LimitReached,
    28: BadRequest,
    29: BadRequest,
    30: KindMismatch,
    31: BadPermits,
}


def server_error(code: int, message: str) -> ServerError:
    """The exception for an ERROR frame."""
    return _BY_CODE.get(code, ServerError)(code, message)


def is_transient(error: Optional[BaseException]) -> bool:
    """Whether retrying later may succeed: the server went away, restarts or is electing."""
    if isinstance(error, (ConnectionLost, ShuttingDown, Recovering, NotLeader, Unavailable)):
        return True
    return isinstance(error, OSError)
