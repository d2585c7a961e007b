"""A grant whose caller stopped waiting (a client-side time-out, a cancelled task) is released
by the client, not left holding the key for its whole TTL with nobody knowing its lease id."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import tenure
from conftest import wait_until
from tenure import Free, Granted


def test_a_cancelled_asyncio_wait_does_not_leave_the_lock_held(server):
    async def scenario() -> None:
        holder = await tenure.AsyncClient.connect(server.addr)
        waiter = await tenure.AsyncClient.connect(server.addr)
        try:
            held = await holder.acquire("abandon/a", ttl=30)
            assert isinstance(held, Granted)
            try:
                await asyncio.wait_for(waiter.acquire("abandon/a", ttl=30, wait=10), 0.3)
                raise AssertionError("the wait should have been cancelled")
            except asyncio.TimeoutError:
                pass
            await holder.release(held)  # hands the lock to the abandoned waiter...
            deadline = time.monotonic() + 10
            while not isinstance(await holder.inspect("abandon/a"), Free):
                assert time.monotonic() < deadline, "the abandoned grant was never released"
                await asyncio.sleep(0.02)
        finally:
            await holder.close()
            await waiter.close()

    asyncio.run(scenario())


def test_a_blocking_acquire_that_timed_out_releases_its_late_grant(server):
    # No time to send it again (acquire_retry_for=0): the caller gives up at the time-out.
    c = tenure.Client(server.addr, timeout=0.3, acquire_retry_for=0)
    observer = tenure.Client(server.addr, timeout=5)
    try:
        c.inspect("warm-up")  # the direct connection is open before the server stops
        os.kill(server.proc.pid, signal.SIGSTOP)
        assert wait_until(lambda: _stopped(server.proc.pid)), "the server did not stop"
        try:
            try:
                c.acquire("abandon/b", ttl=30)
                raise AssertionError("the acquire should have timed out")
            except tenure.RequestTimeout:
                pass
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        # The server wakes and grants; the client gives the grant back: a release nobody
        # else sent, after which the key is free.
        def given_back() -> bool:
            stats = observer.stats()
            return stats["grants"] == 1 and stats["ops_release"] == 1

        assert wait_until(given_back, timeout=10), observer.stats()
        assert isinstance(observer.inspect("abandon/b"), Free)
    finally:
        c.close()
        observer.close()


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc): kill returns before it is."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"
