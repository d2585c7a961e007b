"""Fixtures: a real `tenured` on a free loopback port, killed by PID at teardown.

The binary is `$TENURED_BIN` if set, else `cargo build -p tenure-server --bin tenured` is run
from the repository root and target/debug/tenured is used.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
#: How long a server may take to listen, or to exit after a signal.
START_WAIT_S = 15.0
#: Ports tried before giving up: another process may take a free port before tenured binds it.
PORT_TRIES = 5


def free_port() -> int:
    return free_ports(1)[0]


#: Ports the tests pick from: below Linux's default ephemeral range (32768-60999), so no
#: outgoing connection of another test takes one while a server restarts on it (a port from
#: bind(:0) is in that range), and below the Rust tests' range (testkit: 20000-32000).
TEST_PORTS = range(12000, 20000)
#: Where this process's picks start (so test processes side by side rarely try one port).
_next_port = [(os.getpid() * 7919 + time.monotonic_ns()) % len(TEST_PORTS)]


def free_ports(count: int) -> List[int]:
    """`count` distinct free loopback ports from TEST_PORTS: each socket stays bound until all
    are chosen, so no port is handed out twice (free_port() called twice may)."""
    sockets: List[socket.socket] = []
    try:
        for _ in range(len(TEST_PORTS)):
            if len(sockets) == count:
                break
            port = TEST_PORTS[_next_port[0] % len(TEST_PORTS)]
            _next_port[0] += 1
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < count:
            raise RuntimeError(f"fewer than {count} free ports in {TEST_PORTS}")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def stop_process(proc: subprocess.Popen) -> None:
    """SIGSTOPs `proc` and waits until every thread of it is stopped (state T in /proc):
    the signal is delivered asynchronously, and a test of a hung node must not race it."""
    assert proc.poll() is None, f"process {proc.pid} already exited ({proc.returncode})"
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + START_WAIT_S
    tasks = Path(f"/proc/{proc.pid}/task")
    while time.monotonic() < deadline:
        states = []
        for task in tasks.iterdir():
            try:
                # The state follows the command name, which is in parentheses.
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that just ended
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {proc.pid} did not stop within {START_WAIT_S} s")


@pytest.fixture(scope="session")
def tenured_bin() -> str:
    path = os.environ.get("TENURED_BIN")
    if path:
        return path
    subprocess.run(
        ["cargo", "build", "-p", "tenure-server", "--bin", "tenured"], cwd=REPO_ROOT, check=True
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO_ROOT / "target"))
    return str(target / "debug" / "tenured")


class Tenured:
    """One tenured process; `restart()` starts it again on the same port and data directory."""

    def __init__(self, binary: str, data_dir: Path, args: List[str]) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.args = args
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        #: Single-node tests run with --no-fsync for speed; a test of what survives kill -9
        #: sets this False.
        self.no_fsync = True

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Tenured":
        for _ in range(PORT_TRIES):
            if self._try_start(self.port or free_port()):
                return self
            if self.port:
                time.sleep(0.2)  # restart on the same port: it may take a moment to free
        raise RuntimeError(f"tenured did not start; log:\n{self.log_path.read_text()}")

    def _try_start(self, port: int) -> bool:
        log = open(self.log_path, "ab")
        # --no-fsync speeds the single-node tests; a cluster node refuses it (its Raft log is
        # always fsynced).
        no_fsync = [] if "--cluster" in self.args or not self.no_fsync else ["--no-fsync"]
        cmd = [self.binary, "--listen", f"127.0.0.1:{port}", "--data-dir", str(self.data_dir), *no_fsync, *self.args]
        log_start = log.tell()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            # Ready when this process says so: a connect alone can succeed against another
            # process on the port, or (a port in the ephemeral range) against itself.
            if self._said_ready(log_start, port):
                self.port = port
                return True
            time.sleep(0.02)
        self.kill()
        return False

    def _said_ready(self, log_start: int, port: int) -> bool:
        """Whether the log, from `log_start` on, has this server's "ready" line for `port`
        (single node: "tenured ready addr=Some(127.0.0.1:P)"; cluster: "cluster node
        ready ... addr=127.0.0.1:P")."""
        with open(self.log_path, "rb") as log:
            log.seek(log_start)
            lines = log.read().splitlines()
        listen = f"127.0.0.1:{port}".encode()
        return any(b"ready" in line and listen in line for line in lines)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Sends `sig` and waits for the exit (SIGKILL after the wait)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=START_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=START_WAIT_S)

    def restart(self) -> "Tenured":
        self.stop()
        return self.start()


@pytest.fixture
def start_tenured(tenured_bin: str, tmp_path: Path) -> Iterator:
    """A factory: `start_tenured("--identities", path)` -> a running Tenured."""
    started: List[Tenured] = []

    def start(*args: str) -> Tenured:
        server = Tenured(tenured_bin, tmp_path / f"data{len(started)}", list(args))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def server(start_tenured) -> Tenured:
    return start_tenured()


@pytest.fixture
def client(server: Tenured) -> Iterator:
    import tenure

    c = tenure.Client(server.addr, timeout=5.0)
    yield c
    c.close()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Polls `predicate` until it is true or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
