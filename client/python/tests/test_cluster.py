"""Several addresses and NOT_LEADER: a follower executes nothing, so the client sends the
request again to the leader it names; `leader=unknown` moves on to the next address."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import time
from typing import Iterator, List, Optional

import pytest

import tenure
from tenure import Granted, Held


class FakeFollower:
    """Speaks the handshake, then answers every request with ERROR NOT_LEADER."""

    def __init__(self, leader: Optional[str], delay: float = 0.0, messages=None) -> None:
        self.leader = leader
        self.delay = delay  # seconds before each answer
        self.messages = messages  # the nth request's NOT_LEADER message, if given
        self.requests: List[int] = []
        self.addr = ""

    async def start(self) -> "FakeFollower":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.addr = "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(8)
            limits = struct.pack(">6I", 8192, 4096, 3_600_000, 3_600_000, 1024, 1024)
            writer.write(b"\x00TNR" + struct.pack(">HHH", 1, 0, len(limits)) + limits)
            while True:
                length = int.from_bytes(await reader.readexactly(4), "big")
                data = await reader.readexactly(length)
                self.requests.append(data[0])
                await asyncio.sleep(self.delay)
                text = f"leader={self.leader or 'unknown'}"
                if self.messages is not None:
                    text = self.messages(len(self.requests))
                message = text.encode()
                body = struct.pack(">HH", 23, len(message)) + message
                writer.write(struct.pack(">IBQ", 9 + len(body), 0xFF, int.from_bytes(data[1:9], "big")) + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def unknown_then_refused(n: int) -> str:
    """A leader that lost its place mid-request: its first answer says the outcome is
    unknown, every later one that it does not serve."""
    if n == 1:
        return "the outcome is unknown: this node stopped leading; leader=unknown"
    return "this node was elected but does not serve; leader=unknown"


@contextlib.contextmanager
def follower_on_a_thread(messages) -> Iterator[FakeFollower]:
    """A FakeFollower answering with `messages`, served on a thread of its own, for a test of
    the blocking client."""

    async def serve():
        return await FakeFollower(None, messages=messages).start()

    loop = asyncio.new_event_loop()
    node = loop.run_until_complete(serve())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        yield node
    finally:
        loop.call_soon_threadsafe(node.server.close)
        loop.call_soon_threadsafe(loop.stop)


def test_not_leader_is_followed_to_the_leader_named(server):
    async def main():
        follower = await FakeFollower(server.addr).start()
        async with tenure.AsyncClient(f"{follower.addr},{server.addr}") as c:
            lease = await c.acquire("cl", 10)
            assert isinstance(lease, Granted)
            assert follower.requests == [0x02]  # one ACQUIRE reached it, none executed there
            # Later requests go straight to the leader.
            assert isinstance(await c.inspect("cl"), Held)
            assert follower.requests == [0x02]
        follower.server.close()

    asyncio.run(main())
    with tenure.Client(server.addr) as direct:
        assert isinstance(direct.inspect("cl"), Held)


def test_leader_unknown_moves_to_the_next_address(server):
    async def main():
        electing = await FakeFollower(None).start()
        async with tenure.AsyncClient(f"{electing.addr},{server.addr}") as c:
            start = time.monotonic()
            assert await c.ping() >= 0
            assert time.monotonic() - start >= 0.05  # paused before moving on
            assert electing.requests == [0x01]
        electing.server.close()

    asyncio.run(main())


def test_a_node_that_names_itself_is_not_asked_again_at_once(server):
    """A leader cut off from its followers may still think it leads and name itself."""

    async def main():
        isolated = await FakeFollower(None).start()
        isolated.leader = isolated.addr
        async with tenure.AsyncClient(f"{isolated.addr},{server.addr}") as c:
            assert await c.ping() >= 0
            assert isolated.requests == [0x01]  # asked once, then the next address
        isolated.server.close()

    asyncio.run(main())


def test_an_acquire_that_runs_out_raises_the_last_answer_not_a_later_time_out():
    """A cut-off leader answers NOT_LEADER and is then gone, and the other node accepts
    connections and never answers (stopped): the ACQUIRE raises that NOT_LEADER, not the
    time-out of a later connect, which says nothing of why (outside test a65, 2)."""

    async def main():
        import socket

        cut_off = await FakeFollower(None).start()
        stopped = socket.socket()
        stopped.bind(("127.0.0.1", 0))
        stopped.listen(16)  # never accepted: the handshake is never answered
        addrs = f"{cut_off.addr},127.0.0.1:{stopped.getsockname()[1]}"

        async def gone():
            while not cut_off.requests:
                await asyncio.sleep(0.005)
            cut_off.server.close()

        async with tenure.AsyncClient(addrs, timeout=1.5, acquire_retry_for=4) as c:
            closing = asyncio.ensure_future(gone())
            with pytest.raises(tenure.NotLeader):
                await c.acquire("k", 10)
            await closing
        assert cut_off.requests == [0x02]
        stopped.close()

    asyncio.run(main())


def test_a_refusal_after_a_send_of_unknown_outcome_leaves_the_outcome_unknown():
    """The first send is in flight when its leader loses its quorum, every later one is
    refused unrun: the caller is told the outcome is unknown, as the first send may still
    commit (outside test a66, 1)."""

    async def main():
        node = await FakeFollower(None, messages=unknown_then_refused).start()
        async with tenure.AsyncClient(node.addr, timeout=1, acquire_retry_for=2) as c:
            with pytest.raises(tenure.NotLeader) as raised:
                await c.acquire("k", 10)
        node.server.close()
        text = raised.value.message
        assert text.startswith("the outcome is unknown: an earlier send"), text
        assert "the last answer: this node was elected" in text, text
        assert len(node.requests) > 1

    asyncio.run(main())


def test_a_search_keeps_the_answer_that_said_the_outcome_is_unknown():
    """Any request (a PING here; a RELEASE in outside test a67, 2) in flight when its leader
    lost its place is answered "the outcome is unknown", its re-sends "does not serve": the
    caller hears the first, which a later refusal must not hide."""

    async def main():
        node = await FakeFollower(None, messages=unknown_then_refused).start()
        async with tenure.AsyncClient(node.addr, timeout=1) as c:
            with pytest.raises(tenure.NotLeader) as raised:
                await c.ping()
        node.server.close()
        assert raised.value.message.startswith("the outcome is unknown"), raised.value.message
        assert len(node.requests) > 1

    asyncio.run(main())


def test_the_blocking_clients_acquire_says_when_the_outcome_is_unknown():
    """The blocking client's first send goes over its direct connection: an answer there that
    says the outcome is unknown still makes the ACQUIRE's end say so (outside test a67, 1)."""
    with follower_on_a_thread(unknown_then_refused) as node:
        with tenure.Client(node.addr, timeout=1, acquire_retry_for=2) as c:
            with pytest.raises(tenure.NotLeader) as raised:
                c.acquire("k", 10)
        text = raised.value.message
        assert text.startswith("the outcome is unknown"), text
        assert len(node.requests) > 1


