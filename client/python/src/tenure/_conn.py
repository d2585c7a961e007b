"""One connection: handshake, then pipelined requests matched to replies by request id."""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_module
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

from . import _wire as w
from .errors import CannotConnect, ConnectionLost, HandshakeError, ServerError, server_error, WatchLimit
from .errors import refusal_code
from .results import Event, EventKind

#: Bytes queued in the transport before a writer waits for the socket to drain.
WRITE_BUFFER_HIGH = 256 * 1024
#: Most events a watch queues for a consumer that does not read; past it the watch ends
#: with an error rather than let memory grow.
WATCH_EVENTS_MAX = 1024


class WatchQueue:
    """Events of one watch, waiting for their consumer. Ends with an error or a close."""

    def __init__(self, key: bytes = b"") -> None:
        self.key = key
        self.events: Deque[Event] = collections.deque()
        self.error: Optional[BaseException] = None
        self.ended = False
        self._waiter: Optional[asyncio.Future] = None

    def push(self, event: Event) -> bool:
        """Queues `event`; False (and the watch ends) when the consumer fell too far behind."""
        if len(self.events) >= WATCH_EVENTS_MAX:
            self.end(WatchLimit(15, f"more than {WATCH_EVENTS_MAX} events not read"))
            return False
        self.events.append(event)
        self._wake()
        return True

    def end(self, error: Optional[BaseException]) -> None:
        if not self.ended:
            self.ended = True
            self.error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Returns once an event is queued or the watch ended."""
        while not self.events and not self.ended:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter


Reply = Tuple[int, bytes]
#: Bytes asked of the socket per read; many replies arrive in one.
READ_CHUNK = 64 * 1024


def _answered(reply: "asyncio.Future") -> bool:
    """Whether `reply` holds the server's answer (not a time-out, a cancellation, or a
    connection failure)."""
    return reply.done() and not reply.cancelled() and reply.exception() is None


def _expire(reply: asyncio.Future) -> None:
    if not reply.done():
        reply.set_exception(asyncio.TimeoutError())


class Connection:
    """An open, handshaken connection. Every reply is matched to its request by request id."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        limits: w.ServerLimits,
        address: str,
        in_flight_max: int,
    ) -> None:
        self.address = address
        self.limits = limits
        self._reader = reader
        self._writer = writer
        self._pending: Dict[int, asyncio.Future] = {}
        self._watches: Dict[int, WatchQueue] = {}
        #: ACQUIREs whose caller stopped waiting (time-out, cancellation), by request id, with
        #: their keys: a grant that still comes is released, not left held by no one.
        #: Requests nobody waits for any more: an ACQUIRE's key and the retry state of its
        #: acquire id (None without one), or b"" for a RELEASE of a late grant.
        self._abandoned: Dict[int, Tuple[bytes, Any]] = {}
        self._next_id = 1
        self._slots = asyncio.Semaphore(max(1, min(in_flight_max, limits.in_flight_max)))
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._out: List[bytes] = []
        #: Resolves (to the error) when the connection is closed; never raises.
        self.closed: asyncio.Future = loop.create_future()
        self.error: Optional[ConnectionLost] = None
        self._read_task = loop.create_task(self._read_loop())

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        ssl: Optional[ssl_module.SSLContext],
        server_hostname: Optional[str],
        in_flight_max: int,
    ) -> "Connection":
        """Connects, speaks the handshake and returns the open connection."""
        address = f"{host}:{port}"
        try:
            reader, writer = await asyncio.open_connection(
                host,
                port,
                ssl=ssl,
                server_hostname=(server_hostname or host) if ssl is not None else None,
                limit=w.FRAME_LEN_MAX * 4,
            )
        except ssl_module.SSLError as e:
            raise CannotConnect(f"TLS handshake with {address} failed: {e}") from e
        except OSError as e:
            raise CannotConnect(f"cannot connect to {address}: {e}") from e
        try:
            limits = await _handshake(reader, writer, address)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, limits, address, in_flight_max)

    def is_closed(self) -> bool:
        return self.error is not None

    def _new_id(self) -> int:
        while True:
            rid = self._next_id
            self._next_id = self._next_id + 1 if self._next_id < 2**64 - 1 else 1
            if rid not in self._pending and rid not in self._watches and rid not in self._abandoned:
                return rid

    async def call(
        self,
        opcode: int,
        body: bytes,
        timeout: Optional[float],
        watch: Optional[WatchQueue] = None,
        owner: Any = None,
    ) -> Reply:
        """Sends one request and waits for its reply: (opcode, body). ERROR is a reply too.

        `owner` is an ACQUIRE's retry state (`aio._AcquireRetry`): a late grant of a send its
        caller stopped waiting for is handed to it rather than released while it retries."""
        if self.error is not None:
            raise self.error
        async with self._slots:
            if self.error is not None:
                raise self.error
            rid = self._new_id()
            reply: asyncio.Future = asyncio.get_running_loop().create_future()
            self._pending[rid] = reply
            if watch is not None:
                self._watches[rid] = watch
            expiry = None
            try:
                self._send(w.frame(opcode, rid, body))
                if self._writer.transport.get_write_buffer_size() > WRITE_BUFFER_HIGH:
                    await self._writer.drain()
                if timeout is not None:
                    expiry = self._loop.call_later(timeout, _expire, reply)
                result = await reply
            except BaseException:
                if watch is not None:
                    self._watches.pop(rid, None)
                if opcode == w.ACQUIRE and not _answered(reply) and self.error is None:
                    self._abandoned[rid] = (w.Reader(body).bytes16(), owner)
                raise
            finally:
                self._pending.pop(rid, None)
                if expiry is not None:
                    expiry.cancel()
            if watch is not None and result[0] != w.WATCHING:
                self._watches.pop(rid, None)
            return result

    def _send(self, frame: bytes) -> None:
        """Queues a frame; the frames queued in one turn of the loop go out in one write."""
        self._out.append(frame)
        if len(self._out) == 1:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self.error is None:
            self._writer.write(b"".join(out))

    def watch_id(self, watch: WatchQueue) -> Optional[int]:
        for rid, queue in self._watches.items():
            if queue is watch:
                return rid
        return None

    def watching(self, key: bytes, watch: WatchQueue) -> None:
        """After a WATCHING reply: a connection has one watch per key (PROTOCOL.md 3.4), so a
        new WATCH of a key replaces the old one, which gets no further frame: it ends here."""
        for rid, queue in list(self._watches.items()):
            if queue is not watch and queue.key == key:
                self.forget_watch(rid)

    def forget_watch(self, rid: int) -> None:
        queue = self._watches.pop(rid, None)
        if queue is not None:
            queue.end(None)

    async def _read_loop(self) -> None:
        error: Union[str, BaseException] = "connection closed by the server"
        buffer = bytearray()
        try:
            while True:
                chunk = await self._reader.read(READ_CHUNK)
                if not chunk:
                    break
                buffer += chunk
                broken = self._dispatch_frames(buffer)
                if broken:
                    error = broken
                    break
        except asyncio.CancelledError:
            error = "connection closed by the client"
        except (OSError, w.ProtocolViolation) as e:
            error = e
        self._fail(error)

    def _dispatch_frames(self, buffer: bytearray) -> Optional[str]:
        """Dispatches every whole frame in `buffer` and removes it; an error for a bad length."""
        pos = 0
        end = len(buffer)
        while end - pos >= 4:
            length = int.from_bytes(buffer[pos : pos + 4], "big")
            if not w.FRAME_LEN_MIN <= length <= w.FRAME_LEN_MAX:
                return f"frame length {length} out of range"
            if end - pos - 4 < length:
                break
            start = pos + 4
            opcode = buffer[start]
            rid = int.from_bytes(buffer[start + 1 : start + 9], "big")
            self._dispatch(opcode, rid, bytes(buffer[start + 9 : start + length]))
            pos = start + length
        del buffer[:pos]
        return None

    def _dispatch(self, opcode: int, rid: int, body: bytes) -> None:
        if opcode == w.EVENT:
            self._event(rid, body)
            return
        reply = self._pending.get(rid)
        if reply is not None:
            if not reply.done():
                reply.set_result((opcode, body))
            return
        abandoned = self._abandoned.pop(rid, None)
        if abandoned is not None:
            key, owner = abandoned
            if key and opcode in (w.GRANTED, w.REGRANTED):
                lease_id = body[8:24]
                if owner is not None and not owner.late_grant(key, lease_id):
                    return  # its caller still retries (or kept it): a repeat will find it
                # Nobody waits for this grant any more: give it back (its answer is dropped).
                release_id = self._new_id()
                self._abandoned[release_id] = (b"", None)
                self._send(w.frame(w.RELEASE, release_id, w.release_body(key, lease_id)))
            return
        watch = self._watches.pop(rid, None)
        if watch is not None and opcode == w.ERROR:
            # A running watch ended by the server (WATCH_LIMIT, UNAUTHENTICATED, FORBIDDEN).
            watch.end(server_error(*w.parse_error(body)))
        elif rid == 0 and opcode == w.ERROR:
            code, message = w.parse_error(body)
            self._fail(ConnectionLost(f"server closes the connection: {server_error(code, message)}"))
        # Anything else answers a request that timed out: dropped.

    def _event(self, rid: int, body: bytes) -> None:
        watch = self._watches.get(rid)
        if watch is None:
            return
        r = w.Reader(body)
        kind = r.u8()
        key = r.bytes16()
        token = r.u64()
        meta = r.bytes16()
        try:
            event_kind = EventKind(kind)
        except ValueError:
            return  # a kind a later server added: not ours to interpret
        if not watch.push(Event(event_kind, key, token, meta)):
            self._watches.pop(rid, None)

    def _fail(self, error: Union[str, BaseException]) -> None:
        if self.error is not None:
            return
        if not isinstance(error, ConnectionLost):
            error = ConnectionLost(f"{self.address}: {error}")
        self.error = error
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(error)
        for watch in self._watches.values():
            watch.end(error)
        self._watches.clear()
        if not self.closed.done():
            self.closed.set_result(error)
        self._writer.close()

    def close(self, why: str = "closed by the client") -> None:
        """Closes the connection; requests in flight fail with ConnectionLost."""
        self._fail(ConnectionLost(f"{self.address}: {why}"))
        self._read_task.cancel()


