"""Sessions (PROTOCOL.md 3.11): one keep-alive for many locks.

Blocking::

    with client.session(ttl=10) as s:
        with s.lock("a") as a, s.lock("b") as b:
            s.check()                      # raises LeaseLost once the session is gone
            write(..., token=a.token)

Read leases and semaphore permits live in a session as a lock does (PROTOCOL.md 3.10, 3.11),
each a lease of its own with its own token, kept alive by the session's keep-alives::

    with client.session(ttl=10) as s:
        with s.semaphore("partner-api", permits=4) as permit, s.read_lock("doc") as r:
            ...                            # s.write_lock("doc") waits for r, as outside one

asyncio::

    async with client.session(ttl=10) as s:
        async with s.lock("a") as a:
            ...

A session keeps itself alive in a task on the client's event loop, one SESSION_KEEPALIVE every
third of its TTL, counted from the monotonic instant taken before each send. Its locks need no
renewal: they live while the session does. The session, and every lock in it, is valid until
(the instant before the last confirmed keep-alive was sent) + TTL - max(2 ms, 0.1 % of the TTL),
and the loss signal fires when that deadline less the margin passes unconfirmed, when a
keep-alive is answered NO_SESSION, or when the session is closed. Leaving the `with` block
closes the session (SESSION_CLOSE): every lock still in it is freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from . import _wire as w
from . import semaphore as _kinds
from .errors import (
    CannotConnect,
    ConnectionLost,
    InvalidArgument,
    LeaseLost,
    NotAcquired,
    ProtocolError,
    RequestTimeout,
    ServerError,
    is_transient,
)
from .results import Locked, deadline_margin_s, local_deadline

if TYPE_CHECKING:
    from .aio import AsyncClient
    from .client import Client

log = logging.getLogger("tenure")

#: Pause before an unanswered RELEASE of a session lock, or a SESSION_OPEN whose answer was
#: lost, is sent again, doubled per retry up to the max: a fail-over takes an election (about
#: a second), a restart longer.
RETRY_PAUSE_MIN_S = 0.05
RETRY_PAUSE_MAX_S = 0.8

#: Why a session (and its locks) ended, as `loss_reason` says it.
#: Most rounds of SESSION_OPEN with fresh session ids one open sends: a resend whose session
#: ended before its answer came (a TTL shorter than the time the answer took) hears
#: NO_SESSION, or is answered past the deadline counted from its first send, and the open
#: starts again with a new id.
SESSION_OPEN_ROUNDS_MAX = 3
LOSS_ENDED = "session ended at the server (NO_SESSION)"
LOSS_CLOSED = "session closed by its owner"
LOSS_EXPIRED = "session ran out unconfirmed"
LOSS_RELEASED = "released by its owner"
#: Shortest pause before a failed keep-alive is sent again.
KEEP_ALIVE_RETRY_MIN_S = 0.005


def _timing(ttl: float, every: Optional[float], margin: Optional[float]) -> "tuple[float, float]":
    every = ttl / 3 if every is None else float(every)
    margin = ttl / 10 if margin is None else float(margin)
    if every <= 0 or margin < 0 or every + margin >= ttl:
        raise InvalidArgument(
            f"keep_alive_every {every} s + margin {margin} s must be shorter than the session ttl {ttl} s"
        )
    return every, margin


class AsyncSession:
    """A session on an `AsyncClient`, made by `client.session(ttl)` and opened by `async with`
    (or `await session.open()`)."""

    def __init__(self, client: "AsyncClient", ttl: float, keep_alive_every: Optional[float], margin: Optional[float]):
        from .aio import _ms  # the one duration check of every entry point

        self.client = client
        self._ttl_ms = _ms(ttl, "ttl", w.TTL_MS_MIN, client._limits()[2])
        self.every, self.margin = _timing(self._ttl_ms / 1000, keep_alive_every, margin)
        #: The session id (16 bytes); `session_id` is its hex form.
        self.id = b""
        self.deadline = 0.0
        #: Why the session ended, once it did.
        self.loss_reason: Optional[str] = None
        #: Set on loss; any thread may wait on it.
        self.thread_event = threading.Event()
        self._lost: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None

    @property
    def session_id(self) -> str:
        return self.id.hex()

    @property
    def ttl(self) -> float:
        """The session's TTL in seconds, as the server granted it."""
        return self._ttl_ms / 1000

    @property
    def lost(self) -> asyncio.Event:
        """Set when the session (and so every lock in it) is lost or closed."""
        assert self._lost is not None, "the session is not open"
        return self._lost

    def give_up_at(self) -> float:
        return self.deadline - self.margin

    def is_valid(self) -> bool:
        """True while the session is alive as far as this client can tell (cheap)."""
        return self.loss_reason is None and time.monotonic() < self.give_up_at()

    def check(self) -> None:
        """Raises `LeaseLost` once the session is not valid."""
        if not self.is_valid():
            raise LeaseLost(self.loss_reason or LOSS_EXPIRED)

    def _fire(self, reason: str) -> None:
        if self.loss_reason is not None:
            return
        self.loss_reason = reason
        self.thread_event.set()
        if self._lost is not None:
            self._lost.set()

    async def open(self) -> "AsyncSession":
        """Sends SESSION_OPEN (again while its outcome is unknown) and starts the keep-alives."""
        opcode, reply, sent_at = await self._open_answered()
        self.id, self._ttl_ms = _session_reply(opcode, reply)
        self.deadline = local_deadline(sent_at, 0, self._ttl_ms)
        self._lost = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tenure session keep-alive")
        return self

    async def _open_answered(self) -> "tuple[int, bytes, float]":
        """SESSION_OPEN's answer and the instant before its first send. The open carries a
        session id picked here (16 random bytes), and an open whose answer was lost (a lost
        connection, a time-out, NOT_LEADER or SHUTTING_DOWN) is sent again with that id until
        `acquire_retry_for` (at least `timeout`) after the first send, as an ACQUIRE is: a
        resend finds the session an earlier send opened, so none is left behind empty
        (PROTOCOL.md 3.11). The session counts from the first send, the earliest that can have
        opened it. A resend that hears NO_SESSION (the session it opened has ended already),
        or is answered past the deadline counted from the first send, starts again with a new
        id, at most `SESSION_OPEN_ROUNDS_MAX` rounds. Before outside test a49 (P1) the first lost answer was
        raised."""
        for round in range(1, SESSION_OPEN_ROUNDS_MAX + 1):
            first_sent_at = time.monotonic()
            body = w.session_open_body(self._ttl_ms, secrets.token_bytes(16))
            try:
                opcode, reply = await self._open_sent(body)
            except ServerError as e:
                if e.code != w.NO_SESSION or round == SESSION_OPEN_ROUNDS_MAX:
                    raise
                log.debug("tenure: the session an earlier SESSION_OPEN opened has ended; opening another")
                continue
            # Answered past the deadline counted from the first send: the server may have
            # forgotten the session a send opened and opened the id again, empty, for a later
            # one (outside test a60, F2). A new round, as after NO_SESSION.
            late = opcode == w.SESSION and time.monotonic() >= local_deadline(first_sent_at, 0, self._ttl_ms)
            if not late or round == SESSION_OPEN_ROUNDS_MAX:
                return opcode, reply, first_sent_at
            log.debug("tenure: SESSION_OPEN answered past its session's deadline; opening another")
        raise AssertionError("unreachable")

    async def _open_sent(self, body: bytes) -> "tuple[int, bytes]":
        """SESSION_OPEN of `body`, sent again while its outcome is unknown."""
        client = self.client
        give_up_at = time.monotonic() + max(client.timeout, client.acquire_retry_for)
        pause = RETRY_PAUSE_MIN_S
        # As ACQUIRE's sends do: a last send cut short by the retries running out that times
        # out (or cannot connect in what is left) reports the previous send's failure, not a
        # time-out it never had in full (outside test a61).
        last: Optional[Exception] = None
        while True:
            now = time.monotonic()
            cut_short = give_up_at - now < client.timeout
            timeout = max(0.001, min(client.timeout, give_up_at - now))
            try:
                opcode, reply, _, _ = await client._call_sent(w.SESSION_OPEN, body, timeout)
                return opcode, reply
            except (ConnectionLost, RequestTimeout, ServerError, OSError) as e:
                unknown = is_transient(e) or isinstance(e, RequestTimeout)
                if not unknown:
                    raise
                if cut_short and last is not None and isinstance(e, (RequestTimeout, CannotConnect)):
                    raise last from None
                if time.monotonic() + pause >= give_up_at:
                    raise
                log.debug("tenure: SESSION_OPEN outcome unknown (%s); sending it again", e)
                last = e
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_PAUSE_MAX_S)

    async def __aenter__(self) -> "AsyncSession":
        return self if self._task is not None else await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close(quiet=True)

    async def close(self, quiet: bool = False) -> Optional[int]:
        """Closes the session: every lock in it is freed at once. Returns how many were freed
        (None when nothing was sent: the session had ended; or, with `quiet`, the close failed)."""
        ended = self.loss_reason == LOSS_ENDED
        self._fire(LOSS_CLOSED)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if ended or not self.id:
            return None
        try:
            opcode, reply, _ = await self.client._call(w.SESSION_CLOSE, self.id, keeping=True)
        except ServerError as e:
            if e.code == w.NO_SESSION:
                return None
            if not quiet:
                raise
        except (ConnectionLost, RequestTimeout, OSError) as e:
            if not quiet:
                raise
            log.debug("tenure: session close failed: %s", e)
            return None
        else:
            if opcode == w.SESSION_CLOSED:
                return w.Reader(reply).u32()
            if not quiet:
                raise ProtocolError(f"reply opcode 0x{opcode:02x} to SESSION_CLOSE")
        return None

    def lock(self, key: Any, *, wait: float = 0.0, meta: Any = b"") -> "AsyncSessionLock":
        """`async with session.lock("a", wait=5) as lock:` takes `key` in this session."""
        return AsyncSessionLock(self, key, wait, meta)

    def semaphore(
        self, key: Any, permits: int, *, count: int = 1, wait: float = 0.0, meta: Any = b""
    ) -> "AsyncSessionLock":
        """`async with session.semaphore("pool", permits=4) as permit:` takes `count` (default
        one) of the `permits` permits of semaphore `key` in this session, as
        `client.semaphore()` does outside one; `BadPermits` for counts out of range (raised
        here, before anything is sent), `KindMismatch` when the key is of another kind."""
        return AsyncSessionLock(self, key, wait, meta, _kinds.permits(count, permits))

    def read_lock(self, key: Any, *, wait: float = 0.0, meta: Any = b"") -> "AsyncSessionLock":
        """A read lease on `key` in this session, beside other readers (`client.read_lock()`)."""
        return AsyncSessionLock(self, key, wait, meta, _kinds.SHARED)

    def write_lock(self, key: Any, *, wait: float = 0.0, meta: Any = b"") -> "AsyncSessionLock":
        """The write side of read/write lock `key` in this session: the key alone, `lock()`."""
        return AsyncSessionLock(self, key, wait, meta)

    async def _run(self) -> None:
        # The open's `sent_at`, recovered from the deadline counted from it.
        next_at = self.deadline + deadline_margin_s(self._ttl_ms) - self.ttl + self.every
        retry = max(self.every / 4, KEEP_ALIVE_RETRY_MIN_S)
        last_error: Optional[str] = None
        timeout = self.client.timeout
        if len(self.client.endpoints) > 1:
            timeout = min(timeout, self.every)
        while self.loss_reason is None:
            now = time.monotonic()
            if now >= self.give_up_at():
                why = f"{LOSS_EXPIRED} (last keep-alive: {last_error})" if last_error else LOSS_EXPIRED
                return self._fire(why)
            if now < next_at:
                await asyncio.sleep(min(next_at, self.give_up_at()) - now)
                continue
            call = self.client._call_sent(w.SESSION_KEEPALIVE, self.id, timeout, keeping=True)
            try:
                opcode, reply, _, sent_at = await asyncio.wait_for(call, max(0.0, self.give_up_at() - now))
                _, ttl_ms = _session_reply(opcode, reply)
            except ServerError as e:
                if e.code == w.NO_SESSION:
                    return self._fire(LOSS_ENDED)
                last_error, next_at = str(e), time.monotonic() + retry
                continue
            except (ConnectionLost, RequestTimeout, OSError, asyncio.TimeoutError) as e:
                # A lost connection, a restarting server or a fail-over: the next send goes
                # to the restarted server or the new leader, until the give-up point.
                last_error, next_at = str(e) or type(e).__name__, time.monotonic() + retry
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the keep-alive must outlive any one failure
                # Anything else (a garbled answer from a node going down) is retried too: a
                # keep-alive task that died would leave `lost` unset while the session runs out.
                log.debug("tenure: session keep-alive failed: %r", e)
                last_error, next_at = repr(e), time.monotonic() + retry
                continue
            # Counted from before the answered send: never later than the server's deadline.
            self.deadline = max(self.deadline, local_deadline(sent_at, 0, ttl_ms))
            next_at, last_error = sent_at + self.every, None


