"""The proxy's client side of HTTP/1.1: one asyncio protocol per client connection, parsing with
llhttp (httptools) — the twin of upstream_conn.py — and the listener that makes them (`FrontServer`).

Everything a client can make the proxy hold is bounded here, before any handler runs:
- its request line and headers: counted as they arrive, before the parser buffers them (more than
  ClientPolicy.max_header_bytes without their end: 431 at once); each line at most MAX_LINE bytes,
  at most MAX_HEADERS of them (431); the whole head within ClientPolicy.header_timeout from the
  connection (on a keep-alive one, from the request's first byte), else the connection is closed;
- its body: at most BODY_HIGH_WATER buffered before the handler reads it (then the socket is not
  read; messages.Body), the rest bounded by the forwarder (size, deadline, the proxy-wide budget);
- its connections: ClientPolicy.opened bounds them in all and per address; a connection over a
  limit may still ask for /health or /ready on a probe slot (its request line alone is read);
- an idle keep-alive connection closes after ClientPolicy.timeout.
A request the parser refuses gets an OpenAI-shaped answer (ClientPolicy.malformed) and the
connection ends; so does one answered before its body was read (a 413, a 408): the rest of the
body is not read on, beyond a short linger that lets the answer arrive instead of a reset.
A client that disconnects cancels its handler (which drops the upstream connection, so vLLM
frees the slot). Requests pipelined on one connection are answered in order.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

import httptools

from vsup.proxy.clients import PROBE_BYTES, PROBE_TIMEOUT, ClientPolicy, raw_response
from vsup.proxy.clock import Clock, Handle
from vsup.proxy.messages import (
    EMPTY_BODY,
    BadRequest,
    Body,
    HeadTooLarge,
    RawResponse,
    Request,
    Response,
    StreamAnswer,
)

log = logging.getLogger("vsup.proxy")

Handler = Callable[[Request], Awaitable["Response | RawResponse | StreamAnswer"]]

# Per line of the request (its target, each header) and headers per request: aiohttp's limits,
# which clients already meet.
MAX_LINE = 8190
MAX_HEADERS = 128
# How long a connection refused mid-request is read (and dropped) after its answer, at most, and
# how many bytes: enough for a client that sends a little more to get the answer rather than a
# reset; past LINGER_BYTES the socket is not read, and it is closed at the end of LINGER.
LINGER = 1.0
LINGER_BYTES = 1024 * 1024
# The client's socket is written to until this much is unsent, then the relay waits (drain).
LOW_WATER = 64 * 1024
# A deadline's timer that fires this much early (the loop's timers are in milliseconds) counts as on time.
DEADLINE_SLACK = 0.001


def _ends_head(data: bytes) -> bool:
    """Might `data` end a request's headers (a blank line in it, or the rest of one begun before)?"""
    return b"\r\n\r\n" in data or b"\n\n" in data or data.startswith((b"\n", b"\r\n"))


