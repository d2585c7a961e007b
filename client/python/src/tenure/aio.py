"""The asyncio client: `AsyncClient`, lease guards, watches and elections.

One `AsyncClient` keeps one connection and pipelines every request over it: many tasks may
call it at once, and replies are matched by request id. When the connection dies, requests in
flight fail with `ConnectionLost` and the next request reconnects, waiting an exponentially
growing, jittered delay after a failed attempt.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import random
import secrets
import ssl as ssl_module
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, NoReturn, Optional, Tuple, TypeVar, Union

from . import _wire as w
from . import semaphore as _kinds
from ._conn import Connection, WatchQueue
from .session import AsyncSession, AsyncSessionLock, SessionLock
from .errors import (
    AcquireEnded,
    BadRequest,
    CannotConnect,
    ConnectionLost,
    InvalidArgument,
    LeaseLost,
    NotAcquired,
    NotLeader,
    ProtocolError,
    RequestTimeout,
    ServerError,
    TenureError,
    is_transient,
    server_error,
)
from .results import (
    AcquireResult,
    CheckResult,
    Current,
    Event,
    EventKind,
    Free,
    Granted,
    Held,
    KeyState,
    Leader,
    Locked,
    Lost,
    NotOwner,
    Released,
    ReleaseResult,
    Renewed,
    RenewResult,
    Stale,
    local_deadline,
    deadline_margin_s,
)

log = logging.getLogger("tenure")
T = TypeVar("T")

#: Redirects one request may follow (NOT_LEADER) beyond one per address.
REDIRECTS_EXTRA = 3
#: Longest a request keeps looking for a leader (rounds of redirects, with pauses) before the
#: last NOT_LEADER is raised, if its own time-out is not shorter: a request sent mid-election
#: should be served by the new leader rather than fail.
LEADER_SEARCH_MAX_S = 10.0
#: Share of a request's time-out the leader search may use: the rest is left for its last
#: exchange, so that a search that found no leader ends with that NOT_LEADER (which says why,
#: e.g. a node removed from the cluster) rather than a bare time-out.
LEADER_SEARCH_SHARE = 0.8
#: Pause between rounds of redirects that found no leader, doubled per round up to the max.
ROUND_PAUSE_MIN_S = 0.05
ROUND_PAUSE_MAX_S = 0.4
#: Pause before trying the next address while a cluster elects its leader (`leader=unknown`).
ELECTION_PAUSE_S = 0.1
#: Pause before a candidate queues again after its wait was cut by a server restart.
CAMPAIGN_RETRY_PAUSE_S = 0.1
#: Pause before an observer watches again after its watch failed.
RESUBSCRIBE_DELAY_S = 0.1
#: Doublings of the reconnect delay before it stays at its maximum.
BACKOFF_DOUBLINGS_MAX = 20
#: Longest a request that keeps leases alive (a renewal, a session's keep-alive) waits for the
#: next reconnect attempt after a failed one, where other requests wait the whole backoff (up
#: to `reconnect_delay_max`): a restart shorter than a lease's time left must not outlast it
#: for want of an attempt. Attempts stay one at a time, so many leases still try at most once
#: per this delay.
RECONNECT_DELAY_KEEPING_MAX_S = 0.25
#: Shortest pause between renewal retries after a failed renewal.
RENEW_RETRY_MIN_S = 0.005

#: One request over a synchronous connection: (opcode, body, timeout) -> (opcode, reply).
DirectCall = Callable[[int, bytes, float], Tuple[int, bytes]]
#: Set by the blocking `Client` in its calling thread while it drives a call without the event
#: loop (see `Client._fast`); unset on the loop, so guards and watches never use it.
_DIRECT: "contextvars.ContextVar[Optional[DirectCall]]" = contextvars.ContextVar("tenure_direct", default=None)
#: The retry state of the ACQUIRE being sent, for the direct path's handling of a time-out.
_SENDING_ACQUIRE: "contextvars.ContextVar[Optional[_AcquireRetry]]" = contextvars.ContextVar(
    "tenure_sending_acquire", default=None
)


#: Hands a call to the client's loop from another thread, to run there by the given instant
#: (time.monotonic) at the latest: `post(fn, latest)`.
Post = Callable[[Callable[[], None], float], None]


class UseLoop(Exception):
    """Raised by the direct path before anything was sent: run the call on the event loop.
    `refused`: a NOT_LEADER message saying the outcome of the direct send is unknown, for the
    loop's search to report should it end without an answer of its own (a67, a68)."""

    def __init__(self, why: str, refused: Optional[str] = None) -> None:
        super().__init__(why)
        self.refused = refused


#: The `UseLoop.refused` of the direct send a call on the loop follows (set by the blocking
#: client around that call, read once by its first search).
REFUSED_BEFORE: "contextvars.ContextVar[Optional[str]]" = contextvars.ContextVar(
    "tenure_refused_before", default=None
)


Key = Union[str, bytes]
Meta = Union[str, bytes]


@dataclass(frozen=True)
class Credentials:
    """An identity's name and secret, sent in AUTH on every new connection."""

    name: str
    secret: bytes

    def __repr__(self) -> str:
        return f"Credentials(name={self.name!r}, secret=<hidden>)"


