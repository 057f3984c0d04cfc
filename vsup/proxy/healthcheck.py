"""Active /health checks for `vsup proxy --upstream ...` (instances started elsewhere).

Inside `vsup run` the supervisor feeds the BackendPool; standalone, this does: one task per
upstream polls GET <url>/health. One success puts an instance in rotation (it answered, so it can
take requests); `failures` consecutive failures take it out, so a single slow poll does not.

An upstream that is itself a vsup (a host of a two-level layout: front proxy -> per-host vsup ->
instances) is polled on GET <url>/ready instead, whose JSON says how many instances are ready
behind it: that count becomes its weight in the balancer (4 ready -> twice the share of 2), and
an answer of 0 ready (or draining) takes it out at once — its /health stays 200 while it has
nothing to serve. An upstream whose /ready is not vsup's (vLLM has none: 404) is polled on
/health from then on, weight 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.health import HealthResult, failure_detail, probe_health

log = logging.getLogger("vsup.proxy.health")


@dataclass(frozen=True)
class ReadyResult:
    answered: bool  # an HTTP answer came back (False: timeout, refused, reset)
    instances: int | None  # instances_ready from a vsup's /ready; None: not a vsup's answer
    detail: str

    @property
    def ok(self) -> bool:
        return bool(self.instances)


def parse_ready(status: int, body: bytes) -> int | None:
    """Instances ready behind a vsup, from its /ready answer (200, or 503 with 0 ready or while
    draining, which counts as 0); None when the answer is not vsup's."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    count = data.get("instances_ready") if isinstance(data, dict) else None
    if status not in (200, 503) or isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return None
    return count if status == 200 and not data.get("draining") else 0


async def probe_ready(session: aiohttp.ClientSession, base_url: str, timeout: float) -> ReadyResult:
    """GET <base_url>/ready; connection failures and timeouts as probe_health words them."""
    try:
        async with asyncio.timeout(timeout):
            async with session.get(f"{base_url}/ready", allow_redirects=False) as response:
                body = await response.read()
                count = parse_ready(response.status, body)
                detail = f"HTTP {response.status}" + (f", {count} instance(s) ready" if count is not None else "")
                return ReadyResult(True, count, detail)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return ReadyResult(False, None, failure_detail(exc, timeout))


class HealthChecker:
    def __init__(self, pool: BackendPool, *, interval: float, timeout: float, failures: int,
                 on_weight: Callable[[str, int], None] | None = None) -> None:
        self.pool = pool
        self.interval = interval
        self.timeout = timeout
        self.failures = failures
        self.on_weight = on_weight  # ProxyServer.set_weight
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        # Its own small session: probes must not wait behind a full request pool.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            trust_env=False,
        )
        self._tasks = [asyncio.create_task(self._watch(b), name=f"health {b.name}") for b in self.pool.all()]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _watch(self, backend: Backend) -> None:
        assert self._session is not None
        failed = 0
        plain = False  # its /ready is not a vsup's: /health decides, weight 1
        weight = 1
        while True:
            ready = None if plain else await self._ready(backend)
            result: HealthResult | ReadyResult
            if ready is None:
                plain = True
                result = await probe_health(self._session, backend.url, self.timeout)
            else:
                result = ready
                if ready.instances:
                    if ready.instances != weight and self.on_weight is not None:
                        log.info("upstream %s: %s: weight %d", backend.url, ready.detail, ready.instances)
                        self.on_weight(backend.name, ready.instances)
                    weight = ready.instances
                elif ready.instances == 0:
                    # A definite answer, not a slow poll: nothing behind it can serve, so out now.
                    failed = 0
                    if self.pool.state(backend.name) != "unhealthy":
                        log.warning("upstream %s: /ready: %s: out of rotation", backend.url, ready.detail)
                        self.pool.set_state(backend.name, "unhealthy", False)
                    await asyncio.sleep(self.interval)
                    continue
            if result.ok:
                failed = 0
                if not self.pool.is_ready(backend.name):
                    log.info("upstream %s is healthy: in rotation", backend.url)
                    self.pool.set_state(backend.name, "ready", True)
            else:
                failed += 1
                if failed >= self.failures and self.pool.state(backend.name) != "unhealthy":
                    log.warning("upstream %s: %s (%d checks in a row): out of rotation", backend.url, result.detail, failed)
                    self.pool.set_state(backend.name, "unhealthy", False)
            await asyncio.sleep(self.interval)

    async def _ready(self, backend: Backend) -> ReadyResult | None:
        """The /ready probe; None when the upstream answered but is not a vsup (poll /health)."""
        assert self._session is not None
        result = await probe_ready(self._session, backend.url, self.timeout)
        if result.answered and result.instances is None:
            log.info("upstream %s: /ready is not a vsup's (%s): checked on /health, weight 1", backend.url, result.detail)
            return None
        return result
