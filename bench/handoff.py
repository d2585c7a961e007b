#!/usr/bin/env python3
"""Hand-off latency with N blocking waiters (issue 26): a key is held, N waiters queue on it
(4 binary connections, N/4 pipelined blocking ACQUIREs each), then the holder releases and
the times from that RELEASE to the waiters' GRANTED frames are taken. One fresh tenured
serves every run; the kinds alternate round by round, so they share the machine's drift.

    bench/handoff.py target/release/tenured [N=1000] [ROUNDS=5]

Runs, each on its own key:
  plain    a plain lock; each waiter releases the moment it is granted, so the N grants are a
           chain of N hand-offs (release sent -> next GRANTED received, median and p99)
  permits1 the same chain on a semaphore of 1 permit (PERMITS=1/1)
  permitsN a semaphore of N permits, all held by one lease (N/N); its release grants every
           waiter (1/N each) at once: release -> first and -> last GRANTED
  shared   a read/write key held by a writer (a plain ACQUIRE), N read waiters; the writer's
           release grants them all at once
A fifth figure, release -> first GRANTED, is taken in every run.

tenured listens on 127.0.0.1:17934 only (--durability tokens --no-fsync --threads 1) and is
stopped by its PID at the end. Standard library only; every wait is bounded.
"""
import os
import selectors
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

PORT = 17934
CONNECTIONS = 4
TIMEOUT_S = 60
TTL_MS = 600_000
WAIT_MS = 600_000
GRANTED, RELEASED, ERROR = 0x82, 0x86, 0xFF


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RuntimeError("connection closed")
        buf += chunk
    return buf


def handshake(addr):
    """PROTOCOL.md section 2: the hello, then a 10-byte answer header and its body."""
    sock = socket.create_connection(addr)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(bytes([0x00, 0x54, 0x4E, 0x52, 0x00, 0x01, 0x00, 0x00]))
    header = recv_exact(sock, 10)
    _version, status, body_len = struct.unpack(">HHH", header[4:10])
    body = recv_exact(sock, body_len)
    if status != 0:
        raise RuntimeError(f"handshake refused: {body.decode(errors='replace')}")
    return sock


def acquire_frame(request_id, key, wait_ms, kind=None):
    """An ACQUIRE (PROTOCOL.md 3.1); kind None (plain), "shared" or (count, limit)."""
    body = struct.pack(">H", len(key)) + key + struct.pack(">II", TTL_MS, wait_ms)
    if kind is None:
        body += b"\x00\x00\x00"
    elif kind == "shared":
        body += b"\x08\x00\x00\x01"
    else:
        body += b"\x08\x00\x00\x02" + struct.pack(">II", *kind)
    return struct.pack(">IBQ", 9 + len(body), 0x02, request_id) + body


def release_frame(request_id, key, lease_id):
    body = struct.pack(">H", len(key)) + key + lease_id
    return struct.pack(">IBQ", 9 + len(body), 0x04, request_id) + body


def read_frame(sock):
    length, opcode, request_id = struct.unpack(">IBQ", recv_exact(sock, 13))
    return opcode, request_id, recv_exact(sock, length - 9)


def waiters(addr):
    with socket.create_connection(addr) as sock:
        sock.sendall(b"STATS\n")
        buf = b""
        while not buf.endswith(b"\n"):
            buf += sock.recv(65536)
    return int(buf.decode().split("waiters=")[1].split()[0])


class Frames:
    """Frames from a non-blocking socket, parsed as they arrive."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def read(self):
        self.buf += self.sock.recv(1 << 20)
        out = []
        while len(self.buf) >= 13:
            length, opcode, request_id = struct.unpack(">IBQ", self.buf[:13])
            if len(self.buf) < 4 + length:
                break
            out.append((opcode, request_id, self.buf[13 : 4 + length]))
            self.buf = self.buf[4 + length :]
        return out


def run(addr, n, key, holder_kind, waiter_kind, chain):
    """One run; returns (release->first grant, release->last grant, hop latencies), in s."""
    holder = handshake(addr)
    holder.sendall(acquire_frame(1, key, 0, holder_kind))
    opcode, _, body = read_frame(holder)
    assert opcode == GRANTED, (opcode, body)
    lease = body[8:24]
    conns = [handshake(addr) for _ in range(CONNECTIONS)]
    for c, sock in enumerate(conns):
        per = n // CONNECTIONS
        frames = b"".join(
            acquire_frame(1 + c * per + i, key, WAIT_MS, waiter_kind) for i in range(per)
        )
        sock.sendall(frames)
    total = n // CONNECTIONS * CONNECTIONS
    deadline = time.time() + TIMEOUT_S
    while waiters(addr) < total:
        assert time.time() < deadline, "the waiters never all queued"
        time.sleep(0.02)
    sel = selectors.DefaultSelector()
    for sock in conns:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, Frames(sock))
    grants, hops, next_id = [], [], 1 << 40
    t0 = time.perf_counter()
    holder.sendall(release_frame(2, key, lease))
    last_release = t0
    deadline = time.time() + TIMEOUT_S
    while len(grants) < total:
        assert time.time() < deadline, f"only {len(grants)} of {total} waiters were granted"
        for sel_key, _ in sel.select(timeout=1):
            for opcode, _rid, body in sel_key.data.read():
                if opcode == ERROR:
                    raise RuntimeError(f"ERROR {body!r}")
                if opcode != GRANTED:
                    continue
                now = time.perf_counter()
                grants.append(now - t0)
                if chain:
                    hops.append(now - last_release)
                    next_id += 1
                    sel_key.fileobj.sendall(release_frame(next_id, key, body[8:24]))
                    last_release = time.perf_counter()
    for sock in conns + [holder]:
        sock.close()
    sel.close()
    return grants[0], grants[-1], hops


def main():
    tenured = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    addr = ("127.0.0.1", PORT)
    data = tempfile.mkdtemp()
    args = [tenured, "--listen", f"127.0.0.1:{PORT}", "--data-dir", data,
            "--durability", "tokens", "--no-fsync", "--threads", "1",
            "--waiters-per-key-max", str(max(n, 10_000))]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(addr).close()
                break
            except OSError:
                time.sleep(0.1)
        runs = {
            "plain": (None, None, True),
            "permits1": ((1, 1), (1, 1), True),
            "permitsN": ((n, n), (1, n), False),
            "shared": (None, "shared", False),
        }
        got = {name: [] for name in runs}
        for r in range(rounds):
            names = list(runs)
            names = names[r % len(names):] + names[: r % len(names)]
            for name in names:
                key = f"handoff:{name}:{r}".encode()
                got[name].append(run(addr, n, key, *runs[name]))
        print(f"{n} waiters, {rounds} rounds; medians over rounds (ms):")
        for name, results in got.items():
            first = statistics.median(x[0] for x in results) * 1e3
            last = statistics.median(x[1] for x in results) * 1e3
            line = f"  {name:9} release->first grant {first:7.3f}  ->last grant {last:8.2f}"
            if results[0][2]:
                hops = [statistics.median(x[2]) * 1e6 for x in results]
                p99 = [sorted(x[2])[int(len(x[2]) * 0.99)] * 1e6 for x in results]
                line += (f"  hop median {statistics.median(hops):6.1f} us"
                         f"  hop p99 {statistics.median(p99):7.1f} us")
            print(line)
        print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
