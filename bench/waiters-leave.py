#!/usr/bin/env python3
"""Waiters that leave together (issue 8, item 7): 4 binary connections queue N/4 blocking
acquires each on one held key, then close together; prints how long a STATS from a fresh
connection took, and how long until STATS shows no waiters.

    tenured --listen 127.0.0.1:PORT --durability tokens --no-fsync \\
        --waiters-per-key-max 200000 --waiters-max 12800000 --in-flight-max 100000 &
    bench/waiters-leave.py PORT 100000

Standard library only; talks to 127.0.0.1 only; every wait is bounded.
"""
import socket
import struct
import sys
import time

CONNECTIONS = 4
FILL_TIMEOUT_S = 120
DRAIN_TIMEOUT_S = 600


def console(addr, cmd, sock=None):
    """One console command and its reply line, on `sock` or a new connection."""
    sock = sock or socket.create_connection(addr)
    sock.sendall(cmd.encode() + b"\n")
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError(f"closed while waiting for the reply to {cmd}")
        buf += chunk
    return sock, buf.decode()


def waiters(addr):
    return int(console(addr, "STATS")[1].split("waiters=")[1].split()[0])


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RuntimeError("closed during the handshake")
        buf += chunk
    return buf


def handshake(addr):
    """PROTOCOL.md section 2: the hello, then a 10-byte answer header and its body."""
    sock = socket.create_connection(addr)
    sock.sendall(bytes([0x00, 0x54, 0x4E, 0x52, 0x00, 0x01, 0x00, 0x00]))
    header = recv_exact(sock, 10)
    _version, status, body_len = struct.unpack(">HHH", header[4:10])
    body = recv_exact(sock, body_len)
    if status != 0:
        raise RuntimeError(f"handshake refused: {body.decode(errors='replace')}")
    return sock


def acquire_frame(request_id, key, ttl_ms, wait_ms):
    """An ACQUIRE frame (PROTOCOL.md 3.1); request ids start at 1 (0 is reserved)."""
    body = struct.pack(">H", len(key)) + key + struct.pack(">IIBH", ttl_ms, wait_ms, 0, 0)
    return struct.pack(">IBQ", 9 + len(body), 0x02, request_id) + body


def main():
    addr = ("127.0.0.1", int(sys.argv[1]))
    n = int(sys.argv[2])
    _holder, line = console(addr, "ACQUIRE hot 3600000")
    assert line.startswith("OK"), line
    conns = []
    for _ in range(CONNECTIONS):
        sock = handshake(addr)
        frames = b"".join(
            acquire_frame(i + 1, b"hot", 3_600_000, 3_600_000) for i in range(n // CONNECTIONS)
        )
        sock.sendall(frames)
        conns.append(sock)
    deadline = time.time() + FILL_TIMEOUT_S
    while waiters(addr) < n // CONNECTIONS * CONNECTIONS:
        assert time.time() < deadline, "the waiters never all queued"
        time.sleep(0.05)
    for sock in conns:
        sock.close()
    t0 = time.perf_counter()
    console(addr, "STATS")
    t1 = time.perf_counter()
    deadline = time.time() + DRAIN_TIMEOUT_S
    while waiters(addr) > 0:
        assert time.time() < deadline, "the waiters never left"
        time.sleep(0.001)
    t2 = time.perf_counter()
    print(
        f"waiters={n}: STATS after close {1000 * (t1 - t0):.1f} ms, "
        f"all waiters gone after {1000 * (t2 - t0):.1f} ms"
    )


if __name__ == "__main__":
    main()
