"""The front door, attacked over real sockets before anything is authenticated: headers over
proxy.max_header_bytes, headers and bodies trickled past their deadlines, one address holding
many connections, /health and /ready while every slot is taken, `Expect: 100-continue` and
absolute-form request targets. (The figures under load are bench/flood_bench.py's.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess

import pytest

from tests.proxy_support import MESSAGES, metric_value, metrics_text, ready_pool, running_proxy, start_fakes, wait_for
from tests.test_proxy_clients import exchange, no_tracebacks, parsed

CHAT = json.dumps({"model": "fake-model", "messages": MESSAGES, "max_tokens": 1}).encode()
KEY = "front-door-key"
LINE = b"X-Pad: " + b"a" * 4000 + b"\r\n"  # each line well under aiohttp's 8190 bytes


@pytest.fixture(scope="module")
def fake():
    [started] = start_fakes(["f"])
    yield started
    started.cleanup()


def chat_request(target: str = "/v1/chat/completions", *extra: bytes, body: bytes = CHAT, key: str = KEY, close: bool = True) -> bytes:
    """A chat request's line and headers (the body is the caller's to send)."""
    head = [f"POST {target} HTTP/1.1".encode(), b"Host: x", b"Content-Type: application/json",
            f"Authorization: Bearer {key}".encode(), b"Content-Length: %d" % len(body), *extra]
    if close:
        head.append(b"Connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n"


async def connect(port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the proxy sent before closing the connection (raises TimeoutError if it stays open)."""
    return await asyncio.wait_for(reader.read(), seconds)


# -- header bytes


