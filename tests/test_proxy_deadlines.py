"""The proxy's time limits at their default values, on a virtual clock (tests/virtual_clock.py):
each is checked just before and just after it passes — first byte (300 s), between chunks
(120 s), the admission queue (60 s), a request's headers (30 s) and body (60 s), passive ejection
(10 s). Real sockets and a real fake-vLLM process; only the proxy's timers are virtual."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, MESSAGES, metric_value, metrics_text, url, wait_for
from tests.virtual_clock import ProxyClock
from vsup.config.schema import ProxyConfig
from vsup.proxy import ProxyServer
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.forward import EJECT_SECONDS

JUST = 0.5  # how far before and after a limit each check is made (virtual seconds)


@pytest.fixture(scope="module")
def fake():
    started = start_fake(name="d", env=LEAN)
    started.wait_ready()
    yield started
    started.cleanup()


@contextlib.asynccontextmanager
async def proxy_on(clock: ProxyClock, backends: list[Backend], models: dict | None = None, **config):
    pool = BackendPool()
    for backend in backends:
        pool.add(backend)
        pool.set_state(backend.name, "ready", True)
    proxy = ProxyServer(ProxyConfig(port=0, **config), pool, models=models, clock=clock)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.drain_and_stop(0)


def chat(**fake) -> bytes:
    return json.dumps({"model": "fake-model", "messages": MESSAGES, "max_tokens": 2, "fake": fake}).encode()


async def post(session: aiohttp.ClientSession, proxy, body: bytes):
    async with session.post(url(proxy, "/v1/chat/completions"), data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


# (the stall watchdog would take a lone silent request's instance out first: off in these three)
QUIET = {"stall_timeout": 3600.0}


async def test_first_byte_timeout_cuts_at_300_s_not_before(fake):
    clock = ProxyClock()
    async with proxy_on(clock, [Backend("d", fake.url)], **QUIET) as proxy, aiohttp.ClientSession() as session:
        before = len(fake.events("request"))
        sent = asyncio.create_task(post(session, proxy, chat(first_token_delay=3600)))
        await wait_for(lambda: len(fake.events("request")) > before, what="the request to reach the instance")
        await clock.advance(300 - JUST)
        assert not sent.done()
        await clock.advance(2 * JUST)
        status, body = await asyncio.wait_for(sent, 10)
        assert status == 504 and "proxy.first_byte_timeout" in json.loads(body)["error"]["message"]
        await asyncio.to_thread(fake.wait_event, "cancelled", 10.0)  # the instance saw the request go


async def test_idle_timeout_cuts_a_silent_stream_at_120_s(fake):
    clock = ProxyClock()
    async with proxy_on(clock, [Backend("d", fake.url)], **QUIET) as proxy, aiohttp.ClientSession() as session:
        body = json.dumps({"model": "fake-model", "messages": MESSAGES, "max_tokens": 3, "stream": True,
                           "fake": {"first_token_delay": 0, "token_delay": 3600}}).encode()
        async with session.post(url(proxy, "/v1/chat/completions"), data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200
            first = await asyncio.wait_for(r.content.readline(), 10)  # the first event came
            assert first.startswith(b"data: ")
            reading = asyncio.create_task(r.read())
            await clock.advance(120 - JUST)
            await asyncio.sleep(0.05)
            assert not reading.done()
            await clock.advance(2 * JUST)
            rest = await asyncio.wait_for(reading, 10)
        assert b"proxy.idle_timeout" in rest and b'"upstream_error"' in rest


async def test_queue_timeout_answers_503_at_60_s(fake):
    clock = ProxyClock()
    model = {"fake-model": ProxyConfig(max_in_flight_per_instance=1)}
    async with proxy_on(clock, [Backend("d", fake.url, "fake-model")], models=model, **QUIET) as proxy, \
            aiohttp.ClientSession() as session:
        holding = asyncio.create_task(post(session, proxy, chat(first_token_delay=3600)))
        await wait_for(lambda: proxy.in_flight().get("d") == 1, what="the first request in flight")
        waiting = asyncio.create_task(post(session, proxy, chat()))
        await wait_for(lambda: sum(q["waiting"] for q in proxy.queues().values()) == 1, what="one waiting")
        await clock.advance(60 - JUST)
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await clock.advance(2 * JUST)
        status, body = await asyncio.wait_for(waiting, 10)
        assert status == 503 and json.loads(body)["error"]["code"] == "queue_timeout"
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)


async def test_an_ejection_runs_out_after_10_s(fake):
    with contextlib.closing(__import__("socket").socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"  # bound, not listening: connections are refused
        clock = ProxyClock()
        async with proxy_on(clock, [Backend("gone", dead), Backend("d", fake.url)], policy="round_robin") as proxy, \
                aiohttp.ClientSession() as session:
            for _ in range(2):  # one of them meets the refused instance and is retried on the other
                assert (await post(session, proxy, chat()))[0] == 200
            assert proxy.pool.is_ejected("gone")
            await clock.advance(EJECT_SECONDS - JUST)
            assert proxy.pool.is_ejected("gone")
            await clock.advance(2 * JUST)
            assert not proxy.pool.is_ejected("gone") and proxy.pool.is_ready("gone")


async def test_header_and_body_deadlines_at_their_defaults(fake):
    clock = ProxyClock()
    async with proxy_on(clock, [Backend("d", fake.url)]) as proxy:
        heads = await asyncio.open_connection("127.0.0.1", proxy.port)
        heads[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        body = chat()
        bodies = await asyncio.open_connection("127.0.0.1", proxy.port)
        bodies[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%b" % (len(body), body[:10]))
        await wait_for(lambda: proxy.total_in_flight() == 1, what="the half-sent body in flight")
        await clock.advance(30 - JUST)
        await asyncio.sleep(0.05)
        assert not heads[0].at_eof()
        await clock.advance(2 * JUST)
        assert await asyncio.wait_for(heads[0].read(), 5) == b""  # closed, nothing said
        await clock.advance(60 - 30 - 2 * JUST)  # the body's 60 s run from its headers, sent at 0 s
        await asyncio.sleep(0.05)
        assert not bodies[0].at_eof()
        await clock.advance(2 * JUST)
        answer = await asyncio.wait_for(bodies[0].read(), 5)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"proxy.body_timeout" in answer
        for _, writer in (heads, bodies):
            writer.close()
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_client_timeouts_total", phase="headers") == 1
        assert metric_value(text, "vsup_proxy_client_timeouts_total", phase="body") == 1


# -- a hung instance (proxy/stall.py): /health answers, its requests get nothing


@pytest.fixture(scope="module")
def hung():
    started = start_fake(name="h", env={**LEAN, "FAKE_VLLM_HANG_AFTER": "0", "FAKE_VLLM_HANG_MODE": "engine"})
    started.wait_ready()
    yield started
    started.cleanup()


async def test_a_hung_instance_is_taken_out_and_its_requests_retried_elsewhere(fake, hung):
    clock = ProxyClock()
    reported: list[tuple[str, str]] = []
    async with proxy_on(clock, [Backend("h", hung.url), Backend("d", fake.url)], policy="round_robin") as proxy, \
            aiohttp.ClientSession() as session:
        proxy.pool.on_stalled = lambda name, why: reported.append((name, why))
        async with session.get(f"{hung.url}/health") as health:
            assert health.status == 200
        before = len(hung.events("request"))
        sent = [asyncio.create_task(post(session, proxy, chat())) for _ in range(2)]  # one each, round robin
        await wait_for(lambda: len(hung.events("request")) > before, what="a request to reach the hung instance")
        done, _ = await asyncio.wait(sent, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1  # the healthy instance's answer; the other waits on the hung one
        # a ~100-byte prompt, no prefill measured yet on "h"'s model: 60 s + 100 / 40 s allowed
        await clock.advance(60 - JUST)
        await asyncio.sleep(0.1)
        assert not all(task.done() for task in sent) and proxy.pool.is_ready("h")
        await clock.advance(5 + 2 * JUST)  # past the allowance, and the check (every 1 s)
        results = await asyncio.wait_for(asyncio.gather(*sent), 10)
        assert [status for status, _ in results] == [200, 200]  # retried on "d" before any byte
        assert not proxy.pool.is_ready("h") and proxy.pool.is_ejected("h")
        assert [name for name, _ in reported] == ["h"] and "1 request(s) without a byte" in reported[0][1]
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_retries_total", reason="stalled") == 1


async def test_one_request_that_streams_keeps_its_instance_alive(fake):
    clock = ProxyClock()
    async with proxy_on(clock, [Backend("d", fake.url)]) as proxy, aiohttp.ClientSession() as session:
        stream = json.dumps({"model": "fake-model", "messages": MESSAGES, "max_tokens": 400, "stream": True,
                             "fake": {"token_delay": 0.02}}).encode()
        before = len(fake.events("request"))
        waiting = asyncio.create_task(post(session, proxy, chat(first_token_delay=3600)))
        async with session.post(url(proxy, "/v1/chat/completions"), data=stream, headers={"Content-Type": "application/json"}) as r:
            await wait_for(lambda: len(fake.events("request")) >= before + 2, what="both requests at the instance")
            for _ in range(20):  # the stream moves on while virtual time passes the stall limit
                await asyncio.wait_for(r.content.readline(), 10)
                await clock.advance(4)
            assert proxy.pool.is_ready("d") and not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)


RELOAD_COVERED = {"proxy.stall_timeout"}  # tests/test_reload_classes.py: every live key has a reload test


async def test_a_reload_changes_the_stall_limit_of_requests_already_in_flight(fake, hung):
    clock = ProxyClock()
    async with proxy_on(clock, [Backend("h", hung.url), Backend("d", fake.url)], policy="round_robin", **QUIET) as proxy, \
            aiohttp.ClientSession() as session:
        before = len(hung.events("request"))
        sent = [asyncio.create_task(post(session, proxy, chat())) for _ in range(2)]
        await wait_for(lambda: len(hung.events("request")) > before, what="a request to reach the hung instance")
        await clock.advance(100)
        await asyncio.sleep(0.1)
        assert proxy.pool.is_ready("h")  # 3600 s allowed
        proxy.reconfigure(proxy.config.model_copy(update={"stall_timeout": 60.0}), None)
        await clock.advance(2)
        results = await asyncio.wait_for(asyncio.gather(*sent), 10)
        assert [status for status, _ in results] == [200, 200] and proxy.pool.is_ejected("h")


async def _kept_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """GET /health on a kept connection; its whole answer read (the connection stays open)."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in head.lower()
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
    await asyncio.wait_for(reader.readexactly(length), 5)


