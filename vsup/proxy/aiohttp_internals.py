"""The aiohttp internals the proxy relies on, named in one place and checked at start-up.

(Over 400 lines for a reason: every aiohttp internal the proxy touches is here, so that one file
says what an aiohttp upgrade must be checked against.)

- `web.BaseRequest` is built positionally by our request factory (server.py): the low-level
  `web.Server` gives the factory (message, payload, protocol, writer, task) and we add the loop.
- Streamed bodies are written straight to `request.transport`, framed by hand when
  `request.writer.chunked` says the response is chunked (BodySink, below; fed by upstream.py's
  relay), and ended with `StreamResponse.write_eof()`, whose last chunk must match that framing;
  or ended by BodySink.end() in the write of the last piece, which then sets the writer's
  `chunked` to False so that `write_eof()` writes nothing more.
- An event stream to an HTTP/1.1 client is a RawStream (below): its status line and headers are
  written by the forwarder in one write, its body by a BodySink, and aiohttp, as for a
  RawResponse, only calls `prepare()` and `write_eof()` on it and reads `keep_alive`; the writer's
  `output_size` is advanced by the head, which is how handle_error knows an answer has begun.
- A complete non-streamed answer is returned to aiohttp as a RawResponse (below): aiohttp only
  calls `prepare(request)` and `write_eof()` on what a handler returns and reads its
  `keep_alive`, so the status line, headers and body go out in one write, without building a
  web.Response, its header multidict and aiohttp's payload writer (~15 µs per request).
- The connection handler (`web_protocol.RequestHandler`) is subclassed (make_server, below) to
  bound and count connections (answering /health and /ready on a few over the limit), count a
  request's header bytes before its parser buffers them, close one that sends no complete
  request in time, answer what its parser rejects in our own words (`handle_error`, which
  aiohttp calls with the parser's exception and logs with a traceback; a request whose headers
  came whole but too large is swapped in its queue for such an `_ErrInfo`), and fail the body
  of the request in progress when the parser rejects bytes that arrive after its headers
  (aiohttp queues that error behind the request instead, and the handler would wait for the
  rest of the body forever).

None is public API, so the range of aiohttp versions vsup is tested with is pinned in
pyproject.toml (SUPPORTED below is the same range) and `check()` refuses to start the proxy
outside it, or when the shapes above changed, with one line saying what to install.
tests/test_aiohttp_internals.py exercises each on the wire.
"""

from __future__ import annotations

import asyncio
import inspect
from http import HTTPStatus
from typing import TYPE_CHECKING, cast

import aiohttp
from aiohttp import http_exceptions, http_parser, http_writer, web, web_protocol
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader

from vsup.errors import VsupError
from vsup.proxy.clients import PROBE_BYTES, PROBE_TIMEOUT, raw_response

if TYPE_CHECKING:
    from vsup.proxy.clients import ClientPolicy

# >= first, < second: keep equal to the pin in pyproject.toml. The floor is the oldest release the
# proxy tests pass on (scripts/test runs them there under CI): before 3.13.4 a request with too many
# headers is a 400, not a 431.
SUPPORTED = ((3, 13, 4), (3, 15, 0))
REQUIREMENT = f"aiohttp>={'.'.join(map(str, SUPPORTED[0]))},<{SUPPORTED[1][0]}.{SUPPORTED[1][1]}"
REQUEST_PARAMETERS = ("message", "payload", "protocol", "payload_writer", "task", "loop")
HANDLE_ERROR_PARAMETERS = ("self", "request", "status", "exc", "message")
# What the RequestHandler subclass below reads or overrides.
HANDLER_ATTRIBUTES = (
    "connection_made", "connection_lost", "data_received", "handle_error", "force_close",
    "_request_count", "_current_request", "_messages", "_manager", "_loop", "_force_close", "_keepalive_handle",
)
# What _Handler reads of a parsed request (aiohttp's RawRequestMessage) to size its headers.
MESSAGE_FIELDS = ("method", "path", "raw_headers")
# The parser's complaints (a malformed request, a bad chunk size, a body shorter than announced).
BadRequest = http_exceptions.HttpProcessingError


