"""Forwarding one client request to one instance, byte for byte.

(Over 400 lines for a reason: the phases below are one request's path, and the hot path of
every request; its codecs (codec.py) and its state (exchange.py) are already outside.)

The life of a request, and what can end it:
  body         the rest of a body that did not come with the headers (after `100 Continue`
               when the client waits for it); not all in within proxy.body_timeout, or
               still here when a drain starts                                -> 408/503
  queued       body size-checked, JSON-validated; in a fleet its model's instances
               (routing.py); an instance chosen                             -> 400/404/413/503
  waiting      with a gate (gate.py): its priority and its key's rate limit  -> 400/429;
               every instance of its model full: it waits (admission.py)    -> 429/503
  first_byte   sent upstream, waiting for the status line and the first body byte
               connect error, stale keep-alive connection, 503 from the instance, or a
               connection broken by an instance shown gone within GONE_GRACE (out of the
               rotation, or its port refuses connections) -> the next instance (only here:
               nothing has reached the client yet, so a retry cannot duplicate a generation);
               an unreachable instance is ejected; none left               -> 503
               first_byte_timeout                                            -> 504
  streaming    SSE relayed chunk by chunk as it arrives; idle_timeout between chunks, no overall
               cap; the instance dying                                       -> error event, clean end
  response     a non-streaming body (Content-Length) read whole, then sent   -> 502 if it breaks
A client disconnect in any phase cancels the handler (client_conn.py) and closing
the upstream response closes its connection, so vLLM sees the disconnect and frees the slot.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from vsup.config.schema import ProxyConfig
from vsup.proxy import codec, errors, usage
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.batch_share import BUSY, BUSY_HEADER, PREEMPTED, BatchShare, lowest_below
from vsup.proxy.bodyparse import INLINE_BYTES, BodyParser, NotAnObject, ParserUnavailable, refuse_non_object
from vsup.proxy.budget import BodyBudget
from vsup.proxy.clients import ClientPolicy
from vsup.proxy.clock import Clock, Handle
from vsup.proxy.codec import header_lines, is_json, parse_json, request_headers, response_head, response_headers
from vsup.proxy.errors import RETRY_AFTER_SECONDS
from vsup.proxy.exchange import Exchange
from vsup.proxy.gate import Gate
from vsup.proxy.load import Prefill
from vsup.proxy.messages import HTTP_11, Answer, BadRequest, RawResponse, Request, Response, StreamAnswer
from vsup.proxy.metrics import ProxyMetrics, route_label
from vsup.proxy.ratelimit import Charge
from vsup.proxy.routing import WAIT, ModelRouter, Route
from vsup.proxy.stall import PrefillRates, stalled
from vsup.proxy.upstream import UpstreamClient
from vsup.proxy.upstream_conn import ConnectFailed, StaleConnection, UpstreamBroken, UpstreamResponse

log = logging.getLogger("vsup.proxy")

# The admin route whose adapter name is checked against the names the models own.
LOAD_ADAPTER = "/v1/load_lora_adapter"
# How long a connection broken before its first byte waits for the supervisor to report the
# instance's exit (milliseconds in practice; generous for a loaded machine).
GONE_GRACE = 1.0
# Meanwhile, how often the instance's port is tried (refused: the process is gone).
GONE_PROBE_PERIOD = 0.1
# Passive ejection: an instance the proxy could not reach (connect refused, reset or timed out;
# a connection broken before any byte with nothing listening any more) leaves the rotation for
# at most this long; its owner's next "ready" (health check, restart) brings it back sooner.
# nginx's fail_timeout default. Would be proxy.eject_seconds if it ever needs tuning.
EJECT_SECONDS = 10.0
# How often (clock seconds) the watchdog looks for stalled instances (stall.py).
STALL_CHECK_EVERY = 1.0
# Retry reasons that mean "this instance cannot be reached" (and so was ejected).
_UNREACHABLE = frozenset({"connect", "gone"})
# Longest period of the timeout watchdog (shorter when a configured timeout is very short).
WATCHDOG_TICK = 0.1
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
MiB = 1024 * 1024
TOO_DEEP = "the request body is not valid JSON: it is nested too deeply to parse"
# What a relayed event stream always carries, whatever the instance said about it: nobody between
# us and the client may buffer or compress the events.
SSE_HEADERS = b"X-Accel-Buffering: no\r\nCache-Control: no-cache\r\n"
_SSE_OURS = frozenset({b"x-accel-buffering", b"cache-control"})
_BUSY_HEADER = BUSY_HEADER.encode()


def _says_busy(raw_headers: list[tuple[bytes, bytes]]) -> bool:
    """An upstream vsup's answer `x-vsup-batch: busy` (batch_share.py): no slot for a batch line there now."""
    busy = BUSY.encode()
    return any(key.lower() == _BUSY_HEADER and value.strip() == busy for key, value in raw_headers)


