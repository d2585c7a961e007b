"""The blocking client: `Client`, `LeaseGuard`, `Watch`, `Election`.

A `Client` runs an `AsyncClient` on an event loop in one background thread of its own (the
client's I/O thread): calls from any number of threads are pipelined over its one connection,
and lease guards renew there, so renewals go on while the calling thread computes or blocks.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import socket
import threading
import time
import weakref
from typing import Any, Awaitable, Callable, Coroutine, Dict, Iterator, List, Optional, Tuple, TypeVar, Union

from . import _wire as w
from . import semaphore as _kinds
from .aio import (
    AsyncClient,
    AsyncElection,
    AsyncLeadership,
    AsyncLeaseGuard,
    AsyncObserver,
    AsyncWatch,
    Credentials,
    REFUSED_BEFORE,
    UseLoop,
    _DIRECT,
    _AcquireRetry,
    _SENDING_ACQUIRE,
    ACQUIRE_RETRY_FOR_DEFAULT_S,
    Key,
    Meta,
    TlsOptions,
    _GuardView,
    _timeout,
)
from ._sync import SyncConnection
from .session import Session
from .errors import ConnectionLost, RequestTimeout, ServerError
from .results import (
    AcquireResult,
    CheckResult,
    Event,
    Granted,
    KeyState,
    Leader,
    NotOwner,
    ReleaseResult,
    RenewResult,
)

T = TypeVar("T")
log = logging.getLogger("tenure")
#: The error code NOT_LEADER (23) as it starts an ERROR body.
NOT_LEADER_CODE = (23).to_bytes(2, "big")


class _IoThread:
    """An event loop running in a daemon thread; coroutines are submitted to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.stopped = False
        self.thread = threading.Thread(target=self._main, name="tenure-io", daemon=True)
        self.thread.start()
        _RUNNING.add(self)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # Stopped by close(): end what is left (read loops, renewals) and free the loop.
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            # One more turn: the transports closed by the cancelled read loops finish closing.
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("blocking tenure call from the client's own I/O thread (an on_lost callback?)")
        if self.stopped:
            coro.close()
            raise ConnectionLost("client closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self.stopped:  # the loop stopped under this call: the client was closed
                raise ConnectionLost("client closed") from None
            raise
        except BaseException:
            # This thread stopped waiting (a signal's exception, KeyboardInterrupt): stop the
            # task too, so that an ACQUIRE it sent is recognised as abandoned and a late grant
            # released rather than kept by no one.
            future.cancel()
            raise

    def stop(self) -> None:
        self.stopped = True
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)


#: How long the blocking guards' calls to the I/O thread may wait to be handed over together.
#: One hand-off wakes the loop thread, which then competes with the caller for the
#: interpreter; batched, a loop of short `with client.lock()` blocks wakes it at most once per
#: period instead of twice per block. Only calls due later than two periods wait.
HANDOFF_BATCH_S = 0.02


