"""A lean HTTP/1.1 client for the proxy's hot path: keep-alive connection pools per instance,
requests written as one buffer, responses parsed by llhttp (httptools) straight into a queue of
body chunks.

Why not aiohttp.ClientSession here: measured on the target box it costs ~85 µs of CPU per request
on its own, more than half the proxy's whole budget (docs/proxy.md); this client costs a fraction
of that. aiohttp still serves the clients, lists /v1/models and runs the health checks.

Failure kinds the forwarder acts on:
  ConnectFailed   the TCP connection could not be opened (refused, timeout): safe to retry
  StaleConnection a *reused* keep-alive connection was reset or closed before a single byte of
                  the answer came back: the request met a dead or closing server socket, not a
                  live server (the classic stale keep-alive race every HTTP client retries): safe
                  to retry, like ConnectFailed
  UpstreamBroken  the connection died or sent garbage after the request was written: not retried

What the instance sends is trusted no further than HTTP/1.1 allows: interim 1xx answers are
skipped, bytes beyond the announced end of a response (or arriving while no request is
outstanding) make the connection unusable instead of being taken as the next answer, and a
body delimited by the end of the connection (no Content-Length, not chunked) ends there.
The relay's writes to the client go through a sink (aiohttp_internals.BodySink in the proxy):
this module knows nothing of aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from typing import Any
from urllib.parse import urlsplit

import httptools

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


class _Connection(asyncio.Protocol):
    """One keep-alive TCP connection; carries one request/response at a time."""

    __slots__ = (
        "pool", "transport", "parser", "status", "headers", "headers_done", "chunks", "queued", "complete",
        "error", "waiter", "keep_alive", "reading_paused", "lost", "head", "used", "counted_out", "replied",
        "sink", "sink_blocked", "exchange", "clock", "awaiting", "interim",
    )

    def __init__(self, pool: "UpstreamPool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.used = 0
        self.counted_out = False  # its slot in the pool's `open` count was given back
        self.clock = pool.loop.time
        # One parser for the connection's life: after a clean, complete answer llhttp is at the
        # start of the next one (a connection with any error is never reused).
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: collections.deque[bytes] = collections.deque()
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
        self.sink: Any = None  # relay mode: body goes straight to sink.write (see UpstreamResponse.relay)
        self.sink_blocked = False
        self.exchange: Any = None  # relay mode: the request's Exchange (its `last` is stamped per piece)

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
        sink = self.sink
        if sink is not None:
            # Relay mode: straight from the instance's socket to the client's, no task switch.
            # Exchange.on_data, inlined: this runs once per streamed token.
            exchange = self.exchange
            exchange.last = now = self.clock()
            if exchange.first_data_at is None:
                exchange.first_data(now)
            if sink.write(body) and not self.reading_paused:
                self.reading_paused = True  # a slow client: stop reading until it catches up
                self.sink_blocked = True
                self.transport.pause_reading()  # type: ignore[union-attr]
                self._wake()
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

    def __init__(self, conn: _Connection) -> None:
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

    async def relay(self, sink, exchange) -> None:
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


class UpstreamPool:
    """Connections to one instance: idle keep-alive ones are reused (newest first), at most
    `limit` exist at once; beyond that, requests wait in line for one."""

    def __init__(self, url: str, limit: int, connect_timeout: float, keepalive: float, loop: asyncio.AbstractEventLoop) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"{url}: the proxy talks plain http to its instances")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.host_header = f"Host: {parts.netloc}\r\n".encode()
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.loop = loop
        self.idle: list[tuple[_Connection, float]] = []
        self.open = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.closed = False
        # False while the instance is out of rotation: idle connections were closed and finished
        # ones are closed too, so no later request picks a connection to a process that is gone.
        self.reusable = True

    def take_idle(self) -> _Connection | None:
        """The newest idle keep-alive connection still fresh, or None (no await: the common case)."""
        idle = self.idle
        if idle:
            now = self.loop.time()
            while idle:
                conn, since = idle.pop()
                if not conn.lost and now - since < self.keepalive:
                    return conn
                self._drop(conn)
        return None

    async def acquire(self) -> _Connection:
        """A new connection or, at the limit, the next one released (take_idle() comes first)."""
        while self.open >= self.limit:
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                conn = await waiter
            except BaseException:
                if not waiter.done() or waiter.cancelled():
                    with contextlib.suppress(ValueError):
                        self.waiters.remove(waiter)
                elif waiter.exception() is None:
                    # Handed to us as we were cancelled: pass it on to the next in line.
                    handed = waiter.result()
                    if handed is None:
                        self._wake_waiter()  # a free slot
                    else:
                        self.release(handed, True)
                raise
            if conn is not None:
                return conn
        self.open += 1
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except TimeoutError:
            self._slot_freed()
            raise ConnectFailed(f"no connection to {self.host}:{self.port} within {self.connect_timeout:g} s") from None
        except OSError as exc:
            self._slot_freed()
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        except BaseException:
            self._slot_freed()
            raise
        sock = conn.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def release(self, conn: _Connection, reusable: bool) -> None:
        if not reusable or self.closed or not self.reusable:
            self._drop(conn)
            return
        conn._reset()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self.idle.append((conn, self.loop.time()))

    def _drop(self, conn: _Connection) -> None:
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.abort()  # RST: the instance sees the disconnect at once
        if not conn.counted_out:
            conn.counted_out = True
            self._slot_freed()

    def forget(self, conn: _Connection) -> None:
        """The connection died; if it was idle, take it out of the idle list."""
        for i, (idle, _) in enumerate(self.idle):
            if idle is conn:
                del self.idle[i]
                self._drop(conn)
                return

    def _slot_freed(self) -> None:
        self.open -= 1
        self._wake_waiter()

    def _wake_waiter(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the waiter opens a connection itself
                return

    def close_idle(self) -> None:
        """Close every idle connection now (connections in use are left alone)."""
        idle, self.idle = self.idle, []
        for conn, _ in idle:
            self._drop(conn)

    def close(self) -> None:
        self.closed = True
        self.close_idle()


class UpstreamClient:
    """One pool per instance URL."""

    def __init__(self, *, limit: int, connect_timeout: float, keepalive: float) -> None:
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.pools: dict[str, UpstreamPool] = {}

    def pool(self, url: str) -> UpstreamPool:
        pool = self.pools.get(url)
        if pool is None:
            pool = self.pools[url] = UpstreamPool(url, self.limit, self.connect_timeout, self.keepalive, asyncio.get_running_loop())
        return pool

    def set_connect_timeout(self, seconds: float) -> None:
        """A new proxy.connect_timeout (`vsup reload`): for every connect from now on, to every
        instance (each pool keeps its own copy: it is read once per connect on the hot path)."""
        self.connect_timeout = seconds
        for pool in self.pools.values():
            pool.connect_timeout = seconds

    def set_reusable(self, url: str, reusable: bool) -> None:
        """The instance at `url` left the rotation (False: its idle keep-alive connections are
        closed at once and finished ones are not kept; requests in flight go on) or is back (True)."""
        pool = self.pools.get(url)
        if pool is None:
            return
        pool.reusable = reusable
        if not reusable:
            pool.close_idle()

    def close_idle(self, url: str) -> None:
        """Close the idle keep-alive connections to `url` (after one of them proved stale, the
        others were opened to the same process and are likely stale too)."""
        pool = self.pools.get(url)
        if pool is not None:
            pool.close_idle()

    def idle_connection(self, url: str) -> _Connection | None:
        """An idle keep-alive connection to `url` if one is ready now, else None (then connect())."""
        pool = self.pools.get(url)
        return pool.take_idle() if pool is not None else None

    async def connect(self, url: str) -> _Connection:
        """A new connection to the instance at `url` or, at the pool's limit, the next one
        released (after idle_connection() found none). Raises ConnectFailed."""
        return await self.pool(url).acquire()

    async def listening(self, url: str) -> bool:
        """Does anything accept connections at `url` now? False only when a connect is refused or
        reset (nothing listens: the instance's process is gone or going); True when one opens
        (it is closed at once) or cannot tell within connect_timeout."""
        pool = self.pool(url)
        try:
            async with asyncio.timeout(self.connect_timeout):
                transport, _ = await pool.loop.create_connection(asyncio.Protocol, pool.host, pool.port)
        except TimeoutError:
            return True
        except OSError:
            return False
        transport.close()
        return True

    async def send(self, conn: _Connection, method: str, target: bytes, headers: bytes, body: bytes) -> UpstreamResponse:
        """Send `METHOD target` with `headers` (already `Name: value\\r\\n` lines, no Host, no
        Content-Length) and `body`; return once the status line and headers are in. Raises
        StaleConnection when a reused connection fails before any byte of the answer arrived,
        UpstreamBroken for any other failure."""
        conn.used += 1
        conn.head = method == "HEAD"
        conn.awaiting = True
        length = b"Content-Length: %d\r\n" % len(body) if body or method in ("POST", "PUT", "PATCH") else b""
        try:
            conn.transport.write(b"".join((method.encode(), b" ", target, b" HTTP/1.1\r\n", conn.pool.host_header, headers, length, b"\r\n", body)))  # type: ignore[union-attr]
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                conn.waiter = waiter = conn.pool.loop.create_future()  # conn.wait(), inlined: once per request
                await waiter
        except UpstreamBroken as exc:
            conn.pool.release(conn, False)
            if conn.used > 1 and not conn.replied:
                # Reused keep-alive connection, reset/EOF before a single answer byte: the server
                # socket was dead or closing when the request arrived (nobody read it).
                raise StaleConnection(f"reused keep-alive connection failed before any answer: {exc}") from None
            raise
        except BaseException:
            conn.pool.release(conn, False)
            raise
        return UpstreamResponse(conn)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
