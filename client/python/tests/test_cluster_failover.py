"""Against a real three-node cluster (three `tenured --cluster` processes on loopback): given
every address, the client finds the leader, and a lease guard and a leadership ride through
the leader's `kill -9` by renewing with the same lease id at the new leader."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import List

import pytest

import tenure
from tenure import Granted, Locked

from conftest import Tenured, free_port, free_ports

#: Longest an election and a takeover may take on a loaded machine.
ELECTED_WAIT_S = 15.0
#: The lease of the guard and of the leadership: several renewals, and a fail-over, fit in it.
TTL_S = 6.0
RENEW_EVERY_S = 0.5


def start_cluster(tenured_bin: str, tmp_path: Path) -> List[Tenured]:
    # Every port at once: a client port chosen after the peer ports could be one of them.
    ports = free_ports(6)
    peers = [f"127.0.0.1:{port}" for port in ports[:3]]
    nodes = []
    for i, peer in enumerate(peers):
        args = ["--cluster", "--node-id", str(i + 1), "--peer-listen", peer]
        node = Tenured(tenured_bin, tmp_path / f"node{i + 1}", args)
        node.port = ports[3 + i]
        nodes.append(node.start())
    members = ",".join(f"{i + 1}={peers[i]}/{node.addr}" for i, node in enumerate(nodes))
    subprocess.run([tenured_bin, "cluster-init", "--peer", peers[0], "--nodes", members], check=True)
    return nodes


def leader_of(nodes: List[Tenured]) -> Tenured:
    """The node whose console serves (a follower answers `ERR NOT_LEADER`)."""
    deadline = time.monotonic() + ELECTED_WAIT_S
    while time.monotonic() < deadline:
        for node in nodes:
            host, port = node.addr.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as conn:
                conn.sendall(b"INSPECT held\n")
                reply = conn.makefile("rb").readline()
            if reply.startswith((b"HELD ", b"FREE")):
                return node
        time.sleep(0.05)
    raise AssertionError("no node served")


def test_a_guard_and_a_leadership_ride_through_the_leaders_kill(tenured_bin: str, tmp_path: Path) -> None:
    nodes = start_cluster(tenured_bin, tmp_path)
    try:
        addrs = ",".join(node.addr for node in nodes)
        with tenure.Client(addrs, timeout=ELECTED_WAIT_S) as holder, tenure.Client(addrs) as other:
            guard = holder.lock("held", TTL_S, renew_every=RENEW_EVERY_S)
            guard.acquire()
            leadership = holder.election("primary", ttl=TTL_S).campaign(b"me", renew_every=RENEW_EVERY_S)
            token = guard.token

            leader = leader_of(nodes)
            leader.proc.send_signal(signal.SIGKILL)
            leader.proc.wait(timeout=ELECTED_WAIT_S)
            killed_at = time.monotonic()
            # Past the TTL counted from the kill: only renewals at the new leader can have kept
            # both valid this long, and nobody else is granted the key meanwhile.
            while time.monotonic() - killed_at < TTL_S + RENEW_EVERY_S:
                assert guard.is_valid(), guard.loss_reason
                assert leadership.is_valid()
                result = other.acquire("held", TTL_S)
                assert isinstance(result, Locked) and result.token == token, result
                assert not isinstance(result, Granted)
                time.sleep(RENEW_EVERY_S)
            assert guard.token == token
            guard.release()
    finally:
        for node in nodes:
            node.kill()


def test_an_acquire_every_node_refuses_not_leader_raises_not_leader(start_tenured):
    """Found by outside testing (a29, finding 2): against a node that answers every request
    NOT_LEADER (here one never added to a cluster), the ACQUIRE's retries ran out while the
    last send was still connecting, and the caller heard CannotConnect ("the request was not
    sent"). It must hear the NOT_LEADER the sends did get."""
    peer = f"127.0.0.1:{free_port()}"
    node = start_tenured("--cluster", "--node-id", "4", "--peer-listen", peer)
    with tenure.Client(node.addr, timeout=1, acquire_retry_for=3) as c:
        with pytest.raises(tenure.NotLeader):
            c.acquire("k", ttl=5)


def test_an_open_every_node_refuses_not_leader_raises_not_leader(start_tenured):
    """A SESSION_OPEN's resends run out as an ACQUIRE's do (outside test a61): the caller
    hears the NOT_LEADER the sends got, not the time-out of a last send the retries cut
    short ("reconnect delay runs past the request's timeout")."""
    peer = f"127.0.0.1:{free_port()}"
    node = start_tenured("--cluster", "--node-id", "4", "--peer-listen", peer)
    with tenure.Client(node.addr, timeout=1, acquire_retry_for=3) as c:
        with pytest.raises(tenure.NotLeader):
            c.session(ttl=5)