def version_tuple(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string; a pre-release suffix is dropped ("4.0.0a1" -> 4, 0, 0)."""
    major, minor, patch = (version.split(".") + ["0", "0"])[:3]
    return int(major), _leading_int(minor), _leading_int(patch)


def _leading_int(part: str) -> int:
    digits = ""
    for ch in part:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits or "0")


def problems(version: str = aiohttp.__version__) -> list[str]:
    """What does not match the internals vsup was written against (empty: all is well)."""
    found = []
    low, high = SUPPORTED
    if not low <= version_tuple(version) < high:
        found.append(f"aiohttp {version} is outside the tested range {REQUIREMENT}")
    parameters = tuple(inspect.signature(web.BaseRequest.__init__).parameters)[1:1 + len(REQUEST_PARAMETERS)]
    if parameters != REQUEST_PARAMETERS:
        found.append(f"web.BaseRequest takes {parameters}, not {REQUEST_PARAMETERS}")
    writer = http_writer.StreamWriter  # `chunked`: a class attribute since 3.10, set in __init__ before
    if not (hasattr(writer, "chunked") or "chunked" in writer.__init__.__code__.co_names):
        found.append("aiohttp's StreamWriter has no `chunked` attribute")
    if not (hasattr(writer, "output_size") or "output_size" in writer.__init__.__code__.co_names):
        found.append("aiohttp's StreamWriter has no `output_size` attribute")
    handler = web_protocol.RequestHandler
    for name in HANDLER_ATTRIBUTES:
        if name not in getattr(handler, "__slots__", ()) and not hasattr(handler, name):
            found.append(f"aiohttp's RequestHandler has no `{name}`")
    if tuple(inspect.signature(handler.handle_error).parameters) != HANDLE_ERROR_PARAMETERS:
        found.append(f"RequestHandler.handle_error takes {tuple(inspect.signature(handler.handle_error).parameters)}")
    if not hasattr(web_protocol, "_ErrInfo"):
        found.append("aiohttp.web_protocol has no `_ErrInfo`")
    elif tuple(inspect.signature(web_protocol._ErrInfo).parameters) != ("status", "exc", "message"):
        found.append(f"aiohttp's _ErrInfo takes {tuple(inspect.signature(web_protocol._ErrInfo).parameters)}")
    missing = [f for f in MESSAGE_FIELDS if not hasattr(http_parser.RawRequestMessage, f)]
    if missing:
        found.append(f"aiohttp's RawRequestMessage has no {missing}")
    return found


def check() -> None:
    """Raise VsupError naming what to install when the installed aiohttp is not one vsup knows."""
    found = problems()
    if found:
        raise VsupError(
            "the proxy relies on aiohttp internals and cannot run with this aiohttp: "
            + "; ".join(found) + f". Install a tested one: pip install '{REQUIREMENT}'"
        )


# Pause relaying from an instance while the client's socket has this much unsent.
CLIENT_HIGH_WATER = 256 * 1024


class BodySink:
    """The body of a prepared StreamResponse, written straight to the client's transport: from the
    upstream socket's data callback, with no task switch and no `await` per piece (what
    StreamResponse.write would cost on every streamed token). Framed as HTTP/1.1 chunks when
    aiohttp chose chunked encoding for the response (`request.writer.chunked`), so that
    `StreamResponse.write_eof()` ends it correctly."""

    __slots__ = ("_transport", "_writer", "_chunked", "ended", "drain")

    def __init__(self, transport, writer, chunked: bool | None = None) -> None:
        self._transport = transport
        self._writer = writer  # http_writer.StreamWriter
        self._chunked = writer.chunked if chunked is None else chunked  # given: a RawStream's head said so
        self.ended = False  # end() wrote the end of the body (to a client still there)
        self.drain = writer.drain  # waits until the client's buffer is below aiohttp's low-water mark

    @classmethod
    def of(cls, request: web.BaseRequest) -> "BodySink | None":
        """The sink of a request whose response is prepared; None when the client already left."""
        transport = request.transport
        if transport is None or transport.is_closing():
            return None
        # request.writer is typed as the abstract writer; it is http_writer.StreamWriter, whose
        # `chunked` problems() checks at start-up
        return cls(transport, request.writer)

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
        instead of two); the writer then counts as unchunked, so that the response's
        `write_eof()` adds no second end. Nothing to end on an unchunked body."""
        transport = self._transport
        if transport.is_closing():
            return  # not ended: write_eof() then finds the client gone, as aiohttp's would
        self.ended = True
        if self._chunked:
            transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
            self._chunked = self._writer.chunked = False
        elif data:
            transport.write(data)


_REASONS = {status.value: status.phrase.encode("latin-1") for status in HTTPStatus}


