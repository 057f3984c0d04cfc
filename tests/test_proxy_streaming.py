"""The proxy's streaming path: SSE relayed as it arrives, client disconnects reaching the
instance in every phase, failures after the first byte, timeouts and drain — against fake vLLM
processes whose events file records what the instance saw."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import aiohttp
import openai
import pytest

from tests.proxy_support import client, metric_value, metrics_text, ready_pool, running_proxy, start_fakes, url, wait_for
from tests.raw_http import RawServer, chunk, read_request
from vsup.proxy.backends import Backend, BackendPool

MESSAGES = [{"role": "user", "content": "stream please"}]
CHAT = {"model": "fake-model", "messages": MESSAGES}


@pytest.fixture
def fake():
    [started] = start_fakes(["s"])
    yield started
    started.cleanup()


async def raw_stream(session: aiohttp.ClientSession, proxy, **body) -> aiohttp.ClientResponse:
    return await session.post(url(proxy, "/v1/chat/completions"), json={**CHAT, "stream": True, **body})


async def test_stream_with_async_and_sync_clients(fake):
    async with running_proxy(ready_pool([fake])) as proxy:
        stream = await client(proxy).chat.completions.create(**CHAT, max_tokens=4, stream=True,
                                                             stream_options={"include_usage": True})
        pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        assert "".join(p or "" for p in pieces) == "tok0 tok1 tok2 tok3"

        def sync_stream():
            with openai.OpenAI(base_url=url(proxy, "/v1"), api_key="x", max_retries=0) as c:
                return [ch.choices[0].text for ch in c.completions.create(model="fake-model", prompt="p", max_tokens=3, stream=True)]

        assert "".join(await asyncio.to_thread(sync_stream)) == "tok0 tok1 tok2"


async def test_sse_headers_and_chunks_arrive_as_they_are_generated(fake):
    async with running_proxy(ready_pool([fake])) as proxy, aiohttp.ClientSession(auto_decompress=False) as session:
        response = await raw_stream(session, proxy, max_tokens=4, fake={"token_delay": 0.4})
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["X-Accel-Buffering"] == "no"
        assert response.headers["Cache-Control"] == "no-cache"
        assert "Content-Encoding" not in response.headers
        arrivals = []
        async for line in response.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic())
        response.release()
        # 5 events (role + 4 tokens) spread over ~1.2 s: a buffering proxy would deliver them together
        assert len(arrivals) == 5
        assert arrivals[-1] - arrivals[1] > 0.6


async def _cancelled_event(fake, timeout: float = 5.0) -> dict:
    return fake.wait_event("cancelled", timeout=timeout)


async def test_disconnect_while_waiting_for_first_byte_reaches_the_instance(fake):
    async with running_proxy(ready_pool([fake])) as proxy, aiohttp.ClientSession() as session:
        task = asyncio.create_task(raw_stream(session, proxy, max_tokens=5, fake={"first_token_delay": 30}))
        await wait_for(lambda: fake.events("request"), what="the request to reach the instance")
        started = time.monotonic()
        task.cancel()  # the client hangs up before any byte came back
        event = await asyncio.to_thread(fake.wait_event, "cancelled", 10.0)
        assert time.monotonic() - started < 10
        assert event["phase"] == "waiting_first_token"
        await wait_for(lambda: proxy.total_in_flight() == 0, what="the proxy to forget the request")
        assert metric_value(await metrics_text(proxy), "vsup_proxy_client_disconnects_total", phase="first_byte") == 1


async def test_disconnect_mid_stream_reaches_the_instance(fake):
    async with running_proxy(ready_pool([fake])) as proxy:
        stream = await client(proxy).chat.completions.create(**CHAT, max_tokens=500, stream=True,
                                                             extra_body={"fake": {"token_delay": 0.05}})
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.close()
        event = await asyncio.to_thread(fake.wait_event, "cancelled", 10.0)
        assert event["phase"] == "streaming" and event["tokens"] < 500
        await wait_for(lambda: proxy.total_in_flight() == 0, what="the proxy to forget the request")
        assert metric_value(await metrics_text(proxy), "vsup_proxy_client_disconnects_total", phase="streaming") == 1


async def test_disconnect_of_a_non_streaming_request_reaches_the_instance(fake):
    async with running_proxy(ready_pool([fake])) as proxy:
        with pytest.raises(openai.APITimeoutError):
            await client(proxy, timeout=1.0).chat.completions.create(**CHAT, max_tokens=500,
                                                                     extra_body={"fake": {"token_delay": 0.05}})
        event = await asyncio.to_thread(fake.wait_event, "cancelled", 10.0)
        assert event["tokens"] < 500
        assert not fake.events("finished")
        await wait_for(lambda: proxy.total_in_flight() == 0, what="the proxy to forget the request")
        assert metric_value(await metrics_text(proxy), "vsup_proxy_client_disconnects_total", phase="non_streaming") == 1


async def test_disconnect_while_queued_never_reaches_the_instance(fake):
    async with running_proxy(ready_pool([fake]), max_connections=1) as proxy:
        c = client(proxy)
        holder = await c.chat.completions.create(**CHAT, max_tokens=100, stream=True, extra_body={"fake": {"token_delay": 0.05}})
        await anext(aiter(holder))  # the only upstream connection is busy
        with pytest.raises(openai.APITimeoutError):
            await client(proxy, timeout=0.5).chat.completions.create(**CHAT, max_tokens=1)
        await holder.close()
        await wait_for(lambda: proxy.total_in_flight() == 0, what="the proxy to forget both requests")
        assert len(fake.events("request")) == 1  # the queued request was never sent
        assert metric_value(await metrics_text(proxy), "vsup_proxy_client_disconnects_total", phase="queued") == 1
        # the connection slot is free again
        reply = await c.chat.completions.create(**CHAT, max_tokens=1)
        assert reply.choices[0].message.content == "tok0"


async def test_instance_dying_mid_stream_ends_with_an_error_event():
    [dying] = start_fakes(["d"], env={"FAKE_VLLM_CRASH_AFTER": "1", "FAKE_VLLM_CRASH_MID_STREAM": "1",
                                      "FAKE_VLLM_CRASH_AFTER_TOKENS": "3"})
    try:
        async with running_proxy(ready_pool([dying])) as proxy:
            stream = await client(proxy).chat.completions.create(**CHAT, max_tokens=20, stream=True)
            tokens = []
            with pytest.raises(openai.APIError, match="failed mid-stream"):
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        tokens.append(chunk.choices[0].delta.content)
            assert tokens == ["tok0", " tok1", " tok2"]
            text = await metrics_text(proxy)
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="d", kind="broken") == 1
            assert proxy.total_in_flight() == 0
    finally:
        dying.cleanup()


async def test_instance_dying_during_a_non_streaming_request():
    # It dies before sending a byte (a non-streaming answer comes at the end): nothing it started
    # can reach the client, so another instance answers; with none left, 503 + Retry-After.
    crashing = {"FAKE_VLLM_CRASH_AFTER": "1", "FAKE_VLLM_CRASH_MID_STREAM": "1"}
    [dying] = start_fakes(["d"], env=crashing)
    [other] = start_fakes(["o"])
    try:
        async with running_proxy(ready_pool([dying])) as proxy:
            with pytest.raises(openai.APIStatusError) as caught:
                await client(proxy).chat.completions.create(**CHAT, max_tokens=20)
            assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"] == "1"
            assert "instance d: the instance closed the connection" in caught.value.message
        dying.cleanup()
        [dying] = start_fakes(["d"], env=crashing)
        async with running_proxy(ready_pool([dying, other])) as proxy:
            raw = await client(proxy).chat.completions.with_raw_response.create(**CHAT, max_tokens=20)
            assert raw.headers["x-fake-instance"] == "o"
            assert metric_value(await metrics_text(proxy), "vsup_proxy_retries_total", reason="gone") == 1
    finally:
        dying.cleanup()
        other.cleanup()


async def test_idle_timeout_ends_the_stream_with_an_error_event(fake):
    async with running_proxy(ready_pool([fake]), idle_timeout=0.5) as proxy:
        stream = await client(proxy).chat.completions.create(**CHAT, max_tokens=5, stream=True,
                                                             extra_body={"fake": {"token_delay": 3}})
        with pytest.raises(openai.APIError, match=r"sent nothing for 0.5 s \(proxy.idle_timeout\)"):
            async for _ in stream:
                pass
        await asyncio.to_thread(fake.wait_event, "cancelled", 10.0)


async def test_no_overall_cap_on_a_long_stream(fake):
    # idle 0.5 s, but the stream runs well past it: only silence counts, not total time
    async with running_proxy(ready_pool([fake]), idle_timeout=0.5, first_byte_timeout=0.5) as proxy:
        stream = await client(proxy).chat.completions.create(**CHAT, max_tokens=15, stream=True,
                                                             extra_body={"fake": {"token_delay": 0.1}})
        started = time.monotonic()
        count = sum([1 async for chunk in stream if chunk.choices and chunk.choices[0].delta.content])
        assert count == 15 and time.monotonic() - started > 1.0


async def test_first_byte_timeout_is_504(fake):
    async with running_proxy(ready_pool([fake]), first_byte_timeout=0.5) as proxy:
        with pytest.raises(openai.APIStatusError) as caught:
            await client(proxy).chat.completions.create(**CHAT, max_tokens=2, extra_body={"fake": {"first_token_delay": 5}})
        assert caught.value.status_code == 504
        assert "proxy.first_byte_timeout" in caught.value.message
        await asyncio.to_thread(fake.wait_event, "cancelled", 10.0)


async def test_drain_lets_streams_finish_and_refuses_new_work(fake):
    async with running_proxy(ready_pool([fake])) as proxy, aiohttp.ClientSession() as session:
        async with session.get(url(proxy, "/ready")) as response:
            assert response.status == 200  # this keep-alive connection stays open during the drain
        response = await raw_stream(session, proxy, max_tokens=20, fake={"token_delay": 0.05})
        drain = asyncio.create_task(proxy.drain_and_stop(10))
        await wait_for(lambda: proxy.draining, what="the drain to start")
        async with aiohttp.ClientSession() as other:
            with pytest.raises(aiohttp.ClientConnectionError):
                await other.get(url(proxy, "/health"))  # no new connections
        body = await response.read()
        events = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]
        assert len(events) == 21 and not any("error" in e for e in events)  # role + 20 tokens, complete
        await asyncio.wait_for(drain, 10)
        assert fake.events("finished")


async def test_drain_deadline_aborts_streams_upstream(fake):
    async with running_proxy(ready_pool([fake])) as proxy:
        stream = await client(proxy).chat.completions.create(**CHAT, max_tokens=400, stream=True,
                                                             extra_body={"fake": {"token_delay": 0.05}})
        await anext(aiter(stream))
        started = time.monotonic()
        drain = asyncio.create_task(proxy.drain_and_stop(0.5))
        with pytest.raises(openai.APIError, match="drain deadline"):
            async for _ in stream:
                pass
        await asyncio.wait_for(drain, 10)
        assert time.monotonic() - started < 5
        event = await asyncio.to_thread(fake.wait_event, "cancelled", 10.0)
        assert event["tokens"] < 400


async def test_ready_is_503_and_new_requests_refused_while_draining(fake):
    async with running_proxy(ready_pool([fake])) as proxy, aiohttp.ClientSession() as streamer, \
            aiohttp.ClientSession() as prober:
        async with prober.get(url(proxy, "/ready")) as response:
            assert response.status == 200  # opens a keep-alive connection that outlives the listener
        response = await raw_stream(streamer, proxy, max_tokens=10, fake={"token_delay": 0.1})
        drain = asyncio.create_task(proxy.drain_and_stop(10))
        await wait_for(lambda: proxy.draining, what="the drain to start")
        async with prober.get(url(proxy, "/ready")) as ready:
            assert ready.status == 503 and (await ready.json())["draining"] is True
        async with prober.post(url(proxy, "/v1/chat/completions"), json={**CHAT, "max_tokens": 1}) as refused:
            assert refused.status == 503 and refused.headers["Retry-After"]
            assert "shutting down" in (await refused.json())["error"]["message"]
        await response.read()
        await asyncio.wait_for(drain, 10)


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
async def test_an_event_stream_s_head_is_the_instance_s_with_the_proxy_s_caching_headers(version):
    # HTTP/1.1: chunked; 1.0: delimited by the close (messages.StreamAnswer)
    async def instance(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: private\r\n"
                     b"X-Accel-Buffering: yes\r\nX-Request-Id: r1\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunk(b"data: 1\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(instance) as server:
        pool = BackendPool([Backend("raw", server.url)])
        pool.set_state("raw", "ready", True)
        async with running_proxy(pool) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            body = json.dumps({**CHAT, "stream": True}).encode()
            writer.write(b"POST /v1/chat/completions HTTP/%b\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (version, len(body), body))
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/%b 200 OK" % version, head
    names = [line.split(b":", 1)[0].lower() for line in lines[1:]]
    assert names.count(b"cache-control") == 1 and b"Cache-Control: no-cache" in lines, head
    assert names.count(b"x-accel-buffering") == 1 and b"X-Accel-Buffering: no" in lines, head
    assert b"X-Request-Id: r1" in lines and b"Content-Type: text/event-stream" in lines, head
    if version == b"1.1":
        assert b"Transfer-Encoding: chunked" in lines and b"Connection: close" in lines, head
        payload, ended = b"", rest
        while not ended.startswith(b"0\r\n"):
            size, _, ended = ended.partition(b"\r\n")
            payload, ended = payload + ended[:int(size, 16)], ended[int(size, 16) + 2:]
        assert payload == b"data: 1\n\ndata: [DONE]\n\n" and ended == b"0\r\n\r\n", rest
    else:
        assert b"Transfer-Encoding" not in head and rest == b"data: 1\n\ndata: [DONE]\n\n", (head, rest)


async def test_a_client_leaving_right_after_the_last_chunk_is_a_quiet_disconnect(caplog):
    # The race wrk hit at the end of each run: the instance's final chunk and the client's close
    # reach the proxy in one loop iteration, so the handler ends the response on a closing socket.
    events_sent = asyncio.Event()
    upstream_writer: list[asyncio.StreamWriter] = []

    async def instance(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunk(b'data: {"n": 1}\n\n') + chunk(b"data: [DONE]\n\n"))
        upstream_writer.append(writer)
        events_sent.set()
        await asyncio.sleep(30)

    async with RawServer(instance) as server:
        pool = BackendPool([Backend("raw", server.url)])
        pool.set_state("raw", "ready", True)
        async with running_proxy(pool) as proxy:
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", proxy.port))
            body = json.dumps({**CHAT, "stream": True}).encode()
            await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                          b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
            received = b""
            while b"[DONE]" not in received:
                received += await loop.sock_recv(sock, 65536)
            await events_sent.wait()
            # In one step, with no await between: the instance ends its answer, then the client goes.
            upstream_writer[0].write(b"0\r\n\r\n")
            sock.close()
            await wait_for(lambda: proxy.total_in_flight() == 0, what="the proxy to finish the request")
            assert metric_value(await metrics_text(proxy), "vsup_proxy_client_disconnects_total", phase="streaming") == 1
    errors = [r for r in caplog.records if r.name.startswith(("vsup", "aiohttp")) and (r.levelno >= logging.ERROR or r.exc_info)]
    assert errors == [], [r.getMessage() for r in errors]
