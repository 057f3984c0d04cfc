"""The aiohttp internals the proxy relies on: the installed aiohttp matches them, the pin in
pyproject.toml is the range the check enforces, a mismatch is one clear error, and each internal
still behaves as the proxy needs on the wire (these fail loudly when an aiohttp upgrade changes one)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import tomllib
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from vsup.config.schema import ProxyConfig
from vsup.errors import VsupError
from vsup.proxy import aiohttp_internals
from vsup.proxy.clients import ClientPolicy
from vsup.proxy.metrics import ProxyMetrics

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_aiohttp_has_the_internals_vsup_uses():
    assert aiohttp_internals.problems() == [], f"aiohttp {aiohttp.__version__} changed what the proxy relies on"
    aiohttp_internals.check()


def test_the_pin_in_pyproject_is_the_range_the_check_enforces():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if re.match(r"aiohttp\b", d)]
    assert pin.split(";")[0].strip() == aiohttp_internals.REQUIREMENT


@pytest.mark.parametrize("version, ok", [("3.13.4", True), ("3.14.5", True), ("3.13.3", False), ("3.15.0", False), ("4.0.0a1", False),
                                         ("3.9.5", False)])
def test_versions_outside_the_tested_range_are_refused(version, ok):
    found = [p for p in aiohttp_internals.problems(version) if "outside the tested range" in p]
    assert (found == []) == ok


def test_the_refusal_names_what_to_install(monkeypatch):
    monkeypatch.setattr(aiohttp_internals, "problems", lambda: ["aiohttp 3.15.0 is outside the tested range aiohttp>=3.13.4,<3.15"])
    with pytest.raises(VsupError, match=r"pip install 'aiohttp>=3\.13\.4,<3\.15'"):
        aiohttp_internals.check()


# ---------------------------------------------------------------------------------- on the wire
# The shape checks above see names; these see behaviour: a real round trip through a tiny
# aiohttp web.Server built the way the proxy builds it, read byte for byte by a raw socket.


@contextlib.asynccontextmanager
async def tiny_server(handler):
    loop = asyncio.get_running_loop()
    server = web.Server(handler, request_factory=aiohttp_internals.make_request_factory(loop, 1024), access_log=None)
    runner = web.ServerRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def raw_exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 5)  # the handlers below close after one response
    finally:
        writer.close()


async def stream_through_a_body_sink(request: web.BaseRequest) -> web.StreamResponse:
    assert request.content_length == 2 and await request.read() == b"{}"  # the factory's request works
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    out.force_close()
    await out.prepare(request)
    sink = aiohttp_internals.BodySink.of(request)
    assert sink is not None
    assert sink.write(b"data: one\n\n") is False  # far below the high-water mark
    sink.write(b"data: two\n\n")
    await sink.drain()
    await out.write_eof()
    return out


async def test_a_body_sink_frames_chunks_the_way_aiohttp_ends_them():
    async with tiny_server(stream_through_a_body_sink) as port:
        answer = await raw_exchange(port, b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in head, head
    assert body == b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n", body


async def test_a_body_sink_writes_plain_bytes_to_an_http_1_0_client():
    async with tiny_server(stream_through_a_body_sink) as port:
        answer = await raw_exchange(port, b"POST /s HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head, head
    assert body == b"data: one\n\ndata: two\n\n", body


async def end_through_a_body_sink(request: web.BaseRequest) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    sink = aiohttp_internals.BodySink.of(request)
    assert sink is not None
    sink.write(b"data: one\n\n")
    sink.end(b"data: two\n\ndata: [DONE]\n\n")  # the last piece and the body's end, one write
    await out.write_eof()  # adds nothing after end()
    return out


@pytest.mark.parametrize("requests", [1, 2])
async def test_a_body_sink_ends_the_chunked_body_once_and_the_connection_stays_usable(requests):
    one = b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    last = b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    async with tiny_server(end_through_a_body_sink) as port:
        answer = await raw_exchange(port, one * (requests - 1) + last)  # pipelined on one connection
    expected = b"b\r\ndata: one\n\n\r\n19\r\ndata: two\n\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    answers = answer.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert len(answers) == requests, answer
    for one_answer in answers:
        head, _, body = one_answer.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in head and body == expected, body


async def test_a_body_sink_ends_an_http_1_0_body_with_its_last_piece_alone():
    async with tiny_server(end_through_a_body_sink) as port:
        answer = await raw_exchange(port, b"POST /s HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head, head
    assert body == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n", body


async def raw_stream(request: web.BaseRequest) -> aiohttp_internals.RawStream:
    out = aiohttp_internals.RawStream(200, request.keep_alive)
    sink = out.start(request, b"Content-Type: text/event-stream\r\n")
    assert sink is not None
    sink.write(b"data: one\n\n")
    await asyncio.sleep(0)
    await out.write(b"data: two\n\n")
    await out.write_eof()  # and aiohttp calls prepare() and write_eof() again: nothing more goes out
    return out


async def test_a_raw_stream_is_one_head_and_a_chunked_body_on_a_kept_alive_connection():
    one = b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    last = b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    async with tiny_server(raw_stream) as port:
        answer = await raw_exchange(port, one + last)  # pipelined: the second is answered after the first
    body = b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"
    assert answer == (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body
                      + b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                      b"Connection: close\r\n\r\n" + body), answer


async def test_a_handler_failing_after_a_raw_stream_began_gets_no_second_answer(caplog):
    async def broken(request):
        out = aiohttp_internals.RawStream(200, request.keep_alive)
        sink = out.start(request, b"Content-Type: text/event-stream\r\n")
        assert sink is not None
        sink.write(b"data: one\n\n")
        raise RuntimeError("a bug after the head")

    async with policed_server(broken) as (port, policy, metrics):
        answer = await raw_exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    # the stream is cut (no end of the chunked body), not followed by a 500 in the middle of it
    assert answer == b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\nb\r\ndata: one\n\n\r\n", answer


async def test_a_body_sink_is_none_once_the_client_left():
    seen = []

    async def handler(request):
        request.transport.close()
        seen.append(aiohttp_internals.BodySink.of(request))
        return web.Response()

    async with tiny_server(handler) as port:
        await raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert seen == [None]


# The RequestHandler subclass (make_server): each hook, on the wire, with the proxy's policy.


@contextlib.asynccontextmanager
async def policed_server(handler, limit: int = 8, timeout: float = 0.3):
    metrics = ProxyMetrics(dict, dict, lambda name: False)
    policy = ClientPolicy(metrics, ProxyConfig(header_timeout=timeout, body_timeout=timeout), limit=limit)
    server = aiohttp_internals.make_server(handler, policy=policy, max_body_bytes=1024, access_log=None)
    runner = web.ServerRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], policy, metrics
    finally:
        await runner.cleanup()


async def read_body(request: web.BaseRequest) -> web.StreamResponse:
    try:
        body = await request.read()
    except aiohttp_internals.BadRequest as exc:
        return await aiohttp_internals.send_and_close(request, web.Response(status=400, text=f"handler saw: {exc.message}"))
    return web.Response(text=f"{len(body)} bytes")


async def test_handle_error_answers_in_the_policy_s_words(caplog):
    async with policed_server(read_body) as (port, policy, metrics):
        answer = await raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 431 ") and b'"code": "request_header_fields_too_large"' in answer, answer[:300]
    assert metrics.malformed_requests == {431: 1}
    assert not [r for r in caplog.records if r.exc_info and r.name.startswith(("vsup", "aiohttp"))]


async def test_a_parse_error_after_the_headers_reaches_the_handler_reading_the_body():
    async with policed_server(read_body) as (port, policy, metrics):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the handler is now waiting for the rest of the body
        writer.write(b"zz\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.endswith(b"handler saw: Invalid character in chunk size:\n\n  b'zz'\n    ^"), answer


async def early_answer(request: web.BaseRequest) -> web.StreamResponse:
    return await aiohttp_internals.send_and_close(request, web.Response(status=408, text="too slow"))


async def test_send_and_close_does_not_linger_on_an_unread_body():
    async with policed_server(early_answer, timeout=30) as (port, policy, metrics):
        started = asyncio.get_running_loop().time()
        answer = await raw_exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        assert answer.startswith(b"HTTP/1.1 408 ") and answer.endswith(b"too slow")
        assert asyncio.get_running_loop().time() - started < 2  # not aiohttp's 10 s lingering read


async def test_a_connection_without_a_request_in_time_is_closed_and_counted():
    async with policed_server(read_body, timeout=0.3) as (port, policy, metrics):
        assert await raw_exchange(port, b"GET / HTTP/1.1\r\nHost") == b""
        assert metrics.client_timeouts == {"headers": 1} and policy.open == 0


async def test_connections_over_the_limit_get_the_policy_s_refusal():
    async with policed_server(read_body, limit=1, timeout=30) as (port, policy, metrics):
        _, holder = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)
        answer = await raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"too_many_connections" in answer
        assert (policy.open, metrics.connections_refused) == (1, 1)
        holder.close()


async def test_a_handler_that_raises_gets_a_json_500_and_one_logged_traceback(caplog):
    async def broken(request):
        raise RuntimeError("a bug")

    async with policed_server(broken) as (port, policy, metrics):
        for _ in range(3):
            answer = await raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 500 ") and b'"code": "internal_error"' in answer, answer
    assert len([r for r in caplog.records if r.exc_info and r.name.startswith("vsup")]) == 1  # rate-limited: a bug per request must not flood the log
