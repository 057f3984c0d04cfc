"""One keep-alive HTTP/1.1 connection to an instance: the asyncio protocol that parses its answers
with llhttp (httptools) straight into a queue of body chunks (or, relaying, straight into the
client's socket), UpstreamResponse, which reads one answer, and the failure kinds (see
vsup.proxy.upstream, whose pools own the connections).

What the instance sends is trusted no further than HTTP/1.1 allows: interim 1xx answers are
skipped, bytes beyond the announced end of a response (or arriving while no request is
outstanding) make the connection unusable instead of being taken as the next answer, and a
body delimited by the end of the connection (no Content-Length, not chunked) ends there.
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Protocol

import httptools

if TYPE_CHECKING:
    from vsup.proxy.upstream import UpstreamPool


class Sink(Protocol):
    """Where a relayed body goes (messages.BodySink in the proxy)."""

    def write(self, data: bytes) -> bool: ...  # True: the client's buffer is full, drain() first

    def end(self, data: bytes) -> None: ...  # the body's last bytes and the end of its framing, one write

    async def drain(self) -> None: ...


class Watched(Protocol):
    """What the relay stamps per piece: the forwarder's Exchange (vsup.proxy.exchange)."""

    last: float
    first_data_at: float | None

    def on_data(self, now: float) -> None: ...

    def first_data(self, now: float) -> None: ...

# Pause reading from the instance while this much body is queued and not yet written to the client.
_HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    pass


class UpstreamBroken(UpstreamError):
    pass


class StaleConnection(UpstreamBroken):
    pass


