"""The proxy's own client side of HTTP (vsup/proxy/client_conn.py), byte for byte over real
sockets: a FrontServer with a test handler, a raw socket as the client. What the proxy's tests
check through the whole ProxyServer (tests/test_proxy_front_door.py, test_proxy_clients.py) is
not repeated here: these are the protocol's own promises — framing, keep-alive and pipelining,
bodies bounded before any handler reads them, no reading on after an early answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from pathlib import Path

import pytest

from tests.raw_http import send_in_pieces
from vsup.config.schema import ProxyConfig
from vsup.proxy.client_conn import LINGER_BYTES, FrontServer
from vsup.proxy.clients import ClientPolicy
from vsup.proxy.messages import BODY_HIGH_WATER, RawResponse, Request, Response, StreamAnswer
from vsup.proxy.metrics import ProxyMetrics


def policy(**config) -> ClientPolicy:
    return ClientPolicy(ProxyMetrics(dict, list, lambda name: True, dict), ProxyConfig(port=0, **config))


@contextlib.asynccontextmanager
async def front(handler, **config):
    server = FrontServer(handler, policy(**config))
    port = await server.listen("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.close(0.2)


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


async def echo(request: Request) -> Response:
    body = await read_all(request)
    return Response(body=json.dumps({"method": request.method, "path": request.path, "query": request.query_string,
                                     "raw_path": request.raw_path, "body": len(body), "keep": request.keep_alive}).encode(),
                    content_type="application/json")


async def read_all(request: Request) -> bytes:
    parts = []
    while piece := await request.content.readany():
        parts.append(piece)
    return b"".join(parts)


def answers(data: bytes) -> list[tuple[bytes, bytes]]:
    """Split Content-Length-framed answers: [(head, body), ...]."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b": ")
            if name.lower() == b"content-length":
                length = int(value)
        out.append((head, rest[:length]))
        data = rest[length:]
    return out


async def test_pipelined_requests_are_answered_in_order_on_one_connection():
    async with front(echo) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /b?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                     b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = answers(await read_until_closed(reader))
        writer.close()
    assert [json.loads(body)["path"] for _, body in got] == ["/a", "/b", "/c"]
    assert json.loads(got[1][1])["body"] == 3 and json.loads(got[1][1])["query"] == "x=1"
    assert b"Connection: close" not in got[0][0] and b"Connection: close" in got[2][0]


async def test_a_kept_connection_serves_again_and_http_1_0_closes():
    async with front(echo) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for path in (b"/one", b"/two"):
            writer.write(b"GET %b HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            assert json.loads(await reader.readexactly(length))["path"] == path.decode()
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /old HTTP/1.0\r\n\r\n")
        data = await read_until_closed(reader)
        writer.close()
    assert data.startswith(b"HTTP/1.0 200 OK\r\n") and json.loads(answers(data)[0][1])["keep"] is False


async def test_absolute_form_and_percent_encoded_targets():
    async with front(echo) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET http://h:1/v1/a%2Eb?q=%20 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        seen = json.loads(answers(await read_until_closed(reader))[0][1])
        writer.close()
    assert seen["path"] == "/v1/a.b" and seen["raw_path"] == "http://h:1/v1/a%2Eb?q=%20" and seen["query"] == "q=%20"


async def test_the_headers_a_handler_reads_case_insensitive_and_the_first_of_a_repeated_one():
    async def headers(request: Request) -> Response:
        view = request.headers
        return Response(body=json.dumps({
            "content_type": request.content_type, "authorization": request.authorization, "expect": request.expect,
            "session": view.get("x-SESSION-id"), "missing": view.get("X-None"), "names": sorted(view), "count": len(view),
        }).encode())

    async with front(headers) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /h HTTP/1.1\r\nHost: x\r\nCONTENT-TYPE: application/json\r\nauthorization: Bearer k1\r\n"
                     b"Authorization: Bearer k2\r\nX-Session-ID: s1\r\nx-session-id: s2\r\nConnection: close\r\n\r\n")
        seen = json.loads(answers(await read_until_closed(reader))[0][1])
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /h HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        bare = json.loads(answers(await read_until_closed(reader))[0][1])
        writer.close()
    assert seen == {"content_type": "application/json", "authorization": "Bearer k1", "expect": None, "session": "s1",
                    "missing": None, "count": 5,  # each name once, as first sent
                    "names": sorted(["Host", "CONTENT-TYPE", "authorization", "X-Session-ID", "Connection"])}
    assert (bare["content_type"], bare["authorization"], bare["expect"]) == ("", "", None)


