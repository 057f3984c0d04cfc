#!/usr/bin/env python3
"""The proxy's front door under a flood, measured: what unauthenticated clients can make `vsup proxy`
hold (its RSS), whether /health stays answered, and whether one client's big bodies stall the others.

    .venv/bin/python bench/flood_bench.py [--cases header,idle,trickle,bodies,json]
        [--connections 400] [--header-kib 960] [--idle 4300] [--trickle-every 5] [--trickle-cap 150]
        [--bodies 60] [--body-kib 8192] [--body-timeout 600] [--chunked-after-mib 64]
        [--json-seconds 20] [--json-mib 7] [--json-shape array|object] [--probe-every 0.05]
        [--baseline DIR [--baseline-label TEXT]] [--label TEXT] [--variant NAME] [--out DIR]

Each run starts `vsup proxy` (this tree's, or with --baseline also another vsup source tree's, e.g.
`git archive <commit> | tar -x -C DIR`, measured the same way after it) with its default settings
in front of a minimal upstream (in this process), and runs the cases --cases names (all by default):
  header   --connections clients each send a request line and --header-kib KiB of header
           lines (8 KiB each, under aiohttp's per-line and per-count limits) and never end
           them; the proxy's RSS (VmRSS) before, at its peak, while they are held, and after
           they closed; how many were answered (431) rather than left open.
  idle     --idle connections that send nothing, from 127.0.0.2-127.0.0.12 (loopback is
           127/8, so as many client addresses); meanwhile a new connection from 127.0.0.1
           GETs /health every 0.25 s: how many of those got 200.
  trickle  from the start, one request whose header lines come one every --trickle-every
           seconds and one whose body bytes do: after how long the proxy closed each (or
           "open" at --trickle-cap seconds).
  (these three share one proxy; each case below gets a fresh one)
  bodies   issue 29 item 3: --bodies connections from 127.0.0.2-127.0.0.12 each POST a chat
           completion declaring `Content-Length` of --body-kib KiB (8 MiB: the default
           proxy.max_body_bytes) and send all of it but its last byte (a JSON object missing its
           closing brace), then wait; the proxy's RSS before, at its peak (sampled every 0.1 s),
           while held and after they closed; what each got (503: the body budget refused it, 408:
           the body deadline). This proxy runs with proxy.body_timeout --body-timeout (600 s,
           recorded in the result) so the deadline is not what bounds it. Bar: a peak RSS rise
           < 100 MiB. Then, on the same proxy, one chunked upload that never ends: its answer
           (413 past proxy.max_body_bytes) and how many bytes the client could still send after
           it before the connection closed (up to --chunked-after-mib MiB: "read on"). Bar: 413,
           then closed with at most 1 MiB sent after it.
  json     issue 29 item 4: a phase of --json-seconds with one connection GETting /health and one
           POSTing a small chat completion (max_tokens 2) every --probe-every seconds (unloaded),
           then the same while another process posts --json-mib MiB JSON arrays of small objects
           (`[{"a": 1}, ...]`, 10 bytes each: 734k in 7 MiB; not an object, so 400 once parsed)
           back to back on its own connection (--json-shape object: a chat completion holding that
           array in an extra field, so an answer from the body's first byte alone cannot skip the
           parse; the upstream answers it). Latencies p50/p95/p99/max of both phases; bar:
           loaded /health p99 <= 50 ms and the small request's loaded p95 <= 2x its unloaded p95,
           with the JSON client's posts answered (not refused) at least once.
The bench raises its open-file limit to the hard limit (the proxy inherits it: its connection limit is
4096 or half of that). Writes docs/bench/flood_bench.json when every case ran, else
docs/bench/flood_bench-<cases joined by ->.json; --variant NAME: flood_bench-NAME.json; --out DIR:
there instead of docs/bench. With --baseline, the ratios this / baseline of each case's headline
figures are printed and recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
LINE = b"X-Pad-%03d: " + b"a" * 8180 + b"\r\n"  # 8 KiB, under aiohttp's 8190-byte line limit
SOURCES = [f"127.0.0.{i}" for i in range(2, 13)]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def upstream() -> tuple[web.AppRunner, int]:
    async def health(request):
        return web.json_response({"status": "ok"})

    async def chat(request):  # a small completion, at once
        await request.read()
        return web.json_response({"id": "chatcmpl-bench", "object": "chat.completion", "model": "bench",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"},
                                               "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})

    app = web.Application(client_max_size=64 * 1024 * 1024)  # the json case's object shape forwards 7 MiB bodies
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def get(port: int, path: str, source: str = "127.0.0.1", timeout: float = 5.0) -> int:
    """The status of GET path on a new connection (0: no answer)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), timeout)
    except (OSError, TimeoutError):
        return 0
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), timeout)
        return int(line.split()[1]) if line.startswith(b"HTTP/") else 0
    except (OSError, TimeoutError, ValueError, IndexError):
        return 0
    finally:
        writer.close()