async def _rest_of_line(reader: asyncio.StreamReader) -> bytes:
    """What is left of a line, up to its newline, the connection's end or REFUSAL_LINE_MAX
    bytes."""
    data = b""
    while b"\n" not in data and len(data) < w.REFUSAL_LINE_MAX:
        try:
            chunk = await reader.read(w.REFUSAL_LINE_MAX - len(data))
        except OSError:
            break  # the server closes after the line
        if not chunk:
            break
        data += chunk
    return data


async def _handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str
) -> w.ServerLimits:
    writer.write(w.HELLO)
    try:
        # The magic first: a refusal line may be shorter than the answer's header, and a
        # server that sent one and kept the connection open would hold us to the timeout.
        header = await reader.readexactly(len(w.MAGIC))
        refusal = w.is_console_refusal(header)
        if refusal:
            header += await _rest_of_line(reader)
        else:
            header += await reader.readexactly(w.HANDSHAKE_HEADER_LEN - len(w.MAGIC))
    except asyncio.IncompleteReadError as e:
        partial = e.partial.decode("utf-8", "replace")
        raise HandshakeError(f"{address} closed during the handshake: {partial!r}") from e
    except OSError as e:
        raise HandshakeError(f"{address}: handshake failed: {e}") from e
    if refusal:
        raise HandshakeError(f"{address}: {w.refusal_text(header)}", refusal_code(header))
    try:
        version, status, body_len = w.parse_handshake_header(header)
        body = await reader.readexactly(body_len)
        if status != 0:
            reason = body.decode("utf-8", "replace")
            error = server_error(status, reason)
            raise HandshakeError(f"{address} refused the handshake: {error}", status)
        w.check_version(version)
        return w.parse_limits(body)
    except w.ProtocolViolation as e:
        raise HandshakeError(f"{address}: {e}") from e
    except asyncio.IncompleteReadError as e:
        raise HandshakeError(f"{address} closed during the handshake") from e


__all__ = ["Connection", "WatchQueue", "ServerError"]
