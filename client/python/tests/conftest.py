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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                self.port = port
                return True
            except OSError:
                time.sleep(0.02)
        self.kill()
        return False

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
