"""Admission through a real ProxyServer over a real fake vLLM process (real sockets): a saturated
model queues, a higher priority passes a lower one, a full queue answers 429 and a long wait 503
(OpenAI's error shape, Retry-After), a client that leaves while waiting leaves the queue, a key
over its rate limit gets 429 while another key is served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest

from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, metric_value, metrics_text, model_pool, running_proxy, url, wait_for
from vsup.config.schema import ApiKeyConfig, ProxyConfig
from vsup.proxy import ProxyServer
from vsup.proxy.backends import Backend, BackendPool

LONG = 0.05  # seconds per token of a "long" request: 20 tokens, about 1 s
# the live keys whose reload these tests show (tests/test_reload_classes.py counts them covered)
RELOAD_COVERED = {f"proxy.{key}" for key in ("max_in_flight_per_instance", "reserved_slots", "queue_max", "queue_timeout",
                                             "api_keys", "priority_header", "priority_header_values")}


@pytest.fixture(scope="module")
def fake():
    started = start_fake(name="c0", served_model_names=["chat"], env=LEAN)
    try:
        started.wait_ready()
        yield started
    finally:
        started.cleanup()


@contextlib.asynccontextmanager
async def proxy_over(fake, model: ProxyConfig | None = None, **front):
    async with running_proxy(model_pool(fake), models={"chat": model or ProxyConfig(max_in_flight_per_instance=1)}, **front) as proxy:
        yield proxy


def chat(tokens: int = 2, delay: float | None = None) -> dict:
    body: dict = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    if delay is not None:
        body["fake"] = {"token_delay": delay}
    return body


async def post(session, proxy, body, headers=None, timeout=None):
    kw = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
    async with session.post(url(proxy, "/v1/chat/completions"), data=json.dumps(body),
                            headers={"Content-Type": "application/json", **(headers or {})}, **kw) as response:
        return response.status, response.headers, json.loads(await response.text())


def waiting(proxy) -> int:
    return sum(q["waiting"] for q in proxy.queues().values())


async def test_saturated_model_queues_and_higher_priority_passes_lower(fake):
    front = {"priority_header": "X-Priority", "priority_header_values": {"interactive": 10, "batch": -10}}
    async with proxy_over(fake, **front) as proxy, aiohttp.ClientSession() as session:
        finished: list[str] = []

        async def one(tag, priority, body):
            result = await post(session, proxy, body, {"X-Priority": priority})
            finished.append(tag)
            return result

        first = asyncio.create_task(one("first", "batch", chat(20, LONG)))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first request in flight")
        low = asyncio.create_task(one("low", "batch", chat()))
        await wait_for(lambda: waiting(proxy) == 1, what="the batch request waiting")
        high = asyncio.create_task(one("high", "interactive", chat()))
        await wait_for(lambda: waiting(proxy) == 2, what="both waiting")
        assert proxy.queues()["chat"]["by_priority"] == {"-10": 1, "10": 1}
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_queue_length", model="chat", priority="-10") == 1
        assert metric_value(text, "vsup_proxy_queue_length", model="chat", priority="10") == 1
        assert proxy.in_flight() == {"c0": 1}  # vLLM was sent one, not three
        results = await asyncio.gather(first, low, high)
        assert [status for status, _, _ in results] == [200, 200, 200]
        assert finished == ["first", "high", "low"]
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_queue_wait_seconds_count", model="chat", priority="10") == 1
        assert metric_value(text, "vsup_proxy_queue_length", model="chat", priority="10") == 0
        # a value outside the allow-list is refused, not taken as a priority
        status, _, body = await post(session, proxy, chat(), {"X-Priority": "urgent"})
        assert status == 400 and "X-Priority".lower() in body["error"]["message"] and "'interactive'" in body["error"]["message"]


async def test_full_queue_429_and_deadline_503_in_openai_shape(fake):
    async with proxy_over(fake, ProxyConfig(max_in_flight_per_instance=1, queue_max=1, queue_timeout=0.5)) as proxy, \
            aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, proxy, chat(30, LONG)))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first request in flight")
        started = time.monotonic()
        second = asyncio.create_task(post(session, proxy, chat()))
        await wait_for(lambda: waiting(proxy) == 1, what="one waiting")
        status, headers, body = await post(session, proxy, chat())  # the queue holds one
        assert status == 429 and headers["Retry-After"] == "1"
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == "queue_full"
        assert "proxy.queue_max" in body["error"]["message"]
        status, headers, body = await second
        waited = time.monotonic() - started
        assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "queue_timeout"
        assert "proxy.queue_timeout" in body["error"]["message"]
        assert 0.45 <= waited < 1.2, waited  # the deadline, not the first request's end
        assert (await first)[0] == 200
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_queue_refusals_total", model="chat", reason="queue_full") == 1
        assert metric_value(text, "vsup_proxy_queue_refusals_total", model="chat", reason="queue_timeout") == 1


async def test_a_disconnecting_waiter_leaves_the_queue_at_once(fake):
    async with proxy_over(fake) as proxy, aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, proxy, chat(30, LONG)))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first request in flight")
        with pytest.raises(asyncio.TimeoutError):
            await post(session, proxy, chat(), timeout=0.3)  # gives up while it waits
        await wait_for(lambda: waiting(proxy) == 0, timeout=0.5, what="the gone client out of the queue")
        assert proxy.in_flight() == {"c0": 1}
        late = asyncio.create_task(post(session, proxy, chat()))
        assert (await first)[0] == 200
        assert (await late)[0] == 200  # the freed slot went to a live waiter, not the gone one
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_client_disconnects_total", phase="waiting") == 1


async def test_a_drain_answers_the_waiters(fake):
    async with proxy_over(fake) as proxy, aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, proxy, chat(10, LONG)))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first request in flight")
        second = asyncio.create_task(post(session, proxy, chat()))
        await wait_for(lambda: waiting(proxy) == 1, what="one waiting")
        drain = asyncio.create_task(proxy.drain_and_stop(5))
        status, headers, body = await second
        assert status == 503 and "Retry-After" in headers and "shutting down" in body["error"]["message"]
        assert (await first)[0] == 200  # in flight: finished, not lost
        await drain


async def test_a_key_over_its_rate_limit_gets_429_while_another_is_served(fake):
    keys = [ApiKeyConfig(name="batch", key="k-batch", requests_per_minute=2),
            ApiKeyConfig(name="web", key="k-web", priority=5), ApiKeyConfig(name="ops", key="k-ops", admin=True)]
    async with proxy_over(fake, ProxyConfig(), api_keys=keys) as proxy, aiohttp.ClientSession() as session:
        batch, web = {"Authorization": "Bearer k-batch"}, {"Authorization": "Bearer k-web"}
        status, headers, _ = await post(session, proxy, chat(), batch)
        assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "1"
        assert (await post(session, proxy, chat(), batch))[0] == 200
        status, headers, body = await post(session, proxy, chat(), batch)
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert 1 <= int(headers["Retry-After"]) <= 30  # one request back every 30 s
        assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-reset-requests"].endswith("s")
        for _ in range(3):
            status, headers, _ = await post(session, proxy, chat(), web)
            assert status == 200 and "x-ratelimit-limit-requests" not in headers
        assert (await post(session, proxy, chat(), {"Authorization": "Bearer nope"}))[0] == 401
        assert (await post(session, proxy, chat()))[0] == 401
        text = await metrics_text(proxy, "k-ops")  # an admin key's (a tenant's gets 403: test_proxy_tenants.py)
        assert metric_value(text, "vsup_proxy_rate_limited_total", key="batch", limit="requests") == 1


async def test_a_reload_that_raises_the_limit_or_turns_it_off_lets_the_waiters_go(fake):
    pool = BackendPool()  # a standalone proxy's upstream: no model, one queue for all
    pool.add(Backend(fake.name, fake.url))
    pool.set_state(fake.name, "ready", True)
    proxy = ProxyServer(ProxyConfig(port=0, max_in_flight_per_instance=1), pool)
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, proxy, chat(40, LONG)))
            await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first request in flight")
            second = asyncio.create_task(post(session, proxy, chat(40, LONG)))
            third = asyncio.create_task(post(session, proxy, chat()))
            await wait_for(lambda: waiting(proxy) == 2, what="two waiting")
            proxy.reconfigure(ProxyConfig(port=0, max_in_flight_per_instance=2), None)
            await wait_for(lambda: waiting(proxy) == 1 and proxy.in_flight().get("c0") == 2, timeout=0.5,
                           what="one more admitted at once")
            proxy.reconfigure(ProxyConfig(port=0), None)  # no admission any more
            assert (await asyncio.wait_for(third, 1.5))[0] == 200  # long before the first two end
            assert not first.done()
            assert proxy.queues() == {}
            assert [r[0] for r in await asyncio.gather(first, second)] == [200, 200]
    finally:
        await proxy.drain_and_stop(0)


async def test_a_reload_applies_the_queue_keys_the_keys_and_the_priority_header(fake):
    pool = BackendPool()
    pool.add(Backend(fake.name, fake.url, "chat"))
    pool.set_state(fake.name, "ready", True)
    proxy = ProxyServer(ProxyConfig(port=0), pool, models={"chat": ProxyConfig()})
    await proxy.start()

    def reload(front: dict, model: dict) -> None:
        proxy.reconfigure(ProxyConfig(port=0, **front), None, models={"chat": ProxyConfig(**model)})

    try:
        async with aiohttp.ClientSession() as session:
            # api_keys: a key added by a reload is taken, the requests without one refused
            reload({"api_keys": [ApiKeyConfig(name="web", key="k1", priority=10)]}, {})
            web = {"Authorization": "Bearer k1"}
            assert (await post(session, proxy, chat()))[0] == 401
            assert (await post(session, proxy, chat(), web))[0] == 200
            # priority_header and its values
            front = {"api_keys": [ApiKeyConfig(name="web", key="k1", priority=10), ApiKeyConfig(name="etl", key="k2")],
                     "priority_header": "X-Priority", "priority_header_values": {"batch": -10}}
            reload(front, {})
            assert (await post(session, proxy, chat(), {**web, "X-Priority": "interactive"}))[0] == 400
            front["priority_header_values"] = {"batch": -10, "interactive": 10}
            reload(front, {})
            assert (await post(session, proxy, chat(), {**web, "X-Priority": "interactive"}))[0] == 200
            etl = {"Authorization": "Bearer k2", "X-Priority": "batch"}
            # max_in_flight_per_instance + reserved_slots: the batch waits for the one slot it may take...
            reload(front, {"max_in_flight_per_instance": 2, "reserved_slots": 1, "queue_max": 1, "queue_timeout": 30})
            first = asyncio.create_task(post(session, proxy, chat(30, LONG), etl))
            await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the batch request in flight")
            second = asyncio.create_task(post(session, proxy, chat(), etl))
            await wait_for(lambda: waiting(proxy) == 1, what="the second batch request waiting")
            # ...queue_max 1: a third is refused; the top priority takes the reserved slot at once
            assert (await post(session, proxy, chat(), etl))[1]["Retry-After"] == "1"
            status, _, _ = await asyncio.wait_for(post(session, proxy, chat(), web), 1.0)
            assert status == 200 and second.done() and (await second)[0] == 429  # shed for it (queue_max 1)
            second = asyncio.create_task(post(session, proxy, chat(), etl))
            await wait_for(lambda: waiting(proxy) == 1, what="a batch request waiting again")
            # queue_timeout lowered: the waiting one ends by it, not by the 30 s it began with
            reload(front, {"max_in_flight_per_instance": 2, "reserved_slots": 1, "queue_max": 1, "queue_timeout": 0.2})
            status, _, body = await asyncio.wait_for(second, 1.0)
            assert status == 503 and body["error"]["code"] == "queue_timeout"
            assert (await first)[0] == 200
    finally:
        await proxy.drain_and_stop(0)


async def test_a_body_sent_in_pieces_then_a_long_wait_is_not_cut_by_the_body_timeout(fake):
    async with proxy_over(fake, body_timeout=0.3) as proxy, aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, proxy, chat(20, LONG)))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first request in flight")
        body = json.dumps(chat()).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        await writer.drain()
        await asyncio.sleep(0.05)  # the body after the headers: read in the body phase, under its deadline
        writer.write(body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert (await first)[0] == 200
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]  # waited ~1 s, past body_timeout, and served


async def test_the_api_key_cannot_lift_itself_above_priority_0_with_the_header(fake):
    # proxy.api_key is a key of priority 0: the header may lower it, never raise it (as a named key's)
    front = {"api_key": "k-admin", "api_keys": [ApiKeyConfig(name="web", key="k-web", priority=10)],
             "priority_header": "X-Priority", "priority_header_values": {"interactive": 10, "batch": -10}}
    async with proxy_over(fake, **front) as proxy, aiohttp.ClientSession() as session:
        admin = {"Authorization": "Bearer k-admin"}
        first = asyncio.create_task(post(session, proxy, chat(20, LONG), admin))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first request in flight")
        lifted = asyncio.create_task(post(session, proxy, chat(), {**admin, "X-Priority": "interactive"}))
        lowered = asyncio.create_task(post(session, proxy, chat(), {**admin, "X-Priority": "batch"}))
        web = asyncio.create_task(post(session, proxy, chat(), {"Authorization": "Bearer k-web", "X-Priority": "interactive"}))
        await wait_for(lambda: waiting(proxy) == 3, what="three waiting")
        assert proxy.queues()["chat"]["by_priority"] == {"0": 1, "-10": 1, "10": 1}
        assert [r[0] for r in await asyncio.gather(first, lifted, lowered, web)] == [200] * 4


async def test_one_key_cannot_fill_a_models_whole_queue(fake):
    keys = [ApiKeyConfig(name="batch", key="k-batch"), ApiKeyConfig(name="web", key="k-web")]
    async with proxy_over(fake, ProxyConfig(max_in_flight_per_instance=1, queue_max=4), api_keys=keys) as proxy, \
            aiohttp.ClientSession() as session:
        batch, web = {"Authorization": "Bearer k-batch"}, {"Authorization": "Bearer k-web"}
        first = asyncio.create_task(post(session, proxy, chat(20, LONG), batch))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first request in flight")
        flood = [asyncio.create_task(post(session, proxy, chat(), batch)) for _ in range(4)]
        await wait_for(lambda: waiting(proxy) == 4, what="the batch key's four waiting")
        status, _, body = await post(session, proxy, chat(), batch)
        assert status == 429 and body["error"]["code"] == "queue_full"
        # the other key still gets a place, and is served second, not after the batch key's four
        served = asyncio.create_task(post(session, proxy, chat(), web))
        shed = await next(asyncio.as_completed(flood))
        assert shed[0] == 429 and "took its place" in shed[2]["error"]["message"]
        assert (await served)[0] == 200
        assert sum(1 for t in flood if t.done()) <= 2  # the web request went before the batch key's remaining waiters
        results = [await t for t in flood]
        assert sorted(r[0] for r in results) == [200, 200, 200, 429] and (await first)[0] == 200