def _session_reply(opcode: int, reply: bytes) -> "tuple[bytes, int]":
    if opcode != w.SESSION:
        raise ProtocolError(f"reply opcode 0x{opcode:02x}, expected SESSION")
    r = w.Reader(reply)
    return r.take(16), r.u32()


class AsyncSessionLock:
    """A lock held in an `AsyncSession`: no renewal of its own, lost with its session."""

    def __init__(self, session: AsyncSession, key: Any, wait: float, meta: Any, kind: bytes = b"") -> None:
        self.session = session
        # Checked here, in the caller's thread, as `lock()` checks its arguments.
        body = session.client._acquire_args(key, 0, wait, meta, False, kind=kind, session=session.id)
        self._args = (key, wait, meta)
        #: The ACQUIRE's kind bytes (semaphore.py): empty for the key alone.
        self._kind = kind
        self.key = w.Reader(body).bytes16()
        self.token = 0
        self.lease_id = b""
        self._released = False

    async def acquire(self) -> "AsyncSessionLock":
        """Takes the lock; raises `NotAcquired` if the wait ran out, `NoSession` (a
        `ServerError`) if the session has ended. The ACQUIRE takes the client's one path
        (`AsyncClient._acquire`), as `lock()` does."""
        session = self.session
        session.check()
        key, wait, meta = self._args
        try:
            result, _ = await session.client._acquire(key, 0, wait, meta, False, kind=self._kind, session=session.id)
        except ServerError as e:
            if e.code == w.NO_SESSION:
                session._fire(LOSS_ENDED)
            raise
        if isinstance(result, Locked):
            raise NotAcquired(self.key, result.token, result.ttl_left_ms)
        self.token, self.lease_id = result.token, result.lease_id
        return self

    @property
    def loss_reason(self) -> Optional[str]:
        return LOSS_RELEASED if self._released else self.session.loss_reason

    def is_valid(self) -> bool:
        return not self._released and bool(self.lease_id) and self.session.is_valid()

    def check(self) -> None:
        """Raises `LeaseLost` once the lock is not valid."""
        if not self.is_valid():
            raise LeaseLost(self.loss_reason or LOSS_EXPIRED)

    @property
    def lost(self) -> asyncio.Event:
        """The session's loss event (a released lock does not set it)."""
        return self.session.lost

    async def release(self) -> None:
        """Releases this lock alone (RELEASE); the session and its other locks go on.

        A session lock has no TTL of its own: a RELEASE that goes unanswered would leave the
        key held for as long as the session lives. So a lost connection, a time-out or a
        transient refusal (NOT_LEADER, SHUTTING_DOWN, ...) is sent again, to the restarted
        server or the new leader, for up to the client's `acquire_retry_for`; after that it is
        logged, and the next `release()` sends it again (the session's close frees it too)."""
        if self._released or not self.lease_id:
            return
        if self.session.loss_reason is not None:
            self._released = True
            return  # gone with its session
        body = w.release_body(self.key, self.lease_id)
        client = self.session.client
        give_up_at = time.monotonic() + max(client.timeout, client.acquire_retry_for)
        pause = RETRY_PAUSE_MIN_S
        while True:
            try:
                # RELEASED or NOT_OWNER: either way the lease is no longer this lock's.
                await client._call(w.RELEASE, body)
                self._released = True
                return
            except (ServerError, ConnectionLost, RequestTimeout, OSError) as e:
                retry = is_transient(e) or isinstance(e, RequestTimeout)
                if not retry or self.session.loss_reason is not None:
                    self._released = self.session.loss_reason is not None
                    log.debug("tenure: release of a session lock failed: %s", e)
                    return
                if time.monotonic() + pause >= give_up_at:
                    log.warning("tenure: release of a session lock not answered, kept for a retry: %s", e)
                    return
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_PAUSE_MAX_S)

    async def __aenter__(self) -> "AsyncSessionLock":
        return await self.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()


