"""Token limits charged what vLLM generates, through a real ProxyServer over a real fake vLLM (real
sockets, the real `openai` client): the attacks that made a `tokens_per_minute: 1000` key generate
~19k tokens (max_tokens: 1 beside max_completion_tokens: 5000, "5000", 5000.0, n: 20, a chat
without either), settlement by the usage vLLM returns (JSON and streams: the proxy asks for the
usage chunk and a client that did not ask never sees it), and the client's query string kept out
of the instance's access log."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, client, running_proxy, url, wait_for
from vsup.config.schema import ApiKeyConfig, ProxyConfig
from vsup.proxy.backends import Backend, BackendPool

pytestmark = pytest.mark.timeout(120)
KEY = {"Authorization": "Bearer k-tenant"}


@pytest.fixture(scope="module")
def fake():
    # no delay per token: an attack that got through generates its thousands at once; the
    # instance's access log on (the query string test reads it)
    started = start_fake(name="c0", served_model_names=["chat"],
                         env={**LEAN, "FAKE_VLLM_TOKEN_DELAY": "0", "FAKE_VLLM_ACCESS_LOG": "1"})
    try:
        started.wait_ready()
        yield started
    finally:
        started.cleanup()


@contextlib.asynccontextmanager
async def proxy_over(fake, tokens_per_minute: int = 1000):
    pool = BackendPool()
    pool.add(Backend(fake.name, fake.url, "chat"))
    pool.set_state(fake.name, "ready", True)
    keys = [ApiKeyConfig(name="tenant", key="k-tenant", tokens_per_minute=tokens_per_minute)]
    async with running_proxy(pool, models={"chat": ProxyConfig()}, api_keys=keys) as proxy:
        yield proxy


def chat(content: str = "hi", **fields) -> dict:
    return {"model": "chat", "messages": [{"role": "user", "content": content}], **fields}


async def post(session, proxy, body, path="/v1/chat/completions"):
    async with session.post(url(proxy, path), data=json.dumps(body),
                            headers={"Content-Type": "application/json", **KEY}) as response:
        return response.status, response.headers, json.loads(await response.text())


def generated(results) -> int:
    return sum(body["usage"]["completion_tokens"] for status, _, body in results if status == 200)


@pytest.mark.parametrize("fields", [
    {"max_tokens": 1, "max_completion_tokens": 5000},  # vLLM takes max_completion_tokens
    {"max_tokens": "5000"},  # vLLM's pydantic coerces a string...
    {"max_tokens": 5000.0},  # ...and an integral float
    {"max_tokens": 200, "n": 20},  # n choices of max_tokens each
], ids=["max_completion_tokens", "string", "float", "n"])
async def test_an_attack_on_the_estimate_is_charged_what_vllm_would_generate(fake, fields):
    async with proxy_over(fake) as proxy, aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(post(session, proxy, chat(**fields)) for _ in range(4)))
        assert generated(results) <= 1000, f"a 1000-token-a-minute key generated {generated(results)} tokens"
        status, _, body = results[0]
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
        assert "can never send this request" in body["error"]["message"] and "max_completion_tokens" in body["error"]["message"]


async def test_the_same_fields_within_the_limit_are_served_as_vllm_reads_them(fake):
    async with proxy_over(fake) as proxy, aiohttp.ClientSession() as session:
        status, _, body = await post(session, proxy, chat(max_tokens="30", n=2))
        assert status == 200 and body["usage"]["completion_tokens"] == 60 and len(body["choices"]) == 2


async def test_a_chat_without_a_bound_reserves_the_bucket_until_its_usage_settles_it(fake):
    async with proxy_over(fake) as proxy, aiohttp.ClientSession() as session:
        # vLLM would generate up to max_model_len - the prompt: it takes the whole bucket while it runs...
        slow = chat(fake={"token_delay": 0.05})
        first = asyncio.create_task(post(session, proxy, slow))
        await wait_for(lambda: proxy.in_flight().get("c0") == 1, what="the first chat in flight")
        status, _, body = await post(session, proxy, chat())
        assert status == 429 and body["error"]["type"] == "tokens"
        status, _, body = await first
        assert status == 200
        # ...and is charged its usage after: the bucket is nearly full again
        status, headers, body = await post(session, proxy, chat(max_tokens=5))
        assert status == 200
        assert int(headers["x-ratelimit-remaining-tokens"]) >= 1000 - 2 * 40


async def test_without_a_bound_a_request_reserves_at_most_what_its_instances_max_model_len_allows(fake):
    async with proxy_over(fake, tokens_per_minute=10_000) as proxy, aiohttp.ClientSession() as session:
        await wait_for(lambda: proxy._gate.context.get("c0") == 2048, what="the instance's max_model_len learned")
        # the fake's --max-model-len 2048 (its /v1/models says so): 2048 tokens a sequence, prompt included
        for fields, reserved in (({}, 2048), ({"n": 2}, 4096)):
            status, headers, _ = await post(session, proxy, chat(**fields))
            assert status == 200
            # (less what the earlier ones were charged once settled: a few dozen tokens)
            assert 10_000 - reserved - 60 <= int(headers["x-ratelimit-remaining-tokens"]) <= 10_000 - reserved


async def test_usage_settles_the_estimate_so_a_long_prompt_of_few_tokens_is_charged_its_tokens(fake):
    # 2000 bytes, one word: estimated at ~520 tokens, and the fake counts it one
    body = chat("x" * 2000, max_tokens=10)
    async with proxy_over(fake) as proxy, aiohttp.ClientSession() as session:
        for _ in range(3):  # without settlement the second is over the limit
            status, headers, answer = await post(session, proxy, body)
            assert status == 200, answer
            assert answer["usage"]["total_tokens"] == 11
        status, headers, _ = await post(session, proxy, chat(max_tokens=1))
        assert int(headers["x-ratelimit-remaining-tokens"]) >= 1000 - 3 * 11 - 2 * 40


async def test_a_refused_request_gives_back_what_it_reserved(fake):
    async with proxy_over(fake) as proxy, aiohttp.ClientSession() as session:
        for _ in range(3):  # vLLM's 400 (no messages): nothing generated, the 900 reserved given back each time
            status, _, body = await post(session, proxy, {"model": "chat", "messages": [], "max_tokens": 900})
            assert status == 400 and body["error"]["param"] == "messages"


async def test_a_stream_settles_by_the_usage_chunk_which_only_a_client_that_asked_sees(fake):
    async with proxy_over(fake) as proxy:
        tenant = client(proxy, "k-tenant")
        for _ in range(3):  # each reserves ~540 tokens of the 1000: only settlement lets the next through
            stream = await tenant.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x" * 2000}],
                                                          max_tokens=10, stream=True)
            chunks = [chunk async for chunk in stream]
            assert chunks and all(chunk.choices for chunk in chunks) and all(chunk.usage is None for chunk in chunks)
            assert "".join(c.choices[0].delta.content or "" for c in chunks).startswith("tok0 tok1")
        stream = await tenant.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x" * 2000}],
                                                      max_tokens=10, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 11
        assert all(chunk.usage is None for chunk in chunks[:-1])
        # a completion stream too, read raw: the events as they came, without the usage chunk
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(url(proxy, "/v1/completions"), headers=KEY,
                                        json={"model": "chat", "prompt": "y" * 2000, "max_tokens": 3, "stream": True}) as response:
                    assert response.status == 200
                    text = await response.text()
                assert '"usage"' not in text and text.endswith("data: [DONE]\n\n") and text.count("data: ") == 4


async def test_the_query_string_reaches_the_instance_without_the_key_and_percent_encoded(fake):
    async with proxy_over(fake) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        body = json.dumps(chat(max_tokens=1)).encode()
        writer.write(b"POST /v1/chat/completions?tag=$(touch%%20/tmp/x)&api_key=sk-leaked&api-key=sk-too HTTP/1.1\r\n"
                     b"Host: x\r\nAuthorization: Bearer k-tenant\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body))
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200")
        await wait_for(lambda: "tag=" in fake.output(), what="the instance's access line")
        line = next(line for line in fake.output().splitlines() if "tag=" in line)
        assert "/v1/chat/completions?tag=%24%28touch%20%2Ftmp%2Fx%29 " in line, line
        assert "sk-" not in line and "$(" not in line
