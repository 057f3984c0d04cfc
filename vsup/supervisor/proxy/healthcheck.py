"""Active /health checks for `vsup proxy --upstream ...` (instances started elsewhere).

Inside `vsup run` the supervisor feeds the BackendPool; standalone, this does: one task per
upstream polls GET <url>/health. One success puts an instance in rotation (it answered, so it can
take requests); `failures` consecutive failures take it out, so a single slow poll does not.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from vsup.supervisor.backends import Backend, BackendPool
from vsup.supervisor.health import probe_health

log = logging.getLogger("vsup.proxy.health")


class HealthChecker:
    def __init__(self, pool: BackendPool, *, interval: float, timeout: float, failures: int) -> None:
        self.pool = pool
        self.interval = interval
        self.timeout = timeout
        self.failures = failures
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
        while True:
            result = await probe_health(self._session, backend.url, self.timeout)
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