async def start_proxy(tree: Path, upstream_port: int, settings: dict | None = None) -> tuple[subprocess.Popen, int]:
    """`vsup proxy` of `tree` with its default settings but `settings` (proxy.* keys, given in a --config file)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "-c", "from vsup.cli.main import main; main()", "proxy", "--port", str(port),
               "--upstream", f"http://127.0.0.1:{upstream_port}"]
    with contextlib.ExitStack() as stack:
        if settings:
            config = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="flood_bench-"))
            config.write(json.dumps({"proxy": settings}))  # JSON is YAML
            config.flush()
            command += ["--config", config.name]
        proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while await get(port, "/ready", timeout=1) != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"the proxy of {tree} did not become ready")
            await asyncio.sleep(0.2)
    return proc, port


class Sampler:
    """The proxy's RSS every 0.1 s while it runs; `peak()` since the last `reset()`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.highest = 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.highest = max(self.highest, rss_mib(self.pid))
            await asyncio.sleep(0.1)

    def reset(self) -> None:
        self.highest = rss_mib(self.pid)


async def header_flooder(port: int, kib: int, held: list) -> str:
    """One client sending kib KiB of header lines, never ending them: how the proxy took it
    ('answered' 431, 'held' open without a word, 'reset', or 'closed' without an answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    held.append(writer)
    with contextlib.suppress(ConnectionError):
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        for i in range(kib // 8):
            writer.write(LINE % i)
            await writer.drain()
    try:
        answer = await asyncio.wait_for(reader.read(200), 1.0)
    except TimeoutError:
        return "held"
    except ConnectionError:
        return "reset"
    return "answered" if answer.startswith(b"HTTP/1.1 431") else "closed"


async def header_flood(port: int, pid: int, sampler: Sampler, connections: int, kib: int) -> dict:
    before = rss_mib(pid)
    sampler.reset()
    held: list = []
    outcomes = await asyncio.gather(*(header_flooder(port, kib, held) for _ in range(connections)))
    await asyncio.sleep(2)
    while_held = rss_mib(pid)
    peak = sampler.highest
    for writer in held:
        writer.close()
    await asyncio.sleep(3)
    after = rss_mib(pid)
    return {
        "connections": connections, "header_kib_each": kib,
        "answered_431": outcomes.count("answered"), "held_open": outcomes.count("held"), "reset": outcomes.count("reset"),
        "closed_without_answer": outcomes.count("closed"),
        "rss_mib_before": round(before, 1), "rss_mib_peak": round(peak, 1), "rss_mib_while_held": round(while_held, 1),
        "rss_mib_after_close": round(after, 1), "rss_mib_rise_peak": round(peak - before, 1),
        "rss_mib_rise_after_close": round(after - before, 1),
    }


async def idle_flood(port: int, idle: int, seconds: float = 6.0) -> dict:
    writers = []
    refused = 0

    async def open_one(source: str) -> None:
        nonlocal refused
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            refused += 1
            return
        writers.append(writer)

    for start in range(0, idle, 200):
        await asyncio.gather(*(open_one(SOURCES[i % len(SOURCES)]) for i in range(start, min(idle, start + 200))))
    await asyncio.sleep(1)
    polls = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        polls.append(await get(port, "/health", timeout=2))
        await asyncio.sleep(0.25)
    others = await asyncio.gather(*(get(port, "/v1/models", source="127.0.0.1", timeout=2) for _ in range(3)))
    for writer in writers:
        writer.close()
    await asyncio.sleep(1)
    return {"idle_connections": idle, "health_polls": len(polls), "health_200": polls.count(200),
            "health_statuses": sorted(set(polls)), "other_route_statuses": sorted(set(others))}


async def trickle(port: int, every: float, cap: float, body: bool) -> float | None:
    """Seconds until the proxy closed a request trickled a header line (or a body byte) at a
    time every `every` seconds; None: still open at `cap`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    writer.write(head + b"Content-Length: 100000\r\n\r\n" if body else head)

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            for i in range(int(cap / every) + 2):
                await asyncio.sleep(every)
                writer.write(b" " if body else b"X-Drip-%d: 1\r\n" % i)
                await writer.drain()

    sender = asyncio.create_task(drip())
    try:
        await asyncio.wait_for(reader.read(), cap)
        return round(time.monotonic() - started, 1)
    except TimeoutError:
        return None
    except ConnectionError:
        return round(time.monotonic() - started, 1)
    finally:
        sender.cancel()
        writer.close()