class _Handoff:
    """Calls from other threads to the I/O loop, run there in order, by their due instant."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._calls: List[Callable[[], None]] = []
        #: A drain is on its way (armed, or its arming handed over).
        self._armed = False

    def post(self, call: Callable[[], None], latest: float) -> None:
        """Runs `call` on the loop by `latest` (time.monotonic) at the latest."""
        if latest - time.monotonic() < 2 * HANDOFF_BATCH_S:
            self._hand_over(call)
            return
        with self._lock:
            self._calls.append(call)
            arm, self._armed = not self._armed, True
        if arm:
            self._hand_over(self._arm)

    def _hand_over(self, call: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(call)
        except RuntimeError:
            pass  # the loop is closed: so is the client, and its guards ended with it

    def _arm(self) -> None:
        self.loop.call_later(HANDOFF_BATCH_S, self.drain)

    def drain(self) -> None:
        """On the loop: runs every call posted so far."""
        with self._lock:
            calls, self._calls = self._calls, []
            self._armed = False
        for call in calls:
            try:
                call()
            except Exception:  # one call's failure must not drop the others
                log.exception("tenure: a call handed to the I/O thread failed")


#: The I/O threads not stopped yet (a client that was never closed keeps its own running).
_RUNNING: "weakref.WeakSet[_IoThread]" = weakref.WeakSet()
#: The clients not closed yet, for their direct sockets (which no I/O thread owns).
_OPEN: "weakref.WeakSet[Client]" = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """Closes the connections of clients never closed and stops their I/O threads. Their
    loops run in daemon threads, which the interpreter would freeze mid-way and then destroy
    with the tasks still pending (read loops, renewals), printing asyncio's "Task was
    destroyed but it is pending!"; their direct sockets would be collected open, each a
    `ResourceWarning` under `python -X dev`. Stopped here, the tasks are cancelled and the
    connections closed, as by `close()` (guards are not told: the program is ending)."""
    for client in list(_OPEN):
        client._drop_direct()
    for io in list(_RUNNING):
        io.stop()


async def _build(factory: Callable[[], T]) -> T:
    """Runs `factory` on the I/O loop (objects that need a running loop are made there)."""
    return factory()


async def _after_refusal(coro: Coroutine[Any, Any, T], refused: str) -> T:
    """Runs `coro`, the loop's send of a call whose direct send was answered `refused` (its
    outcome unknown), so that its search reports that answer, not a later refusal alone."""
    REFUSED_BEFORE.set(refused)
    return await coro


class Client:
    """A blocking tenure client. Safe to share between threads.

    `Client("127.0.0.1:7878")` connects at once (errors are raised here). Several addresses,
    `"a:7878,b:7878,c:7878"`, make a cluster client that follows `NOT_LEADER` to the leader.
    Durations are seconds (floats). Options are those of `AsyncClient`.
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
        tls: Optional[Union[TlsOptions, Any]] = None,
        lazy: bool = False,
        acquire_retry_for: float = ACQUIRE_RETRY_FOR_DEFAULT_S,
    ) -> None:
        self._closed = False
        self._io = _IoThread()
        self._handoff = _Handoff(self._io.loop)
        self._sync: Optional[SyncConnection] = None
        self._sync_lock = threading.Lock()
        #: The direct path is plain TCP only; TLS goes through the I/O thread.
        self._sync_usable = tls is None
        def make() -> AsyncClient:
            return AsyncClient(
                addrs,
                timeout=timeout,
                connect_timeout=connect_timeout,
                reconnect_delay_min=reconnect_delay_min,
                reconnect_delay_max=reconnect_delay_max,
                in_flight_max=in_flight_max,
                credentials=credentials,
                tls=tls,
                acquire_retry_for=acquire_retry_for,
            )

        try:
            self.aio: AsyncClient = self._io.run(_build(make))
            if not lazy:
                self._io.run(self.aio.__aenter__())
        except BaseException:
            self._io.stop()
            raise
        _OPEN.add(self)

    def __del__(self) -> None:
        # Dropped without close(): the collector would close the direct socket with a
        # ResourceWarning; closed here, the same happens quietly. The I/O thread keeps running
        # until exit, as it did, for renewals of leases whose guards were dropped too.
        self._drop_direct()

    def _drop_direct(self) -> None:
        """Closes the direct socket without waiting for `_sync_lock`: only at exit (a daemon
        thread using it is about to be frozen) or when nothing can reach this client."""
        sync = getattr(self, "_sync", None)
        if sync is not None:
            self._sync = None
            sync.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._io.run(coro)

    def _fast(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Runs the call `make()` in this thread over the synchronous connection when no other
        thread is using it (and the client is on plain TCP); otherwise on the I/O thread,
        pipelined. A call the direct path cannot take is refused before anything is sent."""
        refused: Optional[str] = None
        if self._sync_usable and self._sync_lock.acquire(blocking=False):
            try:
                reset = _DIRECT.set(self._direct_call)
                try:
                    coro = make()
                    try:
                        coro.send(None)
                    except StopIteration as done:
                        return done.value  # type: ignore[no-any-return]
                    except UseLoop as e:
                        refused = e.refused
                    else:
                        coro.close()
                        raise RuntimeError("a direct tenure call suspended")
                finally:
                    _DIRECT.reset(reset)
            finally:
                self._sync_lock.release()
        if refused is not None:
            return self._run(_after_refusal(make(), refused))
        return self._run(make())

    def _direct_call(self, opcode: int, body: bytes, timeout: float) -> Tuple[int, bytes]:
        conn = self._sync
        if conn is not None and conn.is_stale():
            conn.close()
            conn = self._sync = None
        if conn is None:
            conn = self._sync = self._open_sync(timeout)
        try:
            opcode_in, reply = conn.call(opcode, body, timeout)
        except RequestTimeout as e:
            self._sync = None
            self._leave_hung(self.aio._conn, str(e))
            if opcode == w.ACQUIRE:
                # Drains and closes it, releasing a late grant unless the ACQUIRE, sent again
                # with its acquire id on the loop, is still retried or kept it.
                conn.abandon_acquire(body, _SENDING_ACQUIRE.get())
            else:
                conn.close()
            raise
        except BaseException:
            conn.close()
            self._sync = None
            raise
        if opcode_in == w.ERROR and reply[:2] == NOT_LEADER_CODE:
            # A follower: the next direct connection goes where the pipelined one is sent.
            conn.close()
            self._sync = None
        return opcode_in, reply

    def _leave_hung(self, conn: Any, why: str) -> None:
        """Has the I/O thread leave `conn`'s node, which did not answer in time (see
        `AsyncClient.leave_hung`)."""
        if conn is not None and not self._io.stopped:
            self._io.loop.call_soon_threadsafe(self.aio.leave_hung, conn, why)

    def _open_sync(self, timeout: float) -> SyncConnection:
        """The synchronous connection, to the server the pipelined one reached (it may have
        followed a leader); UseLoop when there is none yet or it cannot be opened, and
        RequestTimeout when that server does not answer within the call's `timeout` (a hung
        node: the call would otherwise wait once here and once more on the loop)."""
        current = self.aio._conn
        if current is None or current.is_closed():
            raise UseLoop("not connected")
        host, _, port = current.address.rpartition(":")
        creds = self.aio.credentials
        auth = (creds.name.encode("utf-8"), creds.secret) if creds is not None else None
        budget = min(self.aio.connect_timeout, timeout)
        try:
            return SyncConnection.open(host, int(port), budget, auth)
        except (socket.timeout, RequestTimeout):
            why = f"no answer within {timeout:.3f} s"
            self._leave_hung(current, why)
            raise RequestTimeout(why) from None
        except Exception as e:
            raise UseLoop(f"direct connection failed: {e}") from e

    @property
    def closed(self) -> bool:
        """True once `close()` was called."""
        return self._closed

    def close(self) -> None:
        """Closes the connection and stops the I/O thread. Later calls raise ConnectionLost;
        iterations over a watch or an observer of this client end."""
        self._closed = True
        _OPEN.discard(self)
        if self._io.stopped:
            return
        with self._sync_lock:
            if self._sync is not None:
                self._sync.close()
                self._sync = None
        try:
            self._run(self._close_on_loop())
        finally:
            self._io.stop()

    async def _close_on_loop(self) -> None:
        # Guards whose start is still waiting to be handed over start now, so that closing
        # ends them too ("client closed").
        self._handoff.drain()
        await self.aio.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def disconnect(self) -> None:
        """Drops the connections; the next request opens a new one."""
        with self._sync_lock:
            if self._sync is not None:
                self._sync.close()
                self._sync = None
        self._io.loop.call_soon_threadsafe(self.aio.disconnect)

    @property
    def server_limits(self) -> Optional[w.ServerLimits]:
        return self.aio.server_limits

    def ping(self) -> float:
        """Round trip to the server, in seconds."""
        return self._fast(lambda: self.aio.ping())

    def acquire(
        self, key: Key, ttl: float, *, wait: float = 0.0, meta: Meta = b"", release_on_disconnect: bool = False
    ) -> AcquireResult:
        """`Granted` (the lease) or `Locked`; see `AsyncClient.acquire`."""
        # One retry state for both paths: a move from the direct path to the loop sends the
        # same ACQUIRE (same acquire id, deadline from the same first send).
        retry = _AcquireRetry()

        async def call() -> AcquireResult:
            result, _ = await self.aio._acquire(key, ttl, wait, meta, release_on_disconnect, retry)
            return result

        return self._fast(call)

    def renew(self, lease: Granted, ttl: Optional[float] = None) -> RenewResult:
        """`Renewed` (with the new local deadline) or `Lost`."""
        return self._fast(lambda: self.aio.renew(lease, ttl))

    def release(self, lease: Union[Granted, Tuple[Key, bytes], "LeaseGuard"]) -> ReleaseResult:
        """`Released` or `NotOwner`. `lease` is a `Granted`, a (key, lease id) pair, or a lease
        guard (`lock()`'s, or a leadership): the guard stops renewing and ends as released
        (`loss_reason` "released by its owner"). A guard whose lease is known gone (a RELEASE
        of it answered, or a renewal answered LOST) sends nothing and is `NotOwner`, the
        server's answer; after a RELEASE that failed, the RELEASE is sent again."""
        if isinstance(lease, LeaseGuard):
            return lease._release(quiet=False) or NotOwner()
        return self._fast(lambda: self.aio.release(lease))

    def inspect(self, key: Key) -> KeyState:
        """`Free` or `Held`."""
        return self._fast(lambda: self.aio.inspect(key))

    def check(self, key: Key, token: int) -> CheckResult:
        """`Current` or `Stale`."""
        return self._fast(lambda: self.aio.check(key, token))

    def stats(self) -> Dict[str, int]:
        return self._fast(lambda: self.aio.stats())

    def watch(self, key: Key) -> "Watch":
        """The key's state now (`watch.initial`), then its changes: iterate, or `next(timeout)`."""
        return Watch(self, self._run(self.aio.watch(key)))

    def lock(
        self,
        key: Key,
        ttl: float,
        *,
        wait: float = 0.0,
        meta: Meta = b"",
        release_on_disconnect: bool = False,
        on_lost: Optional[Callable[[str], None]] = None,
        renew_every: Optional[float] = None,
        margin: Optional[float] = None,
    ) -> "LeaseGuard":
        """`with client.lock("order:1842", ttl=30, wait=10) as lease:`.

        Acquires on entry (raising `NotAcquired` if the wait runs out), renews every third of
        the TTL on the I/O thread, releases on exit. Loss: `lease.lost` (a threading.Event),
        `lease.check()` raising `LeaseLost`, and `on_lost(reason)` called on the I/O thread.
        """
        # Made (and its arguments checked) in the calling thread: an AsyncLeaseGuard touches
        # no loop until it acquires.
        guard = LeaseGuard(self)
        guard._inner = AsyncLeaseGuard(
            self.aio,
            key,
            ttl,
            wait=wait,
            meta=meta,
            release_on_disconnect=release_on_disconnect,
            on_lost=on_lost,
            renew_every=renew_every,
            margin=margin,
        )
        return guard

    def semaphore(
        self, key: Key, permits: int, ttl: float = _kinds.DEFAULT_TTL, *, count: int = 1, **options: Any
    ) -> "LeaseGuard":
        """`with client.semaphore("partner-api", permits=4, wait=10) as permit:`: `count`
        (default one) of the `permits` permits of semaphore `key`, as a guard like `lock()`'s
        (same keywords, loss signals, renewal and `token`); see `AsyncClient.semaphore`."""
        return self._kind_guard(key, ttl, _kinds.permits(count, permits), options)

    def read_lock(self, key: Key, ttl: float = _kinds.DEFAULT_TTL, **options: Any) -> "LeaseGuard":
        """A read lease on `key` beside other readers, as a guard like `lock()`'s."""
        return self._kind_guard(key, ttl, _kinds.SHARED, options)

    def write_lock(self, key: Key, ttl: float = _kinds.DEFAULT_TTL, **options: Any) -> "LeaseGuard":
        """The write side of read/write lock `key`: the key alone, `lock()` itself."""
        return self.lock(key, ttl, **options)

    def inspect_kinds(self, key: Key) -> "Union[KeyState, _kinds.HeldKinds]":
        """`HeldKinds` for a held read/write or semaphore key, else `Free` or `Held`."""
        return self._fast(lambda: self.aio.inspect_kinds(key))

    def _kind_guard(self, key: Key, ttl: float, kind: bytes, options: Dict[str, Any]) -> "LeaseGuard":
        guard = LeaseGuard(self)
        guard._inner = AsyncLeaseGuard(self.aio, key, ttl, kind=kind, **options)
        return guard

    def session(
        self, ttl: float, *, keep_alive_every: Optional[float] = None, margin: Optional[float] = None
    ) -> Session:
        """`with client.session(ttl=10) as s: with s.lock("a"), s.lock("b"): ...`

        Opens a session at once (SESSION_OPEN) and keeps it alive on the I/O thread, one
        keep-alive every third of `ttl`; its locks need no renewal and are lost with it.
        Leaving the `with` closes it, freeing every lock still in it. See `tenure.session`.
        """
        inner = self.aio.session(ttl, keep_alive_every=keep_alive_every, margin=margin)
        return Session(self, self._run(inner.open()))

    def election(
        self,
        group: str,
        *,
        ttl: float = 10.0,
        wait_max: float = w.WAIT_MS_MAX / 1000,
        release_on_disconnect: Optional[bool] = None,
    ) -> "Election":
        """The election `group` (its lock is `election/<group>`); see `AsyncElection` for when
        a leadership is tied to its connection."""
        election = AsyncElection(
            self.aio, group, ttl=ttl, wait_max=wait_max, release_on_disconnect=release_on_disconnect
        )
        return Election(self, election)


class LeaseGuard(_GuardView):
    """A lease renewed on the client's I/O thread. Use as a context manager, or call
    `acquire()` and `release()`.

    `lost` is a `threading.Event` set on loss (any thread may wait on it); `check()` raises
    `LeaseLost`; `is_valid()` is a cheap test.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._inner: Optional[AsyncLeaseGuard] = None

    @property
    def _keeper(self) -> Any:  # type: ignore[override]
        return self._inner._keeper if self._inner is not None else None

    @property
    def lost(self) -> threading.Event:
        """Set when the lease is lost (or released)."""
        return self._k().thread_event

    def acquire(self) -> "LeaseGuard":
        """Acquires and starts renewing; raises `NotAcquired` if the wait ran out.

        The ACQUIRE takes the client's direct path when it is free (the calling thread, no
        hand-off to the I/O thread and back); the start of the renewals is then handed to the
        I/O thread without waiting for it, due by the first renewal (nothing the guard
        watches is due earlier; `check()` reads the clock itself). The lease is counted from
        before the request was sent either way. A `release_on_disconnect` lease is tied to
        the connection that took it, which the I/O thread must watch from the grant: it is
        acquired there.
        """
        inner = self._inner
        assert inner is not None
        if inner._args[4]:  # release_on_disconnect
            self._client._run(inner.acquire())
            return self
        retry = _AcquireRetry()
        result, conn = self._client._fast(lambda: inner._acquire_call(retry))
        client = self._client
        inner._start(inner._granted(result), conn, loop=client._io.loop, post=client._handoff.post)
        return self

    def release(self) -> Optional[ReleaseResult]:
        """Stops renewing and releases the lock: `Released`/`NotOwner`, or None when nothing
        was sent (already lost or released) or the RELEASE failed (logged, not raised)."""
        return self._release(quiet=True)

    def _release(self, quiet: bool) -> Optional[ReleaseResult]:
        """Ends the guard in the calling thread and releases over the direct path when it is
        free. The renewals are told to stop without waiting for them: a renewal task that
        wakes first sees the guard ended, and the answer to one already in flight (RENEWED
        before the RELEASE, LOST after it) changes nothing for a released guard."""
        lease = self._k().release_target()
        if lease is None:
            return None
        try:
            result = self._client.release(lease)
        except (ServerError, ConnectionLost, RequestTimeout, OSError) as e:
            if not quiet:
                raise
            log.debug("tenure: release on exit failed: %s", e)
            return None
        self._k().release_answered = True
        return result

    def wait_lost(self, timeout: Optional[float] = None) -> Optional[str]:
        """Blocks until the lease is lost (the reason) or `timeout` seconds pass (None; no
        limit when `timeout` is None)."""
        return self.loss_reason if self.lost.wait(_timeout(timeout)) else None

    def __enter__(self) -> "LeaseGuard":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class Watch:
    """A running watch (blocking form). `initial` is the state when it started."""

    def __init__(self, client: Client, inner: AsyncWatch) -> None:
        self._client = client
        self._inner = inner
        self.key = inner.key
        self.initial = inner.initial

    def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event, or None after `timeout` seconds (no limit when it is None). Raises
        the error that ended the watch."""
        limit = _timeout(timeout)  # refused here, before a hand-off to the I/O thread
        return self._client._run(self._inner.next(limit))

    def __iter__(self) -> Iterator[Event]:
        """Events until the watch or its client is closed; raises the error that ended it
        otherwise."""
        while True:
            try:
                event = self.next()
            except ConnectionLost:
                if self._client.closed:
                    return
                raise
            if event is None:
                return
            yield event

    def close(self) -> None:
        """UNWATCH."""
        self._client._run(self._inner.close())


