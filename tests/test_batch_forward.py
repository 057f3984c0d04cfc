"""Batch lines through a real ProxyServer over a real fake vLLM process (real sockets): lines take
a quiet instance whole (and a little of vLLM's queue), one slot stays free while interactive
requests are recent, an interactive request that finds no slot preempts the youngest line (its
request aborted in vLLM, the line answered busy: no attempt), reserved_slots and the admission
limit are respected, and a line that finds no room is answered at once (Busy: never queued)."""

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
from vsup.proxy.batch_share import QUIET

LONG = 0.05  # seconds per token: 20 tokens, about 1 s
# While chats are recent lines may hold every slot but the one kept (batch.beside_interactive 1):
# the rules of the keep and the hold on their own; the default share is its own test below.
WHOLE = BatchConfig(beside_interactive=1.0)
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


def cancelled(fake) -> int:
    """Generations the fake vLLM saw cancelled (their client went away), all tests so far."""
    return len(fake.events("cancelled"))


async def test_an_idle_instance_is_used_whole_and_an_interactive_request_preempts_the_youngest_lines(fake):
    # no admission settings at all: 3 slots per instance (as --max-num-seqs 3 would give), no
    # interactive request yet: every slot, and as many again in vLLM's own queue
    async with proxy_over(fake, slots=3, batch=WHOLE) as proxy, aiohttp.ClientSession() as session:
        assert proxy.batch_room("chat") == 3 * QUIET
        before = cancelled(fake)
        lines = []
        for _ in range(3 * QUIET + 1):  # one at a time: their order is their age
            lines.append(asyncio.create_task(line(proxy, chat(20, LONG))))
            await asyncio.sleep(0.01)
        await wait_for(lambda: proxy.in_flight().get("c0") == 3 * QUIET)
        assert proxy.batch_room("chat") == 0
        # an interactive request takes a slot back at once: the youngest lines stop, 3 - 1 stay
        status, answer = await post(session, proxy, chat(2))
        assert status == 200 and answer["object"] == "chat.completion"
        # the youngest stopped, and the last found no room
        assert await asyncio.gather(*lines) == [200, 200] + ["busy"] * (3 * QUIET - 1)
        # the preempted lines were aborted in vLLM (their connections closed), not left to run
        await wait_for(lambda: cancelled(fake) - before == 3 * QUIET - 2, what="the fake to see the preempted lines cancelled")
        scraped = await (await session.get(url(proxy, "/metrics"))).text()
        assert f'vsup_batch_preempted_total{{model="chat"}} {3 * QUIET - 2}.0' in scraped
        # the chat was recent: one slot stays free for the next one (batch.quiet_after)
        assert proxy.batch_room("chat") == 2
        assert proxy.batch_room("nobody") == 0


async def test_a_quiet_model_gets_its_whole_instances_again_after_quiet_after(fake):
    async with proxy_over(fake, slots=3, batch=BatchConfig(quiet_after=0.3, beside_interactive=1.0)) as proxy, aiohttp.ClientSession() as session:
        status, _ = await post(session, proxy, chat(2))
        assert status == 200
        assert proxy.batch_room("chat") == 2  # a slot kept for the next interactive request
        await asyncio.sleep(0.35)
        assert proxy.batch_room("chat") == 3 * QUIET


async def test_beside_recent_chats_lines_take_their_share_of_each_instance_and_the_rest_once_quiet(fake):
    # the default batch.beside_interactive, an eighth: 2 of 16 slots while chats are recent
    async with proxy_over(fake, slots=16, batch=BatchConfig(quiet_after=2.0)) as proxy, aiohttp.ClientSession() as session:
        assert BatchConfig().beside_interactive == 0.125
        assert (await post(session, proxy, chat(2)))[0] == 200
        assert proxy.batch_room("chat") == 2
        lines = [asyncio.create_task(line(proxy, chat(20, LONG))) for _ in range(3)]
        assert sorted(await asyncio.gather(*lines), key=str) == [200, 200, "busy"]  # (the third found no room: never queued)
        await wait_for(lambda: proxy.batch_room("chat") == 16 * QUIET, what="quiet_after to pass")  # quiet again: every slot, and vLLM's queue


async def test_interactive_requests_in_flight_shrink_the_batch_share(fake):
    async with proxy_over(fake, slots=3) as proxy, aiohttp.ClientSession() as session:
        chats = [asyncio.create_task(post(session, proxy, chat(20, LONG))) for _ in range(2)]
        await wait_for(lambda: proxy.in_flight().get("c0") == 2)
        assert proxy.batch_room("chat") == 0  # 3 slots - 1 kept (they are recent) - 2 interactive
        assert await line(proxy, chat(2)) == "busy"
        assert [status for status, _ in await asyncio.gather(*chats)] == [200, 200]
        assert await line(proxy, chat(2)) == 200


