#!/usr/bin/env python3
"""A TCP proxy in front of each node's peer listener, so a bench script can cut a node off.

Usage: peer-proxy.py CONTROL-FILE LISTEN=TARGET...   (one pair per node, in node order)

Every node's peer listener is on a loopback address of its own (127.0.0.{i+2}) and its peer
connections leave from that address, so a connection's source IP names the node it comes
from. CONTROL-FILE holds the 0-based index of the node cut off, or nothing: while it names
node N, every link to and from N is closed (existing ones at once, new ones on accept), as
the nemesis's proxy does (testkit/src/nemesis/proxy.rs). The file is read every 10 ms.
Loopback only; ends on SIGTERM.
"""
import asyncio
import sys

POLL_S = 0.01
BUFFER_BYTES = 1 << 16


def main():
    control = sys.argv[1]
    pairs = [arg.split("=") for arg in sys.argv[2:]]
    targets = [(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for _, t in pairs]
    listens = [(l.rsplit(":", 1)[0], int(l.rsplit(":", 1)[1])) for l, _ in pairs]
    for host, _ in listens + targets:
        assert host.startswith("127."), f"loopback only, got {host}"
    asyncio.run(run(control, listens, targets))


async def run(control, listens, targets):
    state = {"cut": None, "links": []}  # links: (from, to, task)

    def node_at(ip):
        return next((i for i, (host, _) in enumerate(targets) if host == ip), None)

    def is_cut(src, dst):
        n = state["cut"]
        return n is not None and (n == dst or n == src)

    async def pipe(reader, writer):
        try:
            while data := await reader.read(BUFFER_BYTES):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def forward(reader, writer, dst):
        try:
            up_r, up_w = await asyncio.open_connection(*targets[dst])
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            up_w.close()

    def on_accept(dst):
        async def accepted(reader, writer):
            src = node_at(writer.get_extra_info("peername")[0])
            if is_cut(src, dst):
                writer.close()
                return
            task = asyncio.current_task()
            state["links"].append((src, dst, task))
            try:
                await forward(reader, writer, dst)
            finally:
                state["links"] = [l for l in state["links"] if l[2] is not task]
        return accepted

    for dst, (host, port) in enumerate(listens):
        await asyncio.start_server(on_accept(dst), host, port)
    while True:
        try:
            with open(control) as f:
                text = f.read().strip()
            cut = int(text) if text else None
        except (OSError, ValueError):
            cut = None
        if cut != state["cut"]:
            state["cut"] = cut
            for src, dst, task in list(state["links"]):
                if is_cut(src, dst):
                    task.cancel()
        await asyncio.sleep(POLL_S)


if __name__ == "__main__":
    main()