class Election:
    """Leader election (blocking form); see `AsyncElection`."""

    def __init__(self, client: Client, inner: AsyncElection) -> None:
        self._client = client
        self._inner = inner
        self.group = inner.group
        self.key = inner.key

    def campaign(self, value: Meta = b"", *, renew_every: Optional[float] = None) -> "Leadership":
        """Blocks until this candidate leads."""
        leadership = self._client._run(self._inner.campaign(value, renew_every=renew_every))
        return Leadership(self._client, leadership)

    def leader(self) -> Optional[Leader]:
        return self._client._run(self._inner.leader())

    def observe(self) -> "Observer":
        """Every new leader from now on, in increasing term order."""
        return Observer(self._client, self._inner.observe())


class Leadership(LeaseGuard):
    """This candidate leads until `resign()` or loss (`lost`, `check()`, like a LeaseGuard)."""

    def __init__(self, client: Client, inner: AsyncLeadership) -> None:
        super().__init__(client)
        self._inner = inner.guard
        self._leadership = inner
        self.value = inner.value

    @property
    def term(self) -> int:
        """The fencing token of the leader's grant."""
        return self.token

    def resign(self) -> None:
        """Steps down: releases the lock so the next candidate leads."""
        self.release()


class Observer:
    """Leaders of a group (blocking form): iterate, or call `next()`."""

    def __init__(self, client: Client, inner: AsyncObserver) -> None:
        self._client = client
        self._inner = inner

    def next(self, timeout: Optional[float] = None) -> Optional[Leader]:
        """The next new leader; None if `timeout` seconds passed first (no limit when it is
        None). Raises a failed watch's error."""
        limit = _timeout(timeout)
        coro: Awaitable[Leader] = self._inner.next()
        try:
            return self._client._run(asyncio.wait_for(coro, limit))
        except asyncio.TimeoutError:
            return None

    def __iter__(self) -> Iterator[Leader]:
        """Every new leader until the observer's client is closed (the iteration then ends);
        raises a failed watch's error otherwise (`ConnectionLost` when the server restarts)."""
        while True:
            try:
                leader = self.next()
            except ConnectionLost:
                if self._client.closed:
                    return
                raise
            if leader is not None:
                yield leader

    def close(self) -> None:
        self._client._run(self._inner.close())
