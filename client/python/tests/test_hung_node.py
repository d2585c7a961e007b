"""A hung node (a SIGSTOPped tenured: the kernel still accepts connections, nothing answers):
with several addresses the client moves on to the others, and a request's time-out bounds
the whole call."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

import tenure
from tenure import RequestTimeout

from conftest import Tenured, stop_process
from test_cluster_failover import leader_of, start_cluster


def test_connecting_moves_past_a_hung_first_address(start_tenured) -> None:
    hung: Tenured = start_tenured()
    live: Tenured = start_tenured()
    assert hung.addr != live.addr
    stop_process(hung.proc)
    try:
        started = time.monotonic()
        with tenure.Client(f"{hung.addr},{live.addr}", connect_timeout=2) as client:
            client.ping()
            assert client.aio._conn is not None and client.aio._conn.address == live.addr
        # One connect time-out for the hung node, then the live one: well under 10 s.
        assert time.monotonic() - started < 10.0
    finally:
        hung.proc.send_signal(signal.SIGCONT)


#: The request's (and the connect's) time-out in the whole-call case.
WHOLE_CALL_TIMEOUT_S = 6.0


def test_a_request_time_out_bounds_the_whole_call(start_tenured) -> None:
    server: Tenured = start_tenured()
    timeout = WHOLE_CALL_TIMEOUT_S
    with tenure.Client(server.addr, timeout=timeout, connect_timeout=timeout) as client:
        stop_process(server.proc)
        try:
            started = time.monotonic()
            with pytest.raises(RequestTimeout):
                client.inspect("k")
            # One time-out, not one to open the direct connection and then another on the
            # loop (2 x timeout): the bound sits between, with room for a loaded machine.
            assert time.monotonic() - started < 1.75 * timeout
        finally:
            server.proc.send_signal(signal.SIGCONT)


#: The guard's lease and renewal period, as in the report: a stopped leader must be left
#: well before the lease runs out.
TTL_S = 6.0
RENEW_EVERY_S = 1.0


def test_a_guard_leaves_a_stopped_leader_and_renews_at_the_new_one(tenured_bin: str, tmp_path: Path) -> None:
    nodes = start_cluster(tenured_bin, tmp_path)
    leader = None
    try:
        addrs = ",".join(node.addr for node in nodes)
        with tenure.Client(addrs) as holder:
            leader = leader_of(nodes)
            guard = holder.lock("held", TTL_S, renew_every=RENEW_EVERY_S)
            guard.acquire()
            stop_process(leader.proc)
            stopped_at = time.monotonic()
            # Longer than the TTL: only renewals at the new leader keep the guard valid.
            while time.monotonic() - stopped_at < TTL_S + 2 * RENEW_EVERY_S:
                assert guard.is_valid(), guard.loss_reason
                time.sleep(0.25)
            assert guard.time_left() > TTL_S / 2, "renewed lately"
            assert holder.aio._conn is not None and holder.aio._conn.address != leader.addr
            guard.release()
    finally:
        if leader is not None:
            leader.proc.send_signal(signal.SIGCONT)
        for node in nodes:
            node.kill()


@pytest.mark.parametrize(
    "hold",
    [
        pytest.param(["--no-session"], id="lease"),
        pytest.param([], id="session"),
    ],
)
def test_the_rust_cli_s_guard_leaves_a_stopped_leader(tenured_bin: str, tmp_path: Path, hold) -> None:
    """The Rust client, through `tenure run` (built next to tenured): its session (the
    default: TTL 6 s, a keep-alive every 2 s), or with --no-session its guard (TTL 6 s,
    renewed every 2 s, request time-out 5 s), rides through a SIGSTOP of the leader."""
    cli = Path(tenured_bin).with_name("tenure")
    # Not skipped when missing: a test that passes without running is no test.
    assert cli.exists(), f"{cli} is not built: cargo build -p tenure --bin tenure"

    nodes = start_cluster(tenured_bin, tmp_path)
    leader = leader_of(nodes)
    try:
        addrs = ",".join(node.addr for node in nodes)
        run = [str(cli), "--addr", addrs, "run", "--key", "k", "--ttl", "6s", *hold, "--", "sleep", "12"]
        proc = subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # granted and renewing
        stop_process(leader.proc)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode()
        assert b"LOST" not in out, out.decode()
    finally:
        leader.proc.send_signal(signal.SIGCONT)
        for node in nodes:
            node.kill()
