"""ProxyServer: the aiohttp app, its own endpoints, start and drain.

Routes: the serving routes of vsup/config/proxy_routes.py (and the admin routes proxy.admin_routes
opens, behind an admin key) -> an instance (forward.py); GET /v1/models -> merged from the ready
instances (models.py); /health, /ready, /metrics (and pages added with add_page: vsup run's
/status) -> answered here; anything else -> 404 in the OpenAI error shape, never an instance.
Which key opens what: auth.py (the admin routes, /metrics and /status: an admin key; /metrics a
metrics key too). With a batch store (`batch`, `batch_dir`): /v1/files and /v1/batches ->
batch_routes.py for any serving key (its name owns what it makes; an admin key sees all), and
the batch runner (vsup/batch/runner.py) sends each line through the forwarder below every
interactive request (batch_share.py). A request marked `X-Vsup-Batch: line` (a front's batch line,
or any client's) is placed as a batch line here too, after its key's auth and rate limit.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import psutil

from vsup.batch.runner import Busy, Runner
from vsup.batch.slots import CPU_DEFAULT_SLOTS
from vsup.config import proxy_routes
from vsup.config.names import Name
from vsup.config.schema import BatchConfig, ProxyConfig, bytes_of
from vsup.errors import VsupError
from vsup.proxy import errors
from vsup.proxy.address import Sessions
from vsup.proxy.affinity import PrefixAffinity
from vsup.proxy.auth import ADMIN, METRICS, REFUSED, SERVING, BearerAuth, named_keys, roles
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.balancer import make_balancer
from vsup.proxy.batch_routes import is_batch_path
from vsup.proxy.batch_share import BUSY, BUSY_HEADER, LINE, LINE_HEADER
from vsup.proxy.bodyparse import BodyParser
from vsup.proxy.budget import BodyBudget, configured_limit
from vsup.proxy.client_conn import FrontServer
from vsup.proxy.clients import ClientPolicy
from vsup.proxy.clock import Clock
from vsup.proxy.errors import RETRY_AFTER_SECONDS
from vsup.proxy.forward import Forwarder
from vsup.proxy.gate import Gate, refit
from vsup.proxy.health import PROXY_HEADER
from vsup.proxy.load import LoadProbe
from vsup.proxy.messages import Answer, Body, RawResponse, Request, Response
from vsup.proxy.metrics import CONTENT_TYPE, ProxyMetrics, batch_families, preempted_family
from vsup.proxy.models import merged_models, models_of
from vsup.proxy.routing import ModelRouter
from vsup.proxy.upstream import UpstreamClient

if TYPE_CHECKING:
    from vsup.batch.store import Limits, Store
    from vsup.batch.watch import Watch

PageHandler = Callable[[Request, BearerAuth], Awaitable[Response]]

log = logging.getLogger("vsup.proxy")

# Shorter than uvicorn's 5 s keep-alive (vLLM's server): we drop an idle upstream connection
# before the instance does, so a request never races a connection the instance is closing.
UPSTREAM_KEEPALIVE = 4.0
# After the drain deadline, how long aborted streams get to write their error event.
ABORT_GRACE = 2.0
# When the proxy closes, how long a request still being answered gets before it is cut.
SHUTDOWN_GRACE = 1.0
HEALTHY = b'{"status": "ok"}'
# Admin routes after which an instance serves other model names (routing.py learns them again).
_ADAPTER_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
def limits_of(batch: BatchConfig) -> Limits:
    """The store's limits from the batch: section."""
    from vsup.batch.store import Limits

    return Limits(max_file_bytes=bytes_of(batch.max_file_bytes), max_total_bytes=bytes_of(batch.max_total_bytes),
                  retention=batch.retention, max_attempts=batch.max_attempts)


def _request_id(headers: Mapping[str, str] | None, body: bytes) -> str:
    """An answer's request id: its x-request-id header, else its JSON body's id."""
    if headers is not None:
        found = headers.get("x-request-id")
        if found:
            return found
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    found = document.get("id") if isinstance(document, dict) else None
    return found if isinstance(found, str) else ""


