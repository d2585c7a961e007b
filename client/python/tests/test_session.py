"""Sessions against a real tenured (PROTOCOL.md 3.11): one keep-alive keeps many locks past
their TTL without a renewal; closing frees them all and the waiters get them; a session whose
keep-alives stop is reported lost before the server frees its keys; in a cluster a session
rides through the leader's `kill -9`."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

import tenure
from tenure import Granted, Locked

from conftest import wait_until
from test_cluster_failover import ELECTED_WAIT_S, leader_of, start_cluster

#: The session TTL of the single-node tests.
TTL_S = 0.6
LOCKS = 20


def test_one_session_keeps_many_locks_past_their_ttl_without_renewals(client, server) -> None:
    with tenure.Client(server.addr) as other:
        with client.session(ttl=TTL_S) as s:
            locks = [s.lock(f"s/{i}").acquire() for i in range(LOCKS)]
            started = time.monotonic()
            while time.monotonic() - started < TTL_S * 5:
                time.sleep(TTL_S / 4)
                s.check()
                for lock in locks:
                    lock.check()
                probe = other.acquire("s/3", ttl=1)
                assert isinstance(probe, Locked) and probe.token == locks[3].token, probe
            stats = other.stats()
            assert stats["ops_renew"] == 0, "no lease was renewed"
            assert stats["session_leases"] == LOCKS
            assert s.deadline > started + TTL_S * 4
            with pytest.raises(tenure.ServerError) as refused:
                other.renew(Granted(b"s/0", locks[0].token, locks[0].lease_id, 1000, 0, 0.0, False))
            assert refused.value.name == "SESSION_LEASE"
            # The lock itself, given to renew(): the same refusal, before anything is sent
            # (it was an AttributeError).
            renews = other.stats()["ops_renew"]
            with pytest.raises(tenure.BadRequest) as refused:
                other.renew(locks[0])  # type: ignore[arg-type]
            assert refused.value.name == "SESSION_LEASE"
            assert other.stats()["ops_renew"] == renews, "nothing was sent"
            with pytest.raises(tenure.InvalidArgument, match="Granted"):
                other.renew(("s/0", locks[0].lease_id))  # type: ignore[arg-type]


def test_closing_frees_every_lock_and_the_waiters_get_them(client, server) -> None:
    results = {}
    with tenure.Client(server.addr) as waiter:
        s = client.session(ttl=TTL_S)
        a, b = s.lock("c/a").acquire(), s.lock("c/b").acquire()

        def wait_for(key: str) -> None:
            results[key] = waiter.acquire(key, ttl=5, wait=30)

        threads = [threading.Thread(target=wait_for, args=(key,)) for key in ("c/a", "c/b")]
        for thread in threads:
            thread.start()
        assert wait_until(lambda: all(getattr(client.inspect(k), "waiters", 0) == 1 for k in ("c/a", "c/b")))
        assert s.close() == 2, "both locks freed by the close"
        for thread in threads:
            thread.join(timeout=10)
        assert isinstance(results["c/a"], Granted) and results["c/a"].token > a.token
        assert isinstance(results["c/b"], Granted) and results["c/b"].token > b.token
        assert s.lost.is_set() and not a.is_valid() and not b.is_valid()
        with pytest.raises(tenure.LeaseLost):
            a.check()


def test_a_session_lock_waits_in_line_or_is_refused(client, server) -> None:
    with tenure.Client(server.addr) as other:
        held = other.acquire("w/k", ttl=0.5)
        assert isinstance(held, Granted)
        with client.session(ttl=TTL_S) as s:
            with pytest.raises(tenure.NotAcquired) as refused:
                s.lock("w/k").acquire()
            assert refused.value.token == held.token
            with s.lock("w/k", wait=10) as lock:  # granted when the other lease runs out
                assert lock.token > held.token and lock.is_valid()
                assert isinstance(other.acquire("w/k", ttl=1), Locked)
        assert wait_until(lambda: isinstance(other.acquire("w/k", ttl=1), Granted))


class FreezingProxy:
    """A TCP proxy whose forwarding can be frozen: bytes are held and connections stay open,
    as for a client process that was stopped (SIGSTOP)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.frozen = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self.listener.accept()
            except OSError:
                return
            outbound = socket.create_connection(self.target)
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._forward, args=(a, b), daemon=True).start()

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            while self.frozen.is_set():
                time.sleep(0.005)
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()