async def test_headers_still_coming_past_max_header_bytes_get_431_before_auth(fake, caplog):
    before = len(fake.events("request"))
    async with running_proxy(ready_pool([fake]), api_key=KEY) as proxy:
        reader, writer = await connect(proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(40):  # 160 KiB of header lines, never ended
                writer.write(LINE * 1)
                await writer.drain()
        status, headers, body = parsed(await closed_within(reader, 5))
        writer.close()
        assert status == 431 and headers["Connection"] == "close"
        assert body["error"]["code"] == "request_header_fields_too_large" and "proxy.max_header_bytes" in body["error"]["message"]
        assert metric_value(await metrics_text(proxy, KEY), "vsup_proxy_malformed_requests_total", status="431") == 1
    assert len(fake.events("request")) == before
    no_tracebacks(caplog)


async def test_complete_headers_over_max_header_bytes_get_431_and_a_reload_changes_the_cap(fake):
    request = chat_request("/v1/chat/completions", *[LINE.rstrip(b"\r\n")] * 3) + CHAT  # ~12 KiB of headers
    async with running_proxy(ready_pool([fake]), api_key=KEY) as proxy:
        assert parsed(await exchange(proxy.port, request))[0] == 200
        proxy.reconfigure(proxy.config.model_copy(update={"max_header_bytes": 8192}), KEY)
        status, _, body = parsed(await exchange(proxy.port, request))  # whole, in one piece
        assert status == 431 and "proxy.max_header_bytes" in body["error"]["message"]
        big = chat_request("/v1/chat/completions", *[LINE.rstrip(b"\r\n")] * 30) + CHAT  # ~120 KiB, several reads
        proxy.reconfigure(proxy.config.model_copy(update={"max_header_bytes": 64 * 1024}), KEY)
        assert parsed(await exchange(proxy.port, big))[0] == 431


# -- deadlines


async def trickle_headers(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        for i in range(40):  # a header line every 0.1 s: 4 s, if let
            writer.write(b"X-%d: 1\r\n" % i)
            await writer.drain()
            await asyncio.sleep(0.1)


async def test_headers_trickled_past_header_timeout_are_closed(fake):
    async with running_proxy(ready_pool([fake]), header_timeout=0.5) as proxy:
        for first in (b"", chat_request(close=False) + CHAT):
            reader, writer = await connect(proxy.port)
            if first:  # a keep-alive connection: one request served, then the next one trickled
                writer.write(first)
                head = await reader.readuntil(b"\r\n\r\n")
                assert b" 200 " in head
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                await asyncio.sleep(0.8)  # idle between requests is not the header deadline
            writer.write(b"GET /health HTTP/1.1\r\n")

            sender = asyncio.create_task(trickle_headers(writer))
            try:
                rest = await closed_within(reader, 3)
            finally:
                sender.cancel()
                writer.close()
            assert b"HTTP/1.1 200" not in rest
        assert metric_value(await metrics_text(proxy), "vsup_proxy_client_timeouts_total", phase="headers") == 2


async def test_a_body_trickled_past_body_timeout_gets_408_and_never_reaches_the_instance(fake, caplog):
    before = len(fake.events("request"))
    async with running_proxy(ready_pool([fake]), body_timeout=0.5) as proxy:
        reader, writer = await connect(proxy.port)
        writer.write(chat_request(body=b" " * 500 + CHAT))

        async def trickle():
            with contextlib.suppress(ConnectionError):
                for _ in range(40):  # one byte every 0.1 s: never silent for long, never done
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(0.1)

        sender = asyncio.create_task(trickle())
        try:
            status, headers, body = parsed(await closed_within(reader, 3))
        finally:
            sender.cancel()
            writer.close()
        assert status == 408 and headers["Connection"] == "close" and "proxy.body_timeout" in body["error"]["message"]
        assert proxy.total_in_flight() == 0
    assert len(fake.events("request")) == before
    no_tracebacks(caplog)


# -- connections per client address, and the probes over a limit


async def test_one_address_is_limited_while_another_gets_in(fake, caplog):
    async with running_proxy(ready_pool([fake]), max_connections_per_client=3) as proxy, contextlib.AsyncExitStack() as stack:
        for _ in range(3):
            _, writer = await connect(proxy.port)
            stack.callback(writer.close)
        await wait_for(lambda: proxy.metrics.client_connections() == 3, what="3 connections open")
        status, headers, body = parsed(await exchange(proxy.port, chat_request(key="x") + CHAT))
        assert status == 429 and headers["Retry-After"] == "1" and "proxy.max_connections_per_client" in body["error"]["message"]
        reader, writer = await connect(proxy.port, "127.0.0.2")  # another client
        writer.write(chat_request(key="x") + CHAT)
        assert parsed(await closed_within(reader, 5))[0] == 200
        writer.close()
        proxy.reconfigure(proxy.config.model_copy(update={"max_connections_per_client": 4}), None)
        assert parsed(await exchange(proxy.port, chat_request(key="x") + CHAT))[0] == 200
    lines = [r for r in caplog.records if "max_connections_per_client" in r.getMessage()]
    assert len(lines) == 1
    no_tracebacks(caplog)


@pytest.mark.parametrize("limit", ["all", "per client"])
async def test_health_and_ready_are_answered_with_every_slot_taken(fake, monkeypatch, limit):
    monkeypatch.setattr("vsup.proxy.clients.MAX_CLIENT_CONNECTIONS", 3 if limit == "all" else 100)
    async with running_proxy(ready_pool([fake]), max_connections_per_client=3) as proxy, contextlib.AsyncExitStack() as stack:
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4") if limit == "all" else ["127.0.0.1"] * 3:
            _, writer = await connect(proxy.port, source)
            stack.callback(writer.close)
        await wait_for(lambda: proxy.metrics.client_connections() == 3, what="every slot taken")
        status, headers, body = parsed(await exchange(proxy.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert (status, body) == (200, {"status": "ok"}) and headers["X-Vsup-Proxy"]
        status, _, body = parsed(await exchange(proxy.port, b"GET /ready?verbose=1 HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 200 and body["ready"] is True and body["instances_ready"] == 1
        head = await exchange(proxy.port, b"HEAD /health HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
        status, _, body = parsed(await exchange(proxy.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == (503 if limit == "all" else 429) and body["error"]["code"] == "too_many_connections"


async def test_a_refused_connection_that_says_nothing_gets_its_refusal(fake, monkeypatch):
    monkeypatch.setattr("vsup.proxy.client_conn.PROBE_TIMEOUT", 0.2)
    async with running_proxy(ready_pool([fake]), max_connections_per_client=1) as proxy:
        _, held = await connect(proxy.port)
        await wait_for(lambda: proxy.metrics.client_connections() == 1, what="the slot taken")
        reader, writer = await connect(proxy.port)
        assert parsed(await closed_within(reader, 3))[0] == 429
        writer.close()
        held.close()


async def test_silent_connections_over_the_limit_cannot_keep_health_out(fake, monkeypatch):
    monkeypatch.setattr("vsup.proxy.clients.PROBE_RESERVE", 2)
    monkeypatch.setattr("vsup.proxy.clients.MAX_CLIENT_CONNECTIONS", 3)
    async with running_proxy(ready_pool([fake])) as proxy, contextlib.AsyncExitStack() as stack:
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"):  # 3 admitted, 2 silent over
            _, writer = await connect(proxy.port, source)
            stack.callback(writer.close)
        await wait_for(lambda: proxy.metrics.client_connections() == 3, what="the connections admitted")
        for _ in range(3):
            status, _, body = parsed(await exchange(proxy.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert (status, body) == (200, {"status": "ok"})  # the oldest silent one made room


# -- Expect: 100-continue, absolute-form targets


async def test_expect_100_continue_is_answered_before_the_body(fake):
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": 1}).encode()
    async with running_proxy(ready_pool([fake]), api_key=KEY, max_body_bytes=8192) as proxy:
        reader, writer = await connect(proxy.port)
        writer.write(chat_request(body=body).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        status, _, answer = parsed(await closed_within(reader, 5))
        writer.close()
        assert status == 200 and answer["choices"][0]["message"]["content"]
        # too large by its Content-Length, or not authenticated: the answer, no 100
        for key, length, expected in ((KEY, 100_000, 413), ("wrong", len(body), 401)):
            reader, writer = await connect(proxy.port)
            writer.write(chat_request(body=b"x" * length, key=key).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
            writer.close()
            assert head.startswith(b"HTTP/1.1 %d " % expected), head


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curl_waiting_for_100_continue_is_served_at_once(fake, tmp_path):
    payload = tmp_path / "body.json"
    payload.write_bytes(json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "y" * 4000}], "max_tokens": 1}).encode())
    async with running_proxy(ready_pool([fake])) as proxy:
        # curl waits up to --expect100-timeout for the 100 before sending the body: 20 s here, so a
        # proxy that never says 100 makes this test time out, not pass late
        command = ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "--expect100-timeout", "20", "--max-time", "8",
                   "-H", "Content-Type: application/json", "-H", "Expect: 100-continue",
                   "--data-binary", f"@{payload}", f"http://127.0.0.1:{proxy.port}/v1/chat/completions"]
        done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=15)
    assert done.stdout.rsplit("\n", 1)[-1] == "200", (done.stdout[-300:], done.stderr)


async def test_an_absolute_form_target_reaches_the_instance_in_origin_form(fake):
    async with running_proxy(ready_pool([fake])) as proxy:
        target = f"http://127.0.0.1:{proxy.port}/v1/chat/completions?trace=1"
        status, _, _ = parsed(await exchange(proxy.port, chat_request(target) + CHAT))
    assert status == 200
    assert fake.events("request")[-1]["target"] == "/v1/chat/completions?trace=1"
