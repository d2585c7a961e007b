"""Fence helpers, and the sqlite3 example replaying the 33/34 story against a real server."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tenure.fence import Fence, Rejected, SequencedFence, fenced_update, fenced_update_sql

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fencing_sqlite.py"


def test_fencing_example_replays_33_34(server):
    out = subprocess.run([sys.executable, str(EXAMPLE), server.addr], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "A: acquired order:1842 with token 33" in out.stdout
    assert "B: acquired order:1842 with token 34" in out.stdout
    assert "A: rejected (33 < 34)" in out.stdout
    assert "row 1842: status='shipped by B' fence=34" in out.stdout


def test_fence_accepts_equal_and_newer_tokens_only():
    fence = Fence()
    fence.try_accept("r", 33)
    fence.try_accept("r", 33)  # the same holder writes again
    fence.try_accept("r", 34)
    with pytest.raises(Rejected) as e:
        fence.try_accept("r", 33)
    assert e.value.highest == 34 and fence.highest("r") == 34
    fence.try_accept("other", 1)


def test_sequenced_fence_orders_one_holders_writes():
    fence = SequencedFence()
    fence.try_accept("r", 33, 1)
    fence.try_accept("r", 33, 2)
    with pytest.raises(Rejected):
        fence.try_accept("r", 33, 2)  # replayed
    fence.try_accept("r", 34, 0)
    with pytest.raises(Rejected):
        fence.try_accept("r", 33, 9)
    assert fence.highest("r") == (34, 0)


def test_fenced_update_is_one_statement():
    assert fenced_update_sql("t", ("id",), ("data",)) == "UPDATE t SET data = ?, fence = ? WHERE id = ? AND fence <= ?"
    with pytest.raises(ValueError):
        fenced_update_sql("t; DROP TABLE t", ("id",), ("data",))
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, data TEXT, fence INTEGER NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO t (id) VALUES (1)")
    fenced_update(db, "t", {"id": 1}, {"data": "x"}, 5)
    with pytest.raises(Rejected) as e:
        fenced_update(db, "t", {"id": 1}, {"data": "y"}, 4)
    assert e.value.highest == 5
    assert db.execute("SELECT data, fence FROM t").fetchone() == ("x", 5)


def test_fenced_update_of_a_missing_row_is_not_called_stale():
    import sqlite3

    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, data TEXT, fence INTEGER NOT NULL)")
    with pytest.raises(LookupError):
        fenced_update(db, "t", {"id": 1}, {"data": "x"}, 5)
    with pytest.raises(ValueError):
        fenced_update(db, "t", {"id": 1}, {"data": "x"}, 2**63)
