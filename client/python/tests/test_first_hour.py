"""What a new user trips over first: guards given to release(), argument checks that agree,
a clean exit, and an error that says the server was never reached."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

import tenure
from conftest import free_port
from tenure import Free, Held, NotOwner, Released

#: Longest a small program run in a subprocess may take.
PROGRAM_TIMEOUT_S = 30
#: Python's development mode, with an unclosed socket or transport an error in the output.
DEV_MODE = ("-X", "dev", "-W", "error::ResourceWarning")
#: Development mode turns on asyncio's debug mode, which logs callbacks slower than 0.1 s (a
#: loaded machine, not a fault): quieted, so that the output holds only what the client did.
QUIET_SLOW_CALLBACKS = "import logging; logging.getLogger('asyncio').setLevel(logging.ERROR)\n"


def run_program(source: str, addr: str, dev_mode: bool = False) -> subprocess.CompletedProcess:
    code = textwrap.dedent(source).replace("ADDR", addr)
    flags = DEV_MODE if dev_mode else ()
    if dev_mode:
        code = QUIET_SLOW_CALLBACKS + code
    return subprocess.run(
        [sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=PROGRAM_TIMEOUT_S
    )


# -- release() takes a guard ----------------------------------------------------------


def test_release_takes_the_guard_of_a_with_block(client):
    with client.lock("fh/guard", ttl=5) as lease:
        assert client.release(lease) == Released()
        # The guard knows: it ended as released, stopped renewing, and the key is free.
        assert lease.lost.is_set() and lease.loss_reason == "released by its owner"
        assert not lease.is_valid()
        with pytest.raises(tenure.LeaseLost):
            lease.check()
        assert client.inspect("fh/guard") == Free()
        other = client.acquire("fh/guard", 5)
        assert isinstance(other, tenure.Granted)
        # A second release of the guard sends nothing (it would not own the key any more).
        assert client.release(lease) == NotOwner()
    # The exit released nothing: the other holder still holds the key.
    held = client.inspect("fh/guard")
    assert isinstance(held, Held) and held.token == other.token
    assert client.release(other) == Released()


def test_release_takes_a_leadership_and_refuses_locked(client):
    leadership = client.election("fh").campaign("me")
    assert client.release(leadership) == Released()
    assert leadership.loss_reason == "released by its owner"
    held = client.acquire("fh/locked", 5)
    locked = client.acquire("fh/locked", 5)
    assert isinstance(locked, tenure.Locked)
    with pytest.raises(tenure.InvalidArgument, match="not granted"):
        client.release(locked)
    with pytest.raises(tenure.InvalidArgument, match="takes a Granted"):
        client.release("fh/locked")
    client.release(held)


def test_async_release_takes_the_guard(server):
    async def main():
        async with tenure.AsyncClient(server.addr) as client:
            async with client.lock("fh/aguard", ttl=5) as lease:
                assert await client.release(lease) == Released()
                assert lease.lost.is_set() and lease.loss_reason == "released by its owner"
                assert await client.inspect("fh/aguard") == Free()
                assert await client.release(lease) == NotOwner()
            leadership = await client.election("fh-a").campaign("me")
            assert await client.release(leadership) == Released()

    asyncio.run(main())


# -- one argument check ---------------------------------------------------------------

BAD_DURATIONS = ["30", None, True, float("nan"), float("inf"), -1, [30]]


def entry_points(client, aclient, loop):
    """Every way a TTL reaches the server, as `f(ttl)` raising what the call raises."""

    def run(coro):
        return loop.run_until_complete(coro)

    async def async_lock(ttl):
        async with aclient.lock("fh/arg", ttl):
            pass

    granted = client.acquire("fh/renewed", 5)
    return {
        "acquire": lambda ttl: client.acquire("fh/arg", ttl),
        "lock": lambda ttl: client.lock("fh/arg", ttl),
        "acquire wait": lambda wait: client.acquire("fh/arg", 5, wait=wait),
        "renew": lambda ttl: client.renew(granted, ttl),
        "async acquire": lambda ttl: run(aclient.acquire("fh/arg", ttl)),
        "async lock": lambda ttl: run(async_lock(ttl)),
        "async acquire wait": lambda wait: run(aclient.acquire("fh/arg", 5, wait=wait)),
        "election": lambda ttl: client.election("fh-arg", ttl=ttl),
        "async election": lambda ttl: aclient.election("fh-arg", ttl=ttl),
    }


@pytest.fixture
def every_entry_point(client, server):
    loop = asyncio.new_event_loop()
    aclient = loop.run_until_complete(tenure.AsyncClient.connect(server.addr))
    yield entry_points(client, aclient, loop)
    loop.run_until_complete(aclient.close())
    loop.close()


def test_every_entry_point_checks_durations_alike(every_entry_point):
    for name, call in every_entry_point.items():
        for bad in BAD_DURATIONS:
            if name == "renew" and bad is None:
                continue  # renew(lease, None) renews for the granted TTL
            with pytest.raises(tenure.InvalidArgument) as e:
                call(bad)
            assert "seconds" in str(e.value), (name, bad, str(e.value))


def test_range_errors_quote_seconds(every_entry_point):
    for name, call in every_entry_point.items():
        with pytest.raises(tenure.InvalidArgument) as e:
            call(30000)  # seconds: past the server's limit for a TTL and for a wait
        message = str(e.value)
        assert "seconds, not 30000" in message and " ms" not in message, (name, message)
    with pytest.raises(tenure.InvalidArgument, match=r"ttl must be 0\.01 to \d+ seconds, not 0\.001"):
        every_entry_point["lock"](0.001)


def test_client_durations_are_checked():
    for option in ("timeout", "connect_timeout", "reconnect_delay_min", "reconnect_delay_max"):
        with pytest.raises(tenure.InvalidArgument, match=f"{option} must be a finite number of seconds"):
            tenure.Client("127.0.0.1:7878", lazy=True, **{option: "5"})


def test_guard_timing_arguments_are_checked(client):
    with pytest.raises(tenure.InvalidArgument, match="renew_every must be a finite number of seconds"):
        client.lock("fh/arg", 5, renew_every="1")
    with pytest.raises(tenure.InvalidArgument, match="margin must be a finite number of seconds"):
        client.lock("fh/arg", 5, margin="x")


# -- a clean exit -----------------------------------------------------------------------


NEVER_CLOSED_PROGRAMS = {
    "a guard used, then the program ends": """
        import tenure
        client = tenure.Client("ADDR")
        with client.lock("fh/exit", ttl=5) as lease:
            lease.check()
        print("done")
        """,
    "a client made in a function": """
        import tenure
        def main():
            client = tenure.Client("ADDR")
            with client.lock("fh/exit-f", ttl=5) as lease:
                lease.check()
        main()
        print("done")
        """,
    "a guard still renewing, and a lazy client": """
        import tenure
        client = tenure.Client("ADDR")
        held = client.lock("fh/exit-held", ttl=5).acquire()
        lazy_client = tenure.Client("ADDR", lazy=True)  # never connected
        print("done")
        """,
    "calls from several threads, over both connections": """
        import threading, tenure
        client = tenure.Client("ADDR")
        client.acquire("fh/exit-direct", 5)  # the direct connection
        threads = [threading.Thread(target=client.ping) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        watch = client.watch("fh/exit-direct")  # the pipelined one
        print("done")
        """,
    "an asyncio client never closed": """
        import asyncio, tenure
        async def main():
            client = tenure.AsyncClient("ADDR")
            await client.acquire("fh/exit-async", 5)
            await client.lock("fh/exit-async-guard", ttl=5).acquire()
        asyncio.run(main())
        print("done")
        """,
}


@pytest.mark.parametrize("story", sorted(NEVER_CLOSED_PROGRAMS))
def test_a_program_that_never_closes_its_client_exits_cleanly(server, story):
    """In development mode: no socket left for the collector, no task left pending."""
    out = run_program(NEVER_CLOSED_PROGRAMS[story], server.addr, dev_mode=True)
    assert out.returncode == 0 and out.stdout == "done\n", out.stdout + out.stderr
    assert out.stderr == "", out.stderr


def test_closing_a_client_ends_observe_and_watch_iterations(server):
    out = run_program(
        """
        import threading, time, tenure
        client = tenure.Client("ADDR")
        seen = []
        def observe():
            for leader in client.election("fh-exit").observe():
                seen.append(leader.term)
            seen.append("observe ended")
        def watch():
            for event in client.watch("fh/watched"):
                pass
            seen.append("watch ended")
        threads = [threading.Thread(target=observe), threading.Thread(target=watch)]
        for t in threads:
            t.start()
        leadership = client.election("fh-exit").campaign("me")
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        client.close()
        for t in threads:
            t.join(10)
        print(sorted(map(str, seen)))
        """,
        server.addr,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr == ""
    assert "'observe ended'" in out.stdout and "'watch ended'" in out.stdout, out.stdout


def test_async_iterations_end_when_the_client_closes(server):
    async def main():
        client = await tenure.AsyncClient.connect(server.addr)
        watch = await client.watch("fh/awatched")
        events = []

        async def consume():
            async for event in watch:
                events.append(event)
            return "ended"

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        await client.close()
        assert await asyncio.wait_for(task, 10) == "ended"

    asyncio.run(main())


# -- could not connect ------------------------------------------------------------------


def test_a_server_never_reached_is_cannot_connect():
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(tenure.CannotConnect, match="cannot connect") as e:
        tenure.Client(addr, connect_timeout=2)
    assert isinstance(e.value, tenure.ConnectionLost)  # what older code catches
    lazy = tenure.Client(addr, lazy=True, timeout=2)
    try:
        with pytest.raises(tenure.CannotConnect):
            lazy.ping()
    finally:
        lazy.close()


def test_a_connection_lost_after_connecting_is_not_cannot_connect(client, server):
    assert isinstance(client.acquire("fh/lost", 5), tenure.Granted)
    watch = client.watch("fh/lost")
    server.kill()
    with pytest.raises(tenure.ConnectionLost) as e:
        watch.next(timeout=10)
    assert not isinstance(e.value, tenure.CannotConnect)
