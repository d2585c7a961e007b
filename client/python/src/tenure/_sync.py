"""A synchronous connection for the blocking client's fast path (plain TCP only).

A call from one thread at a time goes straight over this socket, in the calling thread: no
hand-off to the I/O thread and back, which costs more than the round trip itself on loopback.
Calls from several threads at once, guards, watches and TLS use the pipelined asyncio
connection instead.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Any, Optional, Tuple

from . import _wire as w
from .errors import ConnectionLost, HandshakeError, RequestTimeout, refusal_code, server_error


#: How long a timed-out ACQUIRE's answer is still waited for, to release a late grant.
ABANDONED_ACQUIRE_WAIT_S = 3600.0


class SyncConnection:
    """One handshaken socket; requests are sent and answered one at a time."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self._next_id = 1
        self._buffer = bytearray()

    @classmethod
    def open(cls, host: str, port: int, timeout: float, credentials: Optional[Tuple[bytes, bytes]]) -> "SyncConnection":
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = cls(sock, f"{host}:{port}")
            conn._handshake()
            if credentials is not None:
                opcode, reply = conn.call(w.AUTH, w.auth_body(*credentials), timeout)
                if opcode == w.ERROR:
                    raise server_error(*w.parse_error(reply))
            return conn
        except BaseException:
            sock.close()
            raise

    def _handshake(self) -> None:
        self.sock.sendall(w.HELLO)
        # The magic first: a refusal line may be shorter than the answer's header, and a
        # server that sent one and kept the connection open would hold us to the timeout.
        header = self._read_exact(len(w.MAGIC))
        if w.is_console_refusal(header):
            line = header + self._read_line()
            raise HandshakeError(f"{self.address}: {w.refusal_text(line)}", refusal_code(line))
        header += self._read_exact(w.HANDSHAKE_HEADER_LEN - len(w.MAGIC))
        try:
            version, status, body_len = w.parse_handshake_header(header)
            body = self._read_exact(body_len)
            if status != 0:
                reason = body.decode("utf-8", "replace")
                raise HandshakeError(f"{self.address} refused the handshake: {reason}", status)
            w.check_version(version)
            w.parse_limits(body)
        except w.ProtocolViolation as e:
            raise HandshakeError(f"{self.address}: {e}") from e

    def _read_line(self) -> bytes:
        """What is left of a line, up to its newline, the connection's end or
        REFUSAL_LINE_MAX bytes."""
        while b"\n" not in self._buffer and len(self._buffer) < w.REFUSAL_LINE_MAX:
            try:
                chunk = self.sock.recv(w.REFUSAL_LINE_MAX)
            except OSError:
                break  # the server closes after the line
            if not chunk:
                break
            self._buffer += chunk
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionLost(f"{self.address}: connection closed by the server")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def is_stale(self) -> bool:
        """True if the server closed the socket (or sent something unasked) since the last call."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable) or bool(self._buffer)

    def call(self, opcode: int, body: bytes, timeout: float) -> Tuple[int, bytes]:
        rid = self._next_id
        self._next_id += 1
        deadline = time.monotonic() + timeout
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(w.frame(opcode, rid, body))
            while True:
                self.sock.settimeout(max(0.001, deadline - time.monotonic()))
                length = int.from_bytes(self._read_exact(4), "big")
                if not w.FRAME_LEN_MIN <= length <= w.FRAME_LEN_MAX:
                    raise ConnectionLost(f"{self.address}: frame length {length} out of range")
                data = self._read_exact(length)
                if int.from_bytes(data[1:9], "big") == rid:
                    return data[0], data[9:]
                if data[0] == w.ERROR and data[1:9] == bytes(8):
                    raise ConnectionLost(f"{self.address}: {server_error(*w.parse_error(data[9:]))}")
                # Otherwise: the late answer of a request that timed out earlier; skipped.
        except socket.timeout:
            raise RequestTimeout(f"no answer within {timeout:.3f} s") from None
        except ConnectionLost:
            raise  # it names the address already (outside test a48, N13: it was named twice)
        except OSError as e:
            raise ConnectionLost(f"{self.address}: {e}") from e

    def abandon_acquire(self, body: bytes, owner: Any = None) -> None:
        """The last call, an ACQUIRE with `body`, timed out: a thread waits a while longer for
        its answer on this socket, releases it if it is a grant (a grant nobody knows of would
        keep the key for its whole TTL), and closes the socket."""
        rid = self._next_id - 1
        key = w.Reader(body).bytes16()
        threading.Thread(target=self._reap, args=(rid, key, owner), name="tenure-reap", daemon=True).start()

    def _reap(self, rid: int, key: bytes, owner: Any) -> None:
        deadline = time.monotonic() + ABANDONED_ACQUIRE_WAIT_S
        try:
            while time.monotonic() < deadline:
                self.sock.settimeout(max(0.001, deadline - time.monotonic()))
                length = int.from_bytes(self._read_exact(4), "big")
                if not w.FRAME_LEN_MIN <= length <= w.FRAME_LEN_MAX:
                    return
                data = self._read_exact(length)
                if int.from_bytes(data[1:9], "big") != rid:
                    continue
                lease_id = data[9 + 8 : 9 + 24]
                if data[0] == w.GRANTED and (owner is None or owner.late_grant(key, lease_id)):
                    self.call(w.RELEASE, w.release_body(key, data[9 + 8 : 9 + 24]), ABANDONED_ACQUIRE_WAIT_S)
                return
        except (OSError, RequestTimeout, ConnectionLost):
            return
        finally:
            self.sock.close()

    def close(self) -> None:
        self.sock.close()
