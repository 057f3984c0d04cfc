"""Batch lines through a real ProxyServer over a real fake vLLM process (real sockets): a line
takes only the slots interactive requests leave but one (no configuration needed), reserved_slots
are respected, a line that finds no room is answered at once (Busy: never queued), and an
interactive request waiting for a slot is admitted ahead of any batch line."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, model_pool, running_proxy, url, wait_for
from vsup.batch.runner import Busy
from vsup.config.schema import BatchConfig, ProxyConfig
from vsup.proxy import ProxyServer

LONG = 0.05  # seconds per token: 20 tokens, about 1 s
ENDPOINT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fake():
    started = start_fake(name="c0", served_model_names=["chat"], env=LEAN)
    try:
        started.wait_ready()
        yield started
    finally:
        started.cleanup()


@contextlib.asynccontextmanager
async def proxy_over(fake, model: ProxyConfig | None = None, batch: BatchConfig | None = None, slots: int | None = None, **front):
    server = {"batch": batch, "batch_slots": {"chat": slots} if slots is not None else None}
    async with running_proxy(model_pool(fake), models={"chat": model or ProxyConfig()}, server=server, **front) as proxy:
        yield proxy


def chat(tokens: int = 2, delay: float | None = None) -> dict:
    body: dict = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    if delay is not None:
        body["fake"] = {"token_delay": delay}
    return body


async def line(proxy: ProxyServer, body: dict) -> int | str:
    """A batch line's status, or "busy"."""
    try:
        status, answer, request_id = await proxy.send_line(ENDPOINT, json.dumps(body).encode(), "tenant")
    except Busy:
        return "busy"
    assert request_id, "a served line carries its request id"
    assert json.loads(answer)["object"] == "chat.completion"
    return status


async def post(session, proxy, body, headers=None):
    async with session.post(url(proxy, ENDPOINT), data=json.dumps(body),
                            headers={"Content-Type": "application/json", **(headers or {})}) as response:
        return response.status, json.loads(await response.text())


async def test_batch_lines_never_take_the_last_slot_without_configuration(fake):
    # no admission settings at all: 3 slots per instance (as --max-num-seqs 3 would give)
    async with proxy_over(fake, slots=3) as proxy, aiohttp.ClientSession() as session:
        assert proxy.batch_room("chat") == 2
        lines = [asyncio.create_task(line(proxy, chat(20, LONG))) for _ in range(4)]
        await wait_for(lambda: proxy.in_flight().get("c0") == 2)
        assert proxy.batch_room("chat") == 0
        # the last slot is the interactive request's: it is served at once, beside the two lines
        status, answer = await post(session, proxy, chat(2))
        assert status == 200 and answer["object"] == "chat.completion"
        results = await asyncio.gather(*lines)
        assert sorted(results, key=str) == [200, 200, "busy", "busy"]
        assert proxy.batch_room("chat") == 2
        assert proxy.batch_room("nobody") == 0


async def test_interactive_requests_in_flight_shrink_the_batch_share(fake):
    async with proxy_over(fake, slots=3) as proxy, aiohttp.ClientSession() as session:
        chats = [asyncio.create_task(post(session, proxy, chat(20, LONG))) for _ in range(2)]
        await wait_for(lambda: proxy.in_flight().get("c0") == 2)
        assert proxy.batch_room("chat") == 0  # 3 slots - 1 kept - 2 interactive
        assert await line(proxy, chat(2)) == "busy"
        assert [status for status, _ in await asyncio.gather(*chats)] == [200, 200]
        assert await line(proxy, chat(2)) == 200


async def test_reserved_slots_are_respected(fake):
    model = ProxyConfig(max_in_flight_per_instance=4, reserved_slots=2)
    async with proxy_over(fake, model, batch=BatchConfig()) as proxy:
        assert proxy.batch_room("chat") == 2  # auto: the admission limit 4, less the 2 reserved
        lines = [asyncio.create_task(line(proxy, chat(20, LONG))) for _ in range(3)]
        results = await asyncio.gather(*lines)
        assert sorted(results, key=str) == [200, 200, "busy"]


async def test_interactive_waiters_are_admitted_ahead_of_batch_lines(fake):
    model = ProxyConfig(max_in_flight_per_instance=3)
    async with proxy_over(fake, model) as proxy, aiohttp.ClientSession() as session:
        first = [asyncio.create_task(line(proxy, chat(20, LONG))) for _ in range(2)]  # the batch share: 3 - 1
        await wait_for(lambda: proxy.in_flight().get("c0") == 2)
        chats = [asyncio.create_task(post(session, proxy, chat(20, LONG))) for _ in range(3)]
        # one interactive request takes the kept slot, two wait in the admission queue
        await wait_for(lambda: sum(q["waiting"] for q in proxy.queues().values()) == 2)
        assert proxy.batch_room("chat") == 0
        assert await line(proxy, chat(2)) == "busy"  # never queued, never ahead of them
        assert await asyncio.gather(*first) == [200, 200]
        # the lines' slots went to the waiting interactive requests, not to another line
        assert sum(q["waiting"] for q in proxy.queues().values()) == 0
        assert await line(proxy, chat(2)) == "busy"  # 3 slots - 1 kept - 3 interactive < 1
        assert [status for status, _ in await asyncio.gather(*chats)] == [200, 200, 200]
        assert await line(proxy, chat(2)) == 200


async def test_batch_priority_is_below_every_key(fake):
    from vsup.config.schema import ApiKeyConfig

    keys = [ApiKeyConfig(name="low", key="k-low", priority=-5), ApiKeyConfig(name="high", key="k-high", priority=5)]
    async with proxy_over(fake, ProxyConfig(max_in_flight_per_instance=3), api_keys=keys) as proxy:
        assert proxy._forwarder.lowest_priority() == -6
    async with proxy_over(fake, ProxyConfig(max_in_flight_per_instance=3), batch=BatchConfig(priority=-1),
                          api_keys=keys) as proxy:
        assert proxy._forwarder.lowest_priority() == -1
