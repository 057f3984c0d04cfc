"""Stale keep-alive connections: an instance killed while the proxy holds idle connections to it.

The race, made deterministic: the instance is SIGSTOPped, requests go out on the proxy's idle
keep-alive connections to it (nobody reads them), then it is SIGKILLed, so the kernel resets
those connections before a single answer byte — what the proxy sees when it reuses a connection
to an API server that was just `kill -9`ed, before the supervisor noticed. The pool still says
"ready" throughout (nobody told the proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import openai
import psutil
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
    wait_for,
)
from tests.raw_http import RawServer, read_request, reset
from vsup.proxy.backends import Backend

# Held long enough that requests sent together each need a connection of their own.
SLOW = {"fake": {"first_token_delay": 0.5}}


@pytest.fixture(autouse=True)
def long_upstream_keepalive(monkeypatch):
    # The proxy drops idle connections after 4 s; on a loaded box the warm-up and the kill could be
    # further apart than that, and these tests need the idle connections to still be there.
    monkeypatch.setattr("vsup.proxy.server.UPSTREAM_KEEPALIVE", 60.0)


def requests_waiting_at(port: int) -> int:
    """Established connections to `port` (ours to the fake) holding bytes its process has not
    read: requests sent to a stopped instance. From /proc/net/tcp's rx_queue."""
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            unread = int(fields[4].split(":")[1], 16)
            if local_port == port and fields[3] == "01" and unread > 0:
                count += 1
    return count


def connections_to(port: int) -> int:
    """Established TCP connections from this process (the proxy runs in it) to `port`."""
    return sum(
        1 for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


async def warm(c: openai.AsyncOpenAI, requests: int) -> set[str]:
    """`requests` concurrent slow requests: as many keep-alive connections, left idle afterwards."""
    return set(await asyncio.gather(*(served_by(c, extra_body=SLOW) for _ in range(requests))))


@contextlib.contextmanager
def stopped(fake):
    fake.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(fake.pid, signal.SIGCONT)


async def test_reused_connections_reset_by_a_killed_instance_are_retried_elsewhere():
    a, b = start_fakes(["a", "b"])
    try:
        async with running_proxy(ready_pool([a, b])) as proxy:
            c = client(proxy, timeout=60)
            assert await warm(c, 8) == {"a", "b"}
            assert connections_to(a.port) >= 2  # idle keep-alive connections to "a", to be reused
            with stopped(a):
                pending = [asyncio.create_task(served_by(c)) for _ in range(4)]  # round-robin: 2 go to "a"
                await wait_for(lambda: requests_waiting_at(a.port) == 2, what="2 requests sent to the stopped instance")
                a.kill()  # the kernel resets its connections, with our unread requests in them
            assert await asyncio.gather(*pending) == ["b"] * 4
            # and later requests too (idle connections to "a" gone, connects refused)
            assert [await served_by(c) for _ in range(4)] == ["b"] * 4
            text = await metrics_text(proxy)
            assert metric_value(text, "vsup_proxy_retries_total", reason="stale") >= 2
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="a", kind="stale") >= 2
            assert metric_value(text, "vsup_proxy_requests_total", route="/v1/chat/completions", status="502", instance="a") == 0
    finally:
        a.cleanup()
        b.cleanup()


async def test_stale_connection_to_the_only_instance_gets_one_fresh_try():
    [a] = start_fakes(["a"])
    try:
        async with running_proxy(ready_pool([a])) as proxy:
            c = client(proxy, timeout=60)
            assert await served_by(c) == "a"
            with stopped(a):
                pending = asyncio.create_task(served_by(c))
                await wait_for(lambda: requests_waiting_at(a.port) == 1, what="the request sent to the stopped instance")
                a.kill()
            with pytest.raises(openai.APIStatusError) as caught:
                await pending
            # the retry was a new connection to the same instance, refused: it is really gone, out
            # of the rotation, and none is left
            assert caught.value.status_code == 503 and "could be reached" in caught.value.message
            assert caught.value.response.headers["Retry-After"] == "1"
            text = await metrics_text(proxy)
            assert metric_value(text, "vsup_proxy_retries_total", reason="stale") == 1
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="a", kind="stale") == 1
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="a", kind="connect") == 1
            assert metric_value(text, "vsup_proxy_ejections_total", instance="a") == 1
    finally:
        a.cleanup()


async def test_reset_on_a_fresh_connection_by_a_killed_instance_is_retried():
    # A new connection queued on an instance that is then killed: the kernel resets it with our
    # request unread. Nothing listens on the instance's port any more, so nothing it started can
    # reach a client: the request goes to the next instance and the dead one leaves the rotation,
    # with no supervisor to say so (standalone `vsup proxy`; the pool says "ready" throughout).
    a, b = start_fakes(["a", "b"])
    try:
        async with running_proxy(ready_pool([a, b])) as proxy:
            c = client(proxy, timeout=60)
            with stopped(a):  # no warm-up: no idle connection; the kernel accepts it into the backlog
                pending = [asyncio.create_task(served_by(c)) for _ in range(2)]  # one to each
                await wait_for(lambda: requests_waiting_at(a.port) == 1, what="the request sent to the stopped instance")
                a.kill()
            assert sorted(await asyncio.gather(*pending)) == ["b", "b"]
            assert [await served_by(c) for _ in range(3)] == ["b"] * 3  # "a" is out of the rotation
            text = await metrics_text(proxy)
            assert metric_value(text, "vsup_proxy_retries_total", reason="gone") == 1
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="a", kind="broken") == 1
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="a", kind="connect") == 0
            assert metric_value(text, "vsup_proxy_ejections_total", instance="a") == 1
    finally:
        a.cleanup()
        b.cleanup()


