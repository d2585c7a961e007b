"""The 33/34 story, with sqlite3 as the protected resource.

Worker A takes the lock (token 33) and pauses longer than its lease (a GC pause, a swapped-out
VM). The lease runs out, worker B takes the lock (token 34) and writes. When A wakes it still
believes it holds the lock and writes too: the fenced UPDATE refuses it, because the row has
seen token 34 and 33 is older.

    python examples/fencing_sqlite.py [127.0.0.1:7878]

On a fresh server the example first takes and frees a few grants so the tokens read 33 and
34 as in the story; on a used server they are just larger.
"""

from __future__ import annotations

import sqlite3
import sys
import time

import tenure
from tenure.fence import Rejected, fenced_update

KEY = "order:1842"
TTL_S = 0.5
STORY_TOKEN = 33


def warm_up(client: tenure.Client) -> None:
    """Takes grants until the next token is 33 (only on a fresh server)."""
    for _ in range(STORY_TOKEN):
        if client.stats().get("token_next", STORY_TOKEN) >= STORY_TOKEN:
            return
        lease = client.acquire("example/warm-up", 1)
        if isinstance(lease, tenure.Granted):
            client.release(lease)


def main(addr: str) -> int:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT, fence INTEGER NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO orders (id, status) VALUES (1842, 'new')")
    db.commit()

    with tenure.Client(addr) as client:
        warm_up(client)
        a = client.acquire(KEY, TTL_S)
        assert isinstance(a, tenure.Granted), a
        print(f"A: acquired {KEY} with token {a.token}; now paused for {2 * TTL_S:.1f} s")
        time.sleep(2 * TTL_S)  # A's pause: no renewal, the lease runs out

        b = client.acquire(KEY, 30, wait=5)
        assert isinstance(b, tenure.Granted), b
        print(f"B: acquired {KEY} with token {b.token}")
        fenced_update(db, "orders", {"id": 1842}, {"status": "shipped by B"}, b.token)
        db.commit()
        print(f"B: wrote 'shipped by B' with token {b.token}: accepted")

        print(f"A: wakes up and writes 'refunded by A' with token {a.token}")
        try:
            fenced_update(db, "orders", {"id": 1842}, {"status": "refunded by A"}, a.token)
            db.commit()
            print("A: accepted -- the fence did not work")
            return 1
        except Rejected as e:
            db.rollback()
            print(f"A: rejected ({a.token} < {e.highest}): {e}")
        client.release(b)

    status, fence = db.execute("SELECT status, fence FROM orders WHERE id = 1842").fetchone()
    print(f"row 1842: status={status!r} fence={fence}")
    return 0 if (status, fence) == ("shipped by B", b.token) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7878"))
