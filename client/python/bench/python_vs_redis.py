"""Acquire/release round trips per second from Python: tenure-client beside redis-py.

Starts `tenured` and `redis-server` on free loopback ports (killed by PID at the end) and
runs, for each, one connection:

- blocking: acquire then release, one request at a time (2 round trips per cycle);
- batched: `--batch` acquires in flight at once, then their releases (tenure: asyncio
  `gather` over one pipelined connection; Redis: a redis-py pipeline, no transaction).

tenure: ACQUIRE (a grant carries a fencing token) and RELEASE (compare-and-delete by lease
id). Redis: `SET key value NX PX ttl` and the usual Lua compare-and-delete release script.
Both servers in memory: `tenured --durability tokens --no-fsync`, Redis with no persistence.

    pip install redis                      # only the benchmark needs it
    python client/python/bench/python_vs_redis.py --tenured target/release/tenured

Prints one table; `--json` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Callable, Dict, List

import tenure

RELEASE_SCRIPT = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""
TTL_S = 30
#: How long a listening server may take to start.
START_WAIT_S = 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on {port}")


def timed(window_s: float, cycle: Callable[[], int]) -> float:
    """Runs `cycle` (returning cycles done) for `window_s`; cycles per second."""
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < window_s:
        done += cycle()
    return done / (time.perf_counter() - start)


def tenure_blocking(addr: str, window_s: float) -> float:
    with tenure.Client(addr) as client:
        def cycle() -> int:
            lease = client.acquire("bench/blocking", TTL_S)
            assert isinstance(lease, tenure.Granted)
            client.release(lease)
            return 1

        timed(0.3, cycle)  # warm-up
        return timed(window_s, cycle)


def tenure_batched(addr: str, window_s: float, batch: int) -> float:
    async def main() -> float:
        async with tenure.AsyncClient(addr) as client:
            keys = [f"bench/batch/{i}" for i in range(batch)]

            async def one_batch() -> None:
                leases = await asyncio.gather(*(client.acquire(k, TTL_S) for k in keys))
                await asyncio.gather(*(client.release(lease) for lease in leases))

            loop_deadline = time.perf_counter() + 0.3
            while time.perf_counter() < loop_deadline:
                await one_batch()
            done = 0
            start = time.perf_counter()
            while time.perf_counter() - start < window_s:
                await one_batch()
                done += batch
            return done / (time.perf_counter() - start)

    return asyncio.run(main())


def redis_blocking(port: int, window_s: float) -> float:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    release = r.register_script(RELEASE_SCRIPT)
    ttl_ms = TTL_S * 1000

    def cycle() -> int:
        value = uuid.uuid4().hex
        assert r.set("bench:blocking", value, nx=True, px=ttl_ms)
        release(keys=["bench:blocking"], args=[value])
        return 1

    timed(0.3, cycle)
    rate = timed(window_s, cycle)
    r.close()
    return rate


def redis_batched(port: int, window_s: float, batch: int) -> float:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    release = r.register_script(RELEASE_SCRIPT)
    release(keys=["bench:warm"], args=["x"])  # loads the script, so EVALSHA finds it
    keys = [f"bench:batch:{i}" for i in range(batch)]
    ttl_ms = TTL_S * 1000

    def cycle() -> int:
        values = [uuid.uuid4().hex for _ in keys]
        pipe = r.pipeline(transaction=False)
        for key, value in zip(keys, values):
            pipe.set(key, value, nx=True, px=ttl_ms)
        assert all(pipe.execute())
        pipe = r.pipeline(transaction=False)
        for key, value in zip(keys, values):
            release(keys=[key], args=[value], client=pipe)
        pipe.execute()
        return batch

    timed(0.3, cycle)
    rate = timed(window_s, cycle)
    r.close()
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenured", default=os.environ.get("TENURED_BIN", "target/release/tenured"))
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--batch", type=int, default=64, help="requests in flight when batched")
    parser.add_argument("--threads", default="1", help="tenured --threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    procs: List[subprocess.Popen] = []
    data_dir = tempfile.mkdtemp(prefix="tenure-bench-")
    try:
        t_port, r_port = free_port(), free_port()
        tenured = subprocess.Popen(
            [args.tenured, "--listen", f"127.0.0.1:{t_port}", "--data-dir", data_dir, "--durability", "tokens",
             "--no-fsync", "--threads", args.threads],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        procs.append(tenured)
        redis_proc = subprocess.Popen(
            [args.redis_server, "--port", str(r_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        procs.append(redis_proc)
        wait_listening(t_port, tenured)
        wait_listening(r_port, redis_proc)
        addr = f"127.0.0.1:{t_port}"
        figures: Dict[str, float] = {
            "tenure_blocking": tenure_blocking(addr, args.window),
            "redis_blocking": redis_blocking(r_port, args.window),
            "tenure_batched": tenure_batched(addr, args.window, args.batch),
            "redis_batched": redis_batched(r_port, args.window, args.batch),
        }
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)

    if args.json:
        print(json.dumps({k: round(v) for k, v in figures.items()}))
        return 0
    print(f"acquire/release cycles per second from Python {sys.version.split()[0]} (one connection each)")
    print(f"{'mode':<28}{'tenure':>10}{'redis':>10}{'ratio':>8}")
    for mode, label in (("blocking", "blocking, 1 in flight"), ("batched", f"batched, {args.batch} in flight")):
        t, r = figures[f"tenure_{mode}"], figures[f"redis_{mode}"]
        print(f"{label:<28}{t:>10.0f}{r:>10.0f}{t / r:>8.2f}")
    print("(cycles/s; one cycle = acquire + release, 2 round trips when blocking; ratio = tenure / redis)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
