"""Fencing at the protected resource: accept a write only if its fencing token is not older
than the newest one the resource has seen.

A lease can run out while its holder is paused (a GC pause, a swapped-out VM, a slow disk) and
the holder cannot notice until it wakes; meanwhile the server grants the lock again with a
larger token. Renewal and the guard's loss signal make this rare; only a check *at the
resource* makes it harmless::

    A: acquire -> token 33 ....... paused ....... write(33) --> rejected (33 < 34)
    B:                 acquire -> token 34, write(34) --> accepted, highest = 34

The check and the write must be one atomic step at the resource. `Fence` does that for
in-memory resources. For a SQL table keep the highest accepted token in a column and make the
comparison part of the write (`fenced_update` builds this statement)::

    UPDATE t SET data = ?, fence = ? WHERE id = ? AND fence <= ?
    -- no row changed: the token is stale; reject the write and tell the caller.

Equal tokens are accepted because one holder usually writes several times under one grant.
To order one holder's own writes too, fence on `(token, seq)` (`SequencedFence`)::

    UPDATE t SET data = ?, fence = ?, seq = ?
     WHERE id = ? AND (fence < ? OR (fence = ? AND seq < ?))

A fence orders the grants it has seen; it does not prove a lease is alive. Install a new
holder's token at the resource (its first write) before relying on it.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Dict, Mapping, Optional, Tuple

from .errors import TenureError

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Rejected(TenureError):
    """A write was refused: the resource has accepted a newer fencing token."""

    def __init__(self, highest: Optional[int], token: int) -> None:
        seen = "a newer token" if highest is None else f"token {highest}"
        super().__init__(f"stale fencing token {token}: the resource has accepted {seen}")
        #: The highest token the resource has accepted (None when the resource did not say).
        self.highest = highest
        self.token = token


class Fence:
    """The highest accepted fencing token per resource name, compared and recorded in one step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._highest: Dict[str, int] = {}

    def try_accept(self, resource: str, token: int) -> None:
        """Records `token` if it is at least the highest accepted; else raises `Rejected`.

        Do the write only after this returns, while still holding whatever serializes writes to
        the resource.
        """
        with self._lock:
            seen = self._highest.get(resource)
            if seen is not None and seen > token:
                raise Rejected(seen, token)
            self._highest[resource] = token

    def highest(self, resource: str) -> Optional[int]:
        with self._lock:
            return self._highest.get(resource)


class SequencedFence:
    """Like `Fence`, but orders a holder's own writes: accepts `(token, seq)` only if strictly
    greater than the newest accepted pair."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._highest: Dict[str, Tuple[int, int]] = {}

    def try_accept(self, resource: str, token: int, seq: int) -> None:
        with self._lock:
            seen = self._highest.get(resource)
            if seen is not None and seen >= (token, seq):
                raise Rejected(seen[0], token)
            self._highest[resource] = (token, seq)

    def highest(self, resource: str) -> Optional[Tuple[int, int]]:
        with self._lock:
            return self._highest.get(resource)


def _name(identifier: str) -> str:
    if not _IDENTIFIER.match(identifier):
        raise ValueError(f"{identifier!r} is not a plain SQL identifier")
    return identifier


def fenced_update_sql(table: str, key_columns: Tuple[str, ...], columns: Tuple[str, ...], fence_column: str = "fence") -> str:
    """The statement `fenced_update` runs (qmark parameters: values, token, keys, token)."""
    sets = ", ".join(f"{_name(c)} = ?" for c in columns + (fence_column,))
    where = " AND ".join(f"{_name(c)} = ?" for c in key_columns)
    return f"UPDATE {_name(table)} SET {sets} WHERE {where} AND {_name(fence_column)} <= ?"


def fenced_update(
    db: Any,
    table: str,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    token: int,
    *,
    fence_column: str = "fence",
) -> None:
    """Writes `values` to the row `key` of `table` only if `token` is not older than the row's
    fence, and stores `token` as the new fence, in one statement. Raises `Rejected` otherwise.

    `db` is any DB-API connection or cursor with the qmark parameter style (sqlite3). The row
    must exist (create it with fence 0): a missing row raises `LookupError`, not `Rejected`.
    The caller commits.
    """
    if not 0 <= token < 2**63:
        # SQL integers are signed 64-bit; tokens this large do not occur in practice.
        raise ValueError(f"token {token} does not fit a SQL integer column")
    key_columns, columns = tuple(key), tuple(values)
    sql = fenced_update_sql(table, key_columns, columns, fence_column)
    params = [*values.values(), token, *key.values(), token]
    cursor = db.execute(sql, params)
    if cursor is None:  # a DB-API cursor whose execute returns nothing (psycopg, ...)
        cursor = db
    if cursor.rowcount == 0:
        where = " AND ".join(f"{_name(c)} = ?" for c in key_columns)
        select = f"SELECT {_name(fence_column)} FROM {_name(table)} WHERE {where}"
        found = db.execute(select, list(key.values()))
        row = (found if found is not None else db).fetchone()
        if row is None:
            # Not a stale token: there is nothing to fence. Saying "stale" would send the
            # caller looking for a newer holder that does not exist.
            raise LookupError(f"no row {dict(key)!r} in {table}: create it with {fence_column} 0 first")
        raise Rejected(int(row[0]), token)
