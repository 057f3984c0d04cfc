"""Forwarding one client request to one instance, byte for byte.

The life of a request, and what can end it:
  queued       body read, size-checked, JSON-validated; an instance chosen    -> 400/413/503
  first_byte   sent upstream, waiting for the status line and the first body byte
               connect error or 503 from the instance -> the next instance (only here: nothing
               has reached the client yet, so a retry cannot duplicate a generation)
               first_byte_timeout                                            -> 504
  streaming    SSE relayed chunk by chunk as it arrives; idle_timeout between chunks, no overall
               cap; the instance dying                                       -> error event, clean end
  response     a non-streaming body (Content-Length) read whole, then sent   -> 502 if it breaks
A client disconnect in any phase cancels the handler (aiohttp's handler_cancellation) and closing
the upstream response closes its connection, so vLLM sees the disconnect and frees the slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web
from multidict import CIMultiDict

from supervisor.backends import Backend, BackendPool
from supervisor.config import ProxyConfig
from supervisor.proxy import errors
from supervisor.proxy.metrics import ProxyMetrics, route_label
from supervisor.proxy.upstream import ConnectFailed, UpstreamBroken, UpstreamClient, UpstreamResponse

log = logging.getLogger("vsup.proxy")

# RFC 9110 §7.6.1 hop-by-hop headers, plus the ones the proxy sets itself for the next hop.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)
_DROP_REQUEST = frozenset(h.encode() for h in HOP_BY_HOP | {"host", "content-length", "expect"})
_DROP_REQUEST_AUTH = _DROP_REQUEST | {b"authorization"}
_DROP_RESPONSE = frozenset(h.encode() for h in HOP_BY_HOP | {"content-length"})
_PROXY_PREFIX = b"proxy-"

RETRY_AFTER_SECONDS = 1


def _connection_tokens(value: bytes) -> frozenset[bytes]:
    return frozenset(token.strip().lower() for token in value.split(b",") if token.strip())


def request_headers(raw_headers: tuple[tuple[bytes, bytes], ...], drop_authorization: bool) -> bytes:
    """The client's header lines, as it sent them, minus hop-by-hop ones (and its Authorization
    when the proxy checked it: the instances listen on loopback without a key)."""
    drop = _DROP_REQUEST_AUTH if drop_authorization else _DROP_REQUEST
    kept = []
    named = None
    for key, value in raw_headers:
        low = key.lower()
        if low in drop or low.startswith(_PROXY_PREFIX):
            if low == b"connection":
                named = _connection_tokens(value) | (named or frozenset())
            continue
        kept.append((low, key, value))
    if named:
        return b"".join(b"%s: %s\r\n" % (key, value) for low, key, value in kept if low not in named)
    return b"".join(b"%s: %s\r\n" % (key, value) for _, key, value in kept)


def response_headers(raw_headers: list[tuple[bytes, bytes]]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    named = None
    for key, value in raw_headers:
        low = key.lower()
        if low in _DROP_RESPONSE or low.startswith(_PROXY_PREFIX):
            if low == b"connection":
                named = _connection_tokens(value) | (named or frozenset())
            continue
        out.add(key.decode("latin-1"), value.decode("utf-8", "replace"))
    if named:
        for name in named:
            out.popall(name.decode("latin-1"), None)
    return out


def _is_json(content_type: str) -> bool:
    # application/json, application/json; charset=utf-8, application/vnd.x+json
    base = content_type.split(";", 1)[0].strip().lower()
    return base == "application/json" or base.endswith("+json")


class Exchange:
    """One request in flight: its phase, and a watchdog that cancels the handler when the
    instance stays silent too long or the proxy drains. Per chunk the relay only stores a
    timestamp; the timer re-arms itself lazily, so a long stream costs one timer, not one per chunk."""

    __slots__ = ("loop", "task", "limit", "limit_key", "last", "handle", "reason", "phase", "stream", "idle_limit", "first_data_at", "sent_at")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        self.loop = loop
        self.task = task
        self.limit = 0.0
        self.limit_key = ""
        self.last = 0.0
        self.handle: asyncio.TimerHandle | None = None
        self.reason: str | None = None  # set when the proxy itself cancels: timeout or drain
        self.phase = "queued"
        self.stream = False
        self.idle_limit = 0.0
        self.first_data_at: float | None = None
        self.sent_at = 0.0

    def on_data(self) -> None:
        """A piece of the response body arrived: from now on the limit is the idle timeout."""
        self.last = now = self.loop.time()
        if self.first_data_at is None:
            self.first_data_at = now
            self.arm(self.idle_limit, "proxy.idle_timeout")

    def arm(self, limit: float, key: str) -> None:
        """A new phase with its own limit (a few times per request, so a fresh timer is fine)."""
        self.limit = limit
        self.limit_key = key
        self.last = self.loop.time()
        if self.handle is not None:
            self.handle.cancel()
        self.handle = self.loop.call_at(self.last + limit, self._check)

    def _check(self) -> None:
        due = self.last + self.limit
        if self.loop.time() >= due - 0.001:
            self.handle = None
            self.abort("timeout")
        else:
            self.handle = self.loop.call_at(due, self._check)

    def abort(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.task.cancel()

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class Forwarder:
    """Sends /v1/* (and /tokenize, /detokenize) to a ready instance and relays the answer."""

    def __init__(
        self,
        config: ProxyConfig,
        pool: BackendPool,
        balancer,
        client: UpstreamClient,
        metrics: ProxyMetrics,
        *,
        drop_authorization: bool,
    ) -> None:
        self.config = config
        self.pool = pool
        self.balancer = balancer
        self.client = client
        self.metrics = metrics
        self.drop_authorization = drop_authorization
        self.in_flight: dict[str, int] = {}
        self.active: set[Exchange] = set()
        self.draining = False

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        route = route_label(request.path)
        if self.draining:
            response = errors.unavailable("the proxy is shutting down; retry on another replica or shortly", RETRY_AFTER_SECONDS)
            response.force_close()
            self.metrics.request(route, 503, "")
            return response
        exchange = Exchange(asyncio.get_running_loop(), asyncio.current_task())  # type: ignore[arg-type]
        self.active.add(exchange)
        try:
            response, instance = await self._handle(request, exchange)
        except asyncio.CancelledError:
            if exchange.reason is None:
                self.metrics.disconnect(exchange.phase)
            raise
        finally:
            exchange.disarm()
            self.active.discard(exchange)
        self.metrics.request(route, response.status, instance)
        return response

    async def _handle(self, request: web.BaseRequest, exchange: Exchange) -> tuple[web.StreamResponse, str]:
        limit = self.config.max_body_bytes
        body = b""
        if request.body_exists:
            declared = request.content_length
            if declared is not None and declared > limit:
                return errors.too_large(declared, limit), ""
            try:
                body = await request.read()  # the app's client_max_size == max_body_bytes
            except web.HTTPRequestEntityTooLarge:
                return errors.too_large(None, limit), ""
            if body and _is_json(request.headers.get("Content-Type", "")):
                try:
                    document = json.loads(body)
                except (ValueError, UnicodeDecodeError) as exc:
                    return errors.bad_request(f"the request body is not valid JSON: {exc}"), ""
                if not isinstance(document, dict):
                    return errors.bad_request(f"the request body must be a JSON object, got {type(document).__name__}"), ""
                exchange.stream = document.get("stream") is True

        headers = request_headers(request.raw_headers, self.drop_authorization)
        # The request target exactly as the client sent it (path and query, still percent-encoded).
        target = request.raw_path.encode("utf-8", "surrogateescape")
        tried: list[str] = []
        fallback: web.Response | None = None  # what to answer if every attempt fails
        while True:
            backend = self.balancer.choose(self.pool.ready(), self.in_flight, tried)
            if backend is None:
                if fallback is not None:
                    return fallback, tried[-1]
                return errors.unavailable("no ready instance: all instances are starting, restarting or unhealthy", RETRY_AFTER_SECONDS), ""
            tried.append(backend.name)
            name = backend.name
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
            try:
                outcome = await self._attempt(request, exchange, backend, target, body, headers)
            finally:
                left = self.in_flight[name] - 1
                if left:
                    self.in_flight[name] = left
                else:
                    del self.in_flight[name]
            if isinstance(outcome, web.StreamResponse):
                return outcome, name
            fallback, reason = outcome
            if reason is None or len(tried) > self.config.retries:
                return fallback, name
            self.metrics.retry(reason)

    async def _attempt(self, request, exchange: Exchange, backend: Backend, target: bytes, body: bytes, headers: bytes):
        """One try on one instance: a response for the client, or (fallback, reason) to retry."""
        exchange.phase = "queued"  # until a connection to the instance is ours
        exchange.arm(self.config.first_byte_timeout, "proxy.first_byte_timeout")
        exchange.first_data_at = None
        upstream: UpstreamResponse | None = None
        try:
            try:
                conn = await self.client.connect(backend.url)
                exchange.phase = "first_byte" if exchange.stream else "non_streaming"
                exchange.sent_at = exchange.loop.time()
                started = time.monotonic()
                upstream = await self.client.send(conn, request.method, target, headers, body)
            except ConnectFailed as exc:
                self.metrics.upstream_error(backend.name, "connect")
                log.warning("instance %s: %s", backend.name, exc)
                return errors.bad_gateway(f"instance {backend.name}: {exc}"), "connect"
            except UpstreamBroken as exc:
                self.metrics.upstream_error(backend.name, "broken")
                return errors.bad_gateway(f"instance {backend.name} failed before answering: {exc}"), None

            if upstream.status == 503:
                # vLLM says it cannot take the request now (e.g. shutting down): try another.
                try:
                    content = await upstream.read()
                except UpstreamBroken:
                    content = b""
                self.metrics.upstream_error(backend.name, "503")
                relayed = web.Response(status=503, body=content, headers=response_headers(upstream.raw_headers))
                relayed.headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))
                return relayed, "503"

            content_type = upstream.header(b"content-type") or b""
            sse = content_type.startswith(b"text/event-stream")
            if sse or upstream.header(b"content-length") is None:
                return await self._relay_stream(request, exchange, backend, upstream, started, sse)
            return await self._relay_body(exchange, backend, upstream, started)
        except asyncio.CancelledError:
            if exchange.reason is None:
                raise  # the client went away: the finally below drops the upstream connection
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return self._proxy_abort_response(exchange, backend)
        finally:
            if upstream is not None:
                upstream.close()  # back to the pool after a complete response; otherwise dropped

    def _proxy_abort_response(self, exchange: Exchange, backend: Backend) -> web.StreamResponse:
        if exchange.reason == "timeout":
            return errors.gateway_timeout(self._abort_message(exchange, backend))
        return errors.unavailable("the proxy is shutting down and the drain deadline passed", RETRY_AFTER_SECONDS)

    async def _relay_body(self, exchange: Exchange, backend: Backend, upstream: UpstreamResponse, started: float):
        exchange.phase = "response"
        self.metrics.ttfb(False, time.monotonic() - started)
        exchange.arm(self.config.idle_timeout, "proxy.idle_timeout")
        try:
            content = await upstream.read()
        except UpstreamBroken as exc:
            self.metrics.upstream_error(backend.name, "broken")
            return errors.bad_gateway(f"instance {backend.name} broke off its response: {exc}")
        self.metrics.duration(False, time.monotonic() - started)
        return web.Response(status=upstream.status, body=content, headers=response_headers(upstream.raw_headers))

    async def _relay_stream(self, request, exchange: Exchange, backend: Backend, upstream: UpstreamResponse, started: float, sse: bool):
        out = web.StreamResponse(status=upstream.status, headers=response_headers(upstream.raw_headers))
        if sse:
            # Nobody between us and the client may buffer or compress the events.
            out.headers["X-Accel-Buffering"] = "no"
            out.headers["Cache-Control"] = "no-cache"
        exchange.phase = "streaming"
        exchange.idle_limit = self.config.idle_timeout
        try:
            await out.prepare(request)
            transport = request.transport
            if transport is None:  # the client left before its headers went out
                self.metrics.disconnect("streaming")
                return out
            writer = request.writer
            await upstream.relay(transport, writer.chunked, writer.drain, exchange.on_data)
        except asyncio.CancelledError:
            if exchange.reason is None:
                raise  # the client went away
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return await self._end_stream(request, out, sse, backend, self._abort_message(exchange, backend))
        except UpstreamBroken as exc:
            self.metrics.upstream_error(backend.name, "broken")
            log.warning("instance %s broke off a stream: %s", backend.name, exc)
            return await self._end_stream(request, out, sse, backend, f"instance {backend.name} failed mid-stream: {exc}")
        except ConnectionResetError:  # our write to the client failed: it is gone
            self.metrics.disconnect("streaming")
            return out
        if exchange.first_data_at is not None:
            self.metrics.ttfb(True, exchange.first_data_at - exchange.sent_at)
        self.metrics.duration(True, time.monotonic() - started)
        await out.write_eof()
        return out

    def _abort_message(self, exchange: Exchange, backend: Backend) -> str:
        if exchange.reason == "timeout":
            self.metrics.upstream_error(backend.name, "timeout")
            return f"instance {backend.name} sent nothing for {exchange.limit:g} s ({exchange.limit_key})"
        return "the proxy is shutting down and the drain deadline passed; the generation was aborted"

    async def _end_stream(self, request, out: web.StreamResponse, sse: bool, backend: Backend, message: str) -> web.StreamResponse:
        """After the first byte the status is gone: an SSE client gets an error event and a clean
        end; any other body can only be cut, so the client sees a broken transfer, not a short one."""
        try:
            if not out.prepared:
                await out.prepare(request)
            if sse:
                await out.write(errors.sse_error_event(message, "upstream_error", "upstream_error"))
                await out.write_eof()
            elif request.transport is not None:
                request.transport.abort()
        except ConnectionResetError:
            self.metrics.disconnect("streaming")
        return out