class RawStream:
    """A streamed answer whose status line and headers the forwarder writes itself, in one write,
    as RawResponse does for a whole one (no StreamResponse, its header multidict and aiohttp's
    header serialisation): HTTP/1.1, chunked, its body through `sink`, ended by
    the sink's end() or by write_eof(). Only where RawResponse `fits` (and for event streams). aiohttp only calls
    `prepare()` and `write_eof()` on it afterwards and reads its `keep_alive`; the writer's
    `output_size` is advanced by the head so that handle_error knows the answer has begun."""

    __slots__ = ("status", "keep_alive", "prepared", "sink")

    def __init__(self, status: int, keep_alive: bool) -> None:
        self.status = status
        self.keep_alive = keep_alive
        self.prepared = False
        self.sink: BodySink | None = None

    def start(self, request: web.BaseRequest, header_lines: bytes) -> BodySink | None:
        """Write the head (`header_lines`: `Name: value\\r\\n` lines without Content-Length,
        Transfer-Encoding or Connection); the body's sink, or None when the client already left."""
        transport = request.transport
        if transport is None or transport.is_closing():
            return None
        head = b"HTTP/1.1 %d %b\r\n%bTransfer-Encoding: chunked\r\n%b\r\n" % (
            self.status, _REASONS.get(self.status, b"Unknown"), header_lines,
            b"" if self.keep_alive else b"Connection: close\r\n",
        )
        transport.write(head)
        writer = request.writer
        writer.output_size += len(head)  # StreamWriter's, checked by problems()
        self.prepared = True
        self.sink = BodySink(transport, writer, chunked=True)
        return self.sink

    async def prepare(self, request: web.BaseRequest) -> None:
        return None  # started by the forwarder

    async def write(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink.write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        sink = self.sink
        if sink is None or sink.ended:
            return
        if sink.gone():
            raise ConnectionResetError("the client is gone")  # as StreamResponse.write_eof: a disconnect
        sink.end(data)


class RawResponse:
    """A complete answer with a body, sent to the client as one write (see the module's docstring).
    Only for HTTP/1.1 requests other than HEAD and for statuses that carry a body (`fits`);
    `header_lines` are `Name: value\\r\\n` lines without Content-Length or Connection."""

    __slots__ = ("status", "keep_alive", "_data")

    def __init__(self, status: int, header_lines: bytes, body: bytes, keep_alive: bool) -> None:
        self.status = status
        self.keep_alive = keep_alive
        self._data = b"HTTP/1.1 %d %b\r\n%bContent-Length: %d\r\n%b\r\n%b" % (
            status, _REASONS.get(status, b"Unknown"), header_lines, len(body),
            b"" if keep_alive else b"Connection: close\r\n", body,
        )

    @staticmethod
    def fits(request: web.BaseRequest, status: int) -> bool:
        return request.version == HTTP_11 and request.method != "HEAD" and status >= 200 and status not in (204, 304)

    async def prepare(self, request: web.BaseRequest) -> None:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client is gone")  # aiohttp counts it as a disconnect
        transport.write(self._data)

    async def write_eof(self, data: bytes = b"") -> None:
        return None


HTTP_11 = aiohttp.HttpVersion11


def make_request_factory(loop, max_body_bytes: int):
    """The request factory for `web.Server`: a plain BaseRequest with our body size limit."""

    def make_request(message, payload, protocol, writer, task) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=max_body_bytes)

    return make_request


async def send_and_close(request: web.BaseRequest, response: web.StreamResponse) -> web.StreamResponse:
    """Send `response` now and close the connection after it, leaving the rest of the request
    body unread (aiohttp would otherwise go on reading it for up to its lingering_time, keeping
    a stalled client's connection open). Returns the response, for the handler to return."""
    response.force_close()
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client is gone anyway
    protocol = request.protocol
    if isinstance(protocol, _Handler):
        protocol.end_after_answer()  # flushed, then closed, the rest of the body dropped
    elif protocol is not None:
        protocol.force_close()  # the transport flushes what was written, then closes
    return response


