"""Bad clients, over raw sockets: malformed HTTP, requests left half-sent, too many connections,
dot-segment paths, JSON nested too deeply. Each gets an OpenAI-shaped answer (or a closed
connection) and at most one warning line, never a traceback; none holds a slot for long."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
import pytest

from tests.proxy_support import (
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

CHAT = json.dumps({"model": "fake-model", "messages": MESSAGES, "max_tokens": 1}).encode()


@pytest.fixture(scope="module")
def fake():
    [started] = start_fakes(["f"])
    yield started
    started.cleanup()


# 0.5 s for a request's headers and for its body, instead of 30 s and 60 s.
QUICK = {"header_timeout": 0.5, "body_timeout": 0.5}


async def exchange(port: int, *pieces: bytes, pause: float = 0.05, timeout: float = 10.0) -> bytes:
    """Send the pieces (a pause between them) and read until the proxy closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(pause)
            writer.write(piece)
            await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def parsed(answer: bytes) -> tuple[int, dict, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def no_tracebacks(caplog) -> None:
    """Nothing the proxy or aiohttp's server logged has a traceback or is an error (other loggers:
    e.g. asyncio reporting an openai client of an earlier test collected late, are not ours)."""
    ours = [r for r in caplog.records if r.name.startswith(("vsup", "aiohttp"))]
    bad = [r for r in ours if r.exc_info or r.levelno >= logging.ERROR]
    assert bad == [], [r.getMessage() for r in bad]


POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"


@pytest.mark.parametrize("pieces, status, says", [
    ([POST + b"X-Big: " + b"a" * 9000 + b"\r\n\r\n"], 431, "request header fields too large"),
    ([POST + b"".join(b"X-H%d: 1\r\n" % i for i in range(200)) + b"\r\n"], 431, "Too many headers"),
    ([b"GET /v1/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"], 431, "request header fields too large"),
    ([POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"], 400, "chunk size"),
    ([POST + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n", b"zz\r\n{}\r\n0\r\n\r\n"], 400, "chunk size"),
    ([POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"], 400, "Transfer-Encoding"),
    ([b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n"], 400, "malformed HTTP request"),
], ids=["long header", "too many headers", "long request line", "bad chunk size", "bad chunk size after the headers",
        "length and chunked", "tls"])
async def test_malformed_http_gets_an_openai_error_and_no_traceback(fake, caplog, pieces, status, says):
    before = len(fake.events("request"))
    async with running_proxy(ready_pool([fake])) as proxy:
        got_status, headers, body = parsed(await exchange(proxy.port, *pieces))
        assert got_status == status and headers["Content-Type"] == "application/json"
        assert set(body["error"]) == {"message", "type", "param", "code"} and says in body["error"]["message"]
        assert metric_value(await metrics_text(proxy), "vsup_proxy_malformed_requests_total", status=str(status)) == 1
    assert len(fake.events("request")) == before  # nothing reached the instance
    no_tracebacks(caplog)


async def test_a_flood_of_malformed_requests_logs_one_line(fake, caplog):
    async with running_proxy(ready_pool([fake])) as proxy:
        for _ in range(20):
            assert parsed(await exchange(proxy.port, POST + b"Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"))[0] == 400
        assert metric_value(await metrics_text(proxy), "vsup_proxy_malformed_requests_total", status="400") == 20
        # still serving
        assert await served_by(client(proxy)) == "f"
    lines = [r for r in caplog.records if r.name == "vsup.proxy" and "malformed HTTP request" in r.getMessage()]
    assert len(lines) == 1
    no_tracebacks(caplog)


async def test_json_nested_too_deeply_is_400(fake, caplog):
    before = len(fake.events("request"))
    deep = b"[" * 200_000 + b"]" * 200_000
    async with running_proxy(ready_pool([fake])) as proxy, aiohttp.ClientSession() as session:
        for body in (deep, b'{"model": "m", "messages": ' + deep + b"}"):
            async with session.post(url(proxy, "/v1/chat/completions"), data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400
                error = (await r.json())["error"]
                assert error["type"] == "invalid_request_error" and "nested too deeply" in error["message"]
    assert len(fake.events("request")) == before  # nothing reached the instance
    no_tracebacks(caplog)


@pytest.mark.parametrize("path", ["/v1/../../etc/passwd", "/v1/./chat/completions", "/v1/%2e%2e/metrics", "/v1/chat/%2E", "/tokenize/.."])
async def test_dot_segment_paths_are_refused(fake, path):
    before = len(fake.events("request"))
    request = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
               f"Content-Length: {len(CHAT)}\r\n\r\n").encode() + CHAT
    async with running_proxy(ready_pool([fake])) as proxy:
        status, _, body = parsed(await exchange(proxy.port, request))
    assert status == 400
    assert body["error"]["code"] == "invalid_request" and "'.' or '..' segment" in body["error"]["message"]
    assert len(fake.events("request")) == before  # nothing reached the instance


async def test_dots_inside_a_segment_are_forwarded(fake):
    async with running_proxy(ready_pool([fake])) as proxy, aiohttp.ClientSession() as session:
        # a forwarded route with dots inside a segment (GET /v1/responses/{id}; only serving routes are forwarded)
        async with session.get(url(proxy, "/v1/responses/resp..x.a.b")) as r:
            assert r.status == 404 and r.headers["X-Fake-Instance"] == "f"  # the instance's answer: forwarded


async def test_a_half_sent_body_gets_408_and_frees_its_slot(fake, caplog):
    before = len(fake.events("request"))
    async with running_proxy(ready_pool([fake]), **QUICK) as proxy:
        started = time.monotonic()
        answer = await exchange(proxy.port, POST + b"Content-Length: 100\r\n\r\n" + CHAT[:10])
        status, headers, body = parsed(answer)
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert time.monotonic() - started < 5
        assert proxy.total_in_flight() == 0
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_client_timeouts_total", phase="body") == 1
    assert len(fake.events("request")) == before  # nothing reached the instance
    no_tracebacks(caplog)


async def test_a_slow_body_within_the_body_timeout_is_not_cut(fake):
    async with running_proxy(ready_pool([fake]), body_timeout=30) as proxy:
        pieces = [CHAT[i:i + 8] for i in range(0, len(CHAT), 8)]
        answer = await exchange(proxy.port, POST + b"Content-Length: %d\r\n\r\n" % len(CHAT), *pieces, pause=0.2)
        status, _, body = parsed(answer)
        assert status == 200 and body["choices"][0]["message"]["content"] == "tok0"


async def test_clients_that_never_finish_their_headers_are_closed(fake, caplog, monkeypatch):
    monkeypatch.setattr("vsup.proxy.clients.CLIENT_TIMEOUT", 0.5)  # the keep-alive idle limit
    async with running_proxy(ready_pool([fake]), **QUICK) as proxy:
        started = time.monotonic()
        answers = await asyncio.gather(*(exchange(proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                                         for _ in range(200)))
        assert answers == [b""] * 200  # closed, nothing said
        assert time.monotonic() - started < 10
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_client_timeouts_total", phase="headers") == 200
        await wait_for(lambda: proxy.metrics.client_connections() == 0, what="the connections to be forgotten")
        # an idle keep-alive connection goes the same way after its first request
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        rest = await asyncio.wait_for(reader.read(), 5)
        assert rest.endswith(b'{"status": "ok"}')  # the body, then the close
        writer.close()
    lines = [r for r in caplog.records if "no complete request" in r.getMessage()]
    assert len(lines) == 1  # rate-limited
    no_tracebacks(caplog)


async def test_a_half_sent_body_does_not_delay_a_drain(fake):
    async with running_proxy(ready_pool([fake])) as proxy:
        pending = asyncio.create_task(exchange(proxy.port, POST + b"Content-Length: 100\r\n\r\n" + CHAT[:10]))
        await wait_for(lambda: proxy.total_in_flight() == 1, what="the half-sent request to be in flight")
        started = time.monotonic()
        await proxy.drain_and_stop(30)
        assert time.monotonic() - started < 3
        status, headers, body = parsed(await pending)
        assert status == 503 and headers["Retry-After"] == "1" and "shutting down" in body["error"]["message"]


async def test_client_connections_are_bounded(fake, monkeypatch):
    monkeypatch.setattr("vsup.proxy.clients.MAX_CLIENT_CONNECTIONS", 3)
    async with running_proxy(ready_pool([fake])) as proxy, contextlib.AsyncExitStack() as stack:
        held = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            stack.callback(writer.close)
            held.append(writer)
        await wait_for(lambda: proxy.metrics.client_connections() == 3, what="3 connections open")
        status, headers, body = parsed(await exchange(proxy.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "too_many_connections"
        held[0].close()
        await wait_for(lambda: proxy.metrics.client_connections() == 2, what="a connection to close")
        async with client(proxy) as c:
            assert await served_by(c) == "f"
        await wait_for(lambda: proxy.metrics.client_connections() == 2, what="the client's connection to close")
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_client_connections_refused_total") == 1
        assert metric_value(text, "vsup_proxy_client_connections") == 3  # 2 held + this scrape's