# ---- bodies: what held request bodies make the proxy hold --------------------------------------------

KiB, MiB = 1024, 1024 * 1024
MAX_BODY_BYTES = 8 * MiB  # the default proxy.max_body_bytes
PIECE = 64 * KiB  # what a flooding client writes at a time
JSON_HEAD = b'{"model": "bench", "max_tokens": 2, "messages": [{"role": "user", "content": "'
JSON_TAIL = b'"}]}'


def held_body(size: int) -> bytes:
    """A chat completion's JSON of exactly `size` bytes, one long string; the bench sends all but
    its last byte (the closing brace), so what the proxy holds is a valid prefix of an object."""
    return JSON_HEAD + b"a" * (size - len(JSON_HEAD) - len(JSON_TAIL)) + JSON_TAIL


def post_head(length: int | None, path: str = "/v1/chat/completions") -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n").encode()


def answer_of(task: asyncio.Task) -> str:
    """What a client's read of its status line came to: the status ('503'), 'closed' (EOF without
    an answer), 'reset', or 'none' (still waiting)."""
    if not task.done():
        return "none"
    if task.cancelled() or task.exception() is not None:
        return "reset"
    line = task.result()
    if not line:
        return "closed"
    parts = line.split()
    return parts[1].decode() if line.startswith(b"HTTP/") and len(parts) > 1 else "garbled"


