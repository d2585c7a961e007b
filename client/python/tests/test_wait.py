"""A blocking acquire that waits in line for longer than the lease's TTL."""

from __future__ import annotations

import threading
import time

import tenure
from tenure import Granted, Renewed

TTL_S = 0.5
#: The holder keeps the lock for three TTLs before it releases.
HOLD_S = 3 * TTL_S


def _hold_then_release(server_addr: str, key: str, held: threading.Event) -> None:
    with tenure.Client(server_addr) as holder:
        with holder.lock(key, ttl=TTL_S):
            held.set()
            time.sleep(HOLD_S)


def test_blocking_acquire_longer_than_the_ttl_counts_waited_ms(server, client):
    held = threading.Event()
    holder = threading.Thread(target=_hold_then_release, args=(server.addr, "bw", held))
    holder.start()
    try:
        assert held.wait(10)
        before = time.monotonic()
        lease = client.acquire("bw", TTL_S, wait=10)
        arrived = time.monotonic()
    finally:
        holder.join(timeout=20)
    assert isinstance(lease, Granted)
    # It waited in line about three TTLs (generous lower bound), and the server said so.
    assert lease.waited_ms >= 1000 * TTL_S
    # The deadline counts the wait: sent_at + waited + ttl - 2 ms, sent_at taken before sending.
    assert before + (lease.waited_ms + lease.ttl_ms) / 1000 - 0.002 <= lease.deadline + 1e-6
    assert lease.deadline <= arrived + lease.ttl_ms / 1000
    # Counting from sent_at + ttl alone would make it look expired on arrival; it is not.
    assert lease.deadline > before + TTL_S
    assert not lease.is_expired()
    assert isinstance(client.renew(lease), Renewed)


def test_lock_guard_waits_three_ttls_then_holds(server, client):
    held = threading.Event()
    holder = threading.Thread(target=_hold_then_release, args=(server.addr, "bg", held))
    holder.start()
    try:
        assert held.wait(10)
        with client.lock("bg", ttl=TTL_S, wait=10) as lease:
            assert lease.lease.waited_ms >= 1000 * TTL_S
            lease.check()  # not lost on arrival
            time.sleep(3 * TTL_S)
            lease.check()  # and renewed since
            assert client.check("bg", lease.token) == tenure.Current()
    finally:
        holder.join(timeout=20)
