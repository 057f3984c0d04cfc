"""One client request and the proxy's answers to it, as the front door (client_conn.py) hands them
to the handlers and writes them back: no framework's classes, only what the proxy uses.

- `Request`: the parsed line and headers (as sent; the few the proxy reads on every request as
  attributes, collected by the parser's pass; any other through a case-insensitive view that looks
  it up when asked), the peer, whether the connection may be kept, and its body as a bounded
  stream (`Body`).
- `Response`: a complete answer (status, headers, body), written in one write.
- `StreamAnswer`: an answer whose body is relayed as it arrives; its head is written by the
  forwarder in one write, its body through a `BodySink` straight onto the client's transport
  (chunked for HTTP/1.1, delimited by the close for HTTP/1.0).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote

from multidict import CIMultiDict, MultiDict, MultiDictProxy

from vsup.proxy.codec import origin_form

if TYPE_CHECKING:
    from vsup.proxy.client_conn import ClientConnection

HTTP_11 = (1, 1)
REASONS = {status.value: status.phrase.encode("latin-1") for status in HTTPStatus}
# Pause reading a client's socket while this much of its body waits for the handler to read it.
BODY_HIGH_WATER = 64 * 1024
# Pause relaying from an instance while the client's socket has this much unsent.
CLIENT_HIGH_WATER = 256 * 1024


class BadRequest(Exception):
    """What the parser refused in a request (its line, headers or body framing); `message` is shown
    to the client and counted as malformed."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class HeadTooLarge(BadRequest):
    """A request's line or headers over a limit (a line, their count, or proxy.max_header_bytes): 431."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 431)


class Body:
    """A request's body as it arrives: fed by the connection, read by the handler. At most
    BODY_HIGH_WATER (plus one read of the socket) waits here: past it the connection stops reading
    the client until the handler has taken what is buffered."""

    __slots__ = ("_conn", "_chunks", "_size", "_eof", "_error", "_waiter", "paused")

    def __init__(self, conn: ClientConnection | None, eof: bool = False) -> None:
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = eof
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.paused = False

    # -- the connection's side
    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > BODY_HIGH_WATER and not self.paused and self._conn is not None:
            self.paused = True
            self._conn.pause_reading()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, error: BaseException) -> None:
        if not self._eof:
            self._error = error
            self._eof = True
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the handler's side
    @property
    def error(self) -> BaseException | None:
        """Why the body failed (the parser refused it, the client left), or None."""
        return self._error

    def is_eof(self) -> bool:
        """Everything is in: the whole body was received (or failed), and read_nowait() returns the rest."""
        return self._eof

    def read_nowait(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        self._resume()
        return data

    async def readany(self) -> bytes:
        """The next piece, or b"" at the end; raises the parser's BadRequest for a body it refused."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft()
        self._size -= len(data)
        self._resume()
        return data

    def _resume(self) -> None:
        if self.paused and self._size <= BODY_HIGH_WATER // 2:
            self.paused = False
            if self._conn is not None:
                self._conn.resume_reading()


EMPTY_BODY = Body(None, eof=True)


