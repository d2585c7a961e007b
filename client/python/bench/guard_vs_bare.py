"""Lock cycles per second from one thread: `with client.lock()` beside bare acquire/release.

Starts `tenured` on a free loopback port with a fresh data directory (killed by PID at the
end) and runs, over one blocking `tenure.Client`, rounds of `--cycles` cycles of each form,
interleaved A/B/A/B so that a drift of the machine (other load, a warm disk cache) touches
both alike:

- bare: `client.acquire(key, ttl)` then `client.release(lease)`;
- guard: `with client.lock(key, ttl=...): pass` (acquire, start renewing, stop, release).

The server runs with `full` durability and fsync unless `--no-fsync` is given.

    python client/python/bench/guard_vs_bare.py --tenured target/debug/tenured

Prints each round's figure, then the median of each form and their ratio.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import tempfile
import time
from typing import Callable, Dict, List

import tenure

#: Longest the server may take to listen.
START_WAIT_S = 15.0
#: TTL of every lease taken (long enough that no renewal falls inside a cycle).
TTL_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(binary: str, data_dir: str, no_fsync: bool) -> "tuple[subprocess.Popen, str]":
    port = free_port()
    extra = ["--no-fsync"] if no_fsync else []
    cmd = [binary, "--listen", f"127.0.0.1:{port}", "--data-dir", data_dir, "--durability", "full", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("tenured did not start")


def bare(client: tenure.Client, key: str) -> None:
    lease = client.acquire(key, TTL_S)
    assert isinstance(lease, tenure.Granted), lease
    assert client.release(lease) == tenure.Released()


def guard(client: tenure.Client, key: str) -> None:
    with client.lock(key, ttl=TTL_S):
        pass


def rate(client: tenure.Client, cycle: Callable[[tenure.Client, str], None], cycles: int) -> float:
    start = time.perf_counter()
    for _ in range(cycles):
        cycle(client, "bench/guard")
    return cycles / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenured", default="target/debug/tenured", help="the server binary")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each form (interleaved)")
    parser.add_argument("--cycles", type=int, default=300, help="lock cycles per round")
    parser.add_argument("--no-fsync", action="store_true", help="run the server without fsync")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        proc, addr = start_server(args.tenured, data_dir, args.no_fsync)
        try:
            with tenure.Client(addr) as client:
                figures: Dict[str, List[float]] = {"bare": [], "guard": []}
                rate(client, bare, args.cycles // 10 + 1)  # warm-up: connections, caches
                rate(client, guard, args.cycles // 10 + 1)
                for round_no in range(args.rounds):
                    for name, cycle in (("bare", bare), ("guard", guard)):
                        figures[name].append(rate(client, cycle, args.cycles))
                        print(f"round {round_no + 1} {name:5} {figures[name][-1]:7.0f} cycles/s")
        finally:
            proc.kill()
            proc.wait()
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(f"median bare {medians['bare']:.0f} cycles/s, guard {medians['guard']:.0f} cycles/s, "
          f"guard/bare {medians['guard'] / medians['bare']:.2f}")


if __name__ == "__main__":
    main()