async def _open_after(clock: ProxyClock, reader: asyncio.StreamReader, seconds: float) -> bool:
    """Still open `seconds` (virtual) from now?"""
    await clock.advance(seconds)
    await asyncio.sleep(0.05)
    return not reader.at_eof()


async def _closed_soon(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 5) == b""


@contextlib.asynccontextmanager
async def _connection(proxy):
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def test_a_kept_connections_idle_and_header_deadlines_move_with_its_requests(fake):
    # The header (30 s) and idle (60 s) deadlines share one timer, moved lazily: each must still
    # close the connection at its own time, never at the time an earlier deadline was set for.
    clock = ProxyClock()
    async with proxy_on(clock, [Backend("d", fake.url)]) as proxy:
        # idle: 60 s from the answer, although the headers' 30 s timer was armed first
        async with _connection(proxy) as (reader, writer):
            await _kept_answer(reader, writer)
            assert await _open_after(clock, reader, 60 - JUST)
            await clock.advance(2 * JUST)
            assert await _closed_soon(reader)
        # the next request's headers: 30 s from its first byte, though the idle deadline was sooner
        async with _connection(proxy) as (reader, writer):
            await _kept_answer(reader, writer)
            assert await _open_after(clock, reader, 40)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no end of its headers
            assert await _open_after(clock, reader, 30 - JUST)
            await clock.advance(2 * JUST)
            assert await _closed_soon(reader)
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_client_timeouts_total", phase="headers") == 1


async def test_an_idle_deadline_sooner_than_the_headers_one_closes_at_its_time(fake):
    # proxy.header_timeout longer than the keep-alive idle limit (60 s): the idle deadline is the
    # earlier one, so it gets a timer of its own
    clock = ProxyClock()
    async with proxy_on(clock, [Backend("d", fake.url)], header_timeout=100.0) as proxy, _connection(proxy) as (reader, writer):
        await _kept_answer(reader, writer)
        assert await _open_after(clock, reader, 60 - JUST)
        await clock.advance(2 * JUST)
        assert await _closed_soon(reader)