class _Handler(web_protocol.RequestHandler):
    """aiohttp's connection handler, with the proxy's ClientPolicy (clients.py) wired in.

    Before the parser sees them, the bytes of a request's line and headers are counted: a piece
    that would take them over policy.max_header_bytes without ending them is answered 431 (and
    the connection closed) instead of being parsed, so a client cannot make aiohttp's parser hold
    more than that for it; heads that end in the piece are measured once parsed. The headers
    have policy.header_timeout from the connection (a keep-alive one: from the request's first
    byte); bytes that arrive while the previous request's body is incomplete are body bytes (the
    forwarder's body_timeout bounds those). A connection over a limit (ClientPolicy.opened) may
    get a probe slot: its request line alone is read, for /health or /ready."""

    @property
    def _vsup_policy(self) -> ClientPolicy:
        # aiohttp types its manager as web.Server (or None once closed); ours is always a _Server.
        return cast("_Server", self._manager).policy

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._vsup_clients = policy = self._vsup_policy  # the same for the connection's life
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else ""
        self._vsup_address = address
        self._vsup_head = 0  # bytes of the awaited request's line and headers received so far
        self._vsup_body: StreamReader | None = None  # the payload of the last request parsed
        self._vsup_timer: asyncio.TimerHandle | None = None
        # Not None: the bytes are not for aiohttp (a probe's request line, or a refused
        # connection's rest, read and dropped until it closes: see _vsup_last_word).
        self._vsup_probe: bytearray | None = None
        self._vsup_probing = False  # holds one of the policy's probe slots
        self._vsup_refusal = refusal = policy.opened(address)
        self._vsup_counted = refusal is None
        # Ours, not aiohttp's (which, from 3.10 on, also arms its keepalive timer here): the first
        # request's deadline is counted and logged (ClientPolicy.no_request_in_time).
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        if refusal is None:
            self._vsup_timer = self._loop.call_later(policy.header_timeout, self._vsup_head_late)
        elif policy.probe_slot(self, address):
            self._vsup_probing = True
            self._vsup_probe = bytearray()
            self._vsup_timer = self._loop.call_later(PROBE_TIMEOUT, self._vsup_probe_end, b"")
        else:
            transport.write(refusal)
            self.force_close()  # flushes the refusal, then closes

    def _vsup_head_late(self) -> None:
        # After a request, aiohttp's own keepalive_timeout closes a connection that sends nothing
        # more; this one closes it when a request's headers have begun but not ended in time.
        self._vsup_timer = None
        if not self._force_close and self.transport is not None:
            self._vsup_policy.no_request_in_time(self.transport.get_extra_info("peername"))
            self.force_close()

    def connection_lost(self, exc) -> None:
        if self._vsup_timer is not None:
            self._vsup_timer.cancel()
            self._vsup_timer = None
        if self._vsup_counted:
            self._vsup_counted = False
            self._vsup_clients.closed(self._vsup_address)
        self._vsup_release_probe()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._vsup_probe is not None:
            self._vsup_probe_data(data)
            return
        body = self._vsup_body
        in_head = body is None or body.is_eof()  # else: bytes of the body, for the forwarder to bound
        if in_head and self._vsup_head + len(data) > self._vsup_clients.max_header_bytes and not _ends_head(data):
            self._vsup_refuse_head(self._vsup_head + len(data))  # before the parser holds any of it
            return
        count = self._request_count
        _base_data_received(self, data)
        if self._request_count != count:
            self._vsup_parsed(count, len(data))
        elif in_head and data:
            head = self._vsup_head + len(data)
            self._vsup_head = head
            if head > self._vsup_clients.max_header_bytes:
                self._vsup_refuse_head(head)
            elif head == len(data) and self._vsup_timer is None:  # a keep-alive request's first bytes
                self._vsup_timer = self._loop.call_later(self._vsup_policy.header_timeout, self._vsup_head_late)

    def _vsup_parsed(self, count: int, received: int) -> None:
        """The data just fed completed the line and headers of one or more requests."""
        if self._vsup_timer is not None:
            self._vsup_timer.cancel()
            self._vsup_timer = None
        new = self._request_count - count
        messages = self._messages
        if not messages:
            return
        self._vsup_body = messages[-1][1]
        policy = self._vsup_clients
        if self._vsup_head + received > policy.max_header_bytes:  # possibly over: measure each new head
            for i in range(max(0, len(messages) - new), len(messages)):
                message = messages[i][0]
                if isinstance(message, web_protocol._ErrInfo):
                    continue
                size = _head_size(message)
                if size > policy.max_header_bytes:  # answered by aiohttp's error path (handle_error)
                    exc = policy.head_error(size)
                    messages[i] = (web_protocol._ErrInfo(status=431, exc=exc, message=exc.message), EMPTY_PAYLOAD)
        self._vsup_head = 0
        if self._current_request is not None:
            # A message was parsed while a request is being handled: if it is the parser's
            # complaint about that request's body, fail the body now (see the module's docstring).
            message = messages[-1][0]
            payload = self._current_request.content
            if isinstance(message, web_protocol._ErrInfo) and not payload.is_eof():
                payload.set_exception(message.exc)
                payload.feed_eof()  # nothing more to read: aiohttp must not linger reading it either

    def _vsup_peer(self):
        return self.transport.get_extra_info("peername") if self.transport is not None else None

    def _vsup_refuse_head(self, size: int) -> None:
        """Headers still arriving past max_header_bytes: 431 now, the rest is not read."""
        transport = self.transport
        if transport is None or self._force_close:
            return
        policy = self._vsup_policy
        self._vsup_last_word(raw_response(policy.malformed(431, policy.head_error(size), self._vsup_peer())))

    def _vsup_probe_data(self, data: bytes) -> None:
        probe = self._vsup_probe
        assert probe is not None
        if self._vsup_timer is None or self.transport is None or self._force_close:
            return  # the answer is out: dropped (see _vsup_last_word)
        probe += data
        end = probe.find(b"\r\n")
        if end >= 0:
            self._vsup_probe_end(bytes(probe[:end]))
        elif len(probe) > PROBE_BYTES:
            self._vsup_probe_end(b"")

    def _vsup_probe_end(self, request_line: bytes) -> None:
        """A connection over a limit: /health's or /ready's answer, or the refusal; then closed."""
        if self._vsup_timer is None:
            return  # answered already
        self._vsup_timer.cancel()
        self._vsup_timer = None
        self._vsup_release_probe()
        assert self._vsup_refusal is not None
        self._vsup_last_word(self._vsup_clients.probe_answer(request_line, self._vsup_refusal))

    def probe_evicted(self) -> None:
        self._vsup_probe_end(b"")

    def _vsup_release_probe(self) -> None:
        if self._vsup_probing:
            self._vsup_probing = False
            self._vsup_clients.probe_done(self)

    def _vsup_last_word(self, answer: bytes) -> None:
        """Send `answer` and end the connection without reading another request. What the client
        still sends is read and dropped for up to LINGER seconds after the FIN (closing with unread
        bytes would reset the connection, and the client could lose the answer)."""
        transport = self.transport
        if transport is None or self._force_close:
            return
        transport.write(answer)
        self.end_after_answer()

    def end_after_answer(self) -> None:
        """Close once what was written is sent, reading and dropping the client's bytes meanwhile
        (for at most LINGER seconds), so that it gets the answer, not a reset."""
        transport = self.transport
        if transport is None or self._force_close:
            return
        if transport.can_write_eof():
            transport.write_eof()
            self._vsup_probe = bytearray()  # from now on, data is dropped
            if self._vsup_timer is not None:
                self._vsup_timer.cancel()
            self._vsup_timer = None
            self._loop.call_later(LINGER, self.force_close)
        else:
            self.force_close()

    def handle_error(self, request, status=500, exc=None, message=None):
        if request.writer.output_size > 0:  # as aiohttp: the answer has begun, nothing to replace it
            raise ConnectionError("the response has started: the connection is broken")
        policy = self._vsup_policy
        peer = request.remote
        if isinstance(exc, BadRequest) or (status == 400 and exc is None):
            response = policy.malformed(status, exc, peer)
        else:
            response = policy.crashed(status, exc, peer)
        response.force_close()
        return response


