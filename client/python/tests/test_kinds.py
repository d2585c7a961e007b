"""Semaphores and read/write locks (PROTOCOL.md 3.10) against a real tenured: at most N permit
holders, the next served on release; readers together, a writer waiting and FIFO between
them; tokens rising; guards reporting loss; the errors of a kind that does not fit."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import List

import pytest

import tenure
from conftest import wait_until

TTL_S = 0.6


def waiters(client: tenure.Client, key: str) -> int:
    state = client.inspect(key)
    return state.waiters if isinstance(state, tenure.Held) else 0


def in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_semaphore_holds_n_permits_and_hands_one_to_the_next(client, server):
    held = [client.semaphore("pool", permits=3, ttl=TTL_S).acquire() for _ in range(3)]
    tokens = [guard.token for guard in held]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    with pytest.raises(tenure.NotAcquired):
        client.semaphore("pool", permits=3, ttl=TTL_S).acquire()
    kinds = client.inspect_kinds("pool")
    assert isinstance(kinds, tenure.HeldKinds)
    assert (kinds.limit, kinds.holders, kinds.in_use, kinds.writer) == (3, 3, 3, False)

    got: List[tenure.LeaseGuard] = []
    fourth = in_thread(lambda: got.append(client.semaphore("pool", 3, TTL_S, wait=30).acquire()))
    assert wait_until(lambda: waiters(client, "pool") == 1)
    time.sleep(3 * TTL_S)  # the guards renew past their TTL; the fourth still waits
    assert not got and all(guard.is_valid() for guard in held)
    held.pop(0).release()
    fourth.join(timeout=10)
    assert got and got[0].token > tokens[-1] and got[0].is_valid()
    for guard in held + got:
        guard.release()
    assert client.inspect("pool") == tenure.Free()


def test_readers_share_a_writer_waits_and_readers_behind_it_wait(client, server):
    r1 = client.read_lock("doc", ttl=TTL_S).acquire()
    r2 = client.read_lock("doc", ttl=TTL_S).acquire()
    assert r2.token > r1.token
    with pytest.raises(tenure.NotAcquired):
        client.write_lock("doc", ttl=TTL_S).acquire()
    order: List[str] = []
    guards: dict = {}

    def take(name: str, guard: tenure.LeaseGuard) -> None:
        guards[name] = guard.acquire()
        order.append(name)

    writer = in_thread(lambda: take("writer", client.write_lock("doc", TTL_S, wait=30)))
    assert wait_until(lambda: waiters(client, "doc") == 1)
    reader = in_thread(lambda: take("reader", client.read_lock("doc", TTL_S, wait=30)))
    assert wait_until(lambda: waiters(client, "doc") == 2)
    kinds = client.inspect_kinds("doc")
    assert isinstance(kinds, tenure.HeldKinds)
    assert (kinds.limit, kinds.in_use, kinds.waiting_shared, kinds.waiting_exclusive) == (0, 2, 1, 1)
    time.sleep(2 * TTL_S)
    assert order == []
    assert client.check("doc", r1.token) == tenure.Current()
    r1.release()
    r2.release()
    writer.join(timeout=10)
    assert order == ["writer"], "the writer first, alone"
    assert guards["writer"].token > r2.token
    assert client.check("doc", r1.token) == tenure.Stale()
    time.sleep(TTL_S)
    assert order == ["writer"], "no reader beside the writer"
    guards["writer"].release()
    reader.join(timeout=10)
    assert order == ["writer", "reader"] and guards["reader"].token > guards["writer"].token
    guards["reader"].release()


def test_permit_and_read_guards_report_their_loss(client, server):
    other = tenure.Client(server.addr)
    try:
        with client.semaphore("lossy", permits=2, ttl=TTL_S) as permit:
            other.release((permit.lease.key, permit.lease.lease_id))
            assert permit.lost.wait(timeout=10), "loss never signalled"
            with pytest.raises(tenure.LeaseLost):
                permit.check()
        with client.read_lock("lossy/doc", ttl=TTL_S) as read:
            server.kill()
            assert read.lost.wait(timeout=10), "loss never signalled"
            assert "ran out unconfirmed" in (read.loss_reason or "")
            assert not read.is_valid()
    finally:
        other.close()


def test_a_kind_that_does_not_fit_is_a_typed_error(client, server):
    with client.semaphore("fit", permits=2, ttl=TTL_S):
        with pytest.raises(tenure.KindMismatch) as mismatch:
            client.semaphore("fit", permits=3, ttl=TTL_S).acquire()
        assert mismatch.value.name == "KIND_MISMATCH" and "2" in mismatch.value.message
        with pytest.raises(tenure.KindMismatch):
            client.lock("fit", ttl=TTL_S).acquire()
        with pytest.raises(tenure.KindMismatch):
            client.read_lock("fit", ttl=TTL_S).acquire()
    for count, permits in [(0, 2), (3, 2), (1, 0), (1, 4097)]:
        with pytest.raises(tenure.BadPermits):
            client.semaphore("fit/bad", permits=permits, count=count)
    assert client.inspect_kinds("fit/plain") == tenure.Free()


def test_asyncio_semaphore_and_read_write_guards(server):
    async def main() -> None:
        async with tenure.AsyncClient(server.addr) as client:
            async with client.semaphore("apool", permits=2, ttl=TTL_S, count=2) as both:
                with pytest.raises(tenure.NotAcquired):
                    await client.semaphore("apool", 2, TTL_S).acquire()
                await asyncio.sleep(2 * TTL_S)
                both.check()
                kinds = await client.inspect_kinds("apool")
                assert isinstance(kinds, tenure.HeldKinds) and kinds.in_use == 2
            async with client.read_lock("adoc", ttl=TTL_S) as r1, client.read_lock("adoc", ttl=TTL_S) as r2:
                assert r2.token > r1.token
            async with client.write_lock("adoc", ttl=TTL_S) as w:
                assert w.token > r2.token

    asyncio.run(main())
