"""Every proxy key classed `live` (vsup/config/schema.py) takes effect through the proxy's
reconfigure, as `vsup reload` calls it: real sockets, a real ProxyServer, in-process upstreams.
(proxy.drain_timeout is the supervisor's: tests/test_reload_classes.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from tests.test_proxy_admission import RELOAD_COVERED
from tests.test_proxy_deadlines import RELOAD_COVERED as STALL_COVERED
from vsup.config.schema import RELOAD, ProxyConfig
from vsup.proxy import ProxyServer
from vsup.proxy.backends import Backend, BackendPool

pytestmark = pytest.mark.timeout(60)

# what these tests cover; test_reload_classes.py checks it is every live proxy key but drain_timeout
COVERED = {"proxy.connect_timeout", "proxy.first_byte_timeout", "proxy.idle_timeout", "proxy.retries", "proxy.policy",
           "proxy.affinity_prefix_chars", "proxy.affinity_load_factor", "proxy.load_interval", "proxy.api_key", "proxy.admin_routes",
           "proxy.max_header_bytes", "proxy.header_timeout", "proxy.body_timeout", "proxy.max_connections_per_client",
           *RELOAD_COVERED,  # the admission keys: tests/test_proxy_admission.py
           *STALL_COVERED}  # the stall watchdog's: tests/test_proxy_deadlines.py


@contextlib.contextmanager
def black_hole():
    """A loopback port where a connect never completes: a listener with backlog 0 that never
    accepts, its accept queue filled, so the kernel drops further SYNs. Yields the port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(16):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
            _, writable, _ = select.select([], [filler], [], 0.5)
            if not writable:
                break  # this one hangs: the queue is full
        else:
            raise AssertionError("could not fill the accept queue")
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