async def send_until(writer: asyncio.StreamWriter, data: bytes, answer: asyncio.Task, deadline: float) -> tuple[int, str]:
    """Write `data` a PIECE at a time, each drained, until all is sent ('sent'), the proxy answered
    ('answered'), stopped reading until `deadline` ('stalled') or the connection broke ('reset').
    Returns the bytes drained and how it ended."""
    view = memoryview(data)
    sent = 0
    try:
        while sent < len(view):
            if answer.done():
                return sent, "answered"
            piece = view[sent:sent + PIECE]
            writer.write(piece)
            drain = asyncio.ensure_future(writer.drain())
            await asyncio.wait({drain, answer}, timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
            if not drain.done():
                drain.cancel()
                return sent, ("answered" if answer.done() else "stalled")
            drain.result()
            sent += len(piece)
    except (ConnectionError, OSError):
        return sent, "reset"
    return sent, "sent"


async def bodies_flood(port: int, pid: int, sampler: Sampler, connections: int, declared: int,
                       hold_s: float, send_s: float = 30.0) -> dict:
    body = held_body(declared)[:-1]
    before = rss_mib(pid)
    sampler.reset()
    started = time.monotonic()
    deadline = started + send_s
    clients: list[tuple[asyncio.StreamWriter, asyncio.Task]] = []

    async def one(source: str) -> tuple[int, str]:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 10)
        except (OSError, TimeoutError):
            return 0, "refused"
        answer = asyncio.ensure_future(reader.readline())
        clients.append((writer, answer))
        writer.write(post_head(declared))
        return await send_until(writer, body, answer, deadline)

    sends = await asyncio.gather(*(one(SOURCES[i % len(SOURCES)]) for i in range(connections)))
    send_seconds = time.monotonic() - started
    await asyncio.sleep(hold_s)
    while_held = rss_mib(pid)
    peak = sampler.highest
    answers = Counter(answer_of(answer) for _, answer in clients)
    for writer, answer in clients:
        answer.cancel()
        writer.close()
    await asyncio.sleep(3)
    after = rss_mib(pid)
    ends = Counter(end for _, end in sends)
    rise = peak - before
    return {
        "connections": connections, "declared_bytes": declared, "body_bytes_each": declared - 1,
        "bytes_sent": sum(sent for sent, _ in sends), "sent_whole": ends["sent"],
        "sending_ended": dict(sorted(ends.items())), "send_s": round(send_seconds, 2), "hold_s": hold_s,
        "answers": dict(sorted(answers.items())),
        "rss_mib_before": round(before, 1), "rss_mib_peak": round(peak, 1), "rss_mib_while_held": round(while_held, 1),
        "rss_mib_after_close": round(after, 1), "rss_mib_rise_peak": round(rise, 1),
        "rss_mib_rise_while_held": round(while_held - before, 1), "rss_mib_rise_after_close": round(after - before, 1),
        "bar": "peak RSS rise < 100 MiB (issue 29 item 3)", "met": rise < 100,
    }


# How far past the limit an upload may go before its answer is seen: the socket buffers between
# the two ends hold several MiB the proxy has not read yet.
UNANSWERED_SLACK = 32 * MiB


def socket_buffers() -> int:
    """The most one loopback connection's send and receive buffers hold (tcp_wmem, tcp_rmem maxima)."""
    total = 0
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            total += int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
        except (OSError, ValueError, IndexError):
            total += 4 * MiB
    return total