_base_data_received = web_protocol.RequestHandler.data_received
# How long a connection refused mid-request is read (and dropped) after its answer, at most.
LINGER = 1.0


def _ends_head(data: bytes) -> bool:
    """Might `data` end a request's headers (a blank line in it, or the rest of one begun before)?"""
    return b"\r\n\r\n" in data or b"\n\n" in data or data.startswith((b"\n", b"\r\n"))


def _head_size(message) -> int:
    """The bytes of a parsed request's line and headers, as sent (give or take whitespace)."""
    return len(message.method) + len(message.path) + 13 + sum(len(k) + len(v) + 4 for k, v in message.raw_headers)


class _Server(web.Server):
    def __init__(self, handler, *, policy: ClientPolicy, **kwargs) -> None:
        super().__init__(handler, **kwargs)
        self.policy = policy

    def __call__(self) -> _Handler:
        return _Handler(self, loop=self._loop, **self._kwargs)


def make_server(handler, *, policy, max_body_bytes: int, **kwargs) -> web.Server:
    """aiohttp's low-level Server running `handler` on our request factory, with `policy` (a
    clients.ClientPolicy) deciding connection limits and what malformed requests get. A client
    connection idle between requests closes after policy.timeout (aiohttp's keepalive_timeout)."""
    loop = asyncio.get_running_loop()
    return _Server(
        handler, policy=policy, request_factory=make_request_factory(loop, max_body_bytes),
        keepalive_timeout=policy.timeout, **kwargs,
    )
