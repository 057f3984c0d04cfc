"""Only vLLM's serving routes reach the instances (issue 20 §3): admin routes (LoRA loading,
profiler, collective_rpc, ...) and unknown paths get the proxy's 404 and never reach a fake
instance (its access log and event log say what it was sent), unless proxy.admin_routes opens
them, and then only with the API key. Real sockets, real fake-vLLM processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import aiohttp
import pytest

from tests.fakevllm.fixtures import free_port
from tests.proxy_support import ready_pool, running_proxy, start_fakes, url
from tests.test_proxy_cli import REPO, VSUP, request, wait_until
from vsup.config import proxy_routes
from vsup.config.schema import ProxyConfig, load_config
from vsup.errors import ConfigError, VsupError
from vsup.proxy import ProxyServer

# The fake writes uvicorn's access line for every request it receives.
WITH_ACCESS_LOG = {"FAKE_VLLM_ACCESS_LOG": "1"}
LORA = {"lora_name": "sql", "lora_path": "/tmp/adapters/sql"}
# Admin routes and odd paths an attacker would try; none may reach an instance by default.
REFUSED = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile", "/collective_rpc",
           "/reset_prefix_cache", "/sleep", "/server_info", "/v1/anything", "/version", "/v1/responses/x/y"]


@pytest.fixture(scope="module")
def fake():
    (started,) = start_fakes(["a"], env=WITH_ACCESS_LOG)
    yield started
    started.cleanup()


def _reached(fake, path: str) -> bool:
    return f" {path} HTTP/1.1" in fake.output() or any(e.get("path") == path for e in fake.events("lora_adapter"))


async def _post(session: aiohttp.ClientSession, target: str, key: str | None = None, method: str = "POST"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": "hi"} if target.endswith("/tokenize") else LORA
    async with session.request(method, target, json=body, headers=headers) as response:
        return response.status, response.headers.get("X-Fake-Instance"), await response.read()


async def test_admin_and_unknown_routes_never_reach_an_instance(fake):
    async with running_proxy(ready_pool([fake])) as proxy, aiohttp.ClientSession() as session:
        for path in REFUSED:
            status, served, body = await _post(session, url(proxy, path))
            assert status == 404 and served is None, path
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "not_found", path
            assert "proxy.admin_routes" in error["message"]
        # the serving routes still reach it, /tokenize (vsup tune's) included
        status, served, _ = await _post(session, url(proxy, "/tokenize"))
        assert (status, served) == (200, "a")
        async with session.post(url(proxy, "/v1/completions"), json={"model": "fake-model", "prompt": "hi", "max_tokens": 1}) as r:
            assert r.status == 200 and r.headers["X-Fake-Instance"] == "a"
        # a method the route does not take: 405 from the proxy, with Allow
        async with session.get(url(proxy, "/v1/chat/completions")) as r:
            assert r.status == 405 and r.headers["Allow"] == "POST" and "X-Fake-Instance" not in r.headers
            assert (await r.json())["error"]["code"] == "method_not_allowed"
        # spelled so that only the instance would see the admin route: refused all the same
        for sneaky, status in (("/v1/load%5Flora%5Fadapter", 404), ("/v1/chat/completions%2F..%2Fload_lora_adapter", 400),
                               ("/v1/chat/completions/../load_lora_adapter", 400), ("//v1/load_lora_adapter", 404)):
            got, headers, _ = await asyncio.to_thread(request, proxy.port, "POST", sneaky, LORA)
            assert (got, "X-Fake-Instance" in headers) == (status, False), sneaky
    assert _reached(fake, "/tokenize")  # the check below can see a request that got through
    for path in REFUSED:
        assert not _reached(fake, path), path


async def test_opened_admin_route_needs_the_key(fake):
    opened = ["/v1/load_lora_adapter"]
    async with running_proxy(ready_pool([fake]), api_key="k3y", admin_routes=opened) as proxy, aiohttp.ClientSession() as session:
        target = url(proxy, "/v1/load_lora_adapter")
        assert (await _post(session, target))[:2] == (401, None)
        assert (await _post(session, target, key="wrong"))[:2] == (401, None)
        assert not fake.events("lora_adapter")
        status, served, body = await _post(session, target, key="k3y")
        assert (status, served) == (200, "a") and b"added successfully" in body
        assert [e["path"] for e in fake.events("lora_adapter")] == ["/v1/load_lora_adapter"]
        # an admin route not opened stays closed, key or not
        status, served, _ = await _post(session, url(proxy, "/v1/unload_lora_adapter"), key="k3y")
        assert (status, served) == (404, None)
        assert (await _post(session, target, key="k3y", method="GET"))[0] == 405
    assert [e["path"] for e in fake.events("lora_adapter")] == ["/v1/load_lora_adapter"]


def test_admin_routes_without_a_key_refuse_to_start():
    with pytest.raises(VsupError, match=r"proxy.admin_routes opens /start_profile, which need an API key: set proxy.api_key"):
        ProxyServer(ProxyConfig(port=0, admin_routes=["/start_profile"]), ready_pool([]))


def test_unknown_admin_route_is_a_config_error_listing_the_valid_ones(tmp_path):
    path = tmp_path / "vsup.yaml"
    path.write_text("model: m\nproxy:\n  api_key: k\n  admin_routes: [/v1/load_lora_adapter, /v1/chat/completions]\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, require_model=False)
    message = str(caught.value)
    assert "proxy.admin_routes" in message and "'/v1/chat/completions' is not an admin route" in message
    assert "valid: /v1/load_lora_adapter, /v1/unload_lora_adapter, /start_profile" in message
    assert "\n" not in message.strip()


def test_templated_routes():
    assert proxy_routes.templated("/v1/responses/resp_1").methods == {"GET"}
    assert proxy_routes.templated("/v1/responses/resp_1/cancel").methods == {"POST"}
    for path in ("/v1/responses/", "/v1/responses//cancel", "/v1/responses/a/b", "/v1/responses/a/cancel/x", "/v1/other/a"):
        assert proxy_routes.templated(path) is None, path


def _doc_table(text: str, header: str) -> dict[str, set[str]]:
    section = text.split(f"| {header} |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([A-Z, ]+) \|", section, re.M)
    return {path: set(methods.split(", ")) for path, methods in rows}


def test_docs_list_exactly_the_table():
    text = (Path(__file__).parent.parent / "docs" / "proxy.md").read_text()
    serving = {path: set(methods) for path, methods in proxy_routes.SERVING.items()}
    serving |= {"/v1/responses/{id}": {"GET"}, "/v1/responses/{id}/cancel": {"POST"}}
    assert _doc_table(text, "serving route") == serving
    assert _doc_table(text, "admin route") == {path: set(methods) for path, (methods, _) in proxy_routes.ADMIN.items()}


def test_standalone_proxy_refuses_admin_routes():
    """`vsup proxy` (upstreams may be other vsups) goes through the same table."""
    (fake,) = start_fakes(["s"], env=WITH_ACCESS_LOG)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), VSUP_API_KEY="")
    proc = subprocess.Popen(
        [*VSUP, "proxy", "--upstream", fake.url, "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_until(lambda: request(port, "GET", "/ready")[0] == 200, what="the standalone proxy to see its upstream")
        status, headers, body = request(port, "POST", "/v1/load_lora_adapter", LORA)
        assert status == 404 and b"not_found" in body and "X-Fake-Instance" not in headers
        assert request(port, "POST", "/tokenize", {"prompt": "hi"})[1]["X-Fake-Instance"] == "s"
        assert _reached(fake, "/tokenize") and not _reached(fake, "/v1/load_lora_adapter")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
        fake.cleanup()