async def chunked_past_limit(port: int, limit: int, after_cap: int, seconds_cap: float = 60.0) -> dict:
    """One chunked upload that never ends: the proxy's answer once it is past `limit`, and how many
    more bytes the client could send (each write drained) before the connection closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(reader.readline())
    chunk = b"%x\r\n" % PIECE + b"a" * PIECE + b"\r\n"
    writer.write(post_head(None) + b"%x\r\n" % len(JSON_HEAD) + JSON_HEAD + b"\r\n")
    started = time.monotonic()
    sent, at_answer, answered_at, end = len(JSON_HEAD), None, None, None
    try:
        while end is None:
            if at_answer is None and answer.done():
                at_answer, answered_at = sent, time.monotonic()
            if at_answer is not None and sent - at_answer >= after_cap:
                end = "read on"
            elif at_answer is None and sent >= limit + UNANSWERED_SLACK + after_cap:
                end = "read on, no answer"
            elif time.monotonic() - started > seconds_cap:
                end = "timed out"
            else:
                writer.write(chunk)
                try:
                    await asyncio.wait_for(writer.drain(), 5)
                except TimeoutError:
                    end = "stalled"  # neither reading nor closed
                else:
                    sent += PIECE
                await asyncio.sleep(0)  # a drain that did not wait did not let the loop read the answer
    except (ConnectionError, OSError):
        end = "closed"
    closed_at = time.monotonic()  # (when the client stopped: closed, or one of the other ends)
    if at_answer is None and answer.done():  # the answer and the close came together
        at_answer, answered_at = sent, time.monotonic()
    if not answer.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(answer), 1)
    status = answer_of(answer)
    answer.cancel()
    writer.close()
    after = None if at_answer is None else sent - at_answer
    return {
        "limit_bytes": limit, "status": status, "ended": end, "bytes_sent": sent,
        "bytes_sent_before_answer": at_answer, "bytes_sent_after_answer": after,
        "seconds_after_answer": None if answered_at is None else round(time.monotonic() - answered_at, 2),
        "cap_after_answer_bytes": after_cap,
        # What the client counts as sent includes what the kernel buffers: the proxy reads at most
        # 1 MiB after its answer (client_conn.LINGER_BYTES); the sockets hold at most their buffers.
        "socket_buffers_bytes": socket_buffers(),
        "bar": "413, then the connection closed within 2 s, the client's bytes after it under 1 MiB + the"
               " loopback sockets' buffers (issue 29 item 3: not read on)",
        "met": (status == "413" and end == "closed" and after is not None and after <= MiB + socket_buffers()
                and answered_at is not None and closed_at - answered_at <= 2.0),
    }


# ---- json: one client's big bodies against the others' latency ---------------------------------------------

def json_array(mib: float) -> bytes:
    """`[{"a": 1}, {"a": 1}, ...]` of about `mib` MiB: 10 bytes an object."""
    count = int(mib * MiB) // 10
    return b"[" + b", ".join([b'{"a": 1}'] * count) + b"]"


JSON_SHAPES = ("array", "object")
CHAT_HEAD = b'{"model": "bench", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "pad": '


def json_body(mib: float, shape: str) -> bytes:
    """The json case's body of about `mib` MiB: the array itself (not an object: 400 once parsed),
    or (`object`) a chat completion whose extra field `pad` holds it, which an answer that looks only
    at the body's first byte cannot refuse unparsed (forwarded: the upstream answers it)."""
    if shape == "array":
        return json_array(mib)
    return CHAT_HEAD + json_array(mib - (len(CHAT_HEAD) + 1) / MiB) + b"}"


def json_client(port: int, seconds: float, mib: float, shape: str) -> None:
    """The json case's flooding client, run as its own process (`flood_bench.py --json-client PORT
    SECONDS MIB SHAPE`) so the measuring clients' loop does not share its CPU: posts the array back to
    back on one keep-alive connection for `seconds`; prints what it got as JSON."""
    body = json_body(mib, shape)
    statuses: Counter = Counter()
    errors = 0
    conn = None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            statuses[str(response.status)] += 1
            if response.will_close:
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException):
            errors += 1
            if conn is not None:
                conn.close()
            conn = None
            time.sleep(0.01)
    if conn is not None:
        conn.close()
    print(json.dumps({"body_bytes": len(body), "objects": body.count(b'{"a": 1}'), "statuses": dict(statuses), "errors": errors}))


class Conn:
    """One keep-alive HTTP/1.1 connection of the bench's own: a request's bytes out, its status
    and whole response in (Content-Length or chunked), reconnecting after a close."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def _response(self) -> int:
        assert self.reader is not None
        line = await self.reader.readline()
        status = int(line.split()[1])
        length, chunked, close = 0, False, False
        while (header := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = header.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value
            elif name == b"connection":
                close = value == b"close"
        if chunked:
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                await self.reader.readexactly(size + 2)
            while await self.reader.readline() not in (b"\r\n", b""):
                pass
        else:
            await self.reader.readexactly(length)
        if close:
            self.close()
        return status

    async def request(self, data: bytes, timeout: float = 30.0) -> int:
        """The status of one request (0: no answer; the connection is then opened again)."""
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), timeout)
            self.writer.write(data)
            return await asyncio.wait_for(self._response(), timeout)
        except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError):
            self.close()
            return 0


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
SMALL_BODY = json.dumps({"model": "bench", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).encode()
SMALL = post_head(len(SMALL_BODY)) + SMALL_BODY


def pct(values: list[float], p: float) -> float:
    """The nearest-rank p-th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def latency(values: list[float], statuses: list[int], ok: int = 200) -> dict:
    ms = [v * 1000 for v in values]
    if not ms:
        return {"count": 0}
    return {"count": len(ms), f"not_{ok}": sum(s != ok for s in statuses),
            **{f"p{p}_ms": round(pct(ms, p), 2) for p in (50, 95, 99)}, "max_ms": round(max(ms), 2)}


