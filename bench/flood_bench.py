#!/usr/bin/env python3
"""The proxy's front door under a flood, measured: what unauthenticated clients can make `vsup proxy`
hold (its RSS) and whether /health stays answered.

    .venv/bin/python bench/flood_bench.py [--connections 400] [--header-kib 960] [--idle 4300]
                                          [--trickle-every 5] [--trickle-cap 150] [--baseline DIR [--baseline-label TEXT]]

Each run starts `vsup proxy` (this tree's, or with --baseline also another vsup source tree's, e.g.
`git archive <commit> | tar -x -C DIR`, measured the same way after it) with its default settings
in front of a minimal upstream (in this process), and, in turn:
  header flood  --connections clients each send a request line and --header-kib KiB of header
                lines (8 KiB each, under aiohttp's per-line and per-count limits) and never end
                them; the proxy's RSS (VmRSS) before, at its peak, while they are held, and after
                they closed; how many were answered (431) rather than left open.
  idle flood    --idle connections that send nothing, from 127.0.0.2-127.0.0.12 (loopback is
                127/8, so as many client addresses); meanwhile a new connection from 127.0.0.1
                GETs /health every 0.25 s: how many of those got 200.
  trickles      from the start, one request whose header lines come one every --trickle-every
                seconds and one whose body bytes do: after how long the proxy closed each (or
                "open" at --trickle-cap seconds).
The bench raises its open-file limit to the hard limit (the proxy inherits it: its connection limit is
4096 or half of that). Writes docs/bench/flood_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
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

    async def chat(request):
        await request.read()
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]})

    app = web.Application()
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


async def start_proxy(tree: Path, upstream_port: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from vsup.cli.main import main; main()", "proxy", "--port", str(port),
         "--upstream", f"http://127.0.0.1:{upstream_port}"],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
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


async def measure(tree: Path, args) -> dict:
    runner, upstream_port = await upstream()
    proc, port = await start_proxy(tree, upstream_port)
    sampler = Sampler(proc.pid)
    try:
        trickles = [asyncio.create_task(trickle(port, args.trickle_every, args.trickle_cap, body)) for body in (False, True)]
        print(f"{tree}: header flood", file=sys.stderr)
        headers = await header_flood(port, proc.pid, sampler, args.connections, args.header_kib)
        print(f"{tree}: idle flood", file=sys.stderr)
        idle = await idle_flood(port, args.idle)
        print(f"{tree}: trickles (up to {args.trickle_cap:g} s)", file=sys.stderr)
        header_trickle, body_trickle = await asyncio.gather(*trickles)
        return {"header_flood": headers, "idle_flood": idle,
                "trickle": {"every_s": args.trickle_every, "cap_s": args.trickle_cap,
                            "headers_closed_after_s": header_trickle, "body_closed_after_s": body_trickle}}
    finally:
        sampler.task.cancel()
        proc.terminate()
        proc.wait(10)
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=400, help="header-flood clients")
    parser.add_argument("--header-kib", type=int, default=960, help="KiB of header lines each sends")
    parser.add_argument("--idle", type=int, default=4300, help="idle connections in the idle flood")
    parser.add_argument("--trickle-every", type=float, default=5.0, help="seconds between two trickled pieces")
    parser.add_argument("--trickle-cap", type=float, default=150.0, help="give up on a trickle after this many seconds")
    parser.add_argument("--baseline", metavar="DIR", help="also measure the proxy of the vsup source tree in DIR")
    parser.add_argument("--baseline-label", metavar="TEXT", help="what the baseline is, for the result (e.g. its commit)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/bench/flood_bench.json")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sys.path.insert(0, str(Path(__file__).parent))
    from result import Recorder  # bench/result.py: docs/bench/<name>.json

    recorder = Recorder("flood_bench")
    figures = {"open_file_limit": hard, "this": asyncio.run(measure(REPO, args))}
    if args.baseline:
        figures["baseline"] = asyncio.run(measure(Path(args.baseline).resolve(), args))
        figures["baseline_label"] = args.baseline_label or Path(args.baseline).name
    for name in ("this", "baseline"):
        if name in figures:
            print(name, figures[name])
    if not args.no_write:
        recorder.write(figures)


if __name__ == "__main__":
    main()
