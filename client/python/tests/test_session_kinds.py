"""Read leases and semaphore permits in a session, against a real tenured (PROTOCOL.md 3.10,
3.11): `s.semaphore(key, permits=N)`, `s.read_lock(key)` and `s.write_lock(key)` live while
the session does, with no renewal of their own; they end when the session is closed and when
it expires; a writer waits for a session's read lease, FIFO as outside a session."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Dict, List

import pytest

import tenure
from tenure import Granted

from conftest import wait_until
from test_session import FreezingProxy

#: The session TTL of these tests.
TTL_S = 0.6


def waiters(client: tenure.Client, key: str) -> int:
    state = client.inspect(key)
    return state.waiters if isinstance(state, tenure.Held) else 0


def in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_permit_and_a_read_lease_live_past_the_ttl_and_end_when_the_session_closes(client, server) -> None:
    got: Dict[str, tenure.LeaseGuard] = {}
    with tenure.Client(server.addr) as other:
        s = client.session(ttl=TTL_S)
        permit = s.semaphore("sk/pool", permits=2).acquire()
        read = s.read_lock("sk/doc").acquire()
        assert read.token > permit.token
        # One permit of two is left; a writer waits for the session's reader.
        beside = other.semaphore("sk/pool", permits=2, ttl=5).acquire()
        assert beside.token > read.token
        threads = [
            in_thread(lambda: got.update(permit=other.semaphore("sk/pool", permits=2, ttl=5, wait=30).acquire())),
            in_thread(lambda: got.update(writer=other.write_lock("sk/doc", ttl=5, wait=30).acquire())),
        ]
        assert wait_until(lambda: waiters(other, "sk/pool") == 1 and waiters(other, "sk/doc") == 1)
        time.sleep(TTL_S * 4)  # past the TTL several times: only the keep-alives keep them
        permit.check()
        read.check()
        assert not got, "nobody overtook the session's permit and read lease"
        kinds = other.inspect_kinds("sk/pool")
        assert isinstance(kinds, tenure.HeldKinds) and (kinds.limit, kinds.in_use) == (2, 2)
        kinds = other.inspect_kinds("sk/doc")
        assert isinstance(kinds, tenure.HeldKinds) and (kinds.in_use, kinds.writer) == (1, False)
        assert s.close() == 2, "the permit and the read lease freed by the close"
        for thread in threads:
            thread.join(timeout=10)
        assert got["permit"].token > read.token and got["writer"].token > read.token
        assert s.lost.is_set() and not permit.is_valid() and not read.is_valid()
        with pytest.raises(tenure.LeaseLost):
            read.check()
        for guard in (beside, got["permit"], got["writer"]):
            guard.release()


def test_the_session_renews_no_permit_or_read_lease_of_its_own(client, server) -> None:
    with client.session(ttl=TTL_S) as s:
        with s.semaphore("sr/pool", permits=3, count=2) as permit, s.read_lock("sr/doc") as read:
            time.sleep(TTL_S * 3)
            permit.check()
            read.check()
            stats = client.stats()
            assert stats["ops_renew"] == 0, "no lease was renewed"
            assert stats["session_leases"] == 2
            kinds = client.inspect_kinds("sr/pool")
            assert isinstance(kinds, tenure.HeldKinds) and (kinds.holders, kinds.in_use) == (1, 2)
        # Leaving a guard's block releases that lease alone; the session goes on.
        assert client.inspect("sr/pool") == tenure.Free() and client.inspect("sr/doc") == tenure.Free()
        assert s.is_valid()


def test_a_write_lease_waits_for_a_sessions_read_lease(client, server) -> None:
    order: List[str] = []
    guards: Dict[str, tenure.SessionLock] = {}
    with tenure.Client(server.addr) as other, client.session(ttl=TTL_S) as readers, other.session(ttl=TTL_S) as writers:
        read = readers.read_lock("sw/doc").acquire()
        with pytest.raises(tenure.NotAcquired) as refused:
            writers.write_lock("sw/doc").acquire()
        assert refused.value.token == read.token

        def take(name: str, lock: tenure.SessionLock) -> None:
            guards[name] = lock.acquire()
            order.append(name)

        writer = in_thread(lambda: take("writer", writers.write_lock("sw/doc", wait=30)))
        assert wait_until(lambda: waiters(client, "sw/doc") == 1)
        # A reader behind the waiting writer waits too (FIFO, PROTOCOL.md 3.10).
        reader = in_thread(lambda: take("reader", readers.read_lock("sw/doc", wait=30)))
        assert wait_until(lambda: waiters(client, "sw/doc") == 2)
        time.sleep(TTL_S * 3)  # the sessions' keep-alives keep the reader and both waiters
        assert order == [] and read.is_valid()
        read.release()
        writer.join(timeout=10)
        assert order == ["writer"] and guards["writer"].token > read.token
        assert client.check("sw/doc", read.token) == tenure.Stale()
        guards["writer"].release()
        reader.join(timeout=10)
        assert order == ["writer", "reader"] and guards["reader"].token > guards["writer"].token


def test_a_permit_and_a_read_lease_end_when_the_session_expires(server) -> None:
    proxy = FreezingProxy(server.addr)
    try:
        with tenure.Client(proxy.addr, timeout=2) as holder, tenure.Client(server.addr) as watcher:
            s = holder.session(ttl=TTL_S)
            permit = s.semaphore("se/pool", permits=1).acquire()
            read = s.read_lock("se/doc").acquire()
            time.sleep(TTL_S * 2)
            assert permit.is_valid() and read.is_valid(), s.loss_reason
            proxy.frozen.set()  # the keep-alives stop reaching the server
            frozen_at = time.monotonic()
            while not all(isinstance(watcher.inspect(k), tenure.Free) for k in ("se/pool", "se/doc")):
                assert time.monotonic() - frozen_at < TTL_S * 20, "the server never freed them"
                time.sleep(0.001)
            # Reported lost before (or as) the server freed them: never valid past that.
            assert s.lost.is_set() and "unconfirmed" in (s.loss_reason or "")
            assert not permit.is_valid() and not read.is_valid()
            with pytest.raises(tenure.LeaseLost):
                permit.check()
            assert isinstance(watcher.acquire("se/doc", ttl=1), Granted), "a writer gets the key"
            taken = watcher.semaphore("se/pool", permits=1, ttl=1).acquire()
            assert taken.token > permit.token
            taken.release()
            proxy.frozen.clear()
    finally:
        proxy.close()


def test_kinds_in_a_session_are_checked_like_outside_one(client, server) -> None:
    with client.session(ttl=TTL_S) as s:
        for count, permits in [(0, 2), (3, 2), (1, 0), (1, 4097)]:
            with pytest.raises(tenure.BadPermits):
                s.semaphore("sc/bad", permits=permits, count=count)
        assert client.stats()["session_leases"] == 0, "nothing was sent"
        with s.semaphore("sc/pool", permits=2):
            with pytest.raises(tenure.KindMismatch):
                s.semaphore("sc/pool", permits=3).acquire()
            with pytest.raises(tenure.KindMismatch):
                s.read_lock("sc/pool").acquire()
            with pytest.raises(tenure.KindMismatch):
                s.write_lock("sc/pool").acquire()
        assert s.is_valid(), "a refused kind does not end the session"


def test_asyncio_session_permits_and_read_write_locks(server) -> None:
    async def main() -> None:
        async with tenure.AsyncClient(server.addr) as client:
            async with client.session(ttl=TTL_S) as s:
                async with s.semaphore("sa/pool", permits=2, count=2) as both:
                    with pytest.raises(tenure.NotAcquired):
                        await s.semaphore("sa/pool", permits=2).acquire()
                    await asyncio.sleep(TTL_S * 2)
                    both.check()
                async with s.read_lock("sa/doc") as r1, s.read_lock("sa/doc") as r2:
                    assert r2.token > r1.token
                    with pytest.raises(tenure.NotAcquired):
                        await s.write_lock("sa/doc").acquire()
                async with s.write_lock("sa/doc") as w:
                    assert w.token > r2.token
                r = await s.read_lock("sa/doc").acquire()
            assert not r.is_valid() and r.loss_reason == tenure.session.LOSS_CLOSED
            assert await client.inspect("sa/doc") == tenure.Free(), "freed with the session"

    asyncio.run(main())
