"""A TCP proxy that breaks connections at chosen byte offsets, to prove transfers resume.

Offsets count every byte forwarded in one direction over all connections so far: with
``cut_up=[700]`` the connection carrying the 700th byte from client to server is dropped
(both sides, no goodbye) right after that byte; the client's next connection goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass
class _Direction:
    cuts: list[int]
    forwarded: int = 0
    done: int = 0

    def allowance(self) -> int | None:
        """Bytes that may pass before the next cut; None: no cut ahead."""
        return self.cuts[0] - self.forwarded if self.cuts else None


@dataclass
class CutProxy:
    target_port: int
    up: _Direction
    down: _Direction
    port: int = 0
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def cuts_done(self) -> int:
        return self.up.done + self.down.done

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: _Direction
    ) -> bool:
        """Forward until EOF (True) or a cut (False)."""
        while True:
            data = await reader.read(64 * 1024)
            if not data:
                if writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                return True
            room = way.allowance()
            if room is not None and len(data) >= room:
                writer.write(data[:room])
                way.forwarded += room
                way.cuts.pop(0)
                way.done += 1
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                return False
            writer.write(data)
            way.forwarded += len(data)
            await writer.drain()

    async def serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers |= {c_writer, s_writer}
        pipes = [
            asyncio.ensure_future(self._pipe(c_reader, s_writer, self.up)),
            asyncio.ensure_future(self._pipe(s_reader, c_writer, self.down)),
        ]
        try:
            done, _ = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            first = done.pop()
            if first.exception() is None and first.result():
                # One side closed cleanly: let the other finish (a response in flight).
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.gather(*pipes), 10)
        finally:
            for p in pipes:
                p.cancel()
            for w in (c_writer, s_writer):
                w.transport.abort()
                self.writers.discard(w)


@asynccontextmanager
async def cut_proxy(
    target_port: int, cut_up: Sequence[int] = (), cut_down: Sequence[int] = ()
) -> AsyncIterator[CutProxy]:
    proxy = CutProxy(target_port, _Direction(sorted(cut_up)), _Direction(sorted(cut_down)))
    server = await asyncio.start_server(proxy.serve, "127.0.0.1", 0)
    proxy.port = server.sockets[0].getsockname()[1]
    try:
        yield proxy
    finally:
        server.close()
        for w in list(proxy.writers):
            w.transport.abort()
        await server.wait_closed()