class Upstream:
    """An instance stand-in on a real socket: answers /v1/completions with its name, after
    `header_delay`; a streamed answer sends one event, is silent `gap` seconds, then ends. A
    prompt containing "hold" waits until `release` is set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hits: list[str] = []
        self.status = 200
        self.header_delay = 0.0
        self.gap = 0.0
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("prompt", "")
        self.hits.append(prompt)
        await asyncio.sleep(self.header_delay)
        if "hold" in prompt:
            await self.release.wait()
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            await asyncio.sleep(self.gap)
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response({"name": self.name}, status=self.status)

    async def start(self) -> Upstream:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/load_lora_adapter", self.handle)  # an admin route (proxy.admin_routes)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@contextlib.asynccontextmanager
async def proxy_over(backends: dict[str, str], **config):
    pool = BackendPool()
    for name, url in backends.items():
        pool.add(Backend(name, url))
        pool.set_state(name, "ready", True)
    proxy = ProxyServer(ProxyConfig(port=0, **config), pool)
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield proxy, session
    finally:
        await proxy.drain_and_stop(0)


def reconfigure(proxy: ProxyServer, **config) -> None:
    """What `vsup reload` does with a changed proxy section (the whole new section, as validated)."""
    new = ProxyConfig(port=0, **config)
    proxy.reconfigure(new, new.api_key)


async def complete(proxy: ProxyServer, session: aiohttp.ClientSession, prompt: str = "hi", *, stream: bool = False,
                   key: str | None = None) -> tuple[int, str, float]:
    began = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.post(f"http://127.0.0.1:{proxy.port}/v1/completions", json={"prompt": prompt, "stream": stream},
                            headers=headers) as response:
        text = await response.text()
    return response.status, text, time.monotonic() - began


def test_every_covered_key_is_live():
    assert all(RELOAD[key].reload == "live" for key in COVERED)


async def test_a_lowered_connect_timeout_reaches_the_pools_and_models():
    with black_hole() as port:
        async with proxy_over({"0": f"http://127.0.0.1:{port}"}, connect_timeout=1.5, retries=0) as (proxy, session):
            status, text, took = await complete(proxy, session)  # its pool is built with 1.5 s
            assert status == 503 and "within 1.5 s" in text and took >= 1.4
            proxy.pool.set_state("0", "ready", True)  # its owner's health check: back in the rotation
            reconfigure(proxy, connect_timeout=0.2, retries=0)
            status, text, took = await complete(proxy, session)
            assert status == 503 and "within 0.2 s" in text, text
            assert took < 1.0
            proxy.pool.set_state("0", "ready", True)
            began = time.monotonic()
            async with session.get(f"http://127.0.0.1:{proxy.port}/v1/models") as response:
                assert response.status == 502
            assert time.monotonic() - began < 1.0  # not the 1.5 s the /v1/models session was built with


async def test_a_lowered_first_byte_timeout_and_idle_timeout_apply_to_the_next_request():
    upstream = await Upstream("0").start()
    try:
        async with proxy_over({"0": upstream.url}, first_byte_timeout=30, idle_timeout=30) as (proxy, session):
            upstream.header_delay = 1.5
            reconfigure(proxy, first_byte_timeout=0.3, idle_timeout=30)
            status, text, took = await complete(proxy, session)
            assert status == 504 and "proxy.first_byte_timeout" in text and took < 1.2
            upstream.header_delay, upstream.gap = 0.0, 1.5
            reconfigure(proxy, first_byte_timeout=30, idle_timeout=0.3)
            status, text, took = await complete(proxy, session, stream=True)
            assert status == 200 and "[DONE]" not in text and "proxy.idle_timeout" in text and took < 1.2
    finally:
        await upstream.stop()


async def test_retries_follow_the_new_count():
    upstreams = [await Upstream(name).start() for name in ("0", "1")]
    try:
        for upstream in upstreams:
            upstream.status = 503
        async with proxy_over({u.name: u.url for u in upstreams}, retries=0) as (proxy, session):
            status, _, _ = await complete(proxy, session)
            assert status == 503 and sum(len(u.hits) for u in upstreams) == 1
            reconfigure(proxy, retries=1)
            status, _, _ = await complete(proxy, session)
            assert status == 503 and sum(len(u.hits) for u in upstreams) == 3  # one, then two tries
    finally:
        for upstream in upstreams:
            await upstream.stop()


async def test_a_new_policy_routes_the_next_requests():
    upstreams = [await Upstream(name).start() for name in ("0", "1")]
    try:
        async with proxy_over({u.name: u.url for u in upstreams}, policy="round_robin") as (proxy, session):
            held = asyncio.ensure_future(complete(proxy, session, "hold"))
            while not any(u.hits for u in upstreams):
                await asyncio.sleep(0.01)
            busy = next(u for u in upstreams if u.hits)
            for _ in range(4):
                await complete(proxy, session)
            assert len(busy.hits) == 1 + 2  # round robin: every other request, busy or not
            reconfigure(proxy, policy="least_outstanding")
            for _ in range(4):
                await complete(proxy, session)
            assert len(busy.hits) == 3  # least outstanding: all to the idle one
            busy.release.set()
            assert (await held)[0] == 200
    finally:
        for upstream in upstreams:
            await upstream.stop()


async def test_affinity_settings_apply_to_the_running_balancer():
    upstreams = [await Upstream(name).start() for name in ("0", "1")]
    prompts = [f"a shared beginning, then {i:03d} something else" for i in range(24)]
    try:
        async with proxy_over({u.name: u.url for u in upstreams}, policy="prefix_affinity") as (proxy, session):
            for prompt in prompts:  # 2048 characters pick the instance: these differ within them
                await complete(proxy, session, prompt)
            assert all(u.hits for u in upstreams)
            reconfigure(proxy, policy="prefix_affinity", affinity_prefix_chars=16)
            for upstream in upstreams:
                upstream.hits.clear()
            for prompt in prompts:  # now only "a shared beginn" picks it: one instance gets all
                await complete(proxy, session, prompt)
            assert sorted(len(u.hits) for u in upstreams) == [0, 24]

            winner = next(u for u in upstreams if u.hits)
            other = next(u for u in upstreams if u is not winner)
            reconfigure(proxy, policy="prefix_affinity", affinity_prefix_chars=16, affinity_load_factor=0)
            # The bound counts the work before a first token (load.work), in units of the next
            # request's prefill; a request to its key's instance counts what its body adds to the
            # key's last one. So the held one adds 1.5 of the next one's size: 1 whole unit queued.
            def size(prompt: str) -> int:  # the body complete() sends (aiohttp's json.dumps)
                return len(json.dumps({"prompt": prompt, "stream": False}))
            hold = "a shared beginning: hold "
            hold += "." * (size(prompts[-1]) + size(prompts[0]) * 3 // 2 - size(hold))
            held = asyncio.ensure_future(complete(proxy, session, hold))
            while len(winner.hits) < 25:
                await asyncio.sleep(0.01)
            await complete(proxy, session, prompts[0])  # 1 + 1 is over ceil((1 + 0) x 2 / 2): escaped
            assert len(other.hits) == 1
            reconfigure(proxy, policy="prefix_affinity", affinity_prefix_chars=16, affinity_load_factor=1.0)
            await complete(proxy, session, prompts[0])  # 1 + 1 within ceil((1 + 1) x 2 / 2)
            assert len(other.hits) == 1 and len(winner.hits) == 26
            winner.release.set()
            assert (await held)[0] == 200
    finally:
        for upstream in upstreams:
            await upstream.stop()


async def test_a_new_api_key_is_required_at_once_and_dropping_it_opens_the_proxy():
    upstream = await Upstream("0").start()
    try:
        async with proxy_over({"0": upstream.url}) as (proxy, session):
            assert (await complete(proxy, session))[0] == 200
            reconfigure(proxy, api_key="sekret")
            assert (await complete(proxy, session))[0] == 401
            assert (await complete(proxy, session, key="sekret"))[0] == 200
            reconfigure(proxy)
            assert (await complete(proxy, session))[0] == 200
    finally:
        await upstream.stop()


async def test_admin_routes_open_and_close_at_once():
    upstream = await Upstream("0").start()
    lora = {"prompt": "lora"}  # Upstream.handle records the prompt
    try:
        async with proxy_over({"0": upstream.url}) as (proxy, session):
            target = f"http://127.0.0.1:{proxy.port}/v1/load_lora_adapter"
            auth = {"Authorization": "Bearer k"}
            async with session.post(target, json=lora, headers=auth) as response:
                assert response.status == 404
            reconfigure(proxy, api_key="k", admin_routes=["/v1/load_lora_adapter"])
            async with session.post(target, json=lora, headers=auth) as response:
                assert response.status == 200
            assert upstream.hits == ["lora"]
            reconfigure(proxy, api_key="k")
            async with session.post(target, json=lora, headers=auth) as response:
                assert response.status == 404
            reconfigure(proxy, admin_routes=["/v1/load_lora_adapter"])  # no key: kept closed, logged
            async with session.post(target, json=lora) as response:
                assert response.status == 404
            assert (await complete(proxy, session))[0] == 200  # the serving routes stay open
            assert upstream.hits == ["lora", "hi"]
    finally:
        await upstream.stop()


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def raw_answer(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    """Send `data` on a new connection and read until the proxy closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


