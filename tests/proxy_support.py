"""Shared pieces of the proxy tests: fake instances as real processes, a ProxyServer over them."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Iterable

import aiohttp
import openai

from tests.fakevllm.fixtures import FakeVllm, start_fake
from vsup.config.schema import ProxyConfig
from vsup.proxy import ProxyServer
from vsup.proxy.backends import Backend, BackendPool

# The fake's EngineCore/Worker stand-ins and shm files are irrelevant to the proxy: skip them.
LEAN = {"FAKE_VLLM_CHILD": "0", "FAKE_VLLM_SHM": "0", "FAKE_VLLM_ACCESS_LOG": "0", "FAKE_VLLM_TOKEN_DELAY": "0.002"}
MESSAGES = [{"role": "user", "content": "hello there"}]


def start_fakes(names: Iterable[str], env: dict[str, str] | None = None) -> list[FakeVllm]:
    fakes = [start_fake(name=name, env={**LEAN, **(env or {})}) for name in names]
    try:
        for fake in fakes:
            fake.wait_ready()
    except BaseException:
        for fake in fakes:
            fake.cleanup()
        raise
    return fakes


def ready_pool(fakes: Iterable[FakeVllm], ready: bool = True) -> BackendPool:
    pool = BackendPool()
    for fake in fakes:
        pool.add(Backend(fake.name, fake.url))
        if ready:
            pool.set_state(fake.name, "ready", True)
    return pool


def model_pool(fake: FakeVllm, model: str = "chat") -> BackendPool:
    """A pool of the one ready instance `fake`, serving `model` (routing by model, as a fleet's)."""
    pool = BackendPool()
    pool.add(Backend(fake.name, fake.url, model))
    pool.set_state(fake.name, "ready", True)
    return pool


@contextlib.asynccontextmanager
async def running_proxy(pool: BackendPool, api_key: str | None = None, *, models=None, names=None, server=None, **config):
    """A started ProxyServer over `pool` (ProxyConfig `config`; `server`: further ProxyServer
    arguments, e.g. batch and batch_dir), its clients closed and itself stopped after."""
    proxy = ProxyServer(ProxyConfig(port=0, **config), pool, api_key=api_key, models=models, names=names, **(server or {}))
    await proxy.start()
    try:
        yield proxy
    finally:
        await close_clients(proxy)
        await proxy.drain_and_stop(0)


def url(proxy: ProxyServer, path: str = "") -> str:
    return f"http://127.0.0.1:{proxy.port}{path}"


# The clients `client()` made for each proxy: `running_proxy` closes them before it stops the proxy
# (left to the garbage collector, their keep-alive sockets are ResourceWarnings in a later test).
_CLIENTS: weakref.WeakKeyDictionary[ProxyServer, list[openai.AsyncOpenAI]] = weakref.WeakKeyDictionary()


def client(proxy: ProxyServer, key: str = "unused", **kw) -> openai.AsyncOpenAI:
    made = openai.AsyncOpenAI(base_url=url(proxy, "/v1"), api_key=key, max_retries=0, **kw)
    _CLIENTS.setdefault(proxy, []).append(made)
    return made


async def close_clients(proxy: ProxyServer) -> None:
    """Close every client `client()` made for `proxy` (for a proxy not started by running_proxy)."""
    for made in _CLIENTS.pop(proxy, []):
        await made.close()


async def served_by(c: openai.AsyncOpenAI, **extra) -> str:
    """The name of the fake instance that answered a short chat completion."""
    raw = await c.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES, max_tokens=2, **extra)
    return raw.headers["x-fake-instance"]


async def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def metrics_text(proxy: ProxyServer, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(url(proxy, "/metrics"), headers=headers) as response:
            assert response.status == 200
            return await response.text()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text, 0 when absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
