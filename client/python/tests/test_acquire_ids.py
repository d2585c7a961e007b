"""Exactly-once ACQUIRE (PROTOCOL.md 3.9) against the real `tenured`: a proxy between the
client and the server throws away a GRANTED reply (the grant is durable: the server replies
only then), the server is killed with SIGKILL (a single node, restarted on its port; or a
cluster's leader), and the client's own retry with the same acquire id must come back as the
one grant the caller sees: the same token and lease id. A lease that ended before the retry
arrived is reported as ended (`AcquireEnded`), not granted again. Without the client's
retries each of these ACQUIREs fails with a lost connection."""

from __future__ import annotations

import queue
import socket
import struct
import threading
from pathlib import Path
from typing import List, Optional, Tuple

import tenure
from tenure import AcquireEnded, Granted, Held

from conftest import Tenured, wait_until
from test_cluster_failover import leader_of, start_cluster

#: Longest a grant, a restart or a fail-over may take here, on a loaded machine.
STEP_S = 30.0
GRANTED = 0x82
SESSION = 0x93


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


class Proxy:
    """Forwards every connection to `upstream` (connecting anew each time, so it reaches a
    restarted server); while armed, drops the first GRANTED reply, reports (token, lease id)
    on `dropped`, and closes that connection once `cut` is set."""

    def __init__(
        self,
        upstream: str,
        armed: threading.Event,
        dropped: "queue.Queue",
        cut: threading.Event,
        opcode: int = GRANTED,
    ) -> None:
        self.upstream = upstream
        self.opcode = opcode
        self.armed, self.dropped, self.cut = armed, dropped, cut
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        host, port = self.upstream.rsplit(":", 1)
        try:
            server = socket.create_connection((host, int(port)), timeout=5)
        except OSError:
            client.close()  # the server is down: the client sees a closed connection
            return
        server.settimeout(None)
        threading.Thread(target=self._upward, args=(client, server), daemon=True).start()
        try:
            self._replies(server, client)
        except OSError:
            pass
        finally:
            # shutdown, not only close: a close leaves the socket open while the upward
            # thread is still in recv() on it, and the client would hear nothing.
            for sock in (client, server):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    @staticmethod
    def _upward(client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                server.sendall(data)
        except OSError:
            pass
        finally:
            server.close()

    def _replies(self, server: socket.socket, client: socket.socket) -> None:
        header = _read_exact(server, 10)
        client.sendall(header + _read_exact(server, int.from_bytes(header[8:10], "big")))
        while True:
            length = _read_exact(server, 4)
            frame = _read_exact(server, int.from_bytes(length, "big"))
            if frame[0] == self.opcode and self.armed.is_set():
                self.armed.clear()
                token = struct.unpack(">Q", frame[9:17])[0]
                self.dropped.put((token, frame[17:33]))
                self.cut.wait(STEP_S)
                return
            client.sendall(length + frame)


class Trap:
    def __init__(self) -> None:
        self.armed = threading.Event()
        self.cut = threading.Event()
        self.dropped: "queue.Queue[Tuple[int, bytes]]" = queue.Queue()

    def proxy(self, upstream: str, opcode: int = GRANTED) -> Proxy:
        return Proxy(upstream, self.armed, self.dropped, self.cut, opcode)

    def arm(self) -> None:
        self.cut.clear()
        self.armed.set()


def _acquire_in_thread(client: tenure.Client, key: str) -> Tuple[threading.Thread, List]:
    out: List = []

    def run() -> None:
        try:
            out.append(client.acquire(key, 60))
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_single_nodes_grant_lost_to_kill_9_is_the_callers_one_grant(tenured_bin: str, tmp_path: Path) -> None:
    node = Tenured(tenured_bin, tmp_path / "data", [])
    node.no_fsync = False  # what was acknowledged must survive the kill
    node.start()
    trap = Trap()
    proxy = trap.proxy(node.addr)
    client = tenure.Client(proxy.addr, timeout=5.0, acquire_retry_for=STEP_S)
    direct = tenure.Client(node.addr, timeout=5.0, lazy=True)
    try:
        # Granted and durable, the reply dropped, the server killed and restarted, then the
        # client's connection cut: the retry finds the grant in the restarted server's log.
        trap.arm()
        thread, out = _acquire_in_thread(client, "job:1")
        token, lease_id = trap.dropped.get(timeout=STEP_S)
        node.kill()
        node.start()
        trap.cut.set()
        thread.join(STEP_S)
        [lease] = out
        assert isinstance(lease, Granted), lease
        assert (lease.token, lease.lease_id) == (token, lease_id)
        held = client.inspect("job:1")
        assert isinstance(held, Held) and held.token == token, held
        assert isinstance(client.release(lease), tenure.Released)

        # The lease ends (released by someone who learnt its id) before the retry arrives:
        # the caller hears that it was granted and has ended; nothing is granted again.
        trap.arm()
        thread, out = _acquire_in_thread(client, "job:2")
        token, lease_id = trap.dropped.get(timeout=STEP_S)
        assert isinstance(direct.release(("job:2", lease_id)), tenure.Released)
        trap.cut.set()
        thread.join(STEP_S)
        [ended] = out
        assert isinstance(ended, AcquireEnded), ended
        assert (ended.how, ended.token) == ("released", token)
        assert isinstance(direct.inspect("job:2"), tenure.Free)
    finally:
        client.close()
        direct.close()
        node.kill()


def test_a_leaders_grant_lost_to_kill_9_is_the_callers_one_grant(tenured_bin: str, tmp_path: Path) -> None:
    nodes = start_cluster(tenured_bin, tmp_path)
    try:
        # A follower's NOT_LEADER names the leader's own address, which bypasses the
        # proxies: the leader's proxy comes first, so that the first send goes through it.
        leader = leader_of(nodes)
        ordered = [leader] + [n for n in nodes if n is not leader]
        trap = Trap()
        proxies = [trap.proxy(n.addr) for n in ordered]
        client = tenure.Client(",".join(p.addr for p in proxies), timeout=5.0, acquire_retry_for=STEP_S)
        try:
            trap.arm()
            thread, out = _acquire_in_thread(client, "job:1")
            token, lease_id = trap.dropped.get(timeout=STEP_S)
            leader.kill()  # committed (the leader replies only then), then killed
            proxies[0].listener.close()  # refused from now on, as the node is
            trap.cut.set()
            thread.join(STEP_S)
            [lease] = out
            assert isinstance(lease, Granted), lease
            assert (lease.token, lease.lease_id) == (token, lease_id)
            held = client.inspect("job:1")
            assert isinstance(held, Held) and held.token == token, held
            assert isinstance(client.release(lease), tenure.Released)
        finally:
            client.close()
    finally:
        for node in nodes:
            node.kill()


def test_a_permit_or_read_leases_lost_grant_is_the_callers_one_grant(tenured_bin: str, tmp_path: Path) -> None:
    # A semaphore permit and a read lease carry an acquire id with their kind: the retry
    # after the GRANTED reply was lost finds that lease (REGRANTED), not a second permit.
    node = Tenured(tenured_bin, tmp_path / "data", []).start()
    trap = Trap()
    proxy = trap.proxy(node.addr)
    client = tenure.Client(proxy.addr, timeout=5.0, acquire_retry_for=STEP_S)
    direct = tenure.Client(node.addr, timeout=5.0, lazy=True)
    try:
        guards = {
            "pool": lambda: client.semaphore("pool", permits=2, ttl=60),
            "doc": lambda: client.read_lock("doc", ttl=60),
        }
        for key, guard in guards.items():
            out: List = []

            def run() -> None:
                try:
                    out.append(guard().acquire())
                except Exception as e:  # noqa: BLE001 - handed to the test
                    out.append(e)

            trap.arm()
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            token, _ = trap.dropped.get(timeout=STEP_S)
            trap.cut.set()
            thread.join(STEP_S)
            [held] = out
            assert isinstance(held, tenure.LeaseGuard), held
            assert held.token == token
            kinds = direct.inspect_kinds(key)
            assert isinstance(kinds, tenure.HeldKinds) and kinds.holders == 1, kinds
            assert direct.stats()["repeats"] >= 1
            held.release()
            assert isinstance(direct.inspect(key), tenure.Free)
    finally:
        client.close()
        direct.close()
        node.kill()


def test_a_session_open_whose_answer_is_lost_is_sent_again_with_its_id(server) -> None:
    """An open whose answer was lost is sent again with the same session id: the resend finds
    the session the first send opened, so the caller gets it and no empty session is left
    behind (outside test a49, P1: the first lost answer was raised; until the session id,
    the lost open's session stayed until its TTL)."""
    trap = Trap()
    proxy = trap.proxy(server.addr, opcode=SESSION)
    with tenure.Client(proxy.addr, timeout=5.0) as client, tenure.Client(server.addr) as direct:
        before = direct.stats()["sessions"]
        trap.arm()
        out: List = []

        def run() -> None:
            try:
                with client.session(ttl=2) as s, s.lock("open/lost") as lock:
                    out.append((s.session_id, lock.token, direct.stats()["sessions"]))
            except Exception as e:  # noqa: BLE001 - handed to the test
                out.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        trap.dropped.get(timeout=STEP_S)
        trap.cut.set()
        thread.join(STEP_S)
        [opened] = out
        assert isinstance(opened, tuple), opened
        # One session while it was held (the one both sends named), none after its close.
        assert opened[2] == before + 1
        assert direct.stats()["sessions"] == before