async def paced(port: int, data: bytes, every: float, seconds: float) -> tuple[list[float], list[int]]:
    """`data` sent on one keep-alive connection every `every` seconds (at once when an answer took
    longer) for `seconds`: each answer's latency and status."""
    conn = Conn(port)
    took: list[float] = []
    statuses: list[int] = []
    until = time.monotonic() + seconds
    while (sent := time.monotonic()) < until:
        statuses.append(await conn.request(data))
        took.append(time.monotonic() - sent)
        await asyncio.sleep(max(0.0, sent + every - time.monotonic()))
    conn.close()
    return took, statuses


async def latency_phase(port: int, every: float, seconds: float) -> dict:
    (health, health_status), (small, small_status) = await asyncio.gather(
        paced(port, HEALTH, every, seconds), paced(port, SMALL, every, seconds))
    return {"health": latency(health, health_status), "small": latency(small, small_status)}


async def json_flood(port: int, pid: int, sampler: Sampler, seconds: float, mib: float, shape: str, every: float) -> dict:
    unloaded = await latency_phase(port, every, seconds)
    lead = 1.0  # the flooder builds its body and has its first one under way before the measuring starts
    flooder = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve()), "--json-client", str(port), str(seconds + lead + 0.5), str(mib), shape,
        stdout=subprocess.PIPE)
    await asyncio.sleep(lead)
    sampler.reset()
    before = rss_mib(pid)
    loaded = await latency_phase(port, every, seconds)
    peak = sampler.highest
    try:
        out, _ = await asyncio.wait_for(flooder.communicate(), 120)
        client = json.loads(out)
    except (TimeoutError, ValueError):
        flooder.kill()
        await flooder.wait()
        client = {"statuses": {}, "errors": None, "failed": True}
    answered = sum(n for status, n in client["statuses"].items() if status < "500" and status not in ("413", "429"))
    health_p99, small_p95, small_p95_unloaded = (loaded["health"].get("p99_ms"), loaded["small"].get("p95_ms"),
                                                 unloaded["small"].get("p95_ms"))
    met = (health_p99 is not None and small_p95 is not None and small_p95_unloaded is not None and answered > 0
           and health_p99 <= 50 and small_p95 <= 2 * small_p95_unloaded)
    return {
        "seconds_per_phase": seconds, "every_s": every, "json_mib": mib, "json_shape": shape, "unloaded": unloaded, "loaded": loaded,
        "json_client": {**client, "posts_answered": answered, "posts_per_s": round(sum(client["statuses"].values()) / (seconds + lead + 0.5), 2)},
        "rss_mib_before_loaded": round(before, 1), "rss_mib_peak_loaded": round(peak, 1),
        "small_p95_loaded_over_unloaded": round(small_p95 / small_p95_unloaded, 2) if small_p95 and small_p95_unloaded else None,
        "bar": "loaded /health p99 <= 50 ms and small p95 <= 2x unloaded, the JSON posts answered (issue 29 item 4)",
        "met": met,
    }


# ---- running it --------------------------------------------------------------------------------------

CASES = ("header", "idle", "trickle", "bodies", "json")
# Each case's headline figures, compared this / baseline: (case key, path in it).
RATIOS = [("header_flood", "rss_mib_rise_peak"), ("bodies", "rss_mib_rise_peak"), ("bodies", "rss_mib_rise_while_held"),
          ("chunked_413", "bytes_sent_after_answer"), ("json", "loaded.health.p99_ms"), ("json", "loaded.health.max_ms"),
          ("json", "loaded.small.p95_ms")]


