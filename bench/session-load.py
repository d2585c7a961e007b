#!/usr/bin/env python3
"""Session load for bench/session-lock.sh: SESSIONS sessions of LEASES session leases each,
every session kept alive once per TTL/3 (spread evenly over that period), for DURATION
seconds, over the console on 127.0.0.1.

    bench/session-load.py PORT [--sessions 500] [--leases 100] [--ttl-ms 3000]
                          [--duration 10] [--probe]

Prints one JSON line: keep-alives sent, their latencies (ms: p50, p99, max, from just before
the send to the reply), and any that were not OK (a lost session would void the run). With
--probe it first measures, on a server otherwise idle, the median round trip of a keep-alive
of one session of LEASES leases and of a PING, one at a time: their difference is about the
time a keep-alive holds the session table's lock (the renewals, done under it).

Sessions are opened over several connections (64 per connection at most, the server's
SESSIONS_PER_CONNECTION_MAX), each driven by a thread that sends its sessions' keep-alives
one at a time when due.
"""

import argparse
import json
import socket
import statistics
import threading
import time

PER_CONNECTION = 50


class Conn:
    """One console connection, line by line."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    def send_lines(self, lines):
        self.sock.sendall("".join(line + "\n" for line in lines).encode())

    def line(self):
        return self.file.readline().decode().rstrip("\r\n")

    def cmd(self, line):
        self.send_lines([line])
        return self.line()


def open_sessions(conn, count, leases, ttl_ms, prefix):
    """Opens `count` sessions on `conn`, each with `leases` session leases; their ids."""
    conn.send_lines([f"SESSION_OPEN {ttl_ms}"] * count)
    ids = []
    for _ in range(count):
        reply = conn.line()
        assert reply.startswith("OK session="), reply
        ids.append(reply.split()[1].split("=")[1])
    for s, sid in enumerate(ids):
        conn.send_lines(
            [f"ACQUIRE {prefix}-{s}-{j} 0 SESSION={sid}" for j in range(leases)]
        )
        for _ in range(leases):
            reply = conn.line()
            assert reply.startswith("OK token="), reply
    return ids


def keep_alive(conn, ids, period_s, offset_s, until, out):
    """Keeps `ids` alive, each once per `period_s`, spread evenly, until `until`."""
    step = period_s / len(ids)
    due = time.monotonic() + offset_s
    i = 0
    while True:
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        if time.monotonic() >= until:
            return
        sent = time.monotonic()
        reply = conn.cmd(f"SESSION_KEEPALIVE {ids[i % len(ids)]}")
        out["latencies"].append((time.monotonic() - sent) * 1000)
        if not reply.startswith("OK session="):
            out["failed"].append(reply)
        i += 1
        due += step


def probe(port, leases, ttl_ms):
    """Median round trips (ms) of a keep-alive of `leases` leases and of a PING."""
    conn = Conn(port)
    (sid,) = open_sessions(conn, 1, leases, ttl_ms, "probe")
    rtts = {"keepalive": [], "ping": []}
    for _ in range(200):
        for what, line in (("keepalive", f"SESSION_KEEPALIVE {sid}"), ("ping", "PING")):
            sent = time.perf_counter()
            reply = conn.cmd(line)
            rtts[what].append((time.perf_counter() - sent) * 1000)
            assert not reply.startswith("ERR"), reply
    conn.cmd(f"SESSION_CLOSE {sid}")
    return {k: statistics.median(v) for k, v in rtts.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--leases", type=int, default=100)
    parser.add_argument("--ttl-ms", type=int, default=3000)
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--probe", action="store_true")
    args = parser.parse_args()
    report = {}
    if args.probe:
        report["probe_ms"] = probe(args.port, args.leases, args.ttl_ms)
    conns, groups = [], []
    for c in range(0, args.sessions, PER_CONNECTION):
        conn = Conn(args.port)
        count = min(PER_CONNECTION, args.sessions - c)
        groups.append(open_sessions(conn, count, args.leases, args.ttl_ms, f"s{c}"))
        conns.append(conn)
    print("ready", flush=True)
    period_s = args.ttl_ms / 3000
    until = time.monotonic() + args.duration
    out = {"latencies": [], "failed": []}
    threads = [
        threading.Thread(
            target=keep_alive,
            args=(conn, ids, period_s, period_s * g / len(conns), until, out),
        )
        for g, (conn, ids) in enumerate(zip(conns, groups))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = sorted(out["latencies"])
    report.update(
        keepalives=len(lat),
        keepalives_per_s=round(len(lat) / args.duration, 1),
        latency_ms_p50=round(lat[len(lat) // 2], 3),
        latency_ms_p99=round(lat[int(len(lat) * 0.99)], 3),
        latency_ms_max=round(lat[-1], 3),
        failed=out["failed"][:5],
    )
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