def _refused_start(piece: bytes) -> Response | None:
    """The 400 for a JSON body whose first bytes show it is no object (bodyparse.refuse_non_object)."""
    try:
        refuse_non_object(piece)
    except NotAnObject as exc:
        return errors.bad_request(str(exc))
    except RecursionError:
        return errors.bad_request(TOO_DEEP)
    return None


class Forwarder:
    """Sends a request on a forwarded route (vsup/config/proxy_routes.py) to a ready instance and relays the answer."""

    def __init__(
        self,
        config: ProxyConfig,
        pool: BackendPool,
        balancer,
        client: UpstreamClient,
        metrics: ProxyMetrics,
        clients: ClientPolicy,
        *,
        drop_authorization: bool,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.balancer = balancer
        self.client = client
        self.metrics = metrics
        self.clients = clients
        self.drop_authorization = drop_authorization
        self.router: ModelRouter | None = None  # routing by model (a fleet); None: one balancer over every instance
        self.gate: Gate | None = None  # priorities, rate limits, admission (server.py builds it when configured)
        self.budget: BodyBudget | None = None  # proxy.max_body_buffer: the bodies held at once, proxy-wide
        self.parser: BodyParser | None = None  # big JSON bodies parsed off the event loop
        self.in_flight: dict[str, int] = {}
        self.prefill = Prefill()  # of those, the ones still without their first byte (load.py)
        self.active: set[Exchange] = set()
        self.draining = False
        self.loop = asyncio.get_running_loop()
        self.clock: Clock = clock or self.loop  # every time limit below is read and armed through it
        # The watchdog's period: a limit is enforced within one tick of its deadline.
        self.tick = max(0.005, min(WATCHDOG_TICK, config.first_byte_timeout / 4, config.idle_timeout / 4, config.body_timeout / 4,
                                   config.queue_timeout / 4))
        self._watchdog: Handle | None = None
        self.rates = PrefillRates()  # each model's slowest recent prefill (stall.py)
        self._stall_check_at = 0.0
        # batch lines (handle(batch=True)): each instance's share of them (batch_share.py), their
        # priority (batch.priority; None: one below the lowest in use) and who hears of a freed slot
        self.share = BatchShare(self.in_flight, self.clock.time)
        self.share.waiting = self._waiting
        self.share.granted = self._granted
        self.share.admits = self._admits
        self.batch_priority: int | None = None
        self.batch_freed: Callable[[], None] | None = None

    # -- batch lines' figures (batch_share.py reads them)
    def _waiting(self, queue: str) -> int:
        gate = self.gate
        return len(gate.admission.queues.get(queue, ())) if gate is not None else 0

    def _granted(self, name: str) -> int:
        gate = self.gate
        return gate.admission.reserved.get(name, 0) if gate is not None else 0

    def _admits(self, backend: Backend) -> int | None:
        gate = self.gate
        return None if gate is None else gate.admission.space(backend, self.lowest_priority())

    def lowest_priority(self) -> int:
        """The batch lines' admission priority."""
        if self.batch_priority is not None:
            return self.batch_priority
        gate = self.gate
        if gate is None:
            return -1
        return lowest_below([k.priority for k in gate.keys.values()] + list(gate.values.values()))

    def batch_room(self, model: str | None) -> int:
        """How many more batch lines the instances of `model` (None: every instance) take now."""
        router = self.router
        if router is None or model is None:
            return self.share.total(self.pool.ready(), "")
        route = router.route_of(model)
        if route is None:  # an unknown name; or backends without models: routed as without a router
            return 0 if router.tagged else self.share.total(self.pool.ready(), "")
        return self.share.total(route.ready, route.model)

    def _busy(self) -> Response:
        """A batch line no instance has room for now: answered at once, never queued (the runner keeps it)."""
        return errors.error_response(
            503, "no instance of this model has a slot free for batch lines now: they take only what interactive requests leave",
            "service_unavailable", "batch_busy", headers={BUSY_HEADER: BUSY, "Retry-After": str(RETRY_AFTER_SECONDS)})

    def _sweep(self) -> None:
        """One timer for every request in flight (instead of arming and cancelling timers per
        request, which cost more than the rest of the bookkeeping): cancel the handlers whose
        instance has been silent past their phase's limit. Runs only while requests are active."""
        now = self.clock.time()
        for exchange in self.active:
            if now - exchange.last >= exchange.limit:
                exchange.abort("timeout")  # cancel() only schedules: `active` is unchanged here
        gate = self.gate
        if gate is not None and gate.admission.waiting:
            gate.admission.expire(now)  # waits past proxy.queue_timeout end with a 503
        if now >= self._stall_check_at:
            self._stall_check_at = now + STALL_CHECK_EVERY
            for name, requests in stalled(self.active, now, self.config.stall_timeout, self.rates, self._model_of).items():
                self._stalled(name, requests, now)  # type: ignore[arg-type]
        self._watchdog = self.clock.call_at(now + self.tick, self._sweep) if self.active else None

    def _model_of(self, name: str) -> str:
        backend = self.pool.get(name)
        return backend.model if backend is not None else ""

    def _stalled(self, name: str, requests: list[Exchange], now: float) -> None:
        """An instance holds requests and sends nothing to any (stall.py): out of the rotation now,
        its requests without a byte retried elsewhere, those streaming ended with an error event,
        and its owner told (vsup run restarts it)."""
        silent = min(now - exchange.last for exchange in requests)
        why = f"stalled: {len(requests)} request(s) without a byte for {silent:.0f} s (proxy.stall_timeout)"
        backend = self.pool.get(name)
        if backend is not None:
            self.metrics.upstream_error(name, "stalled", backend.model)
            if self.pool.eject(name, max(EJECT_SECONDS, self.config.stall_timeout)):
                self.metrics.ejection(name, backend.model)
        log.warning("instance %s: %s: out of the rotation; retrying those requests on another instance", name, why)
        self.pool.report_stalled(name, why)
        for exchange in requests:
            exchange.abort("stalled")

    async def handle(self, request: Request, client: str = "", batch: bool = False, rated: bool = False) -> Answer:
        """`batch`: a line of a batch (vsup/batch/runner.py): at the batch priority, only to an
        instance with room in its batch share, answered 503 `x-vsup-batch: busy` at once when none has.
        `rated`: a batch line that came from outside (a front's, or any client's `X-Vsup-Batch: line`):
        its key's rate limit still applies (the header only ever lowers a request)."""
        route = route_label(request.path)
        if self.draining:
            refused = errors.unavailable("the proxy is shutting down; retry on another replica or shortly", RETRY_AFTER_SECONDS)
            refused.force_close()
            self.metrics.request(route, 503, "")
            return refused
        loop = self.loop
        exchange = Exchange(asyncio.current_task(loop), self.clock.time())  # type: ignore[arg-type]
        self.active.add(exchange)
        if self._watchdog is None:
            self._watchdog = self.clock.call_at(self.clock.time() + self.tick, self._sweep)
        try:
            response, backend = await self._handle(request, exchange, client, batch, rated)
            if exchange.charge is not None:
                self._settle(exchange.charge, response)
        except asyncio.CancelledError:
            if exchange.reason is None:
                self.metrics.disconnect(exchange.phase)
            raise
        finally:
            self.active.discard(exchange)
            if exchange.held:
                self.budget.release(exchange.held)  # type: ignore[union-attr]
                exchange.held = 0
        if backend is None:
            self.metrics.request(route, response.status, "")
        else:
            self.metrics.request(route, response.status, backend.name, backend.model)
        return response

    async def _handle(self, request: Request, exchange: Exchange, client: str, batch: bool = False,
                      rated: bool = False) -> tuple[Answer, Backend | None]:
        """The stages of a request: read its body, route it to its model, gate it (priority, rate
        limit, admission), prepare the policy's key, then send it to an instance (retrying on
        another before the first byte) and relay the answer."""
        read = await self._read(request, exchange)
        if not isinstance(read, tuple):
            return read, None
        body, document = read
        routed = await self._route(request, body, document)
        if not isinstance(routed, tuple):
            return routed, None
        route, balancer = routed
        if route is not None and request.path == LOAD_ADAPTER:  # a name another model owns is never loaded (routing.py)
            if document is None:
                return errors.bad_request(f"{LOAD_ADAPTER} takes a JSON body (Content-Type: application/json)"), None
            refused = self.router.adapter_refused(route, document.get("lora_name"))  # type: ignore[union-attr]
            if refused is not None:
                return refused, None
        key = balancer.key(document, request.headers)  # prefix_affinity: its prefix or session; else None
        admitted: tuple[Backend, ...] | None = None  # the instances with room (admission), else None
        extra: list[tuple[bytes, bytes]] | None = None  # headers for the answer (x-ratelimit-*)
        gate = self.gate
        if batch:  # no wait, no rate limit (but a client's own): only the room interactive requests leave (batch_share.py)
            ready = route.ready if route is not None else self.pool.ready()
            if rated and gate is not None:
                charged = gate.rate(client, request.path, document, len(body), ready)
                if isinstance(charged, Response):
                    return charged, None
                extra, exchange.charge = charged
                extra = extra or None
            admitted = self.share.free(ready, route.model if route is not None else "")
            if not admitted:
                return self._busy(), None
        elif gate is not None:
            passed = await self._gate(request, exchange, gate, route, client, document, len(body))
            if not isinstance(passed, tuple):
                return passed, None
            admitted, extra, exchange.charge = passed
            if exchange.charge is not None and request.path in usage.STREAMS_USAGE and usage.streams(document):
                asked = usage.stream_request(document, body)  # type: ignore[arg-type]
                if asked is not None:  # vLLM sends the usage chunk, which settles the charge
                    body, client_asked = asked
                    exchange.charge.strip = not client_asked
        prepare = getattr(balancer, "prepare", None)
        if prepare is not None and key is not None:  # kv_aware: the prompt's tokens, from the instance's /tokenize
            key = await prepare(key, route.ready if route is not None else self.pool.ready(), self.in_flight)
        return await self._send(request, exchange, route, balancer, key, admitted, extra, body, batch)

    async def _read(self, request: Request, exchange: Exchange) -> tuple[bytes, dict | None] | Answer:
        """The body (bounded by proxy.max_body_bytes, proxy.body_timeout and the proxy-wide
        budget of bodies held) and, for JSON, the parsed document; or the answer instead."""
        if not request.body_exists:
            return b"", None
        limit = self.config.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            return errors.too_large(declared, limit)
        if declared is not None and not self._hold(exchange, declared):
            return self._over_budget(request)
        payload = request.content
        if payload.is_eof() and payload.error is None:
            # The whole body came with the headers (any small JSON request): take it as is.
            body = payload.read_nowait()
            if len(body) > limit:
                return errors.too_large(None, limit)
            if declared is None and not self._hold(exchange, len(body)):
                return self._over_budget(request)
        else:
            read = await self._read_body(request, exchange, limit, declared is None)
            if not isinstance(read, bytes):  # the answer instead of a body
                return read
            body = read
        document = None
        if body and is_json(request.content_type):
            parsed = await self._parse(body, request.remote)
            if not isinstance(parsed, dict):
                return parsed
            document = parsed
            exchange.stream = document.get("stream") is True
        return body, document

    async def _parse(self, body: bytes, client: str | None) -> dict | Answer:
        try:
            # a big body in a worker process (bodyparse.py): the loop goes on serving meanwhile;
            # clients take turns for the worker
            document = await self.parser.parse(body, client) if self.parser is not None else parse_json(body)
        except NotAnObject as exc:
            return errors.bad_request(str(exc))
        except ParserUnavailable as exc:
            return errors.unavailable(f"the proxy could not parse the request body now ({exc}): retry shortly", RETRY_AFTER_SECONDS)
        except (ValueError, UnicodeDecodeError) as exc:
            return errors.bad_request(f"the request body is not valid JSON: {exc}")
        except RecursionError:
            return errors.bad_request(TOO_DEEP)
        if not isinstance(document, dict):
            return errors.bad_request(f"the request body must be a JSON object, got {type(document).__name__}")
        return document

    def _hold(self, exchange: Exchange, size: int) -> bool:
        """Count `size` more bytes of this request's body against proxy.max_body_buffer."""
        budget = self.budget
        if budget is None or size <= 0:
            return True
        if not budget.reserve(size):
            return False
        exchange.held += size
        return True

    def _over_budget(self, request: Request) -> Response:
        budget = self.budget
        assert budget is not None
        self.metrics.body_budget_refusal()
        refused = errors.unavailable(
            f"the proxy holds {budget.held // MiB} MiB of request bodies, its limit (proxy.max_body_buffer):"
            " retry shortly", RETRY_AFTER_SECONDS)
        refused.force_close()  # the rest of the body is not read
        return refused

    async def _route(self, request: Request, body: bytes, document: dict | None):
        """In a fleet, the model's route and balancer (by the body's model, an upload's form field,
        or ?model=); else (None, the one balancer). Or the refusal."""
        router = self.router
        if router is None:
            return None, self.balancer
        asked = document.get("model") if document is not None else None
        if asked is None and body and document is None:  # an upload (audio): its form's model field
            asked = codec.form_field(body, request.content_type, "model")
        if asked is None:  # no body, or one without a model: the query parameter, if any
            asked = request.query.get("model")
        picked = router.pick(asked, False)
        if picked is WAIT:  # an adapter's name maybe, from an instance whose model list is on its way
            await router.settle(self.config.connect_timeout + 5.0)
            picked = router.pick(asked, True)
        if isinstance(picked, Route):
            return picked, picked.balancer
        if picked is not None:  # refused
            return picked
        return None, self.balancer  # no backend has a model: route as before

    async def _send(self, request: Request, exchange: Exchange, route: Route | None, balancer, key,
                    admitted: tuple[Backend, ...] | None, extra: list[tuple[bytes, bytes]] | None,
                    body: bytes, batch: bool = False) -> tuple[Answer, Backend | None]:
        """Attempts on the instances the balancer picks, until one answers or none is left."""
        router = self.router
        gate = self.gate
        headers = request_headers(request.raw_headers, self.drop_authorization)
        # The request target as the client sent it (path and query, still percent-encoded); an
        # absolute-form one (`POST http://host/v1/...`, as to a forward proxy) in origin-form; the
        # query without ?api_key= and percent-encoded where the instance's access log would show it raw.
        target = codec.forwarded_target(request.origin).encode("utf-8", "surrogateescape")
        exchange.size = len(body)  # (stall.py's prefill allowance)
        tried: list[str] = []
        fallback: Answer | None = None  # what to answer if every attempt fails
        reason: str | None = None
        unreachable: list[str] = []  # why each ejected instance could not be reached
        backend: Backend | None = None
        while True:
            last = backend
            if admitted is not None and not tried:
                ready = admitted
            elif route is None:
                ready = self.pool.ready()
            else:
                ready = router.current(route) if tried else route.ready  # type: ignore[union-attr]
            if batch and tried:  # a retry of a batch line: again only where its share has room
                ready = self.share.free(ready, route.model if route is not None else "")
            backend = balancer.choose(ready, self.in_flight, tried, key, exchange.size)
            if backend is None and reason == "stale" and tried.count(last.name) == 1 and self.pool.is_ready(last.name):  # type: ignore[union-attr]
                # A stale keep-alive connection and no other instance to try: one fresh
                # connection to the same instance (its idle ones were closed), which either
                # reaches a live server or is refused.
                backend = last
            if backend is None and batch and fallback is None:
                return self._busy(), None
            if backend is None:
                if reason in _UNREACHABLE:
                    return errors.no_reachable_instance(unreachable), None  # 503: none left to try
                if fallback is not None:
                    return fallback, last
                if route is not None:
                    return router.none_ready(route.name), None  # type: ignore[union-attr]
                return errors.no_ready_instance(), None
            tried.append(backend.name)
            name = backend.name
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
            if batch:
                self.share.started(name, exchange)
            else:
                share = self.share
                share.interactive(backend.model)
                if name in share.lines:
                    share.crowded(backend)  # batch lines there beyond their share now: the youngest stop
                if exchange.stream:  # no new line there before its first byte (batch_share.py)
                    share.hold(name, backend.model)
                    exchange.holds = (share, name)
            tokens = Prefill.estimate(balancer.prefill_bytes(exchange.size))  # a cached prefix is no prefill
            self.prefill.add(name, tokens)  # until its first byte: work ahead of the next request's first token
            exchange.prefill = (self.prefill, name, tokens)
            held = balancer.hold(name)  # prefix_affinity: its key's requests in flight there
            exchange.backend = name
            try:
                outcome = await self._attempt(request, exchange, backend, target, body, headers, extra, batch)
            finally:
                exchange.prefilled()
                if held is not None:
                    balancer.release(held)
                exchange.backend = None
                left = self.in_flight[name] - 1
                if left:
                    self.in_flight[name] = left
                else:
                    del self.in_flight[name]
                if batch:
                    self.share.ended(name, exchange)
                if gate is not None:
                    gate.admission.release(backend)  # the slot to the best waiter
                if self.batch_freed is not None:
                    self.batch_freed()  # a slot for the next batch line, maybe
            if not isinstance(outcome, tuple):  # an answer for the client
                return outcome, backend
            fallback, reason, why = outcome
            if reason in _UNREACHABLE:
                unreachable.append(f"instance {name}: {why}")
            if reason == PREEMPTED:  # an interactive request took the slot: busy, as a line that found none
                return fallback, None
            if reason is None:
                return fallback, backend
            if reason == "busy":  # (a node's vsup: its busy answer caps its share for a while)
                self.share.refused(name)
            if len(tried) > self.config.retries:
                if reason in _UNREACHABLE and not (self.pool.ready() if route is None else router.current(route)):  # type: ignore[union-attr]
                    return errors.no_reachable_instance(unreachable), None
                return fallback, backend
            if reason != "busy":
                self.metrics.retry(reason)

    async def _gate(self, request: Request, exchange: Exchange, gate: Gate, route: Route | None, client: str,
                    document: dict | None, size: int):
        """Priority, rate limit, admission: (the instances with room or None, the answer's extra
        headers), or the refusal. A wait ends with the client gone (the handler is cancelled: it
        leaves the queue), the drain (503) or proxy.queue_timeout (gate's 503)."""
        priority = gate.priority(client, request.headers)
        if isinstance(priority, Response):
            return priority
        router = self.router
        if route is not None and router is not None:
            queue, ready = route.model, (lambda: router.current(route))  # an alias or adapter: its model's queue
        else:
            queue, ready = "", self.pool.ready
        rated = gate.rate(client, request.path, document, size, ready())
        if isinstance(rated, Response):
            return rated
        extra, charge = rated
        exchange.phase = "waiting"
        # no phase limit while it waits (proxy.body_timeout's is over): the deadline is the queue's (gate.py)
        exchange.arm(math.inf, "proxy.queue_timeout", self.clock.time())
        try:
            admitted = await gate.admit(queue, ready, priority, client)
        except asyncio.CancelledError:
            if exchange.reason is None:
                raise  # the client went away: it has left the queue
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if charge is not None:
                charge.settle(None, True, self.clock.time())
            return errors.unavailable("the proxy is shutting down; send the request again", RETRY_AFTER_SECONDS)
        if isinstance(admitted, Response):
            if charge is not None:
                charge.settle(None, True, self.clock.time())  # never sent
            return admitted
        return admitted, extra or None, charge

    async def _read_body(self, request: Request, exchange: Exchange, limit: int, counted: bool) -> bytes | Answer:
        """A body that did not come whole with the headers, read as it arrives: at most `limit`
        bytes, all within proxy.body_timeout (a client that trickles it must not hold its
        connection and an in-flight slot for long, nor delay a drain, which aborts requests
        still in this phase); `counted`: each piece is counted against the budget as it comes (a
        chunked body; a declared length was counted whole). The answer to send instead when it
        fails; the rest of the body is then not read (the connection ends after the answer)."""
        exchange.phase = "body"
        # One deadline for the whole body: the watchdog's `last` is not moved on by each piece.
        exchange.arm(self.clients.body_timeout, "proxy.body_timeout", self.clock.time())
        expect = request.expect
        if expect is not None and expect.lower() == "100-continue" and request.version == HTTP_11:
            # The client waits for this before sending its body: auth and the declared size passed.
            transport = request.transport
            if transport is not None and not transport.is_closing():
                transport.write(CONTINUE)
        payload = request.content
        parts: list[bytes] = []
        size = 0
        response: Response
        # A big JSON body that is no object is refused by its first bytes: the rest is not read.
        check = request.content_length is None or request.content_length > INLINE_BYTES
        check = check and is_json(request.content_type)
        try:
            while piece := await payload.readany():
                size += len(piece)
                if size > limit:
                    response = errors.too_large(None, limit)
                    break
                if counted and not self._hold(exchange, len(piece)):
                    response = self._over_budget(request)
                    break
                if check:
                    check = False
                    refused = _refused_start(piece)
                    if refused is not None:
                        response = refused
                        break
                parts.append(piece)
            else:
                return b"".join(parts)
        except BadRequest as exc:  # the parser rejected the body (bad chunk size, ...)
            response = self.clients.malformed(400, exc, request.remote)
        except ConnectionResetError:
            raise asyncio.CancelledError from None  # the client went away: as a disconnect
        except asyncio.CancelledError:
            if exchange.reason is None:
                raise  # the client went away
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if exchange.reason == "timeout":
                response = self.clients.body_too_slow(request.remote)
            else:
                response = errors.unavailable("the proxy is shutting down; send the request again", RETRY_AFTER_SECONDS)
        response.force_close()
        return response

    async def _attempt(self, request, exchange: Exchange, backend: Backend, target: bytes, body: bytes, headers: bytes,
                       extra: list[tuple[bytes, bytes]] | None = None, batch: bool = False):
        """One try on one instance: a response for the client, or (fallback, reason, why): what
        to answer if nothing better comes, why to retry (None: do not) and what went wrong."""
        exchange.phase = "queued"  # until a connection to the instance is ours
        exchange.arm(self.config.first_byte_timeout, "proxy.first_byte_timeout", self.clock.time())
        exchange.first_data_at = None
        upstream: UpstreamResponse | None = None
        try:
            try:
                conn = self.client.idle_connection(backend.url) or await self.client.connect(backend.url)
                exchange.phase = "first_byte" if exchange.stream else "non_streaming"
                exchange.sent_at = self.clock.time()
                started = time.monotonic()
                upstream = await self.client.send(conn, request.method, target, headers, body)
            except ConnectFailed as exc:
                self.metrics.upstream_error(backend.name, "connect", backend.model)
                self._eject(backend, str(exc))
                return errors.bad_gateway(f"instance {backend.name}: {exc}"), "connect", str(exc)
            except StaleConnection as exc:
                # The request met a dead or closing socket, not a live server: as safe to retry as
                # a refused connect. The other idle connections to that process are likely stale too.
                self.client.close_idle(backend.url)
                self.metrics.upstream_error(backend.name, "stale", backend.model)
                log.warning("instance %s: %s", backend.name, exc)
                return errors.bad_gateway(f"instance {backend.name} failed before answering: {exc}"), "stale", str(exc)
            except UpstreamBroken as exc:
                self.metrics.upstream_error(backend.name, "broken", backend.model)
                failed = errors.bad_gateway(f"instance {backend.name} failed before answering: {exc}")
                gone = await self._gone(backend, exc)
                return failed, "gone" if gone else None, f"{exc}; {gone}" if gone else str(exc)

            if upstream.status == 503:
                # vLLM says it cannot take the request now (e.g. shutting down): try another.
                try:
                    content = await upstream.read()
                except UpstreamBroken:
                    content = b""
                if batch and _says_busy(upstream.raw_headers):
                    # a node's vsup has no room for this batch line now: no failure of the node (batch_share.py)
                    return self._busy(), "busy", f"instance {backend.name} has no slot free for batch lines"
                self.metrics.upstream_error(backend.name, "503", backend.model)
                relayed = Response(status=503, body=content, headers=response_headers(upstream.raw_headers))
                relayed.headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))
                return relayed, "503", "503 from the instance"

            kept, content_type, has_length = response_head(upstream.raw_headers)
            if extra:
                kept += extra
            sse = content_type.startswith(b"text/event-stream")
            if sse or not has_length:
                return await self._relay_stream(request, exchange, backend, upstream, kept, started, sse)
            whole = upstream.complete_body()
            if whole is not None:  # a small answer, all in with its headers: no await, no task switch
                elapsed = time.monotonic() - started
                self.metrics.ttfb(False, elapsed)
                self.rates.measured(backend.model, elapsed, exchange.size)
                self.metrics.duration(False, elapsed)
                return RawResponse(upstream.status, header_lines(kept), whole)
            return await self._relay_body(request, exchange, backend, upstream, kept, started)
        except asyncio.CancelledError:
            if exchange.reason is None:
                raise  # the client went away: the finally below drops the upstream connection
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if exchange.reason == PREEMPTED:  # a batch line an interactive request took the slot of (batch_share.py)
                exchange.reason = None
                return self._busy(), PREEMPTED, f"preempted on instance {backend.name} by an interactive request"
            if exchange.reason == "stalled":  # nothing reached the client: another instance may answer
                exchange.reason = None
                why = f"instance {backend.name} stalled: no byte within proxy.stall_timeout and its prefill allowance"
                return errors.bad_gateway(why), "stalled", why
            return self._proxy_abort_response(exchange, backend)
        finally:
            if upstream is not None:
                upstream.close()  # back to the pool after a complete response; otherwise dropped

    async def _gone(self, backend: Backend, exc: UpstreamBroken) -> str | None:
        """A connection to `backend` broke before any byte: is its process gone? Then nothing
        from it can reach any client and another instance may answer. A kill -9 tears down the
        listening socket, resetting the connections queued on it, a moment before the
        supervisor sees the exit (standalone, no supervisor will say so), and an exiting
        process closes its sockets one by one: so within GONE_GRACE, either the owner takes it
        out of the rotation or a connect to its port is refused (then it is ejected). An
        instance that still accepts connections after that stays a 502: it may be generating
        (an orphaned EngineCore holding the port keeps it so until the supervisor says).
        Returns how it was shown gone, or None."""
        loop = self.loop
        deadline = loop.time() + GONE_GRACE
        while True:
            if not self.pool.is_ready(backend.name):
                return "it left the rotation"
            if not await self.client.listening(backend.url):
                self._eject(backend, f"{exc}, and nothing listens on its port any more")
                return "nothing listens on its port any more"
            left = deadline - loop.time()
            if left <= 0:
                return None
            if await self.pool.wait_not_ready(backend.name, min(GONE_PROBE_PERIOD, left)):
                return "it left the rotation"

    def _eject(self, backend: Backend, why: str) -> None:
        """Passive health: an instance the proxy cannot reach leaves the rotation now, so the
        requests after this one do not pay for finding out again."""
        if self.pool.eject(backend.name, EJECT_SECONDS):
            self.metrics.ejection(backend.name, backend.model)
            log.warning("instance %s: %s: out of the rotation until its next good health check (at most %g s)",
                        backend.name, why, EJECT_SECONDS)
        else:
            log.warning("instance %s: %s", backend.name, why)

    def _proxy_abort_response(self, exchange: Exchange, backend: Backend) -> Answer:
        if exchange.reason == "timeout":
            return errors.gateway_timeout(self._abort_message(exchange, backend))
        return errors.unavailable("the proxy is shutting down and the drain deadline passed", RETRY_AFTER_SECONDS)

    async def _relay_body(self, request, exchange: Exchange, backend: Backend, upstream: UpstreamResponse, headers, started: float):
        exchange.phase = "response"
        self.metrics.ttfb(False, time.monotonic() - started)
        self.rates.measured(backend.model, time.monotonic() - started, exchange.size)
        exchange.arm(self.config.idle_timeout, "proxy.idle_timeout", self.clock.time())
        try:
            content = await upstream.read()
        except UpstreamBroken as exc:
            self.metrics.upstream_error(backend.name, "broken", backend.model)
            return errors.bad_gateway(f"instance {backend.name} broke off its response: {exc}")
        self.metrics.duration(False, time.monotonic() - started)
        return RawResponse(upstream.status, header_lines(headers), content)

    async def _relay_stream(self, request: Request, exchange: Exchange, backend: Backend, upstream: UpstreamResponse,
                            kept: list[tuple[bytes, bytes]], started: float, sse: bool) -> StreamAnswer:
        out = StreamAnswer(request, upstream.status)
        # an event stream always carries the proxy's caching headers (SSE_HEADERS), whatever the instance said
        head = header_lines([pair for pair in kept if pair[0].lower() not in _SSE_OURS]) + SSE_HEADERS if sse else header_lines(kept)
        exchange.phase = "streaming"
        exchange.idle_limit = self.config.idle_timeout
        try:
            sink = out.start(head)
            if sink is None:  # the client left before its headers went out
                self.metrics.disconnect("streaming")
                return out
            charge = exchange.charge
            if charge is not None and sse:  # the usage chunk settles the charge (and is not the client's unless it asked)
                counted = usage.UsageSink(sink, charge.strip is True)
                await upstream.relay(counted, exchange)
                if counted.usage is not None:
                    charge.settle(counted.usage, False, self.clock.time())
            else:
                await upstream.relay(sink, exchange)
            if exchange.first_data_at is not None:
                self.metrics.ttfb(True, exchange.first_data_at - exchange.sent_at)
                self.rates.measured(backend.model, exchange.first_data_at - exchange.sent_at, exchange.size)
            self.metrics.duration(True, time.monotonic() - started)
            # A client that leaves after the last piece makes this raise too (it is no error of ours).
            await out.write_eof()
        except asyncio.CancelledError:
            if exchange.reason is None:
                raise  # the client went away
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return await self._end_stream(request, out, sse, backend, self._abort_message(exchange, backend))
        except UpstreamBroken as exc:
            self.metrics.upstream_error(backend.name, "broken", backend.model)
            log.warning("instance %s broke off a stream: %s", backend.name, exc)
            return await self._end_stream(request, out, sse, backend, f"instance {backend.name} failed mid-stream: {exc}")
        except ConnectionResetError:  # our write to the client failed: it is gone
            self.metrics.disconnect("streaming")
        return out

    def _settle(self, charge: Charge, answer: Answer) -> None:
        """A key's token reservation, settled by the answer (ratelimit.py's rules): the usage of a
        JSON answer; nothing generated when the instance refused it (4xx/5xx without usage) or
        the proxy answered without sending it on (its 503s, 429s, 400s); kept whole when what was
        generated is unknown (a stream without its usage chunk, an answer cut off: 502, 504)."""
        now = self.clock.time()
        if isinstance(answer, RawResponse):
            used = usage.of_body(answer.body)
            charge.settle(used, used is None and answer.status >= 400, now)
        elif isinstance(answer, Response):
            charge.settle(None, answer.status not in (502, 504), now)
        # a StreamAnswer settled itself if its usage chunk came; else the reservation stays charged

    def _abort_message(self, exchange: Exchange, backend: Backend) -> str:
        if exchange.reason == "stalled":
            return f"instance {backend.name} stalled: it sent nothing to any of its requests (proxy.stall_timeout); it was taken out of the rotation"
        if exchange.reason == "timeout":
            self.metrics.upstream_error(backend.name, "timeout", backend.model)
            return f"instance {backend.name} sent nothing for {exchange.limit:g} s ({exchange.limit_key})"
        return "the proxy is shutting down and the drain deadline passed; the generation was aborted"

    async def _end_stream(self, request: Request, out: StreamAnswer, sse: bool, backend: Backend, message: str) -> StreamAnswer:
        """After the first byte the status is gone: an SSE client gets an error event and a clean
        end; any other body can only be cut, so the client sees a broken transfer, not a short one."""
        try:
            if sse:
                await out.write(errors.sse_error_event(message, "upstream_error", "upstream_error"))
                await out.write_eof()
            elif request.transport is not None:
                request.transport.abort()
        except ConnectionResetError:
            self.metrics.disconnect("streaming")
        return out
