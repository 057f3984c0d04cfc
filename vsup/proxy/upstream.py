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

One connection, its parsing of the instance's answers and the reading of one answer are
vsup.proxy.upstream_conn; this module holds the pools and the client the forwarder calls.
The relay's writes to the client go through a sink (messages.BodySink in the proxy):
neither module knows anything of aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from vsup.proxy.address import host_port, label, socket_path
from vsup.proxy.clock import Clock
from vsup.proxy.upstream_conn import ConnectFailed, Connection, StaleConnection, UpstreamBroken, UpstreamResponse

_P = TypeVar("_P", bound=asyncio.BaseProtocol)


class UpstreamPool:
    """Connections to one instance: idle keep-alive ones are reused (newest first), at most
    `limit` exist at once; beyond that, requests wait in line for one."""

    def __init__(self, url: str, limit: int, connect_timeout: float, keepalive: float, loop: asyncio.AbstractEventLoop,
                 clock: Clock | None = None) -> None:
        self.path = socket_path(url)  # a Unix socket (vsup run's default), else TCP host:port
        self.host, self.port = ("localhost", 0) if self.path is not None else host_port(url)
        self.label = label(url)
        self.host_header = f"Host: {self.host if self.path is not None else self.label}\r\n".encode()
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.loop = loop  # keep-alive expiry: real time (the instance's own keep-alive timer is)
        self.clock: Clock = clock or loop
        self.idle: list[tuple[Connection, float]] = []
        self.open = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.closed = False
        # False while the instance is out of rotation: idle connections were closed and finished
        # ones are closed too, so no later request picks a connection to a process that is gone.
        self.reusable = True

    def take_idle(self) -> Connection | None:
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

    async def acquire(self) -> Connection:
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
                _, conn = await self.open_transport(lambda: Connection(self))
        except TimeoutError:
            self._slot_freed()
            raise ConnectFailed(f"no connection to {self.label} within {self.connect_timeout:g} s") from None
        except OSError as exc:
            self._slot_freed()
            raise ConnectFailed(f"cannot connect to {self.label}: {exc.strerror or exc}") from None
        except BaseException:
            self._slot_freed()
            raise
        sock = conn.transport.get_extra_info("socket")
        if sock is not None and self.path is None:  # no Nagle on AF_UNIX to turn off
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def open_transport(self, factory: Callable[[], _P]) -> Coroutine[Any, Any, tuple[asyncio.Transport, _P]]:
        """The loop's connect to the instance: its Unix socket or TCP host:port."""
        if self.path is not None:
            return self.loop.create_unix_connection(factory, self.path)
        return self.loop.create_connection(factory, self.host, self.port)

    def release(self, conn: Connection, reusable: bool) -> None:
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

    def _drop(self, conn: Connection) -> None:
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.abort()  # RST: the instance sees the disconnect at once
        if not conn.counted_out:
            conn.counted_out = True
            self._slot_freed()

    def forget(self, conn: Connection) -> None:
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

    def __init__(self, *, limit: int, connect_timeout: float, keepalive: float, clock: Clock | None = None) -> None:
        self.clock = clock  # what the relay stamps a request's activity with (the forwarder's watchdog reads it); None: the loop
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.pools: dict[str, UpstreamPool] = {}

    def pool(self, url: str) -> UpstreamPool:
        pool = self.pools.get(url)
        if pool is None:
            loop = asyncio.get_running_loop()
            pool = self.pools[url] = UpstreamPool(url, self.limit, self.connect_timeout, self.keepalive, loop, self.clock or loop)
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

    def idle_connection(self, url: str) -> Connection | None:
        """An idle keep-alive connection to `url` if one is ready now, else None (then connect())."""
        pool = self.pools.get(url)
        return pool.take_idle() if pool is not None else None

    async def connect(self, url: str) -> Connection:
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
                transport, _ = await pool.open_transport(asyncio.Protocol)
        except TimeoutError:
            return True
        except OSError:
            return False
        transport.close()
        return True

    async def send(self, conn: Connection, method: str, target: bytes, headers: bytes, body: bytes) -> UpstreamResponse:
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
