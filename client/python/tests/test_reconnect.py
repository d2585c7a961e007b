"""Reconnection after the server restarts; leases survive a restart (full durability)."""

from __future__ import annotations

import time

import pytest

import tenure
from tenure import Granted, Released, Renewed


def test_requests_reconnect_after_a_restart(server, client):
    lease = client.acquire("r", 30)
    assert isinstance(lease, Granted)
    server.restart()
    # The old connection is gone; the next request opens a new one to the restarted server.
    assert client.ping() >= 0
    # The lease came back with its lease id (full durability): renew and release it.
    assert isinstance(client.renew(lease), Renewed)
    assert client.release(lease) == Released()
    # Since the restart: the client's pipelined and direct connections, and the fixture's probe.
    assert client.stats()["connections_total"] <= 3


def test_requests_fail_fast_while_the_server_is_down_then_recover(server):
    c = tenure.Client(server.addr, timeout=2, reconnect_delay_min=0.02, reconnect_delay_max=0.2)
    try:
        server.stop()
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises((tenure.ConnectionLost, tenure.RequestTimeout)):
                c.ping()
            assert time.monotonic() - start < 5
        server.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert c.ping() >= 0
                break
            except (tenure.ConnectionLost, tenure.RequestTimeout):
                assert time.monotonic() < deadline, "never reconnected"
                time.sleep(0.05)
    finally:
        c.close()


def test_guard_rides_through_a_quick_restart(server, client):
    with client.lock("rg", ttl=3) as lease:
        token = lease.token
        server.restart()
        renewed_past = time.monotonic() + 3
        deadline = time.monotonic() + 10
        while lease.deadline < renewed_past and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.deadline >= renewed_past, "no renewal confirmed after the restart"
        lease.check()
        assert client.check("rg", token) == tenure.Current()
