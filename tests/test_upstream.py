"""The proxy's upstream HTTP/1.1 client (vsup/proxy/upstream.py) on its own, against
raw socket servers that misbehave: split and malformed answers, bodies longer or shorter than
announced, interim and bodiless answers, resets at every phase, back-pressure both ways, a pool
waiter cancelled while it waits, connections closed between requests."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from tests.fakevllm.fixtures import free_port
from tests.raw_http import RawServer, chunk, read_request, reset, send_in_pieces
from vsup.proxy import upstream_conn
from vsup.proxy.upstream import UpstreamClient
from vsup.proxy.upstream_conn import ConnectFailed, StaleConnection, UpstreamBroken

JSON = b"Content-Type: application/json\r\n"
CL_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nX-Answer: yes\r\n\r\nhello world"
CHUNKED_ANSWER = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Answer: yes\r\n\r\n" + chunk(b"hello") + chunk(b" world") + b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def upstream_client(limit: int = 4):
    client = UpstreamClient(limit=limit, connect_timeout=2.0, keepalive=30.0)
    try:
        yield client
    finally:
        client.close()


async def ask(client: UpstreamClient, url: str, method: str = "POST", body: bytes = b"{}"):
    """One request on an idle connection or a new one: (status, headers, body)."""
    conn = client.idle_connection(url) or await client.connect(url)
    response = await client.send(conn, method, b"/v1/x", JSON, body)
    try:
        content = await asyncio.wait_for(response.read(), 5)
    finally:
        response.close()
    return response.status, dict(response.raw_headers), content


def answering(*answers: bytes, then=None):
    """A keep-alive server script: the n-th request the server gets (on any connection) gets
    answers[n] (the last one repeats); `then(writer)` runs after each answer, and the connection
    closes when it returns False."""
    count = 0

    async def script(reader, writer):
        nonlocal count
        while True:
            await read_request(reader)
            writer.write(answers[min(count, len(answers) - 1)])
            await writer.drain()
            count += 1
            if then is not None and await then(writer) is False:
                return

    return script


# ------------------------------------------------------------------------- framing


@pytest.mark.parametrize("answer", [CL_ANSWER, CHUNKED_ANSWER], ids=["content-length", "chunked"])
async def test_an_answer_split_at_every_byte_boundary(answer):
    splits = iter(range(1, len(answer)))

    async def script(reader, writer):
        for i in splits:
            await read_request(reader)
            await send_in_pieces(writer, answer[:i], answer[i:])

    async with RawServer(script) as server, upstream_client() as client:
        for _ in range(len(answer) - 1):
            status, headers, body = await ask(client, server.url)
            assert (status, headers[b"X-Answer"], body) == (200, b"yes", b"hello world")
        assert server.connections == 1  # every answer complete and clean: the connection was kept


@pytest.mark.parametrize("answer", [CL_ANSWER, CHUNKED_ANSWER], ids=["content-length", "chunked"])
async def test_an_answer_one_byte_at_a_time(answer):
    async def script(reader, writer):
        await read_request(reader)
        await send_in_pieces(writer, *(answer[i:i + 1] for i in range(len(answer))), pause=0)

    async with RawServer(script) as server, upstream_client() as client:
        assert await ask(client, server.url) == (200, {b"Transfer-Encoding": b"chunked", b"X-Answer": b"yes"}
                                                 if answer is CHUNKED_ANSWER else {b"Content-Length": b"11", b"X-Answer": b"yes"},
                                                 b"hello world")


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
    b"SSH-2.0-OpenSSH_9.2\r\n",
    b"HTTP/1.1 200 OK\r\nthis is no header\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
], ids=["status line", "not http", "header line", "two lengths", "chunk size"])
async def test_malformed_answers_are_broken_not_retried(answer):
    async with RawServer(answering(answer)) as server, upstream_client() as client:
        conn = await client.connect(server.url)
        with pytest.raises(UpstreamBroken, match="invalid HTTP") as caught:
            response = await client.send(conn, "POST", b"/v1/x", JSON, b"{}")
            await response.read()  # a bad chunk size shows only while reading the body
        assert not isinstance(caught.value, StaleConnection)


async def test_a_body_shorter_than_announced_is_broken():
    async def script(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()

    async with RawServer(script) as server, upstream_client() as client:
        conn = await client.connect(server.url)
        response = await client.send(conn, "POST", b"/v1/x", JSON, b"{}")
        assert await response.read_chunk() == b"only this"
        with pytest.raises(UpstreamBroken, match="closed the connection"):
            await response.read()
        response.close()


async def test_a_chunked_body_cut_short_is_broken():
    async def script(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"part"))
        await writer.drain()

    async with RawServer(script) as server, upstream_client() as client:
        with pytest.raises(UpstreamBroken):
            await ask(client, server.url)


async def test_bytes_beyond_the_announced_length_never_become_the_next_answer():
    # The extra bytes are a complete answer: taken as the next request's answer, one client
    # would get a response meant for nobody (or for someone else).
    bogus = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nbogus!"
    genuine = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\ngenuine"
    async with RawServer(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" + bogus, genuine)) as server, \
            upstream_client() as client:
        assert (await ask(client, server.url))[2] == b"hello"
        assert (await ask(client, server.url))[2] == b"genuine"
        assert server.connections == 2  # the first connection was not reused


async def test_an_unsolicited_answer_on_an_idle_connection_drops_it():
    async def late_answer(writer):
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nbogus!")

    genuine = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\ngenuine"
    async with RawServer(answering(genuine, then=late_answer)) as server, upstream_client() as client:
        assert (await ask(client, server.url))[2] == b"genuine"
        await asyncio.sleep(0.2)  # the bogus answer arrived while the connection was idle
        assert (await ask(client, server.url))[2] == b"genuine"
        assert server.connections == 2


async def test_a_body_delimited_by_the_end_of_the_connection():
    async def script(reader, writer):
        await read_request(reader)
        await send_in_pieces(writer, b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n", b"until ", b"the end")
        writer.close()

    async with RawServer(script) as server, upstream_client() as client:
        assert (await ask(client, server.url))[::2] == (200, b"until the end")
        assert (await ask(client, server.url))[::2] == (200, b"until the end")  # not reused: a new one
        assert server.connections == 2


# ------------------------------------------------------------------------- keep-alive


async def test_connection_close_mid_keep_alive():
    answered = 0

    async def close_after_second(writer):
        nonlocal answered
        answered += 1
        if answered == 2:
            return False  # the script ends: the server closes after its "Connection: close" answer

    keep = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nkeep"
    close = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nclose"
    async with RawServer(answering(keep, close, keep, then=close_after_second)) as server, upstream_client() as client:
        assert [(await ask(client, server.url))[2] for _ in range(4)] == [b"keep", b"close", b"keep", b"keep"]
        assert server.connections == 2


async def test_connection_close_is_honoured_even_if_the_server_keeps_it_open():
    close = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nclose"
    async with RawServer(answering(close)) as server, upstream_client() as client:
        for _ in range(3):
            assert (await ask(client, server.url))[2] == b"close"
        assert server.connections == 3


async def test_an_idle_connection_closed_by_the_server_between_requests():
    async def close_soon(writer):
        await asyncio.sleep(0.02)
        return False

    async with RawServer(answering(CL_ANSWER, then=close_soon)) as server, upstream_client() as client:
        assert (await ask(client, server.url))[2] == b"hello world"
        await asyncio.sleep(0.2)
        assert (await ask(client, server.url))[2] == b"hello world"  # a new connection, no error
        assert server.connections == 2
        assert client.pools[server.url].open == 1  # the dead one gave its slot back


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_a_reused_connection_that_dies_before_answering_is_stale(how):
    async def die_on_second(reader, writer):
        await read_request(reader)
        writer.write(CL_ANSWER)
        await read_request(reader)  # the second request arrives, is read, and the server goes
        if how == "rst":
            reset(writer)

    async with RawServer(die_on_second) as server, upstream_client() as client:
        await ask(client, server.url)
        with pytest.raises(StaleConnection):
            await ask(client, server.url)


# ------------------------------------------------------------------------- interim and bodiless answers


@pytest.mark.parametrize("split", [False, True])
async def test_interim_1xx_answers_are_skipped(split):
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n"
    final = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def script(reader, writer):
        while True:
            await read_request(reader)
            await send_in_pieces(writer, *((interim, final) if split else (interim + final,)))

    async with RawServer(script) as server, upstream_client() as client:
        for _ in range(2):
            status, headers, body = await ask(client, server.url)
            assert (status, body) == (200, b"ok") and b"Link" not in headers
        assert server.connections == 1


async def test_101_switching_protocols_is_broken():
    answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n\x81\x00"
    async with RawServer(answering(answer)) as server, upstream_client() as client:
        with pytest.raises(UpstreamBroken, match="101"):
            await ask(client, server.url)


@pytest.mark.parametrize("status", [204, 304])
async def test_bodiless_statuses_end_at_the_headers(status):
    # Content-Length on a 304 is the length the resource would have: no body follows.
    answer = b"HTTP/1.1 %d Whatever\r\nContent-Length: 20\r\n\r\n" % status
    async with RawServer(answering(answer)) as server, upstream_client() as client:
        for _ in range(2):
            assert (await ask(client, server.url))[::2] == (status, b"")
        assert server.connections == 1


async def test_head_answers_end_at_the_headers():
    async with RawServer(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")) as server, upstream_client() as client:
        status, headers, body = await ask(client, server.url, method="HEAD", body=b"")
        assert (status, headers[b"Content-Length"], body) == (200, b"100", b"")


# ------------------------------------------------------------------------- resets at every phase


async def _accepted_then_reset(reader, writer):
    reset(writer)


async def _reset_after_request(reader, writer):
    await read_request(reader)
    reset(writer)


async def _reset_mid_headers(reader, writer):
    await read_request(reader)
    await send_in_pieces(writer, b"HTTP/1.1 200 OK\r\nContent-Le")
    await asyncio.sleep(0.01)
    reset(writer)


@pytest.mark.parametrize("script", [_accepted_then_reset, _reset_after_request, _reset_mid_headers],
                         ids=["on accept", "after the request", "mid headers"])
async def test_a_reset_before_the_answer_on_a_fresh_connection_is_broken_not_stale(script):
    async with RawServer(script) as server, upstream_client() as client:
        with pytest.raises(UpstreamBroken) as caught:
            await ask(client, server.url)
        assert not isinstance(caught.value, StaleConnection)
        assert client.pools[server.url].open == 0


@pytest.mark.parametrize("head, first", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"partial"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", chunk(b"partial") + b"5\r\nhe"),
], ids=["content-length", "chunked"])
async def test_a_reset_mid_body_is_broken(head, first):
    async def script(reader, writer):
        await read_request(reader)
        await send_in_pieces(writer, head + first)
        await asyncio.sleep(0.02)
        reset(writer)

    async with RawServer(script) as server, upstream_client() as client:
        conn = await client.connect(server.url)
        response = await client.send(conn, "POST", b"/v1/x", JSON, b"{}")
        assert response.status == 200
        with pytest.raises(UpstreamBroken, match="closed the connection"):
            await response.read()
        response.close()
        assert client.pools[server.url].open == 0


async def test_a_reset_while_idle_frees_the_connection():
    async def reset_when_idle(writer):
        await asyncio.sleep(0.02)
        reset(writer)
        return False

    async with RawServer(answering(CL_ANSWER, then=reset_when_idle)) as server, upstream_client() as client:
        await ask(client, server.url)
        await asyncio.sleep(0.2)
        pool = client.pools[server.url]
        assert (pool.open, pool.idle) == (0, [])
        assert (await ask(client, server.url))[2] == b"hello world"


async def test_a_refused_connect_is_connect_failed():
    async with upstream_client() as client:
        with pytest.raises(ConnectFailed, match="cannot connect"):
            await client.connect(f"http://127.0.0.1:{free_port()}")
        assert client.pools[next(iter(client.pools))].open == 0


# ------------------------------------------------------------------------- back-pressure


BIG = 4 * 1024 * 1024


async def test_a_slow_reader_pauses_the_instance_and_resumes_it():
    payload = bytes(range(256)) * (BIG // 256)

    async def script(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()

    async with RawServer(script) as server, upstream_client() as client:
        conn = await client.connect(server.url)
        response = await client.send(conn, "POST", b"/v1/x", JSON, b"{}")
        await asyncio.sleep(0.3)  # nobody reads: the connection stops reading at the high-water mark
        assert conn.reading_paused
        assert conn.queued <= upstream_conn._HIGH_WATER + 256 * 1024  # + at most one socket read
        received = bytearray()
        while piece := await response.read_chunk():
            received += piece
            await asyncio.sleep(0)
        assert received == payload and not conn.reading_paused
        response.close()


async def test_a_server_that_stops_reading_still_gets_its_answer_through():
    # The server answers without reading the (large) request body: writing it must not block the
    # client, and the early answer arrives.
    async def script(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbig")
        await writer.drain()
        await asyncio.sleep(0.5)

    async with RawServer(script) as server, upstream_client() as client:
        status, _, body = await asyncio.wait_for(ask(client, server.url, body=b"x" * BIG), 5)
        assert (status, body) == (413, b"big")


class _SlowClientSink:
    """What the relay writes to: a real socket to a client that reads only when told to."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pieces = 0

    def write(self, data: bytes) -> bool:
        self.pieces += 1
        self.writer.write(data)
        return self.writer.transport.get_write_buffer_size() > 64 * 1024

    def end(self, data: bytes) -> None:
        self.pieces += 1
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()