class Connection(asyncio.Protocol):
    """One keep-alive TCP connection; carries one request/response at a time."""

    __slots__ = (
        "pool", "transport", "parser", "status", "headers", "headers_done", "chunks", "queued", "complete",
        "error", "waiter", "keep_alive", "reading_paused", "lost", "head", "used", "counted_out", "replied",
        "sink", "sink_blocked", "exchange", "clock", "awaiting", "interim", "pending",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.used = 0
        self.counted_out = False  # its slot in the pool's `open` count was given back
        self.clock = pool.clock.time
        # One parser for the connection's life: after a clean, complete answer llhttp is at the
        # start of the next one (a connection with any error is never reused).
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: collections.deque[bytes] = collections.deque()
        # relay mode: the pieces parsed from the read in progress, written when it is (_flush)
        self.pending: list[bytes] = []
        self._reset()

    def _reset(self) -> None:
        """Ready for the next request."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.chunks.clear()  # a complete answer whose reader went away may have left its body
        self.queued = 0
        self.complete = False
        self.replied = False  # a byte of the current answer arrived (a reset after that is no stale connection)
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future | None = None
        self.keep_alive = False
        self.reading_paused = False
        self.head = False
        self.awaiting = False  # a request was sent and its answer is not complete: bytes are expected
        self.interim = False  # the message being parsed is a 1xx interim answer (skipped)
        self.sink: Sink | None = None  # relay mode: body goes straight to sink.write (see UpstreamResponse.relay)
        self.sink_blocked = False
        self.exchange: Watched | None = None  # relay mode: the request's Exchange (its `last` is stamped per piece)

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.awaiting:
            # Nobody asked: a late or unsolicited answer. Taking it as the next request's answer
            # would hand one client another's response; the connection cannot be trusted.
            self.keep_alive = False
            self.transport.abort()  # type: ignore[union-attr]
            return
        self.replied = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.complete:
                # Bytes after the announced end of the answer: the answer stands, the connection goes.
                self.keep_alive = False
                self.awaiting = False
            else:
                self._fail(UpstreamBroken(f"invalid HTTP from the instance: {exc}"))
            self.transport.abort()  # type: ignore[union-attr]
        finally:
            if self.pending:
                self._flush()

    def _flush(self) -> None:
        """Relay mode: what this read brought goes to the client now, as one write however many
        pieces (events) it held: no later than writing each as it was parsed, one syscall fewer
        per extra piece. When the answer ended in this read, its end goes in the same write
        (the stream's last event, `[DONE]` and the end of the chunked body come together)."""
        pending = self.pending
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        sink = self.sink
        assert sink is not None  # pieces are pending only in relay mode
        if self.complete and self.error is None:
            sink.end(data)
        elif sink.write(data) and not self.reading_paused:
            self.reading_paused = True  # a slow client: stop reading until it catches up
            self.sink_blocked = True
            self.transport.pause_reading()  # type: ignore[union-attr]
            self._wake()

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.pool.forget(self)
        if not self.complete:
            if exc is None and self.headers_done and self._ends_at_eof():
                self.complete = True  # a body delimited by the end of the connection
                self.keep_alive = False
                self._wake()
                return
            self._fail(UpstreamBroken("the instance closed the connection" + (f" ({exc})" if exc else "")))

    def _ends_at_eof(self) -> bool:
        """The answer's body has neither a length nor chunks: it ends when the connection does."""
        for name, value in self.headers:
            low = name.lower()
            if low == b"content-length" or (low == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            raise UpstreamBroken("a second answer to one request")  # stops the parser: see data_received

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                self._fail(UpstreamBroken("the instance switched protocols (101), which the proxy never asks for"))
                raise self.error  # type: ignore[misc]  # stops the parser: see data_received
            # 100 Continue, 103 Early Hints...: interim, the real answer follows.
            self.interim = True
            self.headers = []
            return
        self.status = status
        self.headers_done = True
        if self.head:
            self.complete = True
            self.keep_alive = False
            self.awaiting = False
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            # Relay mode: straight from the instance's socket to the client's, no task switch,
            # written when this read is parsed (_flush, from data_received).
            # Exchange.on_data, inlined: this runs once per streamed token.
            exchange = self.exchange
            assert exchange is not None  # set together with the sink (relay)
            exchange.last = now = self.clock()
            if exchange.first_data_at is None:
                exchange.first_data(now)
            self.pending.append(body)
            return
        self.chunks.append(body)
        self.queued += len(body)
        if self.queued > _HIGH_WATER and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.awaiting = False
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- helpers
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    async def wait(self) -> None:
        self.waiter = self.pool.loop.create_future()
        await self.waiter


class UpstreamResponse:
    """Status, raw headers and the body of one upstream response. `close()` must be called: it
    returns a cleanly finished connection to the pool and drops any other."""

    __slots__ = ("_conn", "status", "raw_headers", "_released")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.raw_headers = conn.headers
        self._released = False

    async def read_chunk(self) -> bytes:
        """The next piece of body as it arrived (de-chunked); b"" at the end."""
        conn = self._conn
        while True:
            if conn.chunks:
                chunk = conn.chunks.popleft()
                conn.queued -= len(chunk)
                if conn.reading_paused and conn.queued <= _HIGH_WATER // 2:
                    conn.reading_paused = False
                    conn.transport.resume_reading()  # type: ignore[union-attr]
                return chunk
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    async def relay(self, sink: Sink, exchange: Watched) -> None:
        """Hand the rest of the body to `sink.write(piece)` as it arrives, from the connection's
        data callback (no task switch per piece); `sink.write` returns True when the client's
        buffer is full, and reading from the instance pauses until `await sink.drain()` returns.
        `exchange.on_data(now)` (inlined) runs for every piece. Returns when the body is
        complete; raises UpstreamBroken when the instance fails."""
        conn = self._conn
        while conn.chunks:  # what arrived before relaying started
            chunk = conn.chunks.popleft()
            exchange.on_data(conn.clock())
            sink.write(chunk)
        conn.queued = 0
        conn.sink, conn.exchange = sink, exchange
        try:
            while True:
                if conn.sink_blocked or conn.reading_paused:
                    await sink.drain()
                    conn.sink_blocked = False
                    if conn.reading_paused and not conn.lost:
                        conn.reading_paused = False
                        conn.transport.resume_reading()  # type: ignore[union-attr]
                    continue
                if conn.complete:
                    return
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        finally:
            conn.sink = conn.exchange = None

    def complete_body(self) -> bytes | None:
        """The whole body if all of it is in already (a small answer comes in one piece with its
        headers), without an await; None if more is to come."""
        conn = self._conn
        if not conn.complete or conn.reading_paused:
            return None
        chunks = conn.chunks
        body = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        conn.queued = 0
        return body

    async def read(self) -> bytes:
        body = self.complete_body()
        if body is not None:
            return body
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        reusable = conn.complete and conn.keep_alive and conn.error is None and not conn.lost
        conn.pool.release(conn, reusable)
