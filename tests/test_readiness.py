"""Readiness proves vsup talks to the instance, not to itself: the proxy marks what it answers
itself, and the /health probe refuses marked answers. Real sockets: a ProxyServer, a fake vLLM,
and the lifecycle driver with the real operations over a real process."""

from __future__ import annotations

import asyncio
import logging
import sys

import aiohttp
import pytest

from tests.proxy_support import LEAN, ready_pool, running_proxy, start_fakes
from vsup.config.schema import VsupConfig
from vsup.proxy.address import Sessions
from vsup.proxy.backends import BackendPool
from vsup.proxy.health import PROXY_HEADER, probe_health
from vsup.supervisor.lifecycle import Instance
from vsup.supervisor.logs import InstanceLog
from vsup.supervisor.operations import SystemOperations
from vsup.supervisor.states import Event, State

pytestmark = pytest.mark.timeout(60)


async def test_the_proxy_marks_its_own_answers_and_the_probe_refuses_them():
    async with running_proxy(BackendPool()) as proxy, aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{proxy.port}/health") as response:
            assert response.status == 200 and response.headers[PROXY_HEADER]  # the proxy itself is fine ...
        result = await probe_health(session, f"http://127.0.0.1:{proxy.port}", 2.0, expect_instance=True)
        upstream = await probe_health(session, f"http://127.0.0.1:{proxy.port}", 2.0)
    assert not result.ok  # ... but it is not an instance
    assert "HTTP 200 from a vsup proxy" in result.detail and "not from the instance" in result.detail
    # a front proxy's check of its upstreams may meet another vsup's proxy there: that one is fine
    assert upstream.ok and upstream.detail == "HTTP 200"


async def test_an_instance_answering_health_is_ready_and_its_answers_pass_the_proxy_unmarked():
    fakes = start_fakes(["i0"], LEAN)
    try:
        async with aiohttp.ClientSession() as session:
            assert (await probe_health(session, fakes[0].url, 2.0, expect_instance=True)).ok
            async with running_proxy(ready_pool(fakes)) as proxy:
                async with session.get(f"http://127.0.0.1:{proxy.port}/v1/models") as response:
                    assert response.status == 200 and PROXY_HEADER not in response.headers  # forwarded, not its own
    finally:
        for fake in fakes:
            fake.cleanup()


async def test_an_instance_on_the_proxys_port_never_counts_as_ready(tmp_path):
    # A process that never binds, "listening" on the proxy's port: before the fix the proxy's own
    # /health made it ready within one poll, and requests then looped through the proxy.
    config = VsupConfig.model_validate({"model": "m", "health": {"interval": 0.2, "timeout": 1.0, "startup_timeout": 2.0},
                                        "stop": {"timeout": 2.0}})
    log = InstanceLog("i0", tmp_path, max_bytes=1 << 20, backups=0, echo=False, logger=logging.getLogger("t"))
    async with running_proxy(BackendPool()) as proxy, aiohttp.ClientSession() as session:
        inst = Instance(0, [sys.executable, "-c", "import time; time.sleep(60)"], {}, port=proxy.port, config=config,
                        log=log, ops=SystemOperations(Sessions.around(session)))
        task = asyncio.create_task(inst.run())
        try:
            inst.start()
            await inst.wait_for(lambda: inst.state not in (State.STOPPED, State.STARTING))
            left = inst.history[1]
            assert left.event is Event.STARTUP_TIMEOUT, [(t.event, t.reason) for t in inst.history]
            assert "vsup proxy" in left.reason
            await inst.stop()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            log.close()
    assert not any(t.new is State.READY for t in inst.history)