async def test_a_stream_is_chunked_for_1_1_and_delimited_by_the_close_for_1_0():
    async def stream(request: Request) -> StreamAnswer:
        out = StreamAnswer(request, 200)
        sink = out.start(b"Content-Type: text/event-stream\r\n")
        assert sink is not None
        sink.write(b"data: 1\n\n")
        sink.end(b"data: 2\n\n")
        return out

    async with front(stream) as (_, port):
        for version in (b"1.1", b"1.0"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /s HTTP/%b\r\nHost: x\r\nConnection: close\r\n\r\n" % version)
            data = await read_until_closed(reader)
            writer.close()
            head, _, body = data.partition(b"\r\n\r\n")
            if version == b"1.1":
                assert b"Transfer-Encoding: chunked" in head
                assert body == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
            else:
                assert b"Transfer-Encoding" not in head and body == b"data: 1\n\ndata: 2\n\n"


async def test_a_stream_cut_before_its_end_breaks_the_transfer():
    async def cut(request: Request) -> StreamAnswer:
        out = StreamAnswer(request, 200)
        sink = out.start(b"")
        assert sink is not None
        sink.write(b"partial")
        return out  # never ended

    async with front(cut) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await read_until_closed(reader)
        writer.close()
    assert data.endswith(b"7\r\npartial\r\n")  # no last chunk: the client sees a broken body


async def test_head_gets_the_head_alone():
    async def page(request: Request) -> RawResponse:
        return RawResponse(200, b"Content-Type: text/plain\r\n", b"hello")

    async with front(page) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await read_until_closed(reader)
        writer.close()
    assert data.endswith(b"Content-Length: 5\r\nConnection: close\r\n\r\n")


async def test_a_body_nobody_reads_is_not_read_past_the_high_water_mark():
    started = asyncio.Event()
    seen: list[Request] = []

    async def holds(request: Request) -> Response:
        seen.append(request)
        started.set()
        await asyncio.sleep(30)
        return Response()

    async with front(holds) as (server, port):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.setblocking(False)
        sock.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        sent, chunk = 0, b"x" * 65536
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while loop.time() < deadline:  # send until the socket stays full
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                await asyncio.sleep(0.05)
        buffered = seen[0].content._size
        sock.close()
    # the proxy stopped reading: what it holds for the body is the high-water mark and one read,
    # while the client could have sent 100 MiB
    assert buffered <= BODY_HIGH_WATER + 256 * 1024, buffered
    assert sent < 16 * 1024 * 1024, sent


async def test_an_early_answer_ends_the_connection_without_reading_the_body_on():
    async def refuse(request: Request) -> Response:
        answer = Response(413, b"too large")
        answer.force_close()
        return answer

    async with front(refuse) as (_, port):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert (await asyncio.wait_for(loop.sock_recv(sock, 1024), 5)).startswith(b"HTTP/1.1 413 ")
        sent, chunk = 0, b"%x\r\n%b\r\n" % (65536, b"y" * 65536)
        deadline = loop.time() + 5
        closed = False
        while loop.time() < deadline and not closed:
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                await asyncio.sleep(0.01)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        sock.close()
    assert closed, "the connection stayed open after the 413"
    # what the client got to send after the answer: the linger's allowance and the sockets' buffers
    buffers = sum(int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2]) for name in ("tcp_rmem", "tcp_wmem"))
    assert sent <= LINGER_BYTES + buffers + len(chunk), sent


async def test_a_handler_that_fails_gets_a_500_and_nothing_of_the_traceback(caplog):
    async def broken(request: Request) -> Response:
        raise RuntimeError("secret detail")

    async with front(broken) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await read_until_closed(reader)
        writer.close()
    head, body = answers(data)[0]
    assert head.startswith(b"HTTP/1.1 500 ") and b"secret" not in body
    assert json.loads(body)["error"]["code"] == "internal_error"


async def test_a_disconnect_cancels_the_handler():
    cancelled = asyncio.Event()

    async def waits(request: Request) -> Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response()

    async with front(waits) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 5)


async def test_headers_counted_before_the_parser_holds_them():
    async with front(echo, max_header_bytes=4096) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await send_in_pieces(writer, b"GET / HTTP/1.1\r\n", *[b"X-A: " + b"a" * 1000 + b"\r\n"] * 5)
        data = await read_until_closed(reader)
        writer.close()
        # refused once more than 4096 bytes came without the head's end, not when it ended
        assert data.startswith(b"HTTP/1.1 431 ")
        assert server.policy.metrics.malformed_requests == {431: 1}


@pytest.mark.parametrize("request_bytes", [
    b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    b"CONNECT example.com:443 HTTP/1.1\r\n\r\n",
])
async def test_upgrades_are_refused(request_bytes):
    async with front(echo) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes)
        data = await read_until_closed(reader)
        writer.close()
    assert data.startswith(b"HTTP/1.1 400 ") and b"not supported" in data


async def test_no_file_descriptor_outlives_the_server():
    before = len(os.listdir("/proc/self/fd"))
    async with front(echo) as (_, port):
        writers = []
        for _ in range(5):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writers.append(writer)
        await asyncio.sleep(0.05)
    for writer in writers:
        writer.close()
    await asyncio.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= before


async def test_a_pipelined_request_whose_body_follows_later_is_read_when_its_turn_comes():
    async with front(echo) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\nConnection: close\r\n\r\n" + b"x" * 1000)
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"y" * 199_000)  # the rest of /b's body, after the first answer
        got = answers(await read_until_closed(reader))
        writer.close()
    assert [json.loads(body)["path"] for _, body in got] == ["/a", "/b"] and json.loads(got[1][1])["body"] == 200_000