async def test_reset_on_a_fresh_connection_by_a_live_server_is_not_retried():
    # A server that reads the request and resets the connection but still listens: it may have
    # started on the request, so this stays a 502 (the stale rule covers reused connections only),
    # and a server that accepts connections is not ejected.
    async def read_then_reset(reader, writer):
        await read_request(reader)
        reset(writer)

    [b] = start_fakes(["b"])
    try:
        async with RawServer(read_then_reset) as live:
            pool = ready_pool([b])
            pool.add(Backend("live", live.url))
            pool.set_state("live", "ready", True)
            async with running_proxy(pool) as proxy:
                c = client(proxy, timeout=60)
                outcomes = await asyncio.gather(*(served_by(c) for _ in range(2)), return_exceptions=True)
                [failed] = [o for o in outcomes if isinstance(o, BaseException)]
                assert [o for o in outcomes if isinstance(o, str)] == ["b"]
                assert isinstance(failed, openai.APIStatusError) and failed.status_code == 502, failed
                assert "failed before answering" in failed.message
                assert pool.is_ready("live")
                text = await metrics_text(proxy)
                assert metric_value(text, "vsup_proxy_retries_total", reason="gone") == 0
                assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="live", kind="broken") == 1
                assert metric_value(text, "vsup_proxy_ejections_total", instance="live") == 0
    finally:
        b.cleanup()


@pytest.mark.parametrize("supervisor_noticed", ["before the reset", "just after the reset"])
async def test_fresh_connection_broken_by_an_instance_that_left_the_rotation_is_retried(supervisor_noticed):
    # The kill -9 case with real vLLM: a new connection is queued on the dying API server's
    # listening socket (or on an orphaned EngineCore that inherited it) and reset when the socket
    # goes; the supervisor sees the exit a moment before or after. Nothing from that instance can
    # reach a client: retry.
    a, b = start_fakes(["a", "b"])
    try:
        pool = ready_pool([a, b])
        async with running_proxy(pool) as proxy:
            c = client(proxy, timeout=60)
            with stopped(a):
                pending = [asyncio.create_task(served_by(c)) for _ in range(2)]  # one to each
                await wait_for(lambda: requests_waiting_at(a.port) == 1, what="the request sent to the stopped instance")
                if supervisor_noticed == "before the reset":
                    pool.set_state("a", "stopping", False)  # what the supervisor does on the exit event
                else:
                    asyncio.get_running_loop().call_later(0.3, pool.set_state, "a", "stopping", False)
                a.kill()
            assert sorted(await asyncio.gather(*pending)) == ["b", "b"]
            text = await metrics_text(proxy)
            assert metric_value(text, "vsup_proxy_retries_total", reason="gone") == 1
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="a", kind="broken") == 1
    finally:
        a.cleanup()
        b.cleanup()


async def test_instance_leaving_rotation_closes_its_idle_connections_not_its_streams():
    a, b = start_fakes(["a", "b"])
    try:
        pool = ready_pool([a, b])
        async with running_proxy(pool) as proxy:
            c = client(proxy, timeout=60)
            assert await warm(c, 4) == {"a", "b"}
            idle_b = connections_to(b.port)
            assert connections_to(a.port) >= 2 and idle_b >= 2  # so "a" keeps an idle one besides its stream

            async def stream() -> tuple[str, int, str | None]:
                response = await c.chat.completions.with_raw_response.create(
                    model="fake-model", messages=MESSAGES, max_tokens=15, stream=True,
                    extra_body={"fake": {"token_delay": 0.1}})
                pieces, finish = 0, None
                async for chunk in response.parse():
                    for choice in chunk.choices:
                        pieces += bool(choice.delta.content)
                        finish = choice.finish_reason or finish
                return response.headers["x-fake-instance"], pieces, finish

            streams = [asyncio.create_task(stream()) for _ in range(2)]  # one on each instance
            await wait_for(lambda: proxy.in_flight() == {"a": 1, "b": 1}, what="a stream on each instance")
            pool.set_state("a", "stopping", False)
            # a's idle connection is closed at once; its stream's connection and b's are untouched
            await wait_for(lambda: connections_to(a.port) == 1, timeout=5, what="a's idle connections to close")
            assert connections_to(b.port) == idle_b
            assert sorted(await asyncio.gather(*streams)) == [("a", 15, "length"), ("b", 15, "length")]
            # the stream's connection to the instance out of rotation is not kept either
            await wait_for(lambda: connections_to(a.port) == 0, timeout=5, what="a's last connection to close")
            assert connections_to(b.port) == idle_b
            # back in rotation: used (and pooled) again
            pool.set_state("a", "ready", True)
            assert {await served_by(c) for _ in range(2)} == {"a", "b"}
            assert connections_to(a.port) == 1
    finally:
        a.cleanup()
        b.cleanup()