def test_the_blocking_clients_search_keeps_the_answer_that_said_the_outcome_is_unknown():
    """A blocking client's request answered on its direct connection that its outcome is
    unknown, then refused on the loop's re-sends, reports the first (outside test a68, 4)."""
    with follower_on_a_thread(unknown_then_refused) as node:
        with tenure.Client(node.addr, timeout=1) as c:
            with pytest.raises(tenure.NotLeader) as raised:
                c.ping()
        assert raised.value.message.startswith("the outcome is unknown"), raised.value.message
        assert len(node.requests) > 1


def test_a_lease_counts_from_the_send_the_leader_answered(server):
    """A follower slow to answer NOT_LEADER does not eat into the lease granted after it."""

    async def main():
        slow = await FakeFollower(server.addr, delay=1.5).start()
        async with tenure.AsyncClient(f"{slow.addr},{server.addr}", timeout=10) as c:
            first_send = time.monotonic()
            lease = await c.acquire("resent", 2)
            assert isinstance(lease, Granted)
            # Counted from the re-send (>= 1.5 s after the first), not from the first send.
            assert lease.deadline - first_send >= 1.5 + 2 - 0.1, lease.deadline - first_send
            assert lease.deadline <= time.monotonic() + 2
            await c.release(lease)
        slow.server.close()

    asyncio.run(main())


def test_a_search_with_one_address_ends_with_the_nodes_answer():
    """A node that never knows a leader (removed from its cluster), slow to answer: the
    request ends with its NOT_LEADER, which says why, not with a bare time-out."""

    async def main():
        removed = await FakeFollower(None, delay=0.3).start()
        async with tenure.AsyncClient(removed.addr, timeout=2) as c:
            with pytest.raises(tenure.NotLeader):
                await c.ping()
        removed.server.close()

    asyncio.run(main())


def test_redirects_are_bounded():
    async def main():
        a = await FakeFollower(None).start()
        b = await FakeFollower(a.addr).start()
        a.leader = b.addr  # each names the other: a loop
        async with tenure.AsyncClient(f"{a.addr},{b.addr}", timeout=1) as c:
            start = time.monotonic()
            with pytest.raises(tenure.NotLeader):
                await c.ping()
            # Rounds of one redirect per address plus three, paused between (an election may
            # be under way), until the request's time would run out.
            assert time.monotonic() - start < 5
            asked = len(a.requests) + len(b.requests)
            assert 2 + 4 < asked < 100, asked
        a.server.close()
        b.server.close()

    asyncio.run(main())


def test_connect_tries_each_address_in_turn(server):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = "127.0.0.1:%d" % s.getsockname()[1]
    # The first address refuses; connecting goes on to the next one at once.
    with tenure.Client(f"{dead},{server.addr}") as c:
        assert c.ping() >= 0
    # Every address refuses: the error of the last one.
    with pytest.raises(tenure.ConnectionLost):
        tenure.Client(f"{dead},{dead}")


def test_blocking_client_follows_not_leader_and_then_talks_to_the_leader(server):
    """The blocking client's direct path hands NOT_LEADER to the pipelined path, which
    follows it; later calls go to the leader only."""
    import threading

    ready = threading.Event()
    state = {}

    def run_follower():
        async def main():
            follower = await FakeFollower(server.addr).start()
            state["follower"] = follower
            state["loop"] = asyncio.get_running_loop()
            state["stop"] = asyncio.Event()
            ready.set()
            await state["stop"].wait()
            follower.server.close()

        asyncio.run(main())

    thread = threading.Thread(target=run_follower)
    thread.start()
    try:
        assert ready.wait(5)
        follower = state["follower"]
        with tenure.Client(f"{follower.addr},{server.addr}") as c:
            for i in range(5):
                assert isinstance(c.acquire(f"bl/{i}", 10), Granted)
            assert isinstance(c.inspect("bl/0"), Held)
        # At most the first ACQUIRE reached the follower on each of the client's connections.
        assert 1 <= len(follower.requests) <= 2, follower.requests
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(timeout=10)