def test_a_session_whose_keep_alives_stop_is_lost_before_the_server_frees_its_keys(server) -> None:
    proxy = FreezingProxy(server.addr)
    try:
        with tenure.Client(proxy.addr, timeout=2) as holder, tenure.Client(server.addr) as watcher:
            s = holder.session(ttl=TTL_S)
            locks = [s.lock("f/a").acquire(), s.lock("f/b").acquire()]
            time.sleep(TTL_S * 2)
            assert s.is_valid(), s.loss_reason
            lost_at = []
            threading.Thread(target=lambda: (s.lost.wait(30), lost_at.append(time.monotonic())), daemon=True).start()
            proxy.frozen.set()
            frozen_at = time.monotonic()
            while not all(isinstance(watcher.inspect(k), tenure.Free) for k in ("f/a", "f/b")):
                assert time.monotonic() - frozen_at < TTL_S * 20, "the server never freed them"
                time.sleep(0.001)
            freed_at = time.monotonic()
            assert lost_at and lost_at[0] <= freed_at, (lost_at, freed_at)
            assert "unconfirmed" in s.loss_reason
            assert not any(lock.is_valid() for lock in locks)
            assert isinstance(watcher.acquire("f/a", ttl=1), Granted)
            proxy.frozen.clear()
    finally:
        proxy.close()


def test_asyncio_sessions_and_bad_arguments(server) -> None:
    import asyncio

    async def main() -> None:
        async with tenure.AsyncClient(server.addr) as client:
            async with client.session(ttl=TTL_S) as s:
                async with s.lock("a/a") as a, s.lock("a/b") as b:
                    await asyncio.sleep(TTL_S * 2)
                    a.check()
                    b.check()
                    assert isinstance(await client.inspect("a/a"), tenure.Held)
                    with pytest.raises(tenure.BadRequest, match="session"):
                        await client.renew(a)  # type: ignore[arg-type]
                assert isinstance(await client.inspect("a/a"), tenure.Free), "released on exit"
                assert s.is_valid()
            assert not s.is_valid()
            with pytest.raises(tenure.InvalidArgument):
                client.session(ttl=TTL_S, keep_alive_every=TTL_S)

    asyncio.run(main())


def test_a_session_with_two_locks_is_kept_alive_through_kill_9_and_restart(start_tenured) -> None:
    ttl_s = 6.0
    node = start_tenured()
    node.no_fsync = False  # what survives kill -9 is what was fsynced
    node.restart()
    with tenure.Client(node.addr, timeout=2) as holder:
        s = holder.session(ttl=ttl_s)
        locks = [s.lock(k).acquire() for k in ("k9/a", "k9/b")]
        tokens = [lock.token for lock in locks]
        session_id = s.session_id
        node.kill()
        killed_at = time.monotonic()
        time.sleep(0.5)  # down a while: keep-alives meet refused connections
        node.start()
        with tenure.Client(node.addr) as other:
            # Past the TTL counted from the kill: only keep-alives at the restarted server can
            # have kept the session (and its locks) alive this long.
            while time.monotonic() - killed_at < ttl_s * 1.5:
                s.check()
                for lock in locks:
                    lock.check()
                    probe = other.acquire(lock.key, ttl=1)
                    assert isinstance(probe, Locked) and probe.token == lock.token, probe
                time.sleep(0.5)
            assert s.session_id == session_id
            assert [lock.token for lock in locks] == tokens
            assert s.close() == 2
            assert all(isinstance(other.inspect(k), tenure.Free) for k in ("k9/a", "k9/b"))


def test_an_unanswered_release_of_a_session_lock_is_sent_again(start_tenured) -> None:
    """A session lock has no TTL of its own: a RELEASE lost to a crash must not leave its key
    held for the session's life. Sent while the server is down, it is retried and lands at
    the restarted server (the session and lease came back from its log)."""
    node = start_tenured()
    node.no_fsync = False  # what survives kill -9 is what was fsynced
    node.restart()
    with tenure.Client(node.addr, timeout=1) as holder:
        s = holder.session(ttl=10.0)
        lock = s.lock("rl/a").acquire()
        node.kill()
        restarter = threading.Timer(1.0, node.start)
        restarter.start()
        try:
            lock.release()  # first sends meet a refused port; a retry reaches the restart
        finally:
            restarter.join()
        with tenure.Client(node.addr) as other:
            assert isinstance(other.inspect("rl/a"), tenure.Free), "the RELEASE was retried"
            assert s.is_valid(), "the session and its other locks go on"
        s.close()


def test_a_session_rides_through_the_leaders_kill(tenured_bin: str, tmp_path: Path) -> None:
    ttl_s, every_s = 6.0, 0.5
    nodes = start_cluster(tenured_bin, tmp_path)
    try:
        addrs = ",".join(node.addr for node in nodes)
        with tenure.Client(addrs, timeout=ELECTED_WAIT_S) as holder, tenure.Client(addrs) as other:
            s = holder.session(ttl=ttl_s, keep_alive_every=every_s)
            locks = [s.lock(k).acquire() for k in ("r/a", "r/b", "r/c")]
            session_id = s.session_id
            leader = leader_of(nodes)
            leader.kill()
            nodes.remove(leader)
            killed_at = time.monotonic()
            # Past the TTL counted from the kill: only keep-alives at the new leader can have
            # kept the session (and its locks) alive this long.
            while time.monotonic() - killed_at < ttl_s + every_s:
                s.check()
                for lock in locks:
                    lock.check()
                    probe = other.acquire(lock.key, ttl=1)
                    assert isinstance(probe, Locked) and probe.token == lock.token, probe
                time.sleep(every_s)
            assert s.session_id == session_id
            assert s.close() == 3
    finally:
        for node in nodes:
            node.kill()


