"""Pipelining: many requests in flight on one connection, replies matched by request id."""

from __future__ import annotations

import asyncio
import threading

import tenure
from tenure import Granted, Held, Released

REQUESTS = 1000


def test_1000_pipelined_acquires_on_one_connection(server):
    async def main():
        async with tenure.AsyncClient(server.addr) as c:
            opened = (await c.stats())["connections_total"]
            leases = await asyncio.gather(*(c.acquire(f"p/{i}", 30) for i in range(REQUESTS)))
            assert all(isinstance(lease, Granted) for lease in leases)
            assert len({lease.token for lease in leases}) == REQUESTS
            states = await asyncio.gather(*(c.inspect(f"p/{i}") for i in range(REQUESTS)))
            for lease, state in zip(leases, states):
                # Each reply went to its own request: the key's holder has that lease's token.
                assert isinstance(state, Held) and state.token == lease.token
            released = await asyncio.gather(*(c.release(lease) for lease in leases))
            assert released == [Released()] * REQUESTS
            stats = await c.stats()
            assert stats["connections_total"] == opened and stats["held"] == 0

    asyncio.run(main())


def test_1000_blocking_acquires_wait_in_line_at_once_on_one_connection(server):
    """1,000 waiting ACQUIREs are all in flight together (the server counts 1,000 waiters);
    each is then handed the lock in turn."""

    async def main():
        async with tenure.AsyncClient(server.addr) as holder, tenure.AsyncClient(server.addr) as c:
            first = await holder.acquire("line", 30)

            async def wait_then_release(i):
                lease = await c.acquire("line", 30, wait=60)
                assert isinstance(lease, Granted), lease
                assert (await c.release(lease)) == Released()
                return lease.token

            waiters = [asyncio.ensure_future(wait_then_release(i)) for i in range(REQUESTS)]
            for _ in range(500):
                state = await holder.inspect("line")
                if state.waiters == REQUESTS:
                    break
                await asyncio.sleep(0.01)
            assert state.waiters == REQUESTS
            await holder.release(first)
            tokens = await asyncio.wait_for(asyncio.gather(*waiters), 60)
            assert len(set(tokens)) == REQUESTS and min(tokens) > first.token

    asyncio.run(main())


def test_blocking_client_pipelines_calls_from_many_threads(client):
    errors = []
    opened = client.stats()["connections_total"]

    def work(t):
        try:
            for i in range(REQUESTS // 8):
                lease = client.acquire(f"th/{t}/{i}", 10)
                assert client.release(lease) == Released()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert client.stats()["connections_total"] == opened