@dataclass(frozen=True)
class TlsOptions:
    """TLS to the server: trust only `ca_file`; present `cert_file`/`key_file` for mutual TLS.

    `server_name` is the name the server's certificate must carry (default: the host
    connected to). Pass `context` to use an `ssl.SSLContext` of your own instead.
    """

    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    server_name: Optional[str] = None
    context: Optional[ssl_module.SSLContext] = None

    def ssl_context(self) -> ssl_module.SSLContext:
        if self.context is not None:
            return self.context
        ctx = ssl_module.create_default_context(cafile=self.ca_file)
        ctx.minimum_version = ssl_module.TLSVersion.TLSv1_2
        if self.cert_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def _as_bytes(value: Union[str, bytes], what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgument(f"{what} must be str or bytes, not {type(value).__name__}")


def _seconds(value: Any, what: str) -> float:
    """A duration argument: an int or float of seconds, finite and not negative. Every entry
    point (blocking and asyncio, operations and guards) checks its durations here, so that a
    wrong type or value is the same `InvalidArgument` wherever it is passed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number of seconds, not {value!r}")
    if value < 0:
        raise InvalidArgument(f"{what} must not be negative, not {value!r} seconds")
    return float(value)


def _ms(value: Any, what: str, low_ms: int, high_ms: int) -> int:
    """A duration in seconds as the whole milliseconds sent. The value passed must itself be
    within the limits, compared in seconds (the unit the caller wrote): 3600.0005 is over a
    3600 s maximum, not rounded into it, and 0.0099 under a 0.01 s minimum. A value within
    them is sent rounded to the nearest millisecond (halves up), which stays within them.
    The error quotes the limits in seconds."""
    seconds = _seconds(value, what)
    if not low_ms / 1000 <= seconds <= high_ms / 1000:
        raise InvalidArgument(f"{what} must be {low_ms / 1000:g} to {high_ms / 1000:g} seconds, not {value!r}")
    # The clamp only absorbs binary rounding of a limit itself (e.g. 0.01 * 1000).
    return min(high_ms, max(low_ms, math.floor(seconds * 1000.0 + 0.5)))


def _timeout(value: Any, what: str = "timeout") -> Optional[float]:
    """How long a wait for something to happen may last (`watch.next(timeout)`,
    `observer.next(timeout)`, `lease.wait_lost(timeout)`): None or `math.inf` for no limit,
    else seconds, 0 meaning "only what is there now". Negative, NaN or not a number is
    refused, as every duration is, rather than quietly taken as 0 or as no limit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidArgument(f"{what} must be a number of seconds or None, not {value!r}")
    if value < 0:
        raise InvalidArgument(f"{what} must not be negative, not {value!r} seconds")
    return None if math.isinf(value) else float(value)


def parse_addresses(addrs: Union[str, List[str]]) -> List[Tuple[str, int]]:
    """`"a:1,b:2"` (or a list) as (host, port) pairs; IPv6 hosts in brackets: `[::1]:7878`."""
    items = addrs.split(",") if isinstance(addrs, str) else list(addrs)
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidArgument(f"address {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise InvalidArgument("no server address given")
    return out


#: Pause before an ACQUIRE whose outcome is unknown is sent again, doubled per retry up to
#: RETRY_PAUSE_MAX_S: a fail-over takes an election (about a second), a restart longer.
RETRY_PAUSE_MIN_S = 0.05
RETRY_PAUSE_MAX_S = 0.8
#: Default `acquire_retry_for`, seconds: a loaded node's restart or a slow fail-over fits.
ACQUIRE_RETRY_FOR_DEFAULT_S = 15.0


#: How a server begins the message of an ERROR whose request may have been executed (a
#: change in flight when its leader lost its place: PROTOCOL.md 3.8).
OUTCOME_UNKNOWN = "the outcome is unknown"


def _note_maybe_executed(owner: Any) -> None:
    """Notes on an ACQUIRE's retries (`owner`) that a send of it may have been executed."""
    if isinstance(owner, _AcquireRetry):
        owner.maybe_executed = True


def _unknown_if(retry: "_AcquireRetry", error: TenureError) -> TenureError:
    """The error an ACQUIRE's retries ended with, said to leave the outcome unknown when an
    earlier send may have been executed: a later refusal (a cut-off leader's "does not
    serve", not executed) must not read as the whole ACQUIRE's (outside test a66, 1)."""
    if not retry.maybe_executed or not isinstance(error, ServerError):
        return error
    if error.message.startswith(OUTCOME_UNKNOWN):
        return error
    message = (
        f"{OUTCOME_UNKNOWN}: an earlier send of this ACQUIRE may have been executed (its "
        f"answer was lost), and it may still take effect; the last answer: {error.message}"
    )
    return server_error(error.code, message)


def _raise_unknown_if(retry: "_AcquireRetry", error: TenureError) -> NoReturn:
    """Raises `_unknown_if(retry, error)`: `error` itself, or the rewritten one from it."""
    rewritten = _unknown_if(retry, error)
    if rewritten is error:
        raise error
    raise rewritten from error


class _AcquireRetry:
    """One ACQUIRE's acquire id and first send, kept across its retries, and what became of
    grants that arrived for sends nobody waited for any more."""

    __slots__ = ("acquire_id", "first_sent", "kept", "gave_up", "late", "released", "maybe_executed")

    def __init__(self) -> None:
        self.acquire_id = secrets.token_bytes(16)
        self.first_sent: Optional[float] = None
        #: Whether a send may have been executed: a server said its outcome is unknown, or
        #: it got no answer (its connection lost, or no answer in time).
        self.maybe_executed = False
        self.kept = False
        self.gave_up = False
        #: A late grant seen while the caller still retried: (key, lease id).
        self.late: Optional[Tuple[bytes, bytes]] = None
        #: The lease id given back since the caller gave up (every send has the same lease).
        self.released: Optional[bytes] = None

    def late_grant(self, key: bytes, lease_id: bytes) -> bool:
        """A grant for a send nobody waits for: True if it is to be released now (the caller
        gave up); else it is kept (a repeat will find the same lease) or noted for a
        release should the caller give up."""
        if self.gave_up:
            first, self.released = self.released != lease_id, lease_id
            return first
        if not self.kept:
            self.late = (key, lease_id)
        return False


def _connect_failure(target: Tuple[str, int], e: BaseException) -> str:
    """What one failed connect says, naming its address."""
    if isinstance(e, asyncio.TimeoutError):
        return f"connecting to {target[0]}:{target[1]} timed out"
    text = str(e)
    address = f"{target[0]}:{target[1]}"
    return text if address in text else f"{address}: {text}"


class _class_or_instance:
    """A method that gets its class when called on the class and its instance when called on
    an instance (a `classmethod` gets the class either way)."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = method
        self.__doc__ = method.__doc__

    def __get__(self, obj: Any, cls: Any) -> Callable[..., Any]:
        return functools.partial(self._method, cls if obj is None else obj)


class AsyncClient:
    """A tenure client for asyncio: one pipelined connection, reconnected when it fails.

    `addrs` is `"host:port"` or several, `"a:7878,b:7878,c:7878"` (a cluster): each is tried
    in turn when connecting, and a `NOT_LEADER` answer is followed to the leader it names.
    Durations are seconds (floats). Use `await AsyncClient.connect(...)` or
    `async with AsyncClient(...) as client:`.
    """

    def __init__(
        self,
        addrs: Union[str, List[str]] = "127.0.0.1:7878",
        *,
        timeout: float = 5.0,
        connect_timeout: float = 2.0,
        reconnect_delay_min: float = 0.05,
        reconnect_delay_max: float = 5.0,
        in_flight_max: int = 4096,
        credentials: Optional[Union[Credentials, Tuple[str, Union[str, bytes]]]] = None,
        tls: Optional[Union[TlsOptions, ssl_module.SSLContext]] = None,
        acquire_retry_for: float = ACQUIRE_RETRY_FOR_DEFAULT_S,
    ) -> None:
        self.endpoints = parse_addresses(addrs)
        self.timeout = _seconds(timeout, "timeout")
        #: How long past its wait an ACQUIRE whose outcome is unknown keeps being sent again
        #: with its acquire id, from its first send (never less than `timeout`).
        self.acquire_retry_for = _seconds(acquire_retry_for, "acquire_retry_for")
        self.connect_timeout = _seconds(connect_timeout, "connect_timeout")
        self.reconnect_delay_min = _seconds(reconnect_delay_min, "reconnect_delay_min")
        self.reconnect_delay_max = _seconds(reconnect_delay_max, "reconnect_delay_max")
        self.in_flight_max = in_flight_max
        if isinstance(credentials, tuple):
            credentials = Credentials(credentials[0], _as_bytes(credentials[1], "secret"))
        self.credentials = credentials
        if isinstance(tls, ssl_module.SSLContext):
            tls = TlsOptions(context=tls)
        self.tls = tls
        self._ssl = tls.ssl_context() if tls is not None else None
        self._conn: Optional[Connection] = None
        self._lock: Optional[asyncio.Lock] = None
        self._next = self.endpoints[0]
        self._failures = 0
        self._retry_at: Optional[float] = None
        #: When the last connect failed: a request that keeps leases alive may try again
        #: `RECONNECT_DELAY_KEEPING_MAX_S` after it, if that is before `_retry_at`.
        self._failed_at: Optional[float] = None
        self._closed = False
        #: Renewal tasks of this client's guards, told when the client closes.
        self._keepers: "weakref.WeakSet[_Keeper]" = weakref.WeakSet()

    # -- connecting -------------------------------------------------------------------

    @_class_or_instance
    async def connect(
        cls_or_self: Any, addrs: Union[str, List[str], None] = None, **options: Any
    ) -> "AsyncClient":
        """`await AsyncClient.connect(addrs, ...)`: a client whose first connection is open
        (its errors raised here). `await client.connect()` on a client built with
        `AsyncClient(addrs, ...)` opens that client's first connection and returns it."""
        if isinstance(cls_or_self, AsyncClient):
            # Called on an instance: connecting a new default client instead (as a plain
            # classmethod would) leaves this one unconnected and surprises (outside test a48, N15).
            if addrs is not None or options:
                raise TypeError(
                    "client.connect() takes no arguments: the addresses and options were "
                    "given to AsyncClient(...); use AsyncClient.connect(addrs, ...) for a new client"
                )
            client = cls_or_self
        else:
            client = cls_or_self("127.0.0.1:7878" if addrs is None else addrs, **options)
        await client._connection(client._first_connect_deadline())
        return client

    async def __aenter__(self) -> "AsyncClient":
        await self._connection(self._first_connect_deadline())
        return self

    def _first_connect_deadline(self) -> float:
        """The first connection gets `connect_timeout` per address: a hung first address (a
        stopped process accepts connections but never answers) must leave time for the others."""
        return time.monotonic() + self.connect_timeout * len(self.endpoints)

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the connection; requests in flight fail with ConnectionLost, and every lease
        guard of this client stops renewing and signals its loss ("client closed")."""
        self._closed = True
        for keeper in list(self._keepers):
            keeper.stop()
            keeper.fire(LOSS_CLIENT_CLOSED)
        self.disconnect()

    def disconnect(self) -> None:
        """Drops the connection (the next request opens a new one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close("disconnected by the client")

    @property
    def server_limits(self) -> Optional[w.ServerLimits]:
        """The limits the server announced on the current connection."""
        return self._conn.limits if self._conn is not None else None

    def is_connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def _connection(self, deadline: float, keeping: bool = False) -> Connection:
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        if self._closed:
            raise ConnectionLost("client closed")
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            conn = self._conn
            if conn is not None and not conn.is_closed():
                return conn
            retry_at = self._retry_at
            if keeping and retry_at is not None and self._failed_at is not None:
                retry_at = min(retry_at, self._failed_at + RECONNECT_DELAY_KEEPING_MAX_S)
            if retry_at is not None:
                delay = retry_at - time.monotonic()
                if delay > deadline - time.monotonic():
                    raise RequestTimeout("reconnect delay runs past the request's timeout")
                await asyncio.sleep(max(0.0, delay))
            # An attempt ahead of the backoff (lease keeping's): its failure must not raise the
            # backoff of everyone else, which counts the attempts the backoff itself allowed.
            early = self._retry_at is not None and time.monotonic() < self._retry_at
            # Each address once, at once: a cluster with a node down still connects. The
            # backoff delay comes after a whole round of them failed.
            failed: List[str] = []
            for attempt in range(len(self.endpoints)):
                target = self._next
                budget = min(self.connect_timeout, max(0.0, deadline - time.monotonic()))
                try:
                    conn = await asyncio.wait_for(self._open(target), budget)
                except (asyncio.TimeoutError, ConnectionLost, OSError, ServerError) as e:
                    failed.append(_connect_failure(target, e))
                    self._note_failure(target, early)
                    last_round = attempt == len(self.endpoints) - 1 or time.monotonic() >= deadline
                    # A follower may answer the AUTH itself with NOT_LEADER: go where it says.
                    hint = w.leader_hint(e.message) if isinstance(e, NotLeader) else None
                    if hint is not None and hint[0] is not None:
                        self._next = parse_addresses(hint[0])[0]
                    if not last_round and (not isinstance(e, ServerError) or isinstance(e, NotLeader)):
                        continue
                    if len(failed) > 1 and (isinstance(e, asyncio.TimeoutError) or type(e) is CannotConnect):
                        # Every address's failure, not only the last one's (outside test a48, N9).
                        tried = f"{len(failed)} addresses" + ("" if len(failed) == len(self.endpoints) else " tried")
                        raise CannotConnect(f"cannot connect to any of {tried}: " + "; ".join(failed)) from e
                    if isinstance(e, asyncio.TimeoutError):
                        raise CannotConnect(_connect_failure(target, e)) from e
                    raise
                self._failures = 0
                self._retry_at = None
                self._failed_at = None
                self._conn = conn
                return conn
            raise AssertionError("unreachable: the last attempt returns or raises")

    async def _open(self, target: Tuple[str, int]) -> Connection:
        host, port = target
        server_name = self.tls.server_name if self.tls is not None else None
        conn = await Connection.open(
            host, port, ssl=self._ssl, server_hostname=server_name, in_flight_max=self.in_flight_max
        )
        if self.credentials is not None:
            try:
                await _authenticate(conn, self.credentials, self.connect_timeout)
            except BaseException:
                conn.close("authentication failed")
                raise
        return conn

    def _note_failure(self, target: Tuple[str, int], early: bool = False) -> None:
        """After a failed connect: the next address now; the backoff delay after each round
        (not after an `early` one, made ahead of the backoff to keep leases alive)."""
        self._failed_at = time.monotonic()
        self._advance_from(target)
        if early:
            return
        self._failures += 1
        count = len(self.endpoints)
        if self._failures % count == 0:
            self._retry_at = time.monotonic() + self._reconnect_delay(self._failures // count)

    def _reconnect_delay(self, rounds: int) -> float:
        """Exponential backoff with equal jitter: random in [d/2, d], d doubling per round."""
        doublings = min(max(rounds - 1, 0), BACKOFF_DOUBLINGS_MAX)
        delay = min(self.reconnect_delay_min * (2**doublings), self.reconnect_delay_max)
        return delay / 2 + random.random() * delay / 2

    def _advance_from(self, target: Tuple[str, int]) -> None:
        try:
            index = self.endpoints.index(target)
        except ValueError:
            index = -1  # a leader named by NOT_LEADER, not one of ours: start over
        self._next = self.endpoints[(index + 1) % len(self.endpoints)]

    # -- one request ------------------------------------------------------------------

    async def _call(
        self,
        opcode: int,
        body: bytes,
        timeout: Optional[float] = None,
        watch: Optional[WatchQueue] = None,
        keeping: bool = False,
    ) -> Tuple[int, bytes, Connection]:
        """Sends a request (following NOT_LEADER) and returns (opcode, body, connection).

        ERROR replies other than a final NOT_LEADER are raised as ServerError. `keeping`: as
        `_call_sent`'s.
        """
        opcode_in, reply, conn, _ = await self._call_sent(opcode, body, timeout, watch, keeping=keeping)
        return opcode_in, reply, conn

    async def _call_sent(
        self,
        opcode: int,
        body: bytes,
        timeout: Optional[float] = None,
        watch: Optional[WatchQueue] = None,
        owner: Any = None,
        keeping: bool = False,
    ) -> Tuple[int, bytes, Connection, float]:
        """`_call`, and the monotonic instant taken just before the send that was answered
        (the last one, after NOT_LEADER redirects): a lease counted from it is counted from
        the request the leader took up, not from a follower's refusal before it. `keeping`: a
        request that keeps leases alive, which reconnects sooner (`RECONNECT_DELAY_KEEPING_MAX_S`)."""
        timeout = self.timeout if timeout is None else timeout
        direct = _DIRECT.get()
        if direct is not None and watch is None:
            sent_at = time.monotonic()
            return (*self._call_direct(direct, opcode, body, timeout, owner), sent_at)
        deadline = time.monotonic() + timeout
        search_until = time.monotonic() + min(timeout * LEADER_SEARCH_SHARE, LEADER_SEARCH_MAX_S)
        redirects = 0
        pause = ROUND_PAUSE_MIN_S
        # The last NOT_LEADER's message: raised if the search ends at a node it cannot reach,
        # whose failure says neither which node nor why (outside test a65, 2).
        refused: Optional[str] = REFUSED_BEFORE.get()
        REFUSED_BEFORE.set(None)
        while True:
            try:
                conn = await self._connection(deadline, keeping)
            except (ConnectionLost, RequestTimeout) as e:
                if refused is None:
                    raise
                raise server_error(23, refused) from e
            left = deadline - time.monotonic()
            if left <= 0:
                if refused is not None:
                    # Nothing sent on this connection: the search's NOT_LEADER says more.
                    raise server_error(23, refused)
                raise RequestTimeout(f"no answer within {timeout:.3f} s")
            sent_at = time.monotonic()
            try:
                opcode_in, reply = await conn.call(opcode, body, left, watch, owner)
            except asyncio.TimeoutError:
                _note_maybe_executed(owner)
                self.leave_hung(conn, f"no answer within {timeout:.3f} s")
                raise RequestTimeout(f"no answer within {timeout:.3f} s") from None
            except ConnectionLost:
                _note_maybe_executed(owner)
                raise
            if opcode_in != w.ERROR:
                return opcode_in, reply, conn, sent_at
            code, message = w.parse_error(reply)
            if code != 23:
                raise server_error(code, message)
            if message.startswith(OUTCOME_UNKNOWN):
                _note_maybe_executed(owner)
            # The last NOT_LEADER, or the first that said the outcome is unknown (a leader
            # that lost its place mid-change may have executed it), which no later refusal
            # may hide (outside test a67, 2).
            if refused is None or not refused.startswith(OUTCOME_UNKNOWN):
                refused = message
            redirects += 1
            if redirects > len(self.endpoints) + REDIRECTS_EXTRA:
                # A round found no leader: an election is under way, or the nodes still name
                # one that died. Pause, then look again while time is left.
                if time.monotonic() + pause >= search_until:
                    raise server_error(code, refused)
                await asyncio.sleep(pause)
                pause = min(pause * 2, ROUND_PAUSE_MAX_S)
                redirects = 0
            await self._follow(conn, message)

    def _call_direct(
        self, direct: "DirectCall", opcode: int, body: bytes, timeout: float, owner: Any = None
    ) -> Tuple[int, bytes, Any]:
        """The blocking client's fast path: one request over its synchronous connection, in the
        calling thread, without suspending. NOT_LEADER goes back to the loop (the follower
        executed nothing, so sending the request again is safe; an ACQUIRE that a leader may
        have executed is noted on its `owner`, so its end still says so: outside test a67, 1)."""
        try:
            opcode_in, reply = direct(opcode, body, timeout)
        except RequestTimeout:
            _note_maybe_executed(owner)
            raise
        if opcode_in != w.ERROR:
            return opcode_in, reply, None
        code, message = w.parse_error(reply)
        if code == 23:
            unknown = message.startswith(OUTCOME_UNKNOWN)
            if unknown:
                _note_maybe_executed(owner)
            raise UseLoop("NOT_LEADER: follow it on the event loop", message if unknown else None)
        raise server_error(code, message)

    def leave_hung(self, conn: Optional[Connection], why: str) -> None:
        """After a request on `conn` (or on the connection to the same node) got no answer in
        time: with several addresses the node may be hung (a stopped process still accepts
        connections and never answers), so the connection is closed and the next one goes to
        the next address; NOT_LEADER leads back to a live leader. With one address there is
        nowhere else to go, and the connection stays (a slow answer is not a dead server)."""
        if conn is None or len(self.endpoints) < 2 or self._conn is not conn:
            return  # nowhere else to go, or already replaced
        self._conn = None
        conn.close(why)
        self._advance_from(parse_addresses(conn.address)[0])

    async def _follow(self, conn: Connection, message: str) -> None:
        """After NOT_LEADER: a follower executes nothing, so the request goes to the leader."""
        if self._conn is conn:
            self._conn = None
        conn.close("not the leader")
        hint = w.leader_hint(message)
        named = parse_addresses(hint[0])[0] if hint is not None and hint[0] is not None else None
        # A node naming itself (taking over, or a leader cut off from its followers that
        # still thinks it leads) counts as "no leader known": the next endpoint is asked,
        # rather than this node again for as long as a partition lasts.
        if named is not None and named != self._next:
            self._next = named
            return
        self._advance_from(self._next)
        await asyncio.sleep(ELECTION_PAUSE_S)

    async def _checked(self, build: Callable[[], T], timeout: float, keeping: bool = False) -> Tuple[T, float]:
        """`build()` (a request's body, made by the argument checks) checked against the limits
        of the server it goes to, and what is left of `timeout` for the request.

        Without an open connection (a lazy client's first request, or one after
        `disconnect()` or a failure) those limits are not known: the connection is opened
        first, as the request would open it anyway, and the arguments checked again, so that
        a lazy client refuses what an eager one refuses, with the same `InvalidArgument`,
        before anything is sent. The first check, before connecting, refuses without a
        connection attempt what no server would take (a type, a negative value, a value past
        the protocol's limits). `keeping`: the connection is opened as for a request that
        keeps leases (`_call_sent`).
        """
        built = build()
        if self.is_connected():
            return built, timeout
        if _DIRECT.get() is not None:
            raise UseLoop("not connected: the server's limits are not known yet")
        started = time.monotonic()
        await self._connection(started + timeout, keeping)
        return build(), max(0.0, timeout - (time.monotonic() - started))

    def _limits(self) -> Tuple[int, int, int, int]:
        limits = self.server_limits
        if limits is None:
            return w.KEY_LEN_MAX, w.META_LEN_MAX, w.TTL_MS_MAX, w.WAIT_MS_MAX
        return limits.key_len_max, limits.meta_len_max, limits.ttl_ms_max, limits.wait_ms_max

    def _key(self, key: Key) -> bytes:
        data = _as_bytes(key, "key")
        if not 1 <= len(data) <= self._limits()[0]:
            raise InvalidArgument(f"key must be 1 to {self._limits()[0]} bytes, not {len(data)}")
        return data

    def _ttl_ms(self, ttl: float) -> int:
        return _ms(ttl, "ttl", w.TTL_MS_MIN, self._limits()[2])

    def _acquire_args(
        self,
        key: Key,
        ttl: float,
        wait: float,
        meta: Meta,
        release_on_disconnect: bool,
        acquire_id: bytes = b"",
        kind: bytes = b"",
        session: bytes = b"",
    ) -> bytes:
        """The ACQUIRE body for these arguments, every one checked: the one validation of
        `acquire()`, `lock()`, elections and session locks, blocking and asyncio alike. A
        session lock (`session` names it) has no TTL of its own: its `ttl_ms` is 0."""
        key_b = self._key(key)
        ttl_ms = 0 if session else self._ttl_ms(ttl)
        wait_ms = _ms(wait, "wait", 0, self._limits()[3])
        meta_b = _as_bytes(meta, "meta")
        if len(meta_b) > self._limits()[1]:
            raise InvalidArgument(f"meta must be at most {self._limits()[1]} bytes, not {len(meta_b)}")
        flags = w.FLAG_RELEASE_ON_DISCONNECT if release_on_disconnect else 0
        if kind:  # a read lease or permits (semaphore.py): flag bit 3, after the acquire id (bit 1)
            flags |= _kinds.FLAG_KIND
        return w.acquire_body(key_b, ttl_ms, wait_ms, flags, meta_b, acquire_id, session) + kind

    # -- operations -------------------------------------------------------------------

    async def ping(self) -> float:
        """Round trip to the server, in seconds."""
        start = time.monotonic()
        opcode, _, _ = await self._call(w.PING, b"")
        _expect(opcode, w.PONG)
        return time.monotonic() - start

    async def acquire(
        self,
        key: Key,
        ttl: float,
        *,
        wait: float = 0.0,
        meta: Meta = b"",
        release_on_disconnect: bool = False,
    ) -> AcquireResult:
        """Asks for `key` for `ttl` seconds, waiting in line up to `wait` seconds if it is held.

        Returns `Granted` (the lease) or `Locked` (the holder's token and time left).

        Exactly once: the ACQUIRE carries a fresh random acquire id (16 bytes from `secrets`,
        PROTOCOL.md 3.9). While its outcome is unknown (the connection lost, no answer in
        time, `NOT_LEADER` from a leader stepping down, a server shutting down or
        restarting), the same ACQUIRE with the same acquire id is sent again, on a new
        connection and to the new leader, until `wait` plus `acquire_retry_for` after the
        first send; a blocking one waits only what is left of `wait`. A repeat of a grant is
        answered with that grant, so the caller sees one grant or one refusal, never an
        orphan; if that lease has already ended, `AcquireEnded` is raised.

        A GRANTED lease's local deadline counts from an instant taken before the send that
        got it (the answering server knew no earlier grant of this acquire id), plus the
        server's `waited_ms`, plus the TTL, less the margin (2 ms, or 0.1 % of a span over
        2 s): never later than the server's. A grant a repeat found (REGRANTED) was made to an
        earlier send: it counts from before the *first* send plus the TTL, or from before the
        repeat plus the time the server said was left, whichever is earlier.
        """
        lease, _ = await self._acquire(key, ttl, wait, meta, release_on_disconnect)
        return lease

    async def _acquire(
        self,
        key: Key,
        ttl: float,
        wait: float,
        meta: Meta,
        release_on_disconnect: bool,
        retry: Optional["_AcquireRetry"] = None,
        kind: bytes = b"",
        session: bytes = b"",
    ) -> Tuple[AcquireResult, Connection]:
        """`acquire`, and the connection that answered. `retry` carries the acquire id and
        the first send's instant across a move from the blocking client's direct path to the
        loop (which calls this again); `kind` is the ACQUIRE's kind bytes (semaphore.py),
        empty for the key alone; in `session` when one is named (then `ttl` is not sent: the
        lease has none)."""
        retry = retry if retry is not None else _AcquireRetry()
        wait_s = _seconds(wait, "wait")
        build = lambda: self._acquire_args(  # noqa: E731
            key, ttl, wait, meta, release_on_disconnect, retry.acquire_id, kind, session
        )
        if retry.first_sent is None:
            body, _ = await self._checked(build, self.timeout + wait_s)
        else:
            # Sent already, by the direct path, after the same check against the server's
            # limits: its outcome is unknown, and a server that cannot be reached now (it is
            # restarting) is one more unknown outcome for the sends below to retry, not a
            # refusal before sending.
            body = build()
        key_b = w.Reader(body).bytes16()
        if retry.first_sent is None:
            retry.first_sent = time.monotonic()
        try:
            return await self._acquire_sends(key_b, ttl, release_on_disconnect, retry, body, wait_s)
        except UseLoop:
            raise  # sent again from the loop, with this same retry state
        except BaseException:
            if not retry.kept:
                # Cancelled, or an error raised: a grant arriving from now on is given back,
                # and one that already arrived is given back now.
                retry.gave_up = True
                if retry.late is not None:
                    asyncio.ensure_future(self._gave_up(retry))
            raise

    async def _acquire_sends(
        self,
        key_b: bytes,
        ttl: float,
        release_on_disconnect: bool,
        retry: "_AcquireRetry",
        body: bytes,
        wait_s: float,
    ) -> Tuple[AcquireResult, Connection]:
        """The sends of one ACQUIRE, the same body each time but for what is left of its wait,
        until one settles it or `acquire_retry_for` past the wait is spent."""
        first = retry.first_sent
        assert first is not None
        give_up_at = first + wait_s + max(self.timeout, self.acquire_retry_for)
        pause = RETRY_PAUSE_MIN_S
        # The previous send's unknown outcome: what the caller hears if the last send is cut
        # short by the retries running out (say every node answered NOT_LEADER, and the last
        # send was still connecting), rather than a time-out that send never had of its own.
        last: Optional[TenureError] = None
        # The last ERROR a send was answered with (NOT_LEADER, say): raised rather than a
        # later send's failure to connect or time-out, which says nothing of why (a65, 2).
        answered: Optional[TenureError] = None
        while True:
            now = time.monotonic()
            wait_left = max(0.0, first + wait_s - now)
            attempt = w.with_wait(body, int(wait_left * 1000))
            cut_short = give_up_at - now < self.timeout + wait_left
            try:
                timeout = max(0.001, min(self.timeout + wait_left, give_up_at - now))
                reset = _SENDING_ACQUIRE.set(retry)
                try:
                    opcode, reply, conn, sent_at = await self._call_sent(w.ACQUIRE, attempt, timeout, owner=retry)
                finally:
                    _SENDING_ACQUIRE.reset(reset)
            except TenureError as e:
                unknown = is_transient(e) or isinstance(e, RequestTimeout)
                if not unknown:
                    _raise_unknown_if(retry, e)
                if isinstance(e, ServerError):
                    answered = e
                if cut_short and last is not None and isinstance(e, (RequestTimeout, CannotConnect)):
                    raise _unknown_if(retry, answered or last) from None
                if time.monotonic() + pause >= give_up_at:
                    if answered is not None and isinstance(e, (RequestTimeout, ConnectionLost)):
                        raise _unknown_if(retry, answered) from None
                    _raise_unknown_if(retry, e)
                if _DIRECT.get() is not None:
                    raise UseLoop(f"ACQUIRE outcome unknown ({e}): sent again on the loop") from e
                log.debug("tenure: ACQUIRE outcome unknown (%s); sending it again", e)
                last = e
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_PAUSE_MAX_S)
                continue
            return self._acquired(key_b, ttl, release_on_disconnect, retry, opcode, reply, sent_at), conn

    def _acquired(
        self,
        key_b: bytes,
        ttl: float,
        release_on_disconnect: bool,
        retry: "_AcquireRetry",
        opcode: int,
        reply: bytes,
        sent_at: float,
    ) -> AcquireResult:
        """What the ACQUIRE's settling answer means."""
        first = retry.first_sent
        assert first is not None
        r = w.Reader(reply)
        if opcode == w.GRANTED:
            retry.kept = True
            token, lease_id, granted_ttl_ms, waited_ms = r.u64(), r.take(16), r.u32(), r.u32()
            # The answering server knew no live grant of this acquire id: the lease began
            # after this send (a re-sent blocking one must not look expired on arrival).
            deadline = local_deadline(sent_at, waited_ms, granted_ttl_ms)
            return Granted(key_b, token, lease_id, granted_ttl_ms, waited_ms, deadline, release_on_disconnect)
        if opcode == w.REGRANTED:
            retry.kept = True
            token, lease_id, ttl_left_ms = r.u64(), r.take(16), r.u32()
            if not ttl:
                # A session lease (no TTL of its own): the session's time left, counted from
                # before the repeat that heard it.
                deadline = local_deadline(sent_at, 0, ttl_left_ms)
                return Granted(key_b, token, lease_id, ttl_left_ms, 0, deadline, release_on_disconnect)
            ttl_ms = self._ttl_ms(ttl)
            # Granted between the first send and the repeat: no wait is counted, and the
            # repeat's own count is kept if it is earlier.
            deadline = min(local_deadline(first, 0, ttl_ms), local_deadline(sent_at, 0, ttl_left_ms))
            # The server reports no wait for a repeat: 0, so that `first + waited + ttl` (the
            # rule of PROTOCOL.md 3.3) stays no later than the server's deadline.
            return Granted(key_b, token, lease_id, ttl_ms, 0, deadline, release_on_disconnect)
        retry.gave_up = True
        if opcode == w.ACQUIRE_ENDED:
            how, token = r.u8(), r.u64()
            raise AcquireEnded(w.ENDED_HOW.get(how, f"how {how}"), token)
        _expect(opcode, w.LOCKED)
        return Locked(r.u64(), r.u32())

    async def _gave_up(self, retry: "_AcquireRetry") -> None:
        """The caller gave up: a grant that arrived late meanwhile is given back."""
        late, retry.late = retry.late, None
        if late is not None and retry.late_grant(*late):
            try:
                await self.release(late)
            except TenureError as e:
                log.debug("tenure: releasing a late grant failed: %s", e)

    async def renew(self, lease: Granted, ttl: Optional[float] = None) -> RenewResult:
        """Extends `lease` to `ttl` seconds (default: its granted TTL) from now, if it still holds.

        Returns `Renewed` (with the new local deadline) or `Lost`. A lock held in a session
        has no TTL of its own: renewing one is refused before anything is sent, with the
        server's `SESSION_LEASE` (a `BadRequest`); its session's keep-alive keeps it.
        """
        lease = _renewable(lease)
        if ttl is None:
            result, _ = await self._renew(lease.key, lease.lease_id, lease.ttl_ms)
            return result
        ttl_ms, timeout = await self._checked(lambda: self._ttl_ms(ttl), self.timeout)
        result, _ = await self._renew(lease.key, lease.lease_id, ttl_ms, timeout)
        return result

    async def _renew(
        self, key: bytes, lease_id: bytes, ttl_ms: int, timeout: Optional[float] = None, keeping: bool = False
    ) -> Tuple[RenewResult, Connection]:
        body = w.renew_body(key, lease_id, ttl_ms)
        opcode, reply, conn, sent_at = await self._call_sent(w.RENEW, body, timeout, keeping=keeping)
        if opcode == w.LOST:
            return Lost(), conn
        _expect(opcode, w.RENEWED)
        renewed_ms = w.Reader(reply).u32()
        return Renewed(renewed_ms, local_deadline(sent_at, 0, renewed_ms)), conn

    async def release(
        self, lease: Union[Granted, Tuple[Key, bytes], "AsyncLeaseGuard", "AsyncLeadership"]
    ) -> ReleaseResult:
        """Frees the lease's key if the lease still holds it: `Released` or `NotOwner`.

        `lease` is a `Granted`, a (key, lease id) pair, or a lease guard (`lock()`'s, or a
        leadership): the guard stops renewing and ends as released (`loss_reason` "released
        by its owner"). A guard whose lease is known gone (a RELEASE of it answered, or a
        renewal answered LOST) sends nothing and is `NotOwner`, the server's answer; after a
        RELEASE that failed, the RELEASE is sent again.
        """
        if isinstance(lease, AsyncLeadership):
            lease = lease.guard
        if isinstance(lease, AsyncLeaseGuard):
            return await lease._k().finish(release=True, quiet=False) or NotOwner()
        key, lease_id = _lease_parts(lease)
        build = lambda: w.release_body(self._key(key), _lease_id(lease_id))  # noqa: E731
        body, timeout = await self._checked(build, self.timeout, keeping=True)
        # Freeing a lease is lease keeping too: after a restart it reconnects as soon as a
        # renewal would, so the next waiter need not wait out the restored lease's TTL.
        opcode, _, _ = await self._call(w.RELEASE, body, timeout, keeping=True)
        if opcode == w.NOT_OWNER:
            return NotOwner()
        _expect(opcode, w.RELEASED)
        return Released()

    async def inspect(self, key: Key) -> KeyState:
        """The key's state now: `Free`, or `Held` with the holder's token, time left, waiters, meta."""
        body, timeout = await self._checked(lambda: w.bytes16(self._key(key)), self.timeout)
        opcode, reply, _ = await self._call(w.INSPECT, body, timeout)
        if opcode == w.FREE:
            return Free()
        _expect(opcode, w.HELD)
        return Held(*w.parse_held(w.Reader(reply)))

    async def check(self, key: Key, token: int) -> CheckResult:
        """`Current` if `token` is the token of the lease holding `key` now, else `Stale`."""
        body, timeout = await self._checked(lambda: w.check_body(self._key(key), _u64(token)), self.timeout)
        opcode, _, _ = await self._call(w.CHECK, body, timeout)
        if opcode == w.STALE:
            return Stale()
        _expect(opcode, w.CURRENT)
        return Current()

    async def stats(self) -> Dict[str, int]:
        """The server's counters by name (names may be added; ignore unknown ones)."""
        opcode, reply, _ = await self._call(w.STATS, b"")
        _expect(opcode, w.STATS_REPLY)
        return dict(w.parse_stats(reply))

    async def watch(self, key: Key) -> "AsyncWatch":
        """Subscribes to `key`: the state now, then an `Event` for every later change."""
        key_b, timeout = await self._checked(lambda: self._key(key), self.timeout)
        queue = WatchQueue(key_b)
        opcode, reply, conn = await self._call(w.WATCH, w.bytes16(key_b), timeout, watch=queue)
        _expect(opcode, w.WATCHING)
        conn.watching(key_b, queue)
        r = w.Reader(reply)
        initial: KeyState = Held(*w.parse_held(r)) if r.u8() == 1 else Free()
        return AsyncWatch(self, conn, key_b, initial, queue)

    # -- guards and elections ---------------------------------------------------------

    def lock(
        self,
        key: Key,
        ttl: float,
        *,
        wait: float = 0.0,
        meta: Meta = b"",
        release_on_disconnect: bool = False,
        on_lost: Optional[Callable[[str], None]] = None,
        cancel_on_loss: bool = False,
        renew_every: Optional[float] = None,
        margin: Optional[float] = None,
    ) -> "AsyncLeaseGuard":
        """`async with client.lock("order:1842", ttl=30, wait=10) as lease:`.

        Acquires on entry (raising `NotAcquired` if the wait runs out), renews every third of
        the TTL in a background task, releases on exit. With `cancel_on_loss` the body is
        cancelled when the lease is lost and the `async with` raises `LeaseLost`.
        """
        return AsyncLeaseGuard(
            self,
            key,
            ttl,
            wait=wait,
            meta=meta,
            release_on_disconnect=release_on_disconnect,
            on_lost=on_lost,
            cancel_on_loss=cancel_on_loss,
            renew_every=renew_every,
            margin=margin,
        )

    def semaphore(
        self, key: Key, permits: int, ttl: float = _kinds.DEFAULT_TTL, *, count: int = 1, **options: Any
    ) -> "AsyncLeaseGuard":
        """`async with client.semaphore("partner-api", permits=4, wait=10) as permit:`: `count`
        (default one) of the `permits` permits of semaphore `key`, as a guard like `lock()`'s
        (same keywords, loss signals, renewal and `token`). `KindMismatch` when the key is a
        plain or read/write lock or a semaphore of another number of permits; `BadPermits`
        for counts out of range (raised here, before anything is sent)."""
        return AsyncLeaseGuard(self, key, ttl, kind=_kinds.permits(count, permits), **options)

    def read_lock(self, key: Key, ttl: float = _kinds.DEFAULT_TTL, **options: Any) -> "AsyncLeaseGuard":
        """A read lease on `key` beside other readers, as a guard like `lock()`'s; it waits
        (up to `wait`) while a writer holds the key or waits before it (FIFO)."""
        return AsyncLeaseGuard(self, key, ttl, kind=_kinds.SHARED, **options)

    def write_lock(self, key: Key, ttl: float = _kinds.DEFAULT_TTL, **options: Any) -> "AsyncLeaseGuard":
        """The write side of read/write lock `key`: the key alone, `lock()` itself."""
        return AsyncLeaseGuard(self, key, ttl, **options)

    async def inspect_kinds(self, key: Key) -> "Union[Free, Held, _kinds.HeldKinds]":
        """The key's state with its holders and waiters by kind: `HeldKinds` for a held
        read/write or semaphore key, else `Free` or `Held` as `inspect()` answers."""
        body, timeout = await self._checked(lambda: _kinds.inspect_body(self._key(key)), self.timeout)
        opcode, reply, _ = await self._call(w.INSPECT, body, timeout)
        return _kinds.parse_inspect(opcode, reply)

    def session(
        self, ttl: float, *, keep_alive_every: Optional[float] = None, margin: Optional[float] = None
    ) -> "AsyncSession":
        """`async with client.session(ttl=10) as s:` opens a session whose one keep-alive (every
        third of `ttl`) keeps every `s.lock(key)` in it; see `tenure.session`."""
        return AsyncSession(self, ttl, keep_alive_every, margin)

    def election(
        self,
        group: str,
        *,
        ttl: float = 10.0,
        wait_max: float = w.WAIT_MS_MAX / 1000,
        release_on_disconnect: Optional[bool] = None,
    ) -> "AsyncElection":
        """The election `group` (its lock is `election/<group>`); see `AsyncElection`."""
        return AsyncElection(self, group, ttl=ttl, wait_max=wait_max, release_on_disconnect=release_on_disconnect)


def _expect(opcode: int, wanted: int) -> None:
    if opcode != wanted:
        raise ProtocolError(f"reply opcode 0x{opcode:02x}, expected 0x{wanted:02x}")


def _u64(token: int) -> int:
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidArgument(f"a fencing token is an int, not {token!r}")
    if not 0 <= token < 2**64:
        raise InvalidArgument(f"token {token} is not a u64")
    return token


def _lease_parts(lease: Any) -> Tuple[Key, Union[str, bytes]]:
    """(key, lease id) of what `release()` was given, or a clear refusal."""
    if isinstance(lease, Granted):
        return lease.key, lease.lease_id
    if isinstance(lease, tuple) and len(lease) == 2:
        return lease
    if isinstance(lease, Locked):
        raise InvalidArgument("release() was given Locked: that acquire was not granted, there is nothing to release")
    raise InvalidArgument(
        f"release() takes a Granted, a lease guard or a (key, lease id) pair, not {type(lease).__name__}"
    )


def _renewable(lease: Any) -> Granted:
    """The `Granted` that `renew()` was given, or a clear refusal of anything else."""
    if isinstance(lease, Granted):
        return lease
    if isinstance(lease, (AsyncSessionLock, SessionLock)):
        raise BadRequest(
            w.SESSION_LEASE,
            "a lock held in a session has no TTL of its own: its session's keep-alive keeps it, "
            "so there is nothing to renew",
        )
    if isinstance(lease, Locked):
        raise InvalidArgument("renew() was given Locked: that acquire was not granted, there is nothing to renew")
    raise InvalidArgument(
        f"renew() takes a Granted, not {type(lease).__name__} (a lease guard renews itself)"
    )


def _lease_id(lease_id: Union[str, bytes]) -> bytes:
    data = bytes.fromhex(lease_id) if isinstance(lease_id, str) else bytes(lease_id)
    if len(data) != 16:
        raise InvalidArgument("a lease id is 16 bytes (32 hex digits)")
    return data


async def _authenticate(conn: Connection, credentials: Credentials, timeout: float) -> None:
    name = credentials.name.encode("utf-8")
    if not 1 <= len(name) <= w.AUTH_NAME_LEN_MAX or len(credentials.secret) > w.AUTH_SECRET_LEN_MAX:
        raise InvalidArgument("identity name must be 1-64 bytes and secret at most 256")
    opcode, reply = await conn.call(w.AUTH, w.auth_body(name, credentials.secret), timeout)
    if opcode == w.ERROR:
        raise server_error(*w.parse_error(reply))
    _expect(opcode, w.AUTHENTICATED)


class AsyncWatch:
    """A running watch: `initial` is the key's state when it started; iterate for events.

    The iteration ends with the watch's error (ConnectionLost, WatchLimit...) raised.
    """

    def __init__(self, client: AsyncClient, conn: Connection, key: bytes, initial: KeyState, queue: WatchQueue) -> None:
        self.key = key
        self.initial = initial
        self._client = client
        self._conn = conn
        self._queue = queue

    async def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event; None if `timeout` seconds passed first (no limit when it is None) or
        the watch was closed by `close()`.

        Raises the error that ended the watch (ConnectionLost, WatchLimit, ...).
        """
        limit = _timeout(timeout)
        try:
            await asyncio.wait_for(self._queue.wait(), limit)
        except asyncio.TimeoutError:
            return None
        if self._queue.events:
            return self._queue.events.popleft()
        if self._queue.error is not None:
            raise self._queue.error
        return None

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        try:
            event = await self.next()
        except ConnectionLost:
            if self._client._closed:  # the client was closed: the iteration ends
                raise StopAsyncIteration from None
            raise
        if event is None:
            raise StopAsyncIteration
        return event

    async def close(self) -> None:
        """UNWATCH: no event of this watch comes after it."""
        rid = self._conn.watch_id(self._queue)
        if rid is None or self._conn.is_closed():
            self._queue.end(None)
            return
        self._conn.forget_watch(rid)
        opcode, _ = await self._conn.call(w.UNWATCH, w.bytes16(self.key), self._client.timeout)
        if opcode == w.ERROR:
            raise server_error(*w.parse_error(_))


# -- lease guards ---------------------------------------------------------------------

LOSS_REVOKED = "renewal answered LOST"
LOSS_RELEASED = "released by its owner"


def _guard_timing(ttl: float, renew_every: Optional[float], margin: Optional[float]) -> Tuple[float, float]:
    """A guard's renewal period and safety margin for `ttl` (defaults: a third and a tenth of
    it), checked before anything is acquired."""
    renew_every = ttl / 3 if renew_every is None else _seconds(renew_every, "renew_every")
    margin = ttl / 10 if margin is None else _seconds(margin, "margin")
    if not (renew_every > 0 and margin >= 0):
        raise InvalidArgument("renew_every must be positive and margin not negative")
    if renew_every + margin >= ttl:
        raise InvalidArgument("renew_every + margin must be shorter than the ttl")
    return renew_every, margin
LOSS_CLIENT_CLOSED = "client closed"


class _Keeper:
    """Renews one lease in a task on the client's loop and fires the loss signals.

    Loss fires at the first of: a renewal answered LOST; the connection a
    release-on-disconnect lease is tied to closing; the local deadline less the margin
    passing without a confirmed renewal (server down, renewals stuck, process paused).
    """

    def __init__(
        self,
        client: AsyncClient,
        lease: Granted,
        conn: Optional[Connection],
        *,
        renew_every: Optional[float],
        margin: Optional[float],
        on_lost: List[Callable[[str], None]],
        loop: asyncio.AbstractEventLoop,
        post: Optional["Post"] = None,
    ) -> None:
        """Made on any thread; renewing starts with `begin()`, which runs on `loop`. `post`
        hands calls to the loop from other threads (default: `call_soon_threadsafe`)."""
        ttl = lease.ttl_ms / 1000.0
        self.renew_every, self.margin = _guard_timing(ttl, renew_every, margin)
        self.client = client
        self.lease = lease
        self.deadline = lease.deadline
        self.reason: Optional[str] = None
        self.thread_event = threading.Event()
        #: Made by `begin()` on the loop (an asyncio.Event binds the loop it is made on).
        self.async_event: Optional[asyncio.Event] = None
        self.on_lost = on_lost
        self.tied = conn if lease.release_on_disconnect else None
        self.loop = loop
        self.post = post
        #: `reason` is set once, by the loop (a loss) or by the blocking guard's thread (its
        #: release); this makes the first one win.
        self._reason_lock = threading.Lock()
        self._stop: Optional[asyncio.Future] = None
        #: The call that starts the renewal task (see `begin`), until it ran or was cancelled.
        self._timer: Optional[asyncio.TimerHandle] = None
        self.task: Optional[asyncio.Task] = None
        #: A RELEASE of the lease was answered (RELEASED or NOT_OWNER): the lease is gone at the
        #: server, so a later release sends nothing and is NOT_OWNER, the server's own answer.
        self.release_answered = False

    def begin(self) -> None:
        """On the loop: arranges the renewals (none if the guard ended before this ran).

        A lease not tied to a connection has nothing to watch before its first renewal, so
        the renewal task starts then (or at the give-up instant, if earlier): a guard held
        for less than a third of its TTL costs the loop a timer, not a task.
        """
        self.async_event = asyncio.Event()
        self._stop = self.loop.create_future()
        self.client._keepers.add(self)
        if self.reason is not None:
            self.async_event.set()
            self._stop.set_result(None)
        elif self.client._closed:  # closed between the grant and this call
            self.stop()
            self.fire(LOSS_CLIENT_CLOSED)
        elif self.tied is not None:
            self._start_task()
        else:
            delay = self.start_by() - time.monotonic()
            self._timer = self.loop.call_later(max(0.0, delay), self._start_task)

    def start_by(self) -> float:
        """The latest instant `begin()` may run: the first renewal or the give-up instant; at
        once for a lease tied to a connection (its closing is watched from the grant)."""
        if self.tied is not None:
            return -math.inf
        return min(self._first_renew_at(), self.give_up_at())

    def _start_task(self) -> None:
        self._timer = None
        if self._stop is not None and not self._stop.done():
            self.task = self.loop.create_task(self._run(), name=f"tenure renew {self.lease.key!r}")

    def _first_renew_at(self) -> float:
        """The first renewal: `renew_every` after the instant the lease is counted from."""
        span_ms = self.lease.waited_ms + self.lease.ttl_ms
        return self.lease.deadline + deadline_margin_s(span_ms) - self.lease.ttl_ms / 1000 + self.renew_every

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def give_up_at(self) -> float:
        return self.deadline - self.margin

    def is_valid(self) -> bool:
        return self.reason is None and time.monotonic() < self.give_up_at()

    def fire(self, reason: str) -> Optional[str]:
        """Ends the guard with `reason` unless it had ended; returns the reason it already had."""
        with self._reason_lock:
            if self.reason is not None:
                return self.reason
            self.reason = reason
        self.thread_event.set()
        if self._on_loop():
            self._signal_loop()
        elif self.post is not None:
            # No hurry: a renewal task that wakes first sees `reason` and ends.
            self.post(self._signal_loop, math.inf)
        else:
            try:
                self.loop.call_soon_threadsafe(self._signal_loop)
            except RuntimeError:
                pass  # the loop is closed (the client was): no task is left to stop
        if reason == LOSS_RELEASED:
            return None  # the guard ended normally: not a loss, so no on_lost callback
        for callback in self.on_lost:
            try:
                callback(reason)
            except Exception:  # a callback's error must not stop the others
                log.exception("tenure: on_lost callback failed")
        return None

    def _signal_loop(self) -> None:
        """On the loop: sets the asyncio event and stops the renewal task."""
        if self.async_event is not None:
            self.async_event.set()
        self.stop()

    def stop(self) -> None:
        """On the loop: no renewal after this."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)

    async def _run(self) -> None:
        try:
            await self._renewals()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug, or an error no branch expects
            # The renewals have stopped: the guard says so now, instead of never (its
            # deadline would pass with `lost` unset).
            log.error("tenure: renewals of %r stopped: %r", self.lease.key, e)
            self.fire(f"renewals stopped by an unexpected error: {e!r}")

    async def _renewals(self) -> None:
        watched: Optional[Connection] = self.tied
        next_renew = self._first_renew_at()
        retry_delay = max(self.renew_every / 4, RENEW_RETRY_MIN_S)
        last_error: Optional[str] = None
        while True:
            now = time.monotonic()
            give_up_at = self.give_up_at()
            waiters = [self._stop] + ([watched.closed] if watched is not None else [])
            pause = min(next_renew, give_up_at) - now
            done, _ = await asyncio.wait(waiters, timeout=max(0.0, pause), return_when=asyncio.FIRST_COMPLETED)
            if self._stop in done or self.reason is not None:
                return
            if watched is not None and watched.closed in done:
                if self.tied is not None:
                    return self.fire(f"connection closed: {watched.error}")
                watched, next_renew = None, time.monotonic()
                continue
            if time.monotonic() >= give_up_at:
                return self._expired(last_error)
            if time.monotonic() < next_renew:
                continue
            outcome = await self._renew_once(give_up_at)
            if outcome is None:
                return  # stopped
            if isinstance(outcome, tuple):
                sent_at, renewed, conn = outcome
                self.deadline = max(self.deadline, renewed.deadline)
                next_renew, last_error = sent_at + self.renew_every, None
                if self.tied is None:
                    watched = conn
            elif outcome == LOSS_REVOKED:
                return self.fire(LOSS_REVOKED)
            elif outcome == "give up":
                return self._expired(last_error)
            else:
                log.debug("tenure: renewal of %r failed (%s); retrying", self.lease.key, outcome)
                last_error, next_renew = outcome, time.monotonic() + retry_delay

    def _attempt_timeout(self) -> float:
        """One renewal's wait: the request time-out; with several addresses no longer than the
        renewal period, so that after a hung node (left by the client) there is time to retry
        at another before the give-up point. With one address a slow answer is worth waiting
        for."""
        if len(self.client.endpoints) > 1:
            return min(self.client.timeout, self.renew_every)
        return self.client.timeout

    def _expired(self, last_error: Optional[str]) -> None:
        why = "lease ran out unconfirmed"
        self.fire(f"{why} (last renewal: {last_error})" if last_error else why)

    async def _renew_once(self, give_up_at: float) -> Any:
        """One RENEW raced against stop and the give-up instant.

        Returns (sent_at, Renewed, conn), LOSS_REVOKED, "give up", None (stopped) or an
        error text to retry after.
        """
        sent_at = time.monotonic()
        lease = self.lease
        renewal = self.client._renew(lease.key, lease.lease_id, lease.ttl_ms, self._attempt_timeout(), True)
        call = asyncio.ensure_future(renewal)
        done, _ = await asyncio.wait(
            [call, self._stop], timeout=max(0.0, give_up_at - sent_at), return_when=asyncio.FIRST_COMPLETED
        )
        if call not in done:
            call.cancel()
            return None if self._stop in done else "give up"
        try:
            result, conn = call.result()
        except (ServerError, ConnectionLost, RequestTimeout, OSError) as e:
            return str(e) or type(e).__name__
        if isinstance(result, Lost):
            return LOSS_REVOKED
        return sent_at, result, conn

    def release_target(self) -> Optional[Granted]:
        """Ends the guard as released by its owner; the lease to send RELEASE for, or None when
        the lease is known to be gone at the server: a RELEASE of it was answered (see
        `release_answered`), or a renewal was answered LOST. A lease lost to a connection
        failure or an unconfirmed deadline may still exist (a restarted server restores it),
        and so may one whose RELEASE failed (a lost connection, a time-out): it is released
        (again; a RELEASE is safe to repeat)."""
        before = self.fire(LOSS_RELEASED)
        return None if self.release_answered or before == LOSS_REVOKED else self.lease

    async def finish(self, release: bool, quiet: bool = True) -> Optional[ReleaseResult]:
        """Stops renewing; releases the lock unless it was already lost or released. `quiet`
        (a guard's exit): a failed RELEASE is logged and None returned, not raised."""
        self.stop()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        lease = self.release_target()
        if not release or lease is None:
            return None
        try:
            result = await self.client.release(lease)
        except (ServerError, ConnectionLost, RequestTimeout, OSError) as e:
            if not quiet:
                raise
            log.debug("tenure: release on exit failed: %s", e)
            return None
        self.release_answered = True
        return result


class _GuardView:
    """What both guard forms show of their lease."""

    _keeper: Optional[_Keeper]

    def _k(self) -> _Keeper:
        if self._keeper is None:
            raise LeaseLost("not acquired yet")
        return self._keeper

    @property
    def lease(self) -> Granted:
        """The grant: key, fencing token, lease id, TTL, waited_ms."""
        return self._k().lease

    @property
    def key(self) -> bytes:
        return self._k().lease.key

    @property
    def token(self) -> int:
        """The fencing token of this lease: send it with every write to the resource."""
        return self._k().lease.token

    @property
    def deadline(self) -> float:
        """The local deadline (time.monotonic), moved on by each confirmed renewal."""
        return self._k().deadline

    @property
    def loss_reason(self) -> Optional[str]:
        """Why the lease was lost, or None while it holds."""
        return self._k().reason

    def is_valid(self) -> bool:
        """True while not lost and the local deadline less the margin has not passed."""
        return self._keeper is not None and self._keeper.is_valid()

    def time_left(self) -> float:
        """Seconds until the guard gives up (deadline less margin); 0 once lost."""
        k = self._k()
        return 0.0 if k.reason is not None else max(0.0, k.give_up_at() - time.monotonic())

    def check(self) -> None:
        """Raises `LeaseLost` unless the lease still holds. Call it before each step of work.

        Also true while the process was paused: the local clock is read here, so a guard whose
        renewal task could not run still reports the loss.
        """
        k = self._k()
        if k.reason is not None:
            raise LeaseLost(k.reason)
        if time.monotonic() >= k.give_up_at():
            raise LeaseLost("lease ran out unconfirmed")


class AsyncLeaseGuard(_GuardView):
    """A lease renewed in a background task; see `AsyncClient.lock`.

    `lost` is an `asyncio.Event` set on loss; `check()` raises `LeaseLost`; `on_lost` is
    called with the reason (on the event loop).
    """

    def __init__(
        self,
        client: AsyncClient,
        key: Key,
        ttl: float,
        *,
        wait: float = 0.0,
        meta: Meta = b"",
        release_on_disconnect: bool = False,
        on_lost: Optional[Callable[[str], None]] = None,
        cancel_on_loss: bool = False,
        renew_every: Optional[float] = None,
        margin: Optional[float] = None,
        kind: bytes = b"",
    ) -> None:
        # Every argument is checked here, before anything is acquired, by the checks
        # `acquire()` makes: the same errors from `lock()` and `acquire()`.
        client._acquire_args(key, ttl, wait, meta, release_on_disconnect, kind=kind)
        _guard_timing(float(ttl), renew_every, margin)
        self._client = client
        self._args = (key, ttl, wait, meta, release_on_disconnect)
        # The ACQUIRE's kind bytes (semaphore.py): empty for a plain (or write) lock.
        self._kind = kind
        self._on_lost = [on_lost] if on_lost is not None else []
        self._cancel_on_loss = cancel_on_loss
        self._renew_every = renew_every
        self._margin = margin
        self._keeper = None
        self._body: Optional[asyncio.Task] = None
        self._cancelled_body = False

    @classmethod
    def _from_lease(
        cls, client: AsyncClient, lease: Granted, conn: Connection, renew_every: Optional[float] = None
    ) -> "AsyncLeaseGuard":
        guard = cls(client, lease.key, lease.ttl_ms / 1000, renew_every=renew_every)
        guard._start(lease, conn)
        return guard

    @property
    def lost(self) -> asyncio.Event:
        """Set when the guard no longer holds the lease: lost, or released on exit (`loss_reason`
        tells which; `on_lost` is called only for a loss)."""
        event = self._k().async_event
        assert event is not None, "an asyncio guard's keeper begins on its loop at once"
        return event

    async def acquire(self) -> "AsyncLeaseGuard":
        """Acquires and starts renewing; raises `NotAcquired` if the wait ran out."""
        result, conn = await self._acquire_call()
        self._start(self._granted(result), conn)
        return self

    async def _acquire_call(self, retry: Optional[_AcquireRetry] = None) -> Tuple[AcquireResult, Optional[Connection]]:
        key, ttl, wait, meta, rod = self._args
        return await self._client._acquire(key, ttl, wait, meta, rod, retry, self._kind)

    def _granted(self, result: AcquireResult) -> Granted:
        if isinstance(result, Locked):
            raise NotAcquired(_as_bytes(self._args[0], "key"), result.token, result.ttl_left_ms)
        return result

    def _start(
        self,
        lease: Granted,
        conn: Optional[Connection],
        loop: Optional[asyncio.AbstractEventLoop] = None,
        post: Optional["Post"] = None,
    ) -> None:
        """Starts renewing `lease`: at once on the running loop, or (from the blocking client's
        calling thread) by `post`ing the start to `loop`, without waiting for it."""
        self._on_lost.append(self._cancel_body)
        keeper = _Keeper(
            self._client,
            lease,
            conn,
            renew_every=self._renew_every,
            margin=self._margin,
            on_lost=self._on_lost,
            loop=loop or asyncio.get_running_loop(),
            post=post,
        )
        self._keeper = keeper
        if post is None:
            keeper.begin()
        else:
            post(keeper.begin, keeper.start_by())

    def _cancel_body(self, reason: str) -> None:
        if self._cancel_on_loss and self._body is not None and reason != LOSS_RELEASED:
            self._cancelled_body = True
            self._body.cancel()

    async def wait_lost(self) -> str:
        """Returns the loss reason once the lease is lost."""
        await self.lost.wait()
        return self._k().reason or ""

    async def release(self) -> Optional[ReleaseResult]:
        """Stops renewing and releases the lock: `Released`/`NotOwner`, or None when nothing
        was sent (already lost or released) or the RELEASE failed (logged, not raised)."""
        return await self._k().finish(release=True)

    async def __aenter__(self) -> "AsyncLeaseGuard":
        await self.acquire()
        self._body = asyncio.current_task()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Optional[bool]:
        self._body = None
        await self.release()
        if self._cancelled_body and exc_type is asyncio.CancelledError:
            task = asyncio.current_task()
            if sys.version_info >= (3, 11) and task is not None:
                task.uncancel()
            raise LeaseLost(self._k().reason or "lost") from exc
        return None


# -- elections --------------------------------------------------------------------------


class AsyncElection:
    """Leader election over the lock `election/<group>`: the term is the grant's fencing token.

    Candidates queue in line with release on disconnect when the client has one address: a
    leader whose connection drops loses at once and the next candidate leads. With several
    addresses (a cluster) they do not, unless `release_on_disconnect=True`: a fail-over closes
    every connection to the old leader while the lease lives on at the new one, and a tied
    leadership would end with each fail-over (the lock still held until its TTL, so nobody
    would lead meanwhile). Untied, the leader renews with its lease id at the new leader.
    """

    def __init__(
        self,
        client: AsyncClient,
        group: str,
        *,
        ttl: float = 10.0,
        wait_max: float = w.WAIT_MS_MAX / 1000,
        release_on_disconnect: Optional[bool] = None,
    ) -> None:
        self.client = client
        self.group = group
        self.key = f"election/{group}".encode("utf-8")
        # Checked now, as `acquire()` checks them, rather than at the first campaign.
        client._acquire_args(self.key, ttl, wait_max, b"", False)
        self.ttl = ttl
        self.wait_max = wait_max
        if release_on_disconnect is None:
            release_on_disconnect = len(client.endpoints) == 1
        self.release_on_disconnect = release_on_disconnect

    async def campaign(self, value: Meta = b"", *, renew_every: Optional[float] = None) -> "AsyncLeadership":
        """Waits until this candidate leads and returns its leadership (renewed in the background)."""
        while True:
            try:
                result, conn = await self.client._acquire(
                    self.key, self.ttl, self.wait_max, value, self.release_on_disconnect
                )
            except AcquireEnded as e:
                # Granted while the answer was lost, and over since: campaign again.
                log.debug("tenure: campaign's grant ended before it was seen (%s)", e)
                continue
            except (ConnectionLost, ServerError) as e:
                # The server restarted (or is restarting) under the standby: queue again. Not
                # after a timeout: the first request may still be queued on the server.
                if not is_transient(e):
                    raise
                log.debug("tenure: campaign interrupted (%s); queueing again", e)
                await asyncio.sleep(CAMPAIGN_RETRY_PAUSE_S)
                continue
            if isinstance(result, Granted):
                guard = AsyncLeaseGuard._from_lease(self.client, result, conn, renew_every)
                return AsyncLeadership(self, guard, _as_bytes(value, "value"))

    async def leader(self) -> Optional[Leader]:
        """The current leader, if any."""
        state = await self.client.inspect(self.key)
        return Leader(state.token, state.meta) if isinstance(state, Held) else None

    def observe(self) -> "AsyncObserver":
        """Every new leader from now on, in increasing term order, starting with the current one."""
        return AsyncObserver(self)


class AsyncLeadership:
    """This candidate leads until it resigns or its lease is lost."""

    def __init__(self, election: AsyncElection, guard: AsyncLeaseGuard, value: bytes) -> None:
        self.election = election
        self.guard = guard
        self.value = value

    @property
    def term(self) -> int:
        """The fencing token of the leader's grant: fence the leader's writes on it."""
        return self.guard.token

    @property
    def lost(self) -> asyncio.Event:
        return self.guard.lost

    def is_valid(self) -> bool:
        return self.guard.is_valid()

    def check(self) -> None:
        self.guard.check()

    async def resign(self) -> None:
        """Steps down: releases the lock so the next candidate leads."""
        await self.guard.release()


class AsyncObserver:
    """Leaders of a group, by WATCH of its lock; never yields a term not above the last one.

    When the watch fails (the connection closed) `next()` raises the error; the following
    call subscribes again.
    """

    def __init__(self, election: AsyncElection) -> None:
        self._election = election
        self._watch: Optional[AsyncWatch] = None
        self._last_term = 0
        self._failed = False

    def __aiter__(self) -> "AsyncObserver":
        return self

    async def __anext__(self) -> Leader:
        try:
            return await self.next()
        except ConnectionLost:
            if self._election.client._closed:  # the client was closed: the iteration ends
                raise StopAsyncIteration from None
            raise

    async def next(self) -> Leader:
        while True:
            if self._watch is None:
                if self._failed:
                    await asyncio.sleep(RESUBSCRIBE_DELAY_S)
                self._failed = True
                self._watch = await self._election.client.watch(self._election.key)
                self._failed = False
                initial = self._watch.initial
                if isinstance(initial, Held) and initial.token > self._last_term:
                    self._last_term = initial.token
                    return Leader(initial.token, initial.meta)
                continue
            try:
                event = await self._watch.next()
            except (ConnectionLost, ServerError):
                self._watch, self._failed = None, True
                raise
            if event is not None and event.kind == EventKind.GRANTED and event.token > self._last_term:
                self._last_term = event.token
                return Leader(event.token, event.meta)

    async def close(self) -> None:
        if self._watch is not None:
            await self._watch.close()
            self._watch = None