def test_a_release_and_a_close_reconnect_sooner_than_the_backoff(start_tenured) -> None:
    """Freeing leases is lease keeping too: a RELEASE or a SESSION_CLOSE sent again after one
    met the server down tries to reconnect at most `RECONNECT_DELAY_KEEPING_MAX_S` after the
    failed attempt, not after the client's backoff (12 s here, past the request's time-out),
    so a server back within a moment frees the keys then, not a restored lease's TTL later
    (outside test a36, claim 5, in the Rust CLI)."""
    node = start_tenured()
    with tenure.Client(node.addr, timeout=5, reconnect_delay_min=12, reconnect_delay_max=12) as c:
        lease = c.acquire("rr/a", ttl=30)
        assert isinstance(lease, Granted), lease
        s = c.session(ttl=30)
        s.lock("rr/b").acquire()
        node.kill()
        with pytest.raises((tenure.CannotConnect, tenure.ConnectionLost)):
            c.release(lease)  # refused: the backoff starts
        node.start()
        assert c.release(lease) == tenure.Released()
        assert s.close() == 1
        with tenure.Client(node.addr) as other:
            assert isinstance(other.inspect("rr/a"), tenure.Free)
            assert isinstance(other.inspect("rr/b"), tenure.Free)


def test_keep_alives_reconnect_sooner_than_the_backoff(start_tenured) -> None:
    """A restart shorter than the session's time left does not outlast it for want of a
    reconnect attempt: a keep-alive waits at most `RECONNECT_DELAY_KEEPING_MAX_S` after a
    failed one, not the client's backoff (here 6-12 s, past the session's deadline; outside
    test a33 saw `tenure run` drop its lock so over a 3 s restart)."""
    node = start_tenured()
    ttl_s = 3.0
    with tenure.Client(node.addr, reconnect_delay_min=12, reconnect_delay_max=12) as c:
        s = c.session(ttl=ttl_s)
        lock = s.lock("rk/a").acquire()
        node.kill()
        time.sleep(1.2)  # down past the next keep-alive (every 1 s): it meets a refusal
        node.start()
        back_at = time.monotonic()
        # Only a keep-alive confirmed after the restart moves the deadline this far.
        assert wait_until(lambda: s.deadline > back_at + ttl_s - 0.25, timeout=ttl_s), s.loss_reason
        s.check()
        lock.check()
        s.close()


def test_an_open_whose_session_ended_before_its_answer_opens_another(client, server, monkeypatch) -> None:
    """A resent SESSION_OPEN that hears NO_SESSION (the session an earlier send opened has
    ended) starts again with a new session id; every open names one (PROTOCOL.md 3.11)."""
    from tenure import errors
    from tenure.session import AsyncSession

    bodies = []
    real = AsyncSession._open_sent

    async def first_ended(self, body):
        bodies.append(body)
        if len(bodies) == 1:
            raise errors.server_error(25, "session was opened, and has ended")
        return await real(self, body)

    monkeypatch.setattr(AsyncSession, "_open_sent", first_ended)
    with client.session(ttl=2) as s:
        assert len(bodies) == 2
        assert [len(b) for b in bodies] == [20, 20], "TTL and the session id"
        assert bodies[0][:4] == bodies[1][:4] and bodies[0][4:] != bodies[1][4:]
        assert s.session_id == bodies[1][4:].hex()
        assert s.lock("ended/again").acquire().token > 0


def test_an_open_answered_past_its_deadline_opens_another(client, server, monkeypatch) -> None:
    """An open answered only after its session's deadline counted from the first send is not
    taken (the server may have opened its id again, empty, for a resend): a new round opens
    another id (outside test a60, F2: the caller got a dead session)."""
    import asyncio

    from tenure.session import AsyncSession

    bodies = []
    real = AsyncSession._open_sent

    async def first_late(self, body):
        bodies.append(body)
        if len(bodies) == 1:
            await asyncio.sleep(0.35)
        return await real(self, body)

    monkeypatch.setattr(AsyncSession, "_open_sent", first_late)
    with client.session(ttl=0.3) as s:
        assert len(bodies) == 2 and bodies[0][4:] != bodies[1][4:]
        assert s.session_id == bodies[1][4:].hex()
        s.check()