async def test_a_streamed_chat_holds_new_lines_off_its_instance_until_its_first_token(fake):
    async def streamed(session) -> float:
        """The chat's stream: the seconds from its first byte to its end (its first token came then)."""
        body = {**chat(3), "stream": True, "fake": {"first_token_delay": 0.6, "token_delay": 0.1}}
        async with session.post(url(proxy, ENDPOINT), data=json.dumps(body),
                                headers={"Content-Type": "application/json"}) as response:
            assert response.status == 200
            await response.content.readany()
            began = asyncio.get_running_loop().time()
            await response.read()
            return asyncio.get_running_loop().time() - began

    async with proxy_over(fake, slots=3, batch=WHOLE) as proxy, aiohttp.ClientSession() as session:
        stream = asyncio.create_task(streamed(session))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1)
        assert proxy.batch_room("chat") == 0  # a slot free, but a line now would prefill beside the chat
        assert await line(proxy, chat(2)) == "busy"
        await wait_for(lambda: proxy.batch_room("chat") == 1, what="the first token to end the hold")
        assert proxy.in_flight().get("c0") == 1  # while the chat still streams: 3 - 1 kept (recent) - the chat
        assert await stream > 0.1
        assert await line(proxy, chat(2)) == 200
        # a request that is not streamed holds nothing (its first byte is its whole answer); (the line
        # just sent is one started within the chat's time to first byte: the stagger's, waited out first)
        await wait_for(lambda: proxy.batch_room("chat") == 2, what="the stagger of the last line to pass")
        pending = asyncio.create_task(post(session, proxy, {**chat(3), "fake": {"first_token_delay": 0.5}}))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1)
        assert proxy.batch_room("chat") == 1
        assert (await pending)[0] == 200


async def test_reserved_slots_are_respected(fake):
    model = ProxyConfig(max_in_flight_per_instance=4, reserved_slots=2)
    async with proxy_over(fake, model, batch=BatchConfig()) as proxy:
        # auto: the admission limit 4, less the 2 reserved (an admission limit is never passed: no queue in vLLM)
        assert proxy.batch_room("chat") == 2
        lines = [asyncio.create_task(line(proxy, chat(20, LONG))) for _ in range(3)]
        results = await asyncio.gather(*lines)
        assert sorted(results, key=str) == [200, 200, "busy"]


async def test_an_interactive_request_waiting_for_admission_preempts_a_line_and_new_lines_wait(fake):
    model = ProxyConfig(max_in_flight_per_instance=3)
    async with proxy_over(fake, model) as proxy, aiohttp.ClientSession() as session:
        assert proxy.batch_room("chat") == 3  # quiet: the whole admission limit
        first = []
        for _ in range(3):
            first.append(asyncio.create_task(line(proxy, chat(20, LONG))))
            await asyncio.sleep(0.01)
        await wait_for(lambda: proxy.in_flight().get("c0") == 3)
        # each interactive request finds the instance full: it waits, and its wait stops the youngest line
        chats = [asyncio.create_task(post(session, proxy, chat(20, LONG))) for _ in range(2)]
        assert await asyncio.gather(*first[1:]) == ["busy", "busy"]
        await wait_for(lambda: proxy.in_flight().get("c0") == 3 and not proxy.queues().get("chat", {}).get("waiting"),
                       what="both chats admitted in the preempted lines' slots")
        assert proxy.batch_room("chat") == 0
        assert await line(proxy, chat(2)) == "busy"  # never queued, never ahead of them
        assert await first[0] == 200  # the oldest line ran on
        assert [status for status, _ in await asyncio.gather(*chats)] == [200, 200]
        assert await line(proxy, chat(2)) == 200


async def test_batch_priority_is_below_every_key(fake):
    from vsup.config.schema import ApiKeyConfig

    keys = [ApiKeyConfig(name="low", key="k-low", priority=-5), ApiKeyConfig(name="high", key="k-high", priority=5)]
    async with proxy_over(fake, ProxyConfig(max_in_flight_per_instance=3), api_keys=keys) as proxy:
        assert proxy._forwarder.lowest_priority() == -6
    async with proxy_over(fake, ProxyConfig(max_in_flight_per_instance=3), batch=BatchConfig(priority=-1),
                          api_keys=keys) as proxy:
        assert proxy._forwarder.lowest_priority() == -1