async def test_the_front_door_settings_apply_to_the_next_connections():
    upstream = await Upstream("0").start()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    body = b'{"prompt": "hi"}'
    padded = head + (b"X-Pad: " + b"a" * 3000 + b"\r\n") * 4 + b"Content-Length: %d\r\n\r\n" % len(body) + body
    try:
        async with proxy_over({"0": upstream.url}) as (proxy, session):
            assert (await raw_answer(proxy.port, padded)).startswith(b"HTTP/1.1 200")
            reconfigure(proxy, max_header_bytes=8192, header_timeout=0.3, body_timeout=0.3)
            assert b" 431 " in (await raw_answer(proxy.port, padded))[:20]  # proxy.max_header_bytes
            assert await raw_answer(proxy.port, head) == b""  # proxy.header_timeout: closed, not kept for 30 s
            half = head + b"Content-Length: 100\r\n\r\n" + body
            assert (await raw_answer(proxy.port, half)).startswith(b"HTTP/1.1 408")  # proxy.body_timeout
            reconfigure(proxy, max_connections_per_client=1)  # (the held connection is silent: the default header_timeout)
            await until(lambda: proxy.metrics.client_connections() == 0)  # the 408's connection lingers a moment
            _, held = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                await until(lambda: proxy.metrics.client_connections() == 1)
                assert (await raw_answer(proxy.port, head)).startswith(b"HTTP/1.1 429")  # proxy.max_connections_per_client
            finally:
                held.close()
    finally:
        await upstream.stop()
