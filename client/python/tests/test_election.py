"""Elections: campaign, observe, resign, fail-over; the term is the fencing token."""

from __future__ import annotations

import threading
import time

import tenure
from conftest import wait_until
from tenure import Free, Leader

TTL_S = 1.0


def test_election_fail_over_and_resign(server):
    c1, c2, c3 = (tenure.Client(server.addr) for _ in range(3))
    try:
        observer = c3.election("jobs").observe()
        leader1 = c1.election("jobs", ttl=TTL_S).campaign("node-1")
        assert leader1.term > 0 and leader1.value == b"node-1"
        assert observer.next(timeout=5) == Leader(leader1.term, b"node-1")

        won = []
        standby = threading.Thread(target=lambda: won.append(c2.election("jobs", ttl=TTL_S).campaign("node-2")))
        standby.start()
        time.sleep(3 * TTL_S)  # leader 1 renews; the standby stays in line
        assert not won and leader1.is_valid()
        assert c3.election("jobs").leader() == Leader(leader1.term, b"node-1")

        c1.close()  # the leader's process goes: its connection closes, the lock is freed
        standby.join(timeout=10)
        assert won, "the standby did not take over"
        leader2 = won[0]
        assert leader2.term > leader1.term
        assert leader1.lost.is_set() and leader1.loss_reason == "client closed"
        with __import__("pytest").raises(tenure.LeaseLost):
            leader1.check()
        assert observer.next(timeout=5) == Leader(leader2.term, b"node-2")

        time.sleep(2 * TTL_S)
        leader2.check()
        leader2.resign()
        assert leader2.lost.is_set()
        assert wait_until(lambda: c3.inspect("election/jobs") == Free(), timeout=5)
        observer.close()
    finally:
        for c in (c1, c2, c3):
            try:
                c.close()
            except Exception:
                pass


def test_hung_leader_is_replaced_after_its_ttl(server, monkeypatch):
    """A leader whose renewals stop (connection open) loses at its local deadline, before the
    server grants the next candidate."""
    import asyncio

    c1, c2 = tenure.Client(server.addr), tenure.Client(server.addr)
    try:
        leader1 = c1.election("hung", ttl=TTL_S).campaign("a")

        async def hang(*args):
            await asyncio.sleep(3600)

        monkeypatch.setattr(c1.aio, "_renew", hang)
        leader2 = c2.election("hung", ttl=TTL_S).campaign("b")
        lost_by_then = leader1.lost.is_set() or not leader1.is_valid()
        assert lost_by_then, "the old leader still believed it led when the new one was elected"
        assert leader2.term > leader1.term
    finally:
        c1.close()
        c2.close()


def test_asyncio_election(server):
    import asyncio

    async def main():
        async with tenure.AsyncClient(server.addr) as a, tenure.AsyncClient(server.addr) as b:
            observer = b.election("ae").observe()
            lead = await a.election("ae", ttl=TTL_S).campaign(b"x")
            seen = await asyncio.wait_for(observer.next(), 5)
            assert seen.term == lead.term and seen.value == b"x"
            standby = asyncio.ensure_future(b.election("ae", ttl=TTL_S).campaign(b"y"))
            await asyncio.sleep(2 * TTL_S)
            assert not standby.done()
            await lead.resign()
            second = await asyncio.wait_for(standby, 5)
            assert second.term > lead.term
            assert (await asyncio.wait_for(observer.next(), 5)).term == second.term
            await second.resign()
            await observer.close()

    asyncio.run(main())