@contextlib.asynccontextmanager
async def proxy_of(tree: Path, upstream_port: int, settings: dict | None = None):
    proc, port = await start_proxy(tree, upstream_port, settings)
    sampler = Sampler(proc.pid)
    try:
        yield proc, port, sampler
    finally:
        sampler.task.cancel()
        proc.terminate()
        proc.wait(10)


async def measure(tree: Path, args) -> dict:
    runner, upstream_port = await upstream()
    out: dict = {}
    try:
        if {"header", "idle", "trickle"} & set(args.cases):
            async with proxy_of(tree, upstream_port) as (proc, port, sampler):
                trickles = ([asyncio.create_task(trickle(port, args.trickle_every, args.trickle_cap, body)) for body in (False, True)]
                            if "trickle" in args.cases else [])
                if "header" in args.cases:
                    print(f"{tree}: header flood", file=sys.stderr)
                    out["header_flood"] = await header_flood(port, proc.pid, sampler, args.connections, args.header_kib)
                if "idle" in args.cases:
                    print(f"{tree}: idle flood", file=sys.stderr)
                    out["idle_flood"] = await idle_flood(port, args.idle)
                if trickles:
                    print(f"{tree}: trickles (up to {args.trickle_cap:g} s)", file=sys.stderr)
                    header_trickle, body_trickle = await asyncio.gather(*trickles)
                    out["trickle"] = {"every_s": args.trickle_every, "cap_s": args.trickle_cap,
                                      "headers_closed_after_s": header_trickle, "body_closed_after_s": body_trickle}
        if "bodies" in args.cases:
            settings = {"body_timeout": args.body_timeout}
            async with proxy_of(tree, upstream_port, settings) as (proc, port, sampler):
                print(f"{tree}: bodies ({args.bodies} x {args.body_kib} KiB held)", file=sys.stderr)
                out["bodies"] = {"proxy_settings": settings,
                                 **await bodies_flood(port, proc.pid, sampler, args.bodies, args.body_kib * KiB, args.hold)}
                print(f"{tree}: a chunked upload past proxy.max_body_bytes", file=sys.stderr)
                out["chunked_413"] = {"proxy_settings": settings,
                                      **await chunked_past_limit(port, MAX_BODY_BYTES, int(args.chunked_after_mib * MiB))}
        if "json" in args.cases:
            async with proxy_of(tree, upstream_port) as (proc, port, sampler):
                print(f"{tree}: json ({args.json_seconds:g} s unloaded, {args.json_seconds:g} s with "
                      f"{args.json_mib:g} MiB {args.json_shape}s posted back to back)", file=sys.stderr)
                out["json"] = await json_flood(port, proc.pid, sampler, args.json_seconds, args.json_mib, args.json_shape,
                                         args.probe_every)
    finally:
        await runner.cleanup()
    return out


def dig(figures: dict, case: str, path: str):
    value = figures.get(case)
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def ratios(this: dict, baseline: dict) -> dict:
    """this / baseline for each headline figure both runs have (None where the baseline's is 0)."""
    out = {}
    for case, path in RATIOS:
        mine, theirs = dig(this, case, path), dig(baseline, case, path)
        if isinstance(mine, int | float) and isinstance(theirs, int | float):
            out[f"{case}.{path}"] = round(mine / theirs, 3) if theirs else None
    return out


def result_name(args) -> str:
    if args.variant:
        return f"flood_bench-{args.variant}.json"
    return "flood_bench.json" if set(args.cases) == set(CASES) else f"flood_bench-{'-'.join(args.cases)}.json"