def _raw_header(lines: bytes, name: bytes) -> str | None:
    for line in lines.split(b"\r\n"):
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return None


_LINE_HEADER, _LINE = LINE_HEADER.encode(), LINE.encode()


def _marked_line(raw_headers: tuple[tuple[bytes, bytes], ...]) -> bool:
    """`X-Vsup-Batch: line` among the request's headers (on every forwarded request: no header view built)."""
    size = len(_LINE_HEADER)
    for key, value in raw_headers:
        if len(key) == size and key.lower() == _LINE_HEADER:
            return value.strip().lower() == _LINE
    return False


def _total_memory() -> int:
    return psutil.virtual_memory().total


def _has_dot_segment(path: str) -> bool:
    return any(segment in (".", "..") for segment in path.split("/"))


def _shown(raw_path: str, limit: int = 200) -> str:
    return repr(raw_path if len(raw_path) <= limit else raw_path[:limit] + "...")


class ProxyServer:
    """`models` (a fleet): each served model's name -> its ProxyConfig (policy and affinity
    settings; the front door's keys are always `config`'s); requests then go by their `model`
    (routing.py). None or empty: one balancer over every ready instance."""

    def __init__(self, config: ProxyConfig, pool: BackendPool, *, api_key: str | None = None,
                 models: Mapping[str, ProxyConfig] | None = None, clock: Clock | None = None,
                 names: Mapping[str, Name] | None = None, forward_key: bool = False,
                 batch: BatchConfig | None = None, batch_dir: Path | None = None,
                 batch_slots: Mapping[str, int] | None = None) -> None:
        self.config = config
        # the Batch API (vsup/batch/): on when `batch` is enabled and has a folder; `batch_slots`:
        # each model's slots per instance (vsup/batch/slots.py; vsup run reads them from vllm.args)
        self._batch = batch if batch is not None and batch.enabled and batch_dir is not None else None
        self._given_batch = batch  # (its share figures apply to send_line without a store too)
        self._batch_dir = batch_dir
        self._batch_slots = dict(batch_slots or {})
        self._store: Store | None = None
        self._runner: Runner | None = None
        self._batch_routes: Any = None
        self._watch: Watch | None = None
        # a front whose upstreams are vsups checking the same keys passes the client's key on to
        # them; any other proxy drops the Authorization it checked (vLLM has no use for it)
        self._forward_key = forward_key
        self.pool = pool
        # every time limit of the proxy runs on this clock (clock.py); None: the event loop's
        self._clock = clock
        if clock is not None:
            pool.clock = clock
        named = named_keys(config)
        self._auth = BearerAuth(api_key if api_key is not None else config.api_key, named, *roles(config))
        self._tokens = self._owner_tokens(api_key if api_key is not None else config.api_key, named)
        self._line_token = self._admin_token(api_key if api_key is not None else config.api_key, named, config)
        proxy_routes.require_key(config.admin_routes, self._auth.has_admin)
        self._routes = proxy_routes.table(config.admin_routes)
        # a fleet routes by model (routing.py: a balancer each): kv_aware's top-level one follows nothing
        self._balancer = make_balancer(config.policy, config, None if models else self.pool)
        self._forwarder: Forwarder | None = None
        self._client: UpstreamClient | None = None
        self._session: Sessions | None = None  # for /v1/models only
        self._front: FrontServer | None = None
        self._clients: ClientPolicy | None = None
        self._port: int | None = None
        self.metrics = ProxyMetrics(self.in_flight, pool.states, pool.is_ready, pool.models)
        self.metrics.policy, self.metrics.policy_decisions = self._balancer.name, self._balancer.decisions
        self.metrics.families.append(self._batch_families)  # vsup_batch_*: none while the Batch API is off
        self._router: ModelRouter | None = None
        self._model_configs = models
        self._names = names  # aliases and vllm.args adapters -> their model (vsup/config/names.py)
        self._gate: Gate | None = None  # priorities, rate limits, admission: built in start() when configured
        self._probe: LoadProbe | None = None  # the engines' load figures (load.py), while a policy uses them
        self._probe_task: asyncio.Task[None] | None = None
        self._set_models(config, models)
        self._own: dict[str, Callable[[Request], Awaitable[Response]]] = {
            "/health": self._health, "/ready": self._ready, "/metrics": self._metrics,
        }
        # vsup run's collection of the instances' metrics (observe/): its cached text is appended to /metrics
        self.extra_metrics: Callable[[], bytes] | None = None
        self._pid = str(os.getpid())
        pool.subscribe(self._on_backend_change)

    # -- the contract --------------------------------------------------------------------------

    async def start(self) -> None:
        config = self.config
        self._client = UpstreamClient(limit=config.max_connections, connect_timeout=config.connect_timeout, keepalive=UPSTREAM_KEEPALIVE,
                                      clock=self._clock)
        self._session = Sessions(
            connector={"limit": 0, "limit_per_host": 4, "keepalive_timeout": UPSTREAM_KEEPALIVE},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )
        # The client-connection policy (clients.py): a bound on open connections, a timeout on
        # half-sent requests, OpenAI-shaped answers to malformed ones.
        self._clients = ClientPolicy(self.metrics, config)
        # Answered even on connections over a limit (clients.py's probe slots), from the request line.
        self._clients.probes = {b"/health": lambda: (200, HEALTHY), b"/ready": self._readiness}
        self._clients.probe_headers = f"{PROXY_HEADER}: {self._pid}\r\n".encode()
        self.metrics.client_connections = lambda: self._clients.open if self._clients else 0
        self._forwarder = Forwarder(
            config, self.pool, self._balancer, self._client, self.metrics, self._clients,
            drop_authorization=self._auth.enabled and not self._forward_key, clock=self._clock,
        )
        self._forwarder.router = self._router
        self._set_gate(config, self._model_configs)
        self._probe = LoadProbe(self.pool.ready, self._forwarder.in_flight, self._session, config.load_interval,
                                self._forwarder.prefill)
        self._wire_load()
        if self._router is not None:
            for backend in self.pool.ready():
                self._learn(backend)
        budget = self._forwarder.budget = BodyBudget(configured_limit(config.max_body_buffer, config.max_body_bytes, _total_memory()))
        self.metrics.body_buffer = lambda: (budget.held, budget.limit)
        self._forwarder.parser = BodyParser()
        self._configure_batch()
        if self._batch is not None:
            try:
                self._start_batch()
            except BaseException:  # (batch.dir unusable: one line from the store; nothing left open)
                await self._close()
                raise
        # The client side of HTTP (client_conn.py): our own protocol on httptools, every limit of
        # the ClientPolicy applied before a handler runs, our own dispatch (below).
        self._front = FrontServer(self._dispatch, self._clients, self._clock)
        try:
            self._port = await self._front.listen(config.host, config.port)
        except OSError as exc:
            await self._close()
            why = "the port is already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise VsupError(f"proxy cannot listen on {config.host}:{config.port}: {why} (set proxy.port / --port)") from None
        log.info(
            "proxy listening on http://%s:%d (%s, %d instance(s) known, auth %s)",
            config.host, self._port, config.policy, len(self.pool.all()), "on" if self._auth.enabled else "off",
        )

    def _start_batch(self) -> None:
        """Open the batch store (its recover() requeues the lines a stop left running), serve its
        routes and start its runner."""
        from vsup.batch.store import Store
        from vsup.batch.watch import Watch
        from vsup.proxy.batch_routes import BatchRoutes

        batch, directory = self._batch, self._batch_dir
        assert batch is not None and directory is not None and self._forwarder is not None
        self._store = store = Store.open(directory, limits_of(batch))
        self._watch = Watch(store)  # the batches as vsup status, /status and /metrics see them
        self._runner = Runner(store, self.send_line, self.batch_room, self.serves)
        self._forwarder.batch_freed = self._forwarder.share.on_free = self._runner.slot_freed
        self._batch_routes = BatchRoutes(self._store, self._runner.wake, self.serves, directory)
        self._runner.start()
        log.info("batch store %s: the Batch API is served (/v1/files, /v1/batches)", directory)

    def _configure_batch(self) -> None:
        """The live batch keys: the store's limits, the lines' priority, each model's share."""
        forwarder = self._forwarder
        if forwarder is None:
            return
        batch = self._batch or self._given_batch or BatchConfig()
        if self._store is not None:
            self._store.limits = limits_of(batch)
        forwarder.batch_priority = batch.priority
        models = self._model_configs or {}
        fixed = batch.slots_per_instance if isinstance(batch.slots_per_instance, int) else None

        def slots(config: ProxyConfig, model: str | None) -> int:
            if fixed is not None:
                return fixed
            if model is not None and model in self._batch_slots:
                return self._batch_slots[model]
            limit = config.max_in_flight_per_instance
            return limit if isinstance(limit, int) and limit > 0 else CPU_DEFAULT_SLOTS

        forwarder.share.configure({name: slots(c, name) for name, c in models.items()}, slots(self.config, None),
                                  {name: c.reserved_slots for name, c in models.items()}, self.config.reserved_slots,
                                  batch.quiet_after, batch.beside_interactive)

    def batch_room(self, model: str) -> int:
        """How many more batch lines the instances of `model` take now (the runner's Room)."""
        return self._forwarder.batch_room(model) if self._forwarder is not None else 0

    @staticmethod
    def _owner_tokens(api_key: str | None, named: list[tuple[str, str]]) -> dict[str, str]:
        """Each owner's key (a batch's owner is its key's name; "" proxy.api_key): what a front that
        passes keys on (forward_key) sends with that owner's batch lines, as the client would."""
        tokens = {name: token for name, token in named if token}
        if api_key:
            tokens[""] = api_key
        return tokens

    @staticmethod
    def _admin_token(api_key: str | None, named: list[tuple[str, str]], config: ProxyConfig) -> str | None:
        """The key a front that passes keys on sends every batch line with: an admin key when one is
        configured (proxy.api_key, else the first admin of proxy.api_keys), so the nodes do not
        charge a tenant's batch to its rate limit (one box does not either); None: the owner's."""
        if api_key:
            return api_key
        admins = roles(config)[0]
        return next((token for name, token in named if token and name in admins), None)

    def serves(self, model: str) -> bool:
        """Whether `model` has instances here (served, ready or not): what batch lines may name."""
        router = self._router
        return router is None or router.serves(model)

    async def send_line(self, endpoint: str, body: bytes, owner: str) -> tuple[int, bytes, str]:
        """The batch runner's Sender: the line as a request of its own through the forwarder, below
        every interactive request (Forwarder.handle(batch=True))."""
        forwarder = self._forwarder
        if forwarder is None:
            raise ConnectionError("the proxy is closed")
        content = Body(None)
        content.feed(body)
        content.feed_eof()
        # X-Vsup-Batch: line: an upstream vsup (a front's nodes) places it below its interactive requests too
        headers: tuple[tuple[bytes, bytes], ...] = (
            (b"Host", b"vsup-batch"), (b"Content-Type", b"application/json"), (b"Content-Length", str(len(body)).encode()),
            (b"X-Vsup-Batch", LINE.encode()))
        token = (self._line_token or self._tokens.get(owner)) if self._forward_key else None
        if token:  # upstream vsups check the same keys: an admin's, else the line goes as its owner's request
            headers += ((b"Authorization", b"Bearer " + token.encode("utf-8", "surrogateescape")),)
        request = Request("POST", endpoint, headers, (1, 1), True, None, content, len(body), False,
                          content_type="application/json", authorization=f"Bearer {token}" if token else "")
        answer = await forwarder.handle(request, owner, batch=True)
        if isinstance(answer, Response):
            if answer.headers.get(BUSY_HEADER) == BUSY:
                raise Busy
            return answer.status, answer.body, _request_id(answer.headers, answer.body)
        if isinstance(answer, RawResponse):
            if answer.status == 503 and _raw_header(answer.header_lines, BUSY_HEADER.encode()) == BUSY:
                raise Busy  # (an upstream vsup's busy answer, relayed)
            found = _raw_header(answer.header_lines, b"x-request-id")
            return answer.status, answer.body, found or _request_id(None, answer.body)
        # a streamed answer (no Content-Length) has nowhere to go: as a broken one, tried again
        return 502, errors.error_body("the instance answered a batch line with a stream", "upstream_error", "upstream_error"), ""

    async def _close_batch(self) -> None:
        if self._runner is not None:
            await self._runner.stop()
            self._runner = None
        if self._forwarder is not None:
            self._forwarder.batch_freed = None
            self._forwarder.share.on_free = lambda: None
        self._batch_routes = None
        self._watch = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def _on_backend_change(self, backend: Backend, state: str, ready: bool) -> None:
        # An instance out of rotation (exited, restarting, unhealthy) may be a dead process: its
        # idle keep-alive connections are closed now, so no later request is sent down one.
        # Requests in flight keep their connections.
        if self._client is not None:
            self._client.set_reusable(backend.url, ready)
        if self._gate is not None:  # an instance joined or left: free slots to the waiters (once the router's tables follow)
            asyncio.get_running_loop().call_soon(self._gate.admission.poke)
        router = self._router
        if router is not None:
            if state == "removed":
                task = router.learning.pop(backend.name, None)
                if task is not None:
                    task.cancel()
                router.forget(backend.name)
                if self._gate is not None:
                    self._gate.context.pop(backend.name, None)
            elif ready and self._session is not None:
                self._learn(backend)  # (again: a restart may have changed its adapters)

    def _set_models(self, config: ProxyConfig, models: Mapping[str, ProxyConfig] | None) -> None:
        """Route by model with these per-model settings, or (None/empty) not at all."""
        if not models:
            if self._router is not None:
                for task in self._router.learning.values():
                    task.cancel()
            self._router = None
        elif self._router is None:
            self._router = ModelRouter(self.pool, config, models, self._names)
        else:
            self._router.configure(config, models, self._names)
        router = self._router
        if router is not None:
            self.metrics.model_policies = lambda: [(name, b.name, b.decisions) for name, b in router.balancers.items()]
            self.metrics.refusals = router.refused
        else:
            self.metrics.model_policies = list
        if self._forwarder is not None:
            self._forwarder.router = router

    def _set_gate(self, config: ProxyConfig, models: Mapping[str, ProxyConfig] | None) -> None:
        if self._forwarder is not None:
            forwarder = self._forwarder
            self._gate = forwarder.gate = refit(self._gate, config, models, forwarder.in_flight, forwarder.clock.time,
                                                self.metrics.families)
            if self._gate is not None:
                self._gate.authenticated = self._auth.enabled
                self._gate.admission.crowding = forwarder.share.make_room  # a waiter preempts a batch line

    def batches(self) -> list[dict]:
        """The running batches and those that ended lately, each with its rate and ETA (batch/watch.py:
        the status JSON's `batches`); [] without the Batch API."""
        return self._watch.status() if self._watch is not None else []

    def _batch_families(self):
        figures = self._watch.figures() if self._watch is not None else None
        if figures is not None:
            yield from batch_families(figures)
        share = self._forwarder.share if self._forwarder is not None else None
        if share is not None and (figures is not None or share.preempted):  # (a node preempts a front's lines too)
            yield preempted_family(share.preempted)

    def queues(self) -> dict[str, dict]:
        """The admission queues by model (vsup status): waiting by priority, the oldest wait, waits so far."""
        return self._gate.status() if self._gate is not None else {}
    def _balancers(self) -> list:
        return [self._balancer, *(self._router.balancers.values() if self._router is not None else ())]

    def _wire_load(self) -> None:
        """Hand the load probe to every balancer that scores by load, and sample only while one does."""
        probe = self._probe
        if probe is None:  # not started yet: start() wires it
            return
        probe.interval = self.config.load_interval
        users = [b for b in self._balancers() if b.uses_load]
        for balancer in users:
            balancer.probe = probe
        if self._router is not None:
            self._router.probe = probe
        if users and self._probe_task is None:
            self._probe_task = asyncio.get_running_loop().create_task(probe.run(), name="proxy-load")
        elif not users and self._probe_task is not None:
            self._probe_task.cancel()
            self._probe_task = None
            probe.samples.clear()

    def _learn(self, backend: Backend) -> None:
        """Fetch what `backend` serves (its /v1/models: base names and adapters) for routing; a
        request for a name not known yet waits for the fetches in progress (routing.WAIT)."""
        router = self._router
        if router is None or self._session is None:
            return
        running = router.learning.get(backend.name)
        if running is not None:
            running.cancel()
        connect = self.config.connect_timeout
        task = asyncio.get_running_loop().create_task(models_of(self._session, backend, connect + 5.0, connect))
        router.learning[backend.name] = task

        def done(task: asyncio.Task) -> None:
            if router.learning.get(backend.name) is task:
                del router.learning[backend.name]
            if task.cancelled():
                return
            error = task.exception()
            if error is not None:
                log.warning("instance %s: could not read its /v1/models (%s): its adapters are not routed until it answers",
                            backend.name, str(error) or type(error).__name__)
            elif self.pool.get(backend.name) is backend:  # still the same instance
                router.learn(backend.name, [entry["id"] for entry in task.result() if isinstance(entry["id"], str)])
                if self._gate is not None:  # (a key's unbounded request reserves at most its max_model_len)
                    self._gate.learn_context(backend.name, task.result())

        task.add_done_callback(done)

    def reconfigure(self, config: ProxyConfig, api_key: str | None, models: Mapping[str, ProxyConfig] | None = None,
                    names: Mapping[str, Name] | None = None, batch: BatchConfig | None = None,
                    batch_slots: Mapping[str, int] | None = None) -> None:
        """Apply changed settings at once (`vsup reload`): timeouts (connect_timeout reaches the
        upstream pools and /v1/models), retries, policy and its affinity settings, API key (also
        the /status page's), admin routes (kept closed, with an error logged, when no key is set), the client connections' limits (clients.py). Requests already in flight keep the timeouts they were armed with.
        host, port, max_connections and max_body_bytes are built into the listening socket and the
        pools: a reload refuses to change them (vsup/config/schema.py classes them fixed).
        `models`: each model's settings, as in the constructor (a model whose policy is unchanged
        keeps its balancer and counts); {} turns routing by model off; None keeps the models as they
        are (a caller that knows nothing of models cannot turn a fleet's routing off by omission);
        `names` likewise (None: kept). `batch`: its live keys (limits, priority, attempts, slots;
        enabled and dir are fixed: a store open stays open), None: kept; `batch_slots` likewise."""
        self.config = config
        try:
            named = named_keys(config)
        except VsupError as exc:  # fail closed: the named keys are refused until a reload can read them all
            log.error("%s; the named keys (proxy.api_keys) are refused until then", exc)
            named = [(entry.name, "") for entry in config.api_keys]
        self._auth = BearerAuth(api_key if api_key is not None else config.api_key, [(n, t) for n, t in named if t], *roles(config))
        self._tokens = self._owner_tokens(api_key if api_key is not None else config.api_key, named)
        self._line_token = self._admin_token(api_key if api_key is not None else config.api_key, named, config)
        try:
            proxy_routes.require_key(config.admin_routes, self._auth.has_admin)
            self._routes = proxy_routes.table(config.admin_routes)
        except VsupError as exc:  # fail closed: the serving routes only, until a reload sets a key
            log.error("%s; the admin routes stay closed", exc)
            self._routes = proxy_routes.table([])
        if config.policy != self._balancer.name:
            self._balancer = make_balancer(config.policy, config, self.pool if self._router is None and not models else None)
            self.metrics.policy, self.metrics.policy_decisions = self._balancer.name, self._balancer.decisions
        elif isinstance(self._balancer, PrefixAffinity):  # same policy, its counts kept
            self._balancer.prefix_chars = config.affinity_prefix_chars
            self._balancer.load_factor = config.affinity_load_factor
        if names is not None:
            self._names = names
        if models is not None:
            self._set_models(config, models)
            self._model_configs = models
        elif self._router is not None:
            self._router.default = config
            if names is not None:
                self._router.configure(config, self._router.configs, names)
        self._set_gate(config, self._model_configs)
        self._wire_load()
        if self._client is not None:
            self._client.set_connect_timeout(config.connect_timeout)
        if self._clients is not None:
            self._clients.configure(config)  # header size and deadlines, body deadline, per-client limit
        if self._forwarder is not None:
            self._forwarder.config = config
            self._forwarder.balancer = self._balancer
            self._forwarder.drop_authorization = self._auth.enabled and not self._forward_key
        if batch_slots is not None:
            self._batch_slots = dict(batch_slots)
        if batch is not None:
            self._given_batch = batch
            if self._batch is not None and batch.enabled:
                self._batch = batch
        self._configure_batch()
        if self._runner is not None:
            self._runner.wake()  # a model removed: its lines fail now; more slots: more lines

    def add_page(self, path: str, handler: PageHandler) -> None:
        """Answer GET `path` here with `handler(request, auth)` (vsup run's /status page); the auth
        is the one in force when the request comes (a reload may change the key)."""

        async def page(request: Request) -> Response:
            return await handler(request, self._auth)

        self._own[path] = page

    def set_weight(self, name: str, weight: int) -> None:
        """The share of requests `name` gets relative to the others (standalone upstreams: the
        instances ready behind it, see healthcheck.py)."""
        self._balancer.set_weight(name, weight)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("ProxyServer.start() has not run")
        return self._port

    def in_flight(self) -> dict[str, int]:
        return dict(self._forwarder.in_flight) if self._forwarder else {}

    def total_in_flight(self) -> int:
        """Requests being handled, including those not yet assigned to an instance."""
        return len(self._forwarder.active) if self._forwarder else 0

    @property
    def draining(self) -> bool:
        return self._forwarder is not None and self._forwarder.draining

    async def drain_and_stop(self, timeout: float) -> None:
        """Stop accepting, /ready -> 503, let in-flight requests finish for up to `timeout` seconds,
        then abort the rest upstream (streaming clients get an error event) and close."""
        if self._front is None or self._forwarder is None:
            return
        forwarder = self._forwarder
        await self._close_batch()  # its lines in flight stay `running`: the next start resumes them
        forwarder.draining = True
        self._front.stop_listening()  # closes the listening socket; open connections stay
        for exchange in list(forwarder.active):
            if exchange.phase in ("body", "waiting"):
                exchange.abort("draining")  # still sending its request: nothing started, 503 now
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while forwarder.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if forwarder.active:
            log.warning("drain deadline (%g s) passed: aborting %d request(s)", timeout, len(forwarder.active))
            for exchange in list(forwarder.active):
                exchange.abort("draining")
            grace = loop.time() + ABORT_GRACE
            while forwarder.active and loop.time() < grace:
                await asyncio.sleep(0.02)
        await self._close()

    async def stop(self) -> None:
        await self.drain_and_stop(0)

    async def _close(self) -> None:
        await self._close_batch()
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
            self._probe_task = None
        if self._router is not None:
            for task in list(self._router.learning.values()):
                task.cancel()
        if self._front is not None:
            await self._front.close(SHUTDOWN_GRACE)
            self._front = None
        if self._forwarder is not None and self._forwarder.parser is not None:
            await self._forwarder.parser.aclose()
            self._forwarder.parser = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        balancers = [self._balancer, *(self._router.balancers.values() if self._router is not None else ())]
        for balancer in balancers:  # kv_aware: its subscriber thread and /tokenize sessions
            aclose = getattr(balancer, "aclose", None)
            if aclose is not None:
                await aclose()

    # -- handlers ------------------------------------------------------------------------------

    async def _dispatch(self, request: Request) -> Answer:
        path = request.path
        if "/." in path and _has_dot_segment(path):
            # The proxy routes (and checks auth) on the path as sent and forwards it as sent: a
            # path that an instance would resolve to somewhere else is refused, not guessed at.
            self.metrics.request("other", 400, "")
            return errors.bad_request(
                f"the path {_shown(request.raw_path)} has a '.' or '..' segment: send it without (the proxy does not resolve them)"
            )
        if self._batch_routes is not None and is_batch_path(path):
            return await self._batch_request(request)
        route = self._routes.get(path) or proxy_routes.templated(path)
        if route is not None:
            auth = self._auth
            client = auth.identify(request)
            if client is REFUSED:
                self.metrics.request("auth", 401, "")
                return errors.unauthorized()
            if not auth.may(client, ADMIN if route.admin else SERVING):
                self.metrics.request("auth", 403, "")
                return errors.forbidden(path) if auth.may(client, SERVING) else errors.metrics_only(client)
            if request.method not in route.methods:
                self.metrics.request("other", 405, "")
                allow = ", ".join(sorted(route.methods))
                return errors.error_response(405, f"{path} answers {allow} only", "invalid_request_error", "method_not_allowed", headers={"Allow": allow})
            if path == "/v1/models":
                return await self._models()
            # `X-Vsup-Batch: line` (a front's batch runner; the header only ever lowers a request): a
            # batch line here too, into the share interactive requests leave, its key's rate limit kept
            batch = _marked_line(request.raw_headers)
            response = await self._forwarder.handle(request, client, batch=batch, rated=batch)  # type: ignore[union-attr]
            if route.admin and path in _ADAPTER_ROUTES and response.status == 200 and self._router is not None:
                for backend in self.pool.ready():  # an adapter loaded or unloaded: the model names changed
                    self._learn(backend)
            return response
        own = self._own.get(path)
        if own is None:
            self.metrics.request("other", 404, "")
            return errors.not_found(path)
        if request.method not in ("GET", "HEAD"):
            return errors.error_response(405, f"{path} answers GET only", "invalid_request_error", "method_not_allowed", headers={"Allow": "GET"})
        response = await own(request)
        # marks what the proxy answers itself: a health probe that reaches it is not talking to an instance
        response.headers[PROXY_HEADER] = self._pid
        return response

    async def _batch_request(self, request: Request) -> Answer:
        """/v1/files and /v1/batches (batch_routes.py): any serving key; the owner is the key's name
        ("" without keys), None for an admin key (it sees every owner's)."""
        auth = self._auth
        client = auth.identify(request)
        if client is REFUSED:
            self.metrics.request("auth", 401, "")
            return errors.unauthorized()
        if not auth.may(client, SERVING):
            self.metrics.request("auth", 403, "")
            return errors.metrics_only(client)
        owner = None if auth.enabled and auth.may(client, ADMIN) else client
        response = await self._batch_routes.handle(request, owner)
        self.metrics.request("/v1/batches" if request.path.startswith("/v1/batches") else "/v1/files", response.status, "")
        return response

    async def _models(self) -> Response:
        if self.draining:
            return errors.unavailable("the proxy is shutting down", RETRY_AFTER_SECONDS)
        connect = self.config.connect_timeout
        learn = self._router.learn if self._router is not None else None
        response = await merged_models(self._session, self.pool.ready(), connect + 5.0, connect, learn)  # type: ignore[arg-type]
        self.metrics.request("/v1/models", response.status, "")
        return response

    async def _health(self, request: Request) -> Response:
        return Response(body=HEALTHY, content_type="application/json")

    def _readiness(self) -> tuple[int, bytes]:
        ready = len(self.pool.ready())
        ok = ready > 0 and not self.draining
        body: dict = {"ready": ok, "instances_ready": ready, "instances": len(self.pool.all()), "draining": self.draining}
        if self._router is not None and self._router.configs:  # a fleet: ready instances of each model
            body["models"] = {name: len(self._router.ready(name)) for name in self._router.configs}
        return 200 if ok else 503, json.dumps(body).encode()

    async def _ready(self, request: Request) -> Response:
        status, body = self._readiness()
        return Response(status=status, body=body, content_type="application/json")

    async def _metrics(self, request: Request) -> Response:
        # admin and metrics keys only: a tenant would read every request's cache hits (kv_aware's
        # decisions, vLLM's prefix-cache counters) and so confirm guesses of another's prompt
        allowed = self._auth.access(request, METRICS)
        if allowed != 200:
            return errors.unauthorized() if allowed == 401 else errors.forbidden("/metrics")
        body = self.metrics.render()
        if self.extra_metrics is not None:
            body += self.extra_metrics()
        response = Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE
        return response