def _text(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")


class Headers(Mapping[str, str]):
    """A request's headers as str, case-insensitive, the first of a repeated name: a view of the
    raw (name, value) pairs that looks a name up when asked (a few per request, on a dozen
    headers), instead of a dictionary built for every request."""

    __slots__ = ("_raw",)

    def __init__(self, raw: tuple[tuple[bytes, bytes], ...]) -> None:
        self._raw = raw

    def __getitem__(self, name: str) -> str:
        wanted = name.lower().encode("utf-8", "surrogateescape")
        for key, value in self._raw:
            if len(key) == len(wanted) and key.lower() == wanted:
                return _text(value)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        seen: set[bytes] = set()
        for key, _ in self._raw:
            low = key.lower()
            if low not in seen:
                seen.add(low)
                yield _text(key)

    def __len__(self) -> int:
        return len({key.lower() for key, _ in self._raw})


class Request:
    """A client's request as parsed: `raw_path` is the target as sent (absolute-form too), `path`
    its path percent-decoded, `raw_headers` the header lines as sent (name, value) in bytes.
    `content_type`, `authorization` ("" when not sent) and `expect` (None) are those headers'
    values, taken in the parser's one pass over the headers: every request reads them."""

    __slots__ = ("method", "raw_path", "origin", "path", "query_string", "raw_headers", "version", "keep_alive", "remote",
                 "content", "content_length", "chunked", "conn", "started", "content_type", "authorization", "expect",
                 "_query")

    def __init__(self, method: str, raw_path: str, raw_headers: tuple[tuple[bytes, bytes], ...], version: tuple[int, int],
                 keep_alive: bool, remote: str | None, content: Body, content_length: int | None, chunked: bool,
                 conn: ClientConnection | None = None, *, content_type: str = "", authorization: str = "",
                 expect: str | None = None) -> None:
        self.method = method
        self.raw_path = raw_path
        # the target in origin-form, still percent-encoded (what the instance is sent)
        self.origin = origin = raw_path if raw_path[:1] == "/" else origin_form(raw_path)
        path, _, self.query_string = origin.partition("?")
        path = path.partition("#")[0]
        self.path = unquote(path) if "%" in path else path
        self.raw_headers = raw_headers
        self.version = version
        self.keep_alive = keep_alive
        self.remote = remote
        self.content = content
        self.content_length = content_length
        self.chunked = chunked
        self.conn = conn
        self.started = False  # an answer's first byte was written (nothing can replace it now)
        self.content_type = content_type
        self.authorization = authorization
        self.expect = expect
        self._query: MultiDictProxy[str] | None = None

    @property
    def headers(self) -> Headers:
        """Every header, for the lookups that are not on every request (a session or priority header)."""
        return Headers(self.raw_headers)

    @property
    def query(self) -> MultiDictProxy[str]:
        if self._query is None:
            self._query = MultiDictProxy(MultiDict(parse_qsl(self.query_string, keep_blank_values=True)))
        return self._query

    @property
    def body_exists(self) -> bool:
        return self.chunked or bool(self.content_length)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.conn.transport if self.conn is not None else None


def _no_body(status: int) -> bool:
    return status < 200 or status in (204, 304)


class Response:
    """A complete answer. `headers` as str; `close` (force_close()): end the connection after it."""

    __slots__ = ("status", "headers", "body", "close")

    def __init__(self, status: int = 200, body: bytes = b"", *, headers=None, content_type: str | None = None,
                 text: str | None = None, charset: str | None = None) -> None:
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict(headers or ())
        if text is not None:
            body = text.encode(charset or "utf-8")
            if content_type is None:
                content_type = "text/plain"
            charset = charset or "utf-8"
        if content_type is not None:
            self.headers["Content-Type"] = f"{content_type}; charset={charset}" if charset else content_type
        self.body = body
        self.close = False

    @property
    def reason(self) -> str:
        return REASONS.get(self.status, b"Unknown").decode("latin-1")

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def force_close(self) -> None:
        self.close = True

    def encode(self, version: tuple[int, int] = HTTP_11, keep_alive: bool = False, head_only: bool = False) -> bytes:
        lines = b"".join(b"%s: %s\r\n" % (name.encode("latin-1", "replace"), value.encode("latin-1", "replace"))
                         for name, value in self.headers.items() if name.lower() not in ("content-length", "connection"))
        return _head(self.status, version, lines, None if _no_body(self.status) else len(self.body), keep_alive) + (
            b"" if head_only or _no_body(self.status) else self.body)


class RawResponse:
    """A complete answer whose header lines are already bytes (the instance's, forwarded): one
    write, no header dictionary (the forwarder's hot path)."""

    __slots__ = ("status", "header_lines", "body", "close")

    def __init__(self, status: int, header_lines: bytes, body: bytes) -> None:
        self.status = status
        self.header_lines = header_lines
        self.body = body
        self.close = False

    def force_close(self) -> None:
        self.close = True

    def encode(self, version: tuple[int, int] = HTTP_11, keep_alive: bool = False, head_only: bool = False) -> bytes:
        no_body = _no_body(self.status)
        return _head(self.status, version, self.header_lines, None if no_body else len(self.body), keep_alive) + (
            b"" if head_only or no_body else self.body)


def _head(status: int, version: tuple[int, int], lines: bytes, length: int | None, keep_alive: bool) -> bytes:
    if version == HTTP_11:
        connection = b"" if keep_alive else b"Connection: close\r\n"
    else:
        connection = b"Connection: keep-alive\r\n" if keep_alive else b""
    return b"HTTP/%d.%d %d %b\r\n%b%b%b\r\n" % (
        version[0], version[1], status, REASONS.get(status, b"Unknown"), lines,
        b"Content-Length: %d\r\n" % length if length is not None else b"", connection,
    )


class BodySink:
    """A streamed body, written straight to the client's transport: from the upstream socket's data
    callback, with no task switch and no `await` per piece. Framed as HTTP/1.1 chunks when the
    answer is chunked."""

    __slots__ = ("_transport", "_chunked", "ended", "_conn")

    def __init__(self, transport: asyncio.Transport, chunked: bool, conn: ClientConnection | None = None) -> None:
        self._transport = transport
        self._chunked = chunked
        self._conn = conn
        self.ended = False  # end() wrote the end of the body (to a client still there)

    def write(self, data: bytes) -> bool:
        """Send one piece; True when the client reads slower than we write (the caller should
        stop reading upstream until `await drain()`). A client already gone is a no-op: its
        handler is being cancelled."""
        transport = self._transport
        if transport.is_closing():
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        return transport.get_write_buffer_size() > CLIENT_HIGH_WATER

    def gone(self) -> bool:
        return self._transport.is_closing()

    def end(self, data: bytes) -> None:
        """Send the body's last piece with the end of the chunked body in one write (one syscall
        instead of two). Nothing to end on an unchunked body but the close that follows."""
        transport = self._transport
        if transport.is_closing():
            return  # not ended: the client is gone
        self.ended = True
        if self._chunked:
            transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        elif data:
            transport.write(data)

    async def drain(self) -> None:
        """Wait until the client's buffer is below the low-water mark (or the client is gone)."""
        if self._conn is not None:
            await self._conn.drain()


class StreamAnswer:
    """An answer relayed as it arrives: HTTP/1.1 chunked (kept alive if the request allows), or for
    an HTTP/1.0 client delimited by the close. `start` writes the head in one write."""

    __slots__ = ("status", "request", "chunked", "keep_alive", "sink", "close")

    def __init__(self, request: Request, status: int) -> None:
        self.status = status
        self.request = request
        self.chunked = request.version == HTTP_11
        self.keep_alive = request.keep_alive and self.chunked
        self.sink: BodySink | None = None
        self.close = False

    @property
    def prepared(self) -> bool:
        return self.sink is not None

    def start(self, header_lines: bytes) -> BodySink | None:
        """Write the head (`header_lines`: `Name: value\\r\\n` lines without Content-Length,
        Transfer-Encoding or Connection); the body's sink, or None when the client already left."""
        request = self.request
        transport = request.transport
        if transport is None or transport.is_closing():
            return None
        version = request.version
        head = b"HTTP/%d.%d %d %b\r\n%b%b%b\r\n" % (
            version[0], version[1], self.status, REASONS.get(self.status, b"Unknown"), header_lines,
            b"Transfer-Encoding: chunked\r\n" if self.chunked else b"",
            b"" if self.keep_alive or not self.chunked else b"Connection: close\r\n",
        )
        transport.write(head)
        request.started = True
        self.sink = BodySink(transport, self.chunked, request.conn)
        return self.sink

    async def write(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink.write(data)

    async def write_eof(self) -> None:
        sink = self.sink
        if sink is None or sink.ended:
            return
        if sink.gone():
            raise ConnectionResetError("the client is gone")
        sink.end(b"")

    @property
    def complete(self) -> bool:
        """The whole answer went out (its end written): the connection may serve another request."""
        return self.sink is not None and self.sink.ended


Answer = Response | RawResponse | StreamAnswer
