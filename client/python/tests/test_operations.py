"""Every operation, blocking and asyncio, against a real tenured."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

import tenure
from tenure import (
    Current,
    EventKind,
    Free,
    Granted,
    Held,
    Locked,
    Lost,
    NotOwner,
    Released,
    Renewed,
    Stale,
)


def test_ping_and_handshake_limits(client):
    assert client.ping() >= 0
    limits = client.server_limits
    assert limits.frame_len_max == 8192
    assert limits.key_len_max == 1024 and limits.meta_len_max == 1024
    assert limits.ttl_ms_max == 3_600_000


def test_local_deadlines_give_up_the_rounding_or_a_thousandth_of_the_span():
    from tenure.results import local_deadline

    # Short spans: the server's 2 ms rounding; long ones: 0.1 % for clock rates (PROTOCOL.md 3.3).
    assert local_deadline(100.0, 0, 1_000) == pytest.approx(100.998)
    assert local_deadline(100.0, 30_000, 30_000) == pytest.approx(159.940)


def test_acquire_locked_renew_release(client):
    before = time.monotonic()
    lease = client.acquire("order:1842", 30, meta="worker-7")
    assert isinstance(lease, Granted)
    assert lease.ttl_ms == 30_000 and lease.waited_ms == 0 and len(lease.lease_id) == 16
    # Counted from before the request was sent, less the margin: 0.1 % of 30 s.
    assert before + 30 - 0.030 <= lease.deadline + 1e-6
    assert lease.deadline <= time.monotonic() + 30 - 0.030 + 1e-6

    locked = client.acquire("order:1842", 30)
    assert isinstance(locked, Locked)
    assert locked.token == lease.token and 0 < locked.ttl_left_ms <= 30_000

    renewed = client.renew(lease, 60)
    assert isinstance(renewed, Renewed) and renewed.ttl_ms == 60_000
    assert renewed.deadline > lease.deadline

    assert client.release(lease) == Released()
    assert client.release(lease) == NotOwner()
    assert client.renew(lease) == Lost()
    again = client.acquire("order:1842", 30)
    assert isinstance(again, Granted) and again.token > lease.token


def test_release_by_key_and_hex_lease_id(client):
    lease = client.acquire(b"\x00binary\xff", 10)
    assert client.release((b"\x00binary\xff", lease.lease_id_hex)) == Released()


def test_inspect_and_check(client):
    assert client.inspect("k") == Free()
    lease = client.acquire("k", 10, meta=b"\x01meta")
    held = client.inspect("k")
    assert isinstance(held, Held)
    assert held.token == lease.token and held.waiters == 0 and held.meta == b"\x01meta"
    assert 0 < held.ttl_left_ms <= 10_000
    assert client.check("k", lease.token) == Current()
    assert client.check("k", lease.token + 1) == Stale()
    assert client.check("other", lease.token) == Stale()


def test_stats(client):
    client.acquire("s", 10)
    stats = client.stats()
    assert stats["held"] == 1
    assert stats["connections"] >= 1
    assert stats["ops_acquire"] >= 1


def test_watch_events_and_unwatch(client, server):
    other = tenure.Client(server.addr)
    try:
        watch = client.watch("w")
        assert watch.initial == Free()
        lease = other.acquire("w", 10, meta="m")
        event = watch.next(timeout=5)
        assert (event.kind, event.key, event.token, event.meta) == (EventKind.GRANTED, b"w", lease.token, b"m")
        other.release(lease)
        assert watch.next(timeout=5).kind == EventKind.RELEASED
        short = other.acquire("w", 0.05)
        assert watch.next(timeout=5).kind == EventKind.GRANTED
        expired = watch.next(timeout=5)
        assert (expired.kind, expired.token) == (EventKind.EXPIRED, short.token)
        watch.close()
        other.acquire("w", 10)
        assert watch.next(timeout=0.3) is None
    finally:
        other.close()


def test_watch_reports_held_state(client):
    lease = client.acquire("wh", 10, meta="x")
    watch = client.watch("wh")
    assert isinstance(watch.initial, Held) and watch.initial.token == lease.token
    assert watch.initial.meta == b"x"


def test_release_on_disconnect(server, client):
    other = tenure.Client(server.addr)
    lease = other.acquire("rod", 30, release_on_disconnect=True)
    assert isinstance(lease, Granted) and lease.release_on_disconnect
    other.close()
    from conftest import wait_until

    assert wait_until(lambda: client.inspect("rod") == Free(), timeout=5)


def test_invalid_arguments_are_refused_before_sending(client):
    with pytest.raises(tenure.InvalidArgument):
        client.acquire("", 10)
    with pytest.raises(tenure.InvalidArgument):
        client.acquire("k" * 1025, 10)
    with pytest.raises(tenure.InvalidArgument):
        client.acquire("k", 0.001)
    with pytest.raises(tenure.InvalidArgument):
        client.acquire("k", 10, meta=b"m" * 1025)
    with pytest.raises(tenure.InvalidArgument):
        client.acquire("k", 10, wait=3601)
    assert client.stats()["errors"] == 0


def test_server_ttl_limit_is_checked_against_the_handshake(start_tenured):
    server = start_tenured("--ttl-max-ms", "1000")
    with tenure.Client(server.addr) as c:
        assert c.server_limits.ttl_ms_max == 1000
        with pytest.raises(tenure.InvalidArgument):
            c.acquire("k", 2)
        assert isinstance(c.acquire("k", 1), Granted)


def test_connection_refused_is_connection_lost():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(tenure.ConnectionLost):
        tenure.Client(f"127.0.0.1:{port}", connect_timeout=1)


def test_handshake_refusal_by_a_non_tenure_peer():
    """A peer that answers with a console line (as at the connection limit) is refused."""

    async def main():
        async def reply(reader, writer):
            await reader.read(8)
            writer.write(b"ERR CONNECTIONS_LIMIT too many connections\n")
            await writer.drain()
            writer.close()

        srv = await asyncio.start_server(reply, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        async with srv:
            with pytest.raises(tenure.HandshakeError, match="connection refused by server"):
                await tenure.AsyncClient.connect(f"127.0.0.1:{port}")

    asyncio.run(main())


def test_asyncio_operations(server):
    async def main():
        async with tenure.AsyncClient(server.addr) as c:
            assert await c.ping() >= 0
            lease = await c.acquire("a", 10)
            assert isinstance(lease, Granted)
            assert isinstance(await c.acquire("a", 10), Locked)
            assert isinstance(await c.renew(lease), Renewed)
            assert isinstance(await c.inspect("a"), Held)
            assert await c.check("a", lease.token) == Current()
            watch = await c.watch("a")
            assert isinstance(watch.initial, Held)
            assert await c.release(lease) == Released()
            event = await watch.next(timeout=5)
            assert event.kind == EventKind.RELEASED and event.token == lease.token
            await watch.close()
            assert (await c.stats())["held"] == 0

    asyncio.run(main())


def test_watching_a_key_again_ends_the_older_watch(client):
    """One watch per key per connection: the older watch ends (next() returns None) instead of
    waiting forever for events that now go to the newer one."""
    first = client.watch("again")
    second = client.watch("again")
    lease = client.acquire("again", 10)
    start = time.monotonic()
    assert first.next(timeout=10) is None
    assert time.monotonic() - start < 5, "the older watch was left waiting"
    event = second.next(timeout=5)
    assert event.kind == EventKind.GRANTED and event.token == lease.token
