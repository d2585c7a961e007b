#!/usr/bin/env python3
# Usage: bench/expiry-lateness.py PORT N TTL_MS   (against a running tenured on 127.0.0.1:PORT)
# Expiry lateness: grant N leases of TTL ms on one connection while a second connection
# WATCHes them; a reader thread timestamps each EXPIRED event as it arrives. The deadline is
# counted from just after the grant's reply, so the lateness shown is an upper bound.
import socket, sys, threading, time
port, n, ttl = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
w = socket.create_connection(("127.0.0.1", port)); wf = w.makefile("rb")
c = socket.create_connection(("127.0.0.1", port)); cf = c.makefile("rb")
for i in range(n):
    w.sendall(f"WATCH exp:{i}\n".encode()); assert wf.readline().startswith(b"OK")
arrived = {}
def reader():
    while len(arrived) < n:
        words = wf.readline().decode().split()
        if words[1] == "EXPIRED":
            arrived[int(words[2].split(":")[1])] = time.monotonic()
t = threading.Thread(target=reader); t.start()
deadline = {}
for i in range(n):
    c.sendall(f"ACQUIRE exp:{i} {ttl}\n".encode()); line = cf.readline()
    assert line.startswith(b"OK"), line
    deadline[i] = time.monotonic() + ttl / 1000
    time.sleep(0.002)
t.join(timeout=ttl / 1000 + 30)
late = sorted((arrived[i] - deadline[i]) * 1000 for i in range(n))
print(f"expired {n} leases of {ttl} ms: lateness p50 {late[n//2]:.2f} ms, p99 {late[int(n*.99)]:.2f} ms, max {late[-1]:.2f} ms")
