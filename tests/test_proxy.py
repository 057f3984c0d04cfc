"""The proxy: routing, policies, errors, auth, /v1/models, retries — with the real `openai` SDK
against a ProxyServer in front of fake vLLM processes (tests/fakevllm)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import openai
import pytest

from tests.fakevllm.fixtures import free_port, start_fake
from tests.proxy_support import (
    LEAN,
    MESSAGES,
    client,
    metric_value,
    metrics_text,
    ready_pool,
    running_proxy,
    served_by,
    start_fakes,
    url,
    wait_for,
)
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.balancer import LeastOutstanding, RoundRobin, make_balancer
from vsup.proxy.codec import parse_json, request_headers, response_headers
from vsup.proxy.errors import error_body


@pytest.fixture(scope="module")
def fakes():
    started = start_fakes(["a", "b"])
    yield started
    for fake in started:
        fake.cleanup()


# ---------------------------------------------------------------------------------- units


def test_round_robin_takes_turns_and_skips_tried():
    backends = tuple(Backend(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("abc"))
    rr = RoundRobin()
    picks = Counter(rr.choose(backends, {}).name for _ in range(30))
    assert picks == {"a": 10, "b": 10, "c": 10}
    assert rr.choose(backends, {}, tried=["a", "b"]).name == "c"
    assert rr.choose(backends, {}, tried=["a", "b", "c"]) is None
    assert rr.choose((), {}) is None


def test_least_outstanding_prefers_idle_and_rotates_ties():
    backends = tuple(Backend(n, n) for n in "abc")
    lo = LeastOutstanding()
    assert {lo.choose(backends, {"a": 3, "b": 1, "c": 2}).name for _ in range(5)} == {"b"}
    assert Counter(lo.choose(backends, {}).name for _ in range(9)) == {"a": 3, "b": 3, "c": 3}
    assert lo.choose(backends, {"a": 0, "b": 5, "c": 5}, tried=["a"]).name in {"b", "c"}
    with pytest.raises(ValueError, match="round_robin"):
        make_balancer("random")


def test_request_headers_drop_hop_by_hop_and_named_ones():
    raw = (
        (b"Host", b"proxy:8000"),
        (b"Content-Type", b"application/json"),
        (b"Connection", b"keep-alive, X-Secret-Hop"),
        (b"X-Secret-Hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Proxy-Authorization", b"Basic eA=="),
        (b"TE", b"trailers"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Upgrade", b"h2c"),
        (b"Content-Length", b"12"),
        (b"Authorization", b"Bearer k"),
        (b"X-Request-Id", b"r-1"),
    )
    kept = request_headers(raw, drop_authorization=False)
    assert kept == b"Content-Type: application/json\r\nAuthorization: Bearer k\r\nX-Request-Id: r-1\r\n"
    assert b"Authorization" not in request_headers(raw, drop_authorization=True)


def test_response_headers_drop_hop_by_hop():
    raw = [(b"Content-Type", b"text/event-stream"), (b"Transfer-Encoding", b"chunked"), (b"Connection", b"close, X-Gone"),
           (b"X-Gone", b"1"), (b"Content-Length", b"5"), (b"X-Fake-Instance", b"a")]
    assert list(response_headers(raw).items()) == [("Content-Type", "text/event-stream"), ("X-Fake-Instance", "a")]


async def test_an_ejected_backend_leaves_the_rotation_until_its_owner_says_ready():
    pool = BackendPool([Backend("a", "http://127.0.0.1:1"), Backend("b", "http://127.0.0.1:2")])
    for name in "ab":
        pool.set_state(name, "ready", True)
    seen = []
    pool.subscribe(lambda backend, state, ready: seen.append((backend.name, state, ready)))
    leaving = asyncio.create_task(pool.wait_not_ready("a", 5))
    await asyncio.sleep(0)
    assert pool.eject("a", 60) is True
    assert await leaving is True  # an ejection is a departure for whoever waits for one
    assert [b.name for b in pool.ready()] == ["b"] and not pool.is_ready("a") and pool.state("a") == "ready"
    assert pool.eject("a", 60) is False  # already out
    pool.set_state("a", "ready", True)  # the health check passed / the supervisor restarted it
    assert [b.name for b in pool.ready()] == ["a", "b"] and not pool.is_ejected("a")
    assert seen == [("a", "ready", False), ("a", "ready", True)]
    pool.set_state("b", "stopping", False)
    assert pool.eject("b", 60) is False  # not in the rotation: nothing to eject


@pytest.mark.parametrize("body", [
    b'{"a": 1}', b'{"a": 1}  \n', b' {"a": 1}', b'{"a": 1} x', '{"a": 1}\u2003'.encode(), b"[1]", b'{"a": }',
    b'\xef\xbb\xbf{"a": 1}', b'{"a": "\xff"}', b"{}", b'{"a": [1, {"b": null}], "stream": true}', b"",
])
def test_parse_json_is_json_loads(body):
    def outcome(parse):
        try:
            return "ok", parse(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return type(exc).__name__, str(exc)

    assert outcome(parse_json) == outcome(json.loads)


def test_error_body_is_openai_shaped():
    assert json.loads(error_body("m", "t", "c")) == {"error": {"message": "m", "type": "t", "param": None, "code": "c"}}


# ---------------------------------------------------------------------------------- through the proxy


async def test_sync_and_async_clients(fakes):
    async with running_proxy(ready_pool(fakes)) as proxy:
        async_reply = await client(proxy).chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=3)
        assert async_reply.choices[0].message.content == "tok0 tok1 tok2"

        def sync_call():
            with openai.OpenAI(base_url=url(proxy, "/v1"), api_key="x", max_retries=0) as sync_client:
                completion = sync_client.completions.create(model="fake-model", prompt="hi", max_tokens=2)
                embedding = sync_client.embeddings.create(model="fake-model", input="hi")
                return completion, embedding

        completion, embedding = await asyncio.to_thread(sync_call)
        assert completion.choices[0].text == "tok0 tok1"
        assert len(embedding.data[0].embedding) == 8


async def test_round_robin_is_fair(fakes):
    async with running_proxy(ready_pool(fakes)) as proxy:
        c = client(proxy)
        seen = Counter([await served_by(c) for _ in range(20)])
        assert seen == {"a": 10, "b": 10}
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_requests_total", route="/v1/chat/completions", status="200", instance="a") == 10


async def test_instances_not_ready_are_skipped(fakes):
    pool = ready_pool(fakes)
    pool.set_state("b", "restarting", False)
    async with running_proxy(pool) as proxy:
        c = client(proxy)
        assert {await served_by(c) for _ in range(6)} == {"a"}
        pool.set_state("b", "ready", True)  # back in rotation at once, no poll interval
        assert {await served_by(c) for _ in range(6)} == {"a", "b"}


async def test_least_outstanding_avoids_the_busy_instance(fakes):
    async with running_proxy(ready_pool(fakes), policy="least_outstanding") as proxy:
        c = client(proxy)
        stream = await c.chat.completions.create(
            model="fake-model", messages=MESSAGES, max_tokens=40, stream=True, extra_body={"fake": {"token_delay": 0.05}}
        )
        first = await anext(aiter(stream))  # the slow stream is now in flight on one instance
        busy = first.id.split("-")[1]
        assert proxy.in_flight() == {busy: 1}
        others = {await served_by(c) for _ in range(6)}
        assert others == {"a", "b"} - {busy}
        await stream.close()


async def test_no_ready_instance_is_503_with_retry_after(fakes):
    async with running_proxy(ready_pool(fakes, ready=False)) as proxy:
        with pytest.raises(openai.InternalServerError) as caught:
            await client(proxy).chat.completions.create(model="fake-model", messages=MESSAGES)
        assert caught.value.status_code == 503
        assert "no ready instance" in caught.value.message
        assert caught.value.response.headers["Retry-After"] == "1"
        assert caught.value.body["code"] == "no_ready_instance"
        async with aiohttp.ClientSession() as session:
            async with session.get(url(proxy, "/ready")) as response:
                assert response.status == 503
            async with session.get(url(proxy, "/health")) as response:
                assert response.status == 200


async def test_bad_input_gets_openai_shaped_errors(fakes):
    async with running_proxy(ready_pool(fakes), max_body_bytes=2048) as proxy:
        async with aiohttp.ClientSession() as session:
            post = url(proxy, "/v1/chat/completions")
            async with session.post(post, data=b'{"model": "x", "messages": [', headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400
                body = await r.json()
                assert body["error"]["type"] == "invalid_request_error" and "not valid JSON" in body["error"]["message"]
            async with session.post(post, data=b"[1, 2]", headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and "JSON object" in (await r.json())["error"]["message"]
            async with session.post(post, data=b"x" * 5000, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 413 and "proxy.max_body_bytes" in (await r.json())["error"]["message"]

            async def chunked_body():  # no Content-Length: the limit must hold while reading
                for _ in range(5):
                    yield b"y" * 1000

            async with session.post(post, data=chunked_body(), headers={"Content-Type": "application/json"}) as r:
                assert r.status == 413
            async with session.get(url(proxy, "/admin")) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        with pytest.raises(openai.APIStatusError) as caught:
            await client(proxy).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "z" * 4000}])
        assert caught.value.status_code == 413
        # the instance's own errors pass through unchanged
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client(proxy).chat.completions.create(model="no-such-model", messages=MESSAGES)


async def test_auth_on(fakes):
    async with running_proxy(ready_pool(fakes), api_key="s3cret") as proxy:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client(proxy, key="wrong").chat.completions.create(model="fake-model", messages=MESSAGES)
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
        reply = await client(proxy, key="s3cret").chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=1)
        assert reply.choices[0].message.content == "tok0"
        assert (await client(proxy, key="s3cret").models.list()).data[0].id == "fake-model"
        async with aiohttp.ClientSession() as session:
            for path, status in (("/health", 200), ("/ready", 200), ("/metrics", 401), ("/v1/models", 401)):
                async with session.get(url(proxy, path)) as response:
                    assert response.status == status, path
        assert "vsup_proxy_requests_total" in await metrics_text(proxy, api_key="s3cret")


async def test_auth_off_accepts_any_key(fakes):
    async with running_proxy(ready_pool(fakes)) as proxy:
        reply = await client(proxy, key="anything").chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=1)
        assert reply.choices[0].message.content == "tok0"


async def test_models_come_from_ready_instances_only(fakes):
    [other] = start_fakes(["c"])
    try:
        pool = ready_pool(fakes)
        pool.add(Backend("c", other.url))
        async with running_proxy(pool) as proxy:
            c = client(proxy)
            assert [m.id for m in (await c.models.list()).data] == ["fake-model"]  # de-duplicated, c not ready
            pool.set_state("a", "unhealthy", False)
            pool.set_state("b", "unhealthy", False)
            with pytest.raises(openai.InternalServerError):
                await c.models.list()
            pool.set_state("c", "ready", True)
            assert [m.id for m in (await c.models.list()).data] == ["fake-model"]
    finally:
        other.cleanup()


async def test_models_lists_every_distinct_model(fakes):
    second = start_fake(name="m2", env=LEAN, served_model_names=["other-model"])
    try:
        second.wait_ready()
        async with running_proxy(ready_pool([*fakes, second])) as proxy:
            ids = sorted(m.id for m in (await client(proxy).models.list()).data)
            assert ids == ["fake-model", "other-model"]
    finally:
        second.cleanup()


async def test_retry_before_first_byte_when_an_instance_is_killed():
    a, b = start_fakes(["a", "b"])
    try:
        pool = ready_pool([a, b])
        async with running_proxy(pool) as proxy:
            c = client(proxy)
            assert {await served_by(c) for _ in range(2)} == {"a", "b"}  # warm keep-alive connections
            a.kill_group()  # still "ready" in the pool: nobody told the proxy
            assert [await served_by(c) for _ in range(6)] == ["b"] * 6
            text = await metrics_text(proxy)
            # the first refused connect took "a" out of the rotation: no request paid for it again
            assert metric_value(text, "vsup_proxy_retries_total", reason="connect") == 1
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="a", kind="connect") == 1
            assert metric_value(text, "vsup_proxy_ejections_total", instance="a") == 1
    finally:
        a.cleanup()
        b.cleanup()


async def test_retry_on_503_goes_to_another_instance(fakes):
    [refusing] = start_fakes(["r"], env={"FAKE_VLLM_STATUS_503": "1"})
    try:
        pool = ready_pool([refusing, fakes[0]])
        async with running_proxy(pool) as proxy:
            c = client(proxy)
            assert [await served_by(c) for _ in range(4)] == ["a"] * 4
            assert metric_value(await metrics_text(proxy), "vsup_proxy_retries_total", reason="503") >= 2
        # with no other instance, the instance's 503 reaches the client (with Retry-After)
        async with running_proxy(ready_pool([refusing])) as proxy:
            with pytest.raises(openai.InternalServerError) as caught:
                await client(proxy).chat.completions.create(model="fake-model", messages=MESSAGES)
            assert caught.value.status_code == 503 and "FAKE_VLLM_STATUS_503" in caught.value.message
            assert caught.value.response.headers["Retry-After"]
    finally:
        refusing.cleanup()


async def test_retry_budget_is_bounded():
    dead = [Backend(f"dead{i}", f"http://127.0.0.1:{free_port()}") for i in range(3)]
    pool = BackendPool(dead)
    for backend in dead:
        pool.set_state(backend.name, "ready", True)
    async with running_proxy(pool, retries=1) as proxy:
        with pytest.raises(openai.APIStatusError) as caught:
            await client(proxy).chat.completions.create(model="fake-model", messages=MESSAGES)
        assert caught.value.status_code == 502 and "cannot connect" in caught.value.message
        text = await metrics_text(proxy)
        attempts = sum(metric_value(text, "vsup_proxy_upstream_errors_total", instance=b.name, kind="connect") for b in dead)
        assert attempts == 2  # the first try and one retry
        # the two tried were ejected; the next request tries the third, and then none is left
        with pytest.raises(openai.APIStatusError) as caught:
            await client(proxy).chat.completions.create(model="fake-model", messages=MESSAGES)
        assert caught.value.status_code == 503 and "could be reached" in caught.value.message


async def test_every_instance_unreachable_is_503_on_the_first_request():
    a, b = start_fakes(["a", "b"])
    try:
        pool = ready_pool([a, b])
        async with running_proxy(pool) as proxy:
            c = client(proxy)
            assert {await served_by(c) for _ in range(2)} == {"a", "b"}
            a.kill_group()
            b.kill_group()  # nobody tells the proxy: the pool still says both are ready
            with pytest.raises(openai.InternalServerError) as caught:
                await c.chat.completions.create(model="fake-model", messages=MESSAGES)
            assert caught.value.status_code == 503
            assert caught.value.response.headers["Retry-After"] == "1"
            assert caught.value.body["code"] == "no_ready_instance" and "could be reached" in caught.value.message
            assert "instance a:" in caught.value.message and "instance b:" in caught.value.message
            assert pool.ready() == () and pool.state("a") == "ready"  # ejected; the owner's state is untouched
            text = await metrics_text(proxy)
            assert metric_value(text, "vsup_proxy_ejections_total", instance="a") == 1
            assert metric_value(text, "vsup_proxy_ejections_total", instance="b") == 1
            assert metric_value(text, "vsup_instance_ready", instance="a") == 0
            # the next request does not try them again: a plain "no ready instance"
            with pytest.raises(openai.InternalServerError, match="no ready instance"):
                await c.chat.completions.create(model="fake-model", messages=MESSAGES)
            async with aiohttp.ClientSession() as session:
                async with session.get(url(proxy, "/ready")) as response:
                    assert response.status == 503
            # the owner (here: what the supervisor does when the restarted instance is healthy)
            # brings one back at once
            revived = start_fake(a.port, name="a2", env=LEAN)
            try:
                revived.wait_ready()
                pool.set_state("a", "ready", True)
                assert await served_by(c) == "a2"
            finally:
                revived.cleanup()
    finally:
        a.cleanup()
        b.cleanup()


async def test_an_ejection_runs_out_without_a_health_check(monkeypatch):
    # A refused connect that was no death (the owner never says otherwise): the instance is tried
    # again after EJECT_SECONDS, and found alive.
    monkeypatch.setattr("vsup.proxy.forward.EJECT_SECONDS", 0.5)
    port = free_port()
    pool = BackendPool([Backend("late", f"http://127.0.0.1:{port}")])
    pool.set_state("late", "ready", True)
    async with running_proxy(pool) as proxy:
        c = client(proxy)
        with pytest.raises(openai.InternalServerError, match="could be reached"):
            await served_by(c)
        assert pool.ready() == ()
        late = start_fake(port, name="late", env=LEAN)  # it was only slow to listen
        try:
            late.wait_ready()
            await wait_for(lambda: pool.is_ready("late"), what="the ejection to run out")
            assert await served_by(c) == "late"
        finally:
            late.cleanup()


async def test_metrics_show_states_and_in_flight(fakes):
    pool = ready_pool(fakes)
    pool.set_state("b", "starting", False)
    async with running_proxy(pool) as proxy:
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_instance_state", instance="a", state="ready") == 1
        assert metric_value(text, "vsup_instance_state", instance="b", state="starting") == 1
        assert metric_value(text, "vsup_instance_ready", instance="b") == 0
        await served_by(client(proxy))
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_upstream_ttfb_seconds_count", stream="false") == 1
        assert "vsup_proxy_in_flight" in text


async def test_port_in_use_is_one_line_error(fakes):
    from vsup.config.schema import ProxyConfig
    from vsup.errors import VsupError
    from vsup.proxy import ProxyServer

    async with running_proxy(ready_pool(fakes)) as proxy:
        second = ProxyServer(ProxyConfig(port=proxy.port), ready_pool(fakes))
        with pytest.raises(VsupError, match=f"127.0.0.1:{proxy.port}: the port is already in use"):
            await second.start()