class ClientConnection(asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    def __init__(self, server: FrontServer) -> None:
        self.server = server
        self.policy = server.policy  # the same for the connection's life
        self.loop = server.loop
        self.clock = server.clock  # the deadlines' timers
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.address = ""
        self.peer: object = None
        self.counted = False  # holds one of the policy's connection counts
        self.closing = False
        self.timer: Handle | None = None  # a probe's deadline, or the linger after a last answer
        # The header and keep-alive idle deadlines: `deadline` (None: none) and what it calls, on one
        # timer that is moved lazily (see _arm): a keep-alive request re-arms them twice and
        # clears them once, which is then a few assignments, not a timer made and cancelled each time.
        self.deadline: float | None = None
        self.on_deadline: Callable[[], None] = self._head_late
        self.deadline_timer: Handle | None = None
        self.deadline_timer_at = 0.0
        self.idle = False  # the deadline is the keep-alive idle limit (the next request's first byte re-arms it)
        # Not None: the bytes are not for the parser (a probe's request line, or a refused
        # connection's rest, read and dropped until it closes: see last_word).
        self.probe: bytearray | None = None
        self.probing = False  # holds one of the policy's probe slots
        self.refusal: bytes | None = None
        self.dropped = 0  # bytes dropped while lingering
        # the request being parsed
        self.head_bytes = 0  # bytes of the awaited request's line and headers received so far
        self.in_body = False  # its headers are complete, its body is not
        self.url = bytearray()
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_size = 0
        self.body: Body | None = None  # the body being received
        # the requests parsed and not yet answered (the first is being handled)
        self.pipeline: collections.deque[Request] = collections.deque()
        self.task: asyncio.Task | None = None
        self.reading_paused = False
        self.writing_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        transport.set_write_buffer_limits(high=LOW_WATER * 4, low=LOW_WATER)
        peer = transport.get_extra_info("peername")
        self.peer = peer
        self.address = peer[0] if isinstance(peer, tuple) else ""
        policy = self.policy
        self.refusal = refusal = policy.opened(self.address)
        if refusal is None:
            self.counted = True
            self._arm(policy.header_timeout, self._head_late)
        elif policy.probe_slot(self, self.address):
            self.probing = True
            self.probe = bytearray()
            self.timer = self.clock.call_later(PROBE_TIMEOUT, self._probe_end, b"")
        else:
            transport.write(refusal)
            self._close()  # flushes the refusal, then closes

    def connection_lost(self, exc) -> None:
        self.closing = True
        self._cancel_timer()
        self._stop_deadline()
        if self.counted:
            self.counted = False
            self.policy.closed(self.address)
        self._release_probe()
        self.server.connections.discard(self)
        if self.body is not None and not self.body.is_eof():
            self.body.set_exception(ConnectionResetError("the client closed the connection"))
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client is gone: its handler ends (and drops its upstream connection)
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self.transport = None

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        waiter = self.drain_waiter
        if waiter is not None:
            self.drain_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def drain(self) -> None:
        if not self.writing_paused or self.transport is None:
            return
        waiter = self.drain_waiter
        if waiter is None or waiter.done():
            waiter = self.drain_waiter = self.loop.create_future()
        await waiter

    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closing:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closing:
            self.reading_paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.probe is not None:
            self._probe_data(data)
            return
        if self.closing:
            return
        if not self.in_body:
            head = self.head_bytes + len(data)
            if head > self.policy.max_header_bytes and not _ends_head(data):
                self._refuse(HeadTooLarge(f"the request line and headers are {head} bytes or more, over proxy.max_header_bytes"))
                return  # before the parser holds any of it
            if self.idle:  # a keep-alive request's first bytes: its headers' deadline runs from now
                self._arm(self.policy.header_timeout, self._head_late, False)
            self.head_bytes = head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._malformed(BadRequest("protocol upgrades (Upgrade, CONNECT) are not supported by the proxy"))
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._malformed(cause if isinstance(cause, BadRequest) else BadRequest(str(cause or exc)))
        except httptools.HttpParserError as exc:
            self._malformed(BadRequest(str(exc) or type(exc).__name__))

    def eof_received(self) -> bool | None:
        # The client closed its side: taken as a disconnect (as HTTP servers commonly do; a request
        # in progress is cancelled, so the instance frees its slot). The transport then closes.
        return None

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = bytearray()
        self.headers = []
        self.head_size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_LINE:
            raise HeadTooLarge(f"the request target is over {MAX_LINE} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 2 > MAX_LINE:
            raise HeadTooLarge(f"a header line is over {MAX_LINE} bytes")
        headers = self.headers
        if len(headers) >= MAX_HEADERS:
            raise HeadTooLarge(f"Too many headers: more than {MAX_HEADERS}")
        headers.append((name, value))
        self.head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        parser = self.parser
        method = parser.get_method().decode("ascii", "replace")
        size = len(method) + len(self.url) + 13 + self.head_size
        if size > self.policy.max_header_bytes:
            raise HeadTooLarge(f"the request line and headers are {size} bytes, over proxy.max_header_bytes")
        self._cancel_timer()
        self.head_bytes = 0
        self.in_body = True
        length: int | None = None
        chunked = upgrade = False
        # the headers every request reads, taken in this one pass (the first of a repeated one)
        content_type: bytes | None = None
        authorization: bytes | None = None
        expect: bytes | None = None
        for name, value in self.headers:
            low = name.lower()
            if low == b"content-type":
                if content_type is None:
                    content_type = value
            elif low == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise BadRequest("Content-Length is not a number") from None
            elif low == b"authorization":
                if authorization is None:
                    authorization = value
            elif low == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif low == b"expect":
                if expect is None:
                    expect = value
            elif low == b"upgrade":
                upgrade = True
        if upgrade or method == "CONNECT":
            raise BadRequest("protocol upgrades (Upgrade, CONNECT) are not supported by the proxy")
        if self.url[:1] != b"/" and not self.url.lower().startswith((b"http://", b"https://")):
            raise BadRequest("the request target must be a path (/v1/...) or an absolute http:// URL")
        version = parser.get_http_version()
        self.body = Body(self) if chunked or length else None  # None: nothing to receive
        body = self.body or EMPTY_BODY
        request = Request(
            method, self.url.decode("utf-8", "surrogateescape"), tuple(self.headers),
            (1, 1) if version == "1.1" else (1, 0), parser.should_keep_alive(), self.address or None,
            body, length, chunked, self,
            content_type=content_type.decode("utf-8", "surrogateescape") if content_type is not None else "",
            authorization=authorization.decode("utf-8", "surrogateescape") if authorization is not None else "",
            expect=expect.decode("utf-8", "surrogateescape") if expect is not None else None,
        )
        self.pipeline.append(request)
        if self.task is None:
            self._start(request)
        else:
            self.pause_reading()  # one request ahead is enough: the socket waits for the answers

    def on_body(self, body: bytes) -> None:
        if self.body is not None:
            self.body.feed(body)

    def on_message_complete(self) -> None:
        self.in_body = False
        if self.body is not None:
            self.body.feed_eof()
            self.body = None

    # -- requests and answers --------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self.task = self.loop.create_task(self._run(request))

    async def _run(self, request: Request) -> None:
        policy = self.policy
        try:
            answer = await self.server.handler(request)
        except asyncio.CancelledError:
            return  # the client went away (or the server is closing)
        except Exception as exc:  # a bug in the proxy: logged, rate-limited; the client gets a 500
            if request.started:
                self._abort()
                return
            answer = policy.crashed(500, exc, self.peer)
            answer.force_close()
        finally:
            self.task = None
        if self.transport is None:
            return
        if self.pipeline and self.pipeline[0] is request:
            self.pipeline.popleft()
        keep = request.keep_alive and not answer.close and not self.closing
        if isinstance(answer, StreamAnswer):
            if not answer.prepared:  # nothing went out (the client left first)
                self._abort()
                return
            keep = keep and answer.keep_alive and answer.complete
            if not answer.complete:
                self._abort() if answer.chunked else self._close()
                return
        else:
            self.transport.write(answer.encode(request.version, keep, request.method == "HEAD"))
        if not keep or not request.content.is_eof():
            self.end_after_answer()  # nothing more is read (of the body either)
        else:
            self._next()

    def _next(self) -> None:
        """The answer went out on a kept connection: the next pipelined request, or wait for one."""
        self.resume_reading()  # (the next request's body, if it is pipelined, is read as its handler wants it)
        if self.pipeline:
            self._start(self.pipeline[0])
            return
        if self.head_bytes:  # the next request's head has begun: its deadline runs from its first byte
            return
        self._arm(self.policy.timeout, self._idle_too_long, True)

    # -- ends of a connection ------------------------------------------------------------------

    def _arm(self, delay: float, callback: Callable[[], None], idle: bool = False) -> None:
        """`callback` in `delay` seconds, in place of the deadline set before. The timer already
        there is kept when it is due no later (it then finds the deadline moved, and waits again
        for the rest): only a deadline earlier than the timer makes a new one."""
        at = self.clock.time() + delay
        self.deadline = at
        self.on_deadline = callback
        self.idle = idle
        if self.deadline_timer is None or self.deadline_timer_at > at:
            if self.deadline_timer is not None:
                self.deadline_timer.cancel()
            self.deadline_timer = self.clock.call_at(at, self._deadline_due)
            self.deadline_timer_at = at

    def _deadline_due(self) -> None:
        self.deadline_timer = None
        at = self.deadline
        if at is None or self.closing:
            return
        if self.clock.time() < at - DEADLINE_SLACK:  # moved later since the timer was set: wait for the rest
            self.deadline_timer = self.clock.call_at(at, self._deadline_due)
            self.deadline_timer_at = at
            return
        self.deadline = None
        self.idle = False
        self.on_deadline()

    def _cancel_timer(self) -> None:
        """No deadline (its timer, if any, finds none when due) and no probe or linger timer."""
        self.idle = False
        self.deadline = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _stop_deadline(self) -> None:
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
            self.deadline_timer = None

    def _head_late(self) -> None:
        if not self.closing and self.transport is not None and self.task is None:
            self.policy.no_request_in_time(self.peer)
            self._close()

    def _idle_too_long(self) -> None:
        if self.task is None and not self.pipeline and self.head_bytes == 0:
            self._close()

    def _close(self) -> None:
        """Close once what was written is sent."""
        if self.transport is not None and not self.closing:
            self.closing = True
            self._cancel_timer()
            self._stop_deadline()
            self.transport.close()

    def _abort(self) -> None:
        if self.transport is not None:
            self.closing = True
            self._cancel_timer()
            self._stop_deadline()
            self.transport.abort()

    def _malformed(self, error: BadRequest) -> None:
        """The parser refused the connection's bytes: the request being received fails."""
        body = self.body
        if body is not None and self.task is not None and not body.is_eof():
            # refused after the headers (a bad chunk): the handler reading the body answers it
            body.set_exception(error)
            self.body = None
            self.in_body = False
            self.probe = bytearray()  # nothing more is parsed: later bytes are dropped
            return
        self._refuse(error)

    def _refuse(self, error: BadRequest) -> None:
        """Answer a request that never reached a handler (431, 400), then end the connection. A
        request already being answered gets its answer first: the refusal is for what followed."""
        if self.task is not None or self.pipeline:
            self.probe = bytearray()  # drop the rest; the answer in progress ends the connection
            for request in self.pipeline:
                request.keep_alive = False
            return
        self.last_word(raw_response(self.policy.malformed(error.status, error, self.peer)))

    def last_word(self, answer: bytes) -> None:
        """Send `answer` and end the connection without reading another request."""
        if self.transport is None or self.closing:
            return
        self.transport.write(answer)
        self.end_after_answer()

    def end_after_answer(self) -> None:
        """Close once what was written is sent, reading and dropping the client's bytes meanwhile
        (at most LINGER seconds and LINGER_BYTES), so that it gets the answer, not a reset."""
        transport = self.transport
        if transport is None or self.closing:
            return
        self.resume_reading()  # (read and dropped from now on: a paused socket would make the close a reset)
        self.closing = True
        self.probe = bytearray()  # from now on, data is dropped
        if transport.can_write_eof():
            transport.write_eof()
            self._cancel_timer()
            self._stop_deadline()
            self.timer = self.clock.call_later(LINGER, self._linger_over)
        else:
            transport.close()

    def _linger_over(self) -> None:
        self.timer = None
        if self.transport is not None:
            self.transport.close()

    # -- connections over a limit --------------------------------------------------------------

    def _probe_data(self, data: bytes) -> None:
        probe = self.probe
        assert probe is not None
        if not self.probing or self.timer is None or self.transport is None:
            self.dropped += len(data)  # lingering after an answer: dropped
            if self.dropped > LINGER_BYTES and self.transport is not None and not self.reading_paused:
                # enough: nothing more is read; the close comes at the linger's end (the client,
                # if it reads while it sends, has its answer by then)
                self.reading_paused = True
                self.transport.pause_reading()
            return
        probe += data
        end = probe.find(b"\r\n")
        if end >= 0:
            self._probe_end(bytes(probe[:end]))
        elif len(probe) > PROBE_BYTES:
            self._probe_end(b"")

    def _probe_end(self, request_line: bytes) -> None:
        """A connection over a limit: /health's or /ready's answer, or the refusal; then closed."""
        if self.timer is None:
            return  # answered already
        self._cancel_timer()
        self._release_probe()
        assert self.refusal is not None
        self.last_word(self.policy.probe_answer(request_line, self.refusal))

    def probe_evicted(self) -> None:
        self._probe_end(b"")

    def _release_probe(self) -> None:
        if self.probing:
            self.probing = False
            self.policy.probe_done(self)

    # -- the server closing ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """The server closes: an idle connection now, a busy one once its answer is out."""
        for request in self.pipeline:
            request.keep_alive = False
        if self.task is None and not self.pipeline:
            self._close()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self._abort()


class FrontServer:
    """The listening socket and its connections: `handler(request)` answers each request."""

    def __init__(self, handler: Handler, policy: ClientPolicy, clock: Clock | None = None) -> None:
        self.handler = handler
        self.policy = policy
        self.loop = asyncio.get_running_loop()
        self.clock: Clock = clock or self.loop
        self.connections: set[ClientConnection] = set()
        self.listener: asyncio.base_events.Server | None = None

    async def listen(self, host: str, port: int) -> int:
        """Start listening; the port (given, or the one the system chose for 0)."""
        self.listener = await self.loop.create_server(
            lambda: ClientConnection(self), host, port, backlog=1024, reuse_address=True,
        )
        return self.listener.sockets[0].getsockname()[1]

    def stop_listening(self) -> None:
        """No new connections; the open ones stay."""
        if self.listener is not None:
            self.listener.close()

    async def close(self, grace: float = 1.0) -> None:
        """Stop listening, close idle connections, give requests in progress `grace` seconds, then
        cut them."""
        self.stop_listening()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = self.loop.time() + grace
        while any(conn.task is not None for conn in self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.cancel()
        if self.listener is not None:
            await self.listener.wait_closed()
            self.listener = None
        await asyncio.sleep(0)  # let the cancelled handlers run their cleanup
