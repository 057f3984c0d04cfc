"""Raw-socket HTTP peers for the proxy tests: a server whose every connection runs a script (so it
can misbehave at any byte), and small helpers to read a request, send bytes in pieces and reset."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A TCP server on 127.0.0.1 whose connections each run `script(reader, writer)`; the
    connection is closed when the script returns. `connections` counts accepted ones."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> "RawServer":
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await self.script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the peer went, or the server is closing (a cancelled handler would be logged)
        finally:
            self._tasks.discard(asyncio.current_task())  # type: ignore[arg-type]
            if not writer.transport.is_closing():
                writer.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request: (head, body); the body by Content-Length (chunked is not needed here)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return head, body


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0) instead of a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def send_in_pieces(writer: asyncio.StreamWriter, *pieces: bytes, pause: float = 0.002) -> None:
    """Each piece as its own TCP segment (nodelay, flushed, a pause between pieces)."""
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i, piece in enumerate(pieces):
        if i:
            await asyncio.sleep(pause)
        writer.write(piece)
        await writer.drain()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)