def cases_arg(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise argparse.ArgumentTypeError(f"unknown case(s) {', '.join(unknown) or '(none)'}; choose from {','.join(CASES)}")
    return [c for c in CASES if c in cases]  # in the bench's order


def main() -> None:
    if sys.argv[1:2] == ["--json-client"]:  # the json case's flooding client, in its own process
        port, seconds, mib, shape = sys.argv[2:6]
        json_client(int(port), float(seconds), float(mib), shape)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=cases_arg, default=list(CASES), help=f"which cases, comma-separated (default {','.join(CASES)})")
    parser.add_argument("--connections", type=int, default=400, help="header-flood clients")
    parser.add_argument("--header-kib", type=int, default=960, help="KiB of header lines each sends")
    parser.add_argument("--idle", type=int, default=4300, help="idle connections in the idle flood")
    parser.add_argument("--trickle-every", type=float, default=5.0, help="seconds between two trickled pieces")
    parser.add_argument("--trickle-cap", type=float, default=150.0, help="give up on a trickle after this many seconds")
    parser.add_argument("--bodies", type=int, default=60, help="bodies: connections each holding a body")
    parser.add_argument("--body-kib", type=int, default=MAX_BODY_BYTES // KiB,
                        help="bodies: the Content-Length each declares, in KiB (all but one byte sent)")
    parser.add_argument("--body-timeout", type=float, default=600.0,
                        help="bodies: the proxy's proxy.body_timeout there (long: the deadline must not be what bounds it)")
    parser.add_argument("--hold", type=float, default=2.0, help="bodies: seconds the bodies are held once sent")
    parser.add_argument("--chunked-after-mib", type=float, default=64.0,
                        help="bodies: MiB a chunked upload may send after its answer before it counts as read on")
    parser.add_argument("--json-seconds", type=float, default=20.0, help="json: seconds of each phase (unloaded, loaded)")
    parser.add_argument("--json-mib", type=float, default=7.0, help="json: MiB of each JSON array posted")
    parser.add_argument("--json-shape", choices=JSON_SHAPES, default="array",
                        help="json: the posted body: the array (400 once parsed) or a chat completion holding it in a field")
    parser.add_argument("--probe-every", type=float, default=0.05, help="json: seconds between two /health (and small) requests")
    parser.add_argument("--baseline", metavar="DIR", help="also measure the proxy of the vsup source tree in DIR")
    parser.add_argument("--baseline-label", metavar="TEXT", help="what the baseline is, for the result (e.g. its commit)")
    parser.add_argument("--label", metavar="TEXT", help="what this tree is, for the result")
    parser.add_argument("--variant", metavar="NAME", help="write docs/bench/flood_bench-NAME.json")
    parser.add_argument("--out", metavar="DIR", help="write the result file into DIR (default docs/bench)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no result file")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sys.path.insert(0, str(Path(__file__).parent))
    from result import Recorder  # bench/result.py: docs/bench/<name>.json

    recorder = Recorder("flood_bench")
    figures: dict = {"open_file_limit": hard, "cases": args.cases}
    if args.label:
        figures["label"] = args.label
    figures["this"] = asyncio.run(measure(REPO, args))
    if args.baseline:
        figures["baseline"] = asyncio.run(measure(Path(args.baseline).resolve(), args))
        figures["baseline_label"] = args.baseline_label or Path(args.baseline).name
        figures["ratios_this_over_baseline"] = ratios(figures["this"], figures["baseline"])
    for name in ("this", "baseline"):
        if name in figures:
            print(name, json.dumps(figures[name]))
    for name in ("this", "baseline"):
        for case, result in figures.get(name, {}).items():
            if isinstance(result, dict) and "met" in result:
                print(f"{name}: {case}: {'met' if result['met'] else 'MISSED'} ({result['bar']})")
    for what, ratio in figures.get("ratios_this_over_baseline", {}).items():
        print(f"this / baseline, {what}: {'-' if ratio is None else f'{ratio:g}'}")
    if not args.no_write:
        recorder.write(figures, Path(args.out) if args.out else None, result_name(args))


if __name__ == "__main__":
    main()