class Session:
    """The blocking form of `AsyncSession`, made by `client.session(ttl)`; its keep-alives run
    on the client's I/O thread."""

    def __init__(self, client: "Client", inner: AsyncSession) -> None:
        self._client = client
        self._inner = inner

    @property
    def session_id(self) -> str:
        return self._inner.session_id

    @property
    def ttl(self) -> float:
        return self._inner.ttl

    @property
    def deadline(self) -> float:
        return self._inner.deadline

    @property
    def lost(self) -> threading.Event:
        """Set when the session (and every lock in it) is lost or closed."""
        return self._inner.thread_event

    @property
    def loss_reason(self) -> Optional[str]:
        return self._inner.loss_reason

    def is_valid(self) -> bool:
        return self._inner.is_valid()

    def check(self) -> None:
        self._inner.check()

    def wait_lost(self, timeout: Optional[float] = None) -> Optional[str]:
        """Blocks until the session is lost (the reason) or `timeout` seconds pass (None)."""
        return self.loss_reason if self.lost.wait(timeout) else None

    def lock(self, key: Any, *, wait: float = 0.0, meta: Any = b"") -> "SessionLock":
        """`with session.lock("a", wait=5) as lock:` takes `key` in this session."""
        return SessionLock(self, self._inner.lock(key, wait=wait, meta=meta))

    def semaphore(
        self, key: Any, permits: int, *, count: int = 1, wait: float = 0.0, meta: Any = b""
    ) -> "SessionLock":
        """`with session.semaphore("pool", permits=4) as permit:`; see `AsyncSession.semaphore`."""
        return SessionLock(self, self._inner.semaphore(key, permits, count=count, wait=wait, meta=meta))

    def read_lock(self, key: Any, *, wait: float = 0.0, meta: Any = b"") -> "SessionLock":
        """`with session.read_lock("doc") as r:` a read lease on `key` in this session."""
        return SessionLock(self, self._inner.read_lock(key, wait=wait, meta=meta))

    def write_lock(self, key: Any, *, wait: float = 0.0, meta: Any = b"") -> "SessionLock":
        """`with session.write_lock("doc") as w:` the key alone in this session, `lock()`."""
        return SessionLock(self, self._inner.write_lock(key, wait=wait, meta=meta))

    def close(self) -> Optional[int]:
        """Closes the session (every lock in it freed at once); how many were freed."""
        return self._client._run(self._inner.close())

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._client._run(self._inner.close(quiet=True))


class SessionLock:
    """The blocking form of `AsyncSessionLock`."""

    def __init__(self, session: Session, inner: AsyncSessionLock) -> None:
        self._session = session
        self._inner = inner

    @property
    def key(self) -> bytes:
        return self._inner.key

    @property
    def token(self) -> int:
        return self._inner.token

    @property
    def lease_id(self) -> bytes:
        return self._inner.lease_id

    @property
    def loss_reason(self) -> Optional[str]:
        return self._inner.loss_reason

    @property
    def lost(self) -> threading.Event:
        return self._session.lost

    def is_valid(self) -> bool:
        return self._inner.is_valid()

    def check(self) -> None:
        self._inner.check()

    def acquire(self) -> "SessionLock":
        self._session._client._run(self._inner.acquire())
        return self

    def release(self) -> None:
        self._session._client._run(self._inner.release())

    def __enter__(self) -> "SessionLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