class _Exchange:
    first_data_at = None
    last = 0.0

    def on_data(self, now):
        self.last = now
        self.first_data_at = self.first_data_at or now

    def first_data(self, now):
        self.first_data_at = now


async def test_relay_pauses_the_instance_while_the_client_is_slow():
    payload = bytes(range(256)) * (4 * BIG // 256)

    async def script(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(payload), 16384):
            writer.write(chunk(payload[i:i + 16384]))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    reading = asyncio.Event()
    got = bytearray()

    async def slow_client(reader, writer):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        await reading.wait()
        while piece := await reader.read(65536):
            got.extend(piece)

    async with RawServer(script) as server, RawServer(slow_client) as sink_server, upstream_client() as client:
        _, sink_writer = await asyncio.open_connection("127.0.0.1", sink_server.port)
        # small kernel buffers, so that the client's slowness shows before megabytes are in flight
        sink_writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sink = _SlowClientSink(sink_writer)
        conn = await client.connect(server.url)
        response = await client.send(conn, "POST", b"/v1/x", JSON, b"{}")
        relay = asyncio.create_task(response.relay(sink, _Exchange()))
        await asyncio.sleep(0.3)
        assert conn.reading_paused and not relay.done()  # the client reads nothing: we stopped reading
        reading.set()
        await asyncio.wait_for(relay, 10)
        response.close()
        sink_writer.close()
        await asyncio.sleep(0.1)
        assert bytes(got) == payload


class _RecordingSink:
    """A sink that records each call the relay makes (one call is one write to the client)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    def write(self, data: bytes) -> bool:
        self.calls.append(("write", data))
        return False

    def end(self, data: bytes) -> None:
        self.calls.append(("end", data))

    async def drain(self) -> None:
        return None


async def test_what_one_read_brings_is_relayed_in_one_write_with_the_end_of_the_body():
    sent = asyncio.Event()

    async def script(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await sent.wait()
        writer.write(chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.sleep(0.1)  # the first event alone: written as soon as it is read
        # the last event, [DONE] and the end of the body in one segment, as vLLM ends a stream
        writer.write(chunk(b"data: 2\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(script) as server, upstream_client() as client:
        conn = await client.connect(server.url)
        response = await client.send(conn, "POST", b"/v1/x", JSON, b"{}")
        sink = _RecordingSink()
        relay = asyncio.create_task(response.relay(sink, _Exchange()))
        sent.set()
        await asyncio.sleep(0.05)
        assert sink.calls == [("write", b"data: 1\n\n")] and not relay.done()
        await asyncio.wait_for(relay, 5)
        response.close()
    assert sink.calls == [("write", b"data: 1\n\n"), ("end", b"data: 2\n\ndata: [DONE]\n\n")]


# ------------------------------------------------------------------------- the pool


async def test_a_waiter_cancelled_while_waiting_leaves_the_pool_consistent():
    async with RawServer(answering(CL_ANSWER)) as server, upstream_client(limit=1) as client:
        first = await client.connect(server.url)
        pool = client.pools[server.url]
        waiting = asyncio.create_task(client.connect(server.url))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert len(pool.waiters) == 0
        pool.release(first, True)
        assert (pool.open, len(pool.idle)) == (1, 1)
        assert client.idle_connection(server.url) is first


async def test_a_connection_handed_to_a_waiter_being_cancelled_goes_back_to_the_pool():
    async with RawServer(answering(CL_ANSWER)) as server, upstream_client(limit=1) as client:
        first = await client.connect(server.url)
        pool = client.pools[server.url]
        waiting = asyncio.create_task(client.connect(server.url))
        await asyncio.sleep(0.01)
        pool.release(first, True)  # handed to the waiter...
        waiting.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (pool.open, [conn for conn, _ in pool.idle]) == (1, [first])


async def test_a_free_slot_handed_to_a_waiter_being_cancelled_passes_to_the_next():
    async with RawServer(answering(CL_ANSWER)) as server, upstream_client(limit=1) as client:
        first = await client.connect(server.url)
        pool = client.pools[server.url]
        cancelled = asyncio.create_task(client.connect(server.url))
        await asyncio.sleep(0.01)
        next_in_line = asyncio.create_task(client.connect(server.url))
        await asyncio.sleep(0.01)
        pool.release(first, False)  # dropped: its slot goes to the first waiter...
        cancelled.cancel()  # ...which is cancelled before it runs: the slot must reach the next
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        conn = await asyncio.wait_for(next_in_line, 5)
        assert conn is not first and pool.open == 1
        pool.release(conn, False)


async def test_an_answer_left_unread_does_not_leak_into_the_next():
    first = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"
    second = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond"
    async with RawServer(answering(first, second)) as server, upstream_client() as client:
        conn = await client.connect(server.url)
        response = await client.send(conn, "POST", b"/v1/x", JSON, b"{}")
        await asyncio.sleep(0.05)  # the body is in, and nobody reads it (its client went away)
        response.close()
        assert client.idle_connection(server.url) is conn  # complete and clean: kept
        client.pools[server.url].release(conn, True)
        assert (await ask(client, server.url))[2] == b"second"
        assert server.connections == 1
